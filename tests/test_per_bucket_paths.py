"""The per-step work that costs per bucket instead of per tensor, and the general paths it falls back to: the host
sum prepared once per bucket (fastdp._reduction.sums, fastdp._C.PreparedSum), which takes only each gradient's data
pointer after a cheap check, and upstream's per-forward device check walked in C (fastdp._C.on_device, then
upstream's walk for the error). Each case compares with the bare model, or with upstream's error."""

import copy
import re

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp import _C
from fastdp._reduction import sums as _sums

pytestmark = pytest.mark.usefixtures("cpu_apply")

# Upstream's text for a parameter or buffer off device_ids[0] (torch.nn.DataParallel.forward).
MODULE_DEVICE = ("module must have its parameters and buffers on device {} (device_ids[0]) but found one of them on "
                 "device: {}")


def _bucket_and_grads(replicas=3):
    """A host bucket of four members (two matrices, two vectors) and one random gradient per replica and member."""
    torch.manual_seed(0)
    dp = fastdp.DataParallel(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), device_ids=["cpu"] * replicas)
    dp(torch.randn(6, 4)).sum().backward()
    (bucket,) = dp._replica_set.reduced
    grads = [torch.randn(shape) for _ in range(replicas) for shape in bucket.shapes]
    return dp, bucket, grads


def _reference(bucket, grads):
    k = len(bucket.members)
    return [sum(grads[q * k + j] for q in range(bucket.nrep)) for j in range(k)]


def _matrix(bucket):
    return next(j for j, shape in enumerate(bucket.shapes) if len(shape) == 2)


def test_the_prepared_sum_equals_the_replicas_sum():
    _, bucket, grads = _bucket_and_grads()
    result = _sums.bucket_sum(bucket, grads, None, None)
    assert isinstance(bucket.rows, _C.PreparedSum)  # the plan served it
    for got, want in zip(result, _reference(bucket, grads)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("how", ["transposed", "sliced", "missing"])
def test_gradients_the_plan_was_not_made_for_take_the_general_path(how):
    """A gradient of other strides (a transposed layout, a slice of a wider tensor) or a missing one is summed by the
    general path, to the same values: the plan never reads it as if it were dense."""
    _, bucket, grads = _bucket_and_grads()
    k, j = len(bucket.members), _matrix(bucket)
    odd = list(grads)
    g = grads[k + j]
    if how == "transposed":
        odd[k + j] = g.t().contiguous().t()
    elif how == "sliced":
        odd[k + j] = torch.cat([g, torch.zeros_like(g)], dim=1)[:, : g.shape[1]]
    else:
        odd[k + j] = None
    assert odd[k + j] is None or not odd[k + j].is_contiguous()
    assert bucket.rows.run(odd, torch.empty(bucket.numel)) is False  # refused, nothing written
    want = _reference(bucket, [torch.zeros_like(grads[k + j]) if t is None else t for t in odd])
    for got, ref in zip(_sums.bucket_sum(bucket, odd, None, None), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_a_gradient_of_another_dtype_or_shape_gets_the_general_paths_error():
    """What the plan does not fit goes where it went before there was a plan: the general path's checks and errors
    (a gradient autograd would never hand over, made here by hand)."""
    _, bucket, grads = _bucket_and_grads()
    k = len(bucket.members)
    other = list(grads)
    other[k + 1] = grads[k + 1].double()
    with pytest.raises(ValueError, match="float64 but the output is float32"):
        _sums.bucket_sum(bucket, other, None, None)
    wrong = list(grads)
    wrong[k + 1] = torch.randn(grads[k + 1].numel() + 1)
    with pytest.raises(ValueError):
        _sums.bucket_sum(bucket, wrong, None, None)


class _StridedGradMatmul(torch.autograd.Function):
    """x @ w.t() whose backward hands w a gradient in a transposed layout (as some kernels return them)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gw = (g.t() @ x).t().contiguous().t()  # w's shape, column-major
        return g @ w, gw


class _Strided(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4))
        self.b = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return _StridedGradMatmul.apply(x, self.w) + self.b


def test_a_model_whose_gradients_arrive_strided_trains_as_the_bare_model():
    torch.manual_seed(0)
    model = _Strided().double()
    bare = copy.deepcopy(model)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3)
    for _ in range(3):
        x = torch.randn(9, 4, dtype=torch.float64)
        for m in (model, bare):
            m.zero_grad(set_to_none=True)
        dp(x).pow(2).sum().backward()
        bare(x).pow(2).sum().backward()
        for p, q in zip(model.parameters(), bare.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def test_a_member_replaced_between_steps_is_summed_by_a_new_plan():
    """A layer swapped for one of another shape: the replicas are rebuilt with new buckets, whose plans fit the new
    members, and the gradients equal the bare model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)
    x = torch.randn(8, 4)
    dp(x).sum().backward()
    old = dp._replica_set.reduced[0].rows
    model[0] = nn.Linear(4, 5)
    model[2] = nn.Linear(5, 3)
    model.zero_grad(set_to_none=True)
    dp(x).sum().backward()
    assert dp._replica_set.reduced[0].rows is not old
    bare = copy.deepcopy(model)
    bare.zero_grad(set_to_none=True)
    bare(x).sum().backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


# ---- upstream's device check, walked in C ------------------------------------------------------------------------


def _moved(model, how):
    """Puts one tensor of `model` on the meta device, as a user's code between steps could."""
    if how == "to":
        model[0].to("meta")  # Module.to: new Parameters (a CPU tensor's .data cannot become a meta tensor)
    elif how == "parameter":
        model[2].bias = nn.Parameter(torch.empty(3, device="meta"))
    elif how == "buffer":
        model[0].register_buffer("scale", torch.ones(1, device="meta"))
    else:
        model.append(nn.Linear(3, 3, device="meta"))


@pytest.mark.parametrize("how", ["to", "parameter", "buffer", "module"])
def test_a_tensor_moved_off_device_ids_0_between_steps_raises_upstreams_error(how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)
    x = torch.randn(8, 4)
    for _ in range(2):  # kept replicas exist: a changed tensor is found all the same
        dp(x).sum().backward()
    _moved(model, how)
    with pytest.raises(RuntimeError, match="^" + re.escape(MODULE_DEVICE.format("cpu", "meta")) + "$"):
        dp(x)
    with pytest.raises(RuntimeError, match="^" + re.escape(MODULE_DEVICE.format("cpu", "meta")) + "$"):
        dp(x)  # again: nothing was kept of the failed forward


def test_a_tensor_moved_back_trains_as_the_bare_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)
    x = torch.randn(8, 4)
    dp(x).sum().backward()
    weight = model[0].weight
    model[0].weight = nn.Parameter(weight.detach().to("meta"))
    with pytest.raises(RuntimeError, match=re.escape(MODULE_DEVICE.format("cpu", "meta"))):
        dp(x)
    model[0].weight = weight
    model.zero_grad(set_to_none=True)
    bare = copy.deepcopy(model)
    dp(x).sum().backward()
    bare(x).sum().backward()
    for p, q in zip(model.parameters(), bare.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("item", ["none", "string", "sparse", "meta", "subclass", "cuda-less strided"])
def test_the_plan_declines_what_the_shim_cannot_read(item):
    """Anything but a plain dense host tensor of the member's layout makes run() return False with nothing written
    (the caller's general path then raises or sums it)."""
    if _C.tensor_path()[0] != "aoti":
        pytest.skip("the shim path is not in use here")

    class Sub(torch.Tensor):
        pass

    odd = {"none": None, "string": "x", "sparse": torch.zeros(2).to_sparse(), "meta": torch.zeros(2, device="meta"),
           "subclass": torch.zeros(2).as_subclass(Sub), "cuda-less strided": torch.zeros(4)[::2]}[item]
    plan = _C.PreparedSum([torch.zeros(2)], 2)
    out = torch.full((2,), 7.0)
    assert plan.run([torch.ones(2), odd], out) is False
    assert out.eq(7.0).all()
    assert plan.run([torch.ones(2), torch.ones(2)], out) is True
    assert out.eq(2.0).all()


def test_a_plan_refuses_bad_arguments_with_clear_errors():
    with pytest.raises(ValueError, match="2 gradients for 1 members on 3 replicas"):
        _C.PreparedSum([torch.zeros(2)], 3).run([torch.ones(2)] * 2, torch.zeros(2))
    with pytest.raises(ValueError, match="summable dtype"):
        _C.PreparedSum([torch.zeros(2, dtype=torch.complex64)], 2)
    with pytest.raises(ValueError, match="output"):
        _C.PreparedSum([torch.zeros(2)], 2).run([torch.ones(2)] * 2, torch.zeros(1))


def _tree():
    """Nested modules with a shared child, an empty parameter slot and buffers at every depth."""
    shared = nn.Linear(2, 2)
    inner = nn.Sequential(shared, nn.BatchNorm1d(2), shared)
    root = nn.Sequential(nn.Linear(3, 2), inner, nn.Sequential(nn.Sequential(inner)), nn.Linear(2, 2, bias=False))
    root[3].register_parameter("bias", None)
    return root


def _off_device(root, where):
    """Puts one tensor of `root` on the meta device, at the slot `where` names."""
    if where == "deep buffer":
        root[1][1].register_buffer("running_var", torch.ones(2, device="meta"))
    elif where == "shared parameter":
        root[1][0].weight = nn.Parameter(torch.empty(2, 2, device="meta"))
    elif where == "root parameter":
        root[0].bias = nn.Parameter(torch.empty(2, device="meta"))
    elif where == "last child":
        root[3].weight = nn.Parameter(torch.empty(2, 2, device="meta"))


@pytest.mark.parametrize("where", ["nowhere", "deep buffer", "shared parameter", "root parameter", "last child"])
def test_the_device_walk_agrees_with_upstreams(where):
    """_C.on_device answers what upstream's walk over parameters() and buffers() answers, and the forward raises
    upstream's error, naming the device, from the same checks."""
    root = _tree()
    _off_device(root, where)
    cpu = torch.device("cpu")
    want = all(t.device == cpu for t in list(root.parameters()) + list(root.buffers()))
    assert _C.on_device(root, cpu, True) is want
    assert _C.on_device(root, cpu, False) is want  # through each tensor's device object
    assert _C.on_device(root, torch.device("meta"), False) is False
    dp = fastdp.DataParallel(root, device_ids=["cpu"] * 2)
    if want:
        dp.eval()(torch.randn(4, 3))
    else:
        with pytest.raises(RuntimeError, match="^" + re.escape(MODULE_DEVICE.format("cpu", "meta")) + "$"):
            dp(torch.randn(4, 3))


@pytest.mark.parametrize("master", ["sparse", "complex"])
def test_a_bucket_the_plan_cannot_describe_is_summed_by_the_general_path(master):
    """Members the plan cannot be made for (a tensor torch will not give a data pointer for, a dtype the host sum
    lacks) leave the bucket without a plan, and every sum takes the general path, to the same values."""
    _, bucket, grads = _bucket_and_grads()
    bucket.rows = None
    if master == "sparse":
        bucket.master = [torch.zeros(shape).to_sparse() for shape in bucket.shapes]
    else:
        bucket.master = [torch.zeros(shape, dtype=torch.complex64) for shape in bucket.shapes]
    result = _sums.bucket_sum(bucket, grads, None, None)
    assert bucket.rows is False
    for got, want in zip(result, _reference(bucket, grads)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

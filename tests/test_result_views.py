"""The two binding calls behind the gradient reduction of emulated replicas: a bucket's `_C.PreparedSum` sums each
member's gradients over the replicas straight into one flat result, `_C.views` cuts that result into per-member
tensors through libtorch's C shim. Both are compared with the torch path they replace; every input they do not
take must leave the caller's fallback to run (False / None) with nothing written, and bad specs raise."""

import gc
from array import array

import pytest
import torch

import fastdp
from fastdp import _C
from fastdp._native import core as _core
from fastdp._reduction.flat import _unflatten_dense, flatten as _flatten_dense

SHIM = _core.tensor_shim_usable()
needs_shim = pytest.mark.skipif(not SHIM, reason="this torch has no usable C shim")
_use_count = getattr(torch._C, "_storage_Use_Count", None)

SHAPES = [(3, 4), (5,), (), (0, 2), (1, 2, 3), (7,)]


def spec_of(shapes):
    return array("q", [v for shape in shapes for v in (len(shape), *shape)])


def numel(shapes):
    return sum(torch.Size(s).numel() for s in shapes)


@pytest.fixture
def aoti():
    if not SHIM:
        pytest.skip("this torch has no usable C shim: " + _C.tensor_path()[1])
    previous = _C.set_tensor_path("aoti")
    yield
    _C.set_tensor_path(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool,
                                   torch.complex64])
def test_views_match_torch_unflatten(aoti, dtype):
    flat = torch.arange(numel(SHAPES) + 3).to(dtype)
    like = [torch.empty(s, device="meta") for s in SHAPES]
    got, want = _C.views(flat, spec_of(SHAPES)), _unflatten_dense(flat, like)
    assert len(got) == len(want) == len(SHAPES)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride()
        assert g.data_ptr() == w.data_ptr() and torch.equal(g, w)
        assert not g.requires_grad and g.grad_fn is None


def test_views_share_the_flat_memory_and_outlive_it(aoti):
    flat = torch.zeros(numel(SHAPES))
    views = _C.views(flat, spec_of(SHAPES))
    views[0].fill_(2.0)
    assert flat[:12].eq(2.0).all() and flat[12:].eq(0.0).all()
    del flat
    gc.collect()
    assert views[0].sum().item() == 24.0  # each view holds the storage


@pytest.mark.skipif(_use_count is None, reason="torch has no storage use count")
def test_views_keep_no_reference_after_they_go(aoti):
    flat = torch.zeros(numel(SHAPES))
    base = _use_count(flat.untyped_storage()._cdata)
    for _ in range(100):
        views = _C.views(flat, spec_of(SHAPES))
        assert _use_count(flat.untyped_storage()._cdata) == base + len(SHAPES)
        del views
    assert _use_count(flat.untyped_storage()._cdata) == base


@pytest.mark.parametrize("flat", ["offset", "strided", "two_dim", "meta", "subclass"])
def test_views_leave_other_buffers_to_torch(aoti, flat):
    class Sub(torch.Tensor):
        pass

    base = torch.zeros(2 * numel(SHAPES) + 2)
    tensors = {"offset": base[1:], "strided": base[::2], "two_dim": base.view(2, -1),
               "meta": torch.empty(base.numel(), device="meta"), "subclass": base.as_subclass(Sub)}
    assert _C.views(tensors[flat], spec_of(SHAPES)) is None


def test_views_on_the_python_path_are_left_to_torch():
    previous = _C.set_tensor_path("python")
    try:
        assert _C.views(torch.zeros(numel(SHAPES)), spec_of(SHAPES)) is None
    finally:
        _C.set_tensor_path(previous)


@pytest.mark.parametrize("spec, words", [
    (array("q", [1, 100]), "needs more than"),
    (array("q", [17] + [1] * 17), "dimensions"),
    (array("q", [2, 3]), "dimensions"),  # ndim 2 but only one size left
    (array("q", [1, -1]), "bad size"),
    (array("q", [2, 2**40, 2**40]), "bad size"),
    (b"1234567", "int64"),
])
def test_views_reject_bad_specs(aoti, spec, words):
    with pytest.raises(ValueError, match=words):
        _C.views(torch.zeros(10), spec)


@pytest.mark.parametrize("sizes", [[6, 6], [4, 4, 3], [9, 2]], ids=lambda s: "+".join(map(str, s)))
def test_entries_that_fit_alone_but_not_together_are_refused(aoti, sizes):
    """Each entry fits the buffer, their sum does not: refused, even where the buffer is the front of a larger
    storage (views past its end would read memory the buffer does not own)."""
    flat = torch.arange(20.0)[:10]
    with pytest.raises(ValueError, match="needs more than"):
        _C.views(flat, spec_of([(n,) for n in sizes]))


def test_views_read_unaligned_specs(aoti):
    raw = memoryview(b"x" + bytes(spec_of([(2, 2)])))[1:]
    (view,) = _C.views(torch.arange(4.0), raw)
    assert view.tolist() == [[0.0, 1.0], [2.0, 3.0]]


def grads_of(shapes, nrep, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * 4).to(dtype) for _ in range(nrep) for s in shapes]


def prepared_sum(grads, k, out):
    """A bucket's prepared sum over `grads` (replica-major, k members per replica, replica 0's giving the members'
    layout), run once into `out`."""
    return _C.PreparedSum(grads[:k], len(grads) // k).run(grads, out)


def packed_reference(grads, k, nrep, dtype):
    """The packed path the prepared sum replaces: each replica's gradients flattened, the flats summed by the core."""
    flats = [_flatten_dense(grads[r * k : (r + 1) * k]) for r in range(nrep)]
    out = torch.empty(flats[0].numel(), dtype=dtype)
    _C.reduce(flats, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("nrep", [1, 2, 4])
def test_prepared_sum_matches_the_packed_sum(aoti, dtype, nrep):
    k = len(SHAPES)
    grads = grads_of(SHAPES, nrep, dtype)
    out = torch.full((numel(SHAPES) + 5,), 99).to(dtype)  # room to spare: past the members stays untouched
    assert prepared_sum(grads, k, out) is True
    want = packed_reference(grads, k, nrep, dtype)
    assert torch.equal(out[: want.numel()], want)
    assert out[want.numel():].eq(99).all()
    by_torch = torch.cat([sum(grads[r * k + j].double() for r in range(nrep)).reshape(-1) for j in range(k)])
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-2  # rounded once per addition, like the packed sum
    torch.testing.assert_close(out[: want.numel()].double(), by_torch, rtol=tol, atol=tol)


def test_prepared_sum_with_many_members(aoti):
    shapes = [(8, 8)] * 1500  # more descriptors than one page-sized allocation
    grads = grads_of(shapes, 4, seed=3)
    out = torch.empty(numel(shapes))
    assert prepared_sum(grads, len(shapes), out)
    assert torch.equal(out, packed_reference(grads, len(shapes), 4, torch.float32))


MIXED = [(3, 4), (5,), (2, 2)] * 50  # members of several shapes, read a few dozen gradients per conversion


@pytest.mark.parametrize("at", [None, 0, 59, 60, 61, 170, 299])
def test_prepared_sum_reads_every_gradient_and_releases_each(aoti, at):
    """However many gradients, each is read for its own member, first and last and either side of where one
    conversion ends and the next begins: the sum equals the packed one, or, with a gradient unlike its member at
    `at`, nothing is written. Either way no gradient is held after: each one's memory goes with it."""
    k, nrep = len(MIXED), 2
    grads = grads_of(MIXED, nrep, seed=5)
    plan = _C.PreparedSum(grads[:k], nrep)  # the members' layout, before any gradient changes
    if at is not None:
        grads[at] = grads[at].t() if grads[at].dim() == 2 else grads[at].double()
    out = torch.full((numel(MIXED),), 7.0)
    assert plan.run(grads, out) is (at is None)
    if at is None:
        assert torch.equal(out, packed_reference(grads, k, nrep, torch.float32))
    else:
        assert out.eq(7.0).all()
    if _use_count is not None:
        storages = [g.untyped_storage() for g in grads]
        del grads, plan
        gc.collect()
        assert [_use_count(s._cdata) for s in storages] == [1] * len(storages)


def test_views_of_many_members_match_torch_unflatten(aoti):
    flat = torch.arange(float(numel(MIXED)))
    like = [torch.empty(s, device="meta") for s in MIXED]
    got, want = _C.views(flat, spec_of(MIXED)), _unflatten_dense(flat, like)
    assert len(got) == len(want) == len(MIXED)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.data_ptr() == w.data_ptr() and torch.equal(g, w)


@pytest.mark.parametrize("bad", [0, 59, 60, 130, 149])
def test_a_bad_spec_entry_among_many_raises_and_keeps_nothing(aoti, bad):
    """A malformed entry anywhere raises, and the views made before it are let go with every reference they took."""
    shapes = list(MIXED)
    shapes[bad] = (10**6,)  # more than the buffer holds
    flat = torch.zeros(numel(MIXED))
    before = _use_count(flat.untyped_storage()._cdata) if _use_count else None
    with pytest.raises(ValueError, match="needs more than"):
        _C.views(flat, spec_of(shapes))
    gc.collect()
    if before is not None:
        assert _use_count(flat.untyped_storage()._cdata) == before


@pytest.mark.parametrize("case", ["transposed", "expanded", "dtype", "shape"])
def test_prepared_sum_declines_a_gradient_unlike_its_member_and_writes_nothing(aoti, case):
    k, nrep = 2, 3
    grads = grads_of([(3, 4), (4,)], nrep)
    out = torch.full((16,), 7.0)
    if case == "transposed":
        grads[3] = torch.randn(4, 3).t()
    elif case == "expanded":
        grads[4] = torch.ones(1).expand(4)
    elif case == "dtype":
        grads[2] = grads[2].double()
    elif case == "shape":
        grads[5] = torch.randn(2, 2)
    assert prepared_sum(grads, k, out) is False
    assert out.eq(7.0).all()


@pytest.mark.parametrize("case", ["out_2d", "out_short", "out_strided"])
def test_prepared_sum_refuses_an_output_that_does_not_fit_and_writes_nothing(aoti, case):
    grads = grads_of([(3, 4), (4,)], 3)
    out = {"out_2d": torch.full((4, 4), 7.0), "out_short": torch.full((15,), 7.0),
           "out_strided": torch.full((32,), 7.0)[::2]}[case]
    with pytest.raises(ValueError, match="the output is not a dense 1-D host tensor"):
        prepared_sum(grads, 2, out)
    assert out.eq(7.0).all()


def test_prepared_sum_refuses_a_dtype_the_host_sum_lacks(aoti):
    with pytest.raises(ValueError, match="summable dtype"):
        _C.PreparedSum([torch.zeros(3, 4, dtype=torch.complex64)], 3)


def test_prepared_sum_on_the_python_path_declines():
    previous = _C.set_tensor_path("python")
    try:
        out = torch.zeros(12)
        assert prepared_sum(grads_of([(3, 4)], 2), 1, out) is False
        assert out.eq(0).all()
    finally:
        _C.set_tensor_path(previous)


@pytest.mark.parametrize("k, nrep, n", [(0, 4, 4), (1, 0, 4), (3, 1, 4), (1, 65, 65)])
def test_prepared_sum_rejects_bad_counts(aoti, k, nrep, n):
    with pytest.raises(ValueError, match="bad plan|gradients for"):
        _C.PreparedSum([torch.zeros(2)] * k, nrep).run([torch.zeros(2)] * n, torch.zeros(2 * max(k, 1)))


@pytest.mark.parametrize("item", ["none", "string", "sparse", "meta", "subclass"])
def test_prepared_sum_declines_what_the_shim_cannot_read(aoti, item):
    class Sub(torch.Tensor):
        pass

    odd = {"none": None, "string": "x", "sparse": torch.zeros(2).to_sparse(), "meta": torch.zeros(2, device="meta"),
           "subclass": torch.zeros(2).as_subclass(Sub)}[item]
    out = torch.full((2,), 7.0)
    assert prepared_sum([torch.ones(2), odd], 1, out) is False
    assert out.eq(7.0).all()


def test_prepared_sum_rejects_a_non_sequence(aoti):
    with pytest.raises(TypeError):
        _C.PreparedSum([torch.zeros(2)], 1).run(3, torch.zeros(2))


def test_training_on_host_replicas_takes_the_prepared_sum(monkeypatch):
    """The gradient reduction of emulated replicas runs through each bucket's prepared sum where the shim is in use
    (its members' shapes read once, each gradient's data pointer per step), and the result matches the bare
    model's gradients."""
    if _C.tensor_path()[0] != "aoti":
        pytest.skip("the shim path is not in use here")
    calls = []
    real = _C.PreparedSum

    class Spy:
        def __init__(self, members, nrep):
            self.plan = real(members, nrep)

        def run(self, grads, out):
            calls.append(self.plan.run(grads, out))
            return calls[-1]

    monkeypatch.setattr(_C, "PreparedSum", Spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    ref.load_state_dict(model.state_dict())
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3)
    x = torch.randn(9, 6, dtype=torch.float64)
    dp(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert calls and all(calls)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)

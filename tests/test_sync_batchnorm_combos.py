"""SyncBatchNorm with what real training code combines it with: mixed precision (autocast), quantization-aware training
(fused convolution, BatchNorm and ReLU modules with fake quantization) and reentrant activation checkpointing. Each
combination trains as the bare model's BatchNorm on the full batch under the same setting."""

import copy
import functools
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp

from test_master_storage import add_grads, by_hand


def _close(got, expected, tol, what):
    assert got.dtype == expected.dtype, f"{what}: {got.dtype}, the bare model's {expected.dtype}"
    err = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
    assert err <= tol * max(1.0, expected.double().abs().max().item()), f"{what}: max error {err}"


# ---- autocast -------------------------------------------------------------------------------------------------------


class Stack(nn.Module):
    """BatchNorm on the raw float32 images first, then convolutions that autocast runs in low precision, each
    followed by a BatchNorm (one without affine parameters): the layers after a BatchNorm run in the dtype it
    returns."""

    def __init__(self):
        super().__init__()
        self.raw = nn.BatchNorm2d(3)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8, affine=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(self.raw(x))))
        h = torch.tanh(self.bn2(self.conv2(h)))
        return self.head(h.mean((2, 3)))


def _output_dtypes(model):
    """The output dtypes of every BatchNorm call, by layer (its width and whether it is affine tell the layers of
    Stack apart; the wrapper's replicas mirror the master's hooks)."""
    seen = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.register_forward_hook(lambda mod, args, out: seen.append(((mod.num_features, mod.affine), out.dtype)))
    return seen


# Largest difference from the bare model, relative to the largest value, per autocast dtype: about one rounding step
# of the dtype (each replica's convolution runs on fewer rows than the bare model's, which may round differently in
# low precision), ten times what was measured here.
AUTOCAST_TOL = {torch.bfloat16: 4e-3, torch.float16: 5e-4}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_synced_layers_return_batch_norms_dtype(dtype):
    # batch_norm has no autocast rule on CPU or CUDA: it runs in its input's dtype (float32 statistics and
    # parameters with a low-precision input give a low-precision output), and so must every synced layer.
    torch.manual_seed(0)
    bare = Stack()
    synced = fastdp.convert_sync_batchnorm(copy.deepcopy(bare))
    dp = fastdp.DataParallel(synced, device_ids=["cpu"] * 3, chunk_sizes=[3, 5, 4])
    dtypes_bare, dtypes_synced = _output_dtypes(bare), _output_dtypes(synced)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (bare, synced)]
    gen = torch.Generator().manual_seed(1)
    tol = AUTOCAST_TOL[dtype]
    for step in range(2):
        x = torch.randn(12, 3, 6, 6, generator=gen)
        dtypes_bare.clear()
        dtypes_synced.clear()
        with torch.autocast("cpu", dtype=dtype):
            yb, yd = bare(x), dp(x)
        assert [t for _, t in dtypes_bare] == [torch.float32, dtype, dtype], dtypes_bare
        assert sorted(dtypes_synced, key=str) == sorted(dtypes_bare * 3, key=str), dtypes_synced
        _close(yd, yb, tol, f"step {step} output")
        yb.float().square().mean().backward()
        yd.float().square().mean().backward()
        for (name, pb), pd in zip(bare.named_parameters(), synced.parameters()):
            _close(pd.grad, pb.grad, tol, f"step {step} grad of {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (name, bb), bd in zip(bare.named_buffers(), synced.buffers()):
            if bb.is_floating_point():
                _close(bd, bb, tol, f"step {step} buffer {name}")
            else:
                assert torch.equal(bd, bb), name


# ---- quantization-aware training ------------------------------------------------------------------------------------

ao = torch.ao.quantization


def _qat_test(test):
    """Quiet about what torch says of its own quantization API (deprecated in favour of torchao; reduce_range)."""
    test = pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated")(test)
    return pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max")(test)


class ConvNet(nn.Module):
    """Convolution, BatchNorm and ReLU, then convolution and BatchNorm, then a head: what quantization fuses into
    ConvBnReLU2d and ConvBn2d, whose weights pass through per-channel fake quantization (observers that size their
    statistics per channel in the first forward) and their BatchNorm's running statistics."""

    def __init__(self):
        super().__init__()
        self.quant, self.dequant = ao.QuantStub(), ao.DeQuantStub()
        self.conv, self.bn, self.relu = nn.Conv2d(2, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU()
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, bias=False), nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        h = self.relu(self.bn(self.conv(self.quant(x))))
        return self.dequant(self.head(self.bn2(self.conv2(h))))


def _qat_model(how):
    """ConvNet prepared for quantization-aware training with fbgemm's defaults: fused in eager mode ("eager", as
    torchvision's quantizable models' fuse_model(is_qat=True) does) or traced and fused by FX ("fx": a GraphModule,
    which has its own _replicate_for_data_parallel)."""
    torch.manual_seed(0)
    model = ConvNet().train()
    if how == "fx":
        from torch.ao.quantization import quantize_fx

        model.quant, model.dequant = nn.Identity(), nn.Identity()
        return quantize_fx.prepare_qat_fx(model, ao.get_default_qat_qconfig_mapping("fbgemm"),
                                          (torch.randn(2, 2, 8, 8),))
    ao.fuse_modules_qat(model, [["conv", "bn", "relu"], ["conv2", "bn2"]], inplace=True)
    model.qconfig = ao.get_default_qat_qconfig("fbgemm")
    return ao.prepare_qat(model)


def _qat_schedule(step, models):
    """A QAT recipe's switches between steps: the BatchNorm statistics frozen, then the observers off."""
    for m in models:
        if step == 1:
            m.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)
        elif step == 2:
            m.apply(ao.disable_observer)


def _same_grads_and_state(model, ref, what, tol=1e-5):
    """Gradients, then parameters and buffers, by name (a copied GraphModule may list them in another order)."""
    grads = {key: p.grad for key, p in ref.named_parameters()}
    for key, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[key], rtol=tol, atol=tol, msg=lambda m: f"{what} grad {key}: {m}")
    state = ref.state_dict()
    assert model.state_dict().keys() == state.keys()
    for key, v in model.state_dict().items():
        torch.testing.assert_close(v, state[key], rtol=tol, atol=tol, msg=lambda m: f"{what} {key}: {m}")


def _loss(model, x):
    return model(x).pow(2).sum()


def _train_against_upstreams_rule(dp, model, ref, chunk_sizes, steps, shape):
    """`steps` SGD steps of `dp` (over `model`) and of `ref` by upstream's rule by hand, on the same batches, the
    QAT schedule applied to both; gradients, parameters and buffers compared after each."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (ref, model)]
    gen = torch.Generator().manual_seed(2)
    for step in range(steps):
        _qat_schedule(step, (ref, model))
        x = torch.randn(*shape, generator=gen)
        dp(x).pow(2).sum().backward()
        by_hand(ref, x, _loss, sizes=[c for c in chunk_sizes if c] if chunk_sizes else None)
        for opt in opts:
            opt.step()
        _same_grads_and_state(model, ref, f"step {step}")
        for opt in opts:
            opt.zero_grad()


@pytest.mark.parametrize("how, path, chunk_sizes", [
    ("eager", "wrapper", None),
    ("eager", "wrapper", [0, 5, 4]),
    ("eager", "function", None),
    ("fx", "wrapper", [2, 4, 3]),
    ("fx", "wrapper", [0, 5, 4]),
], ids=["eager", "eager-device0-idle", "eager-data_parallel", "fx", "fx-device0-idle"])
@_qat_test
def test_fused_qat_model_trains_as_upstreams_rule(how, path, chunk_sizes):
    # The replicas run in the calling thread: on worker threads a convolution may round its last bit otherwise than
    # the reference's in this thread (each thread keeps its own OpenMP settings), and fake quantization turns such a
    # bit into a whole quantization step. What this test guards, buffers of fresh replicas and of an idle device 0,
    # does not depend on the thread.
    # Upstream's rule (test_master_storage.by_hand): every replica computes its chunk from the master's state before
    # the step, the buffers (observers, BatchNorm statistics) are replica 0's, the first running replica's when
    # device 0 runs no chunk. Replicas made afresh each step ("data_parallel", FX's GraphModule) must not share
    # storage between buffers, which observers resize in their first forward.
    ref = _qat_model(how)
    model = copy.deepcopy(ref)
    if path == "wrapper":
        dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, chunk_sizes=chunk_sizes)
    else:
        def dp(x):
            return fastdp.data_parallel(model, x, device_ids=["cpu"] * 3)
    _train_against_upstreams_rule(dp, model, ref, chunk_sizes, steps=3, shape=(9, 2, 8, 8))


@pytest.mark.parametrize("chunk_sizes", [None, [0, 5, 4]], ids=["chunk", "device0-idle"])
@pytest.mark.usefixtures("one_torch_thread")  # its many small kernels crawl when torch's threads wait for cores
@_qat_test
def test_torchvisions_quantizable_mobilenet_trains_as_upstreams_rule(chunk_sizes):
    # torchvision's quantizable MobileNetV2 as its training recipe prepares it: fuse_model(is_qat=True), then
    # prepare_qat (ConvBnReLU2d and ConvBn2d throughout, FloatFunctional adds with observers of their own). Dropout
    # off: the replicas draw random numbers in another order than one model on the chunks one after another.
    models = pytest.importorskip("torchvision.models.quantization", reason="torchvision is not installed")

    def build():
        torch.manual_seed(0)
        model = models.mobilenet_v2(weights=None, quantize=False, width_mult=0.25, num_classes=4).train()
        model.classifier[0].p = 0.0
        model.fuse_model(is_qat=True)
        model.qconfig = ao.get_default_qat_qconfig("fbgemm")
        return ao.prepare_qat(model)

    ref, model = build(), build()
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, chunk_sizes=chunk_sizes)
    _train_against_upstreams_rule(dp, model, ref, chunk_sizes, steps=2, shape=(9, 3, 32, 32))


def _whole_batch_rule(model, x, loss, sizes):
    """Upstream's rule (the master on the first chunk, copies of it made before the step on the others, the copies'
    gradients added to the master's) with every BatchNorm in training normalising the whole batch: the replicas, each
    in a thread of its own, meet at each such call, where the master's layer runs torch's BatchNorm once on the chunks
    put together (its running statistics updated once), and each replica takes its rows of the result."""
    chunks = x.split(sizes)
    n = len(chunks)
    replicas = [model] + [copy.deepcopy(model) for _ in chunks[1:]]
    masters = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    barrier = threading.Barrier(n, timeout=60)
    calls = [dict.fromkeys(masters, 0) for _ in range(n)]
    meetings = {}

    def meet(name, r, h):
        key = (name, calls[r][name])
        calls[r][name] += 1
        meetings.setdefault(key, [None] * n)[r] = h
        barrier.wait()
        if r == 0:
            bn, parts = masters[name], meetings[key]
            meetings[key] = type(bn).forward(bn, torch.cat(parts)).split([p.size(0) for p in parts])
        barrier.wait()
        return meetings[key][r]

    for r, replica in enumerate(replicas):
        for name, m in replica.named_modules():
            if name in masters and m.training:
                m.forward = functools.partial(meet, name, r)
    losses = [None] * n
    threads = [threading.Thread(target=lambda r=r: losses.__setitem__(r, loss(replicas[r], chunks[r])))
               for r in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for m in masters.values():
            m.__dict__.pop("forward", None)
    sum(losses).backward()
    add_grads(model, replicas[1:])


@pytest.mark.parametrize("how, chunk_sizes", [("eager", [2, 4, 3]), ("eager", [0, 5, 4]), ("fx", [3, 3, 3])],
                         ids=["eager", "eager-device0-idle", "fx"])
@_qat_test
def test_fused_qat_model_with_synced_batchnorm_trains_as_upstreams_rule_over_the_whole_batch(how, chunk_sizes):
    # The fused modules' BatchNorm converted to SyncBatchNorm: every observer follows upstream's rule (replica 0's
    # chunk), every BatchNorm normalises the whole batch; then the statistics frozen. Two steps only: a synced
    # layer's float32 statistics are summed in another order than torch's BatchNorm sums the whole batch, and once
    # that rounding has reached the weights, fake quantization and the ReLU after the BatchNorm turn it, for a value
    # that lies on a rounding step of the grid or at zero, into a different value or gradient there.
    ref = _qat_model(how)
    model = fastdp.convert_sync_batchnorm(copy.deepcopy(ref))
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in model.modules()) == 2
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 3, chunk_sizes=chunk_sizes)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (ref, model)]
    gen = torch.Generator().manual_seed(2)
    for step in range(2):
        _qat_schedule(step, (ref, model))
        x = torch.randn(9, 2, 8, 8, generator=gen)
        dp(x).pow(2).sum().backward()
        _whole_batch_rule(ref, x, _loss, [c for c in chunk_sizes if c])
        for opt in opts:
            opt.step()
        _same_grads_and_state(model, ref, f"step {step}", tol=1e-4)
        for opt in opts:
            opt.zero_grad()

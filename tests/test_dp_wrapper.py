"""fastdp.DataParallel as an nn.Module in the user's hands (docs/data_parallel.md): checkpoints (``state_dict``
without the ``module.`` prefix, ``load_state_dict`` taking either form and naming plain keys in its errors, nested
wrappers, files), deepcopy and pickling, attributes forwarded to the wrapped module, and nn.Module's methods acting
on it.

Every case runs on ``["cpu"] * N`` devices. Results are compared with the bare module on the full batch,
never with numbers typed by hand.
"""

import collections
import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn

import fastdp

from _dp_cases import ids


# Every test runs with "cpu" replicas in the calling thread and on worker threads (conftest.cpu_apply).
pytestmark = pytest.mark.usefixtures("cpu_apply")


# ---------------------------------------------------------------- checkpoints


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def test_state_dict_has_no_prefix_and_equals_module_state_dict():
    m = _model()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    sd, msd = dp.state_dict(), m.state_dict()
    assert list(sd) == list(msd)
    for k in sd:
        assert torch.equal(sd[k], msd[k])
    assert sd._metadata == msd._metadata
    bare = _model()
    for p in bare.parameters():
        p.data.add_(1)
    bare.load_state_dict(sd, strict=True)
    x = torch.randn(5, 3)
    bare.eval()
    m.eval()
    torch.testing.assert_close(bare(x), m(x))


@pytest.mark.parametrize("form", ["plain", "prefixed"])
def test_load_state_dict_accepts_both_forms(form):
    src = _model()
    for p in src.parameters():
        p.data.mul_(2)
    sd = src.state_dict() if form == "plain" else nn.DataParallel(src).state_dict()
    if form == "prefixed":
        assert all(k.startswith("module.") for k in sd)
    m = _model()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    result = dp.load_state_dict(sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in src.state_dict().items():
        assert torch.equal(m.state_dict()[k], v)


@pytest.mark.parametrize("form", ["plain", "prefixed"])
def test_load_state_dict_strict_errors_name_plain_keys(form):
    sd = _model().state_dict()
    del sd["0.bias"]
    sd["extra.weight"] = torch.zeros(1)
    if form == "prefixed":
        sd = collections.OrderedDict(("module." + k, v) for k, v in sd.items())
    dp = fastdp.DataParallel(_model(), device_ids=ids("cpu", 2))
    with pytest.raises(RuntimeError) as info:
        dp.load_state_dict(sd)
    with pytest.raises(RuntimeError) as bare:  # the bare model's text for the same keys, without the prefix
        _model().load_state_dict(collections.OrderedDict((k.removeprefix("module."), v) for k, v in sd.items()))
    assert str(info.value) == str(bare.value)
    result = dp.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["0.bias"] and result.unexpected_keys == ["extra.weight"]


def test_wrapped_module_with_child_named_module():
    inner = nn.DataParallel(nn.Linear(2, 2))  # its own keys start with "module."
    dp = fastdp.DataParallel(inner, device_ids=ids("cpu", 2))
    assert list(dp.state_dict()) == ["module.weight", "module.bias"]
    src = nn.DataParallel(nn.Linear(2, 2))
    assert dp.load_state_dict(src.state_dict()).missing_keys == []
    assert torch.equal(inner.module.weight, src.module.weight)
    wrapped_twice = nn.DataParallel(nn.DataParallel(nn.Linear(2, 2)))
    dp.load_state_dict(wrapped_twice.state_dict())
    assert torch.equal(inner.module.weight, wrapped_twice.module.module.weight)


def test_wrapper_nested_in_another_module_round_trips():
    class Outer(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net
            self.head = nn.Linear(2, 1)

    a = Outer(fastdp.DataParallel(_model(), device_ids=ids("cpu", 2)))
    sd = a.state_dict()
    assert "net.0.weight" in sd and not any(".module." in k for k in sd)
    b = Outer(fastdp.DataParallel(_model(), device_ids=ids("cpu", 2)))
    for p in b.parameters():
        p.data.zero_()
    b.load_state_dict(sd)
    for k, v in sd.items():
        assert torch.equal(b.state_dict()[k], v)
    upstream = Outer(nn.DataParallel(_model()))  # "net.module.0.weight" keys load too
    b.load_state_dict(upstream.state_dict())
    assert torch.equal(b.net.module[0].weight, upstream.net.module[0].weight)


def test_checkpoint_file_round_trip(tmp_path):
    m = _model()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    dp(torch.randn(6, 3)).sum().backward()
    torch.save(dp.state_dict(), tmp_path / "ckpt.pt")
    bare = _model()
    bare.load_state_dict(torch.load(tmp_path / "ckpt.pt"), strict=True)
    for k, v in m.state_dict().items():
        assert torch.equal(bare.state_dict()[k], v)


# ---------------------------------------------------------------- attribute forwarding


class WithExtras(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)
        self.num_classes = 7
        self.device_ids = "module's own"

    def forward(self, x):
        return self.l(x)

    def embed(self, x):
        return self.l(x) * 2

    @property
    def broken(self):
        return self.does_not_exist


def test_attribute_forwarding():
    m = WithExtras()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    assert dp.num_classes == 7
    assert dp.l is m.l
    x = torch.randn(3, 2)
    torch.testing.assert_close(dp.embed(x), m.embed(x))
    assert dp.device_ids == ["cpu", "cpu"]  # the wrapper's own attribute wins
    assert dp.module is m
    with pytest.raises(AttributeError) as info:
        dp.nope
    assert str(info.value) == (f"'DataParallel' object has no attribute 'nope', nor has its wrapped module "
                               f"('{type(m).__name__}')")
    with pytest.raises(AttributeError):
        dp.broken
    assert not hasattr(dp, "nope")
    dp.num_classes = 3  # writes stay on the wrapper
    assert m.num_classes == 7 and dp.num_classes == 3


def test_batch_split_shows_the_last_forwards_chunks_and_its_rule_read_only():
    weights = [1.0, 3.0]
    dp = fastdp.DataParallel(_model(), device_ids=ids("cpu", 2), chunk_sizes=weights)
    assert dp.batch_split == (None, fastdp.memory_report(dp).split)
    dp(torch.randn(8, 3))
    split = dp.batch_split
    assert isinstance(split, fastdp.BatchSplit) and split.chunk_sizes == fastdp.balance.largest_remainder(weights, 8)
    memory = fastdp.memory_report(dp)
    assert split.chunk_sizes == [d.chunk for d in memory.devices] and split.rule == memory.split
    with pytest.raises(AttributeError):
        dp.batch_split = None
    default = fastdp.DataParallel(_model(), device_ids=ids("cpu", 2))
    default(torch.randn(8, 3))
    assert default.batch_split.chunk_sizes is None and "torch.chunk" in default.batch_split.rule


def test_batch_split_is_the_wrappers_and_a_models_own_stays_on_dp_module():
    model = _model()
    model.batch_split = "the model's"
    dp = fastdp.DataParallel(model, device_ids=ids("cpu", 2))
    assert isinstance(dp.batch_split, fastdp.BatchSplit) and dp.module.batch_split == "the model's"


def test_a_training_forward_with_criterion_and_no_target_warns_once_naming_target():
    torch.manual_seed(0)
    model, x = nn.Linear(3, 2), torch.randn(8, 3)
    dp = fastdp.DataParallel(model, device_ids=ids("cpu", 2), criterion=nn.CrossEntropyLoss())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dp(x)
        dp(x)
    assert [w.filename for w in caught] == [__file__]  # once, at the user's line
    text = str(caught[0].message)
    assert "criterion=" in text and "no target=" in text and "pass the labels as dp(x, target=y)" in text
    torch.testing.assert_close(out, model(x))  # the outputs, as without criterion=
    quiet = fastdp.DataParallel(model, device_ids=ids("cpu", 2), criterion=nn.CrossEntropyLoss())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            quiet(x)  # evaluation: the outputs are what is wanted
        quiet.eval()
        quiet(x)


def test_wrapper_copies_and_pickles():
    dp = fastdp.DataParallel(WithExtras(), device_ids=ids("cpu", 2))
    clone = copy.deepcopy(dp)
    assert clone.module is not dp.module and clone.num_classes == 7
    buf = io.BytesIO()
    torch.save(dp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(4, 2)
    torch.testing.assert_close(loaded(x), dp(x))
    loaded.load_state_dict(dp.state_dict())


def test_wrapper_methods_act_on_module():
    m = _model()
    dp = fastdp.DataParallel(m, device_ids=ids("cpu", 2))
    assert [n for n, _ in dp.named_parameters()][0] == "module.0.weight"
    dp.eval()
    assert not m.training
    dp.train()
    assert m.training
    dp.double()
    assert m[0].weight.dtype == torch.float64


def test_warnings_are_not_emitted_on_a_plain_step():
    dp = fastdp.DataParallel(nn.Linear(3, 2), device_ids=ids("cpu", 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp(torch.randn(4, 3)).sum().backward()


class PicklableOuter(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = fastdp.DataParallel(_model(), device_ids=ids("cpu", 2))


def test_nested_load_still_works_after_pickling_the_outer_module():
    a = PicklableOuter()
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    b = torch.load(buf, weights_only=False)
    c = copy.deepcopy(a)
    for p in a.parameters():
        p.data.add_(1)
    for target in (b, c):
        target.load_state_dict(a.state_dict())
        for k, v in a.state_dict().items():
            assert torch.equal(target.state_dict()[k], v)

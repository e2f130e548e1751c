"""Outputs that are neither tensors nor tuples, lists or dicts: upstream's last gather rule,
``type(out)(gathered items)``, rebuilds any iterable (a transformers ``DynamicCache`` is one: per layer a
(key, value) pair). Compared with the bare module on the full batch."""

import pytest
import torch
import torch.nn as nn

import fastdp


class LayerCache:
    """A cache like transformers' DynamicCache: iterates per layer, rebuilt from an iterable of layers."""

    def __init__(self, layers=()):
        self.layers = [tuple(layer) for layer in layers]

    def __iter__(self):
        return iter(self.layers)

    def __len__(self):
        return len(self.layers)


class Sealed:
    """Iterable, but its constructor takes no items: upstream's rule cannot rebuild it."""

    def __init__(self, t, scale):
        self.t = t * scale

    def __iter__(self):
        return iter([self.t])


class WithCache(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(4, 4) for _ in range(layers))

    def forward(self, x):
        cache = LayerCache((p(x), 2 * p(x)) for p in self.proj)
        return {"logits": x.sum(-1), "cache": cache}


@pytest.mark.parametrize("replicas", [2, 3])
def test_cache_rebuilt_from_gathered_layers_equals_full_batch(replicas):
    torch.manual_seed(0)
    model = WithCache()
    x = torch.randn(7, 4)
    ours = fastdp.DataParallel(model, device_ids=["cpu"] * replicas)(x)
    ref = model(x)
    assert type(ours["cache"]) is LayerCache and len(ours["cache"]) == len(ref["cache"])
    for (k, v), (rk, rv) in zip(ours["cache"], ref["cache"]):
        torch.testing.assert_close(k, rk)
        torch.testing.assert_close(v, rv)
    torch.testing.assert_close(ours["logits"], ref["logits"])


def test_gradients_flow_through_a_rebuilt_cache():
    torch.manual_seed(0)
    model = WithCache()
    x = torch.randn(6, 4)
    out = fastdp.DataParallel(model, device_ids=["cpu"] * 2)(x)
    sum(k.sum() + v.sum() for k, v in out["cache"]).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sum(k.sum() + v.sum() for k, v in model(x)["cache"]).backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_iterable_that_cannot_be_rebuilt_names_its_type():
    class Returns(nn.Module):
        def forward(self, x):
            return Sealed(x, 2.0)

    with pytest.raises(TypeError) as reference:
        Sealed([torch.zeros(4, 2)])  # what rebuilding it from its gathered items raises
    cause = f"{type(reference.value).__name__}: {reference.value}"
    with pytest.raises(TypeError) as info:
        fastdp.DataParallel(Returns(), device_ids=["cpu"] * 2)(torch.randn(4, 2))
    assert str(info.value) == (
        f"Cannot gather output of type Sealed: it is iterable, but Sealed(gathered items) failed ({cause}); upstream "
        "DataParallel rebuilds it the same way. Return tensors, tuples, lists or dicts from forward instead."
    )


def test_functional_gather_of_iterables():
    a = LayerCache([(torch.ones(2, 3), torch.zeros(2, 3))])
    b = LayerCache([(2 * torch.ones(1, 3), torch.ones(1, 3))])
    out = fastdp.gather([a, b], "cpu")
    (k, v), = list(out)
    torch.testing.assert_close(k, torch.cat([torch.ones(2, 3), 2 * torch.ones(1, 3)]))
    torch.testing.assert_close(v, torch.cat([torch.zeros(2, 3), torch.ones(1, 3)]))

"""Hooks a replica registers on itself during forward stay on the replica: results equal the bare model's step
after step and the master is left without them; hooks registered on the master still run on every replica."""

import copy

import pytest
import torch
import torch.nn as nn

import fastdp
from fastdp._step import hooks as _hooks


class SelfHooking(nn.Module):
    """Registers forward hooks on itself and its child the first time it runs (guarded by a flag attribute), as
    transformers installs its output-capturing hooks; the hooks record outputs into a per-call list."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 3)

    def _record(self, module, args, output):
        self._recorded.append(output)

    def forward(self, x):
        if not getattr(self, "_hooked", False):
            self.inner.register_forward_hook(self._record)
            self.outer.register_forward_hook(self._record)
            self.inner.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
            self._hooked = True
        self._recorded = []
        y = self.outer(torch.relu(self.inner(x)))
        # What the hooks saw is part of the result: one entry per hooked call, as hidden states are.
        return y, torch.stack([r.sum(1) for r in self._recorded], 1)


class Rebuilt(SelfHooking):
    """The same module on the rebuild-every-step path (a custom _replicate_for_data_parallel)."""

    def _replicate_for_data_parallel(self):
        return super()._replicate_for_data_parallel()


def _hook_counts(model):
    return [sum(len(m.__dict__[k]) for k in _hooks.KEYS) for m in model.modules()]


@pytest.mark.parametrize("cls", [SelfHooking, Rebuilt], ids=["kept-replicas", "fresh-replicas"])
def test_hooks_registered_in_forward_stay_on_the_replica(cls, cpu_apply):
    torch.manual_seed(0)
    bare = cls().double()
    model = copy.deepcopy(bare)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)
    opt_b = torch.optim.SGD(bare.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(6, 4, dtype=torch.float64)
        (yb, hb), (yd, hd) = bare(x), dp(x)
        assert hd.shape == hb.shape, f"step {step}: {hd.shape} vs {hb.shape}"
        torch.testing.assert_close(yd, yb, rtol=0, atol=1e-12)
        torch.testing.assert_close(hd, hb, rtol=0, atol=1e-12)
        (yb.sum() + hb.sum()).backward()
        (yd.sum() + hd.sum()).backward()
        for pb, pd in zip(bare.parameters(), model.parameters()):
            torch.testing.assert_close(pd.grad, pb.grad, rtol=0, atol=1e-12)
        opt_b.step()
        opt_d.step()
        opt_b.zero_grad()
        opt_d.zero_grad()
        assert sum(_hook_counts(model)) == 0, f"step {step}: hooks left on the master"
        assert not getattr(model, "_hooked", False)


def test_master_hooks_run_on_replicas_and_removal_reaches_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * 2)
    x = torch.randn(6, 4)
    plain = dp(x)
    seen = []
    handle = model[0].register_forward_hook(lambda m, a, out: seen.append(out.shape[0]) or out * 3)
    torch.testing.assert_close(dp(x), model(x))
    assert seen == [3, 3, 6]  # both replicas, then the bare call
    handle.remove()
    seen.clear()
    torch.testing.assert_close(dp(x), plain)
    assert seen == []
    kw = model[1].register_forward_pre_hook(lambda m, args, kwargs: ((args[0] + 1,), kwargs), with_kwargs=True)
    torch.testing.assert_close(dp(x), model(x))
    kw.remove()
    torch.testing.assert_close(dp(x), plain)


def test_refresh_rejects_bad_mirror_count():
    from fastdp import _C

    with pytest.raises(ValueError) as info:
        _C.refresh([({}, {})], ("a",), 2)
    assert str(info.value) == "refresh: nmirrored must be between 0 and len(owned) (1), got 2"


def _reference_refresh(master, replica, owned, nmirrored):
    """refresh's documented result for one pair, computed in Python: the replica dict becomes a copy of the master's
    (in its order), except that owned keys keep the replica's values (appended in `owned` order where the master
    lacks them); the last `nmirrored` owned dicts keep their objects with the master's entries."""
    saved = {k: replica[k] for k in owned if k in replica}
    mirrored = owned[len(owned) - nmirrored:]
    contents = {k: list(master[k].items()) if k in mirrored and isinstance(master.get(k), dict)
                and saved.get(k) is not master[k] else None for k in saved}
    out = dict(master)
    for k in owned:
        if k in saved:
            out[k] = saved[k]
    return out, contents


def _check_refresh(pairs, owned, nmirrored, seen=None):
    from fastdp import _C

    want = [_reference_refresh(m, r, owned, nmirrored) for m, r in pairs]
    if seen is None:
        assert _C.refresh(pairs, owned, nmirrored) == len(pairs)
    else:
        _C.refresh(pairs, owned, nmirrored, seen)
    for (m, r), (items, contents) in zip(pairs, want):
        assert list(r) == list(items)  # same keys, same order
        assert all(r[k] is v for k, v in items.items())
        for k, kv in contents.items():
            if kv is not None:
                assert list(r[k].items()) == kv


def _records(npairs, nmirrored):
    from fastdp import _C

    return _C.refresh_records(npairs, nmirrored)


@pytest.mark.parametrize("records", [False, True])
def test_refresh_matches_reference_step_after_step(records):
    """The in-place refresh (taken while the master's keys stay put) and the full one give the reference result:
    values changed on the master, keys added, deleted and moved, owned keys only the replica has, hook dicts
    refilled; each change followed by unchanged steps. With records (NOTE [refresh records]) unchanged pairs are
    skipped: every change, on either side and in either kind of dict, must still reach the replica."""
    owned, nmirrored = ("_own", "_only_replica", "_hooks_a", "_hooks_b"), 2
    master = {"a": 1, "_own": ["master's"], "b": "x", "_hooks_a": {1: "h1"}, "c": 3.0}
    replica = {"_own": ["replica's"], "_only_replica": True, "_hooks_a": {}, "_hooks_b": {7: "stale"}}
    other = dict(master)  # a second pair sharing the master's values
    other_replica = {"_own": ["other"], "_hooks_a": {}}
    pairs = [(master, replica), (other, other_replica)]
    changes = [
        lambda: None,
        lambda: master.__setitem__("a", object()),  # a new value
        lambda: master["_hooks_a"].__setitem__(2, "h2"),  # a hook added on the master
        lambda: master.__setitem__("d", [4]),  # a new key
        lambda: master.pop("b"),  # a key gone
        lambda: master.__setitem__("a", master.pop("a")),  # a key moved to the end
        lambda: master.__setitem__("_hooks_b", {3: "h3"}),  # the master gains a mirrored dict
        lambda: [master.__setitem__(f"k{i}", i) for i in range(40)],  # many new keys
        lambda: [master.__setitem__(f"k{i}", -i) for i in range(40)],  # many changed values at once
        lambda: replica.__setitem__("stray", 1),  # a key only the replica has, not owned: dropped
        lambda: replica.__setitem__("a", "set on the replica"),  # a mirrored value changed on the replica
        lambda: replica["_hooks_a"].__setitem__(9, "replica's own"),  # a hook registered on the replica
        lambda: replica["_hooks_b"].clear(),  # the replica's hook dict emptied
        lambda: master["_hooks_b"].__setitem__(4, "h4"),  # the master's second hook dict, in place
        lambda: master["_hooks_a"].pop(1),  # a hook removed on the master
        lambda: other["_hooks_a"].__setitem__(5, "h5"),  # the other pair's master hook dict (shared object)
        lambda: master.__setitem__("_hooks_a", {6: "h6"}),  # the master's hook dict replaced
        lambda: master.pop("_hooks_b"),  # the master loses a mirrored dict
        lambda: master.__setitem__("_hooks_b", "not a dict"),  # a mirrored key holding something else
    ]
    seen = _records(len(pairs), nmirrored) if records else None
    for change in changes:
        change()
        for _ in range(3):
            _check_refresh(pairs, owned, nmirrored, seen)


def test_refresh_records_skip_unchanged_pairs():
    """With records, a second refresh walks only the pairs whose dicts changed (dict version tags: CPython's up to
    3.11, a dict watcher's from 3.12; where there are none, every pair is walked)."""
    from fastdp import _C

    owned, nmirrored = ("_own", "_hooks"), 1
    pairs = [({"a": i, "_own": 0, "_hooks": {}}, {"_own": i, "_hooks": {}}) for i in range(5)]
    seen = _records(len(pairs), nmirrored)
    assert _C.refresh(pairs, owned, nmirrored, seen) == 5
    tags = bool(_C.DICT_TAGS)
    assert _C.refresh(pairs, owned, nmirrored, seen) == (0 if tags else 5)
    pairs[1][0]["a"] = "new"
    pairs[3][0]["_hooks"][1] = "hook"
    assert _C.refresh(pairs, owned, nmirrored, seen) == (2 if tags else 5)
    assert pairs[1][1]["a"] == "new" and pairs[3][1]["_hooks"] == {1: "hook"}
    assert _C.refresh(pairs, owned, nmirrored, seen) == (0 if tags else 5)
    assert _C.refresh(pairs, owned, nmirrored) == 5  # without records: every pair


def test_refresh_with_the_replicas_own_hooks_settled_reads_the_masters_only():
    """`own_settled` (no hook registered since the last refresh: the wrapper counts torch's handles) skips reading
    the replicas' own hook dicts; a master's hook dict is read either way. Without it, a replica's own edit is seen
    and undone."""
    from fastdp import _C

    if not _C.DICT_TAGS:
        pytest.skip("no dict version tags: every pair is walked")
    owned, nmirrored = ("_own", "_hooks"), 1
    pairs = [({"a": i, "_own": 0, "_hooks": {}}, {"_own": i, "_hooks": {}}) for i in range(3)]
    seen = _records(len(pairs), nmirrored)
    assert _C.refresh(pairs, owned, nmirrored, seen) == 3
    pairs[0][1]["_hooks"][7] = "edited in place"  # on a replica
    pairs[1][0]["_hooks"][8] = "the master's"
    assert _C.refresh(pairs, owned, nmirrored, seen, True) == 1
    assert pairs[1][1]["_hooks"] == {8: "the master's"} and pairs[0][1]["_hooks"] == {7: "edited in place"}
    assert _C.refresh(pairs, owned, nmirrored, seen, False) == 1
    assert pairs[0][1]["_hooks"] == {}


@pytest.mark.parametrize("seen", ["short", "long", "read-only", "unaligned"])
def test_refresh_rejects_records_of_the_wrong_size(seen):
    from fastdp import _C

    right = _records(1, 1)
    buf = {"short": right[:-8], "long": right + b"\0", "read-only": bytes(right),
           "unaligned": memoryview(bytearray(len(right) + 1))[1:]}[seen]
    with pytest.raises((ValueError, TypeError), match="seen|read-write"):
        _C.refresh([({}, {})], ("_hooks", "_h2"), 1, buf)


@pytest.mark.parametrize("npairs, nmirrored", [(-1, 1), (1, -1), (1, 33), (2**62, 7)])
def test_refresh_records_reject_bad_counts(npairs, nmirrored):
    from fastdp import _C

    with pytest.raises(ValueError, match="refresh_records: bad counts"):
        _C.refresh_records(npairs, nmirrored)


def test_refresh_owned_keys_by_equality_among_many_keys():
    """Owned keys given as other (non-interned) objects than the dicts' keys, and far more distinct keys than the
    binding's per-call answer cache has slots, over many pairs: collisions and evictions change no answer."""
    owned = tuple("".join(["_own", str(i)]) for i in range(3)) + ("".join(["_ho", "oks"]),)
    pairs = []
    for p in range(50):
        master = {"".join(["k", str(p), "_", str(i)]): object() for i in range(40)}
        master["".join(["_own", "1"])] = "master's"
        master["".join(["_hoo", "ks"])] = {p: p}
        replica = {"".join(["_own", "1"]): "replica's", "".join(["_own", "2"]): "only the replica's",
                   "".join(["_h", "ooks"]): {}}
        pairs.append((master, replica))
    _check_refresh(pairs, owned, 1)
    for master, _ in pairs:  # values changed on the master: the in-place path
        master[next(iter(master))] = object()
    _check_refresh(pairs, owned, 1)
    assert all(r["_own1"] == "replica's" and r["_own2"] == "only the replica's" for _, r in pairs)

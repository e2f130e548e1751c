"""Dict version tags from CPython 3.12, where dicts no longer carry one: a dict watcher gives them (NOTE [dict tags
from 3.12] in csrc/python/dicttags.c). Seen through ``_C.refresh``, which skips a pair of dicts whose tags did not
move since its last refresh: what it walks, and that the replica dicts always end equal to a refresh without
records. The refresh semantics on every version are in test_replica_hooks.py."""

import gc
import subprocess
import sys
import textwrap

import pytest

from fastdp import _C

pytestmark = pytest.mark.skipif(sys.version_info < (3, 12), reason="CPython up to 3.11 has its own dict tags")

OWNED, NMIRRORED = ("_own", "_hooks"), 1


def _pairs(n, value):
    return [({"a": value(i), "_own": 0, "_hooks": {}}, {"_own": i, "_hooks": {}}) for i in range(n)]


def test_many_dicts_each_change_seen_once():
    """Thousands of watched dicts (the table grows several times): an unchanged set walks nothing, a change to any
    one dict walks its pair only, once."""
    pairs = _pairs(3000, lambda i: i)
    seen = _C.refresh_records(len(pairs), NMIRRORED)
    assert _C.refresh(pairs, OWNED, NMIRRORED, seen) == 3000
    assert _C.refresh(pairs, OWNED, NMIRRORED, seen) == 0
    for i in (0, 1234, 2999):
        pairs[i][0]["a"] = "changed"
        assert _C.refresh(pairs, OWNED, NMIRRORED, seen) == 1
        assert pairs[i][1]["a"] == "changed"
        assert _C.refresh(pairs, OWNED, NMIRRORED, seen) == 0
    pairs[7][1]["_hooks"][1] = "a hook on the replica"
    assert _C.refresh(pairs, OWNED, NMIRRORED, seen) == 1
    assert pairs[7][1]["_hooks"] == {}


def test_a_new_dict_where_a_freed_one_was_is_walked():
    """Records kept while their dicts are freed and new dicts made at the same addresses, in the same places of the
    pairs: the new dicts carry tags no record holds, so every pair is walked and refreshed."""
    n = 200
    seen = _C.refresh_records(n, NMIRRORED)
    pairs = _pairs(n, lambda i: ("old", i))
    assert _C.refresh(pairs, OWNED, NMIRRORED, seen) == n
    where = {}  # address -> (pair, side) of the freed dicts
    for i, pair in enumerate(pairs):
        for side, d in enumerate(pair):
            where[id(d)] = (i, side)
    del pairs, pair, d
    gc.collect()
    pool = [{} for _ in range(20 * n)]  # CPython hands freed dict objects out again
    new = [[None, None] for _ in range(n)]
    rest = []
    for d in pool:
        place = where.get(id(d))
        if place is not None and new[place[0]][place[1]] is None:
            new[place[0]][place[1]] = d
        else:
            rest.append(d)
    same_places = sum(m is not None and r is not None for m, r in new)
    assert same_places, "no pair's dicts came back at their addresses: the case is not exercised"
    for i, pair in enumerate(new):
        for side in (0, 1):
            if pair[side] is None:
                pair[side] = rest.pop()
        pair[0].update({"a": ("new", i), "_own": 0, "_hooks": {}})
        pair[1].update({"_own": i, "_hooks": {}})
    pairs = [tuple(pair) for pair in new]
    assert _C.refresh(pairs, OWNED, NMIRRORED, seen) == n
    assert all(replica["a"] == ("new", i) for i, (_, replica) in enumerate(pairs))


def test_without_a_watcher_left_every_pair_is_walked():
    """An interpreter whose eight dict watchers are taken before fastdp loads (torch needs one of its own): no tags
    (DICT_TAGS 0), every pair walked every time, and kept replicas still train as the bare model."""
    code = textwrap.dedent("""
        import _testcapi
        import torch  # torch takes a dict watcher of its own when it loads
        while True:
            try:
                _testcapi.add_dict_watcher(0)
            except RuntimeError:
                break
        import fastdp
        from fastdp import _C
        assert _C.DICT_TAGS == 0, _C.DICT_TAGS
        pairs = [({"a": i, "_own": 0, "_hooks": {}}, {"_own": i, "_hooks": {}}) for i in range(5)]
        seen = _C.refresh_records(5, 1)
        assert [_C.refresh(pairs, ("_own", "_hooks"), 1, seen) for _ in range(3)] == [5, 5, 5]
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        ref.load_state_dict(net.state_dict())
        dp = fastdp.DataParallel(net, device_ids=["cpu"] * 3)
        for p, q in ((dp, net), (ref, ref)):
            opt = torch.optim.SGD(q.parameters(), lr=0.1)
            torch.manual_seed(1)
            for _ in range(4):
                opt.zero_grad()
                p(torch.randn(9, 4, dtype=torch.float32)).square().sum().backward()
                opt.step()
        for a, b in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b)
        print("OK")
    """)
    pytest.importorskip("_testcapi")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-3000:]

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
    pairs: the new dicts carry tags no record holds, so every pair is walked and refreshed. CPython keeps freed
    plain dicts on a free list (up to 80) and hands out the last one freed first: with the list emptied beforehand,
    the dicts one pair frees are the next four made, in reverse order of freeing."""
    n = 40
    seen = _C.refresh_records(n, NMIRRORED)
    pairs = _pairs(n, lambda i: ("old", i))
    assert _C.refresh(pairs, OWNED, NMIRRORED, seen) == n
    gc.disable()  # no collection frees other dicts in between
    try:
        for i in range(n):
            drain = [{} for _ in range(100)]  # the free list emptied (kept alive until the pair is made again)
            addresses = [id(d) for d in pairs[i]]
            pairs[i] = None  # the replica's hook dict, the replica, the master's hook dict, the master: freed
            master, master_hooks, replica, replica_hooks = {}, {}, {}, {}
            assert [id(master), id(replica)] == addresses  # the case this test is for
            master.update({"a": ("new", i), "_own": 0, "_hooks": master_hooks})
            replica.update({"_own": i, "_hooks": replica_hooks})
            pairs[i] = (master, replica)
            del drain
    finally:
        gc.enable()
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

"""The GPU paths' Python-side decisions, checked on any machine: which core calls they make, on which streams, and
what they ask of the driver. Results are compared with torch's own sums; the C side is covered by the simulated
GPU suite."""

import functools
import subprocess
import sys
import types

import pytest
import torch

import fastdp
from fastdp import _C, comm
from fastdp._native import core as _core, info as _info
from fastdp._platform import devices as _devices


# ---- NCCL usability: no GPU touched ----------------------------------------------------------------------------


def test_collective_asks_the_core_once_per_device_list(monkeypatch):
    """_C.info() reads free memory (creating a context per GPU); the NCCL question goes to the core's route, once per
    device list, and only its answer "nccl" makes the broadcast collective."""
    asked = []

    def no_info(*a, **k):
        raise AssertionError("comm.broadcast_is_collective called _C.info()")

    def route(op, devices):
        asked.append((op, tuple(devices)))
        return "nccl" if devices[0] != devices[1] else "cuda"

    monkeypatch.setattr(_C, "info", no_info)
    monkeypatch.setattr(_C, "route", route)
    monkeypatch.setattr(comm, "_ROUTES", {})
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert comm.broadcast_is_collective(devs) is True
    assert comm.broadcast_is_collective(devs) is True  # kept: asked once
    assert comm.broadcast_is_collective([torch.device("cuda", 0)] * 2) is False
    assert asked == [("broadcast", (0, 1)), ("broadcast", (0, 0))]


def test_collective_on_host_devices_is_the_cores_answer(monkeypatch):
    monkeypatch.setattr(comm, "_ROUTES", {})
    assert _C.route("broadcast", [-1, -1]) == "host"
    assert comm.broadcast_is_collective([torch.device("cpu")] * 2) is False


def test_usable_agrees_with_info():
    info = _C.info()
    for name, b in info["backends"].items():
        ok, why = _C.usable(name)
        assert ok == b["usable"] and (ok or why == b["why"]), name
    with pytest.raises(ValueError) as raised:
        _C.usable("gloo")
    assert str(raised.value) == 'usable: unknown backend \'gloo\' (expected "host", "cuda" or "nccl")'
    with pytest.raises(TypeError) as raised:
        _C.usable(3)
    assert str(raised.value) == "usable: expected a backend name, got int"


# ---- info: free memory only where asked ------------------------------------------------------------------------


def test_info_reads_free_memory_only_when_asked(monkeypatch):
    calls = []
    real = _C.info

    def spy(*, memory=False):
        calls.append(memory)
        return real(memory=memory)

    monkeypatch.setattr(_C, "info", spy)
    _info.collect()
    fastdp.info()
    fastdp.info(memory=True)
    assert calls == [False, False, True]


def test_info_renders_unread_free_memory():
    info = _info.collect()
    gpu = {"total_bytes": 2**34, "peer_access": [True, True], "error": ""}
    info["devices"] = [dict(gpu, index=0, name="GPU A", free_bytes=2**33), dict(gpu, index=1, name="GPU B", free_bytes=None)]
    text = _info.render(info)
    assert "8.0 GiB" in text and "?" in text and "--memory" in text


def test_info_cli_memory_flag(monkeypatch, capsys):
    from fastdp.__main__ import main

    seen = []
    real = _info.collect
    monkeypatch.setattr(_info, "collect", lambda memory=False: seen.append(memory) or real(memory))
    assert main(["info", "--json"]) == 0
    assert main(["info", "--memory"]) == 0
    assert seen == [False, True]
    capsys.readouterr()


# ---- shutdown: never during finalization -----------------------------------------------------------------------


def test_shutdown_is_a_no_op_during_finalization(tmp_path):
    script = tmp_path / "fin.py"
    script.write_text(
        "import os, fastdp\n"
        "from fastdp import _C\n"
        "print('live', _C.shutdown(), flush=True)\n"
        "class Late:\n"
        "    def __del__(self):\n"
        "        os.write(1, b'finalizing %r\\n' % (_C.shutdown(),))\n"
        "late = Late()\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "live True" in out.stdout
    assert "finalizing False" in out.stdout


# ---- scratch allocator -----------------------------------------------------------------------------------------


def test_scratch_allocator_is_registered_and_checked():
    with pytest.raises(TypeError) as info:
        _C.set_device_allocator(3)
    assert str(info.value) == "set_device_allocator: expected a callable or None, got int"
    # Unregister and register again (the import registers _core._scratch where torch has CUDA).
    _C.set_device_allocator(None)
    _C.set_device_allocator(_core._scratch if torch.backends.cuda.is_built() else None)


# ---- scatter with explicit streams -----------------------------------------------------------------------------


class _Stream:
    def __init__(self, index, handle):
        self.device = torch.device("cuda", index)
        self.cuda_stream = handle


def test_scatter_streams_order_on_the_source_stream(monkeypatch):
    current = {0: _Stream(0, 100), 1: _Stream(1, 101), 2: _Stream(2, 102)}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: current[torch.device(d).index])
    src = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), get_device=lambda: 0)
    devs = [torch.device("cuda", i) for i in (0, 1, 2, 1)]
    given = [_Stream(0, 7), _Stream(1, 8), None, _Stream(1, 9)]
    chosen = comm._scatter_streams(src, devs, given)
    # The source device keeps the stream that produced the source; targets their own; None → current.
    assert {k: s.cuda_stream for k, s in chosen.items()} == {0: 100, 1: 8, 2: 102}
    host = types.SimpleNamespace(is_cuda=False)
    chosen = comm._scatter_streams(host, devs[1:3], given[1:3])
    assert {k: s.cuda_stream for k, s in chosen.items()} == {1: 8, 2: 102}


def test_scatter_stream_list_checked():
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(ValueError) as info:
        comm._cuda_streams([None], devs)
    assert str(info.value) == "Expected one stream per device: got 1 streams for 2 devices"
    with pytest.raises(RuntimeError) as info:
        comm._cuda_streams([None, _Stream(0, 5)], devs)
    assert str(info.value) == ("Expected the device associated with the stream at index 1 (was 0) to match the "
                               "device supplied at that index (expected 1)")
    assert comm._cuda_streams(None, devs) is None


# ---- gradient buckets: one reduce per bucket -------------------------------------------------------------------


def _count_reduce_many(monkeypatch):
    calls = []
    real = _C.reduce_many

    def spy(columns, outs, streams=None):
        calls.append([len(c) for c in columns])
        return real(columns, outs, streams)

    monkeypatch.setattr(_C, "reduce_many", spy)
    return calls


def _bucket(shapes, present, nrep, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = [[torch.randn(s, generator=g).to(dtype) if present[j][r] else None for j, s in enumerate(shapes)]
            for r in range(nrep)]
    columns = [[rows[r][j] for r in range(nrep) if rows[r][j] is not None] for j in range(len(shapes))]
    return columns


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.float16])
def test_packed_bucket_is_one_reduce(monkeypatch, tiled, dtype):
    """_pack + one core reduce equals the per-column sums, with replicas missing some gradients."""
    shapes = [(3, 4), (5,), (2, 2, 2), (1,)]
    present = [[1, 1, 1], [0, 1, 1], [1, 0, 1], [1, 1, 0]]
    columns = _bucket(shapes, present, 3, dtype)
    numels = [functools.reduce(lambda a, b: a * b, s, 1) for s in shapes]
    if tiled:
        flat = torch.empty(sum(numels), dtype=dtype)
        outs = [p.view(s) for p, s in zip(flat.split(numels), shapes)]
    else:
        outs = [torch.empty(s, dtype=dtype) for s in shapes]
    calls = _count_reduce_many(monkeypatch)
    flats, result, copy_back = _core._pack(columns, outs)
    assert copy_back is (not tiled)
    assert (result.data_ptr() == outs[0].data_ptr()) is tiled  # packed straight into the output, reduced in place
    assert len(flats) == 3  # one per replica slot
    _core._reduce([flats], [result])
    if copy_back:
        _C.copy([o.view(-1) for o in outs], list(result.split(numels)))
    assert calls == [[3]]
    for col, o in zip(columns, outs):
        ref = functools.reduce(torch.add, col)
        torch.testing.assert_close(o, ref, rtol=0, atol=0)


def test_unspread_columns_are_not_packed(monkeypatch):
    """Host (and single-device) columns are summed in place: no copies, one core call for all columns."""
    columns = _bucket([(4,), (6,)], [[1, 1], [1, 1]], 2)
    outs = [torch.empty(4), torch.empty(6)]
    calls = _count_reduce_many(monkeypatch)
    monkeypatch.setattr(_core, "_pack", lambda *a: pytest.fail("packed host columns"))
    _core.reduce_columns(columns, outs)
    assert calls == [[2, 2]]
    for col, o in zip(columns, outs):
        torch.testing.assert_close(o, col[0] + col[1], rtol=0, atol=0)


def test_spread_columns_take_the_packed_path(monkeypatch):
    """Columns on several CUDA devices go through _pack and one reduce (devices faked: the decision only)."""
    seen = []
    monkeypatch.setattr(_core, "_pack", lambda c, o: seen.append(len(c)) or ([o[0]], o[0], False))
    monkeypatch.setattr(_core, "_reduce", lambda cols, outs: seen.append(len(cols)))

    def fake(dev, dtype=torch.float32):
        return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", dev), dtype=dtype)

    outs = [fake(0), fake(0)]
    _core.reduce_columns([[fake(0), fake(1)], [fake(0), fake(1)]], outs)
    assert seen == [2, 1]
    seen.clear()
    _core.reduce_columns([[fake(0), fake(1, torch.float16)], [fake(0), fake(1)]], outs)  # mixed dtypes: per column
    assert seen == [2]


def test_scatter_allocates_under_the_writing_stream(monkeypatch):
    """comm.scatter(streams=...) allocates each output with the stream that writes it current (as upstream) and
    hands the core one stream per device: the given one, or the current one where None."""
    import contextlib

    current = {1: _Stream(1, 101), 2: _Stream(2, 102)}
    active = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: current[torch.device(d).index])

    @contextlib.contextmanager
    def stream(s):
        active.append(s)
        yield
        active.pop()

    allocated = []

    def empty_like(t, device):
        allocated.append((device.index, active[-1].cuda_stream if active else None))
        return torch.empty_like(t)

    seen = []
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda device, peer: False)  # no peer pairs to open
    monkeypatch.setattr(_devices, "_require_cuda", lambda d, what: d)  # CUDA devices without CUDA: the check passes them
    monkeypatch.setattr(comm, "_empty_like", empty_like)
    monkeypatch.setattr(_C, "scatter", lambda src, outs, dim, sizes, streams: seen.append(streams))
    x = torch.arange(12.0).view(6, 2)
    out = comm.scatter(x, [1, 2], dim=0, streams=[_Stream(1, 7), None])
    assert len(out) == 2
    assert allocated == [(1, 7), (2, 102)]
    assert sorted(seen[0]) == [(1, 7), (2, 102)]

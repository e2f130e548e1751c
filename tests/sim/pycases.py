"""fastdp._C on the simulated GPU, one case per process: python tests/sim/pycases.py CASE (tests/test_sim_python.py
runs each in a subprocess with the simulated libraries named in its environment). Results are compared with
torch's own CPU result, bit for bit; any misuse or race the simulator recorded fails the case. Exit 0 and a last
line "PASS" on success."""

import functools
import operator
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simgpu import (CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_UNKNOWN,  # noqa: E402
                    NCCL_INTERNAL_ERROR, Sim)

import fastdp  # noqa: E402
from fastdp import _C  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)


def rand(shape, dtype):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape) * 8).to(dtype)
    return torch.randint(-100, 100, shape).to(dtype)


def same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    a, b = a.contiguous(), b.contiguous()  # bit-exact comparison through a byte view, whatever the layouts
    assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                       b.view(torch.uint8) if b.dtype != torch.bool else b), f"{what}: values differ"


# ---- every operation, compared with torch ----

def op_broadcast(sim, streams):
    src_cpu = rand((13, 7), torch.float32)
    src = sim.tensor(src_cpu, 0)
    outs = [sim.empty((13, 7), torch.float32, d) for d in range(1, sim.ndev)]  # dense: NCCL
    sim.call(streams, [src] + outs, _C.broadcast, src, outs, streams)
    strided = [sim.tensor(torch.empty(13, 9)[:, :7], d) for d in range(1, sim.ndev)]  # strided: copies
    sim.call(streams, [src] + strided, _C.broadcast, src, strided, streams)
    return [(o, src_cpu) for o in outs + strided], [src] + outs + strided


def op_scatter_gather(sim, streams):
    res, keep = [], []
    for dim in (0, 1):
        src_cpu = rand((12, 10), torch.float16)
        src = sim.tensor(src_cpu, 0)
        chunks = [t.shape[dim] for t in src_cpu.chunk(sim.ndev, dim)]
        outs = [sim.empty(c.shape, torch.float16, i) for i, c in enumerate(src_cpu.split(chunks, dim))]
        sim.call(streams, [src] + outs, _C.scatter, src, outs, dim, chunks, streams)
        res += [(o, c) for o, c in zip(outs, src_cpu.split(chunks, dim))]
        parts_cpu = [rand(c.shape, torch.float16) for c in src_cpu.split(chunks, dim)]
        parts = [sim.tensor(p, i) for i, p in enumerate(parts_cpu)]
        out = sim.empty((12, 10), torch.float16, 1)
        sim.call(streams, parts + [out], _C.gather, parts, out, dim, streams)
        res.append((out, torch.cat(parts_cpu, dim)))
        keep += [src, out] + outs + parts
    return res, keep


def op_reduce(sim, streams):
    res, keep = [], []
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8):
        cpus = [rand((3, 333), dtype) for _ in range(sim.ndev)]
        ins = [sim.tensor(c, d) for d, c in enumerate(cpus)]
        out = sim.empty((3, 333), dtype, 0)
        sim.call(streams, ins + [out], _C.reduce, ins, out, streams)  # NCCL, rank order == input order
        res.append((out, functools.reduce(operator.add, cpus)))
        local = [rand((257,), dtype) for _ in range(40)]
        lins = [sim.tensor(c, 2 % sim.ndev) for c in local]
        sim.call(streams, lins, _C.reduce, lins, lins[35], streams)  # the output aliases an input a later pass reads
        res.append((lins[35], functools.reduce(operator.add, local)))
        # reduce_many: one reduce per column (the bucket reduction of DataParallel's backward)
        cols_cpu = [[rand((2, 50), dtype) for _ in range(sim.ndev)] for _ in range(3)]
        cols = [[sim.tensor(c, d) for d, c in enumerate(col)] for col in cols_cpu]
        outs = [sim.empty((2, 50), dtype, 0) for _ in cols]
        sim.call(streams, [t for col in cols for t in col] + outs, _C.reduce_many, cols, outs, streams)
        res += [(o, functools.reduce(operator.add, c)) for o, c in zip(outs, cols_cpu)]
        keep += ins + [out] + lins + outs + [t for col in cols for t in col]
    return res, keep


def op_copy(sim, streams):
    res, keep = [], []
    # host memory on one side: flat, and strided on both sides (staged)
    for src_cpu, dst_shape in ((rand((64, 5), torch.float32), (64, 5)), (rand((6, 40), torch.float32).t(), (40, 6))):
        dst = sim.tensor(torch.zeros(dst_shape), 1)
        sim.call(streams, [src_cpu, dst], _C.copy, [dst], [src_cpu], streams)
        res.append((dst, src_cpu.contiguous()))
        back = torch.zeros(dst_shape[1], dst_shape[0]).t()
        sim.call(streams, [dst, back], _C.copy, [back], [dst], streams)
        res.append((_Host(back), src_cpu))
        keep.append(dst)
    for sdev, ddev in ((0, 0), (0, 1), (2, 3)):
        src_cpu = rand((4, 6, 150), torch.float32).transpose(1, 2)
        src = sim.tensor(src_cpu, sdev)
        dst_cpu = torch.zeros(4, 160, 6)[:, 3:153, :]
        dst = sim.tensor(dst_cpu, ddev)
        sim.call(streams, [src, dst], _C.copy, [dst], [src], streams)
        want = dst_cpu.clone()
        want.copy_(src_cpu)
        res.append((dst, want))
        keep += [src, dst]
    return res, keep


class _Host:
    """A CPU result, read as a SimTensor's is."""

    def __init__(self, t):
        self.t = t

    def cpu(self):
        return self.t

    def release(self):
        pass


OPS = {"broadcast": op_broadcast, "scatter_gather": op_scatter_gather, "reduce": op_reduce, "copy": op_copy}


def check(sim, res, keep, where):
    for i, (got, want) in enumerate(res):
        same(got.cpu(), want, f"{where}: result {i}")
    for t in keep:
        t.release()
    sim.assert_clean(where)


def case_ops(sim):
    streams_per_dev = [sim.stream(d) for d in range(sim.ndev)]
    for name, op in OPS.items():
        for streams in (None, list(enumerate(streams_per_dev))):
            res, keep = op(sim, streams)
            check(sim, res, keep, f"{name} (streams={'own' if streams else 'default'})")
    _C.shutdown()
    res, keep = op_reduce(sim, None)  # shutdown, then reuse
    check(sim, res, keep, "reduce after shutdown")
    sim.synchronize()
    for d, s in enumerate(streams_per_dev):
        sim.destroy_stream(d, s)


# ---- the fault-injection sweep through the binding ----

def fault_code(entry):
    if entry.startswith("nccl"):
        return NCCL_INTERNAL_ERROR
    if "Alloc" in entry or entry == "cuModuleLoadData":
        return CUDA_ERROR_OUT_OF_MEMORY
    return CUDA_ERROR_LAUNCH_FAILED if entry == "cuLaunchKernel" else CUDA_ERROR_UNKNOWN


ENTRIES = [l.strip() for l in """cuDeviceGet cuDeviceGetAttribute cuDevicePrimaryCtxRetain cuDevicePrimaryCtxGetState
    cuCtxPushCurrent_v2 cuCtxPopCurrent_v2 cuCtxGetCurrent cuCtxSetCurrent cuCtxEnablePeerAccess cuMemAllocAsync
    cuMemFreeAsync cuMemcpyAsync cuMemcpyHtoDAsync_v2 cuMemcpyDtoHAsync_v2 cuStreamSynchronize cuMemcpyPeerAsync
    cuMemcpy2DAsync_v2 cuMemcpy3DPeerAsync cuEventCreate cuEventRecord cuEventDestroy_v2 cuStreamWaitEvent
    cuModuleLoadData cuModuleGetFunction cuLaunchKernel ncclCommInitAll ncclGroupStart ncclGroupEnd ncclBroadcast
    ncclReduce""".split()]
# A failure of the call that destroys something may leave that very thing behind.
# A failed cuCtxSetCurrent cannot give the thread its context back after NCCL switched it: NCCL's stays.
DESTROYS = {"cuEventDestroy_v2": "events", "cuMemFreeAsync": "allocations", "cuCtxPopCurrent_v2": "pushes",
            "cuCtxSetCurrent": "pushes"}


def case_sweep(sim):
    exclude = set(filter(None, os.environ.get("SIM_SWEEP_EXCLUDE", "").split(",")))
    streams = [(d, sim.stream(d)) for d in range(sim.ndev)]
    problems, trials = [], 0
    home = sim.current_context()
    for name, op in OPS.items():
        _C.shutdown()
        sim.reset()
        res, keep = op(sim, streams)
        counts = {e: sim.calls(e) for e in ENTRIES}
        check(sim, res, keep, name)
        for entry, n in counts.items():
            if entry in exclude:
                continue
            for k in range(1, n + 1):
                _C.shutdown()
                base = sim.stats()
                sim.reset()
                sim.fail_at(entry, k, fault_code(entry))
                trials += 1
                where = f"{name}, call {k} of {entry} failing"
                try:
                    op(sim, streams)
                except (fastdp.CudaError, fastdp.NcclError) as e:
                    if not str(e):
                        problems.append(f"{where}: {type(e).__name__} without a message")
                except Exception as e:  # noqa: BLE001 -- anything else is the finding
                    problems.append(f"{where}: {type(e).__name__}: {e} (want CudaError/NcclError)")
                sim.release_all()
                if sim.current_context() != home:  # a failed restore leaves NCCL's context: the caller repairs it
                    sim.set_context(home)
                n_err, text = sim.errors()
                if n_err:
                    problems.append(f"{where}: {n_err} misuse(s): {text}")
                now = sim.stats()
                for stat, v in now.items():
                    if v != base[stat] and not (DESTROYS.get(entry) == stat and v == base[stat] + 1):
                        problems.append(f"{where}: {stat} {base[stat]} before, {v} after")
                sim.reset()
                try:
                    res, keep = op(sim, streams)
                    check(sim, res, keep, f"{where}, the next call")
                except Exception as e:  # noqa: BLE001
                    problems.append(f"{where}: the next call fails too: {type(e).__name__}: {e}")
                sim.release_all()
                sim.reset()
                if len(problems) > 30:
                    break
    print(f"{trials} injected failures")
    sim.synchronize()
    for d, s in streams:
        sim.destroy_stream(d, s)
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:30])


# ---- the simulator's own checks: each kind of misuse it claims to catch is caught, and its fix is not ----

def case_selfcheck(sim):
    import ctypes
    lib, vp, u64, sz = sim.lib, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t
    for name, args in [("cuMemcpyHtoDAsync_v2", [u64, vp, sz, vp]), ("cuMemcpyDtoHAsync_v2", [vp, u64, sz, vp]),
                       ("cuEventCreate", [ctypes.POINTER(vp), ctypes.c_uint]), ("cuEventRecord", [vp, vp]),
                       ("cuStreamWaitEvent", [vp, vp, ctypes.c_uint]), ("cuEventDestroy_v2", [vp]),
                       ("cuMemAlloc_v2", [ctypes.POINTER(u64), sz]), ("cuMemFree_v2", [u64]),
                       ("cuModuleLoadData", [ctypes.POINTER(vp), ctypes.c_char_p]), ("cuModuleUnload", [vp]),
                       ("cuModuleGetFunction", [ctypes.POINTER(vp), vp, ctypes.c_char_p]),
                       ("cuLaunchKernel", [vp] + [ctypes.c_uint] * 7 + [vp, ctypes.POINTER(vp), vp]),
                       ("ncclCommInitAll", [ctypes.POINTER(vp), ctypes.c_int, vp]), ("ncclCommDestroy", [vp]),
                       ("ncclCommAbort", [vp]), ("simgpu_nccl_break", [ctypes.c_int, ctypes.c_int]),
                       ("cuMemAllocAsync", [ctypes.POINTER(u64), sz, vp]), ("cuStreamSynchronize", [vp]),
                       ("cuCtxSetCurrent", [vp])]:
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    host = (ctypes.c_char * 256)()

    def expect(n, what, fn):
        sim.reset()
        fn()
        got, text = sim.errors()
        assert got == n, f"{what}: want {n} recorded misuse(s), got {got}:\n{text}"
        if n:
            print(f"caught: {what}: {text.splitlines()[0]}")

    buf = sim.alloc(0, 256)
    s1, s2, blocking = sim.stream(0), sim.stream(0), None

    def pop_empty():
        c = vp()
        assert lib.cuCtxPopCurrent_v2(ctypes.byref(c)) != 0
    expect(1, "unbalanced pop", pop_empty)

    def unordered(wait):
        def run():
            sim.on(0, lib.cuMemcpyHtoDAsync_v2, buf, host, 256, s1)
            if wait:
                ev = vp()
                sim.on(0, lib.cuEventCreate, ctypes.byref(ev), 2)
                sim.on(0, lib.cuEventRecord, ev, s1)
                sim.on(0, lib.cuStreamWaitEvent, s2, ev, 0)
                sim.on(0, lib.cuEventDestroy_v2, ev)
            sim.on(0, lib.cuMemcpyDtoHAsync_v2, host, buf, 256, s2)
            sim.synchronize()
        return run
    expect(1, "race between two streams", unordered(False))
    expect(0, "the same, ordered by an event", unordered(True))

    def legacy(flags):
        def run():
            nonlocal blocking
            st = vp()
            sim.on(0, lib.cuStreamCreate, ctypes.byref(st), flags)
            sim.on(0, lib.cuMemcpyHtoDAsync_v2, buf, host, 256, None)  # the legacy stream
            sim.on(0, lib.cuMemcpyDtoHAsync_v2, host, buf, 256, st)
            sim.synchronize()
            sim.on(0, lib.cuStreamDestroy_v2, st)
        return run
    expect(0, "legacy stream then a blocking stream", legacy(0))
    expect(1, "legacy stream then a non-blocking stream", legacy(1))

    def stream_of_other_device():
        p = sim.alloc(1, 16)
        assert sim.on(1, lib.cuMemcpyHtoDAsync_v2, p, host, 16, s1) != 0
        sim.free(p)
    expect(1, "a stream of another device's context", stream_of_other_device)

    def freed():
        p = u64()
        sim.on(0, lib.cuMemAlloc_v2, ctypes.byref(p), 64)
        sim.on(0, lib.cuMemFree_v2, p)
        assert sim.on(0, lib.cuMemcpyHtoDAsync_v2, p, host, 64, None) != 0
    expect(1, "freed memory", freed)

    def past_end():
        assert sim.on(0, lib.cuMemcpyHtoDAsync_v2, buf + 200, host, 100, None) != 0
    expect(1, "past the end of an allocation", past_end)

    def host_as_device():
        assert sim.on(0, lib.cuMemcpyDtoHAsync_v2, host, ctypes.addressof(host), 16, None) != 0
    expect(1, "a host pointer as device memory", host_as_device)

    def destroyed_stream():
        st = sim.stream(0)
        sim.destroy_stream(0, st)
        assert sim.on(0, lib.cuMemcpyHtoDAsync_v2, buf, host, 16, st) != 0
    expect(1, "a destroyed stream", destroyed_stream)

    def kernel(peer):
        def run():
            other = sim.alloc(1, 64)
            if peer:
                sim.enable_peer(0, 1)
            mod, fn = vp(), vp()
            sim.on(0, lib.cuModuleLoadData, ctypes.byref(mod), b"any image")
            sim.on(0, lib.cuModuleGetFunction, ctypes.byref(fn), mod, b"fdp_copy_4")
            # fdp_copy_args_t: numel, (ndim, pad), sizes[17], src_strides[17], dst_strides[17]
            args = (ctypes.c_longlong * (2 + 3 * 17))(16, 1, 16)
            args[2 + 17], args[2 + 34] = 1, 1
            src, dst = u64(other), u64(buf)
            params = (vp * 3)(ctypes.addressof(src), ctypes.addressof(dst), ctypes.addressof(args))
            r = sim.on(0, lib.cuLaunchKernel, fn, 1, 1, 1, 32, 1, 1, 0, s1, params, None)
            assert (r == 0) == peer, r
            sim.on(0, lib.cuModuleUnload, mod)
            sim.synchronize()
            sim.free(other)
        return run
    expect(1, "a kernel reading another device's memory without peer access", kernel(False))
    expect(0, "the same with peer access enabled", kernel(True))

    def misaligned(offset):
        def run():
            mod, fn = vp(), vp()
            sim.on(0, lib.cuModuleLoadData, ctypes.byref(mod), b"any image")
            sim.on(0, lib.cuModuleGetFunction, ctypes.byref(fn), mod, b"fdp_copy_8")
            args = (ctypes.c_longlong * (2 + 3 * 17))(4, 1, 4)
            args[2 + 17], args[2 + 34] = 1, 1
            src, dst = u64(buf + offset), u64(buf + 128)
            params = (vp * 3)(ctypes.addressof(src), ctypes.addressof(dst), ctypes.addressof(args))
            r = sim.on(0, lib.cuLaunchKernel, fn, 1, 1, 1, 32, 1, 1, 0, s1, params, None)
            assert (r == 0) == (offset % 8 == 0), r
            sim.on(0, lib.cuModuleUnload, mod)
            sim.synchronize()
        return run
    expect(1, "a kernel reading 8-byte elements at an address 4 bytes off", misaligned(4))
    expect(0, "the same at an aligned address", misaligned(8))

    def pool_memory_freed(wait):
        def run():
            p = u64()
            sim.on(0, lib.cuMemAllocAsync, ctypes.byref(p), 64, s1)
            sim.on(0, lib.cuMemcpyHtoDAsync_v2, p, host, 64, s1)
            if wait:
                sim.on(0, lib.cuStreamSynchronize, s1)
            sim.on(0, lib.cuMemFree_v2, p)  # does not wait for stream-ordered memory's users
        return run
    expect(1, "stream-ordered memory freed with cuMemFree while a copy may still use it", pool_memory_freed(False))
    expect(0, "the same after the stream was synchronised", pool_memory_freed(True))

    def broken_comm_ended(abort):
        def run():
            comms = (vp * 2)()
            devs = (ctypes.c_int * 2)(0, 1)
            assert lib.ncclCommInitAll(comms, 2, devs) == 0  # the client holds the contexts: +2 misuse
            assert lib.simgpu_nccl_break(-1, 3) >= 2
            for c in comms:
                (lib.ncclCommAbort if abort else lib.ncclCommDestroy)(c)
            lib.cuCtxSetCurrent(sim.ctx[0])
        return run
    expect(4, "communicators that reported an error destroyed, not aborted (2 at init, 2 at destroy)",
           broken_comm_ended(False))
    expect(2, "the same aborted (2 at init)", broken_comm_ended(True))

    def comm_outlives_context():
        comms = (vp * 2)()
        devs = (ctypes.c_int * 2)(2, 3)
        assert lib.ncclCommInitAll(comms, 2, devs) == 0
        lib.cuCtxSetCurrent(None)  # NCCL left one of the devices' contexts current, as the real library may
        sim.close()  # every client reference: contexts 2 and 3 die under their communicators
        lib.ncclCommDestroy(comms[0])
        lib.ncclCommDestroy(comms[1])
        sim.open()
    sim.synchronize()
    for st in (s1, s2):
        sim.destroy_stream(0, st)
    sim.free(buf)
    expect(6, "communicators made on contexts only the client holds, outliving them (2 at init, 2 at release, 2 at "
              "destroy)", comm_outlives_context)

    def injected():
        sim.fail_at("cuMemAlloc_v2", 2, 2)
        p = u64()
        assert sim.on(0, lib.cuMemAlloc_v2, ctypes.byref(p), 8) == 0
        assert sim.on(0, lib.cuMemAlloc_v2, ctypes.byref(q := u64()), 8) == 2
        assert sim.on(0, lib.cuMemAlloc_v2, ctypes.byref(q), 8) == 0
        sim.on(0, lib.cuMemFree_v2, p)
        sim.on(0, lib.cuMemFree_v2, q)
    expect(0, "an injected failure (not misuse)", injected)


# ---- one case per GPU-path defect found (each fails on the code before its fix) ----

def case_defect_transient_module_failure(sim):
    """A transient cuModuleLoadData OOM fails that call only: a plain peer copy and the next kernel work succeed."""
    sim.fail_at("cuModuleLoadData", 1, CUDA_ERROR_OUT_OF_MEMORY)
    ins = [sim.tensor(rand((100,), torch.float32), 0) for _ in range(3)]
    out = sim.empty((100,), torch.float32, 0)
    try:
        _C.reduce(ins, out)  # needs the kernels: may fail with the injected OOM
    except fastdp.CudaError:
        pass
    sim.reset()
    src_cpu = rand((100,), torch.float32)
    src, dst = sim.tensor(src_cpu, 0), sim.empty((100,), torch.float32, 1)
    _C.copy([dst], [src])  # needs no kernel
    same(dst.cpu(), src_cpu, "peer copy after a transient module load failure")
    _C.reduce(ins, out)
    same(out.cpu(), functools.reduce(operator.add, [t.cpu() for t in ins]), "reduce after the failure")
    for t in ins + [out, src, dst]:
        t.release()


def case_defect_usability_touches_gpu(sim):
    """Asking whether NCCL serves a device list retains no primary context (touches no GPU)."""
    sim.close()  # no client context either: nothing may be retained at all
    from fastdp import comm
    before = sim.calls("cuDevicePrimaryCtxRetain")
    comm.broadcast_is_collective([torch.device("cuda", 0), torch.device("cuda", 1)])
    assert sim.calls("cuDevicePrimaryCtxRetain") == before, "the NCCL usability check retained primary contexts"
    assert sim.stat("retains") == 0
    sim.open()


def case_defect_peer_access(sim):
    """Cross-device copies enable peer access once per pair, tolerating a pair a client already enabled."""
    assert sim.enable_peer(2, 3) == 0  # as PyTorch may already have done
    before = sim.stat("peer_enables")
    for _ in range(3):
        for s, d in ((0, 1), (3, 2)):
            src_cpu = rand((64,), torch.float32)
            src, dst = sim.tensor(src_cpu, s), sim.empty((64,), torch.float32, d)
            _C.copy([dst], [src])
            same(dst.cpu(), src_cpu, f"copy {s} -> {d}")
            src.release()
            dst.release()
    assert sim.peer_enabled(1, 0) or sim.peer_enabled(0, 1), "peer access between devices 0 and 1 was never enabled"
    assert sim.stat("peer_enables") - before <= 4, "peer access enabled more than once per pair and direction"


def case_defect_staging_retry(sim):
    """A staging buffer that cannot be had at once is retried (or comes from PyTorch's allocator, which retries
    itself): a strided cross-device copy survives a transient cuMemAllocAsync OOM, and with the registered
    allocator the driver's pool is never asked."""
    src_cpu = rand((8, 300), torch.float32).t()
    src, dst = sim.tensor(src_cpu, 0), sim.tensor(torch.zeros(300, 10)[:, 1:9], 1)
    sim.fail_at("cuMemAllocAsync", 1, CUDA_ERROR_OUT_OF_MEMORY)
    before = sim.calls("simgpu_cache_alloc")
    _C.copy([dst], [src])
    same(dst.cpu(), src_cpu, "staged copy after a transient OOM")
    if caching():
        assert sim.calls("cuMemAllocAsync") == 0 and sim.calls("simgpu_cache_alloc") > before
    src.release()
    dst.release()


def case_defect_shutdown_order(sim):
    """fdp_shutdown destroys NCCL communicators before it releases the primary contexts they live in."""
    cpu = rand((50,), torch.float32)
    src = sim.tensor(cpu, 0)
    outs = [sim.empty((50,), torch.float32, d) for d in range(1, sim.ndev)]
    _C.broadcast(src, outs)  # builds communicators
    strided = [sim.tensor(torch.zeros(50, 2)[:, 0], d) for d in range(1, sim.ndev)]
    _C.broadcast(src, strided)  # device copies: fastdp retains every device's primary context itself
    for o in outs + strided:
        same(o.cpu(), cpu, "broadcast")
    for t in [src] + outs + strided:
        t.release()
    assert sim.stat("comms") > 0
    sim.trim()  # the client's caching allocator gives its free blocks back first (PyTorch's empty_cache)
    sim.close()  # the client lets go of its contexts: fastdp's own references keep them alive
    sim.assert_clean("before shutdown")
    _C.shutdown()
    sim.assert_clean("shutdown")
    assert sim.stat("comms") == 0 and sim.stat("retains") == 0
    sim.open()


# ---- the library's own code on the exception; CUDA out of memory is PyTorch's OutOfMemoryError ----

def _staged_copy(sim):
    """A strided cross-device copy: it needs scratch memory (staging) on both devices."""
    src_cpu = rand((8, 300), torch.float32).t()
    return src_cpu, sim.tensor(src_cpu, 0), sim.tensor(torch.zeros(300, 10)[:, 1:9], 1)


def case_status(sim):
    src_cpu, src, dst = _staged_copy(sim)
    if caching():  # out of memory in the registered allocator (PyTorch's has retried inside already)
        sim.fail_at("simgpu_cache_alloc", 1, CUDA_ERROR_OUT_OF_MEMORY)
    else:  # out of memory in the driver's pool, with no retry (the device sync before it fails too)
        sim.fail_at("cuMemAllocAsync", 1, CUDA_ERROR_OUT_OF_MEMORY)
        sim.fail_at("cuCtxSynchronize", 1, CUDA_ERROR_UNKNOWN)
    try:
        _C.copy([dst], [src])
        raise AssertionError("the copy succeeded with no memory")
    except torch.OutOfMemoryError as e:
        assert isinstance(e, fastdp.CudaOutOfMemoryError) and isinstance(e, fastdp.CudaError), type(e)
        assert e.status == CUDA_ERROR_OUT_OF_MEMORY and e.code == "FDP_CUDA", (e.status, e.code)
        assert ("CUDA out of memory" if caching() else "CUDA_ERROR_OUT_OF_MEMORY") in str(e), str(e)
    sim.reset()
    _C.copy([dst], [src])
    same(dst.cpu(), src_cpu, "the copy after out of memory")
    # Any other driver failure: a plain CudaError with its CUresult.
    ins = [sim.tensor(rand((100,), torch.float32), 0) for _ in range(3)]
    out = sim.empty((100,), torch.float32, 0)
    sim.fail_at("cuLaunchKernel", 1, CUDA_ERROR_LAUNCH_FAILED)
    try:
        _C.reduce(ins, out)
        raise AssertionError("the reduce succeeded with a failed launch")
    except fastdp.CudaError as e:
        assert not isinstance(e, torch.OutOfMemoryError) and e.status == CUDA_ERROR_LAUNCH_FAILED, (type(e), e.status)
    sim.reset()
    # NCCL: an NcclError with its ncclResult_t.
    bsrc = sim.tensor(rand((50,), torch.float32), 0)
    bouts = [sim.empty((50,), torch.float32, d) for d in range(1, sim.ndev)]
    sim.fail_at("ncclBroadcast", 1, NCCL_INTERNAL_ERROR)
    try:
        _C.broadcast(bsrc, bouts)
        raise AssertionError("the broadcast succeeded with a failed ncclBroadcast")
    except fastdp.NcclError as e:
        assert e.status == NCCL_INTERNAL_ERROR and e.code == "FDP_NCCL", (e.status, e.code)
    sim.reset()
    # An allocator (PyTorch's, registered where torch has CUDA) that is out of memory: the same exception.
    def torch_out_of_memory(device, nbytes, stream):
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes (test)")

    _C.set_device_allocator(torch_out_of_memory)
    try:
        _C.copy([dst], [src])
        raise AssertionError("the copy succeeded with an allocator out of memory")
    except fastdp.CudaOutOfMemoryError as e:
        assert e.status == CUDA_ERROR_OUT_OF_MEMORY and "Tried to allocate" in str(e), (e.status, str(e))
    finally:
        scratch_route(sim)
    # Failures that are not a library's carry no status.
    small, big = sim.tensor(rand((3,), torch.float32), 0), sim.empty((4,), torch.float32, 0)
    try:
        _C.reduce([small], big)
        raise AssertionError("a reduce of mismatched sizes succeeded")
    except ValueError as e:
        assert getattr(e, "status", None) is None
    for t in ins + [out, bsrc, src, dst, small, big] + bouts:
        t.release()


# ---- a GPU for which no kernels exist (run with FASTDP_DISABLE_NVRTC=1 FASTDP_DISABLE_FATBIN=1) ----

def case_no_kernels(sim):
    """No fatbin and no NVRTC: the core still does every copy the copy engines can do, refuses kernel work with
    BackendUnavailableError naming the kernel, and fastdp's route to torch then gives torch's result (computed by
    torch on the host here, since torch cannot run on simulated memory) with one FallbackWarning."""
    import warnings

    from fastdp._native import fallback as _fallback, route as _route

    assert os.environ.get("FASTDP_DISABLE_NVRTC") == "1" and os.environ.get("FASTDP_DISABLE_FATBIN") == "1"
    assert _C.usable("cuda")[0], "the cuda backend must stay usable without kernels"
    for s, d in ((0, 0), (0, 1)):
        src_cpu = rand((64, 3), torch.float32)
        src, dst = sim.tensor(src_cpu, s), sim.empty((64, 3), torch.float32, d)
        _C.copy([dst], [src])
        same(dst.cpu(), src_cpu, f"contiguous copy {s} -> {d} without kernels")
        src.release()
        dst.release()
    ins_cpu = [rand((100,), torch.float32) for _ in range(3)]
    ins, out = [sim.tensor(t, 0) for t in ins_cpu], sim.empty((100,), torch.float32, 0)
    try:
        _C.reduce(ins, out)
        raise AssertionError("a 3-input reduce ran without any kernels")
    except _C.BackendUnavailableError as e:
        assert "k-way sum kernel" in str(e), str(e)
    ran = []

    def host_sum_into(inputs, o):  # torch's fallback sum, with torch on the host and a core copy back
        ran.append(len(inputs))
        total = functools.reduce(operator.add, [t.cpu() for t in inputs])
        staged = sim.tensor(total, o.get_device())
        _C.copy([o], [staged])
        staged.release()

    _fallback._sum_into = host_sum_into
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _route.reduce_many([ins], [out], None)
        _route.reduce_many([ins], [out], None)
    assert ran == [3, 3], ran
    falls = [w for w in caught if issubclass(w.category, fastdp.FallbackWarning)]
    assert len(falls) == 1 and "k-way sum kernel" in str(falls[0].message), [str(w.message) for w in caught]
    assert "nvidia-cuda-nvrtc" in str(falls[0].message), str(falls[0].message)
    same(out.cpu(), functools.reduce(operator.add, ins_cpu), "reduce through the fallback")
    for t in ins + [out]:
        t.release()


def caching():
    return os.environ.get("SIMGPU_ALLOCATOR", "pool") == "caching"


def scratch_route(sim):
    """The core's scratch memory for this run (SIMGPU_ALLOCATOR): the simulated caching allocator registered as
    fastdp._native.core registers PyTorch's ("caching", every CUDA build's route), or the driver's pool ("pool", a
    PyTorch without CUDA). Set either way, whatever this process's torch registered at import."""
    assert os.environ.get("SIMGPU_ALLOCATOR", "pool") in ("pool", "caching")
    _C.set_device_allocator(sim.caching_allocator() if caching() else None)


def main(name):
    sim = Sim().open()
    if not torch.backends.cuda.is_built():
        # Sim made its getFreeMutex visible before NCCL loads, so fastdp must find it. A CUDA build of torch has
        # loaded its own libc10_cuda, whose free mutex fastdp rightly takes instead (the simulator cannot see it).
        os.environ.setdefault("SIMGPU_REQUIRE_FREE_MUTEX", "1")
    sim.reset()
    scratch_route(sim)
    globals()["case_" + name](sim)
    sim.assert_clean(name)
    _C.shutdown()
    _C.set_device_allocator(None)
    sim.trim()
    sim.close()
    sim.assert_clean(name + " (shutdown)")
    leaks = {k: sim.stat(k) for k in ("allocations", "streams", "events", "modules", "pushes", "retains", "comms",
                                      "groups")}
    assert not any(leaks.values()), f"left behind after shutdown: {leaks}"
    print("PASS")


if __name__ == "__main__":
    main(sys.argv[1])

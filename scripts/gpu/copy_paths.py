"""Every copy path of fastdp's cuda backend on one device, and its sum kernel, against PyTorch's own results
(scripts/gpu_check.sh). Copies go through ``fastdp.comm.broadcast(src, out=[dst])``; with the destination on the
source's device (or the host) the core hands them to the cuda backend, which picks:

- flat on both sides: one cuMemcpyAsync;
- rows of >= 512 bytes with row pitches (and at most 64 outer iterations): cuMemcpy2DAsync per outer index;
- anything else (short rows, strided inner dims, transposes, unaligned bytes, > 64 outer iterations): the
  strided-copy kernel, widened to 16-byte elements where the layout allows;
- host <-> device: one flat transfer, a strided host side packed on the host, a strided device side through a
  staging buffer and the kernel; pageable and pinned host memory;
- more than 2**31 uint8 elements: one flat copy, one kernel copy into a strided destination, and one sum.

Each destination starts as random bytes; the whole destination buffer (gaps included) must equal what
``dst.copy_(src)`` makes of the same start. Sums must equal torch's in-order ``a + b + ...`` bit for bit.
``--device cpu`` runs the same cases through the host backend with small sizes (a check of this script itself).
Prints one line per case; exits 1 if any fails.
"""

import argparse
import functools
import sys
import time

import torch

from fastdp import comm

BIG = 2**31 + 4097  # elements; > 2**31 so that 32-bit indexing anywhere would show


def rand(shape, dtype, device, gen):
    """Random values of any dtype (finite floats, valid bools), made on the host from `gen`, then moved."""
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    elif dtype.is_complex:
        t = torch.randn(shape, dtype=dtype, generator=gen)
    elif dtype.is_floating_point:
        t = (torch.randn(shape, generator=gen) * 100).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=gen).to(dtype)
    return t.to(device)


def same_bytes(a, b):
    """Bit-exact equality of two tensors of one shape and dtype (NaNs and -0.0 included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous(), b.contiguous()
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class Runner:
    def __init__(self, device, small):
        self.dev = torch.device(device)
        self.small = small
        self.gen = torch.Generator().manual_seed(0)
        self.failures = 0
        self.count = 0

    def base(self, shape, dtype, where=None, pinned=False):
        t = rand(shape, dtype, where or self.dev, self.gen)
        return t.pin_memory() if pinned else t

    def report(self, name, ok, t0, detail=""):
        self.count += 1
        ms = (time.perf_counter() - t0) * 1e3
        print(f"{name:64s} {'ok' if ok else 'FAILED'} {ms:9.1f} ms {detail}", flush=True)
        if not ok:
            self.failures += 1

    def copy_case(self, name, src, dst_base, view):
        """Copies src into view(dst_base) through fastdp; compares dst_base as a whole with torch's copy_."""
        t0 = time.perf_counter()
        ok, detail = False, ""
        try:
            expect = dst_base.clone()
            view(expect).copy_(src)
            comm.broadcast(src, out=[view(dst_base)])
            if dst_base.is_cuda or src.is_cuda:
                torch.cuda.synchronize()
            ok = same_bytes(dst_base, expect)
        except Exception as e:  # reported, not raised: every case runs
            detail = f"{type(e).__name__}: {e}"
        self.report(name, ok, t0, detail)

    def sum_case(self, name, inputs):
        t0 = time.perf_counter()
        ok, detail = False, ""
        try:
            ours = comm.reduce_add(inputs, destination=inputs[0].device)
            ref = functools.reduce(torch.add, inputs)
            ok = same_bytes(ours, ref)
        except Exception as e:
            detail = f"{type(e).__name__}: {e}"
        self.report(name, ok, t0, detail)


def device_cases(r):
    d = r.dev
    ident = lambda t: t  # noqa: E731
    # flat: cuMemcpyAsync
    r.copy_case("flat float32 x 1M+3", r.base((2**20 + 3,), torch.float32), r.base((2**20 + 3,), torch.float32), ident)
    # rows >= 512 B with pitches: cuMemcpy2DAsync
    for width in (512, 513, 4096):
        src = r.base((64, 2 * width), torch.uint8)[:, :width]
        r.copy_case(f"rows {width} B, strided source -> contiguous", src, r.base((64, width), torch.uint8), ident)
        r.copy_case(f"rows {width} B, contiguous -> strided destination", r.base((64, width), torch.uint8),
                    r.base((64, width + 64), torch.uint8), lambda t, w=width: t[:, :w])
    r.copy_case("rows 1 KiB float32, 3-d, 4 outer x 32 rows", r.base((4, 32, 512), torch.float32)[:, :, :256],
                r.base((4, 32, 320), torch.float32), lambda t: t[:, :, :256])
    r.copy_case("rows 1 KiB float32, 3-d, 65 outer (kernel)", r.base((65, 4, 512), torch.float32)[:, :, :256],
                r.base((65, 4, 300), torch.float32), lambda t: t[:, :, :256])
    # kernel: short rows, strided inner dims, transposes, every element size, unaligned bytes
    r.copy_case("rows 511 B (kernel)", r.base((64, 1022), torch.uint8)[:, :511], r.base((64, 600), torch.uint8),
                lambda t: t[:, :511])
    for dtype in (torch.uint8, torch.float16, torch.float32, torch.float64, torch.complex128, torch.bool):
        name = str(dtype).replace("torch.", "")
        r.copy_case(f"{name}: strided destination [:, ::2] (kernel)", r.base((37, 53), dtype),
                    r.base((37, 106), dtype), lambda t: t[:, ::2])
        r.copy_case(f"{name}: transposed source (kernel)", r.base((53, 37), dtype).t(), r.base((37, 53), dtype), ident)
    r.copy_case("uint8 unaligned (offset 1), rows of 100 (kernel)", r.base((50, 201), torch.uint8)[:, 1:101],
                r.base((50, 128), torch.uint8), lambda t: t[:, 3:103])
    r.copy_case("float16 rows of 8, 16-byte widened (kernel)", r.base((1000, 16), torch.float16)[:, :8],
                r.base((1000, 8), torch.float16), ident)
    r.copy_case("channels_last float32 -> contiguous", r.base((4, 8, 9, 10), torch.float32).to(
        memory_format=torch.channels_last), r.base((4, 8, 9, 10), torch.float32), ident)
    # host <-> device, pageable and pinned
    if d.type == "cuda":
        for pinned in (False, True):
            kind = "pinned" if pinned else "pageable"
            r.copy_case(f"H2D flat, {kind}", r.base((2**20 + 5,), torch.float32, "cpu", pinned),
                        r.base((2**20 + 5,), torch.float32), ident)
            r.copy_case(f"D2H flat, {kind}", r.base((2**20 + 5,), torch.float32),
                        r.base((2**20 + 5,), torch.float32, "cpu", pinned), ident)
        r.copy_case("H2D strided host source", r.base((300, 80), torch.float64, "cpu")[:, ::3],
                    r.base((300, 27), torch.float64), ident)
        r.copy_case("H2D strided device destination", r.base((300, 27), torch.float64, "cpu"),
                    r.base((300, 81), torch.float64), lambda t: t[:, ::3])
        r.copy_case("D2H strided device source", r.base((300, 80), torch.float64)[:, ::3],
                    r.base((300, 27), torch.float64, "cpu"), ident)
        r.copy_case("D2H strided host destination", r.base((300, 27), torch.float64),
                    r.base((300, 81), torch.float64, "cpu"), lambda t: t[:, ::3])
        r.copy_case("H2D both sides strided, pinned", r.base((64, 64), torch.int32, "cpu", True).t(),
                    r.base((64, 128), torch.int32), lambda t: t[:, 64:])
    # sums (cuda backend kernel on one device, or host), every reduced dtype, in order
    for dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                  torch.bfloat16, torch.float32, torch.float64):
        name = str(dtype).replace("torch.", "")
        if dtype == torch.bool:
            ins = [r.base((10007,), dtype) for _ in range(3)]
        else:
            ins = [r.base((10007,), dtype) for _ in range(5)]
        r.sum_case(f"sum x{len(ins)} {name}", ins)


def big_cases(r):
    """More than 2**31 uint8 elements: flat copy, kernel copy into a strided destination, a 2-input sum."""
    n = 2**20 + 4097 if r.small else BIG
    tag = f"{n} uint8"
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=r.dev)
    r.copy_case(f"big flat copy, {tag}", src, torch.empty(n, dtype=torch.uint8, device=r.dev), lambda t: t)
    width = 100  # rows under 512 B: the kernel, with > 2**31 elements and offsets past 2**31 bytes
    rows = -(-n // width)
    grid = torch.randint(0, 256, (rows, width), dtype=torch.uint8, device=r.dev)
    del src
    dst = torch.zeros(rows, 128, dtype=torch.uint8, device=r.dev)
    r.copy_case(f"big kernel copy into [:, :{width}] of [{rows}, 128]", grid, dst, lambda t: t[:, :width])
    del grid, dst
    if r.dev.type == "cuda":
        torch.cuda.empty_cache()
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, device=r.dev)
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, device=r.dev)
    r.sum_case(f"big sum x2, {tag}", [a, b])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="no > 2**31-element case (implied by --device cpu)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    r = Runner("cuda:0" if args.device == "cuda" else "cpu", args.small or args.device == "cpu")
    torch.manual_seed(0)
    device_cases(r)
    big_cases(r)
    print(f"copy paths: {r.count - r.failures} of {r.count} ok")
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main())

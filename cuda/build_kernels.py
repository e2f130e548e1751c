"""Embeds the kernels in a generated C file for the extension: always their source text (compiled at run time
by NVRTC), and, when nvcc is found, a fatbin of cuda/*.cu that the driver may load first.

Called by setup.py as build_blob(cuda_dir, cuda_home, out_c). The result defines fdp__kernels_fatbin,
fdp__kernels_fatbin_size, fdp__kernels_source and fdp__kernels_source_size (declared in
csrc/backend/cuda/kernels.h). When nvcc is missing or fails, the fatbin is empty; the build never fails here.

FASTDP_CUDA_ARCHS overrides the architectures, e.g. "80;90;100", "8.0 9.0+PTX" or "sm_90,compute_90"; a
bare number means SASS for that architecture, "+PTX" or "compute_XX" adds PTX. Architectures this nvcc does
not know are dropped with a message.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# SASS for Ampere, Hopper and Blackwell datacenter parts, plus compute_80 PTX that the driver JIT-compiles for
# anything else from sm_80 on (consumer Ampere/Ada/Blackwell included).
DEFAULT_ARCHS = "80;90;100;compute_80"


def _log(msg):
    print(f"fastdp build_kernels: {msg}", file=sys.stderr)


def _find_nvcc(cuda_home):
    """nvcc of the given toolkit; None when there is none (setup.py already searched PATH for one)."""
    if cuda_home is None:
        return None
    cand = Path(cuda_home) / "bin" / "nvcc"
    if cand.is_file() and os.access(cand, os.X_OK):
        return str(cand)
    return shutil.which("nvcc")


def _parse_archs(spec):
    """Returns [(kind, number)], kind "sm" (SASS) or "compute" (PTX), in order, without duplicates."""
    out = []
    for tok in re.split(r"[;,\s]+", spec.strip()):
        if not tok:
            continue
        m = re.fullmatch(r"(sm_|compute_)?(\d+)\.?(\d*)([a-z]?)(\+ptx)?", tok.lower())
        if not m:
            _log(f"ignoring architecture {tok!r} in FASTDP_CUDA_ARCHS")
            continue
        prefix, major, minor, suffix, ptx = m.groups()
        num = (major + minor if minor else major) + suffix
        if prefix == "compute_":
            entries = [("compute", num)]
        else:
            entries = [("sm", num)] + ([("compute", num)] if ptx else [])
        for e in entries:
            if e not in out:
                out.append(e)
    return out


def _supported(nvcc, flag):
    try:
        res = subprocess.run([nvcc, flag], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return set(res.stdout.split())


def _gencode_flags(nvcc, archs):
    sass_ok = _supported(nvcc, "--list-gpu-code")  # sm_XX names; None when this nvcc cannot list them
    ptx_ok = _supported(nvcc, "--list-gpu-arch")  # compute_XX names
    flags, kept = [], []
    for kind, num in archs:
        virt = f"compute_{num}"
        if kind == "sm":
            if sass_ok is not None and f"sm_{num}" not in sass_ok:
                _log(f"nvcc does not support sm_{num}; dropped")
                continue
            flags.append(f"-gencode=arch={virt},code=sm_{num}")
            kept.append(f"sm_{num}")
        else:
            if ptx_ok is not None and virt not in ptx_ok:
                _log(f"nvcc does not support {virt}; dropped")
                continue
            flags.append(f"-gencode=arch={virt},code={virt}")
            kept.append(virt)
    return flags, kept


KERNELS_H = "kernels.h"


def kernel_source(cuda_dir):
    """cuda/*.cu as one self-contained text: csrc/backend/cuda/kernels.h inlined once, no other include, so that
    NVRTC (which has no host or toolkit headers) compiles exactly what nvcc compiles."""
    cuda_dir = Path(cuda_dir).resolve()
    header = (cuda_dir.parent / "csrc" / "backend" / "cuda" / KERNELS_H).read_text()
    parts = [f"// fastdp kernels: {KERNELS_H} and {', '.join(p.name for p in sorted(cuda_dir.glob('*.cu')))}\n",
             header]
    for path in sorted(cuda_dir.glob("*.cu")):
        lines = []
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith("#include"):
                if KERNELS_H not in stripped:
                    raise RuntimeError(f"{path}: kernels may include only {KERNELS_H} (NVRTC has no headers)")
                continue
            lines.append(line)
        parts.append(f"// ---- {path.name}\n" + "\n".join(lines) + "\n")
    return "".join(parts)


def _c_string(text):
    """A C string literal, one source line per literal line; bytes outside printable ASCII as octal escapes."""
    out = []
    lines = text.encode().split(b"\n")
    tail = lines.pop()  # after the last newline: "" for a text that ends with one
    for i, line in enumerate(lines + ([tail] if tail else [])):
        end = "\\n" if i < len(lines) else ""
        esc = "".join(
            "\\\\" if b == 0x5C else '\\"' if b == 0x22 else chr(b) if 0x20 <= b < 0x7F else f"\\{b:03o}"
            for b in line
        )
        out.append(f'  "{esc}{end}"')
    return "\n".join(out)


def _write_c(out_c, data, note, source):
    lines = [
        f"/* Generated by cuda/build_kernels.py: {note}. Do not edit. */",
        "#include <stddef.h>",
        "",
        "const char fdp__kernels_source[] =",
        _c_string(source) + ";",
        "const size_t fdp__kernels_source_size = sizeof fdp__kernels_source - 1;",
        "",
    ]
    if data:
        # The fatbin header is read in place by cuModuleLoadData; keep it aligned like nvcc's own embedding.
        lines.append("_Alignas(16) const unsigned char fdp__kernels_fatbin[] = {")
        for i in range(0, len(data), 24):
            lines.append("  " + ",".join(str(b) for b in data[i : i + 24]) + ",")
        lines.append("};")
    else:
        lines.append("const unsigned char fdp__kernels_fatbin[] = {0};")
    lines.append(f"const size_t fdp__kernels_fatbin_size = {len(data)};")
    out_c = Path(out_c)
    out_c.parent.mkdir(parents=True, exist_ok=True)
    out_c.write_text("\n".join(lines) + "\n")


def build_blob(cuda_dir, cuda_home, out_c):
    """Writes out_c; returns the fatbin size in bytes (0 when the kernels could not be compiled)."""
    cuda_dir = Path(cuda_dir).resolve()
    sources = sorted(cuda_dir.glob("*.cu"))
    source = kernel_source(cuda_dir)
    nvcc = _find_nvcc(cuda_home)
    if nvcc is None or not sources:
        why = "nvcc not found" if nvcc is None else f"no .cu files in {cuda_dir}"
        _log(f"{why}; no fatbin, the kernels will be compiled at run time by NVRTC")
        _write_c(out_c, b"", f"source only ({why})", source)
        return 0
    archs = _parse_archs(os.environ.get("FASTDP_CUDA_ARCHS") or DEFAULT_ARCHS)
    flags, kept = _gencode_flags(nvcc, archs)
    if not flags:
        _log("no requested architecture is supported by this nvcc; no fatbin")
        _write_c(out_c, b"", "source only (no architecture supported by nvcc)", source)
        return 0
    include = cuda_dir.parent / "csrc" / "backend" / "cuda"
    with tempfile.TemporaryDirectory(prefix="fastdp-nvcc-") as tmp:
        # One translation unit, so that one cuModuleLoadData per device gets every kernel.
        unity = Path(tmp) / "fastdp_kernels.cu"
        unity.write_text("".join(f'#include "{p.as_posix()}"\n' for p in sources))
        fatbin = Path(tmp) / "fastdp_kernels.fatbin"
        cmd = [nvcc, "-fatbin", "-O3", "-std=c++17", f"-I{include}", "--threads", "0", *flags, "-o", str(fatbin),
               str(unity)]
        start = time.monotonic()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            ok = res.returncode == 0 and fatbin.is_file()
            err = (res.stderr or res.stdout).strip()
        except (OSError, subprocess.SubprocessError) as e:
            ok, err = False, str(e)
        if not ok:
            _log(f"nvcc failed; no fatbin (NVRTC compiles at run time):\n  {' '.join(cmd)}\n{err}")
            _write_c(out_c, b"", "source only (nvcc failed)", source)
            return 0
        data = fatbin.read_bytes()
    _log(f"kernels for {', '.join(kept)}: {len(data)} bytes in {time.monotonic() - start:.1f} s")
    _write_c(out_c, data, f"source and nvcc fatbin for {', '.join(kept)}", source)
    return len(data)


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    build_blob(here, Path(home), Path(sys.argv[1]) if len(sys.argv) > 1 else Path("fdp_kernels_blob.c"))

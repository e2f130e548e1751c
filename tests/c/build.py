"""Builds tests/c/test_core.c with the core and every backend (no CUDA toolkit needed; an empty kernel blob) under
AddressSanitizer and UndefinedBehaviorSanitizer, runs it, and exits with its status.
Usage: python tests/c/build.py [--build-only]."""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD = os.path.join(HERE, "build")
EXE = os.path.join(BUILD, "test_core")

CFLAGS = [
    "-std=c11", "-D_GNU_SOURCE", "-g", "-O1", "-Wall", "-Wextra", "-Werror",
    "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
]
UBSAN_OPTIONS = "halt_on_error=1:print_stacktrace=1"
# What LeakSanitizer prints when it cannot run (e.g. ptrace is forbidden in a sandbox).
LSAN_BROKEN = ("LeakSanitizer has encountered a fatal error", "LeakSanitizer does not work under ptrace")


def compiler():
    """The C compiler: $CC, else cc, gcc or clang on PATH; None when there is none."""
    for name in filter(None, [os.environ.get("CC"), "cc", "gcc", "clang"]):
        path = shutil.which(name)
        if path:
            return path
    return None


def empty_blob():
    """A kernel blob with no fatbin, as a build without nvcc has (cuda/build_kernels.py writes it)."""
    path = os.path.join(BUILD, "fdp_kernels_blob.c")
    spec = importlib.util.spec_from_file_location("fastdp_build_kernels", os.path.join(ROOT, "cuda", "build_kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.build_blob(os.path.join(ROOT, "cuda"), None, path)
    return path


def sources():
    files = []
    for sub in (("core",), ("backend", "host"), ("backend", "cuda"), ("dl",)):
        files += sorted(glob.glob(os.path.join(ROOT, "csrc", *sub, "*.c")))
    return files + [empty_blob(), os.path.join(HERE, "test_core.c")]


def build(cc):
    os.makedirs(BUILD, exist_ok=True)
    cmd = [cc, *CFLAGS, "-I" + os.path.join(ROOT, "csrc"), *sources(), "-o", EXE, "-lm", "-pthread", "-ldl"]
    print("+ " + " ".join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def run(detect_leaks):
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = f"detect_leaks={detect_leaks}:abort_on_error=0:halt_on_error=1"
    env["UBSAN_OPTIONS"] = UBSAN_OPTIONS
    proc = subprocess.run([EXE], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.returncode, proc.stdout


def main(argv):
    cc = compiler()
    if cc is None:
        print("no C compiler found (set CC, or install cc/gcc/clang)", file=sys.stderr)
        return 127
    rc = build(cc)
    if rc != 0:
        print(f"build failed ({rc})", flush=True)
        return rc or 1
    if "--build-only" in argv:
        return 0
    rc, out = run(1)
    if rc != 0 and any(s in out for s in LSAN_BROKEN):
        print("LeakSanitizer cannot run here (ptrace restrictions?); rerunning with detect_leaks=0", flush=True)
        rc, out = run(0)
        out += "note: leak detection was off (LeakSanitizer unavailable in this environment)\n"
    sys.stdout.write(out)
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

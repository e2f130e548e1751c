"""Prints, as one LD_LIBRARY_PATH fragment, the folders of the libnccl.so.2 and libcuda.so.1 that this
interpreter's PyTorch loads, so that a C program loading them by name (fastdp's loaders outside Python) finds
the same ones. Prints an empty line where PyTorch has neither (a CPU build)."""

import glob
import os
import sys

import torch


def loaded(prefixes):
    """Paths of the mapped shared objects whose file names start with one of `prefixes`."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if "/" in line else ""
                if path.startswith("/") and os.path.basename(path).startswith(prefixes) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def main():
    if torch.cuda.is_available():
        torch.cuda.init()  # loads the driver (PyTorch's NCCL is already mapped by `import torch`)
    paths = loaded(("libnccl.so", "libcuda.so"))
    if not any(os.path.basename(p).startswith("libnccl.so") for p in paths):
        # Not mapped yet: the NCCL wheel next to torch, where PyTorch's CUDA builds keep it.
        for site in {os.path.dirname(os.path.dirname(torch.__file__))}:
            paths += sorted(glob.glob(os.path.join(site, "nvidia", "**", "libnccl.so.2"), recursive=True))[:1]
    dirs = []
    for p in paths:
        d = os.path.dirname(p)  # the folder that holds the soname the loaders ask for
        if d not in dirs:
            dirs.append(d)
    print(":".join(dirs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

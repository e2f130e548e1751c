"""Makes torchvision importable where its compiled operators cannot load (a CUDA build of torchvision next to a CPU
build of torch, the pairing the package index offers for torch's pinned version).

torchvision registers fake kernels for ``torchvision::nms`` and ``qnms`` at import, which fails when its own library
did not define them, and transformers then fails to import any model that touches torchvision. Here the two
schemas are defined with a host implementation of non-maximum suppression (greedy, by descending score, as
torchvision's kernel); for ``roi_align`` torchvision falls back to its Python version, which it would compile on
first use (a minute on a 2-core machine), so it runs eagerly here. Both the bare model and the replicas run these
same kernels, so the comparisons in the tests are unaffected.
"""

import importlib.util
import os
import sys

import torch

_LIBRARY = None


def _compiled_ops_load():
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return True  # not installed: nothing to make importable
    folder = spec.submodule_search_locations[0]
    paths = [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("_C.") and n.endswith(".so")]
    try:
        for path in paths:
            torch.ops.load_library(path)
    except OSError:
        return False
    return True


def _nms(boxes, scores, iou_threshold):
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=boxes.device)
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    top_left = torch.maximum(boxes[:, None, :2], boxes[None, :, :2])
    bottom_right = torch.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(-1)
    overlaps = (inter / (area[:, None] + area[None, :] - inter) > iou_threshold).cpu().numpy()
    order = torch.argsort(scores, descending=True, stable=True).cpu().numpy()
    suppressed = overlaps[0] & False
    keep = []
    for i in order:
        if suppressed[i]:
            continue
        keep.append(int(i))
        suppressed |= overlaps[i]
    return torch.tensor(keep, dtype=torch.long, device=boxes.device)


def install():
    """Defines the operators torchvision's import needs when its compiled library does not load; idempotent."""
    global _LIBRARY
    if _LIBRARY is not None or _compiled_ops_load():
        return
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.impl("nms", _nms, "CPU")
    _LIBRARY = lib
    import torchvision.extension

    torchvision.extension._has_ops = lambda: True  # torchvision.ops.nms asks it before calling the operator
    fallback = sys.modules["torchvision.ops.roi_align"]
    fallback._roi_align = getattr(fallback._roi_align, "__wrapped__", fallback._roi_align)

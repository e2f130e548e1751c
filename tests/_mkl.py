"""Resolves oneMKL's vector-math (VML) kernels once, on the calling thread, before any test runs replicas on threads.

oneMKL 2024.2 (the version PyTorch's x86 wheels bundle) picks each VML function's kernel lazily, on its first call,
and that choice is racy: when a process's first calls of one function run on several threads at once, one thread
can run a low-accuracy kernel for its whole input (pytorch/pytorch issue 188792; fixed from oneMKL 2025.0). ATen
sends float unary ops (tanh, exp, sqrt, ...) to VML, so a test whose emulated replicas run on worker threads could
see one replica's activations off by about a thousand ulps on its first step, and blame the wrapper. Calling each
function once, on one thread, first settles the choice. It changes nothing else: later calls use the same kernel
a single-threaded process would."""

import torch

# Unary functions ATen routes to VML on x86 builds with MKL (aten/src/ATen/cpu/vml.h), by torch name.
_VML_UNARY = ("abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "erfinv", "exp", "expm1",
              "floor", "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid",
              "sin", "sinh", "sqrt", "tan", "tanh", "trunc", "digamma")


def warm_vml():
    for dtype in (torch.float32, torch.float64):
        x = torch.full((64,), 0.5, dtype=dtype)
        for name in _VML_UNARY:
            fn = getattr(torch, name, None)
            if fn is not None:
                fn(x)

"""Torch operations on the fake CUDA memory of tests/_fake_cuda.py, noted as the GPU would run them (what
``FakeCuda.install_memory(work=True)`` enters)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Operations on device memory that read none of their inputs' values: they take only shapes and dtypes from them.
_NO_READ = {"empty_like", "new_empty", "new_empty_strided", "zeros_like", "ones_like", "full_like", "new_zeros",
            "new_ones", "new_full", "empty_strided", "fill_", "zero_", "set_"}
# In-place operations that overwrite their destination without reading it.
_OVERWRITE = {"copy_", "fill_", "zero_", "set_"}


class Work(TorchDispatchMode):
    """Every torch operation on tensors in fake device memory, as the GPU would run it: on the current stream of
    their device, reading its inputs (a misuse where a write to them is not ordered before) and writing what it
    changes in place; a result in new memory is a block of that device allocated and written on that stream. Views
    move no data and are left out."""

    def __init__(self, cuda):
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        cuda = self.cuda
        ins = [t for t in tree_flatten((args, kwargs))[0] if cuda.block_of(t) is not None]
        if not ins:
            return out
        schema = func._schema
        written = {id(args[i] if i < len(args) else kwargs.get(a.name)) for i, a in enumerate(schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write}
        name = schema.name.split("::")[-1]
        for t in ins:
            if id(t) in written:
                if name not in _OVERWRITE:
                    cuda.use(t)
                cuda.use(t, write=True)
            elif name not in _NO_READ:
                cuda.use(t)
        device = cuda.block_of(ins[0]).device
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and cuda.block_of(o) is None:
                cuda.adopt(o, device, cuda.current_stream(device))
        return out

"""What the tracer (:mod:`cudapool.fakegpu.tracer`) sees of each operation: the dispatch mode
that shows it every operation's outputs, the operations it treats apart (cuBLAS calls, lifts,
in-place forms' stand-ins, composites CUDA decomposes), and one live allocation."""

from __future__ import annotations

import weakref
from typing import Any, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import kernel_scratch as _kernel_scratch

__all__ = ["BLAS_OPS", "IN_PLACE_STAND_INS", "LIFTS", "Live", "Mode", "decomposes_on_cuda"]

#: ATen operations that run on cuBLAS / cuBLASLt on CUDA (the first one on a stream makes
#: torch allocate that stream's workspace).
BLAS_OPS = frozenset(
    "aten::" + n
    for n in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "addmv",
        "mv",
        "_addmm_activation",
        "_scaled_mm",
        "dot",
        "vdot",
    )
)

#: Operations that return their input's storage as a tensor just made (torch.tensor's data):
#: an allocation, not a view.
LIFTS = frozenset((torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default))


#: Out-of-place operations that backward formulas use instead of their in-place forms when
#: tensors are "subclass-like" (meta, fake, any dispatch mode): gather's backward scatters
#: into zeros with scatter_add instead of scatter_add_, max/min's with scatter, indexing's with
#: index_put, select/slice's with select_scatter/slice_scatter, ...
IN_PLACE_STAND_INS = frozenset(
    "aten::" + n
    for n in (
        "scatter",
        "scatter_add",
        "scatter_reduce",
        "index_add",
        "index_put",
        "_unsafe_index_put",
        "index_copy",
        "index_fill",
        "masked_scatter",
        "masked_fill",
        "slice_scatter",
        "select_scatter",
        "diagonal_scatter",
        "as_strided_scatter",
    )
)

_COMPOSITE: Dict[Any, bool] = {}


def decomposes_on_cuda(func: Any) -> bool:
    """Whether CUDA runs ``func`` through its CompositeImplicitAutograd kernel (no kernel of
    its own for CUDA)."""
    known = _COMPOSITE.get(func)
    if known is None:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        try:
            known = bool(has(func.name(), "CompositeImplicitAutograd")) and not has(func.name(), "CUDA")
        except RuntimeError:  # not a dispatcher operator (prim::device, ...)
            known = False
        _COMPOSITE[func] = known
    return known


class Live:
    """One live allocation: the storage it stands for is alive."""

    __slots__ = ("ident", "size", "stream", "device", "finalizers")

    def __init__(self, ident: int, size: int, stream: int, device: int) -> None:
        self.ident = ident
        self.size = size
        self.stream = stream
        self.device = device
        #: storage key -> the callback run at that storage's death: one storage, or several when
        #: a backward formula's out-of-place result stands for an in-place one (see Mode).
        self.finalizers: Dict[int, weakref.finalize] = {}

    def watch(self, key: int, storage: Any, freed: Any) -> None:
        fin = weakref.finalize(storage, freed, key, self.ident)
        fin.atexit = False
        self.finalizers[key] = fin


class Mode(TorchDispatchMode):
    """Runs every operation, then shows its outputs to the tracer (a :class:`cudapool.fakegpu.tracer.Tracer`)."""

    def __init__(self, tracer: Any) -> None:
        super().__init__()
        self._tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._tracer.adopt_inputs:
            self._tracer._observe((args, kwargs), "first use")
        if decomposes_on_cuda(func):
            # Reached here only with autograd's keys excluded (inference_mode): the op's
            # composite kernel would run below this mode and hide its own temporaries (where's
            # scalar, einsum's copies). Run it with the mode still on, as CUDA runs it.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        into = self._tracer._in_place_stand_in(func, args)
        out = func(*args, **kwargs)
        self._tracer._observe(out, func, (args, kwargs), into)
        if self._tracer.workspace_bytes and func._schema.name in BLAS_OPS:
            # After the result: cuBLAS takes its workspace inside the call.
            self._tracer._workspace(args)
        if self._tracer.cuda_scratch and func._schema.name in _kernel_scratch.OPS:
            self._tracer._kernel_scratch(func, args, kwargs)
        return out

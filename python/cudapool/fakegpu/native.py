"""The fake GPU below Python: cudapool._torch_fakecuda (csrc/fakecuda/, Note [Fake
CUDA in C++] in fakecuda_kernels.cpp) as the tracer of :class:`cudapool.fakegpu.FakeGPU`
(:class:`cudapool.fakegpu.native_engine.NativeEngine`).

A script's CUDA tensors are ordinary torch CUDA tensors whose kernels compute only their
outputs' metadata (torch's meta kernels, cached per shape) and whose storage comes from an
allocator that records each allocation and free. Everything above the kernels is torch's own
CUDA path: autograd's engine (on its device thread, summing gradients as on a GPU), CUDA's
autocast rules, every composite operation, foreach optimizers. No Python runs per operation,
so tracing costs about what the script's own Python and torch's dispatcher cost.

:class:`NativeTracer` has the parts of :class:`cudapool.fakegpu.tracer.Tracer` a FakeGPU uses:
``events``, ``trace()``, ``live_bytes``, ``peak_bytes``, ``workspace_bytes``. It needs the
module built for the running torch, a CUDA build of torch, and CUDA not initialised in this
process (:func:`why_unavailable`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..lab._events import Events
from ..lab.trace import UNSEEN, Trace
from . import kernel_scratch as _kernel_scratch
from .cudnn import CONVOLUTIONS, CudnnModel

__all__ = ["NativeTracer", "why_unavailable"]


def _module() -> Any:
    from .. import _torch_fakecuda

    return _torch_fakecuda


#: torch.cuda.is_initialized as torch has it (the fake GPU answers True while it is up).
_cuda_initialized = torch.cuda.is_initialized


def why_unavailable() -> Optional[str]:
    """None when the fake GPU below Python can run here, else why not (one sentence)."""
    try:
        module = _module()
    except ImportError:
        return (
            "cudapool._torch_fakecuda was not built (it is built against a CUDA build of torch present when "
            "cudapool is installed: pip install --no-build-isolation -e .)"
        )
    if module.torch_version != torch.__version__:
        return (
            f"cudapool._torch_fakecuda was built for torch {module.torch_version}, not the running {torch.__version__}"
        )
    if not torch.version.cuda:
        return f"torch {torch.__version__} is not a CUDA build"
    if _cuda_initialized():
        return "CUDA is initialised in this process already"
    return None


class NativeTracer:
    """Records what a script allocates on the fake GPU of cudapool._torch_fakecuda, inside its
    ``with`` block (entered once). ``read(tensor, what)`` hears of each read of values (an
    ``.item()``, a copy to the host; it may raise to refuse it), ``sdp_choice(args, kwargs)``
    answers torch's ``_fused_sdp_choice`` (the attention kernel, as torch's SDPBackend value).
    ``workspace_bytes``: the cuBLAS workspace of each thread and stream (0: none); ``gpu``: the
    GPU kernel scratch is sized for (:func:`cudapool.fakegpu.kernel_scratch.gpu_shape`);
    ``devices``: how many; ``whole_process``: see the attribute."""

    backward = "torch"

    def __init__(
        self,
        *,
        read: Callable[[torch.Tensor, str], Any],
        sdp_choice: Callable[[Tuple[Any, ...], Dict[str, Any]], int],
        workspace_bytes: Optional[int] = None,
        kernel_scratch: bool = True,
        gpu: Any = None,
        devices: int = 1,
        whole_process: bool = False,
    ) -> None:
        if workspace_bytes is not None and workspace_bytes < 0:
            raise ValueError(f"workspace_bytes must be >= 0, not {workspace_bytes}")
        self.workspace_bytes = workspace_bytes
        self.cuda_scratch = bool(kernel_scratch)
        self.gpu = _kernel_scratch.gpu_shape(gpu)
        total = (
            getattr(gpu, "total_memory", None) if gpu is not None and not isinstance(gpu, (tuple, list, dict)) else None
        )
        #: cuDNN's convolution workspaces (Note [cuDNN workspaces on the fake GPU]), within the
        #: GPU's memory left free (unlimited when the GPU's size is not known).
        self.cudnn = CudnnModel(
            lambda: (1 << 62) if total is None else int(total) - int(_module().counts()["live_bytes"])
        )
        self.devices = int(devices)
        #: The process is the trace's alone (Note [A process of the fake GPU's own] in
        #: csrc/fakecuda/fakecuda_vtable.cpp): pinned host memory works, and no real GPU can be
        #: used in it afterwards.
        self.whole_process = bool(whole_process)
        self._read = read
        self._sdp_choice = sdp_choice
        self._records = bytearray()  # the module's records, as C has them (cudapool.lab._events.EVENT)
        self._final: Optional[Dict[str, Any]] = None
        self._state = "new"

    def __enter__(self) -> "NativeTracer":
        if self._state != "new":
            raise RuntimeError("a NativeTracer records one with block; make a new one")
        why = why_unavailable()
        if why is not None:
            raise RuntimeError(f"cudapool's fake GPU below Python cannot run: {why}")
        _module().install(
            devices=self.devices,
            workspace_bytes=int(self.workspace_bytes or 0),
            read=self._on_read,
            scratch=self._on_scratch,
            sdp_choice=self._sdp_choice,
            scratch_ops=sorted(_kernel_scratch.OPS | CONVOLUTIONS) if self.cuda_scratch else [],
            whole_process=self.whole_process,
        )
        self._state = "tracing"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._state != "tracing":
            return
        module = _module()
        self._sync()
        self._final = dict(module.counts())
        module.uninstall()
        self._state = "done"

    @staticmethod
    def module() -> Any:
        """cudapool._torch_fakecuda: the calling thread's device and stream are set there."""
        return _module()

    # ---- hooks the module calls (with the GIL) -------------------------------------------------

    def _on_read(self, what: str, t: Optional[torch.Tensor]) -> None:
        self._read(t, what)

    def _on_scratch(self, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[int, ...]:
        if name in CONVOLUTIONS:
            return self.cudnn.steps(name, args)
        return tuple(_kernel_scratch.op_steps(name, args, kwargs, self.gpu)[0])

    # ---- results -----------------------------------------------------------------------------

    def _sync(self) -> bytearray:
        if self._state == "tracing":
            _module().append_records(self._records)
        return self._records

    @property
    def events(self) -> Events:
        """Events as (action, id, size, stream, device, time_ns), in order, so far (each
        unpacked when it is read)."""
        return Events(self._sync())

    def _counts(self) -> Dict[str, Any]:
        if self._state == "tracing":
            return dict(_module().counts())
        return self._final or {"live_bytes": 0, "peak_bytes": 0, "operations": 0, "cached": 0, "kernels": 0}

    @property
    def live_bytes(self) -> int:
        """Bytes allocated and not freed yet."""
        return int(self._counts()["live_bytes"])

    @property
    def peak_bytes(self) -> int:
        """The most :attr:`live_bytes` has been."""
        return int(self._counts()["peak_bytes"])

    @property
    def workspaces_taken(self) -> int:
        """cuBLAS workspaces allocated: one per thread and stream that ran a BLAS operation."""
        return int(self._counts().get("workspaces", 0))

    @property
    def operations(self) -> int:
        """Operations that ran this module's kernel, and how many of them were answered from the
        cache (their shapes seen before)."""
        return int(self._counts()["operations"])

    @property
    def cached(self) -> int:
        return int(self._counts()["cached"])

    def trace(self, meta: Optional[Dict[str, Any]] = None) -> Trace:
        """The events recorded so far as a :class:`cudapool.lab.trace.Trace`."""
        records = self._sync()
        full_meta: Dict[str, Any] = {
            "tracer": "cudapool.tracer.native",
            "torch": torch.__version__,
            "traced_device": "cuda",
            "fake_cuda": True,
            "backward": self.backward,
            "workspace_bytes": self.workspace_bytes,
            "kernel_scratch": self.cuda_scratch,
            "gpu": {"multi_processor_count": self.gpu[0], "max_threads_per_multi_processor": self.gpu[1]},
            "unseen": list(UNSEEN) if self.workspace_bytes is None else list(UNSEEN[1:]),
        }
        full_meta.update(meta or {})
        return Trace(records, meta=full_meta)

    def __repr__(self) -> str:
        c = self._counts()
        return (
            f"NativeTracer(state={self._state}, events={len(Events(self._records))}, live={c['live_bytes']} B, "
            f"peak={c['peak_bytes']} B)"
        )

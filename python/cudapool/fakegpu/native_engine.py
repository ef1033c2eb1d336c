"""The fake GPU's native engine: cudapool._torch_fakecuda below Python (:mod:`cudapool.fakegpu.native`
drives it), with the FakeGPU answering what its kernels ask: reads of values, and the attention
kernel torch picks on the GPU (:mod:`cudapool.fakegpu.attention`)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from . import attention
from .engine import Engine, Host, Patch
from .native import NativeTracer, why_unavailable

__all__ = ["NativeEngine"]

#: Operations whose functional overload has a meta kernel in torch and whose ``out=`` overload
#: has none (Inductor's wrapper calls the ``out=`` one: ``extern_kernels._scaled_mm(..., out=buf)``).
OUT_WITHOUT_META = ("_scaled_mm",)


class _Registered:
    """Holds a torch.library registration for a FakeGPU patch: set to None, it is undone."""

    def __init__(self) -> None:
        self._lib: Any = None

    @property
    def lib(self) -> Any:
        return self._lib

    @lib.setter
    def lib(self, value: Any) -> None:
        if value is None and self._lib is not None:
            self._lib._destroy()
        self._lib = value


_REGISTERED = _Registered()


def _out_metas(patch: Patch) -> None:
    """Meta kernels for the ``out=`` overloads of OUT_WITHOUT_META: the functional overload's
    meta kernel, its result's shape given to ``out``."""
    missing = [
        name
        for name in OUT_WITHOUT_META
        if hasattr(torch.ops.aten, name)
        and "out" in torch.ops.aten.__getattr__(name).overloads()
        and not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}.out", "Meta")
    ]
    if not missing or _REGISTERED.lib is not None:
        return
    lib = torch.library.Library("aten", "IMPL")

    def meta_of(name: str) -> Any:
        functional = getattr(torch.ops.aten, name).default

        def out_meta(*args: Any, out: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            result = functional(*args, **kwargs)
            out.resize_(result.shape)
            return out

        return out_meta

    for name in missing:
        lib.impl(f"{name}.out", meta_of(name), "Meta")
    patch(_REGISTERED, "lib", lib)


class NativeEngine(Engine):
    """The fake GPU below Python, for one FakeGPU: a :class:`NativeTracer` whose reads and
    attention choices the FakeGPU answers. ``tracer_kw``: ``workspace_bytes``,
    ``kernel_scratch`` and ``whole_process`` only (ValueError naming any other: the Python engine takes them)."""

    name = "native"

    def __init__(self, gpu: Host, tracer_kw: Dict[str, Any]) -> None:
        unknown = set(tracer_kw) - {"workspace_bytes", "kernel_scratch", "whole_process"}
        if unknown:
            raise ValueError(f"the native engine takes no tracer options {sorted(unknown)}: use engine='python'")
        self.gpu = gpu
        self.tracer = NativeTracer(
            read=self._read, sdp_choice=self._sdp_choice, gpu=gpu._props(), devices=gpu.devices, **tracer_kw
        )

    why_unavailable = staticmethod(why_unavailable)

    def tensor_type(self) -> type:
        return torch.Tensor

    def is_fake(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == "cuda"

    def set_device(self, index: int) -> None:
        self.tracer.module().set_device(int(index))

    def current_device(self) -> int:
        return int(self.tracer.module().current_device())

    def set_stream(self, stream: int) -> None:
        self.tracer.module().set_stream(int(stream))

    def current_stream(self) -> int:
        return int(self.tracer.module().current_stream())

    def cudnn_summary(self) -> Dict[str, Any]:
        return self.tracer.cudnn.summary()

    def capture_to_pool(self, stream: int, pool_stream: int) -> bool:
        self.tracer.module().capture_to_pool(int(stream), int(pool_stream))
        return True

    def patch(self, patch: Patch) -> None:
        # Recurrent layers run torch's own cells (FakeGPU's patch of them): no cuDNN flat weights either.
        patch(torch.backends.cudnn, "is_acceptable", lambda tensor: False)
        # A CUDA storage's resize (FSDP frees and refills its unsharded parameters so) goes to the
        # CUDA runtime in torch; the fake GPU's allocator does it here.
        original = torch.UntypedStorage.resize_
        module = self.tracer.module()

        def resize_(storage: Any, size: int) -> Any:
            if storage.device.type != "cuda":
                return original(storage, size)
            module.resize_storage(storage, int(size))
            return storage

        patch(torch.UntypedStorage, "resize_", resize_)
        # A CUDA storage's copy (copy.deepcopy of a tensor, storage.clone()): its new storage
        # from the fake GPU's allocator, not from torch's CUDA one.
        clone = torch.UntypedStorage.clone

        def clone_storage(storage: Any) -> Any:
            if storage.device.type != "cuda":
                return clone(storage)
            fresh = torch.empty(storage.nbytes(), dtype=torch.uint8, device=storage.device).untyped_storage()
            return fresh.copy_(storage)

        patch(torch.UntypedStorage, "clone", clone_storage)
        _out_metas(patch)

    def _read(self, t: Optional[torch.Tensor], what: str) -> None:
        """A read of values on this fake GPU (its C++ kernels ask)."""
        if t is None:
            return
        if what == "a copy to the host":
            self.gpu._host_copy(t, what)
        else:
            self.gpu._read(t, what)

    def _sdp_choice(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> int:
        """torch's ``_fused_sdp_choice``: the kernel torch picks on this GPU
        (cudapool.fakegpu.attention), as torch's SDPBackend value."""
        from torch.nn.attention import SDPBackend

        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        dropout_p = float(args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0))
        is_causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))
        gqa = bool(kwargs.get("enable_gqa", False))
        m = self.gpu.model
        backend = attention.choose(q, k, v, mask, dropout_p, is_causal, gqa, m.major, m.minor)
        self.gpu.sdpa[backend] = self.gpu.sdpa.get(backend, 0) + 1
        return int(
            {
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH,
            }[backend].value
        )

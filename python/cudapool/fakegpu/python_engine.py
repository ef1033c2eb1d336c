"""The fake GPU's Python engine: torch's fake tensors (:class:`FakeTensorMode`) under
:class:`cudapool.fakegpu.tracer.Tracer`, with the host real (:mod:`cudapool.fakegpu.hostreal`).
It runs on any torch build; what torch's own CUDA paths would do below Python (the attention
kernel torch picks, parameters moved and tied as on a GPU, values read as zeros) is patched in
here, in Python.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .engine import Engine, Host, Patch
from .tracer import Tracer

__all__ = ["PythonEngine"]


def _fake_mode() -> Any:
    """A fake tensor mode that never initialises a device: torch's asks whether CUDA is
    available to decide, and inside a FakeGPU it is."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class NoDeviceFakeTensorMode(FakeTensorMode):
        @property
        def avoid_device_init(self) -> bool:
            return True

    return NoDeviceFakeTensorMode(allow_non_fake_inputs=True)


class PythonEngine(Engine):
    """Fake tensors under a :class:`Tracer` on ``"cuda"``; ``tracer_kw`` go to the Tracer."""

    name = "python"

    def __init__(self, gpu: Host, tracer_kw: Dict[str, Any]) -> None:
        self.gpu = gpu
        self.tracer = Tracer(
            device="cuda",
            fake_mode=_fake_mode(),
            gpu=gpu._props(),
            host="real",
            on_host_read=gpu._host_copy,
            **tracer_kw,
        )

    @staticmethod
    def why_unavailable() -> Optional[str]:
        return None

    def tensor_type(self) -> type:
        from torch._subclasses.fake_tensor import FakeTensor

        return FakeTensor

    def is_fake(self, t: Any) -> bool:
        from torch._subclasses.fake_tensor import FakeTensor

        return isinstance(t, FakeTensor)

    def set_stream(self, stream: int) -> None:
        self.tracer.set_stream(stream)

    def current_stream(self) -> int:
        return self.tracer.current_stream()

    def patch(self, patch: Patch) -> None:
        """What the native engine's kernels do below Python: values, parameter moves and ties,
        the attention kernel."""
        self._patch_values(patch)
        self._patch_module_moves(patch)
        self._patch_module_ties(patch)
        self._patch_attention(patch)
        # Before torch 2.13 a fake CUDA tensor's first making asks torch.cuda.is_available() (True
        # here) and then makes a real CUDA context: there is none to make on the fake GPU.
        import torch._subclasses.fake_tensor as fake_tensor

        if hasattr(fake_tensor, "init_gpu_context"):
            patch(fake_tensor, "init_gpu_context", lambda device: None)

    def _patch_values(self, patch: Patch) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        gpu = self.gpu

        def reader(name: str, original: Any, convert: Any) -> Any:
            def read(t: torch.Tensor, *a: Any, **k: Any) -> Any:
                if not isinstance(t, FakeTensor):
                    return original(t, *a, **k)
                try:  # a small host tensor made from Python numbers keeps its value
                    return original(t, *a, **k)
                except Exception:
                    return convert(gpu._read(t, name), t)

            return read

        def tolist(value: Any, t: torch.Tensor) -> Any:
            out: Any = value
            for n in reversed(t.shape):
                out = [out] * int(n)
            return out

        for name, convert in (
            ("item", lambda v, t: v),
            ("__float__", lambda v, t: float(v)),
            ("__int__", lambda v, t: int(v)),
            ("__index__", lambda v, t: int(v)),
            ("__bool__", lambda v, t: bool(v)),
            ("tolist", tolist),
        ):
            patch(torch.Tensor, name, reader(f".{name.strip('_')}()", getattr(torch.Tensor, name), convert))

    def _patch_module_moves(self, patch: Patch) -> None:
        """``module.to("cuda")`` of fake parameters: torch swaps the tensors, which fake tensors
        (referenced weakly by the fake mode) refuse; the parameter takes the moved data instead."""
        from torch._subclasses.fake_tensor import FakeTensor

        original = torch.utils.swap_tensors

        def swap_tensors(t1: Any, t2: Any) -> None:
            try:
                original(t1, t2)
            except RuntimeError as exc:
                if "weakref" not in str(exc) or not isinstance(t1, FakeTensor):
                    raise
                with torch.no_grad():
                    t1.data = t2.data
                t1.fake_device = t2.fake_device

        patch(torch.utils, "swap_tensors", swap_tensors)

    def _patch_module_ties(self, patch: Patch) -> None:
        """``model.to("cuda")`` keeps tied parameters tied (one tensor in two modules, as an
        embedding and its output layer): torch sets the moved data into the same parameter,
        which a real host tensor cannot take from a fake one; the places that shared one
        tensor before share the moved one, moved once."""
        original = torch.nn.Module._apply
        depth = [0]

        def _apply(module: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return original(module, fn, *args, **kwargs)
            places: Dict[int, List[Tuple[Any, str, str]]] = {}
            held: List[Any] = []
            for m in module.modules():
                for kind in ("_parameters", "_buffers"):
                    for name, t in getattr(m, kind).items():
                        if t is not None:
                            places.setdefault(id(t), []).append((m, kind, name))
                            held.append(t)
            moved: Dict[int, Any] = {}

            def once(t: Any) -> Any:  # a tensor in two places is moved once, as on a GPU
                if id(t) not in moved:
                    held.append(t)
                    moved[id(t)] = fn(t)
                return moved[id(t)]

            depth[0] += 1
            try:
                out = original(module, once, *args, **kwargs)
            finally:
                depth[0] -= 1
            for where in places.values():
                m0, k0, n0 = where[0]
                keep = getattr(m0, k0)[n0]
                for m, k, n in where[1:]:
                    if getattr(m, k)[n] is not keep:
                        getattr(m, k)[n] = keep
            held.clear()
            return out

        patch(torch.nn.Module, "_apply", _apply)

    def _patch_attention(self, patch: Patch) -> None:
        """``scaled_dot_product_attention`` on fake CUDA runs the kernel torch picks on this GPU
        (cudapool.fakegpu.attention), not the math path a machine without a GPU takes."""
        import torch.nn.functional as F
        from torch._subclasses.fake_tensor import FakeTensor

        from . import attention

        gpu = self.gpu
        original = F.scaled_dot_product_attention

        def sdpa(
            query: Any,
            key: Any,
            value: Any,
            attn_mask: Any = None,
            dropout_p: float = 0.0,
            is_causal: bool = False,
            scale: Optional[float] = None,
            enable_gqa: bool = False,
        ) -> Any:
            if not isinstance(query, FakeTensor) or query.device.type != "cuda":
                return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
            m = gpu.model
            backend = attention.choose(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, m.major, m.minor)
            gpu.sdpa[backend] = gpu.sdpa.get(backend, 0) + 1
            if backend == "math":
                return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
            return attention.run(backend, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

        patch(F, "scaled_dot_product_attention", sdpa)

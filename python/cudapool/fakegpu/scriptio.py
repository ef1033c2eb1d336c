"""What scripts do around training, on the fake GPU of :class:`cudapool.fakegpu.FakeGPU`:
printing and formatting CUDA tensors, ``torch.save`` / ``torch.load``, and torch's memory
history calls (``_record_memory_history``, ``_snapshot``, ``_dump_snapshot``), answered from the
simulated run. :class:`ScriptIO` is the part of FakeGPU that patches them.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import hostreal

__all__ = ["ScriptIO"]

#: Fake CUDA tensors of at most this many elements print their (simulated) values.
_PRINTED_MAX = 1000
#: History entries a simulated snapshot keeps.
_HISTORY_MAX = 1_000_000
#: The cudapool.fakegpu.FakeGPU entered now (placeholders loaded by torch.load become its tensors), or None.
ACTIVE: Optional[Any] = None


def _placeholder(shape: Tuple[int, ...], dtype: str, requires_grad: bool, device: str) -> torch.Tensor:
    """A tensor ``torch.save`` wrote on the fake GPU (no values): loaded inside a
    :class:`FakeGPU`, a fake CUDA tensor of that shape; elsewhere a meta tensor."""
    dt = getattr(torch, dtype)
    on_gpu = ACTIVE is not None and device.split(":")[0] == "cuda"
    t = torch.empty(shape, dtype=dt, device="cuda" if on_gpu else "meta")
    return t.requires_grad_() if requires_grad and (dt.is_floating_point or dt.is_complex) else t


class ScriptIO:
    """FakeGPU's patches of printing, serialization and memory history (see the module notes).
    Needs the FakeGPU's ``_patch``, ``_read``, ``engine``, ``tracer`` and counters."""

    _patch: Any
    _read: Any
    engine: Any
    tracer: Any
    saved_placeholders: int
    loaded_to_gpu: int
    scratch: Any
    history_from: Optional[int]
    snapshots_written: List[str]

    def _patch_printing(self) -> None:
        """``print(loss)``, ``f"{loss:.4f}"``: a fake CUDA tensor prints as torch prints a CUDA
        tensor, with the simulated values (zeros; a value read)."""
        gpu = self
        cls: Any = self.engine.tensor_type()
        original_repr, original_format = cls.__repr__, cls.__format__

        def rep(t: Any, *args: Any, **kwargs: Any) -> str:
            if t.device.type != "cuda" or t.numel() > _PRINTED_MAX or t.is_sparse:
                return original_repr(t, *args, **kwargs)
            gpu._read(t, "printing")
            text = repr(hostreal.host_zeros(t))
            extra = f", device='{t.device}'"
            if t.grad_fn is not None:
                extra += f", grad_fn=<{type(t.grad_fn).__name__}>"
            elif t.requires_grad:
                extra += ", requires_grad=True"
            return text[:-1] + extra + ")"

        def fmt(t: Any, spec: str) -> str:
            if t.device.type != "cuda":
                return original_format(t, spec)
            if t.dim() == 0:
                value = gpu._read(t, "formatting")
                return format(float(value) if t.dtype.is_floating_point else value, spec)
            return format(rep(t), spec)

        self._patch(cls, "__repr__", rep)
        self._patch(cls, "__format__", fmt)

    def _patch_serialization(self) -> None:
        """``torch.save`` of fake CUDA tensors writes placeholders (shape, dtype; no values) that
        ``torch.load`` makes fake CUDA tensors of again; ``torch.load`` of a real file onto CUDA
        (``map_location="cuda"``, or tensors saved from CUDA) loads it on the host and moves it."""
        import pickle

        from torch.utils._pytree import tree_map_only

        gpu = self
        save0, load0 = torch.save, torch.load

        class Pickler(pickle.Pickler):
            def reducer_override(self, obj: Any) -> Any:
                if gpu.engine.is_fake(obj):
                    gpu.saved_placeholders += 1
                    return _placeholder, (
                        tuple(obj.shape),
                        str(obj.dtype).split(".")[-1],
                        obj.requires_grad,
                        str(obj.device),
                    )
                return NotImplemented

        placeholder_pickle = types.SimpleNamespace(
            __name__="pickle", Pickler=Pickler, Unpickler=pickle.Unpickler, load=pickle.load, dump=pickle.dump
        )

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if not args:
                kwargs.setdefault("pickle_module", placeholder_pickle)
            return save0(obj, gpu._scratch_path(f, writing=True), *args, **kwargs)

        def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
            if callable(map_location) and not isinstance(map_location, (str, torch.device)):
                return load0(f, map_location, *args, **kwargs)
            targets: List[str] = []

            def on_host(storage: Any, location: str) -> Any:
                target = map_location
                if isinstance(map_location, dict):
                    target = map_location.get(location, location)
                targets.append(str(location if target is None else target))
                return storage

            allowed = getattr(torch.serialization, "safe_globals", None)
            with allowed([_placeholder]) if allowed is not None else contextlib.nullcontext():
                obj = load0(gpu._scratch_path(f, writing=False), on_host, *args, **kwargs)
            if any(t.split(":")[0] == "cuda" for t in targets):
                gpu.loaded_to_gpu += 1
                obj = tree_map_only(
                    torch.Tensor, lambda t: t if gpu.engine.is_fake(t) or t.device.type != "cpu" else t.to("cuda"), obj
                )
            return obj

        self._patch(torch, "save", save)
        self._patch(torch, "load", load)

    def _scratch_path(self, f: Any, writing: bool) -> Any:
        """Where ``torch.save`` writes and ``torch.load`` reads the file ``f``: its own place,
        or with a scratch folder its mirror there (Note [A rank's files] in scratch.py)."""
        return f if self.scratch is None else self.scratch.path(f, writing)

    def _patch_history(self) -> None:
        """``torch.cuda.memory._record_memory_history``, ``_snapshot``, ``_dump_snapshot`` and
        ``memory_snapshot``: answered from the simulated run (the trace so far replayed under
        the built-in allocator's rules), as a snapshot pytorch.org/memory_viz opens."""
        import pickle

        mem = torch.cuda.memory
        gpu = self

        def record(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
            if enabled in (None, False):
                return
            if gpu.history_from is None or kwargs.get("clear_history"):
                gpu.history_from = len(gpu.tracer.events)

        def dump(filename: str = "dump_snapshot.pickle", *args: Any, **kwargs: Any) -> None:
            with open(filename, "wb") as f:
                pickle.dump(gpu.memory_snapshot(), f)
            gpu.snapshots_written.append(str(filename))

        for owner in (mem, torch.cuda):
            for name, value in (
                ("_record_memory_history", record),
                ("_snapshot", lambda *a, **k: gpu.memory_snapshot()),
                ("_dump_snapshot", dump),
                ("memory_snapshot", lambda *a, **k: gpu.memory_snapshot()["segments"]),
            ):
                if hasattr(owner, name):
                    self._patch(owner, name, value)

    def memory_snapshot(self) -> Dict[str, Any]:
        """The run so far as torch's ``_snapshot()`` would have it under the built-in
        allocator: the trace replayed on cudapool's simulated device under its rules, with the
        history from ``_record_memory_history`` on (none before it was called)."""
        from ..lab.trace import ALLOC
        from ..sim import Pool
        from ..snapshots import pool_snapshot

        events = list(self.tracer.events)
        start = len(events) if self.history_from is None else self.history_from
        pool = Pool(1 << 50, policy="builtin", auto_complete=True, touch_memory=False)
        try:
            addrs: Dict[int, int] = {}
            for k, (action, ident, size, stream, _device, _t) in enumerate(events):
                if k == start:
                    pool.set_history(_HISTORY_MAX)
                if action == ALLOC:
                    addrs[ident] = pool.alloc(size, stream)
                elif ident in addrs:
                    pool.free(addrs.pop(ident))
            return pool_snapshot(pool)
        finally:
            pool.close()

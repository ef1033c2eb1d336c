"""The host is real, only the GPU is fake: the dispatch mode behind ``Tracer(host="real")``.

A fake tensor mode entered for the whole program makes every tensor fake, host tensors
included, so host code that computes with values (batch offsets drawn with ``torch.randint``
and used to slice a memory-mapped file, a sampler's indices, a tokenizer's ids) gets zeros and
changes the shapes it makes. :class:`HostReal` instead decides per operation:

- an operation that reads or makes a CUDA tensor (a fake tensor among its arguments, or a
  ``device`` argument naming CUDA: ``torch.zeros(..., device="cuda")``, ``x.to("cuda")``) runs in
  the fake mode, and its results are fake CUDA tensors (host tensors among its arguments are
  taken as constants);
- every other operation runs as it would without the mode: real CPU tensors, real values;
- a copy from a fake CUDA tensor to the host (``.cpu()``, ``.to("cpu")``, ``host.copy_(cuda)``)
  is a read of values the simulation does not have: the host gets a real tensor of zeros of the
  right shape and dtype, and ``on_read`` is told (counted with the script's line).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .leaves import tensors_in

aten = torch.ops.aten

#: Operations that copy a tensor to wherever their ``device`` argument says.
_MOVES = frozenset((aten._to_copy.default,))
#: In-place copies into their first argument.
_COPIES_INTO = frozenset((aten.copy_.default,))


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


def host_zeros(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A real CPU tensor of zeros shaped as ``t`` (its strides when it is dense)."""
    return torch.zeros(tuple(t.shape), dtype=dtype or t.dtype, device="cpu")


class HostReal(TorchDispatchMode):
    """Fake CUDA, real host: see the module notes. ``on_read(tensor, what)`` is called for every
    copy of a fake CUDA tensor's values to the host."""

    def __init__(self, fake_mode: Any, on_read: Optional[Callable[[torch.Tensor, str], None]] = None) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.on_read = on_read

    def _read(self, t: torch.Tensor, what: str) -> None:
        if self.on_read is not None:
            self.on_read(t, what)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fake = [a for a in tensors_in((args, kwargs)) if isinstance(a, FakeTensor)]
        if fake:
            if func in _MOVES and not _is_cuda(kwargs.get("device", fake[0].device)):
                self._read(fake[0], ".cpu()")
                return host_zeros(fake[0], kwargs.get("dtype"))
            dst = args[0] if args else None
            if func in _COPIES_INTO and isinstance(dst, torch.Tensor) and not isinstance(dst, FakeTensor):
                self._read(args[1], "a copy to the host")
                return dst.zero_()
            with self.fake_mode:
                return func(*args, **kwargs)
        if _is_cuda(kwargs.get("device")):
            with self.fake_mode:
                return func(*args, **kwargs)
        return func(*args, **kwargs)


__all__ = ["HostReal", "host_zeros"]

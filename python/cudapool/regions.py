"""Regions: allocations grouped under a tag, whose GPU memory can be given back and mapped
again at the same addresses (``cudapool.pause`` / ``cudapool.resume``).

    with cudapool.region("kv_cache"):
        cache = torch.empty(n, device="cuda")    # served from memory of "kv_cache" only

Which region a thread allocates in is the thread's own, as torch's current stream is: a
``region`` block covers the allocations its thread makes, not those of other threads (torch's
autograd runs the backward pass of CUDA tensors on threads of its own). Needs neither torch
nor a GPU.
"""

import threading
from types import TracebackType
from typing import List, Optional, Type

from . import _C

__all__ = ["region", "graph_region", "current_region"]


class region:
    """``with cudapool.region(tag):`` — the allocations this thread makes inside are served
    from page-mapped memory of region ``tag`` only (a str of 1 to 127 characters; at most 64
    names in a process), so that ``cudapool.pause(tag)`` can give that memory back. Regions
    nest: the innermost wins. A pool without page-mapped memory (policy ``builtin``, or a
    device without the CUDA virtual memory API) serves tagged allocations as untagged ones.
    Allocating in a paused region raises."""

    __slots__ = ("tag", "_id", "_outer")

    def __init__(self, tag: str) -> None:
        if not isinstance(tag, str):
            raise TypeError(f"a region's tag is a str, not {type(tag).__name__}")
        self.tag = tag
        self._id = _C.region_id(tag)
        self._outer = threading.local()  # per thread: the regions it was in, innermost last

    def _stack(self) -> List[int]:
        stack = getattr(self._outer, "stack", None)
        if stack is None:
            stack = self._outer.stack = []
        return stack

    def __enter__(self) -> "region":
        self._stack().append(_C.region_enter(self._id))
        return self

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        _C.region_enter(self._stack().pop())

    def __repr__(self) -> str:
        return f"cudapool.region({self.tag!r})"


def current_region() -> Optional[str]:
    """The tag of the region the calling thread allocates in, or None."""
    return _C.region_name(_C.region_of_thread())


def graph_region(tag: str) -> region:
    """``with cudapool.graph_region(tag):`` around a CUDA graph capture (``torch.cuda.graph``,
    ``make_graphed_callables``) gives the graph a private pool of region ``tag``: page-mapped,
    so that ``cudapool.pause(tag)`` gives back every byte the graph's replays use (its
    intermediates, freed during the capture, included) and ``cudapool.resume(tag)`` maps them
    again at the same addresses, so the graph replays as before. It is :class:`region` by
    another name: a capture inside any region does the same, and allocations made inside it
    outside a capture go to the region as usual."""
    return region(tag)

"""Allocation events in memory: the packed event layout, ``Trace`` and ``TraceWriter``.

``cudapool.lab.trace`` describes the events and the file format, and re-exports all of this; this
module holds only the in-memory form, so that the readers of every kind of trace file
(``cudapool.lab.trace``, ``cudapool.lab.torch_snapshot``) build on it without importing each other.
"""

from __future__ import annotations

import io
import struct
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

__all__ = ["ALLOC", "FREE", "RELEASE", "EVENT", "Trace", "TraceWriter"]

ALLOC = 0
FREE = 1
#: The recorded program gave cached memory back here (empty_cache, or the built-in
#: allocator's out-of-memory retry); id, size and stream are 0. 2 is the pool's own
#: failed-allocation record (never in a trace).
RELEASE = 3

#: One event: action u8, 3 pad bytes, device i32, id u64, size u64, stream u64, time_ns i64.
EVENT = struct.Struct("<B3xiQQQq")
assert EVENT.size == 40


class Trace:
    """Events in packed form, with the header's facts."""

    def __init__(
        self,
        data: bytes = b"",
        meta: Optional[Dict[str, Any]] = None,
        builtin_reserved: Optional[Sequence[Sequence[int]]] = None,
    ) -> None:
        if len(data) % EVENT.size:
            raise ValueError(f"trace data of {len(data)} bytes is not a whole number of {EVENT.size}-byte events")
        self.data = bytes(data)
        self.meta: Dict[str, Any] = dict(meta or {})
        #: The built-in allocator's reserved-bytes curve: [(event_index, bytes)], or None.
        self.builtin_reserved = [tuple(p) for p in builtin_reserved] if builtin_reserved is not None else None

    def __len__(self) -> int:
        return len(self.data) // EVENT.size

    def __iter__(self) -> Iterator[Tuple[int, int, int, int, int, int]]:
        """(action, id, size, stream, device, time_ns) for every event."""
        for action, device, ident, size, stream, time_ns in EVENT.iter_unpack(self.data):
            yield action, ident, size, stream, device, time_ns

    def event(self, index: int) -> Tuple[int, int, int, int, int, int]:
        action, device, ident, size, stream, time_ns = EVENT.unpack_from(self.data, index * EVENT.size)
        return action, ident, size, stream, device, time_ns

    @property
    def builtin_peak_reserved(self) -> Optional[int]:
        if not self.builtin_reserved:
            return None
        return max(b for _, b in self.builtin_reserved)

    def devices(self) -> List[int]:
        return sorted({e[4] for e in self})

    @classmethod
    def from_events(cls, events: Iterable[Sequence[int]], **kwargs: Any) -> "Trace":
        """From (action, id, size[, stream[, device[, time_ns]]]) tuples."""
        w = TraceWriter()
        for e in events:
            w.add(*e)
        return w.trace(**kwargs)


class TraceWriter:
    """Builds a trace event by event."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._n = 0

    def add(self, action: int, ident: int, size: int, stream: int = 0, device: int = 0, time_ns: int = -1) -> None:
        if action not in (ALLOC, FREE, RELEASE):
            raise ValueError(f"unknown action {action!r} (expected ALLOC=0, FREE=1 or RELEASE=3)")
        if size < 0:
            raise ValueError(f"negative size {size}")
        self._buf.write(EVENT.pack(action, device, ident, size, stream, time_ns))
        self._n += 1

    def alloc(self, ident: int, size: int, stream: int = 0, device: int = 0, time_ns: int = -1) -> None:
        self.add(ALLOC, ident, size, stream, device, time_ns)

    def free(self, ident: int, size: int = 0, stream: int = 0, device: int = 0, time_ns: int = -1) -> None:
        self.add(FREE, ident, size, stream, device, time_ns)

    def __len__(self) -> int:
        return self._n

    def trace(
        self, meta: Optional[Dict[str, Any]] = None, builtin_reserved: Optional[Sequence[Sequence[int]]] = None
    ) -> Trace:
        return Trace(self._buf.getvalue(), meta=meta, builtin_reserved=builtin_reserved)

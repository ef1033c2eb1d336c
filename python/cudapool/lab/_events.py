"""Allocation events in memory: the packed event layout, ``Trace`` and ``TraceWriter``.

``cudapool.lab.trace`` describes the events and the file format, and re-exports all of this; this
module holds only the in-memory form, so that the readers of every kind of trace file
(``cudapool.lab.trace``, ``cudapool.lab.torch_snapshot``) build on it without importing each other.
"""

from __future__ import annotations

import io
import struct
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union, overload

__all__ = ["ALLOC", "FREE", "RELEASE", "EVENT", "FIELDS", "Events", "Trace", "TraceWriter"]

ALLOC = 0
FREE = 1
#: The recorded program gave cached memory back here (empty_cache, or the built-in
#: allocator's out-of-memory retry); id, size and stream are 0. 2 is the pool's own
#: failed-allocation record (never in a trace).
RELEASE = 3

#: One event, as the C record cp_trace_event_t (csrc/core/trace_event.h) lays it out: each
#: field's name and struct code, in order (tests/test_native_engine.py checks it against C).
FIELDS: Tuple[Tuple[str, str], ...] = (
    ("action", "B"),
    ("", "3x"),
    ("device", "i"),
    ("id", "Q"),
    ("size", "Q"),
    ("stream", "Q"),
    ("time_ns", "q"),
)
EVENT = struct.Struct("<" + "".join(code for _, code in FIELDS))
assert EVENT.size == 40

#: One event as Python code holds it: (action, id, size, stream, device, time_ns).
Event = Tuple[int, int, int, int, int, int]


def _event(record: Tuple[int, ...]) -> Event:
    action, device, ident, size, stream, time_ns = record
    return action, ident, size, stream, device, time_ns


class Events(Sequence[Event]):
    """The events of packed records, each unpacked when it is read: a view of ``data`` (bytes,
    or a bytearray that may grow, as a tracer's does)."""

    __slots__ = ("_data",)

    def __init__(self, data: Union[bytes, bytearray]) -> None:
        self._data = data

    def __len__(self) -> int:
        return len(self._data) // EVENT.size

    @overload
    def __getitem__(self, index: int) -> Event: ...

    @overload
    def __getitem__(self, index: slice) -> List[Event]: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[Event, List[Event]]:
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            part = self._data[start * EVENT.size : max(start, stop) * EVENT.size]  # a copy
            return list(map(_event, EVENT.iter_unpack(part)))
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"event {index} of {n}")
        return _event(EVENT.unpack_from(self._data, index * EVENT.size))

    def __iter__(self) -> Iterator[Event]:
        # A copy: a bytearray that holds a view cannot grow while it is being read.
        return map(_event, EVENT.iter_unpack(bytes(self._data)))


class Trace:
    """Events in packed form, with the header's facts."""

    def __init__(
        self,
        data: Union[bytes, bytearray] = b"",
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

    def __iter__(self) -> Iterator[Event]:
        """(action, id, size, stream, device, time_ns) for every event."""
        return map(_event, EVENT.iter_unpack(self.data))

    def event(self, index: int) -> Event:
        return _event(EVENT.unpack_from(self.data, index * EVENT.size))

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

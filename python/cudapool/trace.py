"""Allocation traces: the sequence of allocation events of one program.

A trace is a list of events, each ``(action, id, size, stream, device, time_ns)``:

- ``action``: ``ALLOC`` (0) or ``FREE`` (1);
- ``id``: names one allocation from its alloc to its free (an address or a counter; an id
  may be reused after its free);
- ``size``: requested bytes (on a free: the size of what is freed, or 0 when unknown);
- ``stream``: the stream the allocation is made on (0: the default stream);
- ``device``: the device index;
- ``time_ns``: when it happened, or -1 when unknown.

Events are kept as packed little-endian records of 40 bytes (the layout of the C replay's
``cp_trace_event_t``), so a trace of millions of events costs one ``bytes`` object and goes to
the C replay without a copy.

The file format (``.cptrace``, gzip-compressed): one line of JSON (the header: format name,
version, number of events, free-form ``meta``, and optionally ``builtin_reserved``, the
built-in allocator's reserved bytes as ``[[event_index, bytes], ...]`` when the trace came
from a real run that recorded it), then the records.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

__all__ = ["ALLOC", "FREE", "EVENT", "Trace", "TraceWriter", "load", "save"]

ALLOC = 0
FREE = 1

#: One event: action u8, 3 pad bytes, device i32, id u64, size u64, stream u64, time_ns i64.
EVENT = struct.Struct("<B3xiQQQq")
assert EVENT.size == 40

FORMAT_NAME = "cudapool-trace"
FORMAT_VERSION = 1


class Trace:
    """Events in packed form, with the header's facts."""

    def __init__(
        self,
        data: bytes = b"",
        meta: Optional[Dict[str, Any]] = None,
        builtin_reserved: Optional[List[Tuple[int, int]]] = None,
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
        if action not in (ALLOC, FREE):
            raise ValueError(f"unknown action {action!r} (expected ALLOC=0 or FREE=1)")
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

    def trace(self, meta: Optional[Dict[str, Any]] = None, builtin_reserved: Optional[List[Tuple[int, int]]] = None) -> Trace:
        return Trace(self._buf.getvalue(), meta=meta, builtin_reserved=builtin_reserved)


def save(trace: Trace, path: "os.PathLike[str] | str") -> None:
    """Write ``trace`` to ``path`` in the .cptrace format (gzip)."""
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "events": len(trace),
        "meta": trace.meta,
        "builtin_reserved": trace.builtin_reserved,
    }
    with gzip.open(path, "wb", compresslevel=6) as f:
        f.write(json.dumps(header, separators=(",", ":")).encode("utf-8") + b"\n")
        f.write(trace.data)


def load(path: "os.PathLike[str] | str") -> Trace:
    """Read a trace: our .cptrace format, or a torch memory snapshot pickle
    (``torch.cuda.memory._dump_snapshot``), told apart by their first bytes."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return _load_cptrace(path)
    from . import torch_snapshot  # a torch snapshot pickle

    return torch_snapshot.load_snapshot(path)


def _load_cptrace(path: "os.PathLike[str] | str") -> Trace:
    with gzip.open(path, "rb") as f:
        line = f.readline()
        try:
            header = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}: not a cudapool trace (bad header: {exc})") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
            raise ValueError(f"{path}: not a cudapool trace (format {header.get('format')!r})")
        if header.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: trace format version {header.get('version')} is not supported")
        data = f.read()
    n = header.get("events")
    if n is not None and len(data) != n * EVENT.size:
        raise ValueError(f"{path}: truncated trace: {len(data) // EVENT.size} of {n} events")
    return Trace(data, meta=header.get("meta"), builtin_reserved=header.get("builtin_reserved"))

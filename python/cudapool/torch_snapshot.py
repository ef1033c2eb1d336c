"""Torch memory snapshots (``torch.cuda.memory._dump_snapshot``) as cudapool traces.

    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    ...                                          # the program runs
    torch.cuda.memory._dump_snapshot("run.pickle")

    python -m cudapool replay run.pickle         # trace.load() sends such files here

A snapshot is a pickled dict of plain data: ``segments`` (the built-in allocator's segments
at dump time: ``device``, ``address``, ``total_size``, ``stream``, ``blocks``, ...) and
``device_traces`` (one list per device of the allocator's recorded actions: ``action``,
``addr``, ``size``, ``stream``, ``time_us``, ``frames``, ...). It is read with an unpickler
that refuses every global except a few builtin container and scalar types, so a snapshot
file cannot run code; anything else in it is an error.

Events
------
Each device's entries become events of that device, in order:

- ``alloc`` -> ALLOC (id = address, size = the requested size, the entry's stream);
- ``free_completed`` -> FREE: the moment the block is really reusable (after the events of
  the streams it was used on completed), which is when the pool may hand it out again;
- ``free_requested`` is not an event by itself. When a trace has a ``free_requested`` that
  no later ``free_completed`` of the same address follows (recording stopped in between,
  or an older torch that wrote only the request), the FREE goes where the request was. An
  old-style ``free`` entry counts as a request;
- ``segment_alloc``/``segment_free``, ``segment_map``/``segment_unmap`` (expandable segments)
  make the built-in allocator's reserved curve (below); ``oom`` entries are counted in
  ``meta["builtin_ooms"]``; ``snapshot``, ``annotate`` and other entries are ignored.

With several devices, the events of all devices are merged by ``time_us`` when every entry
has one, else laid one device after the other.

The trace window
----------------
The history is a ring buffer: a long run's snapshot starts mid-run. Blocks allocated before
the window and freed in it give FREE events without an ALLOC: a replay counts them as
``bad_events`` and does not model those blocks (``meta["frees_without_alloc"]`` counts
them). Blocks allocated before the window and still live at its end are not in the trace at
all.

The built-in allocator's reserved curve
---------------------------------------
``trace.builtin_reserved`` = ``[[event_index, bytes], ...]``: the bytes the built-in
allocator held from the device, summed over devices, from event ``event_index`` on (the
first point is ``[0, reserved at the start]``; a point follows every segment change, and
several may share an index). The reserved bytes at the start of the window are not
recorded, so they are reconstructed by undoing the trace: the ``segments`` list is the state
at dump time, so per device

    start = sum(total_size of its segments) - (segment_alloc + segment_map bytes)
                                            + (segment_free + segment_unmap bytes)

over the device's entries. If recording stopped before the dump, segments may have changed
after the last entry and this can come out too small; it is never taken below what keeps the
curve non-negative (``meta["reserved_start_adjusted"]`` lists the devices where it was).
``meta["builtin_peak_reserved_by_device"]`` holds each device's own peak.
"""

from __future__ import annotations

import heapq
import io
import os
import pickle
from typing import Any, Dict, List, Optional, Tuple, Union

from ._events import ALLOC, EVENT, FREE, Trace

__all__ = ["load_snapshot", "from_snapshot", "SnapshotError"]

_U64 = (1 << 64) - 1

#: The only globals a snapshot pickle may name: plain data types.
_SAFE_BUILTINS = frozenset(
    {"dict", "list", "tuple", "set", "frozenset", "str", "bytes", "bytearray", "int", "float", "complex", "bool"}
)


class SnapshotError(ValueError):
    """The file is not a torch memory snapshot, or not one this module can read."""


class _DataUnpickler(pickle.Unpickler):
    """Unpickles plain data only: any class or function other than the builtin data types is
    refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return getattr(__import__("builtins"), name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a memory snapshot holds only plain data")


def _unpickle(path: "Union[str, os.PathLike[str]]") -> Any:
    with open(path, "rb") as f:
        data = f.read()
    what = "not a torch memory snapshot"
    if not data.startswith(b"\x80"):  # pickle protocols 2 and later; torch writes 4 or 5
        what = "neither a cudapool trace (.cptrace) nor a torch memory snapshot (pickle)"
    try:
        return _DataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise SnapshotError(f"{path}: {what} ({exc})") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, MemoryError, OverflowError) as exc:
        raise SnapshotError(f"{path}: {what} (unreadable pickle: {exc.__class__.__name__}: {exc})") from None


def load_snapshot(path: "Union[str, os.PathLike[str]]") -> Trace:
    """The trace of a torch memory snapshot pickle (see the module notes). SnapshotError
    (a ValueError) when the file is not one; OSError when it cannot be read."""
    snapshot = _unpickle(path)
    return from_snapshot(snapshot, source=os.fspath(path))


# ------------------------------------------------------------------------------------------
# Conversion
# ------------------------------------------------------------------------------------------

# One device's items, in order: an event (action, id, size, stream, time_ns), a segment
# change (None, delta_bytes, time_ns), or a free request still waiting for its completion.


class _Pending:
    """A free_requested whose free_completed has not been seen (yet)."""

    __slots__ = ("addr", "size", "stream", "time_ns", "completed")

    def __init__(self, addr: int, size: int, stream: int, time_ns: int) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.time_ns = time_ns
        self.completed = False


def _int(entry: Dict[str, Any], key: str, where: str, default: Optional[int] = None) -> int:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        if value is None and default is not None:
            return default
        raise SnapshotError(f"{where}: {key!r} is {value!r}, not an integer")
    return value


def _check_dict(value: Any, where: str, what: str) -> None:
    if not isinstance(value, dict):
        raise SnapshotError(f"{where}: {what} must be a dict, not {type(value).__name__}")


def _time_ns(entry: Dict[str, Any]) -> Optional[int]:
    t = entry.get("time_us")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return None
    return int(t * 1000)


_SEGMENT_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def _device_items(entries: List[Any], device: int, source: str, stats: Dict[str, int]) -> List[Tuple[Any, ...]]:
    """The items of one device's trace (see above), free requests resolved."""
    items: List[Any] = []
    pending: Dict[int, _Pending] = {}
    for k, entry in enumerate(entries):
        where = f"{source}: device_traces[{device}][{k}]"
        _check_dict(entry, where, "a trace entry")
        action = entry.get("action")
        t = _time_ns(entry)
        tn = -1 if t is None else t
        if action == "alloc":
            addr = _int(entry, "addr", where) & _U64
            items.append((ALLOC, addr, _int(entry, "size", where), _int(entry, "stream", where, 0) & _U64, tn, t))
        elif action in ("free_requested", "free"):
            addr = _int(entry, "addr", where) & _U64
            req = _Pending(addr, _int(entry, "size", where, 0), _int(entry, "stream", where, 0) & _U64, tn)
            pending[addr] = req  # a request still pending for addr stays where it was
            items.append((req, t))
        elif action == "free_completed":
            addr = _int(entry, "addr", where) & _U64
            done = pending.pop(addr, None)
            if done is not None:
                done.completed = True
            size = _int(entry, "size", where, 0)
            items.append((FREE, addr, size, _int(entry, "stream", where, 0) & _U64, tn, t))
        elif action in _SEGMENT_DELTA:
            size = _int(entry, "size", where)
            items.append((None, _SEGMENT_DELTA[action] * size, t))
        elif action == "oom":
            stats["builtin_ooms"] += 1
        elif not isinstance(action, str):
            raise SnapshotError(f"{where}: no 'action' (entry keys: {sorted(map(str, entry))})")
        # "snapshot", "annotate", "user_defined", ...: nothing to replay
    out: List[Tuple[Any, ...]] = []
    for item in items:
        if isinstance(item[0], _Pending):
            req = item[0]
            if req.completed:
                continue
            stats["free_requested_fallbacks"] += 1
            out.append((FREE, req.addr, req.size, req.stream, req.time_ns, item[1]))
        else:
            out.append(item)
    return out


def _segment_end_bytes(segments: Any, source: str) -> Dict[int, int]:
    if segments is None:
        return {}
    if not isinstance(segments, list):
        raise SnapshotError(f"{source}: 'segments' must be a list, not {type(segments).__name__}")
    end: Dict[int, int] = {}
    for k, seg in enumerate(segments):
        where = f"{source}: segments[{k}]"
        _check_dict(seg, where, "a segment")
        dev = _int(seg, "device", where, 0)
        end[dev] = end.get(dev, 0) + _int(seg, "total_size", where)
    return end


def from_snapshot(snapshot: Any, source: str = "snapshot") -> Trace:
    """The trace of an unpickled snapshot dict (see the module notes)."""
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        kind = type(snapshot).__name__
        keys = f" with keys {sorted(map(str, snapshot))[:8]}" if isinstance(snapshot, dict) else ""
        raise SnapshotError(
            f"{source}: not a torch memory snapshot (a {kind}{keys}; expected a dict with "
            f"'segments' and 'device_traces', as torch.cuda.memory._dump_snapshot writes)"
        )
    traces = snapshot["device_traces"]
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError(f"{source}: 'device_traces' must be a list of lists (one per device)")
    if not any(traces):
        raise SnapshotError(
            f"{source}: the snapshot has no trace entries: record them with "
            f"torch.cuda.memory._record_memory_history() before torch.cuda.memory._dump_snapshot()"
        )

    stats = {"free_requested_fallbacks": 0, "builtin_ooms": 0}
    per_device = [_device_items(entries, dev, source, stats) for dev, entries in enumerate(traces)]

    # Reserved bytes at the start of the window, per device: the dump-time segments with the
    # trace's segment changes undone; at least what keeps the curve non-negative.
    end = _segment_end_bytes(snapshot.get("segments"), source)
    start: Dict[int, int] = {}
    adjusted: List[int] = []
    for dev, items in enumerate(per_device):
        net = low = 0
        for item in items:
            if item[0] is None:
                net += item[1]
                low = min(low, net)
        s = end.get(dev, 0) - net
        if s < -low:
            adjusted.append(dev)
            s = -low
        if items or s:
            start[dev] = s

    # Merge the devices: by time when every item has one, else one device after another.
    timed = all(item[-1] is not None for items in per_device for item in items)
    tagged = [
        [(item[-1] if timed else 0, dev, i, item) for i, item in enumerate(items)]
        for dev, items in enumerate(per_device)
    ]
    merged = heapq.merge(*tagged) if timed else (x for lst in tagged for x in lst)

    buf = bytearray()
    pack = EVENT.pack
    reserved = dict(start)
    total = sum(reserved.values())
    peak = dict(reserved)
    curve: List[List[int]] = [[0, total]]
    n = 0
    seen_alloc: set = set()
    frees_without_alloc = 0
    for _, dev, _, item in merged:
        action = item[0]
        if action is None:
            reserved[dev] = reserved.get(dev, 0) + item[1]
            total += item[1]
            if reserved[dev] > peak.get(dev, 0):
                peak[dev] = reserved[dev]
            curve.append([n, total])
            continue
        _, addr, size, stream, tn, _ = item
        if action == ALLOC:
            seen_alloc.add((dev, addr))
        elif (dev, addr) in seen_alloc:
            seen_alloc.discard((dev, addr))
        else:
            frees_without_alloc += 1
        buf += pack(action, dev, addr, size, stream, tn)
        n += 1

    meta: Dict[str, Any] = {
        "source": "torch-snapshot",
        "path": source,
        "devices": sorted(start),
        "builtin_peak_reserved_by_device": {str(d): p for d, p in sorted(peak.items())},
        "builtin_reserved_start_by_device": {str(d): s for d, s in sorted(start.items())},
        "frees_without_alloc": frees_without_alloc,
        "free_requested_fallbacks": stats["free_requested_fallbacks"],
        "builtin_ooms": stats["builtin_ooms"],
        "trace_entries": sum(len(t) for t in traces),
    }
    if adjusted:
        meta["reserved_start_adjusted"] = adjusted
    return Trace(bytes(buf), meta=meta, builtin_reserved=curve)

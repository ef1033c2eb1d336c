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
  make the built-in allocator's reserved curve (below). The built-in allocator gives memory
  back only in ``empty_cache`` and in its out-of-memory retry (and its garbage collection,
  when configured), so each run of ``segment_free``/``segment_unmap`` entries with no
  allocation or free between them becomes one RELEASE event where it began: a replay gives
  its cached memory back there too (``meta["releases"]`` counts them); ``oom`` entries are counted in
  ``meta["builtin_ooms"]``; ``snapshot``, ``annotate`` and other entries are ignored.

With several devices, the events of all devices are merged by ``time_us`` when every entry
has one, else laid one device after the other.

The trace window
----------------
The history is a ring buffer (and is often recorded from after the model was loaded): a
snapshot's trace usually starts mid-run, with memory already live and reserved. The state at
the window's first entry is reconstructed per device, in ``meta["window_start"]["<device>"]``:
the dump-time ``segments`` with the trace undone, last entry first:

- ``segment_alloc`` in the window: that segment did not exist at the start; ``segment_free``:
  it did (address, size and stream from the entry; small when it is 2 MiB or less);
  ``segment_map``/``segment_unmap`` (expandable segments) do the same to mapped ranges, and
  each contiguous mapped range is a segment at the start (the mapped bytes are reserved);
- blocks live at the start: those live at dump time (``active_allocated``,
  ``active_pending_free``) that the window does not allocate, plus those it frees without
  allocating them (a FREE event above, so a free requested before the window and completed in
  it counts). A block the dump lists has its exact size and requested size; block addresses are
  consecutive from the segment's address in list order, or the block's ``address`` when
  given. A block known only from its free has its request rounded to 512 B, plus the gap to
  the next live block when that is 1 MiB or less in a large segment (the built-in allocator
  leaves such a remainder unsplit; a remainder followed by memory freed since cannot be seen).

Each start is ``{"segments": [{"address", "size", "stream", "kind", "expandable", "blocks":
[[address, offset, size, requested], ...]}, ...], "reserved_bytes", "live_bytes",
"live_requested_bytes", "live_blocks", "problems"}``; ``problems`` lists what the history and
the dump do not agree on, as ``{"what", "count", "bytes"}``: allocations of the window neither
freed in it nor live at dump time (recording stopped before the dump), segments allocated in
the window but missing at dump time or freed but present, frees of blocks already live,
blocks outside every segment or overlapping, entries of unknown actions, and a reserved curve
that had to be raised (below). ``cudapool.lab.replay`` seeds every replay with this state and says
when the comparison with the recorded run is not like for like.

Integers out of range (a negative address or size, a stream handle beyond 64 bits; torch
writes handles as signed 64-bit values, which are taken as their unsigned bit pattern) and
times that are not finite are errors naming the entry.

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

import bisect
import heapq
import io
import math
import os
import pickle
from typing import Any, Dict, List, Optional, Tuple, Union

from ._events import ALLOC, EVENT, FREE, RELEASE, Trace

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
    if data.startswith(b"\x1f\x8b"):  # gzipped (.pickle.gz)
        import gzip

        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise SnapshotError(f"{path}: a gzip file that cannot be read ({exc})") from None
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


def _int(
    entry: Dict[str, Any], key: str, where: str, default: Optional[int] = None, low: int = 0, high: int = _U64
) -> int:
    """entry[key] as an integer in [low, high] (default: an unsigned 64-bit value), else
    SnapshotError naming the entry."""
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        if value is None and default is not None:
            return default
        raise SnapshotError(f"{where}: {key!r} is {value!r}, not an integer")
    if not low <= value <= high:
        raise SnapshotError(f"{where}: {key!r} is {value}, outside [{low}, {high}]")
    return value


def _stream(entry: Dict[str, Any], where: str) -> int:
    """A stream handle: torch writes it as a signed or unsigned 64-bit integer; anything
    beyond is refused, not wrapped."""
    return _int(entry, "stream", where, 0, low=-(1 << 63)) & _U64


def _check_dict(value: Any, where: str, what: str) -> None:
    if not isinstance(value, dict):
        raise SnapshotError(f"{where}: {what} must be a dict, not {type(value).__name__}")


def _time_ns(entry: Dict[str, Any], where: str) -> Optional[int]:
    t = entry.get("time_us")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return None
    if not math.isfinite(t) or not -(1 << 62) <= t * 1000 < (1 << 62):
        raise SnapshotError(f"{where}: 'time_us' is {t!r}, not a time")
    return int(t * 1000)


_SEGMENT_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}

#: Entries that are not allocator actions: nothing to replay, nothing unknown.
_IGNORED = frozenset({"snapshot", "annotate", "user_defined", "oom"})


def _device_items(entries: List[Any], device: int, source: str, stats: Dict[str, Any]) -> List[Tuple[Any, ...]]:
    """The items of one device's trace (see above), free requests resolved. A segment change
    is (None, delta_bytes, action, addr, size, stream, time)."""
    items: List[Any] = []
    pending: Dict[int, _Pending] = {}
    for k, entry in enumerate(entries):
        where = f"{source}: device_traces[{device}][{k}]"
        _check_dict(entry, where, "a trace entry")
        action = entry.get("action")
        t = _time_ns(entry, where)
        tn = -1 if t is None else t
        if action == "alloc":
            addr = _int(entry, "addr", where)
            items.append((ALLOC, addr, _int(entry, "size", where), _stream(entry, where), tn, t))
        elif action in ("free_requested", "free"):
            addr = _int(entry, "addr", where)
            req = _Pending(addr, _int(entry, "size", where, 0), _stream(entry, where), tn)
            pending[addr] = req  # a request still pending for addr stays where it was
            items.append((req, t))
        elif action == "free_completed":
            addr = _int(entry, "addr", where)
            done = pending.pop(addr, None)
            if done is not None:
                done.completed = True
            size = _int(entry, "size", where, 0)
            items.append((FREE, addr, size, _stream(entry, where), tn, t))
        elif action in _SEGMENT_DELTA:
            addr = _int(entry, "addr", where, 0)
            size = _int(entry, "size", where)
            items.append((None, _SEGMENT_DELTA[action] * size, action, addr, size, _stream(entry, where), t))
        elif action == "oom":
            stats["builtin_ooms"] += 1
        elif not isinstance(action, str):
            raise SnapshotError(f"{where}: no 'action' (entry keys: {sorted(map(str, entry))})")
        elif action not in _IGNORED:
            unknown = stats["unknown_actions"]
            unknown[action] = unknown.get(action, 0) + 1
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


def _segments_by_device(segments: Any, source: str) -> Dict[int, List[Dict[str, Any]]]:
    """The dump-time segments, checked, per device: address, size, stream, kind, expandable
    and blocks ((address, size, requested, live) in address order, or None when the entry
    lists none)."""
    if segments is None:
        return {}
    if not isinstance(segments, list):
        raise SnapshotError(f"{source}: 'segments' must be a list, not {type(segments).__name__}")
    out: Dict[int, List[Dict[str, Any]]] = {}
    for k, seg in enumerate(segments):
        where = f"{source}: segments[{k}]"
        _check_dict(seg, where, "a segment")
        dev = _int(seg, "device", where, 0, high=(1 << 31) - 1)
        addr = _int(seg, "address", where, 0)
        size = _int(seg, "total_size", where)
        kind = seg.get("segment_type")
        if kind not in ("small", "large"):
            kind = "small" if size <= _SMALL_SEGMENT else "large"
        blocks_in = seg.get("blocks")
        blocks: Optional[List[Tuple[int, int, int, bool]]] = None
        if isinstance(blocks_in, list) and blocks_in:
            blocks = []
            at = addr
            for j, blk in enumerate(blocks_in):
                bwhere = f"{where}.blocks[{j}]"
                _check_dict(blk, bwhere, "a block")
                bsize = _int(blk, "size", bwhere)
                baddr = _int(blk, "address", bwhere, at)
                requested = _int(blk, "requested_size", bwhere, bsize)
                state = blk.get("state")
                blocks.append((baddr, bsize, requested, state in _LIVE_STATES))
                at = baddr + bsize
        elif blocks_in is not None and not isinstance(blocks_in, list):
            raise SnapshotError(f"{where}: 'blocks' must be a list, not {type(blocks_in).__name__}")
        out.setdefault(dev, []).append(
            {
                "address": addr,
                "size": size,
                "stream": _stream(seg, where),
                "kind": kind,
                "expandable": bool(seg.get("is_expandable")),
                "blocks": blocks,
            }
        )
    return out


# ------------------------------------------------------------------------------------------
# The state at the window's start
# ------------------------------------------------------------------------------------------

_MiB = 1 << 20
#: The built-in allocator's sizes: the small pool's segments, the granule, and the most a
#: FREE block of the large pool can hold and still be left unsplit (so every FREE block of a
#: large segment is larger than this: a smaller gap after a live block is part of it).
_SMALL_SEGMENT = 2 * _MiB
_GRANULE = 512
_SMALL_SIZE = _MiB
_LIVE_STATES = ("active_allocated", "active_pending_free")


class _Problems:
    """What the reconstruction could not account for, by kind: count and bytes."""

    def __init__(self) -> None:
        self.kinds: Dict[str, List[int]] = {}

    def add(self, what: str, nbytes: int) -> None:
        entry = self.kinds.setdefault(what, [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def as_list(self) -> List[Dict[str, Any]]:
        return [{"what": w, "count": c, "bytes": b} for w, (c, b) in self.kinds.items()]


def _add_range(ranges: List[List[int]], lo: int, hi: int, stream: int) -> None:
    """Add [lo, hi) to a sorted list of disjoint [lo, hi, stream] ranges, merging touching ones."""
    ranges.append([lo, hi, stream])
    ranges.sort()
    merged: List[List[int]] = []
    for r in ranges:
        if merged and r[0] <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], r[1])
        else:
            merged.append(r)
    ranges[:] = merged


def _cut_range(ranges: List[List[int]], lo: int, hi: int) -> int:
    """Remove [lo, hi) from the ranges; the bytes of it that were not there."""
    out: List[List[int]] = []
    covered = 0
    for a, b, st in ranges:
        if b <= lo or a >= hi:
            out.append([a, b, st])
            continue
        covered += min(b, hi) - max(a, lo)
        if a < lo:
            out.append([a, lo, st])
        if b > hi:
            out.append([hi, b, st])
    ranges[:] = out
    return (hi - lo) - covered


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _window_start(dump: List[Dict[str, Any]], items: List[Tuple[Any, ...]], unknown: Dict[str, int]) -> Dict[str, Any]:
    """One device's state at its first trace entry: the dump-time segments and live blocks
    with the trace undone, last entry first (see the module notes)."""
    problems = _Problems()
    segs: Dict[int, Dict[str, Any]] = {}
    expandable: List[List[int]] = []  # mapped ranges of expandable segments: [lo, hi, stream]
    live: Dict[int, List[Optional[int]]] = {}  # address -> [size or None, requested, stream]
    with_blocks = False
    for seg in dump:
        if seg["expandable"]:
            _add_range(expandable, seg["address"], seg["address"] + seg["size"], seg["stream"])
        else:
            segs[seg["address"]] = {k: seg[k] for k in ("address", "size", "stream", "kind")}
        if seg["blocks"] is not None:
            with_blocks = True
            for addr, size, requested, is_live in seg["blocks"]:
                if is_live:
                    live[addr] = [size, requested, seg["stream"]]
    for item in reversed(items):
        action = item[0]
        if action is None:
            _, _, what, addr, size, stream, _ = item
            if what == "segment_alloc":
                if segs.pop(addr, None) is None:
                    problems.add("segments allocated in the window but missing at dump time", size)
            elif what == "segment_free":
                if addr in segs:
                    problems.add("segments freed in the window but present at dump time", size)
                kind = "small" if size <= _SMALL_SEGMENT else "large"
                segs[addr] = {"address": addr, "size": size, "stream": stream, "kind": kind}
            elif what == "segment_map":
                missing = _cut_range(expandable, addr, addr + size)
                if missing:
                    problems.add("expandable ranges mapped in the window but not mapped at dump time", missing)
            else:  # segment_unmap
                _add_range(expandable, addr, addr + size, stream)
        elif action == ALLOC:
            if live.pop(item[1], None) is None and with_blocks:
                problems.add("allocations of the window neither freed in it nor live at dump time", item[2])
        else:  # FREE: the block was live before
            addr, size, stream = item[1], item[2], item[3]
            if addr in live:
                problems.add("blocks freed twice without an allocation between", size)
            live[addr] = [None, size, stream]
    # The start's segments: the plain ones and the mapped runs of expandable ones.
    start = [dict(s, expandable=False) for s in segs.values()]
    for lo, hi, stream in expandable:
        start.append({"address": lo, "size": hi - lo, "stream": stream, "kind": "large", "expandable": True})
    start.sort(key=lambda s: s["address"])
    bases = [s["address"] for s in start]
    for s in start:
        s["blocks"] = []
    for addr in sorted(live):
        size, requested, _ = live[addr]
        i = bisect.bisect_right(bases, addr) - 1
        if i < 0 or addr >= start[i]["address"] + start[i]["size"]:
            problems.add("blocks live at the start outside every segment", size or requested or 0)
            continue
        start[i]["blocks"].append([addr, size, requested])
    for s in start:
        end = s["address"] + s["size"]
        placed: List[List[int]] = []
        blocks = s["blocks"]
        for j, (addr, size, requested) in enumerate(blocks):
            nxt = blocks[j + 1][0] if j + 1 < len(blocks) else end
            if size is None:  # freed in the window: only the request is known
                size = max(_GRANULE, _round_up(requested, _GRANULE))
                if s["kind"] == "large" and 0 < nxt - addr - size <= _SMALL_SIZE:
                    size = nxt - addr  # the remainder was too small to split off
            offset = addr - s["address"]
            if offset % _GRANULE or size % _GRANULE or addr + size > nxt:
                problems.add("blocks live at the start that overlap or are misaligned", size)
                continue
            requested = requested if 0 < requested <= size else size
            placed.append([addr, offset, size, requested])
        s["blocks"] = placed
    for action, n in sorted(unknown.items()):
        problems.add(f"entries of unknown action {action!r}", 0)
        problems.kinds[f"entries of unknown action {action!r}"][0] = n
    return {
        "segments": start,
        "reserved_bytes": sum(s["size"] for s in start),
        "live_bytes": sum(b[2] for s in start for b in s["blocks"]),
        "live_requested_bytes": sum(b[3] for s in start for b in s["blocks"]),
        "live_blocks": sum(len(s["blocks"]) for s in start),
        "problems": problems.as_list(),
    }


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

    per_device = []
    unknown_by_device = []
    stats: Dict[str, Any] = {"free_requested_fallbacks": 0, "builtin_ooms": 0}
    for dev, entries in enumerate(traces):
        stats["unknown_actions"] = {}
        per_device.append(_device_items(entries, dev, source, stats))
        unknown_by_device.append(stats["unknown_actions"])

    # Reserved bytes at the start of the window, per device: the dump-time segments with the
    # trace's segment changes undone; at least what keeps the curve non-negative.
    dump = _segments_by_device(snapshot.get("segments"), source)
    end = {dev: sum(seg["size"] for seg in segs) for dev, segs in dump.items()}
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
    releases = 0
    released: set = set()  # devices whose last record is a RELEASE
    for _, dev, _, item in merged:
        action = item[0]
        if action is None:
            if item[1] < 0 and dev not in released:
                # Memory given back (a burst of segment_free/segment_unmap): one RELEASE.
                buf += pack(RELEASE, dev, 0, 0, 0, -1 if item[-1] is None else item[-1])
                n += 1
                releases += 1
                released.add(dev)
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
        released.discard(dev)
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
        "releases": releases,
        "trace_entries": sum(len(t) for t in traces),
    }
    if adjusted:
        meta["reserved_start_adjusted"] = adjusted
    window: Dict[str, Any] = {}
    for dev, items in enumerate(per_device):
        if dev not in start:
            continue
        w = _window_start(dump.get(dev, []), items, unknown_by_device[dev])
        if dev in adjusted:
            w["problems"].append(
                {
                    "what": "segments changed after the last entry (recording stopped before the dump?)",
                    "count": 1,
                    "bytes": start[dev] - w["reserved_bytes"],
                }
            )
        window[str(dev)] = w
    meta["window_start"] = window
    return Trace(bytes(buf), meta=meta, builtin_reserved=curve)

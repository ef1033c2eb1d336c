"""Memory snapshots and allocation history in the format of ``torch.cuda.memory._snapshot()``.

A snapshot is a dict with ``segments`` (every segment of the pools, with its blocks and their
states) and ``device_traces`` (one list of trace entries per device: what the pool did lately,
while history is recorded). ``torch.cuda._memory_viz`` and the pytorch.org/memory_viz page read
it; :func:`dump` writes the pickle they open.

Field names are torch's. Segments: ``address``, ``total_size``, ``stream``, ``segment_type``
("small"/"large"), ``segment_pool_id``, ``allocated_size``, ``active_size``,
``requested_size``, ``device``, ``is_expandable``, ``frames``, ``blocks``; blocks:
``address``, ``size``, ``requested_size``, ``state`` ("active_allocated",
"active_pending_free", "inactive"), ``frames``. cudapool adds ``segment_kind`` ("plain" or
"page_mapped"); a page-mapped segment is shown as torch shows an expandable one, one segment
per contiguous mapped range, each with ``page_segment_address`` and ``page_segment_size``
naming the whole address range it is part of (what is not mapped there holds no memory), and
``region`` (its region's tag, or None) and ``is_paused`` (a pause gave its memory back: its
blocks keep their states, but no memory is behind them until resume; docs/regions.md).

Trace entries: ``action`` (alloc, free_requested, free_completed, segment_alloc,
segment_free, segment_map, segment_unmap, oom), ``addr``, ``size``, ``stream``, ``time_us``,
``frames``, ``device_free`` (oom only, 0: not known to the pool), and ``seq`` (cudapool: the
record's number; a gap means older records were overwritten).

History records (:func:`history_records`) are the raw form: tuples ``(seq, time_ns, action,
addr, size, stream, stack_id)``; ``stack_id`` 0 means no stack, else
:func:`stack_frames` gives the frames.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import _C

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "HistoryRecord",
    "BLOCK_STATES",
    "pool_snapshot",
    "history_records",
    "stack_frames",
    "trace_entries",
    "segments_of",
    "merge",
    "dump",
    "load",
    "SnapshotError",
]

# (seq, time_ns, action, addr, size, stream, stack_id)
HistoryRecord = Tuple[int, int, str, int, int, int, int]

# The pool's block states -> torch's; None: not memory (left out of the segments). The C layer
# says it (Note [Torch's segments] in csrc/core/cp.h), and cuts ``Pool.snapshot()``'s segments
# into torch's by it (their ``runs``).
BLOCK_STATES: Dict[str, Optional[str]] = dict(_C.TORCH_BLOCK_STATES)

DEFAULT_MAX_ENTRIES = 100_000


class SnapshotError(ValueError):
    """A file that is not a memory snapshot (or cannot be read)."""


def stack_frames(stack_id: int, _cache: Optional[Dict[int, List[Dict[str, Any]]]] = None) -> List[Dict[str, Any]]:
    """The frames of a stack id, innermost first, as torch writes them: dicts of
    ``filename``, ``line``, ``name``. [] for 0 or an unknown id."""
    if not stack_id:
        return []
    if _cache is not None and stack_id in _cache:
        return _cache[stack_id]
    raw = _C.history_stack(stack_id)
    frames = [{"filename": f, "line": line, "name": name} for f, line, name in raw] if raw else []
    if _cache is not None:
        _cache[stack_id] = frames
    return frames


def history_records(pool: Any) -> Tuple[List[HistoryRecord], int, int]:
    """The history a pool holds, oldest first: (records, recorded, capacity). ``recorded``
    counts every record ever made, so ``recorded - len(records)`` were overwritten."""
    records, recorded, capacity = pool.history()
    return records, recorded, capacity


def trace_entries(records: Iterable[HistoryRecord], frames: bool = True) -> List[Dict[str, Any]]:
    """History records as torch's trace entries."""
    cache: Dict[int, List[Dict[str, Any]]] = {}
    out = []
    for seq, time_ns, action, addr, size, stream, stack in records:
        e: Dict[str, Any] = {
            "action": action,
            "addr": addr,
            "size": size,
            "stream": stream,
            "time_us": time_ns // 1000,
            "frames": stack_frames(stack, cache) if frames else [],
            "seq": seq,
        }
        if action == "oom":
            e["device_free"] = 0
        out.append(e)
    return out


def _alloc_frames(records: Sequence[HistoryRecord]) -> Dict[int, int]:
    """The stack id of the latest allocation at each address still standing in the history."""
    last: Dict[int, int] = {}
    for _seq, _t, action, addr, _size, _stream, stack in records:
        if action == "alloc":
            last[addr] = stack
    return last


def _segment_record(
    raw: Dict[str, Any], device: int, run: Sequence[int], blocks: List[Dict[str, Any]]
) -> Dict[str, Any]:
    _first, _count, total, allocated, active, requested = run
    return {
        "device": device,
        "address": blocks[0]["address"],
        "total_size": total,
        "stream": raw["stream"],
        "segment_type": raw["kind"],
        "segment_pool_id": (0, 0),
        "allocated_size": allocated,
        "active_size": active,
        "requested_size": requested,
        "is_expandable": bool(raw["page_mapped"]),
        "frames": [],
        "blocks": blocks,
        "segment_kind": "page_mapped" if raw["page_mapped"] else "plain",
        "region": raw.get("region"),
        "is_paused": bool(raw.get("paused", 0)),
    }


def segments_of(
    raw_segments: Sequence[Dict[str, Any]], device: int, alloc_stacks: Dict[int, int]
) -> List[Dict[str, Any]]:
    """``Pool.snapshot()``'s segments as torch's, one per run the pool cut them into:
    page-mapped segments become one segment per contiguous mapped range."""
    cache: Dict[int, List[Dict[str, Any]]] = {}
    out: List[Dict[str, Any]] = []
    for raw in raw_segments:
        first = len(out)
        for run in raw["runs"]:
            blocks = []
            for addr, size, requested, state in raw["blocks"][run[0] : run[0] + run[1]]:
                torch_state = BLOCK_STATES[state]
                active = torch_state != "inactive"
                blocks.append(
                    {
                        "address": addr,
                        "size": size,
                        "requested_size": requested if active else 0,
                        "state": torch_state,
                        "frames": stack_frames(alloc_stacks.get(addr, 0), cache) if active else [],
                    }
                )
            out.append(_segment_record(raw, device, run, blocks))
        if raw["page_mapped"]:
            for seg in out[first:]:
                seg["page_segment_address"] = raw["address"]
                seg["page_segment_size"] = raw["size"]
    return out


def pool_snapshot(
    pool: Any, device: int = 0, include_traces: bool = True, n_devices: Optional[int] = None
) -> Dict[str, Any]:
    """The snapshot of one pool (a ``_C.Pool``: simulated, or a device's handle) as torch's
    ``_snapshot()`` has it, its segments and trace under ``device``. ``device_traces`` has
    ``n_devices`` lists (default ``device + 1``), the others empty."""
    records, _recorded, _cap = history_records(pool)
    segments = segments_of(pool.snapshot(), device, _alloc_frames(records))
    traces: List[List[Dict[str, Any]]] = [[] for _ in range(max(n_devices or 0, device + 1))]
    if include_traces:
        traces[device] = trace_entries(records)
    return {"segments": segments, "device_traces": traces}


def merge(snapshots: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Several devices' snapshots (from :func:`pool_snapshot`) as one: segments together,
    traces by device."""
    n = max((len(s["device_traces"]) for s in snapshots), default=0)
    traces: List[List[Dict[str, Any]]] = [[] for _ in range(n)]
    segments: List[Dict[str, Any]] = []
    for s in snapshots:
        segments.extend(s["segments"])
        for d, t in enumerate(s["device_traces"]):
            traces[d].extend(t)
    return {"segments": segments, "device_traces": traces}


def dump(snapshot: Dict[str, Any], path: Union[str, "Path"]) -> None:
    """Write ``snapshot`` as the pickle that pytorch.org/memory_viz and
    ``torch.cuda._memory_viz`` read."""
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)


def load(path: Union[str, "Path"]) -> Dict[str, Any]:
    """Read a snapshot pickle (cudapool's or torch's). SnapshotError names the problem: a
    missing file, not a pickle, or a pickle without ``segments``."""
    p = Path(path)
    if not p.is_file():
        raise SnapshotError(f"{path}: no such file")
    try:
        with open(p, "rb") as f:
            head = f.read(2)
        if head == b"\x1f\x8b":  # gzipped (.pickle.gz)
            import gzip

            with gzip.open(p, "rb") as f:
                data = pickle.load(f)
        else:
            with open(p, "rb") as f:
                data = pickle.load(f)
    except Exception as exc:  # any unpickling failure is bad input here
        raise SnapshotError(f"{path}: not a memory snapshot pickle ({type(exc).__name__}: {exc})") from None
    if isinstance(data, list):  # torch.cuda.memory_snapshot(): the segments alone
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise SnapshotError(f"{path}: a pickle, but not a memory snapshot (no 'segments' list)")
    data.setdefault("device_traces", [])
    return data

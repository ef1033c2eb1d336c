"""Out of memory: what the pool held when an allocation failed, and what would have fitted.

    import cudapool
    try:
        train_step()
    except torch.OutOfMemoryError:
        report = cudapool.last_oom()          # a dict, or None when nothing failed
        print(cudapool.oom.format_oom(report))

The figures (requested, reserved, allocated, cached but free with the largest free block,
fragmentation, bytes waiting per stream, the device's free and total memory, the cap) come
from the record the C pool takes under its lock in the failing call; the exception's message
is written from the same record (its ``report``), so the two cannot disagree.

The suggestion is computed, not guessed: each pool keeps a log of its latest allocation events
(``_C.set_event_log``; 16384 events per device pool by default). :func:`recent_trace` turns
that log into a trace that ends with the failed request, starting from the blocks that were
live at the log's first event; :func:`suggest` replays it on a simulated device as large as
the memory the pool could have had (what it held plus what the device had free, under the
same cap), first under the pool's own configuration (does the replay run out too?), then
under each candidate change (:data:`CANDIDATES`, and the named policies), and names the
change with which it fits at the lowest peak of reserved memory. When none fits, it says so:
the request does not fit under any configuration, and the program must need less memory.

Top allocation sites: :func:`top_sites` sums the live bytes of allocation-history entries
per top frame. They come from the pool's own history when it records stacks
(``cudapool.record_history(stacks="python")``); :func:`set_history_provider` connects another.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from . import _C, _config, _torch_stats, policies, snapshots
from ._units import format_bytes, mib_text
from .lab import replay
from .lab._events import ALLOC, EVENT, FREE, Trace

__all__ = [
    "CANDIDATES",
    "analyse",
    "format_oom",
    "last_oom",
    "recent_trace",
    "set_history_provider",
    "suggest",
    "top_sites",
]

#: The single changes tried on top of the pool's configuration, in order (ties go to the
#: earlier one). Entries that equal the pool's own setting are left out; max_split_size_mb
#: values are tried only below the pool's own.
CANDIDATES: Tuple[str, ...] = (
    "expandable_segments:True",
    "max_split_size_mb:512",
    "max_split_size_mb:256",
    "max_split_size_mb:128",
    "max_split_size_mb:64",
    "garbage_collection_threshold:0.8",
    "garbage_collection_threshold:0.6",
    "release_before_grow:True",
    "roundup_power2_divisions:4",
)

# The event log marks failed allocations with this action (CP_TRACE_ALLOC_FAILED).
_ALLOC_FAILED = 2

# The id the failed request gets in the replayed trace: no address is this.
_TARGET_ID = (1 << 64) - 1

# Keys that set the cap: the replay sets it from the record instead.
_CAP_KEYS = ("memory_cap_mb", "memory_fraction")


# ------------------------------------------------------------------------------------------
# The record, with the suggestion and the top sites
# ------------------------------------------------------------------------------------------

_history_provider: Optional[Callable[[int], Optional[Sequence[Mapping[str, Any]]]]] = None
_cache: Dict[Tuple[int, int], Dict[str, Any]] = {}


def set_history_provider(provider: Optional[Callable[[int], Optional[Sequence[Mapping[str, Any]]]]]) -> None:
    """Where :func:`last_oom` gets the allocation history with stacks for ``top_sites``:
    ``provider(device)`` returns the device's history entries (see :func:`top_sites`), or None
    when no history with stacks is being recorded. None disconnects it."""
    global _history_provider
    _history_provider = provider


def _pool_history(pool: Any) -> Optional[List[Dict[str, Any]]]:
    """The pool's own history (cudapool.record_history) as trace entries with frames, when it
    holds stacks; else None."""
    records, _recorded, _capacity = snapshots.history_records(pool)
    if not any(r[6] for r in records):
        return None
    return snapshots.trace_entries(records)


def last_oom(device: Any = None, suggest_change: bool = True) -> Optional[Dict[str, Any]]:
    """The latest out-of-memory failure of ``device``'s pool (None: the current device), as a
    dict, or None when it has not failed. See :func:`analyse` for the keys. The suggestion is
    computed on the first call for a failure and kept."""
    index = _torch_stats.device_index(device)
    return analyse(_C.device_pool(index), suggest_change=suggest_change, cache_key=index)


def analyse(pool: _C.Pool, suggest_change: bool = True, cache_key: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """The latest out-of-memory record of ``pool`` (a simulated ``_C.Pool`` or a device
    pool's handle) with the computed suggestion, or None when the pool has not failed.

    Keys: the record's (``requested``, ``rounded``, ``reserved``, ``allocated``,
    ``cached_free``, ``largest_free_block``, ``fragmentation``, ``pending_free``,
    ``streams`` (per stream: ``stream``, ``cached_free``, ``free_blocks``,
    ``largest_free_block``, ``pending_free``, ``pending_blocks``; most unused first, at most
    8), ``other`` and ``other_streams`` (the rest, summed), ``device_free``,
    ``device_total``, ``memory_cap``, ``segments``, ``live_blocks``, ``free_blocks``,
    ``pending_blocks``, ``stream``, ``device``, ``backend``, ``sequence``, ``time_ns``,
    ``num_ooms``, ``log_event``, ``report``: the exception's text), plus ``suggestion``
    (:func:`suggest`; None when ``suggest_change`` is False) and ``top_sites`` (None unless
    the pool's history records stacks, or a history provider is set).
    """
    record = pool.last_oom()
    if record is None:
        return None
    key = (cache_key, record["sequence"]) if cache_key is not None else None
    if key is not None and key in _cache and (_cache[key]["suggestion"] is not None or not suggest_change):
        return dict(_cache[key])
    result = dict(record)
    result["suggestion"] = None
    if suggest_change:
        trace, why = recent_trace(pool, record)
        result["suggestion"] = suggest(trace, record, pool.config()) if trace is not None else _unavailable(why)
    result["top_sites"] = None
    entries = _history_provider(record["device"]) if _history_provider is not None else _pool_history(pool)
    if entries is not None:
        result["top_sites"] = top_sites(entries)
    if key is not None:
        _cache.clear()  # one failure kept per process: the latest asked for
        _cache[key] = result
    return dict(result)


# ------------------------------------------------------------------------------------------
# The recent history as a trace
# ------------------------------------------------------------------------------------------


def recent_trace(pool: _C.Pool, record: Mapping[str, Any]) -> Tuple[Optional[Trace], str]:
    """The pool's event log as a trace that ends with the failed request of ``record``, and
    "" — or None and why not.

    The trace begins with an allocation for each block live at the log's first event (in
    address order; found by walking the log back from the blocks live now), then the logged
    events up to the failure; earlier failed allocations are left out (they held nothing).
    Its ``meta`` says how many events and seeded blocks it has. This is the one place that
    reads the log: a history recorded some other way can replace it.
    """
    target = record.get("log_event")
    log = pool.event_log()
    if target is None:
        return None, "no event log was kept when the allocation failed (_C.set_event_log)"
    first, events = log["first"], log["events"]
    if target < first:
        return None, (
            f"the event log no longer reaches the failure: {log['next'] - target} events since, "
            f"more than the {log['capacity']} it keeps"
        )
    logged = list(EVENT.iter_unpack(events))  # (action, device, id, size, stream, time_ns)
    live = {ident: (size, stream) for _, _, ident, size, stream, _ in EVENT.iter_unpack(log["live"])}
    for action, _, ident, size, stream, _ in reversed(logged):
        if action == ALLOC:
            live.pop(ident, None)
        elif action == FREE:
            live[ident] = (size, stream)
    device = int(record["device"])
    data = bytearray()
    for ident in sorted(live):
        size, stream = live[ident]
        data += EVENT.pack(ALLOC, device, ident, size, stream, -1)
    for action, _, ident, size, stream, _ in logged[: target - first]:
        if action != _ALLOC_FAILED:
            data += EVENT.pack(action, device, ident, size, stream, -1)
    data += EVENT.pack(ALLOC, device, _TARGET_ID, int(record["requested"]), int(record["stream"]), -1)
    meta = {"source": "event log", "seeded_blocks": len(live), "logged_events": target - first + 1}
    return Trace(bytes(data), meta=meta), ""


# ------------------------------------------------------------------------------------------
# Replaying it under the alternatives
# ------------------------------------------------------------------------------------------


def _unavailable(why: str) -> Dict[str, Any]:
    return {"change": None, "fits": None, "unavailable": why, "text": f"no suggestion: {why}"}


def _replay_config(base: str, change: str, cap: int) -> str:
    """``base`` without its cap, ``change`` on top key by key, and the record's cap."""
    entries = _config.entries_from_text(base, "the pool's configuration")
    for key in _CAP_KEYS:
        entries.pop(key, None)
    for key, entry in _config.entries_from_text(change, "the candidate").items():
        entries[key] = entry
    if cap:
        entries.update(_config.entries_from_text(f"memory_cap_mb:{mib_text(cap)}", "the record's cap"))
    return _config.check(entries)


def _candidates(base: str) -> List[Tuple[str, str]]:
    """(label, configuration text without the cap) of every alternative to ``base``."""
    current = _C.parse_config(_replay_config(base, "", 0))
    split = _config.entries_from_text(current)["max_split_size_mb"].value
    out: List[Tuple[str, str]] = []
    seen = {current}
    for change in CANDIDATES:
        key, _, value = change.partition(":")
        if key == "max_split_size_mb" and split != "unlimited" and Decimal(value) >= Decimal(split):
            continue
        text = _replay_config(base, change, 0)
        effective = _C.parse_config(text)
        if effective not in seen:
            seen.add(effective)
            out.append((change, text))
    for name in sorted(policies.POLICIES):
        text = _replay_config("", policies.config_for(name), 0)
        effective = _C.parse_config(text)
        if effective not in seen:
            seen.add(effective)
            out.append((f"policy:{name}", text))
    return out


def _with_cap(text: str, cap: int) -> str:
    return _replay_config(text, "", cap)


def suggest(trace: Trace, record: Mapping[str, Any], base_config: str) -> Dict[str, Any]:
    """Replay ``trace`` (ending with the failed request) under ``base_config`` and under each
    alternative, on a simulated device with the memory the pool could have had: its reserved
    bytes plus the device's free bytes (no limit when the device's total is unknown), under
    the record's cap. Returns:

    - ``change``: the change with which the trace fits at the lowest peak reserved (ties: the
      earlier in :data:`CANDIDATES`, then the policies), "key:value" or "policy:NAME"; None
      when none fits;
    - ``fits``: whether any does; ``config``: the whole configuration with the change;
      ``peak_reserved``: the replay's peak with it;
    - ``baseline``: the replay under the pool's own configuration: ``oom`` (True when it runs
      out too, as it should), ``oom_at_request`` (at the failed request itself),
      ``peak_reserved``;
    - ``candidates``: every alternative tried, each with ``change``, ``fits`` and
      ``peak_reserved``;
    - ``capacity``, ``memory_cap``, ``events``, ``seeded_blocks``;
    - ``text``: one sentence for people.
    """
    cap = int(record.get("memory_cap") or 0)
    total = int(record.get("device_total") or 0)
    capacity = int(record["reserved"]) + int(record.get("device_free") or 0) if total else replay.DEFAULT_CAPACITY
    last = len(trace) - 1

    def run(text: str) -> Dict[str, Any]:
        res = replay.replay(trace, policy="builtin", config=_with_cap(text, cap), capacity=capacity, window_start=False)
        return {
            "oom": bool(res["oom"]),
            "oom_at_request": bool(res["oom"]) and res["oom_event"] == last,
            "peak_reserved": int(res["peak_reserved"]),
        }

    base = run(base_config)
    tried = []
    best: Optional[Dict[str, Any]] = None
    for label, text in _candidates(base_config):
        r = run(text)
        entry = {"change": label, "fits": not r["oom"], "peak_reserved": r["peak_reserved"], "config": text}
        tried.append(entry)
        if entry["fits"] and (best is None or entry["peak_reserved"] < best["peak_reserved"]):
            best = entry
    out: Dict[str, Any] = {
        "baseline": base,
        "candidates": [{k: v for k, v in c.items() if k != "config"} for c in tried],
        "capacity": capacity if total else None,
        "memory_cap": cap or None,
        "events": len(trace),
        "seeded_blocks": int(trace.meta.get("seeded_blocks", 0)),
        "unavailable": None,
    }
    where = (
        f"the latest {len(trace) - out['seeded_blocks']} allocation events"
        + (f" (from {out['seeded_blocks']} blocks live at their start)" if out["seeded_blocks"] else "")
        + " replayed on a simulated device"
        + (f" of {format_bytes(capacity)}" if total else "")
        + (f" capped at {format_bytes(cap)}" if cap else "")
    )
    if best is None:
        out.update(change=None, fits=False, config=None, peak_reserved=None)
        out["text"] = (
            f"no configuration change helps: {where} run out of memory under every one tried; "
            "reduce the batch size or the memory the model needs"
        )
    else:
        out.update(change=best["change"], fits=True, config=_with_cap(best["config"], cap))
        out["peak_reserved"] = best["peak_reserved"]
        how = (
            f"set {best['change']} (in CUDAPOOL_CONF, or as a keyword of cudapool.enable())"
            if not best["change"].startswith("policy:")
            else f"use the {best['change'].split(':', 1)[1]} policy (policy:NAME in CUDAPOOL_CONF)"
        )
        out["text"] = f"{how}: {where} fit with a peak of {format_bytes(best['peak_reserved'])} reserved"
    if not base["oom"]:
        out["text"] += (
            "; note: the same replay under the current configuration fits too, so the log does not "
            "reproduce the failure (memory outside the log, or a layout the replay does not rebuild)"
        )
    return out


# ------------------------------------------------------------------------------------------
# Top allocation sites
# ------------------------------------------------------------------------------------------


def _frame_text(frame: Mapping[str, Any]) -> str:
    return f"{frame.get('filename', '?')}:{frame.get('line', '?')} {frame.get('name', '?')}"


def top_sites(
    entries: Iterable[Mapping[str, Any]],
    limit: int = 5,
    skip: Callable[[Mapping[str, Any]], bool] = lambda frame: False,
) -> List[Dict[str, Any]]:
    """The allocation sites holding the most live bytes, most first, at most ``limit``.

    ``entries``: allocation history in the order it happened, each a mapping with ``action``
    ("alloc"; "free_requested" or "free_completed" end an allocation; other actions are
    ignored), ``addr`` (the allocation's address, which its free names), ``size`` (bytes)
    and ``frames`` (a list of {"filename", "line", "name"}, innermost first: torch's
    ``_snapshot()["device_traces"]`` form). An allocation is live when no free of its
    address follows it. Its site is its first frame for which ``skip(frame)`` is false (or
    "<no stack>"). Returns [{"site", "bytes", "allocations"}].
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, not {limit}")
    live: Dict[int, Tuple[int, str]] = {}
    for entry in entries:
        action = entry.get("action")
        if action == "alloc":
            frames = [f for f in entry.get("frames") or () if not skip(f)]
            site = _frame_text(frames[0]) if frames else "<no stack>"
            live[int(entry["addr"])] = (int(entry["size"]), site)
        elif action in ("free_requested", "free_completed"):
            live.pop(int(entry["addr"]), None)
    sites: Dict[str, List[int]] = {}
    for size, site in live.values():
        acc = sites.setdefault(site, [0, 0])
        acc[0] += size
        acc[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return [{"site": site, "bytes": b, "allocations": n} for site, (b, n) in ranked[:limit]]


# ------------------------------------------------------------------------------------------
# Text
# ------------------------------------------------------------------------------------------


def format_oom(report: Mapping[str, Any]) -> str:
    """The report's text, the suggestion and the top sites, for people."""
    lines = [f"CUDA out of memory. {report['report']}"]
    suggestion = report.get("suggestion")
    if suggestion is not None:
        lines.append(f"Suggestion (computed by replay): {suggestion['text']}.")
    sites = report.get("top_sites")
    if sites:
        lines.append("Top allocation sites by live bytes:")
        lines += [f"  {format_bytes(s['bytes']):>12}  {s['allocations']:>6} allocs  {s['site']}" for s in sites]
    return "\n".join(lines) + "\n"

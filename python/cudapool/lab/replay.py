"""Replay an allocation trace through the real C pool on a simulated device, on a CPU.

    from cudapool.lab.replay import replay
    result = replay("gpt.cptrace", policy="builtin")
    print(result["peak_reserved"], result["utilization"])

Every replay runs on a fresh simulated ``_C.Pool`` whose addresses are never backed by host memory
(``touch_memory=False``), so a trace of an 80 GB training run replays on a laptop. The
capacity is 2^50 bytes (no out-of-memory) unless one is given. The events go to the C replay
in chunks; between chunks Python only updates the progress bar and samples the curve.

What a replay reports (the keys of the returned dict)
-----------------------------------------------------
- ``events``: events replayed (for one device of a multi-device trace: that device's);
  ``allocs``, ``frees``: those that reached the pool; ``skipped``: allocations of size 0
  and their frees; ``bad_events``: frees of ids never allocated in the trace nor live at its
  start (a trace that began mid-run and whose start is not known, or not seeded) and
  allocations of ids already live;
- ``peak_allocated`` (bytes in blocks handed out, after rounding), ``peak_requested`` (bytes
  asked for), ``peak_reserved`` (bytes reserved from the device), all maxima over the replay;
- ``utilization`` = peak_allocated / peak_reserved (0 when nothing was reserved);
- ``fragmentation`` = 1 - largest_free_at_peak / cached_free_at_peak, the free memory's
  shape at the moment reserved memory peaked (0 when nothing was cached then); with
  ``cached_free_at_peak`` and ``largest_free_at_peak``;
- ``device_allocs``, ``device_frees``: segments reserved from and given back to the device;
- ``device_faults``: what a GPU would have faulted on (0 for a sound pool). The simulated
  device runs behind the host as a GPU does: each block's last use is queued on its stream
  when the trace frees it, and completes only at a call that waits for the device
  (cudaFree, an event synchronize), so memory unmapped before that work is known done counts
  here (Note [Simulated asynchrony] in csrc/backend/sim.h);
- ``device_calls``: every call the replay's pool made to the simulated device, per kind
  (the names of ``_C.Pool.backend_calls()``: reserve, release, event_create, event_destroy,
  event_record, event_query, event_synchronize, mem_info, vmm_granularity, va_reserve,
  va_free, page_create, page_release, page_map, page_unmap, page_set_access, stream_capturing),
  from the pool's
  creation (its start-up queries, the seeding of a window's start) to the trace's last event;
  the simulated device's own counters, read then. ``device_call_bytes``: the bytes those
  calls named, per kind (``backend_bytes()``); ``device_calls_total``, their sum;
- ``device_calls_after_warmup`` (and ``device_call_bytes_after_warmup``,
  ``device_calls_after_warmup_total``): the calls made after warm-up. Warm-up is the first
  ``warmup_events`` events (per device): the later of half the events and the event after
  the one at which the bytes the trace holds live first reach their maximum (its requested
  sizes, whatever the policy). One rule for every trace, with nothing to tune: a training
  loop that repeats its steps has its steady state in the second half, so a pool that makes
  no device calls once warm shows 0 there, whereas one whose memory keeps growing, or that
  gives memory back and takes it again, does not; and a run whose largest step comes late
  (a longer sequence, an evaluation pass) is still warming up until that step, as every
  allocator must grow for it;
- ``releases``: the trace's RELEASE events replayed (the recorded run gave its cached memory
  back there; each is an empty_cache of the replayed pool), ``releases_ignored``: those left
  out (``releases=False``);
- ``device_call_ms``, ``device_call_ms_after_warmup``: the estimated milliseconds those calls
  take, sum(calls x us + bytes / GiB x us_per_gib) over the kinds, from the cost table of
  :mod:`cudapool.lab.device_costs` (the ``costs`` argument overrides it); no wait for the device's
  queued work is in them;
- ``device_ms_warmup``: the estimated milliseconds of the calls made during warm-up (from the
  pool's creation to event ``warmup_events``, seeding included), and ``device_ms_after_warmup``,
  those of the calls after it (the same figure as ``device_call_ms_after_warmup``, which stays):
  the two add up to ``device_call_ms``;
- ``sync_calls``, ``sync_calls_after_warmup``: how many of the device calls (all, and after
  warm-up) are of the kinds that wait for the work queued on the device
  (``device_costs.SYNC_KINDS``: release, event_synchronize, page_unmap, page_set_access). The
  wait depends on the kernels in flight, which no trace records, so the milliseconds above
  leave it out; this count says how often the host would wait;
- ``ns_per_op``: host nanoseconds per event spent in the C replay (``ns`` in all), and
  ``events_per_s`` from the same clock; ``wall_s``: the whole call, Python included;
- ``oom`` (bool), ``oom_event`` (index of the allocation that failed) and ``oom_size``
  (its bytes), both None without an out-of-memory; the replay stops at the first one;
- ``builtin_peak_reserved``: the built-in allocator's peak reserved bytes recorded in the
  trace (a torch snapshot has it), else None;
- ``policy``, ``config`` (the configuration text given to the pool), ``effective_config``
  (every key, defaults included), ``capacity``, ``device``;
- ``curve`` when ``curve_points`` > 0: ``[[event_index, max_allocated, max_reserved], ...]``,
  about ``curve_points`` windows, each the maxima over the events before ``event_index``
  since the previous point.

- ``window_start`` (None when the trace does not know it): for a torch snapshot whose history
  is a window, the memory live and reserved at its first event (``reserved_bytes``,
  ``live_bytes``, ``live_requested_bytes``, ``live_blocks``, ``segments``, ``problems``) and
  how the pool was seeded with it before the first event (``seeded``): ``"segments"`` under the
  ``builtin`` policy (the recorded segments, exact sizes and streams, the live blocks at their
  offsets: the replay continues the recorded run), ``"allocations"`` under any other (the
  policy allocates the live blocks, in address order; these are not counted as events), None
  with ``window_start=False`` (an empty pool). A window traced by ``cudapool.fakegpu.tracer``
  (``Tracer(window=True)``) knows the storages live at its start but not their layout: it is
  seeded with ``"allocations"`` (oldest first) under every policy; ``oom`` when the capacity cannot hold it. The
  peaks include the seeded memory, as the recorded ``builtin_peak_reserved`` does;
- ``comparable``: whether the replay's peak reserved compares with the recorded run's, and
  ``not_comparable``, the reasons when it does not (no recorded figure, an unseeded window
  that began with memory reserved, the reconstruction's ``problems``).

Several devices
---------------
A pool serves one device, so a trace with events on several devices is split: each device's
events are replayed on a pool of their own (``capacity`` each, as every GPU has its own
memory). With ``device=N`` only that device is replayed and reported. Without it, the result
holds ``devices``: ``{"0": {...}, "1": {...}}`` (a full report per device, its ``curve``
indexed by that device's own events), and the top level sums them: events, allocs, frees,
skipped, bad_events, the peaks (each device's peak, added: what the GPUs together must hold),
device allocs and frees, the device calls per kind (all and after warm-up), ns; utilization and fragmentation are computed from those sums
(fragmentation is then the cached-bytes-weighted mean of the devices'); ``oom`` is true when
any device ran out, with ``oom_device``; ``window_start`` adds up the devices' (problems tagged
with their device), and the totals are comparable when every device's is; there is no
top-level curve.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from typing import IO, Any, Dict, List, Optional, Union

from .. import _C, _config, policies
from .._units import format_bytes, parse_size
from . import device_costs
from ._progress import ProgressBar
from .trace import ALLOC, EVENT, FREE, RELEASE, Trace, device_counts, device_data, load, rows_where

__all__ = ["DEFAULT_CAPACITY", "ReplayError", "config_text", "replay"]

#: The simulated device's capacity when none is given: more than any trace asks for.
DEFAULT_CAPACITY = 1 << 50

#: Events handed to the C replay per call (between two progress updates).
CHUNK_EVENTS = 256 * 1024

#: Traces shorter than this replay in well under a second: no progress bar for them.
PROGRESS_MIN_EVENTS = 1_000_000


class ReplayError(RuntimeError):
    """The pool's invariant checker found violations after a replay."""


# ------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------


#: The step plan's figures (policy ``planned``; cudapool.Pool.info()), kept in a replay's result.
PLAN_FIELDS = (
    "plan_state",
    "plan_bytes",
    "plan_step_allocs",
    "plan_planned",
    "plans",
    "plan_drops",
    "plan_served",
    "plan_missed",
    "plan_us",
)


def config_text(policy: str = policies.DEFAULT_POLICY, config: Optional[str] = None) -> str:
    """The checked configuration text of ``policy`` with ``config`` ("key:value,...") on top,
    key by key. ValueError for an unknown policy or an invalid entry (named)."""
    base = policies.config_for(policy)
    merged = _config.entries_from_text(base, f"policy {policy!r}")
    for key, entry in _config.entries_from_text(config or "", "config").items():
        merged[key] = entry
    return _config.check(merged)


# ------------------------------------------------------------------------------------------
# Progress
# ------------------------------------------------------------------------------------------


def _want_progress(progress: Union[bool, str], n_events: int, stream: IO[str]) -> bool:
    """progress=False: never; True: on a TTY, for long traces; "force": for long traces,
    whatever the stream is."""
    if not progress or n_events < PROGRESS_MIN_EVENTS:
        return False
    if progress == "force":
        return True
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed or odd stream
        return False


# ------------------------------------------------------------------------------------------
# Replay
# ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def warmup_events(data: bytes) -> int:
    """Where the steady state of the records ``data`` begins (see ``warmup_events`` in the
    module notes): the later of half the events and the event after the one at which the bytes
    the trace holds live (as requested) first reach their maximum."""
    n = len(data) // EVENT.size
    half = n // 2
    if n == 0:
        return 0
    try:
        import numpy as np
    except ImportError:  # pure Python: one pass with a dict
        live: Dict[int, int] = {}
        now = top = 0
        at = -1
        for i, (action, _dev, ident, size, _st, _t) in enumerate(EVENT.iter_unpack(data)):
            if action == ALLOC and ident not in live:
                live[ident] = size
                now += size
            elif action == FREE:
                now -= live.pop(ident, 0)
            if now > top:
                top, at = now, i
        return max(half, at + 1)
    rec = np.frombuffer(data, dtype=np.dtype([("a", "u1"), ("p", "V3"), ("d", "<i4"), ("id", "<u8"),
                                              ("size", "<u8"), ("st", "<u8"), ("t", "<i8")]))  # fmt: skip
    action = rec["a"]
    size = rec["size"].astype(np.int64)
    order = np.lexsort((np.arange(n), rec["id"]))  # by id, then in trace order
    sa, si, ss = action[order], rec["id"][order], size[order]
    delta = np.zeros(n, dtype=np.int64)
    delta[sa == ALLOC] = ss[sa == ALLOC]
    # A free takes back the size of the allocation of its id just before it.
    prev_alloc = np.zeros(n, dtype=bool)
    prev_alloc[1:] = (sa[1:] == FREE) & (sa[:-1] == ALLOC) & (si[1:] == si[:-1])
    delta[prev_alloc] = -ss[np.flatnonzero(prev_alloc) - 1]
    live_bytes = np.empty(n, dtype=np.int64)
    live_bytes[order] = delta
    live_bytes = np.cumsum(live_bytes)
    return max(half, int(np.argmax(live_bytes)) + 1)


def _without_releases(data: bytes) -> bytes:
    """The records of ``data`` less its RELEASE events."""
    return rows_where(data, "action", RELEASE, equal=False)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _derive(res: Dict[str, Any]) -> None:
    """Add the figures computed from the C replay's raw ones."""
    res["utilization"] = _ratio(res["peak_allocated"], res["peak_reserved"])
    cached = res["cached_free_at_peak"]
    res["fragmentation"] = 1.0 - res["largest_free_at_peak"] / cached if cached else 0.0
    res["ns_per_op"] = _ratio(res["ns"], res["events"])
    res["events_per_s"] = res["events"] * 1e9 / res["ns"] if res["ns"] else 0.0


_CALL_KEYS = ("device_calls", "device_call_bytes", "device_calls_after_warmup", "device_call_bytes_after_warmup")


def _price(res: Dict[str, Any], costs: device_costs.CostTable) -> None:
    """Add the call totals, their estimated milliseconds (cudapool.lab.device_costs), all, during
    and after warm-up, and the counts of the calls that wait for the device."""
    res["device_calls_total"] = sum(res["device_calls"].values())
    res["device_calls_after_warmup_total"] = sum(res["device_calls_after_warmup"].values())
    res["device_call_ms"] = device_costs.estimate_ms(res["device_calls"], res["device_call_bytes"], costs)
    res["device_call_ms_after_warmup"] = device_costs.estimate_ms(
        res["device_calls_after_warmup"], res["device_call_bytes_after_warmup"], costs
    )
    res["device_ms_after_warmup"] = res["device_call_ms_after_warmup"]
    warm_calls = {k: n - res["device_calls_after_warmup"][k] for k, n in res["device_calls"].items()}
    warm_bytes = {k: b - res["device_call_bytes_after_warmup"][k] for k, b in res["device_call_bytes"].items()}
    res["device_ms_warmup"] = device_costs.estimate_ms(warm_calls, warm_bytes, costs)
    res["sync_calls"] = device_costs.sync_calls(res["device_calls"])
    res["sync_calls_after_warmup"] = device_costs.sync_calls(res["device_calls_after_warmup"])


def _seed(pool: _C.Pool, start: Dict[str, Any], mode: Optional[str]) -> Dict[str, Any]:
    """Put the memory live at the window's start into a fresh replay: the recorded segments
    with their live blocks at their offsets (mode "segments"), or each live block allocated
    by the policy itself, in address order ("allocations"); None: nothing. What was done:
    mode, events fed, the replay's result after it, and whether it ran out of memory."""
    segments = start["segments"]
    done: Dict[str, Any] = {"mode": None, "events": 0, "oom": False, "oom_size": 0}
    allocations = start.get("allocations")
    if allocations and mode is not None:
        # A traced window (cudapool.fakegpu.tracer): the live storages are known, their layout is not,
        # so the policy allocates them itself, oldest first, under every mode.
        done["mode"] = "allocations"
        return _seed_allocations(pool, allocations, done)
    if not segments or mode is None:
        return done
    done["mode"] = mode
    if mode == "segments":
        for seg in segments:
            blocks = [(b[0], b[1], b[2], b[3]) for b in seg["blocks"]]
            try:
                pool.replay_seed_segment(seg["stream"], seg["kind"], seg["size"], blocks)
            except _C.OutOfMemoryError:
                done.update(oom=True, oom_size=seg["size"])
                break
            except ValueError as exc:
                raise ReplayError(f"the window's start state does not fit the pool: {exc}") from None
    else:
        live = sorted((b[0], b[3], seg["stream"]) for seg in segments for b in seg["blocks"])
        return _seed_allocations(pool, live, done)
    done["result"] = pool.replay_result()
    return done


def _seed_allocations(pool: _C.Pool, live: List[Any], done: Dict[str, Any]) -> Dict[str, Any]:
    """Allocate each (id, bytes, stream) of ``live`` in order, as the seeding of _seed."""
    buf = b"".join(EVENT.pack(0, 0, ident, size, st, -1) for ident, size, st in live)
    done["events"] = len(live)
    if not pool.replay_feed(buf):
        done.update(oom=True, oom_size=pool.replay_result()["oom_size"])
    done["result"] = pool.replay_result()
    return done


def _start_summary(start: Optional[Dict[str, Any]], seeded: Optional[str]) -> Optional[Dict[str, Any]]:
    if start is None:
        return None
    keys = ("reserved_bytes", "live_bytes", "live_requested_bytes", "live_blocks")
    out: Dict[str, Any] = {k: start[k] for k in keys}
    out["segments"] = len(start["segments"])
    out["seeded"] = seeded
    out["problems"] = list(start["problems"])
    return out


def _replay_data(
    data: bytes,
    config: str,
    capacity: int,
    progress: Union[bool, str],
    label: str,
    curve_points: int,
    stream: IO[str],
    start: Optional[Dict[str, Any]] = None,
    mode: Optional[str] = None,
    lag: Optional[int] = None,
) -> Dict[str, Any]:
    """Replay the records in ``data`` on a fresh pool, seeded with ``start`` (the window's
    start state, see _seed) when given; the C replay's result, the curve, and the effective
    configuration."""
    n = len(data) // EVENT.size
    # The device runs behind the host by everything since its last synchronizing call (no
    # auto_complete): each block's last use is queued at its free, so memory given back before
    # that work is known done is a device fault (device_faults).
    pool = _C.Pool(capacity, config, False, False)
    pool.set_lag(lag)
    bar = ProgressBar(n, label, stream) if _want_progress(progress, n, stream) else None
    seed: Dict[str, Any] = {"mode": None, "events": 0, "oom": False}
    try:
        pool.replay_start(-1)
        if start is not None:
            seed = _seed(pool, start, mode)
            if seed["oom"]:
                n = 0  # out of memory before the first event: nothing more to replay
        curve: Optional[List[List[int]]] = [] if curve_points > 0 else None
        step = max(1, math.ceil(n / curve_points)) if curve_points > 0 else 0
        next_sample = step if curve is not None else n + 1
        warm = warmup_events(data)  # see the module notes
        warm_calls: Optional[Dict[str, int]] = None
        warm_bytes: Optional[Dict[str, int]] = None
        pos = 0
        ok = True
        while pos < n and ok:
            if pos == warm and warm_calls is None:
                warm_calls, warm_bytes = pool.backend_calls(), pool.backend_bytes()
            end = min(n, pos + CHUNK_EVENTS, next_sample, warm if pos < warm else n)
            ok = pool.replay_feed(data, pos, end - pos)
            if ok:
                pos = end
            if curve is not None and (pos >= next_sample or not ok):
                a, r = pool.replay_window()
                index = pos if ok else pool.replay_result()["oom_event"] + 1
                curve.append([index, a, r])
                next_sample += step
            if bar is not None:
                bar.update(pos)
        res = pool.replay_result()
        calls, call_bytes = pool.backend_calls(), pool.backend_bytes()
        if warm_calls is None or warm_bytes is None:  # out of memory in the first half
            warm_calls, warm_bytes = calls, call_bytes
        res["device_calls"] = calls
        res["device_call_bytes"] = call_bytes
        res["device_calls_after_warmup"] = {k: v - warm_calls[k] for k, v in calls.items()}
        info = pool.info()  # after the counts: what it asks the device is not the trace's
        res["stitches"] = info["stitches"]
        res["stitch_reuses"] = info["stitch_reuses"]
        res["plan"] = {k: info[k] for k in PLAN_FIELDS}
        res["device_faults"] = pool.device_fault_count()  # before the pool lets go of its memory
        res["device_call_bytes_after_warmup"] = {k: v - warm_bytes[k] for k, v in call_bytes.items()}
        violations = pool.check()
        if violations:
            raise ReplayError(
                f"the pool's checker found {violations} violation(s) after the replay:\n{pool.check_report()}"
            )
        pool.replay_stop()
        violations = pool.check()
        if violations:
            raise ReplayError(
                f"the pool's checker found {violations} violation(s) after freeing what the trace left live:\n"
                f"{pool.check_report()}"
            )
        res["effective_config"] = pool.config()
    finally:
        if bar is not None:
            bar.close()
        pool.close()
    res["warmup_events"] = warm
    if seed["events"]:  # the seeding allocations are not events of the trace
        before = seed["result"]
        for key in ("events", "allocs", "bad_events"):
            res[key] -= before[key]
        if res["oom"] and not seed["oom"]:
            res["oom_event"] -= before["events"]
    if seed["oom"]:
        res.update(oom=True, oom_event=0, oom_size=seed["oom_size"])
    if not res["oom"]:
        res["oom_event"] = None
        res["oom_size"] = None
    if curve is not None:
        res["curve"] = curve
    res["window_start"] = _start_summary(start, seed["mode"])
    if res["window_start"] is not None:
        res["window_start"]["oom"] = seed["oom"]
    return res


def replay(
    trace: Union[Trace, str, "os.PathLike[str]"],
    policy: str = policies.DEFAULT_POLICY,
    config: Optional[str] = None,
    capacity: Optional[Union[int, str]] = None,
    device: Optional[int] = None,
    progress: Union[bool, str] = False,
    curve_points: int = 0,
    *,
    progress_stream: Optional[IO[str]] = None,
    window_start: bool = True,
    costs: Union[None, str, "os.PathLike[str]", Dict[str, Any]] = None,
    lag: Optional[int] = None,
    releases: bool = True,
) -> Dict[str, Any]:
    """Replay ``trace`` (a Trace, or the path of a .cptrace file or torch snapshot) under
    ``policy`` (see :mod:`cudapool.policies`) with ``config`` ("key:value,...") on top.

    ``capacity``: the simulated device's bytes (int, or text such as "80GB"); default
    :data:`DEFAULT_CAPACITY`. ``device``: replay only that device's events (default: every
    device, each on its own pool; see the module notes). ``progress``: True draws a bar on
    stderr when it is a terminal and the trace is long; "force" draws it on any stream.
    ``curve_points``: sample about that many windows of allocated/reserved maxima.
    ``window_start``: seed each device's pool with the memory live at the trace's first
    event when the trace knows it (a torch snapshot's window; see the module notes); False
    starts from an empty pool.
    ``lag``: how many launches a stream of the simulated device may run behind before its
    oldest completes on its own (0: a device that is always idle); None, the default, runs
    nothing until a call waits for the device (see ``device_faults`` in the module notes).
    ``costs``: the per-call cost table that prices the device calls (cudapool.lab.device_costs):
    None for the default one, a JSON file's path, or a dict with a ``costs`` object.
    ``releases``: replay the trace's RELEASE events (the recorded run gave its cached memory
    back there: a snapshot's ``segment_free``/``segment_unmap``) as an empty_cache, under every
    policy; False leaves them out (``releases_ignored`` counts them).

    Returns a dict (see the module notes). ValueError for an unknown policy, a bad
    configuration, or a device the trace has no events on; ReplayError when the pool's
    checker finds a violation.
    """
    if not isinstance(trace, Trace):
        trace = load(trace)
    ignored = 0
    if not releases:
        kept = _without_releases(trace.data)
        ignored = (len(trace.data) - len(kept)) // EVENT.size
        if ignored:
            trace = Trace(kept, meta=trace.meta, builtin_reserved=trace.builtin_reserved)
    cfg = config_text(policy, config)
    cap = DEFAULT_CAPACITY if capacity is None else parse_size(capacity)
    if cap <= 0:
        raise ValueError(f"capacity must be positive, not {cap}")
    if curve_points < 0:
        raise ValueError(f"curve_points must be >= 0, not {curve_points}")
    if progress not in (True, False, "force"):
        raise ValueError(f"progress must be True, False or 'force', not {progress!r}")
    stream = progress_stream if progress_stream is not None else sys.stderr
    table = device_costs.load(costs)
    t0 = time.perf_counter()

    counts = device_counts(trace.data)
    devices = sorted(counts)
    if device is not None and device not in counts:
        have = ", ".join(map(str, devices)) or "none: the trace is empty"
        raise ValueError(f"the trace has no events on device {device} (devices: {have})")

    by_device = trace.meta.get("builtin_peak_reserved_by_device") if isinstance(trace.meta, dict) else None

    def builtin_peak(d: Optional[int]) -> Optional[int]:
        if isinstance(by_device, dict) and d is not None and str(d) in by_device:
            return by_device[str(d)]
        if len(devices) <= 1:
            return trace.builtin_peak_reserved
        return None

    if lag is not None and (not isinstance(lag, int) or isinstance(lag, bool) or lag < 0):
        raise ValueError(f"lag must be a non-negative number of launches or None, not {lag!r}")
    common = {"policy": policy, "config": cfg, "capacity": cap, "lag": lag, "releases_ignored": ignored}
    starts = trace.meta.get("window_start") if isinstance(trace.meta, dict) else None

    def start_of(d: Optional[int]) -> Optional[Dict[str, Any]]:
        return starts.get(str(d)) if isinstance(starts, dict) and d is not None else None

    mode = None if not window_start else "segments" if policy == "builtin" else "allocations"

    if device is not None or len(devices) <= 1:
        d = device if device is not None else (devices[0] if devices else None)
        data = trace.data if len(devices) <= 1 or d is None else device_data(trace.data, d)
        label = "replay" if len(devices) <= 1 else f"replay device {d}"
        res = _replay_data(data, cfg, cap, progress, label, curve_points, stream, start_of(d), mode, lag)
        _derive(res)
        _price(res, table)
        res.update(common, device=d, builtin_peak_reserved=builtin_peak(d))
        _compare(res)
        res["wall_s"] = time.perf_counter() - t0
        return res

    per: Dict[str, Dict[str, Any]] = {}
    for d in devices:
        data = device_data(trace.data, d)
        res = _replay_data(data, cfg, cap, progress, f"replay device {d}", curve_points, stream, start_of(d), mode, lag)
        _derive(res)
        _price(res, table)
        res.update(common, device=d, builtin_peak_reserved=builtin_peak(d))
        _compare(res)
        per[str(d)] = res

    total: Dict[str, Any] = dict(common, device=None, devices=per)
    for key in (
        "events", "allocs", "frees", "skipped", "bad_events", "releases", "peak_allocated", "peak_requested",
        "peak_reserved", "cached_free_at_peak", "largest_free_at_peak", "device_allocs",
        "device_frees", "ns",
    ):  # fmt: skip
        total[key] = sum(r[key] for r in per.values())
    for key in _CALL_KEYS:
        total[key] = {k: sum(r[key][k] for r in per.values()) for k in next(iter(per.values()))[key]}
    total["warmup_events"] = sum(r["warmup_events"] for r in per.values())
    total["effective_config"] = next(iter(per.values()))["effective_config"]
    oom_devices = [d for d, r in per.items() if r["oom"]]
    total["oom"] = bool(oom_devices)
    first = per[oom_devices[0]] if oom_devices else None
    total["oom_device"] = int(oom_devices[0]) if oom_devices else None
    total["oom_event"] = first["oom_event"] if first else None
    total["oom_size"] = first["oom_size"] if first else None
    peaks = [r["builtin_peak_reserved"] for r in per.values()]
    if all(p is not None for p in peaks):
        total["builtin_peak_reserved"] = sum(peaks)
    else:
        total["builtin_peak_reserved"] = trace.builtin_peak_reserved
    _derive(total)
    _price(total, table)
    total["window_start"] = _sum_starts(per)
    total["comparable"] = all(r["comparable"] for r in per.values()) and total["builtin_peak_reserved"] is not None
    total["not_comparable"] = [f"device {d}: {why}" for d, r in per.items() for why in r["not_comparable"]]
    total["wall_s"] = time.perf_counter() - t0
    return total


def _compare(res: Dict[str, Any]) -> None:
    """Whether the replay's peak reserved compares with the recorded run's: ``comparable``,
    and ``not_comparable``, the reasons it does not."""
    why: List[str] = []
    ws = res.get("window_start")
    if res.get("builtin_peak_reserved") is None:
        why.append("the trace does not record the built-in allocator's reserved memory")
    elif ws is not None:
        if ws["reserved_bytes"] and not ws["seeded"]:
            why.append(
                f"the replay starts from an empty pool, but {format_bytes(ws['reserved_bytes'])} were reserved "
                f"({format_bytes(ws['live_bytes'])} live) when the window began"
            )
        for p in ws["problems"]:
            amount = f", {format_bytes(p['bytes'])}" if p["bytes"] else ""
            why.append(f"window start uncertain: {p['what']} ({p['count']:,}{amount})")
        if ws.get("oom"):
            why.append("out of memory before the first event: the capacity cannot hold the window's start")
    res["comparable"] = not why
    res["not_comparable"] = why


def _sum_starts(per: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The devices' window starts added up (None when no device has one)."""
    starts = {d: r["window_start"] for d, r in per.items() if r.get("window_start") is not None}
    if not starts:
        return None
    out: Dict[str, Any] = {}
    for key in ("reserved_bytes", "live_bytes", "live_requested_bytes", "live_blocks", "segments"):
        out[key] = sum(w[key] for w in starts.values())
    modes = {w["seeded"] for w in starts.values() if w["segments"]}
    out["seeded"] = modes.pop() if len(modes) == 1 else (None if not modes else "mixed")
    out["problems"] = [dict(p, what=f"device {d}: {p['what']}") for d, w in starts.items() for p in w["problems"]]
    out["oom"] = any(w.get("oom") for w in starts.values())
    return out

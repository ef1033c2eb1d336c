"""A snapshot of the pool at a trace's peak of reserved memory, as a replay reaches it.

    from cudapool.lab.peak_snapshot import snapshot_at_peak
    snap = snapshot_at_peak("gpt.cptrace", policy="builtin")   # torch's snapshot format

The trace is replayed twice: once to find the event at the peak, once to stop there with the
history on, so the snapshot carries the timeline up to the peak.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Union

from .. import _C, policies
from .. import snapshots as _snapshot
from .._units import parse_size
from .replay import DEFAULT_CAPACITY, config_text
from .trace import EVENT, Trace, device_counts, device_data, load

__all__ = ["PEAK_HISTORY", "snapshot_at_peak"]


PEAK_HISTORY = 20_000  # history records kept up to the peak (the snapshot's timeline)


def snapshot_at_peak(
    trace: Union[Trace, str, "os.PathLike[str]"],
    policy: str = policies.DEFAULT_POLICY,
    config: Optional[str] = None,
    capacity: Optional[Union[int, str]] = None,
    device: Optional[int] = None,
    history: int = PEAK_HISTORY,
) -> Dict[str, Any]:
    """The memory snapshot (torch's _snapshot format, cudapool.snapshots) of the simulated
    pool at the moment its reserved memory first reaches its peak while replaying ``trace``
    (one device: ``device``, default the trace's first), with the last ``history`` events
    before it as the device's trace. The pool starts empty (a window's start state is not
    seeded). Two passes: the first finds the chunk of events where the peak falls, the second
    stops at the event itself."""
    if not isinstance(trace, Trace):
        trace = load(trace)
    counts = device_counts(trace.data)
    if not counts:
        raise ValueError("the trace has no events")
    d = min(counts) if device is None else device
    if d not in counts:
        raise ValueError(f"the trace has no events on device {d} (devices: {', '.join(map(str, sorted(counts)))})")
    data = device_data(trace.data, d) if len(counts) > 1 else trace.data
    cfg = config_text(policy, config)
    cap = DEFAULT_CAPACITY if capacity is None else parse_size(capacity)
    n = len(data) // EVENT.size
    chunk = 4096
    # Pass 1: the first chunk whose window reaches the peak of reserved.
    pool = _C.Pool(cap, cfg, False, False)
    windows: List[int] = []
    try:
        pool.replay_start(-1)
        pos = 0
        while pos < n:
            end = min(n, pos + chunk)
            ok = pool.replay_feed(data, pos, end - pos)
            windows.append(pool.replay_window()[1])
            if not ok:
                break
            pos = end
        peak = pool.replay_result()["peak_reserved"]
        pool.replay_stop()
    finally:
        pool.close()
    first = next((i for i, r in enumerate(windows) if r >= peak), 0)
    # Pass 2: up to that chunk, then one event at a time until reserved is the peak.
    pool = _C.Pool(cap, cfg, False, False)
    try:
        pool.set_history(history)
        pool.replay_start(-1)
        pos = first * chunk
        if pos:
            pool.replay_feed(data, 0, pos)
        while pos < n and pool.info()["reserved"] < peak:
            if not pool.replay_feed(data, pos, 1):
                break
            pos += 1
        snap = _snapshot.pool_snapshot(pool, d)
        snap["cudapool_replay"] = {"event": pos, "events": n, "peak_reserved": peak, "config": pool.config()}
        pool.replay_stop()
    finally:
        pool.close()
    return snap

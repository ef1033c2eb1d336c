"""The smallest device a trace fits on: bisection over the capacity of fresh replays.

    from cudapool.lab.capacity import min_capacity
    found = min_capacity("gpt.cptrace", policy="cudapool")
    print(found["min_capacity"], found["ratio"])

Each try is a fresh pool with the whole OOM ladder (:func:`cudapool.lab.replay.replay` with
``capacity``), so a policy's choices that depend on the device's size are those it would make.
"""

from __future__ import annotations

import os
from typing import IO, Any, Dict, List, Optional, Union

from .. import policies
from .._units import format_bytes
from .replay import DEFAULT_CAPACITY, ReplayError, replay
from .trace import Trace, load

__all__ = ["AT_MIN_KEYS", "MIN_CAPACITY_TOLERANCE", "min_capacity"]


#: The bisection stops when the bracket is narrower than this fraction of peak allocated.
MIN_CAPACITY_TOLERANCE = 0.01

#: What a report shows of the replay at the smallest device: its device calls and their cost.
AT_MIN_KEYS = (
    "peak_reserved", "device_calls_total", "device_call_ms", "device_ms_warmup", "device_ms_after_warmup",
    "device_calls_after_warmup_total", "sync_calls", "sync_calls_after_warmup",
)  # fmt: skip


def min_capacity(
    trace: Union[Trace, str, "os.PathLike[str]"],
    policy: str = policies.DEFAULT_POLICY,
    config: Optional[str] = None,
    device: Optional[int] = None,
    *,
    tolerance: float = MIN_CAPACITY_TOLERANCE,
    unlimited: Optional[Dict[str, Any]] = None,
    progress: Optional[IO[str]] = None,
    window_start: bool = True,
    costs: Union[None, str, "os.PathLike[str]", Dict[str, Any]] = None,
    lag: Optional[int] = None,
    releases: bool = True,
) -> Dict[str, Any]:
    """The smallest device memory on which ``trace`` replays under ``policy`` without running
    out of memory, found by bisection in this process (each try a fresh pool, with the pool's
    whole out-of-memory ladder: waiting for pending frees, giving cached memory back, and
    stitching where the policy does).

    The bracket starts at [peak allocated, peak reserved on an unlimited device] (``unlimited``:
    that replay's result, when the caller has it): nothing runs below the bytes it holds at once,
    and on a device of its unlimited peak the pool never runs short. It is halved until it is
    narrower than ``tolerance`` x peak allocated. Fitting is not monotonic in the capacity for
    every policy (a pool that runs short earlier gives memory back earlier): the answer is a
    capacity that fits, with one ``tolerance`` below it that does not.

    With several devices, every device gets the same capacity (one GPU model), and the floor is
    the largest device's peak allocated. ``progress``: a stream that gets one line per try.

    Returns ``{"min_capacity": bytes, "ratio": min_capacity / peak_allocated, "peak_allocated",
    "tries": [[capacity, fits], ...], "at_min": the replay's result at min_capacity (device
    calls and their estimated time there)}``; ``min_capacity`` is None (and ``at_min`` the
    unlimited replay) when the trace allocates nothing.
    """
    if not isinstance(trace, Trace):
        trace = load(trace)
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), not {tolerance!r}")
    kw: Dict[str, Any] = dict(
        policy=policy, config=config, device=device, window_start=window_start, costs=costs, lag=lag,
        releases=releases,
    )  # fmt: skip
    if unlimited is None:
        unlimited = replay(trace, **kw)
    per = unlimited.get("devices") or {"": unlimited}
    floor = max(r["peak_allocated"] for r in per.values())
    ceiling = max(r["peak_reserved"] for r in per.values())
    out: Dict[str, Any] = {
        "min_capacity": None,
        "ratio": None,
        "peak_allocated": floor,
        "tries": [],
        "at_min": unlimited,
    }
    if floor == 0:
        return out
    tries: List[List[Any]] = out["tries"]

    def attempt(cap: int) -> Dict[str, Any]:
        res = replay(trace, capacity=cap, **kw)
        tries.append([cap, not res["oom"]])
        if progress is not None:
            verdict = "fits" if not res["oom"] else "out of memory"
            progress.write(
                f"min-capacity: try {len(tries)}: {format_bytes(cap)} ({cap / floor:.4f} x peak allocated): {verdict}\n"
            )
            progress.flush()
        return res

    hi = max(ceiling, floor)
    best = attempt(hi)
    while best["oom"] and hi < DEFAULT_CAPACITY:  # the device's size changed a policy's choices
        hi = min(hi * 2, DEFAULT_CAPACITY)
        best = attempt(hi)
    if best["oom"]:
        raise ReplayError("the trace runs out of memory on every capacity tried")
    lo = floor - 1  # known not to fit: reserved bytes hold every allocated byte
    step = max(1, int(tolerance * floor))
    while hi - lo > step:
        mid = lo + (hi - lo) // 2
        res = attempt(mid)
        if res["oom"]:
            lo = mid
        else:
            hi, best = mid, res
    out.update(min_capacity=hi, ratio=hi / floor, at_min=best)
    return out

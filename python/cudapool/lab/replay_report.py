"""A replay's result (:func:`cudapool.lab.replay.replay`) for people: one figure a line.

    from cudapool.lab.replay import replay
    from cudapool.lab.replay_report import format_report
    print(format_report(replay("gpt.cptrace")))

What each line means is said in :mod:`cudapool.lab.replay` (the keys of the result).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .._units import format_bytes
from . import device_costs
from .replay import DEFAULT_CAPACITY

__all__ = ["format_report"]


def _pct(x: float) -> str:
    return f"{x * 100:.1f} %"


def _report_lines(res: Dict[str, Any], indent: str = "") -> List[str]:
    lines = []

    def row(label: str, value: str) -> None:
        lines.append(f"{indent}{label:<16}{value}")

    row(
        "events",
        f"{res['events']:,} ({res['allocs']:,} allocs, {res['frees']:,} frees"
        + (f", {res['skipped']:,} skipped" if res["skipped"] else "")
        + ")",
    )
    if res["bad_events"]:
        row(
            "bad events",
            f"{res['bad_events']:,} (frees of blocks allocated before the trace began, "
            "or allocations of live ids: not replayed)",
        )
    row(
        "peak allocated",
        f"{format_bytes(res['peak_allocated'])} ({res['peak_allocated']:,} B; "
        f"requested {format_bytes(res['peak_requested'])})",
    )
    ws = res.get("window_start")
    if ws is not None:
        how = {
            "segments": "seeded as the recorded segments, live blocks at their offsets",
            "allocations": "seeded: the policy allocated the live blocks, in address order",
            "mixed": "seeded",
            None: "not seeded: the replay starts from an empty pool",
        }[ws["seeded"]]
        if not ws["reserved_bytes"]:
            how = "the window starts with nothing reserved"
        row(
            "window start",
            f"{format_bytes(ws['live_bytes'])} live in {ws['live_blocks']:,} blocks, "
            f"{format_bytes(ws['reserved_bytes'])} reserved in {ws['segments']:,} segments ({how})",
        )
    reserved = f"{format_bytes(res['peak_reserved'])} ({res['peak_reserved']:,} B)"
    builtin = res.get("builtin_peak_reserved")
    if builtin:
        reserved += f"   built-in allocator in the recorded run: {format_bytes(builtin)}"
        if res.get("comparable", True):
            change = (res["peak_reserved"] - builtin) / builtin * 100
            reserved += f" ({change:+.1f} %)"
        else:
            reserved += " (no percentage: not like for like)"
    row("peak reserved", reserved)
    for why in res.get("not_comparable") or ():
        if builtin:
            row("not comparable", why)
    row("utilization", f"{_pct(res['utilization'])} (peak allocated / peak reserved)")
    row(
        "fragmentation",
        f"{_pct(res['fragmentation'])} (at the reserved peak: 1 - largest free block "
        f"{format_bytes(res['largest_free_at_peak'])} / cached free {format_bytes(res['cached_free_at_peak'])})",
    )
    row("device allocs", f"{res['device_allocs']:,} (segments reserved; {res['device_frees']:,} given back)")
    if "device_calls" in res:
        row(
            "device calls",
            f"{res['device_calls_total']:,}, estimated {res['device_call_ms']:.3f} ms ("
            + (", ".join(f"{k} {v:,}" for k, v in res["device_calls"].items() if v) or "none")
            + ")",
        )
        row(
            "after warm-up",
            f"{res['device_calls_after_warmup_total']:,} calls, estimated {res['device_call_ms_after_warmup']:.3f} ms"
            + (
                " (" + ", ".join(f"{k} {v:,}" for k, v in res["device_calls_after_warmup"].items() if v) + ")"
                if res["device_calls_after_warmup_total"]
                else ""
            )
            + f" (calls made from event {res['warmup_events']:,} on)",
        )
        if "sync_calls" in res:
            row(
                "waiting calls",
                f"{res['sync_calls']:,} ({res['sync_calls_after_warmup']:,} after warm-up): "
                + ", ".join(device_costs.SYNC_KINDS)
                + ", the calls that wait for the device's queued work (the wait is not in the estimate)",
            )
    if res.get("min_capacity") is not None:
        at = res.get("at_min_capacity") or {}
        row(
            "smallest device",
            f"{format_bytes(res['min_capacity'])} ({res['min_capacity_ratio']:.3f} x peak allocated; "
            f"{len(res.get('min_capacity_tries') or ())} tries, to 1 % of peak allocated); there: "
            f"{at.get('device_calls_total', 0):,} device calls, estimated {at.get('device_call_ms', 0.0):.1f} ms "
            f"({at.get('device_ms_after_warmup', 0.0):.1f} ms after warm-up)",
        )
    if res.get("releases"):
        row("releases", f"{res['releases']:,} recorded releases replayed as empty_cache")
    elif res.get("releases_ignored"):
        row("releases", f"{res['releases_ignored']:,} recorded releases left out (--ignore-releases)")
    plan = res.get("plan") or {}
    if plan.get("plan_state"):  # the planned policy: what the step plan did
        row("step plan", plan_line(plan))
    row("replay speed", f"{res['ns_per_op']:.0f} ns/op, {res['events_per_s'] / 1e6:.2f} M events/s")
    if res["oom"]:
        where = f" on device {res['oom_device']}" if res.get("oom_device") is not None else ""
        row(
            "out of memory",
            f"YES{where}: at event {res['oom_event']:,}, allocating "
            f"{format_bytes(res['oom_size'])} ({res['oom_size']:,} B); the replay stopped there",
        )
    else:
        row("out of memory", "no")
    return lines


#: The step plan's states (pool.info()["plan_state"]; Note [Learning the step]).
PLAN_STATES = ("off", "learning", "planning", "armed", "serving", "lost", "dropped", "adopting")


def plan_line(plan: Dict[str, Any]) -> str:
    """The step plan's figures in one line (a replay's ``res["plan"]``)."""
    state = PLAN_STATES[plan["plan_state"]] if plan["plan_state"] < len(PLAN_STATES) else "?"
    if not plan["plans"]:
        return (
            f"{state}: no plan adopted (no step repeated, or the free memory could not hold it "
            f"without growing); {plan['plan_us'] / 1000:.1f} ms spent planning"
        )
    served, missed = plan["plan_served"], plan["plan_missed"]
    return (
        f"{state}: {plan['plans']} plan(s) adopted, {plan['plan_drops']} dropped; a step of "
        f"{plan['plan_step_allocs']:,} allocations, {plan['plan_planned']:,} planned; {served:,} allocations "
        f"served by position, {missed:,} by the pool while a plan was held; "
        f"{plan['plan_us'] / 1000:.1f} ms spent planning"
    )


def format_report(res: Dict[str, Any], title: Optional[str] = None) -> str:
    """A replay's result for people, one figure a line."""
    lines = []
    if title:
        lines.append(title)
    lines.append(f"{'policy':<16}{res['policy']}" + (f" ({res['config']})" if res["config"] else " (defaults)"))
    unlimited = res["capacity"] == DEFAULT_CAPACITY
    lines.append(f"{'capacity':<16}" + ("unlimited" if unlimited else format_bytes(res["capacity"])))
    devices = res.get("devices")
    if devices:
        lines.append(f"{'devices':<16}{', '.join(devices)} (each on its own pool; totals first)")
    elif res.get("device") is not None:
        lines.append(f"{'device':<16}{res['device']}")
    lines += _report_lines(res)
    for d, r in (devices or {}).items():
        lines.append(f"device {d}:")
        lines += _report_lines(r, indent="  ")
    return "\n".join(lines) + "\n"

"""Replay every workload's trace under the built-in allocator's rules and under cudapool's.

    python benchmarks/replay_all.py [--scale small|medium|large] [--workloads gpt,cnn]
                                    [--json PATH] [--plot PATH | --no-plot] [--recapture]
                                    [--device-costs PATH]

For each workload of ``benchmarks/workloads`` (``WORKLOADS``): load its trace from
``build/traces/<workload>-<scale>.cptrace``, capturing and saving it first when it is missing
(or unreadable, or with --recapture); replay it through the pool on a simulated device under
the ``builtin``, ``expandable`` (expandable_segments:True) and ``cudapool`` policies; then print two markdown tables
(the memory, and the device calls' estimated time), write the
results as JSON (default ``build/replay-all.json``:
``{"scale": ..., "device_costs": {"source", "costs"}, "rows": [{"workload", "events",
"policies": {"builtin": {...}, "cudapool": {...}}, "targets": {...}}], "errors": [...]}``,
the policies' dicts holding cudapool.lab.replay's keys less the curve, among them the device
calls per kind, all and after warm-up, their estimated milliseconds, during and after warm-up, and the
counts of the calls that wait for the device) and draw the gpt workload's allocated and reserved
memory over the trace under both policies (default ``build/replay-gpt.png``; needs
matplotlib: ``pip install -e '.[bench]'``).

Then the same traces as the windowed torch snapshots a user records: each trace is run under
the ``builtin`` policy on the simulator, written as the snapshot the built-in allocator would
have dumped, and its history cut at WINDOW_CUT (``benchmarks/window_snapshot.py``). Each such
snapshot is replayed as ``python -m cudapool replay`` would, from the reconstructed state at
the window's start, under every policy, and from an empty pool (what replays did before they
reconstructed the start). The last table puts those peaks beside the recorded built-in peak
over the window (the truth); the JSON holds them under ``"windows"``.

Beside the memory, the table shows what each policy costs in device calls: their estimated
milliseconds (``dev call ms``: calls x per-call cost, from ``cudapool.lab.device_costs`` or the
JSON of ``benchmarks/device_call_costs.py`` given with --device-costs) and how many calls
come after warm-up (from the later of half the events and the trace's peak of live bytes on:
0 for a loop that is warm). A second,
narrower table (printed after it) splits the estimate into warm-up and after warm-up, and counts the calls after
warm-up that wait for the device's queued work (``device_costs.SYNC_KINDS``: cudaFree,
cudaEventSynchronize, cuMemUnmap, cuMemSetAccess; the wait is in no estimate), each cell
"builtin / expandable / cudapool". Every figure of both tables is the simulator's, and the
headers say so.

The targets are checked and reported, not enforced: cudapool reserves no more than the
built-in rules, and strictly less where those use less than 95 % of what they reserve;
cudapool's utilization is at least 90 % on gpt; both replays run at 1 M events/s or more.
The exit status is non-zero only when something failed to run (a capture, a replay, the
plot).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

try:
    import cudapool  # noqa: F401
except ImportError:  # not installed: the in-place build
    sys.path.insert(0, os.path.join(ROOT, "python"))

from cudapool._units import format_bytes  # noqa: E402
from cudapool.lab import device_costs  # noqa: E402
from cudapool.lab.capacity import AT_MIN_KEYS, min_capacity  # noqa: E402
from cudapool.lab.replay import replay  # noqa: E402
from cudapool.lab.torch_snapshot import from_snapshot  # noqa: E402
from cudapool.lab.trace import load, save  # noqa: E402
from window_snapshot import simulate  # noqa: E402

POLICIES = ("builtin", "expandable", "cudapool")
SCALES = ("small", "medium", "large")
PLOT_WORKLOAD = "gpt"
CURVE_POINTS = 2000
#: Where the windowed snapshots' history starts, as a fraction of the trace's events.
WINDOW_CUT = 0.5

#: Target figures (reported, not enforced).
STRICT_BELOW_UTILIZATION = 0.95
#: The smallest device: at most this many times peak allocated, on workloads of at least
#: SMALLEST_DEVICE_FROM bytes allocated at peak.
SMALLEST_DEVICE_RATIO = 1.05
SMALLEST_DEVICE_FROM = 256 << 20
#: cudapool's warm-up device time: at most this many times expandable segments'.
WARMUP_RATIO = 1.5
#: The snapshots with recorded releases give memory back every this fraction of the events.
RELEASE_EVERY = 0.25
GPT_UTILIZATION = 0.90
EVENTS_PER_S = 1_000_000

EXIT_FAILED = 1
EXIT_USAGE = 2


def _err(message: str) -> None:
    print(f"replay_all: {message}", file=sys.stderr)


def _load_registry(module_name: str) -> Dict[str, Any]:
    """The registry's WORKLOADS: name -> capture callable (or a module with capture())."""
    for path in (HERE, ROOT):
        if path not in sys.path:
            sys.path.insert(0, path)
    module = importlib.import_module(module_name)
    workloads = getattr(module, "WORKLOADS", None)
    if not isinstance(workloads, dict):
        raise ImportError(f"{module_name} has no WORKLOADS dict")
    return workloads


def _capture_fn(entry: Any) -> Any:
    if callable(entry):
        return entry
    fn = getattr(entry, "capture", None)
    if callable(fn):
        return fn
    raise TypeError(f"a workload must be a capture callable or have capture(), not {entry!r}")


def get_trace(name: str, entry: Any, scale: str, trace_dir: str, recapture: bool) -> Dict[str, Any]:
    """The workload's trace: from the cache, else captured and cached."""
    path = os.path.join(trace_dir, f"{name}-{scale}.cptrace")
    if os.path.isfile(path) and not recapture:
        try:
            return {"trace": load(path), "path": path, "captured": False, "capture_s": None}
        except (OSError, EOFError, ValueError) as exc:
            _err(f"{path}: {exc}; capturing it again")
    print(f"capturing {name} ({scale}) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    trace = _capture_fn(entry)(scale=scale, seed=0)
    capture_s = time.perf_counter() - t0
    os.makedirs(trace_dir, exist_ok=True)
    tmp = path + ".tmp"
    save(trace, tmp)
    os.replace(tmp, path)
    return {"trace": trace, "path": path, "captured": True, "capture_s": capture_s}


def check_targets(name: str, b: Dict[str, Any], c: Dict[str, Any], e: Dict[str, Any]) -> Dict[str, Any]:
    """Each target: {"ok": bool, "why": text}; "ok" overall."""
    targets: Dict[str, Any] = {}
    if c.get("min_capacity") is not None:
        fits = [c["min_capacity"] <= r["min_capacity"] for r in (b, e) if r.get("min_capacity") is not None]
        big = c["peak_allocated"] >= SMALLEST_DEVICE_FROM
        targets["smallest"] = {
            "ok": all(fits) and (not big or c["min_capacity_ratio"] <= SMALLEST_DEVICE_RATIO),
            "why": f"cudapool's smallest device ({c['min_capacity_ratio']:.3f} x peak allocated) must be at most "
            "builtin's and expandable's" + (f", and at most {SMALLEST_DEVICE_RATIO} x" if big else ""),
        }
    targets["calls"] = {
        "ok": c["device_calls_after_warmup_total"] <= e["device_calls_after_warmup_total"],
        "why": f"cudapool's device calls after warm-up ({c['device_calls_after_warmup_total']:,}) must be at most "
        f"expandable's ({e['device_calls_after_warmup_total']:,})",
    }
    targets["warmup"] = {
        "ok": c["device_ms_warmup"] <= WARMUP_RATIO * e["device_ms_warmup"],
        "why": f"cudapool's warm-up device time ({c['device_ms_warmup']:.2f} ms, est.) must be at most "
        f"{WARMUP_RATIO} x expandable's ({e['device_ms_warmup']:.2f} ms)",
    }
    strict = b["utilization"] < STRICT_BELOW_UTILIZATION
    ok = c["peak_reserved"] < b["peak_reserved"] if strict else c["peak_reserved"] <= b["peak_reserved"]
    why = (
        f"cudapool's peak reserved ({format_bytes(c['peak_reserved'])}) must be "
        + ("below" if strict else "at most")
        + f" builtin's ({format_bytes(b['peak_reserved'])})"
        + (f" where builtin's utilization ({b['utilization'] * 100:.1f} %) is under 95 %" if strict else "")
    )
    targets["reserved"] = {"ok": ok, "why": why, "strict": strict}
    if name == PLOT_WORKLOAD:
        targets["utilization"] = {
            "ok": c["utilization"] >= GPT_UTILIZATION,
            "why": f"cudapool's utilization ({c['utilization'] * 100:.1f} %) must be at least 90 %",
        }
    slowest = min(b["events_per_s"], c["events_per_s"])
    targets["speed"] = {
        "ok": slowest >= EVENTS_PER_S,
        "why": f"the slower replay ({slowest / 1e6:.2f} M events/s) must reach 1 M events/s",
    }
    targets["ok"] = all(t["ok"] for t in targets.values() if isinstance(t, dict))
    return targets


def _targets_cell(targets: Dict[str, Any]) -> str:
    marks = []
    for key, label in (
        ("reserved", "reserved"), ("smallest", "smallest device"), ("calls", "calls ≤ exp."),
        ("warmup", "warm-up ≤ 1.5 x exp."), ("utilization", "util ≥ 90 %"), ("speed", "≥ 1 M ev/s"),
    ):  # fmt: skip
        t = targets.get(key)
        if t is None:
            continue
        if key == "reserved":
            label = "reserved <" if t["strict"] else "reserved ≤"
        marks.append(f"{'✓' if t['ok'] else '✗'} {label}")
    return ", ".join(marks)


def format_table(rows: List[Dict[str, Any]]) -> str:
    head = ["workload", "events"]
    for label, _ in _COLUMNS:
        head += [f"{p} {label}" for p in POLICIES]
    head += ["cudapool / expandable", "targets"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        cells = [row["workload"], f"{row['events']:,}"]
        for _, cell in _COLUMNS:
            cells += [cell(row["policies"][p]) for p in POLICIES]
        cells.append(_versus_cell(row.get("versus_expandable")))
        cells.append(_targets_cell(row["targets"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: The table's figures, one column per policy each: (label, cell from a replay's result).
_COLUMNS = (
    ("peak reserved", lambda r: format_bytes(r["peak_reserved"])),
    ("util", lambda r: f"{r['utilization'] * 100:.1f} %"),
    ("ns/op", lambda r: f"{r['ns_per_op']:.0f}"),
    ("dev allocs", lambda r: f"{r['device_allocs']:,}"),
    ("dev call ms", lambda r: f"{r['device_call_ms']:.2f}"),
    ("calls after warm-up", lambda r: f"{r['device_calls_after_warmup_total']:,}"),
)


#: The second table's figures, one column each, the policies' in POLICIES order in every cell:
#: (header, cell from a replay's result). All come from the simulated device's counters; the
#: milliseconds are those counts priced by the cost table (cudapool.lab.device_costs).
_DEVICE_COLUMNS = (
    ("sim warm-up device ms (est.)", lambda r: f"{r['device_ms_warmup']:.2f}"),
    ("sim device ms after warm-up (est.)", lambda r: f"{r['device_ms_after_warmup']:.2f}"),
    ("sim calls after warm-up", lambda r: f"{r['device_calls_after_warmup_total']:,}"),
    ("sim sync calls after warm-up", lambda r: f"{r['sync_calls_after_warmup']:,}"),
)


def format_device_table(rows: List[Dict[str, Any]]) -> str:
    """The device-time table: one column per figure, each cell "builtin / expandable /
    cudapool" (narrow enough to paste as it is)."""
    head = ["workload", "events"] + [label for label, _ in _DEVICE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        cells = [row["workload"], f"{row['events']:,}"]
        for _, cell in _DEVICE_COLUMNS:
            cells.append(" / ".join(cell(row["policies"][p]) for p in POLICIES))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_capacity_table(rows: List[Dict[str, Any]]) -> str:
    """The smallest-device table: per workload, peak allocated, and per policy (each cell
    "builtin / expandable / cudapool") the smallest device as a ratio to peak allocated and
    the estimated device ms there (all, and after warm-up)."""
    head = ["workload", "peak allocated (cudapool)", "sim smallest device / peak allocated",
            "sim smallest device", "sim device ms there (est.)", "sim ms after warm-up there"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in rows:
        ps = [row["policies"][p] for p in POLICIES]
        if any(r.get("min_capacity") is None for r in ps):
            continue
        cells = [
            row["workload"],
            format_bytes(row["policies"]["cudapool"]["peak_allocated"]),
            " / ".join(f"{r['min_capacity_ratio']:.3f}" for r in ps),
            " / ".join(format_bytes(r["min_capacity"]) for r in ps),
            " / ".join(f"{r['at_min_capacity']['device_call_ms']:.1f}" for r in ps),
            " / ".join(f"{r['at_min_capacity']['device_ms_after_warmup']:.1f}" for r in ps),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def replay_releases(name: str, trace: Any) -> Dict[str, Any]:
    """The trace as a whole torch snapshot whose history gives memory back (empty_cache every
    RELEASE_EVERY of the events, made on the simulator under the built-in rules), replayed under
    builtin with its recorded releases and without them."""
    made = simulate(trace, cut=0, empty_cache_every=max(1, int(len(trace) * RELEASE_EVERY)))
    snap = from_snapshot(made["full"], source=f"{name} with releases")
    with_r = replay(snap, policy="builtin")
    without = replay(snap, policy="builtin", releases=False)
    return {
        "workload": name,
        "recorded_peak_reserved": snap.builtin_peak_reserved,
        "releases": with_r["releases"],
        "builtin_peak_reserved": with_r["peak_reserved"],
        "builtin_peak_reserved_without_releases": without["peak_reserved"],
    }


def format_release_table(rows: List[Dict[str, Any]]) -> str:
    def pct(x: int, truth: int) -> str:
        return f"{100.0 * (x - truth) / truth:+.1f} %" if truth else "-"

    lines = [
        "| workload | recorded releases | recorded builtin peak | builtin replay | builtin replay without releases |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        truth = r["recorded_peak_reserved"]
        w, wo = r["builtin_peak_reserved"], r["builtin_peak_reserved_without_releases"]
        lines.append(
            f"| {r['workload']} | {r['releases']:,} | {format_bytes(truth)} | {format_bytes(w)} ({pct(w, truth)}) | "
            f"{format_bytes(wo)} ({pct(wo, truth)}) |"
        )
    return "\n".join(lines) + "\n"


def compare_expandable(c: Dict[str, Any], e: Dict[str, Any]) -> Dict[str, Any]:
    """cudapool against the expandable-segments yardstick: reported, not a target."""
    ratio = c["peak_reserved"] / e["peak_reserved"] if e["peak_reserved"] else None
    return {
        "cudapool_peak_reserved": c["peak_reserved"],
        "expandable_peak_reserved": e["peak_reserved"],
        "ratio": ratio,
    }


def _versus_cell(v: Any) -> str:
    if not v or v.get("ratio") is None:
        return "-"
    return f"{v['ratio']:.3f} x"


def plot(row: Dict[str, Any], curves: Dict[str, List[List[int]]], builtin_reserved: Any, path: str, scale: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak = max((p[2] for curve in curves.values() for p in curve), default=0)
    unit, div = ("GiB", 1 << 30) if peak >= 1 << 30 else ("MiB", 1 << 20)
    fig, ax = plt.subplots(figsize=(10, 5.5))
    colors = {"builtin": "tab:red", "cudapool": "tab:blue"}
    for policy, curve in curves.items():
        xs = [p[0] for p in curve]
        res = row["policies"][policy]
        ax.plot(
            xs,
            [p[2] / div for p in curve],
            color=colors.get(policy),
            lw=1.6,
            label=f"{policy} reserved (peak {format_bytes(res['peak_reserved'])})",
        )
        ax.plot(
            xs,
            [p[1] / div for p in curve],
            color=colors.get(policy),
            lw=1.0,
            ls="--",
            label=f"{policy} allocated (peak {format_bytes(res['peak_allocated'])})",
        )
    if builtin_reserved:
        ax.step(
            [p[0] for p in builtin_reserved],
            [p[1] / div for p in builtin_reserved],
            where="post",
            color="black",
            lw=1.0,
            alpha=0.6,
            label="built-in allocator, recorded run",
        )
    ax.set_xlabel("event index")
    ax.set_ylabel(unit)
    ax.set_title(
        f"{row['workload']} ({scale}, {row['events']:,} events): allocated and reserved memory (maxima per window)"
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replay_window(name: str, trace: Any) -> Dict[str, Any]:
    """The trace as a windowed torch snapshot (history from WINDOW_CUT on), replayed from the
    reconstructed start under every policy and, for builtin, from an empty pool."""
    cut = int(len(trace) * WINDOW_CUT)
    made = simulate(trace, cut=cut)
    snap = from_snapshot(made["window"], source=f"{name} window")
    results = {p: replay(snap, policy=p) for p in POLICIES}
    empty = replay(snap, policy="builtin", window_start=False)
    truth = made["truth"]
    return {
        "workload": name,
        "cut_event": cut,
        "recorded_peak_reserved": truth["window_peak_reserved"],
        "start_reserved": truth["reserved"],
        "start_live_bytes": sum(size for _, size, _ in truth["blocks"]),
        "policies": {
            p: {k: r[k] for k in ("peak_reserved", "comparable", "not_comparable")} for p, r in results.items()
        },
        "builtin_empty_start_peak_reserved": empty["peak_reserved"],
    }


def format_window_table(rows: List[Dict[str, Any]]) -> str:
    def pct(x: int, truth: int) -> str:
        return f"{100.0 * (x - truth) / truth:+.1f} %" if truth else "-"

    lines = [
        "| workload | window from event | live / reserved at its start | recorded builtin peak | "
        "builtin replay | builtin from an empty pool | expandable replay | cudapool replay |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        truth = r["recorded_peak_reserved"]
        b = r["policies"]["builtin"]["peak_reserved"]
        e = r["builtin_empty_start_peak_reserved"]
        c = r["policies"]["cudapool"]["peak_reserved"]
        x = r["policies"]["expandable"]["peak_reserved"]
        lines.append(
            f"| {r['workload']} | {r['cut_event']:,} | {format_bytes(r['start_live_bytes'])} / "
            f"{format_bytes(r['start_reserved'])} | {format_bytes(truth)} | {format_bytes(b)} ({pct(b, truth)}) | "
            f"{format_bytes(e)} ({pct(e, truth)}) | {format_bytes(x)} ({pct(x, truth)}) | "
            f"{format_bytes(c)} ({pct(c, truth)}) |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Replay every workload under the built-in allocator's rules and under cudapool's; "
        "print one markdown table, write JSON and a plot of the gpt workload."
    )
    parser.add_argument("--scale", choices=SCALES, default="small")
    parser.add_argument("--workloads", metavar="A,B", help="only these workloads (default: all registered)")
    parser.add_argument("--json", metavar="PATH", default=os.path.join(ROOT, "build", "replay-all.json"))
    parser.add_argument("--plot", metavar="PATH", default=os.path.join(ROOT, "build", f"replay-{PLOT_WORKLOAD}.png"))
    parser.add_argument("--no-plot", action="store_true", help="draw no plot (matplotlib not needed)")
    parser.add_argument("--recapture", action="store_true", help="capture every trace again")
    parser.add_argument(
        "--device-costs",
        metavar="PATH",
        help="per-call costs measured on a GPU (benchmarks/device_call_costs.py's JSON) in place of "
        "cudapool.lab.device_costs' default table",
    )
    parser.add_argument("--trace-dir", metavar="DIR", default=os.path.join(ROOT, "build", "traces"))
    parser.add_argument(
        "--registry",
        metavar="MODULE",
        default="workloads",
        help="the module whose WORKLOADS to run (default: benchmarks/workloads)",
    )
    args = parser.parse_args(argv)

    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _err("matplotlib is needed for the plot: pip install -e '.[bench]' (or pass --no-plot)")
            return EXIT_USAGE

    try:
        registry = _load_registry(args.registry)
    except ImportError as exc:
        _err(f"cannot load the workloads ({args.registry}): {exc}")
        return EXIT_FAILED
    names = list(registry)
    if args.workloads:
        names = [n.strip() for n in args.workloads.split(",") if n.strip()]
        unknown = [n for n in names if n not in registry]
        if unknown:
            _err(f"unknown workload(s) {', '.join(unknown)} (known: {', '.join(registry) or 'none'})")
            return EXIT_USAGE
    if not names:
        print("no workloads registered: nothing to replay")

    rows: List[Dict[str, Any]] = []
    windows: List[Dict[str, Any]] = []
    released: List[Dict[str, Any]] = []
    errors: List[Dict[str, str]] = []
    plot_data = None
    for name in names:
        try:
            got = get_trace(name, registry[name], args.scale, args.trace_dir, args.recapture)
            trace = got["trace"]
            want_curve = not args.no_plot and name == PLOT_WORKLOAD
            results = {}
            for policy in POLICIES:
                results[policy] = replay(
                    trace,
                    policy=policy,
                    progress=True,
                    curve_points=CURVE_POINTS if want_curve else 0,
                    costs=args.device_costs,
                )
                found = min_capacity(trace, policy=policy, unlimited=results[policy], costs=args.device_costs)
                results[policy]["min_capacity"] = found["min_capacity"]
                results[policy]["min_capacity_ratio"] = found["ratio"]
                results[policy]["min_capacity_tries"] = len(found["tries"])
                at = found["at_min"]
                results[policy]["at_min_capacity"] = {k: at[k] for k in AT_MIN_KEYS if k in at}
            curves = {p: r.pop("curve") for p, r in results.items() if "curve" in r}
            row = {
                "workload": name,
                "events": len(trace),
                "trace": os.path.relpath(got["path"], ROOT),
                "captured": got["captured"],
                "capture_s": got["capture_s"],
                "trace_builtin_peak_reserved": trace.builtin_peak_reserved,
                "policies": results,
                "targets": check_targets(name, results["builtin"], results["cudapool"], results["expandable"]),
                "versus_expandable": compare_expandable(results["cudapool"], results["expandable"]),
            }
            rows.append(row)
            windows.append(replay_window(name, trace))
            released.append(replay_releases(name, trace))
            if curves:
                plot_data = (row, curves, trace.builtin_reserved)
        except Exception as exc:  # report it, go on with the others
            traceback.print_exc()
            errors.append({"workload": name, "error": f"{exc.__class__.__name__}: {exc}"})

    print(
        f"replay of the {args.scale} workloads on a simulated device: every figure below is the simulator's "
        f"(peak reserved: lower is better; util = peak allocated / peak reserved; ns/op = host time of the replay, "
        f"the simulated device's work included; dev call ms = the device calls' estimated milliseconds, costs "
        f"from {args.device_costs or 'cudapool.lab.device_costs'}; calls after warm-up = device calls after warm-up: from "
        f"the later of half the events and the trace's peak of live bytes on)\n"
    )
    print(format_table(rows))
    print(
        f"device calls and their estimated time, per policy (each cell: {' / '.join(POLICIES)}; sim = counted "
        "on the simulated device, not measured on a GPU; est. ms = those calls priced by the cost table, "
        "without the waits; warm-up = up to the later of half the events and the trace's peak of live bytes, calls of the pool's start-up included; "
        "sync calls = calls that wait for the device's queued work: "
        f"{', '.join(device_costs.SYNC_KINDS)}):\n"
    )
    print(format_device_table(rows))
    print(
        f"the smallest device each policy runs on, simulated (bisection of the capacity to 1 % of peak "
        f"allocated, the pool's whole out-of-memory ladder at each try; each cell: {' / '.join(POLICIES)}), and "
        "the device calls' estimated time there:\n"
    )
    print(format_capacity_table(rows))
    met = sum(1 for r in rows if r["targets"]["ok"])
    print(
        f"targets met on {met} of {len(rows)} workload(s); replay speed (min over policies): "
        + ", ".join(
            f"{r['workload']} {min(p['events_per_s'] for p in r['policies'].values()) / 1e6:.2f} M ev/s" for r in rows
        )
    )
    for r in rows:
        if r["trace_builtin_peak_reserved"]:
            print(
                f"{r['workload']}: the trace records the built-in allocator's peak reserved in the real run: "
                f"{format_bytes(r['trace_builtin_peak_reserved'])}"
            )
        for key, t in r["targets"].items():
            if isinstance(t, dict) and not t["ok"]:
                print(f"{r['workload']}: target missed: {t['why']}")
    if windows:
        print(
            f"\nthe same runs as windowed torch snapshots (history from {WINDOW_CUT:.0%} of the events on, "
            "made on the simulator under the built-in rules), replayed from the reconstructed start:\n"
        )
        print(format_window_table(windows))
    if released:
        print(
            f"\nsnapshots with recorded releases (made on the simulator under the built-in rules, empty_cache every "
            f"{RELEASE_EVERY:.0%} of the events: segment_free entries), replayed under builtin with the releases "
            "(the default) and without (--ignore-releases):\n"
        )
        print(format_release_table(released))
    for e in errors:
        print(f"{e['workload']}: FAILED: {e['error']}")

    status = EXIT_FAILED if errors else 0
    if not args.no_plot:
        if plot_data is not None:
            try:
                plot(*plot_data, path=args.plot, scale=args.scale)
                print(f"plot: {args.plot}")
            except Exception as exc:
                traceback.print_exc()
                _err(f"cannot draw {args.plot}: {exc}")
                status = EXIT_FAILED
        else:
            print(f"plot: none ({PLOT_WORKLOAD} was not replayed)")

    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        costs = device_costs.load(args.device_costs)
        json.dump(
            {
                "scale": args.scale,
                "device_costs": {"source": args.device_costs or "cudapool.lab.device_costs", "costs": costs},
                "rows": rows,
                "windows": windows,
                "releases": released,
                "errors": errors,
            },
            f,
            indent=1,
        )
        f.write("\n")
    print(f"json: {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())

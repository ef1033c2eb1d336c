"""Memory against device time: policy variants replayed on traces, and the frontier they draw.

    python benchmarks/frontier.py [--scale small|medium] [--traces PATH,...] [--variants A,B]
                                  [--tolerance 0.001] [--jobs N] [--min-peak 256MiB]
                                  [--json PATH] [--plot PATH | --no-plot] [--list]

Every trace is replayed under every variant on the simulated device (``cudapool.lab.replay``):
once on an unlimited device (peak reserved, utilization = peak allocated / peak reserved, the
device calls and their estimated time during and after warm-up, from the cost table of
``cudapool.lab.device_costs``), then on devices of shrinking capacity until the smallest one
it runs on is known to ``--tolerance`` x peak allocated (``cudapool.lab.capacity``, the pool's
whole out-of-memory ladder at each try). The traces, by default, are those that exist of
``build/traces/<workload>-<scale>.cptrace`` (the lab's workloads: ``make lab`` or
``benchmarks/workloads/<name>.py --out`` makes them) and ``build/traces/public/*-<scale>.cptrace``
(public model code: ``benchmarks/public_models.py``).

The variants (``VARIANTS``) are the two yardsticks (``builtin``, ``expandable``) and
configurations of cudapool's page-stitching policy that trade the number of physical handles
(each cuMemCreate costs about 0.2 ms whatever its size) against memory stranded in handles
that are partly in use. Per variant the report gives, over the traces whose peak allocated is
at least ``--min-peak`` (the targets' population): the worst and the median utilization, the
worst smallest device / peak allocated, how many traces need a larger device than ``builtin``
or ``expandable`` do, warm-up device time as a multiple of ``expandable``'s (geometric mean and
worst), and the device calls after warm-up above ``expandable``'s. ``--plot`` draws warm-up
device time against median utilization and median smallest device, one point per variant.
Every figure is the simulator's.

Runs in ``--jobs`` processes (default: the number of CPUs); one line per finished replay on
stderr. Results go to ``--json`` (default ``build/frontier-<scale>.json``), one row per
(trace, variant).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from cudapool._units import format_bytes, parse_size  # noqa: E402
from cudapool.lab.capacity import min_capacity  # noqa: E402
from cudapool.lab.replay import replay  # noqa: E402

LAB_WORKLOADS = ("gpt", "cnn", "kvcache", "rmm_random", "vit", "unet", "moe", "lstm")

#: name -> (policy, extra configuration, what it is).
VARIANTS: Dict[str, Tuple[str, str, str]] = {
    "builtin": ("builtin", "", "the built-in allocator's rules"),
    "expandable": ("expandable", "", "built-in rules, expandable_segments:True (20 MiB chunks)"),
    "pages": (
        "cudapool",
        "large_segment_mb:2,min_large_alloc_mb:2,stitch_partial_handles:False",
        "a 2 MiB handle per page, wholly free handles stitch (the default until 2026-12-01)",
    ),
    "handles-20": (
        "cudapool",
        "stitch_partial_handles:False",
        "handles follow growth (at most 20 MiB), wholly free handles stitch (2026-12-01..03)",
    ),
    "pages+part": (
        "cudapool",
        "large_segment_mb:2,min_large_alloc_mb:2",
        "a 2 MiB handle per page, handles in part use stitch too",
    ),
    "handles-8+part": (
        "cudapool",
        "large_segment_mb:8,min_large_alloc_mb:8",
        "handles follow growth (at most 8 MiB), in part use stitch",
    ),
    "cudapool": ("cudapool", "", "handles follow growth (at most 20 MiB), handles in part use stitch: the default"),
    "handles-64+part": (
        "cudapool",
        "large_segment_mb:64",
        "handles follow growth (at most 64 MiB), in part use stitch",
    ),
    "planned": ("planned", "", "the default, and the step plan (plan_steps): a repeating step served by position"),
}

#: The variant the targets are checked for.
CHOSEN = "cudapool"


def default_traces(scale: str) -> List[str]:
    lab = [os.path.join(ROOT, "build", "traces", f"{w}-{scale}.cptrace") for w in LAB_WORKLOADS]
    public = sorted(glob.glob(os.path.join(ROOT, "build", "traces", "public", f"*-{scale}.cptrace")))
    return [p for p in lab if os.path.isfile(p)] + public


def trace_name(path: str) -> str:
    base = os.path.basename(path)
    name = base[: -len(".cptrace")] if base.endswith(".cptrace") else base
    return ("public/" if os.path.basename(os.path.dirname(path)) == "public" else "") + name


def run_one(path: str, variant: str, tolerance: float) -> Dict[str, Any]:
    """One trace under one variant: the unlimited replay's figures and the smallest device."""
    policy, config, _ = VARIANTS[variant]
    t0 = time.perf_counter()
    unlimited = replay(path, policy=policy, config=config or None)
    found = min_capacity(path, policy=policy, config=config or None, tolerance=tolerance, unlimited=unlimited)
    keys = (
        "events", "peak_allocated", "peak_reserved", "utilization", "device_ms_warmup", "device_ms_after_warmup",
        "device_calls_total", "device_calls_after_warmup_total", "sync_calls_after_warmup", "stitches",
        "stitch_reuses", "device_faults", "plan",
    )  # fmt: skip
    row: Dict[str, Any] = {"trace": trace_name(path), "path": path, "variant": variant}
    row.update({k: unlimited.get(k) for k in keys})
    row["min_capacity"] = found["min_capacity"]
    row["min_capacity_ratio"] = found["ratio"]
    row["min_capacity_floor"] = found["peak_allocated"]
    row["tries"] = len(found["tries"])
    row["wall_s"] = time.perf_counter() - t0
    return row


def _geomean(xs: List[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(rows: List[Dict[str, Any]], variants: List[str], min_peak: int) -> Dict[str, Dict[str, Any]]:
    """Per variant, the figures over the traces of at least ``min_peak`` peak allocated."""
    by: Dict[Tuple[str, str], Dict[str, Any]] = {(r["trace"], r["variant"]): r for r in rows}
    traces = sorted({r["trace"] for r in rows})
    big = [
        t for t in traces if all((t, v) in by for v in variants) and by[(t, variants[0])]["peak_allocated"] >= min_peak
    ]
    out: Dict[str, Dict[str, Any]] = {}
    for v in variants:
        rs = [by[(t, v)] for t in big]
        if not rs:
            continue
        worst_u = min(rs, key=lambda r: r["utilization"])
        worst_d = max(rs, key=lambda r: r["min_capacity_ratio"] or 0)
        warm = [r["device_ms_warmup"] / by[(r["trace"], "expandable")]["device_ms_warmup"]
                for r in rs if ("expandable" in variants and by[(r["trace"], "expandable")]["device_ms_warmup"] > 0)]  # fmt: skip
        larger = [
            r["trace"] for r in rs
            if any(r["min_capacity"] > by[(r["trace"], y)]["min_capacity"] for y in ("builtin", "expandable") if y in variants)
        ]  # fmt: skip
        calls_above = [
            r["trace"] for r in rs
            if "expandable" in variants
            and r["device_calls_after_warmup_total"] > by[(r["trace"], "expandable")]["device_calls_after_warmup_total"]
        ]  # fmt: skip
        out[v] = {
            "traces": len(rs),
            "worst_utilization": worst_u["utilization"],
            "worst_utilization_trace": worst_u["trace"],
            "median_utilization": statistics.median(r["utilization"] for r in rs),
            "worst_min_capacity_ratio": worst_d["min_capacity_ratio"],
            "worst_min_capacity_trace": worst_d["trace"],
            "median_min_capacity_ratio": statistics.median(r["min_capacity_ratio"] for r in rs),
            "larger_device_than_a_yardstick": larger,
            "warmup_vs_expandable_geomean": _geomean(warm),
            "warmup_vs_expandable_worst": max(warm) if warm else float("nan"),
            "warmup_ms_total": sum(r["device_ms_warmup"] for r in rs),
            "calls_after_warmup_above_expandable": calls_above,
            "device_faults": sum(r["device_faults"] or 0 for r in rs),
        }
    return out


def format_rows(rows: List[Dict[str, Any]], variants: List[str]) -> str:
    """One line per trace: per variant, utilization / smallest device ratio / warm-up ms."""
    by = {(r["trace"], r["variant"]): r for r in rows}
    traces = sorted({r["trace"] for r in rows}, key=lambda t: (t.startswith("public/"), t))
    head = "| trace | peak allocated | " + " | ".join(f"{v}: util / smallest / warm-up ms" for v in variants) + " |"
    lines = [head, "|" + "---|" * (2 + len(variants))]
    for t in traces:
        first = next((by[(t, v)] for v in variants if (t, v) in by), None)
        if first is None:
            continue
        cells = []
        for v in variants:
            r = by.get((t, v))
            cells.append(
                "–" if r is None
                else f"{r['utilization']:.3f} / {r['min_capacity_ratio']:.3f} / {r['device_ms_warmup']:.1f}"
            )  # fmt: skip
        lines.append(f"| {t} | {format_bytes(first['peak_allocated'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_summary(summary: Dict[str, Dict[str, Any]]) -> str:
    lines = [
        "| variant | what | traces | sim util, worst (trace) | sim util, median | sim smallest device / peak allocated, "
        "worst (trace) | larger device than builtin or expandable | sim warm-up device time / expandable's, "
        "geomean (worst) | calls after warm-up above expandable's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v, s in summary.items():
        lines.append(
            f"| {v} | {VARIANTS[v][2]} | {s['traces']} | {s['worst_utilization']:.3f} ({s['worst_utilization_trace']}) | "
            f"{s['median_utilization']:.3f} | {s['worst_min_capacity_ratio']:.3f} ({s['worst_min_capacity_trace']}) | "
            f"{len(s['larger_device_than_a_yardstick'])} | "
            f"{s['warmup_vs_expandable_geomean']:.2f} x ({s['warmup_vs_expandable_worst']:.2f} x) | "
            f"{len(s['calls_after_warmup_above_expandable'])}"
            + (f" ({', '.join(s['calls_after_warmup_above_expandable'])})" if s["calls_after_warmup_above_expandable"] else "")
            + " |"
        )  # fmt: skip
    return "\n".join(lines)


def plot(summary: Dict[str, Dict[str, Any]], path: str, title: str) -> None:
    """Warm-up device time against median utilization and median smallest device, a point per
    variant (builtin, far off on memory, is left out so that the others can be told apart)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {v: s for v, s in summary.items() if v != "builtin"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    keys = ("median_utilization", "median_min_capacity_ratio")
    for i, (v, s) in enumerate(sorted(shown.items(), key=lambda kv: kv[1]["warmup_vs_expandable_geomean"])):
        x = s["warmup_vs_expandable_geomean"]
        for ax, key in zip(axes, keys):
            ax.scatter([x], [s[key]], s=36, color="C3" if v == CHOSEN else "C0")
            ax.annotate(v, (x, s[key]), textcoords="offset points", xytext=(5, 8 if i % 2 else -12), fontsize=8)
    axes[0].set_ylabel("median utilization (peak allocated / peak reserved)")
    axes[1].set_ylabel("median smallest device / peak allocated")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("warm-up device time / expandable's (geometric mean, est.)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--scale", default="small")
    p.add_argument("--traces", metavar="PATH,...", help="trace files or directories (default: the lab's and public/)")
    p.add_argument("--variants", metavar="A,B", help=f"default: all ({', '.join(VARIANTS)})")
    p.add_argument("--tolerance", type=float, default=0.001, help="smallest device to this x peak allocated")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--min-peak", default="256MiB", help="targets' population: peak allocated at least this")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--list", action="store_true", help="list the variants and traces, run nothing")
    args = p.parse_args(argv)

    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    for need in ("builtin", "expandable"):
        if need not in variants:
            variants.insert(0, need)
    if args.traces:
        paths: List[str] = []
        for item in args.traces.split(","):
            paths += sorted(glob.glob(os.path.join(item, "*.cptrace"))) if os.path.isdir(item) else [item]
    else:
        paths = default_traces(args.scale)
    missing = [x for x in paths if not os.path.isfile(x)]
    if missing:
        p.error(f"no such trace: {', '.join(missing)}")
    if not paths:
        p.error(
            f"no traces of scale {args.scale!r}: make them with `make lab LAB_SCALE={args.scale}` and "
            f"`python benchmarks/public_models.py --scale {args.scale}`"
        )
    if args.list:
        for v in variants:
            print(f"variant {v}: {VARIANTS[v][0]} {VARIANTS[v][1]}  ({VARIANTS[v][2]})")
        for x in paths:
            print(f"trace {trace_name(x)}: {x}")
        return 0
    min_peak = parse_size(args.min_peak)
    jobs = [(x, v) for x in paths for v in variants]
    print(f"frontier: {len(paths)} traces x {len(variants)} variants, {args.jobs} processes", file=sys.stderr)
    rows: List[Dict[str, Any]] = []
    failed = 0
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        futs = {ex.submit(run_one, x, v, args.tolerance): (x, v) for x, v in jobs}
        for n, f in enumerate(as_completed(futs), 1):
            x, v = futs[f]
            try:
                r = f.result()
            except Exception as exc:  # a failed replay is reported, the rest go on
                failed += 1
                print(f"[{n}/{len(jobs)}] {trace_name(x)} {v}: FAILED: {exc}", file=sys.stderr, flush=True)
                continue
            rows.append(r)
            print(
                f"[{n}/{len(jobs)}] {r['trace']} {v}: util {r['utilization']:.4f}, smallest "
                f"{r['min_capacity_ratio']:.4f} x, warm-up {r['device_ms_warmup']:.1f} ms, after "
                f"{r['device_calls_after_warmup_total']} calls ({r['wall_s']:.1f} s, {time.perf_counter() - t0:.0f} s in all)",
                file=sys.stderr,
                flush=True,
            )
    summary = summarize(rows, variants, min_peak)
    print(
        f"Per trace (sim; cells: utilization / smallest device ÷ peak allocated / warm-up device ms est.), scale {args.scale}:\n"
    )
    print(format_rows(rows, variants))
    print(f"\nPer variant, traces of at least {format_bytes(min_peak)} peak allocated (sim):\n")
    print(format_summary(summary))
    out = args.json or os.path.join(ROOT, "build", f"frontier-{args.scale}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump({"scale": args.scale, "tolerance": args.tolerance, "min_peak": min_peak, "variants":
                   {v: list(VARIANTS[v]) for v in variants}, "rows": rows, "summary": summary}, fh, indent=1)  # fmt: skip
    print(f"\nwrote {out}", file=sys.stderr)
    if not args.no_plot and summary:
        path = args.plot or os.path.join(ROOT, "build", f"frontier-{args.scale}.png")
        try:
            plot(summary, path, f"cudapool policy variants, {len(paths)} traces, scale {args.scale} (simulator)")
            print(f"wrote {path}", file=sys.stderr)
        except ImportError:
            print("no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

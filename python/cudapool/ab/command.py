"""``python -m cudapool ab``: the user's own script under several allocators, side by side.

    python -m cudapool ab [OPTIONS] -- SCRIPT [ARGS...]

Each allocator and repeat is one fresh process, ``python -m cudapool.ab.child SCRIPT ARGS``
(or torchrun of it with ``--nproc-per-node``), in its own process group (a timeout kills the
whole group). The child sets the allocator up, runs the script unchanged and writes its
statistics to a JSON file at exit (see :mod:`cudapool.ab.child`); this module reads them,
takes medians over the repeats with their spread (min–max), prints one table, row per
allocator, and with ``--json`` writes every run, rank and device.

Allocators: ``builtin`` (torch's own, as is), ``expandable``
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), ``async``
(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), ``cudapool`` (``cudapool.enable()`` with its
default policy), and ``cudapool:KEY=VAL[;KEY=VAL...]`` variants (any configuration key, or
``policy=NAME``), checked before anything runs.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .. import ab
from .._units import unit_of
from .common import (
    DEFAULT_ALLOCATORS,
    DEFAULT_RANGE,
    EXIT_USAGE,
    Allocator,
    UsageError,
    bisect_max,
    format_table,
    parse_allocators,
    parse_range,
    print_rich,
    progress_printer,
    rich_available,
    safe_label,
    split_and_parse,
    with_arg,
    with_package_on_path,
    write_json,
)

DEFAULT_WARMUP_STEPS = 3
#: Variables a child never inherits: each row is what its name says.
CLEARED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "CUDAPOOL_CONF")
TAIL_CHARS = 4000


# -- the command line ---------------------------------------------------------------------------


def _simulate_options() -> str:
    """The options of ``ab --simulate`` (a mode of its own, without a GPU), for ``ab --help``."""
    import textwrap

    from .sim_cli import build_parser as simulate_parser

    lines = ["without a GPU: python -m cudapool ab --simulate [OPTIONS] -- SCRIPT [ARGS...] takes these options:"]
    for action in simulate_parser()._actions:
        if not action.option_strings or action.dest in ("help", "simulate"):
            continue
        name = ", ".join(action.option_strings) + (f" {action.metavar}" if action.metavar else "")
        text = (action.help or "").replace("%%", "%").replace("%(default)s", str(action.default))
        lines.append(textwrap.fill(text, 100, initial_indent=f"  {name:<24} ", subsequent_indent=" " * 27))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cudapool ab",
        usage="python -m cudapool ab [OPTIONS] -- SCRIPT [ARGS...]",
        description="Run SCRIPT (unchanged) once per allocator and repeat, each in a fresh process, "
        "and print its wall time, peak allocated and reserved memory, utilization, device allocations, "
        "out of memory and exit status side by side (medians over the repeats, with min-max).",
        epilog=_simulate_options(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--allocators",
        default=DEFAULT_ALLOCATORS,
        metavar="LIST",
        help="comma-separated: builtin, expandable (expandable_segments:True), async (backend:cudaMallocAsync), "
        "cudapool, planned (cudapool with the step plan: plan_steps:True), "
        "cudapool:KEY=VAL[;KEY=VAL...] (a configuration variant, e.g. cudapool:policy=builtin or "
        f"cudapool:max_split_size_mb=256;garbage_collection_threshold=0.8) (default: {DEFAULT_ALLOCATORS})",
    )
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="runs per allocator (default: 1)")
    p.add_argument("--json", metavar="PATH", help="write every run, rank and device and the medians to PATH")
    p.add_argument("--timeout", type=float, metavar="S", help="seconds per run; then its whole process group is killed")
    p.add_argument(
        "--step-marker",
        action="store_true",
        help="time the steps the script marks with cudapool.ab.step(): median step time, warm-up apart",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=DEFAULT_WARMUP_STEPS,
        metavar="K",
        help=f"with --step-marker: the first K steps are warm-up, reported apart (default: {DEFAULT_WARMUP_STEPS})",
    )
    p.add_argument(
        "--find-max-batch",
        metavar="ARG",
        help="also find, per allocator, the largest integer value of the script's argument ARG "
        "(e.g. --batch-size) that runs with exit status 0 and no out of memory: doubling, then bisection",
    )
    p.add_argument(
        "--max-batch-range",
        metavar="LO:HI",
        help=f"the range of --find-max-batch (default: {DEFAULT_RANGE[0]}:{DEFAULT_RANGE[1]})",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="no GPU needed: trace SCRIPT once on a fake GPU and predict each allocator's figures by replay "
        "(python -m cudapool ab --simulate --help lists its options)",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="launch each run with torchrun --nproc-per-node N; the row shows the worst rank",
    )
    return p


class Options(NamedTuple):
    allocators: List[Allocator]
    repeat: int
    json: Optional[str]
    timeout: Optional[float]
    step_marker: bool
    warmup_steps: int
    find_max_batch: Optional[str]
    max_batch_range: Tuple[int, int]
    nproc_per_node: Optional[int]
    script: str
    args: List[str]


def parse_args(argv: Sequence[str]) -> Options:
    """The options and the script of ``ab``'s command line; UsageError when it is bad."""
    ns, rest = split_and_parse(argv, build_parser())
    if not rest:
        raise UsageError("no script after --")
    if ns.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    if ns.timeout is not None and ns.timeout <= 0:
        raise UsageError("--timeout must be positive")
    if ns.warmup_steps < 0:
        raise UsageError("--warmup-steps must be at least 0")
    if ns.nproc_per_node is not None and ns.nproc_per_node < 1:
        raise UsageError("--nproc-per-node must be at least 1")
    if ns.max_batch_range is not None and ns.find_max_batch is None:
        raise UsageError("--max-batch-range goes with --find-max-batch")
    if ns.find_max_batch is not None and not ns.find_max_batch.startswith("-"):
        raise UsageError(f"--find-max-batch {ns.find_max_batch!r}: name the script's option, e.g. --batch-size")
    rng = parse_range(ns.max_batch_range) if ns.max_batch_range else DEFAULT_RANGE
    allocators = parse_allocators(ns.allocators)
    script = rest[0]
    if not os.path.isfile(script):
        raise UsageError(f"cannot run {script!r}: no such file")
    return Options(
        allocators,
        ns.repeat,
        ns.json,
        ns.timeout,
        ns.step_marker,
        ns.warmup_steps,
        ns.find_max_batch,
        rng,
        ns.nproc_per_node,
        script,
        rest[1:],
    )


def child_env(alloc: Allocator, stats_template: str, step_marker: bool) -> Dict[str, str]:
    env = dict(os.environ)
    for name in CLEARED_ENV:
        env.pop(name, None)
    if alloc.torch_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc.torch_conf
    env[ab.ENV_ALLOCATOR] = alloc.label
    env[ab.ENV_STATS] = stats_template
    env[ab.ENV_CONF] = alloc.cudapool_conf or ""
    env[ab.ENV_STEPS] = "1" if step_marker else "0"
    env["PYTHONUNBUFFERED"] = "1"
    return with_package_on_path(env)


def child_command(script: str, args: Sequence[str], nproc: Optional[int]) -> List[str]:
    if nproc is None:
        return [sys.executable, "-m", "cudapool.ab.child", script, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "cudapool.ab.child",
        script,
        *args,
    ]


def _kill_group(proc: "subprocess.Popen[bytes]") -> None:
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
            # the leader is gone; others of its group may not be
            os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue
        except (ProcessLookupError, PermissionError):
            return


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - TAIL_CHARS))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def run_once(
    alloc: Allocator, script: str, args: Sequence[str], opts: Options, workdir: str, tag: str
) -> Dict[str, Any]:
    """One run of the script under ``alloc``: its record (status, every rank's statistics)."""
    rundir = os.path.join(workdir, tag)
    os.makedirs(rundir, exist_ok=True)
    template = os.path.join(rundir, "stats-rank{rank}.json")
    cmd = child_command(script, args, opts.nproc_per_node)
    out_path, err_path = os.path.join(rundir, "stdout.txt"), os.path.join(rundir, "stderr.txt")
    timed_out = False
    t0 = time.perf_counter()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            cmd,
            env=child_env(alloc, template, opts.step_marker),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=opts.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            returncode = proc.wait()
        except BaseException:  # Ctrl-C: take the run down with us
            _kill_group(proc)
            raise
    process_s = time.perf_counter() - t0
    ranks = []
    for name in sorted(os.listdir(rundir)):
        if name.startswith("stats-rank") and name.endswith(".json"):
            try:
                with open(os.path.join(rundir, name)) as f:
                    ranks.append(json.load(f))
            except (OSError, ValueError):
                continue
    ranks.sort(key=lambda r: int(r.get("rank", 0)))
    oom = any(r.get("oom") for r in ranks)
    if timed_out:
        status = "timeout"
    elif oom:
        status = "oom"
    elif returncode != 0:
        status = "failed"
    else:
        status = "ok"
    stderr_tail = _tail(err_path)
    record: Dict[str, Any] = {
        "allocator": alloc.label,
        "argv": [script, *args],
        "status": status,
        "exit_status": None if timed_out else returncode,
        "timed_out": timed_out,
        "oom": oom,
        "process_s": process_s,
        "ranks": ranks,
        "stdout_tail": _tail(out_path),
        "stderr_tail": stderr_tail,
    }
    record.update(_run_figures(ranks, opts.warmup_steps))
    if not ranks:
        record["note"] = "no statistics: the child wrote none (killed, or it exited without running atexit)"
    elif status in ("failed", "oom"):
        exc = next(
            (r.get("exception") or r.get("setup_error") for r in ranks if r.get("exception") or r.get("setup_error")),
            None,
        )
        if exc:
            record["note"] = exc
    if status != "ok" and "note" not in record:
        lines = [line for line in stderr_tail.splitlines() if line.strip()]
        if lines:
            record["note"] = lines[-1][:300]
    return record


def _run_figures(ranks: List[Dict[str, Any]], warmup: int) -> Dict[str, Any]:
    """The figures of a run's row: the worst (rank, device) by peak reserved; wall time and step
    times of the slowest rank."""
    worst: Optional[Tuple[int, str, Dict[str, Any]]] = None
    reasons = []
    for r in ranks:
        mem = r.get("memory") or {}
        if not mem.get("available"):
            reasons.append(mem.get("reason") or "unavailable")
            continue
        for device, fig in (mem.get("devices") or {}).items():
            if worst is None or fig["peak_reserved"] > worst[2]["peak_reserved"]:
                worst = (int(r.get("rank", 0)), device, fig)
    figures: Dict[str, Any] = {
        "wall_s": max((r["wall_s"] for r in ranks if r.get("wall_s") is not None), default=None),
        "memory_available": worst is not None,
        "memory_reason": None if worst is not None else (reasons[0] if reasons else "no device was used"),
        "worst_rank": worst[0] if worst else None,
        "worst_device": worst[1] if worst else None,
    }
    for key in ("peak_allocated", "peak_reserved", "utilization", "device_allocs"):
        figures[key] = worst[2].get(key) if worst else None
    step_median = warmup_s = None
    steps = n_steps = None
    for r in ranks:
        times = r.get("step_times")
        if times is None:
            continue
        timed = times[warmup:]
        median = statistics.median(timed) if timed else None
        if step_median is None or (median is not None and median > step_median):
            step_median, steps = median, times
    if steps is not None:
        n_steps = len(steps)
        warmup_s = sum(steps[:warmup]) if steps[:warmup] else None
    figures.update({"step_median_s": step_median, "warmup_s": warmup_s, "steps": n_steps})
    return figures


# -- many runs ----------------------------------------------------------------------------------

METRICS = ("wall_s", "step_median_s", "warmup_s", "peak_allocated", "peak_reserved", "utilization", "device_allocs")


def spread(values: Sequence[float]) -> Optional[Dict[str, float]]:
    """{"median", "min", "max", "n"} of the values, or None when there are none."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(label: str, runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One allocator's row: medians and spreads over its successful runs (over every run that
    has the figure when none succeeded), status counts, OOM and exit statuses."""
    ok = [r for r in runs if r["status"] == "ok"]
    basis = ok or runs
    counts: Dict[str, int] = {}
    for r in runs:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    row: Dict[str, Any] = {
        "allocator": label,
        "runs": len(runs),
        "ok": len(ok),
        "status_counts": counts,
        "oom_runs": sum(1 for r in runs if r["oom"]),
        "exit_statuses": sorted({r["exit_status"] for r in runs if r["exit_status"] is not None}),
        "timeouts": sum(1 for r in runs if r["timed_out"]),
        "memory_reason": next((r["memory_reason"] for r in basis if r["memory_reason"]), None),
        "notes": sorted({r["note"] for r in runs if r.get("note")}),
    }
    for key in METRICS:
        row[key] = spread([r[key] for r in basis if r.get(key) is not None])
    return row


# -- the table ----------------------------------------------------------------------------------


def _status_text(row: Dict[str, Any]) -> str:
    if row["ok"] == row["runs"]:
        return "ok" if row["runs"] == 1 else f"ok {row['ok']}/{row['runs']}"
    parts = [f"{n} {name}" for name, n in sorted(row["status_counts"].items(), key=lambda kv: kv[0] != "ok")]
    return ", ".join(parts) if row["runs"] > 1 else parts[0].split(" ", 1)[1]


def _cell(s: Optional[Dict[str, float]], scale: Callable[[float], Tuple[float, str, int]]) -> str:
    """The median, then (min–max) when there were several runs, in the median's unit:
    "1.23 (1.20–1.31) s"."""
    if s is None:
        return "-"
    div, unit, decimals = scale(s["median"])

    def num(v: float) -> str:
        return f"{v / div:.{decimals}f}"

    text = num(s["median"])
    if s["n"] > 1:
        text += f" ({num(s['min'])}–{num(s['max'])})"
    return f"{text} {unit}".rstrip()


def _seconds(v: float) -> Tuple[float, str, int]:
    return 1.0, "s", 2


def _ms(v: float) -> Tuple[float, str, int]:
    return 1e-3, "ms", 1


def _bytes(v: float) -> Tuple[float, str, int]:
    """The unit format_bytes picks for ``v``, with its two decimals (0 for bytes)."""
    div, unit = unit_of(int(v))
    return float(div), unit, 0 if div == 1 else 2


def _pct(v: float) -> Tuple[float, str, int]:
    return 0.01, "%", 1


def _count(v: float) -> Tuple[float, str, int]:
    return 1.0, "", 0


def table_rows(rows: List[Dict[str, Any]], step_marker: bool, max_batch: Optional[Dict[str, Any]]) -> List[List[str]]:
    """The table as cells, header first."""
    header = ["allocator", "status", "wall time"]
    if step_marker:
        header += ["step (median)", "warm-up"]
    header += ["peak allocated", "peak reserved", "utilization", "device allocs", "OOM", "exit"]
    if max_batch is not None:
        header.append("max " + max_batch["arg"])
    out = [header]
    for row in rows:
        mem = row["peak_reserved"] is not None
        cells = [row["allocator"], _status_text(row), _cell(row["wall_s"], _seconds)]
        if step_marker:
            cells += [_cell(row["step_median_s"], _ms), _cell(row["warmup_s"], _seconds)]
        if mem:
            cells += [
                _cell(row["peak_allocated"], _bytes),
                _cell(row["peak_reserved"], _bytes),
                _cell(row["utilization"], _pct),
                _cell(row["device_allocs"], _count),
            ]
        else:
            cells += ["n/a", "n/a", "n/a", "n/a"]
        oom = row["oom_runs"]
        cells.append("no" if oom == 0 else ("yes" if row["runs"] == 1 else f"yes ({oom}/{row['runs']})"))
        if row["timeouts"] == row["runs"]:
            cells.append("timeout")
        else:
            cells.append(",".join(str(s) for s in row["exit_statuses"]) + (" +timeout" if row["timeouts"] else ""))
        if max_batch is not None:
            found = max_batch["results"].get(row["allocator"], {})
            value = found.get("max")
            cells.append("-" if not found else (str(value) if value is not None else f"none ≥ {found['range'][0]}"))
        out.append(cells)
    return out


def report_head(result: Dict[str, Any]) -> str:
    """The two lines above the table: the command, and what the figures are."""
    o = result["options"]
    detail = [f"{o['repeat']} run(s) per allocator, each in a fresh process"]
    if o["nproc_per_node"]:
        detail.append(f"torchrun --nproc-per-node {o['nproc_per_node']} (the worst rank shown)")
    detail.append("medians (min–max)" if o["repeat"] > 1 else "one run each")
    if o["step_marker"]:
        detail.append(f"step times from cudapool.ab.step(), the first {o['warmup_steps']} as warm-up")
    return f"python -m cudapool ab -- {' '.join(result['argv'])}\n" + "; ".join(detail) + "\n"


def report_notes(result: Dict[str, Any]) -> str:
    """The lines below the table: why figures are missing, what failed runs said."""
    notes = []
    for row in result["rows"]:
        if row["peak_reserved"] is None and row["memory_reason"]:
            notes.append(f"{row['allocator']}: memory figures unavailable: {row['memory_reason']}")
        for note in row["notes"]:
            notes.append(f"{row['allocator']}: {note}")
    return "".join(line + "\n" for line in notes)


def report_text(result: Dict[str, Any]) -> str:
    """The header lines, the table and the notes, as printed (without rich)."""
    notes = report_notes(result)
    return report_head(result) + "\n" + format_table(result["cells"]) + ("\n" + notes if notes else "")


# -- max batch ----------------------------------------------------------------------------------


def find_max_batch(alloc: Allocator, opts: Options, workdir: str, progress: Callable[[str], None]) -> Dict[str, Any]:
    assert opts.find_max_batch is not None
    name = opts.find_max_batch
    lo, hi = opts.max_batch_range
    probes: List[Dict[str, Any]] = []

    def ok(value: int) -> bool:
        args = with_arg(opts.args, name, value)
        tag = f"{safe_label(alloc.label)}-batch{value}"
        rec = run_once(alloc, opts.script, args, opts, workdir, tag)
        probes.append(
            {k: rec[k] for k in ("status", "exit_status", "oom", "timed_out", "process_s", "peak_reserved")}
            | {"value": value}
        )
        progress(f"max {name}, {alloc.label}: {name} {value}: {rec['status']}")
        return rec["status"] == "ok"

    best = bisect_max(ok, lo, hi)
    return {"max": best, "range": [lo, hi], "probes": probes}


# -- the command --------------------------------------------------------------------------------


def run(opts: Options, progress: Callable[[str], None]) -> Dict[str, Any]:
    """Every run; the result (what --json writes, and the table's cells)."""
    total = len(opts.allocators) * opts.repeat
    runs: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cudapool-ab-") as workdir:
        n = 0
        for alloc in opts.allocators:
            for i in range(opts.repeat):
                n += 1
                progress(f"[{n}/{total}] {alloc.label}, run {i + 1}/{opts.repeat} ...")
                rec = run_once(alloc, opts.script, opts.args, opts, workdir, f"{safe_label(alloc.label)}-{i}")
                rec["repeat"] = i
                runs.append(rec)
                took = f"{rec['wall_s']:.2f} s" if rec["wall_s"] is not None else f"{rec['process_s']:.2f} s"
                progress(f"[{n}/{total}] {alloc.label}, run {i + 1}/{opts.repeat}: {rec['status']} ({took})")
        max_batch = None
        if opts.find_max_batch is not None:
            results = {}
            for alloc in opts.allocators:
                results[alloc.label] = find_max_batch(alloc, opts, workdir, progress)
            max_batch = {"arg": opts.find_max_batch, "results": results}
    rows = [summarise(a.label, [r for r in runs if r["allocator"] == a.label]) for a in opts.allocators]
    result: Dict[str, Any] = {
        "argv": [opts.script, *opts.args],
        "options": {
            "allocators": [a._asdict() for a in opts.allocators],
            "repeat": opts.repeat,
            "timeout": opts.timeout,
            "step_marker": opts.step_marker,
            "warmup_steps": opts.warmup_steps,
            "find_max_batch": opts.find_max_batch,
            "max_batch_range": list(opts.max_batch_range) if opts.find_max_batch else None,
            "nproc_per_node": opts.nproc_per_node,
        },
        "rows": rows,
        "max_batch": max_batch,
        "runs": runs,
    }
    result["cells"] = table_rows(rows, opts.step_marker, max_batch)
    return result


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str]) -> int:
    """``python -m cudapool ab ...``: 0 once the table is printed (failed runs are rows that say
    so), 2 on a bad command line (nothing runs then)."""
    try:
        opts = parse_args(argv)
    except UsageError as exc:
        print(f"cudapool ab: {exc}", file=sys.stderr)
        return EXIT_USAGE
    inherited = [name for name in CLEARED_ENV if os.environ.get(name)]
    if inherited:
        print(
            f"cudapool ab: not passed to the runs: {', '.join(inherited)} (each row is the allocator its name says)",
            file=sys.stderr,
        )
    # SIGTERM (a harness's time cap) ends the run in progress too: its process group is killed
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        result = run(opts, progress_printer())
    finally:
        signal.signal(signal.SIGTERM, previous)
    if sys.stdout.isatty() and rich_available():
        sys.stdout.write(report_head(result))
        sys.stdout.flush()
        print_rich(result["cells"])
        sys.stdout.write(report_notes(result))
    else:
        sys.stdout.write(report_text(result))
    if all((row["memory_reason"] or "").startswith("CUDA is not available") for row in result["rows"]):
        sys.stdout.write("no GPU here: `python -m cudapool ab --simulate ...` predicts these figures without one\n")
    sys.stdout.flush()
    if opts.json and not write_json(opts.json, result, "cudapool ab"):
        return 1
    return 0

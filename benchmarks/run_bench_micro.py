#!/usr/bin/env python3
"""Run the micro-benchmark of the pool's hot path and report its figures.

1. Builds build/bench_micro when it is missing or older than its sources (through the
   Makefile when it has the rule, else with gcc directly).
2. Runs it: build/bench_micro --json build/bench-micro.json (timed cases, ns per pair).
3. When valgrind is on PATH, counts instructions per alloc+free pair with callgrind for the
   `pair` and `pair_100k_live` cases: I(N pairs) - I(0 pairs), divided by N, so that setup
   and teardown cancel out. Adds "pair_instr" and "pair_100k_live_instr" to the JSON, and
   "pair_instr_cudapool": the pair under cudapool's default policy (page-mapped, stitching), and
   "pair_instr_planned": under the planned policy once its step plan serves the pair.
   Where torch is importable, also builds build/bench_bridge (benchmarks/bench_bridge.cpp) and
   counts the same way an allocation + free through the bridge's C++ entry (the DataPtr path
   torch's tensors take) and through the C entry points: "bridge_pair_instr",
   "c_entry_pair_instr".
4. Prints a markdown table of every figure with the targets and PASS/MISS markers.

The targets are figures to watch, not tests: a missed target still exits 0. A benchmark that
fails (non-zero exit, a pool check that finds a violation, missing output) exits non-zero.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Tuple

ROOT = Path(__file__).resolve().parent.parent


def _load_policies() -> Any:
    """cudapool/policies.py by its path: pure Python, so no build of the package is needed."""
    spec = importlib.util.spec_from_file_location("_cudapool_policies", ROOT / "python" / "cudapool" / "policies.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


policies = _load_policies()
BUILD = ROOT / "build"
BINARY = BUILD / "bench_micro"
DEFAULT_JSON = BUILD / "bench-micro.json"

# Targets: pair_ns <= 100 ns; pair_ns_100k_live <= 1.5 x pair_ns; the cudapool policy's pair
# <= 1.5 x the plain pool's in instructions.
TARGET_PAIR_NS = 100.0
TARGET_LIVE_RATIO = 1.5
TARGET_POLICY_RATIO = 1.5
# A pair the step plan serves (policy planned) < the plain pool's pair, in instructions; the
# pairs before are left out of the count (the plan learns the one-allocation step in those).
PLANNED_WARM_PAIRS = 1000
# The bridge's allocation + free (benchmarks/bench_bridge.cpp) <= 1.2 x the core's pair.
TARGET_BRIDGE_RATIO = 1.2
BRIDGE_BINARY = BUILD / "bench_bridge"

CALLGRIND_CASES = ("pair", "pair_100k_live")
BENCH_TIMEOUT_S = 600
CALLGRIND_TIMEOUT_S = 600


class BenchError(Exception):
    """The benchmark itself failed (as opposed to a missed target)."""


def log(msg: str) -> None:
    print(f"run_bench_micro: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def sources() -> list[Path]:
    files = [ROOT / "benchmarks" / "bench_micro.c", ROOT / "csrc" / "backend" / "sim.c"]
    files += sorted((ROOT / "csrc" / "core").glob("*.c"))
    files += sorted((ROOT / "csrc").glob("**/*.h"))
    return [f for f in files if f.exists()]


def needs_build() -> bool:
    if not BINARY.exists():
        return True
    built = BINARY.stat().st_mtime
    return any(src.stat().st_mtime > built for src in sources())


def makefile_has_rule() -> bool:
    makefile = ROOT / "Makefile"
    if not makefile.exists() or shutil.which("make") is None:
        return False
    return re.search(r"^build/bench_micro\s*:", makefile.read_text(), re.MULTILINE) is not None


def build() -> None:
    if makefile_has_rule():
        cmd = ["make", "-C", str(ROOT), "build/bench_micro"]
    else:
        cc = os.environ.get("CC") or "gcc"
        core = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "core").glob("*.c"))
        cmd = [
            cc,
            "-std=c11",
            "-D_POSIX_C_SOURCE=200809L",
            "-O2",
            "-DNDEBUG",
            "-pthread",
            "-Icsrc",
            "benchmarks/bench_micro.c",
            *core,
            "csrc/backend/sim.c",
            "-o",
            "build/bench_micro",
        ]
    BUILD.mkdir(parents=True, exist_ok=True)
    log("building: " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0 or not BINARY.exists():
        raise BenchError(f"build failed (exit {proc.returncode})")


# --------------------------------------------------------------------------------------------
# Timed run
# --------------------------------------------------------------------------------------------


def run_timed(json_path: Path, extra: list[str]) -> dict:
    if json_path.exists():
        json_path.unlink()
    cmd = [str(BINARY), "--json", str(json_path), *extra]
    log("running: " + " ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BenchError(f"bench_micro did not finish within {BENCH_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        raise BenchError(f"bench_micro failed (exit {proc.returncode})")
    try:
        data = json.loads(json_path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read {json_path}: {exc}") from None
    for key in ("pair_ns", "pair_ns_100k_live", "pair_ns_4_threads"):
        if not isinstance(data.get(key), (int, float)):
            raise BenchError(f"{json_path} lacks the figure {key!r}")
    return data


# --------------------------------------------------------------------------------------------
# Instruction counts (callgrind)
# --------------------------------------------------------------------------------------------


def parse_callgrind_total(out_file: Path, stderr: str) -> int:
    """Total Ir of a callgrind run: the 'totals:' or 'summary:' line of its output file, else
    the 'Collected : N' line that callgrind prints on stderr."""
    try:
        text = out_file.read_text(errors="replace")
    except OSError:
        text = ""
    for key in ("totals:", "summary:"):
        m = re.search(rf"^{key}\s+(\d+)", text, re.MULTILINE)
        if m:
            return int(m.group(1))
    m = re.search(r"Collected\s*:\s*(\d+)", stderr)
    if m:
        return int(m.group(1))
    raise BenchError("cannot find the instruction total in callgrind's output")


def callgrind_count(valgrind: str, case: str, pairs: int, workdir: Path, config: str = "") -> int:
    out_file = workdir / f"callgrind.{case}.{pairs}{'.config' if config else ''}.out"
    cmd = [
        valgrind,
        "--tool=callgrind",
        f"--callgrind-out-file={out_file}",
        str(BINARY),
        "--case",
        case,
        "--pairs",
        str(pairs),
        *(["--config", config] if config else []),
    ]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=CALLGRIND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BenchError(
            f"callgrind of {case} with {pairs} pairs did not finish within {CALLGRIND_TIMEOUT_S} s"
        ) from None
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise BenchError(f"bench_micro under callgrind ({case}, {pairs} pairs) failed (exit {proc.returncode})")
    return parse_callgrind_total(out_file, proc.stderr)


def bridge_count(valgrind: str, case: str, pairs: int, workdir: Path) -> int:
    out_file = workdir / f"callgrind.bridge.{case}.{pairs}.out"
    cmd = [valgrind, "--tool=callgrind", f"--callgrind-out-file={out_file}", str(BRIDGE_BINARY)]
    cmd += ["--case", case, "--pairs", str(pairs)]
    env = {k: v for k, v in os.environ.items() if k != "CUDAPOOL_CONF"}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=CALLGRIND_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise BenchError(f"callgrind of bench_bridge {case} did not finish within {CALLGRIND_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise BenchError(f"bench_bridge under callgrind ({case}, {pairs} pairs) failed (exit {proc.returncode})")
    return parse_callgrind_total(out_file, proc.stderr)


def run_bridge_callgrind(data: dict, pairs: int) -> None:
    """The bridge's pair (and the C entry points' pair) in instructions, when torch is here to
    build bench_bridge against; None and the reason otherwise."""
    details = data.setdefault("details", {})
    data["bridge_pair_instr"] = data["c_entry_pair_instr"] = None
    valgrind = shutil.which("valgrind")
    try:
        import torch  # noqa: F401
    except Exception as exc:  # no torch: no c10 headers to build against
        details["bridge"] = {"skipped": f"torch is not importable ({exc.__class__.__name__})"}
        log("torch is not importable: no bridge row")
        return
    if valgrind is None:
        details["bridge"] = {"skipped": "valgrind not found"}
        return
    proc = subprocess.run(["make", "-C", str(ROOT), "build/bench_bridge"], cwd=ROOT)
    if proc.returncode != 0 or not BRIDGE_BINARY.exists():
        raise BenchError(f"building build/bench_bridge failed (exit {proc.returncode})")
    counts = {}
    with tempfile.TemporaryDirectory(prefix="bench-bridge-cg-") as tmp:
        for case, key in (("bridge", "bridge_pair_instr"), ("c_entry", "c_entry_pair_instr")):
            base = bridge_count(valgrind, case, 0, Path(tmp))
            total = bridge_count(valgrind, case, pairs, Path(tmp))
            per_pair = (total - base) / pairs
            data[key] = round(per_pair, 1)
            counts[case] = {"pairs": pairs, "instr_without_pairs": base, "instr_with_pairs": total}
            log(f"callgrind bench_bridge {case}: {per_pair:.1f} instructions per pair")
    details["bridge"] = counts


def run_callgrind(data: dict, pairs: int) -> None:
    details = data.setdefault("details", {})
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        log("valgrind is not on PATH: no instruction counts")
        for case in CALLGRIND_CASES:
            data[f"{case}_instr"] = None
        data["pair_instr_cudapool"] = None
        data["pair_instr_planned"] = None
        details["callgrind"] = {"skipped": "valgrind not found"}
        return
    counts = {}
    with tempfile.TemporaryDirectory(prefix="bench-micro-cg-") as tmp:
        for case in CALLGRIND_CASES:
            t0 = time.monotonic()
            base = callgrind_count(valgrind, case, 0, Path(tmp))
            total = callgrind_count(valgrind, case, pairs, Path(tmp))
            if total < base:
                raise BenchError(
                    f"callgrind: {case}: {pairs} pairs counted fewer instructions ({total}) than none ({base})"
                )
            per_pair = (total - base) / pairs
            data[f"{case}_instr"] = round(per_pair, 1)
            counts[case] = {
                "pairs": pairs,
                "instr_without_pairs": base,
                "instr_with_pairs": total,
                "instr_per_pair": round(per_pair, 3),
            }
            log(f"callgrind {case}: {per_pair:.1f} instructions per pair ({time.monotonic() - t0:.1f} s)")
        # The same pair under cudapool's own policy (page-mapped, stitching): its hot path.
        t0 = time.monotonic()
        config = policies.config_for(policies.DEFAULT_POLICY)
        base = callgrind_count(valgrind, "pair", 0, Path(tmp), config)
        total = callgrind_count(valgrind, "pair", pairs, Path(tmp), config)
        per_pair = (total - base) / pairs
        data["pair_instr_cudapool"] = round(per_pair, 1)
        counts["pair_cudapool"] = {"pairs": pairs, "config": config, "instr_per_pair": round(per_pair, 3)}
        log(f"callgrind pair ({config}): {per_pair:.1f} instructions per pair ({time.monotonic() - t0:.1f} s)")
        # The same pair under the planned policy once its plan serves it: the first pairs learn
        # the one-allocation step and are left out (I(warm + N) - I(warm)).
        t0 = time.monotonic()
        config = policies.config_for("planned")
        base = callgrind_count(valgrind, "pair", PLANNED_WARM_PAIRS, Path(tmp), config)
        total = callgrind_count(valgrind, "pair", PLANNED_WARM_PAIRS + pairs, Path(tmp), config)
        per_pair = (total - base) / pairs
        data["pair_instr_planned"] = round(per_pair, 1)
        counts["pair_planned"] = {
            "pairs": pairs,
            "warm_pairs": PLANNED_WARM_PAIRS,
            "config": config,
            "instr_per_pair": round(per_pair, 3),
        }
        log(f"callgrind pair ({config}): {per_pair:.1f} instructions per pair ({time.monotonic() - t0:.1f} s)")
    details["callgrind"] = counts


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _planned_row(data: dict, mark: Any) -> Tuple[str, str, str, str]:
    v, plain = data.get("pair_instr_planned"), data.get("pair_instr")
    if v is None or not plain:
        return ("pair_instr_planned", "n/a (no valgrind)", "< pair_instr", "")
    return (
        "pair_instr_planned",
        f"{v:.1f} ({v / plain:.2f} x pair_instr)",
        f"< pair_instr ({plain:.1f})",
        mark(v < plain),
    )


def _policy_row(data: dict, mark: Any) -> Tuple[str, str, str, str]:
    """Instructions per pair under the cudapool policy, against the plain pool's."""
    v, plain = data.get("pair_instr_cudapool"), data.get("pair_instr")
    if v is None or not plain:
        return ("pair_instr_cudapool", "n/a (no valgrind)", f"<= {TARGET_POLICY_RATIO:g} x pair_instr", "")
    ratio = v / plain
    return (
        "pair_instr_cudapool",
        f"{v:.1f} ({ratio:.2f} x pair_instr)",
        f"<= {TARGET_POLICY_RATIO:g} x pair_instr ({TARGET_POLICY_RATIO * plain:.1f})",
        mark(ratio <= TARGET_POLICY_RATIO),
    )


def _bridge_row(data: dict, mark: Any) -> Tuple[str, str, str, str]:
    """Instructions per allocation + free through the bridge's C++ entry, against the core's pair."""
    v, plain = data.get("bridge_pair_instr"), data.get("pair_instr")
    why = data.get("details", {}).get("bridge", {}).get("skipped", "no valgrind")
    if v is None or not plain:
        return ("bridge_pair_instr", f"n/a ({why})", f"<= {TARGET_BRIDGE_RATIO:g} x pair_instr", "")
    ratio = v / plain
    return (
        "bridge_pair_instr",
        f"{v:.1f} ({ratio:.2f} x pair_instr; the C entry points' pair: {data.get('c_entry_pair_instr')})",
        f"<= {TARGET_BRIDGE_RATIO:g} x pair_instr ({TARGET_BRIDGE_RATIO * plain:.1f})",
        mark(ratio <= TARGET_BRIDGE_RATIO),
    )


def report(data: dict) -> str:
    pair = data["pair_ns"]
    live = data["pair_ns_100k_live"]
    threads = data["pair_ns_4_threads"]
    ratio = live / pair if pair > 0 else float("inf")

    def mark(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    def instr(key: str) -> str:
        v = data.get(key)
        return "n/a (no valgrind)" if v is None else f"{v:.1f}"

    rows = [
        ("pair_ns", f"{pair:.1f} ns", f"<= {TARGET_PAIR_NS:g} ns", mark(pair <= TARGET_PAIR_NS)),
        (
            "pair_ns_100k_live",
            f"{live:.1f} ns ({ratio:.2f} x pair_ns)",
            f"<= {TARGET_LIVE_RATIO:g} x pair_ns ({TARGET_LIVE_RATIO * pair:.1f} ns)",
            mark(ratio <= TARGET_LIVE_RATIO),
        ),
        ("pair_ns_4_threads", f"{threads:.1f} ns ({1e3 / threads:.2f} M pairs/s)" if threads > 0 else "0", "-", ""),
        ("pair_instr", instr("pair_instr"), "-", ""),
        ("pair_100k_live_instr", instr("pair_100k_live_instr"), "-", ""),
        _policy_row(data, mark),
        _planned_row(data, mark),
        _bridge_row(data, mark),
    ]
    lines = ["| figure | value | target | status |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where the figures go")
    ap.add_argument("--reps", type=int, help="timed batches per case (bench_micro's default if unset)")
    ap.add_argument("--batch", type=int, help="pairs per batch (bench_micro's default if unset)")
    ap.add_argument("--thread-reps", type=int, help="timed batches of pair_4_threads")
    ap.add_argument("--thread-batch", type=int, help="pairs per batch and thread in pair_4_threads")
    ap.add_argument(
        "--callgrind-pairs", type=int, default=200000, help="pairs counted under callgrind (default 200000)"
    )
    ap.add_argument("--no-callgrind", action="store_true", help="skip the instruction counts")
    args = ap.parse_args(argv)
    if args.callgrind_pairs <= 0:
        ap.error("--callgrind-pairs must be positive")

    extra = []
    if args.reps is not None:
        extra += ["--reps", str(args.reps)]
    if args.batch is not None:
        extra += ["--batch", str(args.batch)]
    if args.thread_reps is not None:
        extra += ["--thread-reps", str(args.thread_reps)]
    if args.thread_batch is not None:
        extra += ["--thread-batch", str(args.thread_batch)]

    t0 = time.monotonic()
    try:
        if needs_build():
            build()
        data = run_timed(args.json, extra)
        if args.no_callgrind:
            for case in CALLGRIND_CASES:
                data[f"{case}_instr"] = None
            data.setdefault("details", {})["callgrind"] = {"skipped": "--no-callgrind"}
        else:
            run_callgrind(data, args.callgrind_pairs)
            run_bridge_callgrind(data, args.callgrind_pairs)
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    except BenchError as exc:
        log(f"FAILED: {exc}")
        return 1
    print()
    print(report(data))
    print()
    print(f"figures written to {args.json} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

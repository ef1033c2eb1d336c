#!/usr/bin/env python3
"""``python -m cudapool ab`` on the lab's GPU workloads: for each model of benchmarks/ab_train.py,
one A/B with the step marker (median step time, warm-up apart) and one max-batch search
(``--find-max-batch --batch-size``, short runs under a memory fraction so it ends soon), under
builtin, expandable and cudapool. Writes every table to stdout (and --out), every JSON under
--json-dir.

    python3 benchmarks/ab_suite.py --out build/ab-suite.txt --json-dir build/ab-suite
    python3 benchmarks/ab_suite.py --models gpt --budget-s 120

Without torch or a CUDA GPU it prints "no CUDA GPU: skipped" and exits 0. It exits 1 when an
``ab`` command itself fails (a run that fails is a row of its table, not a failure here).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _gpu_common import skipped_without_gpu  # noqa: E402

ALLOCATORS = "builtin,expandable,cudapool"
# (model, batch of the timed A/B, max-batch range, memory fraction of the search)
MODELS = {"gpt": (16, "8:512", 0.1), "cnn": (64, "32:2048", 0.1)}


def ab_command(args: list[str], script_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "cudapool", "ab", *args, "--", str(HERE / "ab_train.py"), *script_args]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default: {','.join(MODELS)})")
    p.add_argument("--allocators", default=ALLOCATORS, help=f"passed to ab (default: {ALLOCATORS})")
    p.add_argument("--steps", type=int, default=30, help="steps of the timed runs (default 30)")
    p.add_argument("--budget-s", type=float, default=300, help="seconds for the whole suite (default 300)")
    p.add_argument("--out", metavar="PATH", help="also write the tables there")
    p.add_argument("--json-dir", metavar="DIR", help="write each ab's JSON there")
    a = p.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s): {', '.join(unknown)} (known: {', '.join(MODELS)})")
    if skipped_without_gpu("ab_suite", os.path.join(a.json_dir, "skipped.json") if a.json_dir else None):
        return 0
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    deadline = time.monotonic() + a.budget_s
    jobs = []
    for m in models:
        batch, rng, fraction = MODELS[m]
        jobs.append(
            (
                f"{m}: A/B, {a.steps} steps, batch {batch}",
                ["--step-marker"],
                ["--model", m, "--steps", str(a.steps), "--batch-size", str(batch)],
                m,
            )
        )
        jobs.append(
            (
                f"{m}: largest --batch-size without out of memory, 3 steps, memory fraction {fraction}",
                ["--find-max-batch", "--batch-size", "--max-batch-range", rng],
                ["--model", m, "--steps", "3", "--memory-fraction", str(fraction)],
                f"{m}-maxbatch",
            )
        )
    texts, failed = [], 0
    for n, (title, ab_args, script_args, tag) in enumerate(jobs):
        left = deadline - time.monotonic()
        share = left / (len(jobs) - n)
        if share < 20:
            texts.append(f"== {title}\nSKIPPED: out of time ({left:.0f} s left)\n")
            continue
        extra = ["--allocators", a.allocators, "--timeout", str(int(max(10, min(90, share / 3))))]
        if a.json_dir:
            extra += ["--json", os.path.join(a.json_dir, f"ab-{tag}.json")]
        cmd = ab_command(extra + ab_args, script_args)
        print(f"ab_suite: {title} ...", file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            out, err = proc.communicate(timeout=share)
            body = out if proc.returncode == 0 else f"FAILED (exit {proc.returncode})\n{err[-3000:]}"
            failed += proc.returncode != 0
        except subprocess.TimeoutExpired:
            proc.terminate()  # ab kills the process group of the run in progress on SIGTERM
            out, _ = proc.communicate()
            body = f"TIMED OUT after {share:.0f} s\n{out}"
            failed += 1
        texts.append(f"== {title}\n{body}")
        print(texts[-1], flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("\n".join(texts))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

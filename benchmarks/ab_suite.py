#!/usr/bin/env python3
"""``python -m cudapool ab`` on the lab's GPU workloads: for each model of benchmarks/ab_train.py,
one A/B with the step marker (median step time, warm-up apart) and one max-batch search
(``--find-max-batch --batch-size``, short runs under a memory fraction so it ends soon), under
builtin, expandable and cudapool. Writes every table to stdout (and --out), every JSON under
--json-dir.

    python3 benchmarks/ab_suite.py --out build/ab-suite.txt --json-dir build/ab-suite
    python3 benchmarks/ab_suite.py --models gpt --budget-s 120

With ``--simulate`` each job is also predicted without the GPU (``ab --simulate --gpu`` the
card's memory, the script traced on a fake GPU, its trace replayed) and a table sets the
predicted peak reserved and max batch beside the measured ones, per allocator.

Without torch or a CUDA GPU it prints "no CUDA GPU: skipped" and exits 0. It exits 1 when an
``ab`` command itself fails (a run that fails is a row of its table, not a failure here).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
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
    p.add_argument("--simulate", action="store_true", help="also predict each job with ab --simulate and compare")
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
    json_dir = a.json_dir or tempfile.mkdtemp(prefix="ab-suite-")
    texts, failed = [], 0
    for n, (title, ab_args, script_args, tag) in enumerate(jobs):
        left = deadline - time.monotonic()
        share = left / (len(jobs) - n)
        if share < 20:
            texts.append(f"== {title}\nSKIPPED: out of time ({left:.0f} s left)\n")
            continue
        extra = ["--allocators", a.allocators, "--timeout", str(int(max(10, min(90, share / 3))))]
        extra += ["--json", os.path.join(json_dir, f"ab-{tag}.json")]
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
        if a.simulate and deadline - time.monotonic() > 20:
            texts.append(predicted_beside_measured(title, ab_args, script_args, tag, a, env, json_dir))
            print(texts[-1], flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("\n".join(texts))
    return 1 if failed else 0


def predicted_beside_measured(
    title: str, ab_args: list[str], script_args: list[str], tag: str, a: argparse.Namespace, env: dict, json_dir: str
) -> str:
    """``ab --simulate`` of the same job (the GPU's memory; a few steps: the peak comes early),
    and its predictions beside what the job measured."""
    import json

    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    sim_args = [a for a in ab_args if a != "--step-marker"] + ["--max-steps", "5"]
    out = os.path.join(json_dir, f"ab-{tag}-simulated.json")
    cmd = ab_command(
        ["--simulate", "--gpu", str(total), "--allocators", a.allocators, "--json", out] + sim_args, script_args
    )
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0 or not os.path.isfile(out):
        return f"== {title}: predicted without the GPU\nFAILED (exit {done.returncode})\n{done.stderr[-2000:]}"
    real = json.loads(Path(os.path.join(json_dir, f"ab-{tag}.json")).read_text())
    sim = json.loads(Path(out).read_text())
    measured = {r["allocator"]: r for r in real["rows"]}
    lines = [f"== {title}: predicted without the GPU (ab --simulate --gpu {total}) beside measured", ""]
    lines.append(
        f"{'allocator':<12}{'peak reserved: measured':>26}{'predicted':>14}{'max batch: measured':>22}{'predicted':>12}"
    )
    for r in sim["rows"]:
        m = measured.get(r["allocator"], {})
        got = (m.get("peak_reserved") or {}).get("median")
        pred = r.get("peak_reserved")
        mb_real = ((real.get("max_batch") or {}).get("results") or {}).get(r["allocator"], {}).get("max")
        mb_sim = ((sim.get("max_batch") or {}).get("results") or {}).get(r["allocator"], {}).get("max")
        fmt = lambda v: "-" if v is None else f"{v / 2**20:,.0f} MiB"  # noqa: E731
        lines.append(
            f"{r['allocator']:<12}{fmt(got):>26}{fmt(pred):>14}{str(mb_real or '-'):>22}{str(mb_sim or '-'):>12}"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A/B benchmark: torch's built-in CUDA caching allocator against cudapool, on one workload.

The same training loop runs twice, each time in a fresh process (the allocator of a process
is chosen before CUDA starts): once with the built-in allocator, once after
``cudapool.enable()``. The workload is a small transformer encoder trained on random tokens;
each step draws its sequence length from a seeded generator, so both runs see the same
sequence of varying allocation sizes.

Per run: wall time of every step (torch.cuda.synchronize() before and after), peak reserved
and peak allocated memory, utilization = peak allocated / peak reserved, and the allocator's
device-allocation counters. Prints a markdown table (built-in | cudapool | ratio) and, with
--json PATH, writes every figure there.

cudapool's run takes its configuration from CUDAPOOL_CONF, the built-in one from
PYTORCH_CUDA_ALLOC_CONF, as usual; both are recorded in the JSON.

Without torch or a CUDA GPU it prints "no CUDA GPU: skipped" and exits 0. It exits 1 when a
run fails (its output is printed), 2 on bad arguments.

    python3 benchmarks/ab_torch.py                     # 50 steps
    python3 benchmarks/ab_torch.py --steps 200 --json build/ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_common import skipped_without_gpu, write_json  # noqa: E402
from _gpu_common import tail as _tail

MODES = ("builtin", "cudapool")
RESULT_PREFIX = "AB_RESULT "
MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# The workload (runs in the child process)
# --------------------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace) -> int:
    """One run of the workload under the allocator `args.worker`; prints one result line."""
    if args.worker == "cudapool":
        import cudapool

        cudapool.enable()  # before anything touches CUDA
    import random

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    if args.worker == "cudapool":
        mem = {
            "stats": cudapool.memory_stats,
            "peak_reserved": cudapool.max_memory_reserved,
            "peak_allocated": cudapool.max_memory_allocated,
            "reserved": cudapool.memory_reserved,
        }
    else:
        mem = {
            "stats": torch.cuda.memory_stats,
            "peak_reserved": torch.cuda.max_memory_reserved,
            "peak_allocated": torch.cuda.max_memory_allocated,
            "reserved": torch.cuda.memory_reserved,
        }

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_seq, args.max_seq) for _ in range(args.steps)]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.d_model)
            layer = nn.TransformerEncoderLayer(
                args.d_model,
                args.heads,
                dim_feedforward=4 * args.d_model,
                dropout=0.1,
                batch_first=True,
                norm_first=True,
            )
            self.encoder = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, args.vocab)

        def forward(self, tokens):
            return self.head(self.norm(self.encoder(self.embed(tokens))))

    device = torch.device("cuda")
    model = Model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    use_amp = not args.no_amp and torch.cuda.is_bf16_supported()

    step_s = []
    losses = []
    t_start = time.perf_counter()
    for length in lengths:
        tokens = torch.randint(0, args.vocab, (args.batch, length + 1), device=device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del logits, tokens
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
    total_s = time.perf_counter() - t_start

    stats = mem["stats"]()
    if args.worker == "cudapool" and stats["allocation.all.allocated"] == 0:
        print("ab_torch: cudapool served no allocation: the allocator swap did not happen", file=sys.stderr)
        return 1
    peak_reserved = int(mem["peak_reserved"]())
    peak_allocated = int(mem["peak_allocated"]())
    result = {
        "mode": args.worker,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "amp_bf16": use_amp,
        "steps": args.steps,
        "seq_lengths": lengths,
        "step_s": step_s,
        "total_s": total_s,
        "losses": losses,
        "peak_reserved": peak_reserved,
        "peak_allocated": peak_allocated,
        "reserved_end": int(mem["reserved"]()),
        "utilization": peak_allocated / peak_reserved if peak_reserved else None,
        "num_device_alloc": int(stats.get("num_device_alloc", 0)),
        "num_device_free": int(stats.get("num_device_free", 0)),
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# The driver (parent process)
# --------------------------------------------------------------------------------------------


def workload_args(args: argparse.Namespace) -> list[str]:
    out = [
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
        "--batch",
        str(args.batch),
        "--d-model",
        str(args.d_model),
        "--heads",
        str(args.heads),
        "--layers",
        str(args.layers),
        "--vocab",
        str(args.vocab),
        "--min-seq",
        str(args.min_seq),
        "--max-seq",
        str(args.max_seq),
        "--warmup",
        str(args.warmup),
    ]
    if args.no_amp:
        out.append("--no-amp")
    return out


class RunFailed(Exception):
    pass


def run_child(mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, *workload_args(args)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if mode == "builtin":
        env.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        raise RunFailed(f"{mode}: timed out after {args.timeout} s\n{_tail(exc.stdout)}\n{_tail(exc.stderr)}")
    if proc.returncode != 0:
        raise RunFailed(
            f"{mode}: exited with status {proc.returncode}\n--- stdout ---\n{_tail(proc.stdout)}"
            f"\n--- stderr ---\n{_tail(proc.stderr)}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise RunFailed(
            f"{mode}: printed no result\n--- stdout ---\n{_tail(proc.stdout)}\n--- stderr ---\n{_tail(proc.stderr)}"
        )
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def summarize(run: dict, warmup: int) -> dict:
    """Step-time figures over the steps after the first `warmup` ones (all, if too few)."""
    times = run["step_s"]
    timed = times[warmup:] if len(times) > warmup else times
    ordered = sorted(timed)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {
        "median_step_ms": 1e3 * statistics.median(timed),
        "mean_step_ms": 1e3 * statistics.fmean(timed),
        "p90_step_ms": 1e3 * p90,
        "first_step_ms": 1e3 * times[0],
        "total_s": run["total_s"],
        "peak_reserved_mib": run["peak_reserved"] / MiB,
        "peak_allocated_mib": run["peak_allocated"] / MiB,
        "utilization_pct": 100.0 * run["utilization"] if run["utilization"] is not None else None,
        "num_device_alloc": run["num_device_alloc"],
        "num_device_free": run["num_device_free"],
        "num_alloc_retries": run["num_alloc_retries"],
        "final_loss": run["losses"][-1] if run["losses"] else None,
    }


ROWS = (
    ("median_step_ms", "median step (ms)", "{:.2f}"),
    ("mean_step_ms", "mean step (ms)", "{:.2f}"),
    ("p90_step_ms", "p90 step (ms)", "{:.2f}"),
    ("first_step_ms", "first step (ms)", "{:.1f}"),
    ("total_s", "total (s)", "{:.2f}"),
    ("peak_reserved_mib", "peak reserved (MiB)", "{:.1f}"),
    ("peak_allocated_mib", "peak allocated (MiB)", "{:.1f}"),
    ("utilization_pct", "utilization: peak allocated / peak reserved (%)", "{:.1f}"),
    ("num_device_alloc", "device allocations", "{:d}"),
    ("num_device_free", "device frees", "{:d}"),
    ("num_alloc_retries", "alloc retries", "{:d}"),
    ("final_loss", "final loss", "{:.4f}"),
)


def _cell(fmt: str, value) -> str:
    return "—" if value is None else fmt.format(value)


def markdown_table(summary: dict) -> str:
    a, b = summary["builtin"], summary["cudapool"]
    lines = ["| metric | built-in | cudapool | cudapool / built-in |", "|---|---:|---:|---:|"]
    for key, label, fmt in ROWS:
        va, vb = a.get(key), b.get(key)
        numbers = isinstance(va, (int, float)) and isinstance(vb, (int, float))
        ratio = f"{vb / va:.3f}" if numbers and va else "—"
        lines.append(f"| {label} | {_cell(fmt, va)} | {_cell(fmt, vb)} | {ratio} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50, help="training steps per run (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the step-time figures (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--min-seq", type=int, default=64)
    p.add_argument("--max-seq", type=int, default=512)
    p.add_argument("--no-amp", action="store_true", help="train in float32 (default: bf16 autocast)")
    p.add_argument("--timeout", type=int, default=300, help="seconds allowed per run (default 300)")
    p.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or not 1 <= args.min_seq <= args.max_seq:
        p.error("need --steps >= 1, --warmup >= 0 and 1 <= --min-seq <= --max-seq")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)

    if skipped_without_gpu("ab_torch", args.json):
        return 0

    workload = {
        "model": f"TransformerEncoder d_model={args.d_model} heads={args.heads} layers={args.layers} "
        f"vocab={args.vocab}",
        "batch": args.batch,
        "seq_len": [args.min_seq, args.max_seq],
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": args.seed,
        "amp_bf16": not args.no_amp,
        "CUDAPOOL_CONF": os.environ.get("CUDAPOOL_CONF"),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    runs, summary = {}, {}
    for mode in MODES:
        print(f"ab_torch: running {mode} ({args.steps} steps) ...", file=sys.stderr, flush=True)
        try:
            runs[mode] = run_child(mode, args)
        except RunFailed as exc:
            print(f"ab_torch: run failed: {exc}", file=sys.stderr)
            write_json(args.json, {"workload": workload, "error": str(exc), "runs": runs})
            return 1
        summary[mode] = summarize(runs[mode], args.warmup)

    first = runs["builtin"]
    print(
        f"A/B: {workload['model']}, batch {args.batch}, sequence length {args.min_seq}..{args.max_seq} "
        f"(seed {args.seed}), {args.steps} steps, {'bf16 autocast' if first['amp_bf16'] else 'float32'}; "
        f"{first['device']}, torch {first['torch']}, Python {platform.python_version()}"
    )
    print()
    print(markdown_table(summary))
    write_json(args.json, {"workload": workload, "summary": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())

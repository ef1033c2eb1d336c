#!/usr/bin/env python3
"""What the step plan costs the host: time to plan a step of N allocations, and time per event.

    python benchmarks/plan_cost.py [--sizes 100,1000,5000,20000] [--steps 8] [--json PATH]

For each N, a synthetic training-like loop (``--steps`` steps; in each, N/2 activations kept for
a backward pass and freed in reverse, each followed by a temporary freed at once, sizes drawn
once from 0.5-16 MiB and repeated every step) is replayed on the simulated device under
``cudapool`` and under ``planned``, side by side in one process. Printed per N: the plan's own
time (``plan_us``: lifetimes, position 0 and due lists without the pool lock; the layouts and
placement at the step's start with it), the allocations it served, and the replay's ns per
event under both policies (the learning, the planning and the served allocations included).
Figures are the host's, on the simulator's pool; the machine's load moves them, so compare the
two columns of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from cudapool.lab.replay import replay  # noqa: E402
from cudapool.lab.trace import ALLOC, FREE, Trace  # noqa: E402

MiB = 1 << 20


def loop(n: int, steps: int, seed: int = 0) -> Trace:
    """`steps` steps of `n` allocations each (see the module notes)."""
    rng = random.Random(seed)
    sizes = [rng.randrange(MiB // 2, 16 * MiB, 512) for _ in range(n // 2)]
    ev, next_id = [], 1
    for _ in range(steps):
        kept = []
        for size in sizes:
            ev.append((ALLOC, next_id, size))
            kept.append(next_id)
            ev += [(ALLOC, next_id + 1, size // 4), (FREE, next_id + 1, 0)]
            next_id += 2
        ev += [(FREE, k, 0) for k in reversed(kept)]
    return Trace.from_events(ev)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100,1000,5000,20000", help="allocations per step, comma-separated")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    rows = []
    print("| allocations per step | plan ms (sim) | served by position | cudapool ns/event | planned ns/event |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.sizes.split(",")):
        trace = loop(n, args.steps)
        base = replay(trace, policy="cudapool", capacity="1TB")
        planned = replay(trace, policy="planned", capacity="1TB")
        plan = planned["plan"]
        row = {
            "allocations_per_step": n,
            "plan_ms": plan["plan_us"] / 1000,
            "served": plan["plan_served"],
            "plans": plan["plans"],
            "cudapool_ns_per_event": base["ns_per_op"],
            "planned_ns_per_event": planned["ns_per_op"],
        }
        rows.append(row)
        print(
            f"| {n:,} | {row['plan_ms']:.1f} | {row['served']:,} ({plan['plans']} plan) | "
            f"{row['cudapool_ns_per_event']:.0f} | {row['planned_ns_per_event']:.0f} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Host cost of recording the history, per allocation (an alloc + free pair on a simulated
pool, through the binding as torch's entry points go): off, on without stacks, and on with
Python stacks at a call site 10 frames deep. Prints ns per pair and the difference to off.

Usage: PYTHONPATH=python python benchmarks/history_cost.py [--pairs N] [--repeat R]
The figures include the Python call overhead of Pool.alloc/free (the same in every mode);
the differences are what recording adds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cudapool import _C


def _pairs(pool: _C.Pool, n: int, depth: int) -> float:
    def go(level: int) -> float:
        if level > 0:
            return go(level - 1)
        alloc, free = pool.alloc, pool.free
        t0 = time.perf_counter_ns()
        for _ in range(n):
            free(alloc(4096))
        return (time.perf_counter_ns() - t0) / n

    return go(depth)


def measure(mode: str, n: int, repeat: int, depth: int = 10) -> float:
    pool = _C.Pool(1 << 30)
    pool.free(pool.alloc(4096))  # the segment exists before timing
    if mode != "off":
        pool.set_history(100_000)
    _C.set_history_stacks(mode == "python")
    try:
        _pairs(pool, n // 10, depth)  # warm-up
        return statistics.median(_pairs(pool, n, depth) for _ in range(repeat))
    finally:
        _C.set_history_stacks(False)
        pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    ns = ap.parse_args()
    base = measure("off", ns.pairs, ns.repeat)
    print(f"history cost per alloc+free pair ({ns.pairs} pairs, median of {ns.repeat}):")
    print(f"  {'mode':<28}{'ns/pair':>10}{'added':>10}")
    for mode, label in (("off", "off"), ("none", 'on, stacks="none"'), ("python", 'on, stacks="python"')):
        v = base if mode == "off" else measure(mode, ns.pairs, ns.repeat)
        print(f"  {label:<28}{v:>10.0f}{v - base:>10.0f}")


if __name__ == "__main__":
    main()

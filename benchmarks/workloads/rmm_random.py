"""Random allocations and frees, after the pattern of RMM's random_allocations benchmark.

Generated directly, without torch: ``count`` allocations of sizes drawn uniformly from
``[1, max_size_mb MiB]`` bytes. At each step the generator picks an operation at random: an
allocation with probability ``p_alloc`` (0.73), otherwise the free of a live allocation
chosen uniformly at random (when nothing is live, the step allocates). Live bytes never
exceed ``cap_gib`` GiB (16): when the next allocation would go past the cap, live
allocations chosen at random are freed instead until it fits, then it is made, so every size
drawn is allocated and the sizes stay uniform. At the end everything still live is freed, in
random order. Allocations go to ``streams`` streams (0..streams-1, uniformly; default one
stream); a free names the stream of its allocation. Events carry no time (-1).

    python benchmarks/workloads/rmm_random.py --count 10000 --out build/traces/rmm-10k.cptrace
    python benchmarks/workloads/rmm_random.py --count 100000 --max-size-mb 64

Scales: ``small`` 1 000 allocations, ``medium`` 10 000, ``large`` 100 000 (``--count`` sets
any number). The header's ``meta`` holds the counts of each kind of step (``random_allocs``,
``random_frees``, ``cap_frees``, ``final_frees``) and the peak of live bytes.
"""

from __future__ import annotations

import random
import sys
from typing import Any, List, Tuple

try:
    from . import _common
except ImportError:  # run as a script
    import _common

from cudapool.lab.trace import Trace, TraceWriter

MiB = 1 << 20
GiB = 1 << 30

SCALES = {
    "small": dict(count=1000, max_size_mb=4096, cap_gib=16.0, p_alloc=0.73, streams=1),
    "medium": dict(count=10000, max_size_mb=4096, cap_gib=16.0, p_alloc=0.73, streams=1),
    "large": dict(count=100000, max_size_mb=4096, cap_gib=16.0, p_alloc=0.73, streams=1),
}


def generate(count: int, max_size: int, cap: int, p_alloc: float = 0.73, seed: int = 0, streams: int = 1) -> Trace:
    """The trace: ``count`` allocations of 1..``max_size`` bytes, live bytes never above ``cap``."""
    if count < 0:
        raise ValueError(f"count must be >= 0, not {count}")
    if not 1 <= max_size <= cap:
        raise ValueError(f"need 1 <= max_size <= cap, got max_size={max_size}, cap={cap}")
    if not 0.0 < p_alloc <= 1.0:
        raise ValueError(f"p_alloc must be in (0, 1], not {p_alloc}")
    if streams < 1:
        raise ValueError(f"streams must be >= 1, not {streams}")
    rng = random.Random(seed)
    w = TraceWriter()
    live: List[Tuple[int, int, int]] = []  # (id, size, stream), in no particular order
    live_bytes = peak = 0
    stats = {"random_allocs": 0, "random_frees": 0, "cap_frees": 0, "final_frees": 0, "empty_allocs": 0}

    def free_random() -> None:
        nonlocal live_bytes
        i = rng.randrange(len(live))
        live[i], live[-1] = live[-1], live[i]
        ident, size, stream = live.pop()
        w.free(ident, size, stream)
        live_bytes -= size

    made = 0
    while made < count:
        if live and rng.random() >= p_alloc:
            stats["random_frees"] += 1
            free_random()
            continue
        stats["random_allocs" if live else "empty_allocs"] += 1
        size = rng.randint(1, max_size)
        while live_bytes + size > cap:
            stats["cap_frees"] += 1
            free_random()
        made += 1
        stream = rng.randrange(streams) if streams > 1 else 0
        w.alloc(made, size, stream)
        live.append((made, size, stream))
        live_bytes += size
        peak = max(peak, live_bytes)
    while live:
        stats["final_frees"] += 1
        free_random()
    meta = {
        "workload": "rmm_random",
        "count": count,
        "max_size": max_size,
        "cap": cap,
        "p_alloc": p_alloc,
        "seed": seed,
        "streams": streams,
        "peak_live_bytes": peak,
        **stats,
    }
    return w.trace(meta=meta)


def capture(scale: str = "small", seed: int = 0, **kw: Any) -> Trace:
    """The random trace at ``scale`` (kw: count, max_size_mb, cap_gib, p_alloc, streams)."""
    cfg = _common.pick(SCALES, scale, kw)
    trace = generate(
        cfg["count"], int(cfg["max_size_mb"] * MiB), int(cfg["cap_gib"] * GiB), cfg["p_alloc"], seed, cfg["streams"]
    )
    trace.meta["scale"] = scale
    return trace


if __name__ == "__main__":
    sys.exit(_common.main("rmm_random", capture, SCALES, __doc__, torch_device=False))

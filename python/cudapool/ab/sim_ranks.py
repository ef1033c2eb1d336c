"""``ab --simulate`` for a multi-GPU job: one trace per traced rank, and a row per group of ranks.

    python -m cudapool ab --simulate --nproc-per-node 8 [--nnodes 2] [--ranks 0,15] -- train.py ...

Each traced rank runs the script in a fresh process as torchrun would start it
(:mod:`cudapool.ab.ranks`), several at a time; traces that are the same program make one group
(Note [Which ranks are traced] in ranks.py). Each group's traced rank is replayed under each
allocator on its own GPU, with the memory its process holds outside PyTorch's allocator (its
CUDA context, its NCCL communicators: :mod:`cudapool.ab.outside`) taken from the GPU's before
"fits" and added to "smallest GPU memory". The answer is the worst rank's.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence

from .._units import format_bytes
from . import common, ranks
from .outside import Communicator, OutsideEstimate, estimate_outside

__all__ = ["communicators", "outside_of", "rank_groups", "trace_ranks"]


def trace_ranks(
    trace: Callable[[Optional[int], str], Dict[str, Any]],
    traced: Sequence[int],
    workdir: str,
    progress: Callable[[str], None],
    label: str = "",
) -> Dict[int, Dict[str, Any]]:
    """Each rank of ``traced`` traced by ``trace(rank, out_dir)`` (a fresh process each), as
    many at once as this machine has CPUs; their results by rank, each with its trace loaded
    (``"trace"``; None where the script did not run to a trace)."""
    from ..lab.trace import load

    def one(rank: int) -> Dict[str, Any]:
        progress(f"{label}tracing rank {rank} ...")
        t = trace(rank, os.path.join(workdir, f"rank-{rank}"))
        t["trace"] = load(t["trace_path"]) if t.get("status") in ("finished", "stopped", "exit") else None
        progress(f"{label}rank {rank}: {t['status']} ({t.get('seconds', 0):.1f} s)")
        return t

    with ThreadPoolExecutor(max_workers=min(len(traced), ranks.cpu_slots())) as pool:
        done = list(pool.map(one, traced))
    return dict(zip(traced, done))


def rank_groups(results: Dict[int, Dict[str, Any]], world: ranks.World) -> List[List[int]]:
    """The traced ranks grouped by identical traces (Note [Which ranks are traced]); a rank
    without a trace is a group of its own. Each result keeps its ``"fingerprint"``."""
    for rank, t in results.items():
        if "fingerprint" not in t:  # once per trace: the grouping is asked again after a second look
            data = t["trace"].data if t.get("trace") is not None else b""
            t["fingerprint"] = ranks.fingerprint(data, world.local_rank(rank)) if data else f"none-{rank}"
    return ranks.group_ranks({rank: t["fingerprint"] for rank, t in results.items()})


def communicators(result: Dict[str, Any], world: ranks.World) -> List[Communicator]:
    """The NCCL communicators a traced rank holds: each process group it is in of more than one
    rank, made for NCCL."""
    out = []
    for g in (result.get("world") or {}).get("groups") or ():
        members = g["ranks"]
        if g.get("backend") != "nccl" or len(members) < 2:
            continue
        rank = int(result["world"]["rank"])
        node = world.node_of(rank)
        local = sum(1 for r in members if world.node_of(r) == node)
        out.append(Communicator(len(members), local, len({world.node_of(r) for r in members})))
    return out


def outside_of(result: Dict[str, Any], world: ranks.World, gpu: Any, given: Optional[int] = None) -> OutsideEstimate:
    """The memory outside PyTorch's allocator of a traced rank's process: the estimate, or
    ``given`` bytes (--outside) in its place."""
    est = estimate_outside(gpu, communicators(result, world), os.environ)
    if given is None:
        return est
    return OutsideEstimate(given, 0, [0] * len(est.per_communicator), [f"--outside {format_bytes(given)}"])


def second_look(done: Dict[int, Dict[str, Any]], world: ranks.World) -> Optional[int]:
    """The rank to trace next when the default ranks (the first and the last) differ: rank 1,
    where it was not traced (Note [Which ranks are traced]); else None."""
    if world.size <= 2 or 1 in done or len(done) != 2:
        return None
    if any(t.get("trace") is None for t in done.values()):
        return None
    return 1 if len(rank_groups(done, world)) > 1 else None


def stands_for(groups: List[List[int]], world: ranks.World) -> Dict[int, List[int]]:
    """Each group's first rank and the ranks its row answers for (Note [Which ranks are
    traced]): its own; with every traced rank in one group, every rank of the world; else the
    group holding both rank 1 and the last rank answers for the untraced ranks too."""
    if len(groups) == 1:
        return {groups[0][0]: list(range(world.size))}
    traced = {r for g in groups for r in g}
    out = {g[0]: list(g) for g in groups}
    last = world.size - 1
    for g in groups:
        if 1 in g and last in g and len(g) < last:
            out[g[0]] = sorted(set(g) | (set(range(1, last)) - traced))
    return out


def worst(rank_rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per allocator, the rank that needs the most GPU memory, and whether every rank fits."""
    out: Dict[str, Any] = {}
    for rr in rank_rows:
        for r in rr["rows"]:
            if not r["simulated"]:
                continue
            w = out.setdefault(r["allocator"], {"rank": rr["rank"], "min_capacity": -1, "fits": True})
            if (r["min_capacity"] or 0) > w["min_capacity"]:
                w.update(rank=rr["rank"], min_capacity=r["min_capacity"])
            w["fits"] = w["fits"] and r["fits"]
    return out


def summary_lines(result: Dict[str, Any]) -> List[str]:
    """The lines under the table: the outside memory of each row, the answer per allocator."""
    lines = []
    for rr in result["rank_rows"]:
        est = rr["outside"]
        lines.append(f"rank {rr['rank']}: outside PyTorch's allocator (estimates): " + "; ".join(est["lines"]))
    for label, w in result["worst"].items():
        lines.append(
            f"{label}: {'fits on every rank' if w['fits'] else 'does NOT fit on every rank'}; the most GPU memory a rank "
            f"needs is rank {w['rank']}'s {format_bytes(w['min_capacity'])}"
        )
    return lines


def outside_dict(est: OutsideEstimate) -> Dict[str, Any]:
    return {
        "context": est.context,
        "nccl": est.nccl,
        "per_communicator": list(est.per_communicator),
        "total": est.total,
        "lines": list(est.lines),
    }


def traced_text(world: ranks.World, traced: Sequence[int], groups: List[List[int]]) -> str:
    """How the ranks were traced and grouped, for the report."""
    text = f"{world.size} ranks ({world.nnodes} node(s) of {world.nproc_per_node} GPUs); traced: rank(s) "
    text += ranks.ranks_text(traced)
    answered = {r for rs in stands_for(groups, world).values() for r in rs}
    if len(traced) == 1 and world.size > 1:
        text += " alone: the others are taken to run as it does, not compared with it"
    elif len(groups) == 1 and len(traced) < world.size:
        text += ": their allocations are identical, so the others are taken to run as they do"
    elif len(groups) > 1:
        text += f": {len(groups)} different programs among them"
        if len(answered) < world.size:
            text += f"; ranks {ranks.ranks_text(set(range(world.size)) - answered)} are not answered for"
        elif len(traced) < world.size:
            text += f"; the untraced ranks are taken to run as the traced rank 1 and rank {world.size - 1} do"
    if len(traced) < world.size:
        text += " (--ranks all traces every rank)"
    return text


def usage_checks(nproc: Optional[int], nnodes: int, ranks_arg: Optional[str]) -> Optional[ranks.World]:
    """The world of the command line's --nproc-per-node/--nnodes (None: a single-GPU run), or
    UsageError."""
    if nproc is None:
        if nnodes != 1:
            raise common.UsageError("--nnodes goes with --nproc-per-node")
        if ranks_arg is not None:
            raise common.UsageError("--ranks goes with --nproc-per-node")
        return None
    if not 1 <= nproc <= 64:
        raise common.UsageError(f"--nproc-per-node must be 1..64, not {nproc}")
    if not 1 <= nnodes <= 4096:
        raise common.UsageError(f"--nnodes must be 1..4096, not {nnodes}")
    world = ranks.World(nproc, nnodes)
    if ranks_arg is not None:
        try:
            ranks.parse_ranks(ranks_arg, world)
        except ValueError as exc:
            raise common.UsageError(str(exc)) from None
    return world

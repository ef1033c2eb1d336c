"""The ranks of a multi-GPU job under ``ab --simulate``: the world torchrun would make, which
ranks are traced, and which traced rank stands for which others.

A world is ``nnodes`` nodes of ``nproc_per_node`` GPUs; rank ``r`` runs on node ``r //
nproc_per_node`` as local rank ``r % nproc_per_node``, with the environment torchrun gives it
(:func:`rank_env`). Note [Which ranks are traced].

Note [Which ranks are traced]
A job of 64 ranks is answered without 64 traces. Unless ``--ranks`` names them, the first and
the last rank are traced (rank 0 is where scripts log, evaluate and save; the last rank is where
uneven splits of data, of layers and of shards leave a remainder). Their traces are compared
event by event (:func:`fingerprint`: each allocation and free, its size, stream and whether it is
on the rank's own GPU, in order up to the last allocation, the frees between two allocations
as a set; not times, not addresses): ranks
whose traces are identical ran the same program as far as memory goes and make one row. When
the two differ, rank 1 is traced too: where it runs the last rank's program, rank 0 is the odd
one out (the common case: rank 0 logs and evaluates) and rank 1's row answers for every rank
not traced; otherwise the untraced ranks are not answered for, and the report says so.
``--ranks LIST`` traces exactly those ranks (``all``: every one, as many at once as there are
CPUs). A rank not traced is assumed to run as the traced rank whose row names it.
"""

from __future__ import annotations

import hashlib
import os
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

__all__ = [
    "World",
    "default_ranks",
    "fingerprint",
    "from_torchrun_env",
    "group_ranks",
    "parse_ranks",
    "rank_env",
    "ranks_text",
]

#: The variables torchrun sets for each process it starts.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class World(NamedTuple):
    """``nnodes`` nodes of ``nproc_per_node`` GPUs each."""

    nproc_per_node: int
    nnodes: int = 1

    @property
    def size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def node_of(self, rank: int) -> int:
        return rank // self.nproc_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.nproc_per_node


def rank_env(world: World, rank: int, master_port: int = 29500) -> Dict[str, str]:
    """The environment torchrun gives rank ``rank`` of ``world`` (its static rendezvous)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(world.local_rank(rank)),
        "GROUP_RANK": str(world.node_of(rank)),
        "NODE_RANK": str(world.node_of(rank)),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(world.nproc_per_node),
        "WORLD_SIZE": str(world.size),
        "GROUP_WORLD_SIZE": str(world.nnodes),
        "ROLE_WORLD_SIZE": str(world.size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": "cudapool-simulate",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": "1",
    }


def from_torchrun_env(env: Mapping[str, str]) -> Optional[Tuple[World, int]]:
    """The world and rank of a process torchrun started (its variables), or None."""
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")):
        return None
    try:
        rank, size, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    except ValueError:
        return None
    if local < 1 or size < 1 or size % local or not 0 <= rank < size:
        return None
    return World(local, size // local), rank


def parse_ranks(text: str, world: World) -> List[int]:
    """``--ranks``: "all", or ranks and ranges ("0,3,6-7"), each in the world; ValueError
    saying what is wrong."""
    text = text.strip()
    if text == "all":
        return list(range(world.size))
    ranks: List[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise ValueError(f"--ranks {text!r}: {part!r} is not a rank or a range such as 2-5") from None
        if first > last:
            raise ValueError(f"--ranks {text!r}: the range {part} is empty")
        for r in range(first, last + 1):
            if not 0 <= r < world.size:
                raise ValueError(f"--ranks {text!r}: rank {r} is not in a world of {world.size} (0-{world.size - 1})")
            if r not in ranks:
                ranks.append(r)
    if not ranks:
        raise ValueError("--ranks names no rank")
    return sorted(ranks)


def default_ranks(world: World) -> List[int]:
    """The ranks traced when ``--ranks`` is not given (Note [Which ranks are traced])."""
    return sorted({0, world.size - 1})


def fingerprint(data: bytes, own_device: int) -> str:
    """What decides whether two ranks' traces are the same program (Note [Which ranks are
    traced]): a digest of each event's action, id, size, stream and whether it is on the rank's
    own GPU, in order up to the last allocation, the frees between two allocations as a set."""
    from ..lab._events import ALLOC, EVENT

    events = list(EVENT.iter_unpack(bytes(data[: len(data) - len(data) % EVENT.size])))
    # The frees after the last allocation change no figure, and when the last of them come is
    # not the program's: objects that autograd's threads let go of as the script ends.
    while events and events[-1][0] != ALLOC:
        events.pop()
    # The frees between two allocations are compared as a set: their order can follow Python's
    # iteration of objects by address (a set of tensors let go at once), which differs per process.
    h = hashlib.sha256()
    frees: List[bytes] = []
    for action, device, ident, size, stream, _time in events:
        record = b"%d %d %d %d %d;" % (action, ident, size, stream, int(device == own_device))
        if action == ALLOC:
            h.update(b"".join(sorted(frees)) + record)
            frees.clear()
        else:
            frees.append(record)
    return h.hexdigest()


def group_ranks(prints: Mapping[int, str]) -> List[List[int]]:
    """Traced ranks grouped by identical fingerprints, each group in rank order, the groups by
    their first rank."""
    groups: Dict[str, List[int]] = {}
    for rank in sorted(prints):
        groups.setdefault(prints[rank], []).append(rank)
    return sorted(groups.values())


def ranks_text(ranks: Iterable[int]) -> str:
    """Ranks as ranges: [0, 1, 2, 5] -> "0-2, 5"."""
    out: List[str] = []
    run: List[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


def cpu_slots() -> int:
    """How many traces run at once: the CPUs this process may use, at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)

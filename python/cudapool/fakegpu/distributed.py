"""torch.distributed on the fake GPU: one rank of a job, its process groups torch's own.

    with FakeGPU(model, devices=8) as fg, FakeWorld(fg, rank=3, world_size=16):
        runpy.run_path("train.py", run_name="__main__")   # unchanged: init_process_group("nccl"), DDP, FSDP2, DTensor

Every process group the script makes (``init_process_group``, ``new_group``, a device mesh's
groups) is made by torch's c10d machinery as usual, with the fake GPU's process group in place of
NCCL or Gloo (Note [The fake GPU's process group]) and a store that needs no other process.
Collectives run through torch as on a GPU: their outputs are allocated where torch allocates them
(by the caller, by the functional collectives, by DDP's buckets and FSDP's all-gather buffers),
on the streams torch uses; the group computes nothing, so the values are zeros as everywhere on
the fake GPU. Note [One rank of a world].

Note [The fake GPU's process group]
torch's own fake backend (torch._C._distributed_c10d.FakeProcessGroup) completes every
collective with a future that holds nothing, where NCCL's holds the output tensors: DDP's reducer
reads its buckets back from that future and fails. So the group is a ProcessGroup of its own, a
Python subclass of torch's (a "Python process group", which c10d calls through its trampoline),
registered with ``torch.distributed.Backend.register_backend``: each collective returns work
already done whose future holds the outputs, on their CUDA devices. Where ProcessGroupNCCL itself
allocates (a list all-gather or reduce-scatter stages through one flat buffer of the whole
world's data; a barrier all-reduces a 1-element tensor), the group allocates the same on the
caller's stream, for a group made for NCCL; it is freed as the collective returns, where NCCL
frees it when the work completes.

What the world records for the report: the groups this rank is a member of (their sizes and
ranks: each of more than one rank is an NCCL communicator on a GPU, with buffers of its own
outside PyTorch's allocator) and the backend the script asked for.

Note [One rank of a world]
A rank runs alone: no other process answers its collectives. What rank-dependent code needs
from the others is answered as if every rank held what this one holds:
- ``all_gather_object`` and ``gather_object`` fill their lists with this rank's object;
  ``broadcast_object_list`` and ``scatter_object_list`` leave a receiving rank's list as the
  script made it (the sender's objects are not known here; a list of nothing but None or empty
  containers, which only the sender could fill, fails saying which rank to trace instead: the
  broadcast of a checkpoint rank 0 loaded, for one); ``send_object_list`` sends nothing
  and ``recv_object_list`` fails saying so; counted in :attr:`object_collectives`.
- DDP's check that every rank has parameters of the same shapes compares values gathered from
  the others; here it would compare zeros, so it is skipped (the ranks run the same script).
- DDP rebuilds its gradient buckets after the first iteration in the order the gradients
  became ready there, taking rank 0's order from a broadcast it reads back from the GPU: values
  the fake GPU does not have. Its buckets keep their first assignment instead: the same bytes
  (the buckets partition the gradients either way), in parameter order.
- The rendezvous (``MASTER_ADDR``, ``init_method``) is not made: the fake backend needs a store
  no other process writes to. (A ``store=`` the script makes itself, a TCPStore, would wait for
  the other ranks: such a script is not simulated.)
Nothing of these changes what a rank allocates on its GPU.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, NamedTuple, Optional

__all__ = ["FakeWorld", "Group", "NoWorld", "RanksNeeded", "available"]

#: How a run is given ranks, said wherever a script needs them and has none.
HOW_TO_GIVE_RANKS = (
    "give its ranks as torchrun would: python -m cudapool ab --simulate --nproc-per-node N [--nnodes M] -- SCRIPT"
)


class RanksNeeded(RuntimeError):
    """The script set up torch.distributed in a run given no ranks."""


class Group(NamedTuple):
    """A process group this rank is a member of: its global ranks, and the backend the script
    asked for it ("nccl" where it named none on CUDA)."""

    ranks: List[int]
    backend: str


def available() -> Optional[str]:
    """None when torch.distributed and its fake backend are there, else why not."""
    try:
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - every supported torch has it
        return f"torch.distributed cannot be imported: {exc}"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    try:
        from torch._C._distributed_c10d import FakeProcessGroup  # noqa: F401
    except ImportError:
        return "this torch build has no fake process group (torch._C._distributed_c10d.FakeProcessGroup)"
    return None


def _unfilled(o: Any) -> bool:
    """Whether a receiving rank's object is a placeholder only the sender fills: None, or an
    empty container."""
    return o is None or (isinstance(o, (dict, list, tuple, set)) and not o)


def _fake_store() -> Any:
    try:
        from torch._C._distributed_c10d import FakeStore

        return FakeStore()
    except ImportError:
        import torch.distributed as dist

        return dist.HashStore()


#: The name the process groups of the fake GPU are registered under (torch.distributed.Backend).
BACKEND = "cudapool_fake"


def _tensors(value: Any) -> List[Any]:
    """The tensors in a collective's argument (a tensor, or lists of lists of them)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _process_group_class() -> Any:
    """The process group of the fake GPU (Note [The fake GPU's process group]), made once per
    process: a subclass of torch's ProcessGroup."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _create_work_from_future

    class RankGroup(dist.ProcessGroup):
        def __init__(self, rank: int, size: int, asked: str) -> None:
            super().__init__(rank, size)
            self.asked = asked
            self._name = ""
            self._desc = ""

        # A group of torch's keeps its name in its backends; this one has none of them.
        def _set_group_name(self, name: str) -> None:
            self._name = name

        @property
        def group_name(self) -> str:
            return self._name

        def _set_group_desc(self, desc: str) -> None:
            self._desc = desc

        @property
        def group_desc(self) -> str:
            return self._desc

        @property
        def _device_types(self) -> List[Any]:
            """The devices the backend asked for serves (torch's answer for its own groups)."""
            if self.asked == "nccl":
                return [torch.device("cuda")]
            if self.asked == "gloo":
                return [torch.device("cpu")]
            return [torch.device("cpu"), torch.device("cuda")]

        def getBackendName(self) -> str:
            return self.asked

        def name(self) -> str:
            return self.asked

        def _done(self, result: Any) -> Any:
            tensors = _tensors(result)
            cuda = sorted({t.device.index for t in tensors if t.device.type == "cuda"})
            fut = torch.futures.Future(devices=[torch.device("cuda", i) for i in cuda] if cuda else None)
            fut.set_result(result)
            return _create_work_from_future(fut)

        def _staged(self, pairs: Any) -> Any:
            """NCCL's staging of a list collective: for each (tensor, list of its peers' tensors
            of its shape), one flat buffer of them all on its device, gone when the collective is."""
            for one, group in pairs:
                if self.asked == "nccl" and one.device.type == "cuda" and all(t.shape == one.shape for t in group):
                    torch.empty(one.numel() * len(group), dtype=one.dtype, device=one.device)

        # one tensor, or a list, in place
        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            return self._done(tensors)

        allreduce_coalesced = reduce = broadcast = allreduce

        def barrier(self, opts: Any = None) -> Any:
            if self.asked == "nccl":
                torch.zeros(1, device="cuda")  # the 1-element allreduce NCCL's barrier is
            return self._done([])

        # outputs given by the caller: (outputs, inputs, opts)
        def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            self._staged(zip(inputs, outputs))
            return self._done(outputs)

        def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            self._staged(zip(outputs, inputs))
            return self._done(outputs)

        def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            return self._done(outputs)

        all_gather_single_coalesced = allgather_coalesced = allgather_into_tensor_coalesced
        reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced = allgather_into_tensor_coalesced
        alltoall = gather = scatter = allgather_into_tensor_coalesced

        # one output tensor: (output, input, ...)
        def _allgather_base(self, output: Any, inp: Any, *rest: Any) -> Any:
            return self._done([output])

        all_gather_single = _reduce_scatter_base = reduce_scatter_single = _allgather_base
        alltoall_base = all_to_all_single = _allgather_base

        # point to point: (tensors, peer, tag)
        def send(self, tensors: Any, peer: int = -1, tag: int = 0) -> Any:
            return self._done(tensors)

        recv = send

        def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
            return self._done(tensors)

        recvAnysource = recv_anysource

    return RankGroup


_registered: List[Any] = []


def _register_backend() -> Any:
    """Registers :data:`BACKEND` with torch.distributed (once per process); the process group
    class. Each group is made for the backend its world asked for (``asked`` of the creator)."""
    import torch.distributed as dist

    if not _registered:
        cls = _process_group_class()

        def create(common_opts: Any, backend_opts: Any = None) -> Any:
            return cls(common_opts.group_rank, common_opts.group_size, _asking[-1] if _asking else "nccl")

        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])
        _registered.append(cls)
    return _registered[0]


#: The backend each group being made was asked for (set around torch's helper).
_asking: List[str] = []


class NoWorld:
    """A run given no ranks: torch.distributed's rendezvous (``init_process_group``'s, whoever
    calls it) raises :class:`RanksNeeded` saying how to give them (on a GPU it would wait for the
    other ranks, or miss torchrun's variables)."""

    def __init__(self) -> None:
        self._patched: List[Any] = []

    def __enter__(self) -> "NoWorld":
        try:
            import torch.distributed.distributed_c10d as c10d
        except ImportError:  # pragma: no cover - every supported torch has it
            return self

        def rendezvous(*args: Any, **kwargs: Any) -> None:
            raise RanksNeeded(f"the script initialises torch.distributed (init_process_group): {HOW_TO_GIVE_RANKS}")

        if hasattr(c10d, "rendezvous"):
            self._patched.append((c10d, c10d.rendezvous))
            c10d.rendezvous = rendezvous
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._patched:
            owner, value = self._patched.pop()
            owner.rendezvous = value

    def summary(self) -> None:
        return None


class FakeWorld:
    """This process as rank ``rank`` of ``world_size`` ranks, ``local_world_size`` per node,
    inside a :class:`cudapool.fakegpu.FakeGPU` (``gpu``: its device ``rank %
    local_world_size`` is this rank's). Enter after the FakeGPU; everything patched is put back
    at exit, and the groups made inside are destroyed."""

    def __init__(self, gpu: Any, *, rank: int, world_size: int, local_world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if local_world_size < 1 or world_size % local_world_size:
            raise ValueError(f"{world_size} ranks do not make whole nodes of {local_world_size}")
        self.gpu = gpu
        self.rank = rank
        self.world_size = world_size
        self.local_world_size = local_world_size
        #: The groups this rank is a member of, in the order they were made.
        self.groups: List[Group] = []
        #: The backend the script asked for at init_process_group (None: not initialised).
        self.backend: Optional[str] = None
        #: Object collectives answered as Note [One rank of a world] says, per function.
        self.object_collectives: Dict[str, int] = {}
        self._patched: List[Any] = []

    # -- patching -----------------------------------------------------------------------------

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> "FakeWorld":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        why = available()
        if why is not None:
            raise RuntimeError(f"cudapool cannot simulate torch.distributed here: {why}")
        _register_backend()
        try:
            self._patch_init(dist, c10d)
            self._patch_groups(c10d)
            self._patch_objects(dist, c10d)
            self._patch_checks()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            self._restore()

    def _restore(self) -> None:
        while self._patched:
            owner, name, value = self._patched.pop()
            setattr(owner, name, value)

    def _patch_init(self, dist: Any, c10d: Any) -> None:
        """torch's own init_process_group runs (a device mesh calls it too, by a name it imported
        itself): its rendezvous gives a store no other process needs and this rank, and the
        backend the script asked for is what ``get_backend`` answers."""
        world = self

        def rendezvous(url: str, rank: int = -1, world_size: int = -1, **kwargs: Any) -> Any:
            yield (
                _fake_store(),
                rank if rank >= 0 else world.rank,
                world_size if world_size >= 0 else world.world_size,
            )

        self._patch(c10d, "rendezvous", rendezvous)

        def get_backend(group: Any = None) -> str:
            return world.backend or "nccl"

        self._patch(c10d, "get_backend", get_backend)
        self._patch(dist, "get_backend", get_backend)

    def _patch_groups(self, c10d: Any) -> None:
        """Every group is made by torch's helper with the fake backend; the ones this rank is in
        are recorded."""
        original = c10d._new_process_group_helper
        signature = inspect.signature(original)
        world = self

        def helper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            asked = bound.arguments.get("backend")
            ranks = list(bound.arguments.get("global_ranks_in_group") or range(world.world_size))
            if "backend_options" in bound.arguments:
                bound.arguments["backend_options"] = None
            if "device_id" in bound.arguments:
                bound.arguments["device_id"] = None
            name = str(asked).lower() if asked not in (None, "undefined", BACKEND) else (world.backend or "nccl")
            name = "nccl" if ("nccl" in name or name in ("cuda", BACKEND)) else name
            if world.backend is None:  # the first group is the default one
                world.backend = name
            bound.arguments["backend"] = c10d.Backend(BACKEND)
            _asking.append(name)
            try:
                made = original(*bound.args, **bound.kwargs)
            finally:
                _asking.pop()
            if world.rank in ranks:
                world.groups.append(Group(ranks, name))
            return made

        self._patch(c10d, "_new_process_group_helper", helper)

    def _patch_objects(self, dist: Any, c10d: Any) -> None:
        world = self

        def count(name: str) -> None:
            world.object_collectives[name] = world.object_collectives.get(name, 0) + 1

        def all_gather_object(object_list: List[Any], obj: Any, group: Any = None) -> None:
            count("all_gather_object")
            for i in range(len(object_list)):
                object_list[i] = obj

        def gather_object(obj: Any, object_gather_list: Optional[List[Any]] = None, *a: Any, **k: Any) -> None:
            count("gather_object")
            for i in range(len(object_gather_list or ())):
                object_gather_list[i] = obj  # type: ignore[index]

        def broadcast_object_list(object_list: List[Any], src: Optional[int] = None, *a: Any, **k: Any) -> None:
            count("broadcast_object_list")
            source = 0 if src is None else src
            if world.rank != source and object_list and all(_unfilled(o) for o in object_list):
                raise RuntimeError(
                    f"broadcast_object_list: rank {world.rank} receives objects only rank {source} has (a checkpoint "
                    f"rank {source} loaded, say), which one rank alone does not know: trace rank {source} "
                    f"(--ranks {source})"
                )

        def scatter_object_list(output: List[Any], inputs: Optional[List[Any]] = None, *a: Any, **k: Any) -> None:
            count("scatter_object_list")
            if inputs:
                output[0] = inputs[min(world.rank, len(inputs) - 1)]

        def send_object_list(object_list: List[Any], *a: Any, **k: Any) -> None:
            count("send_object_list")

        def recv_object_list(object_list: List[Any], *a: Any, **k: Any) -> None:
            raise RuntimeError(
                "recv_object_list: the objects another rank sends are not known to one rank on the fake GPU (pipeline "
                "stages of torch.distributed.pipelining exchange their shapes so: they are not simulated)"
            )

        for name, fn in (
            ("all_gather_object", all_gather_object),
            ("gather_object", gather_object),
            ("broadcast_object_list", broadcast_object_list),
            ("scatter_object_list", scatter_object_list),
            ("send_object_list", send_object_list),
            ("recv_object_list", recv_object_list),
        ):
            for owner in (dist, c10d):
                if hasattr(owner, name):
                    self._patch(owner, name, fn)

    def _patch_checks(self) -> None:
        import torch.distributed as dist
        import torch.distributed.utils as du
        import torch.nn.parallel.distributed as ddp

        skip = lambda *a, **k: None  # noqa: E731
        for owner in (du, ddp):
            if hasattr(owner, "_verify_param_shape_across_processes"):
                self._patch(owner, "_verify_param_shape_across_processes", skip)
        if hasattr(dist, "Reducer"):

            class Reducer(dist.Reducer):
                def _rebuild_buckets(self) -> bool:
                    return False

            self._patch(dist, "Reducer", Reducer)

    # -- what the report shows ----------------------------------------------------------------

    def summary(self) -> Dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "backend": self.backend,
            "groups": [{"ranks": g.ranks, "backend": g.backend} for g in self.groups],
            "object_collectives": dict(self.object_collectives),
        }

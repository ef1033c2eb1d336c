"""torch's memory functions answered from cudapool's pools: the device arguments torch takes,
the statistics under torch's key names, the summary table, snapshots and history. cudapool's
own functions of these names (``cudapool.memory_stats``, ...) call them, and once cudapool is
enabled on torch's pluggable path (:mod:`cudapool._torch`) they replace torch's own
(:data:`REPLACEMENTS`).

torch is imported inside the functions only: importing cudapool never imports torch.
"""

import sys
import threading
import warnings
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from . import _C
from . import snapshots as _snapshot_mod
from .summary import DEFAULT_TITLE, format_all_ranks, format_regions, format_summary

# Keys some torch versions' memory_stats() have that the pool does not track: always this
# value, and only when the installed torch documents the key (so the key set stays equal to
# that torch's). num_oom_rejections counts allocations refused up front by torch's own OOM
# pre-emption policy, which cudapool does not have.
EXTRA_STATS: Dict[str, int] = {"num_oom_rejections": 0}

# record_history's two settings change together.
_history_lock = threading.Lock()


# -- device arguments -------------------------------------------------------------------------


def _torch_if_imported() -> Any:
    return sys.modules.get("torch")


def cuda_initialized() -> bool:
    torch = _torch_if_imported()
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # a torch without CUDA support, a half-imported torch
        return False


def _current_device() -> int:
    """torch's current device when CUDA is initialised; 0 otherwise (asking torch then would
    initialise CUDA, or fail without a GPU)."""
    if cuda_initialized():
        return int(_torch_if_imported().cuda.current_device())
    return 0


def _parse_device_text(text: str) -> int:
    kind, sep, index = text.strip().partition(":")
    if kind != "cuda" or (sep and not index.strip().isdigit()):
        raise ValueError(f"Expected a cuda device, but got: {text!r}")
    return int(index) if sep else _current_device()


def device_index(device: Any = None) -> int:
    """The CUDA device index that ``device`` names: None (the current device), an int,
    "cuda", "cuda:1", a torch.device or a torch.cuda.device."""
    if device is None:
        return _current_device()
    if isinstance(device, bool):
        raise TypeError(f"invalid device {device!r}")
    if isinstance(device, int):
        return device
    torch = _torch_if_imported()
    if torch is None:
        if isinstance(device, str):
            return _parse_device_text(device)
        raise TypeError(f"invalid device {device!r}: expected an int, a string or a torch.device")
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        if device.index is None:
            return _current_device()
        return int(device.index)
    try:
        from torch.cuda._utils import _get_device_index
    except ImportError:  # pragma: no cover - every torch with CUDA support has it
        raise TypeError(f"invalid device {device!r}") from None
    return int(_get_device_index(device, optional=True))


# -- statistics (torch's names, from cudapool's pools) ----------------------------------------


def extra_stats() -> Dict[str, int]:
    """The entries of EXTRA_STATS that the installed torch's memory_stats documents."""
    global _extra_stats_cache
    if _extra_stats_cache is None:
        if "torch" not in sys.modules:
            return {}  # torch not in use: the pool's own key set (and torch stays unimported)
        doc = ""
        try:
            import torch.cuda.memory as torch_memory

            # torch's own function: cudapool._torch reads this before it replaces it.
            doc = torch_memory.memory_stats.__doc__ or ""
        except Exception:  # a torch without CUDA support: the pool's own key set
            pass
        _extra_stats_cache = {k: v for k, v in EXTRA_STATS.items() if k in doc}
    return _extra_stats_cache


_extra_stats_cache: Optional[Dict[str, int]] = None


def memory_stats(device: Any = None) -> "OrderedDict[str, int]":
    """The statistics of ``device``'s pool under torch's key names, sorted by key, as
    ``torch.cuda.memory_stats`` returns them. All zero before the device's first allocation."""
    stats = dict(_C.device_pool(device_index(device)).stats())
    for key, value in extra_stats().items():
        stats.setdefault(key, value)
    return OrderedDict(sorted(stats.items()))


def memory_stats_as_nested_dict(device: Any = None) -> Dict[str, Any]:
    """:func:`memory_stats` as a nested dict ({"allocated_bytes": {"all": {"current": ...}}}),
    the form of ``torch.cuda.memory_stats_as_nested_dict``."""
    nested: Dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    # cudapool has no private (CUDA graph / MemPool) pools: torch reports this empty then.
    nested.setdefault("reserved_bytes_by_private_pools", {})
    return nested


def memory_summary(device: Any = None, abbreviated: bool = False, all_ranks: bool = False) -> str:
    """The statistics of ``device``'s pool as the table of ``torch.cuda.memory_summary``;
    with ``all_ranks``, every rank's (see :func:`all_ranks_summary`)."""
    if all_ranks:
        return all_ranks_summary(device)
    index = device_index(device)
    text = format_summary(memory_stats(index), index, abbreviated, title=DEFAULT_TITLE)
    return text + format_regions(_C.device_pool(index).regions(), index)


def device_name(index: int) -> str:
    """The name of device ``index`` for tables: "simulated device", the CUDA device's name
    (only once CUDA is initialised: asking would initialise it), else "cuda:N"."""
    if _C.using_sim_devices():
        return "simulated device"
    if cuda_initialized():
        try:
            return str(_torch_if_imported().cuda.get_device_name(index))
        except Exception:  # a device torch cannot name
            pass
    return f"cuda:{index}"


# The gloo group the statistics are gathered over when the default group is not gloo
# (NCCL gathers objects through CUDA tensors): (default group, its gloo twin).
_gather_group: Optional[Tuple[Any, Any]] = None


def gather_rank_stats(device: Any = None) -> List[Dict[str, Any]]:
    """Every rank's statistics, gathered over torch.distributed (a collective: every rank
    must call it): one dict per rank, in rank order, with ``rank``, ``device`` (the index
    ``device`` names on that rank), ``device_name`` and ``stats``. Over the default group
    when its backend is gloo, else over a gloo group made once (with ``new_group``, itself
    a collective). RuntimeError when torch.distributed is not initialised."""
    global _gather_group
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "memory_summary(all_ranks=True) gathers every rank's statistics over torch.distributed, "
            "which is not initialised in this process: call torch.distributed.init_process_group() "
            "first (torchrun sets up its environment), on every rank"
        )
    index = device_index(device)
    mine = {
        "rank": dist.get_rank(),
        "device": index,
        "device_name": device_name(index),
        "stats": dict(memory_stats(index)),
    }
    group = None
    if dist.get_backend() != "gloo":
        default = dist.group.WORLD
        if _gather_group is None or _gather_group[0] is not default:
            _gather_group = (default, dist.new_group(backend="gloo"))
        group = _gather_group[1]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine, group=group)
    return sorted(gathered, key=lambda r: int(r["rank"]))


def all_ranks_summary(device: Any = None) -> str:
    """Every rank's statistics in one table (a collective: every rank must call it, and every
    rank gets the table): per statistic, its minimum, maximum and mean over the ranks and the
    worst rank (see :func:`cudapool.summary.format_all_ranks`)."""
    return format_all_ranks(gather_rank_stats(device), title=DEFAULT_TITLE)


def reset_peak_memory_stats(device: Any = None) -> None:
    """Set every peak of ``device``'s pool to its current value."""
    _C.device_pool(device_index(device)).reset_peak_stats()


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Zero the accumulated ("allocated", "freed") statistics and the counters."""
    _C.device_pool(device_index(device)).reset_accumulated_stats()


def empty_cache() -> None:
    """Return every wholly free segment of every device pool to the device."""
    for device in _C.device_pools():
        _C.device_pool(device).empty_cache()


def _reset_peaks_as(name: str, device: Any) -> None:
    """torch's deprecated ``name``: the warning torch gives, then every peak reset."""
    warnings.warn(
        f"torch.cuda.{name} now calls torch.cuda.reset_peak_memory_stats, which resets /all/ peak memory stats.",
        FutureWarning,
        stacklevel=3,
    )
    reset_peak_memory_stats(device)


def _reset_max_memory_allocated(device: Any = None) -> None:
    _reset_peaks_as("reset_max_memory_allocated", device)


def _reset_max_memory_cached(device: Any = None) -> None:
    _reset_peaks_as("reset_max_memory_cached", device)


def get_per_process_memory_fraction(device: Any = None) -> float:
    """The memory fraction of ``device``, as ``torch.cuda.get_per_process_memory_fraction``
    reports it: the last one ``set_per_process_memory_fraction`` set (0.0 included), else the
    configuration's ``memory_fraction``, else 1.0."""
    return _C.memory_fraction(device_index(device))


def foreign_pointer_calls() -> Dict[str, int]:
    """How many frees ("free") and ``record_stream`` calls ("record_stream") torch made on
    pointers that no cudapool pool holds (memory of another allocator, a DLPack import).
    Such calls do nothing and print nothing, as with the built-in allocator."""
    return dict(_C.foreign_pointer_calls())


# -- snapshots and history ----------------------------------------------------------------------


def snapshot(device: Any = None, include_traces: bool = True) -> Dict[str, Any]:
    """The memory snapshot of the device pools in torch.cuda.memory._snapshot()'s format
    (cudapool.snapshots module notes): every device with a pool when ``device`` is None, else
    that one device's segments and trace."""
    pools = list(_C.device_pools())
    if device is not None:
        d = device_index(device)
        pools = [d] if d in pools else []
        n = d + 1
    else:
        n = max(pools) + 1 if pools else 0
    return _snapshot_mod.merge(
        [_snapshot_mod.pool_snapshot(_C.device_pool(d), d, include_traces, n) for d in pools]
        or [{"segments": [], "device_traces": [[] for _ in range(n)]}]
    )


def dump_snapshot(path: Any = "dump_snapshot.pickle", device: Any = None) -> None:
    """Write :func:`snapshot` as the pickle that pytorch.org/memory_viz opens."""
    _snapshot_mod.dump(snapshot(device), path)


_STACKS = ("python", "none")


def record_history(
    enabled: bool = True, max_entries: int = _snapshot_mod.DEFAULT_MAX_ENTRIES, stacks: str = "python"
) -> None:
    """Record what every device pool does (now and created later) in a ring of the last
    ``max_entries`` events: allocations, frees requested and completed, segments reserved,
    mapped, unmapped and given back, out-of-memory. ``stacks="python"`` also keeps the Python
    stack of each allocation and free (of threads running Python). ``enabled=False`` stops
    recording and drops the records. Snapshots then carry the records as ``device_traces``
    and the stacks as their blocks' ``frames``."""
    if stacks not in _STACKS:
        raise ValueError(f"stacks must be one of {', '.join(map(repr, _STACKS))}, not {stacks!r}")
    if enabled and (not isinstance(max_entries, int) or max_entries <= 0):
        raise ValueError(f"max_entries must be a positive int, not {max_entries!r}")
    with _history_lock:
        _C.set_history_stacks(bool(enabled) and stacks == "python")
        _C.set_device_history(max_entries if enabled else 0)


def _torch_snapshot(device: Any = None, augment_with_fx_traces: bool = False) -> Dict[str, Any]:
    """torch.cuda.memory._snapshot answered from cudapool (every device, as torch's does)."""
    del device, augment_with_fx_traces  # torch's snapshot covers every device; no FX frames here
    return snapshot()


def _torch_memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> List[Dict[str, Any]]:
    """torch.cuda.memory_snapshot answered from cudapool: the segments."""
    del mempool_id
    return snapshot(include_traces=include_traces)["segments"]


def _torch_record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
    """torch.cuda.memory._record_memory_history answered by cudapool: None or False stops,
    "state", "all" or True records; ``stacks`` "python", "all" or "cpp" keep Python stacks
    (C++ frames are not captured); ``max_entries`` beyond the default ring size is capped to
    it (torch's default is unbounded)."""
    names = ("context", "stacks", "max_entries", "device")
    opts = dict(zip(names, args))
    opts.update(kwargs)
    on = enabled not in (None, False)
    stacks = "none" if opts.get("stacks") in (None, False) else "python"
    max_entries = opts.get("max_entries")
    if not isinstance(max_entries, int) or max_entries <= 0 or max_entries > _MAX_TORCH_ENTRIES:
        max_entries = _snapshot_mod.DEFAULT_MAX_ENTRIES
    record_history(on, max_entries, stacks)


_MAX_TORCH_ENTRIES = 10_000_000


def _torch_dump_snapshot(filename: Any = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
    """torch.cuda.memory._dump_snapshot answered from cudapool."""
    del augment_with_fx_traces
    dump_snapshot(filename)


# The torch functions that answer from cudapool once it is enabled on the pluggable path (by
# name, in torch.cuda.memory and torch.cuda). torch's own memory_allocated / memory_reserved /
# max_memory_* / memory_cached call the module-global memory_stats of torch.cuda.memory, so
# they follow without being replaced.
REPLACEMENTS = {
    "memory_stats": memory_stats,
    "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
    "memory_summary": memory_summary,
    "reset_peak_memory_stats": reset_peak_memory_stats,
    "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
    "reset_max_memory_allocated": _reset_max_memory_allocated,
    "reset_max_memory_cached": _reset_max_memory_cached,
    "get_per_process_memory_fraction": get_per_process_memory_fraction,
    "_snapshot": _torch_snapshot,
    "memory_snapshot": _torch_memory_snapshot,
    "_record_memory_history": _torch_record_memory_history,
    "_dump_snapshot": _torch_dump_snapshot,
}

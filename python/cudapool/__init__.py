"""cudapool — a stream-aware caching GPU memory allocator for PyTorch.

    import cudapool
    cudapool.enable()                 # at the top of the script, before any CUDA use
    ...
    print(cudapool.memory_summary())

After ``enable()`` every CUDA tensor of the process is served by cudapool's pool, and torch's
own ``torch.cuda.memory_stats()``, ``memory_allocated()``, ``memory_summary()``, ... answer
from it. Importing cudapool does not import torch. The simulated-device pool lives in
:mod:`cudapool.sim`; it needs neither a GPU nor torch.
"""

import atexit
from typing import Any, Dict, List, Optional

try:
    from . import _C
except ImportError as _exc:  # a source checkout without the built extension
    _why = "" if "partially initialized" in str(_exc) else f" ({_exc})"
    raise ImportError(
        "cudapool's C extension (cudapool._C) is not built or does not match this Python: install the package "
        "from the checkout with `pip install -e .` (or `python setup.py build_ext --inplace`), then import it "
        f"again{_why}"
    ) from None
from . import _torch, _torch_stats, ab, oom
from . import regions as _regions
from ._version import __version__
from .regions import current_region, graph_region, region

# Frees that arrive while the interpreter exits (tensors dropped during teardown, possibly
# after the CUDA driver shut down) cannot fail loudly: they are counted instead.
atexit.register(_C.interpreter_exiting)

__all__ = [
    "__version__",
    "enable",
    "enabled",
    "memory_stats",
    "memory_summary",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "empty_cache",
    "foreign_pointer_calls",
    "snapshot",
    "dump_snapshot",
    "record_history",
    "last_oom",
    "graph_pools",
    "mem_pool_allocator",
    "region",
    "graph_region",
    "current_region",
    "pause",
    "resume",
    "sleep",
    "wake_up",
    "regions",
    "ab",
    "oom",
]


def enable(**config: Any) -> None:
    """Make cudapool torch's CUDA memory allocator for this process.

    Call it before the first CUDA use (before any tensor or model goes to the GPU). The
    configuration comes from the CUDAPOOL_CONF environment variable ("key:value,..."), with
    the keyword arguments on top, e.g. ``enable(max_split_size_mb=256)``; a bad key or value
    is a ValueError naming it, and then nothing changes. A second call with no configuration
    or the same one does nothing; a different one is a RuntimeError.
    """
    _torch.enable(**config)


def enabled() -> bool:
    """True once :func:`enable` has made cudapool the allocator of this process."""
    return _torch.enabled()


def memory_stats(device: Any = None) -> Dict[str, int]:
    """Statistics of the device's pool under ``torch.cuda.memory_stats``'s key names.

    ``device``: None (the current device; 0 before CUDA is initialised), an int, "cuda:1",
    or a torch.device. All zero before the device's first allocation.
    """
    return _torch_stats.memory_stats(device)


def memory_summary(device: Any = None, abbreviated: bool = False, all_ranks: bool = False) -> str:
    """The pool's statistics as a table, in ``torch.cuda.memory_summary``'s layout.

    ``all_ranks=True`` under torch.distributed (one process per GPU): every rank's statistics
    gathered into one table, per statistic its min / max / mean over the ranks and the worst
    rank. A collective: every rank must call it, and every rank gets the table."""
    return _torch_stats.memory_summary(device, abbreviated, all_ranks)


def memory_allocated(device: Any = None) -> int:
    """Bytes of the device's pool currently allocated to tensors."""
    return memory_stats(device)["allocated_bytes.all.current"]


def memory_reserved(device: Any = None) -> int:
    """Bytes the device's pool currently holds from the device (allocated and cached)."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_allocated(device: Any = None) -> int:
    """The peak of :func:`memory_allocated` since the start or the last peak reset."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def max_memory_reserved(device: Any = None) -> int:
    """The peak of :func:`memory_reserved` since the start or the last peak reset."""
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Any = None) -> None:
    """Set every peak statistic of the device's pool to its current value."""
    _torch_stats.reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Zero the accumulated statistics ("allocated", "freed", retries, OOMs) of the pool."""
    _torch_stats.reset_accumulated_memory_stats(device)


def empty_cache() -> None:
    """Return every cached, wholly free segment of every device pool to the device.

    Blocks still in use, and parts of segments that are in use, stay. Once cudapool is
    enabled, ``torch.cuda.empty_cache()`` does the same.
    """
    _torch_stats.empty_cache()


def last_oom(device: Any = None) -> Optional[Dict[str, Any]]:
    """The latest out-of-memory failure of the device's pool as a dict, or None: the figures
    at the failure (the exception's report is its "report"), and "suggestion", the configuration
    change with which the latest allocations fit, found by replaying them on a simulated device
    under each alternative (see :mod:`cudapool.oom`)."""
    return oom.last_oom(device)


def foreign_pointer_calls() -> Dict[str, int]:
    """How many frees and ``record_stream`` calls torch made on memory cudapool does not hold
    (another allocator's, a DLPack import): {"free": N, "record_stream": M}. They do nothing and
    print nothing, as with torch's built-in allocator."""
    return _torch_stats.foreign_pointer_calls()


def snapshot(device: Any = None) -> Dict[str, Any]:
    """The memory snapshot of the device pools, in ``torch.cuda.memory._snapshot()``'s format:
    ``segments`` (each with its blocks and their states) and ``device_traces`` (the history,
    while :func:`record_history` records). ``device``: None for every device with a pool, or
    one device. See :mod:`cudapool.snapshots` for the fields."""
    return _torch_stats.snapshot(device)


def dump_snapshot(path: str = "dump_snapshot.pickle", device: Any = None) -> None:
    """Write :func:`snapshot` as the pickle that pytorch.org/memory_viz and
    ``torch.cuda._memory_viz`` read (``python -m cudapool plot PATH`` draws it)."""
    _torch_stats.dump_snapshot(path, device)


def record_history(enabled: bool = True, max_entries: int = 100_000, stacks: str = "python") -> None:
    """Record the last ``max_entries`` events of every device pool (allocations, frees,
    segments mapped and given back, out-of-memory), with the Python stack of each allocation
    and free when ``stacks="python"`` (``"none"``: no stacks, cheaper). ``enabled=False``
    stops and drops the records."""
    _torch_stats.record_history(enabled, max_entries, stacks)


def graph_pools() -> List[Dict[str, Any]]:
    """The private pools cudapool holds for CUDA graphs and ``torch.cuda.MemPool`` ids (oldest
    first): ``device``, ``id``, ``uses``, ``window_open``, ``allocated``, ``reserved``,
    ``allocations``, ``region``, ``paused``. :func:`memory_stats` counts the shared pool of each
    device only."""
    return _torch.graph_pools()


def mem_pool_allocator() -> Any:
    """cudapool as the allocator of a ``torch.cuda.MemPool`` (torch's caching allocator stays
    the process's and takes whole segments of that pool from cudapool)::

        pool = torch.cuda.MemPool(allocator=cudapool.mem_pool_allocator().allocator())
        with torch.cuda.use_mem_pool(pool):
            x = torch.empty(n, device="cuda")

    Not together with :func:`enable` (torch's pluggable allocator refuses ``MemPool``)."""
    return _torch.mem_pool_allocator()


# -- regions: pause and resume (docs/regions.md) ----------------------------------------------


def _pools_of(device: Any) -> List[int]:
    if device is not None:
        return [_torch_stats.device_index(device)]
    return list(_C.device_pools())


def _require_pools(what: str) -> None:
    if not (_torch.enabled() or _C.using_sim_devices()):
        raise RuntimeError(f"cudapool.{what}: cudapool is not this process's allocator: call cudapool.enable() first")


def pause(tag: _regions.Tags = None, backup: Optional[bool] = None, device: Any = None) -> None:
    """Give back the GPU memory of region ``tag`` (a tag, a list of tags, or None: every
    region), live tensors included, keeping their addresses: the tensors stay valid objects, but
    their memory is gone until :func:`resume`. First it waits for the work queued on the streams
    the region's memory is used on (those streams only, not the whole device); with
    ``backup=True`` it then copies the live tensors' bytes to pinned host memory, which
    :func:`resume` copies back (``backup=None``: each region's default, ``region(tag,
    backup=...)``, else False). Until then, allocating in the region raises and touching its
    tensors is an illegal memory access. CUDA graphs captured in the region
    (:func:`graph_region`) are paused whole: every byte their replays use. On every device with
    a pool, or on ``device``. A tag no region has is a ValueError (nothing is paused); raises
    during a CUDA graph capture, and for a pool without page-mapped memory."""
    _require_pools("pause")
    calls = _regions.pause_calls(tag, backup)
    for index in _pools_of(device):
        for name, copy in calls:
            _C.device_pool(index).pause(name, copy)
            _C.graph_pause(index, _C.region_id(name) if name is not None else 0, copy)  # its CUDA graphs


def resume(tag: _regions.Tags = None, device: Any = None) -> None:
    """Map new GPU memory at every address of region ``tag`` (a tag, a list of tags, or None:
    every paused region) and copy back what :func:`pause` backed up: tensors made before the
    pause work again, with the same ``data_ptr()``. All or nothing per region; a region that
    finds no room first makes the pool give back the memory it caches (other regions' and
    untagged free memory, as ``empty_cache()``), and only then, when the device still has no room
    for it, it raises ``cudapool.sim.OutOfMemoryError`` (a MemoryError) and stays paused; the
    other tags are resumed still. A tag no region has is a ValueError."""
    _require_pools("resume")
    names = _regions.tags_of(tag, "resume")
    for index in _pools_of(device):

        def one(name: Optional[str], index: int = index) -> None:
            _C.device_pool(index).resume(name)
            _C.graph_resume(index, _C.region_id(name) if name is not None else 0)

        _regions.resume_with(one, names if names is not None else [None])


def sleep(level: int = 1, *, weights: str = "weights", kv_cache: str = "kv_cache", device: Any = None) -> None:
    """vLLM's sleep levels over two regions (docs/regions.md has the calls side by side):
    level 1 backs the weights up to host memory and releases them, and releases the KV cache
    (its contents are lost); level 2 releases both (weights must be loaded again). A region not
    used yet is left out. :func:`wake_up` maps them again."""
    for name, copy in _regions.sleep_calls(level, weights, kv_cache):
        pause(name, backup=copy, device=device)


def wake_up(tags: _regions.Tags = None, device: Any = None) -> None:
    """Map again the regions :func:`sleep` or :func:`pause` released (vLLM's ``wake_up(tags)``:
    e.g. ``["weights"]`` first, ``["kv_cache"]`` once the weights are updated); None: every
    paused region. The same as :func:`resume`."""
    resume(tags, device=device)


def regions(device: Any = None) -> List[Dict[str, Any]]:
    """The regions of every device's pool (or of ``device``'s): one dict each with device,
    tag, paused, live_bytes, live_blocks, reserved_bytes, paused_bytes, backup_bytes,
    segments and streams."""
    rows: List[Dict[str, Any]] = []
    for index in _pools_of(device):
        for row in _C.device_pool(index).regions():
            rows.append({"device": index, **row})
    return rows

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
from typing import Any, Dict, List

from . import _C, _torch, ab
from ._version import __version__

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
    "graph_pools",
    "mem_pool_allocator",
    "ab",
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
    return _torch.memory_stats(device)


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """The pool's statistics as a table, in ``torch.cuda.memory_summary``'s layout."""
    return _torch.memory_summary(device, abbreviated)


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
    _torch.reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Zero the accumulated statistics ("allocated", "freed", retries, OOMs) of the pool."""
    _torch.reset_accumulated_memory_stats(device)


def empty_cache() -> None:
    """Return every cached, wholly free segment of every device pool to the device.

    Blocks still in use, and parts of segments that are in use, stay. Once cudapool is
    enabled, ``torch.cuda.empty_cache()`` does the same.
    """
    _torch.empty_cache()


def foreign_pointer_calls() -> Dict[str, int]:
    """How many frees and ``record_stream`` calls torch made on memory cudapool does not hold
    (another allocator's, a DLPack import): {"free": N, "record_stream": M}. They do nothing and
    print nothing, as with torch's built-in allocator."""
    return _torch.foreign_pointer_calls()


def graph_pools() -> List[Dict[str, Any]]:
    """The private pools cudapool holds for CUDA graphs and ``torch.cuda.MemPool`` ids (oldest
    first): ``device``, ``id``, ``uses``, ``window_open``, ``allocated``, ``reserved``,
    ``allocations``. :func:`memory_stats` counts the shared pool of each device only."""
    return _torch.graph_pools()


def mem_pool_allocator() -> Any:
    """cudapool as the allocator of a ``torch.cuda.MemPool`` (torch's caching allocator stays
    the process's and takes whole segments of that pool from cudapool)::

        pool = torch.cuda.MemPool(allocator=cudapool.mem_pool_allocator().allocator())
        with torch.cuda.use_mem_pool(pool):
            x = torch.empty(n, device="cuda")

    Not together with :func:`enable` (torch's pluggable allocator refuses ``MemPool``)."""
    return _torch.mem_pool_allocator()

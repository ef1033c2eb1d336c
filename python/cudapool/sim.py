"""A cudapool pool over a simulated device: host memory with a capacity, streams whose work
finishes only when told to, and fault injection. Needs neither a GPU nor torch.

    from cudapool.sim import Pool

    with Pool(64 << 20, max_split_size_mb=32) as pool:
        p = pool.alloc(1000)
        pool.free(p)
        print(pool.memory_stats()["allocated_bytes.all.peak"])
"""

from collections import OrderedDict
from typing import Any, Dict, Optional

from . import _C
from ._config import config_string
from .summary import format_summary

__all__ = ["Pool", "OutOfMemoryError", "config_string"]

#: Raised when the simulated device (or the memory cap) cannot hold a request.
OutOfMemoryError = _C.OutOfMemoryError


class Pool:
    """A cudapool pool over a simulated device of ``capacity`` bytes.

    Keyword options beyond ``auto_complete`` and ``touch_memory`` are configuration keys
    (``max_split_size_mb=64``, ``garbage_collection_threshold=0.8``, ...).
    ``auto_complete``: events complete as soon as they are recorded (an always idle device).
    ``touch_memory=False``: addresses are not backed by host memory (for huge replays).
    """

    def __init__(
        self,
        capacity: int,
        *,
        auto_complete: bool = False,
        touch_memory: bool = True,
        **config: Any,
    ) -> None:
        self._config_text = config_string(config)
        self._pool = _C.SimPool(
            capacity,
            self._config_text,
            auto_complete=bool(auto_complete),
            touch_memory=bool(touch_memory),
        )

    # -- allocation -------------------------------------------------------------------------

    def alloc(self, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes for use on ``stream``; returns the address (0 for size 0)."""
        return self._pool.alloc(size, stream)

    def free(self, ptr: int) -> None:
        """Free an address returned by :meth:`alloc` (0 is a no-op)."""
        self._pool.free(ptr)

    def record_stream(self, ptr: int, stream: int) -> None:
        """Mark ``ptr`` as used on ``stream`` too: it is reused only after that work ends."""
        self._pool.record_stream(ptr, stream)

    # -- the simulated device -----------------------------------------------------------------

    def complete(self, stream: int) -> None:
        """Finish all work submitted to ``stream`` so far."""
        self._pool.complete(stream)

    def complete_all(self) -> None:
        """Finish all work on every stream."""
        self._pool.complete_all()

    def fail_nth(self, kind: str, n: int, *, oom: bool = True) -> None:
        """Make the ``n``-th next backend call of ``kind`` ("reserve", ...) fail: out of
        memory, or a device error when ``oom`` is False. ``n = 0`` disarms."""
        self._pool.fail_nth(kind, n, oom)

    def backend_calls(self) -> Dict[str, int]:
        """Calls made to the simulated device so far, by kind."""
        return self._pool.backend_calls()

    def invalidate_stream(self, stream: int) -> None:
        """Make ``stream`` invalid, as a destroyed stream is: recording an event on it fails
        from now on, so freeing a block used there (:meth:`record_stream`) raises."""
        self._pool.invalidate_stream(stream)

    def sim_reserved_bytes(self) -> int:
        """Bytes the simulated device has handed out to the pool."""
        return self._pool.sim_reserved_bytes()

    # -- cache and limits ---------------------------------------------------------------------

    def empty_cache(self) -> None:
        """Return every wholly free segment to the device."""
        self._pool.empty_cache()

    def set_memory_cap(self, nbytes: int) -> None:
        """Cap the reserved memory at ``nbytes`` (0 = no cap)."""
        self._pool.set_memory_cap(nbytes)

    def set_memory_fraction(self, fraction: float) -> None:
        """Cap the reserved memory at ``fraction`` of the device's capacity."""
        self._pool.set_memory_fraction(fraction)

    # -- introspection ------------------------------------------------------------------------

    def memory_stats(self) -> "OrderedDict[str, int]":
        """The statistics under the built-in allocator's key names, sorted by key (as
        ``torch.cuda.memory_stats`` returns them)."""
        stats = self._pool.stats()
        return OrderedDict(sorted(stats.items()))

    def memory_summary(self, abbreviated: bool = False) -> str:
        """The statistics as a table, in the layout of ``torch.cuda.memory_summary``."""
        return format_summary(
            self.memory_stats(), 0, abbreviated, title="cudapool sim memory summary"
        )

    def reset_peak_stats(self) -> None:
        self._pool.reset_peak_stats()

    def reset_accumulated_stats(self) -> None:
        self._pool.reset_accumulated_stats()

    def info(self) -> Dict[str, int]:
        """Facts beyond the statistics: reserved, allocated, cached_free, largest_free_block,..."""
        return self._pool.info()

    def check(self) -> int:
        """Walk the pool and count invariant violations (0 = healthy)."""
        return self._pool.check()

    def check_report(self) -> str:
        """The invariant violations, one per line ("" when healthy)."""
        return self._pool.check_report()

    def oom_report(self, size: int) -> str:
        """The out-of-memory report for a request of ``size`` bytes."""
        return self._pool.oom_report(size)

    def config(self) -> str:
        """The configuration the pool runs with, in "key:value,..." form."""
        return self._pool.config()

    @property
    def capacity(self) -> int:
        return self._pool.capacity

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def close(self) -> None:
        """Destroy the pool, then the device. Idempotent; other methods then raise ValueError."""
        self._pool.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<cudapool.sim.Pool closed>"
        return f"<cudapool.sim.Pool capacity={self.capacity} config={self._config_text!r}>"

"""A cudapool pool over a simulated device: host memory with a capacity, streams whose work
finishes only when told to, and fault injection. Needs neither a GPU nor torch.

    from cudapool.sim import Pool

    with Pool(64 << 20, max_split_size_mb=32) as pool:
        p = pool.alloc(1000)
        pool.free(p)
        print(pool.memory_stats()["allocated_bytes.all.peak"])
"""

from collections import OrderedDict
from typing import Any, Optional

from . import _C
from ._config import config_string
from .regions import region
from .summary import format_regions, format_summary

__all__ = ["Pool", "OutOfMemoryError", "config_string"]

#: Raised when the simulated device (or the memory cap) cannot hold a request.
OutOfMemoryError = _C.OutOfMemoryError


class Pool(_C.Pool):
    """A cudapool pool over a simulated device of ``capacity`` bytes.

    Keyword options beyond ``auto_complete`` and ``touch_memory`` are configuration keys
    (``max_split_size_mb=64``, ``garbage_collection_threshold=0.8``, ...).
    ``auto_complete``: work completes as soon as it is queued (an always idle device).
    ``touch_memory=False``: addresses are not backed by host memory (for huge replays).

    The device runs behind the host, as a GPU does: ``launch(ptr, stream)`` queues work that
    uses an allocation, and it completes only with ``complete(stream)``, ``complete_all()`` or
    a call that waits for the device; an event recorded on a stream completes when the work
    queued before it has. What a GPU would fault on (memory unmapped or handed to another
    stream while queued work still uses it, a launch on memory the pool has not handed out, a
    call refused during a capture, a handle used after its destroy) is listed by
    ``device_faults()`` ([] when there is none).

    Allocation (``alloc``, ``free``, ``record_stream``), the simulated device (``launch``,
    ``complete``, ``complete_all``, ``set_lag``, ``device_faults``, ``fail_nth``,
    ``backend_calls``, ``invalidate_stream``, ``sim_reserved_bytes``), cache and limits (``empty_cache``, ``set_memory_cap``,
    ``set_memory_fraction``), introspection (``info``, ``check``, ``check_report``,
    ``oom_report``, ``config``, ``reset_peak_stats``, ``reset_accumulated_stats``), regions
    (``pause``, ``resume``, ``regions``) and ``close`` are the methods of
    :class:`cudapool._C.Pool`; this class adds the torch-style statistics, ``region(tag)`` and
    the context manager.
    """

    _config_text: str

    def __new__(cls, capacity: int, *, auto_complete: bool = False, touch_memory: bool = True, **config: Any) -> "Pool":
        text = config_string(config)
        self = super().__new__(cls, capacity, text, auto_complete=bool(auto_complete), touch_memory=bool(touch_memory))
        self._config_text = text
        return self

    # -- introspection ------------------------------------------------------------------------

    def memory_stats(self) -> "OrderedDict[str, int]":
        """The statistics under the built-in allocator's key names, sorted by key (as
        ``torch.cuda.memory_stats`` returns them)."""
        return OrderedDict(sorted(self.stats().items()))

    def memory_summary(self, abbreviated: bool = False) -> str:
        """The statistics as a table, in the layout of ``torch.cuda.memory_summary``, and the
        regions' table when there are regions."""
        text = format_summary(self.memory_stats(), 0, abbreviated, title="cudapool sim memory summary")
        return text + format_regions(self.regions(), 0)

    # -- regions ------------------------------------------------------------------------------

    @staticmethod
    def region(tag: str) -> region:
        """``with pool.region(tag):`` — this thread's allocations inside go to region ``tag``
        (the same as :class:`cudapool.region`: regions are the thread's, in every pool).
        ``pause(tag=None, backup=False)``, ``resume(tag=None)`` and ``regions()`` are the
        methods of :class:`cudapool._C.Pool`."""
        return region(tag)

    # -- lifetime -----------------------------------------------------------------------------

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<cudapool.sim.Pool closed>"
        return f"<cudapool.sim.Pool capacity={self.capacity} config={self._config_text!r}>"

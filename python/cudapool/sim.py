"""A cudapool pool over a simulated device: host memory with a capacity, streams whose work
finishes only when told to, and fault injection. Needs neither a GPU nor torch.

    from cudapool.sim import Pool

    with Pool(64 << 20, max_split_size_mb=32) as pool:
        p = pool.alloc(1000)
        pool.free(p)
        print(pool.memory_stats()["allocated_bytes.all.peak"])
"""

import weakref
from collections import OrderedDict
from typing import Any, Optional

from . import _C, _config, policies
from ._config import config_string
from .regions import Tags, pause_calls, region, resume_with, sleep_calls, tags_of, warn_untagged
from .summary import format_regions, format_summary

__all__ = ["Pool", "OutOfMemoryError", "config_string"]

#: Raised when the simulated device (or the memory cap) cannot hold a request.
OutOfMemoryError = _C.OutOfMemoryError


class Pool(_C.Pool):
    """A cudapool pool over a simulated device of ``capacity`` bytes.

    ``policy``: the named policy the configuration starts from (``"cudapool"``, the default, as
    :func:`cudapool.enable`; ``"builtin"``: torch's own rules; ``"expandable"``: torch's with
    expandable segments; :mod:`cudapool.policies`). Keyword options beyond ``policy``,
    ``auto_complete`` and ``touch_memory`` are configuration keys on top of it
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

    def __new__(
        cls,
        capacity: int,
        *,
        policy: str = policies.DEFAULT_POLICY,
        auto_complete: bool = False,
        touch_memory: bool = True,
        **config: Any,
    ) -> "Pool":
        if not isinstance(policy, str):
            raise TypeError(f"policy is the name of a policy ({', '.join(sorted(policies.POLICIES))}), not {policy!r}")
        text = _config.check(_config.merge(None, {"policy": policy, **config}, use_policy=True))
        self = super().__new__(cls, capacity, text, auto_complete=bool(auto_complete), touch_memory=bool(touch_memory))
        self._config_text = text
        if not self.info()["page_mapped"]:
            # Until its first allocation in a region, which it serves untagged and says so once
            # (then the C method again: a pool with page-mapped memory never pays for this). A
            # weak reference: the pool must not keep itself alive.
            me = weakref.ref(self)

            def alloc_until_tagged(size: int, stream: int = 0) -> int:
                pool = me()
                if pool is None:
                    raise ValueError("the pool is gone")
                tag = _C.region_of_thread()
                if tag:
                    pool.__dict__.pop("alloc", None)
                    warn_untagged(str(_C.region_name(tag)), "this cudapool.sim.Pool")
                return _C.Pool.alloc(pool, size, stream)

            self.__dict__["alloc"] = alloc_until_tagged
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
    def region(tag: str, backup: Optional[bool] = None) -> region:
        """``with pool.region(tag):`` — this thread's allocations inside go to region ``tag``
        (the same as :class:`cudapool.region`: regions are the thread's, in every pool)."""
        return region(tag, backup)

    def pause(self, tag: Tags = None, backup: Optional[bool] = None) -> None:
        """:func:`cudapool.pause` on this pool: a tag, a list of tags or None (every region);
        ``backup=None`` takes each region's default. A tag no region has is a ValueError."""
        for name, copy in pause_calls(tag, backup):
            super().pause(name, copy)

    def resume(self, tag: Tags = None) -> None:
        """:func:`cudapool.resume` on this pool: the pool's cached memory is given back before
        a region fails to find room (the region then stays paused: OutOfMemoryError)."""
        names = tags_of(tag, "resume")
        resume_with(super().resume, names if names is not None else [None])

    def sleep(self, level: int = 1, *, weights: str = "weights", kv_cache: str = "kv_cache") -> None:
        """:func:`cudapool.sleep` on this pool: vLLM's sleep levels."""
        for name, copy in sleep_calls(level, weights, kv_cache):
            super().pause(name, copy)

    def wake_up(self, tags: Tags = None) -> None:
        """:func:`cudapool.wake_up` on this pool."""
        self.resume(tags)

    # -- lifetime -----------------------------------------------------------------------------

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<cudapool.sim.Pool closed>"
        return f"<cudapool.sim.Pool capacity={self.capacity} config={self._config_text!r}>"

"""Regions: allocations grouped under a tag, whose GPU memory can be given back and mapped
again at the same addresses (``cudapool.pause`` / ``cudapool.resume``).

    with cudapool.region("kv_cache"):
        cache = torch.empty(n, device="cuda")    # served from memory of "kv_cache" only

Which region a thread allocates in is the thread's own, as torch's current stream is: a
``region`` block covers the allocations its thread makes, not those of other threads (torch's
autograd runs the backward pass of CUDA tensors on threads of its own). Needs neither torch
nor a GPU.
"""

import threading
import warnings
from types import TracebackType
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type, Union

from . import _C

__all__ = ["region", "graph_region", "current_region", "known_regions", "Tags"]

#: What pause, resume and wake_up take: one tag, several, or None (every region).
Tags = Union[None, str, Iterable[str]]

# Each region's backup default (region(tag, backup=...)); pause(backup=None) uses it.
_backup_defaults: Dict[str, bool] = {}
_defaults_lock = threading.Lock()

_REGION_MAX = 64  # CP_REGION_MAX: names a process may give

#: Called with the tag at each region's entry when set (enable() sets it: it warns once when the
#: process's pools have no page-mapped memory, so the region would change nothing).
on_enter: Optional[Callable[[str], None]] = None


class region:
    """``with cudapool.region(tag):`` — the allocations this thread makes inside are served
    from page-mapped memory of region ``tag`` only (a str of 1 to 127 characters; at most 64
    names in a process), so that ``cudapool.pause(tag)`` can give that memory back. Regions
    nest: the innermost wins. A pool without page-mapped memory (policy ``builtin``, or a
    device without the CUDA virtual memory API) serves tagged allocations as untagged ones,
    and says so with a warning. Allocating in a paused region raises.

    ``backup`` sets the region's default for :func:`cudapool.pause` (as torch_memory_saver's
    ``enable_cpu_backup``): ``pause(tag)`` without ``backup=`` then copies its live blocks to host
    memory first when it is True. It stays the region's until another ``region(tag, backup=...)``
    changes it."""

    __slots__ = ("tag", "_id", "_outer")

    def __init__(self, tag: str, backup: Optional[bool] = None) -> None:
        if not isinstance(tag, str):
            raise TypeError(f"a region's tag is a str, not {type(tag).__name__}")
        if backup is not None and not isinstance(backup, bool):
            raise TypeError(f"backup is True, False or None, not {backup!r}")
        self.tag = tag
        self._id = _C.region_id(tag)
        self._outer = threading.local()  # per thread: the regions it was in, innermost last
        if backup is not None:
            with _defaults_lock:
                _backup_defaults[tag] = backup

    def _stack(self) -> List[int]:
        stack = getattr(self._outer, "stack", None)
        if stack is None:
            stack = self._outer.stack = []
        return stack

    def __enter__(self) -> "region":
        check = on_enter
        if check is not None:
            check(self.tag)
        self._stack().append(_C.region_enter(self._id))
        return self

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        _C.region_enter(self._stack().pop())

    def __repr__(self) -> str:
        return f"cudapool.region({self.tag!r})"


def current_region() -> Optional[str]:
    """The tag of the region the calling thread allocates in, or None."""
    return _C.region_name(_C.region_of_thread())


def graph_region(tag: str) -> region:
    """``with cudapool.graph_region(tag):`` around a CUDA graph capture (``torch.cuda.graph``,
    ``make_graphed_callables``) gives the graph a private pool of region ``tag``: page-mapped,
    so that ``cudapool.pause(tag)`` gives back every byte the graph's replays use (its
    intermediates, freed during the capture, included) and ``cudapool.resume(tag)`` maps them
    again at the same addresses, so the graph replays as before. It is :class:`region` by
    another name: a capture inside any region does the same, and allocations made inside it
    outside a capture go to the region as usual."""
    return region(tag)


def known_regions() -> List[str]:
    """The names regions were given in this process (by :class:`region` or by a pool that
    served one), in the order they were first given."""
    names = (_C.region_name(i) for i in range(1, _REGION_MAX + 1))
    return [name for name in names if name is not None]


def tags_of(tags: Tags, what: str) -> Optional[List[str]]:
    """``tags`` as a list of known region names (None stays None: every region). TypeError
    for what is not a str or an iterable of str; ValueError naming an unknown tag, with the
    known ones (a typo must not pause nothing in silence)."""
    if tags is None:
        return None
    if isinstance(tags, str):
        wanted: List[str] = [tags]
    else:
        try:
            wanted = list(tags)
        except TypeError:
            raise TypeError(f"cudapool.{what}: tags are a str, a list of str or None, not {tags!r}") from None
        if not wanted:
            raise ValueError(f"cudapool.{what}: an empty list of tags (None means every region)")
    known = known_regions()
    out: List[str] = []
    for tag in wanted:
        if not isinstance(tag, str):
            raise TypeError(f"cudapool.{what}: a tag is a str, not {tag!r}")
        if tag not in known:
            listed = ", ".join(map(repr, known)) or "none yet"
            raise ValueError(f"cudapool.{what}: no region is named {tag!r} (regions: {listed})")
        if tag not in out:
            out.append(tag)
    return out


def backup_default(tag: str) -> bool:
    """The region's backup default (region(tag, backup=...)); False when none was set."""
    with _defaults_lock:
        return _backup_defaults.get(tag, False)


def pause_calls(tags: Tags, backup: Optional[bool], what: str = "pause") -> List[Tuple[Optional[str], bool]]:
    """The (tag, backup) pauses that ``pause(tags, backup)`` makes: one per tag, each with
    ``backup`` or, when it is None, the region's default; for every region (None) a single
    pause of all unless some region has a default of its own."""
    if backup is not None and not isinstance(backup, bool):
        raise TypeError(f"cudapool.{what}: backup is True, False or None, not {backup!r}")
    names = tags_of(tags, what)
    if names is None:
        with _defaults_lock:
            defaults = dict(_backup_defaults)
        if backup is not None or not any(defaults.values()):
            return [(None, bool(backup))]
        names = known_regions()
    return [(tag, backup_default(tag) if backup is None else backup) for tag in names]


#: vLLM's sleep levels, over the regions that hold an engine's weights and its KV cache.
SLEEP_LEVELS: Dict[int, str] = {
    1: "weights backed up to host memory and released, KV cache released (its contents are lost)",
    2: "weights and KV cache released (weights must be loaded again after wake_up)",
}


def sleep_calls(level: int, weights: str, kv_cache: str) -> List[Tuple[str, bool]]:
    """The (tag, backup) pauses of sleep(level): vLLM's meanings (SLEEP_LEVELS). A region
    never used (a model without a KV cache yet) is left out; ValueError when neither is."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"cudapool.sleep: level is 1 or 2 (vLLM's sleep levels), not {level!r}")
    known = known_regions()
    calls = [(weights, level == 1), (kv_cache, False)]
    present = [(tag, backup) for tag, backup in calls if tag in known]
    if not present:
        raise ValueError(
            f"cudapool.sleep: neither {weights!r} nor {kv_cache!r} is a region "
            f"(regions: {', '.join(map(repr, known)) or 'none yet'}); allocate the model in "
            f"cudapool.region({weights!r}) and its KV cache in cudapool.region({kv_cache!r})"
        )
    return present


def warn_untagged(tag: str, where: str, stacklevel: int = 3) -> None:
    """The warning that a region changes nothing in a pool without page-mapped memory."""
    warnings.warn(
        f"cudapool.region({tag!r}): {where} has no page-mapped memory (policy 'builtin', or a device "
        f"without the CUDA virtual memory API), so allocations in a region are served as untagged ones "
        f"and pause() raises; use policy 'cudapool' or 'expandable' for regions",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


def watch_paging(config: str) -> None:
    """From now on, the first region entered warns (warn_untagged) when the process's pools
    cannot serve it: ``config`` (the enabled configuration) has no page-mapped memory, or every
    device pool made so far fell back to plain segments. Checking stops once it has warned or
    found page-mapped memory in use."""
    global on_enter
    paged = "expandable_segments:True" in config or "page_stitching:True" in config

    def check(tag: str) -> None:
        global on_enter
        pools = list(_C.device_pools())
        if paged and not pools:
            return  # nothing made yet: look again at the next region
        on_enter = None
        if not paged or not any(_C.device_pool(d).info()["page_mapped"] for d in pools):
            warn_untagged(tag, "cudapool's pool" if paged else f"cudapool's policy ({config})", stacklevel=4)

    on_enter = check


def resume_with(resume_one: Callable[[Optional[str]], None], tags: Sequence[Optional[str]]) -> None:
    """Resume each of ``tags`` (None: every paused region) in order, all of them tried: the
    first failure is raised once the others were resumed."""
    first: Optional[BaseException] = None
    for tag in tags:
        try:
            resume_one(tag)
        except (MemoryError, RuntimeError) as exc:
            if first is None:
                first = exc
    if first is not None:
        raise first

"""cudapool as torch's CUDA allocator: ``enable()`` swaps it in, and torch's memory
statistics functions then answer from the pool.

torch is imported inside the functions only: importing cudapool never imports torch.

Two ways in, chosen by ``enable()`` (:func:`allocator_path` says which):

- **the bridge** (``"bridge"``): ``cudapool._torch_bridge`` (csrc/bridge/bridge.cpp), built against
  the installed torch, is a subclass of torch's own allocator interface over the same pools;
  torch's C++ entry points (statistics, snapshots, history, OOM observers, cacheInfo, MemPool,
  raw_alloc, trace trackers) reach cudapool directly, and nothing of torch's is patched. It is
  used when it was built for the running torch.
- **the pluggable path** (``"pluggable"``): ``torch.cuda.memory.CUDAPluggableAllocator`` opens our
  extension module (``_C.__file__``) with ctypes and takes the addresses of ``cudapool_alloc`` and
  ``cudapool_free``. The extension is already loaded, so the dynamic loader hands back the same
  library: torch's allocations and this module's statistics see one set of pools. The optional
  hooks (init, reset = empty_cache, memory fraction, record_stream, base_alloc, and the three
  graph-pool hooks of CUDA graphs) are set from the same library, and torch's Python memory
  functions are replaced by cudapool's. Used when the bridge was not built, was built for another
  torch (a warning says so and how to rebuild), or CUDAPOOL_BRIDGE=0 asks for it.

Either swap only works before CUDA is initialised in the process.
"""

import ctypes
import importlib.machinery
import os
import sys
import threading
import warnings
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from . import _C, _config
from . import snapshots as _snapshot_mod
from .regions import watch_paging
from .summary import DEFAULT_TITLE, format_all_ranks, format_regions, format_summary

# The hooks cudapool sets, when the installed torch offers them:
# (name, setter on torch._C._CUDAPluggableAllocator, exported symbol of _C).
_HOOKS: Tuple[Tuple[str, str, str], ...] = (
    ("init", "set_init_fn", "cudapool_init"),
    ("reset", "set_reset_fn", "cudapool_empty_cache"),
    ("memory_fraction", "set_memory_fraction_fn", "cudapool_set_memory_fraction"),
    ("record_stream", "set_record_stream_fn", "cudapool_record_stream"),
    ("base_alloc", "set_base_alloc_fn", "cudapool_base_alloc"),
    # CUDA graphs, use_mem_pool and cudagraph trees' warm-up (Note [Graph pools] in
    # csrc/devices/graphs.h): C++ functions with torch's signatures (csrc/devices/graph_hooks.cpp).
    ("begin_allocate_to_pool", "set_begin_allocate_to_pool", "cudapool_begin_allocate_to_pool"),
    ("end_allocate_to_pool", "set_end_allocate_to_pool_fn", "cudapool_end_allocate_to_pool"),
    ("release_pool", "set_release_pool", "cudapool_release_pool"),
)

#: The names of the hooks cudapool sets when torch offers them.
HOOK_NAMES: Tuple[str, ...] = tuple(name for name, _, _ in _HOOKS)

# torch._C functions that cudagraph trees (torch.compile(mode="reduce-overhead")) call and that
# torch's pluggable allocator does not forward: after enable() they raise REDUCE_OVERHEAD_MESSAGE.
_CUDAGRAPH_TREE_FUNCTIONS = (
    "_cuda_getCheckpointState",
    "_cuda_setCheckpointPoolState",
    "_cuda_checkPoolLiveAllocations",
)

#: What torch.compile(mode="reduce-overhead") raises on the pluggable path (the bridge answers
#: cudagraph trees' calls), and what to do instead.
REDUCE_OVERHEAD_MESSAGE = (
    "cudapool: torch.compile(mode='reduce-overhead') records CUDA graphs as cudagraph trees, which "
    "checkpoint and check the allocator's private pools (getCheckpointState, setCheckpointPoolState, "
    "checkPoolLiveAllocations); cudapool's torch bridge answers them, but this process runs on torch's "
    "pluggable allocator (CUDAPOOL_BRIDGE=0, or a bridge not built for this torch: python -m cudapool info "
    "says which), which does not forward those calls. Reinstall cudapool against this torch to get the "
    "bridge, or use plain CUDA graphs: set torch._inductor.config.triton.cudagraph_trees = False before "
    "compiling (reduce-overhead then captures each graph with torch.cuda.graph), or compile with "
    "mode='max-autotune-no-cudagraphs'."
)

# Keys some torch versions' memory_stats() have that the pool does not track: always this
# value, and only when the installed torch documents the key (so the key set stays equal to
# that torch's). num_oom_rejections counts allocations refused up front by torch's own OOM
# pre-emption policy, which cudapool does not have.
_EXTRA_STATS: Dict[str, int] = {"num_oom_rejections": 0}

# The torch functions that answer from cudapool once it is enabled. torch's own
# memory_allocated / memory_reserved / max_memory_* / memory_cached call the module-global
# memory_stats of torch.cuda.memory, so they follow without being replaced.
_PATCHED = (
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_summary",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "reset_max_memory_allocated",
    "reset_max_memory_cached",
    "get_per_process_memory_fraction",
    "_snapshot",
    "memory_snapshot",
    "_record_memory_history",
    "_dump_snapshot",
)

_NOT_FIRST_MESSAGE = (
    "cudapool.enable() must be called before the first CUDA use: torch's CUDA allocator "
    "is already initialised in this process (CUDA has been used, or another allocator was "
    "installed), and it cannot be swapped after that. Call cudapool.enable() at the top of the script, before any tensor "
    "or model is moved to the GPU (or run the script with `python -m cudapool run SCRIPT`)."
)

_lock = threading.RLock()


#: Set to 0 to use torch's pluggable allocator path even when the bridge is built.
BRIDGE_ENV = "CUDAPOOL_BRIDGE"


class _State:
    def __init__(self) -> None:
        self.allocator: Any = None  # torch's allocator object: the pluggable one, or the bridge's
        self.path: Optional[str] = None  # "bridge" or "pluggable" once enabled
        self.bridge_lib: Optional[ctypes.CDLL] = None
        self.config: Optional[str] = None  # the effective configuration, formatted
        self.hooks: Tuple[str, ...] = ()
        self.originals: Dict[Tuple[str, str], Any] = {}  # (module, name) -> torch's function
        self.warned_record_stream = False
        self.oom_thrower = False  # out of memory raises torch.OutOfMemoryError (_torch_oom installed)
        self.torch_oom_lib: Optional[ctypes.CDLL] = None
        self.mem_pool_allocator: Any = None  # mem_pool_allocator()'s, never swapped in


_state = _State()


# -- public -----------------------------------------------------------------------------------


def enabled() -> bool:
    """True once :func:`enable` has made cudapool torch's CUDA allocator in this process."""
    return _state.allocator is not None


def allocator_path() -> Optional[str]:
    """How cudapool is torch's allocator: "bridge" (torch's own allocator interface, every call
    answered by the pool), "pluggable" (torch's CUDAPluggableAllocator, the fallback), or None
    before :func:`enable`."""
    return _state.path


def hooks_set() -> Tuple[str, ...]:
    """The optional allocator hooks cudapool set on torch's pluggable allocator (a subset of
    HOOK_NAMES, depending on the torch version); () through the bridge, which needs none."""
    return _state.hooks


def oom_error_type() -> Optional[str]:
    """What an allocation that runs out of memory raises once cudapool is enabled:
    "torch.OutOfMemoryError" (c10::OutOfMemoryError, thrown by the bridge or through
    cudapool._torch_oom) or "RuntimeError" (the pluggable path without that library). None
    before :func:`enable`."""
    if not enabled():
        return None
    return "torch.OutOfMemoryError" if _state.oom_thrower else "RuntimeError"


def enabled_config() -> Optional[str]:
    """The configuration cudapool was enabled with (formatted, defaults filled in), or None."""
    return _state.config


def enable(**config: Any) -> None:
    """Make cudapool the CUDA memory allocator of torch in this process.

    The configuration is a named policy's (``policy="cudapool"`` by default, or
    ``policy="builtin"`` for the built-in allocator's rules; also settable in CUDAPOOL_CONF as
    ``policy:NAME``), with CUDAPOOL_CONF's entries on top and the keyword arguments on top of
    those (a keyword wins over the environment's entry of the same key); it is checked before anything changes
    (ValueError naming the bad key). Must run before the first CUDA use: RuntimeError when
    torch has already initialised CUDA. Calling it again is a no-op when no configuration or
    the same configuration is given; a different configuration is a RuntimeError.
    """
    with _lock:
        text = _config.resolve(config, use_policy=True)
        effective = _config.effective(text)
        if enabled():
            if config and effective != _state.config:
                raise RuntimeError(
                    f"cudapool is already enabled with {_state.config!r}; the allocator "
                    f"cannot be reconfigured in this process (asked for {effective!r})"
                )
            return
        _require_cuda_build()
        if _cuda_initialized():
            raise RuntimeError(_NOT_FIRST_MESSAGE)
        if _C.device_config() != effective:
            _C.configure(text)  # RuntimeError once a pool exists: nothing is swapped then
        watch_paging(effective)  # a region under a policy without page-mapped memory warns
        bridge, why = _load_bridge()
        if bridge is not None:
            _install_bridge(bridge)
            _state.config = effective
            return
        if why:
            warnings.warn(
                f"cudapool: {why}: falling back to torch's pluggable allocator, which forwards only some of "
                f"torch's allocator calls (cudnn.benchmark, MemPool, torch's C++ statistics and snapshots, OOM "
                f"observers are lost; docs/pytorch.md has the table). To fix, {_REINSTALL}.",
                RuntimeWarning,
                stacklevel=3,
            )
        allocator, hooks = _make_allocator()
        _swap(allocator)
        _state.allocator = allocator
        _state.path = "pluggable"
        _state.config = effective
        _state.hooks = hooks
        _patch_torch()
        _refuse_cudagraph_trees()
        _state.oom_thrower = _install_oom_thrower()
        _warn_if_cudnn_benchmark()


# -- device arguments -------------------------------------------------------------------------


def _torch_if_imported() -> Any:
    return sys.modules.get("torch")


def _cuda_initialized() -> bool:
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
    if _cuda_initialized():
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


def _extra_stats() -> Dict[str, int]:
    """The entries of _EXTRA_STATS that the installed torch's memory_stats documents."""
    global _extra_stats_cache
    if _extra_stats_cache is None:
        if "torch" not in sys.modules:
            return {}  # torch not in use: the pool's own key set (and torch stays unimported)
        doc = ""
        try:
            import torch.cuda.memory as torch_memory

            original = _state.originals.get((torch_memory.__name__, "memory_stats"), torch_memory.memory_stats)
            doc = original.__doc__ or ""
        except Exception:  # a torch without CUDA support: the pool's own key set
            pass
        _extra_stats_cache = {k: v for k, v in _EXTRA_STATS.items() if k in doc}
    return _extra_stats_cache


_extra_stats_cache: Optional[Dict[str, int]] = None


def memory_stats(device: Any = None) -> "OrderedDict[str, int]":
    """The statistics of ``device``'s pool under torch's key names, sorted by key, as
    ``torch.cuda.memory_stats`` returns them. All zero before the device's first allocation."""
    stats = dict(_C.device_pool(device_index(device)).stats())
    for key, value in _extra_stats().items():
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
    if _cuda_initialized():
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


def _reset_max_memory_allocated(device: Any = None) -> None:
    warnings.warn(
        "torch.cuda.reset_max_memory_allocated now calls torch.cuda.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.",
        FutureWarning,
        stacklevel=2,
    )
    reset_peak_memory_stats(device)


def _reset_max_memory_cached(device: Any = None) -> None:
    warnings.warn(
        "torch.cuda.reset_max_memory_cached now calls torch.cuda.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.",
        FutureWarning,
        stacklevel=2,
    )
    reset_peak_memory_stats(device)


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
    with _lock:
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


_REPLACEMENTS = {
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


# -- the swap ---------------------------------------------------------------------------------


def _require_cuda_build() -> None:
    import torch

    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError(
            f"cudapool needs a CUDA build of torch; torch {torch.__version__} is built without CUDA support"
        )


def _symbol_address(lib: ctypes.CDLL, name: str) -> int:
    address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    if not address:
        raise RuntimeError(f"cudapool: {lib._name} exports no {name}")
    return address


def _make_allocator() -> Tuple[Any, Tuple[str, ...]]:
    """torch's pluggable allocator over our exported functions, with every hook this torch
    offers set. Returns it and the names of the hooks set."""
    import torch.cuda.memory as tcm

    allocator = tcm.CUDAPluggableAllocator(_C.__file__, "cudapool_alloc", "cudapool_free")
    lib = ctypes.CDLL(_C.__file__)  # the loaded extension itself: same pools
    raw = allocator.allocator()
    hooks = []
    for name, setter, symbol in _HOOKS:
        set_fn = getattr(raw, setter, None)
        if set_fn is None:
            continue
        set_fn(_symbol_address(lib, symbol))
        hooks.append(name)
    if "record_stream" not in hooks and not _state.warned_record_stream:
        _state.warned_record_stream = True
        warnings.warn(
            "this torch's pluggable allocator has no record_stream hook: Tensor.record_stream() "
            "does nothing under cudapool, so a tensor used on a stream other than the one it "
            "was allocated on may be reused while that stream still reads it",
            RuntimeWarning,
            stacklevel=3,
        )
    return allocator, tuple(hooks)


# -- out of memory as torch.OutOfMemoryError (Note [Out-of-memory type] in csrc/devices/abi.h) ---

_REINSTALL = (
    "reinstall cudapool against the torch in use, without build isolation "
    "(pip install --no-build-isolation --force-reinstall --no-deps cudapool, or from a checkout "
    "pip install --no-build-isolation -e .)"
)


def _library_path(stem: str) -> Optional[str]:
    """The path of the library cudapool.<stem> beside _C, or None when it was not built."""
    paths = (os.path.join(os.path.dirname(_C.__file__), stem + s) for s in importlib.machinery.EXTENSION_SUFFIXES)
    return next((path for path in paths if os.path.isfile(path)), None)


def torch_oom_library_path() -> Optional[str]:
    """The path of cudapool._torch_oom (the library that throws c10::OutOfMemoryError), or
    None when it was not built (torch was not importable when cudapool was built)."""
    return _library_path("_torch_oom")


def torch_bridge_library_path() -> Optional[str]:
    """The path of cudapool._torch_bridge (cudapool as torch's own allocator), or None when it
    was not built (no CUDA build of torch, or no CUDA runtime headers, when cudapool was built)."""
    return _library_path("_torch_bridge")


def _load_torch_library(path: str, version_symbol: str) -> Tuple[Optional[ctypes.CDLL], str]:
    """The library at ``path`` loaded, if it was built for the running torch (its
    ``version_symbol`` says which), else None and why."""
    import torch

    try:
        lib = ctypes.CDLL(path)
        getattr(lib, version_symbol).restype = ctypes.c_char_p
        built_for = getattr(lib, version_symbol)().decode()
    except (OSError, AttributeError) as exc:  # torch's libraries missing, or their symbols changed
        return None, f"{path} cannot be loaded ({exc})"
    running = str(torch.__version__)
    if built_for != running:
        return None, f"{path} was built for torch {built_for}, but torch {running} is running"
    return lib, ""


def _load_torch_oom() -> Tuple[Optional[ctypes.CDLL], str]:
    """cudapool._torch_oom loaded if it was built for the running torch, else None and why ("": not built)."""
    path = torch_oom_library_path()
    return (None, "") if path is None else _load_torch_library(path, "cudapool_torch_oom_torch_version")


def _load_bridge() -> Tuple[Optional[ctypes.CDLL], str]:
    """cudapool._torch_bridge loaded, if it was built for the running torch and CUDAPOOL_BRIDGE is
    not 0, else None and why ("" when CUDAPOOL_BRIDGE=0 asked for the pluggable path)."""
    if os.environ.get(BRIDGE_ENV, "") == "0":
        return None, ""
    path = torch_bridge_library_path()
    if path is None:
        return (
            None,
            "cudapool._torch_bridge was not built (no CUDA build of torch was importable when cudapool was built)",
        )
    return _load_torch_library(path, "cudapool_bridge_torch_version")


def _install_bridge(lib: ctypes.CDLL) -> None:
    """Make the bridge torch's allocator (torch's own swap). RuntimeError when torch refuses."""
    import torch.cuda.memory as tcm

    lib.cudapool_bridge_install.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.cudapool_bridge_install.restype = ctypes.c_int
    buf = ctypes.create_string_buffer(4096)
    if lib.cudapool_bridge_install(buf, len(buf)) != 0:
        message = buf.value.decode(errors="replace")
        if "already initialized allocator" in message:
            raise RuntimeError(_NOT_FIRST_MESSAGE)
        raise RuntimeError(f"cudapool: torch refused the bridge allocator: {message}")
    _state.bridge_lib = lib
    _state.allocator = tcm._get_current_allocator()
    _state.path = "bridge"
    _state.hooks = ()
    _state.oom_thrower = True  # the bridge throws c10::OutOfMemoryError itself


def _install_oom_thrower() -> bool:
    """Make _C's allocation throw c10::OutOfMemoryError through cudapool._torch_oom; True when
    done. A library built for another torch is not used: a RuntimeWarning says so and how to
    fix it, and out of memory raises RuntimeError."""
    lib, why = _load_torch_oom()
    if lib is None:
        if why:
            warnings.warn(
                f"cudapool: {why}: out of memory raises RuntimeError instead of torch.OutOfMemoryError, "
                f"and torch's recovery from out of memory (cuDNN's workspace fallback) cannot see it. "
                f"To fix, {_REINSTALL}.",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    ours = ctypes.CDLL(_C.__file__)
    ours.cudapool_set_oom_thrower.argtypes = [ctypes.c_void_p]
    ours.cudapool_set_oom_thrower.restype = None
    ours.cudapool_set_oom_thrower(_symbol_address(lib, "cudapool_torch_oom_throw"))
    _state.torch_oom_lib = lib  # keep it loaded while the thrower is installed
    return True


def _swap(allocator: Any) -> None:
    import torch.cuda.memory as tcm

    try:
        tcm.change_current_allocator(allocator)
    except RuntimeError as exc:
        if "already initialized allocator" not in str(exc):
            raise
        raise RuntimeError(_NOT_FIRST_MESSAGE) from exc


def _patch_torch() -> None:
    import torch
    import torch.cuda.memory as tcm

    for module in (tcm, torch.cuda):
        for name in _PATCHED:
            original = getattr(module, name, None)
            if original is None:
                continue
            _state.originals[(module.__name__, name)] = original
            setattr(module, name, _REPLACEMENTS[name])


def _warn_if_cudnn_benchmark() -> None:
    """cuDNN's benchmark mode asks the allocator for its largest free block (cacheInfo),
    which torch's pluggable allocator does not provide: the first benchmarked convolution
    would raise. Say so when the mode is already on."""
    import torch

    try:
        on = bool(torch.backends.cudnn.benchmark)
    except Exception:  # a torch without cuDNN bindings
        return
    if on:
        warnings.warn(
            "torch.backends.cudnn.benchmark is True, but torch's pluggable allocator (which "
            "cudapool plugs into) does not support cacheInfo, which cuDNN's benchmark mode "
            "calls: benchmarked convolutions may fail with 'CUDAPluggableAllocator does not yet "
            "support cacheInfo'. Set torch.backends.cudnn.benchmark = False under cudapool.",
            RuntimeWarning,
            stacklevel=3,
        )


def torch_hooks_offered() -> Tuple[str, ...]:
    """The hooks the installed torch's pluggable allocator offers (names as in
    :func:`hooks_set`, plus the ones cudapool does not set). Empty without a CUDA build."""
    import torch

    cls = getattr(torch._C, "_CUDAPluggableAllocator", None)
    if cls is None:
        return ()
    return tuple(name for name, setter, _ in _HOOKS if hasattr(cls, setter))


def graph_pools() -> List[Dict[str, Any]]:
    """The private pools of CUDA graphs and ``torch.cuda.MemPool`` ids that cudapool holds now
    (oldest first): ``device``, ``id`` (torch's MempoolId pair), ``uses`` (captures or pool
    uses not released yet), ``window_open`` (allocations are being routed into it),
    ``allocated``, ``reserved``, ``allocations``, ``region`` (the region it was captured in, or
    None: docs/regions.md) and ``paused`` (bytes a pause gave back). A pool goes once torch
    released it and its last allocation is freed."""
    return _C.graph_pools()


def mem_pool_allocator() -> Any:
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` over cudapool, not swapped in, for
    ``torch.cuda.MemPool(allocator=cudapool.mem_pool_allocator().allocator())``: torch's own
    caching allocator stays the process's allocator and asks cudapool for the whole segments of
    that pool only (``with torch.cuda.use_mem_pool(pool): ...``). Use it without ``enable()``:
    under ``enable()`` through the bridge a plain ``torch.cuda.MemPool()`` is served by cudapool
    already, and on the pluggable fallback torch refuses ``MemPool`` ("does not yet support
    createOrIncrefPool"). The same object is returned on every call."""
    _require_cuda_build()
    with _lock:
        if _state.mem_pool_allocator is None:
            import torch.cuda.memory as tcm

            allocator = tcm.CUDAPluggableAllocator(_C.__file__, "cudapool_alloc", "cudapool_free")
            lib = ctypes.CDLL(_C.__file__)
            raw = allocator.allocator()
            for _, setter, symbol in _HOOKS:
                set_fn = getattr(raw, setter, None)
                if set_fn is not None:
                    set_fn(_symbol_address(lib, symbol))
            _state.mem_pool_allocator = allocator
        return _state.mem_pool_allocator


def _refuse_cudagraph_trees() -> None:
    """Make cudagraph trees' allocator calls raise REDUCE_OVERHEAD_MESSAGE instead of torch's
    bare "does not yet support"."""
    import torch

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(REDUCE_OVERHEAD_MESSAGE)

    for name in _CUDAGRAPH_TREE_FUNCTIONS:
        if hasattr(torch._C, name):
            _state.originals[("torch._C", name)] = getattr(torch._C, name)
            setattr(torch._C, name, refuse)

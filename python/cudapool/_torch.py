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
  functions are replaced by cudapool's (:mod:`cudapool._torch_stats`). Used when the bridge was
  not built, was built for another torch (a warning says so and how to rebuild), or
  CUDAPOOL_BRIDGE=0 asks for it.

Either swap only works before CUDA is initialised in the process. The libraries built against
torch are found and loaded by :mod:`cudapool._torch_libraries`; the statistics, snapshots and
history torch's functions answer from are :mod:`cudapool._torch_stats`'.
"""

import ctypes
import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple

from . import _C, _config
from ._torch_libraries import REINSTALL, load_bridge, load_torch_oom, symbol_address
from ._torch_stats import REPLACEMENTS, cuda_initialized, extra_stats
from .regions import watch_paging

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

_NOT_FIRST_MESSAGE = (
    "cudapool.enable() must be called before the first CUDA use: torch's CUDA allocator "
    "is already initialised in this process (CUDA has been used, or another allocator was "
    "installed), and it cannot be swapped after that. Call cudapool.enable() at the top of the script, before any tensor "
    "or model is moved to the GPU (or run the script with `python -m cudapool run SCRIPT`)."
)

_lock = threading.RLock()


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
        if cuda_initialized():
            raise RuntimeError(_NOT_FIRST_MESSAGE)
        if _C.device_config() != effective:
            _C.configure(text)  # RuntimeError once a pool exists: nothing is swapped then
        watch_paging(effective)  # a region under a policy without page-mapped memory warns
        bridge, why = load_bridge()
        if bridge is not None:
            _install_bridge(bridge)
            _state.config = effective
            return
        if why:
            warnings.warn(
                f"cudapool: {why}: falling back to torch's pluggable allocator, which forwards only some of "
                f"torch's allocator calls (cudnn.benchmark, MemPool, torch's C++ statistics and snapshots, OOM "
                f"observers are lost; docs/pytorch.md has the table). To fix, {REINSTALL}.",
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


# -- the swap ---------------------------------------------------------------------------------


def _require_cuda_build() -> None:
    import torch

    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError(
            f"cudapool needs a CUDA build of torch; torch {torch.__version__} is built without CUDA support"
        )


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
        set_fn(symbol_address(lib, symbol))
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
    lib, why = load_torch_oom()
    if lib is None:
        if why:
            warnings.warn(
                f"cudapool: {why}: out of memory raises RuntimeError instead of torch.OutOfMemoryError, "
                f"and torch's recovery from out of memory (cuDNN's workspace fallback) cannot see it. "
                f"To fix, {REINSTALL}.",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    ours = ctypes.CDLL(_C.__file__)
    ours.cudapool_set_oom_thrower.argtypes = [ctypes.c_void_p]
    ours.cudapool_set_oom_thrower.restype = None
    ours.cudapool_set_oom_thrower(symbol_address(lib, "cudapool_torch_oom_throw"))
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

    extra_stats()  # read from torch's own memory_stats, before it is replaced
    for module in (tcm, torch.cuda):
        for name, replacement in REPLACEMENTS.items():
            original = getattr(module, name, None)
            if original is None:
                continue
            _state.originals[(module.__name__, name)] = original
            setattr(module, name, replacement)


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
                    set_fn(symbol_address(lib, symbol))
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

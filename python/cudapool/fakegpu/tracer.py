"""Record the allocation trace a PyTorch program would make on a GPU, without a GPU.

    from cudapool.lab.tracer import Tracer

    with Tracer(device="meta") as tr:
        model = GPT(device="meta")          # built inside: its parameters are allocations too
        train(model, steps=10)
    trace = tr.trace(meta={"workload": "gpt"})
    cudapool.lab.trace.save(trace, "gpt.cptrace")

How it works
------------
A :class:`torch.utils._python_dispatch.TorchDispatchMode` sees every ATen operation the
program runs: factory functions (``torch.empty``, ``zeros``, ``randn``, ``tensor``, ...), the
forward ops, the backward ops autograd runs (gradients included), and the optimizer's ops
(its state, foreach temporaries). For each tensor an operation returns, the tracer looks at its
storage (``Tensor.untyped_storage()``): a storage not seen before is one allocation of
``storage.nbytes()`` bytes under a fresh id. The free is recorded when that storage dies, by
``weakref.finalize`` on its Python object: torch keeps that object alive for as long as the
C++ storage lives (views, ``.detach()``, ``nn.Parameter`` and saved-for-backward tensors
all share it), so the callback runs exactly when the last user lets go. Views and in-place
operations return storages already seen and allocate nothing; an operation that grows a
known storage in place (``resize_``, ``out=`` with a larger result) is recorded as the
allocation of the new size followed by the free of the old one, as CUDA's resize does.

The program runs on ``"cpu"`` (real math: exact, slow) or on ``"meta"`` (no math, no
memory, fast; sizes are exact because meta kernels compute the same output shapes). For
dense tensors a storage holds the same number of bytes on CUDA as on the CPU, so the sizes
are the ones a GPU run would request. Storages of zero bytes are left out (the CUDA caching
allocator makes no allocation for them). Every event carries the time
(``time.perf_counter_ns()``), a stream and a device index; the stream is 0 unless the
program marks work with ``tr.stream(n)`` (a "virtual stream": on the CPU there are no CUDA
streams). Allocations still live when the ``with`` block ends stay without a free; a replay
deals with them.

Build the model and optimizer inside the ``with`` block so that their allocations are in the
trace. A storage an operation reads that the tracer has not seen (a tensor made before the
block, or made below the dispatcher, as ``torch.tensor(data, device="meta")`` is) is recorded
as allocated at its first use; :meth:`Tracer.watch` records existing tensors, modules and
optimizers at once instead.

``device`` chooses which storages count: with ``Tracer(device="meta")`` only meta storages
are recorded, so host-side tensors that a GPU run also keeps on the CPU (AdamW's ``step``
counters, Python scalars wrapped by ``torch.tensor``) are left out, as they should be. A
program traced on ``"cpu"`` has no such distinction: those few small host tensors are
recorded as allocations too.

Observing without changing the program
--------------------------------------
Three things would make a traced program allocate otherwise than on a GPU, and the tracer
undoes each:

- **Backward.** Under any dispatch mode (this tracer's included), and always on meta tensors,
  torch's autograd engine sums gradients out of place: a parameter's second gradient goes to a
  new tensor instead of into ``.grad``, a tensor used twice gets its gradients summed into a new
  one. On fake CUDA tensors it does not run at all without a GPU. Inside the block, backward
  passes (``loss.backward()``, ``torch.autograd.grad``) run on the tracer's own pass
  (:mod:`cudapool.lab._backward`, ``backward="tracer"``, the default): torch's node formulas, in
  the engine's order, each node's saved tensors dropped once it has run, and the two sums
  made as the engine makes them on ordinary dense CUDA tensors. ``backward="torch"`` keeps
  torch's engine. Hooks on non-leaf tensors and on graph nodes, ``retain_grad()`` and
  ``create_graph=True`` are not supported by the tracer's pass (the last goes to torch's engine).
- **Formulas that switch.** Some backward formulas write into zeros in place on CUDA but use
  an out-of-place form on "subclass-like" tensors: indexing (``index_put``), max/min along a
  dimension (``scatter``), gather (``scatter_add``), select and slice (``*_scatter``). Inside
  a node of the tracer's pass, such a form applied to a tensor the same node made is recorded
  as writing into it: no allocation.
- **Composite operations under inference_mode.** With autograd's keys off, an operation with a
  composite kernel (``where`` with a scalar, ``einsum``) would reach the tracer whole and run its
  parts out of its sight; the tracer runs its parts in view, as CUDA does, so their temporaries
  are recorded.

Measured (benchmarks/tracer_public.py, benchmarks/tracer_fidelity.py, docs/tracer.md's
section): on ten memory snapshots recorded on GPUs for public programs, traces on fake CUDA
have every allocation and free of the window, in order and to the byte.

What the tracer cannot see
--------------------------
The trace holds the tensors the program makes through ATen operations, and the scratch
buffers of the kernels cudapool.lab._kernel_scratch models (programs traced for CUDA, on meta or
fake CUDA: the staging of large sum/mean reductions and the sort of ``index_put`` with
``accumulate=True``; ``gpu=`` gives the GPU they are sized for, by default an H100/H200;
``kernel_scratch=False`` leaves them out). It does not see:

- library workspaces and handles: cuBLAS and cuBLASLt workspaces (``workspace_bytes=N`` models
  torch's per-stream one), cuDNN convolution and batch-norm workspaces, cuFFT plans, cuSOLVER
  buffers;
- the scratch of other kernels (staging of other reductions, sort and top-k, scans, embedding's
  own backward kernel) and the CUDA caching allocator's own internal allocations;
- NCCL and other communication buffers;
- memory that custom C++/CUDA extensions or other libraries allocate without going through
  the dispatcher (``cudaMalloc`` directly, Triton autotuning buffers, CUDA graphs' pools);
- choices a GPU makes that meta tensors do not follow: CUDA autocast (trace on fake CUDA:
  ``Tracer(device="cuda")`` without a GPU), fused kernels such as scaled_dot_product_attention's
  flash and memory-efficient backends (other saved buffers than the math path), dropout's bool
  mask on CUDA, cuDNN batch norm's reserve buffer, optimizers' foreach/fused defaults by device
  (pass ``foreach=True`` to get the CUDA default on meta).

``meta["unseen"]`` lists what a trace does not hold.

Windows, fake CUDA, workspaces
------------------------------
``window=True``: storages live at ``__enter__`` (reachable from Python tensors, gradients
included) are the window's start (``meta["window_start"]``), not allocations; their frees are
recorded. Views and in-place results of storages the tracer does not record allocate nothing.
A graph built before the window keeps its saved tensors until it is freed (the tracer can
drop only those of graphs built inside it).
``fake=True`` (the default for ``device="cuda"`` without a GPU) or ``fake_mode=``: fake CUDA
tensors, with ``torch.autocast("cuda")`` applying CUDA's rules, forward and backward. A model
whose initialisation needs real values (``trunc_normal_``) is built on meta and moved with
``model.to_empty(device="cuda")`` inside the fake mode. ``workspace_bytes=N``: a cuBLAS
workspace of N bytes per stream and thread (backward passes: autograd's) at its first BLAS
operation, never freed. ``host="real"``: only CUDA tensors are fake (:mod:`cudapool.lab._hostreal`;
``on_host_read(tensor, what)`` hears of each copy of one to the host).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _backward, _kernel_scratch
from ._leaves import tensors_in
from .trace import ALLOC, FREE, UNSEEN, Trace

__all__ = ["Tracer", "UNSEEN"]

_now = time.perf_counter_ns

#: ATen operations that run on cuBLAS / cuBLASLt on CUDA (the first one on a stream makes
#: torch allocate that stream's workspace).
_BLAS_OPS = frozenset(
    "aten::" + n
    for n in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "addmv",
        "mv",
        "_addmm_activation",
        "_scaled_mm",
        "dot",
        "vdot",
    )
)

#: Operations that return their input's storage as a tensor just made (torch.tensor's data):
#: an allocation, not a view.
_LIFTS = frozenset((torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default))


def _window_start(start: List[Tuple[int, int, int, int]]) -> Dict[str, Any]:
    """The storages live when a window began, per device, in the layout of
    cudapool.lab.torch_snapshot's window starts; their addresses are not known, so they are listed
    as ``allocations`` ([id, size, stream], oldest first) with no segments."""
    by_device: Dict[str, Dict[str, Any]] = {}
    for ident, size, stream, device in start:
        d = by_device.setdefault(
            str(device),
            {
                "segments": [],
                "allocations": [],
                "reserved_bytes": 0,
                "live_bytes": 0,
                "live_requested_bytes": 0,
                "live_blocks": 0,
                "problems": [],
            },
        )
        d["allocations"].append([ident, size, stream])
        d["live_bytes"] += size
        d["live_requested_bytes"] += size
        d["live_blocks"] += 1
    return by_device


#: Out-of-place operations that backward formulas use instead of their in-place forms when
#: tensors are "subclass-like" (meta, fake, any dispatch mode): gather's backward scatters
#: into zeros with scatter_add instead of scatter_add_, max/min's with scatter, indexing's with
#: index_put, select/slice's with select_scatter/slice_scatter, ...
_IN_PLACE_STAND_INS = frozenset(
    "aten::" + n
    for n in (
        "scatter",
        "scatter_add",
        "scatter_reduce",
        "index_add",
        "index_put",
        "_unsafe_index_put",
        "index_copy",
        "index_fill",
        "masked_scatter",
        "masked_fill",
        "slice_scatter",
        "select_scatter",
        "diagonal_scatter",
        "as_strided_scatter",
    )
)

_COMPOSITE: Dict[Any, bool] = {}


def _decomposes_on_cuda(func: Any) -> bool:
    """Whether CUDA runs ``func`` through its CompositeImplicitAutograd kernel (no kernel of
    its own for CUDA)."""
    known = _COMPOSITE.get(func)
    if known is None:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        try:
            known = bool(has(func.name(), "CompositeImplicitAutograd")) and not has(func.name(), "CUDA")
        except RuntimeError:  # not a dispatcher operator (prim::device, ...)
            known = False
        _COMPOSITE[func] = known
    return known


class _Live:
    """One live allocation: the storage it stands for is alive."""

    __slots__ = ("ident", "size", "stream", "device", "finalizers")

    def __init__(self, ident: int, size: int, stream: int, device: int) -> None:
        self.ident = ident
        self.size = size
        self.stream = stream
        self.device = device
        #: storage key -> the callback run at that storage's death: one storage, or several when
        #: a backward formula's out-of-place result stands for an in-place one (see _Mode).
        self.finalizers: Dict[int, weakref.finalize] = {}

    def watch(self, key: int, storage: Any, freed: Any) -> None:
        fin = weakref.finalize(storage, freed, key, self.ident)
        fin.atexit = False
        self.finalizers[key] = fin


class _Mode(TorchDispatchMode):
    """Runs every operation, then shows its outputs to the tracer."""

    def __init__(self, tracer: "Tracer") -> None:
        super().__init__()
        self._tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._tracer.adopt_inputs:
            self._tracer._observe((args, kwargs), "first use")
        if _decomposes_on_cuda(func):
            # Reached here only with autograd's keys excluded (inference_mode): the op's
            # composite kernel would run below this mode and hide its own temporaries (where's
            # scalar, einsum's copies). Run it with the mode still on, as CUDA runs it.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        into = self._tracer._in_place_stand_in(func, args)
        out = func(*args, **kwargs)
        self._tracer._observe(out, func, (args, kwargs), into)
        if self._tracer.workspace_bytes and func._schema.name in _BLAS_OPS:
            # After the result: cuBLAS takes its workspace inside the call.
            self._tracer._workspace(args)
        if self._tracer.cuda_scratch and func._schema.name in _kernel_scratch.OPS:
            self._tracer._kernel_scratch(func, args, kwargs)
        return out


class Tracer:
    """Records storage allocations and frees of the code run inside ``with Tracer() as tr:``.

    ``device``: the device type whose storages count ("cpu", "meta", "cuda", ...), or None for
    every device. ``device_index``: the device index written into events of devices that have
    none (cpu, meta); CUDA tensors keep their own. ``adopt_inputs``: a storage an operation
    reads that the tracer has not seen (made before the ``with`` block, or outside the
    dispatcher, as ``torch.tensor(data, device="meta")`` is) is recorded as allocated at its
    first use; with False such storages are ignored (:meth:`watch` records them explicitly).
    ``record_ops``: also remember which operation made each allocation (:attr:`alloc_ops`).
    ``window``, ``fake``, ``fake_mode``, ``workspace_bytes``: see the module notes.
    ``backward``: "tracer" (the default: backward passes inside the block run on
    :mod:`cudapool.lab._backward`) or "torch" (torch's engine). ``kernel_scratch``: model the scratch
    buffers of the CUDA kernels :mod:`cudapool.lab._kernel_scratch` knows (default: for meta and
    CUDA traces). ``gpu``: the GPU those are sized for: ``torch.cuda.get_device_properties(i)``,
    a dict with ``multi_processor_count`` and ``max_threads_per_multi_processor``, or a pair
    (default: 132 and 2048, an H100/H200).

    A tracer records one ``with`` block; it cannot be entered twice. While it records, it
    replaces ``torch.autograd.graph._engine_run_backward`` (process-wide) and pushes saved-tensor
    hooks (this thread).
    """

    def __init__(
        self,
        device: Optional[str] = None,
        device_index: int = 0,
        adopt_inputs: bool = True,
        record_ops: bool = False,
        window: bool = False,
        fake: Optional[bool] = None,
        workspace_bytes: Optional[int] = None,
        fake_mode: Optional[Any] = None,
        backward: Optional[str] = None,
        kernel_scratch: Optional[bool] = None,
        gpu: Any = None,
        host: str = "fake",
        on_host_read: Any = None,
    ) -> None:
        self.device_type = torch.device(device).type if device is not None else None
        self.device_index = int(device_index)
        self.adopt_inputs = adopt_inputs
        self.record_ops = record_ops
        self.window = window
        if fake is None:
            fake = fake_mode is not None or (self.device_type == "cuda" and not torch.cuda.is_available())
        if fake and self.device_type != "cuda":
            raise ValueError("fake=True traces fake CUDA tensors: use it with device='cuda'")
        self.fake = bool(fake)
        if host not in ("fake", "real"):
            raise ValueError(f"host must be 'fake' or 'real', not {host!r}")
        #: With fake CUDA: "fake" (host tensors too) or "real" (only CUDA ones: _hostreal).
        self.host = host
        self._on_host_read = on_host_read
        self._host_mode: Optional[Any] = None
        #: Whether the tracer's backward pass is running (its cuBLAS calls run on autograd's
        #: device thread on a GPU, whose handle has a workspace of its own).
        self._in_backward = False
        if workspace_bytes is not None and workspace_bytes < 0:
            raise ValueError(f"workspace_bytes must be >= 0, not {workspace_bytes}")
        self.workspace_bytes = workspace_bytes
        if backward is None:
            backward = "tracer"
        if backward not in ("tracer", "torch"):
            raise ValueError(f"backward must be 'tracer' or 'torch', not {backward!r}")
        #: Who runs backward passes inside the block: "tracer" (cudapool.lab._backward, the sums a GPU
        #: run makes) or "torch" (torch's engine).
        self.backward = backward
        self._saved: Optional[_backward.SavedTensors] = None
        #: Model the scratch buffers CUDA kernels take from the caching allocator where they are
        #: known (programs traced for CUDA: on meta or fake CUDA).
        self.cuda_scratch = self.device_type in ("meta", "cuda") if kernel_scratch is None else bool(kernel_scratch)
        #: (multiprocessors, threads per multiprocessor) the scratch is sized for.
        self.gpu = _kernel_scratch.gpu_shape(gpu)
        #: Storage keys allocated by the backward node running now (the tracer's backward).
        self._fresh: Optional[set] = None
        self._fresh_outer: List[Optional[set]] = []
        #: The fake tensor mode programs build their CUDA tensors in (``fake=True``), else None.
        self.fake_mode: Optional[Any] = fake_mode
        #: Storages live when the window began (``window=True``): key -> live allocation, in order.
        self._start: Dict[int, _Live] = {}
        self._start_order: List[Tuple[int, int, int, int]] = []  # (id, size, stream, device) at the start
        self._workspace_streams: Dict[Tuple[int, bool], int] = {}  # (stream, backward) -> its workspace's id
        self._patched: List[Tuple[Any, str, Any]] = []
        #: Events as (action, id, size, stream, device, time_ns), in order.
        self.events: List[Tuple[int, int, int, int, int, int]] = []
        #: id -> name of the operation that made the allocation (with ``record_ops``).
        self.alloc_ops: Dict[int, str] = {}
        self._live: Dict[int, _Live] = {}  # storage key (its C++ address) -> live allocation
        self._next_id = 1
        self._stream = 0
        self._mode: Optional[_Mode] = None
        self._state = "new"  # new -> tracing -> done
        self._lock = threading.RLock()
        self._live_bytes = 0
        self._peak_bytes = 0

    # ---- the with block -------------------------------------------------------------------

    def __enter__(self) -> "Tracer":
        if self._state != "new":
            raise RuntimeError("a Tracer records one with block; make a new one")
        self._state = "tracing"
        if self.fake:
            self._enter_fake()
        if self.window:
            self._scan_start()
        if self.backward == "tracer":
            self._enter_backward()
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                mode.__exit__(*exc)
        finally:
            self._exit_backward(exc)
            self._exit_fake(exc)
            with self._lock:
                self._state = "done"
                for live in list(self._live.values()) + list(self._start.values()):
                    for fin in live.finalizers.values():
                        fin.detach()
                    live.finalizers.clear()

    @contextlib.contextmanager
    def stream(self, n: int) -> Iterator[None]:
        """Allocations made inside are on virtual stream ``n`` (nesting restores the outer one)."""
        if n < 0:
            raise ValueError(f"stream must be >= 0, not {n}")
        outer, self._stream = self._stream, int(n)
        try:
            yield
        finally:
            self._stream = outer

    # ---- results -----------------------------------------------------------------------------

    def trace(self, meta: Optional[Dict[str, Any]] = None) -> Trace:
        """The events recorded so far as a :class:`cudapool.lab.trace.Trace`."""
        with self._lock:
            events = list(self.events)
            start = list(self._start_order)
        full_meta: Dict[str, Any] = {
            "tracer": "cudapool.tracer",
            "torch": torch.__version__,
            "traced_device": self.device_type,
            "fake_cuda": self.fake,
            "backward": self.backward,
            "workspace_bytes": self.workspace_bytes,
            "kernel_scratch": self.cuda_scratch,
            "gpu": {"multi_processor_count": self.gpu[0], "max_threads_per_multi_processor": self.gpu[1]},
            "unseen": self._unseen(),
        }
        if self.window:
            full_meta["window_start"] = _window_start(start)
        full_meta.update(meta or {})
        return Trace.from_events(events, meta=full_meta)

    def _unseen(self) -> List[str]:
        unseen = list(UNSEEN)
        if not self.cuda_scratch:
            unseen[1] = (
                "kernel_scratch: not modelled in this trace (a CPU trace, or kernel_scratch=False): staging of"
                " reductions, sorts, scans, cuDNN and cuFFT workspaces"
            )
        return unseen if self.workspace_bytes is None else unseen[1:]

    @property
    def live_bytes(self) -> int:
        """Bytes of recorded allocations not freed yet (storages live at a window's start
        included)."""
        return self._live_bytes

    @property
    def start_bytes(self) -> int:
        """Bytes of the storages that were live when the window began (``window=True``)."""
        return sum(size for _, size, _, _ in self._start_order)

    @property
    def peak_bytes(self) -> int:
        """The most :attr:`live_bytes` has been."""
        return self._peak_bytes

    @property
    def live_count(self) -> int:
        """Recorded allocations not freed yet."""
        return len(self._live)

    def ident_of(self, t: torch.Tensor) -> Optional[int]:
        """The id of the live allocation holding ``t``'s storage (one of the window's start
        included), or None when not recorded."""
        try:
            key = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None
        with self._lock:
            live = self._live.get(key) or self._start.get(key)
            return live.ident if live is not None else None

    # ---- the window's start and the fake CUDA device ----------------------------------------

    def _scan_start(self) -> None:
        """Make every storage live now (reachable from a Python tensor, gradients included) a
        storage of the window's start: known, not an allocation of the window."""
        seen: List[torch.Tensor] = []
        with warnings.catch_warnings():  # isinstance() on every object wakes deprecation warnings
            warnings.simplefilter("ignore")
            objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        for obj in objects:
            seen.append(obj)
            grad = obj.grad if obj.requires_grad and obj.is_leaf else None
            if grad is not None:
                seen.append(grad)
        for t in seen:
            storage = self._storage_of(t)
            if storage is None:
                continue
            key, size = storage._cdata, storage.nbytes()
            if size == 0 or key in self._start:
                continue
            device = t.device.index if t.device.index is not None else self.device_index
            live = _Live(self._next_id, size, self._stream, device)
            self._next_id += 1
            self._start[key] = live
            self._start_order.append((live.ident, size, live.stream, device))
            self._live_bytes += size
            live.watch(key, storage, self._freed)
        self._peak_bytes = max(self._peak_bytes, self._live_bytes)

    def _enter_fake(self) -> None:
        import torch.cuda.amp.common as amp_common
        from torch._subclasses.fake_tensor import FakeTensorMode

        # torch.autocast("cuda") switches itself off when no GPU is there: tell it one is, while
        # the fake mode lasts (only the two checks it makes).
        for owner, name, value in (
            (amp_common, "amp_definitely_not_available", lambda: False),
            (torch.cuda, "is_bf16_supported", lambda *a, **k: True),
        ):
            self._patched.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        if self.fake_mode is None:
            self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        if self.host == "real":
            from ._hostreal import HostReal

            # No driver to initialise: torch would before a CUDA factory or move (no fake mode on).
            self._patched.append((torch.cuda, "_lazy_init", torch.cuda._lazy_init))
            torch.cuda._lazy_init = lambda: None
            self._host_mode = HostReal(self.fake_mode, self._on_host_read)
            self._host_mode.__enter__()
            torch.empty(0, device="cuda")  # settles the current device, which moves ask for
        else:
            self.fake_mode.__enter__()

    def _enter_backward(self) -> None:
        """Backward passes inside the block run on :mod:`cudapool.lab._backward`, with every saved
        tensor kept where it can be dropped once its node has run."""
        import torch.autograd.graph as graph

        saved = self._saved = _backward.SavedTensors()
        saved.node_hook = self._node_boundary
        original = graph._engine_run_backward

        def engine_run_backward(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
            outer, self._in_backward = self._in_backward, True
            try:
                return _backward.run_backward(saved, t_outputs, *args, **kwargs)
            except _backward.Unsupported:
                return original(t_outputs, *args, **kwargs)
            finally:
                self._in_backward = outer

        for owner in (graph, torch.autograd):
            if getattr(owner, "_engine_run_backward", None) is original:
                self._patched.append((owner, "_engine_run_backward", original))
                setattr(owner, "_engine_run_backward", engine_run_backward)
        saved.__enter__()

    def _exit_backward(self, exc: Any) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            saved.__exit__(*exc)

    def _exit_fake(self, exc: Any) -> None:
        try:
            if self._host_mode is not None:
                mode, self._host_mode = self._host_mode, None
                mode.__exit__(*exc)
            elif self.fake_mode is not None:
                self.fake_mode.__exit__(*exc)
        finally:
            while self._patched:
                owner, name, value = self._patched.pop()
                setattr(owner, name, value)

    # ---- tensors made before the with block ---------------------------------------------------

    def watch(self, *objs: Any) -> int:
        """Record tensors that exist already (made before the ``with`` block) as allocations now.

        Takes tensors, ``nn.Module`` (parameters, buffers and gradients), optimizers (their
        state) and iterables of these. Storages already recorded are skipped. Returns the number
        of new allocations.
        """
        if self._state != "tracing":
            raise RuntimeError("watch() works inside the with block")
        before = self._next_id
        tensors: List[torch.Tensor] = []
        for obj in objs:
            self._collect(obj, tensors)
        self._observe(tensors, "watch")
        return self._next_id - before

    def _collect(self, obj: Any, into: List[torch.Tensor]) -> None:
        if isinstance(obj, torch.Tensor):
            into.append(obj)
            if obj.grad is not None:
                into.append(obj.grad)
        elif isinstance(obj, torch.nn.Module):
            for t in obj.parameters():
                self._collect(t, into)
            into.extend(obj.buffers())
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for p in group["params"]:
                    self._collect(p, into)
            for state in obj.state.values():
                into.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(obj, dict):
            for v in obj.values():
                self._collect(v, into)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                self._collect(v, into)
        else:
            raise TypeError(f"watch() takes tensors, modules, optimizers and collections, not {type(obj).__name__}")

    # ---- the work ------------------------------------------------------------------------------

    def _observe(self, out: Any, func: Any, inputs: Any = None, into: Optional[_Live] = None) -> None:
        for t in tensors_in(out):
            self._see(t, func, inputs, into)

    def _in_place_stand_in(self, func: Any, args: Any) -> Optional[_Live]:
        """Inside a node of the tracer's backward: for an out-of-place operation that formulas
        use instead of its in-place form on subclass-like tensors, applied to a tensor the same
        node made (zeros to scatter into), the allocation of that tensor; a GPU run writes into
        it instead of allocating a result."""
        if self._fresh is None or not args or func._schema.name not in _IN_PLACE_STAND_INS:
            return None
        target = args[0]
        if not isinstance(target, torch.Tensor):
            return None
        storage = self._storage_of(target)
        if storage is None:
            return None
        key = storage._cdata
        with self._lock:
            return self._live.get(key) if key in self._fresh else None

    def _kernel_scratch(self, func: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        """The scratch buffers the CUDA kernel of ``func`` takes and returns inside the call,
        where cudapool.lab._kernel_scratch models them (programs traced for CUDA only)."""
        if not args or not isinstance(args[0], torch.Tensor) or self._storage_of(args[0]) is None:
            return
        steps, what = _kernel_scratch.op_steps(func._schema.name, args, kwargs, self.gpu)
        self._temporaries(steps, what)

    def _temporaries(self, steps: Tuple[int, ...], what: str) -> None:
        with self._lock:
            if self._state != "tracing":
                return
            made: List[_Live] = []
            for step in steps:
                if step > 0:
                    made.append(self._record_alloc(step, self.device_index, what))
                else:
                    self._record_free(made[-step - 1])

    def _node_boundary(self, starting: bool) -> None:
        """The tracer's backward starts (True) or ends (False) running one node's formula
        (nested when a formula runs a backward of its own, as reentrant checkpointing does)."""
        if starting:
            self._fresh_outer.append(self._fresh)
            self._fresh = set()
        else:
            self._fresh = self._fresh_outer.pop() if self._fresh_outer else None

    def _storage_of(self, t: torch.Tensor) -> Any:
        if t.layout != torch.strided:
            return None  # sparse and other layouts: no single dense storage
        if self.device_type is not None and t.device.type != self.device_type:
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None  # a tensor without a storage of its own (some subclasses)

    def _input_keys(self, inputs: Any) -> set:
        keys = set()
        for t in tensors_in(inputs):
            storage = self._storage_of(t)
            if storage is not None:
                keys.add(storage._cdata)
        return keys

    def _see(self, t: torch.Tensor, func: Any, inputs: Any = None, into: Optional[_Live] = None) -> None:
        storage = self._storage_of(t)
        if storage is None:
            return
        key = storage._cdata
        size = storage.nbytes()
        with self._lock:
            if self._state != "tracing":
                return
            live = self._live.get(key)
            if live is not None:
                if size > live.size:
                    # Grown in place (resize_, out= with a larger result): CUDA allocates the
                    # new size, copies, then frees the old block.
                    self._realloc(key, live, size, storage, func)
                return
            if size == 0 or key in self._start:
                return
            if inputs is not None and func not in _LIFTS and key in self._input_keys(inputs):
                # A view or in-place result of a storage the operation read and the tracer
                # does not record (adopt_inputs=False): it allocates nothing.
                return
            if into is not None and size == into.size and into.finalizers:
                # The result of an in-place form's stand-in: the same allocation, now under a
                # second storage (freed when every one of them has died).
                self._live[key] = into
                into.watch(key, storage, self._freed)
                if self._fresh is not None:
                    self._fresh.add(key)
                return
            device = t.device.index if t.device.index is not None else self.device_index
            self._alloc(key, size, device, storage, func)

    def _record_alloc(self, size: int, device: int, what: Any) -> _Live:
        """A new allocation of ``size`` bytes on the current stream: its event, its operation's
        name (with ``record_ops``), the live and peak bytes. The caller holds the lock."""
        live = _Live(self._next_id, size, self._stream, device)
        self._next_id += 1
        self.events.append((ALLOC, live.ident, size, live.stream, device, _now()))
        if self.record_ops:
            self.alloc_ops[live.ident] = str(what)
        self._live_bytes += size
        if self._live_bytes > self._peak_bytes:
            self._peak_bytes = self._live_bytes
        return live

    def _alloc(self, key: int, size: int, device: int, storage: Any, func: Any) -> None:
        live = self._live[key] = self._record_alloc(size, device, func)
        live.watch(key, storage, self._freed)
        if self._fresh is not None:
            self._fresh.add(key)

    def _workspace(self, args: Any) -> None:
        """The first BLAS operation on a stream from a thread: the cuBLAS workspace torch
        allocates for that (handle, stream) through the caching allocator and keeps for the life
        of the handle (never freed). cuBLAS handles are per thread, and backward passes run on
        autograd's device thread on a GPU: the tracer's backward pass has workspaces of its own."""
        with self._lock:
            key = (self._stream, self._in_backward)
            if self._state != "tracing" or key in self._workspace_streams:
                return
            if not any(self._storage_of(t) is not None for t in tensors_in(args)):
                return  # not on the traced device
            live = self._record_alloc(int(self.workspace_bytes or 0), self.device_index, "cublas workspace")
            self._workspace_streams[key] = live.ident
            self._live[-1 - 2 * self._stream - int(self._in_backward)] = live  # a key no storage has

    def _realloc(self, key: int, old: _Live, size: int, storage: Any, func: Any) -> None:
        fin = old.finalizers.pop(key, None)
        if fin is not None:
            fin.detach()
        del self._live[key]
        self._alloc(key, size, old.device, storage, func)
        if not old.finalizers:  # no other storage stands for the old allocation
            self._record_free(old)

    def _record_free(self, live: _Live) -> None:
        self.events.append((FREE, live.ident, live.size, live.stream, live.device, _now()))
        self._live_bytes -= live.size

    def _freed(self, key: int, ident: int) -> None:
        """The storage behind allocation ``ident`` died (weakref.finalize callback)."""
        with self._lock:
            where = self._live if key in self._live else self._start
            live = where.get(key)
            if live is None or live.ident != ident or self._state != "tracing":
                return
            del where[key]
            live.finalizers.pop(key, None)
            if not live.finalizers:
                self._record_free(live)

    def __repr__(self) -> str:
        return (
            f"Tracer(device={self.device_type!r}, state={self._state}, events={len(self.events)}, "
            f"live={len(self._live)} ({self._live_bytes} B), peak={self._peak_bytes} B)"
        )

"""Record the allocation trace a PyTorch program would make on a GPU, without a GPU.

    from cudapool.fakegpu.tracer import Tracer

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
trace; a storage an operation reads that the tracer has not seen is recorded as allocated at
its first use (:meth:`Tracer.watch` records existing tensors, modules and optimizers at once).

docs/tracer.md says the rest once: how the tracer keeps a traced program allocating as on a
GPU (its own backward pass, :mod:`cudapool.fakegpu.backward`; out-of-place stand-ins of in-place
forms; composites under inference_mode, :mod:`cudapool.fakegpu.dispatch`), windows that start
mid-program (``window=True``), fake CUDA (``fake=``, ``fake_mode=``, ``host="real"``:
:mod:`cudapool.fakegpu.hostreal`), kernel scratch (:mod:`cudapool.fakegpu.kernel_scratch`) and
cuBLAS workspaces (``workspace_bytes=``), what a trace cannot hold (``meta["unseen"]``), and the
fidelity measured against GPU snapshots.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..lab.trace import ALLOC, FREE, UNSEEN, Trace
from . import backward as _backward
from . import kernel_scratch as _kernel_scratch
from .dispatch import IN_PLACE_STAND_INS, LIFTS, Live, Mode
from .leaves import tensors_in, tensors_of

__all__ = ["Tracer", "UNSEEN"]

_now = time.perf_counter_ns


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
    :mod:`cudapool.fakegpu.backward`) or "torch" (torch's engine). ``kernel_scratch``: model the scratch
    buffers of the CUDA kernels :mod:`cudapool.fakegpu.kernel_scratch` knows (default: for meta and
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
        #: With fake CUDA: "fake" (host tensors too) or "real" (only CUDA ones: hostreal).
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
        #: Who runs backward passes inside the block: "tracer" (cudapool.fakegpu.backward, the sums a GPU
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
        self._start: Dict[int, Live] = {}
        self._start_order: List[Tuple[int, int, int, int]] = []  # (id, size, stream, device) at the start
        self._workspace_streams: Dict[Tuple[int, bool], int] = {}  # (stream, backward) -> its workspace's id
        self._patched: List[Tuple[Any, str, Any]] = []
        #: Events as (action, id, size, stream, device, time_ns), in order.
        self.events: List[Tuple[int, int, int, int, int, int]] = []
        #: id -> name of the operation that made the allocation (with ``record_ops``).
        self.alloc_ops: Dict[int, str] = {}
        self._live: Dict[int, Live] = {}  # storage key (its C++ address) -> live allocation
        self._next_id = 1
        self._stream = 0
        self._mode: Optional[Mode] = None
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
        self._mode = Mode(self)
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

    def set_stream(self, n: int) -> None:
        """Allocations made from now on are on virtual stream ``n``."""
        if n < 0:
            raise ValueError(f"stream must be >= 0, not {n}")
        self._stream = int(n)

    def current_stream(self) -> int:
        """The virtual stream allocations are made on now."""
        return self._stream

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
    def workspaces_taken(self) -> int:
        """cuBLAS workspaces allocated: one per thread and stream that ran a BLAS operation."""
        return len(self._workspace_streams)

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
            live = Live(self._next_id, size, self._stream, device)
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
            from .hostreal import HostReal

            # No driver to initialise: torch would before a CUDA factory or move (no fake mode on).
            self._patched.append((torch.cuda, "_lazy_init", torch.cuda._lazy_init))
            torch.cuda._lazy_init = lambda: None
            self._host_mode = HostReal(self.fake_mode, self._on_host_read)
            self._host_mode.__enter__()
            torch.empty(0, device="cuda")  # settles the current device, which moves ask for
        else:
            self.fake_mode.__enter__()

    def _enter_backward(self) -> None:
        """Backward passes inside the block run on :mod:`cudapool.fakegpu.backward`, with every saved
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
        self._observe(tensors_of(objs), "watch")
        return self._next_id - before

    # ---- the work ------------------------------------------------------------------------------

    def _observe(self, out: Any, func: Any, inputs: Any = None, into: Optional[Live] = None) -> None:
        for t in tensors_in(out):
            self._see(t, func, inputs, into)

    def _in_place_stand_in(self, func: Any, args: Any) -> Optional[Live]:
        """Inside a node of the tracer's backward: for an out-of-place operation that formulas
        use instead of its in-place form on subclass-like tensors, applied to a tensor the same
        node made (zeros to scatter into), the allocation of that tensor; a GPU run writes into
        it instead of allocating a result."""
        if self._fresh is None or not args or func._schema.name not in IN_PLACE_STAND_INS:
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
        where cudapool.fakegpu.kernel_scratch models them (programs traced for CUDA only)."""
        if not args or not isinstance(args[0], torch.Tensor) or self._storage_of(args[0]) is None:
            return
        steps, what = _kernel_scratch.op_steps(func._schema.name, args, kwargs, self.gpu)
        self._temporaries(steps, what)

    def _temporaries(self, steps: Tuple[int, ...], what: str) -> None:
        with self._lock:
            if self._state != "tracing":
                return
            made: List[Live] = []
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

    def _see(self, t: torch.Tensor, func: Any, inputs: Any = None, into: Optional[Live] = None) -> None:
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
            if inputs is not None and func not in LIFTS and key in self._input_keys(inputs):
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

    def _record_alloc(self, size: int, device: int, what: Any) -> Live:
        """A new allocation of ``size`` bytes on the current stream: its event, its operation's
        name (with ``record_ops``), the live and peak bytes. The caller holds the lock."""
        live = Live(self._next_id, size, self._stream, device)
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

    def _realloc(self, key: int, old: Live, size: int, storage: Any, func: Any) -> None:
        fin = old.finalizers.pop(key, None)
        if fin is not None:
            fin.detach()
        del self._live[key]
        self._alloc(key, size, old.device, storage, func)
        if not old.finalizers:  # no other storage stands for the old allocation
            self._record_free(old)

    def _record_free(self, live: Live) -> None:
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

"""A GPU that is not there: a script's ``torch.cuda`` answers as on a GPU of a given model while
the tracer records what it allocates on fake CUDA tensors.

    from cudapool.fakegpu import FakeGPU, gpu_model
    with FakeGPU(gpu_model("H100")) as fg:
        runpy.run_path("train.py", run_name="__main__")   # unchanged
    trace = fg.tracer.trace()

Inside, a CUDA-only script runs on a machine without a GPU: ``torch.cuda.is_available()`` is
True, one device (or ``devices``) of the model's name, memory and multiprocessors is there,
tensors made on or moved to ``"cuda"`` (``.cuda()``, ``.to("cuda")``, a data loader's CPU
batches) are fake CUDA tensors (no memory and no math) with CUDA's autocast rules, and every
allocation is recorded.
Two engines make them (``engine=``; :class:`cudapool.fakegpu.engine.Engine` is what FakeGPU asks
of them): ``"native"`` (:mod:`cudapool.fakegpu.native_engine`, the module
cudapool._torch_fakecuda: plain torch CUDA tensors whose kernels compute only shapes, below
Python; torch's own CUDA paths above them, autograd's engine included) and ``"python"``
(:mod:`cudapool.fakegpu.python_engine`: :class:`torch._subclasses.fake_tensor.FakeTensorMode`
under :class:`cudapool.fakegpu.tracer.Tracer`,
on any torch build); ``"auto"`` (the default) takes native where it can run. The host is real
(:mod:`cudapool.fakegpu.hostreal` on the Python engine; plain CPU tensors on the native one): CPU
tensors, numpy arrays and Python numbers keep their values, so host code that slices, samples
or indexes with them runs as on a GPU machine. ``torch.cuda.memory_allocated()`` and ``max_memory_allocated()``
answer from the tracer's live bytes (the reserved ones likewise: no allocator is simulated
while tracing). Events and ``synchronize`` do nothing; each stream allocates on its own
(:mod:`cudapool.fakegpu.streams`); the CUDA RNG calls are no-ops.

Kernels and workspaces as the GPU has them: ``scaled_dot_product_attention`` runs the backend
torch picks on that GPU (:mod:`cudapool.fakegpu.attention`), recurrent layers run torch's own CUDA
cells (cuDNN's have no fake backward), and the cuBLAS workspace of each thread and stream is
allocated at its first matrix multiply (:func:`cublas_workspace_bytes`).

What a fake tensor does not have is its values. A read of one (``.item()``, ``float()``,
``int()``, ``bool()``, ``.tolist()``, formatting, printing, ``.cpu()``) gets zeros of the
tensor's dtype: ``0.0`` for a loss, ``False`` for a comparison. The script goes on, but
control flow that depends on a value (stop when the loss is small, skip a step on NaN) is not
simulated; the reads are counted (:attr:`FakeGPU.value_reads`, first places in
:attr:`FakeGPU.value_read_sites`), and with ``strict_values=True`` a read raises
:class:`ValueRead` instead. ``torch.save`` writes placeholders of fake tensors (shapes, no
values) that ``torch.load`` makes fake CUDA tensors of again; memory history calls answer from
the run (:meth:`FakeGPU.memory_snapshot`). Data loader workers run in the main process (the
batches are the same). ``torch.compile`` returns the function or module unchanged (it runs
eagerly; counted in :attr:`FakeGPU.compiled`).

A FakeGPU of ``devices`` devices is a node of a multi-GPU job: with
:class:`cudapool.fakegpu.distributed.FakeWorld` one rank of it runs torch.distributed's own code.

What cannot run fails inside torch: custom CUDA extensions without a fake (meta)
implementation, NCCL-specific calls, outputs whose shape depends on values (``nonzero``,
``unique``). :func:`explain_failure` turns such an exception into one line naming the
operation and the script's line.
"""

from __future__ import annotations

import os
import sys
import traceback
import types
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import scriptio
from .compiled import CompiledPrograms
from .engine import Engine
from .failures import LIBRARY_DIRS, ValueRead, explain_failure, script_error
from .graphs import Graphs
from .models import GPUS, SHARED_MEMORY_OPTIN, SHARED_MEMORY_OPTIN_LATEST, GPUModel, cublas_workspace_bytes, gpu_model
from .scratch import Scratch
from .scriptio import ScriptIO
from .streams import FakeEvent, stream_classes

__all__ = [
    "ENGINES",
    "FakeGPU",
    "GPUModel",
    "GPUS",
    "ValueRead",
    "cublas_workspace_bytes",
    "explain_failure",
    "gpu_model",
    "resolve_engine",
    "script_error",
]


ENGINES = ("auto", "native", "python")


def _engine_class(name: str) -> Any:
    if name == "native":
        from .native_engine import NativeEngine

        return NativeEngine
    from .python_engine import PythonEngine

    return PythonEngine


def resolve_engine(engine: str) -> str:
    """ "native" or "python" for an engine name of :data:`ENGINES` ("auto": native where
    cudapool._torch_fakecuda can run here, else python); an engine named that cannot run here
    raises RuntimeError saying why."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    for name in ("native", "python") if engine == "auto" else (engine,):
        why = _engine_class(name).why_unavailable()
        if why is None:
            return name
    raise RuntimeError(f"the {engine} engine cannot run: {why}")


def _zeros_like_value(t: torch.Tensor) -> Any:
    if t.dtype == torch.bool:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return 0.0
    return 0


class FakeGPU(ScriptIO):
    """Run code as on one GPU of ``model`` while the engine's tracer records it.

    ``strict_values``: a read of a fake tensor's value raises :class:`ValueRead`. ``script``:
    the script's path, so that value reads are reported at its lines. ``engine``: one of
    :data:`ENGINES`. ``devices``: the node's GPUs (autograd's engine sizes its device threads at
    a process's first backward: a backward on a device beyond the count of that moment fails, so
    ab --simulate traces each rank in a process of its own). ``scratch_dir``: a folder in front
    of the script's files (Note [A rank's files] in scratch.py). Extra keyword arguments go to
    the engine's tracer (the Python engine's :class:`cudapool.fakegpu.tracer.Tracer` takes them
    all). Enter once; everything patched is put back at exit.
    """

    def __init__(
        self,
        model: GPUModel,
        *,
        strict_values: bool = False,
        script: Optional[str] = None,
        engine: str = "auto",
        devices: int = 1,
        scratch_dir: Optional[str] = None,
        **tracer_kw: Any,
    ):
        if not 1 <= int(devices) <= 64:
            raise ValueError(f"devices must be 1..64, not {devices}")
        self.model = model
        #: The node's devices: cuda:0 .. cuda:devices-1, each of ``model``.
        self.devices = int(devices)
        #: The scratch folder in front of the script's files (None: the script's own files are
        #: written): Note [A rank's files] in scratch.py.
        self.scratch: Optional[Scratch] = Scratch(scratch_dir) if scratch_dir is not None else None
        self.strict_values = strict_values
        self.script = os.path.abspath(script) if script else None
        tracer_kw.setdefault("workspace_bytes", cublas_workspace_bytes(model))
        #: The engine: "native" (cudapool._torch_fakecuda: the fake GPU below Python) or "python"
        #: (torch's fake tensors under cudapool.fakegpu.tracer.Tracer); "auto" picks native where
        #: it can run.
        self.engine: Engine = _engine_class(resolve_engine(engine))(self, tracer_kw)
        #: What records the allocations (the engine's).
        self.tracer: Any = self.engine.tracer
        #: Copies of fake CUDA tensors to the host (``.cpu()``, ``.numpy()`` after it): zeros.
        self.host_copies = 0
        #: ``torch.save`` calls that wrote fake CUDA tensors (as placeholders), and
        #: ``torch.load`` calls that read files onto the fake GPU.
        self.saved_placeholders = 0
        self.loaded_to_gpu = 0
        #: Where ``torch.cuda.memory._record_memory_history`` began recording (an event
        #: index), or None; the snapshot files written by ``_dump_snapshot``.
        self.history_from: Optional[int] = None
        self.snapshots_written: List[str] = []
        #: scaled_dot_product_attention calls per backend chosen ("flash", "efficient", "math").
        self.sdpa: Dict[str, int] = {}
        #: Recurrent layers run on fake CUDA (torch's own cells instead of cuDNN's), per kind.
        self.rnn_calls: Dict[str, int] = {}
        self._warnings: Optional[Any] = None
        #: Reads of fake CUDA tensors' values (``.item()``, ``float()``, ...) so far.
        self.value_reads = 0
        #: Reads of host tensors made inside (a data loader's shuffled indices, say): they are
        #: fake too, so that building a model on the CPU costs no host memory.
        self.host_value_reads = 0
        #: The first places in the script that read values: "file:line".
        self.value_read_sites: List[str] = []
        #: Calls of ``torch.compile``.
        self.compiled = 0
        #: Calls of flex_attention without torch.compile.
        self.flex_eager = 0
        #: What compiled programs need of the fake GPU (native engine).
        self.programs = CompiledPrograms(self)
        #: CUDA graphs: captures, replays, calls of graph trees.
        self.graphs = Graphs(self)
        #: The last ``torch.cuda.set_per_process_memory_fraction`` the script set, or None: the
        #: memory a run may use is then that fraction of the GPU's.
        self.memory_fraction: Optional[float] = None
        #: The most data loader workers a loader asked for (they run in the main process).
        self.loader_workers = 0
        #: ``Tensor.record_stream`` calls (not modelled: Note [Streams of the fake GPU]).
        self.record_streams = 0
        self._patched: List[Tuple[Any, str, Any]] = []

    # -- what the script sees ------------------------------------------------------------------

    def _props(self) -> Any:
        m = self.model
        return types.SimpleNamespace(
            name=m.name,
            total_memory=m.total_memory,
            multi_processor_count=m.multi_processor_count,
            max_threads_per_multi_processor=m.max_threads_per_multi_processor,
            major=m.major,
            minor=m.minor,
            is_integrated=False,
            is_multi_gpu_board=False,
            L2_cache_size=m.l2_cache,
            warp_size=32,
            max_threads_per_block=1024,
            regs_per_multiprocessor=65536,
            shared_memory_per_block=48 << 10,
            shared_memory_per_multiprocessor=SHARED_MEMORY_OPTIN.get((m.major, m.minor), SHARED_MEMORY_OPTIN_LATEST)
            + (1 << 10),
            shared_memory_per_block_optin=SHARED_MEMORY_OPTIN.get((m.major, m.minor), SHARED_MEMORY_OPTIN_LATEST),
            uuid="00000000-0000-0000-0000-000000000000",
        )

    def _live(self) -> int:
        return int(self.tracer.live_bytes)

    def _peak(self) -> int:
        return int(self.tracer.peak_bytes)

    def _device_index(self, device: Any = None) -> int:
        """The index of ``device`` (None, an int, "cuda", "cuda:1", a torch.device): the current
        device where it names none; RuntimeError for a device the fake GPU does not have."""
        if device is None:
            return self.engine.current_device()
        if isinstance(device, (torch.device, str)):
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"expected a CUDA device, not {device}")
            index = device.index
        else:
            index = int(device)
        if index is None or index < 0:
            return self.engine.current_device()
        if index >= self.devices:
            if self.devices == 1:
                raise RuntimeError(
                    f"cudapool's simulated GPU is one device (cuda:0); the script asked for cuda:{index} "
                    "(a multi-GPU run: ab --simulate --nproc-per-node N)"
                )
            raise RuntimeError(
                f"cudapool's simulated node has {self.devices} GPUs (cuda:0 .. cuda:{self.devices - 1}); the script "
                f"asked for cuda:{index}"
            )
        return index

    def _set_device(self, device: Any) -> None:
        self.engine.set_device(self._device_index(device))

    def _exchange_device(self, device: int) -> int:
        """torch.cuda's device switch: make ``device`` current (nothing for a negative one); the
        device that was."""
        was = self.engine.current_device()
        if device >= 0:
            self._set_device(device)
        return was

    def _record_stream(self, t: torch.Tensor, stream: Any) -> None:
        self.record_streams += 1

    def _bf16_supported(self, including_emulation: bool = True) -> bool:
        """As torch answers on the GPU: natively from compute capability 8.0, emulated on any."""
        return self.model.major >= 8 or bool(including_emulation)

    def _set_fraction(self, fraction: float, device: Any = None) -> None:
        self._device_index(device)
        if not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(f"invalid memory fraction {fraction}: it must be in [0, 1]")
        self.memory_fraction = float(fraction)

    def _read(self, t: torch.Tensor, what: str) -> Any:
        if t.device.type != "cuda":
            self.host_value_reads += 1
            return _zeros_like_value(t)
        self.value_reads += 1
        site = self._script_site()
        if site and len(self.value_read_sites) < 8 and site not in self.value_read_sites:
            self.value_read_sites.append(site)
        if self.strict_values:
            raise ValueRead(
                f"{site or 'the script'}: {what} of a fake CUDA tensor: its value is not simulated "
                "(without --strict-values the script gets zeros)"
            )
        return _zeros_like_value(t)

    def _script_site(self) -> Optional[str]:
        for frame, lineno in traceback.walk_stack(sys._getframe(2)):
            name = os.path.abspath(frame.f_code.co_filename)
            if name == self.script or (self.script is None and not name.startswith(LIBRARY_DIRS)):
                return f"{os.path.basename(name)}:{lineno}"
        return None

    # -- patching --------------------------------------------------------------------------------

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _patch_cuda(self) -> None:
        cuda = torch.cuda
        props = self._props()
        streams = stream_classes(self.engine, self._device_index)
        one = {
            "is_available": lambda: True,
            "device_count": lambda: self.devices,
            "current_device": lambda: self.engine.current_device(),
            "_lazy_init": lambda: None,
            # CUDA is up on the fake GPU: torch resolves a bare "cuda" to the current device only then
            # (fake tensors under torch.compile, for one).
            "is_initialized": lambda: True,
            "init": lambda: None,
            "set_device": self._set_device,
            "get_device_name": lambda device=None: (self._device_index(device), props.name)[1],
            "get_device_properties": lambda device=None: (self._device_index(device), props)[1],
            "get_device_capability": lambda device=None: (props.major, props.minor),
            "is_bf16_supported": self._bf16_supported,
            "synchronize": lambda device=None: None,
            "empty_cache": lambda: None,
            "mem_get_info": lambda device=None: (max(0, props.total_memory - self._live()), props.total_memory),
            "memory_allocated": lambda device=None: self._live(),
            "memory_reserved": lambda device=None: self._live(),
            "max_memory_allocated": lambda device=None: self._peak(),
            "max_memory_reserved": lambda device=None: self._peak(),
            "reset_peak_memory_stats": lambda device=None: None,
            "set_per_process_memory_fraction": self._set_fraction,
            "Stream": streams.Stream,
            "ExternalStream": streams.ExternalStream,
            "Event": FakeEvent,
            "current_stream": streams.current_stream,
            "default_stream": streams.default_stream,
            "stream": streams.stream,
            "StreamContext": streams.StreamContext,
            "set_stream": streams.set_stream,
            "_exchange_device": self._exchange_device,
            # Another function than _exchange_device's: Dynamo keeps one handler per function.
            "_maybe_exchange_device": lambda device: self._exchange_device(device),
        }
        for name, value in one.items():
            if hasattr(cuda, name):
                self._patch(cuda, name, value)
        self._patch(torch.Tensor, "record_stream", lambda t, stream: self._record_stream(t, stream))
        self._patch_accelerator(streams)
        # A data loader's pinned batches: pinning needs the driver; a fake copy needs none.
        self._patch(torch.Tensor, "pin_memory", lambda t, *a, **k: t)
        import torch.utils.data._utils.pin_memory as pin

        self._patch(pin, "pin_memory", lambda data, device=None: data)

    def _patch_accelerator(self, streams: Any) -> None:
        """torch.accelerator and the accelerator torch's own code asks for (FSDP's default mesh,
        device meshes): CUDA, with the fake GPU's devices and streams."""
        cuda = torch.device("cuda")
        for name in ("_get_accelerator", "_accelerator_getAccelerator"):
            if hasattr(torch._C, name):
                self._patch(torch._C, name, lambda: cuda)
        acc = getattr(torch, "accelerator", None)
        if acc is None:
            return
        for name, value in (
            ("current_accelerator", lambda check_available=False: cuda),
            ("is_available", lambda: True),
            ("device_count", lambda: self.devices),
            ("current_device_index", lambda: self.engine.current_device()),
            ("current_device_idx", lambda: self.engine.current_device()),
            ("set_device_index", self._set_device),
            ("set_device_idx", self._set_device),
            # Functions of their own, not torch.cuda's: Dynamo keeps one handler per function.
            ("current_stream", lambda device=None: streams.current_stream(device)),
            ("set_stream", lambda stream: streams.set_stream(stream)),
            ("synchronize", lambda device=None: None),
        ):
            if hasattr(acc, name):
                self._patch(acc, name, value)

    def _patch_loaders(self) -> None:
        """Data loader workers run in the main process: a worker process would have to send
        fake tensors back, which cannot cross processes. The batches are the same."""
        loader = torch.utils.data.DataLoader
        original = loader.__init__
        gpu = self

        def init(this: Any, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("num_workers"):
                gpu.loader_workers = max(gpu.loader_workers, int(kwargs["num_workers"]))
                kwargs.update(num_workers=0, prefetch_factor=None, persistent_workers=False)
            original(this, *args, **kwargs)

        self._patch(loader, "__init__", init)

    def _patch_compile(self) -> None:
        """``torch.compile`` on the native engine compiles as on a GPU
        (:mod:`cudapool.fakegpu.compiled`); on the Python engine it returns the function or
        module unchanged (Dynamo cannot trace the tracer's tensor subclass)."""
        gpu = self
        original = torch.compile

        torch_dir = os.path.dirname(torch.__file__) + os.sep

        def compile(model: Any = None, **kwargs: Any) -> Any:
            if not sys._getframe(1).f_code.co_filename.startswith(torch_dir):  # torch's own (flex_attention's)
                gpu.compiled += 1
                gpu.programs.asked(kwargs)
            if gpu.engine.name == "native":
                gpu.programs.setup()
                return original(model, **kwargs) if model is not None else original(**kwargs)
            if model is None:  # @torch.compile(mode=...)
                return lambda fn: fn
            return model

        self._patch(torch, "compile", compile)

    def _patch_flex(self) -> None:
        """Counts flex_attention's calls without torch.compile (torch's unfused path, which
        materialises the scores): torch warns once; the notes say how many ran."""
        try:
            import torch.nn.attention.flex_attention as flex
        except ImportError:  # an older torch: no flex_attention
            return
        original = flex._warn_once
        gpu = self

        def warn_once(warning_id: str, message: str, *args: Any, **kwargs: Any) -> None:
            if warning_id == "flex_attention_performance":
                gpu.flex_eager += 1
            original(warning_id, message, *args, **kwargs)

        self._patch(flex, "_warn_once", warn_once)

    # -- what scripts do around training ---------------------------------------------------------

    def _host_copy(self, t: torch.Tensor, what: str) -> None:
        """A fake CUDA tensor copied to the host (cudapool.fakegpu.hostreal): the host gets zeros."""
        self.host_copies += 1
        self._read(t, what)

    def _patch_rnns(self) -> None:
        """LSTM, GRU and RNN layers on fake CUDA: cuDNN's RNN kernels have no fake backward in
        torch, so the layers run torch's own CUDA cells (per time step), whose saved gates and
        states stand for cuDNN's reserve space (an estimate: cuDNN sizes it itself)."""
        from torch import _VF

        gpu = self

        def native(name: str, original: Any) -> Any:
            def run(inp: Any, *args: Any, **kwargs: Any) -> Any:
                if not gpu.engine.is_fake(inp) or inp.device.type != "cuda":
                    return original(inp, *args, **kwargs)
                gpu.rnn_calls[name] = gpu.rnn_calls.get(name, 0) + 1
                with torch.backends.cudnn.flags(enabled=False):
                    return original(inp, *args, **kwargs)

            return run

        for name in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
            self._patch(_VF, name, native(name, getattr(_VF, name)))

    def _patch_rng(self) -> None:
        cuda = torch.cuda
        state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)  # noqa: E731
        for name, value in (
            ("manual_seed", lambda seed: None),
            ("manual_seed_all", lambda seed: None),
            ("seed", lambda: None),
            ("seed_all", lambda: None),
            ("initial_seed", lambda: 0),
            ("get_rng_state", state),
            ("get_rng_state_all", lambda: [state()]),
            ("set_rng_state", lambda *a, **k: None),
            ("set_rng_state_all", lambda *a, **k: None),
        ):
            if hasattr(cuda, name):
                self._patch(cuda, name, value)

    def __enter__(self) -> "FakeGPU":
        try:
            self._patch_cuda()
            self.graphs.patch()
            self.engine.patch(self._patch)
            self._patch_compile()
            self.programs.patch_user_kernels()
            self._patch_flex()
            self._patch_loaders()
            self._patch_printing()
            self._patch_serialization()
            self._patch_history()
            self._patch_rng()
            self._patch_rnns()
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            scriptio.ACTIVE = self
            self.tracer.__enter__()
            self._patch(torch.cuda, "is_bf16_supported", self._bf16_supported)  # the tracer's says True
            if self.scratch is not None:
                self.scratch.__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
        if self.scratch is not None:
            self.scratch.__exit__(None, None, None)
        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            self._warnings = None
        while self._patched:
            owner, name, value = self._patched.pop()
            setattr(owner, name, value)

    def __exit__(self, *exc: Any) -> None:
        try:
            self.tracer.__exit__(*exc)
        finally:
            scriptio.ACTIVE = None
            self._restore()

    def summary(self) -> Dict[str, Any]:
        """What the run did that a GPU run would not: value reads, compile calls."""
        return {
            "gpu": self.model._asdict(),
            "value_reads": self.value_reads,
            "value_read_sites": list(self.value_read_sites),
            "host_value_reads": self.host_value_reads,
            "strict_values": self.strict_values,
            "compiled": self.compiled,
            "compile": self.programs.summary(),
            "flex_eager": self.flex_eager,
            "cudnn": self.engine.cudnn_summary(),
            "cuda_graphs": {
                "captures": self.graphs.captures,
                "replays": self.graphs.replays,
                "tree_calls": self.graphs.tree_calls,
            },
            "memory_fraction": self.memory_fraction,
            "loader_workers": self.loader_workers,
            "devices": self.devices,
            "scratch_files": len(self.scratch.files) if self.scratch is not None else 0,
            "record_streams": self.record_streams,
            "host_copies": self.host_copies,
            "saved_placeholders": self.saved_placeholders,
            "loaded_to_gpu": self.loaded_to_gpu,
            "snapshots_written": list(self.snapshots_written),
            "sdpa": dict(self.sdpa),
            "rnn_calls": dict(self.rnn_calls),
            "cublas_workspace_bytes": self.tracer.workspace_bytes,
            "cublas_workspaces": int(getattr(self.tracer, "workspaces_taken", 0)),
            "engine": self.engine.name,
        }

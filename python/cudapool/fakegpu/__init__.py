"""A GPU that is not there: a script's ``torch.cuda`` answers as on a GPU of a given model while
the tracer records what it allocates on fake CUDA tensors.

    from cudapool.lab.fakegpu import FakeGPU, gpu_model
    with FakeGPU(gpu_model("H100")) as fg:
        runpy.run_path("train.py", run_name="__main__")   # unchanged
    trace = fg.tracer.trace()

Inside, a CUDA-only script runs on a machine without a GPU: ``torch.cuda.is_available()`` is
True, one device of the model's name, memory and multiprocessors is there, tensors made on or
moved to ``"cuda"`` (``.cuda()``, ``.to("cuda")``, a data loader's CPU batches) are fake CUDA
tensors (no memory and no math) with CUDA's autocast rules, and every allocation is recorded.
Two engines make them (``engine=``): ``"native"`` (:mod:`cudapool.lab._native`, the module
cudapool._torch_fakecuda: plain torch CUDA tensors whose kernels compute only shapes, below
Python; torch's own CUDA paths above them, autograd's engine included) and ``"python"``
(:class:`torch._subclasses.fake_tensor.FakeTensorMode` under :class:`cudapool.lab.tracer.Tracer`,
on any torch build); ``"auto"`` (the default) takes native where it can run. The host is real
(:mod:`cudapool.lab._hostreal` on the Python engine; plain CPU tensors on the native one): CPU
tensors, numpy arrays and Python numbers keep their values, so host code that slices, samples
or indexes with them runs as on a GPU machine. ``torch.cuda.memory_allocated()`` and ``max_memory_allocated()``
answer from the tracer's live bytes (the reserved ones likewise: no allocator is simulated
while tracing). Streams, events and ``synchronize`` do nothing; the CUDA RNG calls are no-ops.

Kernels and workspaces as the GPU has them: ``scaled_dot_product_attention`` runs the backend
torch picks on that GPU (:mod:`cudapool.lab._attention`), recurrent layers run torch's own CUDA
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

What cannot run fails inside torch: custom CUDA extensions without a fake (meta)
implementation, NCCL collectives, outputs whose shape depends on values (``nonzero``,
``unique``). :func:`explain_failure` turns such an exception into one line naming the
operation and the script's line.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
import types
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from . import _scriptio
from ._scriptio import ScriptIO
from .replay import parse_size
from .tracer import Tracer

__all__ = ["FakeGPU", "GPUModel", "GPUS", "ValueRead", "cublas_workspace_bytes", "explain_failure", "gpu_model"]


class GPUModel(NamedTuple):
    """A GPU as a script sees it: ``torch.cuda.get_device_properties()``'s main fields."""

    name: str
    total_memory: int
    multi_processor_count: int
    max_threads_per_multi_processor: int
    major: int
    minor: int


_MIB = 1 << 20

#: Common GPUs: total memory as ``nvidia-smi`` lists it for the card (MiB), multiprocessors and
#: threads per multiprocessor of the chip, compute capability. Keys are matched without case,
#: spaces, dashes or underscores.
GPUS: Dict[str, GPUModel] = {
    "h200": GPUModel("NVIDIA H200", 143771 * _MIB, 132, 2048, 9, 0),
    "h100": GPUModel("NVIDIA H100 80GB HBM3", 81559 * _MIB, 132, 2048, 9, 0),
    "a10080gb": GPUModel("NVIDIA A100-SXM4-80GB", 81920 * _MIB, 108, 2048, 8, 0),
    "a10040gb": GPUModel("NVIDIA A100-SXM4-40GB", 40960 * _MIB, 108, 2048, 8, 0),
    "l40s": GPUModel("NVIDIA L40S", 46068 * _MIB, 142, 1536, 8, 9),
    "rtx4090": GPUModel("NVIDIA GeForce RTX 4090", 24564 * _MIB, 128, 1536, 8, 9),
    "rtx3090": GPUModel("NVIDIA GeForce RTX 3090", 24576 * _MIB, 82, 1536, 8, 6),
    "a10g": GPUModel("NVIDIA A10G", 23028 * _MIB, 80, 1536, 8, 6),
    "l4": GPUModel("NVIDIA L4", 23034 * _MIB, 58, 1536, 8, 9),
    "v10032gb": GPUModel("Tesla V100-SXM2-32GB", 32768 * _MIB, 80, 2048, 7, 0),
    "t4": GPUModel("Tesla T4", 15360 * _MIB, 40, 1024, 7, 5),
}
_ALIASES = {"h10080gb": "h100", "a100": "a10080gb", "4090": "rtx4090", "3090": "rtx3090", "v100": "v10032gb"}
DEFAULT_GPU = "h100"


def _key(text: str) -> str:
    return re.sub(r"[\s_\-]", "", text).lower()


def gpu_model(spec: str) -> GPUModel:
    """The GPU ``spec`` names: a key of :data:`GPUS` (``H100``, ``a100-40gb``, ``RTX 4090``...)
    or a memory size (``24GB``, ``80GiB``, bytes), then with an H100's multiprocessors.
    ValueError naming the known models otherwise."""
    key = _key(spec)
    key = _ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    try:
        size = parse_size(spec)
    except ValueError:
        known = ", ".join(m.name + f" ({k})" for k, m in GPUS.items())
        raise ValueError(f"unknown GPU {spec!r}: give a model ({known}) or a memory size such as 24GB") from None
    if size <= 0:
        raise ValueError(f"GPU memory must be positive, not {spec!r}")
    h100 = GPUS[DEFAULT_GPU]
    return h100._replace(name=f"GPU with {spec} (an H100's multiprocessors)", total_memory=size)


class ValueRead(RuntimeError):
    """A script read a value of a fake tensor under ``strict_values=True``."""


class _Stream:
    """torch.cuda.Stream on the fake GPU: work is not run, so there is nothing to wait for."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cuda", 0)
        self.priority = priority
        self.cuda_stream = 0

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_Event":
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Any) -> float:
        return 0.0


def _fake_mode() -> Any:
    """A fake tensor mode that never initialises a device: torch's asks whether CUDA is
    available to decide, and inside :class:`FakeGPU` it is."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class NoDeviceFakeTensorMode(FakeTensorMode):
        @property
        def avoid_device_init(self) -> bool:
            return True

    return NoDeviceFakeTensorMode(allow_non_fake_inputs=True)


def cublas_workspace_bytes(model: "GPUModel", config: Optional[str] = None) -> int:
    """The cuBLAS workspace torch allocates per (handle, stream) on ``model``: from
    ``CUBLAS_WORKSPACE_CONFIG`` (``config``, default the environment's: ``:SIZE_KiB:COUNT``
    pairs, summed) when set, else torch's default for the architecture (Hopper and later
    ``:4096:8``, 32 MiB; earlier ``:4096:2:16:8``, 8 MiB and 128 KiB)."""
    text = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    if text:
        nums = [int(n) for n in re.findall(r"\d+", text)]
        if nums and len(nums) % 2 == 0:
            return sum(nums[i] * nums[i + 1] for i in range(0, len(nums), 2)) * 1024
    return (4096 * 8 if model.major >= 9 else 4096 * 2 + 16 * 8) * 1024


ENGINES = ("auto", "native", "python")


def resolve_engine(engine: str) -> str:
    """ "native" or "python" for an engine name of :data:`ENGINES` ("auto": native where
    cudapool._torch_fakecuda can run here, else python); "native" where it cannot run raises
    RuntimeError saying why."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if engine == "python":
        return engine
    from ._native import why_unavailable

    why = why_unavailable()
    if why is None:
        return "native"
    if engine == "native":
        raise RuntimeError(f"the native engine cannot run: {why}")
    return "python"


def _zeros_like_value(t: torch.Tensor) -> Any:
    if t.dtype == torch.bool:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return 0.0
    return 0


class FakeGPU(ScriptIO):
    """Run code as on one GPU of ``model`` while a :class:`Tracer` on fake CUDA records it.

    ``strict_values``: a read of a fake tensor's value raises :class:`ValueRead`. ``script``:
    the script's path, so that value reads are reported at its lines. Extra keyword arguments
    go to the :class:`Tracer`. Enter once; everything patched is put back at exit.
    """

    def __init__(
        self,
        model: GPUModel,
        *,
        strict_values: bool = False,
        script: Optional[str] = None,
        engine: str = "auto",
        **tracer_kw: Any,
    ):
        self.model = model
        self.strict_values = strict_values
        self.script = os.path.abspath(script) if script else None
        #: "native" (cudapool._torch_fakecuda: the fake GPU below Python) or "python" (torch's fake
        #: tensors under cudapool.lab.tracer.Tracer); "auto" picks native where it can run.
        self.engine = resolve_engine(engine)
        tracer_kw.setdefault("workspace_bytes", cublas_workspace_bytes(model))
        self.tracer: Any
        if self.engine == "native":
            from ._native import NativeTracer

            unknown = set(tracer_kw) - {"workspace_bytes", "kernel_scratch"}
            if unknown:
                raise ValueError(f"the native engine takes no tracer options {sorted(unknown)}: use engine='python'")
            self.tracer = NativeTracer(
                read=self._native_read, sdp_choice=self._sdp_choice, gpu=self._props(), **tracer_kw
            )
        else:
            self.tracer = Tracer(
                device="cuda",
                fake_mode=_fake_mode(),
                gpu=self._props(),
                host="real",
                on_host_read=self._host_copy,
                **tracer_kw,
            )
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
        #: Calls of ``torch.compile`` (run eagerly).
        self.compiled = 0
        #: The last ``torch.cuda.set_per_process_memory_fraction`` the script set, or None: the
        #: memory a run may use is then that fraction of the GPU's.
        self.memory_fraction: Optional[float] = None
        #: The most data loader workers a loader asked for (they run in the main process).
        self.loader_workers = 0
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
            L2_cache_size=50 * _MIB,
            warp_size=32,
            uuid="00000000-0000-0000-0000-000000000000",
        )

    def _live(self) -> int:
        return self.tracer._live_bytes

    def _peak(self) -> int:
        return self.tracer._peak_bytes

    def _device_index(self, device: Any = None) -> int:
        if device is None:
            return 0
        index = device if isinstance(device, int) else torch.device(device).index
        if index not in (None, 0):
            raise RuntimeError(f"cudapool's simulated GPU is one device (cuda:0); the script asked for cuda:{index}")
        return 0

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

    def _native_read(self, t: Optional[torch.Tensor], what: str) -> None:
        """A read of values on the native engine's fake GPU (its C++ kernels ask)."""
        if t is None:
            return
        if what == "a copy to the host":
            self._host_copy(t, what)
        else:
            self._read(t, what)

    def _sdp_choice(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> int:
        """torch's ``_fused_sdp_choice`` on the native engine: the kernel torch picks on this GPU
        (cudapool.lab._attention), as torch's SDPBackend value."""
        from torch.nn.attention import SDPBackend

        from . import _attention

        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        dropout_p = float(args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0))
        is_causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))
        gqa = bool(kwargs.get("enable_gqa", False))
        m = self.model
        backend = _attention.choose(q, k, v, mask, dropout_p, is_causal, gqa, m.major, m.minor)
        self.sdpa[backend] = self.sdpa.get(backend, 0) + 1
        return int(
            {
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH,
            }[backend].value
        )

    def _on_fake_gpu(self, t: Any) -> bool:
        """Whether ``t`` is a tensor of the fake GPU."""
        if self.engine == "native":
            return isinstance(t, torch.Tensor) and t.device.type == "cuda"
        from torch._subclasses.fake_tensor import FakeTensor

        return isinstance(t, FakeTensor)

    def _script_site(self) -> Optional[str]:
        for frame, lineno in traceback.walk_stack(sys._getframe(2)):
            name = os.path.abspath(frame.f_code.co_filename)
            if name == self.script or (self.script is None and not name.startswith(_LIBRARY_DIRS)):
                return f"{os.path.basename(name)}:{lineno}"
        return None

    # -- patching --------------------------------------------------------------------------------

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _patch_cuda(self) -> None:
        cuda = torch.cuda
        props = self._props()
        one = {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "_lazy_init": lambda: None,
            "init": lambda: None,
            "set_device": lambda device: self._device_index(device),
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
            "Stream": _Stream,
            "Event": _Event,
            "current_stream": lambda device=None: _Stream(),
            "default_stream": lambda device=None: _Stream(),
            "stream": lambda stream=None: contextlib.nullcontext(),
            "_exchange_device": lambda device: self._device_index(device) if device >= 0 else 0,
            "_maybe_exchange_device": lambda device: self._device_index(device) if device >= 0 else 0,
        }
        for name, value in one.items():
            if hasattr(cuda, name):
                self._patch(cuda, name, value)
        if self.engine == "native":
            # Recurrent layers run torch's own cells (_patch_rnns): no cuDNN flat weights either.
            self._patch(torch.backends.cudnn, "is_acceptable", lambda tensor: False)
        # A data loader's pinned batches: pinning needs the driver; a fake copy needs none.
        self._patch(torch.Tensor, "pin_memory", lambda t, *a, **k: t)
        import torch.utils.data._utils.pin_memory as pin

        self._patch(pin, "pin_memory", lambda data, device=None: data)

    def _patch_values(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        gpu = self

        def reader(name: str, original: Any, convert: Any) -> Any:
            def read(t: torch.Tensor, *a: Any, **k: Any) -> Any:
                if not isinstance(t, FakeTensor):
                    return original(t, *a, **k)
                try:  # a small host tensor made from Python numbers keeps its value
                    return original(t, *a, **k)
                except Exception:
                    return convert(gpu._read(t, name), t)

            return read

        def tolist(value: Any, t: torch.Tensor) -> Any:
            out: Any = value
            for n in reversed(t.shape):
                out = [out] * int(n)
            return out

        for name, convert in (
            ("item", lambda v, t: v),
            ("__float__", lambda v, t: float(v)),
            ("__int__", lambda v, t: int(v)),
            ("__index__", lambda v, t: int(v)),
            ("__bool__", lambda v, t: bool(v)),
            ("tolist", tolist),
        ):
            self._patch(torch.Tensor, name, reader(f".{name.strip('_')}()", getattr(torch.Tensor, name), convert))

    def _patch_module_moves(self) -> None:
        """``module.to("cuda")`` of fake parameters: torch swaps the tensors, which fake tensors
        (referenced weakly by the fake mode) refuse; the parameter takes the moved data instead."""
        from torch._subclasses.fake_tensor import FakeTensor

        original = torch.utils.swap_tensors

        def swap_tensors(t1: Any, t2: Any) -> None:
            try:
                original(t1, t2)
            except RuntimeError as exc:
                if "weakref" not in str(exc) or not isinstance(t1, FakeTensor):
                    raise
                with torch.no_grad():
                    t1.data = t2.data
                t1.fake_device = t2.fake_device

        self._patch(torch.utils, "swap_tensors", swap_tensors)

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
        gpu = self

        def compile(model: Any = None, **kwargs: Any) -> Any:
            gpu.compiled += 1
            if model is None:  # @torch.compile(mode=...)
                return lambda fn: fn
            return model

        self._patch(torch, "compile", compile)

    # -- what scripts do around training ---------------------------------------------------------

    def _host_copy(self, t: torch.Tensor, what: str) -> None:
        """A fake CUDA tensor copied to the host (cudapool.lab._hostreal): the host gets zeros."""
        self.host_copies += 1
        self._read(t, what)

    def _patch_module_ties(self) -> None:
        """``model.to("cuda")`` keeps tied parameters tied (one tensor in two modules, as an
        embedding and its output layer): torch sets the moved data into the same parameter,
        which a real host tensor cannot take from a fake one; the places that shared one
        tensor before share the moved one, moved once."""
        original = torch.nn.Module._apply
        depth = [0]

        def _apply(module: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return original(module, fn, *args, **kwargs)
            places: Dict[int, List[Tuple[Any, str, str]]] = {}
            held: List[Any] = []
            for m in module.modules():
                for kind in ("_parameters", "_buffers"):
                    for name, t in getattr(m, kind).items():
                        if t is not None:
                            places.setdefault(id(t), []).append((m, kind, name))
                            held.append(t)
            moved: Dict[int, Any] = {}

            def once(t: Any) -> Any:  # a tensor in two places is moved once, as on a GPU
                if id(t) not in moved:
                    held.append(t)
                    moved[id(t)] = fn(t)
                return moved[id(t)]

            depth[0] += 1
            try:
                out = original(module, once, *args, **kwargs)
            finally:
                depth[0] -= 1
            for where in places.values():
                m0, k0, n0 = where[0]
                keep = getattr(m0, k0)[n0]
                for m, k, n in where[1:]:
                    if getattr(m, k)[n] is not keep:
                        getattr(m, k)[n] = keep
            held.clear()
            return out

        self._patch(torch.nn.Module, "_apply", _apply)

    def _patch_attention(self) -> None:
        """``scaled_dot_product_attention`` on fake CUDA runs the kernel torch picks on this GPU
        (cudapool.lab._attention), not the math path a machine without a GPU takes."""
        import torch.nn.functional as F
        from torch._subclasses.fake_tensor import FakeTensor

        from . import _attention

        gpu = self
        original = F.scaled_dot_product_attention

        def sdpa(
            query: Any,
            key: Any,
            value: Any,
            attn_mask: Any = None,
            dropout_p: float = 0.0,
            is_causal: bool = False,
            scale: Optional[float] = None,
            enable_gqa: bool = False,
        ) -> Any:
            if not isinstance(query, FakeTensor) or query.device.type != "cuda":
                return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
            m = gpu.model
            backend = _attention.choose(
                query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, m.major, m.minor
            )
            gpu.sdpa[backend] = gpu.sdpa.get(backend, 0) + 1
            if backend == "math":
                return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
            return _attention.run(backend, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

        self._patch(F, "scaled_dot_product_attention", sdpa)

    def _patch_rnns(self) -> None:
        """LSTM, GRU and RNN layers on fake CUDA: cuDNN's RNN kernels have no fake backward in
        torch, so the layers run torch's own CUDA cells (per time step), whose saved gates and
        states stand for cuDNN's reserve space (an estimate: cuDNN sizes it itself)."""
        from torch import _VF

        gpu = self

        def native(name: str, original: Any) -> Any:
            def run(inp: Any, *args: Any, **kwargs: Any) -> Any:
                if not gpu._on_fake_gpu(inp) or inp.device.type != "cuda":
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
            if self.engine == "python":  # fake tensors: what the native engine's kernels do
                self._patch_values()
                self._patch_module_moves()
                self._patch_module_ties()
                self._patch_attention()
            self._patch_compile()
            self._patch_loaders()
            self._patch_printing()
            self._patch_serialization()
            self._patch_history()
            self._patch_rng()
            self._patch_rnns()
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            _scriptio.ACTIVE = self
            self.tracer.__enter__()
            self._patch(torch.cuda, "is_bf16_supported", self._bf16_supported)  # the tracer's says True
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self) -> None:
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
            _scriptio.ACTIVE = None
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
            "memory_fraction": self.memory_fraction,
            "loader_workers": self.loader_workers,
            "host_copies": self.host_copies,
            "saved_placeholders": self.saved_placeholders,
            "loaded_to_gpu": self.loaded_to_gpu,
            "snapshots_written": list(self.snapshots_written),
            "sdpa": dict(self.sdpa),
            "rnn_calls": dict(self.rnn_calls),
            "cublas_workspace_bytes": self.tracer.workspace_bytes,
            "engine": self.engine,
        }


_OP = re.compile(r"\b([A-Za-z_][\w]*::[\w.]+)")
_OVERLOAD = re.compile(r"\b(aten|prims|[a-z_]+lib)\.(\w+)\.\w+\b")


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch,) if getattr(m, "__file__", None)
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)


def script_error(exc: BaseException, script: str) -> Optional[str]:
    """The line for an exception raised by the script's own code (its innermost frame is
    outside torch and cudapool: the script, or a module of its own), as it would be on a GPU;
    None when torch or the simulation raised it (:func:`explain_failure` then)."""
    here = os.path.dirname(os.path.abspath(script))
    if isinstance(exc, SyntaxError) and exc.filename and not exc.filename.startswith("<"):
        # The script (or a module of its own) does not compile: where the compiler says, and
        # which Python said so (newer syntax, e.g. 3.12's f-strings, fails on an older one).
        path = os.path.abspath(exc.filename)
        if path.startswith(_LIBRARY_DIRS):
            return None
        version = "{}.{}".format(*sys.version_info[:2])
        return (
            f"{os.path.relpath(path, here)}:{exc.lineno}: `{(exc.text or '').strip()}`: "
            f"{type(exc).__name__}: {exc.msg} (Python {version} compiled it)"
        )
    frames = list(traceback.walk_tb(exc.__traceback__))
    if not frames or isinstance(exc, ValueRead) or "cudapool's fake GPU" in str(exc):
        return None  # the simulation's limit (the native engine raises from below the script's line)
    filename = frames[-1][0].f_code.co_filename
    inner = os.path.abspath(filename)
    if filename.startswith("<") or inner.startswith(_LIBRARY_DIRS):
        return None
    import linecache

    lineno = frames[-1][1]
    code = linecache.getline(inner, lineno).strip()
    where = f"{os.path.relpath(inner, here)}:{lineno}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{where}: `{code}`: {type(exc).__name__}" + (f": {text}" if text else "")


def explain_failure(exc: BaseException, script: str) -> str:
    """One line for an exception the script raised on the fake GPU: the script's line (the
    innermost frame in it), the operation when one is named, and what it means."""
    script = os.path.abspath(script)
    where = os.path.basename(script)
    code = ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if os.path.abspath(frame.f_code.co_filename) == script:
            where = f"{os.path.basename(script)}:{lineno}"
            import linecache

            code = linecache.getline(script, lineno).strip()
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    op_name = None
    m = _OP.search(str(exc)) or _OVERLOAD.search(str(exc))
    if m is not None:
        op_name = m.group(1) if "::" in m.group(0) else f"{m.group(1)}::{m.group(2)}"
    kind = type(exc).__name__
    if isinstance(exc, ValueRead):
        return str(exc)
    if any(k in kind for k in ("DataDependent", "DynamicOutputShape")) or "data-dependent" in str(exc).lower():
        why = "its output's shape depends on tensor values, which a fake tensor does not have"
    elif "nccl" in str(exc).lower() or "process group" in str(exc).lower() or "distributed" in kind.lower():
        why = "NCCL collectives and process groups are not simulated (one fake GPU)"
    elif "driver version is insufficient" in str(exc) or "no nvidia driver" in str(exc).lower():
        why = "it ran real CUDA code, which needs a GPU (a custom CUDA extension's own kernel?)"
    elif op_name is not None and ("Meta" in str(exc) or "fake" in str(exc).lower() or "NotImplemented" in kind):
        why = f"the operation {op_name} has no fake (meta) implementation: a custom CUDA extension?"
    else:
        why = f"{kind}: {text}"
    name = f" {op_name}" if op_name is not None else ""
    line = f"{where}: `{code}`" if code else where
    return f"{line}:{name} cannot be simulated: {why}"

"""Compiled programs on the fake GPU: ``torch.compile`` as the GPU runs it.

Dynamo, AOTAutograd and Inductor run as they do on a GPU machine, on the native engine's CUDA
tensors; what they ask the device is answered as the named GPU (:class:`FakeTritonDriver`), and
the program Inductor writes runs as written: its buffers are allocated through the fake GPU's
allocator in the wrapper's order, freed where it drops them, reused where it reuses them, and
its extern kernels (cuBLAS matrix multiplies, attention) are ATen operations the fake GPU runs.
Only Triton kernels are not built: a kernel of the program is a launch that does nothing
(:class:`NoLaunch`). Note [Compiled programs on the fake GPU].

Note [Compiled programs on the fake GPU]
What decides a compiled program's memory is Inductor's wrapper: which buffers it allocates
(``empty_strided_cuda``), in which order, which it reuses for another (``buf3 = buf0; del buf0 #
reuse``), what AOTAutograd's partition saves for the backward, and the extern kernels' outputs
and workspaces. All of that is Python and ATen, and runs here unchanged. A Triton kernel writes
into buffers the wrapper allocated before it and allocates nothing itself (its scratch, where it
has any, is a buffer of the wrapper too), so a launch that does nothing leaves the memory as on
a GPU. What Inductor decides from the device is answered as the named GPU: its capability, SM
count and memory (``get_device_properties``), Triton's target, the raw stream. Autotuning
(``mode="max-autotune"``) runs its benchmarks, which allocate what they allocate on a GPU (their
inputs, Triton's cache-flush buffer), but times nothing: every candidate takes 0 ms, so each
choice falls to the first, which Inductor lists ATen's (cuBLAS's) ahead of its templates. The
output is the same size either way; cuBLAS's workspace was allocated at the first matrix
multiply anyway. The notes say so.

Compilation costs what it costs on a GPU machine without the Triton builds, and Inductor's
caches (the FX graph cache, on by default) keep it across runs: a second run of the same script
loads the compiled program instead of compiling it.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

import torch

__all__ = ["ENVIRON", "CompiledPrograms", "NoLaunch", "cache_dir"]


class _Environ:
    """The process's environment variables as attributes, for a patch that is undone: an
    unset variable reads None, and setting None unsets it."""

    def __getattr__(self, name: str) -> Optional[str]:
        return os.environ.get(name)

    def __setattr__(self, name: str, value: Optional[str]) -> None:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


ENVIRON = _Environ()


def cache_dir() -> str:
    """Where the fake GPU's compiled programs are cached: ``CUDAPOOL_COMPILE_CACHE``, else
    ``cudapool/inductor`` in the user's cache folder (``XDG_CACHE_HOME``, ``~/.cache``); never
    Inductor's own folder, which runs on a real GPU read."""
    own = os.environ.get("CUDAPOOL_COMPILE_CACHE")
    if own:
        return os.path.abspath(own)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cudapool", "inductor")


class NoLaunch:
    """A Triton kernel of a compiled program on the fake GPU: launches do nothing (the buffers
    it writes were allocated by the wrapper)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def run(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getitem__(self, grid: Any) -> "NoLaunch":  # kernel[grid](...)
        return self

    def __repr__(self) -> str:
        return f"<Triton kernel {self.name}: not launched on the fake GPU>"


class CompiledPrograms:
    """What ``torch.compile`` needs of the fake GPU, set up at the script's first compiled call
    (importing Dynamo and Inductor costs seconds a script that does not compile should not pay)
    and undone with the FakeGPU's other patches. ``gpu``: the FakeGPU (its model, engine and
    ``_patch``)."""

    def __init__(self, gpu: Any) -> None:
        self.gpu = gpu
        self.ready = False
        self.kernels = 0
        self.cache_dir: Optional[str] = None
        self.user_launches = 0
        #: torch.compile's modes the script asked for, with how many calls asked each.
        self.modes: Dict[str, int] = {}

    def asked(self, kwargs: Dict[str, Any]) -> None:
        """A call of torch.compile with ``kwargs``: its mode counted (options' max_autotune too)."""
        mode = kwargs.get("mode") or "default"
        if (kwargs.get("options") or {}).get("max_autotune") and "max-autotune" not in mode:
            mode = "max-autotune (options)"
        self.modes[mode] = self.modes.get(mode, 0) + 1

    def patch_user_kernels(self) -> None:
        """Triton kernels the script (or a library) launches itself (``kernel[grid](...)``):
        launches that do nothing, as the compiled program's (they write into tensors allocated
        before them). Nothing when Triton is not installed."""
        try:
            from triton.runtime.autotuner import Autotuner, Heuristics
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        programs = self

        def run(this: Any, *args: Any, **kwargs: Any) -> None:
            programs.user_launches += 1

        for cls in (JITFunction, Autotuner, Heuristics):
            if "run" in cls.__dict__:
                self.gpu._patch(cls, "run", run)

    def compiled_so_far(self) -> Optional[int]:
        """Graphs Inductor has compiled (or loaded) so far, for a progress line; None before the
        script's first torch.compile."""
        if not self.ready:
            return None
        from torch._dynamo.utils import counters

        return int(counters["aot_autograd"]["total"])

    def summary(self) -> Dict[str, Any]:
        """What was compiled, from Dynamo's and Inductor's own counters: graphs, graph breaks,
        Triton kernels (not built), the FX graph cache's hits and the seconds compiling took."""
        if not self.ready:
            return {"user_triton_launches": self.user_launches} if self.user_launches else {}
        from torch._dynamo.utils import compilation_time_metrics, counters

        breaks = sum(counters["graph_break"].values())
        return {
            "graphs": int(counters["aot_autograd"]["total"]),
            "graph_breaks": int(breaks),
            "triton_kernels": self.kernels,
            "cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "cache_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
            "seconds": round(sum(compilation_time_metrics.get("_compile.compile_inner", ())), 3),
            "cache_dir": self.cache_dir,
            "user_triton_launches": self.user_launches,
            "modes": dict(self.modes),
        }

    def setup(self) -> None:
        if self.ready:
            return
        self.ready = True
        gpu = self.gpu
        patch: Callable[[Any, str, Any], None] = gpu._patch
        engine = gpu.engine
        # Inductor's caches of the fake GPU's own: a program compiled here (its autotuning's
        # choices made without timings) must never be loaded by a run on a real GPU.
        self.cache_dir = cache_dir()
        if gpu.scratch is not None:  # a rank's files are mirrored; the compiled programs are everyone's
            gpu.scratch.passthrough.append(self.cache_dir)
        patch(ENVIRON, "TORCHINDUCTOR_CACHE_DIR", self.cache_dir)
        patch(ENVIRON, "TRITON_CACHE_DIR", os.path.join(self.cache_dir, "triton"))
        import torch._dynamo.device_interface as device_interface
        import torch._inductor.async_compile as async_compile
        import torch._inductor.config as inductor_config

        cuda = torch.cuda
        iface = device_interface.CudaInterface
        for name in (
            "current_device",
            "set_device",
            "device_count",
            "stream",
            "current_stream",
            "set_stream",
            "synchronize",
            "get_device_properties",
            "exchange_device",
            "maybe_exchange_device",
            "memory_allocated",
            "is_bf16_supported",
            "is_available",
        ):
            source = {"exchange_device": "_exchange_device", "maybe_exchange_device": "_maybe_exchange_device"}.get(
                name, name
            )
            if name in iface.__dict__ and hasattr(cuda, source):
                patch(iface, name, staticmethod(getattr(cuda, source)))
        raw_stream = lambda device=None: int(engine.current_stream())  # noqa: E731
        patch(iface, "get_raw_stream", staticmethod(raw_stream))
        patch(iface, "get_compute_capability", staticmethod(lambda device=None: gpu.model.major * 10 + gpu.model.minor))
        worker = iface.Worker
        patch(worker, "current_device", staticmethod(lambda: engine.current_device()))
        patch(worker, "set_device", staticmethod(lambda device: gpu._set_device(device)))
        patch(worker, "get_device_properties", staticmethod(lambda device=None: gpu._props()))
        patch(torch._C, "_cuda_getCurrentRawStream", raw_stream)
        guards = torch._C._dynamo.guards

        def empty_strided_cuda(size: Any, stride: Any, dtype: Any, device: Any = None) -> torch.Tensor:
            return torch.empty_strided(
                size, stride, dtype=dtype, device=torch.device("cuda", gpu._device_index(device))
            )

        patch(guards, "_empty_strided_cuda", empty_strided_cuda)
        # Compiled in this process: a compile worker would be a process without the fake GPU.
        patch(inductor_config, "compile_threads", 1)
        programs = self

        def triton(this: Any, kernel_name: str, source_code: str, device_str: str = "cuda") -> NoLaunch:
            programs.kernels += 1
            return NoLaunch(kernel_name)

        patch(async_compile.AsyncCompile, "triton", triton)
        gpu.graphs.patch_trees()
        driver = _triton_driver(gpu)
        if driver is not None:
            from triton.runtime.driver import driver as triton_driver

            patch(triton_driver, "_active", driver)


def _triton_driver(gpu: Any) -> Optional[Any]:
    """Triton's driver as the named GPU would answer, or None without Triton."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.driver import CudaDriver
    except ImportError:
        return None
    engine = gpu.engine

    class FakeTritonDriver(CudaDriver):
        """Triton's CUDA driver on the fake GPU: the target and devices of the named GPU; no
        driver library is loaded."""

        def __init__(self) -> None:  # CudaDriver's would load libcuda
            self.launcher_cls = None
            self.utils = None

        def get_device_capability(self, device: Any = None) -> Any:
            return (gpu.model.major, gpu.model.minor)

        def get_current_stream(self, device: Any = None) -> int:
            return int(engine.current_stream())

        def get_current_device(self) -> int:
            return int(engine.current_device())

        def set_current_device(self, device: Any) -> None:
            gpu._set_device(device)

        def get_current_target(self) -> Any:
            return GPUTarget("cuda", gpu.model.major * 10 + gpu.model.minor, 32)

        @staticmethod
        def is_active() -> bool:
            return True

    return FakeTritonDriver()

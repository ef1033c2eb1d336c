"""What an engine of the fake GPU is: the part of :class:`cudapool.fakegpu.FakeGPU` that makes
its CUDA tensors and records what they allocate. Two engines implement :class:`Engine`:

- ``"native"`` (:class:`cudapool.fakegpu.native_engine.NativeEngine`): cudapool._torch_fakecuda, plain
  torch CUDA tensors whose kernels compute only shapes, below Python;
- ``"python"`` (:class:`cudapool.fakegpu.python_engine.PythonEngine`): torch's fake tensors
  under :class:`cudapool.fakegpu.tracer.Tracer`, on any torch build.

FakeGPU does everything else the same way on both (torch.cuda's answers, printing, saving,
data loaders, recurrent layers) and asks its engine only what this interface names.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Dict, Optional, Protocol

__all__ = ["Engine", "Host", "Patch"]

#: ``patch(owner, name, value)``: set ``owner.name`` to ``value`` until the FakeGPU exits.
Patch = Callable[[Any, str, Any], None]


class Host(Protocol):
    """What an engine asks of the FakeGPU it runs under (FakeGPU's own hooks, kept private to
    the package)."""

    #: The GPU model (cudapool.fakegpu.models.GPUModel): compute capability for the attention
    #: kernel, memory and multiprocessors for ``torch.cuda``'s answers.
    model: Any
    #: How many devices of that model the fake GPU has (a node's: cuda:0 .. cuda:devices-1).
    devices: int
    #: scaled_dot_product_attention calls per backend chosen.
    sdpa: Dict[str, int]

    def _props(self) -> Any:
        """``torch.cuda.get_device_properties()``'s answer."""

    def _read(self, t: Any, what: str) -> Any:
        """A read of a fake CUDA tensor's values (``.item()``, ...): zeros of its dtype, counted;
        raises under ``strict_values``."""

    def _host_copy(self, t: Any, what: str) -> None:
        """A copy of a fake CUDA tensor to the host (``.cpu()``): counted as a read."""


class Engine(abc.ABC):
    """The fake GPU's tensors and their recorder, for one :class:`FakeGPU` (made by it, entered
    with it once)."""

    #: The name ``FakeGPU(engine=...)`` takes and its summary reports.
    name: str
    #: What records the allocations: ``events``, ``trace()``, ``live_bytes``, ``peak_bytes``,
    #: ``workspace_bytes``, and ``__enter__``/``__exit__`` around the script.
    tracer: Any

    @staticmethod
    @abc.abstractmethod
    def why_unavailable() -> Optional[str]:
        """None when the engine can run in this process, else why not (one sentence)."""

    @abc.abstractmethod
    def tensor_type(self) -> type:
        """The class whose ``__repr__`` and ``__format__`` print the fake GPU's tensors."""

    @abc.abstractmethod
    def is_fake(self, t: Any) -> bool:
        """Whether ``t`` is a tensor of the fake GPU."""

    def set_device(self, index: int) -> None:
        """Make device ``index`` the calling thread's current one (checked by the FakeGPU against
        its device count). An engine of one device takes only 0."""
        if index != 0:
            raise RuntimeError(f"the {self.name} engine simulates one device (cuda:0), not cuda:{index}")

    def current_device(self) -> int:
        """The calling thread's current device."""
        return 0

    def set_stream(self, stream: int) -> None:
        """Make ``stream`` (a number; 0 is the default stream) the calling thread's current one:
        what it allocates from now on is on that stream."""
        self._stream = int(stream)

    def current_stream(self) -> int:
        """The calling thread's current stream."""
        return int(getattr(self, "_stream", 0))

    def cudnn_summary(self) -> Dict[str, Any]:
        """What the engine's model of cuDNN's workspaces did (empty: not modelled)."""
        return {}

    def capture_to_pool(self, stream: int, pool_stream: int) -> bool:
        """Record what is allocated on ``stream`` from now on on the trace stream
        ``pool_stream`` (a CUDA graph's pool; 0: no longer). False where the engine cannot:
        the caller then makes ``pool_stream`` the thread's stream for the capture."""
        return False

    @abc.abstractmethod
    def patch(self, patch: Patch) -> None:
        """What this engine changes in torch for the script to run on it, through ``patch``
        (called before the tracer is entered)."""

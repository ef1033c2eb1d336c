"""Devices and streams of the fake GPU, as ``torch.cuda`` and ``torch.accelerator`` show them.

The fake GPU has ``devices`` devices (one node of a multi-GPU job: ``cuda:0`` .. ``cuda:N-1``)
and as many streams as the script makes. Work is not run, so there is nothing to wait for:
events, waits and synchronisation do nothing. What a stream decides is where memory is
allocated: each allocation is recorded on the thread's current stream (the engine's
:meth:`cudapool.fakegpu.engine.Engine.current_stream`), and the replay keeps each stream's
cached blocks apart as torch's allocators do. Note [Streams of the fake GPU].

Note [Streams of the fake GPU]
A stream the script makes (``torch.cuda.Stream()``) gets a number of its own, never 0 (the
default stream); ``torch.cuda.stream(s)``, ``torch.cuda.set_stream(s)`` and ``with s:`` make it
the current stream of the calling thread, and autograd runs each backward operation on the
stream its forward ran on (the engine's device guard gives torch the thread's current stream).
So FSDP's all-gather and reduce-scatter buffers, made on its own streams, land in their own
pools in the replay, as they do on a GPU. ``Tensor.record_stream`` is counted and otherwise
ignored: on a GPU it keeps a block from reuse until the other stream's work passes the point it
was recorded at; the replay frees it where the program dropped it.
"""

from __future__ import annotations

import itertools
import types
from typing import Any, Callable, Optional

import torch

__all__ = ["FakeEvent", "stream_classes"]


class FakeEvent:
    """``torch.cuda.Event`` on the fake GPU: work is not run, so every event has happened."""

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


def stream_classes(engine: Any, device_index: Callable[[Any], int]) -> Any:
    """The stream class of ``torch.cuda`` for the fake GPU run by ``engine`` (its current
    device and stream), and the functions of ``torch.cuda`` around it, as a namespace.
    ``device_index(device)``: the fake GPU's index of a device argument (the current one for
    None), refusing one it does not have."""

    numbers = itertools.count(1)

    class FakeStream:
        """``torch.cuda.Stream`` on the fake GPU: a number and a device."""

        def __init__(
            self, device: Any = None, priority: int = 0, stream_id: Optional[int] = None, **kwargs: Any
        ) -> None:
            self.device = torch.device("cuda", device_index(device))
            self.priority = priority
            self.stream_id = next(numbers) if stream_id is None else int(stream_id)
            self.cuda_stream = self.stream_id
            self._outer: list = []

        def wait_stream(self, stream: Any) -> None:
            pass

        def wait_event(self, event: Any) -> None:
            pass

        def record_event(self, event: Any = None) -> FakeEvent:
            return event if event is not None else FakeEvent()

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return True

        def is_capturing(self) -> bool:
            return False

        def __enter__(self) -> "FakeStream":
            self._outer.append(engine.current_stream())
            engine.set_stream(self.stream_id)
            return self

        def __exit__(self, *exc: Any) -> None:
            engine.set_stream(self._outer.pop())

        def __eq__(self, other: object) -> bool:
            return isinstance(other, FakeStream) and (other.stream_id, other.device) == (self.stream_id, self.device)

        def __hash__(self) -> int:
            return hash((self.stream_id, self.device.index))

        def __repr__(self) -> str:
            return f"<torch.cuda.Stream device={self.device} cuda_stream={self.stream_id:#x} (fake)>"

    external: dict = {}

    def external_stream(stream_ptr: int, device: Any = None) -> FakeStream:
        """``torch.cuda.ExternalStream``: a stream another library made, one number per pointer."""
        if int(stream_ptr) not in external:
            external[int(stream_ptr)] = next(numbers)
        return FakeStream(device, stream_id=external[int(stream_ptr)])

    def current_stream(device: Any = None) -> FakeStream:
        return FakeStream(device, stream_id=engine.current_stream())

    def default_stream(device: Any = None) -> FakeStream:
        return FakeStream(device, stream_id=0)

    class StreamContext:
        """``torch.cuda.StreamContext`` (what ``torch.cuda.stream(s)`` returns): makes ``s``
        the calling thread's current stream while it is entered; None changes nothing."""

        def __init__(self, s: Any = None) -> None:
            self.stream = s
            self._outer: list = []

        def __enter__(self) -> None:
            self._outer.append(engine.current_stream())
            if self.stream is not None:
                engine.set_stream(self.stream.stream_id)

        def __exit__(self, *exc: Any) -> None:
            engine.set_stream(self._outer.pop())

    def stream(s: Any = None) -> StreamContext:
        return StreamContext(s)

    def set_stream(s: Any) -> None:
        if s is not None:
            engine.set_stream(s.stream_id)

    return types.SimpleNamespace(
        Stream=FakeStream,
        ExternalStream=external_stream,
        current_stream=current_stream,
        default_stream=default_stream,
        stream=stream,
        StreamContext=StreamContext,
        set_stream=set_stream,
    )

"""CUDA graphs on the fake GPU: ``torch.cuda.CUDAGraph``, ``torch.cuda.graph``,
``make_graphed_callables`` and the CUDA graph trees of ``torch.compile(mode="reduce-overhead")``.

Note [CUDA graphs on the fake GPU]
On a GPU, what a capture allocates comes from a private memory pool: its blocks are never
handed to allocations outside the pool, blocks freed during the capture are reused by later
allocations of the same capture (and of later captures sharing the pool), and the pool's
memory stays reserved while a graph that replays into it lives. A replay allocates nothing.

The trace has no pools, but it has streams, and the replay keeps each stream's cached blocks
apart exactly as a private pool keeps its blocks apart. So a pool is a stream of its own in the
trace (:func:`pool_stream`, numbers from ``POOL_STREAMS`` on, far from the script's streams):
while a capture is underway, the capturing thread allocates on its pool's stream; the outputs it
keeps are freed into that stream's cache when the script drops them, where only the pool's
later allocations can take them. Replays do nothing. What a pool shares with no other (a second
capture into ``g1.pool()``) is the stream's cache, as on a GPU.

Graph trees (``mode="reduce-overhead"``) keep one pool per device for all the graphs of all
compiled functions, record each function at its second call, and replay it from then on; each
replay's outputs are the recorded outputs' memory again. Here every call of a function that
the trees would replay runs the compiled program on the device's tree pool: the same
allocations in the same order, on the pool's stream, so the pool's cached blocks serve it
again and the pool's size is the recording's; its outputs are allocations of the pool, as the
trees' are. Not modelled: the trees' copies of inputs that change address between calls (a
batch not made at a fixed address: usually small), and ``empty_cache`` in the replay gives back
a pool's unused cached segments, which a GPU keeps while a graph lives.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["POOL_STREAMS", "Graphs"]

#: The first stream number of a private pool in the trace.
POOL_STREAMS = 1 << 40


class Graphs:
    """The CUDA graph calls of ``torch.cuda`` on the fake GPU ``gpu`` (its engine and
    ``_patch``): :meth:`patch` installs them; counts in :attr:`captures`, :attr:`replays`,
    :attr:`tree_calls`."""

    def __init__(self, gpu: Any) -> None:
        self.gpu = gpu
        self.captures = 0
        self.replays = 0
        self.tree_calls = 0
        self._handles = itertools.count(1)
        self._streams: Dict[Tuple[int, int], int] = {}
        self._capturing: Dict[int, int] = {}  # captures underway, by stream

    def pool_handle(self) -> Tuple[int, int]:
        """A new pool's handle (torch's ``graph_pool_handle``: a pair of ints)."""
        return (0, next(self._handles))

    def pool_stream(self, pool: Any) -> int:
        """The trace's stream of a private pool (a handle, or a ``torch.cuda.MemPool``)."""
        key = tuple(pool.id) if hasattr(pool, "id") else tuple(pool)
        if key not in self._streams:
            self._streams[key] = POOL_STREAMS + len(self._streams)
        return self._streams[key]

    def capturing(self) -> bool:
        """Whether a capture is underway on the calling thread's stream."""
        return self.gpu.engine.current_stream() in self._capturing

    def enter_pool(self, pool: Tuple[int, int]) -> Tuple[int, bool]:
        """Allocations on the calling thread's stream go to ``pool`` until :meth:`leave_pool`
        (given what this returns)."""
        engine = self.gpu.engine
        stream = engine.current_stream()
        into = self.pool_stream(pool)
        if engine.capture_to_pool(stream, into):
            self._capturing[stream] = self._capturing.get(stream, 0) + 1
            return (stream, True)
        engine.set_stream(into)  # an engine without pools: the pool's stream is the thread's
        self._capturing[into] = self._capturing.get(into, 0) + 1
        return (stream, False)

    def leave_pool(self, entered: Tuple[int, bool]) -> None:
        engine = self.gpu.engine
        stream, pooled = entered
        key = stream if pooled else engine.current_stream()
        self._capturing[key] -= 1
        if not self._capturing[key]:
            del self._capturing[key]
        if pooled:
            if key not in self._capturing:
                engine.capture_to_pool(stream, 0)
        else:
            engine.set_stream(stream)

    def patch(self) -> None:
        gpu = self.gpu
        graphs = self

        class CUDAGraph:
            """``torch.cuda.CUDAGraph`` on the fake GPU (Note [CUDA graphs on the fake GPU]):
            a capture allocates on its pool's stream; a replay does nothing."""

            def __init__(self, keep_graph: bool = False) -> None:
                self._pool: Optional[Tuple[int, int]] = None
                self._outer: List[Tuple[int, bool]] = []

            def capture_begin(self, pool: Any = None, capture_error_mode: str = "global", **kwargs: Any) -> None:
                self._pool = tuple(pool) if pool is not None else graphs.pool_handle()
                self._outer.append(graphs.enter_pool(self._pool))
                graphs.captures += 1

            def capture_end(self) -> None:
                graphs.leave_pool(self._outer.pop())

            def instantiate(self) -> None:
                pass

            def replay(self) -> None:
                graphs.replays += 1

            def reset(self) -> None:
                pass

            def pool(self) -> Tuple[int, int]:
                if self._pool is None:
                    raise RuntimeError("Called CUDAGraph::pool without a preceding successful capture.")
                return self._pool

            def enable_debug_mode(self) -> None:
                pass

            def debug_dump(self, path: str) -> None:
                pass

            def raw_cuda_graph(self) -> int:
                return 0

            def raw_cuda_graph_exec(self) -> int:
                return 0

        import torch.cuda.graphs as torch_graphs

        patch = gpu._patch
        handle = lambda: graphs.pool_handle()  # noqa: E731
        patch(torch.cuda, "CUDAGraph", CUDAGraph)
        patch(torch_graphs, "CUDAGraph", CUDAGraph)
        patch(torch.cuda, "graph_pool_handle", handle)
        patch(torch_graphs, "graph_pool_handle", lambda: graphs.pool_handle())
        patch(torch.cuda, "is_current_stream_capturing", lambda: graphs.capturing())
        patch(torch_graphs, "is_current_stream_capturing", lambda: graphs.capturing())
        # torch.cuda.graph's stream of its own, made on the fake GPU.
        patch(torch_graphs.graph, "default_capture_stream", None)

    def patch_trees(self) -> None:
        """``mode="reduce-overhead"``: Inductor's CUDA graph trees, as each call runs on the
        device's tree pool (Note [CUDA graphs on the fake GPU]). Called when Inductor is set up."""
        import torch._inductor.cudagraph_trees as trees

        graphs = self
        engine = self.gpu.engine
        tree_pools: Dict[int, Tuple[int, int]] = {}

        def cudagraphify_impl(
            model: Callable[..., Any], inputs: List[Any], static_input_idxs: Any, *args: Any, **kwargs: Any
        ) -> Callable[..., Any]:
            device = int(kwargs.get("device_index", engine.current_device()))
            pool = tree_pools.setdefault(device, graphs.pool_handle())
            del inputs

            def run(new_inputs: List[Any]) -> Any:
                graphs.tree_calls += 1
                entered = graphs.enter_pool(pool)
                try:
                    return model(new_inputs)
                finally:
                    graphs.leave_pool(entered)

            return run

        self.gpu._patch(trees, "cudagraphify_impl", cudagraphify_impl)

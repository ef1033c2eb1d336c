"""cuDNN convolution workspaces on the fake GPU: a model of what torch asks its caching
allocator for around each cuDNN convolution (the native engine's kernel scratch).

Note [cuDNN workspaces on the fake GPU]
torch runs a CUDA convolution with cuDNN and takes the kernel's workspace from its caching
allocator, for the kernel's run only. How large it is, cuDNN says: its heuristics (with
``torch.backends.cudnn.benchmark`` off) or its timed search (on) pick an engine, and each
engine has its own size. cuDNN cannot be asked without a GPU (its handle needs a context), so
the sizes here are a model, not cuDNN's answer:

- **The kernel that runs.** Forward and backward-data convolutions run an implicit-GEMM
  engine, which needs no workspace worth counting (the first engines cuDNN's heuristics rank
  for tensor-core dtypes, and the fastest a search finds at training sizes). A
  backward-weight convolution of half-precision inputs (float16, bfloat16) accumulates the
  weight's gradient in float32: a workspace of the weight's size in float32.
- **The search** (``benchmark=True``), at the first call of each configuration (shapes,
  dtypes, stride, padding, dilation, groups; torch caches its answer per configuration): torch
  sets aside the largest workspace among the engines it will time, within the memory its
  allocator can give (its largest free block, or the GPU's free memory), before timing them.
  Here: the explicit-GEMM engine's, the lowered input (``im2col``: batch x input channels x
  kernel positions x output positions, in the input's dtype), within the GPU's memory left free
  at that moment; nothing for 1x1 convolutions of stride 1 without padding (their input is
  already the matrix).

``torch.backends.cudnn.enabled = False`` turns the model off (torch then runs its own
convolution kernels, which take no workspace from the allocator). The notes of ``ab
--simulate`` say that these sizes are the model's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

__all__ = ["CONVOLUTIONS", "CudnnModel"]

#: The operations the fake GPU asks the model about (their CUDA kernels call cuDNN).
CONVOLUTIONS = frozenset(("aten::convolution", "aten::convolution_backward"))


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def _spatial_out(
    size: Sequence[int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> List[int]:
    return [
        (int(i) + 2 * int(p) - int(d) * (int(k) - 1) - 1) // int(s) + 1
        for i, k, s, p, d in zip(size, kernel, stride, padding, dilation)
    ]


class CudnnModel:
    """The model of Note [cuDNN workspaces on the fake GPU] for one traced run: ``room()`` is
    the GPU memory left free now (for the search's limit). Counts in :meth:`summary`."""

    def __init__(self, room: Any) -> None:
        self.room = room
        self.convolutions = 0
        self.searches = 0
        self.largest_search = 0
        self.largest_workspace = 0

    def steps(self, name: str, args: Sequence[Any]) -> Tuple[int, ...]:
        """Scratch steps of one convolution (cudapool.fakegpu.kernel_scratch's steps; those
        before a 0 run at the first call of the configuration only)."""
        if not torch.backends.cudnn.enabled or name not in CONVOLUTIONS:
            return ()
        if name == "aten::convolution":  # a forward: one pass, searched like a backward-data one
            x, w = args[0], args[1]
            stride, padding, dilation, transposed, groups = args[3], args[4], args[5], bool(args[6]), int(args[8])
            passes = ["data"]
        else:
            x, w = args[1], args[2]
            stride, padding, dilation, transposed, groups = args[4], args[5], args[6], bool(args[7]), int(args[9])
            mask = list(args[10]) if len(args) > 10 else [True, True, False]
            passes = [p for p, on in (("data", mask[0]), ("weight", mask[1])) if on]
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() < 3:
            return ()
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return ()
        kernel = [int(k) for k in w.shape[2:]]
        pointwise = all(k == 1 for k in kernel) and all(int(s) == 1 for s in stride) and not any(padding)
        if pointwise:
            lowered = 0
        elif transposed:  # the image is the transposed convolution's output; its input the columns
            channels = int(w.shape[1]) * groups
            lowered = int(x.shape[0]) * channels * _prod(kernel) * _prod(x.shape[2:]) * x.element_size()
        else:
            cols = _spatial_out(x.shape[2:], kernel, stride, padding, dilation)
            lowered = int(x.shape[0]) * int(x.shape[1]) * _prod(kernel) * _prod(cols) * x.element_size()
        self.convolutions += 1
        first: List[int] = []
        every: List[int] = []
        if torch.backends.cudnn.benchmark and lowered > 0:
            for _ in passes:
                size = max(0, min(lowered, int(self.room())))
                if size:
                    first += [size, -(len(first) // 2 + 1)]
                    self.searches += 1
                    self.largest_search = max(self.largest_search, size)
        if "weight" in passes and w.element_size() < 4:
            size = w.numel() * 4
            every += [size, -1]
            self.largest_workspace = max(self.largest_workspace, size)
        return tuple(first + ([0] if first else []) + every)

    def summary(self) -> Dict[str, Any]:
        return {
            "convolutions": self.convolutions,
            "searches": self.searches,
            "largest_search": self.largest_search,
            "largest_workspace": self.largest_workspace,
            "benchmark": bool(torch.backends.cudnn.benchmark),
        }

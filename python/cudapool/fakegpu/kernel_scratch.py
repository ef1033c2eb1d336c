"""Scratch buffers CUDA kernels take from the caching allocator inside one ATen operation, for
the kernels where their sizes follow from the operation's shapes (and the GPU's size).

Each model returns the buffers' lifetimes as steps: ``+n`` allocates a temporary of n bytes,
``-k`` frees the k-th temporary allocated (1-based). The tracer emits them after the
operation's result, in the order the kernel takes and returns them.

Modelled:

- **Reduction staging** (sum and mean; torch's ``gpu_reduce_kernel``): when a reduction has
  few outputs and many inputs per output, the kernel splits each output's inputs over several
  thread blocks that combine their partial results through a global buffer, with one
  semaphore per output block. The launch configuration is ``setReduceConfig`` of
  ``ATen/native/cuda/Reduce.cuh``, redone here for dense inputs; the GPU enters through its
  number of multiprocessors and threads per multiprocessor. Typical case: the gradient of a
  bias or norm weight, summed over every token (``[tokens, d] -> [d]``): 8 bytes per input
  element at 1,024 tokens and more.
- **index_put with accumulate=True** (indexing's backward: ``index_put_with_sort_kernel``): the
  N indices are linearised (a remainder, then a product), sorted with their original positions
  (CUB radix sort, with an arange), 8N bytes each, plus CUB's temporary storage. That last
  size is an estimate: 1 byte up to N = 2,048 (the sort fits one tile) and 16.25 N + 5,631 bytes
  from N = 4,096, the sizes recorded on GPUs at N = 512, 1,024, 2,048, 4,096 and 8,192 (indices
  into 10,000 rows); it holds the sort's alternate key and value buffers (16 N) and CUB's own
  bookkeeping, which depends on the number of index bits too. Where between 2,048 and 4,096 the
  one-tile sort stops, and the size for other index ranges, are unverified.

- **Flash attention backward** (``mha_bwd`` of flash_api.cpp): ``softmax_d`` and ``dq_accum``,
  float32, sized from the query (see :func:`flash_backward_steps`).

Not modelled (a trace lists them in ``meta["unseen"]``): the staging of other reductions (max
or min with indices, var/std, norm, any/all), sort and top-k, cuDNN and cuFFT workspaces,
embedding's own backward kernel, scans.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "DEFAULT_GPU",
    "OPS",
    "acc_size",
    "flash_backward_steps",
    "gpu_shape",
    "index_put_steps",
    "op_steps",
    "reduction_steps",
]

#: index_put with accumulate=True: on CUDA it sorts the indices (index_put_with_sort_kernel).
SORTED_INDEX_PUTS = frozenset(
    ("aten::index_put", "aten::index_put_", "aten::_index_put_impl_", "aten::_unsafe_index_put")
)
#: Reductions whose staging is modelled.
STAGED_REDUCTIONS = frozenset(("aten::sum", "aten::mean"))
#: The flash attention backward (flash_api.cpp's mha_bwd): float32 accumulators.
FLASH_BACKWARDS = frozenset(("aten::_scaled_dot_product_flash_attention_backward",))
#: Every operation (schema name) some model here applies to.
OPS = SORTED_INDEX_PUTS | STAGED_REDUCTIONS | FLASH_BACKWARDS

#: Multiprocessors and threads per multiprocessor of the GPU the scratch is sized for when the
#: caller names none: an H100 SXM / H200.
DEFAULT_GPU = (132, 2048)


def gpu_shape(props: Any) -> Tuple[int, int]:
    """(multiprocessors, threads per multiprocessor) from torch's device properties, a dict
    with those keys, a pair, or None (DEFAULT_GPU)."""
    if props is None:
        return DEFAULT_GPU
    if isinstance(props, (tuple, list)) and len(props) == 2:
        sms, threads = props
    elif isinstance(props, dict):
        sms, threads = props["multi_processor_count"], props["max_threads_per_multi_processor"]
    else:
        sms, threads = props.multi_processor_count, props.max_threads_per_multi_processor
    sms, threads = int(sms), int(threads)
    if sms <= 0 or threads <= 0:
        raise ValueError(f"a GPU has a positive number of multiprocessors and threads, not {sms} and {threads}")
    return sms, threads


def _div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


def _last_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _dims(
    shape: Sequence[int], strides: Sequence[int], reduced: Sequence[int]
) -> Optional[List[Tuple[int, int, bool]]]:
    """The reduction's dimensions as TensorIterator lays them out: size-1 dimensions dropped,
    fastest first, neighbours of the same kind that are contiguous with each other merged;
    then the reduced ones before the kept ones. (size, stride in elements, reduced) each, or
    None for a layout not modelled (overlapping, or a zero stride)."""
    dims = [(int(s), int(st), i in reduced) for i, (s, st) in enumerate(zip(shape, strides)) if s != 1]
    if any(st <= 0 for _, st, _ in dims):
        return None
    dims.sort(key=lambda d: d[1])
    merged: List[Tuple[int, int, bool]] = []
    for size, stride, red in dims:
        if merged:
            psize, pstride, pred = merged[-1]
            if pred == red and pstride * psize == stride:
                merged[-1] = (psize * size, pstride, red)
                continue
        merged.append((size, stride, red))
    return [d for d in merged if d[2]] + [d for d in merged if not d[2]]


def reduction_steps(
    shape: Sequence[int],
    strides: Sequence[int],
    reduced: Sequence[int],
    in_size: int,
    acc_size: int,
    gpu: Tuple[int, int] = DEFAULT_GPU,
    vt0: int = 4,
) -> Tuple[int, ...]:
    """The staging of one sum/mean over ``reduced`` dimensions of a dense input (``in_size``
    bytes per element, ``acc_size`` per accumulator): () when the kernel needs none."""
    sms, threads_per_sm = gpu
    dims = _dims(shape, strides, reduced)
    if not dims:
        return ()
    n_reduce = sum(1 for d in dims if d[2])
    if n_reduce == 0:
        return ()
    num_outputs = 1
    inputs_per_output = 1
    for size, _, red in dims:
        if red:
            inputs_per_output *= size
        else:
            num_outputs *= size
    if num_outputs * inputs_per_output >= 1 << 31:
        return ()  # split into 32-bit-indexable pieces: not modelled
    on_fastest = n_reduce == len(dims) or dims[0][1] < dims[n_reduce][1]
    if on_fastest:
        dim0, dim1, fastest = inputs_per_output, num_outputs, dims[0][1]
    else:
        dim0, dim1, fastest = num_outputs, inputs_per_output, dims[n_reduce][1]
    output_vec = 1
    if fastest == 1:
        if on_fastest and dim0 > 128 and n_reduce == 1:
            dim0 //= vt0  # the input is read vt0 elements at a time
        elif not on_fastest:
            output_vec = 4  # the result is assumed aligned (the caching allocator's blocks are)
            for n in [dims[n_reduce][0]] + [d[1] for i, d in enumerate(dims) if i != n_reduce]:
                while n % output_vec:
                    output_vec //= 2
            dim0 //= output_vec
    max_threads = (256 if acc_size > 8 else 512) // output_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, 32)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height
    step_input = step_output = 1
    block_x_reduce = False
    if on_fastest:
        step_input *= block_width
        block_x_reduce = True
    else:
        step_output *= block_width
    input_split_y = False
    if _div_up(inputs_per_output, step_input) >= block_height * 16 or _div_up(inputs_per_output, step_input) >= 256:
        step_input *= block_height
        input_split_y = True
    else:
        step_output *= block_height
    grid_x = _div_up(num_outputs // output_vec, step_output)
    target_grid = sms * (threads_per_sm // num_threads)
    values_per_thread = _div_up(inputs_per_output, step_input)
    ctas = 1
    if input_split_y and values_per_thread >= 256 and grid_x <= target_grid:
        ctas = max(min(_div_up(target_grid, grid_x), _div_up(values_per_thread, 16)), _div_up(values_per_thread, 256))
    if ctas <= 1:
        return ()
    buffer = acc_size * num_outputs * ctas
    if not block_x_reduce:
        buffer *= block_width * output_vec
    semaphores = 4 * grid_x
    return (buffer, semaphores, -2, -1)


def index_put_steps(n: int) -> Tuple[int, ...]:
    """index_put with accumulate=True over n index elements (see the module notes)."""
    if n <= 0:
        return ()
    b = 8 * n
    cub = 1 if n <= 2048 else (65 * n + 3) // 4 + 5631
    return (b, b, -1, b, b, b, cub, -6, -5, -4, -3, -2)


def flash_backward_steps(batch: int, heads: int, length: int, head_dim: int) -> Tuple[int, ...]:
    """The flash backward's float32 buffers (query [batch, heads, length, head_dim]):
    ``softmax_d`` [batch, heads, length rounded up to 128] and ``dq_accum`` [batch, length
    rounded up to 128, heads, head_dim rounded up to 32 (64 past 128)], taken and given back
    inside the call."""
    rows = _div_up(length, 128) * 128
    width = _div_up(head_dim, 32 if head_dim <= 128 else 64) * (32 if head_dim <= 128 else 64)
    return (4 * batch * heads * rows, 4 * batch * rows * heads * width, -1, -2)


def acc_size(dtype: torch.dtype) -> int:
    """Bytes of the accumulator torch's CUDA sum/mean use for ``dtype``."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return 4
    if dtype.is_complex:
        return 16 if dtype == torch.complex128 else 8
    if dtype.is_floating_point:
        return 8
    return 8  # integers and bool accumulate in int64


def op_steps(name: str, args: Any, kwargs: Any, gpu: Tuple[int, int] = DEFAULT_GPU) -> Tuple[Tuple[int, ...], str]:
    """The scratch steps of one call of the operation ``name`` (a schema name such as
    "aten::sum") with its arguments, and what they are: ((), "") where no model applies."""
    x = args[0]
    if name in STAGED_REDUCTIONS:
        if x.layout != torch.strided or x.numel() == 0:
            return (), ""
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = list(range(x.dim()))
        elif isinstance(dims, int):
            dims = [dims]
        reduced = [d % x.dim() for d in dims] if x.dim() else []
        steps = reduction_steps(tuple(x.shape), tuple(x.stride()), reduced, x.element_size(), acc_size(x.dtype), gpu)
        return steps, "reduction staging"
    if name in FLASH_BACKWARDS and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].dim() == 4:
        return flash_backward_steps(*args[1].shape), "flash attention backward accumulators"
    if name in SORTED_INDEX_PUTS:
        accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
        if not accumulate or len(args) < 2:
            return (), ""
        index = [i for i in (args[1] or ()) if isinstance(i, torch.Tensor)]
        if not index or any(i.dtype == torch.bool for i in index):
            return (), ""  # boolean masks go through nonzero first: not modelled
        n = 1
        for size in torch.broadcast_shapes(*(tuple(i.shape) for i in index)):
            n *= size
        return index_put_steps(n), "index_put scratch"
    return (), ""

"""scaled_dot_product_attention as torch would run it on a given GPU, on fake CUDA tensors.

Without a GPU, ``torch.nn.functional.scaled_dot_product_attention`` on fake CUDA tensors takes
the math path: it materialises the T x T attention weights (in float32 for half inputs), which
the fused kernels a GPU runs never allocate. :func:`choose` redoes torch's backend selection
(``select_sdp_backend`` in ATen/native/transformers/cuda/sdp_utils.cpp) for the GPU's compute
capability, the inputs and the ``torch.backends.cuda.*_sdp_enabled()`` flags, and :func:`run`
calls that backend's own ATen operation, whose fake (meta) implementation returns what the
kernel returns: the output, the log-sum-exp it saves for backward (float32, one per query row),
the random state of dropout. Its backward is the backend's backward operation (gradients of
q, k and v; the flash backward's float32 accumulators are modelled as kernel scratch).

The rules (torch 2.11-2.14's sdp_utils.cpp and attention.cpp; a query of shape [batch, heads,
length, head_dim]):

- order of preference: flash, memory-efficient, math; cuDNN attention comes first instead on
  compute capability 9.x and 10.x (Hopper, Blackwell) with cuDNN later than 9.15 (the version
  torch has, else 9.15: torch's own build; ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1`` turns it off),
  and after math otherwise (that is: never, as math takes everything);
- cuDNN: capability 8.0 to 12.x, float16 or bfloat16, head_dim a multiple of 8 and at most 128
  (256 with cuDNN later than 9.22), a mask allowed (2-D or 4-D), dropout in steps of 1/16,
  batch and heads at most 65,535, more than one key;
- flash: capability 8.0 to 12.x, float16 or bfloat16, no mask, head_dim at most 256 (q, k and v
  alike; padded up to a multiple of 8 with copies, the output sliced back), no causal mask
  between different query and key lengths; in training on capability 8.6-8.9 and 12.x, no
  head_dim in (192, 224], nor in (224, 256] with dropout;
- memory-efficient: capability 5.0 and later, float32 or float16 (bfloat16 from 8.0), any
  mask (broadcast to [batch, heads, q, k]), head_dim of q, k and v a multiple of 8 for half
  types (4 for float32 from 8.0, 1 for float32 before);
- grouped-query attention (``enable_gqa``: key and value heads dividing the query's) in all
  three; math takes whatever is left, as torch does.

Their memory (the fake kernels' outputs): flash: the output and a float32 log-sum-exp of
[batch, heads, q] and 24 bytes of random state; backward, dq, dk, dv and the float32
accumulators torch's flash backward allocates (``softmax_d``, [batch, heads, q rounded up to
128]; ``dq_accum``, [batch, q rounded up to 128, heads, head_dim rounded up to 32, or 64 past
128]: kernel scratch, :mod:`cudapool.fakegpu.kernel_scratch`). Memory-efficient: the output and a
float32 log-sum-exp of [batch, heads, q rounded up to 32] when a gradient is needed. cuDNN: the
output and a float32 log-sum-exp of [batch, heads, q, 1]. Not modelled: the flash forward's
split-KV accumulators (inference at small batch), the memory-efficient backward's workspace
and cuDNN's own workspace.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ["choose", "run"]

aten = torch.ops.aten


def _flag(name: str) -> bool:
    fn = getattr(torch.backends.cuda, name, None)
    return True if fn is None else bool(fn())


def _cudnn_version() -> int:
    try:
        return int(torch.backends.cudnn.version() or 91500)
    except Exception:  # noqa: BLE001 - no cuDNN library: torch's own build
        return 91500


def _dense4(*ts: torch.Tensor) -> bool:
    return all(
        t.dim() == 4 and not t.is_nested and not t.is_sparse and (t.stride(-1) == 1 or t.size(-1) == 1) for t in ts
    )


def _heads_ok(q: Any, k: Any, v: Any, gqa: bool) -> bool:
    hq, hk, hv = q.size(-3), k.size(-3), v.size(-3)
    if gqa:
        return hk == hv and hq % hk == 0
    return hq == hk == hv or (hk == hv == 1)


def _half(q: Any, k: Any, v: Any) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype


def _training(q: Any, k: Any, v: Any) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))


def _prefer_cudnn(major: int) -> bool:
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "") not in ("", "0"):
        return False
    return major in (9, 10) and _cudnn_version() > 91500


def _cudnn_ok(q: Any, k: Any, v: Any, mask: Any, dropout_p: float, major: int, gqa: bool) -> bool:
    if not _flag("cudnn_sdp_enabled") or not 8 <= major <= 12 or not _half(q, k, v) or not _dense4(q, k, v):
        return False
    limit = 256 if _cudnn_version() > 92200 else 128
    if any(t.size(-1) % 8 or t.size(-1) > limit for t in (q, k, v)):
        return False
    if mask is not None and (mask.dim() not in (2, 4) or mask.requires_grad):
        return False
    if dropout_p and (dropout_p * 16) % 1:
        return False
    return q.size(0) <= 65535 and q.size(1) <= 65535 and k.size(-2) != 1 and _heads_ok(q, k, v, gqa)


def _flash_ok(
    q: Any, k: Any, v: Any, mask: Any, dropout_p: float, is_causal: bool, major: int, minor: int, gqa: bool
) -> bool:
    if not _flag("flash_sdp_enabled") or not 8 <= major <= 12 or mask is not None or not _half(q, k, v):
        return False
    d = q.size(-1)
    if not _dense4(q, k, v) or not d == k.size(-1) == v.size(-1) or d > 256:
        return False
    if is_causal and q.size(-2) != k.size(-2):
        return False
    if _training(q, k, v) and (major == 12 or (major == 8 and 6 <= minor <= 9)):
        if 192 < d <= 224 or (224 < d <= 256 and dropout_p > 0):
            return False
    return _heads_ok(q, k, v, gqa)


def _efficient_ok(q: Any, k: Any, v: Any, mask: Any, major: int, gqa: bool) -> bool:
    if not _flag("mem_efficient_sdp_enabled") or major < 5:
        return False
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return False
    if q.dtype == torch.bfloat16 and major < 8:
        return False
    if q.dtype == torch.float32:
        align = 4 if major >= 8 else 1
    else:
        align = 8 if major >= 7 else 1
    if q.size(-1) != k.size(-1) or q.size(-1) % align or v.size(-1) % align:
        return False
    return _dense4(q, k, v) and _heads_ok(q, k, v, gqa)


def choose(
    q: Any, k: Any, v: Any, mask: Any, dropout_p: float, is_causal: bool, gqa: bool, major: int, minor: int = 0
) -> str:
    """The backend torch picks on a GPU of compute capability ``major``.``minor``: "cudnn",
    "flash", "efficient" or "math"."""
    if _prefer_cudnn(major) and _cudnn_ok(q, k, v, mask, dropout_p, major, gqa):
        return "cudnn"
    if _flash_ok(q, k, v, mask, dropout_p, is_causal, major, minor, gqa):
        return "flash"
    if _efficient_ok(q, k, v, mask, major, gqa):
        return "efficient"
    return "math"


def _pad_last(t: torch.Tensor, to: int) -> torch.Tensor:
    extra = (-t.size(-1)) % to
    return F.pad(t, (0, extra)) if extra else t


def _bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The additive bias a fused kernel takes for ``mask``: a boolean mask becomes one."""
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(mask.logical_not(), float("-inf"))
    else:
        bias = mask if mask.dtype == q.dtype else mask.to(q.dtype)
    return bias


def _expand_heads(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t if t.size(-3) == q.size(-3) else t.repeat_interleave(q.size(-3) // t.size(-3), dim=-3)


def run(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],
    gqa: bool,
) -> torch.Tensor:
    """The attention output through ``backend``'s ATen operation (see the module notes)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    need_lse = _training(q, k, v)
    if backend == "cudnn":
        bias = None if mask is None else _bias(mask, q, k).expand(q.size(0), q.size(1), q.size(2), k.size(2))
        k, v = _expand_heads(q, k), _expand_heads(q, v)
        return aten._scaled_dot_product_cudnn_attention(
            q, k, v, bias, need_lse, dropout_p, is_causal, False, scale=scale
        )[0]
    if backend == "flash":
        k, v = _expand_heads(q, k), _expand_heads(q, v)
        d = v.size(-1)
        qp, kp, vp = (_pad_last(t, 8) for t in (q, k, v))
        out = aten._scaled_dot_product_flash_attention(qp, kp, vp, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :d] if out.size(-1) != d else out
    bias = None
    if mask is not None:
        bias = _bias(mask, q, k)
        if bias.size(-1) % 8:
            bias = F.pad(bias, (0, (-bias.size(-1)) % 8))[..., : mask.size(-1)]
        bias = bias.expand(q.size(0), q.size(1), q.size(2), k.size(2))
    k, v = _expand_heads(q, k), _expand_heads(q, v)
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, need_lse, dropout_p, is_causal, scale=scale)[0]

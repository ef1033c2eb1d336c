"""GPT-style decoder trained with AdamW on steps of varying sequence length and batch.

The model: token and position embeddings, N pre-LayerNorm blocks of causal self-attention and
a GELU MLP, a final LayerNorm and an LM head tied to the token embedding (GPT-2's layout), in
float32 without dropout. Attention is written out (q @ kᵀ, causal mask, softmax, @ v) rather
than calling scaled_dot_product_attention, so the buffers it saves are the same on every
device (SDPA's CUDA flash/memory-efficient kernels save different ones than the CPU path).
AdamW runs with ``foreach=True``, the implementation it picks on CUDA.

Every step draws its sequence length (``min_seq``..``max_seq`` in multiples of 8) and batch
(``min_batch``..``max_batch``) from a generator seeded with ``seed``: varying shapes are what
fragments a caching allocator. The model is built inside the tracer, so parameters, gradients
and optimizer state are in the trace.

    python benchmarks/workloads/gpt.py --out build/traces/gpt-small.cptrace
    python benchmarks/workloads/gpt.py --scale medium --steps 100 --out gpt.cptrace
    python benchmarks/workloads/gpt.py --layers 12 --d-model 768 --max-seq 1024 --device cpu

Scales: ``small`` (4 layers, d_model 256, 20 steps, seq 32..512: seconds to capture on
fake CUDA; for CI), ``medium`` (GPT-2 small: 12 layers, d_model 768, 50 steps, seq up to 1024),
``large`` (24 layers, d_model 1024, 100 steps, seq up to 2048).
"""

from __future__ import annotations

import math
import random
import sys
from typing import Any, List, Optional, Tuple

try:
    from . import _common
except ImportError:  # run as a script
    import _common

from cudapool.lab.trace import Trace

# What every scale shares; the model and the shapes grow with the scale.
_TRAINING = dict(lr=3e-4, weight_decay=0.1, optimizer="adamw", device="cuda")
# fmt: off
SCALES = {
    "small": dict(layers=4, d_model=256, heads=4, vocab=8192, steps=20, min_seq=32, max_seq=512,
                  min_batch=2, max_batch=8, **_TRAINING),
    "medium": dict(layers=12, d_model=768, heads=12, vocab=50304, steps=50, min_seq=64, max_seq=1024,
                   min_batch=4, max_batch=16, **_TRAINING),
    "large": dict(layers=24, d_model=1024, heads=16, vocab=50304, steps=100, min_seq=128, max_seq=2048,
                  min_batch=4, max_batch=16, **_TRAINING),
}
# fmt: on


def build_model(layers: int, d_model: int, heads: int, vocab: int, max_seq: int, device: str) -> Any:
    """The GPT model (an nn.Module) on ``device``; call it inside a tracer to record its weights.

    ``model(idx)`` -> logits ``[B, T, vocab]``; ``model(idx, cache)`` also takes and returns a
    per-layer key/value cache (see :func:`kvcache.capture`).
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(d_model, 3 * d_model, device=device)
            self.proj = nn.Linear(d_model, d_model, device=device)
            self.head_dim = d_model // heads

        def forward(self, x, causal, cache=None):
            B, T, C = x.shape
            q, k, v = self.qkv(x).split(C, dim=2)
            q = q.view(B, T, heads, self.head_dim).transpose(1, 2)
            k = k.view(B, T, heads, self.head_dim).transpose(1, 2)
            v = v.view(B, T, heads, self.head_dim).transpose(1, 2)
            if cache is not None:
                k, v = cache.update(k, v)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            if T > 1:
                S = k.size(2)
                att = att.masked_fill(causal[S - T : S, :S], float("-inf"))
            att = F.softmax(att, dim=-1)
            y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
            return self.proj(y)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model, device=device)
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(d_model, device=device)
            self.fc = nn.Linear(d_model, 4 * d_model, device=device)
            self.out = nn.Linear(4 * d_model, d_model, device=device)

        def forward(self, x, causal, cache=None):
            x = x + self.attn(self.ln1(x), causal, cache)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d_model, device=device)
            self.pos = nn.Embedding(max_seq, d_model, device=device)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d_model, device=device)
            self.head = nn.Linear(d_model, vocab, bias=False, device=device)
            self.head.weight = self.tok.weight  # tied, as in GPT-2
            # True above the diagonal: the positions a token may not attend to.
            self.register_buffer(
                "causal", torch.ones(max_seq, max_seq, dtype=torch.bool, device=device).triu(1), persistent=False
            )
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)

        def forward(self, idx, caches: Optional[List[Any]] = None, last_only: bool = False):
            B, T = idx.shape
            start = caches[0].length if caches else 0
            if start + T > max_seq:
                raise ValueError(f"sequence of {start + T} tokens is longer than max_seq {max_seq}")
            pos = torch.arange(start, start + T, device=idx.device)
            x = self.tok(idx) + self.pos(pos)
            for i, block in enumerate(self.blocks):
                x = block(x, self.causal, caches[i] if caches else None)
            if last_only:
                x = x[:, -1:]
            return self.head(self.ln_f(x))

    return GPT()


def draw_shapes(
    seed: int, steps: int, min_seq: int, max_seq: int, min_batch: int, max_batch: int
) -> List[Tuple[int, int]]:
    """(batch, seq_len) of every step: lengths in multiples of 8, from a generator seeded with seed."""
    if not 8 <= min_seq <= max_seq:
        raise ValueError(f"need 8 <= min_seq <= max_seq, got {min_seq}, {max_seq}")
    if not 1 <= min_batch <= max_batch:
        raise ValueError(f"need 1 <= min_batch <= max_batch, got {min_batch}, {max_batch}")
    rng = random.Random(seed)
    lo, hi = -(-min_seq // 8), max_seq // 8
    return [(rng.randint(min_batch, max_batch), 8 * rng.randint(lo, hi)) for _ in range(steps)]


def capture(scale: str = "small", seed: int = 0, **kw: Any) -> Trace:
    """Trace ``steps`` AdamW training steps of the GPT model at ``scale`` (settings in kw override)."""
    import torch
    import torch.nn.functional as F

    cfg = _common.pick(SCALES, scale, kw)
    shapes = draw_shapes(seed, cfg["steps"], cfg["min_seq"], cfg["max_seq"], cfg["min_batch"], cfg["max_batch"])
    if cfg["optimizer"] not in ("adamw", "sgd"):
        raise ValueError(f"unknown optimizer {cfg['optimizer']!r} (adamw or sgd)")

    def build(device: str) -> Tuple[Any, Any]:
        model = build_model(cfg["layers"], cfg["d_model"], cfg["heads"], cfg["vocab"], cfg["max_seq"], device)
        decay = cfg["weight_decay"] if cfg["optimizer"] == "adamw" else 0.0
        return model, _common.make_optimizer(cfg["optimizer"], model.parameters(), cfg["lr"], decay)

    def loss_of(model: Any, shape: Tuple[int, int]) -> Any:
        batch, seq = shape
        idx = torch.randint(0, cfg["vocab"], (batch, seq + 1), device=cfg["device"])
        logits = model(idx[:, :-1])
        return F.cross_entropy(logits.view(-1, cfg["vocab"]), idx[:, 1:].reshape(-1))

    return _common.capture_training("gpt", scale, seed, cfg, build, shapes, loss_of, shapes=shapes)


if __name__ == "__main__":
    sys.exit(_common.main("gpt", capture, SCALES, __doc__))

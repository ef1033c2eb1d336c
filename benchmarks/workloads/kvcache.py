"""Autoregressive inference with a growing key/value cache, over requests of varying shape.

The GPT model of :mod:`gpt` (weights allocated first, inside the tracer) serves a sequence of
requests, each with its own batch size, prompt length and number of generated tokens, drawn
from a generator seeded with ``seed``. A request runs the prompt through the model once
(prefill, filling the cache), then generates one token per step (decode) with greedy
sampling; logits are computed for the last position only. The cache of a request is dropped
when the request ends, so every request allocates and frees its own.

Cache policies (``cache``):

- ``cat`` (default): every decode step concatenates the new keys and values to the cache
  (``torch.cat``), allocating a cache one token longer and freeing the old one, per layer;
- ``chunked``: the cache is preallocated for ``chunk`` tokens and, when full, grows by
  ``chunk`` tokens into a new buffer (the old one is copied and freed); new keys and values
  are written in place.

    python benchmarks/workloads/kvcache.py --out build/traces/kvcache-small.cptrace
    python benchmarks/workloads/kvcache.py --cache chunked --chunk 128 --requests 20

Scales: ``small`` (4 layers, d_model 256, 5 requests, prompts 16..256, 8..48 new tokens;
seconds to capture), ``medium`` (12 layers, d_model 768, 16 requests), ``large``
(24 layers, d_model 1024, 32 requests, prompts up to 1536).
"""

from __future__ import annotations

import random
import sys
from typing import Any, List, Tuple

try:
    from . import _common, gpt
except ImportError:  # run as a script
    import _common
    import gpt

from cudapool.lab.trace import Trace

# fmt: off
SCALES = {
    "small": dict(layers=4, d_model=256, heads=4, vocab=8192, requests=5, min_prompt=16, max_prompt=256,
                  min_new=8, max_new=48, min_batch=1, max_batch=8, cache="cat", chunk=64, device="cuda"),
    "medium": dict(layers=12, d_model=768, heads=12, vocab=50304, requests=16, min_prompt=32, max_prompt=768,
                   min_new=32, max_new=256, min_batch=1, max_batch=16, cache="cat", chunk=128, device="cuda"),
    "large": dict(layers=24, d_model=1024, heads=16, vocab=50304, requests=32, min_prompt=64, max_prompt=1536,
                  min_new=64, max_new=512, min_batch=1, max_batch=32, cache="cat", chunk=256, device="cuda"),
}
# fmt: on


class CatCache:
    """One layer's cache, grown by torch.cat at every step."""

    def __init__(self) -> None:
        self.k = self.v = None
        self.length = 0

    def update(self, k: Any, v: Any) -> Tuple[Any, Any]:
        import torch

        if self.k is None:
            self.k, self.v = k.contiguous(), v.contiguous()
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        self.length = self.k.size(2)
        return self.k, self.v


class ChunkedCache:
    """One layer's cache, preallocated ``chunk`` tokens at a time; grows by copying into a larger buffer."""

    def __init__(self, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, not {chunk}")
        self.chunk = chunk
        self.k = self.v = None
        self.length = 0

    def _grow(self, like: Any, need: int) -> None:
        capacity = -(-need // self.chunk) * self.chunk
        B, H, _, D = like.shape
        k = like.new_empty((B, H, capacity, D))
        v = like.new_empty((B, H, capacity, D))
        if self.k is not None:
            k[:, :, : self.length].copy_(self.k[:, :, : self.length])
            v[:, :, : self.length].copy_(self.v[:, :, : self.length])
        self.k, self.v = k, v

    def update(self, k: Any, v: Any) -> Tuple[Any, Any]:
        n = k.size(2)
        end = self.length + n
        if self.k is None or end > self.k.size(2):
            self._grow(k, end)
        self.k[:, :, self.length : end].copy_(k)
        self.v[:, :, self.length : end].copy_(v)
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


def draw_requests(seed: int, cfg: dict) -> List[Tuple[int, int, int]]:
    """(batch, prompt_len, new_tokens) of every request."""
    rng = random.Random(seed)
    for lo, hi in (("min_prompt", "max_prompt"), ("min_new", "max_new"), ("min_batch", "max_batch")):
        if not 1 <= cfg[lo] <= cfg[hi]:
            raise ValueError(f"need 1 <= {lo} <= {hi}, got {cfg[lo]}, {cfg[hi]}")
    return [
        (
            rng.randint(cfg["min_batch"], cfg["max_batch"]),
            rng.randint(cfg["min_prompt"], cfg["max_prompt"]),
            rng.randint(cfg["min_new"], cfg["max_new"]),
        )
        for _ in range(cfg["requests"])
    ]


def capture(scale: str = "small", seed: int = 0, **kw: Any) -> Trace:
    """Trace inference over ``requests`` requests with the model at ``scale`` (kw overrides settings)."""
    import torch
    from cudapool.fakegpu.tracer import Tracer

    cfg = _common.pick(SCALES, scale, kw)
    if cfg["cache"] not in ("cat", "chunked"):
        raise ValueError(f"unknown cache policy {cfg['cache']!r} (cat or chunked)")
    device = cfg["device"]
    requests = draw_requests(seed, cfg)
    max_seq = max(p + n for _, p, n in requests)
    torch.manual_seed(seed)
    with Tracer(device=device, **_common.tracer_kw(device)) as tr, torch.no_grad():
        model = gpt.build_model(cfg["layers"], cfg["d_model"], cfg["heads"], cfg["vocab"], max_seq, device)
        model.eval()
        for batch, prompt_len, new_tokens in requests:
            if cfg["cache"] == "cat":
                caches = [CatCache() for _ in range(cfg["layers"])]
            else:
                caches = [ChunkedCache(cfg["chunk"]) for _ in range(cfg["layers"])]
            prompt = torch.randint(0, cfg["vocab"], (batch, prompt_len), device=device)
            logits = model(prompt, caches, last_only=True)
            del prompt
            out = []
            for _ in range(new_tokens):
                token = logits.argmax(dim=-1)  # [batch, 1]
                out.append(token)
                logits = model(token, caches, last_only=True)
            generated = torch.cat(out, dim=1)
            del out, logits, caches, token, generated
        del model
    meta = {"workload": "kvcache", "scale": scale, "seed": seed, "config": cfg, "requests": requests}
    return tr.trace(meta=meta)


if __name__ == "__main__":
    sys.exit(_common.main("kvcache", capture, SCALES, __doc__))

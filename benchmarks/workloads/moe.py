"""Mixture-of-experts transformer (top-k routing) trained with Adafactor on language modelling.

The model: token and position embeddings, N pre-RMSNorm blocks of causal self-attention
(``scaled_dot_product_attention``) and a mixture-of-experts feed-forward layer, a final
RMSNorm and an untied LM head. The MoE layer routes each token to its ``top_k`` best experts
(a linear router, softmax, top-k, gates renormalised), sorts the (token, expert) pairs by
expert, gathers the tokens (``index_select``), runs each expert (a SwiGLU MLP) on its own
slice, weights the results by their gates and scatters them back (``index_add_``); no token is
dropped. A load-balancing loss (Switch Transformer's) is added to the cross-entropy.

Each expert's batch is the number of tokens routed to it, which changes from step to step
and from layer to layer: the shape pattern of MoE training. A traced tensor (fake CUDA or meta)
has no values, so the routing counts come from a generator seeded with ``seed``: every (step,
layer) draws expert popularities from a Dirichlet(``router_alpha``) distribution (smaller is
more skewed) and splits the ``tokens x top_k`` assignments accordingly, at most one per token
and expert. The sort, gather, split and scatter then run with those sizes.

The optimizer (``adafactor``, the default) is Adafactor with factored second moments (a row
and a column vector per matrix), relative step sizes and update clipping, written without
host synchronisation (scalars stay on the device); ``sgd`` is SGD with momentum.

    python benchmarks/workloads/moe.py --out build/traces/moe-small.cptrace
    python benchmarks/workloads/moe.py --experts 16 --top-k 1 --router-alpha 0.3

Scales: ``small`` (4 layers, d_model 256, 8 experts, top-2, batch 8 x 256 tokens, 6 steps;
seconds to capture), ``medium`` (12 layers, d_model 768, 8 experts, batch 8 x 1024,
20 steps), ``large`` (24 layers, d_model 1024, 16 experts, batch 16 x 2048, 40 steps).
"""

from __future__ import annotations

import math
import random
import sys
from typing import Any, List, Tuple

try:
    from . import _common
except ImportError:  # run as a script
    import _common

from cudapool.lab.trace import Trace

_TRAINING = dict(router_alpha=1.0, aux_weight=0.01, lr=1e-2, weight_decay=0.0, optimizer="adafactor", device="cuda")
# fmt: off
SCALES = {
    "small": dict(layers=4, d_model=256, heads=4, experts=8, top_k=2, hidden=512, vocab=8192, batch=8, seq=256,
                  steps=6, **_TRAINING),
    "medium": dict(layers=12, d_model=768, heads=12, experts=8, top_k=2, hidden=2048, vocab=32000, batch=8,
                   seq=1024, steps=20, **_TRAINING),
    "large": dict(layers=24, d_model=1024, heads=16, experts=16, top_k=2, hidden=2816, vocab=32000, batch=16,
                  seq=2048, steps=40, **_TRAINING),
}
# fmt: on


def build_model(cfg: dict, device: str) -> Any:
    """The MoE transformer on ``device``. Set ``layer.counts`` (tokens per expert) on every
    ``model.moe`` layer before a forward pass; ``model(idx)`` -> (logits, load-balancing loss)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    d, heads, E, k, hidden = cfg["d_model"], cfg["heads"], cfg["experts"], cfg["top_k"], cfg["hidden"]
    if d % heads:
        raise ValueError(f"d_model {d} is not a multiple of heads {heads}")

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(d, hidden, bias=False, device=device)
            self.up = nn.Linear(d, hidden, bias=False, device=device)
            self.down = nn.Linear(hidden, d, bias=False, device=device)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(d, E, bias=False, device=device)
            self.experts = nn.ModuleList(Expert() for _ in range(E))
            self.counts: List[int] = []

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, d)  # [T, d]
            probs = F.softmax(self.router(x), dim=-1)  # [T, E]
            gates, chosen = probs.topk(k, dim=-1)  # [T, k]
            gates = gates / gates.sum(dim=-1, keepdim=True)
            flat = chosen.reshape(-1)
            order = flat.argsort(stable=True)  # the (token, expert) pairs, by expert
            tokens = order // k
            slices = x.index_select(0, tokens).split(self.counts)
            out = torch.cat([self.experts[e](s) for e, s in enumerate(slices) if s.size(0)])
            out = out * gates.reshape(-1)[order].unsqueeze(1)
            y = torch.zeros_like(x).index_add_(0, tokens, out)
            share = torch.zeros(E, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=x.dtype))
            aux = E * (share / flat.numel() * probs.mean(dim=0)).sum()
            return y.view(shape), aux

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.RMSNorm(d, device=device)
            self.qkv = nn.Linear(d, 3 * d, bias=False, device=device)
            self.proj = nn.Linear(d, d, bias=False, device=device)
            self.norm2 = nn.RMSNorm(d, device=device)
            self.moe = MoE()

        def forward(self, x):
            B, T, _ = x.shape
            q, k_, v = self.qkv(self.norm1(x)).view(B, T, 3, heads, d // heads).permute(2, 0, 3, 1, 4).unbind(0)
            y = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
            m, aux = self.moe(self.norm2(x))
            return x + m, aux

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(cfg["vocab"], d, device=device)
            self.pos = nn.Embedding(cfg["seq"], d, device=device)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.moe = [b.moe for b in self.blocks]
            self.norm = nn.RMSNorm(d, device=device)
            self.head = nn.Linear(d, cfg["vocab"], bias=False, device=device)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
            aux = []
            for block in self.blocks:
                x, a = block(x)
                aux.append(a)
            return self.head(self.norm(x)), torch.stack(aux).sum()

    return Model()


def make_adafactor(params: Any, lr: float, weight_decay: float) -> Any:
    """Adafactor (Shazeer and Stern, 2018): factored second moments for matrices, relative step
    size min(lr, 1/sqrt(t)) scaled by the parameter's RMS, beta2 = 1 - t^-0.8, updates clipped to
    RMS 1. Unlike torch.optim.Adafactor it reads no scalar back to the host."""
    import torch

    class Adafactor(torch.optim.Optimizer):
        def __init__(self) -> None:
            super().__init__(params, dict(lr=lr, weight_decay=weight_decay, eps1=1e-30, eps2=1e-3))

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, p.grad, group)

        def _update(self, p: Any, g: Any, group: dict) -> None:
            state = self.state[p]
            factored = p.dim() >= 2
            if not state:
                state["step"] = 0
                if factored:
                    state["row"] = g.new_zeros(g.shape[:-1])
                    state["col"] = g.new_zeros(g.shape[:-2] + g.shape[-1:])
                else:
                    state["sq"] = torch.zeros_like(g)
            state["step"] += 1
            t = state["step"]
            weight = t**-0.8  # 1 - beta2
            sq = g * g + group["eps1"]
            if factored:
                state["row"].lerp_(sq.mean(dim=-1), weight)
                state["col"].lerp_(sq.mean(dim=-2), weight)
                row = state["row"] / state["row"].mean(dim=-1, keepdim=True)
                update = g * (row.unsqueeze(-1) * state["col"].unsqueeze(-2)).rsqrt()
            else:
                state["sq"].lerp_(sq, weight)
                update = g * state["sq"].rsqrt()
            del sq
            rms = math.sqrt(p.numel())
            update.div_(torch.clamp(update.norm() / rms, min=1.0))
            scale = torch.clamp(p.norm() / rms, min=group["eps2"]) * min(group["lr"], 1.0 / math.sqrt(t))
            if group["weight_decay"]:
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
            p.sub_(update.mul_(scale))

    return Adafactor()


def draw_routing(seed: int, cfg: dict) -> List[List[List[int]]]:
    """Tokens per expert, for every step and layer: [step][layer][expert], each summing to tokens x top_k."""
    E, k = cfg["experts"], cfg["top_k"]
    tokens = cfg["batch"] * cfg["seq"]
    if not 1 <= k <= E:
        raise ValueError(f"need 1 <= top_k <= experts, got {k}, {E}")
    if cfg["router_alpha"] <= 0:
        raise ValueError(f"router_alpha must be positive, not {cfg['router_alpha']}")
    rng = random.Random(seed)

    def one() -> List[int]:
        w = [rng.gammavariate(cfg["router_alpha"], 1.0) for _ in range(E)]
        total = sum(w) or 1.0
        counts = [min(tokens, int(tokens * k * x / total)) for x in w]
        left = tokens * k - sum(counts)
        for e in sorted(range(E), key=lambda e: -w[e]) * k:  # the remainder to the most popular with room
            if left == 0:
                break
            room = min(left, tokens - counts[e])
            counts[e] += room
            left -= room
        return counts

    return [[one() for _ in range(cfg["layers"])] for _ in range(cfg["steps"])]


def capture(scale: str = "small", seed: int = 0, **kw: Any) -> Trace:
    """Trace ``steps`` training steps of the MoE transformer at ``scale`` (kw overrides settings)."""
    import torch
    import torch.nn.functional as F

    cfg = _common.pick(SCALES, scale, kw)
    routing = draw_routing(seed, cfg)

    def build(device: str) -> Tuple[Any, Any]:
        model = build_model(cfg, device)
        if cfg["optimizer"] == "adafactor":
            return model, make_adafactor(model.parameters(), cfg["lr"], cfg["weight_decay"])
        return model, _common.make_optimizer(cfg["optimizer"], model.parameters(), cfg["lr"], cfg["weight_decay"])

    def loss_of(model: Any, counts: List[List[int]]) -> Any:
        for layer, c in zip(model.moe, counts):
            layer.counts = c
        idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), device=cfg["device"])
        logits, aux = model(idx[:, :-1])
        return F.cross_entropy(logits.view(-1, cfg["vocab"]), idx[:, 1:].reshape(-1)) + cfg["aux_weight"] * aux

    return _common.capture_training("moe", scale, seed, cfg, build, routing, loss_of, routing=routing)


if __name__ == "__main__":
    sys.exit(_common.main("moe", capture, SCALES, __doc__))

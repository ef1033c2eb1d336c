"""Sequence-to-sequence LSTM with attention, trained with Adagrad on batches of varying length.

The model (Luong-style translation): source and target embeddings; an encoder of ``layers``
stacked LSTM layers; a decoder of as many, started from the encoder's final states and fed
the target shifted right (teacher forcing); global dot-product attention of every decoder
output over the encoder outputs (padding masked); ``tanh(W [output; context])`` and a linear
projection to the vocabulary; cross-entropy that ignores padding. Gradients are clipped to
norm ``clip`` (``clip_grad_norm_``), then Adagrad (``foreach=True``; ``rmsprop`` also works)
takes its step.

The LSTM layers are written out (one input projection over the whole sequence, then a loop
over time steps of a hidden projection and the gate arithmetic) rather than calling
``nn.LSTM``, whose CPU, meta and cuDNN implementations all allocate differently; so the
trace is what this program does on any device. Sequences of a batch have their own lengths:
past its end a sequence keeps its state (``torch.where`` on the padding mask), as
``pack_padded_sequence`` would. That makes thousands of small, short-lived allocations per
step, and a graph of activations saved for backward that grows with the padded length.

Every step draws a bucket length for the source and one for the target
(``min_len..max_len``), then each sequence's length in the top quarter of its bucket (length
bucketing, as translation batches are made), from a generator seeded with ``seed``.

    python benchmarks/workloads/lstm.py --out build/traces/lstm-small.cptrace
    python benchmarks/workloads/lstm.py --scale medium --optimizer rmsprop --lr 1e-3

Scales: ``small`` (2 layers, hidden 256, batch 32, lengths 8..32, 4 steps; seconds to capture on
fake CUDA), ``medium`` (4 layers, hidden 1024, batch 64, lengths 16..80, 6 steps), ``large``
(4 layers, hidden 2048, batch 128, lengths 16..128, 10 steps).
"""

from __future__ import annotations

import random
import sys
from typing import Any, List, Tuple

try:
    from . import _common
except ImportError:  # run as a script
    import _common

from cudapool.lab.trace import Trace

_TRAINING = dict(lr=0.05, weight_decay=0.0, clip=5.0, optimizer="adagrad", device="cuda")
# fmt: off
SCALES = {
    "small": dict(layers=2, embed=128, hidden=256, vocab=8000, batch=32, min_len=8, max_len=32, steps=4,
                  **_TRAINING),
    "medium": dict(layers=4, embed=512, hidden=1024, vocab=32000, batch=64, min_len=16, max_len=80, steps=6,
                   **_TRAINING),
    "large": dict(layers=4, embed=1024, hidden=2048, vocab=32000, batch=128, min_len=16, max_len=128, steps=10,
                  **_TRAINING),
}
# fmt: on

PAD = 0

Batch = Tuple[List[int], List[int]]  # source lengths, target lengths


def build_model(layers: int, embed: int, hidden: int, vocab: int, device: str) -> Any:
    """The seq2seq model on ``device``: ``model(src, src_mask, tgt_in, tgt_mask)`` -> logits ``[B, T, vocab]``."""
    import torch
    import torch.nn as nn

    class LSTMLayer(nn.Module):
        def __init__(self, cin: int) -> None:
            super().__init__()
            self.ih = nn.Linear(cin, 4 * hidden, device=device)
            self.hh = nn.Linear(hidden, 4 * hidden, bias=False, device=device)

        def forward(self, x, mask, state):
            xs = self.ih(x)  # [B, T, 4H]: the input projection of every time step at once
            h, c = state
            outs = []
            for t in range(x.size(1)):
                i, f, g, o = (xs[:, t] + self.hh(h)).chunk(4, dim=1)
                c_new = f.sigmoid() * c + i.sigmoid() * g.tanh()
                h_new = o.sigmoid() * c_new.tanh()
                m = mask[:, t, None]
                c = torch.where(m, c_new, c)  # a sequence past its end keeps its state
                h = torch.where(m, h_new, h)
                outs.append(h)
            return torch.stack(outs, dim=1), (h, c)

    class Seq2Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.src_embed = nn.Embedding(vocab, embed, padding_idx=PAD, device=device)
            self.tgt_embed = nn.Embedding(vocab, embed, padding_idx=PAD, device=device)
            self.encoder = nn.ModuleList(LSTMLayer(embed if i == 0 else hidden) for i in range(layers))
            self.decoder = nn.ModuleList(LSTMLayer(embed if i == 0 else hidden) for i in range(layers))
            self.combine = nn.Linear(2 * hidden, hidden, device=device)
            self.out = nn.Linear(hidden, vocab, device=device)

        def forward(self, src, src_mask, tgt_in, tgt_mask):
            x = self.src_embed(src)
            zero = x.new_zeros(x.size(0), hidden)
            finals = []
            for layer in self.encoder:
                x, state = layer(x, src_mask, (zero, zero))
                finals.append(state)
            enc = x  # [B, S, H]
            y = self.tgt_embed(tgt_in)
            for layer, state in zip(self.decoder, finals):
                y, _ = layer(y, tgt_mask, state)
            scores = torch.bmm(y, enc.transpose(1, 2))  # [B, T, S]
            scores = scores.masked_fill(~src_mask[:, None, :], float("-inf"))
            context = torch.bmm(scores.softmax(dim=-1), enc)
            return self.out(torch.tanh(self.combine(torch.cat([y, context], dim=-1))))

    return Seq2Seq()


def draw_batches(seed: int, cfg: dict) -> List[Batch]:
    """(source lengths, target lengths) of every step: a bucket length each, sequences in its top quarter."""
    _common.check_range(cfg, "min_len", "max_len", least=2)
    if cfg["batch"] < 1:
        raise ValueError(f"batch must be >= 1, not {cfg['batch']}")
    rng = random.Random(seed)

    def lengths() -> List[int]:
        top = rng.randint(cfg["min_len"], cfg["max_len"])
        lo = max(cfg["min_len"], top - top // 4)
        return [top] + [rng.randint(lo, top) for _ in range(cfg["batch"] - 1)]

    return [(lengths(), lengths()) for _ in range(cfg["steps"])]


def capture(scale: str = "small", seed: int = 0, **kw: Any) -> Trace:
    """Trace ``steps`` training steps of the seq2seq LSTM at ``scale`` (kw overrides settings)."""
    import torch
    import torch.nn.functional as F

    cfg = _common.pick(SCALES, scale, kw)
    batches = draw_batches(seed, cfg)
    device, vocab = cfg["device"], cfg["vocab"]

    def build(device: str) -> Tuple[Any, Any]:
        model = build_model(cfg["layers"], cfg["embed"], cfg["hidden"], vocab, device)
        return model, _common.make_optimizer(cfg["optimizer"], model.parameters(), cfg["lr"], cfg["weight_decay"])

    def padded(lengths: List[int], extra: int) -> Tuple[Any, Any]:
        """Random tokens [B, max + extra], padding past each length + extra; the mask of the first max."""
        n = torch.tensor(lengths).to(device)  # made on the host, copied over
        mask = torch.arange(max(lengths) + extra, device=device)[None, :] < (n[:, None] + extra)
        tokens = torch.randint(1, vocab, mask.shape, device=device).masked_fill(~mask, PAD)
        return tokens, mask[:, : max(lengths)]

    def loss_of(model: Any, batch: Batch) -> Any:
        src, src_mask = padded(batch[0], 0)
        tgt, tgt_mask = padded(batch[1], 1)  # <bos> target tokens: the decoder's input and its labels
        logits = model(src, src_mask, tgt[:, :-1], tgt_mask)
        return F.cross_entropy(logits.reshape(-1, vocab), tgt[:, 1:].reshape(-1), ignore_index=PAD)

    return _common.capture_training(
        "lstm", scale, seed, cfg, build, batches, loss_of, clip=cfg["clip"], lengths=batches
    )


if __name__ == "__main__":
    sys.exit(_common.main("lstm", capture, SCALES, __doc__))

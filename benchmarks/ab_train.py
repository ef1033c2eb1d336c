#!/usr/bin/env python3
"""A plain PyTorch training script for ``python -m cudapool ab`` (benchmarks/ab_suite.py): it
knows nothing of allocators; it only marks its steps with ``cudapool.ab.step()`` (a no-op
outside ``ab``).

    python benchmarks/ab_train.py --model gpt --batch-size 16 --steps 30
    python -m cudapool ab --step-marker -- benchmarks/ab_train.py --model cnn --batch-size 64

Models: ``gpt`` (a GPT-style decoder, 8 layers, d_model 512, vocab 32768; each step draws its
sequence length from 64..1024 in multiples of 64 with a seeded generator: varying shapes) and
``cnn`` (a ResNet-style CNN on 3x128x128 images; each step draws its resolution from
96..160). ``--memory-fraction F`` caps the process at F of the GPU
(``torch.cuda.set_per_process_memory_fraction``) so a max-batch search ends sooner.
"""

import argparse
import random
import sys
from pathlib import Path

try:
    import cudapool.ab as ab
except ImportError:  # a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import cudapool.ab as ab

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, device=x.device, dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 32768, d: int = 512, layers: int = 8, heads: int = 8, max_seq: int = 1024):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.tok.weight.t()


def cnn() -> nn.Module:
    def stage(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=2, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
        )

    return nn.Sequential(
        stage(3, 64),
        stage(64, 128),
        stage(128, 256),
        stage(256, 512),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(512, 1000),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["gpt", "cnn"], default="gpt")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-fraction", type=float)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("ab_train: no CUDA GPU", file=sys.stderr)
        return 1
    if a.memory_fraction:
        torch.cuda.set_per_process_memory_fraction(a.memory_fraction)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    dev = torch.device("cuda")
    model = (GPT() if a.model == "gpt" else cnn()).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(a.steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if a.model == "gpt":
                n = 64 * rng.randint(1, 16)
                tokens = torch.randint(0, 32768, (a.batch_size, n + 1), device=dev)
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, 32768), tokens[:, 1:].reshape(-1))
            else:
                r = 32 * rng.randint(3, 5)
                images = torch.randn(a.batch_size, 3, r, r, device=dev)
                labels = torch.randint(0, 1000, (a.batch_size,), device=dev)
                loss = F.cross_entropy(model(images).float(), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the host waits for the GPU: the step marks fall at the GPU's pace
        ab.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())

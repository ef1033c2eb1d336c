"""Two convolutions, trained a step, with cudnn.benchmark as --benchmark says (and bfloat16
autocast with --bf16)."""

import argparse

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--benchmark", type=int, default=0)
p.add_argument("--bf16", action="store_true")
args = p.parse_args()
torch.backends.cudnn.benchmark = bool(args.benchmark)
model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 8, 1)).cuda()
x = torch.randn(4, 16, 64, 64, device="cuda")
for _ in range(2):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
        loss = model(x).float().sum()
    loss.backward()

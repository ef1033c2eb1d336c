"""A loop that prints loss.item() every step and stops early on a small loss."""

import sys

import torch
import torch.nn as nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1)).cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(steps):
    x = torch.randn(32, 256, device="cuda")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step}: loss {loss.item():.4f}")
    if loss.item() < -1:  # never true on a GPU either (a mean of squares)
        break
print("done")

"""Memory affine in --batch-size: 64 MiB of weights and 4 MiB a sample, for two steps."""

import argparse

import torch

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=4)
args = p.parse_args()
weights = torch.empty(16 << 20, device="cuda")  # 64 MiB
for _ in range(2):
    batch = torch.empty(args.batch_size, 1 << 20, device="cuda")  # 4 MiB a sample
    del batch

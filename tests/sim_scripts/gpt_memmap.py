"""A GPT trainer of the common shape: tokens in a memory-mapped file, batches drawn at random
offsets on the host, causal attention through scaled_dot_product_attention, bf16 autocast, a
GradScaler, AdamW, an evaluation pass, a loss printed with a format and a checkpoint saved."""

import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--data", default="tokens.bin")
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--block-size", type=int, default=256)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--heads", type=int, default=8)
p.add_argument("--d-model", type=int, default=512)
p.add_argument("--vocab", type=int, default=8192)
p.add_argument("--iters", type=int, default=4)
p.add_argument("--eval-iters", type=int, default=2)
p.add_argument("--out", default="ckpt.pt")
args = p.parse_args()

if not os.path.exists(args.data):
    rng = np.random.default_rng(0)
    rng.integers(0, args.vocab, size=200_000, dtype=np.uint16).tofile(args.data)
data = np.memmap(args.data, dtype=np.uint16, mode="r")
device = "cuda"
torch.manual_seed(1337)
torch.cuda.manual_seed(1337)
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
ctx = torch.autocast(device_type="cuda", dtype=getattr(torch, dtype))


def get_batch():
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + args.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + args.block_size].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(args.vocab, args.d_model)
        self.wpe = nn.Embedding(args.block_size, args.d_model)
        self.blocks = nn.ModuleList(Block(args.d_model, args.heads) for _ in range(args.layers))
        self.ln = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.vocab, bias=False)
        self.wte.weight = self.head.weight
        for name, prm in self.named_parameters():
            if name.endswith("out.weight"):
                torch.nn.init.normal_(prm, mean=0.0, std=0.02 / math.sqrt(2 * args.layers))

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


model = GPT().to(device)
scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=True)
print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = torch.zeros(args.eval_iters)
    for k in range(args.eval_iters):
        X, Y = get_batch()
        with ctx:
            _, loss = model(X, Y)
        losses[k] = loss.item()
    model.train()
    return losses.mean()


X, Y = get_batch()
for it in range(args.iters):
    with ctx:
        _, loss = model(X, Y)
    X, Y = get_batch()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    print(f"iter {it}: loss {loss.item():.4f}")
print(f"val loss {estimate_loss():.4f}")
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter": args.iters}, args.out)
print("saved", args.out)

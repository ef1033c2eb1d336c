"""A character-level GPT trainer: the text encoded on the host, batches drawn at random, a
generation callback sampling tokens one at a time, the loss printed as a tensor with a format,
and the weights saved and loaded back."""

import argparse

import torch
import torch.nn as nn
from torch.nn import functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--block-size", type=int, default=128)
p.add_argument("--d-model", type=int, default=256)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--generate", type=int, default=50)
p.add_argument("--out", default="char_gpt.pt")
args = p.parse_args()

text = "".join(chr(32 + (i * 7919) % 90) for i in range(50_000))
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
itos = {i: c for c, i in stoi.items()}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(1337)


def get_batch(split):
    d = train_data if split == "train" else val_data
    ix = torch.randint(len(d) - args.block_size, (args.batch_size,))
    x = torch.stack([d[i : i + args.block_size] for i in ix])
    y = torch.stack([d[i + 1 : i + args.block_size + 1] for i in ix])
    return x.to(device), y.to(device)


class Head(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.key = nn.Linear(args.d_model, size, bias=False)
        self.query = nn.Linear(args.d_model, size, bias=False)
        self.value = nn.Linear(args.d_model, size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(args.block_size, args.block_size)))

    def forward(self, x):
        B, T, C = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        return F.softmax(wei, dim=-1) @ self.value(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        size = args.d_model // args.heads
        self.heads = nn.ModuleList([Head(size) for _ in range(args.heads)])
        self.proj = nn.Linear(args.d_model, args.d_model)
        self.ffwd = nn.Sequential(
            nn.Linear(args.d_model, 4 * args.d_model), nn.ReLU(), nn.Linear(4 * args.d_model, args.d_model)
        )
        self.ln1, self.ln2 = nn.LayerNorm(args.d_model), nn.LayerNorm(args.d_model)

    def forward(self, x):
        x = x + self.proj(torch.cat([h(self.ln1(x)) for h in self.heads], dim=-1))
        return x + self.ffwd(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.tok = nn.Embedding(vocab, args.d_model)
        self.pos = nn.Embedding(args.block_size, args.d_model)
        self.blocks = nn.Sequential(*[Block() for _ in range(args.layers)])
        self.ln = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, vocab)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T, device=device))
        logits = self.head(self.ln(self.blocks(x)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -args.block_size :])
            probs = F.softmax(logits[:, -1, :], dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


model = CharGPT(len(chars)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(args.steps):
    xb, yb = get_batch("train")
    _, loss = model(xb, yb)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    print(f"step {step}: train loss {loss:.4f}")
context = torch.zeros((1, 1), dtype=torch.long, device=device)
sample = model.generate(context, max_new_tokens=args.generate)[0].tolist()
print("sample:", "".join(itos[i] for i in sample)[:40])
torch.save(model.state_dict(), args.out)
model.load_state_dict(torch.load(args.out, map_location=device))
print("saved and loaded", args.out)

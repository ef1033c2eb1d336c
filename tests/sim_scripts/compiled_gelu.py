"""A tanh-GELU after a matrix multiply, compiled or not (--eager): eagerly every intermediate of
the GELU is a tensor of the output's size; compiled, Inductor fuses them into one kernel."""

import argparse

import torch

p = argparse.ArgumentParser()
p.add_argument("--eager", action="store_true")
p.add_argument("--mode", default=None)
args = p.parse_args()


def gelu_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w
    return 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * h**3)))


fn = gelu_mm if args.eager else torch.compile(gelu_mm, mode=args.mode)
x = torch.randn(1024, 512, device="cuda")
w = torch.randn(512, 2048, device="cuda")
with torch.no_grad():
    for _ in range(3):
        y = fn(x, w)
        del y
print("peak", torch.cuda.max_memory_allocated())

"""How fast ``ab --simulate`` traces: events per second for a transformer's forward and backward
on the fake GPU (cudapool.lab.fakegpu), the model built first and one step left out as warm-up.

    python benchmarks/trace_speed.py [--gpu H100] [--steps 5] [--layers 4] [--d-model 256]
                                     [--batch 8] [--ctx 128]

Prints the events traced (allocations and frees), the seconds the steps took and their ratio,
and the attention kernels chosen. Host time of this machine: run it where the figure is wanted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="H100")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=128)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")

    import torch
    import torch.nn as nn
    from cudapool.lab.fakegpu import FakeGPU, gpu_model

    with FakeGPU(gpu_model(args.gpu)) as fg:
        layer = nn.TransformerEncoderLayer(args.d_model, 4, 4 * args.d_model, batch_first=True)
        model = nn.TransformerEncoder(layer, args.layers).cuda()
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(args.batch, args.ctx, args.d_model, device="cuda")
        start = events = 0.0
        for step in range(args.steps + 1):
            if step == 1:
                start, events = time.perf_counter(), len(fg.tracer.events)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        seconds = time.perf_counter() - start
        n = len(fg.tracer.events) - events
    print(
        f"trace speed ({args.gpu}, {args.layers} layers, d_model {args.d_model}, batch {args.batch} x {args.ctx}, "
        f"bf16 autocast, AdamW): {n:,.0f} events in {seconds:.2f} s over {args.steps} steps: "
        f"{n / seconds:,.0f} events/s; attention kernels {fg.sdpa}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

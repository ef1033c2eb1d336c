"""How fast ``ab --simulate`` traces: events per second for a transformer's forward and backward
on the fake GPU (cudapool.fakegpu), the model built first and one step left out as warm-up.

    python benchmarks/trace_speed.py [--gpu H100] [--steps 20] [--layers 4] [--d-model 256]
                                     [--batch 8] [--ctx 128] [--engine both|native|python]

Prints, per engine of the fake GPU (``native``: cudapool._torch_fakecuda, below Python;
``python``: torch's fake tensors), the events traced (allocations and frees), the seconds the
steps took and their ratio, the peak, the attention kernels chosen, and how long making the
trace of all the events and saving it took (what ab --simulate does once the script ends); with
``--engine both`` (the default) each engine runs in a process of its own, one after the other,
and the ratio of their speeds is printed. Host time of this machine: run it where the figure is wanted.
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
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--engine", choices=("both", "native", "python"), default="both")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.engine == "both":
        import json
        import subprocess

        rates = {}
        for engine in ("native", "python"):
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--engine", engine]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            sys.stdout.write(done.stdout)
            sys.stderr.write(done.stderr)
            if done.returncode != 0:
                return done.returncode
            rates[engine] = json.loads(done.stdout.strip().splitlines()[-1])["events_per_s"]
        print(f"native / python: {rates['native'] / rates['python']:.1f} x the events per second")
        return 0

    import tempfile

    import torch
    import torch.nn as nn
    from cudapool.fakegpu import FakeGPU, gpu_model
    from cudapool.lab.trace import save

    with FakeGPU(gpu_model(args.gpu), engine=args.engine) as fg:
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
        made = time.perf_counter()
        seconds = made - start
        n = len(fg.tracer.events) - events  # the events handed to Python, counted in trace_s
        with tempfile.TemporaryDirectory() as tmp:
            trace = fg.tracer.trace()
            save(trace, os.path.join(tmp, "trace.cptrace"))
        trace_s = time.perf_counter() - made
    print(
        f"trace speed, {args.engine} engine ({args.gpu}, {args.layers} layers, d_model {args.d_model}, batch "
        f"{args.batch} x {args.ctx}, bf16 autocast, AdamW): {n:,.0f} events in {seconds:.2f} s over {args.steps} "
        f"steps: {n / seconds:,.0f} events/s; peak {fg.tracer.peak_bytes:,} B; attention kernels {fg.sdpa}; "
        f"the trace of its {len(trace):,} events made and saved in {trace_s * 1e3:.1f} ms"
    )
    import json

    print(
        json.dumps(
            {"engine": args.engine, "events": n, "seconds": seconds, "events_per_s": n / seconds, "trace_s": trace_s}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

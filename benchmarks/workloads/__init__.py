"""Allocation workloads: programs whose allocation traces we replay through the pool.

Each module has ``capture(scale="small", seed=0, **settings) -> cudapool.lab.trace.Trace`` and a
command line (``python benchmarks/workloads/<name>.py --out PATH``) that writes the trace
(.cptrace) and prints its event count and peak live bytes. The torch workloads run the real
PyTorch program under :class:`cudapool.fakegpu.tracer.Tracer`, on fake CUDA tensors by default (sizes
exact, no math, no memory, CUDA's kernel choices, no GPU used even where there is one;
``device="meta"`` traces meta tensors, ``device="cpu"`` does the math); ``rmm_random`` is generated
directly and needs no torch. Importing this package does not import torch.

| workload | what | small | medium | large |
|---|---|---|---|---|
| ``gpt`` | GPT decoder, AdamW, varying seq length and batch | 4 layers, d 256, 20 steps, seq 32..512 | 12 layers, d 768, 50 steps, seq ..1024 | 24 layers, d 1024, 100 steps, seq ..2048 |
| ``cnn`` | ResNet, SGD, random images | batch 16, 64 px, widths 32..128, 4 steps | ResNet-18, batch 64, 224 px, 10 steps | ResNet-34, batch 128, 224 px, 20 steps |
| ``kvcache`` | inference with a growing KV cache | 5 requests, 4 layers, d 256 | 16 requests, 12 layers, d 768 | 32 requests, 24 layers, d 1024 |
| ``rmm_random`` | random alloc (p=0.73) / free, 16 GiB cap | 1 000 allocations | 10 000 | 100 000 |
| ``vit`` | vision transformer, AdamW, image height and width vary | 4 blocks, dim 192, 32..96 px, 12 steps | ViT-B/16, batch 32, 128..384 px, 20 steps | ViT-L/16, 160..512 px, 40 steps |
| ``unet`` | diffusion UNet, Adam, noise prediction, resolution varies | 32 ch x (1,2,2), 32..64 px, 8 steps | 128 ch x (1,2,2,4), batch 16, 64..256 px, 12 steps | 128 ch x (1,2,3,4), 128..512 px, 20 steps |
| ``moe`` | mixture-of-experts transformer, top-2 routing, Adafactor | 4 layers, d 256, 8 experts, 6 steps | 12 layers, d 768, 8 experts, 8 x 1024 tokens, 20 steps | 24 layers, d 1024, 16 experts, 40 steps |
| ``lstm`` | seq2seq LSTM with attention, Adagrad, lengths vary | 2 layers, hidden 256, lengths 8..32, 4 steps | 4 layers, hidden 1024, batch 64, lengths 16..80, 6 steps | hidden 2048, batch 128, lengths ..128, 10 steps |

``small`` is the CI scale: each small capture takes seconds on two cores and its trace is
well under 2 MB compressed. Every setting of a scale can be overridden by keyword (or by the
matching command-line flag), e.g. ``WORKLOADS["gpt"](scale="small", steps=50, layers=8)``.
"""

from __future__ import annotations

from typing import Callable, Dict

try:
    from . import cnn, gpt, kvcache, lstm, moe, rmm_random, unet, vit
except ImportError:  # the directory itself is on sys.path
    import cnn  # type: ignore[no-redef]
    import gpt  # type: ignore[no-redef]
    import kvcache  # type: ignore[no-redef]
    import lstm  # type: ignore[no-redef]
    import moe  # type: ignore[no-redef]
    import rmm_random  # type: ignore[no-redef]
    import unet  # type: ignore[no-redef]
    import vit  # type: ignore[no-redef]

from cudapool.lab.trace import Trace

__all__ = ["WORKLOADS", "SCALES"]

#: name -> capture(scale="small", seed=0, **settings) -> Trace
WORKLOADS: Dict[str, Callable[..., Trace]] = {
    "gpt": gpt.capture,
    "cnn": cnn.capture,
    "kvcache": kvcache.capture,
    "rmm_random": rmm_random.capture,
    "vit": vit.capture,
    "unet": unet.capture,
    "moe": moe.capture,
    "lstm": lstm.capture,
}

#: name -> {scale: settings}
SCALES = {
    "gpt": gpt.SCALES,
    "cnn": cnn.SCALES,
    "kvcache": kvcache.SCALES,
    "rmm_random": rmm_random.SCALES,
    "vit": vit.SCALES,
    "unet": unet.SCALES,
    "moe": moe.SCALES,
    "lstm": lstm.SCALES,
}

"""Diffusion UNet trained with Adam to predict the noise, at a resolution that changes every step.

The model follows DDPM's UNet: a sinusoidal timestep embedding through a two-layer MLP; a 3x3
input convolution; down levels of residual blocks (GroupNorm, SiLU, 3x3 conv, the timestep
embedding added per channel, GroupNorm, SiLU, 3x3 conv, a 1x1 conv on the skip where the width
changes) with a strided 3x3 conv between levels; a middle of residual block, self-attention,
residual block; up levels that concatenate the saved activation of the matching down block
(the UNet's skip connections) before each residual block, with nearest-neighbour upsampling
and a 3x3 conv between levels; GroupNorm, SiLU and a 3x3 conv back to 3 channels.
Self-attention over the pixels (GroupNorm, 1x1 qkv conv, scaled_dot_product_attention, 1x1
projection, residual) runs at the lowest resolution only. Each level's width is ``channels``
times its entry in ``mults``.

A training step draws a batch of random "images" x0, timesteps t and Gaussian noise, makes
x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise from a linear beta schedule, and regresses the
model's output on the noise (MSE); Adam runs with ``foreach=True``. The square resolution of
every step (a multiple of 4 times the downsampling factor in ``min_image..max_image``) comes
from a generator seeded with ``seed``.

    python benchmarks/workloads/unet.py --out build/traces/unet-small.cptrace
    python benchmarks/workloads/unet.py --scale medium --mults 1,2,4 --max-image 128

Scales: ``small`` (32 channels x (1, 2, 2), 32..64 px, batch 8, 8 steps; seconds to capture on
fake CUDA), ``medium`` (128 channels x (1, 2, 2, 4), 64..256 px, batch 16, 12 steps), ``large``
(128 channels x (1, 2, 3, 4), two blocks a level, 128..512 px, batch 16, 20 steps).
"""

from __future__ import annotations

import math
import random
import sys
from typing import Any, List, Sequence, Tuple

try:
    from . import _common
except ImportError:  # run as a script
    import _common

from cudapool.lab.trace import Trace

_TRAINING = dict(timesteps=1000, lr=2e-4, weight_decay=0.0, optimizer="adam", device="cuda")
# fmt: off
SCALES = {
    "small": dict(channels=32, mults=(1, 2, 2), blocks=1, groups=8, heads=4, min_image=32, max_image=64,
                  batch=8, steps=8, **_TRAINING),
    "medium": dict(channels=128, mults=(1, 2, 2, 4), blocks=1, groups=32, heads=4, min_image=64, max_image=256,
                   batch=16, steps=12, **_TRAINING),
    "large": dict(channels=128, mults=(1, 2, 3, 4), blocks=2, groups=32, heads=8, min_image=128, max_image=512,
                  batch=16, steps=20, **_TRAINING),
}
# fmt: on


def build_model(channels: int, mults: Sequence[int], blocks: int, groups: int, heads: int, device: str) -> Any:
    """The UNet (an nn.Module) on ``device``: ``model(x [B, 3, H, W], t [B])`` -> ``[B, 3, H, W]``."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    tdim = 4 * channels

    def conv(cin: int, cout: int, k: int = 3, stride: int = 1) -> Any:
        return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, device=device)

    def norm(c: int) -> Any:
        return nn.GroupNorm(groups, c, device=device)

    class ResBlock(nn.Module):
        def __init__(self, cin: int, cout: int) -> None:
            super().__init__()
            self.norm1, self.conv1 = norm(cin), conv(cin, cout)
            self.temb = nn.Linear(tdim, cout, device=device)
            self.norm2, self.conv2 = norm(cout), conv(cout, cout)
            self.skip = conv(cin, cout, 1) if cin != cout else None

        def forward(self, x, temb):
            h = self.conv1(F.silu(self.norm1(x)))
            h = h + self.temb(temb)[:, :, None, None]
            h = self.conv2(F.silu(self.norm2(h)))
            return h + (x if self.skip is None else self.skip(x))

    class Attention(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            if c % heads:
                raise ValueError(f"width {c} is not a multiple of heads {heads}")
            self.norm, self.qkv, self.proj = norm(c), conv(c, 3 * c, 1), conv(c, c, 1)

        def forward(self, x, temb=None):
            B, C, H, W = x.shape
            q, k, v = self.qkv(self.norm(x)).reshape(B, 3, heads, C // heads, H * W).transpose(-2, -1).unbind(1)
            y = F.scaled_dot_product_attention(q, k, v)  # [B, heads, HW, C/heads]
            return x + self.proj(y.transpose(-2, -1).reshape(B, C, H, W))

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.temb = nn.Sequential(
                nn.Linear(channels, tdim, device=device), nn.SiLU(), nn.Linear(tdim, tdim, device=device)
            )
            self.conv_in = conv(3, channels)
            widths = [channels * m for m in mults]
            last = len(widths) - 1
            self.down = nn.ModuleList()
            skips, c = [channels], channels
            for level, w in enumerate(widths):
                for _ in range(blocks):
                    self.down.append(ResBlock(c, w))
                    c = w
                    if level == last:
                        self.down.append(Attention(c))
                    skips.append(c)
                if level != last:
                    self.down.append(conv(c, c, 3, stride=2))
                    skips.append(c)
            self.mid = nn.ModuleList([ResBlock(c, c), Attention(c), ResBlock(c, c)])
            self.up = nn.ModuleList()
            for level, w in reversed(list(enumerate(widths))):
                for _ in range(blocks + 1):
                    self.up.append(ResBlock(c + skips.pop(), w))
                    c = w
                    if level == last:
                        self.up.append(Attention(c))
                if level != 0:
                    self.up.append(nn.Sequential(nn.Upsample(scale_factor=2.0, mode="nearest"), conv(c, c)))
            self.out = nn.Sequential(norm(c), nn.SiLU(), conv(c, 3))

        def embed(self, t):
            half = channels // 2
            freqs = torch.exp(torch.arange(half, device=t.device) * (-math.log(10000.0) / half))
            args = t[:, None].float() * freqs[None]
            return self.temb(torch.cat([args.sin(), args.cos()], dim=1))

        def forward(self, x, t):
            temb = self.embed(t)
            x = self.conv_in(x)
            saved = [x]
            for m in self.down:
                x = m(x, temb) if isinstance(m, (ResBlock, Attention)) else m(x)
                if not isinstance(m, Attention):
                    saved.append(x)
            for m in self.mid:
                x = m(x, temb)
            for m in self.up:
                if isinstance(m, ResBlock):
                    x = m(torch.cat([x, saved.pop()], dim=1), temb)
                else:
                    x = m(x, temb) if isinstance(m, Attention) else m(x)
            return self.out(x)

    return UNet()


def draw_sizes(seed: int, cfg: dict) -> List[int]:
    """The square resolution of every step: a multiple of 4 x the downsampling factor."""
    multiple = 4 * 2 ** (len(cfg["mults"]) - 1)
    _common.check_range(cfg, "min_image", "max_image", least=1)
    rng = random.Random(seed)
    return [_common.draw_multiple(rng, cfg["min_image"], cfg["max_image"], multiple) for _ in range(cfg["steps"])]


def capture(scale: str = "small", seed: int = 0, **kw: Any) -> Trace:
    """Trace ``steps`` Adam noise-prediction steps of the UNet at ``scale`` (kw overrides settings)."""
    import torch
    import torch.nn.functional as F

    cfg = _common.pick(SCALES, scale, kw)
    cfg["mults"] = tuple(cfg["mults"])
    if not cfg["mults"] or min(cfg["mults"]) < 1 or cfg["blocks"] < 1:
        raise ValueError(f"mults and blocks must be positive, got {cfg['mults']}, {cfg['blocks']}")
    sizes = draw_sizes(seed, cfg)
    device = cfg["device"]

    def build(device: str) -> Tuple[Any, Any]:
        model = build_model(cfg["channels"], cfg["mults"], cfg["blocks"], cfg["groups"], cfg["heads"], device)
        betas = torch.linspace(1e-4, 0.02, cfg["timesteps"], device=device)
        model.register_buffer("abar", torch.cumprod(1.0 - betas, dim=0), persistent=False)
        return model, _common.make_optimizer(cfg["optimizer"], model.parameters(), cfg["lr"], cfg["weight_decay"])

    def loss_of(model: Any, size: int) -> Any:
        x0 = torch.randn(cfg["batch"], 3, size, size, device=device)
        t = torch.randint(0, cfg["timesteps"], (cfg["batch"],), device=device)
        noise = torch.randn_like(x0)
        abar = model.abar[t].view(-1, 1, 1, 1)
        x_t = abar.sqrt() * x0 + (1.0 - abar).sqrt() * noise
        return F.mse_loss(model(x_t, t), noise)

    return _common.capture_training("unet", scale, seed, cfg, build, sizes, loss_of, sizes=sizes)


if __name__ == "__main__":
    sys.exit(_common.main("unet", capture, SCALES, __doc__))

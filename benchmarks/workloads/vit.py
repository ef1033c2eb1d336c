"""Vision transformer trained with AdamW on images whose height and width change every step.

The model (ViT): a strided convolution cuts the image into ``patch`` x ``patch`` patches and
embeds them, a learned class token is prepended, a learned position embedding kept on a
``max_image / patch`` grid is resized (bilinear) to the step's patch grid and added, then
``depth`` pre-LayerNorm ``nn.TransformerEncoderLayer`` blocks (multi-head self-attention, GELU
MLP, no dropout), a final LayerNorm and a linear classifier on the class token. Training uses
label smoothing and AdamW (``foreach=True``).

Every step draws the image height and width independently (multiples of ``patch`` in
``min_image..max_image``) from a generator seeded with ``seed``, so the number of patches, and
with it every activation and the attention maps (quadratic in it), changes from step to step:
the shape pattern that fragments a caching allocator most. Traced without a GPU (fake CUDA
or meta), ``nn.MultiheadAttention`` takes scaled_dot_product_attention's math path, which keeps the
attention map for backward; CUDA's flash kernel would keep less.

    python benchmarks/workloads/vit.py --out build/traces/vit-small.cptrace
    python benchmarks/workloads/vit.py --scale medium --steps 40 --max-image 512

Scales: ``small`` (4 blocks, dim 192, patch 8, images 32..96 px, batch 16, 12 steps; seconds to
capture), ``medium`` (ViT-B/16: 12 blocks, dim 768, images 128..384 px, batch 32, 20
steps), ``large`` (ViT-L/16: 24 blocks, dim 1024, images 160..512 px, batch 32, 40 steps).
"""

from __future__ import annotations

import random
import sys
from typing import Any, List, Tuple

try:
    from . import _common
except ImportError:  # run as a script
    import _common

from cudapool.lab.trace import Trace

_TRAINING = dict(lr=1e-3, weight_decay=0.05, label_smoothing=0.1, optimizer="adamw", device="cuda")
# fmt: off
SCALES = {
    "small": dict(depth=4, dim=192, heads=3, patch=8, min_image=32, max_image=96, batch=16, classes=100,
                  steps=12, **_TRAINING),
    "medium": dict(depth=12, dim=768, heads=12, patch=16, min_image=128, max_image=384, batch=32, classes=1000,
                   steps=20, **_TRAINING),
    "large": dict(depth=24, dim=1024, heads=16, patch=16, min_image=160, max_image=512, batch=32, classes=1000,
                  steps=40, **_TRAINING),
}
# fmt: on


def build_model(depth: int, dim: int, heads: int, patch: int, max_image: int, classes: int, device: str) -> Any:
    """The ViT (an nn.Module) on ``device``: ``model(images [B, 3, H, W])`` -> logits ``[B, classes]``."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    if dim % heads:
        raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
    grid = max_image // patch

    class ViT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Conv2d(3, dim, patch, stride=patch, device=device)
            self.cls = nn.Parameter(torch.zeros(1, 1, dim, device=device))
            self.pos = nn.Parameter(torch.randn(1, dim, grid, grid, device=device) * 0.02)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True,
                    device=device,
                )
                for _ in range(depth)
            )  # fmt: skip
            self.norm = nn.LayerNorm(dim, device=device)
            self.head = nn.Linear(dim, classes, device=device)

        def forward(self, images):
            x = self.embed(images)  # [B, dim, H/patch, W/patch]
            pos = F.interpolate(self.pos, size=x.shape[2:], mode="bilinear", align_corners=False)
            x = (x + pos).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x[:, 0]))

    return ViT()


def draw_images(seed: int, cfg: dict) -> List[Tuple[int, int]]:
    """(height, width) of every step's images: multiples of patch, drawn independently."""
    _common.check_range(cfg, "min_image", "max_image", least=cfg["patch"])
    rng = random.Random(seed)
    size = lambda: _common.draw_multiple(rng, cfg["min_image"], cfg["max_image"], cfg["patch"])  # noqa: E731
    return [(size(), size()) for _ in range(cfg["steps"])]


def capture(scale: str = "small", seed: int = 0, **kw: Any) -> Trace:
    """Trace ``steps`` AdamW training steps of the ViT at ``scale`` (kw overrides settings)."""
    import torch
    import torch.nn.functional as F

    cfg = _common.pick(SCALES, scale, kw)
    shapes = draw_images(seed, cfg)

    def build(device: str) -> Tuple[Any, Any]:
        model = build_model(
            cfg["depth"], cfg["dim"], cfg["heads"], cfg["patch"], cfg["max_image"], cfg["classes"], device
        )
        return model, _common.make_optimizer(cfg["optimizer"], model.parameters(), cfg["lr"], cfg["weight_decay"])

    def loss_of(model: Any, hw: Tuple[int, int]) -> Any:
        images = torch.randn(cfg["batch"], 3, *hw, device=cfg["device"])
        labels = torch.randint(0, cfg["classes"], (cfg["batch"],), device=cfg["device"])
        return F.cross_entropy(model(images), labels, label_smoothing=cfg["label_smoothing"])

    return _common.capture_training("vit", scale, seed, cfg, build, shapes, loss_of, shapes=shapes)


if __name__ == "__main__":
    sys.exit(_common.main("vit", capture, SCALES, __doc__))

"""ResNet-style CNN trained with SGD (momentum, weight decay) on random images.

The model is a small ResNet of our own: a 3x3 stem convolution, stages of basic residual blocks
(conv-BN-ReLU, conv-BN, plus the skip connection; a strided 1x1 conv-BN on the skip where the
shape changes), global average pooling and a linear classifier, in float32. Every stage after
the first halves the resolution and doubles the width. SGD runs with ``foreach=True``, the
implementation it picks on CUDA. Images and labels are random; shapes are fixed per step, so
this is the steady, repetitive pattern of vision training.

    python benchmarks/workloads/cnn.py --out build/traces/cnn-small.cptrace
    python benchmarks/workloads/cnn.py --batch 128 --image 224 --width 64 --blocks 2,2,2,2

Scales: ``small`` (batch 16, 64x64 images, widths 32-64-128, 4 steps; seconds to capture on
fake CUDA), ``medium`` (ResNet-18 layout: batch 64, 224x224, widths 64..512, 10 steps),
``large`` (ResNet-34 layout: batch 128, 224x224, 20 steps).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence, Tuple

try:
    from . import _common
except ImportError:  # run as a script
    import _common

from cudapool.lab.trace import Trace

# What every scale shares; the model and the batch grow with the scale.
_TRAINING = dict(lr=0.1, weight_decay=5e-4, device="cuda")
SCALES = {
    "small": dict(batch=16, image=64, width=32, blocks=(2, 2, 2), classes=10, steps=4, **_TRAINING),
    "medium": dict(batch=64, image=224, width=64, blocks=(2, 2, 2, 2), classes=1000, steps=10, **_TRAINING),
    "large": dict(batch=128, image=224, width=64, blocks=(3, 4, 6, 3), classes=1000, steps=20, **_TRAINING),
}


def build_model(width: int, blocks: Sequence[int], classes: int, device: str) -> Any:
    """The ResNet (an nn.Module) on ``device``."""
    import torch.nn as nn
    import torch.nn.functional as F

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False, device=device)
            self.bn1 = nn.BatchNorm2d(cout, device=device)
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False, device=device)
            self.bn2 = nn.BatchNorm2d(cout, device=device)
            self.skip = None
            if stride != 1 or cin != cout:
                self.skip = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride=stride, bias=False, device=device),
                    nn.BatchNorm2d(cout, device=device),
                )

        def forward(self, x):
            y = F.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return F.relu(y + (x if self.skip is None else self.skip(x)))

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, width, 3, padding=1, bias=False, device=device),
                nn.BatchNorm2d(width, device=device),
                nn.ReLU(),
            )
            layers = []
            cin = width
            for i, n in enumerate(blocks):
                cout = width << i
                for j in range(n):
                    layers.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1))
                    cin = cout
            self.layers = nn.Sequential(*layers)
            self.fc = nn.Linear(cin, classes, device=device)

        def forward(self, x):
            x = self.layers(self.stem(x))
            return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))

    return ResNet()


def capture(scale: str = "small", seed: int = 0, **kw: Any) -> Trace:
    """Trace ``steps`` SGD training steps of the ResNet at ``scale`` (kw overrides settings)."""
    import torch
    import torch.nn.functional as F

    cfg = _common.pick(SCALES, scale, kw)
    cfg["blocks"] = tuple(cfg["blocks"])
    if not cfg["blocks"] or min(cfg["blocks"]) < 1:
        raise ValueError(f"blocks must be positive counts per stage, got {cfg['blocks']}")

    def build(device: str) -> Tuple[Any, Any]:
        model = build_model(cfg["width"], cfg["blocks"], cfg["classes"], device)
        return model, _common.make_optimizer("sgd", model.parameters(), cfg["lr"], cfg["weight_decay"])

    def loss_of(model: Any, step: int) -> Any:
        images = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], device=cfg["device"])
        labels = torch.randint(0, cfg["classes"], (cfg["batch"],), device=cfg["device"])
        return F.cross_entropy(model(images), labels)

    return _common.capture_training("cnn", scale, seed, cfg, build, range(cfg["steps"]), loss_of)


if __name__ == "__main__":
    sys.exit(_common.main("cnn", capture, SCALES, __doc__))

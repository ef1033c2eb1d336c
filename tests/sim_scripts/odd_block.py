"""One allocation of 11.5 MiB: torch's allocator hands out its 12 MiB block whole."""

import torch

x = torch.empty(23 << 19, dtype=torch.uint8, device="cuda")
y = x + 1

"""A call into torch that needs the CUDA driver itself: its caching allocator's raw allocation."""

import torch

x = torch.zeros(4, device="cuda")
torch.cuda.caching_allocator_alloc(1 << 20, stream=0)

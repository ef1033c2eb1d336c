"""flex_attention with a causal block mask, compiled or not (--eager)."""

import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

B, H, S, D = 2, 4, 1024, 64
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
mask = create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, S, S, device="cuda")
attend = flex_attention if "--eager" in sys.argv else torch.compile(flex_attention)
attend(q, k, v, block_mask=mask).sum().backward()

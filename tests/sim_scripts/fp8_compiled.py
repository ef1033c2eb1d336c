"""A float8 matrix multiply (torch._scaled_mm) under torch.compile: Inductor calls its out= form."""

import torch

a = torch.randn(256, 512, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(1024, 512, device="cuda").to(torch.float8_e4m3fn).t()
scale = torch.tensor(1.0, device="cuda")


@torch.compile
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a, b, scale, scale, out_dtype=torch.bfloat16)


print(tuple(matmul(a, b).shape))

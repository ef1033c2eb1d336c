"""A custom operator without a fake implementation: it cannot run on fake CUDA tensors."""

import torch


@torch.library.custom_op("mylib::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


x = torch.ones(4, device="cuda")
y = scale(x)
print(y)

"""A compiled function on each rank's own GPU: a bare "cuda" inside it is the rank's device."""

import os

import torch

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
limit = torch.tensor(3, device="cuda")


@torch.compile
def below(n: torch.Tensor) -> torch.Tensor:
    return (torch.arange(1 << 20, device="cuda") < n).float().sum()


print("device", below(limit).device)

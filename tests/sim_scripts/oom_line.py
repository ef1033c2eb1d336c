"""Three 4 GiB tensors at once in each step: 12 GiB, which a 10 GB GPU does not have."""

import torch

x = torch.empty(1 << 30, device="cuda")  # 4 GiB
for step in range(3):
    y = x * 2
    z = y + 1
    del y, z
    torch.optim.SGD([torch.zeros(1, device="cuda", requires_grad=True)], lr=0.1).step()

"""A script that needs a CUDA GPU."""

import torch

x = torch.zeros(3, device="cuda")

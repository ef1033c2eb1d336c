"""A script that warns and writes to stderr."""

import sys
import warnings

import torch

warnings.warn("a warning of the script's own")
print("to stderr", file=sys.stderr)
print("to stdout")
torch.ones(4, device="cuda").sum()

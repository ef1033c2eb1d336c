"""cudapool — a stream-aware caching GPU memory allocator for PyTorch.

The simulated-device pool lives in :mod:`cudapool.sim`; it needs neither a GPU nor torch.
"""

from ._version import __version__

__all__ = ["__version__"]

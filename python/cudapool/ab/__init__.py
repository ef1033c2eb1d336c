"""What a script can tell ``python -m cudapool ab`` about itself, without depending on it.

    import cudapool.ab
    for batch in loader:
        train_step(batch)
        cudapool.ab.step()          # the end of one step: a timestamp under `ab --step-marker`

Outside ``python -m cudapool ab --step-marker`` (a plain ``python train.py``), :func:`step` does
nothing, cheaply, so the call can stay in the script. Under it, each call appends one
``time.perf_counter()`` reading to a list; the child runner (``cudapool.ab.child``) writes the
step times at exit. The reading is taken on the host, without synchronising the GPU: over many
steps the host runs at the GPU's pace (every ``loss.item()`` waits for it), so medians are
right; a single step's time may not be.

This module imports nothing from cudapool and never imports torch.
"""

import os
import time
from typing import Any, Dict, List, Optional

__all__ = ["step", "allocator", "ENV_ALLOCATOR", "ENV_STATS", "ENV_STEPS", "ENV_CONF"]

#: The allocator of the run, as ``ab`` names it (builtin, expandable, async, cudapool,
#: cudapool:KEY=VAL...): set by ``ab`` in each child's environment.
ENV_ALLOCATOR = "CUDAPOOL_AB_ALLOCATOR"
#: Where the child runner writes its statistics (JSON); "{rank}" is replaced by the
#: torch.distributed rank (RANK), 0 outside torchrun.
ENV_STATS = "CUDAPOOL_AB_STATS"
#: "1": record a timestamp at each :func:`step` call.
ENV_STEPS = "CUDAPOOL_AB_STEPS"
#: The configuration text ("key:value,...") of a cudapool variant, for ``cudapool.enable()``.
ENV_CONF = "CUDAPOOL_AB_CONF"

# The readings of step(), or None when not recording (outside `ab --step-marker`).
_times: Optional[List[float]] = None
# Memory figures a script without a GPU reports in place of the allocator's (tests' stand-ins).
_fake_memory: Dict[int, Dict[str, Any]] = {}


def step() -> None:
    """Mark the end of one step (a training iteration, a batch of inference). A no-op outside
    ``python -m cudapool ab --step-marker``; under it, records ``time.perf_counter()``."""
    if _times is not None:
        _times.append(time.perf_counter())


def allocator() -> Optional[str]:
    """The allocator this process runs under when ``python -m cudapool ab`` started it
    ("builtin", "expandable", "async", "cudapool" or a "cudapool:..." variant), else None."""
    return os.environ.get(ENV_ALLOCATOR) or None


def _start_recording() -> None:
    """Make :func:`step` record (the child runner calls it under ``--step-marker``)."""
    global _times
    _times = []


def _report_memory(
    device: int = 0, *, peak_allocated: int, peak_reserved: int, device_allocs: int = 0, num_ooms: int = 0
) -> None:
    """Report a device's memory figures in place of the allocator's statistics.

    For stand-in scripts that run without a GPU (the tests of ``ab``): when any figures were
    reported this way, the child runner writes them instead of reading torch's or cudapool's
    statistics. A real script never needs it."""
    _fake_memory[int(device)] = {
        "peak_allocated": int(peak_allocated),
        "peak_reserved": int(peak_reserved),
        "device_allocs": int(device_allocs),
        "num_ooms": int(num_ooms),
    }

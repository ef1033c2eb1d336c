"""The GPUs the fake GPU can be: their names, memory and multiprocessors as a script sees
them in ``torch.cuda.get_device_properties()``, how they are linked to the other GPUs of their
board, and the cuBLAS workspace torch gives each."""

from __future__ import annotations

import os
import re
from typing import Dict, NamedTuple, Optional

from .._units import MIB, parse_size

__all__ = ["DEFAULT_GPU", "GPUModel", "GPUS", "SHARED_MEMORY_OPTIN", "cublas_workspace_bytes", "gpu_model"]


class GPUModel(NamedTuple):
    """A GPU as a script sees it: ``torch.cuda.get_device_properties()``'s main fields; then
    its links to the other GPUs of the usual board that carries it (for NCCL's buffers,
    cudapool.ab.outside): NVLink links per GPU (0: PCIe only) and whether they go through
    NVSwitches (every GPU one hop from every other, and NVLink SHARP from compute capability 9.0)."""

    name: str
    total_memory: int
    multi_processor_count: int
    max_threads_per_multi_processor: int
    major: int
    minor: int
    nvlinks: int = 0
    nvswitch: bool = False
    l2_cache: int = 50 * MIB  # L2_cache_size (Inductor sizes its benchmarks' cache flush by it)


#: Common GPUs: total memory as ``nvidia-smi`` lists it for the card (MiB), multiprocessors and
#: threads per multiprocessor of the chip, compute capability; NVLink links and NVSwitch of the
#: 8-GPU board (HGX/DGX H100 and H200: 18 NVLink 4 links through NVSwitches; HGX A100: 12 NVLink 3
#: links through NVSwitches; DGX-1 V100: 6 NVLink 2 links, GPU to GPU; the others are PCIe cards).
#: Keys are matched without case, spaces, dashes or underscores.
GPUS: Dict[str, GPUModel] = {
    "h200": GPUModel("NVIDIA H200", 143771 * MIB, 132, 2048, 9, 0, 18, True, 50 * MIB),
    "h100": GPUModel("NVIDIA H100 80GB HBM3", 81559 * MIB, 132, 2048, 9, 0, 18, True, 50 * MIB),
    "a10080gb": GPUModel("NVIDIA A100-SXM4-80GB", 81920 * MIB, 108, 2048, 8, 0, 12, True, 40 * MIB),
    "a10040gb": GPUModel("NVIDIA A100-SXM4-40GB", 40960 * MIB, 108, 2048, 8, 0, 12, True, 40 * MIB),
    "l40s": GPUModel("NVIDIA L40S", 46068 * MIB, 142, 1536, 8, 9, l2_cache=96 * MIB),
    "rtx4090": GPUModel("NVIDIA GeForce RTX 4090", 24564 * MIB, 128, 1536, 8, 9, l2_cache=72 * MIB),
    "rtx3090": GPUModel("NVIDIA GeForce RTX 3090", 24576 * MIB, 82, 1536, 8, 6, l2_cache=6 * MIB),
    "a10g": GPUModel("NVIDIA A10G", 23028 * MIB, 80, 1536, 8, 6, l2_cache=6 * MIB),
    "l4": GPUModel("NVIDIA L4", 23034 * MIB, 58, 1536, 8, 9, l2_cache=48 * MIB),
    "v10032gb": GPUModel("Tesla V100-SXM2-32GB", 32768 * MIB, 80, 2048, 7, 0, 6, l2_cache=6 * MIB),
    "t4": GPUModel("Tesla T4", 15360 * MIB, 40, 1024, 7, 5, l2_cache=4 * MIB),
}
#: Shared memory a block may opt in to, by compute capability (CUDA's programming guide's table
#: of technical specifications): Triton's and Inductor's templates size their tiles by it.
SHARED_MEMORY_OPTIN = {(7, 0): 96 << 10, (7, 5): 64 << 10, (8, 0): 163 << 10, (8, 6): 99 << 10, (8, 9): 99 << 10}
SHARED_MEMORY_OPTIN_LATEST = 227 << 10  # 9.0 and later
_ALIASES = {"h10080gb": "h100", "a100": "a10080gb", "4090": "rtx4090", "3090": "rtx3090", "v100": "v10032gb"}
DEFAULT_GPU = "h100"


def _key(text: str) -> str:
    return re.sub(r"[\s_\-]", "", text).lower()


def gpu_model(spec: str) -> GPUModel:
    """The GPU ``spec`` names: a key of :data:`GPUS` (``H100``, ``a100-40gb``, ``RTX 4090``...)
    or a memory size (``24GB``, ``80GiB``, bytes), then with an H100's multiprocessors and links.
    ValueError naming the known models otherwise."""
    key = _key(spec)
    key = _ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    try:
        size = parse_size(spec)
    except ValueError:
        known = ", ".join(m.name + f" ({k})" for k, m in GPUS.items())
        raise ValueError(f"unknown GPU {spec!r}: give a model ({known}) or a memory size such as 24GB") from None
    if size <= 0:
        raise ValueError(f"GPU memory must be positive, not {spec!r}")
    h100 = GPUS[DEFAULT_GPU]
    return h100._replace(name=f"GPU with {spec} (an H100's multiprocessors)", total_memory=size)


def cublas_workspace_bytes(model: "GPUModel", config: Optional[str] = None) -> int:
    """The cuBLAS workspace torch allocates per (handle, stream) on ``model``: from
    ``CUBLAS_WORKSPACE_CONFIG`` (``config``, default the environment's: ``:SIZE_KiB:COUNT``
    pairs, summed) when set, else torch's default for the architecture (Hopper and later
    ``:4096:8``, 32 MiB; earlier ``:4096:2:16:8``, 8 MiB and 128 KiB)."""
    text = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    if text:
        nums = [int(n) for n in re.findall(r"\d+", text)]
        if nums and len(nums) % 2 == 0:
            return sum(nums[i] * nums[i + 1] for i in range(0, len(nums), 2)) * 1024
    return (4096 * 8 if model.major >= 9 else 4096 * 2 + 16 * 8) * 1024

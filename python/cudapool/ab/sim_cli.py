"""The command line of ``python -m cudapool ab --simulate`` (:mod:`cudapool.ab.simulate` runs it):
its options, in one place for its own ``--help`` and for ``ab --help``."""

from __future__ import annotations

import argparse

from . import common

__all__ = ["build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cudapool ab --simulate",
        usage="python -m cudapool ab --simulate [OPTIONS] -- SCRIPT [ARGS...]",
        description="Trace SCRIPT (unchanged) once on a fake GPU, without a GPU, and predict what each allocator "
        "would reserve, whether the run fits on that GPU, the smallest GPU memory it needs and the device time.",
    )
    p.add_argument("--simulate", action="store_true", help="this mode (required)")
    p.add_argument(
        "--gpu",
        default="H100",
        metavar="NAME_OR_BYTES",
        help="the GPU to predict for: H200, H100, A100-80GB, A100-40GB, L40S, RTX4090, RTX3090, A10G, L4, V100, T4, "
        "or a memory size such as 24GB (default: H100)",
    )
    p.add_argument(
        "--allocators", default=common.DEFAULT_ALLOCATORS, metavar="LIST", help="as for ab (default: %(default)s)"
    )
    p.add_argument("--json", metavar="PATH", help="write the prediction, every replay and the trace's facts to PATH")
    p.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help="stop the script after N steps: N cudapool.ab.step() marks, or N steps of one optimizer (a loop that "
        "steps several takes one step of each), whichever comes first",
    )
    p.add_argument(
        "--strict-values",
        action="store_true",
        help="make a read of a tensor's value (.item(), float(), bool()) an error instead of a zero",
    )
    p.add_argument("--find-max-batch", metavar="ARG", help="the largest value of the script's option ARG that fits")
    p.add_argument(
        "--max-batch-range",
        metavar="LO:HI",
        help=f"its range (default {common.DEFAULT_RANGE[0]}:{common.DEFAULT_RANGE[1]})",
    )
    p.add_argument(
        "--max-batch-step",
        type=int,
        metavar="N",
        help="with --find-max-batch: stop once the answer is known to within N (default: 1, the exact value)",
    )
    p.add_argument(
        "--hide-output", action="store_true", help="do not show the script's own output (stdout and stderr) as it runs"
    )
    p.add_argument("--timeout", type=float, metavar="S", help="seconds per trace")
    p.add_argument(
        "--trace", metavar="PATH", help="also keep the script's trace there (python -m cudapool replay PATH)"
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="run the script as torchrun would on each node of N GPUs: one process per traced rank, each rank's GPU "
        "cuda:LOCAL_RANK of the node, torch.distributed on the fake GPU",
    )
    p.add_argument("--nnodes", type=int, default=1, metavar="M", help="with --nproc-per-node: M nodes (default 1)")
    p.add_argument(
        "--ranks",
        metavar="LIST",
        help="with --nproc-per-node: the ranks to trace, e.g. 0,7 or 0-3 or all (default: the first and the last; "
        "ranks whose traces are identical make one row)",
    )
    p.add_argument(
        "--outside",
        metavar="BYTES",
        help="GPU memory the process holds outside PyTorch's allocator, set aside before fits, smallest GPU memory "
        "and --find-max-batch (e.g. 1GiB, 0; default: an estimate of the CUDA context and, with ranks, NCCL's "
        "buffers)",
    )
    p.add_argument(
        "--wide",
        action="store_true",
        help="every column of the table: utilization, device calls and device time too (the table then passes "
        "100 characters)",
    )
    p.add_argument(
        "--engine",
        choices=("auto", "native", "python"),
        default="auto",
        metavar="auto|native|python",
        help="the fake GPU: native (cudapool's, below Python: fast, torch's own CUDA paths), python (torch's fake "
        "tensors, any torch build), or auto: native where it was built for this torch (default)",
    )
    return p

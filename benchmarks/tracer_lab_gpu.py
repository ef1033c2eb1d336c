"""The lab's workloads on a real GPU against their traces (needs a CUDA GPU).

    python benchmarks/tracer_lab_gpu.py --out DIR [--workloads gpt,cnn] [--scale small] [--json PATH]

For each torch workload of ``benchmarks/workloads`` (rmm_random is generated, not a program):

1. the program runs on the GPU with the built-in allocator and no tracer (the workloads'
   ``Tracer`` is replaced by a stand-in that records nothing), with torch's memory history
   recorded from before the model is built (after one matrix multiply, so that the cuBLAS
   workspace is not in the window); the snapshot is kept as ``DIR/<workload>.pickle``
   (``context=None``: no stacks, small files);
2. the same program is traced as the lab traces it, on fake CUDA tensors (``build/traces`` is
   not used);
3. the table compares them as benchmarks/tracer_public.py does: the window's peak, the
   allocations, and whether every allocation and free matches in order.

Without a GPU it prints "no CUDA GPU: skipped" and exits 0. Data-dependent shapes (moe's
routing) may differ between the GPU run, which routes on real values, and the trace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "workloads"))

import cudapool.fakegpu.tracer as tracer_mod  # noqa: E402
import torch  # noqa: E402
from cudapool.lab.trace import ALLOC, Trace  # noqa: E402
from tracer_public import compare, comparison_cells, measure, snapshot_events  # noqa: E402

PROGRAMS = ("gpt", "cnn", "kvcache", "vit", "unet", "moe", "lstm")


class _NoTracer:
    """Stands in for cudapool.fakegpu.tracer.Tracer while a workload runs for real: records nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> "_NoTracer":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @contextlib.contextmanager
    def stream(self, n: int) -> Iterator[None]:
        yield

    def watch(self, *objs: Any) -> int:
        return 0

    def trace(self, meta: Optional[Dict[str, Any]] = None) -> Trace:
        return Trace.from_events([], meta=meta or {})


def _capture(name: str) -> Any:
    import workloads

    return workloads.WORKLOADS[name]


def run_untraced(name: str, scale: str, device: str) -> None:
    """The workload's program on ``device`` with no tracer."""
    real = tracer_mod.Tracer
    tracer_mod.Tracer = _NoTracer  # type: ignore[misc]
    try:
        _capture(name)(scale=scale, seed=0, device=device)
    finally:
        tracer_mod.Tracer = real  # type: ignore[misc]


def gpu_run(name: str, scale: str, out: Path) -> Path:
    """The workload on the GPU, untraced, its memory history kept as a snapshot."""
    path = out / f"{name}.pickle"
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=10_000_000, context=None)
    try:
        run_untraced(name, scale, "cuda")
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path


def rows(names: List[str], scale: str, out: Path) -> List[Dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    rs = []
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        path = gpu_run(name, scale, out)
        events, _ = snapshot_events(path)
        real = measure(events)
        trace = _capture(name)(scale=scale, seed=0)  # the lab's trace: fake CUDA
        got = measure([("A" if e[0] == ALLOC else "F", e[1], e[2]) for e in trace])
        row = {"workload": name, "scale": scale, "snapshot": str(path)}
        row.update(compare(real, got))
        rs.append(row)
        print(f"[{i + 1}/{len(names)}] {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return rs


def table(rs: List[Dict[str, Any]]) -> str:
    lines = [
        "| workload | scale | peak GPU / traced (MiB) | peak error | allocations GPU / traced | count error "
        "| sizes in order | all events in order |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rs:
        lines.append(f"| {r['workload']} | {r['scale']} | {comparison_cells(r)} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="directory for the GPU snapshots")
    ap.add_argument("--workloads", default=",".join(PROGRAMS), metavar="A,B")
    ap.add_argument("--scale", default="small", choices=("small", "medium", "large"))
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    bad = [n for n in names if n not in PROGRAMS]
    if bad:
        ap.error(f"not a torch workload: {', '.join(bad)} (known: {', '.join(PROGRAMS)})")
    if not torch.cuda.is_available():
        print("no CUDA GPU: skipped")
        return 0
    rs = rows(names, args.scale, args.out)
    print(table(rs))
    if args.json:
        Path(args.json).write_text(json.dumps(rs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

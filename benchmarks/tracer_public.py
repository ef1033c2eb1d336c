"""The tracer against memory snapshots recorded on real GPUs by other people, for programs whose
code is public.

    python benchmarks/tracer_public.py --snapshots DIR --code DIR [--on meta,fake-cuda] [--json PATH]

The programs are memory-profiling runs of Stanford CS336's assignment 2 (spring 2026): the
course's reference Transformer language model (``cs336_basics``: einsum linears, RMSNorm, RoPE,
SwiGLU, softmax attention written out, a hand-written cross-entropy and AdamW), recorded with
``torch.cuda.memory._record_memory_history`` on a GPU with the built-in allocator and
published in students' repositories. Neither the snapshots nor the model's code are part of
cudapool: ``--snapshots`` is a directory holding the snapshot files under the names in RUNS
(``<owner>__<repository>/<file>``), ``--code`` a directory holding the ``cs336_basics``
package (its ``cs336-basics`` folder). The runs need ``einops``, ``einx`` and ``jaxtyping``.

Each run is re-enacted on the CPU the way its script ran it (model, optimizer, warm-up before
the window, the window itself: see PROGRAMS), with the window under
``cudapool.fakegpu.tracer.Tracer(window=True)``. The model is built on meta (and moved to fake CUDA
tensors with ``to_empty``); one warm-up step stands for the script's five (the state they
leave is the same). Whether the recorded run used bf16 autocast is read from the snapshot (its
stacks show autocast's casts).

Per run, the table gives the window's peak (bytes allocated inside the window and live at
once) in the snapshot and in the trace, the number of allocations, whether the allocations have
the same sizes in the same order, and whether the whole sequence of allocations and frees
matches. The figures depend only on the programs' shapes, not on the GPU, except where noted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from cudapool.fakegpu.tracer import Tracer  # noqa: E402
from cudapool.lab.torch_snapshot import _unpickle, from_snapshot  # noqa: E402
from cudapool.lab.trace import ALLOC  # noqa: E402

#: The model sizes of the course's table.
SIZES = {
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
}

#: The public runs: snapshot (under --snapshots), program, size, context length, batch.
RUNS: List[Dict[str, Any]] = (
    [
        {
            "snapshot": f"Wedsonlin__assignment2-systems/medium_{ctx}_inference_memory_snapshot.pickle",
            "program": "forward",
            "size": "medium",
            "ctx": ctx,
            "batch": 4,
        }
        for ctx in (128, 256, 512, 1024)
    ]
    + [
        {
            "snapshot": f"Wedsonlin__assignment2-systems/medium_{ctx}_training_memory_snapshot.pickle",
            "program": "train",
            "size": "medium",
            "ctx": ctx,
            "batch": 4,
        }
        for ctx in (128, 256, 512, 1024)
    ]
    + [
        {
            "snapshot": "MAGMA27__assignment2-systems/memory_snapshot.pickle",
            "program": "accumulate",
            "size": "small",
            "ctx": 256,
            "batch": 32,
        },
        {
            "snapshot": "Charan6924__assignment2-systems/memory_snapshot.pickle",
            "program": "no-grad-forwards",
            "workspace_bytes": 8519680,
            "size": "small",
            "ctx": 512,
            "batch": 4,
        },
    ]
)

#: What each program does around and inside its window (the recorded scripts' logic).
PROGRAMS = {
    "forward": "5 forwards under inference_mode, then the window: one more",
    "train": "5 training steps (forward, cross_entropy, backward, AdamW step, zero_grad), the "
    "previous output and loss dropped, zero_grad(set_to_none=True), then the window: one more step",
    "accumulate": "5 steps of forward, cross_entropy and backward (no optimizer: gradients accumulate), "
    "then the window: one more",
    "no-grad-forwards": "the window from model creation: 5 forwards under no_grad",
}

Event = Tuple[str, int, int]  # ("A" or "F", id, bytes)


def snapshot_events(path: Path) -> Tuple[List[Event], bool]:
    """The snapshot's events, and whether its stacks show CUDA autocast's casts."""
    raw = _unpickle(path)
    autocast = False
    for trace in raw.get("device_traces", []):
        for entry in trace:
            if entry.get("action") == "alloc" and any(
                "autocast" in str(f.get("name", "")) for f in entry.get("frames", ()) or ()
            ):
                autocast = True
                break
        if autocast:
            break
    t = from_snapshot(raw, source=str(path))
    return [("A" if e[0] == ALLOC else "F", e[1], e[2]) for e in t], autocast


def measure(events: List[Event]) -> Dict[str, Any]:
    """Window peak (bytes allocated inside the window and live at once), allocations, and the
    sequence of (action, bytes) with frees of storages from before the window left out."""
    born: Dict[int, int] = {}
    live = peak = 0
    allocs: List[int] = []
    seq: List[Tuple[str, int]] = []
    for action, ident, size in events:
        if action == "A":
            born[ident] = size
            live += size
            allocs.append(size)
            seq.append(("A", size))
        elif ident in born:
            live -= born.pop(ident)
            seq.append(("F", size))
        peak = max(peak, live)
    return {"peak": peak, "allocs": allocs, "seq": seq}


def _import_model(code: Path) -> Any:
    root = code / "cs336-basics" if (code / "cs336-basics").is_dir() else code
    sys.path.insert(0, str(root))
    try:
        import cs336_basics.model as model_mod
        import cs336_basics.nn_utils as nn_utils
        import cs336_basics.optimizer as optim_mod
    finally:
        sys.path.remove(str(root))
    return model_mod, nn_utils, optim_mod


def trace_run(run: Dict[str, Any], code: Path, on: str, autocast: bool, backward: str = "tracer") -> List[Event]:
    """Re-enact one run on meta or fake CUDA tensors; the window's events."""
    model_mod, nn_utils, optim_mod = _import_model(code)
    device = "meta" if on == "meta" else "cuda"
    kw: Dict[str, Any] = {"backward": backward}
    fake: Any = contextlib.nullcontext()
    if on == "fake-cuda":
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake = FakeTensorMode(allow_non_fake_inputs=True)
        kw["fake_mode"] = fake
    if run.get("workspace_bytes"):
        # The window holds the program's first matrix multiply: torch allocates the cuBLAS
        # workspace there. Its size is torch's default (CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8":
        # 2 x 4 MiB + 8 x 16 KiB), which the snapshot shows.
        kw["workspace_bytes"] = run["workspace_bytes"]
    vocab, ctx, batch = 10000, run["ctx"], run["batch"]
    with torch.device("meta"):
        model = model_mod.BasicsTransformerLM(vocab_size=vocab, context_length=ctx, **SIZES[run["size"]])
    with fake, torch.device(device):
        if on == "fake-cuda":
            model = model.to_empty(device="cuda")
        data = torch.randint(0, vocab, (batch, ctx))
        target = torch.randint(0, vocab, (batch, ctx))
        optimizer = optim_mod.AdamW(model.parameters()) if run["program"] == "train" else None

    def amp() -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast)

    def step() -> Tuple[Any, Any]:
        with amp():
            out = model(data)
            loss = nn_utils.cross_entropy(out, target)
        loss.backward()
        return out, loss

    program = run["program"]
    if program == "forward":
        model.eval()
        with Tracer(device=device, window=True, **kw) as tr, torch.inference_mode(), amp():
            model(data)
    elif program == "no-grad-forwards":
        with Tracer(device=device, window=True, **kw) as tr, torch.no_grad(), amp():
            for _ in range(5):
                model(data)
    elif program == "train":
        assert optimizer is not None
        with Tracer(device=device, **kw):  # the warm-up: traced (fake CUDA needs it), not kept
            out, loss = step()
            optimizer.step()
            optimizer.zero_grad()
            del out, loss
        optimizer.zero_grad(set_to_none=True)
        with Tracer(device=device, window=True, **kw) as tr:
            out, loss = step()
            optimizer.step()
    elif program == "accumulate":
        with Tracer(device=device, **kw):
            out, loss = step()
        with Tracer(device=device, window=True, **kw) as tr:
            # The script rebinds its names: the previous output and loss die as the new ones come.
            out = None
            with amp():
                out = model(data)
                loss = nn_utils.cross_entropy(out, target)
            loss.backward()
    else:
        raise ValueError(f"unknown program {program!r}")
    return [("A" if e[0] == ALLOC else "F", e[1], e[2]) for e in tr.events]


def compare(real: Dict[str, Any], got: Dict[str, Any]) -> Dict[str, Any]:
    n_real, n_got = len(real["allocs"]), len(got["allocs"])
    return {
        "real_peak": real["peak"],
        "traced_peak": got["peak"],
        "peak_error_pct": 100.0 * (got["peak"] - real["peak"]) / real["peak"] if real["peak"] else 0.0,
        "real_allocs": n_real,
        "traced_allocs": n_got,
        "count_error_pct": 100.0 * (n_got - n_real) / n_real if n_real else 0.0,
        "same_sizes_in_order": real["allocs"] == got["allocs"],
        "same_events_in_order": real["seq"] == got["seq"],
    }


def rows(
    snapshots: Path, code: Path, on: List[str], only: Optional[str] = None, backward: str = "tracer"
) -> List[Dict[str, Any]]:
    out = []
    runs = [r for r in RUNS if only is None or only in r["snapshot"]]
    for i, run in enumerate(runs):
        path = snapshots / run["snapshot"]
        if not path.exists():
            print(f"[{i + 1}/{len(runs)}] {run['snapshot']}: not found, skipped", file=sys.stderr)
            continue
        events, autocast = snapshot_events(path)
        real = measure(events)
        for where in on:
            t0 = time.perf_counter()
            got = measure(trace_run(run, code, where, autocast, backward))
            row = {
                "snapshot": run["snapshot"],
                "program": run["program"],
                "model": f"{run['size']}, ctx {run['ctx']}, batch {run['batch']}",
                "precision": "bf16 autocast" if autocast else "fp32",
                "traced_on": where,
            }
            row.update(compare(real, got))
            out.append(row)
            print(
                f"[{i + 1}/{len(runs)}] {run['snapshot']} on {where}: {time.perf_counter() - t0:.1f} s", file=sys.stderr
            )
    return out


def comparison_cells(r: Dict[str, Any]) -> str:
    """The table cells of one compare() result: peaks (MiB), peak error, allocations, count
    error, sizes in order, all events in order."""
    mib = 1 << 20
    return (
        f"{r['real_peak'] / mib:,.1f} / {r['traced_peak'] / mib:,.1f} | {r['peak_error_pct']:+.2f} % | "
        f"{r['real_allocs']:,} / {r['traced_allocs']:,} | {r['count_error_pct']:+.2f} % | "
        f"{'same' if r['same_sizes_in_order'] else 'differ'} | {'same' if r['same_events_in_order'] else 'differ'}"
    )


def table(rs: List[Dict[str, Any]]) -> str:
    lines = [
        "| snapshot | program | model | precision | traced on | window peak GPU / traced (MiB) | peak error | "
        "allocations GPU / traced | count error | sizes in order | all events in order |",
        "|---|---|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rs:
        lines.append(
            f"| {r['snapshot']} | {r['program']} | {r['model']} | {r['precision']} | {r['traced_on']} | "
            f"{comparison_cells(r)} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--snapshots", required=True, type=Path, help="directory holding the snapshots (see RUNS)")
    ap.add_argument("--code", required=True, type=Path, help="directory holding the cs336_basics package")
    ap.add_argument("--on", default="meta,fake-cuda", help="comma-separated: meta, fake-cuda")
    ap.add_argument("--only", help="only the runs whose snapshot path contains this")
    ap.add_argument(
        "--backward",
        choices=("tracer", "torch"),
        default="tracer",
        help="who runs backward in the traces (Tracer(backward=))",
    )
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    on = [w.strip() for w in args.on.split(",") if w.strip()]
    bad = [w for w in on if w not in ("meta", "fake-cuda")]
    if bad:
        ap.error(f"--on takes meta and fake-cuda, not {', '.join(bad)}")
    if not args.snapshots.is_dir():
        ap.error(f"--snapshots {args.snapshots}: not a directory")
    try:
        _import_model(args.code)
    except ImportError as exc:
        ap.error(f"--code {args.code}: cannot import cs336_basics ({exc})")
    rs = rows(args.snapshots, args.code, on, args.only, args.backward)
    if not rs:
        print("no snapshot found", file=sys.stderr)
        return 1
    print(table(rs))
    if args.json:
        Path(args.json).write_text(json.dumps(rs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

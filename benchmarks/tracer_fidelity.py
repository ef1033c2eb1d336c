"""How close the tracer's traces come to what a program allocates, on programs of our own.

    python benchmarks/tracer_fidelity.py [--json PATH] [--gpu DIR]

Every program builds its model before the traced window (``Tracer(window=True)``), as a
snapshot recorded after model creation does, and is traced three ways where that applies:
``meta`` (meta tensors), ``fake-cuda`` (fake CUDA tensors: torch's CUDA autocast rules) and
compared with an expectation derived without the tracer:

- ``hand``: the allocation sequence derived by hand from the program and torch's documented
  rules (CUDA autocast: linear in lower precision, casts of leaf weights cached until the
  autocast region ends), written out below;
- ``cpu-unobserved (CPU autocast)``: the same, for a program whose autocast region holds only
  operations that the CPU's and CUDA's autocast treat alike (linear in bf16);
- ``cpu-unobserved``: the program run on the CPU with no dispatch mode at all, its storage
  allocations read from the profiler's memory events (``profile_memory=True``). CPU tensors
  are not "subclass-like", so autograd takes the formulas it takes on CUDA (in-place gradient
  accumulation, ...); allocations of 8 bytes or less are left out on both sides (host
  scalars that a CUDA run keeps on the CPU cannot be told from 0-d device tensors there).

The table gives each program's expected and traced window peak (bytes allocated inside the
window, over the storages live at its start), the error, and the error in allocation count.
No GPU takes part, except with ``--gpu DIR`` (scripts/gpu-check.sh): the programs then run on
the GPU with the built-in allocator, their snapshots (from after model creation) are kept in
DIR, and the table compares the tracer's traces with them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from cudapool.fakegpu.tracer import Tracer  # noqa: E402
from cudapool.lab.trace import ALLOC  # noqa: E402

Event = Tuple[str, int]  # ("A" or "F", bytes)

SMALL = 8  # allocations of this size or less are left out of cpu-unobserved comparisons


def mlp(device: str) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32, device=device), torch.nn.ReLU(), torch.nn.Linear(32, 8, device=device)
    )


def sgd_step(model: torch.nn.Sequential) -> None:
    """SGD through ``p.data`` (a view of a storage made before the window), gradients dropped."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.data.add_(p.grad, alpha=-0.1)
                p.grad = None


def infer(model: torch.nn.Sequential, device: str, autocast: bool) -> torch.Tensor:
    """Inference on a batch of 4, made inside the window."""
    x = torch.randn(4, 16, device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
        h = model[0](x)
        h = torch.relu(h)
        y = model[2](h)
    del x, h
    return y


def train(model: torch.nn.Sequential, device: str) -> None:
    """One step: forward, MSE loss, backward, SGD through p.data (a view of a storage made
    before the window), gradients dropped."""
    x = torch.randn(4, 16, device=device)
    target = torch.randn(4, 8, device=device)
    loss = ((model(x) - target) ** 2).mean()
    loss.backward()
    del loss
    sgd_step(model)


def train_shared(model: torch.nn.Sequential, device: str) -> None:
    """Like train, with the first layer's output fed through the layer-shaped path twice
    (a residual branch), so autograd sums gradients: in place on a GPU, out of place when
    the tensors are "subclass-like" (meta, or under any dispatch mode)."""
    x = torch.randn(4, 16, device=device)
    target = torch.randn(4, 8, device=device)
    h = torch.relu(model[0](x))
    h = h + h * h
    loss = ((model[2](h) - target) ** 2).mean()
    loss.backward()
    del loss, h
    sgd_step(model)


# The expectations derived by hand (sizes in bytes; fp32 = 4 B, bf16 = 2 B).
HAND: Dict[str, List[Event]] = {
    # x (4x16), the first linear's output (4x32), relu's output (the first one dies at the
    # rebinding), the second linear's output (4x8); then x and h go.
    "mlp infer fp32": [("A", 256), ("A", 512), ("A", 512), ("F", 512), ("A", 128), ("F", 256), ("F", 512)],
    # CUDA autocast runs linear in bf16: the casts of x (128, freed after the op), of the weight
    # and bias (1024, 64; 512, 16: cached until the autocast region ends; the kernel's casts
    # are arguments of one call, which the compiler evaluates last to first: bias, weight,
    # input); outputs in bf16 (256, relu 256, 64). The cache's frees come in an order the
    # hand cannot know: only their bytes count for the peak, which is reached before.
    "mlp infer bf16 autocast": [
        ("A", 256),
        ("A", 64),
        ("A", 1024),
        ("A", 128),
        ("A", 256),
        ("F", 128),
        ("A", 256),
        ("F", 256),
        ("A", 16),
        ("A", 512),
        ("A", 64),
        ("F", 1024),
        ("F", 64),
        ("F", 512),
        ("F", 16),
        ("F", 256),
        ("F", 256),
    ],
}


def peak_of(events: List[Event]) -> int:
    live = peak = 0
    for action, size in events:
        live += size if action == "A" else -size
        peak = max(peak, live)
    return peak


def train_bf16(model: torch.nn.Sequential, device: str) -> None:
    """One step with the forward under bf16 autocast: CUDA's autocast on fake CUDA tensors,
    the CPU's on the CPU (both run linear in bf16, with the casts of the weights cached until
    the region ends), the loss in fp32."""
    x = torch.randn(4, 16, device=device)
    target = torch.randn(4, 8, device=device)
    with torch.autocast("cpu" if device == "cpu" else "cuda", dtype=torch.bfloat16):
        out = model(x)
    loss = ((out.float() - target) ** 2).mean()
    loss.backward()
    del loss, out
    sgd_step(model)


def train_indexed(model: torch.nn.Sequential, device: str) -> None:
    """A step through the operations whose backward formulas autograd switches to out-of-place
    forms on "subclass-like" tensors: an embedding looked up by indexing (index_put into zeros),
    a max over the last dimension (scatter into zeros) and a loss that gathers (scatter_add
    into zeros)."""
    table = model[0].weight  # 32 x 16: 32 rows looked up by index
    ids = torch.randint(0, 32, (4, 8), device=device)
    targets = torch.randint(0, 8, (4, 8, 1), device=device)
    h = table[ids]  # 4 x 8 x 16
    h = h - h.max(dim=-1, keepdim=True)[0]
    logits = model[2](torch.relu(torch.cat([h, h], dim=-1)))  # 4 x 8 x 8
    loss = -torch.gather(torch.log_softmax(logits, dim=-1), -1, targets).mean()
    loss.backward()
    del loss, h, logits
    sgd_step(model)


def traced(program: Callable[[torch.nn.Sequential, str], Any], device: str, **kw: Any) -> Tuple[List[Event], Tracer]:
    model = mlp(device) if device != "cuda" else None
    if device == "cuda":  # the model is made before the window, under the fake mode the tracer uses
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # the model, made before the window
            model = mlp("cuda")
        kw_tr: Dict[str, Any] = {"fake_mode": mode}
    else:
        kw_tr = {}
    with Tracer(device=device, window=True, **kw_tr, **kw) as tr:
        out = program(model, device)
        del out
    return [("A" if e[0] == ALLOC else "F", e[2]) for e in tr.events], tr


def cpu_unobserved(program: Callable[[torch.nn.Sequential, str], Any]) -> List[Event]:
    """The program on the CPU under no dispatch mode, its allocations from the profiler."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    model = mlp("cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = program(model, "cpu")
        del out
    found: List[Tuple[int, int]] = []

    def walk(node: Any) -> None:
        if node.typed[0] == _EventType.Allocation:
            found.append((node.start_time_ns, node.typed[1].alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    found.sort()
    return [("A" if size > 0 else "F", abs(size)) for _, size in found]


def big(events: List[Event]) -> List[Event]:
    return [e for e in events if e[1] > SMALL]


def row(program: str, traced_as: str, expected_from: str, expected: List[Event], got: List[Event]) -> Dict[str, Any]:
    exp_peak, got_peak = peak_of(expected), peak_of(got)
    exp_n = sum(1 for a, _ in expected if a == "A")
    got_n = sum(1 for a, _ in got if a == "A")
    return {
        "program": program,
        "traced": traced_as,
        "expected_from": expected_from,
        "expected_peak": exp_peak,
        "traced_peak": got_peak,
        "peak_error_pct": 100.0 * (got_peak - exp_peak) / exp_peak if exp_peak else 0.0,
        "expected_allocs": exp_n,
        "traced_allocs": got_n,
        "count_error_pct": 100.0 * (got_n - exp_n) / exp_n if exp_n else 0.0,
        "same_sizes_in_order": [s for a, s in expected if a == "A"] == [s for a, s in got if a == "A"],
    }


def rows() -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    ev, _ = traced(lambda m, d: infer(m, d, autocast=False), "meta")
    out.append(row("mlp infer fp32", "meta", "hand", HAND["mlp infer fp32"], ev))
    ev, _ = traced(lambda m, d: infer(m, d, autocast=True), "cuda")
    out.append(row("mlp infer bf16 autocast", "fake-cuda", "hand", HAND["mlp infer bf16 autocast"], ev))
    ev, _ = traced(lambda m, d: infer(m, d, autocast=True), "meta")
    out.append(row("mlp infer bf16 autocast", "meta", "hand", HAND["mlp infer bf16 autocast"], ev))
    ref = big(cpu_unobserved(train))
    ev, _ = traced(train, "meta")
    out.append(row("mlp train fp32, late window", "meta", "cpu-unobserved", ref, big(ev)))
    ev, _ = traced(train, "cuda")
    out.append(row("mlp train fp32, late window", "fake-cuda", "cpu-unobserved", ref, big(ev)))
    ref = big(cpu_unobserved(train_bf16))
    ev, _ = traced(train_bf16, "cuda")
    out.append(row("mlp train bf16 autocast", "fake-cuda", "cpu-unobserved (CPU autocast)", ref, big(ev)))
    ref = big(cpu_unobserved(train_shared))
    ev, _ = traced(train_shared, "meta")
    out.append(row("mlp train fp32, summed gradients", "meta", "cpu-unobserved", ref, big(ev)))
    ev, _ = traced(train_shared, "meta", backward="torch")
    out.append(row("mlp train fp32, summed gradients", "meta, torch's engine", "cpu-unobserved", ref, big(ev)))
    ref = big(cpu_unobserved(train_indexed))
    ev, _ = traced(train_indexed, "meta", kernel_scratch=False)
    out.append(row("indexing, max, gather: train fp32", "meta", "cpu-unobserved", ref, big(ev)))
    ev, _ = traced(train_indexed, "meta", kernel_scratch=False, backward="torch")
    out.append(row("indexing, max, gather: train fp32", "meta, torch's engine", "cpu-unobserved", ref, big(ev)))
    return out


def gpu_rows(out_dir: Path) -> List[Dict[str, Any]]:
    """The programs on a real GPU with the built-in allocator, recorded as torch memory
    snapshots (kept in ``out_dir``) from after model creation, against the tracer's traces.
    A matmul runs before recording so that the cuBLAS workspace is not in the window."""
    from cudapool.lab.torch_snapshot import load_snapshot

    out_dir.mkdir(parents=True, exist_ok=True)
    programs = [
        ("mlp infer fp32", lambda m, d: infer(m, d, autocast=False), "meta"),
        ("mlp infer bf16 autocast", lambda m, d: infer(m, d, autocast=True), "cuda"),
        ("mlp train fp32, late window", train, "meta"),
        ("mlp train fp32, summed gradients", train_shared, "meta"),
        ("indexing, max, gather: train fp32", train_indexed, "meta"),
    ]
    props = torch.cuda.get_device_properties(0)
    rs = []
    for i, (name, program, traced_on) in enumerate(programs):
        model = mlp("cuda")
        torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        out = program(model, "cuda")
        del out
        torch.cuda.synchronize()
        path = out_dir / f"tracer-fidelity-{i}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        real = [("A" if e[0] == ALLOC else "F", e[2]) for e in load_snapshot(path)]
        ev, _ = traced(program, traced_on, gpu=props)
        rs.append(row(name, "fake-cuda" if traced_on == "cuda" else traced_on, f"GPU snapshot {path.name}", real, ev))
    return rs


def table(rs: List[Dict[str, Any]]) -> str:
    lines = [
        "| program | traced on | expected from | expected peak (B) | traced peak (B) | peak error | "
        "allocations expected / traced | count error | same sizes in order |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rs:
        lines.append(
            f"| {r['program']} | {r['traced']} | {r['expected_from']} | {r['expected_peak']} | "
            f"{r['traced_peak']} | {r['peak_error_pct']:+.1f} % | {r['expected_allocs']} / {r['traced_allocs']} | "
            f"{r['count_error_pct']:+.1f} % | {'yes' if r['same_sizes_in_order'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--gpu", metavar="DIR", help="compare with snapshots recorded on the GPU, kept in DIR")
    args = ap.parse_args(argv)
    if args.gpu:
        if not torch.cuda.is_available():
            print("no CUDA GPU: skipped")
            return 0
        rs = gpu_rows(Path(args.gpu))
    else:
        rs = rows()
    print(table(rs))
    if args.json:
        Path(args.json).write_text(json.dumps(rs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

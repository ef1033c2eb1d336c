#!/usr/bin/env python3
"""Fidelity of the ``builtin`` replay policy: the real built-in allocator against its replay.

Each workload runs in a fresh process under torch's built-in CUDA caching allocator (cudapool
is never imported there, and PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF are cleared, so the
allocator runs with its defaults) while ``torch.cuda.memory._record_memory_history`` records
every allocation, free and segment change; the process dumps the memory snapshot
(``torch.cuda.memory._dump_snapshot``) and reports ``torch.cuda.max_memory_reserved()`` and
its cudaMalloc count (``memory_stats()["num_device_alloc"]``, or the snapshot's
``segment_alloc`` entries where torch has no such counter). Recording starts in a process
whose allocator holds nothing yet, before any tensor exists, so the snapshot holds the whole
run (no frees of blocks allocated before it).

This process then reads each snapshot with ``cudapool.lab.trace.load`` and replays it through the
real C pool on a simulated device with the policy ``builtin`` (the built-in allocator's
default rules) and ``cudapool``, and prints one row per workload: trace events, the real peak
reserved bytes, the peak rebuilt from the snapshot's segment events, the replayed peak and
its relative error against the real one, the device allocations of both, and cudapool's peak.

Workloads (fixed seeds):

- ``transformer``: a transformer encoder trained with AdamW under bf16 autocast, the sequence
  length of each step drawn from 64..512 (20 steps);
- ``cnn``: a small convolutional network with batch norm, SGD with momentum, the image size
  of each step drawn from 64..224 px (12 steps);
- ``random``: 3000 operations of ``torch.empty`` / free, sizes log-uniform from 512 B to
  128 MiB, random lifetimes, a fifth of the allocations on a second stream, at most 8 GiB
  live.

Without torch or a CUDA GPU it prints "no CUDA GPU: skipped" and exits 0 (with --json PATH it
writes {"skipped": reason} there). It exits 1 when a run or a replay fails (the other
workloads still run and print), 2 on bad arguments. About a minute on one H200.

    python3 benchmarks/builtin_fidelity.py
    python3 benchmarks/builtin_fidelity.py --workloads transformer --json build/fidelity.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_common import skipped_without_gpu, write_json  # noqa: E402
from _gpu_common import tail as _tail

WORKLOADS = ("transformer", "cnn", "random")
RESULT_PREFIX = "FIDELITY_RESULT "
MiB = 1 << 20
GiB = 1 << 30

#: Settings that would take the built-in allocator off its defaults: cleared in the runs.
ALLOCATOR_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING")


# --------------------------------------------------------------------------------------------
# The workloads (run in the child process, under the built-in allocator)
# --------------------------------------------------------------------------------------------


def _transformer(torch, args: argparse.Namespace) -> Dict[str, Any]:
    import random

    import torch.nn as nn
    import torch.nn.functional as F

    d_model, heads, layers, vocab, batch = 512, 8, 6, 8192, 32
    rng = random.Random(args.seed)
    lengths = [rng.randint(64, 512) for _ in range(args.steps)]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            layer = nn.TransformerEncoderLayer(
                d_model, heads, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True, norm_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, tokens):
            return self.head(self.norm(self.encoder(self.embed(tokens))))

    model = Model().to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    use_amp = torch.cuda.is_bf16_supported()
    for length in lengths:
        tokens = torch.randint(0, vocab, (batch, length + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del logits, tokens, loss
    return {
        "what": f"TransformerEncoder d_model={d_model} heads={heads} layers={layers} vocab={vocab}, "
        f"batch {batch}, seq 64..512, AdamW, {'bf16 autocast' if use_amp else 'float32'}",
        "steps": args.steps,
        "seq_lengths": lengths,
    }


def _cnn(torch, args: argparse.Namespace) -> Dict[str, Any]:
    import random

    import torch.nn as nn
    import torch.nn.functional as F

    batch, classes, steps = 64, 100, max(1, (args.steps * 3) // 5)
    rng = random.Random(args.seed + 1)
    sizes = [16 * rng.randint(4, 14) for _ in range(steps)]

    def block(cin: int, cout: int, stride: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
        )

    model = nn.Sequential(
        block(3, 32, 1),
        block(32, 64, 2),
        block(64, 64, 1),
        block(64, 128, 2),
        block(128, 128, 1),
        block(128, 256, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(256, classes),
    ).to("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for px in sizes:
        images = torch.randn(batch, 3, px, px, device="cuda")
        labels = torch.randint(0, classes, (batch,), device="cuda")
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del images, labels, loss
    return {
        "what": f"6 conv+BN+ReLU blocks (32..256 channels), batch {batch}, image 64..224 px, SGD momentum, float32",
        "steps": steps,
        "image_px": sizes,
    }


def _random(torch, args: argparse.Namespace) -> Dict[str, Any]:
    import random

    ops, cap, side_share = 3000, 8 * GiB, 0.2
    rng = random.Random(args.seed + 2)
    side = torch.cuda.Stream()
    live: List[Any] = []
    live_bytes = allocs = on_side = 0
    for _ in range(ops):
        if live and (live_bytes > cap or rng.random() < 0.4):
            live_bytes -= live.pop(rng.randrange(len(live))).numel()  # the last reference: freed
            continue
        size = int(2 ** rng.uniform(9, 27))
        if rng.random() < side_share:
            with torch.cuda.stream(side):
                live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            on_side += 1
        else:
            live.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        live_bytes += size
        allocs += 1
    live.clear()
    return {
        "what": f"{ops} torch.empty/free operations, sizes 512 B..128 MiB log-uniform, random lifetimes, "
        f"{side_share:.0%} on a second stream, at most {cap // GiB} GiB live",
        "allocations": allocs,
        "on_second_stream": on_side,
    }


_WORKLOAD_FUNCS = {"transformer": _transformer, "cnn": _cnn, "random": _random}


def _start_recording(torch, max_entries: int) -> str:
    """Record every alloc/free/segment event, without tracebacks (cheap). torch >= 2.1 takes
    enabled="all" and context/stacks/max_entries; torch 2.0 takes enabled=True and
    trace_alloc_max_entries (newer versions still accept that form when enabled is a bool)."""
    record = torch.cuda.memory._record_memory_history
    try:
        try:
            record("all", context=None, stacks="python", max_entries=max_entries)
        except RuntimeError:  # a torch that wants tracebacks with the history
            record("all", context="alloc", stacks="python", max_entries=max_entries)
        return "all"
    except TypeError:
        record(True, trace_alloc_max_entries=max_entries, trace_alloc_record_context=False)
        return "legacy"


def _stop_recording(torch, style: str) -> None:
    torch.cuda.memory._record_memory_history(None if style == "all" else False)


def _dump_snapshot(torch, path: str) -> None:
    dump = getattr(torch.cuda.memory, "_dump_snapshot", None)
    if dump is not None:
        dump(path)
    else:  # older torch: the same pickle by hand
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)


def _snapshot_counts(path: str) -> Dict[str, Any]:
    """What the snapshot this process just wrote says about the allocator's segments."""
    with open(path, "rb") as f:
        snap = pickle.load(f)  # our own file
    counts: Dict[str, int] = {}
    entries = 0
    for trace in snap.get("device_traces", []):
        entries += len(trace)
        for entry in trace:
            action = entry.get("action")
            if isinstance(action, str) and action.startswith("segment_"):
                counts[action] = counts.get(action, 0) + 1
    segments = snap.get("segments", [])
    return {
        "trace_entries": entries,
        "segment_alloc": counts.get("segment_alloc", 0),
        "segment_free": counts.get("segment_free", 0),
        "segment_map": counts.get("segment_map", 0),
        "segment_unmap": counts.get("segment_unmap", 0),
        "segments_at_dump": len(segments),
        "expandable_segments": any(bool(s.get("is_expandable")) for s in segments),
    }


def run_worker(args: argparse.Namespace) -> int:
    """One workload under the built-in allocator, recorded; prints one result line."""
    if "cudapool" in sys.modules:
        print("builtin_fidelity: cudapool is imported in the built-in allocator's run", file=sys.stderr)
        return 1
    import torch

    torch.manual_seed(args.seed)
    torch.cuda.init()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    reserved_at_start = int(torch.cuda.memory_reserved())
    style = _start_recording(torch, args.max_entries)

    t0 = time.perf_counter()
    info = _WORKLOAD_FUNCS[args.worker](torch, args)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0

    stats = torch.cuda.memory_stats()
    _dump_snapshot(torch, args.snapshot)
    _stop_recording(torch, style)
    counts = _snapshot_counts(args.snapshot)
    try:
        backend = torch.cuda.get_allocator_backend()
    except Exception:  # older torch
        backend = None
    num_device_alloc = stats.get("num_device_alloc")
    result = {
        "workload": args.worker,
        **info,
        "seed": args.seed,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "allocator_backend": backend,
        "recording": style,
        "max_entries": args.max_entries,
        "seconds": seconds,
        "reserved_at_start": reserved_at_start,
        "peak_reserved": int(torch.cuda.max_memory_reserved()),
        "peak_allocated": int(torch.cuda.max_memory_allocated()),
        "reserved_end": int(torch.cuda.memory_reserved()),
        "num_device_alloc": None if num_device_alloc is None else int(num_device_alloc),
        "num_device_free": None if stats.get("num_device_free") is None else int(stats["num_device_free"]),
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
        "snapshot": counts,
        "history_wrapped": counts["trace_entries"] >= args.max_entries,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# The driver (parent process)
# --------------------------------------------------------------------------------------------


class RunFailed(Exception):
    pass


def child_env() -> Dict[str, str]:
    """This process's environment, less the settings that would change the built-in
    allocator's rules."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ALLOCATOR_SETTINGS:
        env.pop(name, None)
    return env


def run_child(workload: str, snapshot: Path, args: argparse.Namespace) -> Dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        workload,
        "--snapshot",
        str(snapshot),
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
        "--max-entries",
        str(args.max_entries),
    ]
    try:
        proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        raise RunFailed(f"{workload}: timed out after {args.timeout} s\n{_tail(exc.stdout)}\n{_tail(exc.stderr)}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        what = f"exited with status {proc.returncode}" if proc.returncode else "printed no result"
        raise RunFailed(
            f"{workload}: {what}\n--- stdout ---\n{_tail(proc.stdout)}\n--- stderr ---\n{_tail(proc.stderr)}"
        )
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def _rel(value: Optional[int], reference: Optional[int]) -> Optional[float]:
    if value is None or not reference:
        return None
    return (value - reference) / reference


def compare(workload: str, snapshot: "os.PathLike[str] | str", real: Dict[str, Any]) -> Dict[str, Any]:
    """Replay ``snapshot`` under the policies builtin and cudapool and set the results beside
    ``real`` (the recorded run's figures: peak_reserved, peak_allocated, num_device_alloc or
    snapshot.segment_alloc). One row of the table, as a dict."""
    from cudapool.lab.replay import replay
    from cudapool.lab.trace import load

    trace = load(snapshot)
    builtin = replay(trace, policy="builtin")
    ours = replay(trace, policy="cudapool")
    real_allocs = real.get("num_device_alloc")
    if real_allocs is None:
        real_allocs = (real.get("snapshot") or {}).get("segment_alloc")
    real_reserved = real.get("peak_reserved")
    meta = trace.meta if isinstance(trace.meta, dict) else {}
    return {
        "workload": workload,
        "events": len(trace),
        "bad_events": builtin["bad_events"],
        "frees_without_alloc": meta.get("frees_without_alloc"),
        "real_peak_reserved": real_reserved,
        "snapshot_peak_reserved": builtin["builtin_peak_reserved"],
        "snapshot_error": _rel(builtin["builtin_peak_reserved"], real_reserved),
        "replay_peak_reserved": builtin["peak_reserved"],
        "relative_error": _rel(builtin["peak_reserved"], real_reserved),
        "real_peak_allocated": real.get("peak_allocated"),
        "replay_peak_allocated": builtin["peak_allocated"],
        "real_device_allocs": real_allocs,
        "replay_device_allocs": builtin["device_allocs"],
        "replay_device_frees": builtin["device_frees"],
        "replay_oom": builtin["oom"],
        "cudapool_peak_reserved": ours["peak_reserved"],
        "cudapool_device_allocs": ours["device_allocs"],
        "cudapool_vs_real": _rel(ours["peak_reserved"], real_reserved),
    }


def _mib(value: Optional[int]) -> str:
    return "—" if value is None else f"{value / MiB:.1f}"


def _pct(value: Optional[float]) -> str:
    return "—" if value is None else f"{value * 100:+.2f} %"


def markdown_table(rows: List[Dict[str, Any]]) -> str:
    lines = [
        "| workload | events | real builtin peak reserved (MiB) | from snapshot segments (MiB) "
        "| replayed builtin (MiB) | relative error | device allocs real / replayed "
        "| peak allocated real / replayed (MiB) | cudapool peak reserved (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        allocs = f"{'—' if r['real_device_allocs'] is None else r['real_device_allocs']} / {r['replay_device_allocs']}"
        allocated = f"{_mib(r['real_peak_allocated'])} / {_mib(r['replay_peak_allocated'])}"
        cudapool = f"{_mib(r['cudapool_peak_reserved'])} ({_pct(r['cudapool_vs_real'])})"
        lines.append(
            f"| {r['workload']} | {r['events']:,} | {_mib(r['real_peak_reserved'])} "
            f"| {_mib(r['snapshot_peak_reserved'])} | {_mib(r['replay_peak_reserved'])} "
            f"| {_pct(r['relative_error'])} | {allocs} | {allocated} | {cudapool} |"
        )
    return "\n".join(lines)


def notes(rows: List[Dict[str, Any]], runs: Dict[str, Dict[str, Any]]) -> List[str]:
    """What makes a row less than a clean comparison."""
    out = []
    for r in rows:
        run = runs.get(r["workload"], {})
        name = r["workload"]
        if r["bad_events"] or r["frees_without_alloc"]:
            out.append(
                f"{name}: {r['bad_events']} bad event(s), {r['frees_without_alloc']} free(s) without an "
                f"alloc: the snapshot does not hold the whole run"
            )
        if run.get("history_wrapped"):
            out.append(f"{name}: the history filled its {run['max_entries']:,} entries: raise --max-entries")
        if run.get("reserved_at_start"):
            out.append(f"{name}: {run['reserved_at_start']:,} B were reserved before recording started")
        snap = run.get("snapshot") or {}
        if snap.get("expandable_segments") or snap.get("segment_map"):
            out.append(
                f"{name}: the built-in allocator used expandable segments (segment_map events): "
                f"the builtin policy models the default, non-expandable segments"
            )
        if r["snapshot_error"]:
            out.append(
                f"{name}: the peak rebuilt from the snapshot's segment events differs from "
                f"max_memory_reserved() by {_pct(r['snapshot_error'])}"
            )
        if run.get("num_alloc_retries") or run.get("num_ooms"):
            out.append(f"{name}: the real run had {run['num_alloc_retries']} alloc retries and {run['num_ooms']} OOMs")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)"
    )
    p.add_argument(
        "--steps", type=int, default=20, help="transformer training steps (default 20; the CNN runs 3/5 as many)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-entries", type=int, default=2_000_000, help="the memory history's length (default 2000000)")
    p.add_argument("--timeout", type=int, default=120, help="seconds allowed per workload run (default 120)")
    p.add_argument("--keep-snapshots", metavar="DIR", help="keep the snapshot pickles in DIR")
    p.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    p.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    p.add_argument("--snapshot", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workload_list if w not in WORKLOADS]
    if unknown or not args.workload_list:
        p.error(f"--workloads: unknown {', '.join(unknown) or '(none given)'} (known: {', '.join(WORKLOADS)})")
    if args.steps < 1 or args.max_entries < 1000 or args.timeout < 1:
        p.error("need --steps >= 1, --max-entries >= 1000 and --timeout >= 1")
    if args.worker and not args.snapshot:
        p.error("--worker needs --snapshot")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)

    if skipped_without_gpu("builtin_fidelity", args.json):
        return 0

    try:
        try:
            import cudapool.lab.replay  # noqa: F401  (the replays below; checked before any GPU time is spent)
        except ImportError:  # not installed: the in-place build
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
            import cudapool.lab.replay  # noqa: F401
    except Exception as exc:
        print(
            f"builtin_fidelity: cannot import cudapool.lab.replay ({exc.__class__.__name__}: {exc}); "
            f"install cudapool first (pip install -e .)",
            file=sys.stderr,
        )
        write_json(args.json, {"error": f"cudapool.lab.replay is not importable: {exc}"})
        return 1

    cleared = {name: os.environ[name] for name in ALLOCATOR_SETTINGS if name in os.environ}
    if cleared:
        print(f"builtin_fidelity: cleared for the recorded runs: {cleared}", file=sys.stderr)
    settings = {
        "workloads": args.workload_list,
        "steps": args.steps,
        "seed": args.seed,
        "max_entries": args.max_entries,
        "cleared_environment": cleared,
    }
    runs: Dict[str, Dict[str, Any]] = {}
    rows: List[Dict[str, Any]] = []
    errors: Dict[str, str] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="builtin-fidelity-") as tmp:
        where = Path(args.keep_snapshots) if args.keep_snapshots else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        for workload in args.workload_list:
            snapshot = where / f"{workload}.pickle"
            print(f"builtin_fidelity: running {workload} ...", file=sys.stderr, flush=True)
            try:
                runs[workload] = run_child(workload, snapshot, args)
            except RunFailed as exc:
                print(f"builtin_fidelity: run failed: {exc}", file=sys.stderr)
                errors[workload] = str(exc)
                continue
            try:
                rows.append(compare(workload, snapshot, runs[workload]))
            except Exception as exc:  # a snapshot the loader refuses, a pool checker violation
                message = f"{workload}: replay failed: {exc.__class__.__name__}: {exc}"
                print(f"builtin_fidelity: {message}", file=sys.stderr)
                errors[workload] = message

    first = next(iter(runs.values()), {})
    print(
        f"builtin replay fidelity: {first.get('device', '?')}, torch {first.get('torch', '?')} "
        f"(CUDA {first.get('cuda', '?')}), Python {platform.python_version()}, seed {args.seed}, "
        f"{time.perf_counter() - t0:.0f} s"
    )
    for workload, run in runs.items():
        print(f"  {workload}: {run['what']} ({run['seconds']:.1f} s recorded)")
    print()
    if rows:
        print(markdown_table(rows))
        print()
        worst = max(rows, key=lambda r: abs(r["relative_error"] or 0.0))
        print(
            f"largest |relative error| of the replayed builtin peak reserved: "
            f"{_pct(worst['relative_error'])} ({worst['workload']})"
        )
        for line in notes(rows, runs):
            print(f"note: {line}")
    for workload, message in errors.items():
        print(f"FAILED: {message.splitlines()[0]}")
    write_json(args.json, {"settings": settings, "rows": rows, "runs": runs, "errors": errors})
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

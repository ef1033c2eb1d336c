"""Shared pieces of the workload scripts: making cudapool importable, trace figures, the CLI,
drawing varying shapes, optimizers and the traced training loop."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]


def ensure_cudapool() -> None:
    """Make ``import cudapool`` work from a source checkout that is not installed."""
    try:
        import cudapool.lab.trace  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "python"))
        import cudapool.lab.trace  # noqa: F401


ensure_cudapool()

from cudapool._units import format_bytes  # noqa: E402
from cudapool.lab.trace import ALLOC, Trace, save  # noqa: E402


def peak_live_bytes(trace: Trace) -> int:
    """The most bytes live at once over the trace (frees of unknown ids are ignored)."""
    live: Dict[Tuple[int, int], int] = {}
    cur = peak = 0
    for action, ident, size, _stream, device, _t in trace:
        key = (device, ident)
        if action == ALLOC:
            live[key] = size
            cur += size
            if cur > peak:
                peak = cur
        else:
            cur -= live.pop(key, 0)
    return peak


def counts(trace: Trace) -> Tuple[int, int]:
    """(allocations, frees) in the trace."""
    allocs = sum(1 for e in trace if e[0] == ALLOC)
    return allocs, len(trace) - allocs


def pick(scales: Dict[str, Dict[str, Any]], scale: str, overrides: Dict[str, Any]) -> Dict[str, Any]:
    """The settings of ``scale`` with the non-None ``overrides`` on top."""
    if scale not in scales:
        raise ValueError(f"unknown scale {scale!r} (one of: {', '.join(scales)})")
    cfg = dict(scales[scale])
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))} (known: {', '.join(cfg)})")
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


def draw_multiple(rng: random.Random, lo: int, hi: int, multiple: int) -> int:
    """A multiple of ``multiple`` in ``lo..hi`` drawn uniformly by ``rng`` (lo rounded up, hi down)."""
    a, b = -(-lo // multiple), hi // multiple
    if not 1 <= a <= b:
        raise ValueError(f"no multiple of {multiple} in {lo}..{hi}")
    return multiple * rng.randint(a, b)


def check_range(cfg: Dict[str, Any], lo: str, hi: str, least: int = 1) -> None:
    """Raise ValueError unless ``least <= cfg[lo] <= cfg[hi]``."""
    if not least <= cfg[lo] <= cfg[hi]:
        raise ValueError(f"need {least} <= {lo} <= {hi}, got {cfg[lo]}, {cfg[hi]}")


def make_optimizer(kind: str, params: Any, lr: float, weight_decay: float = 0.0) -> Any:
    """A torch optimizer by name, with ``foreach=True`` (the implementation it picks on CUDA):
    adamw, adam, sgd (momentum 0.9), rmsprop (momentum 0.9) or adagrad."""
    import torch

    makers: Dict[str, Callable[[], Any]] = {
        "adamw": lambda: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True),
        "adam": lambda: torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, foreach=True),
        "sgd": lambda: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay, foreach=True),
        "rmsprop": lambda: torch.optim.RMSprop(params, lr=lr, momentum=0.9, weight_decay=weight_decay, foreach=True),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay, foreach=True),
    }
    if kind not in makers:
        raise ValueError(f"unknown optimizer {kind!r} (one of: {', '.join(makers)})")
    return makers[kind]()


def tracer_kw(device: str) -> Dict[str, Any]:
    """The Tracer's options for a workload's device: "cuda" is always fake CUDA tensors (CUDA's
    kernel choices, such as the fused RMSNorm and autocast's rules, without using a GPU even
    where there is one); "meta" and "cpu" trace those devices."""
    return {"fake": True} if device == "cuda" else {}


def capture_training(
    name: str,
    scale: str,
    seed: int,
    cfg: Dict[str, Any],
    build: Callable[[str], Tuple[Any, Any]],
    batches: Iterable[Any],
    loss_of: Callable[[Any, Any], Any],
    clip: Optional[float] = None,
    **meta: Any,
) -> Trace:
    """Trace a training run: ``build(device) -> (model, optimizer)``, then for each item of
    ``batches`` one step: ``loss_of(model, item)`` (which makes its inputs; they die when it
    returns, unless autograd saved them), backward, the gradients clipped to norm ``clip`` when
    it is given (``clip_grad_norm_``), the optimizer's step, gradients set to None.

    Runs under ``Tracer(device=cfg["device"])`` (fake CUDA for "cuda": see :func:`tracer_kw`)
    with ``torch.manual_seed(seed)``; the model and
    the optimizer are built inside, so their allocations are in the trace, and dropped at the
    end. The trace's meta: workload, scale, seed, config and ``meta``.
    """
    import torch
    from cudapool.fakegpu.tracer import Tracer

    torch.manual_seed(seed)
    with Tracer(device=cfg["device"], **tracer_kw(cfg["device"])) as tr:
        model, opt = build(cfg["device"])
        for item in batches:
            loss = loss_of(model, item)
            loss.backward()
            del loss
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        del model, opt
    return tr.trace(meta={"workload": name, "scale": scale, "seed": seed, "config": cfg, **meta})


def main(
    name: str,
    capture: Callable[..., Trace],
    scales: Dict[str, Dict[str, Any]],
    doc: Optional[str],
    argv: Optional[List[str]] = None,
    torch_device: bool = True,
) -> int:
    """Command line of one workload: one flag per setting of its scales, --scale, --seed, --out.

    Prints the event count, allocations and frees, peak live bytes and the capture time.
    """
    p = argparse.ArgumentParser(prog=f"{name}.py", description=(doc or "").split("\n\n")[0])
    p.add_argument("--scale", default="small", choices=list(scales), help="preset (default: small)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="PATH", help="write the trace there (.cptrace)")
    if torch_device:
        p.add_argument(
            "--device",
            choices=["cuda", "meta", "cpu"],
            help="fake CUDA tensors (CUDA's kernel choices, no GPU used; default), meta (no math) or cpu (real math)",
        )
    sample = scales["small"]
    for key, value in sample.items():
        if key == "device":
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, dest=key, type=lambda s: s.lower() in ("1", "true", "yes", "on"), metavar="BOOL")
        elif isinstance(value, tuple):
            p.add_argument(flag, dest=key, type=lambda s: tuple(int(x) for x in s.split(",")), metavar="A,B")
        else:
            p.add_argument(flag, dest=key, type=type(value))
    args = p.parse_args(argv)
    kw = {k: getattr(args, k) for k in sample if getattr(args, k, None) is not None}
    t0 = time.perf_counter()
    trace = capture(scale=args.scale, seed=args.seed, **kw)
    secs = time.perf_counter() - t0
    allocs, frees = counts(trace)
    peak = peak_live_bytes(trace)
    changed = " ".join(f"{k}={v}" for k, v in kw.items() if scales[args.scale].get(k) != v)
    print(
        f"{name}: scale={args.scale}{' ' + changed if changed else ''} seed={args.seed} "
        f"events={len(trace)} allocs={allocs} frees={frees}"
    )
    print(f"{name}: peak live bytes={peak} ({format_bytes(peak, largest='GiB')}) capture_s={secs:.2f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        save(trace, args.out)
        print(f"{name}: wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    return 0

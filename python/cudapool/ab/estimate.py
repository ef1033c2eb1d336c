"""``ab --simulate`` from Python: will this function or script fit on that GPU, and under which
allocator? For a notebook, without a GPU.

    from cudapool.ab.estimate import estimate_memory

    def step():
        model = torch.nn.Linear(4096, 4096).cuda()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            model(torch.randn(512, 4096, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()

    est = estimate_memory(step, gpu="24GB")
    est                           # the table and the notes, as the command prints them
    est.fits["builtin"]           # True
    est.peak_allocated["cudapool"]
    est.to_dict()                 # every figure, as --json writes it

A script (a path) runs as ``python -m cudapool ab --simulate`` runs it: in a fresh process,
unchanged, with its own arguments (``args``). A function runs in this process, inside a fake
GPU, with ``args`` and ``kwargs``; its CUDA tensors are fake (no memory, no math), and they are
gone when it returns. What the real GPU of this process sees, if it has one: nothing. Where
CUDA is already initialised here (a notebook that used the GPU) or a CUDA driver is present, the
function is traced on torch's fake tensors (``engine="python"``), which never call the device;
elsewhere on cudapool's native fake GPU, whose changes to torch are all undone on return.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .. import _C
from . import common
from .sim_report import report
from .simulate import SimOptions, predict_one_gpu, run

__all__ = ["MemoryEstimate", "estimate_memory"]


class MemoryEstimate:
    """What :func:`estimate_memory` predicted: per allocator (the keys), the peak allocated and
    reserved bytes, whether the run fits on the GPU, and the smallest GPU memory it runs on;
    the notes; ``to_dict()`` for everything. Every figure is a prediction."""

    def __init__(self, result: Dict[str, Any]) -> None:
        self._result = result
        rows = [r for r in result.get("rows", []) if r.get("simulated")]
        self.gpu: str = result["gpu"]["name"]
        self.peak_allocated: Dict[str, int] = {r["allocator"]: int(r["peak_allocated"]) for r in rows}
        self.peak_reserved: Dict[str, int] = {r["allocator"]: int(r["peak_reserved"]) for r in rows}
        self.fits: Dict[str, bool] = {r["allocator"]: bool(r["fits"]) for r in rows}
        self.smallest_gpu: Dict[str, Optional[int]] = {r["allocator"]: r["min_capacity"] for r in rows}
        self.outside: int = int((result.get("outside") or {}).get("total", 0))
        text = report(result)
        self.notes: List[str] = [line[len("note: ") :] for line in text.splitlines() if line.startswith("note: ")]
        self._text = text

    def to_dict(self) -> Dict[str, Any]:
        """Every figure, as ``ab --simulate --json`` writes them."""
        return {k: v for k, v in self._result.items() if k != "cells"}

    def __repr__(self) -> str:
        return self._text.split("\n", 1)[1] if self._text.startswith("python -m") else self._text


def estimate_memory(
    target: Union[str, "os.PathLike[str]", Callable[..., Any]],
    *args: Any,
    gpu: str = "H100",
    allocators: str = "builtin,expandable,cudapool",
    max_steps: Optional[int] = None,
    outside: Optional[Union[int, str]] = None,
    engine: str = "auto",
    quiet: bool = False,
    **kwargs: Any,
) -> MemoryEstimate:
    """Predict the GPU memory of ``target`` on ``gpu`` (a model name or a size) under each of
    ``allocators`` (as ``--allocators``): a script's path (run with ``args``, its command-line
    arguments, in a fresh process) or a function (called with ``args`` and ``kwargs`` in this
    process, on a fake GPU). ``max_steps``: stop after that many steps (optimizer steps or
    ``cudapool.ab.step()`` marks); ``outside``: the memory set aside outside PyTorch's
    allocator (bytes or "1GiB"; default the CUDA context's estimate); ``quiet``: no progress
    lines. ValueError for a bad argument; RuntimeError when the target cannot be traced (the
    message names the line and why)."""
    from .._units import parse_size
    from ..fakegpu import gpu_model

    gpu_model(gpu)  # ValueError naming the known models
    rows = common.parse_allocators(allocators)
    given = None if outside is None else parse_size(outside)
    if max_steps is not None and max_steps < 1:
        raise ValueError("max_steps must be at least 1")
    progress = (lambda line: None) if quiet else common.progress_printer("cudapool estimate_memory: ")
    if callable(target):
        result = _trace_function(target, args, kwargs, gpu, rows, max_steps, given, engine, progress)
    else:
        script = os.fspath(target)
        if not os.path.isfile(script):
            raise ValueError(f"cannot run {script!r}: no such file")
        if kwargs:
            raise ValueError(f"a script takes its arguments as strings in args, not {sorted(kwargs)}")
        opts = _options(gpu, rows, max_steps, script, [str(a) for a in args], engine, given, hide_output=quiet)
        result = run(opts, progress)
    if "rows" not in result:
        raise RuntimeError(
            f"cudapool could not trace {getattr(target, '__name__', target)}: {result['trace'].get('message')}"
        )
    return MemoryEstimate(result)


def _options(
    gpu: str,
    allocators: List[common.Allocator],
    max_steps: Optional[int],
    script: str,
    args: List[str],
    engine: str,
    outside: Optional[int],
    hide_output: bool = True,
) -> SimOptions:
    return SimOptions(
        gpu=gpu,
        allocators=allocators,
        json=None,
        max_steps=max_steps,
        strict_values=False,
        find_max_batch=None,
        max_batch_range=common.DEFAULT_RANGE,
        max_batch_step=None,
        hide_output=hide_output,
        timeout=None,
        trace=None,
        script=script,
        args=args,
        engine=engine,
        outside=outside,
    )


def _native_is_safe() -> bool:
    """The native fake GPU patches torch's CUDA hooks while it runs: not in a process whose real
    GPU is in use or could be."""
    import torch

    return not torch.cuda.is_initialized() and not _C.cuda_info().get("available")


def _trace_function(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Dict[str, Any],
    gpu: str,
    allocators: List[common.Allocator],
    max_steps: Optional[int],
    outside: Optional[int],
    engine: str,
    progress: Callable[[str], None],
) -> Dict[str, Any]:
    """Trace ``fn(*args, **kwargs)`` in this process and replay it under each allocator: the
    result as :func:`cudapool.ab.simulate.run` makes it for a script."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from ..fakegpu import FakeGPU, explain_failure, gpu_model, resolve_engine

    model = gpu_model(gpu)
    if engine == "auto":
        engine = "native" if resolve_engine("auto") == "native" and _native_is_safe() else "python"
    fake = FakeGPU(model, engine=engine)
    counts = {"steps": 0}

    class _Enough(Exception):
        pass

    def on_step(optimizer: Any, *a: Any, **k: Any) -> None:
        counts["steps"] += 1
        if max_steps is not None and counts["steps"] >= max_steps:
            raise _Enough()

    hook = register_optimizer_step_post_hook(on_step)
    name = getattr(fn, "__qualname__", repr(fn))
    progress(f"tracing {name} on a simulated {model.name} ...")
    start = time.monotonic()
    status, message = "finished", None
    try:
        with fake:
            try:
                fn(*args, **kwargs)
            except _Enough:
                status = "stopped"
    except Exception as exc:  # noqa: BLE001 - one line naming the place, as the command says it
        status, message = "failed", explain_failure(exc, getattr(getattr(fn, "__code__", None), "co_filename", "<fn>"))
    finally:
        hook.remove()
    seconds = time.monotonic() - start
    trace_result: Dict[str, Any] = {
        "status": status,
        "message": message,
        "steps": 0,
        "optimizer_steps": counts["steps"],
        "events": len(fake.tracer.events),
        "peak_allocated": fake.tracer.peak_bytes,
        "seconds": seconds,
        "fake_gpu": fake.summary(),
    }
    result: Dict[str, Any] = {
        "argv": [name],
        "predicted": True,
        "gpu": model._asdict(),
        "options": {
            "gpu": gpu,
            "allocators": [a._asdict() for a in allocators],
            "max_steps": max_steps,
            "engine": engine,
            "outside": outside,
            "function": True,
        },
        "trace": trace_result,
    }
    if status == "failed":
        return result
    trace = fake.tracer.trace(meta={"function": name, "gpu": model.name})
    opts = _options(gpu, allocators, max_steps, name, [], engine, outside)
    result.update(predict_one_gpu(opts, model, trace_result, trace, progress), max_batch=None)
    return result

"""The child of ``python -m cudapool ab --simulate``: one trace of the user's script on a fake GPU.

    python -m cudapool.ab.sim_child --gpu H100 --out DIR [--max-steps N] [--strict-values] \\
        [--engine auto|native|python] -- SCRIPT [ARGS...]

Runs SCRIPT unchanged as ``__main__``, with ``sys.argv = [SCRIPT, *ARGS]`` and its directory
first on ``sys.path``, inside :class:`cudapool.fakegpu.FakeGPU` (fake CUDA tensors, the
GPU's ``torch.cuda`` answers, the tracer recording), and writes ``DIR/trace.cptrace`` and
``DIR/result.json``: ``status`` ("finished", "stopped" after ``--max-steps``, "exit" with the
script's ``exit_code``, or "failed" with ``message``: the operation and the script's line),
or "script_error" with ``message``: an exception of the script's own code, its line),
``steps`` (``cudapool.ab.step()`` marks), ``optimizer_steps``, ``events``, ``peak_allocated``,
``seconds`` and what the fake GPU noticed (value reads, ``torch.compile`` calls). A progress
line (steps, events, elapsed) goes to stderr while it traces. Exit status 0 when a trace was
written, 3 when the script failed, 2 on a bad command line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import runpy
import sys
import threading
import time
from typing import Any, Dict, List, Optional

EXIT_FAILED = 3


class _Stop(BaseException):
    """Raised at the step that ends a ``--max-steps`` run (not an Exception: the script's own
    ``except Exception`` does not catch it)."""


class _Counter:
    def __init__(self, max_steps: Optional[int]) -> None:
        self.max_steps = max_steps
        self.steps = 0
        self.optimizer_steps = 0

    def done(self) -> int:
        return max(self.steps, self.optimizer_steps)

    def check(self) -> None:
        if self.max_steps is not None and self.done() >= self.max_steps:
            raise _Stop()


def _progress(tracer: Any, counter: _Counter, start: float, stop: threading.Event) -> None:
    tty = sys.stderr.isatty()
    last = ""
    while not stop.wait(0.5 if tty else 5.0):
        last = (
            f"cudapool ab --simulate: tracing: {counter.done():,} steps, {len(tracer.events):,} events, "
            f"{time.monotonic() - start:.1f} s"
        )
        sys.stderr.write(("\r\033[K" + last) if tty else last + "\n")
        sys.stderr.flush()
    if tty and last:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


def trace_script(
    script: str,
    args: List[str],
    gpu: str,
    out_dir: str,
    max_steps: Optional[int] = None,
    strict_values: bool = False,
    engine: str = "auto",
) -> Dict[str, Any]:
    """Trace ``script`` on a fake ``gpu`` into ``out_dir``; the result (also written as
    result.json). Runs in this process: the command starts a fresh one for each trace."""

    import cudapool.ab as ab
    from cudapool.fakegpu import FakeGPU, explain_failure, gpu_model, script_error
    from cudapool.lab.trace import save

    model = gpu_model(gpu)
    counter = _Counter(max_steps)
    fake = FakeGPU(model, strict_values=strict_values, script=script, engine=engine)

    def on_step() -> None:
        counter.steps += 1
        counter.check()

    def on_optimizer_step(optimizer: Any, *a: Any, **k: Any) -> None:
        counter.optimizer_steps += 1
        counter.check()

    result: Dict[str, Any] = {"script": script, "args": args, "gpu": model._asdict(), "max_steps": max_steps}
    script_dir = os.path.dirname(os.path.abspath(script))
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *args]
    sys.path.insert(0, script_dir)
    original_step = ab.step
    ab.step = on_step
    from torch.optim.optimizer import register_optimizer_step_post_hook

    hook = register_optimizer_step_post_hook(on_optimizer_step)
    start = time.monotonic()
    stop = threading.Event()
    shown = threading.Thread(target=_progress, args=(fake.tracer, counter, start, stop), daemon=True)
    shown.start()
    status: str = "finished"
    exit_code: Optional[int] = 0
    message: Optional[str] = None
    try:
        with fake:
            try:
                runpy.run_path(script, run_name="__main__")
            except _Stop:
                status = "stopped"
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if code != 0:
                    status, exit_code = "exit", code
            finally:
                # What the script left as garbage in cycles (a stopped script's frames, through the
                # exception's traceback) is freed while the fake GPU still records, whenever the
                # collector last ran: the trace ends the same whatever Python allocated meanwhile.
                gc.collect()
    except Exception as exc:  # noqa: BLE001 - the script's failure, reported in one line
        own = script_error(exc, script)
        if own is not None:
            status, exit_code, message = "script_error", 1, own
        else:
            status, exit_code, message = "failed", None, explain_failure(exc, script)
    finally:
        stop.set()
        shown.join()
        hook.remove()
        ab.step = original_step
        sys.argv, sys.path[:] = saved_argv, saved_path
    trace = fake.tracer.trace(meta={"script": os.path.basename(script), "args": args, "gpu": model.name})
    os.makedirs(out_dir, exist_ok=True)
    save(trace, os.path.join(out_dir, "trace.cptrace"))
    result.update(
        status=status,
        exit_code=exit_code,
        message=message,
        steps=counter.steps,
        optimizer_steps=counter.optimizer_steps,
        events=len(fake.tracer.events),
        peak_allocated=fake.tracer.peak_bytes,
        seconds=time.monotonic() - start,
        fake_gpu=fake.summary(),
    )
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return result


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m cudapool.ab.sim_child")
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--strict-values", action="store_true")
    parser.add_argument("--engine", choices=("auto", "native", "python"), default="auto")
    if "--" not in argv:
        print("usage: python -m cudapool.ab.sim_child [OPTIONS] -- SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ns = parser.parse_args(argv[:cut])
    rest = argv[cut + 1 :]
    if not rest or not os.path.isfile(rest[0]):
        print(f"cudapool ab --simulate: no script to run: {rest[:1]}", file=sys.stderr)
        return 2
    try:
        result = trace_script(rest[0], rest[1:], ns.gpu, ns.out, ns.max_steps, ns.strict_values, ns.engine)
    except RuntimeError as exc:  # --engine native where it cannot run
        print(f"cudapool ab --simulate: {exc}", file=sys.stderr)
        return 2
    return EXIT_FAILED if result["status"] in ("failed", "script_error") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

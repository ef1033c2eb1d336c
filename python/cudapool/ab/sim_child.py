"""The child of ``python -m cudapool ab --simulate``: one trace of the user's script on a fake GPU.

    python -m cudapool.ab.sim_child --gpu H100 --out DIR [--max-steps N] [--strict-values] \\
        [--engine auto|native|python] [--rank R --nproc-per-node N [--nnodes M]] -- SCRIPT [ARGS...]

Runs SCRIPT unchanged as ``__main__``, with ``sys.argv = [SCRIPT, *ARGS]`` and its directory
first on ``sys.path``, inside :class:`cudapool.fakegpu.FakeGPU` (fake CUDA tensors, the
GPU's ``torch.cuda`` answers, the tracer recording), and writes ``DIR/trace.cptrace`` and
``DIR/result.json``: ``status`` ("finished", "stopped" after ``--max-steps``, "exit" with the
script's ``exit_code``, or "failed" with ``message``: the operation and the script's line),
or "script_error" with ``message``: an exception of the script's own code, its line),
``steps`` (``cudapool.ab.step()`` marks), ``optimizer_steps``, ``events``, ``peak_allocated``,
``seconds`` and what the fake GPU noticed (value reads, ``torch.compile`` calls). With
``--rank``, the script runs as that rank of a torchrun job of ``--nnodes`` nodes of
``--nproc-per-node`` GPUs (:mod:`cudapool.ab.ranks`: torchrun's variables; the fake GPU a node of
that many devices; torch.distributed on :class:`cudapool.fakegpu.distributed.FakeWorld`), and
``world`` in the result says which process groups it was in. A progress
line (steps, events, elapsed) goes to stderr while it traces. Exit status 0 when a trace was
written, 3 when the script failed, 2 on a bad command line.
"""

from __future__ import annotations

import argparse
import gc
import json
import linecache
import os
import runpy
import sys
import threading
import time
import traceback
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


def _progress(fake: Any, counter: _Counter, start: float, stop: threading.Event, err: Any) -> None:
    tty = err.isatty()
    last = ""
    while not stop.wait(0.5 if tty else 5.0):
        compiled = fake.programs.compiled_so_far()
        last = (
            f"cudapool ab --simulate: tracing: {counter.done():,} steps, {len(fake.tracer.events):,} events"
            + ("" if compiled is None else f", {compiled:,} graph(s) compiled by torch.compile")
            + f", {time.monotonic() - start:.1f} s"
        )
        err.write(("\r\033[K" + last) if tty else last + "\n")
        err.flush()
    if tty and last:
        err.write("\r\033[K")
        err.flush()


def trace_script(
    script: str,
    args: List[str],
    gpu: str,
    out_dir: str,
    max_steps: Optional[int] = None,
    strict_values: bool = False,
    engine: str = "auto",
    rank: Optional[int] = None,
    world: Optional[Any] = None,
    where_event: Optional[int] = None,
) -> Dict[str, Any]:
    """Trace ``script`` on a fake ``gpu`` into ``out_dir``; the result (also written as
    result.json). Runs in this process: the command starts a fresh one for each trace. With
    ``rank`` and ``world`` (a :class:`cudapool.ab.ranks.World`), as that rank of that job. With
    ``where_event`` (native engine), the trace is a second look: when its record of that index
    (an allocation) is made, where the script was and how many steps it had done go to
    where.json, and the process ends there."""

    import cudapool.ab as ab
    from cudapool.ab.ranks import TORCHRUN_VARS, rank_env
    from cudapool.fakegpu import FakeGPU, explain_failure, gpu_model, resolve_engine, script_error
    from cudapool.fakegpu.distributed import HOW_TO_GIVE_RANKS, FakeWorld, NoWorld
    from cudapool.lab.trace import save

    model = gpu_model(gpu)
    counter = _Counter(max_steps)
    devices = world.nproc_per_node if world is not None else 1
    # This process traces and ends: the native engine may answer for it whole (pinned memory).
    whole = {"whole_process": True} if resolve_engine(engine) == "native" else {}
    # A rank's files go to its own scratch folder: another rank traced beside it must not read them.
    scratch = os.path.join(out_dir, "files") if world is not None else None
    # The script's own `nvidia-smi` (logging the machine) lists the fake GPU's devices.
    from cudapool.fakegpu import nvidia_smi

    nvidia_smi.install(os.path.join(out_dir, "bin"), model._asdict(), devices)
    fake = FakeGPU(
        model, strict_values=strict_values, script=script, engine=engine, devices=devices, scratch_dir=scratch, **whole
    )
    if world is not None and rank is not None:
        os.environ.update(rank_env(world, rank))
        ranks: Any = FakeWorld(fake, rank=rank, world_size=world.size, local_world_size=world.nproc_per_node)
    else:
        ranks = NoWorld()

    def on_step() -> None:
        counter.steps += 1
        counter.check()

    per_optimizer: Dict[int, int] = {}

    def on_optimizer_step(optimizer: Any, *a: Any, **k: Any) -> None:
        # Steps of the training loop: a loop that steps several optimizers (one per parameter
        # group kind) takes one step of each; the count is the most-stepped optimizer's.
        n = per_optimizer[id(optimizer)] = per_optimizer.get(id(optimizer), 0) + 1
        counter.optimizer_steps = max(counter.optimizer_steps, n)
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
    # The script's stderr (its warnings, torch's messages from C++ too) is its output, as its
    # stdout is: shown after "| " as it comes, hidden by --hide-output, kept in the result. This
    # process's own progress goes to the stderr it was given.
    sys.stdout.flush()
    sys.stderr.flush()
    err_fd = os.dup(2)
    err = os.fdopen(err_fd, "w", buffering=1)
    os.dup2(1, 2)
    saved_stderr = sys.stderr
    sys.stderr = sys.stdout
    shown = threading.Thread(target=_progress, args=(fake, counter, start, stop, err), daemon=True)
    shown.start()
    status: str = "finished"
    exit_code: Optional[int] = 0
    message: Optional[str] = None
    try:
        with fake, ranks:
            if where_event is not None:
                _watch(fake, where_event, script, counter, out_dir)
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
            if world is None and isinstance(exc, KeyError) and exc.args and exc.args[0] in TORCHRUN_VARS:
                own += f" (torchrun sets {exc.args[0]}: {HOW_TO_GIVE_RANKS})"
            status, exit_code, message = "script_error", 1, own
        else:
            status, exit_code, message = "failed", None, explain_failure(exc, script)
    finally:
        stop.set()
        shown.join()
        sys.stdout.flush()
        sys.stderr = saved_stderr
        os.dup2(err_fd, 2)
        err.close()
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
        world=ranks.summary(),
    )
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return result


def site_now(script: str) -> Dict[str, Optional[str]]:
    """Where the script is now: its own line (the innermost frame in the script) and, when the
    innermost frame of its own code is in another of its modules, that line too. From autograd's
    device thread, which runs no frame of the script's, the main thread's (the line that called
    backward)."""
    from cudapool.fakegpu.failures import LIBRARY_DIRS

    script = os.path.abspath(script)
    here = os.path.dirname(script)

    def lines(frame: Any) -> Dict[str, Optional[str]]:
        own: Optional[str] = None
        inner: Optional[str] = None
        for f, lineno in traceback.walk_stack(frame):
            name = os.path.abspath(f.f_code.co_filename)
            code = linecache.getline(name, lineno).strip()
            where = f"{os.path.relpath(name, here)}:{lineno}: `{code}`"
            if inner is None and not name.startswith(LIBRARY_DIRS) and not f.f_code.co_filename.startswith("<"):
                inner = where
            if name == script:
                own = where
                break
        return {"script_line": own, "own_code": inner if inner != own else None}

    try:
        found = lines(sys._getframe(1))
    except ValueError:  # no Python frame on this thread: autograd's device thread
        found = {"script_line": None, "own_code": None}
    if found["script_line"] is None:
        main = sys._current_frames().get(threading.main_thread().ident or -1)
        if main is not None:
            found = lines(main)
    return found


def _watch(fake: Any, index: int, script: str, counter: _Counter, out_dir: str) -> None:
    """Writes where the script is when the trace's record ``index`` is made, and ends the
    process there (:func:`trace_script`'s ``where_event``)."""
    module = getattr(fake.engine.tracer, "module", None)
    if module is None:
        return  # the Python engine: no second look

    def hook() -> None:
        where = dict(site_now(script), event=index, steps_done=counter.done())
        with open(os.path.join(out_dir, "where.json"), "w") as f:
            json.dump(where, f)
        sys.stdout.flush()
        os._exit(0)

    module().watch_record(index, hook)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m cudapool.ab.sim_child")
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--strict-values", action="store_true")
    parser.add_argument("--engine", choices=("auto", "native", "python"), default="auto")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--nproc-per-node", type=int)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--where-event", type=int)
    if "--" not in argv:
        print("usage: python -m cudapool.ab.sim_child [OPTIONS] -- SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ns = parser.parse_args(argv[:cut])
    rest = argv[cut + 1 :]
    if not rest or not os.path.isfile(rest[0]):
        print(f"cudapool ab --simulate: no script to run: {rest[:1]}", file=sys.stderr)
        return 2
    world = None
    if ns.nproc_per_node is not None:
        from cudapool.ab.ranks import World

        world = World(ns.nproc_per_node, ns.nnodes)
        if ns.rank is None or not 0 <= ns.rank < world.size:
            print(f"cudapool ab --simulate: --rank must be in 0..{world.size - 1}", file=sys.stderr)
            return 2
    try:
        result = trace_script(
            rest[0], rest[1:], ns.gpu, ns.out, ns.max_steps, ns.strict_values, ns.engine, ns.rank, world,
            ns.where_event,
        )  # fmt: skip
    except RuntimeError as exc:  # --engine native where it cannot run
        print(f"cudapool ab --simulate: {exc}", file=sys.stderr)
        return 2
    return EXIT_FAILED if result["status"] in ("failed", "script_error") else 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # The result is written: the process ends here, without the interpreter's shutdown, where
    # autograd's device threads can still let go of a graph (and abort: pytorch/pytorch#38228).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

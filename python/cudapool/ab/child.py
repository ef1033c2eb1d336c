"""The child of ``python -m cudapool ab``: ``python -m cudapool.ab.child SCRIPT [ARGS...]``.

Sets the allocator up (the environment ``ab`` gives it: CUDAPOOL_AB_ALLOCATOR, and for a
cudapool variant CUDAPOOL_AB_CONF; ``expandable`` and ``async`` arrive as
PYTORCH_CUDA_ALLOC_CONF, set by the parent before torch starts), runs SCRIPT as ``__main__``
with ``sys.argv = [SCRIPT, *ARGS]`` and its directory first on ``sys.path``, and at exit (an
atexit handler registered before the script runs, so it runs after the script's own) writes
what it saw to the JSON file CUDAPOOL_AB_STATS names ("{rank}" replaced by RANK under torchrun):

- ``exit_status``, the escaping exception (type and message) and ``oom``: whether an out of
  memory error escaped the script: ``torch.OutOfMemoryError``, or a ``RuntimeError`` whose
  message starts with "CUDA out of memory" (cudapool's, without ``cudapool._torch_oom``),
  anywhere in the exception's cause/context chain (a script that catches it and calls
  ``sys.exit(1)`` counts);
- ``wall_s``: from before the allocator is set up (``cudapool.enable()`` imports torch; the
  built-in runs import it in the script) to the end of the script;
- per CUDA device that was used: peak allocated and reserved bytes, device allocations and
  out-of-memory counts, from ``torch.cuda.memory_stats`` for torch's allocator and from
  ``cudapool.memory_stats`` for cudapool's. Without torch in use or without CUDA, ``devices``
  is empty and ``memory`` says why;
- ``step_times``: under ``--step-marker``, the time of each step the script marked with
  ``cudapool.ab.step()``; the first counts from the same start as ``wall_s``.

The script is not changed in any way. The exit status is the script's.
"""

import atexit
import json
import os
import runpy
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

from cudapool import ab

OOM_PREFIX = "CUDA out of memory"


def _is_oom(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` or an exception in its cause/context chain is an out of memory error."""
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if oom_type is not None and isinstance(exc, oom_type):
            return True
        if isinstance(exc, RuntimeError) and str(exc).startswith(OOM_PREFIX):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def exit_code(exc: SystemExit) -> int:
    """The process exit status Python gives a SystemExit (printing a non-int code)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _device_figures(stats: Dict[str, Any]) -> Dict[str, Any]:
    peak_allocated = int(stats.get("allocated_bytes.all.peak", 0))
    peak_reserved = int(stats.get("reserved_bytes.all.peak", 0))
    return {
        "peak_allocated": peak_allocated,
        "peak_reserved": peak_reserved,
        "utilization": peak_allocated / peak_reserved if peak_reserved else None,
        "device_allocs": int(stats.get("num_device_alloc", 0)),
        "num_ooms": int(stats.get("num_ooms", 0)),
        "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
    }


def _memory(uses_cudapool: bool) -> Dict[str, Any]:
    """{"available": bool, "reason": str, "source": str, "devices": {index: figures}}."""
    if ab._fake_memory:
        reported: Dict[str, Any] = {}
        for index, fig in sorted(ab._fake_memory.items()):
            fig = dict(fig)
            fig["utilization"] = fig["peak_allocated"] / fig["peak_reserved"] if fig["peak_reserved"] else None
            fig.setdefault("num_alloc_retries", 0)
            reported[str(index)] = fig
        return {"available": True, "reason": "", "source": "reported by the script", "devices": reported}
    torch = sys.modules.get("torch")
    if torch is None:
        return {"available": False, "reason": "the script did not use torch", "source": "", "devices": {}}
    try:
        initialized = bool(torch.cuda.is_initialized())
    except Exception as exc:  # a torch without CUDA support
        return {"available": False, "reason": f"no CUDA in torch ({exc})", "source": "", "devices": {}}
    if not initialized:
        try:
            why = "CUDA is not available" if not torch.cuda.is_available() else "the script did not use CUDA"
        except Exception as exc:
            why = f"CUDA is not available ({exc})"
        return {"available": False, "reason": why, "source": "", "devices": {}}
    devices: Dict[str, Any] = {}
    if uses_cudapool:
        import cudapool
        from cudapool import _C

        for index in _C.device_pools():
            devices[str(index)] = _device_figures(dict(cudapool.memory_stats(index)))
        source = "cudapool.memory_stats"
    else:
        from torch.cuda import memory as torch_memory

        for index in range(torch.cuda.device_count()):
            stats = torch_memory.memory_stats(index)
            if stats and (stats.get("allocation.all.allocated", 0) or stats.get("reserved_bytes.all.peak", 0)):
                devices[str(index)] = _device_figures(dict(stats))
        source = "torch.cuda.memory_stats"
    return {"available": True, "reason": "", "source": source, "devices": devices}


class _Run:
    def __init__(self, script: str, args: List[str]) -> None:
        self.t0 = time.perf_counter()
        self.script = script
        self.args = args
        self.allocator = os.environ.get(ab.ENV_ALLOCATOR, "builtin")
        self.uses_cudapool = self.allocator.split(":", 1)[0] == "cudapool"
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.exit_status = 0
        self.exception: Optional[str] = None
        self.oom = False
        self.setup_error: Optional[str] = None
        self.t_end: Optional[float] = None
        self.written = False

    def setup(self) -> bool:
        if not self.uses_cudapool:
            return True
        conf = os.environ.get(ab.ENV_CONF)
        if conf:
            os.environ["CUDAPOOL_CONF"] = conf
        else:
            os.environ.pop("CUDAPOOL_CONF", None)
        try:
            import cudapool

            cudapool.enable()
        except Exception as exc:
            self.setup_error = f"cudapool.enable() failed: {exc.__class__.__name__}: {exc}"
            print(f"cudapool ab: {self.setup_error}", file=sys.stderr)
            self.exit_status = 1
            return False
        return True

    def run(self) -> None:
        script_dir = os.path.dirname(os.path.abspath(self.script))
        sys.argv = [self.script, *self.args]
        if sys.path:
            sys.path[0] = script_dir
        else:
            sys.path.append(script_dir)
        if os.environ.get(ab.ENV_STEPS) == "1":
            ab._start_recording()
        try:
            runpy.run_path(self.script, run_name="__main__")
        except SystemExit as exc:
            self.exit_status = exit_code(exc)
            if self.exit_status != 0 and _is_oom(exc.__context__):
                self.oom = True
                self.exception = _describe(exc.__context__)
        except KeyboardInterrupt:
            traceback.print_exc()
            self.exit_status = 130
            self.exception = "KeyboardInterrupt"
        except BaseException as exc:  # the script failed: report it as Python would
            traceback.print_exc()
            self.exit_status = 1
            self.exception = _describe(exc)
            self.oom = _is_oom(exc)
        finally:
            self.t_end = time.perf_counter()
            sys.stdout.flush()
            sys.stderr.flush()

    def record(self) -> Dict[str, Any]:
        end = self.t_end if self.t_end is not None else time.perf_counter()
        try:
            memory = _memory(self.uses_cudapool) if self.setup_error is None else _unavailable("setup failed")
        except Exception as exc:  # never lose the run's status to a statistics failure
            memory = _unavailable(f"cannot read the statistics: {exc.__class__.__name__}: {exc}")
        steps = ab._times
        step_times = None
        if steps is not None:
            # the first step counts from the runner's start, as the wall time does: torch's
            # import is in it whether enable() or the script imports torch
            marks = [self.t0, *steps]
            step_times = [b - a for a, b in zip(marks, marks[1:])]
        torch = sys.modules.get("torch")
        config = None
        if self.uses_cudapool and self.setup_error is None:
            from cudapool import _torch

            config = _torch.enabled_config()
        return {
            "allocator": self.allocator,
            "config": config,
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "script": self.script,
            "argv": [self.script, *self.args],
            "exit_status": self.exit_status,
            "exception": self.exception,
            "setup_error": self.setup_error,
            "oom": self.oom,
            "wall_s": end - self.t0,
            "torch": str(getattr(torch, "__version__", "")) or None,
            "memory": memory,
            "step_times": step_times,
        }

    def write(self) -> None:
        if self.written:
            return
        self.written = True
        template = os.environ.get(ab.ENV_STATS)
        if not template:
            return
        path = template.replace("{rank}", str(self.rank))
        try:
            payload = self.record()
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(payload, f)
            os.replace(tmp, path)
        except Exception as exc:
            print(f"cudapool ab: cannot write the run's statistics to {path!r}: {exc}", file=sys.stderr)


def _unavailable(reason: str) -> Dict[str, Any]:
    return {"available": False, "reason": reason, "source": "", "devices": {}}


def _describe(exc: Optional[BaseException]) -> Optional[str]:
    if exc is None:
        return None
    text = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {text[0] if text else ''}"[:500]


def main(argv: List[str]) -> int:
    if not argv:
        print("usage: python -m cudapool.ab.child SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script, args = argv[0], argv[1:]
    if not os.path.isfile(script):
        print(f"cudapool ab: cannot run {script!r}: no such file", file=sys.stderr)
        return 2
    run = _Run(script, args)
    atexit.register(run.write)  # first registered, last run: after the script's own handlers
    if run.setup():
        run.run()
    return run.exit_status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

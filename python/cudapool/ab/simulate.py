"""``python -m cudapool ab --simulate``: the A/B of a script answered without a GPU.

    python -m cudapool ab --simulate [--gpu NAME_OR_BYTES] [--allocators LIST] [--max-steps N]
        [--strict-values] [--find-max-batch ARG [--max-batch-range LO:HI]] [--json PATH]
        [--nproc-per-node N [--nnodes M] [--ranks LIST]] -- SCRIPT [ARGS...]

The script runs once, unchanged, in a fresh process (:mod:`cudapool.ab.sim_child`) on a fake
GPU of the given model (:mod:`cudapool.fakegpu`: fake CUDA tensors, CUDA's autocast rules,
the tracer's backward pass), and its allocation trace is replayed under each allocator's rules
on cudapool's simulated device (:mod:`cudapool.lab.replay`): peak allocated and reserved,
utilization, whether it fits on that GPU (a replay with the GPU's memory as the capacity and
the whole out-of-memory ladder), the smallest GPU memory it fits in
(:mod:`cudapool.lab.capacity`), the device calls and their estimated time. Every figure is a
prediction and the table says so. ``async`` (cudaMallocAsync) has no model: its row says so.
``--find-max-batch ARG`` traces the script again for each value it tries (each in a fresh
process; one trace serves every allocator) and reports the largest that fits per allocator.
``--nproc-per-node N`` runs the script as the ranks of a torchrun job of ``--nnodes`` nodes of N
GPUs (:mod:`cudapool.ab.sim_ranks`): a row per group of ranks, the memory outside PyTorch's
allocator counted; run under torchrun itself, it takes the job from torchrun's variables.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .._units import format_bytes
from . import common
from .sim_cli import build_parser
from .sim_report import report, table

#: The replay policy of each of torch's rows.
POLICY_OF = {"builtin": "builtin", "expandable": "expandable"}
EXIT_NOT_SIMULATED = 1
#: The script's output lines kept in the result (the rest is shown as it runs).
OUTPUT_KEPT = 2000


class SimOptions(NamedTuple):
    gpu: str
    allocators: List[common.Allocator]
    json: Optional[str]
    max_steps: Optional[int]
    strict_values: bool
    find_max_batch: Optional[str]
    max_batch_range: Tuple[int, int]
    max_batch_step: Optional[int]
    hide_output: bool
    timeout: Optional[float]
    trace: Optional[str]
    script: str
    args: List[str]
    engine: str = "auto"
    #: The job's world (None: one GPU, no ranks) and the ranks --ranks named (None: the default,
    #: Note [Which ranks are traced] in cudapool.ab.ranks).
    world: Optional[Any] = None
    ranks: Optional[List[int]] = None
    #: --outside: the bytes a process holds outside PyTorch's allocator (None: the estimate).
    outside: Optional[int] = None
    #: --wide: every column of the table.
    wide: bool = False


def parse_args(argv: Sequence[str]) -> SimOptions:
    from ..fakegpu import gpu_model

    ns, rest = common.split_and_parse(argv, build_parser())
    try:
        gpu_model(ns.gpu)
    except ValueError as exc:
        raise common.UsageError(f"--gpu: {exc}") from None
    if ns.max_steps is not None and ns.max_steps < 1:
        raise common.UsageError("--max-steps must be at least 1")
    if ns.timeout is not None and ns.timeout <= 0:
        raise common.UsageError("--timeout must be positive")
    if ns.max_batch_range is not None and ns.find_max_batch is None:
        raise common.UsageError("--max-batch-range goes with --find-max-batch")
    if ns.max_batch_step is not None and ns.find_max_batch is None:
        raise common.UsageError("--max-batch-step goes with --find-max-batch")
    if ns.max_batch_step is not None and ns.max_batch_step < 1:
        raise common.UsageError("--max-batch-step must be at least 1")
    if ns.engine == "native":
        from ..fakegpu import resolve_engine

        try:
            resolve_engine("native")
        except RuntimeError as exc:
            raise common.UsageError(f"--engine native: {exc}") from None
    if ns.find_max_batch is not None and not ns.find_max_batch.startswith("-"):
        raise common.UsageError(f"--find-max-batch {ns.find_max_batch!r}: name the script's option, e.g. --batch-size")
    from . import ranks as _ranks
    from .sim_ranks import usage_checks

    world = usage_checks(ns.nproc_per_node, ns.nnodes, ns.ranks)
    if world is None:
        launched = _ranks.from_torchrun_env(os.environ)
        if launched is not None:
            world = launched[0]
    traced = None
    if world is not None:
        traced = _ranks.parse_ranks(ns.ranks, world) if ns.ranks else None
        if ns.engine == "python":
            raise common.UsageError("--engine python simulates one GPU: ranks need the native engine")
        from ..fakegpu.native import why_unavailable

        why = why_unavailable()
        if why is not None:
            raise common.UsageError(f"ranks need cudapool's native fake GPU, which cannot run here: {why}")
    outside = None
    if ns.outside is not None:
        from .._units import parse_size

        try:
            outside = parse_size(ns.outside)
        except ValueError as exc:
            raise common.UsageError(f"--outside: {exc}") from None
    if not rest:
        raise common.UsageError("no script after --")
    if not os.path.isfile(rest[0]):
        raise common.UsageError(f"cannot run {rest[0]!r}: no such file")
    return SimOptions(
        ns.gpu,
        common.parse_allocators(ns.allocators),
        ns.json,
        ns.max_steps,
        ns.strict_values,
        ns.find_max_batch,
        common.parse_range(ns.max_batch_range) if ns.max_batch_range else common.DEFAULT_RANGE,
        ns.max_batch_step,
        ns.hide_output,
        ns.timeout,
        ns.trace,
        rest[0],
        rest[1:],
        ns.engine,
        world,
        traced,
        outside,
        ns.wide,
    )


# -- tracing --------------------------------------------------------------------------------------


def trace_once(
    opts: SimOptions, args: Sequence[str], out_dir: str, rank: Optional[int] = None, extra: Sequence[str] = ()
) -> Dict[str, Any]:
    """Trace the script with ``args`` in a fresh process (as rank ``rank`` of the job with
    ranks; ``extra``: more options of the child); its result.json (status "failed" with a
    message when it could not run, "timeout" past --timeout)."""
    cmd = [sys.executable, "-m", "cudapool.ab.sim_child", "--gpu", opts.gpu, "--out", out_dir, *extra]
    if opts.max_steps is not None:
        cmd += ["--max-steps", str(opts.max_steps)]
    if opts.strict_values:
        cmd.append("--strict-values")
    if rank is not None and opts.world is not None:
        cmd += ["--rank", str(rank), "--nproc-per-node", str(opts.world.nproc_per_node)]
        cmd += ["--nnodes", str(opts.world.nnodes)]
    cmd += ["--engine", opts.engine, "--", opts.script, *args]
    # Unbuffered: the script's output and its stderr (one pipe) come in the order it wrote them.
    env = common.with_package_on_path(dict(os.environ, PYTHONUNBUFFERED="1"))
    started = time.monotonic()
    os.makedirs(out_dir, exist_ok=True)
    out_path = os.path.join(out_dir, "stdout.txt")
    try:
        prefix = "| " if rank is None else f"| [rank {rank}] "
        returncode = _run_showing(cmd, env, out_path, opts.timeout, show=not opts.hide_output, prefix=prefix)
    except subprocess.TimeoutExpired:
        return {
            "status": "timeout",
            "message": f"no trace within --timeout {opts.timeout:g} s",
            "seconds": opts.timeout,
        }
    path = os.path.join(out_dir, "result.json")
    if not os.path.isfile(path):
        return {
            "status": "failed",
            "message": f"the tracing process ended with status {returncode} and wrote no trace",
            "seconds": time.monotonic() - started,
        }
    with open(path) as f:
        result: Dict[str, Any] = json.load(f)
    result["trace_path"] = os.path.join(out_dir, "trace.cptrace")
    with open(out_path, "rb") as f:
        output = f.read().decode("utf-8", "replace")
    lines = output.splitlines()
    result["output_lines"] = len(lines)
    result["output"] = lines[-OUTPUT_KEPT:]
    result["output_tail"] = output[-2000:]
    return result


def _run_showing(
    cmd: List[str], env: Dict[str, str], out_path: str, timeout: Optional[float], show: bool, prefix: str = "| "
) -> int:
    """Run the tracing child with the script's stdout kept in ``out_path`` and, with ``show``,
    shown on stderr as it comes (each line after ``prefix``; the child's own progress lines and
    the script's stderr go to stderr as they are). Its exit status; TimeoutExpired past ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with open(out_path, "wb") as out:
        child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE)
        assert child.stdout is not None
        timer = None
        if deadline is not None:
            import threading

            timer = threading.Timer(max(0.0, deadline - time.monotonic()), child.kill)
            timer.start()
        try:
            for line in child.stdout:
                out.write(line)
                if show:
                    sys.stderr.write(prefix + line.decode("utf-8", "replace"))
                    sys.stderr.flush()
            returncode = child.wait()
        finally:
            if timer is not None:
                timer.cancel()
    if deadline is not None and time.monotonic() >= deadline and returncode < 0:
        raise subprocess.TimeoutExpired(cmd, timeout or 0.0)
    return returncode


# -- replay ---------------------------------------------------------------------------------------


def policy_and_config(alloc: common.Allocator) -> Optional[Tuple[str, Optional[str]]]:
    """The replay policy and configuration of a row, or None when the allocator has no model."""
    if alloc.cudapool_conf is None:
        policy = POLICY_OF.get(alloc.label)
        return (policy, None) if policy else None
    policy, rest = "cudapool", []
    for entry in filter(None, alloc.cudapool_conf.split(",")):
        key, _, value = entry.partition(":")
        if key == "policy":
            policy = value
        else:
            rest.append(entry)
    return policy, ",".join(rest) or None


def predict(trace: Any, alloc: common.Allocator, limit: int, outside: int = 0) -> Dict[str, Any]:
    """One row's figures: replays unlimited and at ``limit`` (what the allocator may use:
    :func:`room`), and the smallest device (``outside``, what the process holds outside
    PyTorch's allocator, added)."""
    from ..lab.capacity import min_capacity
    from ..lab.replay import replay

    pc = policy_and_config(alloc)
    if pc is None:
        return {"allocator": alloc.label, "simulated": False, "why": "no model of cudaMallocAsync's pool"}
    policy, config = pc
    free = replay(trace, policy=policy, config=config)
    there = replay(trace, policy=policy, config=config, capacity=limit)
    smallest = min_capacity(trace, policy=policy, config=config, unlimited=free)
    keys = ("peak_allocated", "peak_reserved", "utilization", "device_calls_total", "device_call_ms", "device_faults")
    return {
        "allocator": alloc.label,
        "simulated": True,
        "policy": policy,
        "config": config,
        **{k: free.get(k) for k in keys},
        "fits": not there["oom"],
        "oom_event": there.get("oom_event"),
        "oom_size": there.get("oom_size"),
        # None: the trace allocates nothing
        "min_capacity": None if smallest["min_capacity"] is None else smallest["min_capacity"] + outside,
        # the step plan's figures (policy planned): what it learned and served, unlimited
        "plan": free.get("plan") if (free.get("plan") or {}).get("plan_state") else None,
    }


def predict_each(
    trace: Any,
    allocators: Sequence[common.Allocator],
    limit: int,
    outside: int,
    progress: Callable[[str], None],
    prefix: str = "",
) -> List[Dict[str, Any]]:
    """:func:`predict`'s row for each allocator, saying each replay as it starts."""
    rows = []
    for i, alloc in enumerate(allocators, 1):
        progress(f"{prefix}[{i}/{len(allocators)}] replaying under {alloc.label} ...")
        rows.append(predict(trace, alloc, limit, outside))
    return rows


def predict_one_gpu(
    opts: SimOptions, gpu: Any, traced: Dict[str, Any], trace: Any, progress: Callable[[str], None]
) -> Dict[str, Any]:
    """A one-GPU run's rows (``traced``: the trace's result; ``trace``: the trace), with the
    memory set aside outside the allocator and what the allocator may use: the parts of the
    result ``rows``, ``outside``, ``capacity`` and ``devices``."""
    outside = outside_single(opts, gpu)
    capacity = room(traced, gpu.total_memory, outside["total"])
    rows = predict_each(trace, opts.allocators, capacity, outside["total"], progress)
    return {"rows": rows, "outside": outside, "capacity": capacity, "devices": trace.devices()}


def outside_single(opts: SimOptions, gpu: Any) -> Dict[str, Any]:
    """What a one-GPU run's process holds outside PyTorch's allocator: --outside, or the CUDA
    context's estimate (:mod:`cudapool.ab.outside`)."""
    from .outside import estimate_outside

    if opts.outside is not None:
        return {"total": opts.outside, "given": True, "lines": [f"--outside {format_bytes(opts.outside)}"]}
    est = estimate_outside(gpu, [], os.environ)
    return {"total": est.context, "given": False, "lines": est.lines[:1]}


def usable(trace_result: Dict[str, Any], total: int) -> int:
    """The memory a run may use: the GPU's, or the fraction of it the script set."""
    fraction = (trace_result.get("fake_gpu") or {}).get("memory_fraction")
    return total if fraction is None else max(1, int(fraction * total))


def room(trace_result: Dict[str, Any], total: int, outside: int) -> int:
    """What PyTorch's allocator may hold on a GPU of ``total`` bytes when the process holds
    ``outside`` bytes outside it: the GPU's rest, or less, the fraction the script set (torch
    caps the allocator alone with it)."""
    return max(1, min(usable(trace_result, total), total - outside))


def fits(trace_result: Dict[str, Any], alloc: common.Allocator, total: int, outside: int = 0) -> bool:
    """Whether a traced run (its "trace": loaded once, shared by the allocators) fits in the
    memory it may use under ``alloc``, ``outside`` bytes of it held outside PyTorch's allocator."""
    return spare(trace_result, alloc, total, outside) is not None


def spare(trace_result: Dict[str, Any], alloc: common.Allocator, total: int, outside: int = 0) -> Optional[int]:
    """What a traced run leaves unreserved at its peak on the GPU under ``alloc`` (its room less
    the peak reserved of the replay there), or None where it does not fit."""
    from ..lab.replay import replay

    pc = policy_and_config(alloc)
    if pc is None or trace_result.get("trace") is None:
        return None
    limit = room(trace_result, total, outside)
    there = replay(trace_result["trace"], policy=pc[0], config=pc[1], capacity=limit)
    return None if there["oom"] else max(0, limit - int(there["peak_reserved"]))


def find_max(
    opts: SimOptions,
    capacity: int,
    workdir: str,
    progress: Callable[[str], None],
    gpu: Any = None,
    rank_list: Sequence[int] = (),
    seed: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Per allocator, the largest value of --find-max-batch whose trace fits (with ranks: on
    every rank of ``rank_list``, the one traced rank of each group of the first run, each with
    the memory it holds outside PyTorch's allocator); one trace (a fresh process per rank) per
    value tried, shared by the allocators. ``seed``: the first run's traced result (its "trace"
    loaded), standing for the value the script's arguments give (one GPU only)."""
    from ..lab.trace import load

    assert opts.find_max_batch is not None
    name = opts.find_max_batch
    lo, hi = opts.max_batch_range
    traces: Dict[int, Dict[str, Any]] = {}
    per_rank: Dict[int, List[Tuple[Dict[str, Any], int]]] = {}
    own = common.arg_value(opts.args, name)
    if seed is not None and own is not None and lo <= own <= hi and opts.world is None:
        traces[own] = seed
        per_rank[own] = [(seed, outside_single(opts, gpu)["total"])]

    def traced(value: int) -> Dict[str, Any]:
        if value not in traces:
            progress(f"max {name}: tracing {name} {value} ...")
            args, where = common.with_arg(opts.args, name, value), os.path.join(workdir, f"batch-{value}")
            if opts.world is None:
                t = trace_once(opts, args, where)
                t["trace"] = load(t["trace_path"]) if t["status"] in ("finished", "stopped") else None
                per_rank[value] = [(t, outside_single(opts, gpu)["total"])]
            else:
                from . import sim_ranks

                done = sim_ranks.trace_ranks(
                    lambda r, d: trace_once(opts, args, d, rank=r),
                    list(rank_list),
                    where,
                    progress,
                    f"{name} {value}: ",
                )
                per_rank[value] = [
                    (t, sim_ranks.outside_of(t, opts.world, gpu, opts.outside).total if t.get("world") else 0)
                    for t in done.values()
                ]
                # the value's status is the first failing rank's, if one failed
                t = min(done.values(), key=lambda r: r["status"] in ("finished", "stopped"))
            traces[value] = t
            status = t["status"]
            said = {"stopped": "traced to --max-steps", "finished": "traced to its end", "exit": "traced to its exit"}
            progress(f"max {name}: {name} {value}: {said.get(status, status + ': ' + str(t.get('message') or ''))}")
        return traces[value]

    def spare_all(value: int, alloc: common.Allocator) -> Optional[int]:
        """The least any of the value's traces leaves unreserved at its peak; None: one does not fit."""
        traced(value)
        left = [spare(t, alloc, capacity, outside) for t, outside in per_rank[value]]
        return None if None in left else min(x for x in left if x is not None)

    needs: Dict[Tuple[int, str], Optional[int]] = {}

    def need_all(value: int, alloc: common.Allocator) -> Optional[int]:
        """The smallest GPU the value's traces fit on under ``alloc`` (outside memory counted)."""
        from ..lab.capacity import min_capacity

        key = (value, alloc.label)
        if key not in needs:
            traced(value)
            policy, config = policy_and_config(alloc) or ("builtin", None)
            sizes = []
            for t, outside in per_rank[value]:
                found = (
                    min_capacity(t["trace"], policy=policy, config=config)["min_capacity"] if t.get("trace") else None
                )
                sizes.append(None if found is None else found + outside)
            needs[key] = None if not sizes or None in sizes else max(s for s in sizes if s is not None)
        return needs[key]

    def prefetch(values: Sequence[int]) -> None:
        """Trace the values not traced yet side by side (a process each, as many as cores)."""
        missing = sorted({v for v in values if v not in traces and lo <= v <= hi})
        if len(missing) > 1 and opts.world is None:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=min(len(missing), os.cpu_count() or 1)) as pool:
                list(pool.map(traced, missing))

    results: Dict[str, Dict[str, Any]] = {}
    for alloc in opts.allocators:
        if policy_and_config(alloc) is None:
            results[alloc.label] = {"max": None, "simulated": False}
            continue
        tried: List[Dict[str, Any]] = []

        def ok(value: int, alloc: common.Allocator = alloc, tried: List[Dict[str, Any]] = tried) -> bool:
            left = spare_all(value, alloc)
            probe: Dict[str, Any] = {"value": value, "fits": left is not None, "trace": traced(value)["status"]}
            if left is not None:
                probe["spare"] = left
                how = f"fits, {format_bytes(left)} to spare"
            else:
                need = need_all(value, alloc)  # by how much: the smallest GPU it runs on
                probe["need"] = need
                how = "does not fit" + ("" if need is None else f": needs {format_bytes(max(0, need - capacity))} more")
            tried.append(probe)
            progress(f"max {name}: {name} {value}: {alloc.label} {how}")
            return left is not None

        def need(value: int, alloc: common.Allocator = alloc) -> Optional[int]:
            return need_all(value, alloc)

        best, how = common.predict_max(
            ok, need, capacity, lo, hi, step=opts.max_batch_step, second=own, prefetch=prefetch
        )
        results[alloc.label] = {"max": best, "range": [lo, hi], "probes": tried, "simulated": True, "found_by": how}
    return {"arg": name, "results": results, "traces": {str(v): _brief(t) for v, t in sorted(traces.items())}}


def _brief(t: Dict[str, Any]) -> Dict[str, Any]:
    return {k: t.get(k) for k in ("status", "message", "steps", "events", "peak_allocated", "seconds")}


# -- the command ----------------------------------------------------------------------------------


def run(opts: SimOptions, progress: Callable[[str], None]) -> Dict[str, Any]:
    from ..fakegpu import gpu_model
    from ..lab.trace import load

    gpu = gpu_model(opts.gpu)
    with tempfile.TemporaryDirectory(prefix="cudapool-ab-sim-") as workdir:
        result: Dict[str, Any] = {
            "argv": [opts.script, *opts.args],
            "predicted": True,
            "gpu": gpu._asdict(),
            "options": {
                "gpu": opts.gpu,
                "allocators": [a._asdict() for a in opts.allocators],
                "max_steps": opts.max_steps,
                "strict_values": opts.strict_values,
                "engine": opts.engine,
                "find_max_batch": opts.find_max_batch,
                "max_batch_range": list(opts.max_batch_range) if opts.find_max_batch else None,
                "nproc_per_node": opts.world.nproc_per_node if opts.world else None,
                "nnodes": opts.world.nnodes if opts.world else None,
                "ranks": opts.ranks,
                "outside": opts.outside,
                "max_batch_step": opts.max_batch_step,
                "hide_output": opts.hide_output,
                "timeout": opts.timeout,
                "json": opts.json,
                "trace": opts.trace,
                "wide": opts.wide,
            },
        }
        if opts.world is not None:
            return _run_ranks(opts, gpu, result, workdir, progress)
        progress(f"tracing {opts.script} on a simulated {gpu.name} ...")
        traced = trace_once(opts, opts.args, os.path.join(workdir, "run"))
        progress(f"traced: {traced['status']} ({traced.get('seconds', 0):.1f} s)")
        result["trace"] = {k: v for k, v in traced.items() if k != "trace_path"}
        if traced["status"] not in ("finished", "stopped", "exit"):
            return result
        trace = load(traced["trace_path"])
        if opts.trace:
            shutil.copyfile(traced["trace_path"], opts.trace)
            result["trace_file"] = opts.trace
        result.update(predict_one_gpu(opts, gpu, traced, trace, progress))
        rows = result["rows"]
        _where_out_of_memory(opts, rows, traced, workdir, progress)
        result["max_batch"] = (
            find_max(opts, gpu.total_memory, workdir, progress, gpu=gpu, seed=dict(traced, trace=trace))
            if opts.find_max_batch
            else None
        )
    result["cells"] = table(rows, opts.gpu, result["max_batch"])
    return result


def _where_out_of_memory(
    opts: SimOptions, rows: List[Dict[str, Any]], traced: Dict[str, Any], workdir: str, progress: Callable[[str], None]
) -> None:
    """For each row that runs out of memory, where the script was: its line and step at the
    allocation that failed (``oom_site``), from a second look at the script stopped there (the
    native engine; the trace is the same up to that point)."""
    events = sorted(
        {r["oom_event"] for r in rows if r.get("simulated") and not r["fits"] and r.get("oom_event") is not None}
    )
    if not events or (traced.get("fake_gpu") or {}).get("engine") != "native":
        return
    sites: Dict[int, Dict[str, Any]] = {}
    for event in events[:3]:
        progress(f"out of memory at event {event:,}: finding the script's line ...")
        where = os.path.join(workdir, f"where-{event}")
        trace_once(opts._replace(hide_output=True), opts.args, where, extra=["--where-event", str(event)])
        path = os.path.join(where, "where.json")
        if os.path.isfile(path):
            with open(path) as f:
                sites[event] = json.load(f)
    for r in rows:
        if r.get("oom_event") in sites:
            r["oom_site"] = sites[r["oom_event"]]


def _run_ranks(
    opts: SimOptions, gpu: Any, result: Dict[str, Any], workdir: str, progress: Callable[[str], None]
) -> Dict[str, Any]:
    """run() for a job of several ranks (cudapool.ab.sim_ranks): a row per group of identical
    ranks and allocator."""
    from . import sim_ranks
    from .ranks import default_ranks

    world = opts.world
    assert world is not None
    traced_ranks = opts.ranks or default_ranks(world)
    progress(
        f"tracing {opts.script} as rank(s) {', '.join(map(str, traced_ranks))} of {world.size} on simulated "
        f"{gpu.name}s ..."
    )

    def trace(rank: Optional[int], out_dir: str) -> Dict[str, Any]:
        return trace_once(opts, opts.args, out_dir, rank=rank)

    where = os.path.join(workdir, "run")
    done = sim_ranks.trace_ranks(trace, traced_ranks, where, progress)
    second = sim_ranks.second_look(done, world) if opts.ranks is None else None
    if second is not None:
        progress(f"ranks {traced_ranks[0]} and {traced_ranks[-1]} differ: tracing rank {second} too ...")
        done.update(sim_ranks.trace_ranks(trace, [second], where, progress))
        traced_ranks = sorted(done)
    result["traces"] = {
        str(r): {k: v for k, v in t.items() if k not in ("trace_path", "trace")} for r, t in done.items()
    }
    failed = [r for r, t in done.items() if t["status"] not in ("finished", "stopped", "exit")]
    first = done[failed[0]] if failed else done[traced_ranks[0]]
    result["trace"] = {k: v for k, v in first.items() if k not in ("trace_path", "trace")}
    if failed:
        result["trace"]["rank"] = failed[0]
        return result
    groups = sim_ranks.rank_groups(done, world)
    answers = sim_ranks.stands_for(groups, world)
    rank_rows = []
    for rank, stands in answers.items():
        t = done[rank]
        outside = sim_ranks.outside_of(t, world, gpu, opts.outside)
        capacity = room(t, gpu.total_memory, outside.total)
        rows = predict_each(t["trace"], opts.allocators, capacity, outside.total, progress, f"rank {rank}: ")
        rank_rows.append(
            {
                "rank": rank,
                "stands_for": stands,
                "traced_same": next(g for g in groups if g[0] == rank),
                "devices": t["trace"].devices(),
                "outside": sim_ranks.outside_dict(outside),
                "capacity": capacity,
                "rows": rows,
            }
        )
    if opts.trace:
        for rank, t in done.items():
            path = opts.trace if len(done) == 1 else f"{opts.trace}.rank{rank}"
            shutil.copyfile(t["trace_path"], path)
    result["groups"] = groups
    result["traced_text"] = sim_ranks.traced_text(world, traced_ranks, groups)
    result["rank_rows"] = rank_rows
    result["worst"] = sim_ranks.worst(rank_rows)
    result["rows"] = [dict(r, rank=rr["rank"]) for rr in rank_rows for r in rr["rows"]]
    result["max_batch"] = (
        find_max(opts, gpu.total_memory, workdir, progress, gpu=gpu, rank_list=[rr["rank"] for rr in rank_rows])
        if opts.find_max_batch
        else None
    )
    result["cells"] = table(result["rows"], opts.gpu, result["max_batch"], rank_rows)
    return result


def main(argv: Sequence[str]) -> int:
    """0 once the prediction is printed, 1 when the script could not be traced (the message
    names the operation and the line), 2 on a bad command line."""
    try:
        opts = parse_args(argv)
    except common.UsageError as exc:
        print(f"cudapool ab --simulate: {exc}", file=sys.stderr)
        return common.EXIT_USAGE
    from .ranks import from_torchrun_env

    launched = from_torchrun_env(os.environ)
    if launched is not None and launched[1] != 0 and "--nproc-per-node" not in argv:
        # Started by torchrun: rank 0 answers for the whole job (the world of torchrun's variables).
        print(
            f"cudapool ab --simulate: rank {launched[1]} of torchrun's job: rank 0 prints the prediction",
            file=sys.stderr,
        )
        return 0
    result = run(opts, common.progress_printer("cudapool ab --simulate: "))
    rc = 0
    if "rows" not in result:
        t = result["trace"]
        if t.get("rank") is not None:
            opts = opts._replace(script=f"{opts.script} (rank {t['rank']})")
        if t.get("status") == "script_error":
            from ..fakegpu.failures import NOT_INSTALLED

            reads = (t.get("fake_gpu") or {}).get("value_reads") or 0
            if NOT_INSTALLED in str(t.get("message")) or "torchrun sets" in str(t.get("message")):
                why = ""  # the message says what to do
            elif reads:
                why = f" (it had read {reads:,} simulated tensor value(s) before: zeros, which may be why)"
            else:
                why = " (its own code raised it: it would on a GPU too)"
            print(f"cudapool ab --simulate: {opts.script} failed: {t.get('message')}{why}", file=sys.stderr)
        else:
            print(f"cudapool ab --simulate: {opts.script} could not be simulated: {t.get('message')}", file=sys.stderr)
        rc = EXIT_NOT_SIMULATED
    else:
        sys.stdout.write(report(result))
        sys.stdout.flush()
    if opts.json and not common.write_json(opts.json, result, "cudapool ab --simulate"):
        return 1
    return rc


__all__ = ["main", "run", "parse_args", "predict"]

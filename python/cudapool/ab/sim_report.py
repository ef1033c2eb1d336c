"""The report of ``ab --simulate``: its table (a row per allocator; with ranks, per group of
ranks and allocator) and the notes under it, from the result :func:`cudapool.ab.simulate.run`
makes."""

from __future__ import annotations

import shlex
from typing import Any, Dict, List, Optional

from .._units import format_bytes
from ..lab.replay_report import plan_line
from . import common
from .ranks import ranks_text

__all__ = ["command_line", "compile_notes", "report", "table"]


# -- the table ------------------------------------------------------------------------------------


def table(
    rows: List[Dict[str, Any]],
    gpu_spec: str,
    max_batch: Optional[Dict[str, Any]],
    rank_rows: Optional[List[Dict[str, Any]]] = None,
    wide: bool = True,
) -> List[List[str]]:
    """The report's table: a row per allocator; with ``rank_rows`` (a job of several ranks), a
    row per group of ranks and allocator, with the ranks it stands for and what each rank holds
    outside PyTorch's allocator. Without ``wide``, the columns that fit 100 characters: the
    utilization, device calls and device time are left to ``--wide`` (and to the JSON)."""
    head = ["allocator", "peak allocated", "peak reserved"] + (["utilization"] if wide else [])
    if rank_rows is not None:
        head = ["ranks", *head, "outside (est.)"]
    head += [f"fits on {gpu_spec}", "smallest GPU"]
    if wide:
        head += ["device calls", "device time"]
    if max_batch is not None:
        head.append(f"max {max_batch['arg']}")
    groups = (
        [(None, None, rows)]
        if rank_rows is None
        else [
            (f"{rr['rank']} (for {ranks_text(rr['stands_for'])})", rr["outside"]["total"], rr["rows"])
            for rr in rank_rows
        ]
    )
    cells = [head]
    for who, outside, group in groups:
        for r in group:
            if not r["simulated"]:
                figures = ["not simulated"] + ["-"] * (len(head) - 2 - (who is not None) - (max_batch is not None))
            else:
                figures = [
                    format_bytes(r["peak_allocated"]),
                    format_bytes(r["peak_reserved"]),
                    *([f"{r['utilization'] * 100:.1f} %"] if wide else []),
                    *([] if outside is None else [format_bytes(outside)]),
                    "yes" if r["fits"] else "no",
                    "-" if r["min_capacity"] is None else format_bytes(r["min_capacity"]),
                    *([f"{r['device_calls_total']:,}", f"{r['device_call_ms']:.1f} ms"] if wide else []),
                ]
            line = ([] if who is None else [who]) + [r["allocator"], *figures]
            if max_batch is not None:
                m = max_batch["results"][r["allocator"]]["max"]
                line.append("-" if not r["simulated"] else ("none" if m is None else str(m)))
            cells.append(line)
    return cells


def _engine_words(t: Dict[str, Any]) -> str:
    engine = (t.get("fake_gpu") or {}).get("engine")
    if engine == "native":
        return ", cudapool's fake GPU below Python"
    if engine == "python":
        return ", torch's fake tensors"
    return ""


def command_line(result: Dict[str, Any]) -> str:
    """The command that makes this prediction again: every option it was given (a shell's
    quoting where an argument needs it)."""
    o = result["options"]
    words = ["python", "-m", "cudapool", "ab", "--simulate", "--gpu", str(o["gpu"])]
    allocators = ",".join(a["label"] for a in o["allocators"])
    if allocators != common.DEFAULT_ALLOCATORS:
        words += ["--allocators", allocators]
    if o.get("max_steps") is not None:
        words += ["--max-steps", str(o["max_steps"])]
    if o.get("strict_values"):
        words.append("--strict-values")
    if o.get("find_max_batch"):
        lo, hi = o["max_batch_range"]
        words += ["--find-max-batch", o["find_max_batch"], "--max-batch-range", f"{lo}:{hi}"]
        if o.get("max_batch_step"):
            words += ["--max-batch-step", str(o["max_batch_step"])]
    if o.get("nproc_per_node"):
        words += ["--nproc-per-node", str(o["nproc_per_node"])]
        if o.get("nnodes", 1) != 1:
            words += ["--nnodes", str(o["nnodes"])]
        if o.get("ranks"):
            words += ["--ranks", ",".join(map(str, o["ranks"]))]
    if o.get("outside") is not None:
        words += ["--outside", str(o["outside"])]
    if o.get("engine", "auto") != "auto":
        words += ["--engine", o["engine"]]
    if o.get("timeout") is not None:
        words += ["--timeout", f"{o['timeout']:g}"]
    for flag in ("hide_output", "wide"):
        if o.get(flag):
            words.append("--" + flag.replace("_", "-"))
    for name in ("json", "trace"):
        if o.get(name):
            words += [f"--{name}", o[name]]
    return shlex.join([*words, "--", *result["argv"]])


def report(result: Dict[str, Any]) -> str:
    t, gpu, o = result["trace"], result["gpu"], result["options"]
    head = command_line(result) + "\n"
    if "rank_rows" in result:
        head += (
            f"PREDICTED, not measured: {gpu['name']} ({format_bytes(gpu['total_memory'])}) simulated per rank; "
            f"{result['traced_text']}; each traced on fake CUDA ({t['steps']:,} steps marked, {t['optimizer_steps']:,} "
            f"optimizer steps, {t['events']:,} events on rank {result['rank_rows'][0]['rank']}{_engine_words(t)}), "
            "torch.distributed on the fake GPU's process group, each trace replayed under each allocator's rules on "
            "cudapool's simulated device\n"
        )
    else:
        subject = "the function" if o.get("function") else "the script"
        head += (
            f"PREDICTED, not measured: {gpu['name']} ({format_bytes(gpu['total_memory'])}) simulated; {subject} "
            f"traced once on fake CUDA ({t['steps']:,} steps marked, {t['optimizer_steps']:,} optimizer steps, "
            f"{t['events']:,} events, {t['seconds']:.1f} s{_engine_words(t)}), its trace replayed under each "
            "allocator's rules on cudapool's simulated device\n"
        )
    notes = []
    if t["status"] == "stopped":
        notes.append(f"the script was stopped after --max-steps {result['options']['max_steps']}")
    if t["status"] == "exit":
        notes.append(f"the script exited with status {t['exit_code']}: the trace ends there")
    fg = t.get("fake_gpu") or {}
    if fg.get("value_reads"):
        sites = ", ".join(fg["value_read_sites"])
        notes.append(
            f"the script read {fg['value_reads']:,} tensor value(s) ({sites}): it got zeros; control flow that "
            "depends on values is not simulated (--strict-values makes such reads an error)"
        )
    if fg.get("host_copies"):
        notes.append(
            f"{fg['host_copies']:,} copy(ies) of CUDA tensors to the host (.cpu(), .numpy()) got zeros of the right "
            "shape; host tensors the script computes itself are real"
        )
    if fg.get("host_value_reads"):
        notes.append(f"{fg['host_value_reads']:,} read(s) of fake host tensors got zeros")
    for rr in result.get("rank_rows") or ():
        own = rr["rank"] % o["nproc_per_node"]
        if any(d != own for d in rr["devices"]):
            notes.append(
                f"rank {rr['rank']} allocated on devices {rr['devices']}, not only its own cuda:{own} (did the script "
                "call torch.cuda.set_device(LOCAL_RANK)?): each device's memory is replayed on its own pool and "
                "added up"
            )
    world = t.get("world") or {}
    if world.get("object_collectives"):
        calls = ", ".join(f"{n:,} {k}" for k, n in sorted(world["object_collectives"].items()))
        notes.append(
            f"object collectives ({calls}) were answered as if every rank held this rank's objects (a receiving "
            "rank keeps its own)"
        )
    if fg.get("record_streams"):
        notes.append(
            f"Tensor.record_stream was called {fg['record_streams']:,} time(s): the blocks were freed where the program "
            "dropped them, not when the other stream's work passed (a GPU may hold them a little longer)"
        )
    if "rank_rows" not in result and any(d != 0 for d in result.get("devices") or ()):
        notes.append(
            f"the script allocated on devices {result['devices']}: one GPU is simulated, and each device's "
            "memory is replayed on its own pool and added up"
        )
    if fg.get("memory_fraction") is not None:
        notes.append(
            f"the script capped its memory at {fg['memory_fraction']:g} of the GPU "
            f"(set_per_process_memory_fraction): fits means within {format_bytes(result['capacity'])}"
        )
    if fg.get("loader_workers"):
        notes.append(f"data loader workers ({fg['loader_workers']} asked for) ran in the main process: same batches")
    notes.extend(compile_notes(fg))
    if fg.get("sdpa"):
        kinds = ", ".join(f"{n:,} {k}" for k, n in sorted(fg["sdpa"].items()))
        fused = "" if set(fg["sdpa"]) == {"math"} else ": the fused kernels' outputs and log-sum-exp, no attention maps"
        math = (
            " (math: the inputs no fused kernel takes on this GPU, with their attention maps)"
            if "math" in fg["sdpa"]
            else ""
        )
        notes.append(f"scaled_dot_product_attention ran as torch picks on {gpu['name']} ({kinds}){fused}{math}")
    if fg.get("rnn_calls"):
        notes.append(
            "recurrent layers (" + ", ".join(sorted(fg["rnn_calls"])) + ") ran as torch's own CUDA cells: their "
            "saved gates stand for cuDNN's reserve space (an estimate)"
        )
    if fg.get("scratch_files"):
        notes.append(
            f"the script wrote {fg['scratch_files']:,} file(s) on rank {world.get('rank', 0)} (torch.save, and open() in "
            "folders it made): into a scratch folder of that rank's own, not into the script's folders (a traced rank "
            "must not read what another wrote; they are gone afterwards)"
        )
    elif fg.get("saved_placeholders"):
        notes.append(
            f"torch.save wrote {fg['saved_placeholders']:,} CUDA tensor(s) as placeholders (shape and dtype, no "
            "values): loading them outside ab --simulate gives meta tensors"
        )
    if fg.get("snapshots_written"):
        notes.append(
            "memory snapshots written from the simulated run (the built-in allocator's rules): "
            + ", ".join(fg["snapshots_written"])
        )
    for r in result["rows"]:
        if r.get("simulated") and not r["fits"]:
            notes.append(oom_note(r, gpu_spec=o["gpu"]))
    peaks = sorted({r["peak_allocated"] for r in result["rows"] if r["simulated"]})
    if len(peaks) > 1:
        notes.append(
            f"peak allocated differs between allocators ({format_bytes(peaks[0])} to {format_bytes(peaks[-1])}) for "
            "one trace: each counts the blocks it hands out, rounded and split by its own rules (torch's built-in "
            "allocator rounds requests to 512 bytes and hands out a whole block where the rest would be too small "
            "to split off), as torch.cuda.max_memory_allocated() would report under it"
        )
    for r in result["rows"]:
        if r.get("plan"):
            notes.append(f"{r['allocator']}: the step plan, {plan_line(r['plan'])}")
    for label, why in dict((r["allocator"], r.get("why")) for r in result["rows"] if not r["simulated"]).items():
        notes.append(f"{label}: not simulated ({why})")
    ws, taken = fg.get("cublas_workspace_bytes"), fg.get("cublas_workspaces")
    if ws and taken:
        notes.append(
            f"cuBLAS workspaces are in the trace ({taken:,} of {format_bytes(ws)}: one per thread and stream that ran "
            "a matrix multiply, as torch allocates them on this GPU)"
        )
    cudnn = fg.get("cudnn") or {}
    if cudnn.get("convolutions"):
        parts = []
        if cudnn.get("searches"):
            parts.append(
                f"cudnn.benchmark's search at each configuration's first call ({cudnn['searches']:,}, up to "
                f"{format_bytes(cudnn['largest_search'])}: the lowered input, within the GPU's free memory)"
            )
        if cudnn.get("largest_workspace"):
            parts.append(f"backward-weight float32 accumulators (up to {format_bytes(cudnn['largest_workspace'])})")
        held = "; ".join(parts) if parts else "none (implicit-GEMM kernels need none worth counting)"
        notes.append(
            f"cuDNN ran {cudnn['convolutions']:,} convolution(s); their workspaces in the trace are a model's, not "
            f"cuDNN's (it cannot be asked without a GPU): {held}"
        )
    if "rank_rows" in result:
        from .sim_ranks import summary_lines

        if o.get("outside") is not None:
            notes.append(
                f"fits and smallest GPU memory set aside --outside {format_bytes(o['outside'])} per rank for memory "
                "outside PyTorch's allocator"
            )
        else:
            notes.append(
                "fits and smallest GPU memory set aside each rank's CUDA context and NCCL buffers (estimates: the "
                "lines below; --outside BYTES sets the amount)"
            )
        tail = "".join(f"{line}\n" for line in summary_lines(result))
    else:
        out = result.get("outside") or {}
        if out.get("given"):
            notes.append(
                f"fits, smallest GPU memory and max batch set aside --outside {format_bytes(out['total'])} for memory "
                "outside PyTorch's allocator"
            )
        elif out:
            notes.append(
                f"fits, smallest GPU memory and max batch set aside {format_bytes(out['total'])} for memory outside "
                f"PyTorch's allocator: the {out['lines'][0]} (--outside BYTES sets the amount)"
            )
        tail = ""
    cells = table(result["rows"], o["gpu"], result.get("max_batch"), result.get("rank_rows"), wide=bool(o.get("wide")))
    table_text = common.format_table(cells)
    return head + "\n" + table_text + "\n" + tail + "".join(f"note: {n}\n" for n in notes)


def oom_note(r: Dict[str, Any], gpu_spec: str) -> str:
    """Where a row ran out of memory: the script's line and step when a second look found them,
    else the trace's event."""
    who = f"rank {r['rank']}: " if r.get("rank") is not None else ""
    size = f" of {format_bytes(r['oom_size'])}" if r.get("oom_size") else ""
    site = r.get("oom_site") or {}
    if site.get("script_line"):
        own = f" (in {site['own_code']})" if site.get("own_code") else ""
        return (
            f"{who}{r['allocator']} runs out of memory on {gpu_spec} in step {site['steps_done'] + 1}, at "
            f"{site['script_line']}{own}: an allocation{size} (event {r['oom_event']:,} of the trace)"
        )
    return f"{who}{r['allocator']} runs out of memory on {gpu_spec} at event {r['oom_event']:,} of the trace: an allocation{size}"


def compile_notes(fg: Dict[str, Any]) -> List[str]:
    """The report's notes on compiled programs and CUDA graphs (the fake GPU's summary)."""
    notes = []
    c = fg.get("compile") or {}
    if fg.get("compiled") and not c:
        notes.append(
            f"torch.compile was called {fg['compiled']} time(s) on the Python engine: traced eagerly, as if not "
            "compiled (the native engine runs the compiled program)"
        )
    elif c and fg.get("compiled"):
        cached = (
            f", {c['cache_hits']:,} of its forward and backward programs from the cache" if c.get("cache_hits") else ""
        )
        breaks = f", {c['graph_breaks']:,} graph break(s)" if c.get("graph_breaks") else ""
        notes.append(
            f"torch.compile: {c['graphs']:,} graph(s){breaks} compiled by Inductor as for this GPU{cached} "
            f"({c['seconds']:.1f} s); the compiled program's buffers are in the trace as its wrapper allocates "
            f"them; its {c['triton_kernels']:,} Triton kernel(s) were not built (a launch allocates nothing)"
        )
    if any("max-autotune" in m for m in c.get("modes") or {}):
        notes.append(
            "max-autotune's benchmarks ran (what they allocate is in the trace) but timed nothing on the fake GPU: "
            "each choice fell to its first candidate, ATen's (cuBLAS), whose output is the same size"
        )
    if c.get("user_triton_launches"):
        notes.append(
            f"{c['user_triton_launches']:,} launch(es) of Triton kernels the script or a library launched itself did "
            "nothing (they write into tensors allocated before them)"
        )
    g = fg.get("cuda_graphs") or {}
    if g.get("captures") or g.get("tree_calls"):
        parts = []
        if g.get("captures"):
            parts.append(f"{g['captures']:,} capture(s) and {g.get('replays', 0):,} replay(s)")
        if g.get("tree_calls"):
            parts.append(f"{g['tree_calls']:,} call(s) of torch.compile's CUDA graph trees")
        notes.append(
            "CUDA graphs: " + " and ".join(parts) + ": what a capture allocates comes from its private pool, kept "
            "apart from other memory in the replay; replays allocate nothing"
        )
    if fg.get("flex_eager"):
        notes.append(
            f"flex_attention ran {fg['flex_eager']:,} time(s) without torch.compile: torch's unfused path, which "
            "materialises the attention scores (compiled, it is one fused kernel: output and log-sum-exp)"
        )
    return notes

"""``python -m cudapool ab --simulate``: a user's script traced on a fake GPU, predicted by replay.

The scripts (tests/sim_scripts/) are written as users write them: an HF-style causal LM loop, a
torchvision-style CNN loop with a pinned data loader, a loop that prints ``loss.item()`` every
step, ``torch.compile``, and a custom operator that cannot run. Each test checks the command
against something it does not compute itself: the tracer's API on the same program, the replay
command at the same capacity, the trace at the values next to the max batch it found.
"""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

torch = pytest.importorskip("torch")

from cudapool.fakegpu import cublas_workspace_bytes, gpu_model  # noqa: E402
from cudapool.fakegpu.native import why_unavailable  # noqa: E402
from cudapool.fakegpu.tracer import Tracer  # noqa: E402
from cudapool.lab.replay import replay  # noqa: E402
from cudapool.lab.trace import ALLOC, FREE, load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "sim_scripts"
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
NATIVE_WHY = why_unavailable()


def simulate(tmp_path: Path, *argv: str, expect: int = 0, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "cudapool", "ab", "--simulate", *argv],
        env=ENV if env is None else env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        check=False,
    )
    assert done.returncode == expect, done.stdout + done.stderr
    return done


def line_of(script: str, text: str) -> str:
    """ "script.py:N" of the first line holding `text`."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return f"{script}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def rows(result: dict) -> dict:
    return {r["allocator"]: r for r in result["rows"]}


def sizes(trace) -> list:
    """(action, id, size) of every allocation and free, in order."""
    return [(action, ident, size) for action, ident, size, *_ in trace if action in (ALLOC, FREE)]


def test_hf_style_loop_is_the_tracer_api_trace(tmp_path: Path) -> None:
    # The Python engine is the tracer's API (the native engine's differences are where torch's
    # own CUDA paths differ from fake tensors': test_native_engine.py).
    args = ["--batch-size", "2", "--steps", "2", "--layers", "2", "--d-model", "64", "--ctx", "32"]
    simulate(
        tmp_path,
        "--engine",
        "python",
        "--json",
        "out.json",
        "--trace",
        "t.cptrace",
        "--",
        str(SCRIPTS / "hf_style.py"),
        *args,
    )
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["predicted"] is True and result["trace"]["status"] == "finished"
    assert result["trace"]["optimizer_steps"] == 2
    # The same program through the tracer's API: the model made on CUDA directly, the loop as
    # the script's (its variables live as long as there).
    ns = runpy.run_path(str(SCRIPTS / "hf_style.py"), run_name="not_main")

    def program() -> None:
        with torch.device("cuda"):
            model = ns["CausalLM"](1000, 64, 2, 4, 32)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        for _ in range(2):
            input_ids = torch.randint(0, 1000, (2, 32)).to("cuda", non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids, labels=input_ids)
            out.loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: F841 (lives on, as there)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)

    # The host is real and the cuBLAS workspaces are modelled, as under ab --simulate on an H100.
    with Tracer(device="cuda", host="real", workspace_bytes=cublas_workspace_bytes(gpu_model("H100"))) as tr:
        program()
    api = tr.trace()
    simulated = load(str(tmp_path / "t.cptrace"))
    # Allocations in order; frees as a set (two frees at one statement come in either order).
    assert [e for e in sizes(simulated) if e[0] == ALLOC] == [e for e in sizes(api) if e[0] == ALLOC]
    assert sorted(e for e in sizes(simulated) if e[0] == FREE) == sorted(e for e in sizes(api) if e[0] == FREE)
    for name, row in rows(result).items():
        if row["simulated"]:
            assert row["peak_allocated"] == replay(api, policy=row["policy"])["peak_allocated"], name


def test_torchvision_style_fits_as_replay_capacity_says(tmp_path: Path) -> None:
    script = [str(SCRIPTS / "cnn_style.py"), "--batch-size", "8", "--width", "16"]
    simulate(tmp_path, "--gpu", "80GB", "--json", "big.json", "--trace", "t.cptrace", "--", *script)
    smallest = {
        k: r["min_capacity"] for k, r in rows(json.loads((tmp_path / "big.json").read_text())).items() if r["simulated"]
    }
    assert smallest["cudapool"] < smallest["builtin"], smallest
    capacity = (smallest["cudapool"] + smallest["builtin"]) // 2  # cudapool fits, builtin does not
    simulate(tmp_path, "--gpu", str(capacity), "--json", "small.json", "--", *script)
    result = json.loads((tmp_path / "small.json").read_text())
    small = rows(result)
    assert small["cudapool"]["fits"] and not small["builtin"]["fits"]
    # The smallest GPU memory counts the CUDA context's estimate; the allocator gets the rest.
    outside = result["outside"]["total"]
    assert outside > 256 << 20 and not result["outside"]["given"]
    for policy in ("builtin", "expandable", "cudapool"):
        done = subprocess.run(
            [sys.executable, "-m", "cudapool", "replay", "t.cptrace", "--policy", policy]
            + ["--capacity", str(capacity - outside)]
            + ["--json", "-", "--no-progress"],
            env=ENV,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert (not json.loads(done.stdout)["oom"]) == small[policy]["fits"], policy
    assert small["async"]["simulated"] is False


def test_a_loop_that_reads_loss_item_every_step_runs_to_the_end(tmp_path: Path) -> None:
    done = simulate(tmp_path, "--json", "out.json", "--", str(SCRIPTS / "item_every_step.py"), "5")
    result = json.loads((tmp_path / "out.json").read_text())
    t = result["trace"]
    assert t["status"] == "finished" and t["optimizer_steps"] == 5
    assert (
        t["fake_gpu"]["value_reads"] >= 5
        and line_of("item_every_step.py", "loss.item():.4f") in t["fake_gpu"]["value_read_sites"]
    )
    assert "step 4: loss 0.0000" in t["output_tail"] and "done" in t["output_tail"]
    assert "PREDICTED, not measured" in done.stdout and "it got zeros" in done.stdout


def test_strict_values_makes_a_read_an_error_naming_the_line(tmp_path: Path) -> None:
    done = simulate(tmp_path, "--strict-values", "--", str(SCRIPTS / "item_every_step.py"), "5", expect=1)
    assert (
        line_of("item_every_step.py", "loss.item():.4f") in done.stderr and "its value is not simulated" in done.stderr
    )
    assert "Traceback" not in done.stderr


def test_a_custom_op_that_cannot_run_is_named_with_its_line(tmp_path: Path) -> None:
    # torch's fake tensors need the op's fake implementation, which this one does not have.
    done = simulate(tmp_path, "--engine", "python", "--", str(SCRIPTS / "custom_op.py"), expect=1)
    assert line_of("custom_op.py", "y = scale(x)") in done.stderr and "mylib::scale" in done.stderr, done.stderr
    assert "no fake (meta) implementation" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(NATIVE_WHY is not None, reason=f"the native engine cannot run here: {NATIVE_WHY}")
def test_a_custom_op_of_torch_operations_runs_on_the_native_engine(tmp_path: Path) -> None:
    # Its implementation's operations run on the fake GPU as on a GPU: their memory is traced.
    done = simulate(tmp_path, "--engine", "native", "--json", "out.json", "--", str(SCRIPTS / "custom_op.py"))
    t = json.loads((tmp_path / "out.json").read_text())["trace"]
    assert t["status"] == "finished" and t["fake_gpu"]["engine"] == "native"
    assert t["events"] == 2 and t["peak_allocated"] == 2 * 16  # x, then scale's x * 2
    assert "cudapool's fake GPU below Python" in done.stdout
    assert "tensor([0., 0., 0., 0.], device='cuda:0')" in done.stderr  # the script's print: simulated zeros


def test_max_steps_stops_a_long_script(tmp_path: Path) -> None:
    script = [str(SCRIPTS / "hf_style.py"), "--steps", "1000", "--d-model", "32", "--ctx", "16"]
    done = simulate(tmp_path, "--max-steps", "3", "--json", "out.json", "--", *script)
    t = json.loads((tmp_path / "out.json").read_text())["trace"]
    assert t["status"] == "stopped" and t["optimizer_steps"] == 3
    assert "stopped after --max-steps 3" in done.stdout


def test_torch_compile_on_the_python_engine_runs_eagerly_and_says_so(tmp_path: Path) -> None:
    done = simulate(tmp_path, "--engine", "python", "--json", "out.json", "--", str(SCRIPTS / "compiled.py"))
    t = json.loads((tmp_path / "out.json").read_text())["trace"]
    assert t["status"] == "finished" and t["fake_gpu"]["compiled"] == 1
    assert "traced eagerly" in done.stdout


def test_find_max_batch_is_the_largest_that_fits(tmp_path: Path) -> None:
    gpu = str((24 << 20) + 2 * (32 << 20))  # 24 MiB beside the two cuBLAS workspaces of an H100
    script = [str(SCRIPTS / "cnn_style.py"), "--width", "16", "--batch-size", "4"]
    steps = ["--max-steps", "2"]  # the peak is reached by the second step (momentum made in the first)
    simulate(
        tmp_path, "--gpu", gpu, "--outside", "0", "--allocators", "builtin,cudapool", "--find-max-batch",
        "--batch-size", "--max-batch-range", "1:24", *steps, "--json", "out.json", "--", *script,
    )  # fmt: skip
    found = json.loads((tmp_path / "out.json").read_text())["max_batch"]["results"]
    by_hand: dict = {}  # value -> its trace, traced once for both allocators

    def trace_at(value: int) -> object:
        if value not in by_hand:
            out = tmp_path / f"by-hand-{value}"
            subprocess.run(
                [sys.executable, "-m", "cudapool.ab.sim_child", "--gpu", gpu, *steps, "--out", str(out), "--"]
                + script[:-1] + [str(value)],
                env=ENV, capture_output=True, timeout=300, check=True, cwd=tmp_path,
            )  # fmt: skip
            by_hand[value] = load(str(out / "trace.cptrace"))
        return by_hand[value]

    for name, policy in (("builtin", "builtin"), ("cudapool", "cudapool")):
        best = found[name]["max"]
        assert best is not None and 1 <= best < 24, found
        for value, fits in ((best, True), (best + 1, False)):  # by hand: the trace at each value
            oom = replay(trace_at(value), policy=policy, capacity=int(gpu))["oom"]
            assert (not oom) == fits, (name, value)


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--gpu", "B200X", "--", "x.py"], "unknown GPU 'B200X'"),
        (["--gpu", "0GB", "--", "x.py"], "GPU memory must be positive"),
        (["--max-steps", "0", "--", "x.py"], "--max-steps must be at least 1"),
        (["x.py"], "put -- before the script"),
        (["--", "missing.py"], "no such file"),
        (["--find-max-batch", "batch", "--", "x.py"], "name the script's option"),
    ],
)
def test_bad_command_lines_exit_2(tmp_path: Path, argv: list, expect: str) -> None:
    (tmp_path / "x.py").write_text("pass\n")
    done = simulate(tmp_path, *argv, expect=2)
    assert expect in done.stderr, done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the hint is for machines without a GPU")
def test_ab_without_a_gpu_points_at_simulate(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("import torch\n")
    done = subprocess.run(
        [sys.executable, "-m", "cudapool", "ab", "--allocators", "builtin", "--", "x.py"],
        env=ENV, capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "memory figures unavailable: CUDA is not available\n" in done.stdout
    assert "python -m cudapool ab --simulate" in done.stdout


@pytest.mark.parametrize(
    "source, expect",
    [
        (
            'import torch\nx = torch.randn(8, device="cuda")\nidx = x.nonzero()\n',
            "dyn.py:3: `idx = x.nonzero()`: aten::nonzero cannot be simulated: its output's shape depends on tensor values",
        ),
        (
            "import torch.distributed as dist\n"
            'dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)\n',
            "dyn.py:2: ",
        ),
    ],
)
def test_what_cannot_be_simulated_says_what_and_where(tmp_path: Path, source: str, expect: str) -> None:
    (tmp_path / "dyn.py").write_text(source)
    done = simulate(tmp_path, "--allocators", "builtin", "--", "dyn.py", expect=1)
    assert expect in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


FIDELITY_PROGRAMS = {
    "infer fp32": "tf.infer(model, 'cuda', False)",
    "infer bf16 autocast": "tf.infer(model, 'cuda', True)",
    "train": "tf.train(model, 'cuda')",
    "train shared": "tf.train_shared(model, 'cuda')",
    "train bf16": "tf.train_bf16(model, 'cuda')",
    "train indexed": "tf.train_indexed(model, 'cuda')",
}


@pytest.mark.parametrize("name", sorted(FIDELITY_PROGRAMS))
def test_the_tracer_fidelity_programs_as_scripts_predict_the_tracers_peak(tmp_path: Path, name: str) -> None:
    """benchmarks/tracer_fidelity.py's programs, run as scripts (the model made on "cuda" in the
    script): the predicted peak allocated is the tracer's of the same program."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import tracer_fidelity as tf
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    script = tmp_path / "program.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'benchmarks')!r})\nimport tracer_fidelity as tf\n"
        f"model = tf.mlp('cuda')\nout = {FIDELITY_PROGRAMS[name]}\n"
    )
    simulate(tmp_path, "--allocators", "builtin,cudapool", "--json", "out.json", "--", str(script))
    predicted = rows(json.loads((tmp_path / "out.json").read_text()))
    with Tracer(device="cuda", host="real", workspace_bytes=cublas_workspace_bytes(gpu_model("H100"))) as tr:
        model = tf.mlp("cuda")
        out = eval(FIDELITY_PROGRAMS[name], {"tf": tf, "model": model})  # noqa: S307 - the table above
        del out, model
    api = tr.trace()
    for policy in ("builtin", "cudapool"):
        assert predicted[policy]["peak_allocated"] == replay(api, policy=policy)["peak_allocated"], (name, policy)

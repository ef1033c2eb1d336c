"""``ab --simulate`` as a newcomer meets it: the help, the report's first line, its table and
notes, the script's output, failures, ``--find-max-batch``, ``info``, ``run`` without a GPU,
the install, and the Python API (``cudapool.ab.estimate.estimate_memory``), each checked against
what the user typed or what the script itself implies."""

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cudapool.fakegpu.native import why_unavailable  # noqa: E402
from test_ab_simulate import simulate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "sim_scripts"
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
NATIVE_WHY = why_unavailable()
MIB = 1 << 20
native = pytest.mark.skipif(NATIVE_WHY is not None, reason=f"the native engine cannot run: {NATIVE_WHY}")


def cudapool(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cudapool", *argv], env=ENV, capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_ab_help_shows_the_simulate_options() -> None:
    text = cudapool("ab", "--help").stdout
    for option in ("--gpu", "--max-steps", "--find-max-batch", "--outside", "--wide", "--nproc-per-node"):
        assert re.search(rf"^\s+{option}\b", text, re.M), option
    # --max-steps says the same in both helps and in the docs: whichever comes first
    assert "whichever comes first" in " ".join(text.split())
    assert "whichever comes first" in " ".join(cudapool("ab", "--simulate", "--help").stdout.split())
    assert "whichever counts more" not in (ROOT / "docs" / "ab.md").read_text()


def test_the_first_line_is_the_command_that_reproduces_the_run(tmp_path: Path) -> None:
    argv = ["--gpu", "24GB", "--allocators", "builtin,cudapool", "--max-steps", "2", "--engine", "auto",
            "--find-max-batch", "--batch-size", "--max-batch-range", "1:8", "--hide-output", "--outside", "0",
            "--json", "out.json", "--", str(SCRIPTS / "affine.py"), "--batch-size", "2"]  # fmt: skip
    first = simulate(tmp_path, *argv).stdout.splitlines()[0]
    words = shlex.split(first)
    assert words[:5] == ["python", "-m", "cudapool", "ab", "--simulate"]
    given = {w for w in argv if w.startswith("--")} - {"--engine"}  # the default engine is not repeated
    assert given <= set(words), given - set(words)
    # the same command again: the same prediction
    again = simulate(tmp_path, *words[5:]).stdout
    assert again.splitlines()[0] == first
    first_json = json.loads((tmp_path / "out.json").read_text())
    assert first_json["max_batch"]["results"]["builtin"]["max"] == 8


def test_the_table_fits_100_columns_and_wide_shows_the_rest(tmp_path: Path) -> None:
    script = [str(SCRIPTS / "hf_style.py"), "--steps", "2", "--d-model", "32", "--ctx", "16"]
    narrow = simulate(tmp_path, "--gpu", "A100-80GB", "--", *script).stdout
    table = narrow.split("\n\n")[1].splitlines()
    assert table[0].startswith("allocator") and max(len(line) for line in table) <= 100, table
    wide = simulate(tmp_path, "--gpu", "A100-80GB", "--wide", "--", *script).stdout
    assert "device calls" in wide and "device calls" not in narrow and "utilization" in wide


@native
def test_a_note_explains_peak_allocated_differing_between_allocators(tmp_path: Path) -> None:
    simulate(tmp_path, "--json", "out.json", "--", str(SCRIPTS / "odd_block.py"))
    result = json.loads((tmp_path / "out.json").read_text())
    peaks = {r["allocator"]: r["peak_allocated"] for r in result["rows"] if r["simulated"]}
    # 11.5 MiB twice: torch's allocator hands out 12 MiB blocks (the 0.5 MiB left is too small to split)
    assert peaks["builtin"] == 24 * MIB and peaks["cudapool"] == 23 * MIB, peaks
    out = simulate(tmp_path, "--", str(SCRIPTS / "odd_block.py")).stdout
    assert "peak allocated differs between allocators (23.00 MiB to 24.00 MiB)" in out


def test_the_cublas_note_only_where_a_matrix_multiply_ran(tmp_path: Path) -> None:
    none = simulate(tmp_path, "--", str(SCRIPTS / "odd_block.py")).stdout
    assert "cuBLAS" not in none
    some = simulate(tmp_path, "--", str(SCRIPTS / "hf_style.py"), "--steps", "1", "--d-model", "32", "--ctx", "16")
    assert "cuBLAS workspaces are in the trace (2 of 32.00 MiB" in some.stdout


@native
def test_out_of_memory_names_the_step_and_the_line(tmp_path: Path) -> None:
    out = simulate(tmp_path, "--gpu", "10GB", "--allocators", "builtin", "--", str(SCRIPTS / "oom_line.py")).stdout
    assert "builtin runs out of memory on 10GB in step 1, at oom_line.py:8: `z = y + 1`" in out, out
    assert "an allocation of 4.00 GiB" in out and "OOM at event" not in out


def test_hide_output_hides_warnings_and_stderr_too(tmp_path: Path) -> None:
    shown = simulate(tmp_path, "--", str(SCRIPTS / "warns.py")).stderr
    for line in ("to stderr", "to stdout", "a warning of the script's own"):
        assert any(x.startswith("| ") and line in x for x in shown.splitlines()), (line, shown)
    hidden = simulate(tmp_path, "--hide-output", "--", str(SCRIPTS / "warns.py")).stderr
    assert "to stderr" not in hidden and "a warning of the script's own" not in hidden, hidden


@pytest.mark.parametrize("direct", [True, False])
def test_a_missing_package_is_named_the_same_wherever_it_is_imported(tmp_path: Path, direct: bool) -> None:
    args = ["--direct"] if direct else []
    done = simulate(tmp_path, "--", str(SCRIPTS / "missing_module.py"), *args, expect=1)
    line = done.stderr.strip().splitlines()[-1]
    where = "missing_module.py:7" if direct else "helpers.py:3"
    assert where in line and "No module named 'cudapool_no_such_package': not installed here" in line, line
    assert "cannot be simulated" not in line and "its own code raised it" not in line, line


def test_find_max_batch_predicts_and_confirms_in_a_few_traces(tmp_path: Path) -> None:
    # 64 MiB of weights and 4 MiB a sample, alone on the GPU (--outside 0): 37 samples fit in 214 MiB.
    gpu = str((64 + 4 * 37 + 2) * MIB)
    done = simulate(tmp_path, "--gpu", gpu, "--outside", "0", "--allocators", "builtin,cudapool", "--find-max-batch",
                    "--batch-size", "--json", "out.json", "--", str(SCRIPTS / "affine.py"), "--batch-size", "4")  # fmt: skip
    found = json.loads((tmp_path / "out.json").read_text())["max_batch"]
    for name in ("builtin", "cudapool"):
        assert found["results"][name]["max"] == 37, found["results"][name]
        assert found["results"][name]["found_by"] == "predicted"
    assert len(found["traces"]) <= 4, found["traces"]  # besides the first run's, shared by both
    assert "--batch-size 37: builtin fits, 2.00 MiB to spare" in done.stderr
    assert "--batch-size 38: builtin does not fit: needs 2.00 MiB more" in done.stderr


def test_predict_max_is_bisection_where_memory_is_not_affine() -> None:
    from cudapool.ab.common import bisect_max, predict_max

    for limit in (1, 7, 100, 999):
        need = lambda v: v * v  # noqa: E731 - far from affine
        found, how = predict_max(lambda v: need(v) <= limit * limit, need, limit * limit, 1, 1000)
        assert found == bisect_max(lambda v: v <= limit, 1, 1000) == limit, (limit, found, how)


def test_run_without_a_gpu_says_where_the_prediction_is(tmp_path: Path) -> None:
    from cudapool import _C

    if _C.cuda_info().get("available"):
        pytest.skip("a CUDA driver is here: run uses the GPU")
    done = cudapool("run", str(SCRIPTS / "no_gpu.py"))
    assert "this machine has no CUDA GPU" in done.stderr
    assert f"python -m cudapool ab --simulate -- {SCRIPTS / 'no_gpu.py'}" in done.stderr
    assert "no device pool was created (nothing was allocated" not in done.stderr


def test_info_says_which_engine_ab_simulate_uses() -> None:
    out = cudapool("info").stdout
    line = next(x for x in out.splitlines() if x.startswith("ab --simulate (no GPU needed): "))
    assert ("the native engine" in line) == (NATIVE_WHY is None), line
    path = next((x for x in out.splitlines() if x.startswith("allocator path of cudapool.enable(): ")), "")
    if path and not path.split(": ", 1)[1].startswith("pluggable"):
        assert "pluggable allocator hooks offered" not in out  # not the path enable() takes


def test_the_install_compiles_a_source_per_core() -> None:
    tree = ast.parse((ROOT / "setup.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_compile_in_parallel")
    scope: dict = {"os": os}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "setup.py", "exec"), scope)
    cores = min(4, os.cpu_count() or 1)
    # Each compile waits until `cores` of them run at once: sources compiled one after another
    # never get there, and the barrier breaks after its timeout.
    together = threading.Barrier(cores, timeout=60)
    arrived = [0]
    lock = threading.Lock()

    class Compiler:
        def _setup_compile(self, out, macros, incdirs, sources, depends, extra):
            objects = [s + ".o" for s in sources]
            return macros, objects, extra, [], {o: (s, ".cpp") for o, s in zip(objects, sources)}

        def _get_cc_args(self, pp_opts, debug, before):
            return []

        def _compile(self, obj, src, ext, cc_args, extra, pp_opts):
            with lock:
                first = arrived[0] < cores
                arrived[0] += 1
            if first:
                together.wait()

    objects = scope["_compile_in_parallel"](Compiler(), ["a.cpp", "b.cpp", "c.cpp", "d.cpp"], "out", [], [], 0, [], [])
    assert objects == ["a.cpp.o", "b.cpp.o", "c.cpp.o", "d.cpp.o"]
    assert arrived[0] == 4 and not together.broken


def test_the_docs_say_what_a_script_needs_offline() -> None:
    text = (ROOT / "docs" / "ab.md").read_text()
    assert "### What a script needs offline" in text and "tokenizer" in text


@native
def test_the_python_api_example_of_the_docs_runs(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "ab.md").read_text()
    example = text.split("### From Python: `estimate_memory`", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "example.py").write_text(example)
    done = subprocess.run([sys.executable, "example.py"], env=ENV, capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("PREDICTED, not measured: NVIDIA H100 80GB HBM3") and "the function" in done.stdout


@native
def test_the_python_api_on_a_script_and_a_function_that_fails(tmp_path: Path) -> None:
    from cudapool.ab.estimate import estimate_memory

    est = estimate_memory(str(SCRIPTS / "affine.py"), "--batch-size", "8", gpu="1GB", outside=0, quiet=True,
                          allocators="builtin")  # fmt: skip
    assert est.peak_allocated == {"builtin": (64 + 32) * MIB} and est.fits == {"builtin": True}
    assert est.to_dict()["argv"] == [str(SCRIPTS / "affine.py"), "--batch-size", "8"]
    with pytest.raises(ValueError, match="no such file"):
        estimate_memory(str(tmp_path / "nothing.py"))
    with pytest.raises(ValueError, match="unknown GPU"):
        estimate_memory(str(SCRIPTS / "affine.py"), gpu="H900")


def test_a_scripts_own_error_on_a_torchrun_variable_is_its_own(tmp_path: Path) -> None:
    script = tmp_path / "lr.py"
    script.write_text('import os\n\nrank = int(os.environ["LOCAL_RANK"])\n')
    line = simulate(tmp_path, "--", str(script), expect=1).stderr.strip().splitlines()[-1]
    assert "lr.py failed: lr.py:3: `rank = int(os.environ[\"LOCAL_RANK\"])`: KeyError: 'LOCAL_RANK'" in line, line
    assert "--nproc-per-node N" in line and "cannot be simulated" not in line and "(its own code" not in line

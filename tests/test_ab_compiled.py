"""``ab --simulate`` on compiled programs: torch.compile (Inductor's program, run as compiled),
CUDA graphs (captures from private pools, replays that allocate nothing, graph trees),
flex_attention, Triton kernels a script launches, cuDNN's workspaces, and the memory set aside
outside PyTorch's allocator (--outside).

Each test checks the prediction against what it does not compute itself: the eager program's
memory, the sizes torch's documentation gives for a buffer, the replay command at the capacity
the report says it used.
"""

import json
import os
import subprocess
from pathlib import Path
from typing import List

import pytest

torch = pytest.importorskip("torch")

from cudapool.fakegpu.graphs import POOL_STREAMS  # noqa: E402
from cudapool.fakegpu.native import why_unavailable  # noqa: E402
from cudapool.lab.trace import ALLOC, load  # noqa: E402
from test_ab_simulate import simulate as run_simulate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "sim_scripts"
NATIVE_WHY = why_unavailable()
pytestmark = pytest.mark.skipif(NATIVE_WHY is not None, reason=f"the native engine cannot run: {NATIVE_WHY}")
MIB = 1 << 20


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The package from this checkout, and one compile cache for the module's runs."""
    cache = tmp_path_factory.mktemp("compile-cache")
    return dict(os.environ, PYTHONPATH=str(ROOT / "python"), CUDAPOOL_COMPILE_CACHE=str(cache))


def simulate(tmp_path: Path, env: dict, *argv: str, expect: int = 0) -> subprocess.CompletedProcess:
    return run_simulate(tmp_path, "--allocators", "builtin", *argv, expect=expect, env=env)


def result(tmp_path: Path, env: dict, script: str, *args: str, options: List[str] = ()) -> dict:  # type: ignore[assignment]
    name = f"{script}{'-'.join(args)}{'-'.join(options)}".replace("/", "_")
    done = simulate(tmp_path, env, *options, "--json", f"{name}.json", "--trace", f"{name}.cptrace", "--",
                    str(SCRIPTS / script), *args)  # fmt: skip
    out = json.loads((tmp_path / f"{name}.json").read_text())
    out["stdout"] = done.stdout
    out["events"] = list(load(str(tmp_path / f"{name}.cptrace")))
    return out


def builtin(res: dict) -> dict:
    return next(r for r in res["rows"] if r["allocator"] == "builtin")


def test_a_compiled_program_allocates_what_inductor_fused(tmp_path: Path, env: dict) -> None:
    # x (2 MiB) and w (4 MiB) are live throughout; each output is 1024 x 2048 float32: 8 MiB.
    out = 8 * MIB
    eager = result(tmp_path, env, "compiled_gelu.py", "--eager")
    compiled = result(tmp_path, env, "compiled_gelu.py")
    inputs = 6 * MIB
    # Eagerly the GELU's intermediates (h, h**3, the sums, tanh) are tensors of the output's size.
    assert builtin(eager)["peak_allocated"] - inputs >= 3 * out + 32 * MIB, builtin(eager)
    # Compiled: the matrix multiply's output and one fused kernel's (or the same buffer reused),
    # beside the cuBLAS workspace (32 MiB on an H100).
    assert builtin(compiled)["peak_allocated"] - inputs <= 2 * out + 32 * MIB, builtin(compiled)
    c = compiled["trace"]["fake_gpu"]["compile"]
    assert c["graphs"] == 1 and c["triton_kernels"] >= 1, c
    assert "compiled by Inductor as for this GPU" in compiled["stdout"]
    assert "Triton kernel(s) were not built" in compiled["stdout"]
    # torch.cuda.max_memory_allocated() in the script is the trace's peak (sizes of 512-byte multiples).
    assert f"peak {builtin(compiled)['peak_allocated']}" in compiled["trace"]["output"]


def test_reduce_overhead_runs_on_the_graph_trees_pool(tmp_path: Path, env: dict) -> None:
    res = result(tmp_path, env, "compiled_gelu.py", "--mode", "reduce-overhead")
    graphs = res["trace"]["fake_gpu"]["cuda_graphs"]
    assert graphs["tree_calls"] == 3, graphs
    pooled = [e for e in res["events"] if e[0] == ALLOC and e[3] >= POOL_STREAMS]
    # Each call's output and the matrix multiply's buffer come from the trees' one pool.
    assert len(pooled) >= 3 and len({e[3] for e in pooled}) == 1, pooled
    assert "call(s) of torch.compile's CUDA graph trees" in res["stdout"]


def test_captures_allocate_from_private_pools_and_replays_allocate_nothing(tmp_path: Path, env: dict) -> None:
    res = result(tmp_path, env, "graphs.py")
    out = "\n".join(res["trace"]["output"])
    captured = int(out.split("captured ")[1].split()[0])
    replayed = int(out.split("replayed ")[1].split()[0])
    assert captured == replayed  # five replays, and the random inputs copied in are freed
    graphs = res["trace"]["fake_gpu"]["cuda_graphs"]
    assert graphs["captures"] == 3 and graphs["replays"] >= 5, graphs  # one by hand, forward and backward
    pools = {e[3] for e in res["events"] if e[0] == ALLOC and e[3] >= POOL_STREAMS}
    assert len(pools) == 2, pools  # the hand capture's pool, and make_graphed_callables' shared one
    # The hand capture's allocations: the two layers' outputs (64 x 1024 and 64 x 256 float32)
    # and the cuBLAS workspace of the capture stream.
    first = sorted(e[2] for e in res["events"] if e[0] == ALLOC and e[3] == min(pools))
    assert 64 * 1024 * 4 in first and 64 * 256 * 4 in first, first


def test_flex_attention_compiled_allocates_its_fused_kernels_outputs(tmp_path: Path, env: dict) -> None:
    eager = result(tmp_path, env, "flex.py", "--eager")
    compiled = result(tmp_path, env, "flex.py")
    scores = 2 * 4 * 1024 * 1024 * 4  # one float32 score per query and key: 32 MiB
    assert builtin(eager)["peak_allocated"] > scores
    assert builtin(compiled)["peak_allocated"] < scores // 2
    assert eager["trace"]["fake_gpu"]["flex_eager"] == 1
    assert "flex_attention ran 1 time(s) without torch.compile" in eager["stdout"]
    assert "without torch.compile" not in compiled["stdout"]


def test_a_scripts_own_triton_kernel_launches_nothing(tmp_path: Path, env: dict) -> None:
    pytest.importorskip("triton")
    res = result(tmp_path, env, "user_triton.py")
    assert res["trace"]["status"] == "finished"
    assert res["trace"]["fake_gpu"]["compile"]["user_triton_launches"] == 1
    assert builtin(res)["peak_allocated"] == 3 * 4 * MIB  # x, y and out


def test_cudnn_benchmark_searches_once_per_configuration(tmp_path: Path, env: dict) -> None:
    on = result(tmp_path, env, "convs.py", "--benchmark", "1")
    off = result(tmp_path, env, "convs.py", "--benchmark", "0")
    # The 3x3 convolution's lowered input: batch 4 x 16 channels x 9 positions x 64 x 64 outputs, float32.
    lowered = 4 * 16 * 9 * 64 * 64 * 4
    sizes_on = [e[2] for e in on["events"] if e[0] == ALLOC]
    sizes_off = [e[2] for e in off["events"] if e[0] == ALLOC]
    # Searched at its first forward and first backward (weight only: the input needs no gradient),
    # not at the second step; the 1x1 convolution needs none.
    assert sizes_on.count(lowered) == 2 and sizes_off.count(lowered) == 0
    assert on["trace"]["fake_gpu"]["cudnn"]["searches"] == 2
    assert "cudnn.benchmark's search" in on["stdout"] and "a model's, not cuDNN's" in on["stdout"]


def test_cudnn_half_precision_weight_gradients_accumulate_in_float32(tmp_path: Path, env: dict) -> None:
    res = result(tmp_path, env, "convs.py", "--bf16")
    sizes = [e[2] for e in res["events"] if e[0] == ALLOC]
    # Each backward-weight pass: the weight's size in float32 (32x16x3x3 and 8x32x1x1).
    assert sizes.count(32 * 16 * 9 * 4) >= 2 and sizes.count(8 * 32 * 4) >= 2, sizes
    assert "backward-weight float32 accumulators" in res["stdout"]


def test_outside_memory_is_set_aside_and_can_be_given(tmp_path: Path, env: dict) -> None:
    script = "user_triton.py" if _has_triton() else "compiled_gelu.py"
    args = () if script == "user_triton.py" else ("--eager",)
    estimated = result(tmp_path, env, script, *args)
    given = result(tmp_path, env, script, *args, options=["--outside", "1GiB"])
    zero = result(tmp_path, env, script, *args, options=["--outside", "0"])
    context = estimated["outside"]["total"]
    assert 256 * MIB < context < 2048 * MIB and given["outside"] == {
        "total": 1 << 30,
        "given": True,
        "lines": ["--outside 1.00 GiB"],
    }
    smallest = {k: builtin(r)["min_capacity"] for k, r in (("est", estimated), ("given", given), ("zero", zero))}
    assert smallest["est"] - smallest["zero"] == context and smallest["given"] - smallest["zero"] == 1 << 30
    assert "set aside" in estimated["stdout"] and "--outside 1.00 GiB" in given["stdout"]
    assert "--outside 1073741824" in given["stdout"].splitlines()[0]  # the command echoed


def test_outside_larger_than_the_gpu_does_not_fit(tmp_path: Path, env: dict) -> None:
    res = result(tmp_path, env, "compiled_gelu.py", "--eager", options=["--gpu", "1GB", "--outside", "1GB"])
    assert not builtin(res)["fits"]


def test_bad_outside_is_a_usage_error(tmp_path: Path, env: dict) -> None:
    done = simulate(tmp_path, env, "--outside", "lots", "--", str(SCRIPTS / "graphs.py"), expect=2)
    assert "--outside: bad size 'lots'" in done.stderr


def test_a_cuda_driver_call_inside_torch_is_named_not_blamed_on_the_script(tmp_path: Path, env: dict) -> None:
    done = simulate(tmp_path, env, "--", str(SCRIPTS / "driver_call.py"), expect=1)
    line = done.stderr.strip().splitlines()[-1]
    assert "driver_call.py:6" in line and "torch.cuda.memory.caching_allocator_alloc" in line, line
    assert "called the CUDA driver" in line and "its own code" not in line, line


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def test_what_scripts_do_around_the_model_runs_as_on_a_gpu(tmp_path: Path, env: dict) -> None:
    res = result(tmp_path, env, "machine_log.py", options=["--max-steps", "3"])
    out = res["trace"]["output"]
    # nvidia-smi lists the fake GPU, as nvidia-smi lists the GPU
    assert out[0].startswith("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-")
    assert out[1] == f"NVIDIA H100 80GB HBM3, {res['gpu']['total_memory'] >> 20} MiB"
    # Two optimizers per iteration: --max-steps counts iterations (the most-stepped optimizer's).
    assert res["trace"]["status"] == "stopped" and res["trace"]["optimizer_steps"] == 3
    assert [line for line in out if line.startswith("iteration")] == ["iteration 0", "iteration 1", "iteration 2"]
    # copy.deepcopy of the state dict: a second copy of the embedding and the linear layer.
    weights = [e[2] for e in res["events"] if e[0] == ALLOC and e[2] == 1000 * 256 * 4]
    assert len(weights) >= 4, weights  # two weights, and their two copies


def test_a_compiled_function_on_another_rank_runs_on_that_ranks_gpu(tmp_path: Path, env: dict) -> None:
    own = dict(env, CUDAPOOL_COMPILE_CACHE=str(tmp_path / "cold-cache"))  # a rank writing a cold cache
    done = simulate(tmp_path, own, "--nproc-per-node", "2", "--ranks", "1", "--json", "r.json", "--",
                    str(SCRIPTS / "compiled_rank.py"))  # fmt: skip
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["traces"]["1"]["status"] == "finished", done.stderr
    assert "device cuda:1" in "\n".join(res["traces"]["1"].get("output", [])) or "device cuda:1" in done.stderr
    assert any((tmp_path / "cold-cache").rglob("*.py"))  # the compiled program is in the shared cache


def test_float8_matrix_multiplies_compile(tmp_path: Path, env: dict) -> None:
    res = result(tmp_path, env, "fp8_compiled.py")
    assert res["trace"]["status"] == "finished" and "(256, 1024)" in res["trace"]["output"]
    assert 256 * 1024 * 2 in [e[2] for e in res["events"] if e[0] == ALLOC]  # the bfloat16 output


def test_max_autotune_benchmarks_allocate_but_time_nothing(tmp_path: Path, env: dict) -> None:
    res = result(tmp_path, env, "compiled_gelu.py", "--mode", "max-autotune-no-cudagraphs")
    assert res["trace"]["fake_gpu"]["compile"]["modes"] == {"max-autotune-no-cudagraphs": 1}
    assert "max-autotune's benchmarks ran" in res["stdout"]
    # The program it chose is the default mode's: same peak once the benchmarks' buffers are gone.
    default = result(tmp_path, env, "compiled_gelu.py")
    assert builtin(res)["peak_allocated"] >= builtin(default)["peak_allocated"]

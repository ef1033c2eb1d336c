"""``ab --simulate`` on scripts as people write them: the host is real, only the GPU is fake.

Three trainers in the shapes people run (tests/sim_scripts/gpt_memmap.py, char_gpt.py,
lstm_lm.py) must run unchanged; smaller scripts written here check one behaviour each against
what it must be on a GPU machine: host values (batch offsets, slices) are real, tensors print
and format, checkpoints save and load, attention runs the kernel torch picks for the GPU (no
T x T map), cuBLAS workspaces are where torch allocates them, a script's own error is the
script's, memory snapshots come from the simulated run, a gzipped snapshot replays.
"""

import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cudapool.ab.common import bisect_max  # noqa: E402
from cudapool.fakegpu import GPUS, FakeGPU, cublas_workspace_bytes, gpu_model, script_error  # noqa: E402
from cudapool.lab.trace import ALLOC, load  # noqa: E402
from test_ab_simulate import SCRIPTS, simulate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python"))


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def allocations(trace) -> list:
    return [e[2] for e in trace if e[0] == ALLOC]


@pytest.mark.parametrize(
    "name, args, shown",
    [
        ("gpt_memmap.py", ["--iters", "2", "--layers", "2", "--d-model", "128", "--heads", "4", "--vocab", "512"],
         ["iter 1: loss 0.0000", "val loss 0.0000", "saved ckpt.pt"]),
        ("char_gpt.py", ["--steps", "2", "--layers", "2", "--d-model", "64", "--generate", "5"],
         ["step 1: train loss 0.0000", "saved and loaded char_gpt.pt"]),
        ("lstm_lm.py", ["--emsize", "32", "--nhid", "64", "--chunks", "2", "--vocab", "500"],
         ["batch 2 | loss  0.00", "saved lstm.pt"]),
    ],
)  # fmt: skip
def test_the_trainers_run_unchanged_and_show_their_output(tmp_path: Path, name: str, args: list, shown: list) -> None:
    done = simulate(
        tmp_path, "--allocators", "builtin,cudapool", "--json", "out.json", "--", str(SCRIPTS / name), *args
    )
    for line in shown:
        assert f"| {line}" in done.stderr, done.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["trace"]["status"] == "finished"
    assert any(line in result["trace"]["output"] for line in shown)
    fg = result["trace"]["fake_gpu"]
    assert fg["saved_placeholders"] > 0
    if name == "lstm_lm.py":
        assert fg["rnn_calls"] == {"lstm": 3} and "ran as torch's own CUDA cells" in done.stdout


def test_host_values_are_real(tmp_path: Path) -> None:
    """Offsets drawn on the host slice a host array: every batch has its full length (a fake
    host would read the offset as 0 + 0 and make empty slices)."""
    path = script(
        tmp_path,
        "slices.py",
        "import numpy as np, torch\n"
        "data = np.arange(10_000, dtype=np.int64)\n"
        "for _ in range(3):\n"
        "    i = torch.randint(len(data) - 64, (1,))\n"
        "    x = torch.from_numpy(data[i : i + 64]).cuda()\n"
        "    print('shape', tuple(x.shape), 'host sum', int(torch.from_numpy(data[i : i + 4]).sum() - 4 * i - 6))\n",
    )
    done = simulate(tmp_path, "--allocators", "cudapool", "--", path)
    assert done.stderr.count("| shape (64,) host sum 0") == 3, done.stderr


def test_tied_weights_stay_tied_when_moved() -> None:
    with FakeGPU(gpu_model("H100")) as fg:
        emb, head = torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 1000, bias=False)
        emb.weight = head.weight
        model = torch.nn.ModuleList([emb, head]).cuda()
    assert model[0].weight is model[1].weight and model[0].weight.device.type == "cuda"
    assert allocations(fg.tracer.trace()).count(1000 * 64 * 4) == 1


def test_tensors_print_and_format_as_cuda_tensors(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "fmt.py",
        "import torch\n"
        "w = torch.randn(4, 4, device='cuda', requires_grad=True)\n"
        "loss = (w * 2).sum()\n"
        "print(f'loss {loss:.4f}', loss, torch.zeros(2, device='cuda'))\n"
        "print('host', w.detach().cpu().numpy().shape)\n",
    )
    done = simulate(tmp_path, "--allocators", "cudapool", "--json", "out.json", "--", path)
    assert "| loss 0.0000 tensor(0., device='cuda:0', grad_fn=<SumBackward0>) tensor([0., 0.], device='cuda:0')" in (
        done.stderr
    )
    assert "| host (4, 4)" in done.stderr
    fg = json.loads((tmp_path / "out.json").read_text())["trace"]["fake_gpu"]
    assert fg["host_copies"] == 1 and fg["value_reads"] >= 3


def test_a_checkpoint_saved_on_the_fake_gpu_loads_back_onto_it(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "ckpt.py",
        "import torch, torch.nn as nn\n"
        "m = nn.Linear(256, 1024).cuda()\n"
        "torch.save({'model': m.state_dict(), 'step': 3}, 'c.pt')\n"
        "del m\n"
        "state = torch.load('c.pt', map_location='cuda')\n"
        "print('loaded', state['step'], tuple(state['model']['weight'].shape), state['model']['weight'].device)\n",
    )
    done = simulate(tmp_path, "--allocators", "cudapool", "--trace", "t.cptrace", "--", path)
    assert "| loaded 3 (1024, 256) cuda:0" in done.stderr
    sizes = allocations(load(str(tmp_path / "t.cptrace")))
    assert sizes.count(1024 * 256 * 4) == 2  # made, then loaded back
    outside = torch.load(tmp_path / "c.pt", weights_only=False)  # a placeholder file: meta tensors
    assert outside["model"]["weight"].device.type == "meta" and outside["step"] == 3


def test_a_real_checkpoint_loads_onto_the_fake_gpu(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(128, 128)}, tmp_path / "real.pt")
    path = script(
        tmp_path, "load.py", "import torch\nw = torch.load('real.pt', map_location='cuda')['w']\nprint(w.device)\n"
    )
    done = simulate(tmp_path, "--allocators", "cudapool", "--trace", "t.cptrace", "--", path)
    assert "| cuda:0" in done.stderr
    assert 128 * 128 * 4 in allocations(load(str(tmp_path / "t.cptrace")))


def _attention_trace(gpu: str, dtype: torch.dtype, flags: dict = None) -> tuple:
    flags = flags or {}
    with FakeGPU(gpu_model(gpu)) as fg:
        saved = {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")() for k in flags}
        for k, on in flags.items():
            getattr(torch.backends.cuda, f"enable_{k}_sdp")(on)
        try:
            q = torch.randn(1, 2, 1024, 64, device="cuda", dtype=dtype, requires_grad=True)
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            out.sum().backward()
        finally:
            for k, on in saved.items():
                getattr(torch.backends.cuda, f"enable_{k}_sdp")(on)
    return fg.sdpa, allocations(fg.tracer.trace())


@pytest.mark.parametrize(
    "gpu, dtype, backend",
    [("H100", torch.bfloat16, "cudnn"), ("A100-80GB", torch.bfloat16, "flash"), ("T4", torch.float16, "efficient"),
     ("A100-80GB", torch.float32, "efficient")],
)  # fmt: skip
def test_attention_runs_the_kernel_the_gpu_would_pick(gpu: str, dtype: torch.dtype, backend: str) -> None:
    chosen, sizes = _attention_trace(gpu, dtype)
    assert chosen == {backend: 1}
    attention_map = 2 * 1024 * 1024 * dtype.itemsize  # one head's T x T weights, both heads
    assert max(sizes) < attention_map, sizes
    if backend == "flash":  # the backward's float32 accumulators (dq_accum: 1024 x 2 heads x 64)
        assert 1024 * 2 * 64 * 4 in sizes
    _, math_sizes = _attention_trace(gpu, dtype, {"cudnn": False, "flash": False, "mem_efficient": False})
    assert max(math_sizes) >= attention_map  # what the fused kernels spare


def test_cublas_workspaces_per_thread_as_torch_sizes_them() -> None:
    assert cublas_workspace_bytes(GPUS["h100"], config="") == 32 << 20
    assert cublas_workspace_bytes(GPUS["a10080gb"], config="") == 8519680
    assert cublas_workspace_bytes(GPUS["h100"], config=":4096:2:16:8") == 8519680
    assert cublas_workspace_bytes(GPUS["t4"], config=":4096:8") == 32 << 20
    with FakeGPU(gpu_model("A100-80GB")) as fg:
        w = torch.randn(64, 64, device="cuda", requires_grad=True)
        for _ in range(2):
            (w @ w).sum().backward()
    assert allocations(fg.tracer.trace()).count(8519680) == 2  # the forward's and backward's thread


def test_bf16_support_is_answered_as_torch_answers_on_the_gpu() -> None:
    for gpu, native in (("T4", False), ("V100", False), ("A100-80GB", True), ("H100", True)):
        with FakeGPU(gpu_model(gpu)):
            assert torch.cuda.is_bf16_supported()  # emulated where not native, as torch says
            assert torch.cuda.is_bf16_supported(including_emulation=False) == native, gpu


def test_a_scripts_own_error_is_reported_as_the_scripts(tmp_path: Path) -> None:
    path = script(
        tmp_path, "bug.py", "import torch\nx = torch.zeros(3, device='cuda')\nitems = [1, 2]\nprint(items[5])\n"
    )
    done = simulate(tmp_path, "--", path, expect=1)
    assert "bug.py:4: `print(items[5])`: IndexError: list index out of range" in done.stderr
    assert "cannot be simulated" not in done.stderr and "it would on a GPU too" in done.stderr


def test_a_script_that_does_not_compile_is_named_at_its_line(tmp_path: Path) -> None:
    """A SyntaxError is the script's, at the line the compiler names (not runpy's frame), with
    the Python that compiled it: newer syntax fails on an older Python, not on the fake GPU."""
    path = script(tmp_path, "new.py", "x = [1]\nprint(f'{x[')\n")
    try:
        compile(Path(path).read_text(), path, "exec")
    except SyntaxError as exc:
        line = script_error(exc, path)
    else:
        raise AssertionError("the script compiled")
    assert line is not None and line.startswith("new.py:"), line
    assert "SyntaxError" in line and f"Python {sys.version_info[0]}.{sys.version_info[1]}" in line
    assert "<frozen" not in line


def test_memory_history_calls_write_a_snapshot_of_the_simulated_run(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "hist.py",
        "import torch\n"
        "keep = torch.empty(1 << 20, device='cuda')\n"
        "torch.cuda.memory._record_memory_history(max_entries=1000)\n"
        "x = torch.empty(3 << 20, device='cuda')\n"
        "del x\n"
        "torch.cuda.memory._dump_snapshot('snap.pickle')\n",
    )
    done = simulate(tmp_path, "--allocators", "builtin", "--", path)
    assert "snap.pickle" in done.stdout
    snap = pickle.loads((tmp_path / "snap.pickle").read_bytes())
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions.count("alloc") == 1 and "free_completed" in actions  # from the call on
    assert sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated") == 4 << 20
    # Gzipped, the way snapshots are often shared: replay reads it.
    with gzip.open(tmp_path / "snap.pickle.gz", "wb") as f:
        f.write((tmp_path / "snap.pickle").read_bytes())
    out = subprocess.run(
        [sys.executable, "-m", "cudapool", "replay", "snap.pickle.gz"],
        env=ENV, capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_find_max_batch_stops_within_its_step() -> None:
    calls = []

    def ok(v: int) -> bool:
        calls.append(v)
        return v <= 777

    assert bisect_max(ok, 1, 4096) == 777
    exact = len(calls)
    calls.clear()
    found = bisect_max(ok, 1, 4096, rel=0.01)
    assert 777 * 0.99 <= found <= 777 and len(calls) < exact
    calls.clear()
    assert 777 - 50 <= bisect_max(ok, 1, 4096, step=50) <= 777


def test_a_checkout_without_the_extension_names_the_install_command(tmp_path: Path) -> None:
    pkg = tmp_path / "cudapool"
    shutil.copytree(ROOT / "python" / "cudapool", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    out = subprocess.run(
        [sys.executable, "-c", "import cudapool"],
        env=dict(os.environ, PYTHONPATH=str(tmp_path)), capture_output=True, text=True, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert "C extension (cudapool._C) is not built" in out.stderr and "pip install -e ." in out.stderr
    assert "circular import" not in out.stderr

"""memory_summary(all_ranks=True) across 2 CPU processes (torchrun, gloo backend, simulated
pools), and `python -m cudapool run` under torchrun printing it once, on rank 0."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
needs_cuda_build = pytest.mark.skipif(
    not hasattr(torch._C, "_cuda_customAllocator"), reason="`run` enables cudapool: needs a CUDA build of torch"
)

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Rank r allocates r + 1 blocks of 24 MiB through the entry point torch calls.
SCRIPT = """
import ctypes, sys
import torch.distributed as dist
import cudapool
from cudapool import _C

_C.use_sim_devices(256 << 20)
lib = ctypes.CDLL(_C.__file__)
lib.cudapool_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.cudapool_alloc.restype = ctypes.c_void_p
dist.init_process_group("gloo")
rank = dist.get_rank()
for _ in range(rank + 1):
    assert lib.cudapool_alloc(24 << 20, 0, None)
table = cudapool.memory_summary(all_ranks=True)      # every rank gets it
print(f"RANK {rank} TABLE BEGIN\\n{table}RANK {rank} TABLE END")
dist.destroy_process_group()
"""


def torchrun(tmp_path, *args):
    script = tmp_path / "dist_script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDAPOOL_CONF", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args, str(script)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    except subprocess.TimeoutExpired:
        pytest.fail("torchrun did not finish in 240 s")
    if proc.returncode != 0 and "RANK 0 TABLE" not in proc.stdout and "Address already in use" in proc.stderr:
        pytest.skip(f"torchrun cannot start here: {proc.stderr[-500:]}")
    return proc


def rows(table):
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5:
            out[cells[0]] = cells[1:]
    return out


def check_table(table):
    assert "cudapool CUDA memory summary, all 2 ranks" in table
    assert "devices: 0 (simulated device)" in table
    r = rows(table)
    assert r["Metric"] == ["Min", "Max", "Mean", "Worst"]
    assert r["Allocated memory"] == ["24.00 MiB", "48.00 MiB", "36.00 MiB", "1"]
    assert r["GPU reserved mem., peak"] == ["24.00 MiB", "48.00 MiB", "36.00 MiB", "1"]
    assert r["Allocations"] == ["1", "2", "1.5", "1"]
    assert r["CUDA OOMs"] == ["0", "0", "0", "0"]


def between(text, begin, end):
    return text.split(begin, 1)[1].split(end, 1)[0]


def test_all_ranks_summary_two_processes_gloo(tmp_path):
    proc = torchrun(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    t0 = between(proc.stdout, "RANK 0 TABLE BEGIN\n", "RANK 0 TABLE END")
    t1 = between(proc.stdout, "RANK 1 TABLE BEGIN\n", "RANK 1 TABLE END")
    assert t0 == t1
    check_table(t0)


@needs_cuda_build
def test_run_under_torchrun_prints_the_all_ranks_table_once_on_rank_0(tmp_path):
    # The script tears its group down; `run` makes a gloo group of its own to gather.
    proc = torchrun(tmp_path, "-m", "cudapool", "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("cudapool CUDA memory summary, all 2 ranks") == 1, proc.stderr[-3000:]
    assert "device ID" not in proc.stderr  # no per-rank tables
    start = proc.stderr.index("|=====")
    check_table(proc.stderr[start:])


def test_all_ranks_without_torch_distributed_says_what_to_do():
    code = (
        "import cudapool\ntry:\n    cudapool.memory_summary(all_ranks=True)\nexcept RuntimeError as e:\n    print(e)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "init_process_group" in proc.stdout and "not initialised" in proc.stdout

"""The layer check (scripts/check_layers.py) passes on the tree and fails on what breaks it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT / "scripts" / "check_layers.py"


def run_checker(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECKER), str(root)], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the sources the checker reads."""
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    shutil.copytree(
        ROOT / "python" / "cudapool", tmp_path / "python" / "cudapool", ignore=shutil.ignore_patterns("*.so")
    )
    return tmp_path


def add_line(path: Path, line: str) -> None:
    text = path.read_text(encoding="utf-8")
    first_include = text.index("#include") if path.suffix in {".c", ".h"} else 0
    path.write_text(text[:first_include] + line + "\n" + text[first_include:], encoding="utf-8")


def test_the_tree_follows_the_layers() -> None:
    result = run_checker(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_copy_passes(tree: Path) -> None:
    assert run_checker(tree).returncode == 0


@pytest.mark.parametrize(
    "file, line, expect",
    [
        ("csrc/core/pool.c", '#include "backend/sim.h"', 'layer core includes "backend/sim.h" of layer backend'),
        ("csrc/backend/sim.c", '#include "core/cp.h"', 'layer backend includes "core/cp.h" of layer core'),
        ("csrc/base/status.c", '#include "core/cp.h"', 'layer base includes "core/cp.h" of layer core'),
        ("csrc/core/stats.c", '#include "devices/devices.h"', "layer core includes"),
        ("csrc/devices/devices.c", '#include "python/convert.h"', "layer devices includes"),
        ("csrc/core/pool.c", "#include <Python.h>", "only the binding (and its test hooks) talk to CPython"),
        ("csrc/backend/cuda.c", "#include <cuda.h>", "the driver is loaded with dlopen"),
        ("csrc/core/pool.c", '#include "cp_internal.h"', "does not name its layer"),
        ("csrc/core/pool.c", '#include "core/nonexistent.h"', "does not exist under csrc/"),
    ],
)
def test_a_wrong_include_fails(tree: Path, file: str, line: str, expect: str) -> None:
    add_line(tree / file, line)
    result = run_checker(tree)
    assert result.returncode == 1
    assert file in result.stdout and expect in result.stdout, result.stdout


def test_an_import_against_the_ranks_fails(tree: Path) -> None:
    pkg = tree / "python" / "cudapool"
    add_line(pkg / "lab" / "trace.py", "from . import replay  # noqa")
    result = run_checker(tree)
    assert result.returncode == 1
    assert "lab.trace (rank 2) imports lab.replay (rank 3)" in result.stdout, result.stdout


@pytest.mark.parametrize(
    "file, line, expect",
    [
        # the lab must not reach up into the allocator's OOM report
        ("lab/replay.py", "from .. import oom  # noqa", "lab.replay (rank 3) imports oom (rank 5)"),
        # absolute imports of a subpackage's module count too
        (
            "lab/plot.py",
            "from cudapool.lab.replay import replay  # noqa",
            "lab.plot (rank 2) imports lab.replay (rank 3)",
        ),
        # step() for user scripts imports nothing of cudapool
        ("ab/__init__.py", "from .. import _config  # noqa", "ab (rank 0) imports _config (rank 1)"),
        ("ab/command.py", "import cudapool.__main__  # noqa", "ab.command (rank 8) imports __main__ (rank 10)"),
    ],
)
def test_an_import_across_the_packages_fails(tree: Path, file: str, line: str, expect: str) -> None:
    add_line(tree / "python" / "cudapool" / file, line)
    result = run_checker(tree)
    assert result.returncode == 1
    assert expect in result.stdout, result.stdout


def test_a_new_module_without_a_rank_fails(tree: Path) -> None:
    (tree / "python" / "cudapool" / "lab" / "newtool.py").write_text("", encoding="utf-8")
    result = run_checker(tree)
    assert result.returncode == 1
    assert "python/cudapool/lab.newtool: not in the layer table" in result.stdout, result.stdout


def test_an_import_inside_a_function_counts(tree: Path) -> None:
    pkg = tree / "python" / "cudapool"
    text = (pkg / "summary.py").read_text(encoding="utf-8")
    (pkg / "summary.py").write_text(text + "\n\ndef _late():\n    from cudapool import _torch\n", encoding="utf-8")
    result = run_checker(tree)
    assert result.returncode == 1
    assert "summary (rank 1) imports _torch" in result.stdout, result.stdout


def test_a_new_module_needs_a_place(tree: Path) -> None:
    (tree / "python" / "cudapool" / "newthing.py").write_text("x = 1\n", encoding="utf-8")
    result = run_checker(tree)
    assert result.returncode == 1
    assert "newthing: not in the layer table" in result.stdout


def test_a_new_directory_needs_a_layer(tree: Path) -> None:
    (tree / "csrc" / "misc").mkdir()
    (tree / "csrc" / "misc" / "x.c").write_text("int x;\n", encoding="utf-8")
    result = run_checker(tree)
    assert result.returncode == 1
    assert "csrc/misc is not a layer" in result.stdout


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")


@pytest.mark.parametrize(
    "file, text, expect",
    [
        # the block layer calling up into stream-ordered release
        (
            "csrc/core/block.c",
            "void cp_zz_probe(cp_pool_t *pool);\nvoid cp_zz_probe(cp_pool_t *pool) { cp_drain_destroy(pool); }\n",
            "block (rank 6) calls cp_drain_destroy of drain (rank 9)",
        ),
        # a memory source calling the ladder's neighbour source of the same rank
        (
            "csrc/core/expand.c",
            "void cp_zz_probe(cp_pool_t *pool);\nvoid cp_zz_probe(cp_pool_t *pool) { cp_segment_release_free_locked(pool); }\n",
            "expand (rank 7) calls cp_segment_release_free_locked of segment (rank 7)",
        ),
        # a function-like macro counts as a call of the header that defines it
        (
            "csrc/core/capture.c",
            "void cp_zz_probe(cp_pool_t *pool);\nvoid cp_zz_probe(cp_pool_t *pool) { CP_HISTORY(pool, 0, 0, 0, 0); }\n",
            "capture (rank 5) calls CP_HISTORY of history (rank 5)",
        ),
        # an inline function of a header is its file's too
        (
            "csrc/core/stream.c",
            "void cp_zz_probe(cp_pool_t *pool, cp_block_t *b);\n"
            "void cp_zz_probe(cp_pool_t *pool, cp_block_t *b) { cp_block_end_use_locked(pool, b); }\n",
            "stream (rank 3) calls cp_block_end_use_locked of block (rank 6)",
        ),
        # the device table calling up into the private pools (Note [Hooks of the device table])
        (
            "csrc/devices/devices.c",
            "int cpd_zz_probe(void);\nint cpd_zz_probe(void) { return cpd_graph_pools_exist(); }\n",
            "devices (rank 0) calls cpd_graph_pools_exist of graphs (rank 1)",
        ),
        # the private pools calling up into the entry points
        (
            "csrc/devices/graphs.c",
            'void cpd_zz_probe(void);\nvoid cpd_zz_probe(void) { cpd_report("x"); }\n',
            "graphs (rank 1) calls cpd_report of abi (rank 3)",
        ),
        # one backend calling another: the circle of a backend's own files stops at its edge
        (
            "csrc/backend/sim_work.c",
            "int cp_zz_probe(int *n);\nint cp_zz_probe(int *n) { return cp_cuda_device_count(n); }\n",
            "sim_work (rank 0) calls cp_cuda_device_count of cuda_vmm (rank 0)",
        ),
        # C++ in a namespace: the bridge's state calling up into the bridge
        (
            "csrc/bridge/bridge_state.cpp",
            "namespace cudapool_bridge {\nvoid zz_probe();\nvoid zz_probe() { (void)allocate_with(0, 0, nullptr); }\n}\n",
            "bridge_state (rank 0) calls allocate_with of bridge (rank 2)",
        ),
        # the binding's state calling up into the Pool type
        (
            "csrc/python/state.c",
            "PyObject *cpy_zz_probe(cpy_state *st);\nPyObject *cpy_zz_probe(cpy_state *st) { return cpy_pool_for_device(st, 0); }\n",
            "state (rank 0) calls cpy_pool_for_device of pool (rank 1)",
        ),
    ],
)
def test_a_call_back_up_the_ranks_fails(tree: Path, file: str, text: str, expect: str) -> None:
    append(tree / file, text)
    result = run_checker(tree)
    assert result.returncode == 1
    assert file in result.stdout and expect in result.stdout, result.stdout


def test_a_call_in_a_comment_or_string_is_no_call(tree: Path) -> None:
    append(tree / "csrc/core/block.c", '/* cp_drain_destroy(pool) */\nstatic const char *zz = "cp_alloc(p)";\n')
    assert run_checker(tree).returncode == 0


def test_a_core_include_back_up_fails(tree: Path) -> None:
    add_line(tree / "csrc/core/block.c", '#include "core/drain.h"')
    result = run_checker(tree)
    assert result.returncode == 1
    assert 'block (rank 6) includes "core/drain.h" (rank 9)' in result.stdout, result.stdout


def test_a_call_back_and_forth_is_a_circle(tree: Path) -> None:
    append(
        tree / "csrc/devices/devices.c",
        "int cpd_zz_probe(void);\nint cpd_zz_probe(void) { return cpd_graph_pools_exist(); }\n",
    )
    result = run_checker(tree)
    assert result.returncode == 1
    assert (
        "csrc/devices: files call or include each other in a circle: devices (csrc/devices/devices.c:" in result.stdout
    )
    assert "-> graphs (csrc/devices/graphs.c:" in result.stdout, result.stdout


def test_files_of_one_rank_including_each_other_are_a_circle(tree: Path) -> None:
    add_line(tree / "csrc/python/convert.h", '#include "python/stacks.h"')
    add_line(tree / "csrc/python/stacks.h", '#include "python/convert.h"')
    result = run_checker(tree)
    assert result.returncode == 1
    assert "csrc/python: files call or include each other in a circle: convert (csrc/python/convert.h:" in result.stdout
    assert "-> stacks (csrc/python/stacks.h:" in result.stdout, result.stdout


def test_the_files_of_one_backend_may_call_each_other(tree: Path) -> None:
    # sim.c calls sim_work.c and standin_mem.c calls standin_stream.c; here each calls back:
    # a backend's files, and the stand-in's, are one library each.
    append(
        tree / "csrc/backend/sim_work.c",
        "void cp_zz_probe(cp_sim_t *s);\nvoid cp_zz_probe(cp_sim_t *s) { cp_sim_complete_all(s); }\n",
    )
    append(
        tree / "csrc/standin/standin_stream.c",
        "void sti_zz_probe(void);\nvoid sti_zz_probe(void) { sti_mem_clear(); }\n",
    )
    result = run_checker(tree)
    assert result.returncode == 0, result.stdout


def test_a_member_call_or_an_own_definition_is_no_call_of_another_file(tree: Path) -> None:
    append(
        tree / "csrc/bridge/bridge_state.cpp",
        "namespace cudapool_bridge {\nnamespace {\nstruct Zz {\n  int allocate_with(int x) { return x; }\n};\n"
        "int zz_probe(Zz &z, Zz *p) { return z.allocate_with(1) + p->allocate_with(2); }\n}\n}\n",
    )
    assert run_checker(tree).returncode == 0


@pytest.mark.parametrize(
    "file, table",
    [
        ("csrc/core/newsource.c", "CORE_RANKS"),
        ("csrc/devices/newtable.c", "DEVICES_RANKS"),
        ("csrc/bridge/bridge_new.cpp", "BRIDGE_RANKS"),
        ("csrc/standin/standin_new.c", "STANDIN_RANKS"),
    ],
)
def test_a_file_without_a_rank_fails_in_every_layer(tree: Path, file: str, table: str) -> None:
    (tree / file).write_text("", encoding="utf-8")
    result = run_checker(tree)
    assert result.returncode == 1
    assert f"{file}: not in {table} of scripts/check_layers.py" in result.stdout, result.stdout


def test_a_file_over_its_size_fails(tree: Path) -> None:
    append(tree / "csrc/core/index.c", "\n" * 700)
    append(tree / "python/cudapool/summary.py", "\n" * 800)
    result = run_checker(tree)
    assert result.returncode == 1
    assert "csrc/core/index.c:" in result.stdout and "over 700" in result.stdout, result.stdout
    assert "python/cudapool/summary.py:" in result.stdout and "over 800" in result.stdout, result.stdout

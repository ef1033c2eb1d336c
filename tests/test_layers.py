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
        ("csrc/core/stats.c", '#include "torch/devices.h"', "layer core includes"),
        ("csrc/torch/devices.c", '#include "python/convert.h"', "layer torch includes"),
        ("csrc/core/pool.c", "#include <Python.h>", "only the binding talks to CPython"),
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
    add_line(pkg / "trace.py", "from . import replay  # noqa")
    result = run_checker(tree)
    assert result.returncode == 1
    assert "trace (rank 2) imports replay (rank 3)" in result.stdout, result.stdout


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

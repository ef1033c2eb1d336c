"""The docs check (scripts/check_docs.py) passes on the tree and fails on what breaks it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT / "scripts" / "check_docs.py"


def run_checker(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECKER), str(root)], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The files the checker reads."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for name in ("README.md", "Makefile"):
        shutil.copy(ROOT / name, tmp_path / name)
    for folder in ("benchmarks", "scripts", "tests"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "corpus"))
    shutil.copytree(
        ROOT / "python" / "cudapool", tmp_path / "python" / "cudapool", ignore=shutil.ignore_patterns("*.so")
    )
    return tmp_path


def test_the_tree_passes() -> None:
    result = run_checker(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
        first = page.read_text(encoding="utf-8").split("\n")
        assert first[0].startswith("# ") and first[2].startswith("For: "), (
            f"{page.name} does not open with what it is for"
        )


def test_the_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


@pytest.mark.parametrize(
    "text, expect",
    [
        ("See [the tour](docs/tour.md).", "link to docs/tour.md: docs/tour.md does not exist"),
        ("See [it](docs/lab.md#no-such-heading).", "no heading #no-such-heading in docs/lab.md"),
        ("Run `make labs` first.", "`make labs`: no such target"),
        ("```\nmake test-c && make bench-micros\n```", "`make bench-micros`: no such target"),
        ("Run `python -m cudapool replays t.cptrace`.", "`python -m cudapool replays`: no such command"),
        ("Run `python -m cudapool.lab.nothing`.", "`python -m cudapool.lab.nothing`: no such module"),
        ("Run `python benchmarks/nothing.py`.", "`python benchmarks/nothing.py`: no such file"),
    ],
)
def test_a_bad_link_or_command_fails(tree: Path, text: str, expect: str) -> None:
    readme = tree / "README.md"
    readme.write_text(readme.read_text(encoding="utf-8") + "\n" + text + "\n", encoding="utf-8")
    result = run_checker(tree)
    assert result.returncode == 1
    assert expect in result.stdout, result.stdout


def test_good_ones_pass(tree: Path) -> None:
    readme = tree / "README.md"
    readme.write_text(
        readme.read_text(encoding="utf-8")
        + "\n[lab](docs/lab.md#the-lab-report), `make lab LAB_SCALE=medium`, `python -m cudapool replay x`,"
        " `python -m cudapool.ab.child`, prose that says make sure, [web](https://example.org/x).\n",
        encoding="utf-8",
    )
    result = run_checker(tree)
    assert result.returncode == 0, result.stdout

#!/usr/bin/env python3
"""Fail when README.md or a page of docs/ points at something that does not exist.

Checked, in README.md and docs/*.md:
- every relative link ``[text](path)`` and ``[text](path#anchor)``: the file exists, and the
  anchor is a heading of it (GitHub's rule: lower case, punctuation dropped, spaces to hyphens);
- every ``make TARGET`` inside code (a code span or a fenced block): TARGET is a target of the
  Makefile;
- every ``python -m cudapool COMMAND`` inside code: COMMAND is a subcommand of the command line
  (python/cudapool/__main__.py), and every ``python -m cudapool.MODULE`` a module of the package;
- every ``python benchmarks/….py`` (or scripts/, tests/) inside code: the file exists.

Usage: check_docs.py [ROOT]   (default: the repository this script lives in). Prints one line
per problem and exits 1 when there is any.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?:^|[\s;&|(])make\s+((?:[A-Za-z_][\w.-]*=\S*\s+)*)([a-z][\w.-]*)")
PYTHON_M = re.compile(r"\bpython3?\s+-m\s+(cudapool(?:\.[\w.]+)?)(?:\s+([A-Za-z][\w-]*))?")
PYTHON_FILE = re.compile(r"\bpython3?\s+((?:benchmarks|scripts|tests)/[\w/.-]+\.py)\b")
MAKE_TARGET = re.compile(r"^([A-Za-z0-9_][\w.-]*(?:\s+[A-Za-z0-9_][\w.-]*)*)\s*:(?!=)", re.M)
SUBCOMMAND = re.compile(r"\.add_parser\(\s*\"([\w-]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        base = slug(m.group(1))
        name, n = base, 1
        while name in found:  # repeated headings get -1, -2, ...
            name, n = f"{base}-{n}", n + 1
        found.add(name)
    return found


def code_of(text: str) -> list[tuple[int, str]]:
    """(line, text) of every fenced block and code span."""
    out = []
    for m in FENCE.finditer(text):
        out.append((text.count("\n", 0, m.start(1)) + 1, m.group(1)))
    rest = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in SPAN.finditer(rest):
        out.append((rest.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def make_targets(root: Path) -> set[str]:
    text = (root / "Makefile").read_text(encoding="utf-8")
    targets: set[str] = set()
    for m in MAKE_TARGET.finditer(text):
        if m.group(1).startswith((".", "%")) or "$" in m.group(1):
            continue
        targets.update(m.group(1).split())
    return targets


def subcommands(root: Path) -> set[str]:
    return set(SUBCOMMAND.findall((root / "python" / "cudapool" / "__main__.py").read_text(encoding="utf-8")))


def module_exists(root: Path, dotted: str) -> bool:
    base = root / "python" / Path(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def check_file(root: Path, path: Path, targets: set[str], commands: set[str]) -> list[str]:
    errors = []
    where = path.relative_to(root).as_posix()
    text = path.read_text(encoding="utf-8")
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in LINK.finditer(prose):
        target = m.group(1)
        line = prose.count("\n", 0, m.start()) + 1
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            errors.append(f"{where}:{line}: link to {target}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            errors.append(f"{where}:{line}: link to {target}: no heading #{anchor} in {dest.relative_to(root)}")
    for line, code in code_of(text):
        for m in MAKE.finditer(code):
            if m.group(2) not in targets:
                errors.append(f"{where}:{line}: `make {m.group(2)}`: no such target in the Makefile")
        for m in PYTHON_M.finditer(code):
            module, word = m.group(1), m.group(2)
            if module != "cudapool":
                if not module_exists(root, module):
                    errors.append(f"{where}:{line}: `python -m {module}`: no such module")
            elif word is not None and word not in commands:
                errors.append(
                    f"{where}:{line}: `python -m cudapool {word}`: no such command "
                    f"(the commands: {', '.join(sorted(commands))})"
                )
        for m in PYTHON_FILE.finditer(code):
            if not (root / m.group(1)).is_file():
                errors.append(f"{where}:{line}: `python {m.group(1)}`: no such file")
    return errors


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    targets, commands = make_targets(root), subcommands(root)
    errors = [e for page in pages for e in check_file(root, page, targets, commands)]
    for line in errors:
        print(line)
    if errors:
        print(f"check_docs: {len(errors)} problem(s)", file=sys.stderr)
        return 1
    print(f"check_docs: the links and commands of {len(pages)} pages exist")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

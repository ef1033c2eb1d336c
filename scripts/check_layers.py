#!/usr/bin/env python3
"""Fail when an #include in csrc/ or an import in python/cudapool/ runs against the layers.

The layers (docs/design.md, "Repository layout"), each using only those below it, arrows one way:

    python   the CPython binding            -> torch, core, backend, base
    torch    device table, exported ABI     -> core, backend, base
    core     the pool                       -> base
    backend  cuda, sim                      -> base
    base     status, fork locks, contract   -> (nothing)
    standin  a stand-in for libcuda, built  -> (nothing)
             as its own library for the tests

core and backend never include each other. Only the binding may include Python.h, and no
layer includes a CUDA header (the driver is loaded at run time). Includes are written with
the layer's directory ("core/cp.h"), so the layer of every quoted include is visible.

Inside csrc/core, each file has a rank (CORE_RANKS below; a header shares its .c file's): a
file calls functions (and function-like macros) only of files of a lower rank, and includes
core headers only of its own rank or lower. So the block layer knows no memory source, the
sources know no ladder, and the ladder knows nothing that reads it. A core file missing from
the table is an error.

In python/cudapool, each module has a rank (PY_LAYERS below) and may import only modules of
a lower rank, at module level or inside a function: that rules out import cycles too. A
module that is missing from the table is an error, so a new one gets a place on purpose.

Sizes: no C file of csrc/ over C_MAX_LINES lines and no module of the package over
PY_MAX_LINES: a file that grows past them is split along what it owns.

Usage: check_layers.py [ROOT]   (default: the repository this script lives in). Prints one
line per violation and exits 1 when there is any.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

C_LAYERS: dict[str, set[str]] = {
    "base": {"base"},
    "core": {"base", "core"},
    "backend": {"base", "backend"},
    "devices": {"base", "core", "backend", "devices"},
    "python": {"base", "core", "backend", "devices", "python"},
    # Products of their own: each folder is one built library (setup.py, product_sources).
    "testhooks": {"base", "python", "testhooks"},
    "torch_oom": {"base", "devices", "torch_oom"},
    "bridge": {"base", "core", "devices", "bridge"},
    "bridge_testhooks": {"base", "core", "devices", "bridge", "bridge_testhooks"},
    "fakecuda": {"core", "fakecuda"},  # core: only the trace's record (core/trace_event.h)
    # Not part of cudapool: the driver stand-in the C tests load in libcuda's place (csrc/standin/).
    "standin": {"standin"},
}

# csrc/core by rank: a file calls only functions of files of a lower rank (Note: a header and
# its .c file are one entry; cp.h declares the public functions, each owned where it is defined).
CORE_RANKS: dict[str, int] = {
    # 0-2: the public header (its macros), the size rules, the configuration
    "cp": 0,
    "cp_share": 0,
    "trace_event": 0,
    "sizes": 1,
    "region": 1,
    "config": 2,
    # 1-4: the data: blocks and segments, the free index, streams, the pool's struct
    "types": 1,
    "index": 2,
    "stream": 3,
    "state": 4,
    # 5: records and queries that change no block: history, the OOM record, capture windows
    "history": 5,
    "oom": 5,
    "capture": 5,
    # 6: the block layer (blocks, segments, split, merge, free lists); the OOM report's text
    "block": 6,
    "report": 6,
    # 7-8: the memory sources: plain segments, page-mapped segments, stitched ranges (whose
    # pages are the page-mapped segments')
    "segment": 7,
    "expand": 7,
    "stitch": 8,
    # 9: stream-ordered release of what the sources retire; the checker of all of it
    "drain": 9,
    "check": 9,
    # 10: the ladder, frees, empty_cache and the pool's life
    "pool": 10,
    # 11-12: what reads or drives a pool: stats, seeding, pause, checkpoints and sharing (11), resume (12), the
    # replay
    "stats": 11,
    "seed": 11,
    "pause": 11,
    "checkpoint": 11,
    "share": 11,
    "replay": 12,
    "resume": 12,
}

# System headers a layer must not include, with the reason: (pattern, the layers that must not, why).
TORCH_BUILT = {"torch_oom", "bridge", "bridge_testhooks", "fakecuda"}  # built against the installed torch
C_FORBIDDEN: list[tuple[re.Pattern[str], set[str], str]] = [
    (
        re.compile(r"^Python\.h$"),
        set(C_LAYERS) - {"python", "testhooks"},
        "only the binding (and its test hooks) talk to CPython",
    ),
    # The bridge is built against torch, which brings and loads the CUDA runtime; every other
    # layer loads the driver with dlopen.
    (
        re.compile(r"^(cuda|cuda_runtime|cuda_runtime_api)\.h$"),
        set(C_LAYERS) - {"bridge", "bridge_testhooks"},
        "the driver is loaded with dlopen",
    ),
    (re.compile(r"^(torch|c10|ATen)/"), set(C_LAYERS) - TORCH_BUILT, "only a library built against torch uses torch"),
    # The fake GPU is a Python module built on torch's bindings (pybind11).
    (
        re.compile(r"^(pybind11/|torch/csrc/.*python|torch/python\.h$|torch/extension\.h$)"),
        set(C_LAYERS) - {"fakecuda"},
        "only the fake GPU binds torch's Python",
    ),
]

# python/cudapool modules by rank: a module imports only modules of a lower rank.
PY_LAYERS: dict[str, int] = {
    # 0: leaves
    "_C": 0,
    "_testhooks": 0,
    "_version": 0,
    "_units": 0,
    "policies": 0,
    "ab": 0,  # cudapool.ab: step() for user scripts; imports nothing of cudapool
    "lab": 0,  # cudapool.lab: its docstring only
    "lab._events": 0,
    "lab._leaves": 0,
    "lab.device_costs": 0,
    # 1: formats and configuration
    "lab.torch_snapshot": 1,
    "snapshots": 1,
    "summary": 1,
    "_config": 1,
    "regions": 1,
    # 2: traces, the simulated pool, torch's functions
    "lab.trace": 2,
    "lab._backward": 2,
    "lab._kernel_scratch": 2,
    "lab._attention": 2,
    "lab._hostreal": 2,
    "sim": 2,
    "_torch": 2,
    "lab.plot": 2,
    # 3: what reads traces or makes them
    "lab.tracer": 3,
    "lab.replay": 3,
    "lab._scriptio": 3,
    "lab._native": 3,
    # 4: what is built on a replay
    "lab.replay_report": 4,
    "lab.capacity": 4,
    "lab.peak_snapshot": 4,
    "lab.fakegpu": 4,
    # 5: what replays traces to explain out of memory
    "oom": 5,
    # 6: the package and what the A/B command's parts share; 7: the A/B command and its child
    # runners; 8: its simulated form; 9: the command line
    "__init__": 6,
    "ab.common": 6,
    "ab.command": 7,
    "ab.child": 7,
    "ab.sim_child": 7,
    "ab.simulate": 8,
    "__main__": 9,
}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
INCLUDE_ANY = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def check_c(root: Path) -> list[str]:
    errors = []
    csrc = root / "csrc"
    for path in sorted(p for p in csrc.rglob("*") if p.suffix in {".c", ".h", ".cpp", ".hpp"}):
        rel = path.relative_to(csrc)
        layer = rel.parts[0]
        where = path.relative_to(root).as_posix()
        if layer not in C_LAYERS:
            errors.append(f"{where}: directory csrc/{layer} is not a layer (known: {', '.join(C_LAYERS)})")
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            kind, name = m.groups()
            if kind == "<":
                for pattern, layers, why in C_FORBIDDEN:
                    if layer in layers and pattern.search(name):
                        errors.append(f"{where}:{lineno}: <{name}> in layer {layer}: {why}")
                continue
            target = name.split("/")[0] if "/" in name else None
            if target is None or target not in C_LAYERS:
                errors.append(f'{where}:{lineno}: "{name}" does not name its layer (write "layer/file.h")')
            elif target not in C_LAYERS[layer]:
                allowed = ", ".join(sorted(C_LAYERS[layer]))
                errors.append(
                    f'{where}:{lineno}: layer {layer} includes "{name}" of layer {target} (allowed: {allowed})'
                )
            elif not (csrc / name).is_file():
                errors.append(f'{where}:{lineno}: "{name}" does not exist under csrc/')
    return errors


def _strip_c(text: str) -> str:
    """`text` with comments and string and character literals blanked, newlines kept."""

    def blank(m: re.Match[str]) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    return re.sub(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', blank, text, flags=re.S)


C_DEFINITION = re.compile(r"^(static\s+inline\s+)?[A-Za-z_][\w \t\*]*?\b(cp_\w+)\s*\([^;{]*\)\s*\{", re.M)
C_STATIC = re.compile(r"^static\b")
C_MACRO = re.compile(r"^\s*#\s*define\s+(CP_\w+)\(", re.M)
C_PROTOTYPE = re.compile(r"^[A-Za-z_][\w \t\*]*?\b(cp_\w+)\s*\([^;{]*\)\s*;", re.M)
C_CALL = re.compile(r"\b(cp_\w+|CP_[A-Z0-9_]+)\s*\(")


def check_core_calls(root: Path) -> list[str]:
    """Calls and includes inside csrc/core against CORE_RANKS."""
    core = root / "csrc" / "core"
    errors: list[str] = []
    files = sorted(p for p in core.iterdir() if p.suffix in {".c", ".h"})
    owner: dict[str, str] = {}  # function or macro -> the stem that defines it
    texts: dict[Path, str] = {}
    raws: dict[Path, str] = {}
    for path in files:
        if path.stem not in CORE_RANKS:
            errors.append(f"{path.relative_to(root).as_posix()}: not in CORE_RANKS of scripts/check_layers.py")
            continue
        raws[path] = path.read_text(encoding="utf-8")
        text = _strip_c(raws[path])
        texts[path] = text
        for m in C_DEFINITION.finditer(text):
            line = m.group(0)
            if C_STATIC.match(line) and not (m.group(1) and path.suffix == ".h"):
                continue  # file-local: no other file can call it
            owner[m.group(2)] = path.stem
        if path.suffix == ".h":
            for m in C_MACRO.finditer(text):
                owner[m.group(1)] = path.stem
    for path, text in texts.items():
        stem, rank = path.stem, CORE_RANKS[path.stem]
        where = path.relative_to(root).as_posix()
        for m in INCLUDE_ANY.finditer(raws[path]):
            name = m.group(1)
            if not name.startswith("core/"):
                continue
            target = Path(name).stem
            if target in CORE_RANKS and CORE_RANKS[target] > rank:
                lineno = raws[path].count("\n", 0, m.start()) + 1
                errors.append(
                    f'{where}:{lineno}: {stem} (rank {rank}) includes "{name}" (rank {CORE_RANKS[target]}): '
                    "an include runs back up"
                )
        # Where a function is declared or defined, its name is not a call.
        named = {m.start(2) for m in C_DEFINITION.finditer(text)} | {m.start(1) for m in C_PROTOTYPE.finditer(text)}
        seen: set[tuple[int, str]] = set()
        for m in C_CALL.finditer(text):
            if m.start(1) in named:
                continue
            name = m.group(1)
            target = owner.get(name)
            if target is None or target == stem or CORE_RANKS[target] < rank:
                continue
            lineno = text.count("\n", 0, m.start()) + 1
            if (lineno, name) in seen:
                continue
            seen.add((lineno, name))
            errors.append(
                f"{where}:{lineno}: {stem} (rank {rank}) calls {name} of {target} (rank {CORE_RANKS[target]}): "
                "a call runs back up (or across) the core's ranks"
            )
    return errors


def _module_names(pkg: Path) -> dict[str, Path]:
    """Every module of the package by its dotted name inside it ("lab.replay"; a subpackage is
    named by its folder, "ab"; the package itself is "__init__")."""
    found: dict[str, Path] = {}
    for path in sorted(pkg.rglob("*.py*")):
        if path.suffix not in {".py", ".pyi"} or "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(pkg).with_suffix("").parts)
        parts[-1] = parts[-1].split(".")[0]
        if parts == ["__init__"]:
            name = "__init__"
        elif parts[-1] == "__init__":
            name = ".".join(parts[:-1])
        else:
            name = ".".join(parts)
        if path.suffix == ".py" or name not in found:
            found[name] = path
    return found


def _imported_modules(tree: ast.AST, package: str, here: str, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module name inside the package) for every import of one, anywhere in the file of
    module `here`. A name imported from a module counts as that module."""
    is_pkg = here == "__init__" or (here in modules and modules[here].name == "__init__.py")
    base = [] if here == "__init__" else here.split(".")
    if not is_pkg:
        base = base[:-1]  # the package the module is in

    def resolve(parts: list[str]) -> str:
        for n in range(len(parts), 0, -1):  # the longest prefix that is a module
            name = ".".join(parts[:n])
            if name in modules:
                return name
        return ".".join(parts)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level > 0:
                anchor = base[: len(base) - (node.level - 1)] if node.level - 1 <= len(base) else []
                mod = anchor + (node.module.split(".") if node.module else [])
            elif node.module is not None and node.module.split(".")[0] == package:
                mod = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                target = resolve(mod + [alias.name]) if mod + [alias.name] else ""
                if ".".join(mod + [alias.name]) not in modules:
                    target = resolve(mod) if mod else ""
                if target:
                    found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == package and len(parts) > 1:
                    found.append((node.lineno, resolve(parts[1:])))
    return found


def check_python(root: Path, package: str = "cudapool") -> list[str]:
    errors = []
    pkg = root / "python" / package
    modules = _module_names(pkg)
    for name in sorted(modules):
        if name not in PY_LAYERS:
            errors.append(f"python/{package}/{name}: not in the layer table of scripts/check_layers.py")
    for name, path in sorted(modules.items()):
        if path.suffix != ".py" or name not in PY_LAYERS:
            continue
        where = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=where)
        for lineno, target in _imported_modules(tree, package, name, modules):
            if target == name or target not in PY_LAYERS:
                continue  # itself (a package's own names), or not a module of the package
            if PY_LAYERS[target] >= PY_LAYERS[name]:
                errors.append(
                    f"{where}:{lineno}: {name} (rank {PY_LAYERS[name]}) imports {target} (rank {PY_LAYERS[target]}): "
                    "a module imports only modules of a lower rank"
                )
    return errors


C_MAX_LINES = 700
PY_MAX_LINES = 800


def check_sizes(root: Path, package: str = "cudapool") -> list[str]:
    errors = []
    files = [(p, C_MAX_LINES) for p in sorted((root / "csrc").rglob("*")) if p.suffix in {".c", ".h", ".cpp", ".hpp"}]
    files += [(p, PY_MAX_LINES) for p in sorted((root / "python" / package).rglob("*.py"))]
    for path, limit in files:
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit:
            errors.append(f"{path.relative_to(root).as_posix()}: {n} lines, over {limit}: split it along what it owns")
    return errors


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else Path(__file__).resolve().parent.parent
    errors = check_c(root) + check_core_calls(root) + check_python(root) + check_sizes(root)
    for line in errors:
        print(line)
    if errors:
        print(f"check_layers: {len(errors)} violation(s)", file=sys.stderr)
        return 1
    print("check_layers: includes, core calls and imports follow the layers; no file is over its size")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
"""Fail when an #include in csrc/ or an import in python/cudapool/ runs against the layers.

The layers (README, "Layout"), each using only those below it, arrows one way:

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

In python/cudapool, each module has a rank (PY_LAYERS below) and may import only modules of
a lower rank, at module level or inside a function: that rules out import cycles too. A
module that is missing from the table is an error, so a new one gets a place on purpose.

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
    "torch": {"base", "core", "backend", "torch"},
    "python": {"base", "core", "backend", "torch", "python"},
    # Not part of cudapool: the driver stand-in the C tests load in libcuda's place (csrc/standin/).
    "standin": {"standin"},
}

# System headers a layer must not include, with the reason.
C_FORBIDDEN: list[tuple[re.Pattern[str], set[str], str]] = [
    (re.compile(r"^Python\.h$"), {"base", "core", "backend", "torch", "standin"}, "only the binding talks to CPython"),
    (re.compile(r"^(cuda|cuda_runtime|cuda_runtime_api)\.h$"), set(C_LAYERS), "the driver is loaded with dlopen"),
    (
        re.compile(r"^(torch|c10|ATen)/"),
        {"base", "core", "backend", "python", "standin"},
        "only the torch layer may use torch",
    ),
]

# python/cudapool modules by rank: a module imports only modules of a lower rank.
PY_LAYERS: dict[str, int] = {
    # 0: leaves
    "_C": 0,
    "_testhooks": 0,
    "_version": 0,
    "_units": 0,
    "_events": 0,
    "policies": 0,
    "device_costs": 0,
    "ab": 0,
    # 1: formats and configuration
    "torch_snapshot": 1,
    "snapshots": 1,
    "summary": 1,
    "_config": 1,
    # 2: traces, the simulated pool, torch's functions
    "trace": 2,
    "_backward": 2,
    "_kernel_scratch": 2,
    "sim": 2,
    "_torch": 2,
    "plot": 2,
    # 3: what reads traces or makes them
    "tracer": 3,
    "replay": 3,
    # 4: what replays traces to explain out of memory
    "oom": 4,
    # 5: the package; 6: the A/B command and its child runner; 7: the command line
    "__init__": 5,
    "_ab": 6,
    "_ab_child": 6,
    "__main__": 7,
}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


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


def _imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, module name inside the package) for every import of one, anywhere in the file."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:  # from . import a, b
                found += [(node.lineno, alias.name) for alias in node.names]
            elif node.level == 1:  # from .a import x
                found.append((node.lineno, node.module.split(".")[0]))
            elif node.level == 0 and node.module is not None:
                parts = node.module.split(".")
                if parts[0] == package and len(parts) > 1:  # from cudapool.a import x
                    found.append((node.lineno, parts[1]))
                elif node.module == package:  # from cudapool import a, b
                    found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == package and len(parts) > 1:
                    found.append((node.lineno, parts[1]))
    return found


def check_python(root: Path, package: str = "cudapool") -> list[str]:
    errors = []
    pkg = root / "python" / package
    modules = {p.stem: p for p in pkg.glob("*.py")}
    modules.update({p.name.split(".")[0]: p for p in pkg.glob("*.pyi")})
    for name in sorted(modules):
        if name not in PY_LAYERS:
            errors.append(f"python/{package}/{name}: not in the layer table of scripts/check_layers.py")
    for name, path in sorted(modules.items()):
        if path.suffix != ".py" or name not in PY_LAYERS:
            continue
        where = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=where)
        for lineno, target in _imported_modules(tree, package):
            if target not in modules:
                continue  # a name imported from the package, not a module
            if target not in PY_LAYERS:
                continue  # reported above
            if PY_LAYERS[target] >= PY_LAYERS[name]:
                errors.append(
                    f"{where}:{lineno}: {name} (rank {PY_LAYERS[name]}) imports {target} (rank {PY_LAYERS[target]}): "
                    "a module imports only modules of a lower rank"
                )
    return errors


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else Path(__file__).resolve().parent.parent
    errors = check_c(root) + check_python(root)
    for line in errors:
        print(line)
    if errors:
        print(f"check_layers: {len(errors)} violation(s)", file=sys.stderr)
        return 1
    print("check_layers: includes and imports follow the layers")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
"""Fail when an #include or a call in csrc/, or an import in python/cudapool/, runs against the layers.

The C layers (docs/design.md, "Repository layout"), one folder of csrc/ each, each using only
those it names, arrows one way:

    python            the CPython binding (cudapool._C)       -> devices, core, backend, base
    testhooks         cudapool._testhooks, for tests          -> python, base
    bridge            cudapool._torch_bridge: torch's         -> devices, core, base
                      allocator interface (C++, on torch)
    bridge_testhooks  cudapool._torch_bridge_testhooks        -> bridge, devices, core, base
    torch_oom         cudapool._torch_oom: throws torch's     -> devices, base
                      out-of-memory type (C++, on torch)
    fakecuda          cudapool._torch_fakecuda: the fake GPU  -> (nothing)
                      of `ab --simulate` (C++, on torch)
    devices           the device table and the entry points  -> core, backend, base
                      torch calls (the C layer of _C)
    core              the pool                                -> base
    backend           cuda, sim                               -> base
    base              status, fork locks, the device          -> (nothing)
                      contract, the pointer map
    standin           a stand-in for libcuda, built as its    -> (nothing)
                      own library for the C tests

core and backend never include each other. Only the binding (and its test hooks) may include
Python.h, only the bridge a CUDA header (everything else loads the driver at run time), and
only the libraries built against torch include torch's headers. Includes are written with the layer's directory
("core/cp.h"), so the layer of every quoted include is visible.

Inside each layer, each file has a rank (C_RANKS below: CORE_RANKS, DEVICES_RANKS, ... one
table per layer; a header shares its .c/.cpp file's entry, a header without one is an entry of
its own): a file calls functions (and function-like macros of headers) only of files of a lower
rank, and includes headers of its layer only of its own rank or lower. A call is found by name:
any function defined outside a file's own scope (not static, not in an anonymous namespace; an
inline function of a header counts) in one file of the layer and called from another, member
calls and names the calling file defines itself left out. A file missing from its table is an
error, so a new one gets a place on purpose. Besides, no files of a layer may call or include
each other in a circle, whatever their ranks. The one exception is a rule, circle_family: the
files of ONE backend (csrc/backend/sim*, and csrc/backend/cuda* likewise) are one library that
may call each other in a circle, as are the files of the driver stand-in (csrc/standin); two
backends share a rank, so neither calls the other.

So in the core the block layer knows no memory source, the sources know no ladder, and the
ladder knows nothing that reads it; in csrc/devices the device table calls nothing above it
(what it must do to the private pools and the IPC descriptors goes through hooks: Note [Hooks
of the device table] in devices/devices.h).

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
    "bridge": {"base", "core", "devices", "torch_oom", "bridge"},  # torch_oom: its header-only throw
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
    "snapshot": 0,
    "trace_event": 0,
    "sizes": 1,
    "region": 1,
    "config": 2,
    # 1-4: the data: blocks and segments, the free index, streams, the pool's struct
    "types": 1,
    "plan_types": 1,  # the step plan's state in the pool (the struct state.h holds)
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
    "plan_learn": 8,  # learning a loop's step, laying out its plan (Note [Learning the step])
    "plan": 9,  # the step plan in service: adopted in the pool's free memory, served by position
    "stitch_alloc": 9,  # a request served by stitching: it makes the ranges stitch.c keeps
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

# The other layers by rank, on the same rules as csrc/core (a layer's table is C_RANKS[layer]).
BASE_RANKS: dict[str, int] = {"status": 0, "backend": 0, "ptrmap": 1, "fork": 1}
# csrc/backend: each backend is one family of files that may call each other in a circle
# (circle_family); two backends share a rank, so neither calls the other.
BACKEND_RANKS: dict[str, int] = {
    **dict.fromkeys(("cuda", "cuda_internal", "cuda_call", "cuda_copy", "cuda_ipc", "cuda_vmm"), 0),
    **dict.fromkeys(("sim", "sim_internal", "sim_copy", "sim_vmm", "sim_work"), 0),
}
# csrc/devices: the device table is the floor (Note [Hooks of the device table] in
# devices/devices.h); the private pools above it, sharing with other processes above both, the
# entry points torch calls above all three, and their C++ faces on top.
DEVICES_RANKS: dict[str, int] = {"devices": 0, "graphs": 1, "ipc": 2, "abi": 3, "alloc": 4, "graph_hooks": 4}
# csrc/python: the module state, conversions and Python stacks; the Pool type; its simulated
# methods; the module, which makes all of it.
PYTHON_RANKS: dict[str, int] = {
    "state": 0,
    "convert": 0,
    "hooks_api": 0,
    "stacks": 0,
    "pool": 1,
    "pool_snapshot": 2,
    "pool_sim": 2,
    "module": 3,
}
TESTHOOKS_RANKS: dict[str, int] = {"testhooks": 0}
# csrc/bridge: what the hot path calls of the state (bridge_notes.h) and what the bridge keeps of
# torch's; the hot path every tensor takes (it calls the state's notes and failure); torch's
# allocator interface over both.
BRIDGE_RANKS: dict[str, int] = {"bridge_notes": 0, "bridge_state": 0, "bridge_path": 1, "bridge": 2}
BRIDGE_TESTHOOKS_RANKS: dict[str, int] = {"bridge_testhooks": 0}
TORCH_OOM_RANKS: dict[str, int] = {"oom_c10": 0}
# csrc/fakecuda: the shared declarations; the one slot of torch's it writes; the fake device
# (allocator, guard, records); an operation's inputs as a cache key; the kernels that use
# both; the module that installs it all.
FAKECUDA_RANKS: dict[str, int] = {
    "fakecuda": 0,
    "fakecuda_vtable": 1,
    "fakecuda_reducer": 1,
    "fakecuda_device": 2,
    "fakecuda_key": 3,
    "fakecuda_kernels": 4,
    "fakecuda_module": 5,
}
# csrc/standin: one library, the driver stand-in, whose files may call each other in a circle.
STANDIN_RANKS: dict[str, int] = dict.fromkeys(
    ("standin", "standin_internal", "standin_copy", "standin_mem", "standin_share", "standin_stream"), 0
)
C_RANKS: dict[str, dict[str, int]] = {
    "base": BASE_RANKS,
    "core": CORE_RANKS,
    "backend": BACKEND_RANKS,
    "devices": DEVICES_RANKS,
    "python": PYTHON_RANKS,
    "testhooks": TESTHOOKS_RANKS,
    "bridge": BRIDGE_RANKS,
    "bridge_testhooks": BRIDGE_TESTHOOKS_RANKS,
    "torch_oom": TORCH_OOM_RANKS,
    "fakecuda": FAKECUDA_RANKS,
    "standin": STANDIN_RANKS,
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
    "_torch_fakecuda": 0,
    "_version": 0,
    "_units": 0,
    "policies": 0,
    "ab": 0,  # cudapool.ab: step() for user scripts; imports nothing of cudapool
    "lab": 0,  # cudapool.lab: its docstring only
    "lab._events": 0,
    "lab._progress": 0,
    "lab.device_costs": 0,
    "fakegpu.engine": 0,
    "fakegpu.leaves": 0,
    "fakegpu.streams": 0,
    "fakegpu.scratch": 0,
    "fakegpu.distributed": 0,
    "fakegpu.compiled": 0,
    "fakegpu.graphs": 0,
    "fakegpu.cudnn": 0,
    "fakegpu.nvidia_smi": 0,
    # 1: formats and configuration
    "lab.torch_snapshot": 1,
    "snapshots": 1,
    "summary": 1,
    "_config": 1,
    "regions": 1,
    "fakegpu.models": 1,
    "fakegpu.failures": 1,
    "ab.ranks": 1,
    "_torch_libraries": 1,
    # 2: traces, the simulated pool, torch's functions, what the fake GPU's tracer runs on; the
    # estimate of what a rank holds outside torch's allocator
    "lab.trace": 2,
    "ab.outside": 2,
    "fakegpu.backward": 2,
    "fakegpu.kernel_scratch": 2,
    "fakegpu.attention": 2,
    "fakegpu.hostreal": 2,
    "sim": 2,
    "_torch_stats": 2,
    "lab.plot": 2,
    # 3: what reads traces or makes them; the swap of torch's allocator
    "lab.replay": 3,
    "_torch": 3,
    "fakegpu.dispatch": 3,
    "fakegpu.scriptio": 3,
    "fakegpu.native": 3,
    "fakegpu.native_engine": 4,
    # 4: what is built on a replay; the tracer
    "lab.replay_report": 4,
    "lab.capacity": 4,
    "lab.peak_snapshot": 4,
    "fakegpu.tracer": 4,
    # 5: what replays traces to explain out of memory; the fake GPU's Python engine
    "oom": 5,
    "fakegpu.python_engine": 5,
    # 6: the package, the fake GPU, and what the A/B command's parts share; 7: the child runners
    # and the simulated form's options; 8: the A/B command and the simulated form's report; 9: the
    # simulated form; 10: the command line and the simulated form from Python
    "__init__": 6,
    "fakegpu": 6,
    "ab.common": 6,
    "ab.sim_cli": 7,
    "ab.command": 8,
    "ab.child": 7,
    "ab.sim_child": 7,
    "ab.sim_ranks": 7,
    "ab.sim_report": 8,
    "ab.simulate": 9,
    "ab.estimate": 10,
    "__main__": 10,
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


# A function defined at the top level of a file (C, or C++ in a namespace): its return type on
# the same line, from the first column, then the name (not qualified: no member of a class) and
# its parameters, maybe over several lines, then the body.
C_DEFINITION = re.compile(
    r"^(?:static\s+)?(?:inline\s+)?(?!(?:return|if|for|while|switch|else|do|case|sizeof)\b)"
    r"[A-Za-z_][\w \t\*&:<>,]*?(?<![\w:])(?<!::)([A-Za-z_]\w*)\s*\([^;{]*\)\s*(?:const\s*)?(?:noexcept\s*)?\{",
    re.M,
)
# Any function body, members of classes included (indented): what a file defines itself.
C_ANY_DEFINITION = re.compile(r"^[ \t]*[A-Za-z_][\w \t\*&:<>,]*?\b([A-Za-z_]\w*)\s*\([^;{]*\)\s*(?:const\s*)?\{", re.M)
C_PROTOTYPE = re.compile(r"^[A-Za-z_][\w \t\*&:<>,]*?\b([A-Za-z_]\w*)\s*\([^;{]*\)\s*(?:noexcept\s*)?;", re.M)
C_MACRO = re.compile(r"^\s*#\s*define\s+([A-Za-z_]\w*)\(", re.M)
C_CALL = re.compile(r"(?<![\w.])(?<!->)([A-Za-z_]\w*)\s*\(")
C_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "defined", "alignof", "_Alignof", "decltype"}
ANON_NAMESPACE = re.compile(r"\bnamespace\s*\{")


def _file_local_spans(text: str) -> list[tuple[int, int]]:
    """The (start, end) of every anonymous namespace of C++ `text` (comments blanked)."""
    spans = []
    for m in ANON_NAMESPACE.finditer(text):
        depth, i = 0, m.end() - 1
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        spans.append((m.start(), i))
    return spans


def circle_family(layer: str, stem: str) -> str | None:
    """The files that may call (and include) each other in a circle: those of one backend (csrc/
    backend/sim*.c among themselves, cuda*.c among themselves; the family is the name before the
    first "_") and the driver stand-in (csrc/standin, one library). None: no circle allowed."""
    if layer == "backend":
        return stem.split("_")[0]
    if layer == "standin":
        return "standin"
    return None


def check_c_ranks(root: Path) -> list[str]:
    """Calls and includes between the files of each layer of csrc/ against its rank table."""
    errors: list[str] = []
    for layer in C_LAYERS:
        if (root / "csrc" / layer).is_dir():
            errors += _check_layer_ranks(root, layer)
    return errors


def _check_layer_ranks(root: Path, layer: str) -> list[str]:
    ranks = C_RANKS[layer]
    table = f"{layer.upper()}_RANKS"
    folder = root / "csrc" / layer
    errors: list[str] = []
    files = sorted(p for p in folder.iterdir() if p.suffix in {".c", ".h", ".cpp", ".hpp"})
    owner: dict[str, str] = {}  # function or macro -> the stem that defines it
    texts: dict[Path, str] = {}
    raws: dict[Path, str] = {}
    for path in files:
        if path.stem not in ranks:
            errors.append(f"{path.relative_to(root).as_posix()}: not in {table} of scripts/check_layers.py")
            continue
        raws[path] = path.read_text(encoding="utf-8")
        text = _strip_c(raws[path])
        texts[path] = text
        local = _file_local_spans(text)
        header = path.suffix in {".h", ".hpp"}
        for m in C_DEFINITION.finditer(text):
            static = m.group(0).startswith("static")
            if (static and not (header and "inline" in m.group(0).split("(")[0])) or any(
                a <= m.start() <= b for a, b in local
            ):
                continue  # file-local: no other file can call it
            owner.setdefault(m.group(1), path.stem)
        if header:
            for m in C_MACRO.finditer(text):
                owner.setdefault(m.group(1), path.stem)
    edges: dict[tuple[str, str], str] = {}  # (from stem, to stem) -> where, the first time
    for path, text in texts.items():
        stem, rank = path.stem, ranks[path.stem]
        family = circle_family(layer, stem)
        where = path.relative_to(root).as_posix()
        for m in INCLUDE_ANY.finditer(raws[path]):
            name = m.group(1)
            if not name.startswith(layer + "/"):
                continue
            target = Path(name).stem
            if target == stem or target not in ranks:
                continue
            lineno = raws[path].count("\n", 0, m.start()) + 1
            if family is not None and circle_family(layer, target) == family:
                continue
            edges.setdefault((stem, target), f"{where}:{lineno}")
            if ranks[target] > rank:
                errors.append(
                    f'{where}:{lineno}: {stem} (rank {rank}) includes "{name}" (rank {ranks[target]}): '
                    "an include runs back up"
                )
        # Where a function is declared or defined, its name is not a call; nor is a call of a
        # function the file defines itself (its own, or a member of one of its classes).
        named = {m.start(1) for m in C_ANY_DEFINITION.finditer(text)} | {m.start(1) for m in C_PROTOTYPE.finditer(text)}
        own = {m.group(1) for m in C_ANY_DEFINITION.finditer(text)} | {m.group(1) for m in C_MACRO.finditer(text)}
        seen: set[tuple[int, str]] = set()
        for m in C_CALL.finditer(text):
            name = m.group(1)
            if m.start(1) in named or name in own or name in C_KEYWORDS:
                continue
            target = owner.get(name)
            if target is None or target == stem:
                continue
            if family is not None and circle_family(layer, target) == family:
                continue
            lineno = text.count("\n", 0, m.start()) + 1
            edges.setdefault((stem, target), f"{where}:{lineno}")
            if ranks[target] < rank or (lineno, name) in seen:
                continue
            seen.add((lineno, name))
            errors.append(
                f"{where}:{lineno}: {stem} (rank {rank}) calls {name} of {target} (rank {ranks[target]}): "
                f"a call runs back up (or across) the ranks of csrc/{layer}"
            )
    for circle in _circles(edges):
        steps = " -> ".join(f"{a} ({edges[(a, b)]})" for a, b in zip(circle, circle[1:] + circle[:1]))
        errors.append(f"csrc/{layer}: files call or include each other in a circle: {steps} -> {circle[0]}")
    return errors


def _circles(edges: dict[tuple[str, str], str]) -> list[list[str]]:
    """One circle through each group of files that reach each other (a path, first file not
    repeated), found by walking the graph of `edges`."""
    succ: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        succ.setdefault(a, []).append(b)
    found: list[list[str]] = []
    covered: set[str] = set()
    for start in sorted(succ):
        if start in covered:
            continue
        # The shortest way back to `start`, breadth first.
        back: dict[str, str] = {}
        queue, i = [start], 0
        while i < len(queue):
            node = queue[i]
            i += 1
            for nxt in succ.get(node, []):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(back[path[-1]])
                    circle = path[::-1]
                    found.append(circle)
                    covered.update(circle)
                    queue = []
                    break
                if nxt not in back:
                    back[nxt] = node
                    queue.append(nxt)
    return found


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
    errors = check_c(root) + check_c_ranks(root) + check_python(root) + check_sizes(root)
    for line in errors:
        print(line)
    if errors:
        print(f"check_layers: {len(errors)} violation(s)", file=sys.stderr)
        return 1
    print("check_layers: includes, calls and imports follow the layers and the ranks; no file is over its size")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
"""Build the torch bridge (csrc/bridge/*.cpp) against another torch than the installed one.

    python3 -m pip download --no-deps torch==2.11.0 -d /tmp/wheels      # once, ~0.5 GB
    python3 scripts/check_bridge_build.py /tmp/wheels/torch-2.11.0-*.whl

The bridge is compiled against the torch it runs with (torch's allocator interface changes
between releases), so this checks that the sources still build for a torch users have, without
installing it: it unpacks the wheel's headers and libraries into a scratch folder, compiles the
bridge's files and its test hooks' with warnings as errors, and links them into a shared library against that
torch's libc10, libc10_cuda, libtorch_cuda, libtorch_cpu and libtorch, the CUDA runtime and the
built cudapool._C with --no-undefined: every symbol the bridge uses must exist in that torch.
The CUDA runtime headers come from the installed torch's nvidia wheel (or CUDA_HOME), as setup.py
finds them. Prints what it ran; exits non-zero on a failure.
"""

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SOURCES = sorted(
    str(p.relative_to(ROOT))
    for folder in ("bridge", "bridge_testhooks")
    for p in (ROOT / "csrc" / folder).glob("*.cpp")
)


def _setup_function(name: str):
    """The function ``name`` of setup.py (the build's own search), without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope = {"os": os, "Path": Path}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "setup.py", "exec"), scope)
    return scope[name]


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path, help="a torch wheel (CUDA build)")
    ap.add_argument("--cxx", default="g++")
    args = ap.parse_args(argv)
    if not args.wheel.is_file():
        ap.error(f"{args.wheel} is not a file")
    match = re.match(r"torch-([^-]+)-", args.wheel.name)
    version = match.group(1) if match else "unknown"

    import torch

    cuda = _setup_function("_cuda_runtime_dirs")(Path(torch.__file__).resolve().parent)
    if cuda is None:
        print("check_bridge_build: no CUDA runtime headers found (torch's nvidia wheel, CUDA_HOME)", file=sys.stderr)
        return 1
    cuda_includes, cuda_lib, cudart = cuda
    built_c = sorted((ROOT / "python" / "cudapool").glob("_C.*.so"))
    if not built_c:
        print("check_bridge_build: build cudapool._C first (pip install -e .)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="bridge-torch-") as tmp:
        with zipfile.ZipFile(args.wheel) as whl:
            members = [n for n in whl.namelist() if n.startswith(("torch/include/", "torch/lib/"))]
            print(f"check_bridge_build: unpacking {len(members)} files of {args.wheel.name}")
            whl.extractall(tmp, members)
        include, lib = Path(tmp) / "torch" / "include", Path(tmp) / "torch" / "lib"
        cmd = [args.cxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-Icsrc"]
        for folder in (include, include / "torch" / "csrc" / "api" / "include", *cuda_includes):
            cmd += ["-isystem", str(folder)]
        cmd += [f'-DCUDAPOOL_TORCH_VERSION="{version}"', "-D_GLIBCXX_USE_CXX11_ABI=1", *SOURCES]
        cmd += ["-o", str(Path(tmp) / "bridge.so"), f"-L{lib}", "-lc10", "-lc10_cuda", "-ltorch_cuda", "-ltorch_cpu"]
        cmd += ["-ltorch", f"-L{cuda_lib}", f"-l:{cudart}", f"-L{built_c[0].parent}", f"-l:{built_c[0].name}"]
        cmd += ["-Wl,--no-undefined", "-Wl,--allow-shlib-undefined"]
        print("check_bridge_build: " + " ".join(cmd))
        proc = subprocess.run(cmd, cwd=ROOT)
        if proc.returncode != 0:
            print(f"check_bridge_build: the bridge does not build against torch {version}", file=sys.stderr)
            return 1
    print(f"check_bridge_build: the bridge builds and links against torch {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Build the fake GPU (csrc/fakecuda/*.cpp, cudapool._torch_fakecuda) against another torch than the
installed one, and run it there.

    python3 -m pip download --no-deps torch==2.11.0 -d /tmp/wheels      # once, ~0.5 GB
    python3 scripts/check_fakecuda_build.py /tmp/wheels/torch-2.11.0-*.whl [--keep DIR]

The fake GPU is compiled against the torch it runs with and writes one slot of that torch's CUDA
hooks (Note [The primary-context slot] in csrc/fakecuda/fakecuda_vtable.cpp), so this checks a
torch users have without installing it: it unpacks the wheel (or takes a folder that holds an
unpacked torch/), compiles the module's files with warnings as errors against that torch's
headers, links it against its libraries, and then, in a fresh interpreter whose sys.path puts that
torch before the installed one (its nvidia libraries are the installed ones), imports it with a
copy of this tree's package and traces two forward and backward passes of a small model on it
(autograd's engine asks the patched slot) on the native engine and, where cudapool.fakegpu
runs them on that torch, on torch's fake tensors, whose peaks must agree, then two AdamW steps on
each (what an optimizer's step asks of torch.cuda changes between releases); torch answers as
before once the fake GPU is gone. First of all, rank 1 of a job of 2 as ab --simulate
--nproc-per-node 2 runs it (DDP with a static graph, FSDP2; the slots of a process of the fake
GPU's own): autograd's engine sizes its device threads once, at a process's first backward. A CPU build of torch has no
CUDA library to link or patch: its check compiles the files only. Prints what it ran; exits
non-zero on a failure. The build of this tree comes first (cudapool._C).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "fakecuda").glob("*.cpp"))

# Run in the other torch's interpreter: {torch_root}, {version} filled in.
SCENARIO = """
import sys
import torch, torch.nn as nn
assert torch.__file__.startswith({torch_root!r}), torch.__file__
assert torch.__version__ == {version!r}, torch.__version__
import cudapool._torch_fakecuda as m
from cudapool.fakegpu.native import why_unavailable
from cudapool.fakegpu import FakeGPU, gpu_model
assert m.torch_version == torch.__version__, m.torch_version
assert why_unavailable() is None, why_unavailable()

def context():  # what torch's CUDA hooks answer for device 0 (an error's first line where they raise)
    try:
        return str(torch._C._cuda_hasPrimaryContext(0))
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc).splitlines()[0]

def step(engine):
    torch.manual_seed(0)
    with FakeGPU(gpu_model("H100"), engine=engine) as fg:
        model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
        x = torch.randn(32, 256, device="cuda")
        for _ in range(2):
            model(x).pow(2).mean().backward()  # autograd's engine asks the patched slot
        return len(fg.tracer.events), fg.tracer.peak_bytes

def optimizer_steps(engine):  # an optimizer's step asks torch.cuda what differs between releases
    with FakeGPU(gpu_model("H100"), engine=engine) as fg:
        model = nn.Linear(64, 64).cuda()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(torch.randn(8, 64, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        return len(fg.tracer.events)

def ranks():  # rank 1 of 2 with DDP (a static graph: pinned host memory) and FSDP2, as ab --simulate runs it
    import os
    from cudapool.ab.ranks import World, rank_env
    from cudapool.fakegpu.distributed import FakeWorld
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    os.environ.update(rank_env(World(2), 1))
    fg = FakeGPU(gpu_model("H100"), engine="native", devices=2, whole_process=True)
    with fg, FakeWorld(fg, rank=1, world_size=2, local_world_size=2):
        dist.init_process_group("nccl")
        torch.cuda.set_device(1)
        ddp = DDP(nn.Linear(256, 256).cuda(), device_ids=[1], static_graph=True)
        for _ in range(2):
            ddp(torch.randn(8, 256, device="cuda")).sum().backward()
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)).cuda()
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        del ddp, model  # gone while the fake GPU is there: a reducer's end asks the device guard
        import gc
        gc.collect()
        streams = {{e[3] for e in fg.tracer.events}}
    assert fg.tracer.peak_bytes > 0 and len(streams) > 1, (fg.tracer.peak_bytes, streams)
    return len(fg.tracer.events), len(streams)

before = context()
rank_events, rank_streams = ranks()  # first: autograd's engine sizes its device threads at its first backward
native = step("native")
optimizer_steps("native")
after = context()
assert after == before, (before, after)
try:
    python = step("python")
    optimizer_steps("python")
    same = "the same as torch's fake tensors'"
except Exception as exc:  # cudapool.fakegpu's own use of that torch
    python, same = None, "not compared: torch's fake tensors fail here: " + str(exc).splitlines()[0]
assert python is None or native[1] == python[1], ("peaks differ", native, python)

print(f"check_fakecuda_build: torch {{torch.__version__}}: two forward and backward passes traced on the native "
      f"engine, {{native[0]}} events, peak {{native[1]:,}} B, {{same}}; two AdamW steps traced; "
      f"hasPrimaryContext answers as before: {{after}}; rank 1 of 2 with DDP and FSDP2 traced, "
      f"{{rank_events}} events on {{rank_streams}} streams")
"""


def _unpacked(source: Path, tmp: Path) -> Path:
    """The folder that holds torch/ (the wheel unpacked into tmp, or source itself)."""
    if source.is_dir():
        return source
    with zipfile.ZipFile(source) as whl:
        print(f"check_fakecuda_build: unpacking {source.name}")
        whl.extractall(tmp / "site")
    return tmp / "site"


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("torch", type=Path, help="a torch wheel, or a folder holding an unpacked torch/")
    ap.add_argument("--cxx", default="g++")
    ap.add_argument("--keep", type=Path, help="build and unpack here (kept) instead of a scratch folder")
    args = ap.parse_args(argv)
    if not args.torch.exists():
        ap.error(f"{args.torch} does not exist")
    if not sorted((ROOT / "python" / "cudapool").glob("_C.*.so")):
        print("check_fakecuda_build: build cudapool._C first (pip install -e .)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="fakecuda-torch-") as scratch:
        tmp = Path(args.keep) if args.keep else Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        site = _unpacked(args.torch, tmp)
        root = site / "torch"
        text = (root / "version.py").read_text(encoding="utf-8")
        version = re.search(r"^__version__ = '([^']+)'", text, re.M).group(1)  # type: ignore[union-attr]
        cuda = re.search(r"^cuda: .*= '([^']+)'", text, re.M) is not None
        include, lib = root / "include", root / "lib"
        flags = ["-std=c++20", "-O1", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror", "-Icsrc"]
        for folder in (include, include / "torch" / "csrc" / "api" / "include", Path(sysconfig.get_paths()["include"])):
            flags += ["-isystem", str(folder)]
        flags += [f'-DCUDAPOOL_TORCH_VERSION="{version}"', "-D_GLIBCXX_USE_CXX11_ABI=1"]
        if not cuda:
            # No libtorch_cuda: nothing to link against or patch (setup.py does not build the module then).
            cmd = [args.cxx, *flags, "-fsyntax-only", *SOURCES]
            print("check_fakecuda_build: " + " ".join(cmd))
            if subprocess.run(cmd, cwd=ROOT).returncode != 0:
                print(f"check_fakecuda_build: the fake GPU does not compile against torch {version}", file=sys.stderr)
                return 1
            print(f"check_fakecuda_build: torch {version} is a CPU build: the files compile; nothing to link or run")
            return 0
        pkg = tmp / "pkg"
        shutil.rmtree(pkg, ignore_errors=True)
        shutil.copytree(
            ROOT / "python" / "cudapool", pkg / "cudapool", ignore=shutil.ignore_patterns("_torch_*.so", "__pycache__")
        )
        out = pkg / "cudapool" / ("_torch_fakecuda" + sysconfig.get_config_var("EXT_SUFFIX"))
        cmd = [args.cxx, "-shared", *flags, *SOURCES, "-o", str(out), f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10"]
        cmd += ["-ltorch_cpu", "-ltorch_cuda", "-ltorch", "-ltorch_python", "-pthread"]
        print("check_fakecuda_build: " + " ".join(cmd))
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            print(f"check_fakecuda_build: the fake GPU does not build against torch {version}", file=sys.stderr)
            return 1
        code = SCENARIO.format(torch_root=str(root), version=version)
        env = dict(os.environ, PYTHONPATH=f"{site}:{pkg}")  # that torch before the installed one
        print(f"check_fakecuda_build: running it with PYTHONPATH={env['PYTHONPATH']}")
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env)
        if proc.returncode != 0:
            print(f"check_fakecuda_build: the fake GPU does not run on torch {version}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``ab --simulate`` against memory snapshots recorded on a GPU, for a public script run as its
author ran it.

    python benchmarks/ab_public.py --repo DIR [--ctx 128,256,512,1024]
                                   [--patterns forward-only,full-training-step] [--gpu A100-80GB]
                                   [--engine auto|native|python] [--json PATH]

The script is ``cs336_systems/nsys_profile.py`` of a student's public solution to Stanford
CS336's assignment 2 (spring 2026; repository ``Wedsonlin/assignment2-systems``): it builds the
course's Transformer language model (``cs336_basics``), runs five warm-up steps, records one
more step with ``torch.cuda.memory._record_memory_history`` and writes the snapshot with
``_dump_snapshot``, under the built-in allocator on a GPU. The repository holds those snapshots
(``results/medium_<ctx>_{inference,training}_memory_snapshot.pickle``, the medium model: d_model
1024, d_ff 4096, 24 layers, 16 heads, batch 4), recorded on a GPU with 8 MiB + 128 KiB cuBLAS
workspaces (one such block lies in each: not a Hopper GPU, hence ``--gpu A100-80GB``). Neither
the script nor the snapshots are part of cudapool: ``--repo`` is a checkout of that repository.
The script needs ``einops`` and ``jaxtyping``.

Each run is ``python -m cudapool ab --simulate --gpu GPU --allocators builtin -- nsys_profile.py
...`` with the arguments of the repository's ``scripts/run_profile_configs.sh`` for the medium
model (``--memory-profiler pytorch``, five warm-up steps), with ``--autocast true`` where the
recorded snapshot's stacks show autocast's casts (three of the eight), from the script's own
folder. The script is run unmodified, but on a Python older than 3.12 its two f-strings that
nest double quotes (3.12 syntax) are rewritten with single quotes in a copy. The recorded
snapshot is replayed under the built-in allocator's rules (``python -m cudapool replay``) for
its peak allocated (the window's, with the memory live at its start) and the reserved memory
the recorded run held; the prediction's peak allocated and peak reserved are set beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
MEDIUM = ["--d_model", "1024", "--d_ff", "4096", "--num_layers", "24", "--num_heads", "16"]
KINDS = {"forward-only": "inference", "full-training-step": "training"}


def _env(*extra: Path) -> Dict[str, str]:
    """cudapool from this checkout, and `extra` (the course's package, as its install would)."""
    env = dict(os.environ)
    paths = (str(ROOT / "python"), *map(str, extra), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _prepare(repo: Path, work: Path) -> Path:
    """A copy of the script's folder and of cs336_basics, the f-strings ported where needed."""
    for name in ("cs336_systems", "cs336-basics"):
        if not (repo / name).is_dir():
            raise SystemExit(f"ab_public: {repo} has no {name}/: not a checkout of the assignment's repository")
        shutil.copytree(repo / name, work / name)
    script = work / "cs336_systems" / "nsys_profile.py"
    if sys.version_info < (3, 12):
        text = script.read_text()
        script.write_text(text.replace('model.config["context_length"]', "model.config['context_length']"))
    (work / "results").mkdir()
    return script


def _autocast(snapshot: Path) -> bool:
    """Whether the recorded run used bf16 autocast: its allocations' stacks show its casts."""
    sys.path.insert(0, str(ROOT / "python"))
    from cudapool.lab.torch_snapshot import _unpickle

    for trace in _unpickle(snapshot).get("device_traces", []):
        for entry in trace:
            frames = entry.get("frames", ()) or () if entry.get("action") == "alloc" else ()
            if any("autocast" in str(f.get("name", "")) for f in frames):
                return True
    return False


def _recorded(snapshot: Path) -> Dict[str, int]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cudapool",
            "replay",
            str(snapshot),
            "--policy",
            "builtin",
            "--json",
            "-",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        check=True,
    )
    r = json.loads(out.stdout)
    return {"peak_allocated": int(r["peak_allocated"]), "reserved": int(r["builtin_peak_reserved"])}


def _predicted(
    script: Path, ctx: int, pattern: str, autocast: bool, gpu: str, out: Path, engine: str = "auto"
) -> Dict[str, Any]:
    argv = [sys.executable, "-m", "cudapool", "ab", "--simulate", "--gpu", gpu, "--allocators", "builtin"]
    argv += ["--engine", engine]
    argv += ["--hide-output", "--json", str(out), "--", script.name, *MEDIUM, "--context_length", str(ctx)]
    argv += ["--model_name", "medium", "--memory-profiler", "pytorch", "--pattern", pattern, "--warmup-steps", "5"]
    argv += ["--autocast", "true" if autocast else "false"]
    start = time.perf_counter()
    basics = script.parent.parent / "cs336-basics"
    done = subprocess.run(argv, cwd=script.parent, env=_env(basics), capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"ab_public: ab --simulate failed on ctx {ctx}, {pattern}: {tail[0]}")
    row = json.loads(out.read_text())["rows"][0]
    return {
        "peak_allocated": int(row["peak_allocated"]),
        "peak_reserved": int(row["peak_reserved"]),
        "seconds": time.perf_counter() - start,
    }


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", required=True, type=Path, help="a checkout of Wedsonlin/assignment2-systems")
    p.add_argument("--ctx", default="128,256,512,1024", help="context lengths (default: all four recorded)")
    p.add_argument("--patterns", default="forward-only,full-training-step")
    p.add_argument("--gpu", default="A100-80GB")
    p.add_argument("--engine", choices=("auto", "native", "python"), default="auto", help="ab --simulate's fake GPU")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    try:
        ctxs = [int(c) for c in args.ctx.split(",")]
    except ValueError:
        p.error(f"--ctx: not a list of integers: {args.ctx!r}")
    patterns = args.patterns.split(",")
    for pattern in patterns:
        if pattern not in KINDS:
            p.error(f"--patterns: unknown pattern {pattern!r} (known: {', '.join(KINDS)})")
    rows = []
    with tempfile.TemporaryDirectory(prefix="cudapool-ab-public-") as tmp:
        work = Path(tmp)
        script = _prepare(args.repo.resolve(), work)
        for ctx in ctxs:
            for pattern in patterns:
                kind = KINDS[pattern]
                snapshot = args.repo / "results" / f"medium_{ctx}_{kind}_memory_snapshot.pickle"
                if not snapshot.is_file():
                    raise SystemExit(f"ab_public: no recorded snapshot {snapshot}")
                autocast = _autocast(snapshot)
                print(
                    f"ab_public: medium, ctx {ctx}, {kind}, autocast {autocast}: tracing ...",
                    file=sys.stderr,
                    flush=True,
                )
                rec = _recorded(snapshot)
                pred = _predicted(script, ctx, pattern, autocast, args.gpu, work / f"{ctx}_{kind}.json", args.engine)
                rows.append({"ctx": ctx, "kind": kind, "autocast": autocast, "recorded": rec, "predicted": pred})
    print(
        f"ab --simulate --gpu {args.gpu} --engine {args.engine} against the recorded snapshots "
        "(built-in allocator on a GPU)"
    )
    print(
        f"{'run':28s} {'recorded peak alloc':>20s} {'predicted':>14s} {'diff':>9s} "
        f"{'recorded reserved':>18s} {'predicted':>14s} {'diff':>9s} {'trace s':>8s}"
    )
    for r in rows:
        ra, pa = r["recorded"]["peak_allocated"], r["predicted"]["peak_allocated"]
        rr, pr = r["recorded"]["reserved"], r["predicted"]["peak_reserved"]
        print(
            f"{'medium ctx ' + str(r['ctx']) + ' ' + r['kind']:28s} {ra / 2**20:16.2f} MiB {pa / 2**20:10.2f} MiB "
            f"{(pa / ra - 1) * 100:+8.2f}% {rr / 2**20:14.2f} MiB {pr / 2**20:10.2f} MiB {(pr / rr - 1) * 100:+8.2f}% "
            f"{r['predicted']['seconds']:8.0f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"gpu": args.gpu, "engine": args.engine, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

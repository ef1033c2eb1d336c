"""``ab --simulate`` on compiled programs against memory recorded on GPUs by public scripts.

    python benchmarks/ab_compiled_public.py speedrun --repo DIR --record NAME [--max-steps 3]
    python benchmarks/ab_compiled_public.py snapshot --repo DIR --commit REV --script PATH
                                          --snapshot PATH [--gpu A100-80GB] [-- ARGS...]

``speedrun``: a record of the modded-nanogpt speedrun (``KellerJordan/modded-nanogpt``; ``--repo``
a checkout or a bare git directory). Each record's log under ``records/track_1_short/NAME/``
begins with the full source of the script that wrote it (everything before the first line of
100 ``=``) and ends with the peak its rank 0 measured on 8 H100s (``peak memory consumption: N
MiB``, or ``peak memory allocated: N MiB reserved: M MiB``: ``torch.cuda.max_memory_allocated()``
and ``max_memory_reserved()``). The script is written out unchanged, its training data stood in
for by random tokens in the shard format it reads (a 256 x int32 header: 20240520, 1, the token
count; then uint16 tokens), and run under ``ab --simulate --gpu H100 --nproc-per-node 8
--allocators builtin --max-steps N`` (the peak of these scripts comes in their first steps, when
the optimizers' states exist: the third step is past it).

``snapshot``: a script whose author recorded a memory snapshot on a GPU
(``torch.cuda.memory._dump_snapshot``), both in a git repository at ``--commit``: the script's
folder is checked out from that commit, the script run under ``ab --simulate --allocators
builtin`` with ``ARGS``, and the recorded snapshot replayed under the built-in allocator's rules
(``python -m cudapool replay``) for its peak allocated (with what was live when recording began)
and the memory it held reserved. The scripts' own packages (einops, jaxtyping, ...) must be
installed.

Neither the scripts nor the recordings are part of cudapool; each run prints the recorded
figures beside the predicted ones and their difference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SEPARATOR = "\n" + "=" * 100 + "\n"
MIB = 1 << 20


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "python"), env.get("PYTHONPATH", "")) if p)
    return env


def _git(repo: Path, *args: str) -> bytes:
    """``git`` in ``repo`` (a checkout or a bare git directory)."""
    where = (
        ["--git-dir", str(repo)] if (repo / "HEAD").is_file() and not (repo / ".git").exists() else ["-C", str(repo)]
    )
    return subprocess.run(["git", *where, *args], capture_output=True, check=True).stdout


def _simulate(argv: List[str], cwd: Path, out: Path) -> Dict:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "cudapool", "ab", "--simulate", "--allocators", "builtin", "--hide-output"]
    done = subprocess.run([*cmd, "--json", str(out), *argv], cwd=cwd, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"ab_compiled_public: ab --simulate failed: {tail[0]}")
    result = json.loads(out.read_text())
    result["wall_seconds"] = time.perf_counter() - start
    return result


def _line(name: str, recorded: Optional[int], predicted: int) -> str:
    if recorded is None:
        return f"{name:20s} {'-':>14s} {predicted / MIB:12.2f} MiB"
    return (
        f"{name:20s} {recorded / MIB:10.2f} MiB {predicted / MIB:12.2f} MiB {(predicted / recorded - 1) * 100:+8.3f} %"
    )


# -- speedrun records ------------------------------------------------------------------------------


def stand_in_shards(folder: Path, tokens: int) -> None:
    """The speedrun's training and validation shards, of random tokens (1 in 1,000 a document's end)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("fineweb_train_000001.bin", "fineweb_val_000000.bin"):
        toks = rng.integers(0, 50256, size=tokens, dtype=np.uint16)
        toks[rng.random(tokens) < 1e-3] = 50256
        toks[0] = 50256
        header = np.zeros(256, dtype=np.int32)
        header[:3] = (20240520, 1, tokens)
        with open(folder / name, "wb") as f:
            f.write(header.tobytes())
            f.write(toks.tobytes())


def speedrun(args: argparse.Namespace) -> int:
    folder = f"records/track_1_short/{args.record}"
    logs = [
        n
        for n in _git(args.repo, "ls-tree", "--name-only", "HEAD", f"{folder}/").decode().split()
        if n.endswith(".txt")
    ]
    if not logs:
        raise SystemExit(f"ab_compiled_public: no logs in {folder} of {args.repo}")
    log = _git(args.repo, "show", f"HEAD:{sorted(logs)[0]}").decode()
    if SEPARATOR not in log:
        raise SystemExit(f"ab_compiled_public: {logs[0]} does not begin with its script's source")
    code, output = log.split(SEPARATOR, 1)
    peaks = re.findall(r"peak memory (?:consumption|allocated): (\d+) MiB(?: reserved: (\d+) MiB)?", output)
    if not peaks:
        raise SystemExit(f"ab_compiled_public: {logs[0]} prints no peak memory")
    alloc, reserved = int(peaks[-1][0]) * MIB, (int(peaks[-1][1]) * MIB if peaks[-1][1] else None)
    version = re.search(r"Running pytorch (\S+)", output, re.IGNORECASE)
    with tempfile.TemporaryDirectory(prefix="cudapool-speedrun-") as tmp:
        work = Path(tmp)
        (work / "train_gpt.py").write_text(code.rstrip("\n") + "\n")
        (work / "logs").mkdir()
        stand_in_shards(work / "data" / "fineweb10B", args.tokens)
        print(f"ab_compiled_public: {args.record}: tracing ranks of 8 ...", file=sys.stderr, flush=True)
        argv = ["--gpu", "H100", "--nproc-per-node", "8", "--max-steps", str(args.max_steps), "--", "train_gpt.py"]
        result = _simulate(argv, work, work / "out.json")
    row = next(r for r in result["rows"] if r.get("rank") == 0)
    print(f"{args.record}: recorded on 8 x H100 with torch {version.group(1) if version else '?'}; predicted by "
          f"ab --simulate --nproc-per-node 8 --max-steps {args.max_steps} ({result['wall_seconds']:.0f} s)")  # fmt: skip
    print(f"{'rank 0':20s} {'recorded':>14s} {'predicted':>16s} {'diff':>10s}")
    print(_line("peak allocated", alloc, int(row["peak_allocated"])))
    print(_line("peak reserved", reserved, int(row["peak_reserved"])))
    return 0


# -- recorded snapshots ----------------------------------------------------------------------------


def snapshot(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="cudapool-snapshot-") as tmp:
        work = Path(tmp)
        folder = str(Path(args.script).parent)
        archive = _git(args.repo, "archive", args.commit, "--", "." if folder == "." else folder)
        subprocess.run(["tar", "x", "-C", str(work)], input=archive, check=True)
        recorded_path = work / "recorded.pickle"
        recorded_path.write_bytes(_git(args.repo, "show", f"{args.commit}:{args.snapshot}"))
        done = subprocess.run(
            [sys.executable, "-m", "cudapool", "replay", str(recorded_path), "--policy", "builtin", "--json", "-"]
            + ["--no-progress"],
            capture_output=True, text=True, env=_env(), check=True,
        )  # fmt: skip
        recorded = json.loads(done.stdout)
        script = work / args.script
        print(f"ab_compiled_public: {args.script} at {args.commit}: tracing ...", file=sys.stderr, flush=True)
        argv = ["--gpu", args.gpu, "--", script.name, *args.args]
        result = _simulate(argv, script.parent, work / "out.json")
    row = result["rows"][0]
    print(f"{args.script} at {args.commit}: {args.snapshot} recorded on a GPU; predicted by ab --simulate --gpu "
          f"{args.gpu} ({result['wall_seconds']:.0f} s)")  # fmt: skip
    print(f"{'':20s} {'recorded':>14s} {'predicted':>16s} {'diff':>10s}")
    print(_line("peak allocated", int(recorded["peak_allocated"]), int(row["peak_allocated"])))
    print(_line("peak reserved", int(recorded["builtin_peak_reserved"]), int(row["peak_reserved"])))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speedrun", help="a modded-nanogpt speedrun record")
    s.add_argument("--repo", required=True, type=Path, help="KellerJordan/modded-nanogpt (checkout or git dir)")
    s.add_argument("--record", required=True, help="a folder of records/track_1_short, e.g. 2025-01-04_SoftCap")
    s.add_argument("--max-steps", type=int, default=3)
    s.add_argument("--tokens", type=int, default=24 << 20, help="tokens per stand-in shard")
    r = sub.add_parser("snapshot", help="a script and the snapshot its author recorded")
    r.add_argument("--repo", required=True, type=Path)
    r.add_argument("--commit", required=True)
    r.add_argument("--script", required=True, help="the script's path in the repository")
    r.add_argument("--snapshot", required=True, help="the recorded snapshot's path in the repository")
    r.add_argument("--gpu", default="H100")
    r.add_argument("args", nargs="*", help="the script's arguments (after --)")
    args = p.parse_args(argv)
    return speedrun(args) if args.what == "speedrun" else snapshot(args)


if __name__ == "__main__":
    sys.exit(main())

"""``nvidia-smi`` for a script traced on the fake GPU: many training scripts run it to log the
machine (``subprocess.run(["nvidia-smi"])``), and on a machine without a GPU it is missing.
:func:`install` writes a stand-in that lists the fake GPU's devices (the default table, ``-L``,
and ``--query-gpu=...`` with ``--format=csv``) and puts its folder first on ``PATH``.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any, Dict, List

__all__ = ["install", "render"]

MIB = 1 << 20


def render(argv: List[str], gpu: Dict[str, Any], devices: int) -> str:
    """What the stand-in prints for ``argv`` (its arguments) on ``devices`` GPUs of ``gpu``
    (a GPU model's fields: name, total_memory)."""
    name, total = gpu["name"], int(gpu["total_memory"]) // MIB
    uuid = "GPU-00000000-0000-0000-0000-{:012d}"
    if "-L" in argv or "--list-gpus" in argv:
        return "".join(f"GPU {i}: {name} (UUID: {uuid.format(i)})\n" for i in range(devices))
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    if query is not None:
        fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "csv")
        units = "nounits" not in fmt
        keys = [k.strip() for k in query.split(",") if k.strip()]

        def value(key: str, i: int) -> str:
            mem = {"memory.total": total, "memory.used": 0, "memory.free": total}
            if key in mem:
                return f"{mem[key]} MiB" if units else str(mem[key])
            return {"name": name, "index": str(i), "uuid": uuid.format(i), "count": str(devices)}.get(key, "[N/A]")

        lines = [] if "noheader" in fmt else [", ".join(keys)]
        lines += [", ".join(value(k, i) for k in keys) for i in range(devices)]
        return "\n".join(lines) + "\n"
    rule = "+" + "-" * 78 + "+\n"
    rows = "".join(f"| {i:>3}  {name:<46} {0:>8}MiB / {total:>7}MiB |\n" for i in range(devices))
    title = f"| {'nvidia-smi of cudapool ab --simulate: the fake GPU (no GPU is here)':<76} |\n"
    return rule + title + rule + rows + rule


def install(folder: str, gpu: Dict[str, Any], devices: int) -> str:
    """Write the stand-in into ``folder`` and put the folder first on ``PATH`` (of this process
    and the processes it starts); the stand-in's path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "nvidia-smi")
    with open(path, "w") as f:
        f.write(
            f"#!{sys.executable}\n"
            "import json, sys\n"
            "from cudapool.fakegpu.nvidia_smi import render\n"
            f"sys.stdout.write(render(sys.argv[1:], json.loads({json.dumps(dict(gpu))!r}), {int(devices)}))\n"
        )
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
    return path

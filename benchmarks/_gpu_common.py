"""Pieces shared by the benchmarks that need a CUDA GPU (ab_torch.py, builtin_fidelity.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, Optional


def gpu_skip_reason() -> Optional[str]:
    """Why a GPU benchmark cannot run here, or None. Never initialises CUDA in this process."""
    try:
        import torch
    except Exception as exc:  # not installed, or broken
        return f"torch is not importable ({exc.__class__.__name__}: {exc})"
    if not torch.cuda.is_available():
        return f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build {torch.version.cuda})"
    return None


def skipped_without_gpu(name: str, json_path: Optional[str]) -> bool:
    """True when there is no GPU to run on, after saying so: "no CUDA GPU: skipped" on stdout,
    the reason on stderr, and {"skipped": reason} in the JSON file when one was asked for."""
    reason = gpu_skip_reason()
    if reason is None:
        return False
    print("no CUDA GPU: skipped")
    print(f"{name}: {reason}", file=sys.stderr)
    write_json(json_path, {"skipped": reason})
    return True


def tail(data: Any, limit: int = 6000) -> str:
    """The last `limit` characters of a child's output (bytes or str, or None)."""
    if data is None:
        return ""
    if isinstance(data, bytes):
        data = data.decode(errors="replace")
    return data[-limit:]


def write_json(path: Optional[str], payload: Dict[str, Any]) -> None:
    """Write `payload` as indented JSON to `path` (parents created); nothing when no path."""
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")

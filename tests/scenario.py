"""Scenarios in a fresh interpreter, for tests whose state must start clean (the device
table, torch's allocator, fork handlers) or whose failure could be a hang.

``run_python`` runs code with CUDAPOOL_CONF unset (unless ``env`` sets it) and a deadline: a
scenario still running at the deadline fails the test with what it printed. ``expect_ok``
checks the usual ending: exit 0, "OK" as the last line.
"""

import os
import subprocess
import sys
from typing import Dict, Optional, Sequence

import pytest

# Scenario code that declares the C entry points torch calls, as `lib` (ctypes releases the GIL
# around each call, so Python threads really are inside the pool at once).
ENTRY_POINTS = """
import ctypes
from cudapool import _C, _testhooks
lib = ctypes.CDLL(_C.__file__)
lib.cudapool_alloc_catching.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                                        ctypes.c_size_t]
lib.cudapool_alloc_catching.restype = ctypes.c_int
lib.cudapool_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.cudapool_free.restype = None
lib.cudapool_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
lib.cudapool_record_stream.restype = None
lib.cudapool_empty_cache.argtypes = []
lib.cudapool_empty_cache.restype = None
lib.cudapool_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
lib.cudapool_set_memory_fraction.restype = None
lib.cudapool_init.argtypes = [ctypes.c_int]
lib.cudapool_init.restype = None
"""


def run_python(
    code: str, *, timeout: float, env: Optional[Dict[str, str]] = None, python_args: Sequence[str] = ()
) -> subprocess.CompletedProcess:
    environ = dict(os.environ)
    environ.pop("CUDAPOOL_CONF", None)
    environ.update(env or {})
    try:
        return subprocess.run(
            [sys.executable, *python_args, "-c", code], capture_output=True, text=True, timeout=timeout, env=environ
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"scenario still running after {timeout} s (a deadlock?)\n--- stdout\n{out}\n--- stderr\n{err}")


def expect_ok(proc: subprocess.CompletedProcess) -> str:
    """The stdout of a scenario that must exit 0 with "OK" as its last line."""
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("OK"), (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc.stdout

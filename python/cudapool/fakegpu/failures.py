"""Why a script failed on the fake GPU, in one line: its own error (as on a GPU), or what the
simulation cannot do (:func:`explain_failure`)."""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Optional

import torch

__all__ = ["LIBRARY_DIRS", "NOT_INSTALLED", "ValueRead", "explain_failure", "script_error"]


class ValueRead(RuntimeError):
    """A script read a value of a fake tensor under ``strict_values=True``."""


_OP = re.compile(r"\b([A-Za-z_][\w]*::[\w.]+)")
_OVERLOAD = re.compile(r"\b(aten|prims|[a-z_]+lib)\.(\w+)\.\w+\b")


#: What a missing package's message ends with (the report adds nothing to it).
NOT_INSTALLED = "not installed here (install it: a GPU machine without it fails the same way)"

#: Where torch and cudapool live: a frame under them is not the script's own.
LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch,) if getattr(m, "__file__", None)
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)


def script_error(exc: BaseException, script: str) -> Optional[str]:
    """The line for an exception raised by the script's own code (its innermost frame is
    outside torch and cudapool: the script, or a module of its own), as it would be on a GPU;
    None when torch or the simulation raised it (:func:`explain_failure` then)."""
    here = os.path.dirname(os.path.abspath(script))
    if isinstance(exc, SyntaxError) and exc.filename and not exc.filename.startswith("<"):
        # The script (or a module of its own) does not compile: where the compiler says, and
        # which Python said so (newer syntax, e.g. 3.12's f-strings, fails on an older one).
        path = os.path.abspath(exc.filename)
        if path.startswith(LIBRARY_DIRS):
            return None
        version = "{}.{}".format(*sys.version_info[:2])
        return (
            f"{os.path.relpath(path, here)}:{exc.lineno}: `{(exc.text or '').strip()}`: "
            f"{type(exc).__name__}: {exc.msg} (Python {version} compiled it)"
        )
    # Python's own frozen modules (os.environ's lookup, say) are not where a script's error is.
    frames = [f for f in traceback.walk_tb(exc.__traceback__) if not f[0].f_code.co_filename.startswith("<frozen")]
    if isinstance(exc, ModuleNotFoundError) and exc.name and frames:
        # A package that is not installed here, whoever imports it (the script, a module of its
        # own, a library): the machine's, as it would be on a GPU machine without it.
        import linecache

        frame, lineno = frames[-1]
        name = os.path.abspath(frame.f_code.co_filename)
        code = linecache.getline(name, lineno).strip()
        where = os.path.relpath(name, here) if not name.startswith(LIBRARY_DIRS) else os.path.basename(name)
        return f"{where}:{lineno}: `{code}`: ModuleNotFoundError: No module named {exc.name!r}: {NOT_INSTALLED}"
    if not frames or isinstance(exc, ValueRead) or "cudapool's fake GPU" in str(exc) or _cuda_error(exc):
        # the simulation's limit (the native engine raises from below the script's line), or the
        # CUDA runtime's error from a call the script made into torch's C code
        return None
    filename = frames[-1][0].f_code.co_filename
    inner = os.path.abspath(filename)
    if filename.startswith("<") or inner.startswith(LIBRARY_DIRS):
        return None
    import linecache

    lineno = frames[-1][1]
    code = linecache.getline(inner, lineno).strip()
    where = f"{os.path.relpath(inner, here)}:{lineno}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{where}: `{code}`: {type(exc).__name__}" + (f": {text}" if text else "")


_CUDA_ERRORS = re.compile(
    r"driver version is insufficient|no nvidia driver|cuda error|cudaerror|cuda driver|cuda_error_|"
    r"libcuda\.so|found no nvidia|cuInit|CUDA call failed",
    re.IGNORECASE,
)


def _cuda_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the CUDA runtime's or driver's error (no driver here)."""
    return bool(_CUDA_ERRORS.search(str(exc)))


def _caller(exc: BaseException, script: str) -> str:
    """Who made the call that failed: the innermost Python frame's function, with its module
    (torch's or a library's), or the script's line when the script called C code itself."""
    frames = [f for f in traceback.walk_tb(exc.__traceback__) if not f[0].f_code.co_filename.startswith("<")]
    if not frames:
        return "the script"
    frame, lineno = frames[-1]
    path = os.path.abspath(frame.f_code.co_filename)
    name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
    for root in sys.path:
        root = os.path.abspath(root or ".") + os.sep
        if path.startswith(root) and ("site-packages" in root or "dist-packages" in root):
            module = os.path.splitext(os.path.relpath(path, root))[0].replace(os.sep, ".")
            return f"{module}.{name} ({os.path.basename(path)}:{lineno})"
    if path == os.path.abspath(script):
        return f"the script's own call at line {lineno}"
    return f"{name} ({os.path.basename(path)}:{lineno})"


def explain_failure(exc: BaseException, script: str) -> str:
    """One line for an exception the script raised on the fake GPU: the script's line (the
    innermost frame in it), the operation when one is named, and what it means."""
    script = os.path.abspath(script)
    where = os.path.basename(script)
    code = ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if os.path.abspath(frame.f_code.co_filename) == script:
            where = f"{os.path.basename(script)}:{lineno}"
            import linecache

            code = linecache.getline(script, lineno).strip()
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    op_name = None
    m = _OP.search(str(exc)) or _OVERLOAD.search(str(exc))
    if m is not None:
        op_name = m.group(1) if "::" in m.group(0) else f"{m.group(1)}::{m.group(2)}"
    kind = type(exc).__name__
    if isinstance(exc, ValueRead):
        return str(exc)
    from .distributed import RanksNeeded

    if isinstance(exc, RanksNeeded):
        return f"{where}: `{code}`: {exc}" if code else f"{where}: {exc}"
    if "INTERNAL ASSERT FAILED" in str(exc):
        # torch's own consistency check, tripped by what the fake GPU does differently: never
        # passed on as a bug of torch's, nor of the script's.
        text = text.split(", please report a bug to PyTorch")[0]
        why = f"torch's internal check failed on the fake GPU ({text}): a limit of cudapool's simulation"
    elif any(k in kind for k in ("DataDependent", "DynamicOutputShape")) or "data-dependent" in str(exc).lower():
        why = "its output's shape depends on tensor values, which a fake tensor does not have"
    elif "nccl" in str(exc).lower() or "process group" in str(exc).lower() or "distributed" in kind.lower():
        why = (
            "torch.distributed runs on the fake GPU's own process group, which has no NCCL-specific calls "
            "(communicators, streams, registration)"
        )
    elif _cuda_error(exc):
        why = f"{_caller(exc, script)} called the CUDA driver, which the fake GPU does not stand in for ({text})"
    elif op_name is not None and ("Meta" in str(exc) or "fake" in str(exc).lower() or "NotImplemented" in kind):
        why = f"the operation {op_name} has no fake (meta) implementation: a custom CUDA extension?"
    else:
        why = f"{kind}: {text}"
    name = f" {op_name}" if op_name is not None else ""
    line = f"{where}: `{code}`" if code else where
    return f"{line}:{name} cannot be simulated: {why}"

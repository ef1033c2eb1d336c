"""The libraries cudapool builds against the installed torch, beside cudapool._C:
``_torch_bridge`` (cudapool as torch's own allocator), ``_torch_oom`` (out of memory as
``torch.OutOfMemoryError``) and ``_torch_bridge_testhooks`` (the bridge's test hooks). They are
plain shared libraries with a C interface, loaded with ctypes here, not Python modules: they
have no ``.pyi`` stubs and are never imported. Each says which torch it was built for, and one
built for another torch is not used.
"""

import ctypes
import importlib.machinery
import os
from typing import Optional, Tuple

from . import _C

__all__ = [
    "BRIDGE_ENV",
    "REINSTALL",
    "library_path",
    "load_bridge",
    "load_torch_oom",
    "symbol_address",
    "torch_bridge_library_path",
    "torch_oom_library_path",
]

#: Set to 0 to use torch's pluggable allocator path even when the bridge is built.
BRIDGE_ENV = "CUDAPOOL_BRIDGE"


REINSTALL = (
    "reinstall cudapool against the torch in use, without build isolation "
    "(pip install --no-build-isolation --force-reinstall --no-deps cudapool, or from a checkout "
    "pip install --no-build-isolation -e .)"
)


def library_path(stem: str) -> Optional[str]:
    """The path of the library cudapool.<stem> beside _C, or None when it was not built."""
    paths = (os.path.join(os.path.dirname(_C.__file__), stem + s) for s in importlib.machinery.EXTENSION_SUFFIXES)
    return next((path for path in paths if os.path.isfile(path)), None)


def torch_oom_library_path() -> Optional[str]:
    """The path of cudapool._torch_oom (the library that throws c10::OutOfMemoryError), or
    None when it was not built (torch was not importable when cudapool was built)."""
    return library_path("_torch_oom")


def torch_bridge_library_path() -> Optional[str]:
    """The path of cudapool._torch_bridge (cudapool as torch's own allocator), or None when it
    was not built (no CUDA build of torch, or no CUDA runtime headers, when cudapool was built)."""
    return library_path("_torch_bridge")


def _load_torch_library(path: str, version_symbol: str) -> Tuple[Optional[ctypes.CDLL], str]:
    """The library at ``path`` loaded, if it was built for the running torch (its
    ``version_symbol`` says which), else None and why."""
    import torch

    try:
        lib = ctypes.CDLL(path)
        getattr(lib, version_symbol).restype = ctypes.c_char_p
        built_for = getattr(lib, version_symbol)().decode()
    except (OSError, AttributeError) as exc:  # torch's libraries missing, or their symbols changed
        return None, f"{path} cannot be loaded ({exc})"
    running = str(torch.__version__)
    if built_for != running:
        return None, f"{path} was built for torch {built_for}, but torch {running} is running"
    return lib, ""


def load_torch_oom() -> Tuple[Optional[ctypes.CDLL], str]:
    """cudapool._torch_oom loaded if it was built for the running torch, else None and why ("": not built)."""
    path = torch_oom_library_path()
    return (None, "") if path is None else _load_torch_library(path, "cudapool_torch_oom_torch_version")


def load_bridge() -> Tuple[Optional[ctypes.CDLL], str]:
    """cudapool._torch_bridge loaded, if it was built for the running torch and CUDAPOOL_BRIDGE is
    not 0, else None and why ("" when CUDAPOOL_BRIDGE=0 asked for the pluggable path)."""
    if os.environ.get(BRIDGE_ENV, "") == "0":
        return None, ""
    path = torch_bridge_library_path()
    if path is None:
        return (
            None,
            "cudapool._torch_bridge was not built (no CUDA build of torch was importable when cudapool was built)",
        )
    return _load_torch_library(path, "cudapool_bridge_torch_version")


def symbol_address(lib: ctypes.CDLL, name: str) -> int:
    address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    if not address:
        raise RuntimeError(f"cudapool: {lib._name} exports no {name}")
    return address

"""Build of the extension modules: cudapool._C and its test hooks, cudapool._testhooks, and, when torch is
importable at build time, the libraries cudapool._torch_oom and cudapool._torch_bridge.

Each product is built from its own folders under csrc/ (product_sources below).

cudapool._C: every .c / .cpp of the layers base, core, backend, devices and python. C and C++
sources get different flags: setuptools hands every source of an Extension the same extra_compile_args,
so C++ sources are compiled here first with their own flags and linked in as objects.
cudapool._testhooks: csrc/testhooks/ only; it links nothing of the core and calls _C's functions
through a capsule (Note [Test hooks] in csrc/python/hooks_api.h).

cudapool._torch_oom: csrc/torch_oom/ alone, compiled against the installed torch's headers and
linked to its libc10 (rpath: torch/lib). It throws c10::OutOfMemoryError for cudapool_alloc (Note
[Out-of-memory type] in csrc/devices/abi.h), so that torch raises torch.OutOfMemoryError; enable() loads it
with ctypes and installs it only when the running torch is the one it was built for. It is built only when
`import torch` works here: under pip's default build isolation torch is not there, so build with
`pip install --no-build-isolation .` to have it. Without it everything works, and out of memory raises a
RuntimeError. Set CUDAPOOL_TORCH_OOM=0 to skip it. Its build failing is a warning, not an error, unless
warnings are errors (CUDAPOOL_WERROR=1).

cudapool._torch_bridge: csrc/bridge/*.cpp, cudapool as torch's own CUDA allocator (a subclass of
c10::cuda::CUDACachingAllocator::CUDAAllocator, Note [The bridge] in csrc/bridge/bridge.cpp), compiled
against the installed torch's headers (C++20 for torch 2.14's) and the CUDA runtime headers of its nvidia
wheels, linked to its libraries and to cudapool._C (by file name, found beside it: the one copy Python
loaded). Built when a CUDA build of torch is importable here (so also only with --no-build-isolation);
enable() uses it when it was built for the running torch, else falls back to torch's pluggable allocator.
CUDAPOOL_TORCH_BRIDGE=0 skips it; its build failing is a warning unless CUDAPOOL_WERROR=1.

Warnings are errors only when asked (CUDAPOOL_WERROR=1, as the Makefile does): a user's newer
compiler with a new warning must not fail `pip install .`.
"""

import copy
import json
import os
import re
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

C_SUFFIXES = {".c"}
CXX_SUFFIXES = {".cpp", ".cc", ".cxx"}

# Set CUDAPOOL_WERROR=1 to make warnings errors (the project's own builds do).
_WERROR = ["-Werror"] if os.environ.get("CUDAPOOL_WERROR", "") not in ("", "0") else []

C_FLAGS = [
    "-std=c11",
    "-D_POSIX_C_SOURCE=200809L",
    "-Wall",
    "-Wextra",
    "-Wshadow",
    "-Wstrict-prototypes",
    "-Wmissing-prototypes",
    *_WERROR,
    "-O2",
    "-pthread",
]
CXX_FLAGS = ["-std=c++17", "-Wall", "-Wextra", *_WERROR, "-O2", "-pthread"]
LINK_FLAGS = ["-pthread", "-ldl"]


def read_version() -> str:
    """The version from python/cudapool/_version.py, read without importing the package."""
    text = (ROOT / "python" / "cudapool" / "_version.py").read_text(encoding="utf-8")
    match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    if not match:
        raise RuntimeError("python/cudapool/_version.py defines no __version__")
    version = match.group(1)
    header = (ROOT / "csrc" / "core" / "cp.h").read_text(encoding="utf-8")
    c_match = re.search(r'^#define\s+CP_VERSION\s+"([^"]+)"', header, re.MULTILINE)
    if c_match and c_match.group(1) != version:
        raise RuntimeError(
            f"version mismatch: python/cudapool/_version.py says {version}, csrc/core/cp.h says {c_match.group(1)}"
        )
    return version


def rel_glob(*patterns: str) -> list:
    """Files matching the patterns, relative to this directory, sorted."""
    found = set()
    for pattern in patterns:
        found.update(p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern) if p.is_file())
    return sorted(found)


def _compile_in_parallel(compiler, sources, output_dir, macros, include_dirs, debug, extra_postargs, depends):
    """CCompiler.compile with one source per core at a time (the C++ built against torch's
    headers takes most of an install: on 2 cores, about half as long)."""
    from concurrent.futures import ThreadPoolExecutor

    macros, objects, extra, pp_opts, build = compiler._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs
    )
    cc_args = compiler._get_cc_args(pp_opts, debug, None)

    def one(obj):
        if obj in build:
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra, pp_opts)

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        list(pool.map(one, objects))
    return objects


class BuildExt(build_ext):
    """Compile C and C++ sources of one extension with per-language flags, a source per core."""

    def build_extensions(self):
        original = self.compiler.compile

        def compile_parallel(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                             extra_preargs=None, extra_postargs=None, depends=None):  # fmt: skip
            if extra_preargs or len(sources) < 2:
                return original(
                    sources, output_dir, macros, include_dirs, debug, extra_preargs, extra_postargs, depends
                )
            return _compile_in_parallel(
                self.compiler, sources, output_dir, macros, include_dirs, debug, extra_postargs, depends
            )

        self.compiler.compile = compile_parallel
        try:
            super().build_extensions()
        finally:
            self.compiler.compile = original

    def build_extension(self, ext):
        links_to = getattr(ext, "links_to", ())
        if links_to:
            # Linked to the built cudapool._C (and others of ours) by file name, found beside it at run
            # time ($ORIGIN): the loader then maps the one copy Python has loaded (same file), not a second.
            ext = copy.copy(ext)
            ext.extra_link_args = list(ext.extra_link_args or [])
            for name in links_to:
                path = Path(self.get_ext_fullpath(name))
                ext.extra_link_args += [f"-L{path.parent}", f"-l:{path.name}"]
        cxx_sources = [s for s in ext.sources if Path(s).suffix in CXX_SUFFIXES]
        if not cxx_sources:
            return super().build_extension(ext)

        cxx_flags = CXX_FLAGS + list(getattr(ext, "cxx_flags", []))
        macros = list(ext.define_macros or [])
        macros.extend((name,) for name in (ext.undef_macros or []))
        cxx_objects = self.compiler.compile(
            cxx_sources,
            output_dir=self.build_temp,
            macros=macros,
            include_dirs=ext.include_dirs,
            debug=self.debug,
            extra_postargs=cxx_flags,
            depends=ext.depends,
        )
        c_ext = copy.copy(ext)
        c_ext.sources = [s for s in ext.sources if Path(s).suffix not in CXX_SUFFIXES]
        c_ext.extra_objects = list(ext.extra_objects or []) + cxx_objects
        # setuptools links only when a source or a dependency is newer than the library: an
        # extension of C++ alone has no C source left, so its objects are what must be compared.
        c_ext.depends = list(ext.depends or []) + cxx_objects
        c_ext.language = "c++"  # link with the C++ driver so libstdc++ comes along
        return super().build_extension(c_ext)


def product_sources(*folders: str) -> list:
    """The C and C++ sources of the folders under csrc/ that make one built product."""
    suffixes = sorted(C_SUFFIXES | CXX_SUFFIXES)
    return rel_glob(*(f"csrc/{folder}/*{suffix}" for folder in folders for suffix in suffixes))


# One folder (or, for _C, the layers it is made of) per built product: docs/design.md, "Repository layout".
SOURCES = product_sources("base", "core", "backend", "devices", "python")  # cudapool._C
TESTHOOKS_SOURCES = product_sources("testhooks")  # cudapool._testhooks
TORCH_OOM_SOURCES = product_sources("torch_oom")  # cudapool._torch_oom, against torch
BRIDGE_SOURCES = product_sources("bridge")  # cudapool._torch_bridge, against torch, linked to _C
BRIDGE_TESTHOOKS_SOURCES = product_sources("bridge_testhooks")  # its test entry points, linked to both
FAKECUDA_SOURCES = product_sources("fakecuda")  # cudapool._torch_fakecuda, against torch and its bindings
HEADERS = rel_glob("csrc/**/*.h", "csrc/**/*.hpp")


def _torch_build_info():
    """(torch module, its include dir, its lib dir, the C++ ABI flag) when torch with its C++ headers
    and libc10 is importable here, else None."""
    try:
        import torch
    except Exception:  # not installed, or broken: build without it
        return None
    root = Path(torch.__file__).resolve().parent
    include, lib = root / "include", root / "lib"
    if not (include / "c10" / "util" / "Exception.h").is_file() or not list(lib.glob("libc10.*")):
        return None
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    return torch, include, lib, abi


def _cuda_runtime_dirs(torch_root: Path):
    """(include dirs, lib dir, library file name) of the CUDA runtime the installed torch uses: its
    nvidia wheel's (site-packages/nvidia/cu*/), else CUDA_HOME's or /usr/local/cuda's; None when
    there is none. The wheel's headers need the toolkit's crt/ headers, which the wheel lacks:
    they come from the same folder when it has them, else from triton's copy (a dependency of
    torch's CUDA builds), else from a toolkit."""
    site = torch_root.parent
    toolkits = [Path(os.environ[env]) for env in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(env)]
    toolkits.append(Path("/usr/local/cuda"))
    candidates = sorted(site.glob("nvidia/cu*/")) + sorted(site.glob("nvidia/cuda_runtime/")) + toolkits
    crt_dirs = [base / "include" for base in toolkits] + [site / "triton" / "backends" / "nvidia" / "include"]
    for base in candidates:
        include = base / "include"
        if not (include / "cuda_runtime_api.h").is_file():
            continue
        for libdir in (base / "lib", base / "lib64"):
            libs = sorted(libdir.glob("libcudart.so*"))
            if not libs:
                continue
            includes = [include]
            if not (include / "crt" / "host_defines.h").is_file():
                crt = [d for d in crt_dirs if (d / "crt" / "host_defines.h").is_file()]
                if not crt:
                    return None
                includes.append(crt[0])
            return includes, libdir, libs[-1].name
    return None


def _against_torch(name: str, sources: list, torch, abi: int, lib_dirs: list, libraries: list, **kw) -> Extension:
    """An extension built against the installed torch (its version and C++ ABI defined), linked to
    ``libraries`` found in ``lib_dirs`` (also its run-time search path); optional unless warnings
    are errors."""
    return Extension(
        name,
        sources=sources,
        include_dirs=["csrc"],
        depends=HEADERS,
        define_macros=[
            ("CUDAPOOL_TORCH_VERSION", json.dumps(str(torch.__version__))),
            ("_GLIBCXX_USE_CXX11_ABI", str(abi)),
        ],
        library_dirs=[str(d) for d in lib_dirs],
        libraries=libraries,
        runtime_library_dirs=kw.pop("runtime_library_dirs", [str(d) for d in lib_dirs]),
        extra_link_args=kw.pop("extra_link_args", ["-pthread"]),
        language="c++",
        optional=not _WERROR,
        **kw,
    )


def torch_bridge_extension() -> list:
    """cudapool._torch_bridge (csrc/bridge/bridge.cpp: cudapool as torch's own CUDA allocator) when a
    CUDA build of torch with its headers, and the CUDA runtime headers, are here; else nothing.
    CUDAPOOL_TORCH_BRIDGE=0 skips it."""
    if os.environ.get("CUDAPOOL_TORCH_BRIDGE", "") == "0":
        return []
    info = _torch_build_info()
    if info is None:
        return []
    torch, include, lib, abi = info
    if not (include / "c10" / "cuda" / "CUDACachingAllocator.h").is_file() or not list(lib.glob("libtorch_cuda.*")):
        return []
    cuda = _cuda_runtime_dirs(Path(torch.__file__).resolve().parent)
    if cuda is None:
        return []
    cuda_includes, cuda_lib, cudart = cuda
    ext = _against_torch(
        "cudapool._torch_bridge",
        BRIDGE_SOURCES,
        torch,
        abi,
        [lib, cuda_lib],
        ["c10", "c10_cuda", "torch_cuda", "torch_cpu", "torch"],
        runtime_library_dirs=[str(lib), str(cuda_lib), "$ORIGIN"],
        extra_link_args=["-pthread", f"-l:{cudart}"],
    )
    # torch's and CUDA's headers: their warnings are not ours.
    # torch's headers of 2.14 need C++20 (std::strong_ordering); older ones build with it too.
    ext.cxx_flags = ["-std=c++20"]
    for folder in (include, include / "torch" / "csrc" / "api" / "include", *cuda_includes):
        ext.cxx_flags += ["-isystem", str(folder)]
    ext.links_to = ("cudapool._C",)  # (BuildExt), for the pools
    # The bridge's test entry points (tests/test_torch_bridge.py): a library of their own, never
    # part of the bridge users load.
    hooks = copy.copy(ext)
    hooks.name = "cudapool._torch_bridge_testhooks"
    hooks.sources = BRIDGE_TESTHOOKS_SOURCES
    hooks.links_to = ("cudapool._C", "cudapool._torch_bridge")
    return [ext, hooks]


def torch_fakecuda_extension() -> list:
    """cudapool._torch_fakecuda (csrc/fakecuda/*.cpp: the fake GPU of ab --simulate below Python)
    when a CUDA build of torch with its C++ headers is importable here; else nothing (ab --simulate
    then traces with torch's fake tensors). CUDAPOOL_TORCH_FAKECUDA=0 skips it."""
    if os.environ.get("CUDAPOOL_TORCH_FAKECUDA", "") == "0":
        return []
    info = _torch_build_info()
    if info is None:
        return []
    torch, include, lib, abi = info
    if not getattr(torch.version, "cuda", None) or not (include / "torch" / "csrc" / "jit" / "python").is_dir():
        return []
    if not list(lib.glob("libtorch_cuda.*")):
        return []
    ext = _against_torch(
        "cudapool._torch_fakecuda",
        FAKECUDA_SOURCES,
        torch,
        abi,
        [lib],
        ["c10", "torch_cpu", "torch_cuda", "torch", "torch_python"],
    )
    ext.cxx_flags = ["-std=c++20", "-fvisibility=hidden"]
    for folder in (include, include / "torch" / "csrc" / "api" / "include"):
        ext.cxx_flags += ["-isystem", str(folder)]
    return [ext]


def torch_oom_extension() -> list:
    """cudapool._torch_oom when torch (with its C++ headers and libc10) is importable here, else nothing."""
    if os.environ.get("CUDAPOOL_TORCH_OOM", "") == "0":
        return []
    info = _torch_build_info()
    if info is None:
        return []
    torch, include, lib, abi = info
    ext = _against_torch("cudapool._torch_oom", TORCH_OOM_SOURCES, torch, abi, [lib], ["c10"])
    ext.cxx_flags = ["-isystem", str(include)]  # torch's headers: their warnings are not ours
    return [ext]


setup(
    version=read_version(),
    ext_modules=[
        Extension(
            "cudapool._C",
            sources=SOURCES,
            include_dirs=["csrc"],
            depends=HEADERS,
            extra_compile_args=C_FLAGS,
            extra_link_args=LINK_FLAGS,
            language="c",
        ),
        Extension(
            "cudapool._testhooks",
            sources=TESTHOOKS_SOURCES,
            include_dirs=["csrc"],
            depends=HEADERS,
            extra_compile_args=C_FLAGS,
            language="c",
        ),
        *torch_oom_extension(),
        *torch_bridge_extension(),
        *torch_fakecuda_extension(),
    ],
    cmdclass={"build_ext": BuildExt},
)

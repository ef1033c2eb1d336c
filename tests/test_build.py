"""setup.py without torch: the build of a fresh machine (or of pip's isolated build
environment) makes _C and _testhooks only, and they serve allocations; out of memory is then
the std::exception torch turns into RuntimeError. torch is hidden from the build and from the
scenario by a None entry in sys.modules (``import torch`` raises ImportError)."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300

NO_TORCH = "import sys\nsys.modules['torch'] = None\n"


def test_setup_py_without_torch_builds_a_working_package_without_the_thrower(tmp_path: Path) -> None:
    build_lib, build_temp = tmp_path / "lib", tmp_path / "temp"
    code = NO_TORCH + textwrap.dedent(
        f"""
        import runpy
        sys.argv = ["setup.py", "-q", "build_ext", "--build-lib", {str(build_lib)!r}, "--build-temp", {str(build_temp)!r}]
        runpy.run_path("setup.py", run_name="__main__")
        """
    )
    env_proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert env_proc.returncode == 0, env_proc.stdout + env_proc.stderr
    built = sorted(p.name.split(".")[0] for p in (build_lib / "cudapool").iterdir())
    assert built == ["_C", "_testhooks"], built

    package = tmp_path / "pkg" / "cudapool"
    shutil.copytree(ROOT / "python" / "cudapool", package, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for so in (build_lib / "cudapool").iterdir():
        shutil.copy(so, package / so.name)
    scenario = NO_TORCH + textwrap.dedent(
        """
        import cudapool
        from cudapool import _C, _testhooks, _torch, _torch_libraries
        assert _C.__file__.startswith(sys.argv[1]), _C.__file__
        assert _torch_libraries.torch_oom_library_path() is None
        _C.use_sim_devices(64 << 20)
        ptr, status, msg = _testhooks.alloc_catching(1 << 20, 0, 0)
        assert status == 0 and ptr, (status, msg)
        ptr, status, msg = _testhooks.alloc_catching(100 << 20, 0, 0)
        assert status == 1 and msg.startswith("CUDA out of memory. Tried to allocate"), (status, msg)
        print("OK")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", scenario, str(package)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={"PYTHONPATH": str(tmp_path / "pkg"), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr

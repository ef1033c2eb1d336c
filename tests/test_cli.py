"""The command line: python -m cudapool run / info."""

import os
import subprocess
import sys
import textwrap

import cudapool
import pytest

TIMEOUT_S = 120


def cli(*args, env=None, cwd=None):
    environ = dict(os.environ)
    environ.pop("CUDAPOOL_CONF", None)
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "cudapool", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=environ,
        cwd=cwd,
    )


def _torch_cuda_build():
    try:
        import torch
    except Exception:
        return False
    return hasattr(torch._C, "_cuda_customAllocator")


needs_torch_cuda_build = pytest.mark.skipif(
    not _torch_cuda_build(), reason="run needs a CUDA build of torch (enable() swaps its allocator)"
)


def test_no_command_prints_help():
    proc = cli()
    assert proc.returncode == 0
    assert "run" in proc.stdout and "info" in proc.stdout and "usage" in proc.stdout.lower()


def test_info_prints_version_configuration_and_driver_status():
    proc = cli("info", env={"CUDAPOOL_CONF": "max_split_size_mb:64"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"cudapool {cudapool.__version__}" in out
    assert "CUDAPOOL_CONF='max_split_size_mb:64'" in out and "max_split_size_mb:64" in out
    assert "CUDA driver:" in out
    from cudapool import _C

    info = _C.cuda_info()
    if info["available"]:
        assert "CUDA driver: available" in out
    else:
        assert f"CUDA driver: not available ({info['error']})" in out
    if _torch_cuda_build():
        assert "CUDA build" in out
        path = next(x for x in out.splitlines() if x.startswith("allocator path of cudapool.enable(): "))
        # the pluggable allocator's hooks are listed only where enable() takes that path
        pluggable = path.split(": ", 1)[1].startswith("pluggable")
        assert ("pluggable allocator hooks offered:" in out) == pluggable, out
        from cudapool._torch_libraries import BRIDGE_ENV

        asked = cli("info", env={BRIDGE_ENV: "0"}).stdout
        assert "allocator path of cudapool.enable(): pluggable" in asked
        assert "pluggable allocator hooks offered:" in asked and "record_stream" in asked


def test_info_with_defaults_never_initialises_cuda():
    proc = cli("info")
    assert proc.returncode == 0, proc.stderr
    assert "configuration (the default policy):" in proc.stdout
    assert "release_before_grow:True" in proc.stdout  # the cudapool policy


def test_info_with_a_bad_key_names_it_and_exits_2():
    proc = cli("info", env={"CUDAPOOL_CONF": "bogus_key:1"})
    assert proc.returncode == 2
    assert "bogus_key" in proc.stdout and "INVALID" in proc.stdout


SCRIPT = """
import ctypes, sys
from cudapool import _C

# a pool on a simulated device, allocated through the entry point torch calls
_C.use_sim_devices(64 << 20)
lib = ctypes.CDLL(_C.__file__)
lib.cudapool_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.cudapool_alloc.restype = ctypes.c_void_p
assert lib.cudapool_alloc(3 << 20, 0, None)
import cudapool
assert cudapool.enabled()
cudapool.enable()                      # a no-op under `run`
print("argv:", sys.argv)
print("path0:", sys.path[0])
print("name:", __name__)
sys.exit(3)
"""


@needs_torch_cuda_build
def test_run_passes_argv_propagates_the_exit_code_and_prints_the_summary(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = cli("run", str(script), "--epochs", "2", "x")
    assert proc.returncode == 3, proc.stderr
    assert f"argv: [{str(script)!r}, '--epochs', '2', 'x']" in proc.stdout
    assert f"path0: {tmp_path}" in proc.stdout
    assert "name: __main__" in proc.stdout
    assert "cudapool CUDA memory summary, device ID 0" in proc.stderr
    assert "Allocated memory" in proc.stderr and "3072 KiB" in proc.stderr


@needs_torch_cuda_build
def test_run_reports_a_failing_script_and_still_summarises(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("raise KeyError('boom')\n")
    proc = cli("run", str(script))
    assert proc.returncode == 1
    assert "KeyError: 'boom'" in proc.stderr
    assert "no device pool was created" in proc.stderr


@needs_torch_cuda_build
def test_run_exit_0_when_the_script_ends(tmp_path):
    script = tmp_path / "fine.py"
    script.write_text("print('done')\n")
    proc = cli("run", str(script))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"


def test_run_missing_script_exits_2(tmp_path):
    proc = cli("run", str(tmp_path / "nope.py"))
    assert proc.returncode == 2
    assert "nope.py" in proc.stderr and "no such file" in proc.stderr


def test_run_config_error_exits_2_naming_the_key(tmp_path):
    script = tmp_path / "fine.py"
    script.write_text("print('never')\n")
    proc = cli("run", str(script), env={"CUDAPOOL_CONF": "max_split_size_mb:64,bogus_key:1"})
    assert proc.returncode == 2
    assert "bogus_key" in proc.stderr and "never" not in proc.stdout


def test_run_without_a_script_is_a_usage_error():
    proc = cli("run")
    assert proc.returncode == 2
    assert "SCRIPT" in proc.stderr

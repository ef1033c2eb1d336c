"""cudapool as torch's CUDA allocator: enable(), the hooks, the swap, and torch's statistics
functions answering from the pool.

The allocator swap is once per process, so every scenario runs in its own interpreter
(``sys.executable -c ...``). Without a GPU, torch still builds the pluggable allocator from
our .so and swaps it in; the first CUDA tensor then fails with torch's own no-driver error.
Pools on simulated devices (``_C.use_sim_devices`` before the first allocation) let the
torch-facing statistics be checked with real allocations made through the exported entry
points torch calls. Tests marked ``gpu`` need a CUDA GPU and are skipped without one.
"""

import itertools
import os
import re
import subprocess
import sys
import textwrap

import pytest
from scenario import expect_ok, run_python

torch = pytest.importorskip("torch", reason="torch is not installed")
if not hasattr(torch._C, "_cuda_customAllocator"):
    pytest.skip(f"torch {torch.__version__} is a CPU-only build (no CUDAPluggableAllocator)", allow_module_level=True)

import cudapool  # noqa: E402
from cudapool import _C, _torch_libraries, _torch_stats  # noqa: E402

TIMEOUT_S = 120


def _gpu_available() -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], timeout=TIMEOUT_S).returncode == 0
    except subprocess.TimeoutExpired:
        return False


HAS_GPU = _gpu_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
needs_no_gpu = pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a GPU")

# Common head of every scenario: names the scenarios use, nothing swapped yet.
PRELUDE = """
import ctypes, sys, warnings
import torch
import cudapool
from cudapool import _C, _testhooks, _torch, _torch_libraries, _torch_stats
MiB = 1 << 20
"""


# These are the tests of the pluggable path (torch's CUDAPluggableAllocator, with cudapool's
# patches of torch's Python functions), which enable() falls back to when the bridge cannot be
# used; tests/test_torch_bridge.py tests the bridge.
FALLBACK_ENV = {"CUDAPOOL_BRIDGE": "0"}


def run_py(code: str, env: dict = None) -> subprocess.CompletedProcess:
    """Run PRELUDE + code in a fresh interpreter on the pluggable path; CUDAPOOL_CONF unset unless
    ``env`` sets it."""
    return run_python(PRELUDE + textwrap.dedent(code), timeout=TIMEOUT_S, env={**FALLBACK_ENV, **(env or {})})


def ok(code: str, env: dict = None) -> str:
    """Run a scenario that must end by printing OK and exit 0; its stdout."""
    return expect_ok(run_py(code, env))


# -- the package without torch ------------------------------------------------------------------


def test_importing_cudapool_does_not_import_torch():
    code = (
        "import sys, cudapool, cudapool.sim, cudapool.summary\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert not cudapool.enabled()\n"
        "print(cudapool.memory_stats(0)['allocated_bytes.all.current'], cudapool.memory_allocated())\n"
        "assert 'torch' not in sys.modules\nprint('OK')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0 and proc.stdout.split() == ["0", "0", "OK"], proc.stderr


# -- enable(): the swap -------------------------------------------------------------------------


def test_enable_swaps_in_our_allocator_with_every_hook():
    ok(
        """
        assert not cudapool.enabled() and _torch.hooks_set() == ()
        before = torch.cuda.memory.memory_stats
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cudapool.enable()
        assert not caught, [str(w.message) for w in caught]
        assert cudapool.enabled()
        hooks = set(_torch.hooks_set())
        offered = set(_torch.torch_hooks_offered())
        ours = {"init", "reset", "memory_fraction", "record_stream", "base_alloc",
                "begin_allocate_to_pool", "end_allocate_to_pool", "release_pool"}
        assert hooks == offered & ours, (hooks, offered)
        if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 14):
            assert hooks == ours, hooks
        ours = _torch._state.allocator
        assert type(ours) is torch.cuda.memory.CUDAPluggableAllocator
        if hasattr(torch.cuda.memory, "_get_current_allocator"):
            current = torch.cuda.memory._get_current_allocator()
            assert current.allocator() is ours.allocator(), "torch's current allocator is not ours"
        # torch's statistics functions now answer from cudapool
        assert torch.cuda.memory.memory_stats is _torch_stats.memory_stats is torch.cuda.memory_stats
        assert torch.cuda.memory_summary is _torch_stats.memory_summary
        assert before is not torch.cuda.memory.memory_stats
        assert not torch.cuda.is_initialized()
        print("OK")
        """
    )


def test_missing_record_stream_hook_warns_once():
    # An older torch without set_record_stream_fn, simulated by asking for a setter that
    # does not exist.
    ok(
        """
        _torch._HOOKS = tuple(
            (n, s + "_absent" if n == "record_stream" else s, sym) for n, s, sym in _torch._HOOKS
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cudapool.enable()
            cudapool.enable()
        assert "record_stream" not in _torch.hooks_set(), _torch.hooks_set()
        assert "reset" in _torch.hooks_set()
        relevant = [w for w in caught if "record_stream" in str(w.message)]
        assert len(relevant) == 1 and issubclass(relevant[0].category, RuntimeWarning), caught
        assert cudapool.enabled()
        print("OK")
        """
    )


def test_cudnn_benchmark_on_at_enable_warns():
    ok(
        """
        torch.backends.cudnn.benchmark = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cudapool.enable()
        assert any("cacheInfo" in str(w.message) for w in caught), [str(w.message) for w in caught]
        print("OK")
        """
    )


def test_one_copy_of_the_library_serves_python_and_torch():
    # CUDAPluggableAllocator dlopens _C.__file__: the loader must return the loaded module.
    ok(
        """
        cudapool.enable()
        maps = open("/proc/self/maps").read().splitlines()
        path = _C.__file__
        import os
        real = os.path.realpath(path)
        lines = [l for l in maps if l.endswith(real)]
        assert lines, "the extension is not mapped"
        inodes = {l.split()[4] for l in lines}
        assert len(inodes) == 1, lines
        # one mapping of file offset 0: loaded once
        assert sum(1 for l in lines if int(l.split()[2], 16) == 0) == 1, lines
        print("OK")
        """
    )


@needs_no_gpu
def test_first_cuda_tensor_raises_torchs_no_gpu_error_and_the_process_survives():
    out = ok(
        """
        cudapool.enable()
        try:
            torch.empty(1, device="cuda")
        except RuntimeError as exc:
            print("ERROR:", exc)
        else:
            raise AssertionError("a CUDA tensor without a GPU")
        assert cudapool.enabled()
        assert torch.cuda.memory_allocated(0) == 0
        print("OK")
        """
    )
    message = out.split("ERROR:", 1)[1]
    assert re.search(r"Found no NVIDIA driver|No CUDA GPUs are available", message), message
    assert "cudapool" not in message, "the error should be torch's, not ours"


def test_torch_statistics_answer_from_the_pool_after_enable():
    out = ok(
        """
        assert torch.cuda.memory_stats(0) == {}   # before: torch's, which has nothing yet
        cudapool.enable()
        s = torch.cuda.memory_stats(0)
        assert s == cudapool.memory_stats(0) and len(s) > 50
        assert list(s) == sorted(s)
        assert all(v == 0 for k, v in s.items() if k != "max_split_size"), s
        assert s["max_split_size"] == -1  # the cudapool policy leaves it unlimited
        for fn in (torch.cuda.memory_allocated, torch.cuda.memory_reserved,
                   torch.cuda.max_memory_allocated, torch.cuda.max_memory_reserved):
            assert fn(0) == 0 and fn() == 0 and fn("cuda:0") == 0 and fn(torch.device("cuda", 0)) == 0
        assert torch.cuda.memory_stats() == torch.cuda.memory_stats(torch.device("cuda")) == s
        nested = torch.cuda.memory_stats_as_nested_dict(0)
        assert nested["allocated_bytes"]["large_pool"]["peak"] == 0
        assert nested["oversize_segments"]["freed"] == 0 and nested["num_ooms"] == 0
        torch.cuda.reset_peak_memory_stats(0)
        torch.cuda.reset_accumulated_memory_stats(0)
        torch.cuda.memory.reset_peak_memory_stats()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.reset_max_memory_allocated(0)
            torch.cuda.reset_max_memory_cached(0)
            assert torch.cuda.memory_cached(0) == 0 and torch.cuda.max_memory_cached(0) == 0
        assert sum(issubclass(w.category, FutureWarning) for w in caught) >= 4, caught
        try:
            torch.cuda.memory_stats("cpu")
        except ValueError:
            pass
        else:
            raise AssertionError("a CPU device was accepted")
        torch.cuda.empty_cache()   # through the reset hook once CUDA is up; harmless before
        cudapool.empty_cache()
        print(torch.cuda.memory_summary(0))
        print(torch.cuda.memory_summary(abbreviated=True))
        print("OK")
        """
    )
    assert "cudapool CUDA memory summary, device ID 0" in out
    assert "PyTorch CUDA memory summary" not in out
    assert "Allocated memory" in out and "from large pool" in out


# -- enable(): configuration and refusals ---------------------------------------------------


def test_enable_twice_is_a_noop():
    ok(
        """
        cudapool.enable()
        allocator = _torch._state.allocator
        cudapool.enable()
        cudapool.enable(**{})
        assert _torch._state.allocator is allocator and cudapool.enabled()
        print("OK")
        """
    )


def test_enable_again_with_the_same_config_is_a_noop_and_a_different_one_is_refused():
    ok(
        """
        cudapool.enable(max_split_size_mb=64)
        cudapool.enable(max_split_size_mb=64)
        cudapool.enable(max_split_size_mb="64")        # same effective configuration
        cudapool.enable()                              # no configuration: no-op
        try:
            cudapool.enable(max_split_size_mb=128)
        except RuntimeError as exc:
            msg = str(exc)
            assert "already enabled" in msg and "max_split_size_mb:64" in msg, msg
            assert "cannot be reconfigured" in msg, msg
        else:
            raise AssertionError("reconfigured")
        assert "max_split_size_mb:64" in _C.device_config()
        print("OK")
        """
    )


def test_bad_keyword_is_a_value_error_and_nothing_is_swapped():
    ok(
        """
        try:
            cudapool.enable(bogus_key=1)
        except ValueError as exc:
            assert "bogus_key" in str(exc), exc
        else:
            raise AssertionError("accepted bogus_key")
        assert not cudapool.enabled()
        assert torch.cuda.memory.memory_stats.__module__ == "torch.cuda.memory"
        # nothing was swapped: torch still accepts a swap (a second one would be refused)
        cudapool.enable()
        assert cudapool.enabled()
        print("OK")
        """
    )


def test_bad_value_is_named():
    ok(
        """
        try:
            cudapool.enable(garbage_collection_threshold=2)
        except ValueError as exc:
            assert "garbage_collection_threshold" in str(exc), exc
        else:
            raise AssertionError("accepted")
        assert not cudapool.enabled()
        print("OK")
        """
    )


def test_bad_key_in_cudapool_conf_is_a_value_error():
    ok(
        """
        try:
            cudapool.enable()
        except ValueError as exc:
            assert "no_such_key" in str(exc) and "CUDAPOOL_CONF" in str(exc), exc
        else:
            raise AssertionError("accepted CUDAPOOL_CONF")
        assert not cudapool.enabled()
        print("OK")
        """,
        env={"CUDAPOOL_CONF": "max_split_size_mb:64,no_such_key:1"},
    )


def test_keywords_win_over_cudapool_conf_per_key():
    ok(
        """
        # the environment's bad max_split_size_mb is replaced, so it is never parsed
        cudapool.enable(max_split_size_mb=128)
        cfg = _C.device_config()
        assert "max_split_size_mb:128" in cfg and "garbage_collection_threshold:0.5" in cfg, cfg
        assert "roundup_power2_divisions:[256:1,512:2,>:4]" in cfg, cfg
        assert _torch.enabled_config() == cfg
        print("OK")
        """,
        env={
            "CUDAPOOL_CONF": "max_split_size_mb:abc,garbage_collection_threshold:0.5,"
            "roundup_power2_divisions:[256:1,512:2,>:4]"
        },
    )


def test_enable_after_cuda_initialised_is_refused_with_advice():
    ok(
        """
        torch.cuda.is_initialized = lambda: True
        try:
            cudapool.enable()
        except RuntimeError as exc:
            msg = str(exc)
            assert "before the first CUDA use" in msg, msg
            assert "top of the script" in msg, msg
        else:
            raise AssertionError("enabled after CUDA initialisation")
        assert not cudapool.enabled()
        assert torch.cuda.memory.memory_stats.__module__ == "torch.cuda.memory"
        print("OK")
        """
    )


def test_torchs_cant_swap_error_becomes_the_same_advice():
    # Another allocator already installed: torch itself refuses the swap.
    ok(
        """
        other = torch.cuda.memory.CUDAPluggableAllocator(_C.__file__, "cudapool_alloc", "cudapool_free")
        torch.cuda.memory.change_current_allocator(other)
        try:
            cudapool.enable()
        except RuntimeError as exc:
            assert "before the first CUDA use" in str(exc), exc
            assert "Can't swap an already initialized allocator" in str(exc.__cause__), exc.__cause__
        else:
            raise AssertionError("swapped over an initialised allocator")
        assert not cudapool.enabled()
        print("OK")
        """
    )


# -- torch-facing paths on simulated devices ------------------------------------------------

# The scenarios count segments and offsets of plain segments: they run the builtin policy's
# rules (test_sim_default_policy_through_the_entry_points runs cudapool's own).
SIM_PRELUDE = """
_C.use_sim_devices(64 * MiB, count=2)
cudapool.enable(policy=POLICY)
lib = ctypes.CDLL(_C.__file__)
lib.cudapool_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.cudapool_alloc.restype = ctypes.c_void_p
lib.cudapool_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.cudapool_free.restype = None
lib.cudapool_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
lib.cudapool_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
"""


def sim(code: str, head: str = "", policy: str = "builtin") -> str:
    """A scenario on two simulated 64 MiB devices, cudapool enabled with ``policy``, ``lib`` =
    our .so (then ``head``, unindented)."""
    return SIM_PRELUDE.replace("POLICY", repr(policy)) + head + textwrap.dedent(code)


def test_sim_default_policy_through_the_entry_points():
    """cudapool's own policy on simulated devices with page-mapped memory: one range per
    stream serves both sizes, reserved bytes are mapped pages, scattered free pages serve a
    large request without new memory, empty_cache gives everything back."""
    out = ok(
        sim(
            """
        a = lib.cudapool_alloc(1000, 0, None)
        b = lib.cudapool_alloc(3 * MiB, 0, None)
        assert "page_stitching:True" in _C.device_pool(0).config()
        assert b == a + 1024                                   # the same range
        s = torch.cuda.memory_stats(0)
        assert s["allocation.large_pool.current"] == 2 and s["allocation.small_pool.current"] == 0
        assert torch.cuda.memory_reserved(0) == 4 * MiB        # two pages mapped
        lib.cudapool_free(a, 1000, 0, None)
        lib.cudapool_free(b, 3 * MiB, 0, None)
        holes = []
        keep = []
        for _ in range(4):
            holes.append(lib.cudapool_alloc(4 * MiB, 0, None))
            keep.append(lib.cudapool_alloc(4 * MiB, 0, None))
        for h in holes:
            lib.cudapool_free(h, 4 * MiB, 0, None)
        before = torch.cuda.memory_reserved(0)
        big = lib.cudapool_alloc(16 * MiB, 0, None)            # four holes, stitched
        assert big and torch.cuda.memory_reserved(0) == before
        info = _C.device_pool(0).info()
        assert info["stitches"] == 1 and info["stitched_ranges"] == 1
        lib.cudapool_free(big, 16 * MiB, 0, None)
        for p in keep:
            lib.cudapool_free(p, 4 * MiB, 0, None)
        cudapool.empty_cache()   # torch.cuda.empty_cache needs CUDA up
        assert torch.cuda.memory_reserved(0) == 0 and _C.device_pool(0).info()["stitched_ranges"] == 0
        print("OK")
        """,
            policy="cudapool",
        )
    )
    assert out.rstrip().endswith("OK")


def test_sim_allocations_through_the_entry_points_show_in_torchs_functions():
    out = ok(
        sim(
            """
        assert _C.using_sim_devices()
        a = lib.cudapool_alloc(1000, 0, None)
        b = lib.cudapool_alloc(3 * MiB, 0, None)
        assert a and b and a % 512 == 0
        assert _C.device_pools() == [0]
        s = torch.cuda.memory_stats(0)
        assert s == cudapool.memory_stats(0)
        assert s["allocated_bytes.all.current"] == 1024 + 3 * MiB
        assert s["allocation.small_pool.current"] == 1 and s["allocation.large_pool.current"] == 1
        assert torch.cuda.memory_allocated(0) == cudapool.memory_allocated(0) == 1024 + 3 * MiB
        assert torch.cuda.memory_reserved() == 2 * MiB + 20 * MiB
        assert torch.cuda.memory.memory_stats_as_nested_dict(0)["allocated_bytes"]["all"]["current"] == 1024 + 3 * MiB
        print(torch.cuda.memory_summary(0))
        lib.cudapool_free(b, 3 * MiB, 0, None)
        assert torch.cuda.max_memory_allocated(0) == 1024 + 3 * MiB
        torch.cuda.reset_peak_memory_stats(0)
        assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0) == 1024
        # the second device has its own pool
        c = lib.cudapool_alloc(5 * MiB, 1, None)
        assert torch.cuda.memory_allocated("cuda:1") == 5 * MiB
        assert torch.cuda.memory_allocated(torch.device("cuda", 1)) == 5 * MiB
        assert torch.cuda.memory_allocated(0) == 1024
        lib.cudapool_free(c, 5 * MiB, 1, None)
        # record_stream through the exported hook, then free: reuse waits for stream 7
        lib.cudapool_record_stream(a, 7)
        lib.cudapool_free(a, 1000, 0, None)
        assert torch.cuda.memory_allocated(0) == 0
        # empty_cache through the reset hook torch calls
        lib.cudapool_empty_cache()
        assert torch.cuda.memory_reserved(0) == 0 and cudapool.memory_reserved(1) == 0
        assert _C.device_pool(0).check() == 0 and _C.device_pool(1).check() == 0
        print("OK")
        """
        )
    )
    assert "cudapool CUDA memory summary, device ID 0" in out
    assert re.search(r"Allocated memory\s+\|\s+3073 KiB", out), out


def test_sim_oom_through_the_entry_point_then_a_fitting_allocation():
    ok(
        sim(
            """
        a = lib.cudapool_alloc(30 * MiB, 0, None)
        ptr, status, msg = _testhooks.alloc_catching(40 * MiB, 0, 0)
        assert status == 1 and ptr == 0, (status, msg)     # CP_ERR_OOM
        assert msg.startswith("CUDA out of memory. Tried to allocate"), msg
        s = torch.cuda.memory_stats(0)
        assert s["num_ooms"] == 1 and s["num_alloc_retries"] >= 1, s
        ptr, status, msg = _testhooks.alloc_catching(20 * MiB, 0, 0)
        assert status == 0 and ptr != 0 and msg == "", (status, msg)
        assert torch.cuda.memory_allocated(0) == 50 * MiB
        lib.cudapool_free(ptr, 20 * MiB, 0, None)
        lib.cudapool_free(a, 30 * MiB, 0, None)
        torch.cuda.reset_accumulated_memory_stats(0)
        assert torch.cuda.memory_stats(0)["num_ooms"] == 0
        print("OK")
        """
        )
    )


def test_sim_memory_fraction_hook_caps_the_pool():
    ok(
        sim(
            """
        lib.cudapool_set_memory_fraction(0.5, 0)         # what set_per_process_memory_fraction calls
        ptr, status, msg = _testhooks.alloc_catching(40 * MiB, 0, 0)
        assert status == 1 and msg.startswith("CUDA out of memory."), (status, msg)
        ptr, status, msg = _testhooks.alloc_catching(30 * MiB, 0, 0)
        assert status == 0, msg
        lib.cudapool_free(ptr, 30 * MiB, 0, None)
        print("OK")
        """
        )
    )


def test_sim_memory_fraction_zero_forbids_growth_and_get_fraction_answers():
    ok(
        sim(
            """
        # torch.cuda.get_per_process_memory_fraction answers from cudapool (no CUDA init)
        assert torch.cuda.get_per_process_memory_fraction is _torch_stats.get_per_process_memory_fraction
        assert torch.cuda.memory.get_per_process_memory_fraction is _torch_stats.get_per_process_memory_fraction
        assert torch.cuda.get_per_process_memory_fraction() == 1.0 and not torch.cuda.is_initialized()
        keep = _testhooks.alloc_catching(1000, 0, 0)[0]                   # a 2 MiB small segment
        lib.cudapool_set_memory_fraction(0.0, 0)         # what set_per_process_memory_fraction(0.0) calls
        assert torch.cuda.get_per_process_memory_fraction(0) == 0.0
        assert torch.cuda.get_per_process_memory_fraction("cuda:1") == 1.0
        ptr, status, msg = _testhooks.alloc_catching(1000, 0, 0)          # the cache still serves
        assert status == 0, msg
        lib.cudapool_free(ptr, 1000, 0, None)
        for size in (4 * MiB, 3 * MiB):                                   # growth is refused
            ptr, status, msg = _testhooks.alloc_catching(size, 0, 0)
            assert status == 1 and msg.startswith("CUDA out of memory. Tried to allocate"), (status, msg)
        assert _testhooks.alloc_catching(4 * MiB, 1, 0)[1] == 0           # the other device is free to grow
        lib.cudapool_set_memory_fraction(0.5, 0)
        assert torch.cuda.get_per_process_memory_fraction(torch.device("cuda", 0)) == 0.5
        ptr, status, msg = _testhooks.alloc_catching(4 * MiB, 0, 0)
        assert status == 0, msg
        try:
            torch.cuda.get_per_process_memory_fraction("cpu")
        except ValueError:
            pass
        else:
            raise AssertionError("a CPU device was accepted")
        try:
            _C.parse_config("memory_fraction:0")                           # the key still refuses 0
        except ValueError as exc:
            assert "memory_fraction" in str(exc), exc
        else:
            raise AssertionError("memory_fraction:0 accepted")
        print("OK")
        """
        )
    )


def test_get_fraction_reports_the_configured_memory_fraction():
    ok(
        """
        cudapool.enable(memory_fraction=0.75)
        assert torch.cuda.get_per_process_memory_fraction(0) == 0.75
        assert torch.cuda.get_per_process_memory_fraction(3) == 0.75
        print("OK")
        """
    )


def test_sim_base_alloc_hook_answers_the_segment_of_a_live_block():
    ok(
        sim(
            """
        assert "base_alloc" in _torch.hooks_set()
        lib.cudapool_base_alloc.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        lib.cudapool_base_alloc.restype = ctypes.c_void_p
        size = ctypes.c_size_t(0)
        a = lib.cudapool_alloc(1000, 1, None)
        b = lib.cudapool_alloc(5000, 1, None)                 # after a, in the same 2 MiB segment
        assert lib.cudapool_base_alloc(b, ctypes.byref(size)) == a and size.value == 2 * MiB
        assert lib.cudapool_base_alloc(b + 100, ctypes.byref(size)) == a and size.value == 2 * MiB
        c = lib.cudapool_alloc(12 * MiB, 0, None)             # a large block: its own segment
        assert lib.cudapool_base_alloc(c, ctypes.byref(size)) == c and size.value == 12 * MiB
        foreign = ctypes.create_string_buffer(64)
        address = ctypes.addressof(foreign)
        assert lib.cudapool_base_alloc(address, ctypes.byref(size)) == address and size.value == 0
        lib.cudapool_free(b, 5000, 1, None)
        assert lib.cudapool_base_alloc(b, ctypes.byref(size)) == b and size.value == 0   # freed: not an allocation
        # the hook torch calls is this very function
        raw = _torch._state.allocator.allocator()
        assert hasattr(raw, "set_base_alloc_fn")
        # record_stream of memory no pool holds (a DLPack import): silent and counted
        lib.cudapool_record_stream(address, 7)
        assert cudapool.foreign_pointer_calls() == {"free": 0, "record_stream": 1}
        lib.cudapool_free(a, 1000, 1, None)
        lib.cudapool_free(c, 12 * MiB, 0, None)
        print("OK")
        """
        )
    )


# -- out of memory is torch.OutOfMemoryError (cudapool._torch_oom) ----------------------------

needs_torch_oom = pytest.mark.skipif(
    _torch_libraries.torch_oom_library_path() is None,
    reason="cudapool._torch_oom was not built (torch absent at build time)",
)

# The allocation entry point called from C++ (cudapool._torch_oom's test entry), which names
# the C++ type of the exception as torch's catch sites see it: 1 c10::OutOfMemoryError,
# 2 another c10::Error, 3 another std::exception.
CATCHING = """
oom_lib = ctypes.CDLL(_torch_libraries.torch_oom_library_path())
oom_lib.cudapool_torch_oom_catch.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
oom_lib.cudapool_torch_oom_catch.restype = ctypes.c_int
alloc_address = ctypes.cast(lib.cudapool_alloc, ctypes.c_void_p).value

def caught(size, device=0):
    out, buf = ctypes.c_void_p(), ctypes.create_string_buffer(4096)
    kind = oom_lib.cudapool_torch_oom_catch(alloc_address, size, device, None, ctypes.byref(out), buf, len(buf))
    return kind, buf.value.decode(), out.value
"""


GRAPH_HEAD = """
FILTER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
lib.cudapool_call_graph_hook.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong,
                                         FILTER, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
buf = ctypes.create_string_buffer(1024)
asked = []
@FILTER
def stream_5(stream, arg):
    asked.append(stream)
    return int(stream == 5)
def hook(which, device, pool, filter=stream_5):
    status = lib.cudapool_call_graph_hook(which, device, pool[0], pool[1], filter, None, buf, len(buf))
    return buf.value.decode() if status else None
def event_calls(device):
    return sum(_testhooks.sim_calls(device, k) for k in ("event_record", "event_query", "event_synchronize"))
"""


def test_sim_graph_hooks_take_torchs_std_function_and_route_into_a_private_pool():
    ok(
        sim(
            """
        assert {"begin_allocate_to_pool", "end_allocate_to_pool", "release_pool"} <= set(_torch.hooks_set())
        cached = lib.cudapool_alloc(MiB, 0, 5)
        lib.cudapool_free(cached, MiB, 0, 5)
        assert hook(0, 0, (3, 0)) is None             # begin, with a std::function filter
        assert _torch.graph_pools() == [dict(device=0, id=(3, 0), uses=1, window_open=True,
                                             allocated=0, reserved=0, allocations=0, region=None, paused=0)]
        g = lib.cudapool_alloc(MiB, 0, 5)             # the filter accepts stream 5
        s = lib.cudapool_alloc(MiB, 0, 6)             # and refuses stream 6
        assert asked[-2:] == [5, 6], asked
        assert g != cached and cudapool.memory_allocated(0) == MiB
        assert _torch.graph_pools()[0]["allocated"] == MiB
        assert "already allocating to pool (3, 0)" in hook(0, 0, (3, 0))
        assert hook(1, 0, (3, 0)) is None             # end
        assert "not allocating to pool (3, 0)" in hook(1, 0, (3, 0))
        assert lib.cudapool_alloc(MiB, 0, 5) == cached  # outside the window: the shared pool
        lib.cudapool_free(cached, MiB, 0, 5)
        assert hook(2, 0, (3, 0)) is None             # release: the live output keeps the pool
        assert _torch.graph_pools()[0]["uses"] == 0
        lib.cudapool_free(g, MiB, 0, 5)               # its last allocation freed: the pool goes
        assert _torch.graph_pools() == []
        assert hook(2, 0, (3, 0)) is None             # release never throws: it reports
        lib.cudapool_free(s, MiB, 0, 6)
        assert _C.device_pool(0).check() == 0
        print("OK")
        """,
            GRAPH_HEAD,
        )
    )


def test_sim_capture_makes_no_event_call_and_defers_record_stream_frees():
    out = ok(
        sim(
            """
        a = lib.cudapool_alloc(MiB, 0, 5)
        lib.cudapool_record_stream(a, 9)
        b = lib.cudapool_alloc(MiB, 0, 5)
        lib.cudapool_free(b, MiB, 0, 5)
        assert hook(0, 0, (4, 0)) is None
        _testhooks.sim_set_capturing(0, 5)            # the capture begins
        before = event_calls(0)
        g = lib.cudapool_alloc(2 * MiB, 0, 5)         # the graph's pool grows: no event call
        lib.cudapool_free(a, MiB, 0, 5)               # a record_stream use: deferred
        assert cudapool.memory_allocated(0) == MiB
        lib.cudapool_empty_cache()                    # torch's reset hook: nothing goes back now
        assert event_calls(0) == before and _testhooks.sim_capture_violations(0) == 0
        _testhooks.sim_set_capturing(0, 5, False)     # the capture ends
        assert hook(1, 0, (4, 0)) is None             # end: the deferred free records its event
        assert event_calls(0) == before + 1 and cudapool.memory_allocated(0) == 0
        assert hook(2, 0, (4, 0)) is None
        lib.cudapool_free(g, 2 * MiB, 0, 5)
        assert _torch.graph_pools() == []
        _testhooks.sim_complete_all(0)
        lib.cudapool_empty_cache()
        assert cudapool.memory_reserved(0) == 0 and _testhooks.sim_capture_violations(0) == 0
        print("OK")
        """,
            GRAPH_HEAD,
        )
    )
    assert "OK" in out


def test_cudagraph_trees_fail_with_a_message_that_names_the_workaround():
    ok(
        """
        cudapool.enable()
        for name in ("_cuda_getCheckpointState", "_cuda_setCheckpointPoolState", "_cuda_checkPoolLiveAllocations"):
            try:
                getattr(torch._C, name)(0, (1, 0))
            except RuntimeError as exc:
                assert str(exc) == _torch.REDUCE_OVERHEAD_MESSAGE
                assert "cudagraph_trees = False" in str(exc)
            else:
                raise AssertionError(name)
        print("OK")
        """
    )


def test_mem_pool_allocator_is_a_pluggable_allocator_that_is_not_swapped_in():
    ok(
        """
        a = _torch.mem_pool_allocator()
        assert type(a) is torch.cuda.memory.CUDAPluggableAllocator
        assert _torch.mem_pool_allocator() is a and cudapool.mem_pool_allocator() is a
        assert isinstance(a.allocator(), torch._C._cuda_CUDAAllocator)
        assert not cudapool.enabled() and not torch.cuda.is_initialized()
        print("OK")
        """
    )


@needs_torch_oom
def test_oom_throws_c10_out_of_memory_error_once_enabled():
    ok(
        sim(
            """
        assert _torch.oom_error_type() == "torch.OutOfMemoryError"
        kind, msg, _ = caught(100 * MiB)
        assert kind == 1, (kind, msg)                                  # c10::OutOfMemoryError
        assert msg.startswith("CUDA out of memory. Tried to allocate 100.00 MiB"), msg
        assert "Exception raised from" not in msg, msg                 # no C++ backtrace in the text
        kind, msg, ptr = caught(MiB)
        assert kind == 0 and ptr, (kind, msg)
        lib.cudapool_free(ptr, MiB, 0, None)
        kind, msg, _ = caught(MiB, device=5)                           # not out of memory: a std::exception
        assert kind == 3 and "device 5 does not exist" in msg, (kind, msg)
        # the ctypes-facing path sees the same exception, with its status and message
        ptr, status, msg = _testhooks.alloc_catching(100 * MiB, 0, 0)
        assert status == 1 and ptr == 0 and msg.startswith("CUDA out of memory. Tried to allocate"), (status, msg)
        ptr, status, msg = _testhooks.alloc_catching(MiB, 5, 0)
        assert status == 2 and "device 5 does not exist" in msg, (status, msg)   # CP_ERR_INVALID
        assert torch.cuda.memory_stats(0)["num_ooms"] == 2
        print("OK")
        """,
            head=CATCHING,
        )
    )


@needs_torch_oom
def test_oom_before_enable_is_the_std_exception():
    # Nothing installed yet: the fallback type, which torch turns into RuntimeError.
    ok(
        "_C.use_sim_devices(64 * MiB)\nlib = ctypes.CDLL(_C.__file__)\n"
        + CATCHING
        + textwrap.dedent(
            """
        assert _torch.oom_error_type() is None
        kind, msg, _ = caught(100 * MiB)
        assert kind == 3 and msg.startswith("CUDA out of memory. Tried to allocate"), (kind, msg)
        print("OK")
        """
        )
    )


@needs_torch_oom
def test_torch_oom_built_for_another_torch_is_not_installed_and_says_how_to_fix():
    out = ok(
        """
        _C.use_sim_devices(64 * MiB)
        torch.__version__ = "2.0.0+other"
        with warnings.catch_warnings(record=True) as caught_warnings:
            warnings.simplefilter("always")
            cudapool.enable()
        assert cudapool.enabled() and _torch.oom_error_type() == "RuntimeError"
        [w] = [w for w in caught_warnings if "OutOfMemoryError" in str(w.message)]
        assert issubclass(w.category, RuntimeWarning), w
        text = str(w.message)
        assert "was built for torch 2" in text and "torch 2.0.0+other is running" in text, text
        assert "reinstall cudapool" in text and "--no-build-isolation" in text, text
        ptr, status, msg = _testhooks.alloc_catching(100 * MiB, 0, 0)
        assert status == 1 and msg.startswith("CUDA out of memory. Tried to allocate"), (status, msg)
        print("WARNING:", text)
        print("OK")
        """
    )
    assert "RuntimeError instead of torch.OutOfMemoryError" in out


def test_without_torch_oom_enable_is_silent_and_oom_is_a_runtime_error():
    ok(
        """
        _C.use_sim_devices(64 * MiB)
        _torch_libraries.torch_oom_library_path = lambda: None     # as when torch was absent at build time
        with warnings.catch_warnings(record=True) as caught_warnings:
            warnings.simplefilter("always")
            cudapool.enable()
        assert not caught_warnings, [str(w.message) for w in caught_warnings]
        assert _torch.oom_error_type() == "RuntimeError"
        ptr, status, msg = _testhooks.alloc_catching(100 * MiB, 0, 0)
        assert status == 1 and msg.startswith("CUDA out of memory. Tried to allocate"), (status, msg)
        print("OK")
        """
    )


def test_the_extension_does_not_need_torch():
    # _C is what torch dlopens, and what `pip install` builds without torch: no libc10 in it.
    with open(_C.__file__, "rb") as f:
        image = f.read()
    assert b"libc10" not in image and b"c10::" not in image and b"_ZN3c10" not in image
    path = _torch_libraries.torch_oom_library_path()
    if path is not None:  # the thrower library links libc10, and nothing of cudapool
        with open(path, "rb") as f:
            image = f.read()
        assert b"libc10.so" in image and b"cp_alloc" not in image


# -- the statistics key set equals torch's ---------------------------------------------------


def _brace_expand(pattern: str):
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return {"".join(combo) for combo in itertools.product(*choices)}


# torch's memory_stats docstring calls the allocation-count family "allocated"; the key torch
# emits (and its own memory_summary reads) is "allocation".
_DOC_MISNAMED_FAMILIES = {"allocated": "allocation"}
# Documented, but nested by MemPool id: flattened, it contributes one key per private pool,
# and none while no private pool exists (cudapool has none).
_DOC_PER_PRIVATE_POOL = {"reserved_bytes_by_private_pools"}


_KEY_PATTERN = re.compile(r"^[a-z][a-z_]*(\.(\{[a-z_,]+\}|[a-z_]+))*$")


def documented_torch_stat_keys():
    """The flat keys torch.cuda.memory_stats() documents, read from the installed torch's
    docstring: every ``"quoted"`` key pattern, braces expanded. For torch 2.14 that is the nine
    families allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes,
    active_bytes, inactive_split_bytes, requested_bytes, each .{all,large_pool,small_pool}
    .{current,peak,allocated,freed}; oversize_allocations.* and oversize_segments.*
    (current, peak, allocated, freed); the counters num_alloc_retries, num_ooms,
    num_sync_all_streams, num_device_alloc, num_device_free, num_oom_rejections; and
    max_split_size. cudapool must have each of them."""
    doc = torch.cuda.memory.memory_stats.__doc__ or ""
    keys = set()
    for pattern in re.findall(r'``"([^"`]+)"``', doc):
        if not _KEY_PATTERN.match(pattern):  # e.g. ``"_"``, ``"0_1"``: prose, not keys
            continue
        for key in _brace_expand(pattern):
            head, dot, rest = key.partition(".")
            head = _DOC_MISNAMED_FAMILIES.get(head, head)
            if head in _DOC_PER_PRIVATE_POOL:
                continue
            keys.add(head + dot + rest)
    return keys


def test_stats_keys_equal_the_keys_torch_documents():
    documented = documented_torch_stat_keys()
    assert len(documented) >= 9 * 3 * 4 + 2 * 4 + 5 + 1, sorted(documented)
    ours_c = set(_C.device_pool(0).stats())
    filled = set(_torch_stats.EXTRA_STATS)  # keys torch has for policies cudapool lacks (always 0)
    assert ours_c | filled == documented, (
        f"missing: {sorted(documented - ours_c - filled)}, extra: {sorted((ours_c | filled) - documented)}"
    )
    assert set(cudapool.memory_stats(0)) == documented
    assert all(cudapool.memory_stats(0)[k] == 0 for k in filled)


@pytest.mark.gpu
@needs_gpu
def test_stats_keys_equal_the_builtin_allocators_on_a_gpu():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; x = torch.empty(1 << 20, device='cuda'); print(sorted(torch.cuda.memory_stats()))",
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={k: v for k, v in os.environ.items() if k != "CUDAPOOL_CONF"},
    )
    assert proc.returncode == 0, proc.stderr
    builtin = set(eval(proc.stdout.strip()))
    assert set(cudapool.memory_stats(0)) == builtin, (
        f"missing: {sorted(builtin - set(cudapool.memory_stats(0)))}, "
        f"extra: {sorted(set(cudapool.memory_stats(0)) - builtin)}"
    )


# -- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_gpu_tensors_are_served_by_the_pool():
    out = ok(
        """
        cudapool.enable()
        x = torch.ones(1 << 20, device="cuda")                       # 4 MiB
        assert float(x.sum()) == float(1 << 20)
        s = torch.cuda.memory_stats()
        assert s == cudapool.memory_stats() and s["allocated_bytes.all.current"] >= 4 * MiB, s
        assert torch.cuda.memory_allocated() >= 4 * MiB
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            y = x * 2
        x.record_stream(side)
        del x
        torch.cuda.synchronize()
        del y
        torch.cuda.empty_cache()
        assert torch.cuda.memory_allocated() == 0
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        except RuntimeError as exc:
            assert "CUDA out of memory. Tried to allocate" in str(exc), exc
        else:
            raise AssertionError("a petabyte was allocated")
        assert torch.cuda.memory_stats()["num_ooms"] == 1
        torch.cuda.set_per_process_memory_fraction(0.5)
        z = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        print(torch.cuda.memory_summary())
        assert _C.device_pool(torch.cuda.current_device()).check() == 0
        print("OK")
        """
    )
    assert "cudapool CUDA memory summary" in out

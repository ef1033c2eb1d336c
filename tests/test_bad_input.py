"""Bad input through every Python-facing entry: the C entry points torch calls (through
ctypes on ``_C.__file__``), ``cudapool.sim.Pool``, ``_C`` and ``cudapool``'s own functions,
and the configuration of ``enable()``. Each case must end in a clear error or a documented
no-op, never a crash, a hang or a pool left broken. Each test backs a row of docs/testing.md's
"Bad input" table and is named after it.

The entry points share the process-wide device table, so those scenarios run in a fresh
interpreter each, on simulated devices, with a timeout: a hang fails instead of blocking.
A free that fails cannot raise into torch: it writes one line to stderr, which the scenarios
capture around each call (``stderr_of``).
"""

import math
import subprocess
import textwrap

import pytest
from cudapool import _C, _config, _testhooks
from cudapool.sim import OutOfMemoryError
from cudapool.sim import Pool as SimPool
from scenario import ENTRY_POINTS, expect_ok, run_python


def Pool(*args, **kwargs):
    """A simulated pool under torch's built-in rules, which these tests check (sim.Pool's own
    default is cudapool's policy)."""
    kwargs.setdefault("policy", "builtin")
    return SimPool(*args, **kwargs)


MiB = 1 << 20
SIZE_MAX = (1 << 64) - 1
TIMEOUT_S = 120

# Common head of every scenario: the entry points through ctypes, on simulated devices.
PRELUDE = (
    ENTRY_POINTS
    + """
import ctypes, math, os, sys, tempfile
import cudapool
from cudapool import _C
MiB = 1 << 20
SIZE_MAX = (1 << 64) - 1

def alloc(size, device=0, stream=0):
    ptr, status, msg = _testhooks.alloc_catching(size, device, stream)
    assert status == 0 and ptr, (status, msg)
    return ptr

def stderr_of(fn, *args):
    # What fn writes to file descriptor 2 (the entry points' reports), as text.
    sys.stderr.flush()
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            fn(*args)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode()

def allocated(device=0):
    return cudapool.memory_stats(device)["allocated_bytes.all.current"]
"""
)

SIM2 = "_C.use_sim_devices(64 * MiB, count=2)\n"


def run_py(code: str, env: dict = None) -> subprocess.CompletedProcess:
    """PRELUDE + code (after an optional SIM2 head) in a fresh interpreter."""
    head = SIM2 if code.startswith(SIM2) else ""
    return run_python(PRELUDE + head + textwrap.dedent(code[len(head) :]), timeout=TIMEOUT_S, env=env)


def ok(code: str, env: dict = None) -> str:
    """Run a scenario that must print OK last and exit 0; its stdout."""
    return expect_ok(run_py(code, env))


def _torch_cuda_build() -> bool:
    try:
        import torch
    except Exception:
        return False
    return hasattr(torch._C, "_cuda_customAllocator")


needs_torch_cuda_build = pytest.mark.skipif(not _torch_cuda_build(), reason="enable() needs a CUDA build of torch")


@pytest.fixture
def pool():
    with Pool(64 * MiB) as p:
        yield p
        assert p.check() == 0, p.check_report()


# -- sizes ------------------------------------------------------------------------------------


def test_row_size_zero_entry_alloc_returns_null_without_a_pool():
    ok(
        SIM2
        + """
        assert _testhooks.alloc_catching(0, 0, 0) == (0, 0, "")
        assert _testhooks.alloc_catching(0, 99, 0) == (0, 0, "")   # size 0: the device is not looked at
        assert _C.device_pools() == []
        assert stderr_of(lib.cudapool_free, None, 0, 0, None) == ""
        print("OK")
        """
    )


def test_row_size_zero_sim_pool_alloc_returns_0(pool):
    assert pool.alloc(0) == 0
    assert pool.alloc(0, stream=5) == 0
    pool.free(0)
    assert pool.memory_stats()["allocation.all.allocated"] == 0
    assert pool.backend_calls()["reserve"] == 0


def test_row_huge_sizes_entry_alloc_throws_out_of_memory():
    ok(
        SIM2
        + """
        keep = alloc(1000)
        sizes = [SIZE_MAX, SIZE_MAX - 511, SIZE_MAX - 4 * MiB, 1 << 63, 64 * MiB + 1]
        for size in sizes:
            ptr, status, msg = _testhooks.alloc_catching(size, 0, 0)
            assert (ptr, status) == (0, 1), (size, status, msg)
            assert msg.startswith("CUDA out of memory. Tried to allocate"), msg
            assert f"({size} bytes)" in msg, msg
            assert _C.device_pool(0).check() == 0
        s = cudapool.memory_stats(0)
        assert s["num_ooms"] == len(sizes) and s["allocation.all.current"] == 1, s
        assert s["reserved_bytes.all.current"] == 2 * MiB, s
        big = alloc(60 * MiB)                        # what fits still fits
        assert stderr_of(lib.cudapool_free, big, 60 * MiB, 0, None) == ""
        assert stderr_of(lib.cudapool_free, keep, 1000, 0, None) == ""
        print("OK")
        """
    )


def test_row_huge_sizes_sim_pool_alloc_raises_out_of_memory(pool):
    keep = pool.alloc(1000)
    for size in (SIZE_MAX, SIZE_MAX - 511, 1 << 63, 64 * MiB + 1):
        with pytest.raises(OutOfMemoryError, match=r"^Tried to allocate .*\(%d bytes\)" % size):
            pool.alloc(size)
        assert pool.check() == 0
    assert pool.info()["live_blocks"] == 1
    assert pool.memory_stats()["num_ooms"] == 4
    pool.free(keep)


def test_row_negative_or_oversized_ints_are_refused_before_allocating(pool):
    p = pool.alloc(1000)
    before = pool.memory_stats()
    for call, message in [
        (lambda: pool.alloc(-1), "size must be non-negative"),
        (lambda: pool.alloc(10, stream=-3), "stream must be non-negative"),
        (lambda: pool.free(-512), "ptr must be non-negative"),
        (lambda: pool.record_stream(p, -1), "stream must be non-negative"),
        (lambda: pool.set_memory_cap(-1), "bytes must be non-negative"),
        (lambda: pool.oom_report(-1), "size must be non-negative"),
        (lambda: pool.complete(-1), "stream must be non-negative"),
        (lambda: pool.fail_nth("reserve", -1), "n must be non-negative"),
        (lambda: _testhooks.alloc_catching(-1, 0, 0), "size must be non-negative"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    for call in (
        lambda: pool.alloc(1 << 64),
        lambda: pool.record_stream(p, 1 << 64),
        lambda: pool.set_memory_cap(1 << 64),
        lambda: pool.free(1 << 64),
        lambda: _testhooks.alloc_catching(1 << 64, 0, 0),
        lambda: _testhooks.alloc_catching(1, 1 << 40, 0),
    ):
        with pytest.raises(OverflowError):
            call()
    assert pool.memory_stats() == before
    with pytest.raises(ValueError):
        Pool(-1)
    pool.free(p)


def test_row_non_integer_sizes_are_type_errors(pool):
    p = pool.alloc(1000)
    for bad in (1.5, "10", None, b"1", 2.0):
        with pytest.raises(TypeError):
            pool.alloc(bad)
        with pytest.raises(TypeError):
            pool.free(bad)
        with pytest.raises(TypeError):
            pool.record_stream(p, bad)
            pool.launch(p, bad)  # work there uses it
        with pytest.raises(TypeError):
            pool.set_memory_cap(bad)
    with pytest.raises(TypeError):
        pool.set_memory_fraction("0.5")
    with pytest.raises(TypeError):
        Pool(1.5)
    assert pool.info()["live_blocks"] == 1
    pool.free(p)


# -- pointers ---------------------------------------------------------------------------------


def test_row_free_null_entry_and_sim_pool_are_noops(pool):
    ok(
        SIM2
        + """
        p = alloc(1000)
        for args in ((None, 0, 0, None), (None, 123, 99, None), (None, 5, -1, 7)):
            assert stderr_of(lib.cudapool_free, *args) == ""
        assert stderr_of(lib.cudapool_record_stream, None, 7) == ""
        assert allocated(0) == 1024
        print("OK")
        """
    )
    pool.free(0)
    assert pool.memory_stats()["allocation.all.freed"] == 0


def test_row_free_double_interior_entry_warns_and_changes_nothing():
    ok(
        SIM2
        + """
        p = alloc(1000)
        keep = alloc(4096)
        for bad in (p + 512, p + 1, p + 2 * MiB - 1):        # inside the pool's segment
            err = stderr_of(lib.cudapool_free, bad, 1000, 0, None)
            assert err.count("\\n") == 1 and err.startswith("cudapool: free("), err
            assert "was not allocated by this pool, or was already freed" in err, err
        assert _C.foreign_pointer_calls() == {"free": 0, "record_stream": 0}
        assert allocated(0) == 1024 + 4096
        assert stderr_of(lib.cudapool_free, p, 1000, 0, None) == ""
        err = stderr_of(lib.cudapool_free, p, 1000, 0, None)   # double free
        assert "was already freed" in err, err
        assert allocated(0) == 4096 and _C.device_pool(0).check() == 0
        q, r = alloc(1000), alloc(1000)                         # p comes back once, not twice
        assert q == p and r != p
        print("OK")
        """
    )


def test_row_free_unknown_double_interior_sim_pool_raises_value_error(pool):
    p = pool.alloc(1000)
    before = pool.memory_stats()
    for bad in (p + 512, p + 1, 0x1234_0000):
        with pytest.raises(ValueError, match="was not allocated by this pool, or was already freed"):
            pool.free(bad)
    assert pool.memory_stats() == before
    pool.free(p)
    with pytest.raises(ValueError, match="already freed"):
        pool.free(p)
    assert pool.info()["live_blocks"] == 0


def test_row_free_size_mismatch_entry_is_refused_and_the_block_stays():
    ok(
        SIM2
        + """
        p = alloc(1000)                              # a 1024-byte block
        for wrong in (1024, 999, 0, SIZE_MAX):
            err = stderr_of(lib.cudapool_free, p, wrong, 0, None)
            assert f"was allocated with 1000 bytes, not {wrong}" in err, err
            assert "the block stays allocated" in err and err.count("\\n") == 1, err
            assert allocated(0) == 1024 and _C.device_pool(0).check() == 0
        assert stderr_of(lib.cudapool_free, p, 1000, 0, None) == ""
        assert allocated(0) == 0
        print("OK")
        """
    )


def test_row_free_stream_argument_entry_is_ignored():
    ok(
        SIM2
        + """
        p = alloc(1000, stream=5)
        assert stderr_of(lib.cudapool_free, p, 1000, 0, 9) == ""   # not the allocation stream
        assert alloc(1000, stream=9) != p            # the block went back to stream 5 only
        assert alloc(1000, stream=5) == p
        print("OK")
        """
    )


def test_row_foreign_pointer_entry_free_and_record_stream_are_silent_and_counted():
    # Memory no pool holds (another allocator's, a DLPack import): ignored, as torch's
    # built-in allocator ignores record_stream on memory it does not own; counted.
    ok(
        SIM2
        + """
        p = alloc(1000)
        q = alloc(1000, device=1)
        foreign = ctypes.create_string_buffer(4096)
        addresses = (0x1234_0000, ctypes.addressof(foreign), p + 2 * MiB, p - 1)
        for bad in addresses:
            assert stderr_of(lib.cudapool_record_stream, bad, 7) == ""
            for device in (0, 1, 5, -1, 64):          # whatever the device number
                assert stderr_of(lib.cudapool_free, bad, 1000, device, None) == ""
        assert _C.foreign_pointer_calls() == {"free": 5 * len(addresses), "record_stream": len(addresses)}
        assert cudapool.foreign_pointer_calls() == _C.foreign_pointer_calls()
        assert allocated(0) == 1024 and allocated(1) == 1024
        assert _C.device_pool(0).check() == 0 and _C.device_pool(1).check() == 0
        print("OK")
        """
    )


def test_row_record_stream_freed_or_interior_pointer_entry_warns():
    ok(
        SIM2
        + """
        p = alloc(1000)
        err = stderr_of(lib.cudapool_record_stream, p + 512, 7)
        assert err == f"cudapool: record_stream({hex(p + 512)}): not a live allocation of cudapool (freed, or inside one)\\n", err
        assert stderr_of(lib.cudapool_free, p, 1000, 0, None) == ""
        assert "not a live allocation" in stderr_of(lib.cudapool_record_stream, p, 7)   # after its free
        assert _C.foreign_pointer_calls() == {"free": 0, "record_stream": 0}
        assert _C.device_pool(0).check() == 0
        print("OK")
        """
    )


# -- devices ----------------------------------------------------------------------------------


def test_row_bad_device_entry_alloc_throws():
    ok(
        SIM2
        + """
        for device, text in ((-1, "invalid device -1"), (64, "invalid device 64"),
                             (1000, "invalid device 1000"),
                             (2, "device 2 does not exist (2 simulated devices)")):
            ptr, status, msg = _testhooks.alloc_catching(1000, device, 0)
            assert ptr == 0 and status != 0, (device, status, msg)
            assert msg.startswith(f"cudapool: allocating 1000 bytes on device {device} failed (CP_ERR_INVALID)"), msg
            assert text in msg, msg
        assert _C.device_pools() == []
        print("OK")
        """
    )


def test_row_bad_device_entry_free_warns_and_the_block_stays():
    ok(
        SIM2
        + """
        p = alloc(1000, device=0)
        for device in (-1, 64, 1):                   # the pointer's own device is named
            err = stderr_of(lib.cudapool_free, p, 1000, device, None)
            text = f"the pointer is a live allocation of device 0, not of device {device}: not freed"
            assert err.startswith("cudapool: free(") and text in err and err.count("\\n") == 1, err
        for device in (-1, 64):                      # a freed pointer of device 0's segment
            err = stderr_of(lib.cudapool_free, p + 1024, 1000, device, None)
            assert f"invalid device {device} (expected 0..63)" in err, err
        q = alloc(1000, device=1)                    # device 1's pool now exists: same refusal
        err = stderr_of(lib.cudapool_free, p, 1000, 1, None)
        assert "the pointer is a live allocation of device 0, not of device 1" in err, err
        err = stderr_of(lib.cudapool_free, p + 1024, 1000, 5, None)
        assert "device 5 has no cudapool pool" in err, err
        assert _C.foreign_pointer_calls()["free"] == 0
        assert allocated(0) == 1024 and allocated(1) == 1024
        assert stderr_of(lib.cudapool_free, p, 1000, 0, None) == ""
        assert stderr_of(lib.cudapool_free, q, 1000, 1, None) == ""
        assert allocated(0) == allocated(1) == 0
        assert _C.device_pool(0).check() == _C.device_pool(1).check() == 0
        print("OK")
        """
    )


def test_row_bad_device_or_fraction_entry_set_memory_fraction_creates_no_pool():
    ok(
        SIM2
        + """
        cases = [
            (math.nan, 0, "memory fraction nan is outside [0, 1]"),
            (1.5, 0, "memory fraction 1.5 is outside [0, 1]"),
            (-0.1, 0, "memory fraction -0.1 is outside [0, 1]"),
            (math.inf, 1, "memory fraction inf is outside [0, 1]"),
            (0.5, -1, "invalid device -1"),
            (0.5, 64, "invalid device 64"),
            (0.5, 7, "device 7 does not exist (2 simulated devices)"),
        ]
        for fraction, device, text in cases:
            err = stderr_of(lib.cudapool_set_memory_fraction, fraction, device)
            assert err.startswith("cudapool: set_memory_fraction(") and text in err, err
        for fraction in (math.nan, 2.0, -1.0):
            try:
                _C.device_pool(0).set_memory_fraction(fraction)
            except ValueError as exc:
                assert "is outside [0, 1]" in str(exc), exc
            else:
                raise AssertionError(fraction)
        assert _C.device_pools() == []
        _C.configure("max_split_size_mb:64")         # no pool yet: the configuration is still open
        print("OK")
        """
    )


def test_row_init_entry_is_a_noop_for_any_count():
    ok(
        SIM2
        + """
        for count in (-5, 0, 1, 64, 1 << 30):
            assert stderr_of(lib.cudapool_init, count) == ""
        assert _C.device_pools() == []
        assert alloc(1000)
        print("OK")
        """
    )


def test_row_bad_device_python_functions():
    # Without torch imported (as before enable()): device arguments are checked by cudapool.
    ok(
        """
        assert "torch" not in sys.modules
        def refused(fn, arg, kind, text):
            try:
                fn(arg)
            except kind as exc:
                assert text in str(exc), (arg, exc)
            else:
                raise AssertionError(f"{fn.__name__}({arg!r}) was accepted")
        for fn in (cudapool.memory_stats, cudapool.memory_summary, cudapool.reset_peak_memory_stats,
                   cudapool.reset_accumulated_memory_stats, cudapool.memory_allocated):
            refused(fn, -1, ValueError, "invalid device -1 (expected 0..63)")
            refused(fn, 64, ValueError, "invalid device 64")
            refused(fn, 1 << 70, ValueError, "invalid device")
            refused(fn, "cuda:x", ValueError, "Expected a cuda device")
            refused(fn, "cpu", ValueError, "Expected a cuda device")
            refused(fn, True, TypeError, "invalid device True")
            refused(fn, 1.5, TypeError, "invalid device 1.5")
        refused(_C.device_pool, 1 << 70, ValueError, "invalid device")
        refused(_C.device_pool, -1, ValueError, "invalid device -1")
        s = cudapool.memory_stats(5)                 # a device index without a pool: all zero
        assert all(v == 0 for k, v in s.items() if k != "max_split_size"), s
        assert cudapool.memory_allocated("cuda:7") == 0
        cudapool.empty_cache()
        assert _C.device_pools() == []
        print("OK")
        """
    )


# -- streams ----------------------------------------------------------------------------------


def test_row_invalid_stream_entry_alloc_works_and_free_after_record_stream_warns():
    ok(
        SIM2
        + """
        alloc(1)                                     # creates device 0's simulated device
        _testhooks.sim_invalidate_stream(0, 9)
        q = alloc(1000, stream=9)                    # no device call for the allocation stream
        assert stderr_of(lib.cudapool_free, q, 1000, 0, 9) == ""
        p = alloc(1000)
        assert stderr_of(lib.cudapool_record_stream, p, 7) == ""
        _testhooks.sim_invalidate_stream(0, 7)
        for attempt in range(2):
            err = stderr_of(lib.cudapool_free, p, 1000, 0, None)
            assert err.startswith("cudapool: free(") and err.count("\\n") == 1, err
            assert "invalid resource handle" in err and "the block stays allocated" in err, err
        assert _C.device_pool(0).check() == 0
        assert allocated(0) == 512 + 1024            # p stays allocated; q was freed
        assert stderr_of(lib.cudapool_empty_cache) == ""
        assert _C.device_pool(0).info()["pending_blocks"] == 0
        try:
            _testhooks.sim_invalidate_stream(1, 7)           # device 1 has no simulated device yet
        except RuntimeError as exc:
            assert "no simulated device yet" in str(exc), exc
        else:
            raise AssertionError("invalidated a stream of a device never used")
        print("OK")
        """
    )


def test_row_invalid_stream_sim_pool_free_after_record_stream_raises(pool):
    pool.invalidate_stream(9)
    q = pool.alloc(1000, stream=9)
    pool.free(q)
    p = pool.alloc(1000)
    pool.record_stream(p, 7)
    pool.launch(p, 7)  # work there uses it
    pool.invalidate_stream(7)
    before = pool.memory_stats()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="CP_ERR_BACKEND: .*invalid resource handle.*stays allocated"):
            pool.free(p)
        assert pool.check() == 0
    assert pool.memory_stats() == before
    assert pool.info()["live_blocks"] == 1 and pool.info()["pending_blocks"] == 0
    with pytest.raises(ValueError):
        pool.invalidate_stream(-1)


# -- limits -----------------------------------------------------------------------------------


def test_row_memory_fraction_out_of_range_sim_pool_raises_value_error(pool):
    pool.set_memory_fraction(0.5)
    for bad in (math.nan, math.inf, -math.inf, -0.1, 1.0000001, 2):
        with pytest.raises(ValueError, match=r"is outside \[0, 1\]"):
            pool.set_memory_fraction(bad)
    assert pool.info()["memory_cap"] == 32 * MiB


def test_row_memory_fraction_tiny_caps_everything_sim_pool(pool):
    pool.set_memory_fraction(1e-300)
    assert pool.info()["memory_cap"] == 1
    with pytest.raises(OutOfMemoryError, match="Memory cap: 1 bytes"):
        pool.alloc(512)
    assert pool.backend_calls()["reserve"] == 0
    with Pool(64 * MiB, memory_fraction=1e-300) as tiny:
        assert tiny.info()["memory_cap"] == 1
        with pytest.raises(OutOfMemoryError):
            tiny.alloc(512)


def test_row_sim_pool_capacity_zero_is_refused():
    with pytest.raises(ValueError, match="capacity must be > 0"):
        Pool(0)
    with pytest.raises(ValueError, match="capacity must be > 0"):
        _C.Pool(0)


# -- configuration ----------------------------------------------------------------------------

BAD_CONF_ENTRIES = [
    ("no_such_key:1", "no_such_key", "unknown key 'no_such_key'"),
    ("max_split_size_mb:abc", "max_split_size_mb", "expected a size in MiB"),
    ("memory_cap_mb:-1", "memory_cap_mb", "a size must not be negative"),
    ("memory_fraction:nan", "memory_fraction", "bad value 'nan'"),
    ("garbage_collection_threshold:inf", "garbage_collection_threshold", "bad value 'inf'"),
    ("memory_fraction:1e999", "memory_fraction", "out of range"),
    ("memory_cap_mb:99999999999999999999999", "memory_cap_mb", "overflows size_t"),
    ("max_split_size_mb:64 junk", "max_split_size_mb", "bad value '64 junk'"),
    ("max_split_size_mb:", "max_split_size_mb", "empty value for max_split_size_mb"),
    ("max_split_size_mb", "max_split_size_mb", "is not key:value"),
    ("release_before_grow:maybe", "release_before_grow", "expected True or False"),
]


@pytest.mark.parametrize("text,key,reason", BAD_CONF_ENTRIES)
def test_row_config_malformed_cudapool_conf_is_named(text, key, reason):
    env = {"CUDAPOOL_CONF": f"max_non_split_rounding_mb:30,{text}"}
    with pytest.raises(ValueError) as info:
        _config.resolve({}, env, use_policy=True)
    message = str(info.value)
    assert message.startswith(f"invalid config option {key!r}") and "(from CUDAPOOL_CONF)" in message, message
    assert reason in message, message


def test_row_config_cudapool_conf_empty_entries_are_skipped_and_a_later_key_wins():
    assert _config.resolve({}, {"CUDAPOOL_CONF": ",, max_split_size_mb:64 ,,"}) == "max_split_size_mb:64"
    assert _config.resolve({}, {"CUDAPOOL_CONF": "  ,  "}) == ""
    assert _config.resolve({}, {"CUDAPOOL_CONF": ""}) == ""
    text = _config.resolve({}, {"CUDAPOOL_CONF": "max_split_size_mb:64,memory_cap_mb:8,max_split_size_mb:128"})
    assert text == "memory_cap_mb:8,max_split_size_mb:128"
    # The C parser, which reads one string, refuses both (test_bad_input.c).
    for text in ("max_split_size_mb:64,,", "max_split_size_mb:64,max_split_size_mb:128"):
        with pytest.raises(ValueError):
            _C.parse_config(text)


BAD_KEYWORDS = [
    ({"max_split_size_mb": math.nan}, "max_split_size_mb", "bad value 'nan'"),
    ({"max_split_size_mb": math.inf}, "max_split_size_mb", "bad value 'inf'"),
    ({"memory_cap_mb": -5}, "memory_cap_mb", "a size must not be negative"),
    ({"memory_cap_mb": 10**30}, "memory_cap_mb", "overflows size_t"),
    ({"memory_cap_mb": None}, "memory_cap_mb", "bad value 'None'"),
    ({"memory_cap_mb": ""}, "memory_cap_mb", "empty value for memory_cap_mb"),
    ({"memory_cap_mb": "8 junk"}, "memory_cap_mb", "bad value '8 junk'"),
    ({"memory_cap_mb": True}, "memory_cap_mb", "bad value 'True'"),
    ({"memory_fraction": 0}, "memory_fraction", "bad value '0'"),
    ({"memory_fraction": math.nan}, "memory_fraction", "bad value 'nan'"),
    ({"no_such_key": 1}, "no_such_key", "unknown key 'no_such_key'"),
]


@pytest.mark.parametrize("config,key,reason", BAD_KEYWORDS)
def test_row_config_malformed_keywords_are_named(config, key, reason):
    for make in (lambda: Pool(64 * MiB, **config), lambda: _config.resolve(config, {}, use_policy=True)):
        with pytest.raises(ValueError) as info:
            make()
        message = str(info.value)
        assert message.startswith(f"invalid config option {key!r}") and reason in message, message


def test_row_config_keyword_with_a_comma_is_refused():
    smuggled = [{"max_split_size_mb": "64,garbage_collection_threshold:0.5"}, {"memory_cap_mb": "8,"}, {"a,b": 1}]
    for config in smuggled:
        for make in (lambda: Pool(64 * MiB, **config), lambda: _config.resolve(config, {})):
            with pytest.raises(ValueError, match="one keyword is one key:value entry"):
                make()
    # Commas inside brackets belong to the value.
    with Pool(64 * MiB, roundup_power2_divisions="[256:1,>:4]") as pool:
        assert "roundup_power2_divisions:[256:1,>:4]" in pool.config()
    with Pool(64 * MiB, roundup_power2_divisions={256: 1, ">": 4}) as pool:
        assert "roundup_power2_divisions:[256:1,>:4]" in pool.config()


def test_row_configure_or_sim_switch_bad_or_late_is_refused():
    ok(
        """
        def refused(fn, kind, text, *args, **kwargs):
            try:
                fn(*args, **kwargs)
            except kind as exc:
                assert text in str(exc), exc
            else:
                raise AssertionError(f"{fn.__name__}{args} was accepted")
        refused(_C.use_sim_devices, ValueError, "need a capacity > 0 and 1..64 devices", 0)
        refused(_C.use_sim_devices, ValueError, "need a capacity > 0 and 1..64 devices", MiB, count=0)
        refused(_C.use_sim_devices, ValueError, "need a capacity > 0 and 1..64 devices", MiB, count=65)
        refused(_C.use_sim_devices, ValueError, "capacity must be non-negative", -1)
        refused(_C.configure, ValueError, "unknown key 'bogus'", "bogus:1")
        refused(_C.configure, ValueError, "embedded null character", "max_split_size_mb:64\\0")
        assert _C.device_pools() == [] and not _C.using_sim_devices()
        _C.use_sim_devices(64 * MiB)
        alloc(1000)
        refused(_C.configure, RuntimeError, "cannot change once a device pool exists", "max_split_size_mb:64")
        refused(_C.use_sim_devices, RuntimeError, "once a device pool exists", 64 * MiB)
        print("OK")
        """
    )


@needs_torch_cuda_build
def test_row_config_enable_with_bad_config_changes_nothing():
    ok(
        """
        import torch
        for config in ({"max_split_size_mb": "64,garbage_collection_threshold:0.5"},
                       {"memory_fraction": math.nan}, {"memory_cap_mb": -1}):
            try:
                cudapool.enable(**config)
            except ValueError as exc:
                assert "invalid config option" in str(exc), exc
            else:
                raise AssertionError(f"enable({config}) was accepted")
            assert not cudapool.enabled()
        os.environ["CUDAPOOL_CONF"] = "max_split_size_mb:nan"
        try:
            cudapool.enable()
        except ValueError as exc:
            assert "(from CUDAPOOL_CONF)" in str(exc) and "max_split_size_mb" in str(exc), exc
        else:
            raise AssertionError("enable() accepted CUDAPOOL_CONF")
        assert not cudapool.enabled() and _C.device_pools() == []
        del os.environ["CUDAPOOL_CONF"]
        cudapool.enable()                            # nothing was swapped before: this works
        assert cudapool.enabled()
        print("OK")
        """
    )


# -- after shutdown / close ---------------------------------------------------------------------


def test_row_after_shutdown_entry_points_warn_or_do_nothing():
    ok(
        SIM2
        + """
        p = alloc(1000)
        q = alloc(1000, device=1)
        handle = _C.device_pool(0)
        assert handle.info()["live_blocks"] == 1
        _C.shutdown()
        assert _C.device_pools() == [] and not _C.using_sim_devices()
        assert handle.info()["live_blocks"] == 0 and handle.check() == 0   # the handle does not dangle
        # every segment went back: the old pointers are no pool's memory any more
        assert stderr_of(lib.cudapool_free, p, 1000, 0, None) == ""
        assert stderr_of(lib.cudapool_record_stream, q, 7) == ""
        assert _C.foreign_pointer_calls() == {"free": 1, "record_stream": 1}
        assert stderr_of(lib.cudapool_empty_cache) == ""
        assert stderr_of(lib.cudapool_init, 2) == ""
        assert allocated(0) == allocated(1) == 0
        cudapool.empty_cache()
        _C.shutdown()                                # twice: nothing left to do
        _C.use_sim_devices(64 * MiB, count=2)        # fresh state: the table works again
        r = alloc(1000)
        assert handle.info()["live_blocks"] == 1                          # it sees the fresh pool
        assert stderr_of(lib.cudapool_free, r, 1000, 0, None) == ""
        print("OK")
        """
    )


def test_row_after_close_sim_pool_methods_raise_value_error():
    pool = Pool(16 * MiB)
    p = pool.alloc(1000)
    pool.close()
    pool.close()  # idempotent
    assert pool.closed and repr(pool) == "<cudapool.sim.Pool closed>"
    calls = [
        lambda: pool.alloc(10),
        lambda: pool.free(p),
        lambda: pool.free(0),
        lambda: pool.record_stream(p, 1),
        lambda: pool.complete(1),
        lambda: pool.complete_all(),
        lambda: pool.fail_nth("reserve", 1),
        lambda: pool.backend_calls(),
        lambda: pool.sim_reserved_bytes(),
        lambda: pool.invalidate_stream(1),
        lambda: pool.empty_cache(),
        lambda: pool.set_memory_cap(1),
        lambda: pool.set_memory_fraction(0.5),
        lambda: pool.memory_stats(),
        lambda: pool.memory_summary(),
        lambda: pool.reset_peak_stats(),
        lambda: pool.reset_accumulated_stats(),
        lambda: pool.info(),
        lambda: pool.check(),
        lambda: pool.check_report(),
        lambda: pool.oom_report(1),
        lambda: pool.config(),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="pool is closed"):
            call()
    assert pool.capacity == 16 * MiB

"""The Python sim pool: cudapool.sim.Pool over cudapool._C.Pool. No torch, no GPU."""

import itertools
from collections import OrderedDict

import cudapool
import pytest
from cudapool import _C
from cudapool.sim import OutOfMemoryError
from cudapool.sim import Pool as SimPool

KiB = 1 << 10
MiB = 1 << 20


def Pool(*args, **kwargs):
    """A simulated pool under torch's built-in rules, which these tests check (sim.Pool's own
    default is cudapool's policy)."""
    kwargs.setdefault("policy", "builtin")
    return SimPool(*args, **kwargs)


METRICS = ("current", "peak", "allocated", "freed")
FAMILIES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
KINDS = ("all", "small_pool", "large_pool")
COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "max_split_size",
)


@pytest.fixture
def pool():
    with Pool(64 * MiB) as p:
        yield p
        assert p.check() == 0, p.check_report()


# -- module ------------------------------------------------------------------------------------


def test_version_is_one_value():
    assert cudapool.__version__ == _C.__version__ == "0.1.0"


def test_module_constants():
    assert _C.STAT_FAMILIES == FAMILIES
    assert _C.POOL_KINDS == KINDS
    assert _C.STAT_METRICS == METRICS
    assert "reserve" in _C.SIM_CALLS
    assert issubclass(_C.OutOfMemoryError, MemoryError)
    assert OutOfMemoryError is _C.OutOfMemoryError


def test_parse_config_round_trip():
    defaults = _C.parse_config("")
    assert "max_split_size_mb" in defaults
    text = _C.parse_config("max_split_size_mb:64,garbage_collection_threshold:0.5")
    assert "max_split_size_mb:64" in text
    assert _C.parse_config(text) == text


def test_parse_config_rejects_unknown_key():
    with pytest.raises(ValueError, match="no_such_key"):
        _C.parse_config("no_such_key:1")


# -- allocation ----------------------------------------------------------------------------------


def test_alloc_free_round_trip(pool):
    p = pool.alloc(1000)
    assert p != 0
    assert pool.info()["live_blocks"] == 1
    pool.free(p)
    assert pool.info()["live_blocks"] == 0
    assert pool.memory_stats()["allocated_bytes.all.current"] == 0


def test_alloc_zero_returns_null(pool):
    assert pool.alloc(0) == 0
    pool.free(0)  # no-op
    assert pool.memory_stats()["allocation.all.current"] == 0


@pytest.mark.parametrize("size", [1, 511, 512, 513, 1000, 4097, 1 * MiB, 1 * MiB + 1, 3 * MiB, 12 * MiB])
def test_addresses_are_512_aligned(pool, size):
    ptrs = [pool.alloc(size) for _ in range(3)]
    assert all(p % 512 == 0 for p in ptrs)
    assert len(set(ptrs)) == 3
    for p in ptrs:
        pool.free(p)


def test_distinct_live_blocks_do_not_overlap(pool):
    sizes = [1000, 512, 70000, 1 * MiB, 2 * MiB + 3, 600]
    spans = sorted((pool.alloc(s), s) for s in sizes)
    for (a, sa), (b, _) in zip(spans, spans[1:]):
        assert a + sa <= b
    for p, _ in spans:
        pool.free(p)


def test_touched_memory_is_usable():
    import ctypes

    with Pool(8 * MiB) as pool:
        p = pool.alloc(4096)
        ctypes.memset(p, 0xAB, 4096)
        assert ctypes.string_at(p, 4) == b"\xab" * 4
        pool.free(p)


def test_no_touch_addresses():
    with Pool(1 << 40, touch_memory=False) as pool:  # a terabyte that is never backed
        p = pool.alloc(100 * MiB)
        assert p % 512 == 0
        assert pool.sim_reserved_bytes() >= 100 * MiB
        pool.free(p)


# -- statistics --------------------------------------------------------------------------------


def test_stats_keys_complete(pool):
    stats = pool.memory_stats()
    expected = {f"{f}.{k}.{m}" for f, k, m in itertools.product(FAMILIES, KINDS, METRICS)}
    expected |= {f"oversize_{x}.{m}" for x in ("allocations", "segments") for m in METRICS}
    expected |= set(COUNTERS)
    assert set(stats) == expected
    assert all(isinstance(v, int) for v in stats.values())


def test_memory_stats_is_sorted_ordered_dict(pool):
    stats = pool.memory_stats()
    assert isinstance(stats, OrderedDict)
    assert list(stats) == sorted(stats)


def test_stats_after_one_small_alloc(pool):
    p = pool.alloc(1000)
    s = pool.memory_stats()
    assert s["allocated_bytes.all.current"] == 1024
    assert s["allocated_bytes.small_pool.current"] == 1024
    assert s["allocated_bytes.large_pool.current"] == 0
    assert s["requested_bytes.all.current"] == 1000
    assert s["reserved_bytes.all.current"] == 2 * MiB
    assert s["segment.small_pool.current"] == 1
    assert s["segment.large_pool.current"] == 0
    assert s["allocation.all.current"] == 1
    assert s["active.all.current"] == 1
    assert s["num_device_alloc"] == 1
    assert s["max_split_size"] == -1
    pool.free(p)
    s = pool.memory_stats()
    assert s["allocated_bytes.all.current"] == 0
    assert s["allocated_bytes.all.peak"] == 1024
    assert s["allocated_bytes.all.allocated"] == 1024
    assert s["allocated_bytes.all.freed"] == 1024
    assert s["reserved_bytes.all.current"] == 2 * MiB  # cached, not returned


def test_stats_large_alloc(pool):
    p = pool.alloc(3 * MiB)
    s = pool.memory_stats()
    assert s["allocated_bytes.large_pool.current"] == 3 * MiB
    assert s["reserved_bytes.large_pool.current"] == 20 * MiB
    assert s["segment.large_pool.current"] == 1
    pool.free(p)


def test_reset_peak_and_accumulated(pool):
    p = pool.alloc(1000)
    pool.free(p)
    pool.reset_peak_stats()
    s = pool.memory_stats()
    assert s["allocated_bytes.all.peak"] == 0
    pool.reset_accumulated_stats()
    s = pool.memory_stats()
    assert s["allocated_bytes.all.allocated"] == 0
    assert s["num_device_alloc"] == 0


def test_info_fields(pool):
    p = pool.alloc(1000)
    info = pool.info()
    assert info["reserved"] == 2 * MiB
    assert info["allocated"] == 1024
    assert info["segments"] == 1
    assert info["device_total"] == 64 * MiB
    pool.free(p)


def test_max_split_size_config():
    with Pool(64 * MiB, max_split_size_mb=32) as pool:
        assert pool.memory_stats()["max_split_size"] == 32 * MiB
        assert "max_split_size_mb:32" in pool.config()


# -- errors --------------------------------------------------------------------------------


def test_free_unknown_pointer_raises_value_error(pool):
    p = pool.alloc(1000)
    with pytest.raises(ValueError):
        pool.free(p + 512)
    with pytest.raises(ValueError):
        pool.free(0x1234_0000)
    pool.free(p)
    with pytest.raises(ValueError):
        pool.free(p)  # double free
    assert pool.info()["live_blocks"] == 0


def test_negative_and_bad_arguments(pool):
    with pytest.raises(ValueError):
        pool.alloc(-1)
    with pytest.raises(ValueError):
        pool.alloc(10, stream=-3)
    with pytest.raises(ValueError):
        pool.free(-512)
    with pytest.raises(OverflowError):
        pool.alloc(1 << 64)
    with pytest.raises(TypeError):
        pool.alloc(1.5)
    with pytest.raises(TypeError):
        pool.alloc("10")
    with pytest.raises(ValueError):
        Pool(-1)


def test_oom_then_pool_still_works():
    with Pool(16 * MiB) as pool:
        with pytest.raises(OutOfMemoryError) as info:
            pool.alloc(64 * MiB)
        assert isinstance(info.value, MemoryError)
        assert str(info.value)
        p = pool.alloc(1000)
        assert p != 0
        pool.free(p)
        s = pool.memory_stats()
        assert s["num_ooms"] == 1
        assert pool.check() == 0


def test_oom_catchable_as_memory_error():
    with Pool(4 * MiB) as pool:
        with pytest.raises(MemoryError):
            pool.alloc(8 * MiB)


def test_oom_report_is_text(pool):
    report = pool.oom_report(1 << 30)
    assert isinstance(report, str) and report


def test_memory_cap():
    with Pool(64 * MiB) as pool:
        pool.set_memory_cap(2 * MiB)
        p = pool.alloc(1000)  # one 2 MiB small segment fits
        with pytest.raises(OutOfMemoryError):
            pool.alloc(3 * MiB)  # a 20 MiB large segment does not
        pool.free(p)
        pool.set_memory_cap(0)
        q = pool.alloc(3 * MiB)
        pool.free(q)
        with pytest.raises(ValueError):
            pool.set_memory_fraction(1.5)


def test_bad_config_key_names_it():
    with pytest.raises(ValueError, match="bogus_option"):
        Pool(16 * MiB, bogus_option=3)


def test_bad_config_value_names_key():
    with pytest.raises(ValueError, match="max_split_size_mb"):
        Pool(16 * MiB, max_split_size_mb="lots")


def test_config_checked_as_a_whole():
    # Valid together although small_size_mb:4 alone exceeds the default 2 MiB segment.
    with Pool(64 * MiB, small_size_mb=4, small_segment_mb=8) as pool:
        assert "small_size_mb:4" in pool.config()
        p = pool.alloc(3 * MiB)
        assert pool.memory_stats()["segment.small_pool.current"] == 1
        pool.free(p)
    with pytest.raises(ValueError, match="max_split_size"):
        Pool(64 * MiB, max_split_size_mb=32, large_segment_mb=40)


def test_roundup_power2_divisions_mapping():
    with Pool(64 * MiB, roundup_power2_divisions={64: 8, ">": 4}) as pool:
        assert "roundup_power2_divisions:[64:8,>:4]" in pool.config()


def test_bool_config_value():
    with Pool(16 * MiB, expandable_segments=False) as pool:
        assert pool.check() == 0


def test_fail_nth_oom_is_retried(pool):
    pool.fail_nth("reserve", 1)
    p = pool.alloc(1000)  # first reserve fails as out of memory; the retry succeeds
    calls = pool.backend_calls()
    assert calls["reserve"] == 2
    s = pool.memory_stats()
    assert s["num_alloc_retries"] == 1
    assert s["num_ooms"] == 0
    pool.free(p)


def test_fail_nth_device_error_is_runtime_error(pool):
    pool.fail_nth("reserve", 1, oom=False)
    with pytest.raises(RuntimeError):
        pool.alloc(1000)
    p = pool.alloc(1000)
    pool.free(p)


def test_fail_nth_unknown_kind(pool):
    with pytest.raises(ValueError, match="reserve"):
        pool.fail_nth("no_such_call", 1)


# -- streams -------------------------------------------------------------------------------


def test_same_stream_reuse_is_immediate(pool):
    p = pool.alloc(1000)
    pool.free(p)
    assert pool.alloc(1000) == p


def test_record_stream_delays_reuse_until_complete(pool):
    p = pool.alloc(1000, stream=0)
    pool.record_stream(p, 7)
    pool.launch(p, 7)  # work there uses it
    pool.free(p)
    assert pool.info()["pending_blocks"] == 1
    q = pool.alloc(1000, stream=0)
    assert q != p  # stream 7 may still be using p
    pool.complete(7)
    r = pool.alloc(1000, stream=0)
    assert r == p  # stream 7's work finished: p comes back
    pool.free(q)
    pool.free(r)


def test_auto_complete_pool_reuses_at_once():
    with Pool(16 * MiB, auto_complete=True) as pool:
        p = pool.alloc(1000)
        pool.record_stream(p, 5)
        pool.launch(p, 5)  # work there uses it
        pool.free(p)
        assert pool.alloc(1000) == p


def test_blocks_are_per_stream(pool):
    p = pool.alloc(1000, stream=1)
    pool.free(p)
    q = pool.alloc(1000, stream=2)
    assert q != p
    pool.free(q)


def test_complete_all(pool):
    p = pool.alloc(1000)
    pool.record_stream(p, 3)
    pool.launch(p, 3)  # work there uses it
    pool.record_stream(p, 4)
    pool.launch(p, 4)  # work there uses it
    pool.free(p)
    pool.complete_all()
    assert pool.alloc(1000) == p


# -- caching and the device ------------------------------------------------------------------


def test_backend_reserve_called_once_with_caching(pool):
    p = pool.alloc(1000)
    pool.free(p)
    q = pool.alloc(1000)
    pool.free(q)
    calls = pool.backend_calls()
    assert calls["reserve"] == 1
    assert calls["release"] == 0


def test_empty_cache_returns_segments(pool):
    ptrs = [pool.alloc(s) for s in (1000, 3 * MiB, 12 * MiB)]
    assert pool.sim_reserved_bytes() > 0
    for p in ptrs:
        pool.free(p)
    pool.empty_cache()
    assert pool.sim_reserved_bytes() == 0
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0
    assert pool.backend_calls()["release"] == pool.backend_calls()["reserve"]


def test_empty_cache_keeps_live_segments(pool):
    p = pool.alloc(1000)
    pool.empty_cache()
    assert pool.sim_reserved_bytes() == 2 * MiB
    pool.free(p)


# -- lifetime ------------------------------------------------------------------------------


def test_close_is_idempotent_and_final():
    pool = Pool(16 * MiB)
    p = pool.alloc(1000)  # live blocks go with the pool
    assert p
    pool.close()
    pool.close()
    assert pool.closed
    with pytest.raises(ValueError, match="pool is closed"):
        pool.alloc(10)
    with pytest.raises(ValueError, match="pool is closed"):
        pool.memory_stats()


def test_context_manager_closes():
    with Pool(16 * MiB) as pool:
        pool.alloc(1000)
    assert pool.closed


def test_raw_simpool():
    sp = _C.Pool(16 * MiB, "max_split_size_mb:32", auto_complete=True)
    assert sp.capacity == 16 * MiB
    assert "max_split_size_mb:32" in sp.config()
    p = sp.alloc(100)
    sp.free(p)
    assert sp.check() == 0
    assert sp.check_report() == ""
    assert sp.sim_live_reservations() == 1
    del sp  # dealloc closes


def test_sim_pool_is_a_c_pool():
    with Pool(16 * MiB) as pool:
        assert isinstance(pool, _C.Pool) and pool.device is None
        assert pool.stats() == dict(pool.memory_stats())


def test_device_handle_of_an_unused_device():
    handle = _C.device_pool(63)  # creates no pool: reads as an empty one
    assert handle.device == 63 and not handle.closed and repr(handle) == "<cudapool._C.Pool device=63>"
    assert 63 not in _C.device_pools()
    assert handle.check() == 0 and handle.check_report() == "" and handle.oom_report(MiB) == ""
    assert all(v == 0 for v in handle.info().values())
    assert all(v == 0 for k, v in handle.stats().items() if k != "max_split_size")
    assert handle.config() == _C.device_config()
    handle.reset_peak_stats()
    handle.reset_accumulated_stats()
    handle.empty_cache()
    assert 63 not in _C.device_pools()
    for call in (
        lambda: handle.alloc(1),
        lambda: handle.free(0),
        lambda: handle.set_memory_cap(0),
        handle.complete_all,
        lambda: handle.fail_nth("reserve", 1),
        handle.backend_calls,
        lambda: handle.replay_start(),
        handle.close,
        lambda: handle.capacity,
    ):
        with pytest.raises(TypeError, match="needs a simulated pool; this Pool is a handle of device 63"):
            call()
    for bad in (-1, 64, 1 << 70):
        with pytest.raises(ValueError, match="invalid device"):
            _C.device_pool(bad)


def test_raw_simpool_bad_config():
    with pytest.raises(ValueError):
        _C.Pool(16 * MiB, "max_split_size_mb:")


def test_many_pools_do_not_leak_state():
    for _ in range(50):
        with Pool(4 * MiB) as pool:
            pool.free(pool.alloc(1000))


# -- the device runs behind the host (Note [Simulated asynchrony]) ------------------------------


def test_empty_cache_waits_for_no_work_and_gives_back_later():
    with Pool(256 * MiB, expandable_segments=True, page_stitching=True) as pool:
        p = pool.alloc(8 * MiB)
        pool.launch(p)  # a kernel on stream 0 uses p, still queued
        pool.free(p)
        reserved = pool.memory_stats()["reserved_bytes.all.current"]
        pool.empty_cache()
        calls = pool.backend_calls()
        assert calls["event_synchronize"] == 0 and calls["release"] == 0  # nothing waited for
        assert pool.memory_stats()["reserved_bytes.all.current"] == reserved  # still in use
        assert pool.device_faults() == []
        pool.complete(0)  # the kernel ran
        pool.empty_cache()
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0
        assert pool.device_faults() == []


def test_launch_on_memory_the_pool_did_not_hand_out_is_a_fault():
    with Pool(64 * MiB) as pool:
        p = pool.alloc(1 * MiB)
        pool.launch(p, stream=3)
        pool.free(p)
        assert pool.device_faults() == []
        pool.launch(p, stream=3)  # use after free: a GPU kernel would corrupt the next owner
        faults = pool.device_faults()
        assert len(faults) == 1 and pool.device_fault_count() == 1
        assert faults[0]["addr"] == p and faults[0]["stream"] == 3
        assert "not handed out" in faults[0]["what"]
        pool.clear_device_faults()
        assert pool.device_faults() == []
        with pytest.raises(ValueError):
            pool.launch(p, size=0)


def test_lag_completes_old_work_on_its_own():
    with Pool(64 * MiB) as pool:
        p = pool.alloc(4096)
        pool.record_stream(p, 5)
        pool.set_lag(1)  # a stream runs at most one launch behind
        pool.launch(p, stream=5)
        pool.free(p)  # waits for stream 5's launch
        assert pool.info()["pending_blocks"] == 1
        q = pool.alloc(8192)
        pool.launch(q, stream=5)  # the second launch: the first has run
        pool.free(q)
        assert pool.alloc(4096) == p


def test_a_dropped_pool_goes_at_once_under_every_policy():
    import weakref

    for policy in ("builtin", "expandable", "cudapool"):
        pool = SimPool(16 * MiB, policy=policy)
        ref = weakref.ref(pool)
        del pool  # no reference cycle of its own: freed without the garbage collector
        assert ref() is None, policy

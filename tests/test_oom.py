"""The out-of-memory report (cudapool.last_oom, cudapool.oom): its figures equal the statistics
at the failure, the exception's text is its "report", and the suggested change, applied, makes
the failing replay fit. All on simulated devices."""

import subprocess
import sys
import textwrap

import pytest
from cudapool import _C, oom
from cudapool.lab import replay
from cudapool.summary import format_all_ranks

MiB = 1 << 20


def fragmenting(pool):
    """Three 20 MiB segments, each left with 9 MiB free | 2 MiB live | 9 MiB free; then 16 MiB.
    Plain segments cannot serve it (60 MiB device); page-mapped ones merge the free neighbours."""
    freed = []
    for _ in range(3):
        freed.append(pool.alloc(9 * MiB))
        pool.alloc(2 * MiB)
        freed.append(pool.alloc(9 * MiB))
    for ptr in freed:
        pool.free(ptr)
    return pool.alloc(16 * MiB)


def failed(pool):
    with pytest.raises(_C.OutOfMemoryError) as info:
        fragmenting(pool)
    return str(info.value)


def test_no_failure_is_none():
    pool = _C.Pool(64 * MiB)
    assert pool.last_oom() is None and oom.analyse(pool) is None


def test_figures_equal_the_statistics_at_the_failure():
    pool = _C.Pool(60 * MiB)
    pool.set_event_log(1024)
    message = failed(pool)
    stats, info = pool.stats(), pool.info()  # nothing changed since the failure
    r = oom.analyse(pool, suggest_change=False)
    assert r["report"] == message
    assert r["requested"] == 16 * MiB and r["stream"] == 0 and r["sequence"] == 1
    assert r["reserved"] == stats["reserved_bytes.all.current"] == info["reserved"] == 60 * MiB
    assert r["allocated"] == stats["allocated_bytes.all.current"] == 6 * MiB
    assert r["cached_free"] == info["cached_free"] == 54 * MiB
    assert r["largest_free_block"] == info["largest_free_block"] == 9 * MiB
    assert r["fragmentation"] == pytest.approx(1 - 9 / 54)
    assert r["pending_free"] == info["pending_free"] == 0
    assert r["segments"] == stats["segment.all.current"] == 3
    assert r["num_ooms"] == stats["num_ooms"] == 1
    assert (r["device_total"], r["device_free"], r["memory_cap"]) == (60 * MiB, 0, 0)
    assert r["streams"] == [
        {
            "stream": 0,
            "cached_free": 54 * MiB,
            "free_blocks": 6,
            "largest_free_block": 9 * MiB,
            "pending_free": 0,
            "pending_blocks": 0,
        }
    ]
    assert r["suggestion"] is None and r["top_sites"] is None
    for text in ("Tried to allocate 16.00 MiB", "60.00 MiB reserved in 3 segments", "fragmentation 83.3%"):
        assert text in message


@pytest.mark.parametrize("log", [4096, 8], ids=["whole-history", "wrapped-log"])
def test_suggested_change_applied_makes_the_failing_replay_fit(log):
    pool = _C.Pool(60 * MiB)
    pool.set_event_log(log)
    failed(pool)
    r = oom.analyse(pool)
    s = r["suggestion"]
    assert s["unavailable"] is None
    if log == 4096:  # the whole history: the replay reproduces the failure
        assert s["baseline"]["oom"] and s["baseline"]["oom_at_request"]
    else:
        # A wrapped log re-allocates the blocks live at its start in address order, and the
        # simulated device's addresses come from the host's mmap: whether that layout fails
        # as the real one did depends on them, and the suggestion says which it was.
        assert isinstance(s["baseline"]["oom"], bool)
    assert s["fits"] and s["change"] == "expandable_segments:True", s
    assert s["capacity"] == 60 * MiB and s["seeded_blocks"] == (0 if log == 4096 else 8)
    assert "set expandable_segments:True" in s["text"]
    trace, why = oom.recent_trace(pool, r)
    assert why == ""
    # the same replay under the suggested configuration fits, under the old one it does not
    assert not replay.replay(trace, policy="builtin", config=s["config"], capacity=s["capacity"])["oom"]
    old = replay.replay(trace, policy="builtin", config=pool.config(), capacity=s["capacity"])["oom"]
    assert old == s["baseline"]["oom"]
    # and the program itself, run again with the change, fits
    again = _C.Pool(60 * MiB, s["change"])
    assert fragmenting(again)
    # cached per failure when asked through a cache key
    assert oom.analyse(pool, cache_key=0) == oom.analyse(pool, cache_key=0)


def test_no_candidate_fits_says_to_reduce():
    pool = _C.Pool(32 * MiB)
    pool.set_event_log(64)
    pool.alloc(20 * MiB)
    with pytest.raises(_C.OutOfMemoryError):
        pool.alloc(20 * MiB)
    s = oom.analyse(pool)["suggestion"]
    assert s["fits"] is False and s["change"] is None
    assert all(not c["fits"] for c in s["candidates"]) and len(s["candidates"]) >= 5
    assert "reduce the batch size" in s["text"]


def test_cap_is_kept_in_the_replay():
    pool = _C.Pool(1 << 30)
    pool.set_event_log(64)
    pool.set_memory_cap(60 * MiB)
    failed(pool)
    r = oom.analyse(pool)
    assert r["memory_cap"] == 60 * MiB and "Memory cap: 60.00 MiB" in r["report"]
    s = r["suggestion"]
    assert s["memory_cap"] == 60 * MiB and s["baseline"]["oom"] and s["change"] == "expandable_segments:True"
    assert "memory_cap_mb:60" in s["config"]


def test_without_a_log_or_past_it_the_suggestion_says_why():
    pool = _C.Pool(60 * MiB)  # a simulated pool keeps no log unless asked
    failed(pool)
    s = oom.analyse(pool)["suggestion"]
    assert s["change"] is None and "no event log" in s["unavailable"]
    pool = _C.Pool(60 * MiB)
    pool.set_event_log(4)
    failed(pool)
    for _ in range(5):
        pool.free(pool.alloc(2 * MiB))
    s = oom.analyse(pool)["suggestion"]
    assert "no longer reaches the failure" in s["unavailable"]


def test_set_event_log_bad_input():
    pool = _C.Pool(MiB)
    with pytest.raises(ValueError, match="more than"):
        pool.set_event_log((1 << 30) + 1)
    with pytest.raises(ValueError):
        pool.set_event_log(-1)
    with pytest.raises(TypeError, match="needs a simulated pool"):
        _C.device_pool(0).set_event_log(4)


def test_top_sites_sums_live_bytes_per_top_frame():
    def frame(name, line):
        return {"filename": "train.py", "line": line, "name": name}

    entries = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [frame("attn", 10), frame("fwd", 3)]},
        {"action": "alloc", "addr": 2, "size": 300, "frames": [frame("mlp", 20)]},
        {"action": "alloc", "addr": 3, "size": 50, "frames": [frame("attn", 10)]},
        {"action": "alloc", "addr": 4, "size": 999, "frames": [frame("attn", 10)]},
        {"action": "free_requested", "addr": 4, "size": 999},
        {"action": "alloc", "addr": 5, "size": 7, "frames": []},
        {"action": "segment_alloc", "addr": 0, "size": 1 << 20},
    ]
    assert oom.top_sites(entries) == [
        {"site": "train.py:20 mlp", "bytes": 300, "allocations": 1},
        {"site": "train.py:10 attn", "bytes": 150, "allocations": 2},
        {"site": "<no stack>", "bytes": 7, "allocations": 1},
    ]
    skip_attn = oom.top_sites(entries, limit=1, skip=lambda f: f["name"] == "attn")
    assert skip_attn == [{"site": "train.py:20 mlp", "bytes": 300, "allocations": 1}]
    with pytest.raises(ValueError):
        oom.top_sites(entries, limit=-1)


SCRIPT = """
import ctypes
import cudapool
from cudapool import _C, _testhooks, oom

MiB = 1 << 20
_C.use_sim_devices(60 * MiB)
lib = ctypes.CDLL(_C.__file__)
lib.cudapool_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
assert cudapool.last_oom() is None
assert _C.event_log_capacity() == 16384

def alloc(n):
    ptr, status, msg = _testhooks.alloc_catching(n, 0, 0)
    return ptr, status, msg

freed = []
for _ in range(3):
    freed.append(alloc(9 * MiB)[0]); alloc(2 * MiB); freed.append(alloc(9 * MiB)[0])
for x in freed:
    lib.cudapool_free(x, 9 * MiB, 0, None)
ptr, status, msg = alloc(16 * MiB)
assert status == 1 and msg.startswith("CUDA out of memory. Tried to allocate 16.00 MiB"), msg
assert "cudapool.last_oom()" in msg
oom.set_history_provider(lambda device: [{"action": "alloc", "addr": 1, "size": 5, "frames": [
    {"filename": "t.py", "line": 1, "name": "f"}]}])
r = cudapool.last_oom()
assert msg == "CUDA out of memory. " + r["report"] + msg[len("CUDA out of memory. ") + len(r["report"]):]
assert r["suggestion"]["change"] == "expandable_segments:True", r["suggestion"]
assert r["top_sites"] == [{"site": "t.py:1 f", "bytes": 5, "allocations": 1}]
print(oom.format_oom(r))
print("OK")
"""


def test_device_pool_last_oom_through_the_torch_entry_point(tmp_path):
    path = tmp_path / "s.py"
    path.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("OK")
    assert "Suggestion (computed by replay): set expandable_segments:True" in proc.stdout


def test_all_ranks_table_min_max_mean_worst():
    base = _C.Pool(MiB).stats()
    ranks = []
    for rank, reserved in ((0, 4 * MiB), (1, 8 * MiB), (2, 8 * MiB)):
        stats = dict(base, **{"reserved_bytes.all.peak": reserved, "num_ooms": rank % 2})
        ranks.append({"rank": rank, "device": rank, "device_name": "simulated device", "stats": stats})
    text = format_all_ranks(list(reversed(ranks)))
    assert "all 3 ranks" in text and "devices: 0, 1, 2 (simulated device)" in text
    row = next(line for line in text.splitlines() if "GPU reserved mem., peak" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:] == ["4.00 MiB", "8.00 MiB", "6.67 MiB", "1"]  # worst: the lowest rank at the max
    row = next(line for line in text.splitlines() if "CUDA OOMs" in line)
    assert [c.strip() for c in row.strip("|").split("|")][1:] == ["0", "1", "0.3", "1"]
    assert all(len(line) == 77 for line in text.splitlines())
    with pytest.raises(ValueError):
        format_all_ranks([])


def _hold_a_lot(pool):
    """The allocation site the top-sites list must name first."""
    held = []
    for _ in range(4):
        held.append(pool.alloc(9 * MiB))
    return held


def test_top_sites_come_from_the_pools_own_history_with_stacks():
    _C.set_history_stacks(True)
    try:
        pool = _C.Pool(60 * MiB)
        pool.set_event_log(256)
        pool.set_history(1000)
        held = _hold_a_lot(pool)
        with pytest.raises(_C.OutOfMemoryError):
            pool.alloc(40 * MiB)
        r = oom.analyse(pool, suggest_change=False)
        sites = r["top_sites"]
        assert sites, r
        assert "_hold_a_lot" in sites[0]["site"] and sites[0]["bytes"] == 36 * MiB and sites[0]["allocations"] == 4
        assert held
    finally:
        _C.set_history_stacks(False)
    # Without stacks, no sites: None, not a guess.
    pool = _C.Pool(60 * MiB)
    pool.set_event_log(256)
    pool.set_history(1000)
    _hold_a_lot(pool)
    with pytest.raises(_C.OutOfMemoryError):
        pool.alloc(40 * MiB)
    assert oom.analyse(pool, suggest_change=False)["top_sites"] is None

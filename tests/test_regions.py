"""Regions, pause and resume from Python (docs/regions.md): cudapool.sim.Pool on the simulated
device, whose memory is host memory a test can read and write, and the device pools behind the
entry points torch calls, in fresh interpreters (simulated devices, no GPU)."""

import ctypes
import os
import subprocess
import sys
import textwrap
import threading

import cudapool
import pytest
from cudapool import _C
from cudapool.policies import config_for
from cudapool.sim import OutOfMemoryError, Pool

MiB = 1 << 20
GiB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = dict(expandable_segments=True, page_stitching=True, release_before_grow=True)


def pool(capacity=512 * MiB, **config):
    return Pool(capacity, **(config or DEFAULT))


def write(ptr, data):
    ctypes.memmove(ptr, data, len(data))


def read(ptr, n):
    return ctypes.string_at(ptr, n)


def region(p, tag):
    return {r["tag"]: r for r in p.regions()}[tag]


def test_backup_round_trips_every_byte_at_the_same_address():
    with pool() as p:
        with cudapool.region("kv_cache"):
            blocks = [p.alloc(n) for n in (64 * MiB, 3 * MiB + 123, 4096, 17)]
        other = p.alloc(8 * MiB)
        payload = {b: os.urandom(n) for b, n in zip(blocks, (64 * MiB, 3 * MiB + 123, 4096, 17))}
        for b, data in payload.items():
            write(b, data)
        write(other, b"x" * 100)
        before = region(p, "kv_cache")
        reserved = p.memory_stats()["reserved_bytes.all.current"]
        p.pause("kv_cache", backup=True)
        paused = region(p, "kv_cache")
        assert paused["paused"] and paused["reserved_bytes"] == 0
        assert paused["paused_bytes"] == before["reserved_bytes"]  # >= 99 %: all of it
        assert paused["backup_bytes"] == sum(len(d) for d in payload.values())
        assert p.memory_stats()["reserved_bytes.all.current"] == reserved - before["reserved_bytes"]
        assert p.sim_reserved_bytes() == reserved - before["reserved_bytes"]  # the device has it back
        assert read(other, 100) == b"x" * 100  # the rest of the pool is untouched
        p.resume("kv_cache")
        for b, data in payload.items():
            assert read(b, len(data)) == data
        assert region(p, "kv_cache")["reserved_bytes"] == before["reserved_bytes"]
        assert p.device_faults() == []
        assert p.check() == 0
        for b in blocks + [other]:
            p.free(b)


def test_pause_waits_for_queued_work_stream_ordered():
    with pool() as p:
        with cudapool.region("weights"):
            w = p.alloc(32 * MiB)
        a = p.alloc(4 * MiB, stream=3)
        p.launch(w, stream=0)  # its allocation stream: still running when the pause comes
        p.record_stream(w, 2)
        p.launch(w, stream=2)
        p.launch(a, stream=3)  # another stream's work: not waited for
        p.pause("weights")
        assert p.device_faults() == []
        calls = p.backend_calls()
        assert calls["release"] == 0  # nothing waits for the whole device
        p.resume("weights")
        p.complete_all()
        p.free(w)
        p.free(a)


def test_work_on_a_stream_never_declared_is_what_a_gpu_would_fault_on():
    # The contract torch's allocator has for frees: memory used on another stream is declared
    # with record_stream. Without it the pause cannot know that stream's work, and the
    # simulated device reports the unmap under queued work, as a GPU would fault.
    with pool() as p:
        with cudapool.region("weights"):
            w = p.alloc(32 * MiB)
        p.launch(w, stream=1)
        p.pause("weights")
        faults = p.device_faults()
        assert [(f["call"], f["stream"]) for f in faults] == [("page_unmap", 1)]
        p.clear_device_faults()
        p.complete_all()
        p.resume("weights")
        p.free(w)


def test_paused_region_refuses_allocations_and_faults_on_touch():
    with pool() as p:
        with cudapool.region("kv"):
            k = p.alloc(8 * MiB)
        p.pause("kv")
        with cudapool.region("kv"):
            with pytest.raises(RuntimeError, match='region "kv" is paused'):
                p.alloc(1024)
        p.launch(k, stream=0)  # a kernel on paused memory: a device fault, as on a GPU
        assert [f["what"] for f in p.device_faults()] == [
            "launch on memory that is not the device's (not reserved, or not mapped with access)"
        ]
        p.clear_device_faults()
        p.free(k)  # frees work while paused
        p.resume("kv")
        with cudapool.region("kv"):
            assert p.alloc(8 * MiB) == k  # its memory serves the region again
        p.free(k)


def test_regions_nest_and_are_per_thread():
    assert cudapool.current_region() is None
    with cudapool.region("outer"):
        assert cudapool.current_region() == "outer"
        with cudapool.region("inner"):
            assert cudapool.current_region() == "inner"
            seen = []
            t = threading.Thread(target=lambda: seen.append(cudapool.current_region()))
            t.start()
            t.join()
            assert seen == [None]  # another thread is not in it
        assert cudapool.current_region() == "outer"
    assert cudapool.current_region() is None
    r = cudapool.region("reused")  # one object, entered twice, nested
    with r:
        with r:
            assert cudapool.current_region() == "reused"
        assert cudapool.current_region() == "reused"
    assert cudapool.current_region() is None


def test_summary_snapshot_and_stats_keep_torch_keys():
    with pool() as p:
        with cudapool.region("kv_cache"):
            k = p.alloc(20 * MiB)
        keys = set(p.memory_stats())
        p.pause("kv_cache", backup=True)
        assert set(p.memory_stats()) == keys
        text = p.memory_summary()
        assert "Regions of device 0" in text
        row = [line for line in text.splitlines() if line.startswith("| kv_cache")][0]
        assert "paused" in row and "20.00 MiB" in row
        assert all(len(line) == 77 for line in text.splitlines())
        segs = [s for s in p.snapshot() if s["region"] == "kv_cache"]
        assert segs and all(s["paused"] == s["mapped"] for s in segs)
        assert p.info()["paused_bytes"] == 20 * MiB and p.info()["backup_bytes"] == 20 * MiB
        from cudapool.snapshots import segments_of

        torch_style = segments_of(p.snapshot(), 0, {})
        assert [s["is_paused"] for s in torch_style if s["region"] == "kv_cache"] == [True]
        assert not any(s["is_paused"] for s in torch_style if s["region"] is None)
        p.resume("kv_cache")
        assert all(s["paused"] == 0 for s in p.snapshot())
        p.free(k)


def test_bad_input():
    with pytest.raises(TypeError, match="a region's tag is a str"):
        cudapool.region(123)
    with pytest.raises(ValueError, match="1 to 127 characters"):
        cudapool.region("")
    with pytest.raises(ValueError, match="control characters"):
        cudapool.region("a\tb")
    with pool() as p:
        with pytest.raises(TypeError, match="tags are a str, a list of str or None"):
            p.pause(5)
        with pytest.raises(TypeError, match="a tag is a str"):
            p.pause(["kv_cache", 7])
        with pytest.raises(ValueError, match="an empty list of tags"):
            p.pause([])
        with pytest.raises(TypeError, match="backup is True, False or None"):
            p.pause("kv_cache", backup="yes")
        cudapool.region("known_but_unused")
        p.pause("known_but_unused")  # a region this pool never served: nothing to do
        p.resume("known_but_unused")
        for call in (p.pause, p.resume, p.wake_up):
            with pytest.raises(ValueError, match="no region is named 'kv_cahce'") as err:
                call(["kv_cache", "kv_cahce"])  # a typo pauses nothing, and says so
            assert "'known_but_unused'" in str(err.value)
        assert not any(r["paused"] for r in p.regions())
    with Pool(64 * MiB, policy="builtin") as plain:  # plain segments
        with cudapool.region("kv"):
            with pytest.warns(RuntimeWarning, match="no page-mapped memory"):
                q = plain.alloc(MiB)  # served untagged, and it says so once
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("error")
                plain.free(plain.alloc(MiB))  # once only
        with pytest.raises(RuntimeError, match="no page-mapped memory"):
            plain.pause("kv")
        plain.free(q)


def test_resume_without_room_stays_paused_and_keeps_the_backup():
    with pool(96 * MiB) as p:
        with cudapool.region("kv"):
            k = p.alloc(40 * MiB)
        write(k, b"keep me")
        p.pause("kv", backup=True)
        hog = p.alloc(80 * MiB)
        with pytest.raises(cudapool.sim.OutOfMemoryError, match="it stays paused"):
            p.resume("kv")
        assert region(p, "kv")["paused"] and region(p, "kv")["backup_bytes"] == 40 * MiB
        p.free(hog)
        p.empty_cache()
        p.resume("kv")
        assert read(k, 7) == b"keep me"
        p.free(k)


@pytest.mark.parametrize("kind", ["page_create", "page_map", "page_set_access", "copy_to_device"])
def test_injected_failure_at_resume_leaves_it_paused(kind):
    with pool() as p:
        with cudapool.region("kv"):
            k = p.alloc(30 * MiB)
        write(k, b"payload")
        p.pause("kv", backup=True)
        p.fail_nth(kind, 1, oom=False)
        with pytest.raises(RuntimeError):
            p.resume("kv")
        assert region(p, "kv")["paused"] and region(p, "kv")["reserved_bytes"] == 0
        assert p.check() == 0
        p.resume("kv")
        assert read(k, 7) == b"payload"
        p.free(k)


def test_one_gibibyte_calls():
    """The issue's count: one unmap per stretch, one map and one access call per stretch."""
    with Pool(4 * GiB, touch_memory=False, **DEFAULT) as p:
        with cudapool.region("big"):
            blocks = [p.alloc(64 * MiB) for _ in range(16)]
        before = p.backend_calls()
        p.pause("big")
        mid = p.backend_calls()
        p.resume("big")
        after = p.backend_calls()
        assert mid["page_unmap"] - before["page_unmap"] == 1
        assert mid["event_synchronize"] - before["event_synchronize"] == 1
        assert after["page_map"] - mid["page_map"] == 1
        assert after["page_set_access"] - mid["page_set_access"] == 1
        assert after["release"] == before["release"]
        for b in blocks:
            p.free(b)


def test_threads_pause_resume_allocate():
    errors = []
    with pool(1 << 30) as p:
        p.set_lag(0)

        def worker(tag):
            try:
                for i in range(20):
                    with cudapool.region(tag):
                        blocks = [p.alloc((j + 1) * MiB) for j in range(3)]
                    for b in blocks:
                        write(b, tag.encode())
                    p.pause(tag, backup=bool(i % 2))
                    p.resume(tag)
                    for b in blocks:
                        if i % 2 and read(b, len(tag)) != tag.encode():
                            errors.append(f"{tag}: bytes lost")
                        p.free(b)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(f"{tag}: {exc!r}")

        threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert p.check() == 0 and p.device_faults() == []


DEVICE_SCRIPT = r"""
import ctypes
import cudapool
from cudapool import _C, _testhooks
from cudapool.policies import config_for

_C.configure(config_for("cudapool"))
_C.use_sim_devices(512 << 20, count=2, auto_complete=False)
MiB = 1 << 20

def alloc(size, device, stream=0):
    ptr, status, msg = _testhooks.alloc_catching(size, device, stream)
    assert status == 0, msg
    return ptr

with cudapool.region("kv_cache"):
    kv = [alloc(40 * MiB, d) for d in (0, 1)]
with cudapool.region("model"):
    weights = [alloc(24 * MiB, d) for d in (0, 1)]
for d, p in enumerate(kv + weights):
    ctypes.memmove(p, bytes([65 + d]) * 4096, 4096)
_testhooks.sim_launch(0, 0, kv[0], 40 * MiB)       # work still queued on device 0
reserved = [cudapool.memory_reserved(d) for d in (0, 1)]
cudapool.pause("kv_cache", backup=True)             # both devices
assert _testhooks.sim_device_faults(0) == 0
for d in (0, 1):
    assert cudapool.memory_reserved(d) == reserved[d] - 40 * MiB, (d, cudapool.memory_reserved(d))
rows = {(r["device"], r["tag"]): r for r in cudapool.regions()}
assert rows[(0, "kv_cache")]["paused"] and rows[(1, "kv_cache")]["paused"]
assert not rows[(0, "model")]["paused"]
print(cudapool.memory_summary(0).splitlines()[-3])
with cudapool.region("kv_cache"):
    ptr, status, msg = _testhooks.alloc_catching(MiB, 0, 0)
assert ptr == 0 and status != 0 and 'region "kv_cache" is paused' in msg, msg
cudapool.resume("kv_cache", device=1)
assert not {(r["device"], r["tag"]): r for r in cudapool.regions()}[(1, "kv_cache")]["paused"]
cudapool.resume()                                   # every paused region
for d, p in enumerate(kv + weights):
    assert ctypes.string_at(p, 4096) == bytes([65 + d]) * 4096
assert [cudapool.memory_reserved(d) for d in (0, 1)] == reserved
for d, p in enumerate(kv + weights):
    _testhooks.sim_complete_all(d % 2)
print("OK")
"""


def test_device_pools_of_several_devices(tmp_path):
    script = tmp_path / "devices.py"
    script.write_text(textwrap.dedent(DEVICE_SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDAPOOL_CONF", None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK")
    assert "kv_cache" in proc.stdout and "paused" in proc.stdout


def test_pause_needs_the_allocator():
    if _C.using_sim_devices() or cudapool.enabled():
        pytest.skip("this process's device pools are set up already")
    with pytest.raises(RuntimeError, match="call cudapool.enable"):
        cudapool.pause("kv")


def test_policy_string_is_the_default():
    assert config_for("cudapool") == "expandable_segments:True,page_stitching:True,release_before_grow:True"


# -- regions as RL frameworks use them ------------------------------------------------------------


def test_sim_pool_defaults_to_cudapools_policy_as_enable_does():
    with Pool(64 * MiB) as p:
        assert p.config() == _C.parse_config(config_for("cudapool")), p.config()
        assert p.info()["page_mapped"] == 1
        with cudapool.region("default_policy"):
            q = p.alloc(MiB)
        assert [r["tag"] for r in p.regions()] == ["default_policy"]  # tagged, not served untagged
        p.pause("default_policy")
        p.resume("default_policy")
        p.free(q)
    with Pool(64 * MiB, policy="expandable") as p:
        assert "expandable_segments:True" in p.config() and "page_stitching:True" not in p.config()
    with pytest.raises(ValueError, match="unknown policy 'fast'"):
        Pool(64 * MiB, policy="fast")
    with pytest.raises(TypeError, match="policy is the name of a policy"):
        Pool(64 * MiB, policy=3)


def test_pause_and_resume_take_lists_of_tags():
    with pool() as p:
        held = {}
        for tag in ("list_a", "list_b", "list_c"):
            with cudapool.region(tag):
                held[tag] = p.alloc(4 * MiB)
            write(held[tag], tag.encode() * 100)
        p.pause(["list_a", "list_b"], backup=True)
        state = {r["tag"]: r["paused"] for r in p.regions()}
        assert state == {"list_a": True, "list_b": True, "list_c": False}, state
        p.resume(("list_b",))
        assert read(held["list_b"], 600) == b"list_b" * 100
        p.resume(["list_a", "list_a"])  # a tag twice is resumed once
        assert read(held["list_a"], 600) == b"list_a" * 100
        assert not any(r["paused"] for r in p.regions())
        for ptr in held.values():
            p.free(ptr)


def test_a_regions_backup_default():
    with pool() as p:
        with cudapool.region("weights_bk", backup=True):
            w = p.alloc(8 * MiB)
        with cudapool.region("scratch_bk"):
            s = p.alloc(8 * MiB)
        write(w, b"W" * 4096)
        write(s, b"S" * 4096)
        p.pause()  # every region, each with its own default
        rows = {r["tag"]: r for r in p.regions()}
        assert rows["weights_bk"]["backup_bytes"] >= 8 * MiB and rows["scratch_bk"]["backup_bytes"] == 0, rows
        p.resume()
        assert read(w, 4096) == b"W" * 4096  # backed up; scratch's bytes are undefined
        p.pause("weights_bk", backup=False)  # an explicit backup= wins over the default
        assert {r["tag"]: r for r in p.regions()}["weights_bk"]["backup_bytes"] == 0
        p.resume("weights_bk")
        with pytest.raises(TypeError, match="backup is True, False or None"):
            cudapool.region("weights_bk", backup=1)
        p.free(w)
        p.free(s)


def test_sleep_levels_and_wake_up_as_vllm():
    with pool(256 * MiB) as p:
        with cudapool.region("weights"):
            w = p.alloc(32 * MiB)
        with cudapool.region("kv_cache"):
            kv = p.alloc(64 * MiB)
        write(w, b"weights!" * 512)
        p.sleep(level=1)  # weights backed up and released, KV cache released
        rows = {r["tag"]: r for r in p.regions()}
        assert rows["weights"]["paused"] and rows["kv_cache"]["paused"]
        assert rows["weights"]["backup_bytes"] >= 32 * MiB and rows["kv_cache"]["backup_bytes"] == 0
        assert rows["weights"]["reserved_bytes"] == 0 and rows["kv_cache"]["reserved_bytes"] == 0
        p.wake_up(["weights"])  # vLLM: weights first, the KV cache once they are updated
        assert read(w, 4096) == b"weights!" * 512
        assert {r["tag"]: r["paused"] for r in p.regions()}["kv_cache"]
        p.wake_up(["kv_cache"])
        p.sleep(level=2)  # both released, nothing backed up
        assert all(r["backup_bytes"] == 0 and r["paused"] for r in p.regions() if r["tag"] in ("weights", "kv_cache"))
        p.wake_up()
        assert not any(r["paused"] for r in p.regions())
        with pytest.raises(ValueError, match="level is 1 or 2"):
            p.sleep(level=3)
        with pytest.raises(ValueError, match="neither 'w2' nor 'kv2' is a region"):
            p.sleep(weights="w2", kv_cache="kv2")
        p.free(w)
        p.free(kv)


def test_resume_gives_back_cached_memory_before_failing():
    with pool(96 * MiB) as p:
        with cudapool.region("ladder"):
            keep = p.alloc(40 * MiB)
        write(keep, b"L" * 4096)
        p.pause("ladder", backup=True)
        hog = p.alloc(80 * MiB)  # untagged memory takes the device
        p.free(hog)
        p.complete_all()
        assert p.info()["reserved"] >= 80 * MiB  # cached, not given back yet
        p.resume("ladder")  # gives the cached memory back, then resumes
        assert read(keep, 4096) == b"L" * 4096
        p.pause("ladder", backup=True)
        hog = p.alloc(80 * MiB)  # in use this time: nothing to give back
        with pytest.raises(OutOfMemoryError, match="stays paused"):
            p.resume("ladder")
        assert {r["tag"]: r["paused"] for r in p.regions()}["ladder"]
        p.free(hog)
        p.complete_all()
        p.resume("ladder")
        assert read(keep, 4096) == b"L" * 4096
        p.free(keep)


def test_device_pools_lists_sleep_and_wake_up_and_the_untagged_warning():
    code = """
import ctypes, warnings, cudapool
from cudapool import _C
MiB = 1 << 20
_C.use_sim_devices(256 * MiB, count=1)
from cudapool.policies import config_for
_C.configure(config_for("cudapool"))  # as enable() would: the device pools page-mapped
lib = ctypes.CDLL(_C.__file__)
lib.cudapool_alloc_catching.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
def alloc(n):
    out = ctypes.c_void_p(); buf = ctypes.create_string_buffer(512)
    assert lib.cudapool_alloc_catching(n, 0, None, ctypes.byref(out), buf, 512) == 0, buf.value
    return out.value
with cudapool.region("weights"):
    w = alloc(16 * MiB)
with cudapool.region("kv_cache"):
    kv = alloc(32 * MiB)
ctypes.memmove(w, b"w" * 64, 64)
cudapool.sleep(1)
rows = {r["tag"]: r for r in cudapool.regions()}
assert rows["weights"]["paused"] and rows["weights"]["backup_bytes"] >= 16 * MiB, rows
assert rows["kv_cache"]["paused"] and rows["kv_cache"]["backup_bytes"] == 0, rows
cudapool.wake_up(["weights", "kv_cache"])
assert ctypes.string_at(w, 64) == b"w" * 64
cudapool.pause(["kv_cache"])
cudapool.resume(["kv_cache"])
try:
    cudapool.pause("kv_cahce")
except ValueError as exc:
    assert "no region is named 'kv_cahce'" in str(exc), exc
else:
    raise AssertionError("a typo was accepted")
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr
    warn = """
import warnings, cudapool
from cudapool import _C
_C.use_sim_devices(64 << 20, count=1)
try:
    import torch  # noqa: F401
except ImportError:
    print("OK"); raise SystemExit
if not hasattr(torch._C, "_cuda_customAllocator"):
    print("OK"); raise SystemExit
cudapool.enable(policy="builtin")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with cudapool.region("untagged_here"):
        pass
    with cudapool.region("untagged_here"):
        pass
messages = [str(w.message) for w in caught if "no page-mapped memory" in str(w.message)]
assert len(messages) == 1 and "policy" in messages[0], [str(w.message) for w in caught]
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", warn], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr

"""The bridge: cudapool as torch's own allocator (csrc/bridge/bridge.cpp), without a GPU.

Each scenario runs in a fresh interpreter with two simulated devices behind the device table,
cudapool enabled through the bridge. torch's C++ entry points that need no CUDA runtime
(``torch._C._cuda_memoryStats``, the resets, ``_cuda_memorySnapshot``, ``_cuda_getAllocatorBackend``)
are called as torch's own code calls them; the bridge methods that torch reaches only through
CUDA's initialisation (allocate with the current stream, recordHistory, MemPool, cacheInfo, ...)
are called on torch's current allocator through the bridge's test hooks
(csrc/bridge_testhooks/, the library cudapool._torch_bridge_testhooks), which run the bridge's own code with the device and stream
given. GPU tests of the same features are in tests/test_gpu.py.
"""

import textwrap

import pytest
from scenario import expect_ok, run_python

torch = pytest.importorskip("torch", reason="torch is not installed")
if not hasattr(torch._C, "_cuda_customAllocator"):
    pytest.skip(f"torch {torch.__version__} is a CPU-only build", allow_module_level=True)

from cudapool import _torch_libraries  # noqa: E402

if _torch_libraries.torch_bridge_library_path() is None:
    pytest.skip("cudapool._torch_bridge was not built (no CUDA build of torch at build time)", allow_module_level=True)

TIMEOUT_S = 180

PRELUDE = """
import ctypes, os, pickle, struct, sys, warnings
import torch
import cudapool
from cudapool import _C, _torch, _torch_libraries
MiB = 1 << 20
_C.use_sim_devices(CAPACITY, count=2)
with warnings.catch_warnings(record=True) as enable_warnings:
    warnings.simplefilter("always")
    cudapool.enable(policy=POLICY)
assert _torch.allocator_path() == "bridge", _torch.allocator_path()
br = ctypes.CDLL(_torch_libraries.library_path("_torch_bridge_testhooks"))
br.cudapool_bridge_test_allocate.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
br.cudapool_bridge_test_free.argtypes = [ctypes.c_void_p]
br.cudapool_bridge_test_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
br.cudapool_bridge_test_record_history.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_size_t,
                                                   ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
br.cudapool_bridge_test_call.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                         ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p, ctypes.c_size_t]

class BridgeError(Exception):
    pass

def alloc(size, device=0, stream=0):
    out = ctypes.c_void_p()
    buf = ctypes.create_string_buffer(4096)
    rc = br.cudapool_bridge_test_allocate(size, device, stream, ctypes.byref(out), buf, len(buf))
    if rc:
        raise BridgeError(rc, buf.value.decode())
    return out.value or 0

def free(ptr):
    assert br.cudapool_bridge_test_free(ptr) == 0, ptr

def call(name, device=0, a=0, b=0):
    out = (ctypes.c_uint64 * 2)()
    buf = ctypes.create_string_buffer(4096)
    rc = br.cudapool_bridge_test_call(name.encode(), device, a, b, out, buf, len(buf))
    if rc:
        raise BridgeError(rc, buf.value.decode())
    return out[0], out[1]

def double_bits(f):  # a double as the test hooks take one (a fraction): its 64 bits
    return struct.unpack("<Q", struct.pack("<d", f))[0]

def bits_double(b):
    return struct.unpack("<d", struct.pack("<Q", b))[0]

def refused(name, *args):
    try:
        call(name, *args)
    except BridgeError as exc:
        return exc.args[1]
    raise AssertionError(f"{name} was not refused")

def history(enabled=True, stacks=True, when=3, entries=1000, clear=False, skip=""):
    buf = ctypes.create_string_buffer(4096)
    rc = br.cudapool_bridge_test_record_history(int(enabled), int(stacks), when, entries, int(clear),
                                                skip.encode(), buf, len(buf))
    assert rc == 0, buf.value

def flat(nested, prefix=""):
    out = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            out.update(flat(value, prefix + str(key) + "."))
        else:
            out[prefix + str(key)] = value
    return out
"""


def ok(code: str, policy: str = "builtin", capacity: int = 64 << 20, env: dict = None) -> str:
    head = PRELUDE.replace("CAPACITY", str(capacity)).replace("POLICY", repr(policy))
    return expect_ok(run_python(head + textwrap.dedent(code), timeout=TIMEOUT_S, env=env))


def test_enable_installs_the_bridge_and_patches_nothing():
    ok(
        """
        assert not [str(w.message) for w in enable_warnings], [str(w.message) for w in enable_warnings]
        assert torch._C._cuda_getAllocatorBackend() == "cudapool"
        assert torch.cuda.memory.get_allocator_backend() == "cudapool"
        # torch's own functions are torch's: the bridge answers underneath them
        import torch.cuda.memory as tcm
        assert tcm.memory_stats.__module__ == "torch.cuda.memory", tcm.memory_stats
        assert torch.cuda.memory_summary.__module__ == "torch.cuda.memory"
        assert tcm._snapshot.__module__ == "torch.cuda.memory"
        assert torch._C._cuda_checkPoolLiveAllocations.__module__ != "cudapool._torch"
        assert not _torch._state.originals
        assert cudapool._torch.oom_error_type() == "torch.OutOfMemoryError"
        assert call("name")[0] == 1
        cudapool.enable()  # again: a no-op
        assert br.cudapool_bridge_is_current() == 1
        # the device-generic registry names the bridge too (torch.accelerator, storages for a device)
        T = os.path.dirname(torch.__file__) + "/lib/"
        c10 = ctypes.CDLL(T + "libc10.so")
        get = c10._ZN3c1012GetAllocatorERKNS_10DeviceTypeE
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.POINTER(ctypes.c_int8)]
        current = ctypes.c_void_p.in_dll(ctypes.CDLL(T + "libc10_cuda.so"), "_ZN3c104cuda20CUDACachingAllocator9allocatorE")
        assert get(ctypes.byref(ctypes.c_int8(1))) == current.value    # DeviceType::CUDA is 1
        print("OK")
        """
    )


def test_torchs_cpp_statistics_and_resets_answer_from_the_pool():
    ok(
        """
        lib = ctypes.CDLL(_C.__file__)
        lib.cudapool_alloc.restype = ctypes.c_void_p
        lib.cudapool_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudapool_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        empty = flat(torch._C._cuda_memoryStats(0))
        assert empty["allocated_bytes.all.current"] == 0 and empty["num_ooms"] == 0
        assert alloc(0) == 0 and alloc(0, device=99) == 0    # size 0: a null DataPtr, as torch's
        a = alloc(1000)                       # through the bridge's DataPtr path
        b = alloc(3 * MiB)
        c = lib.cudapool_alloc(5 * MiB, 0, None)   # and through the C entry point
        d = alloc(2 * MiB, device=1)
        s = flat(torch._C._cuda_memoryStats(0))
        ours = dict(cudapool.memory_stats(0))
        common = set(s) & set(ours)
        assert {k for k in s if not k.startswith("reserved_bytes_by_private_pools")} == set(ours), (
            set(s) ^ set(ours))
        assert all(s[k] == ours[k] for k in common), {k: (s[k], ours[k]) for k in common if s[k] != ours[k]}
        assert s["allocated_bytes.all.current"] == 1024 + 3 * MiB + 5 * MiB
        assert s["allocation.small_pool.current"] == 1 and s["allocation.large_pool.current"] == 2
        assert s["max_split_size"] == -1
        assert flat(torch._C._cuda_memoryStats(1))["allocated_bytes.all.current"] == 2 * MiB
        free(b)
        lib.cudapool_free(c, 5 * MiB, 0, None)
        s = flat(torch._C._cuda_memoryStats(0))
        assert s["allocated_bytes.all.peak"] == 1024 + 8 * MiB and s["allocated_bytes.all.current"] == 1024
        torch._C._cuda_resetPeakMemoryStats(0)
        s = flat(torch._C._cuda_memoryStats(0))
        assert s["allocated_bytes.all.peak"] == 1024, s["allocated_bytes.all.peak"]
        try:
            alloc(200 * MiB)
        except BridgeError as exc:
            assert exc.args[0] == 2 and exc.args[1].startswith("CUDA out of memory. Tried to allocate"), exc
        else:
            raise AssertionError("200 MiB fitted in 64")
        assert flat(torch._C._cuda_memoryStats(0))["num_ooms"] == 1
        torch._C._cuda_resetAccumulatedMemoryStats(0)
        s = flat(torch._C._cuda_memoryStats(0))
        assert s["num_ooms"] == 0 and s["allocated_bytes.all.allocated"] == 0
        assert s["allocated_bytes.all.current"] == 1024
        free(a)
        free(d)
        assert flat(torch._C._cuda_memoryStats(0))["allocated_bytes.all.current"] == 0
        assert _C.device_pool(0).check() == 0 and _C.device_pool(1).check() == 0
        print("OK")
        """
    )


def test_snapshot_through_torch_in_torchs_format_and_memory_viz():
    out = ok(
        """
        a = alloc(1000)
        b = alloc(12 * MiB)
        c = alloc(4 * MiB)
        free(c)
        snap = torch.cuda.memory._snapshot()
        assert set(snap) >= {"segments", "device_traces"}, set(snap)
        segs = snap["segments"]
        assert segs and all(s["device"] == 0 for s in segs)
        assert all(s["is_expandable"] for s in segs), segs   # the default policy: page-mapped
        for s in segs:
            assert s["total_size"] == sum(blk["size"] for blk in s["blocks"])
            assert s["allocated_size"] == sum(blk["size"] for blk in s["blocks"] if blk["state"] == "active_allocated")
        blocks = {blk["address"]: blk for s in segs for blk in s["blocks"]}
        assert blocks[a]["state"] == "active_allocated" and blocks[a]["requested_size"] == 1000
        assert blocks[b]["size"] == 12 * MiB
        mapped = sum(s["total_size"] for s in segs)
        assert mapped == flat(torch._C._cuda_memoryStats(0))["reserved_bytes.all.current"], mapped
        import tempfile
        path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            assert pickle.load(f)["segments"]
        from torch.cuda import _memory_viz
        html = _memory_viz.segment_plot(snap)
        assert "<html" in html.lower() or "<script" in html.lower(), html[:200]
        print("settings", snap.get("allocator_settings"))
        free(a); free(b)
        print("OK")
        """,
        policy="cudapool",
    )
    assert "page_stitching:True" in out


def test_history_with_torchs_stacks_on_and_off():
    ok(
        """
        assert not torch._C._cuda_isHistoryEnabled()
        def allocate_here():
            return alloc(3 * MiB)
        history(when=3)                               # RecordContext.ALL
        assert torch._C._cuda_isHistoryEnabled()
        p = allocate_here()
        q = alloc(1 * MiB)
        free(q)
        snap = torch._C._cuda_memorySnapshot(None)
        trace = snap["device_traces"][0]
        actions = [e["action"] for e in trace]
        assert "segment_alloc" in actions and "alloc" in actions and "free_requested" in actions, actions
        alloc_entry = [e for e in trace if e["action"] == "alloc" and e["addr"] == p][0]
        names = [f["name"] for f in alloc_entry["frames"]]
        assert "allocate_here" in names, names
        free_entry = [e for e in trace if e["action"] == "free_requested" and e["addr"] == q][0]
        assert free_entry["frames"], free_entry
        assert all(e["time_us"] > 1.5e15 for e in trace), trace[0]       # microseconds since the epoch
        block = [blk for s in snap["segments"] for blk in s["blocks"] if blk["address"] == p][0]
        assert "allocate_here" in [f["name"] for f in block["frames"]], block
        # STATE: stacks for live blocks only, none in the trace
        history(when=1, clear=True)
        r = allocate_here()
        snap = torch._C._cuda_memorySnapshot(None)
        assert all(not e.get("frames") for e in snap["device_traces"][0]), snap["device_traces"][0]
        block = [blk for s in snap["segments"] for blk in s["blocks"] if blk["address"] == r][0]
        assert "allocate_here" in [f["name"] for f in block["frames"]], block
        # skip_actions, and no stacks at all
        history(stacks=False, when=0, clear=True, skip="free_requested")
        free(r)
        snap = torch._C._cuda_memorySnapshot(None)
        assert [e for e in snap["device_traces"][0] if e["action"] == "free_completed"]
        assert not [e for e in snap["device_traces"][0] if e["action"] == "free_requested"]
        assert all(not e.get("frames") for e in snap["device_traces"][0])
        history(enabled=False)
        assert not torch._C._cuda_isHistoryEnabled()
        assert torch._C._cuda_memorySnapshot(None)["device_traces"][0] == []
        free(p)
        print("OK")
        """
    )


TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
TORCH_2_13 = TORCH_VERSION >= (2, 13)  # capture marks, allocateWithAddress, getContextForPointer (bridge_state.h)
TORCH_2_14 = TORCH_VERSION >= (2, 14)  # supportsUserMetadata, annotateMemory


@pytest.mark.skipif(not TORCH_2_14, reason="user metadata and annotations are torch 2.14's")
def test_user_metadata_annotations_and_compile_contexts_in_torchs_snapshot():
    # torch's own Python entry points (they need no CUDA runtime); history and torch.compile's
    # region marks through the hooks, as torch's _record_memory_history and its record_function
    # callback would call the allocator (both need CUDA's initialisation).
    ok(
        GRAPH_TREES
        + textwrap.dedent(
            """
        import threading
        import torch.cuda.memory as tcm
        br.cudapool_bridge_test_compile_context.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p,
                                                            ctypes.c_size_t]
        def compile_region(push, name=b""):
            buf = ctypes.create_string_buffer(1024)
            assert br.cudapool_bridge_test_compile_context(push, name, buf, len(buf)) == 0, buf.value
        assert torch._C._cuda_memoryMetadataSupported() and tcm._memory_metadata_supported()
        def allocate_here(size):
            return alloc(size)
        history(when=3)
        tcm._set_memory_metadata("phase-1")
        assert tcm._get_memory_metadata() == "phase-1"
        p = allocate_here(3 * MiB)
        seen = {}
        def other_thread():                                  # thread-local, as torch's
            seen["metadata"] = tcm._get_memory_metadata()
            seen["ptr"] = alloc(1 * MiB)
        t = threading.Thread(target=other_thread); t.start(); t.join()
        assert seen["metadata"] == ""
        tcm._set_memory_metadata("")
        q = alloc(2 * MiB)
        torch._C._cuda_annotateMemory(p, "packed for backward")
        s = storage(4 * MiB)
        whole = torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(
            {"size": (4 * MiB,), "stride": (1,), "storage_offset": 0, "dtype": torch.uint8}, s)
        tcm._annotate_tensor(whole, "a whole tensor")
        for bad in (p + 512, 12345):                          # not the base of a live allocation
            try:
                torch._C._cuda_annotateMemory(bad, "x")
                raise AssertionError("not refused")
            except RuntimeError as exc:
                assert "annotateMemory" in str(exc) and "live allocation" in str(exc), exc
        compile_region(1, b"Torch-Compiled Region: 0/0")
        r = alloc(1 * MiB)
        compile_region(0)
        call("recordAnnotation", b=7); call("recordAnnotation", a=1, b=7)   # record_function's START, END
        snap = tcm._snapshot()
        trace = snap["device_traces"][0]
        def entry(action, addr):
            return [e for e in trace if e["action"] == action and e["addr"] == addr][0]
        assert entry("alloc", p)["user_metadata"] == "phase-1" and entry("alloc", q)["user_metadata"] == ""
        assert entry("alloc", seen["ptr"])["user_metadata"] == ""
        segs = [e for e in trace if e["action"] == "segment_alloc" and e["user_metadata"] == "phase-1"]
        assert segs, trace                                    # every entry the thread makes, as torch's
        note = entry("annotate", p)
        assert note["user_metadata"] == "packed for backward" and note["size"] == entry("alloc", p)["size"], note
        assert "<module>" in [f["name"] for f in note["frames"]], note   # the annotation's own stack
        assert entry("annotate", s.data_ptr())["user_metadata"] == "a whole tensor"
        assert entry("alloc", r)["compile_context"] == "Torch-Compiled Region: 0/0"
        assert entry("alloc", q)["compile_context"] == "N/A"             # torch's "none"
        assert [(a["name"], a["stage"], a["device"]) for a in snap["external_annotations"]] == [
            ("region7", "START", 0), ("region7", "END", 0)], snap["external_annotations"]
        from torch.cuda import _memory_viz
        assert "# annotate" in _memory_viz.trace(snap) and "packed for backward" in _memory_viz.trace(snap)
        pickle.loads(pickle.dumps(snap))
        # the stack of a live allocation (getContextForPointer), as torch answers it
        frames = tcm._allocation_traceback(p)
        assert frames and "allocate_here" in [f["name"] for f in frames], frames
        assert tcm._allocation_traceback(p + 512) is None
        free(p)
        assert tcm._allocation_traceback(p) is None
        # many labels, a short ring: labels no record names go, those the ring holds stay
        history(entries=64, clear=True)
        assert snap is not None and tcm._snapshot()["external_annotations"] == []   # cleared with the history
        for i in range(6000):
            tcm._set_memory_metadata(f"step {i}")
            free(alloc(4096))
        tcm._set_memory_metadata("")
        trace = tcm._snapshot()["device_traces"][0]
        assert len(trace) == 64 and trace[-1]["user_metadata"] == "step 5999", trace[-1]
        assert all(e["user_metadata"].startswith("step 59") for e in trace), [e["user_metadata"] for e in trace]
        history(enabled=False)
        assert tcm._allocation_traceback(q) is None
        free(q); free(r); free(seen["ptr"])
        print("OK")
        """
        )
    )


@pytest.mark.skipif(not TORCH_2_13, reason="capture marks and allocateWithAddress are torch 2.13's")
def test_capture_marks_and_allocate_with_address_answer_as_cudapool_can():
    ok(
        """
        pid = (0, 11)
        call("beginAllocateToPool", 0, *pid)            # torch's CUDAGraph: the window, then the capture
        call("markCaptureBegin", 1)                      # another device's capture, nested
        call("markCaptureBegin", 0)
        p = alloc(2 * MiB)
        assert cudapool.graph_pools()[0]["allocated"] == 2 * MiB
        call("markCaptureEnd", 0)
        call("markCaptureEnd", 1)
        call("endAllocateToPool", 0, *pid)
        for device in (0, 1):                          # an end with no capture under way
            m = refused("markCaptureEnd", device)
            assert "markCaptureEnd" in m and "no capture" in m, m
        m = refused("markCaptureBegin", 200)
        assert "markCaptureBegin" in m and "no device" in m, m
        m = refused("allocateWithAddress", 0, 1 * MiB, p)
        assert "allocateWithAddress" in m and "does not yet support" not in m, m
        call("releasePool", 0, *pid)
        free(p)
        assert cudapool.graph_pools() == [] and _C.device_pool(0).check() == 0
        print("OK")
        """
    )


# Each virtual of torch's CUDAAllocator interface (and of its bases) whose default throws, warns
# or is pure: the bridge must answer it itself.
_INTERFACE_HEADERS = ["c10/cuda/CUDACachingAllocator.h", "c10/core/CachingDeviceAllocator.h", "c10/core/Allocator.h"]


def _defaults_that_refuse():
    import os
    import re

    include = os.path.join(os.path.dirname(torch.__file__), "include")
    names = set()
    for rel in _INTERFACE_HEADERS:
        text = open(os.path.join(include, rel), encoding="utf-8").read()
        for cls in re.finditer(
            r"(?:class|struct) (?:C10_API )?(?:CUDAAllocator|DeviceAllocator|Allocator)\b[^{;]*{", text
        ):
            body, depth, i = [], 1, cls.end()
            while depth:
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                body.append(text[i])
                i += 1
            body = "".join(body)
            for m in re.finditer(r"virtual [^;{]*?(\w+)\(((?:[^;(){}]|{[^{}]*})*)\)[^;{]*?(=\s*0\s*;|{)", body):
                if m.group(3).startswith("="):
                    names.add(m.group(1))
                    continue
                j, depth = m.end(), 1
                while depth:
                    depth += {"{": 1, "}": -1}.get(body[j], 0)
                    j += 1
                if re.search(r"TORCH_CHECK\(\s*false|TORCH_WARN|NOT_IMPLEMENTED", body[m.end() : j]):
                    names.add(m.group(1))
    return names


@pytest.mark.skipif(not TORCH_2_13, reason="the calls checked here are torch 2.13's and 2.14's")
def test_no_call_of_torchs_interface_is_left_to_a_default_that_refuses():
    import os
    import re

    names = _defaults_that_refuse()
    assert {"allocate", "emptyCache", "snapshot", "getMemoryInfo", "allocateWithAddress"} <= names, names
    if TORCH_2_14:
        assert {"setUserMetadata", "annotateMemory"} <= names, names
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bridge = open(os.path.join(root, "csrc", "bridge", "bridge.cpp"), encoding="utf-8").read()
    missing = sorted(
        n
        for n in names
        if not re.search(r"\b" + n + r"\((?:[^;(){}]|{[^{}]*}|\([^()]*\))*\)[^;{]*\b(?:override|final)\b", bridge)
    )
    assert not missing, f"torch's defaults would refuse or warn: {missing}"
    # and each one torch's Python reaches without CUDA runs with warnings as errors, nothing
    # printed by torch's C++ warnings
    code = GRAPH_TREES + textwrap.dedent(
        """
        import torch.cuda.memory as tcm
        warnings.simplefilter("error")
        history(when=3)
        p = alloc(1 * MiB)
        assert torch._C._cuda_memoryMetadataSupported() == TORCH_2_14
        tcm._set_memory_metadata("m"); assert tcm._get_memory_metadata() == ("m" if TORCH_2_14 else "")
        tcm._set_memory_metadata("")
        if TORCH_2_14:
            torch._C._cuda_annotateMemory(p, "a")
        assert tcm._allocation_traceback(p)
        tcm._snapshot()
        call("recordAnnotation"); call("markCaptureBegin"); call("markCaptureEnd")
        try:
            call("allocateWithAddress", 0, 512, p)
        except BridgeError as exc:
            assert "cudapool: allocateWithAddress" in exc.args[1], exc
        free(p)
        print("OK")
        """
    ).replace("TORCH_2_14", str(TORCH_2_14))
    head = PRELUDE.replace("CAPACITY", str(64 << 20)).replace("POLICY", repr("builtin"))
    proc = run_python(head + code, timeout=TIMEOUT_S)
    expect_ok(proc)
    for phrase in ("does not support", "does not yet support", "not implemented", "is ignored"):
        assert phrase not in proc.stderr, proc.stderr


def test_out_of_memory_is_torchs_type_and_reaches_torchs_observers():
    ok(
        """
        call("attachOutOfMemoryObserver")      # torch's Python form needs CUDA: the C++ call itself
        keep = alloc(40 * MiB)
        try:
            alloc(30 * MiB)
        except BridgeError as exc:
            code, message = exc.args
        else:
            raise AssertionError("no out of memory")
        assert code == 2, (code, message)                      # c10::OutOfMemoryError
        assert message.startswith("CUDA out of memory. Tried to allocate 30.00 MiB"), message
        seen = [call("oomObserved", a=k)[1] for k in range(4)]
        assert call("oomObserved")[0] == 1, seen
        device, size, total, device_free = seen
        assert device == 0 and size == 30 * MiB and total == 64 * MiB, seen
        assert device_free < 30 * MiB, seen
        q = alloc(10 * MiB)                                      # the next that fits succeeds
        free(q); free(keep)
        assert cudapool.last_oom()["requested"] == 30 * MiB
        print("OK")
        """,
        policy="builtin",
    )


def test_cache_info_for_cudnn_benchmark():
    ok(
        """
        first = call("cacheInfo", a=0)[0]                       # starts from the device's free memory
        assert first == 64 * MiB, first
        p = alloc(8 * MiB)
        q = alloc(1 * MiB)
        free(p)
        largest = call("cacheInfo", a=1)[0]
        assert largest == 20 * MiB, largest                     # p's 20 MiB segment, wholly free again
        assert largest == _C.device_pool(0).info()["largest_free_block"]
        r = alloc(15 * MiB)
        assert call("cacheInfo", a=1)[0] == 5 * MiB             # what is left of it
        free(r)
        free(q)
        print("OK")
        """
    )


def test_mem_pool_calls_route_into_a_private_pool():
    ok(
        """
        pid = (0, 7)
        call("createOrIncrefPool", 0, *pid)
        assert call("getPoolUseCount", 0, *pid)[0] == 1
        call("beginAllocateToPool", 0, *pid)                    # use_mem_pool: this thread's allocations
        assert call("getPoolUseCount", 0, *pid)[0] == 2          # as torch's: a window is a use too
        p = alloc(2 * MiB)
        call("endAllocateToPool", 0, *pid)
        pools = cudapool.graph_pools()
        assert len(pools) == 1 and pools[0]["id"] == pid and pools[0]["allocated"] >= 2 * MiB, pools
        assert cudapool.memory_allocated(0) == 0             # not in the shared pool
        s = flat(torch._C._cuda_memoryStats(0))
        assert s["reserved_bytes_by_private_pools.(0, 7).all.current"] == pools[0]["reserved"] \\
            if "reserved_bytes_by_private_pools.(0, 7).all.current" in s else True
        snap = torch._C._cuda_memorySnapshot(None)
        owned = [sg for sg in snap["segments"] if tuple(sg["segment_pool_id"]) == pid]
        assert owned and owned[0]["blocks"][0]["state"] == "active_allocated", snap["segments"]
        call("releasePool", 0, *pid)                            # use_mem_pool's release
        assert call("getPoolUseCount", 0, *pid)[0] == 1
        call("releasePool", 0, *pid)                            # MemPool's destructor
        assert call("getPoolUseCount", 0, *pid)[0] == 0
        assert len(cudapool.graph_pools()) == 1                # its tensor keeps it
        free(p)
        assert cudapool.graph_pools() == []
        call("emptyCache", 0, *pid)                             # gone already: nothing to do
        m = refused("setNoSplit", 0, *pid)
        assert "setNoSplit" in m, m
        m = refused("setUseOnOOM", 0, 1, 7)
        assert "setUseOnOOM" in m, m
        call("setUseOnOOM", 0, 0, 7)                             # use_on_oom=False: nothing to refuse
        m = refused("createOrIncrefPoolOther", 0, 0, 9)
        assert "createOrIncrefPool" in m and "allocator" in m, m
        print("OK")
        """
    )


GRAPH_TREES = """
br.cudapool_bridge_test_storage.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                                            ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p, ctypes.c_size_t]
br.cudapool_bridge_test_storage_drop.argtypes = [ctypes.c_uint64]
dev = torch.device("cuda", 0)

def storage(size, stream=5):
    # A CUDA storage as torch makes for a tensor: allocate() with the device and stream given.
    impl = ctypes.c_uint64()
    buf = ctypes.create_string_buffer(4096)
    rc = br.cudapool_bridge_test_storage(size, 0, stream, ctypes.byref(impl), buf, len(buf))
    assert rc == 0, buf.value
    s = torch.UntypedStorage._new_with_weak_ptr(impl.value)
    assert br.cudapool_bridge_test_storage_drop(impl.value) == 0
    return s

def live(pool, ptrs):
    return torch._C._cuda_checkPoolLiveAllocations(0, pool, set(ptrs))

def in_pool(pool):
    torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)

def out_of_pool(pool):
    torch._C._cuda_endAllocateToPool(0, pool)
    torch._C._cuda_releasePool(0, pool)

def replay_output(ptr, size):
    # cudagraph trees' outputs of a replay: storages over the graph's addresses, no deleter
    return torch._C._construct_storage_from_data_pointer(ptr, dev, size)
"""


def test_cudagraph_trees_checkpoint_and_restore_through_torchs_bindings():
    # The calls and their order are those of torch/_inductor/cudagraph_trees.py: record in the
    # tree's pool, checkpoint after the graph, replay (outputs without deleters), restore the
    # checkpoint with the live outputs given deleters, free outputs that died, check liveness.
    ok(
        GRAPH_TREES
        + textwrap.dedent(
            """
        pool = torch.cuda.graph_pool_handle()
        call("createOrIncrefPool", 0, *pool)                   # the recorded graph's use of it
        in_pool(pool)                                           # _use_cuda_memory_pool_manager
        tmp = storage(6 * MiB)
        out1, out2 = storage(3 * MiB), storage(1000)
        p1, p2 = out1.data_ptr(), out2.data_ptr()
        del tmp                                                 # an intermediate of the graph
        out_of_pool(pool)
        assert cudapool.memory_allocated(0) == 0                # all of it in the private pool
        state = torch._C._cuda_getCheckpointState(0, pool)
        assert live(pool, [p1, p2]) and not live(pool, [p1]) and not live(pool, [p1, p2, 12345])
        # the outputs die; a replay brings them back without the allocator knowing
        del out1, out2
        assert live(pool, [])
        r1, r2 = replay_output(p1, 3 * MiB), replay_output(p2, 1000)
        assert not torch._C._has_Standard_Deleter(r1._cdata)
        # apply_checkpoint_execution_state_in_allocator before the next recording
        torch._C._cuda_setCheckpointPoolState(0, state, [], [r1._cdata, r2._cdata])
        assert live(pool, [p1, p2])
        assert torch._C._has_Standard_Deleter(r1._cdata) and torch._C._has_Standard_Deleter(r2._cdata)
        in_pool(pool)                                           # the next recording goes around them
        w = storage(2 * MiB)
        assert not (p1 <= w.data_ptr() < p1 + 3 * MiB), (hex(w.data_ptr()), hex(p1))
        out_of_pool(pool)
        assert live(pool, [p1, p2, w.data_ptr()])
        del w
        # a new execution overwrites the outputs: their storages lose the deleter, the memory goes
        for s in (r1, r2):
            torch._C._free_And_Remove_DeleterFn(s._cdata)
            assert not torch._C._has_Standard_Deleter(s._cdata)
        assert live(pool, [])
        del r1, r2                                              # deleteNothing: no second free
        # replay again; out2 dies before the checkpoint is applied: re-created, then freed by torch
        q1, q2 = replay_output(p1, 3 * MiB), replay_output(p2, 1000)
        del q2
        torch._C._cuda_setCheckpointPoolState(0, state, [], [q1._cdata])
        assert live(pool, [p1, p2])
        torch._C._cuda_cudaCachingAllocator_raw_delete(p2)      # ptrs_to_deallocate
        assert live(pool, [p1])
        # a storage allocated after the checkpoint and still alive is a stale one: torch swaps
        # its deleter when it is passed, and cudapool frees its block
        in_pool(pool)
        y = storage(1 * MiB)
        out_of_pool(pool)
        yp = y.data_ptr()
        torch._C._cuda_setCheckpointPoolState(0, state, [y._cdata], [])
        assert live(pool, [p1, p2]) and not torch._C._has_Standard_Deleter(y._cdata)
        del y
        torch._C._cuda_cudaCachingAllocator_raw_delete(p2)
        del q1                                                  # its deleter frees p1
        assert live(pool, [])
        g = cudapool.graph_pools()
        assert len(g) == 1 and g[0]["allocated"] == 0, g
        snap = torch.cuda.memory._snapshot()
        segs = [sg for sg in snap["segments"] if tuple(sg["segment_pool_id"]) == tuple(pool)]
        assert segs and all(b["state"] == "inactive" for sg in segs for b in sg["blocks"]), segs
        # a state of another device, or of no pool, is refused with the call's name
        try:
            torch._C._cuda_setCheckpointPoolState(1, state, [], [])
            raise AssertionError("not refused")
        except RuntimeError as exc:
            assert "setCheckpointPoolState" in str(exc) and "device 0" in str(exc), exc
        try:
            torch._C._cuda_getCheckpointState(0, (0, 999999))
            raise AssertionError("not refused")
        except RuntimeError as exc:
            assert "getCheckpointState" in str(exc) and "no private pool" in str(exc), exc
        call("releasePool", 0, *pool)                           # the graph goes
        assert cudapool.graph_pools() == []
        del state
        assert _C.device_pool(0).check() == 0
        print("OK")
        """
        )
    )


def test_every_other_call_answers_or_names_itself():
    ok(
        """
        assert call("initialized")[0] in (0, 1)
        call("init", 2)
        assert call("initialized")[0] == 1
        p = alloc(3 * MiB)
        base, size = call("getBaseAllocation", a=p + 4096)
        assert base == p and size == 20 * MiB, (hex(base), size)  # the 20 MiB segment holding it
        base, size = call("getBaseAllocation", a=12345)
        assert base == 12345 and size == 0
        assert call("getMemoryInfo")[0] == 64 * MiB - 20 * MiB
        # memory fraction, through the bridge both ways
        call("setMemoryFraction", 1, double_bits(0.5))
        got = bits_double(call("getMemoryFraction", 1)[0])
        assert got == 0.5, got
        m = refused("setMemoryFraction", 1, double_bits(1.5))
        assert "setMemoryFraction" in m and "1.5" in m, m
        # raw_alloc_with_stream / raw_delete / raw_deleter (cuDNN and cuBLAS workspaces)
        r = call("raw_alloc_with_stream", 0, 1 * MiB, 5)[0]
        assert r and cudapool.memory_allocated(0) == 4 * MiB
        call("raw_delete", a=r)
        r = call("raw_alloc_with_stream", 0, 1 * MiB, 5)[0]
        call("raw_deleter", a=r)
        assert cudapool.memory_allocated(0) == 3 * MiB
        r1 = call("raw_alloc_with_stream", 1, 1 * MiB, 0)[0]   # a plain address of device 1
        assert cudapool.memory_allocated(1) == 1 * MiB
        call("raw_deleter", a=r1)                               # found in device 1's pool
        assert cudapool.memory_allocated(1) == 0
        d1 = alloc(2 * MiB, device=1)                           # a DataPtr of device 1 ...
        free(d1)                                                # ... freed there by its deleter
        assert cudapool.memory_allocated(1) == 0
        # recordStream through torch's CUDAStream type
        buf = ctypes.create_string_buffer(1024)
        rc = br.cudapool_bridge_test_record_stream(p, 7, buf, len(buf))
        assert rc == 0, buf.value
        assert call("getExpandableSegmentSizes")[0] == 0       # builtin rules: plain segments
        call("emptyCache")
        assert call("isHistoryEnabled")[0] == 0
        for name in ("checkPoolLiveAllocations", "getCheckpointState"):
            m = refused(name, 0, 0, 4242)                         # no such private pool
            assert name in m and "no private pool" in m, m
        m = refused("shareIpcHandle")                          # NULL: no allocation
        assert "shareIpcHandle" in m and "not a live allocation" in m, m
        m = refused("shareIpcHandle", 0, p)                   # a simulated device has no IPC
        assert "shareIpcHandle" in m and "cannot share memory with another process" in m, m
        m = refused("getIpcDevPtr")                           # not a handle cudapool opens
        assert "getIpcDevPtr" in m and "type 'a'" in m, m
        m = refused("enable", 0, 0)
        assert "enable(False)" in m, m
        call("enable", 0, 1)
        free(p)
        # the free waits for stream 7 (record_stream): completed on the simulated device, then reused
        assert _C.device_pool(0).check() == 0
        print("OK")
        """
    )


def test_trace_trackers_see_segments_reserved_mapped_and_given_back():
    ok(
        """
        call("attachAllocatorTraceTracker")
        ALLOC, FREE, MAP, UNMAP = 3, 4, 5, 6                       # TraceEntry::Action
        p = alloc(3 * MiB)
        assert call("trackerEvents", a=ALLOC)[0] == 1
        free(p)
        cudapool.empty_cache()
        assert call("trackerEvents", a=FREE)[0] == 1
        print("OK")
        """,
        policy="builtin",
    )
    ok(
        """
        call("attachAllocatorTraceTracker")
        MAP, UNMAP = 5, 6
        p = alloc(3 * MiB)
        assert call("trackerEvents", a=MAP)[0] >= 1
        free(p)
        cudapool.empty_cache()
        assert call("trackerEvents", a=UNMAP)[0] >= 1
        print("OK")
        """,
        policy="cudapool",
    )


def test_bridge_for_another_torch_falls_back_with_one_warning():
    code = """
    import warnings, torch, cudapool
    from cudapool import _C, _torch
    real = torch.__version__
    torch.__version__ = "0.0.1"                  # as if cudapool were built for another torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cudapool.enable()
    messages = [str(w.message) for w in caught if "_torch_bridge" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert "built for torch" in messages[0] and "falling back" in messages[0], messages
    assert "--no-build-isolation" in messages[0], messages
    assert _torch.allocator_path() == "pluggable"
    assert torch._C._cuda_getAllocatorBackend() == "pluggable"
    print("OK")
    """
    expect_ok(run_python(textwrap.dedent(code), timeout=TIMEOUT_S))


def test_bridge_not_built_falls_back_with_one_warning_and_the_env_asks_silently():
    code = """
    import warnings, torch, cudapool
    from cudapool import _torch, _torch_libraries
    _torch_libraries.torch_bridge_library_path = lambda: None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cudapool.enable()
    messages = [str(w.message) for w in caught if "_torch_bridge" in str(w.message)]
    assert len(messages) == 1 and "was not built" in messages[0], [str(w.message) for w in caught]
    assert _torch.allocator_path() == "pluggable"
    print("OK")
    """
    expect_ok(run_python(textwrap.dedent(code), timeout=TIMEOUT_S))
    code = """
    import warnings, torch, cudapool
    from cudapool import _torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cudapool.enable()
    assert not caught, [str(w.message) for w in caught]
    assert _torch.allocator_path() == "pluggable"
    print("OK")
    """
    expect_ok(run_python(textwrap.dedent(code), timeout=TIMEOUT_S, env={"CUDAPOOL_BRIDGE": "0"}))


def test_info_names_the_path():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "cudapool", "info"], capture_output=True, text=True, timeout=TIMEOUT_S
    ).stdout
    assert "allocator path of cudapool.enable(): bridge" in out, out
    env_out = run_python(
        "import runpy, sys; sys.argv = ['cudapool', 'info']; runpy.run_module('cudapool', run_name='__main__')",
        timeout=TIMEOUT_S,
        env={"CUDAPOOL_BRIDGE": "0"},
    ).stdout
    assert "allocator path of cudapool.enable(): pluggable (CUDAPOOL_BRIDGE=0" in env_out, env_out


# What the generated calls below draw from: sizes from nothing to past any device, devices that
# exist, do not, or wrap around torch's 8-bit device index, pool ids torch never made, fractions
# that are not fractions, and addresses the bridge never handed out.
_GENERATED = """
import math
from hypothesis import given, settings, strategies as st

U64 = (1 << 64) - 1
SIZES = st.one_of(st.sampled_from([0, 1, 511, 512, 2 * MiB, 24 * MiB, 64 * MiB, 64 * MiB + 1, 1 << 40, 1 << 63, U64]),
                  st.integers(min_value=0, max_value=U64))
DEVICES = st.sampled_from([0, 0, 1, 1, -1, 2, 127, 128, 255, 300, -129])
POOLS = st.sampled_from([(0, 0), (1, 0), (0, 1), (7, 7), (U64, U64)])
FRACTIONS = st.sampled_from([0.0, 0.5, 1.0, -0.0, 1e-300, -0.25, 1.5, math.nan, math.inf, -math.inf])
FOREIGN = st.sampled_from([0, 1, 512, 0xDEAD0000, U64])
QUERIES = ["init", "cacheInfo", "getMemoryInfo", "getMemoryFraction", "getExpandableSegmentSizes",
           "isHistoryEnabled", "initialized", "name"]
POOL_CALLS = ["emptyCache", "getPoolUseCount", "releasePool", "setUseOnOOM", "setNoSplit",
              "checkPoolLiveAllocations", "getCheckpointState"]
FOREIGN_CALLS = ["raw_delete", "getBaseAllocation", "shareIpcHandle"]
OPS = st.one_of(
    st.tuples(st.just("alloc"), SIZES, DEVICES),
    st.tuples(st.just("free"), st.integers(min_value=0, max_value=31)),
    st.tuples(st.just("query"), st.sampled_from(QUERIES), DEVICES),
    st.tuples(st.just("pool"), st.sampled_from(POOL_CALLS), DEVICES, POOLS),
    st.tuples(st.just("make_pool"), DEVICES, POOLS),
    st.tuples(st.just("fraction"), FRACTIONS, DEVICES),
    st.tuples(st.just("foreign"), st.sampled_from(FOREIGN_CALLS), FOREIGN),
    st.tuples(st.just("torch"), st.sampled_from(["stats", "reset_peak", "reset_accumulated", "snapshot"]), DEVICES),
)
TORCH_CALLS = {
    "stats": lambda d: torch._C._cuda_memoryStats(d),
    "reset_peak": lambda d: torch._C._cuda_resetPeakMemoryStats(d),
    "reset_accumulated": lambda d: torch._C._cuda_resetAccumulatedMemoryStats(d),
    "snapshot": lambda d: torch._C._cuda_memorySnapshot(None),
}
counts = {"examples": 0, "calls": 0, "refused": 0, "oom": 0}


def refused_clearly(exc):
    code, message = exc.args
    assert code in (1, 2) and message.strip(), exc.args
    counts["refused" if code == 1 else "oom"] += 1


def whole(live):
    for d in (0, 1):
        pool = _C.device_pool(d)
        assert pool.check() == 0, pool.check_report()
        st_ = flat(torch._C._cuda_memoryStats(d))
        mine = [size for ptr, size, dev in live if dev == d]
        assert st_["allocation.all.current"] == len(mine), (d, st_["allocation.all.current"], len(mine))
        assert st_["allocated_bytes.all.current"] >= sum(mine), d
        assert st_["reserved_bytes.all.current"] >= st_["allocated_bytes.all.current"], d


@settings(max_examples=EXAMPLES, PROFILE)
@given(ops=st.lists(OPS, max_size=40))
def generated(ops):
    counts["examples"] += 1
    live, pools = [], []
    try:
        for op in ops:
            counts["calls"] += 1
            kind = op[0]
            try:
                if kind == "alloc":
                    _, size, device = op
                    ptr = alloc(size, device)
                    if ptr:
                        assert size > 0 and device in (0, 1), (size, device, ptr)
                        live.append((ptr, size, device))
                elif kind == "free":
                    if live:
                        free(live.pop(op[1] % len(live))[0])
                elif kind == "query":
                    call(op[1], op[2])
                elif kind == "pool":
                    _, name, device, (a, b) = op
                    call(name, device, a, b)
                elif kind == "make_pool":
                    _, device, (a, b) = op
                    call("createOrIncrefPool", device, a, b)
                    pools.append((device, a, b))
                elif kind == "fraction":
                    _, f, device = op
                    call("setMemoryFraction", device, double_bits(f))
                    assert 0.0 <= f <= 1.0, f  # anything else is refused
                elif kind == "foreign":
                    _, name, ptr = op
                    call(name, 0, ptr)
                    assert name == "getBaseAllocation" or ptr == 0, (name, ptr)  # only nothing is nobody's
                else:
                    try:
                        TORCH_CALLS[op[1]](op[2])
                    except (RuntimeError, IndexError, ValueError, OverflowError) as exc:
                        assert str(exc).strip(), op
                        assert op[2] not in (0, 1), (op, exc)
                        counts["refused"] += 1
            except BridgeError as exc:
                refused_clearly(exc)
            whole(live)
    finally:
        while live:
            free(live.pop()[0])
        for device, a, b in pools:
            try:
                call("releasePool", device, a, b)
            except BridgeError as exc:  # a pool id the bridge refused to make
                refused_clearly(exc)
        for d in (0, 1):
            call("setMemoryFraction", d, double_bits(1.0))
            call("emptyCache", d)
    whole([])


generated()
print("generated:", counts)
assert counts["refused"] > 0 and counts["calls"] > counts["refused"], counts
for d in (0, 1):
    assert flat(torch._C._cuda_memoryStats(d))["reserved_bytes.all.current"] == 0, d
print("OK")
"""


@pytest.mark.parametrize("policy", ["builtin", "expandable", "cudapool"])
def test_generated_bad_calls_leave_the_bridge_whole(policy):
    """The bridge's entry points that run without a GPU (torch's C++ allocator methods through the
    test hooks, and torch's own stats, resets and snapshot functions), driven by Hypothesis with
    bad sizes, devices, pool ids, fractions and foreign addresses among good calls: each call works
    or is refused with a message (out of memory as torch's type); after each, both pools are
    consistent, no simulated device fault happened and torch's counts are the live blocks."""
    pytest.importorskip("hypothesis", reason="hypothesis is not installed")
    import hyp  # the run's draw: seeded, or long and unseeded (tests/hyp.py)

    n = hyp.examples(150)
    out = ok(_GENERATED.replace("EXAMPLES", str(n)).replace("PROFILE", hyp.profile_settings()), policy=policy)
    assert f"generated: {{'examples': {n}" in out, out

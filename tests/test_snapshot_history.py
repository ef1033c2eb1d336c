"""Snapshots, history and the plot: the snapshot's fields and states from a simulated pool,
the history ring wrapping, Python stacks, torch's own _memory_viz functions reading the
dumped pickles (from a simulated pool and from a replay at its peak), the device pools after
use_sim_devices, the plot's PNG, and bad input. No GPU needed."""

import os
import pickle
import random
import struct
import subprocess
import sys
import zlib

import pytest
from cudapool import _C
from cudapool import snapshots as snapshot
from cudapool.lab import peak_snapshot, plot
from cudapool.lab import replay as rp
from cudapool.lab.trace import ALLOC, FREE, Trace, save

MiB = 1 << 20
# Subprocesses import this checkout's package, wherever they run.
ENV = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(_C.__file__)))}


def _workload(pool, stacks=True):
    """Allocations on two streams, a pending free, frees: every block state."""

    def make(size, stream=0):
        return pool.alloc(size, stream=stream)

    a = make(1000)
    b = make(3000)
    c = make(5 * MiB, stream=7)
    d = make(200_000)
    pool.record_stream(d, 9)
    pool.launch(d, 9)  # work there uses it
    pool.free(d)  # waits on stream 9: active_pending_free
    pool.free(a)
    return b, c


@pytest.fixture
def stacks():
    _C.set_history_stacks(True)
    yield
    _C.set_history_stacks(False)


def test_snapshot_fields_and_states(stacks):
    pool = _C.Pool(512 * MiB)
    pool.set_history(1000)
    b, c = _workload(pool)
    s = snapshot.pool_snapshot(pool, device=0)
    assert set(s) == {"segments", "device_traces"} and len(s["device_traces"]) == 1
    states = {blk["state"] for seg in s["segments"] for blk in seg["blocks"]}
    assert states == {"active_allocated", "active_pending_free", "inactive"}
    for seg in s["segments"]:
        assert seg["total_size"] == sum(blk["size"] for blk in seg["blocks"])
        assert seg["segment_type"] in ("small", "large") and seg["segment_kind"] == "plain"
        assert seg["allocated_size"] == sum(x["size"] for x in seg["blocks"] if x["state"] == "active_allocated")
        assert seg["active_size"] >= seg["allocated_size"]
        for blk in seg["blocks"]:
            assert {"address", "size", "requested_size", "state", "frames"} <= set(blk)
    large = [seg for seg in s["segments"] if seg["stream"] == 7]
    assert len(large) == 1 and large[0]["segment_type"] == "large" and large[0]["total_size"] == 20 * MiB
    live = {blk["address"]: blk for seg in s["segments"] for blk in seg["blocks"] if blk["state"] == "active_allocated"}
    assert live[b]["requested_size"] == 3000 and live[b]["size"] == 3072
    # The frames of a live block name the function that allocated it, innermost first.
    assert live[b]["frames"][0]["name"] == "make" and live[b]["frames"][0]["filename"] == __file__
    assert live[b]["frames"][1]["name"] == "_workload"
    actions = [e["action"] for e in s["device_traces"][0]]
    assert actions[:2] == ["segment_alloc", "alloc"]
    assert actions.count("free_requested") == 2 and actions.count("free_completed") == 1  # d is pending
    pool.complete(9)
    pool.free(pool.alloc(100))  # reclaims d first
    trace = snapshot.pool_snapshot(pool)["device_traces"][0]
    completed = [e for e in trace if e["action"] == "free_completed"]
    assert len(completed) == 3 and completed[1]["size"] == 200_192 and completed[1]["stream"] == 0
    pool.close()


def test_history_ring_wraps_and_numbers_records():
    pool = _C.Pool(64 * MiB)
    keep = pool.alloc(512)
    pool.set_history(7)
    for _ in range(10):
        pool.free(pool.alloc(512))  # 3 records each: alloc, free_requested, free_completed
    records, recorded, capacity = snapshot.history_records(pool)
    assert (recorded, capacity, len(records)) == (30, 7, 7)
    assert [r[0] for r in records] == list(range(24, 31))
    assert [r[2] for r in records[-3:]] == ["alloc", "free_requested", "free_completed"]
    assert all(r[6] == 0 for r in records)  # no stacks asked for
    entries = snapshot.trace_entries(records)
    assert [e["seq"] for e in entries] == list(range(24, 31))
    assert entries[0]["time_us"] <= entries[-1]["time_us"]
    pool.set_history(0)
    pool.free(pool.alloc(512))
    assert snapshot.history_records(pool) == ([], 30, 0)  # nothing recorded while off
    pool.free(keep)
    pool.close()


def test_page_mapped_segments_show_as_expandable_ranges():
    pool = _C.Pool(512 * MiB, "expandable_segments:True")
    pool.set_history(100)
    a = pool.alloc(30 * MiB)
    pool.alloc(4 * MiB)
    pool.free(a)
    pool.empty_cache()
    s = snapshot.pool_snapshot(pool)
    segs = s["segments"]
    assert segs and all(seg["is_expandable"] and seg["segment_kind"] == "page_mapped" for seg in segs)
    for seg in segs:
        assert seg["page_segment_address"] <= seg["address"]
        assert seg["address"] + seg["total_size"] <= seg["page_segment_address"] + seg["page_segment_size"]
    actions = [e["action"] for e in s["device_traces"][0]]
    assert "segment_map" in actions and "segment_unmap" in actions and "segment_alloc" not in actions
    bars = plot.segment_bars(s)
    assert any(p[2] == "unmapped" for bar in bars for p in bar["pieces"])
    pool.close()


def _memory_viz():
    return pytest.importorskip("torch.cuda._memory_viz")


def _check_memory_viz(s, extra_field=True):
    mv = _memory_viz()
    if extra_field:
        assert any("segment_kind" in seg for seg in s["segments"])  # fields torch does not know are ignored
    flame = lambda lines, *a, **k: lines  # noqa: E731 -- no flamegraph.pl download
    for name in ("segments", "memory"):
        if hasattr(mv, name):
            out = getattr(mv, name)(s, format_flamegraph=flame)
            assert "stream_" in out
    if hasattr(mv, "segsum"):
        assert "segments:" in mv.segsum(s)
    if hasattr(mv, "trace") and s["device_traces"] and s["device_traces"][0]:
        assert "alloc" in mv.trace(s) or "b" in mv.trace(s)
    if hasattr(mv, "compare"):
        mv.compare(s["segments"], s["segments"], format_flamegraph=flame)  # memory_snapshot() lists
    for name in ("segment_plot", "trace_plot"):
        if hasattr(mv, name):
            html = getattr(mv, name)(s)
            assert "<html" in html.lower() or "snapshot.pickle" in html
    if hasattr(mv, "trace_plot"):
        mv.trace_plot(s, filter_freed=True)


def test_memory_viz_reads_a_dumped_simulated_pool(tmp_path, stacks):
    pool = _C.Pool(512 * MiB)
    pool.set_history(1000)
    _workload(pool)
    path = tmp_path / "snap.pickle"
    snapshot.dump(snapshot.pool_snapshot(pool), path)
    with open(path, "rb") as f:
        back = pickle.load(f)
    _check_memory_viz(back)
    pool.close()


def _trace(n=3000, seed=1):
    rng = random.Random(seed)
    live, events, ident = [], [], 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            i = live.pop(rng.randrange(len(live)))
            events.append((FREE, i[0], i[1]))
        else:
            ident += 1
            size = rng.choice([512, 4096, 300_000, 3 * MiB, 12 * MiB])
            live.append((ident, size))
            events.append((ALLOC, ident, size))
    return Trace.from_events(events)


def test_replay_snapshot_at_peak_round_trip(tmp_path):
    t = _trace()
    r = rp.replay(t, policy="builtin")
    s = peak_snapshot.snapshot_at_peak(t, policy="builtin")
    reserved = sum(seg["total_size"] for seg in s["segments"])
    assert reserved == r["peak_reserved"] == s["cudapool_replay"]["peak_reserved"]
    assert s["device_traces"][0] and s["device_traces"][0][-1]["action"] in ("alloc", "segment_alloc")
    path = tmp_path / "peak.pickle"
    snapshot.dump(s, path)
    _check_memory_viz(snapshot.load(path))
    # The CLI writes the same snapshot.
    save(t, tmp_path / "t.cptrace")
    out = tmp_path / "cli.pickle"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cudapool",
            "replay",
            str(tmp_path / "t.cptrace"),
            "--policy",
            "builtin",
            "--snapshot-at-peak",
            str(out),
        ],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert sum(seg["total_size"] for seg in snapshot.load(out)["segments"]) == r["peak_reserved"]


def _png_size_and_colours(path):
    """(width, height, set of RGB colours) of an 8-bit RGB/RGBA PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    w = h = ctype = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    bpp = {2: 3, 6: 4}[ctype]
    raw = zlib.decompress(idat)
    stride = w * bpp
    prev = bytearray(stride)
    colours = set()
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if y % 2 == 0:
            colours.update(bytes(line[i : i + 3]) for i in range(0, stride, bpp))
        prev = line
    return w, h, colours


def test_plot_renders_png_with_state_colours(tmp_path):
    pytest.importorskip("matplotlib")
    pool = _C.Pool(512 * MiB)
    pool.set_history(1000)
    _workload(pool)
    s = snapshot.pool_snapshot(pool)
    pool.close()
    path = tmp_path / "p.png"
    snapshot.dump(s, tmp_path / "s.pickle")
    done = subprocess.run(
        [sys.executable, "-m", "cudapool", "plot", str(tmp_path / "s.pickle"), "-o", str(path), "--size", "800x600"],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    w, h, colours = _png_size_and_colours(path)
    assert (w, h) == (800, 600)
    for hexcolour in plot.STATE_COLOURS.values():
        assert bytes.fromhex(hexcolour[1:]) in colours, hexcolour


def test_plot_of_a_trace_and_bad_input(tmp_path):
    pytest.importorskip("matplotlib")
    save(_trace(800), tmp_path / "t.cptrace")
    out = tmp_path / "t.png"
    cli = [sys.executable, "-m", "cudapool", "plot"]
    done = subprocess.run(cli + [str(tmp_path / "t.cptrace"), "-o", str(out)], env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _png_size_and_colours(out)[:2] == (1200, 900)
    (tmp_path / "bad.pickle").write_bytes(b"not a pickle")
    pickle.dump({"x": 1}, open(tmp_path / "dict.pickle", "wb"))
    for name, message in (
        ("missing.pickle", "no such file"),
        ("bad.pickle", "not a memory snapshot pickle"),
        ("dict.pickle", "no 'segments' list"),
    ):
        done = subprocess.run(cli + [str(tmp_path / name), "-o", str(out)], env=ENV, capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr, done.stderr
    with pytest.raises(snapshot.SnapshotError, match="no such file"):
        snapshot.load(tmp_path / "nope")


def test_plot_without_matplotlib_says_so(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from cudapool.lab import plot\n"
        "try:\n plot.render({'segments': []}, 'x.png')\n"
        "except plot.PlotError as e:\n print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, cwd=tmp_path)
    assert "needs matplotlib" in done.stdout, done.stderr


def test_device_pools_snapshot_and_record_history(stacks):
    import cudapool

    _C.shutdown()
    _C.use_sim_devices(256 * MiB, 2)
    try:
        cudapool.record_history(True, max_entries=50)
        assert _C.device_history_entries() == 50
        pool = _C.device_pool(1)
        with pytest.raises(TypeError):
            pool.alloc(10)
        assert cudapool.snapshot() == {"segments": [], "device_traces": []}
        with pytest.raises(ValueError, match="stacks"):
            cudapool.record_history(stacks="cpp")
        cudapool.record_history(False)
        assert _C.device_history_entries() == 0
    finally:
        _C.shutdown()


def test_torch_replacements_answer_from_the_device_pools(tmp_path):
    from cudapool import _torch_stats

    assert {"_snapshot", "memory_snapshot", "_record_memory_history", "_dump_snapshot"} <= set(
        _torch_stats.REPLACEMENTS
    )
    _C.shutdown()
    _C.use_sim_devices(256 * MiB, 1)
    try:
        _torch_stats._torch_record_memory_history("all", max_entries=10)
        assert _C.device_history_entries() == 10
        _torch_stats._torch_record_memory_history(None)
        assert _C.device_history_entries() == 0
        assert _torch_stats._torch_snapshot() == {"segments": [], "device_traces": []}
        assert _torch_stats._torch_memory_snapshot() == []
        _torch_stats._torch_dump_snapshot(str(tmp_path / "d.pickle"))
        assert snapshot.load(tmp_path / "d.pickle")["segments"] == []
    finally:
        _C.shutdown()

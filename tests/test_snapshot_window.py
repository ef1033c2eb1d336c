"""Torch snapshots whose history is a window: the state at the window's start, reconstructed
from the dump-time segments and the history, and replays seeded with it. The snapshots are
made on the simulator (benchmarks/window_snapshot.py): a run under the `builtin` policy
written down as torch would, its history cut after a warm-up; the full run is the truth."""

import os
import pickle
import random
import sys

import pytest
from cudapool import _C
from cudapool.lab.replay import config_text, replay
from cudapool.lab.replay_report import format_report
from cudapool.lab.torch_snapshot import SnapshotError, from_snapshot, load_snapshot
from cudapool.lab.trace import ALLOC, FREE, Trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from window_snapshot import simulate  # noqa: E402
from workloads import rmm_random  # noqa: E402

MiB = 1 << 20


def mixed(n=6000, seed=3, streams=(0, 7)):
    """Weights allocated first and kept, then steps of activations freed in random order, on
    two streams: small and large blocks, splits, reuse."""
    rng = random.Random(seed)
    ev = []
    ident = 0
    for _ in range(40):
        ident += 1
        ev.append((ALLOC, ident, rng.choice([300, 4096, 700_000, 3 * MiB, 12 * MiB + 5]), 0))
    live = []
    while len(ev) < n:
        if live and (len(live) > 300 or rng.random() < 0.48):
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            j, size, st = live.pop()
            ev.append((FREE, j, size, st))
        else:
            ident += 1
            size = rng.choice([512, 5000, 200_000, 1 * MiB, 2 * MiB + 100, 9 * MiB, 30 * MiB]) + rng.randrange(4096)
            st = rng.choice(streams)
            ev.append((ALLOC, ident, size, st))
            live.append((ident, size, st))
    return Trace.from_events(ev)


TRACES = {"mixed": mixed, "rmm_random": lambda: rmm_random.capture(scale="small", seed=0)}


def start_of(trace):
    ws = trace.meta["window_start"]["0"]
    segs = sorted((s["address"], s["size"], s["stream"], s["kind"]) for s in ws["segments"])
    blocks = sorted((b[0], b[2], b[3]) for s in ws["segments"] for b in s["blocks"])
    return segs, blocks, ws


def peak_from(trace, policy, cut):
    """The full replay's peak reserved from event `cut` on (what was reserved then included)."""
    pool = _C.Pool(1 << 50, config_text(policy), True, False)
    pool.replay_start(-1)
    pool.replay_feed(trace.data, 0, cut)
    pool.replay_window()
    pool.replay_feed(trace.data, cut)
    peak = pool.replay_window()[1]
    pool.close()
    return peak


@pytest.mark.parametrize("name", sorted(TRACES))
@pytest.mark.parametrize("frac", [0.25, 0.6])
@pytest.mark.parametrize("block_addresses, empty_cache_every", [(True, 0), (False, 0), (True, 397)])
def test_start_state_round_trips(name, frac, block_addresses, empty_cache_every):
    """The dump with the history undone is the state at the cut: with segments freed in the
    window (empty_cache_every), with and without block addresses in the dump."""
    trace = TRACES[name]()
    cut = int(len(trace) * frac)
    made = simulate(trace, cut=cut, block_addresses=block_addresses, empty_cache_every=empty_cache_every)
    segs, blocks, ws = start_of(from_snapshot(made["window"]))
    truth = made["truth"]
    assert ws["problems"] == []
    assert segs == truth["segments"]
    # Addresses and requested sizes exactly. A block's size is exact when the dump lists the
    # block; one the window frees was recorded with its request only: its size is the request
    # rounded, plus a remainder too small to split off when that is visible (a gap of at most
    # 1 MiB before the next live block). A remainder followed by memory freed since is not.
    assert [(a, r) for a, _, r in blocks] == [(a, r) for a, _, r in truth["blocks"]]
    for (_, got, _), (_, want, _) in zip(blocks, truth["blocks"]):
        assert want - MiB <= got <= want
    short = sum(w[1] - g[1] for g, w in zip(blocks, truth["blocks"]))
    assert short <= len(blocks) * 1024
    assert ws["reserved_bytes"] == truth["reserved"] > 0
    # The full history starts from nothing.
    full = from_snapshot(made["full"]).meta["window_start"]["0"]
    assert full["reserved_bytes"] == 0 and full["live_blocks"] == 0 and full["problems"] == []


@pytest.mark.parametrize("name", sorted(TRACES))
def test_builtin_continues_the_recorded_run_exactly(name):
    trace = TRACES[name]()
    cut = int(len(trace) * 0.4)
    made = simulate(trace, cut=cut)
    window = from_snapshot(made["window"])
    truth = made["truth"]["window_peak_reserved"]
    assert window.builtin_peak_reserved == truth
    r = replay(window, policy="builtin")
    assert r["peak_reserved"] == truth
    assert r["bad_events"] == 0 and r["comparable"]
    assert r["window_start"]["seeded"] == "segments"
    assert "(+0.0 %)" in format_report(r)
    # Before: from an empty pool, the frees of blocks allocated before the window are lost.
    before = replay(window, policy="builtin", window_start=False)
    assert before["bad_events"] > 0 and not before["comparable"]


def test_other_policies_windowed_as_full():
    """With the warm-up's blocks kept (weights) and nothing cached at the cut, the policy's
    own placement of the live blocks is what it had in the full run."""
    trace = mixed(streams=(0,))
    cut = 40  # right after the weights
    made = simulate(trace, cut=cut)
    window = from_snapshot(made["window"])
    for policy in ("builtin", "cudapool"):
        r = replay(window, policy=policy)
        assert r["peak_reserved"] == peak_from(trace, policy, cut), policy
        assert r["events"] == len(trace) - cut


def test_rmm_random_cudapool_windowed_as_full():
    """Seeding lays the window's live blocks out in address order in one range; the full run
    held some of them in stitched ranges and in other places, so the peaks differ a little
    (16 MiB of 16 GiB when measured): within 1 %."""
    trace = rmm_random.capture(scale="small", seed=0)
    cut = int(len(trace) * 0.6)
    window = from_snapshot(simulate(trace, cut=cut)["window"])
    got = replay(window, policy="cudapool")["peak_reserved"]
    full = peak_from(trace, "cudapool", cut)
    assert abs(got - full) <= full // 100, (got, full)


def test_several_streams_and_the_json_report(tmp_path):
    made = simulate(mixed(), cut=3000)
    path = tmp_path / "w.pickle"
    with open(path, "wb") as f:
        pickle.dump(made["window"], f)
    t = load_snapshot(path)
    segs, _, ws = start_of(t)
    assert {s[2] for s in segs} == {0, 7}
    r = replay(t, policy="builtin")
    w = r["window_start"]
    assert w["reserved_bytes"] == made["truth"]["reserved"] and w["segments"] == len(segs)
    assert w["live_blocks"] == len(made["truth"]["blocks"])
    assert "window start" in format_report(r)


def test_recording_stopped_before_the_dump_is_reported_not_compared():
    made = simulate(mixed(), cut=2000, stop_at=None)
    full = made["window"]
    cut_history = dict(full, device_traces=[full["device_traces"][0][:-400]])
    t = from_snapshot(cut_history)
    ws = t.meta["window_start"]["0"]
    assert ws["problems"], "the dump holds blocks the history does not explain"
    r = replay(t, policy="builtin")
    assert not r["comparable"] and any("uncertain" in why for why in r["not_comparable"])
    text = format_report(r)
    assert "no percentage" in text and "not comparable" in text


def test_unknown_actions_are_reported():
    made = simulate(mixed(n=400), cut=100)
    w = made["window"]
    w = dict(w, device_traces=[w["device_traces"][0] + [{"action": "segment_grow", "addr": 0, "size": 1}]])
    r = replay(from_snapshot(w), policy="builtin")
    assert any("unknown action 'segment_grow'" in why for why in r["not_comparable"])


def test_expandable_segments_replay_as_mapped_ranges():
    base = 0x7F0000000000
    seg = {
        "device": 0, "address": base, "total_size": 6 * MiB, "stream": 0, "segment_type": "large",
        "is_expandable": True,
        "blocks": [
            {"size": 2 * MiB, "requested_size": 2 * MiB, "state": "active_allocated"},
            {"size": 4 * MiB, "requested_size": 0, "state": "inactive"},
        ],
    }  # fmt: skip
    trace = [
        {"action": "segment_map", "addr": base + 2 * MiB, "size": 4 * MiB, "stream": 0},
        {"action": "alloc", "addr": base + 2 * MiB, "size": 3 * MiB, "stream": 0},
        {"action": "free_completed", "addr": base + 2 * MiB, "size": 3 * MiB, "stream": 0},
    ]
    t = from_snapshot({"segments": [seg], "device_traces": [trace]})
    segs, blocks, ws = start_of(t)
    assert segs == [(base, 2 * MiB, 0, "large")] and ws["problems"] == []
    assert blocks == [(base, 2 * MiB, 2 * MiB)]
    assert t.builtin_peak_reserved == 6 * MiB
    r = replay(t, policy="builtin")
    assert r["comparable"] and r["window_start"]["reserved_bytes"] == 2 * MiB


GOOD = {"action": "alloc", "addr": 0x1000, "size": 512, "stream": 0}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"addr": -5, "size": -1}, r"device_traces\[0\]\[0\]: 'addr' is -5, outside"),
        ({"size": -1}, r"device_traces\[0\]\[0\]: 'size' is -1, outside"),
        ({"stream": 1 << 64}, r"'stream' is 18446744073709551616, outside"),
        ({"stream": -(1 << 63) - 1}, r"'stream' is -9223372036854775809, outside"),
        ({"addr": 1 << 64}, r"'addr' is 18446744073709551616"),
        ({"time_us": float("nan")}, r"'time_us' is nan, not a time"),
        ({"time_us": 1e300}, r"'time_us' is 1e\+300, not a time"),
        ({"action": "segment_alloc", "size": -3}, r"'size' is -3"),
    ],
)
def test_bad_values_are_clean_errors(change, message):
    with pytest.raises(SnapshotError, match=message):
        from_snapshot({"segments": [], "device_traces": [[dict(GOOD, **change)]]})


@pytest.mark.parametrize(
    "segment, message",
    [
        ({"total_size": -1}, r"segments\[0\]: 'total_size' is -1"),
        ({"address": -2}, r"segments\[0\]: 'address' is -2"),
        ({"device": 1 << 40}, r"segments\[0\]: 'device'"),
        ({"stream": 1 << 70}, r"segments\[0\]: 'stream'"),
        ({"blocks": [{"size": -512, "state": "inactive"}]}, r"segments\[0\].blocks\[0\]: 'size' is -512"),
        ({"blocks": "many"}, r"segments\[0\]: 'blocks' must be a list"),
    ],
)
def test_bad_segments_are_clean_errors(segment, message):
    seg = dict({"device": 0, "address": 0x2000, "total_size": 2 * MiB, "stream": 0}, **segment)
    with pytest.raises(SnapshotError, match=message):
        from_snapshot({"segments": [seg], "device_traces": [[GOOD]]})


def test_negative_stream_handles_are_64_bit_twos_complement():
    t = from_snapshot({"segments": [], "device_traces": [[dict(GOOD, stream=-1)]]})
    assert t.event(0)[3] == (1 << 64) - 1


def test_binding_refuses_bad_seeds_and_changes_nothing():
    pool = _C.Pool(1 << 40, "", True, False)
    with pytest.raises(RuntimeError, match="replay_start"):
        pool.replay_seed_segment(0, "large", 20 * MiB, [])
    pool.replay_start(-1)
    with pytest.raises(ValueError, match="kind must be 'small' or 'large'"):
        pool.replay_seed_segment(0, "medium", 20 * MiB, [])
    with pytest.raises(ValueError, match="block 1 .*overlaps"):
        pool.replay_seed_segment(0, "large", 20 * MiB, [(1, 0, 4 * MiB, 100), (2, MiB, 512, 512)])
    with pytest.raises(TypeError, match="seed block 0 must be a tuple"):
        pool.replay_seed_segment(0, "large", 20 * MiB, [[1, 0, 512, 512]])
    with pytest.raises(OverflowError):
        pool.replay_seed_segment(0, "large", 20 * MiB, [(1 << 64, 0, 512, 512)])
    assert pool.info()["segments"] == 0 and pool.check() == 0
    pool.replay_seed_segment(3, "small", 2 * MiB, [(9, 512, 1024, 1000)])
    info = pool.info()
    assert info["segments"] == 1 and info["live_blocks"] == 1 and info["free_blocks"] == 2
    pool.replay_stop()
    assert pool.check() == 0 and pool.info()["live_blocks"] == 0
    pool.close()


def test_recorded_releases_replay_to_the_recorded_peak():
    """A history whose run gave memory back (segment_free) replays under builtin to its
    recorded peak; without the releases the replay keeps everything and can only be higher."""
    rng = random.Random(5)
    events, live, ident = [], [], 0
    for _ in range(3000):
        if live and rng.random() < 0.5:
            events.append((FREE, live.pop(rng.randrange(len(live))), 0))
        else:
            ident += 1
            live.append(ident)
            events.append((ALLOC, ident, rng.choice([4096, 700 << 10, 3 << 20, 12 << 20, 40 << 20])))
    trace = Trace.from_events(events)
    made = simulate(trace, cut=0, empty_cache_every=500)
    snap = from_snapshot(made["full"], source="with releases")
    assert snap.meta["releases"] >= 5
    with_r = replay(snap, policy="builtin")
    without = replay(snap, policy="builtin", releases=False)
    assert with_r["releases"] == snap.meta["releases"] and without["releases_ignored"] == snap.meta["releases"]
    assert with_r["peak_reserved"] == snap.builtin_peak_reserved
    assert without["peak_reserved"] >= with_r["peak_reserved"]
    for policy in ("expandable", "cudapool"):
        assert replay(snap, policy=policy)["releases"] == snap.meta["releases"]

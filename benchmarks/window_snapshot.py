"""Torch memory snapshots made on the simulator: the known truth for windowed replays.

    python benchmarks/window_snapshot.py --workload gpt --scale small --cut 0.5 \\
        --out build/gpt-window.pickle [--full-out build/gpt-full.pickle]
    python -m cudapool replay build/gpt-window.pickle --policy builtin

``simulate(trace, cut)`` replays ``trace`` event by event under the ``builtin`` policy on a
simulated pool (the built-in allocator's rules) and writes down what a real run under the
built-in allocator would have put in ``torch.cuda.memory._dump_snapshot``: the dump-time
``segments`` (address, total_size, stream, segment_type, blocks with size, requested_size,
state and address) and one device's history (``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``, ``segment_free``, with ``time_us``). The windowed
snapshot keeps the same dump-time segments but only the entries from the ``cut``-th event
of the trace on: what a ring buffer that wrapped, or a recording started after the model was
loaded, leaves. ``truth`` holds the state at the cut (segments and live blocks, the
simulator's addresses) and the peak reserved from the cut on: what a reconstruction of the
window's start and a seeded replay must find. ``empty_cache_every`` gives memory back every
N events (segment_free entries); ``stop_at`` ends the history before the last event, as
when recording stops before the dump (then the snapshot is inconsistent, on purpose).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

try:
    import cudapool  # noqa: F401
except ImportError:  # not installed: the in-place build
    sys.path.insert(0, os.path.join(ROOT, "python"))

from cudapool import _C  # noqa: E402
from cudapool.lab.trace import ALLOC, Trace, load  # noqa: E402
from cudapool.policies import config_for  # noqa: E402

MiB = 1 << 20
SMALL_SEGMENT = 2 * MiB


def _entry(action: str, addr: int, size: int, stream: int, t: int) -> Dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t, "frames": []}


def simulate(
    trace: Trace, cut: int = 0, empty_cache_every: int = 0, stop_at: Optional[int] = None, block_addresses: bool = True
) -> Dict[str, Any]:
    """{"full": snapshot, "window": snapshot, "truth": {...}} for one device's ``trace`` cut
    before its event ``cut`` (see the module notes)."""
    pool = _C.Pool(1 << 50, config_for("builtin"), True, False)
    live: Dict[Tuple[int, int], Tuple[int, int, int, int]] = {}  # (stream, id) -> addr, size, requested, stream
    ids: Dict[int, Tuple[int, int]] = {}  # id -> (stream, id) while live
    segments: Dict[int, Dict[str, Any]] = {}  # addr -> size, stream, kind
    entries: List[Dict[str, Any]] = []
    cut_entry = 0
    truth: Dict[str, Any] = {}
    window_peak = 0
    info = pool.info()

    def state() -> Dict[str, Any]:
        blocks = sorted((a, size, req) for a, size, req, _ in live.values())
        segs = sorted((a, s["size"], s["stream"], s["kind"]) for a, s in segments.items())
        return {"segments": segs, "blocks": blocks, "reserved": info["reserved"]}

    for k, (action, ident, size, stream, _device, _t) in enumerate(trace):
        if k == cut:
            cut_entry = len(entries)
            truth = state()
            window_peak = info["reserved"]
        t = k + 1
        if empty_cache_every and k % empty_cache_every == empty_cache_every - 1:
            used = {a for a, _, _, _ in live.values()}
            for a in sorted(segments):
                s = segments[a]
                if not any(a <= u < a + s["size"] for u in used):
                    entries.append(_entry("segment_free", a, s["size"], s["stream"], t))
                    del segments[a]
            pool.empty_cache()
            info = pool.info()
            assert info["reserved"] == sum(s["size"] for s in segments.values())
        if action == ALLOC:
            if size == 0 or ident in ids:
                continue
            before = info
            addr = pool.alloc(size, stream)
            info = pool.info()
            grown = info["reserved"] - before["reserved"]
            if grown:  # a new segment: its first block is this one
                kind = "small" if grown <= SMALL_SEGMENT else "large"
                segments[addr] = {"size": grown, "stream": stream, "kind": kind}
                entries.append(_entry("segment_alloc", addr, grown, stream, t))
            block = info["allocated"] - before["allocated"]
            live[(stream, ident)] = (addr, block, size, stream)
            ids[ident] = (stream, ident)
            entries.append(_entry("alloc", addr, size, stream, t))
        else:
            key = ids.pop(ident, None)
            if key is None:
                continue
            addr, block, requested, st = live.pop(key)
            pool.free(addr)
            info = pool.info()
            entries.append(_entry("free_requested", addr, requested, st, t))
            entries.append(_entry("free_completed", addr, requested, st, t))
        if k >= cut:
            window_peak = max(window_peak, info["reserved"])
    assert pool.check() == 0, pool.check_report()
    pool.close()

    dump = []
    for a in sorted(segments):
        s = segments[a]
        inside = sorted((b[0], b[1], b[2]) for b in live.values() if a <= b[0] < a + s["size"])
        blocks = []
        at = a
        for baddr, bsize, req in inside + [(a + s["size"], 0, 0)]:
            if baddr > at:
                blocks.append({"address": at, "size": baddr - at, "requested_size": 0, "state": "inactive"})
            if bsize:
                blocks.append({"address": baddr, "size": bsize, "requested_size": req, "state": "active_allocated"})
            at = baddr + bsize
        if not block_addresses:
            for b in blocks:
                del b["address"]
        dump.append(
            {
                "device": 0,
                "address": a,
                "total_size": s["size"],
                "allocated_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                "stream": s["stream"],
                "segment_type": s["kind"],
                "is_expandable": False,
                "frames": [],
                "blocks": blocks,
            }
        )
    history = entries if stop_at is None else entries[:stop_at]
    full = {"segments": dump, "device_traces": [history]}
    window = {"segments": dump, "device_traces": [history[cut_entry:]]}
    truth["window_peak_reserved"] = window_peak
    truth["cut_entry"] = cut_entry
    return {"full": full, "window": window, "truth": truth}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="gpt", help="a workload of benchmarks/workloads, or a .cptrace file")
    ap.add_argument("--scale", default="small")
    ap.add_argument("--cut", type=float, default=0.5, help="where the window starts: a fraction of the events")
    ap.add_argument("--empty-cache-every", type=int, default=0, metavar="N")
    ap.add_argument("--out", required=True, help="the windowed snapshot (pickle)")
    ap.add_argument("--full-out", help="also the snapshot with the whole history")
    ns = ap.parse_args(argv)
    if os.path.isfile(ns.workload):
        trace = load(ns.workload)
    else:
        sys.path.insert(0, HERE)
        from workloads import WORKLOADS

        trace = WORKLOADS[ns.workload](scale=ns.scale, seed=0)
    cut = int(len(trace) * ns.cut)
    made = simulate(trace, cut=cut, empty_cache_every=ns.empty_cache_every)
    for path, key in ((ns.out, "window"), (ns.full_out, "full")):
        if path:
            with open(path, "wb") as f:
                pickle.dump(made[key], f)
    t = made["truth"]
    print(
        f"{len(trace):,} events, window from event {cut:,}: at its start {len(t['segments'])} segments, "
        f"{t['reserved']:,} B reserved, {len(t['blocks'])} blocks live; "
        f"peak reserved over the window {t['window_peak_reserved']:,} B"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

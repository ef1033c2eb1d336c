"""Draw a memory snapshot: a segment map and a timeline (``python -m cudapool plot``).

The segment map has one bar per segment (x: bytes from the segment's start), its blocks
coloured by state: allocated, waiting on a stream (freed, pending the streams it was used
on), free. A page-mapped segment is one bar for its whole address range: its mapped ranges
with their blocks, the rest drawn as unmapped (cut short when the range is much longer than
what is mapped; the label gives its size). The timeline shows allocated and reserved bytes
over the history records of the snapshot's ``device_traces`` (none without history).

matplotlib is needed (imported only here, when drawing); without it, :class:`PlotError`
says so.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._units import format_bytes

__all__ = ["PlotError", "STATE_COLOURS", "UNMAPPED_COLOUR", "render", "timeline", "segment_bars"]

# State -> fill colour (RGB hex); the tests look for these colours in the PNG.
STATE_COLOURS: Dict[str, str] = {
    "active_allocated": "#1f77b4",  # allocated
    "active_pending_free": "#ff7f0e",  # waiting on a stream
    "inactive": "#98df8a",  # free (cached)
}
UNMAPPED_COLOUR = "#d9d9d9"
STATE_LABELS = {
    "active_allocated": "allocated",
    "active_pending_free": "waiting on a stream",
    "inactive": "free (cached)",
}
MAX_BARS = 60
MiB = 1 << 20


class PlotError(RuntimeError):
    """The plot cannot be drawn (matplotlib missing, nothing to draw)."""


Bar = Dict[str, Any]  # label, size, shown, pieces [(offset, size, state or "unmapped")]


def segment_bars(snapshot: Dict[str, Any]) -> List[Bar]:
    """One bar per segment (page-mapped ranges joined into their address range), largest
    first, at most MAX_BARS (the bar list says how many were left out in ``hidden``)."""
    plain: List[Bar] = []
    paged: Dict[Tuple[int, int], Bar] = {}
    for seg in snapshot.get("segments", []):
        dev = seg.get("device", 0)
        if "page_segment_address" in seg:
            base = seg["page_segment_address"]
            bar = paged.setdefault(
                (dev, base),
                {
                    "device": dev,
                    "address": base,
                    "size": seg["page_segment_size"],
                    "kind": f"page-mapped {seg.get('segment_type', '')}",
                    "stream": seg.get("stream", 0),
                    "pieces": [],
                    "mapped": 0,
                },
            )
            bar["mapped"] += seg["total_size"]
        else:
            base = seg["address"]
            bar = {
                "device": dev,
                "address": base,
                "size": seg["total_size"],
                "kind": seg.get("segment_type", ""),
                "stream": seg.get("stream", 0),
                "pieces": [],
                "mapped": seg["total_size"],
            }
            plain.append(bar)
        offset = seg["address"] - base
        for b in seg.get("blocks", []):
            bar["pieces"].append((offset, b["size"], b.get("state", "inactive")))
            offset += b["size"]
    bars = plain + list(paged.values())
    for bar in bars:
        bar["pieces"].sort()
        if bar["mapped"] != bar["size"]:  # fill the unmapped gaps; cut a long tail short
            gaps, at = [], 0
            for off, size, _state in bar["pieces"]:
                if off > at:
                    gaps.append((at, off - at, "unmapped"))
                at = off + size
            end = max(at, 1)
            tail = bar["size"] - at
            shown_tail = min(tail, max(end // 4, 2 * MiB))
            if tail > 0:
                gaps.append((at, shown_tail, "unmapped"))
            bar["pieces"] += gaps
            bar["shown"] = at + shown_tail
        else:
            bar["shown"] = bar["size"]
    bars.sort(key=lambda b: (-b["mapped"], b["device"], b["address"]))
    hidden = max(0, len(bars) - MAX_BARS)
    bars = bars[:MAX_BARS]
    bars.sort(key=lambda b: (b["device"], b["address"]))
    for bar in bars:
        bar["hidden"] = hidden
    return bars


def timeline(snapshot: Dict[str, Any], device: Optional[int] = None) -> Tuple[List[int], List[int], List[int]]:
    """(record index, allocated bytes, reserved bytes) after each history record of one
    device (default: the first with records). Levels are anchored on the snapshot's own
    segments: the last point equals what the snapshot holds."""
    traces = snapshot.get("device_traces", [])
    if device is None:
        device = next((d for d, t in enumerate(traces) if t), 0)
    trace = traces[device] if device < len(traces) else []
    segs = [s for s in snapshot.get("segments", []) if s.get("device", 0) == device]
    final_alloc = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
    final_res = sum(s["total_size"] for s in segs)
    da = {"alloc": 1, "free_requested": -1}
    dr = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    xs, alloc, res = [0], [0], [0]
    a = r = 0
    for i, e in enumerate(trace, 1):
        a += da.get(e["action"], 0) * e.get("size", 0)
        r += dr.get(e["action"], 0) * e.get("size", 0)
        xs.append(i)
        alloc.append(a)
        res.append(r)
    a0, r0 = final_alloc - a, final_res - r
    return xs, [max(0, v + a0) for v in alloc], [max(0, v + r0) for v in res]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotError(
            "drawing needs matplotlib, which is not installed: pip install matplotlib "
            "(snapshots and memory_viz pickles work without it)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render(
    snapshot: Dict[str, Any],
    out: str,
    title: str = "cudapool memory snapshot",
    width_px: int = 1200,
    height_px: int = 900,
    dpi: int = 100,
) -> Dict[str, Any]:
    """Draw the segment map and the timeline of ``snapshot`` into the PNG ``out``
    (``width_px`` x ``height_px``). Returns what was drawn: bars, hidden bars, trace points."""
    if width_px < 200 or height_px < 200:
        raise ValueError(f"the image must be at least 200 x 200 pixels, not {width_px} x {height_px}")
    plt = _pyplot()
    from matplotlib.patches import Patch

    bars = segment_bars(snapshot)
    xs, alloc, res = timeline(snapshot)
    fig, (ax_map, ax_time) = plt.subplots(
        2, 1, figsize=(width_px / dpi, height_px / dpi), dpi=dpi, gridspec_kw={"height_ratios": [3, 2]}
    )
    fig.suptitle(title)
    for row, bar in enumerate(bars):
        for off, size, state in bar["pieces"]:
            if state == "unmapped":
                ax_map.barh(
                    row,
                    size / MiB,
                    left=off / MiB,
                    color=UNMAPPED_COLOUR,
                    edgecolor="#999999",
                    hatch="//",
                    linewidth=0.3,
                )
            else:
                ax_map.barh(
                    row,
                    size / MiB,
                    left=off / MiB,
                    color=STATE_COLOURS.get(state, "#7f7f7f"),
                    edgecolor="white",
                    linewidth=0.3,
                )
    labels = []
    for bar in bars:
        extra = f" of {format_bytes(bar['size'])} range" if bar["mapped"] != bar["size"] else ""
        labels.append(f"cuda:{bar['device']} s{bar['stream']} {bar['kind']} {format_bytes(bar['mapped'])}{extra}")
    ax_map.set_yticks(range(len(bars)))
    ax_map.set_yticklabels(labels, fontsize=7)
    ax_map.invert_yaxis()
    ax_map.set_xlabel("offset in segment (MiB)")
    hidden = bars[0]["hidden"] if bars else 0
    ax_map.set_title(
        f"segments: {len(bars)}" + (f" (the {hidden} smallest not shown)" if hidden else "") if bars else "no segments",
        fontsize=9,
    )
    handles = [Patch(color=c, label=STATE_LABELS[s]) for s, c in STATE_COLOURS.items()]
    handles.append(Patch(facecolor=UNMAPPED_COLOUR, edgecolor="#999999", hatch="//", label="page-mapped: unmapped"))
    ax_map.legend(handles=handles, fontsize=7, loc="lower right")
    if len(xs) > 1:
        ax_time.step(xs, [v / MiB for v in res], where="post", label="reserved", color="#d62728")
        ax_time.step(xs, [v / MiB for v in alloc], where="post", label="allocated", color="#1f77b4")
        ax_time.set_xlabel("history record")
        ax_time.set_ylabel("MiB")
        ax_time.legend(fontsize=8)
        ax_time.set_title("allocated and reserved memory over the recorded history", fontsize=9)
    else:
        ax_time.axis("off")
        ax_time.text(
            0.5, 0.5, "no history in this snapshot (cudapool.record_history() records it)", ha="center", va="center"
        )
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return {"bars": len(bars), "hidden": hidden, "trace_points": len(xs) - 1}


def states_present(snapshot: Dict[str, Any]) -> Sequence[str]:
    """The block states a snapshot's segments hold."""
    return sorted({b["state"] for s in snapshot.get("segments", []) for b in s.get("blocks", [])})

"""Handles in part use (stitch_partial_handles) through the lab, and benchmarks/frontier.py end to end."""

import json
import os
import subprocess
import sys

import pytest
from cudapool.lab.replay import replay
from cudapool.lab.trace import TraceWriter, save

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRONTIER = os.path.join(REPO, "benchmarks", "frontier.py")
MiB = 1 << 20


def part_used_trace(rounds=3):
    """Three 20 MiB handles; the first keeps an 8 MiB block at its start, the last one at its
    end, the middle one stays live; then `rounds` times a 24 MiB request that only the two
    free 12 MiB pieces can serve without growing."""
    w = TraceWriter()
    for i, size in enumerate((20, 20, 20)):
        w.alloc(i, size * MiB)
    w.free(0)
    w.free(2)
    for i, size in ((3, 8), (4, 12), (5, 12), (6, 8)):
        w.alloc(i, size * MiB)
    w.free(4)
    w.free(5)
    for r in range(rounds):
        w.alloc(10 + r, 24 * MiB)
        w.free(10 + r)
    return w.trace(meta={"workload": "part-used"})


def test_handles_in_part_use_stitch_instead_of_growing():
    t = part_used_trace()
    on = replay(t)
    off = replay(t, config="stitch_partial_handles:False")
    assert on["peak_reserved"] == 60 * MiB
    assert off["peak_reserved"] == 84 * MiB  # the 24 MiB grew the pool
    assert on["stitches"] == 1 and on["stitch_reuses"] == 2  # kept, and served again
    assert on["device_faults"] == 0 and off["device_faults"] == 0
    assert "stitch_partial_handles:False" in off["effective_config"]
    assert "stitch_partial_handles" not in on["effective_config"]


def test_stitch_partial_handles_rejects_a_bad_value():
    with pytest.raises(ValueError, match="stitch_partial_handles"):
        replay(part_used_trace(), config="stitch_partial_handles:maybe")


def test_frontier_end_to_end(tmp_path):
    path = tmp_path / "part-used.cptrace"
    save(part_used_trace(), str(path))
    out = tmp_path / "frontier.json"
    proc = subprocess.run(
        [sys.executable, FRONTIER, "--traces", str(path), "--variants", "handles-20,cudapool", "--jobs", "1",
         "--min-peak", "1MiB", "--json", str(out), "--no-plot"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    by = {r["variant"]: r for r in data["rows"]}
    assert set(by) == {"builtin", "expandable", "handles-20", "cudapool"}  # the yardsticks join
    assert by["cudapool"]["peak_reserved"] == 60 * MiB and by["handles-20"]["peak_reserved"] == 84 * MiB
    assert by["cudapool"]["utilization"] == pytest.approx(60 / 60)
    assert 1.0 <= by["cudapool"]["min_capacity_ratio"] <= 1.001
    assert by["handles-20"]["min_capacity_ratio"] > 1.0
    s = data["summary"]["cudapool"]
    assert s["traces"] == 1 and s["worst_utilization_trace"] == "part-used"
    assert "| cudapool |" in proc.stdout and "sim util" in proc.stdout


def test_frontier_refuses_an_unknown_variant(tmp_path):
    proc = subprocess.run(
        [sys.executable, FRONTIER, "--variants", "nope"], capture_output=True, text=True, timeout=60
    )  # fmt: skip
    assert proc.returncode == 2 and "unknown variant(s) nope" in proc.stderr

"""benchmarks/builtin_fidelity.py without a GPU: the snapshot -> replay -> table path it takes
after the recorded runs, on handcrafted torch memory snapshots, and its no-GPU exit. (The
snapshot reader and the replay themselves are tested in test_replay.py.)"""

import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "builtin_fidelity.py"
MiB = 1 << 20


def _load_script():
    spec = importlib.util.spec_from_file_location("builtin_fidelity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fidelity = _load_script()
from _gpu_common import gpu_skip_reason  # noqa: E402  (the script put benchmarks/ on sys.path)

SIDE = 0x7F00_1234_5000  # a second stream, as torch records it: the cudaStream_t value
A, B, C, D = 0x7F10_0000_0000, 0x7F10_0020_0000, 0x7F10_0160_0000, 0x7F10_02A0_0000


def _entry(action, addr, size, stream=0, t=[0]):
    t[0] += 10
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t[0], "frames": []}


def _segment(addr, size, stream=0):
    return {
        "device": 0,
        "address": addr,
        "total_size": size,
        "allocated_size": 0,
        "requested_size": 0,
        "stream": stream,
        "segment_type": "small" if size == 2 * MiB else "large",
        "blocks": [],
    }


def _handcrafted():
    """What torch 2.1+ records for this program under the built-in allocator's default rules:

    4 KiB and 1000 B (small pool: one 2 MiB segment), 3 MiB (a 20 MiB segment), 2 MiB on a
    second stream (blocks are per stream: another 20 MiB segment), the 3 MiB freed and 6 MiB
    taken from the same segment (no new one), 64 MiB (a segment of its own), then frees; the
    side-stream block's free completes later (it was used on another stream)."""
    trace = [
        _entry("segment_alloc", A, 2 * MiB),
        _entry("alloc", A, 4096),
        _entry("alloc", A + 4096, 1000),
        _entry("segment_alloc", B, 20 * MiB),
        _entry("alloc", B, 3 * MiB),
        _entry("segment_alloc", C, 20 * MiB, SIDE),
        _entry("alloc", C, 2 * MiB, SIDE),
        _entry("free_requested", B, 3 * MiB),
        _entry("free_completed", B, 3 * MiB),
        _entry("alloc", B, 6 * MiB),
        _entry("free_requested", C, 2 * MiB, SIDE),
        _entry("segment_alloc", D, 64 * MiB),
        _entry("alloc", D, 64 * MiB),
        _entry("free_completed", C, 2 * MiB, SIDE),
        _entry("free_requested", A, 4096),
        _entry("free_completed", A, 4096),
        _entry("free_requested", D, 64 * MiB),
        _entry("free_completed", D, 64 * MiB),
    ]
    segments = [_segment(A, 2 * MiB), _segment(B, 20 * MiB), _segment(C, 20 * MiB, SIDE), _segment(D, 64 * MiB)]
    return {"segments": segments, "device_traces": [trace]}


PEAK_RESERVED = (2 + 20 + 20 + 64) * MiB
PEAK_ALLOCATED = 4096 + 1024 + (6 + 2 + 64) * MiB  # block sizes: 1000 B rounds to 1024


@pytest.fixture
def snapshot_path(tmp_path):
    path = tmp_path / "run.pickle"
    with open(path, "wb") as f:
        pickle.dump(_handcrafted(), f, protocol=4)
    return path


def test_builtin_replay_reproduces_the_recorded_run(snapshot_path):
    real = {
        "peak_reserved": PEAK_RESERVED,
        "peak_allocated": PEAK_ALLOCATED,
        "num_device_alloc": 4,
        "snapshot": {"segment_alloc": 4},
    }
    row = fidelity.compare("hand", snapshot_path, real)
    assert row["events"] == 10  # 6 allocs, 4 frees (the 1000 B and 6 MiB blocks stay live)
    assert row["bad_events"] == 0 and row["frees_without_alloc"] == 0
    assert row["snapshot_peak_reserved"] == PEAK_RESERVED and row["snapshot_error"] == 0
    assert row["replay_peak_reserved"] == PEAK_RESERVED
    assert row["relative_error"] == 0
    assert row["replay_device_allocs"] == row["real_device_allocs"] == 4
    assert row["replay_peak_allocated"] == PEAK_ALLOCATED
    assert not row["replay_oom"]
    assert row["cudapool_peak_reserved"] > 0

    table = fidelity.markdown_table([row])
    assert table.count("\n") == 2
    assert "| hand | 10 | 106.0 | 106.0 | 106.0 | +0.00 % | 4 / 4 |" in table
    assert fidelity.notes([row], {"hand": real}) == []


def test_device_allocs_fall_back_to_segment_alloc_entries(snapshot_path):
    real = {
        "peak_reserved": 2 * PEAK_RESERVED,
        "peak_allocated": PEAK_ALLOCATED,
        "num_device_alloc": None,
        "snapshot": {"segment_alloc": 4},
    }
    row = fidelity.compare("hand", snapshot_path, real)
    assert row["real_device_allocs"] == 4
    assert row["relative_error"] == pytest.approx(-0.5)
    assert "-50.00 %" in fidelity.markdown_table([row])
    assert any("differs from max_memory_reserved()" in n for n in fidelity.notes([row], {"hand": real}))


def test_a_window_that_misses_the_start_is_flagged(tmp_path):
    snap = _handcrafted()
    snap["device_traces"][0] = snap["device_traces"][0][3:]  # recording began after the first allocs
    path = tmp_path / "late.pickle"
    with open(path, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    real = {"peak_reserved": PEAK_RESERVED, "peak_allocated": PEAK_ALLOCATED, "num_device_alloc": 4}
    row = fidelity.compare("late", path, real)
    assert row["frees_without_alloc"] == 1  # the 4 KiB block
    assert row["snapshot_peak_reserved"] == PEAK_RESERVED  # the 2 MiB segment from the dump's segments
    notes = fidelity.notes([row], {"late": real})
    assert any("does not hold the whole run" in n for n in notes)


def test_main_prints_the_table_and_writes_json(tmp_path, monkeypatch, capsys):
    """The driver end to end, with the recorded runs stood in for by the handcrafted snapshot."""
    real = {
        "what": "handcrafted",
        "seconds": 0.1,
        "device": "NVIDIA H200",
        "torch": "2.x",
        "cuda": "13.0",
        "peak_reserved": PEAK_RESERVED,
        "peak_allocated": PEAK_ALLOCATED,
        "num_device_alloc": 4,
        "reserved_at_start": 0,
        "history_wrapped": False,
        "num_alloc_retries": 0,
        "num_ooms": 0,
        "snapshot": {"segment_alloc": 4, "segment_map": 0, "expandable_segments": False},
    }

    def fake_run_child(workload, snapshot, args):
        if workload == "cnn":
            raise fidelity.RunFailed("cnn: exited with status 1\n--- stderr ---\nboom")
        with open(snapshot, "wb") as f:
            pickle.dump(_handcrafted(), f, protocol=4)
        return dict(real, workload=workload)

    monkeypatch.setattr(fidelity, "skipped_without_gpu", lambda name, json_path: False)
    monkeypatch.setattr(fidelity, "run_child", fake_run_child)
    out = tmp_path / "fidelity.json"
    assert fidelity.main(["--workloads", "transformer,random", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("| 106.0 | 106.0 | 106.0 | +0.00 % | 4 / 4 |") == 2
    assert "largest |relative error| of the replayed builtin peak reserved: +0.00 %" in text
    payload = json.loads(out.read_text())
    assert [r["workload"] for r in payload["rows"]] == ["transformer", "random"]
    assert payload["errors"] == {} and set(payload["runs"]) == {"transformer", "random"}

    assert fidelity.main(["--workloads", "cnn,random", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAILED: cnn: exited with status 1" in text and "| random |" in text
    assert set(json.loads(out.read_text())["errors"]) == {"cnn"}


def test_arguments():
    assert fidelity.parse_args([]).workload_list == list(fidelity.WORKLOADS)
    assert fidelity.parse_args(["--workloads", "random, cnn"]).workload_list == ["random", "cnn"]
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--workloads", "nope"])
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--worker", "random"])  # needs --snapshot


@pytest.mark.skipif(gpu_skip_reason() is None, reason="a CUDA GPU is here: the check would run")
def test_without_a_gpu_it_skips(tmp_path):
    out = tmp_path / "fidelity.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("no CUDA GPU: skipped")
    assert set(json.loads(out.read_text())) == {"skipped"}

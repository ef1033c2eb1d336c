"""The tracer against allocation sequences derived without it (benchmarks/tracer_fidelity.py):
by hand from torch's rules, and from the CPU run under no dispatch mode (profiler memory
events). Also windows that start after the model exists, fake CUDA tensors and the modelled
cuBLAS workspace."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

try:
    import torch
except Exception:  # not installed, or a broken install
    torch = None

pytestmark = pytest.mark.skipif(torch is None, reason="torch is not importable")

if torch is not None:
    import tracer_fidelity as fid
    from cudapool.fakegpu.tracer import Tracer
    from cudapool.lab.trace import ALLOC, FREE


def test_fp32_inference_in_a_late_window_is_the_hand_sequence():
    ev, tr = fid.traced(lambda m, d: fid.infer(m, d, autocast=False), "meta")
    assert ev[: len(fid.HAND["mlp infer fp32"])] == fid.HAND["mlp infer fp32"]
    start = tr.trace().meta["window_start"]["0"]
    assert start["live_blocks"] == 4 and start["live_bytes"] == 4 * (16 * 32 + 32 + 32 * 8 + 8)
    assert tr.start_bytes == start["live_bytes"]


def test_bf16_autocast_on_fake_cuda_follows_cudas_rules():
    ev, tr = fid.traced(lambda m, d: fid.infer(m, d, autocast=True), "cuda")
    r = fid.row("bf16", "fake-cuda", "hand", fid.HAND["mlp infer bf16 autocast"], ev)
    assert r["same_sizes_in_order"] and r["peak_error_pct"] == 0.0
    assert tr.trace().meta["fake_cuda"] is True


def test_autocast_is_invisible_on_meta():
    ev, _ = fid.traced(lambda m, d: fid.infer(m, d, autocast=True), "meta")
    assert ev[: len(fid.HAND["mlp infer fp32"])] == fid.HAND["mlp infer fp32"]


def test_training_in_a_late_window_matches_the_unobserved_cpu_run():
    ref = fid.big(fid.cpu_unobserved(fid.train))
    ev, tr = fid.traced(fid.train, "meta")
    r = fid.row("train", "meta", "cpu-unobserved", ref, fid.big(ev))
    assert r["same_sizes_in_order"] and r["peak_error_pct"] == 0.0
    # p.data and the in-place update are views and in-place ops of storages from before the
    # window: no allocation; nothing of the window is left live.
    assert tr.live_count == 0 and len(tr.trace().meta["window_start"]["0"]["allocations"]) == 4


def test_bf16_autocast_training_on_fake_cuda():
    """Backward on fake CUDA tensors with CUDA's autocast rules, against the CPU run under the
    CPU's autocast (the same casts for linear): every allocation, in order."""
    ref = fid.big(fid.cpu_unobserved(fid.train_bf16))
    ev, tr = fid.traced(fid.train_bf16, "cuda")
    r = fid.row("bf16 train", "fake-cuda", "cpu-unobserved", ref, fid.big(ev))
    assert r["same_sizes_in_order"] and r["peak_error_pct"] == 0.0
    assert tr.fake and tr.live_count == 0


def test_summed_gradients_are_summed_in_place():
    ref = fid.big(fid.cpu_unobserved(fid.train_shared))
    ev, _ = fid.traced(fid.train_shared, "meta")
    r = fid.row("shared", "meta", "cpu-unobserved", ref, fid.big(ev))
    assert r["same_sizes_in_order"] and r["peak_error_pct"] == 0.0
    # torch's engine, with the tracer's mode on, sums out of place: two allocations the
    # unobserved run does not make, the peak not raised.
    ev, _ = fid.traced(fid.train_shared, "meta", backward="torch")
    r = fid.row("shared", "meta", "cpu-unobserved", ref, fid.big(ev))
    assert r["traced_allocs"] - r["expected_allocs"] == 2 and r["peak_error_pct"] == 0.0


def test_switched_formulas_write_into_their_zeros():
    """Indexing, max and gather: their backward formulas scatter out of place on subclass-like
    tensors; the trace keeps the in-place allocations of the unobserved run."""
    ref = fid.big(fid.cpu_unobserved(fid.train_indexed))
    ev, _ = fid.traced(fid.train_indexed, "meta", kernel_scratch=False)
    r = fid.row("indexed", "meta", "cpu-unobserved", ref, fid.big(ev))
    assert r["same_sizes_in_order"] and r["peak_error_pct"] == 0.0
    ev, _ = fid.traced(fid.train_indexed, "cuda", kernel_scratch=False)
    r = fid.row("indexed", "fake-cuda", "cpu-unobserved", ref, fid.big(ev))
    assert r["same_sizes_in_order"] and r["peak_error_pct"] == 0.0
    ev, _ = fid.traced(fid.train_indexed, "meta", kernel_scratch=False, backward="torch")
    r = fid.row("indexed", "meta", "cpu-unobserved", ref, fid.big(ev))
    assert r["traced_allocs"] > r["expected_allocs"]


def test_views_of_unrecorded_inputs_allocate_nothing():
    w = torch.empty(64, 64, device="meta")
    with Tracer(device="meta", adopt_inputs=False) as tr:
        a = w.unsqueeze(0)
        b = w.detach().select(0, 1)
        w.mul_(2)
        c = w * 2
    assert [e[:3] for e in tr.events] == [(ALLOC, 1, 64 * 64 * 4)]
    del a, b, c


def test_window_frees_of_start_storages_and_replay_seeding():
    pytest.importorskip("cudapool._C")
    from cudapool.lab.replay import replay

    big = torch.empty(1 << 20, device="meta")
    keep = torch.empty(10, device="meta")
    with Tracer(device="meta", window=True) as tr:
        x = big + 1
        del big
    t = tr.trace()
    start = t.meta["window_start"]["0"]
    ids = {a[0]: a[1] for a in start["allocations"]}
    assert (FREE, 4 << 20) in [(e[0], e[2]) for e in t if e[1] in ids]
    assert tr.live_bytes == (4 << 20) + tr.start_bytes - (4 << 20)
    for policy in ("builtin", "cudapool"):
        res = replay(t, policy=policy)
        assert res["window_start"]["seeded"] == "allocations"
        assert res["peak_allocated"] >= 2 * (4 << 20)
    del x, keep


def test_cublas_workspace_is_modelled_once_per_stream():
    with Tracer(device="meta", workspace_bytes=32 << 20) as tr:
        a = torch.empty(8, 8, device="meta")
        _ = a @ a
        _ = a @ a
        with tr.stream(1):
            _ = torch.mm(a, a)
    sizes = [e[2] for e in tr.events if e[0] == ALLOC]
    assert sizes.count(32 << 20) == 2
    meta = tr.trace().meta
    assert meta["workspace_bytes"] == 32 << 20 and not any(u.startswith("cublas") for u in meta["unseen"])
    assert any(u.startswith("cublas") for u in Tracer().trace().meta["unseen"])


def test_lab_gpu_comparison_runs_the_workloads_untraced():
    """benchmarks/tracer_lab_gpu.py (run by scripts/gpu-check.sh): without a GPU it skips; its
    untraced run of a workload records nothing and leaves the tracer in place."""
    import cudapool.fakegpu.tracer as tracer_mod
    import tracer_lab_gpu as lab

    real = tracer_mod.Tracer
    lab.run_untraced("cnn", "small", "meta")
    assert tracer_mod.Tracer is real
    if not torch.cuda.is_available():
        assert lab.main(["--out", "unused", "--workloads", "cnn"]) == 0
    with pytest.raises(SystemExit):
        lab.main(["--out", "unused", "--workloads", "rmm_random"])

"""The tracer's own backward pass (cudapool.fakegpu.backward) and the corrections that make a trace
take the allocations a GPU run makes: the gradients it computes are torch's, its sums are in
place where the engine's are on ordinary dense tensors, saved tensors go when their node has
run, and it runs on fake CUDA tensors without a GPU."""

import contextlib
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
    from cudapool.fakegpu import backward as _backward
    from cudapool.fakegpu.tracer import Tracer
    from cudapool.lab.trace import ALLOC, FREE

    class _Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * 2 + x * 0


def _program(device):
    """Shared uses, a two-output op, a custom Function, a checkpointed block and a leaf hook."""
    torch.manual_seed(0)
    lin1 = torch.nn.Linear(8, 16, device=device)
    lin2 = torch.nn.Linear(8, 4, device=device)
    lin1.bias.register_hook(lambda g: g * 3)
    x = torch.randn(5, 8, device=device)
    h = torch.relu(lin1(x))
    a, b = h.chunk(2, dim=1)
    y = lin2(a) + lin2(_Twice.apply(b))
    z = torch.utils.checkpoint.checkpoint(lambda t: (t * t).sum(), h, use_reentrant=False)
    return (y * y).mean() + z, [lin1.weight, lin1.bias, lin2.weight, lin2.bias]


def _reference():
    loss, params = _program("cpu")
    loss.backward()
    return [p.grad.clone() for p in params]


def test_gradients_are_torchs():
    ref = _reference()
    saved = _backward.SavedTensors()
    with saved:
        loss, params = _program("cpu")
    _backward.run_backward(saved, [loss], [torch.ones(())], False, False)
    for want, p in zip(ref, params):
        torch.testing.assert_close(p.grad, want)


def test_inside_a_tracer_backward_runs_on_the_tracers_pass_and_matches():
    ref = _reference()
    with Tracer(device="cpu") as tr:
        loss, params = _program("cpu")
        loss.backward()
    assert tr.backward == "tracer" and tr.trace().meta["backward"] == "tracer"
    for want, p in zip(ref, params):
        torch.testing.assert_close(p.grad, want)


def test_a_second_backward_needs_retain_graph_and_then_accumulates():
    saved = _backward.SavedTensors()
    with saved:
        loss, params = _program("cpu")
    _backward.run_backward(saved, [loss], [torch.ones(())], True, False)
    once = params[2].grad.clone()
    _backward.run_backward(saved, [loss], [torch.ones(())], False, False)
    torch.testing.assert_close(params[2].grad, 2 * once)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _backward.run_backward(saved, [loss], [torch.ones(())], False, False)


def test_grad_returns_the_wanted_gradients_and_accumulates_nothing():
    ref = _reference()
    with Tracer(device="cpu"):
        loss, params = _program("cpu")
        w, bias = torch.autograd.grad(loss, params[:2])
    torch.testing.assert_close(w, ref[0])
    torch.testing.assert_close(bias, ref[1])
    assert all(p.grad is None for p in params)
    with Tracer(device="cpu"):
        loss, params = _program("cpu")
        unused = torch.zeros(3, requires_grad=True)
        with pytest.raises(RuntimeError, match="not have been used"):
            torch.autograd.grad(loss, [params[0], unused])
        loss, params = _program("cpu")
        g = torch.autograd.grad(loss, [params[0], unused], allow_unused=True)
        assert g[1] is None


def test_backward_with_inputs_accumulates_only_those():
    ref = _reference()
    with Tracer(device="cpu"):
        loss, params = _program("cpu")
        loss.backward(inputs=[params[2]])
    torch.testing.assert_close(params[2].grad, ref[2])
    assert params[0].grad is None and params[1].grad is None and params[3].grad is None


def test_custom_functions_with_non_tensor_inputs_and_missing_gradients():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, k, x, y):
            return x * k, y * 2

        @staticmethod
        def backward(ctx, gx, gy):
            return None, gx * 3, gy * 2  # gy: zeros made by torch when the output was unused

    def run(inside):
        x = torch.ones(3, requires_grad=True)
        y = torch.ones(3, requires_grad=True)
        if inside:
            with Tracer(device="cpu") as tr:
                a, _ = Scale.apply(3, x, y)
                a.sum().backward()
            return x.grad, y.grad, tr
        a, _ = Scale.apply(3, x, y)
        a.sum().backward()
        return x.grad, y.grad, None

    gx, gy, _ = run(False)
    tx, ty, tr = run(True)
    torch.testing.assert_close(tx, gx)
    torch.testing.assert_close(ty, gy)
    assert float(ty.sum()) == 0.0


def test_reentrant_checkpoint_runs_a_backward_inside_a_node():
    def run(inside):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8, requires_grad=True)
        ctx = Tracer(device="cpu") if inside else contextlib.nullcontext()
        with ctx:
            y = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(lin(t)) * 2, x, use_reentrant=True)
            (y * y).sum().backward()
        return lin.weight.grad, x.grad

    for want, got in zip(run(False), run(True)):
        torch.testing.assert_close(got, want)


def test_post_accumulate_grad_hooks_run():
    seen = []
    with Tracer(device="meta"):
        w = torch.randn(4, 4, device="meta", requires_grad=True)
        w.register_post_accumulate_grad_hook(lambda p: seen.append(tuple(p.grad.shape)))
        (w * 2).sum().backward()
    assert seen == [(4, 4)]


def test_create_graph_goes_to_torchs_engine():
    with Tracer(device="cpu"):
        x = torch.tensor([3.0], requires_grad=True)
        (g,) = torch.autograd.grad(x**3, x, create_graph=True)
        (gg,) = torch.autograd.grad(g, x)
    assert float(gg) == pytest.approx(18.0)


def test_bad_backward_choice():
    with pytest.raises(ValueError, match="backward must be"):
        Tracer(backward="engine")


def test_backward_runs_on_fake_cuda_and_gives_grads():
    ev, tr = fid.traced(fid.train, "cuda")
    assert tr.fake and any(e == ("A", 16 * 32 * 4) for e in ev)  # the first weight's gradient
    assert tr.live_count == 0


def test_saved_tensors_are_freed_as_their_nodes_run():
    """A chain of 8 layers: on the tracer's pass each activation goes once its node has run,
    so the backward holds about one activation at a time (as torch's engine does on a GPU)."""
    act = 256 * 1024 * 4
    with Tracer(device="meta") as tr:
        x = torch.randn(256, 1024, device="meta", requires_grad=True)
        h = x
        for _ in range(8):
            h = torch.tanh(h)  # each saves its output
        peak_forward = tr.live_bytes
        h.sum().backward()
        del h
    # forward: x and 8 activations; backward adds a gradient or two at a time, while the
    # activations go one by one.
    assert peak_forward == 9 * act
    assert tr.peak_bytes <= peak_forward + 2 * act + 64  # and a few scalars
    assert tr.live_bytes == 2 * act  # x and its gradient


def test_index_put_sort_scratch_as_recorded_on_a_gpu():
    """Indexing's backward on CUDA: zeros, then index_put_ with accumulate=True, which sorts
    the N indices with scratch buffers (recorded on a GPU with N = 512: 8N bytes x 5, one of
    them freed early, and 1 byte of CUB temporary storage)."""
    n = 512
    table = torch.empty(100, 16, device="meta", requires_grad=True)
    ids = torch.zeros(4, 128, dtype=torch.long, device="meta")
    with Tracer(device="meta", record_ops=True) as tr:
        table[ids].sum().backward()
    scratch = [(e[0], e[2]) for e in tr.events if tr.alloc_ops.get(e[1]) == "index_put scratch" or e[0] == FREE]
    allocs = [e for e in tr.events if e[0] == ALLOC]
    names = [tr.alloc_ops.get(e[1], "") for e in allocs]
    assert names.count("index_put scratch") == 6
    sizes = [e[2] for e, name in zip(allocs, names) if name == "index_put scratch"]
    assert sizes == [8 * n] * 5 + [1]
    # Live: the table and the indices (recorded at first use) and the table's gradient, which
    # index_put wrote into its zeros instead of a copy.
    assert tr.live_count == 3 and "aten.index_put.default" not in names
    assert scratch  # frees recorded
    with Tracer(device="meta", record_ops=True, kernel_scratch=False) as tr2:
        table.grad = None
        table[ids].sum().backward()
    assert "index_put scratch" not in tr2.alloc_ops.values()


def test_inference_mode_sees_composite_temporaries():
    """Under inference_mode autograd's keys are off: composite operations reach the tracer
    whole. It runs them with the tracer on, as CUDA runs them, so their temporaries show: the
    4-byte scalar tensor of where(mask, x, -inf), as a GPU snapshot records it."""
    x = torch.empty(4, 8, device="meta")
    mask = torch.empty(4, 8, dtype=torch.bool, device="meta")
    with Tracer(device="meta", record_ops=True) as tr, torch.inference_mode():
        y = torch.where(mask, x, float("-inf"))
    sizes = [(tr.alloc_ops[e[1]], e[2]) for e in tr.events if e[0] == ALLOC]
    assert ("aten.scalar_tensor.default", 4) in sizes
    assert ("aten.where.self", 4 * 8 * 4) in sizes
    del y

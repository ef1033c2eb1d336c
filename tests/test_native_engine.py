"""The fake GPU below Python (cudapool._torch_fakecuda, cudapool.fakegpu.native) against torch itself:
what torch's own CUDA paths do on it, what it records, and that torch is whole again after it.

Each scenario runs in a fresh process: the engine replaces torch's CUDA kernels, device guard and
one slot of its CUDA hooks for the process while installed, and autograd's device threads, once
started, stay."""

import json
import sys
from pathlib import Path

import pytest
from scenario import expect_ok, run_python

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from cudapool.fakegpu.native import why_unavailable  # noqa: E402

WHY = why_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the native engine cannot run here: {WHY}")

PRELUDE = f"""
import json, sys
sys.path.insert(0, {str(ROOT / "python")!r})
import torch, torch.nn as nn, torch.nn.functional as F
from cudapool.fakegpu import FakeGPU, ValueRead, cublas_workspace_bytes, gpu_model
from cudapool.fakegpu.kernel_scratch import op_steps
from cudapool.lab.trace import ALLOC, FREE
H100 = gpu_model("H100")
def sizes(events, lo=0):
    return [(e[0], e[2]) for e in events[lo:]]
"""


def scenario(body: str, timeout: float = 240) -> str:
    return expect_ok(run_python(PRELUDE + body + "\nprint('OK')\n", timeout=timeout))


def test_torch_is_whole_again_after_the_fake_gpu() -> None:
    scenario(
        """
def attempt(fn):
    try:
        fn()
        return "ran"
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc).splitlines()[0]
before = [attempt(lambda: torch.empty(4, device="cuda")), attempt(lambda: torch._C._cuda_hasPrimaryContext(0))]
with FakeGPU(H100, engine="native") as fg:
    assert torch.cuda.is_available() and torch.cuda.device_count() == 1
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    assert type(x) is torch.Tensor and x.is_cuda and x.device == torch.device("cuda", 0)
    (x @ x).sum().backward()  # autograd's engine on its CUDA device thread
    assert x.grad is not None and x.grad.is_cuda
    kernels = fg.tracer._counts()["kernels"]
    assert kernels > 1000, kernels  # every operation with a CUDA kernel that runs device code
after = [attempt(lambda: torch.empty(4, device="cuda")), attempt(lambda: torch._C._cuda_hasPrimaryContext(0))]
assert after == before, (before, after)
assert not torch.cuda.is_available()
n = len(fg.tracer.events)
del x  # freed after the trace ended: not recorded, and nothing breaks
assert len(fg.tracer.events) == n
with FakeGPU(H100, engine="native") as again:  # installs again in the same process
    y = torch.ones(3, device="cuda")
assert [(e[0], e[2]) for e in again.tracer.events] == [(ALLOC, 12)]
"""
    )


def test_what_a_training_step_allocates_is_what_torch_does_on_a_gpu() -> None:
    out = scenario(
        """
with FakeGPU(H100, engine="native") as fg:
    ws = cublas_workspace_bytes(H100)
    lin = nn.Linear(256, 256).cuda()                   # weight and bias moved: two allocations
    assert sizes(fg.tracer.events) == [(ALLOC, 256 * 256 * 4), (ALLOC, 256 * 4)]
    x = torch.randn(32, 256, device="cuda")
    n = len(fg.tracer.events)
    y = lin(x)                                          # addmm: its output, then cuBLAS's workspace
    assert sizes(fg.tracer.events, n)[:2] == [(ALLOC, 32 * 256 * 4), (ALLOC, ws)], sizes(fg.tracer.events, n)
    y.sum().backward()                                  # autograd's thread: a workspace of its own
    grads = sizes(fg.tracer.events, n)
    assert grads.count((ALLOC, ws)) == 2, grads
    n = len(fg.tracer.events)
    lin(x).sum().backward()                             # second pass: gradients summed in place
    second = sizes(fg.tracer.events, n)
    # The new weight gradient (mm's output) is added into .grad and freed: no sum is allocated.
    assert second.count((ALLOC, 256 * 256 * 4)) == 1 and second.count((FREE, 256 * 256 * 4)) == 1, second
    assert second.count((ALLOC, ws)) == 0
    # A second identical step: the same events, its operations answered from the cache.
    n, cached = len(fg.tracer.events), fg.tracer.cached
    lin(x).sum().backward()
    assert sizes(fg.tracer.events, n) == second
    assert fg.tracer.cached > cached
    # AdamW on CUDA tensors takes torch's foreach path, as on a GPU: state, then no per-tensor temporaries.
    opt = torch.optim.AdamW(lin.parameters())
    opt.step(); n = len(fg.tracer.events); opt.step()
    step2 = sizes(fg.tracer.events, n)
    assert all(size <= 256 * 256 * 4 for _, size in step2), step2
    print(json.dumps({"events": len(fg.tracer.events), "peak": fg.tracer.peak_bytes, "live": fg.tracer.live_bytes}))
"""
    )
    facts = json.loads(out.splitlines()[-2])
    assert facts["peak"] >= facts["live"] > 0


def test_values_read_are_zeros_counted_at_the_script_line() -> None:
    scenario(
        """
with FakeGPU(H100, engine="native") as fg:
    loss = torch.randn(8, device="cuda").pow(2).mean()
    assert loss.item() == 0.0 and float(loss) == 0.0 and f"{loss:.4f}" == "0.0000"
    assert torch.ones(3, device="cuda").tolist() == [0.0, 0.0, 0.0]
    host = torch.ones(2, 3, device="cuda").cpu()        # a copy to the host: zeros of its shape
    assert host.device.type == "cpu" and host.shape == (2, 3) and host.abs().sum().item() == 0
    assert not torch.equal(loss, loss)
    assert "tensor(0., device='cuda:0')" in repr(loss)
    assert fg.value_reads >= 4 and fg.host_copies >= 2, (fg.value_reads, fg.host_copies)
    assert fg.value_read_sites and fg.value_read_sites[0].startswith("<string>:"), fg.value_read_sites
with FakeGPU(H100, engine="native", strict_values=True):
    t = torch.ones(2, device="cuda").sum()
    try:
        t.item()
        raise AssertionError("strict_values let a value read through")
    except ValueRead as exc:
        assert "its value is not simulated" in str(exc)
"""
    )


def test_attention_runs_the_kernel_torch_picks_on_the_named_gpu() -> None:
    scenario(
        """
def attention(gpu, dtype, mask=False):
    with FakeGPU(gpu_model(gpu), engine="native") as fg:
        q = torch.randn(2, 4, 256, 64, device="cuda", dtype=dtype, requires_grad=True)
        m = torch.ones(256, 256, device="cuda").bool() if mask else None
        o = F.scaled_dot_product_attention(q, q, q, attn_mask=m)
        o.sum().backward()
        return fg.sdpa, fg.tracer.peak_bytes
sdpa, _ = attention("A100-80GB", torch.bfloat16)
assert sdpa == {"flash": 1}, sdpa
sdpa, _ = attention("H100", torch.bfloat16)
assert set(sdpa) <= {"cudnn", "flash"}, sdpa
sdpa, peak_fused = attention("A100-80GB", torch.float32)
assert sdpa == {"efficient": 1}, sdpa
# The math path (a T x T map per head in float32) where no fused kernel takes the inputs.
sdpa, _ = attention("V100", torch.float32, mask=True)
assert sdpa in ({"efficient": 1}, {"math": 1}), sdpa
with FakeGPU(gpu_model("T4"), engine="native") as fg:
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        q = torch.randn(2, 4, 256, 64, device="cuda", requires_grad=True)
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    assert fg.sdpa == {"math": 1}, fg.sdpa
    assert fg.tracer.peak_bytes > peak_fused + 2 * 4 * 256 * 256 * 4  # the attention maps
"""
    )


def test_kernel_scratch_is_the_python_model_asked_once_per_shape() -> None:
    scenario(
        """
with FakeGPU(H100, engine="native") as fg:
    g = torch.randn(4096, 1024, device="cuda")
    n = len(fg.tracer.events)
    s = g.sum(0)                                        # a bias gradient's reduction: staged
    expected = op_steps("aten::sum", (torch.empty(4096, 1024, device="meta"), [0]), {}, fg.tracer.gpu)[0]
    got = [size if kind == ALLOC else -1 for kind, size in sizes(fg.tracer.events, n)]
    staged = [s_ for s_ in expected if s_ > 0]
    assert staged, expected
    assert got[0] == 1024 * 4 and [x for x in got[1:] if x > 0] == staged, (got, expected)
    n = len(fg.tracer.events)
    g.sum(0)
    again = [size if kind == ALLOC else -1 for kind, size in sizes(fg.tracer.events, n)]
    assert again[: len(got)] == got
"""
    )


def test_what_cannot_run_names_the_operation() -> None:
    scenario(
        """
with FakeGPU(H100, engine="native"):
    x = torch.randn(8, device="cuda")
    try:
        x.nonzero()
        raise AssertionError("nonzero ran")
    except RuntimeError as exc:
        assert "aten::nonzero" in str(exc) and "data-dependent" in str(exc), exc
    y = x * 2  # the engine goes on after a refused operation
    assert y.shape == (8,)
"""
    )


def test_the_engine_matches_torchs_fake_tensors_on_a_transformer_step() -> None:
    # Same peak; the event counts differ where torch's CUDA paths differ from fake tensors'
    # (in place on plain tensors, foreach optimizers): docs/ab.md.
    scenario(
        """
def run(engine):
    with FakeGPU(H100, engine=engine) as fg:
        layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).cuda()
        x = torch.randn(4, 64, 128, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        return fg.tracer.peak_bytes, dict(fg.sdpa)
native, python = run("native"), run("python")
assert native == python, (native, python)
""",
        timeout=400,
    )


def test_a_wrong_engine_name_and_an_engine_that_cannot_run_are_refused() -> None:
    scenario(
        """
import cudapool._torch_fakecuda as m
from cudapool.fakegpu import native
from cudapool.fakegpu import resolve_engine
try:
    FakeGPU(H100, engine="fast")
    raise AssertionError("accepted")
except ValueError as exc:
    assert "auto, native, python" in str(exc)
m.torch_version = "0.0"
assert "built for torch 0.0" in native.why_unavailable()
assert resolve_engine("auto") == "python"
try:
    resolve_engine("native")
    raise AssertionError("accepted")
except RuntimeError as exc:
    assert "built for torch 0.0" in str(exc)
"""
    )


def test_the_records_are_the_replays_own_and_reach_python_as_bytes() -> None:
    import struct

    import cudapool._torch_fakecuda as m
    from cudapool.lab._events import EVENT, FIELDS

    offsets, at = [], 0
    for name, code in FIELDS:
        if name:
            offsets.append((name, at, struct.calcsize("<" + code)))
        at += struct.calcsize("<" + code)
    assert tuple(offsets) == tuple(tuple(f) for f in m.record_layout)
    assert EVENT.size == m.record_size
    scenario(
        """
from cudapool.lab.trace import Trace
with FakeGPU(H100, engine="native") as fg:
    a = torch.empty(1000, device="cuda")
    del a
    b = torch.empty(10, device="cuda")
    events, trace = fg.tracer.events, fg.tracer.trace()
    assert type(fg.tracer._records) is bytearray and trace.data == bytes(fg.tracer._records)
    assert [e[:3] for e in events] == [(ALLOC, 1, 4000), (FREE, 1, 4000), (ALLOC, 2, 40)], list(events)
    assert list(events) == list(trace) == events[:] and events[-1] == trace.event(2) and len(events) == 3
    assert all(e[3] == 0 and e[4] == 0 and e[5] > 0 for e in events), list(events)
    assert events[1:] == [trace.event(1), trace.event(2)] and events[::2] == [trace.event(0), trace.event(2)]
"""
    )

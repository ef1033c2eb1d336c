"""cudapool as torch's CUDA allocator, on a real GPU.

Every test here needs torch with CUDA and a visible GPU; without them the whole module is
skipped. The allocator of a process can only be swapped before CUDA is initialised, so each
scenario runs in its own Python subprocess: a short script that enables cudapool (or, for the
comparisons, leaves the built-in allocator in place), does its work, checks what it can
itself, and prints one line ``RESULT {json}`` for the test to check the rest.

Run them with ``python3 -m pytest -m gpu -v tests/test_gpu.py`` (``scripts/gpu-check.sh``
does, together with the build and the A/B benchmark).
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MiB = 1 << 20
SUBPROCESS_TIMEOUT_S = 180


def _gpu_skip_reason():
    """Why these tests cannot run here, or None when they can."""
    try:
        import torch
    except Exception as exc:  # not installed, or a broken install
        return f"torch is not importable ({exc.__class__.__name__}: {exc})"
    if not torch.cuda.is_available():
        # is_available() asks for the device count only: it neither initialises CUDA in
        # this process nor keeps another test file from swapping the allocator.
        return (
            f"no CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda})"
        )
    return None


_SKIP_REASON = _gpu_skip_reason()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]


# -- running a scenario --------------------------------------------------------------------------

# Every script starts with this.
PRELUDE = """
import json, os, sys
import torch

MiB = 1 << 20
GiB = 1 << 30


def result(**values):
    print("RESULT " + json.dumps(values), flush=True)


def expect_oom(size, what):
    # The allocation must fail with cudapool's (torch-compatible) out-of-memory error.
    try:
        x = torch.empty(size, dtype=torch.uint8, device="cuda")
    except RuntimeError as exc:  # torch.OutOfMemoryError is a RuntimeError too
        message = str(exc)
        assert message.startswith("CUDA out of memory. Tried to allocate"), (
            what + ": unexpected error message: " + repr(message[:2000]))
        return message
    raise AssertionError("%s: allocating %d bytes succeeded (data_ptr 0x%x), expected OOM"
                         % (what, size, x.data_ptr()))
"""

# Scripts run under cudapool add this right after the prelude, before any CUDA use.
ENABLE = """
import cudapool
from cudapool import _C

cudapool.enable()
assert cudapool.enabled(), "cudapool.enable() returned, but cudapool.enabled() is False"


def check_pool(device=0):
    # The pool's invariant checker on the real device's pool: 0 violations.
    bad = _C.device_pool(device).check()
    assert bad == 0, "pool invariant violations on device %d: %d\\n%s" % (
        device, bad, _C.device_pool(device).check_report())
"""


@pytest.fixture(scope="module")
def child_env():
    """The environment of the scenario subprocesses: this process's, with the directory that
    holds the cudapool this process imports first on PYTHONPATH, and none of the settings that
    would change what the scenarios measure."""
    import cudapool

    env = dict(os.environ)
    package_root = str(Path(cudapool.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    for name in (
        "CUDAPOOL_CONF",
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_NO_CUDA_MEMORY_CACHING",
        "CUDA_LAUNCH_BLOCKING",  # would serialise the streams the stream test needs apart
    ):
        env.pop(name, None)
    return env


def run_scenario(env, body, *, cudapool_on=True, args=(), extra_env=None, timeout=SUBPROCESS_TIMEOUT_S):
    """Run PRELUDE (+ ENABLE) + body in a fresh interpreter; return its RESULT dict.

    Fails the test, with the child's output, when it exits non-zero, times out, or prints no
    RESULT line."""
    code = PRELUDE + (ENABLE if cudapool_on else "") + textwrap.dedent(body)
    run_env = dict(env)
    run_env.update(extra_env or {})
    label = "cudapool" if cudapool_on else "built-in allocator"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args], env=run_env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"scenario ({label}) timed out after {timeout} s\n"
            f"--- stdout ---\n{_text(exc.stdout)[-4000:]}\n--- stderr ---\n{_text(exc.stderr)[-8000:]}"
        )
    if proc.returncode != 0:
        pytest.fail(
            f"scenario ({label}) exited with status {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        pytest.fail(
            f"scenario ({label}) printed no RESULT line\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def _text(data):
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


# -- a. sizes, dtypes, values, alignment, exact accounting ---------------------------------------

SIZES_AND_DTYPES = """
TARGETS = [0, 1, 511, 512, 513, MiB - 1, MiB, MiB + 1, 10 * MiB - 1, 10 * MiB, 10 * MiB + 1,
           100 * MiB, GiB]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool,
          torch.complex64]
PERIOD = 61  # the fill pattern repeats with this period


def round512(n):
    return (n + 511) // 512 * 512


def base_pattern(dtype, device):
    # PERIOD small values, exact in every dtype, also after compute() below.
    v = torch.arange(PERIOD, device=device)
    if dtype is torch.bool:
        return v % 2 == 1
    if dtype.is_complex:
        return torch.complex(v.float(), -(v % 7).float())
    return v.to(dtype)


def compute(x):
    return ~x if x.dtype is torch.bool else x * 2 + 1


def tiled(base, n):
    return base.repeat(-(-n // PERIOD))[:n]


assert torch.cuda.memory_allocated() == 0, torch.cuda.memory_allocated()

# Every (size, dtype) at least `target` bytes long.
specs = []
for target in TARGETS:
    for dtype in DTYPES:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = -(-target // itemsize)
        specs.append((round512(numel * itemsize), target, str(dtype), dtype, numel))

# Allocated in ascending order of rounded size, before anything else touches the pool: then
# every request is either served by a split (the rest of the block stays free) or by a fresh
# segment of exactly its size, so allocated_bytes is exactly the sum of the rounded sizes.
# (A request that takes a cached block too small to split counts the whole block, in
# cudapool as in the built-in allocator; a different order could produce one.)
specs.sort(key=lambda s: (s[0], s[2]))
tensors = []
for rounded, target, name, dtype, numel in specs:
    t = torch.empty(numel, dtype=dtype, device="cuda")
    assert t.data_ptr() % 512 == 0, (name, numel, hex(t.data_ptr()))
    assert t.untyped_storage().nbytes() == numel * t.element_size()
    tensors.append(t)

expected = sum(round512(t.untyped_storage().nbytes()) for t in tensors)
live = sum(1 for t in tensors if t.untyped_storage().nbytes() > 0)


def check_accounting(when):
    got = torch.cuda.memory_allocated()
    stats = cudapool.memory_stats()
    assert got == expected, "%s: torch.cuda.memory_allocated() %d != expected %d (diff %d)" % (
        when, got, expected, got - expected)
    assert cudapool.memory_allocated() == expected, (when, cudapool.memory_allocated(), expected)
    assert stats["allocation.all.current"] == live, (when, stats["allocation.all.current"], live)


check_accounting("after allocation")

# Fill with the pattern, compute, and compare both on the CPU.
for t in tensors:
    n = t.numel()
    dtype = t.dtype
    base_gpu = base_pattern(dtype, "cuda")
    t.copy_(tiled(base_gpu, n))
    u = compute(t)
    assert u.data_ptr() % 512 == 0, (str(dtype), n, hex(u.data_ptr()))
    base_cpu = base_pattern(dtype, "cpu")
    assert torch.equal(t.cpu(), tiled(base_cpu, n)), ("fill", str(dtype), n)
    assert torch.equal(u.cpu(), tiled(compute(base_cpu), n)), ("compute", str(dtype), n)
    del u, base_gpu

torch.cuda.synchronize()
check_accounting("after fill and compute")

reserved_peak = torch.cuda.max_memory_reserved()
del tensors, t
torch.cuda.synchronize()
assert torch.cuda.memory_allocated() == 0, torch.cuda.memory_allocated()
check_pool()

# A matrix product (cuBLAS; its workspace comes from the pool too), checked on the CPU.
torch.backends.cuda.matmul.allow_tf32 = False
g = torch.Generator().manual_seed(7)
a = torch.randn(257, 513, generator=g)
b = torch.randn(513, 129, generator=g)
c = (a.cuda() @ b.cuda()).cpu()
ref = (a.double() @ b.double()).float()
assert torch.allclose(c, ref, rtol=1e-4, atol=1e-4), (c - ref).abs().max().item()
check_pool()

result(tensors=len(specs), live=live, expected=expected, reserved_peak=reserved_peak)
"""


def test_sizes_dtypes_values_and_exact_accounting(child_env):
    r = run_scenario(child_env, SIZES_AND_DTYPES)
    assert r["tensors"] == 13 * 7
    assert r["expected"] > 7 * (1 << 30)
    assert r["reserved_peak"] >= r["expected"]


# -- b. training gives the same losses as under the built-in allocator --------------------------

TRAINING = """
import torch.nn as nn
import torch.nn.functional as F

kind = sys.argv[1]
torch.manual_seed(1234)
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = False
torch.backends.cudnn.deterministic = True
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

g = torch.Generator().manual_seed(99)
if kind == "mlp":
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Dropout(0.1),
        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    xs = torch.randn(20, 128, 64, generator=g)
else:  # a small conv net (cuDNN, its workspaces from the allocator under test)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 8 * 8, 10))
    xs = torch.randn(20, 64, 3, 32, 32, generator=g)
ys = torch.randint(0, 10, (20, xs.shape[1]), generator=g)
model = model.cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

losses = []
for step in range(20):
    x = xs[step].cuda()
    target = F.one_hot(ys[step], 10).float().cuda()
    # Cross-entropy from elementwise ops and reductions only: deterministic on CUDA.
    loss = -(model(x).log_softmax(dim=-1) * target).sum(dim=-1).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())

torch.cuda.synchronize()
served = None
if "cudapool" in sys.modules:
    served = cudapool.memory_stats()["allocation.all.allocated"]
    check_pool()
result(losses=losses, served=served)
"""


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_training_losses_equal_builtin(child_env, kind):
    det = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    builtin = run_scenario(child_env, TRAINING, cudapool_on=False, args=[kind], extra_env=det)
    ours = run_scenario(child_env, TRAINING, cudapool_on=True, args=[kind], extra_env=det)
    assert builtin["served"] is None
    assert ours["served"] > 0, "cudapool served no allocation: the swap did not happen"
    assert len(ours["losses"]) == 20
    assert all(loss == loss and abs(loss) < 1e6 for loss in ours["losses"]), ours["losses"]
    # Exactly equal floats: the allocator must not change a single bit of the computation.
    assert ours["losses"] == builtin["losses"], (
        f"{kind}: losses differ\n  built-in: {builtin['losses']}\n  cudapool: {ours['losses']}"
    )


# -- c. record_stream keeps a block away from reuse while another stream uses it -----------------

STREAMS = """
hooks = cudapool._torch.hooks_set()
assert cudapool._torch.allocator_path() == "bridge" or "record_stream" in hooks, (
    "torch's record_stream hook is not set: " + repr(hooks))
N = 16 * MiB  # float32 elements: 64 MiB, a segment of its own
default = torch.cuda.current_stream()
side = torch.cuda.Stream()


def delay_kernel_factory():
    # A way to keep the current stream busy for about `seconds`, calibrated on this GPU.
    if hasattr(torch.cuda, "_sleep"):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        probe = 20_000_000
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        cycles_per_ms = probe / max(start.elapsed_time(end), 1e-3)
        return "torch.cuda._sleep", lambda seconds: torch.cuda._sleep(int(cycles_per_ms * 1000 * seconds))
    m = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        m @ m
    end.record()
    end.synchronize()
    per_ms = 10 / max(start.elapsed_time(end), 1e-3)

    def busy(seconds):
        for _ in range(max(1, int(per_ms * 1000 * seconds))):
            m @ m
    return "matmul loop", busy


how, delay = delay_kernel_factory()
torch.cuda.synchronize()

a = torch.empty(N, device="cuda")  # allocated on the default stream
a.fill_(1.0)
a_ptr = a.data_ptr()
side.wait_stream(default)
with torch.cuda.stream(side):
    delay(2.0)      # the side stream is busy for ~2 s ...
    a.mul_(3.0)     # ... then writes a ...
    c = a * 1.0     # ... and reads it into c (allocated on the side stream)
a.record_stream(side)
del a               # freed on the host now; the side stream still has to use it

others = []
for i in range(4):
    b = torch.empty(N, device="cuda")
    assert b.data_ptr() != a_ptr, (
        "allocation %d on the default stream got the block the side stream still uses" % i)
    b.fill_(7.0)    # runs now, while the side stream waits: must not touch a's block
    others.append(b)
assert not side.query(), (
    "the side stream finished before the checks ran (%s too short): inconclusive" % how)

side.synchronize()
d = torch.empty(N, device="cuda")  # a's block is free now, and the only free block that fits
reused = d.data_ptr() == a_ptr
torch.cuda.synchronize()

three = torch.full((N,), 3.0)
assert torch.equal(c.cpu(), three), "the side stream read damaged data: " + str(c[:8].cpu())
assert torch.equal(d.cpu(), three), "a's block was written by someone else: " + str(d[:8].cpu())
for b in others:
    assert torch.equal(b.cpu(), torch.full((N,), 7.0))
assert reused, "after side.synchronize(), the block did not come back (0x%x != 0x%x)" % (
    d.data_ptr(), a_ptr)
del b, others, c, d
torch.cuda.synchronize()
check_pool()
result(delay=how)
"""


def test_record_stream_defers_reuse(child_env):
    run_scenario(child_env, STREAMS)


# -- d. empty_cache gives memory back -----------------------------------------------------------

EMPTY_CACHE = """
big = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
mids = [torch.empty(3 * MiB, dtype=torch.uint8, device="cuda") for _ in range(5)]
smalls = [torch.empty(4096, dtype=torch.uint8, device="cuda") for _ in range(1000)]
torch.cuda.synchronize()
reserved_live = torch.cuda.memory_reserved()
assert reserved_live >= 256 * MiB + 5 * 3 * MiB + 1000 * 4096, reserved_live
del big, mids, smalls
torch.cuda.synchronize()
reserved_cached = torch.cuda.memory_reserved()
assert reserved_cached == reserved_live, (reserved_cached, reserved_live)  # kept, cached
assert torch.cuda.memory_allocated() == 0, torch.cuda.memory_allocated()

free_before = torch.cuda.mem_get_info()[0]
device_frees = cudapool.memory_stats()["num_device_free"]
torch.cuda.empty_cache()
reserved_after = torch.cuda.memory_reserved()
free_after = torch.cuda.mem_get_info()[0]
assert reserved_after < reserved_cached, (reserved_after, reserved_cached)
assert reserved_after == 0, reserved_after  # nothing was live: every segment went back
assert cudapool.memory_reserved() == 0
assert cudapool.memory_stats()["num_device_free"] > device_frees
assert free_after - free_before >= 128 * MiB, (
    "the device's free memory grew by only %d bytes" % (free_after - free_before))

# cudapool.empty_cache() does the same; a live tensor keeps its segment.
keep = torch.ones(MiB, device="cuda")
tmp = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
del tmp
before = cudapool.memory_reserved()
cudapool.empty_cache()
after = cudapool.memory_reserved()
assert after < before and after > 0, (before, after)
assert torch.equal(keep.cpu(), torch.ones(MiB))
check_pool()
result(reserved_cached=reserved_cached, returned=free_after - free_before)
"""


def test_empty_cache_lowers_reserved(child_env):
    r = run_scenario(child_env, EMPTY_CACHE)
    assert r["reserved_cached"] > 0


# -- e. out of memory is an exception, and the process carries on -------------------------------

OOM = """
total = torch.cuda.get_device_properties(0).total_memory

first = expect_oom(int(1.2 * total), "more than the device holds")

# A fitting allocation works after that.
x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
x.fill_(5)
assert torch.equal(x[-4096:].cpu(), torch.full((4096,), 5, dtype=torch.uint8))
del x

# Out of memory for real (the device is full), then the ladder: a larger request gives back
# the cached segment and retries.
a = torch.empty(int(0.6 * total), dtype=torch.uint8, device="cuda")
second = expect_oom(int(0.6 * total), "the device is full")
del a
b = torch.empty(int(0.65 * total), dtype=torch.uint8, device="cuda")
b[:4096].fill_(9)
assert torch.equal(b[:4096].cpu(), torch.full((4096,), 9, dtype=torch.uint8))
del b

stats = cudapool.memory_stats()
assert stats["num_ooms"] >= 2, stats["num_ooms"]
assert torch.cuda.memory_stats()["num_ooms"] == stats["num_ooms"]
assert stats["num_alloc_retries"] >= 1, stats["num_alloc_retries"]
torch.cuda.synchronize()
check_pool()
result(first=first[:300], second=second[:300], num_ooms=stats["num_ooms"])
"""


def test_oom_raises_and_process_continues(child_env):
    r = run_scenario(child_env, OOM)
    assert r["first"].startswith("CUDA out of memory. Tried to allocate")
    assert r["num_ooms"] >= 2


# -- f. summaries and statistics ----------------------------------------------------------------

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50}
_ALLOCATED_ROW = re.compile(r"^\|\s*Allocated memory\s*\|\s*([\d.]+)\s*(B|KiB|MiB|GiB|TiB|PiB)\s*\|", re.M)


def allocated_in_summary(text):
    """The "Allocated memory" row's current value of a memory summary, in bytes."""
    match = _ALLOCATED_ROW.search(text)
    assert match, "no 'Allocated memory' row in the summary:\n" + text
    return float(match.group(1)) * _UNITS[match.group(2)]


SUMMARY = """
x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
while_live = {
    "cudapool": cudapool.memory_summary(),
    "torch": torch.cuda.memory_summary(),
    "torch_abbreviated": torch.cuda.memory_summary(abbreviated=True),
}
allocated = [torch.cuda.memory_allocated(), cudapool.memory_allocated()]
keys = sorted(cudapool.memory_stats().keys())
torch_keys = sorted(torch.cuda.memory_stats().keys())
del x
after_free = torch.cuda.memory_summary()
check_pool()
result(while_live=while_live, after_free=after_free, allocated=allocated, keys=keys,
       torch_keys=torch_keys)
"""

BUILTIN_KEYS = """
x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")  # CUDA and the allocator start
result(keys=sorted(torch.cuda.memory_stats().keys()))
"""


def test_summary_and_stats_keys(child_env):
    ours = run_scenario(child_env, SUMMARY)
    builtin = run_scenario(child_env, BUILTIN_KEYS, cudapool_on=False)

    assert ours["allocated"] == [4 * MiB, 4 * MiB]
    for name, text in ours["while_live"].items():
        value = allocated_in_summary(text)
        assert value > 0, f"{name} summary shows nothing allocated while a tensor lives:\n{text}"
        assert abs(value - 4 * MiB) <= 0.01 * 4 * MiB, f"{name}: {value}\n{text}"
    assert allocated_in_summary(ours["after_free"]) == 0, ours["after_free"]

    expected = set(builtin["keys"])
    for name in ("keys", "torch_keys"):
        got = set(ours[name])
        assert got == expected, f"{name}: missing {sorted(expected - got)}, extra {sorted(got - expected)}"


# -- g. set_per_process_memory_fraction caps the pool -------------------------------------------

FRACTION = """
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(0.1)
message = expect_oom(int(0.12 * total), "above 10 % of the device")

x = torch.empty(int(0.05 * total), dtype=torch.uint8, device="cuda")
x[-4096:].fill_(3)
assert torch.equal(x[-4096:].cpu(), torch.full((4096,), 3, dtype=torch.uint8))
expect_oom(int(0.06 * total), "5 % live + 6 % more")
del x  # cached now: the cap counts it until the pool gives it back
y = torch.empty(int(0.06 * total), dtype=torch.uint8, device="cuda")
assert torch.cuda.memory_reserved() <= 0.1 * total + 2 * MiB, torch.cuda.memory_reserved()
del y
torch.cuda.synchronize()
check_pool()
result(message=message[:300])
"""


def test_memory_fraction_caps_allocations(child_env):
    r = run_scenario(child_env, FRACTION)
    assert r["message"].startswith("CUDA out of memory. Tried to allocate")


# -- g2. torch parity: the out-of-memory type, fraction 0, get_per_process_memory_fraction ------

OOM_TYPE_AND_FRACTION = """
from cudapool import _torch, _torch_libraries
assert _torch.oom_error_type() == "torch.OutOfMemoryError", (
    "cudapool._torch_oom is not in use: %r (built: %r)" % (_torch.oom_error_type(), _torch_libraries.torch_oom_library_path()))
total = torch.cuda.get_device_properties(0).total_memory
caught_as = None
try:
    torch.empty(2 * total, dtype=torch.uint8, device="cuda")
except torch.cuda.OutOfMemoryError as exc:        # torch's own type, as with the built-in allocator
    caught_as = type(exc).__name__
    first = str(exc)
assert caught_as == "OutOfMemoryError" and first.startswith("CUDA out of memory. Tried to allocate"), first

assert torch.cuda.get_per_process_memory_fraction() == 1.0
keep = torch.empty(MiB, dtype=torch.uint8, device="cuda")   # a small segment that stays cached
torch.cuda.set_per_process_memory_fraction(0.0)            # torch: no growth at all
assert torch.cuda.get_per_process_memory_fraction() == 0.0
assert torch.cuda.get_per_process_memory_fraction(0) == 0.0
zero_oom = None
try:
    torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
except torch.cuda.OutOfMemoryError as exc:
    zero_oom = str(exc)
assert zero_oom is not None, "fraction 0.0 allowed a 64 MiB allocation"
small = torch.empty(1024, dtype=torch.uint8, device="cuda")  # the cache still serves
torch.cuda.set_per_process_memory_fraction(0.5)
assert torch.cuda.get_per_process_memory_fraction() == 0.5
y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
del y, small, keep
torch.cuda.synchronize()
check_pool()
result(first=first[:300], zero_oom=zero_oom[:300])
"""


def test_oom_is_torch_out_of_memory_error_and_fraction_zero_forbids_growth(child_env):
    r = run_scenario(child_env, OOM_TYPE_AND_FRACTION)
    assert r["zero_oom"].startswith("CUDA out of memory. Tried to allocate")


# cuDNN (v8 API) tries engines in turn and moves on when allocating one's workspace throws
# c10::OutOfMemoryError; any other exception ends the convolution. With growth forbidden
# (fraction 0.0) and the output's block waiting in the cache, only engines without a workspace
# can run: the convolution must still succeed, with the same values.
CONV_FALLBACK = """
if not torch.backends.cudnn.is_available():
    result(skipped="cuDNN is not available")
    sys.exit(0)
torch.backends.cudnn.benchmark = False
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)
x = torch.randn(8, 64, 128, 128, device="cuda")
w = torch.randn(128, 64, 3, 3, device="cuda")
reference = torch.nn.functional.conv2d(x, w, padding=1)
torch.cuda.synchronize()
torch.cuda.empty_cache()                      # the workspaces of that run go back
slot = torch.empty_like(reference)            # the output's block, cached for the next run
del slot
oom_before = torch.cuda.memory_stats()["num_ooms"]
torch.cuda.set_per_process_memory_fraction(0.0)
y = torch.nn.functional.conv2d(x, w, padding=1)
torch.cuda.synchronize()
workspace_ooms = torch.cuda.memory_stats()["num_ooms"] - oom_before
torch.cuda.set_per_process_memory_fraction(1.0)
max_diff = float((y - reference).abs().max())
assert torch.allclose(y, reference, rtol=1e-3, atol=1e-3), max_diff
del x, w, y, reference
torch.cuda.synchronize()
check_pool()
result(workspace_ooms=workspace_ooms, max_diff=max_diff)
"""


def test_cudnn_convolution_at_the_cap_falls_back_to_a_smaller_workspace(child_env):
    r = run_scenario(child_env, CONV_FALLBACK)
    if "skipped" in r:
        pytest.skip(r["skipped"])
    print("workspace allocations refused and recovered from:", r["workspace_ooms"], "max diff", r["max_diff"])


# -- h. a pool per device -----------------------------------------------------------------------

MULTI_GPU = """
x0 = torch.full((MiB,), 1.0, device="cuda:0")
x1 = torch.full((MiB,), 2.0, device="cuda:1")
y1 = x1 * 3
assert y1.device.index == 1 and y1.data_ptr() % 512 == 0
assert torch.equal(y1.cpu(), torch.full((MiB,), 6.0))
z0 = x1.to("cuda:0") + x0
assert torch.equal(z0.cpu(), torch.full((MiB,), 3.0))

s0 = cudapool.memory_stats(0)
s1 = cudapool.memory_stats(1)
assert 0 in _C.device_pools() and 1 in _C.device_pools(), _C.device_pools()
assert s1["allocated_bytes.all.current"] == 2 * 4 * MiB, s1["allocated_bytes.all.current"]
assert s0["allocated_bytes.all.current"] == 2 * 4 * MiB, s0["allocated_bytes.all.current"]
assert cudapool.memory_stats("cuda:1") == s1
with torch.cuda.device(1):
    assert torch.cuda.memory_allocated() == 2 * 4 * MiB

# Freed while device 0 is current: the block goes back to device 1's pool.
torch.cuda.set_device(0)
del x1, y1
torch.cuda.synchronize(1)
assert cudapool.memory_allocated(1) == 0, cudapool.memory_allocated(1)
assert cudapool.memory_allocated(0) == 2 * 4 * MiB
check_pool(0)
check_pool(1)
result(devices=_C.device_pools())
"""


def test_multi_gpu_pool_per_device(child_env):
    import torch

    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs 2 CUDA devices, found {count}")
    r = run_scenario(child_env, MULTI_GPU)
    assert 0 in r["devices"] and 1 in r["devices"]


# -- h. lifecycle: exit with live tensors, fork, threads -----------------------------------------

EXIT_WITH_LIVE_TENSORS = """
side = torch.cuda.Stream()
keep = [torch.randn(1 << 20, device="cuda") for _ in range(8)]   # live at exit
with torch.cuda.stream(side):
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        busy = busy @ busy                                        # still running at exit
moved = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
moved.record_stream(side)                                         # its free needs an event
check_pool()
result(live=_C.device_pool(0).info()["live_blocks"])
# no synchronize, no empty_cache: the interpreter exits with all of it live
"""


def test_exit_with_live_tensors_and_busy_streams_is_clean(child_env):
    code = PRELUDE + ENABLE + textwrap.dedent(EXIT_WITH_LIVE_TENSORS)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cudapool:" not in proc.stderr, proc.stderr[-4000:]  # no failed frees reported
    assert "RESULT" in proc.stdout


FORK_AND_THREADS = """
import threading, time
stop = threading.Event()
errors = []

def worker(k):
    torch.cuda.set_device(0)
    s = torch.cuda.Stream()
    try:
        while not stop.is_set():
            with torch.cuda.stream(s):
                xs = [torch.empty((k + 1) * 3 * MiB, dtype=torch.uint8, device="cuda") for _ in range(4)]
                del xs
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
for t in threads: t.start()
children = []
for _ in range(10):
    time.sleep(0.01)
    pid = os.fork()          # a CPU-only child, like a DataLoader worker
    if pid == 0:
        import cudapool as cp
        _ = cp.memory_stats(0)   # the pool's lock is free in the child
        os._exit(0)
    end = time.monotonic() + 30
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            children.append(os.waitstatus_to_exitcode(status))
            break
        if time.monotonic() > end:
            os.kill(pid, 9); os.waitpid(pid, 0); children.append("deadlocked"); break
        time.sleep(0.005)
stop.set()
for t in threads: t.join()
torch.cuda.synchronize()
check_pool()
assert not errors, errors
result(children=children, allocated=cudapool.memory_allocated(0))
"""


def test_fork_while_threads_allocate_on_the_gpu(child_env):
    r = run_scenario(child_env, FORK_AND_THREADS, extra_env={"PYTHONWARNINGS": "ignore::DeprecationWarning"})
    assert r["children"] == [0] * 10, r
    assert r["allocated"] == 0


# -- i. CUDA graphs, MemPool, record_stream across streams and devices ---------------------------

GRAPH_CAPTURE = """
from cudapool import _torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).cuda()
static_in = torch.randn(64, 512, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):  # warm-up outside the capture, as torch's documentation does
    for _ in range(3):
        model(static_in)
torch.cuda.current_stream().wait_stream(side)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):  # the graph's private pool grows during the capture
    static_out = model(static_in)
pools = _torch.graph_pools()
assert len(pools) == 1 and pools[0]["allocated"] > 0 and not pools[0]["window_open"], pools
outs = []
for _ in range(5):
    x = torch.randn(64, 512, device="cuda")
    static_in.copy_(x)
    g.replay()
    torch.cuda.synchronize()
    eager = model(x)
    assert torch.allclose(static_out, eager, rtol=1e-4, atol=1e-5), (static_out - eager).abs().max().item()
    outs.append(static_out.sum().item())
# A second graph sharing the first one's pool, then both released: the pool goes once the
# static outputs are freed.
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2, pool=g.pool()):
    out2 = static_out * 2
g2.replay()
torch.cuda.synchronize()
assert torch.equal(out2, static_out * 2)
assert len(_torch.graph_pools()) == 1
del g, g2
assert len(_torch.graph_pools()) == 1  # the outputs are still alive
del static_out, out2
import gc; gc.collect()
assert _torch.graph_pools() == [], _torch.graph_pools()
check_pool()
result(outs=outs)
"""


def test_cuda_graph_capture_and_replay_equal_eager(child_env):
    r = run_scenario(child_env, GRAPH_CAPTURE)
    assert len(r["outs"]) == 5


GRAPHED_CALLABLES = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(128, 256, device="cuda")
y = x[:, :1].clone()
graphed = torch.cuda.make_graphed_callables(model, (torch.randn(128, 256, device="cuda"),))
losses = []
for step in range(40):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(graphed(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
assert losses[-1] < losses[0] * 0.5, losses
check_pool()
result(first=losses[0], last=losses[-1])
"""


def test_make_graphed_callables_trains(child_env):
    r = run_scenario(child_env, GRAPHED_CALLABLES)
    assert r["last"] < r["first"]


MEM_POOL = """
import cudapool
from cudapool import _C
allocator = cudapool.mem_pool_allocator()
pool = torch.cuda.MemPool(allocator=allocator.allocator())
with torch.cuda.use_mem_pool(pool):
    x = torch.arange(8 * MiB, dtype=torch.float32, device="cuda")
    y = torch.ones(1000, device="cuda")
z = torch.ones(MiB, device="cuda")  # outside: torch's own allocator
ours = cudapool.memory_stats(0)["allocated_bytes.all.current"]
assert ours >= 32 * MiB, ours  # torch's caching front-end took whole segments from cudapool
assert x[-1].item() == 8 * MiB - 1 and y.sum().item() == 1000 and z.sum().item() == MiB
assert not cudapool.enabled()
del x, y
del pool
import gc; gc.collect()
torch.cuda.empty_cache()
result(ours=ours, after=cudapool.memory_stats(0)["allocated_bytes.all.current"])
"""


def test_mem_pool_mode_takes_segments_from_cudapool(child_env):
    import torch

    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        pytest.skip(f"torch {torch.__version__} has no torch.cuda.MemPool")
    r = run_scenario(child_env, MEM_POOL, cudapool_on=False)
    assert r["ours"] >= 32 * MiB


RECORD_STREAM_DEVICES = """
a, b = torch.cuda.Stream(), torch.cuda.Stream()
x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
with torch.cuda.stream(a):
    x.fill_(1)
with torch.cuda.stream(b):
    x.add_(1)
x.record_stream(a)
x.record_stream(b)
del x
devices = torch.cuda.device_count()
if devices > 1:
    other = torch.cuda.Stream(device=1)
    t = torch.ones(16 * MiB, device="cuda:0")
    t.record_stream(other)  # a stream of another device: its event lives there
    d = torch.ones(MiB, device="cuda:0")
    with torch.cuda.device(1):
        d.record_stream(torch.cuda.default_stream(1))  # device 1's default stream, not device 0's
    del t, d
torch.cuda.synchronize()
for i in range(devices):
    torch.cuda.synchronize(i)
y = torch.empty(MiB, device="cuda")  # reclaims the frees whose events completed
del y
assert cudapool.memory_allocated(0) == 0, cudapool.memory_allocated(0)
check_pool()
result(devices=devices)
"""


def test_record_stream_across_streams_and_devices_frees_cleanly(child_env):
    r = run_scenario(child_env, RECORD_STREAM_DEVICES)
    assert r["devices"] >= 1


REDUCE_OVERHEAD = """
import torch.nn as nn
from cudapool import _torch
torch.manual_seed(0)
dev = torch.device("cuda")
# A small transformer, compiled with torch's defaults for reduce-overhead: cudagraph trees.
model = nn.TransformerEncoder(
    nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True, dropout=0.0),
    num_layers=3,
).to(dev).eval()
x = torch.randn(8, 128, 256, device=dev)
with torch.no_grad():
    eager = [model(x * (i + 1)).clone() for i in range(4)]
    compiled = torch.compile(model, mode="reduce-overhead")
    outs = []
    for step in range(20):
        y = compiled(x * (step % 4 + 1))
        outs.append(y.clone())
    torch.cuda.synchronize()
worst = max((outs[i] - eager[i % 4]).abs().max().item() for i in range(20))
assert worst < 1e-3, worst
path = _torch.allocator_path() if cudapool.enabled() else "builtin"
result(path=path, worst=worst, reserved=torch.cuda.memory_reserved(), allocated=torch.cuda.memory_allocated())
"""


def test_reduce_overhead_with_cudagraph_trees_matches_eager_and_the_builtin_memory(child_env):
    ours = run_scenario(child_env, REDUCE_OVERHEAD, timeout=300)
    assert ours["path"] == "bridge", ours
    builtin = run_scenario(child_env, REDUCE_OVERHEAD, cudapool_on=False, timeout=300)
    print(f"reduce-overhead, 20 steps: reserved cudapool {ours['reserved']} vs built-in {builtin['reserved']}")
    assert ours["reserved"] <= builtin["reserved"], (ours, builtin)


# -- CUDA IPC: tensors shared between processes (Note [Handles for torch] in csrc/devices/ipc.c) ---

IPC_CHILD = """
import torch
import cudapool


def child(policy, q_in, q_out):
    # The receiver: cudapool enabled (policy None: torch's own allocator, which opens torch's
    # format of plain segments), the parent's tensor opened through its getIpcDevPtr.
    if policy is not None:
        cudapool.enable(policy=policy)
    got = q_in.get()
    t = got if isinstance(got, torch.Tensor) else got[0](*got[1])  # a tensor, or reduce_tensor's pair
    q_out.put(float(t.double().sum().item()))
    t.mul_(2)  # written back into the parent's memory
    torch.cuda.synchronize()
    del t, got
    q_out.put("done")
"""

IPC_SHARE = """
import sys, tempfile
import cudapool
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor
from cudapool import _torch
policy, child_policy, how = sys.argv[1], sys.argv[2], sys.argv[3]
child_policy = None if child_policy == "torch" else child_policy
folder = tempfile.mkdtemp()
with open(os.path.join(folder, "ipc_child.py"), "w") as f:
    f.write(IPC_CHILD_SOURCE)
sys.path.insert(0, folder)
os.environ["PYTHONPATH"] = folder + os.pathsep + os.environ.get("PYTHONPATH", "")
import ipc_child
cudapool.enable(policy=policy)
ctx = mp.get_context("spawn")
q_in, q_out = ctx.Queue(), ctx.Queue()
proc = ctx.Process(target=ipc_child.child, args=(child_policy, q_in, q_out))
proc.start()
n = 3 << 20
if how == "region":
    with cudapool.region("weights"):
        x = torch.arange(n, device="cuda", dtype=torch.float32)
    cudapool.pause("weights", backup=True)
    cudapool.resume("weights")
else:
    x = torch.arange(n, device="cuda", dtype=torch.float32)
expect = float(x.double().sum().item())
q_in.put(reduce_tensor(x) if how == "region" else x)
got = q_out.get(timeout=180)
assert q_out.get(timeout=180) == "done"
proc.join(60)
assert proc.exitcode == 0, proc.exitcode
torch.cuda.synchronize()
assert got == expect, (got, expect)
assert torch.equal(x, torch.arange(n, device="cuda", dtype=torch.float32) * 2)
refused = None
if how == "region":
    try:
        cudapool.pause("weights")
    except Exception as exc:  # shared: refused until the tensor is freed
        refused = str(exc)
    assert refused and "shared with another process" in refused, refused
    del x
    cudapool.pause("weights")
    cudapool.resume("weights")
result(path=_torch.allocator_path(), refused=refused)
"""


@pytest.mark.parametrize(
    "policy,child_policy,how",
    [
        ("builtin", "builtin", "tensor"),
        ("builtin", "torch", "tensor"),  # torch's own receiver opens the plain segment
        ("expandable", "expandable", "tensor"),
        ("cudapool", "cudapool", "tensor"),
        ("cudapool", "cudapool", "region"),
    ],
)
def test_tensors_shared_between_processes(child_env, policy, child_policy, how):
    body = "IPC_CHILD_SOURCE = " + repr(IPC_CHILD) + "\n" + IPC_SHARE
    r = run_scenario(child_env, body, cudapool_on=False, args=(policy, child_policy, how), timeout=300)
    assert r["path"] == "bridge", r


# -- regions: pause and resume (docs/regions.md) ------------------------------------------------

RL_LOOP = """
import time
import torch.nn as nn
torch.manual_seed(0)
dev = torch.device("cuda")
# The "inference engine": weights and a KV cache, each in a region of its own.
with cudapool.region("engine_weights"):
    engine = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(dev)
with cudapool.region("kv_cache"):
    kv = torch.randn(64, 1 << 20, device=dev)           # 256 MiB
ptrs = {n: p.data_ptr() for n, p in engine.named_parameters()}
kv_ptr = kv.data_ptr()
# The "trainer": its model and optimizer state in a third region.
with cudapool.region("trainer"):
    trainer = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(dev)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    (trainer(torch.zeros(1, 1024, device=dev)) ** 2).mean().backward()
    opt.step()                                        # its state, allocated in the region
    opt.zero_grad(set_to_none=True)
trainer_ptrs = {n: p.data_ptr() for n, p in trainer.named_parameters()}
x = torch.randn(256, 1024, device=dev)
cudapool.pause("trainer", backup=True)                # the engine runs first
side = torch.cuda.Stream()
log = []
for it in range(4):
    # inference: both regions in use, a kernel on a side stream declared with record_stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = engine(x)
        kv.mul_(0.5)
    kv.record_stream(side)
    want = engine(x).sum().item()
    kv_sum = kv.double().sum().item()
    reserved = torch.cuda.memory_reserved()
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    cudapool.pause("kv_cache")                        # contents dropped
    cudapool.pause("engine_weights", backup=True)     # contents kept on the host
    t_pause = time.perf_counter() - t0
    paused = {r["tag"]: r for r in cudapool.regions()}
    assert paused["kv_cache"]["paused"] and paused["engine_weights"]["paused"], paused
    given = paused["kv_cache"]["paused_bytes"] + paused["engine_weights"]["paused_bytes"]
    # its free memory went back too (not counted as paused): reserved drops by at least `given`
    assert torch.cuda.memory_reserved() <= reserved - given, (torch.cuda.memory_reserved(), reserved, given)
    free_paused = torch.cuda.mem_get_info()[0]
    assert free_paused - free_before >= given * 0.99, (free_paused, free_before, given)
    # training, with the memory given back
    cudapool.resume("trainer")
    assert {n: p.data_ptr() for n, p in trainer.named_parameters()} == trainer_ptrs
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = (trainer(x) ** 2).mean()
        loss.backward()
        opt.step()
    try:
        with cudapool.region("kv_cache"):
            torch.empty(1024, device=dev)
        raise AssertionError("allocated in a paused region")
    except RuntimeError as exc:
        assert "is paused" in str(exc), exc
    t0 = time.perf_counter()
    cudapool.pause("trainer", backup=True)            # weights and optimizer state kept on the host
    cudapool.resume("engine_weights")
    cudapool.resume("kv_cache")
    t_resume = time.perf_counter() - t0
    assert {n: p.data_ptr() for n, p in engine.named_parameters()} == ptrs
    assert kv.data_ptr() == kv_ptr
    got = engine(x).sum().item()
    assert got == want, (got, want)                    # weights back, byte for byte
    kv.fill_(1.0)                                     # the cache is usable again
    log.append(dict(given=given, freed=free_paused - free_before, loss=loss.item(), pause_ms=t_pause * 1e3,
                    resume_ms=t_resume * 1e3))
torch.cuda.synchronize()
check_pool()
result(log=log)
"""


def test_rl_loop_pauses_engine_while_trainer_trains(child_env):
    r = run_scenario(child_env, RL_LOOP)
    assert len(r["log"]) == 4 and all(row["given"] >= 256 * MiB for row in r["log"])
    for row in r["log"]:  # in the log of scripts/gpu-check.sh
        print(
            f"regions on the GPU: gave back {row['given'] / MiB:.0f} MiB (device free +{row['freed'] / MiB:.0f} "
            f"MiB); pause {row['pause_ms']:.1f} ms, resume {row['resume_ms']:.1f} ms"
        )


GRAPH_REGION = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).cuda()
static_x = torch.randn(64, 512, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        model(static_x)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with cudapool.graph_region("graph"):
    with torch.cuda.graph(g):
        static_y = model(static_x)
g.replay()
want = static_y.clone()
pools = [p for p in cudapool.graph_pools() if p["region"] == "graph"]
assert pools, cudapool.graph_pools()
cudapool.pause("graph", backup=True)
assert [p for p in cudapool.graph_pools() if p["region"] == "graph"][0]["paused"] > 0
cudapool.resume("graph")
g.replay()
torch.cuda.synchronize()
assert torch.equal(static_y, want)
check_pool()
result(paused=pools[0]["reserved"])
"""


def test_graph_in_a_region_replays_after_resume(child_env):
    r = run_scenario(child_env, GRAPH_REGION)
    assert r["paused"] > 0


# -- the bridge: torch's own allocator interface (csrc/bridge/bridge.cpp) --------------------------

BRIDGE_CNN = """
from cudapool import _torch
assert _torch.allocator_path() == "bridge", _torch.allocator_path()
assert torch._C._cuda_getAllocatorBackend() == "cudapool"
torch.backends.cudnn.benchmark = True            # cuDNN asks cacheInfo at the first convolution
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
    torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(), torch.nn.Linear(64, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for step in range(3):
    x = torch.randn(32, 3, 64, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(float(loss))
torch.cuda.synchronize()
stats = torch.cuda.memory_stats()
assert stats["allocated_bytes.all.current"] == cudapool.memory_stats()["allocated_bytes.all.current"]
assert torch.cuda.max_memory_allocated() > 0
# cuBLAS/cuDNN workspaces and extensions: raw_alloc / raw_delete
p = torch.cuda.caching_allocator_alloc(3 * MiB)
assert cudapool.memory_allocated() >= 3 * MiB
torch.cuda.caching_allocator_delete(p)
check_pool()
result(losses=losses, allocated=stats["allocated_bytes.all.current"])
"""


def test_bridge_trains_a_cnn_with_cudnn_benchmark(child_env):
    r = run_scenario(child_env, BRIDGE_CNN)
    assert len(r["losses"]) == 3 and all(v == v for v in r["losses"]), r


BRIDGE_HISTORY = """
import pickle, tempfile
torch.cuda.memory._record_memory_history(max_entries=10000)
def make_tensors():
    return [torch.empty(n * MiB, dtype=torch.uint8, device="cuda") for n in (1, 5, 30)]
kept = make_tensors()
del kept[1]
snap = torch.cuda.memory._snapshot()
trace = snap["device_traces"][0]
allocs = [e for e in trace if e["action"] == "alloc"]
assert allocs and any("make_tensors" in [f["name"] for f in e["frames"]] for e in allocs), allocs[:2]
blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
assert any("make_tensors" in [f["name"] for f in b["frames"]] for b in blocks)
from torch.cuda import _memory_viz
html = _memory_viz.trace_plot(snap)
assert len(html) > 1000
path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
torch.cuda.memory._dump_snapshot(path)
with open(path, "rb") as f:
    assert pickle.load(f)["segments"]
torch.cuda.memory._record_memory_history(enabled=None)
assert not torch._C._cuda_isHistoryEnabled()
dumped = []
torch._C._cuda_attach_out_of_memory_observer(lambda *a: dumped.append(a))
try:
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError:
    pass
assert len(dumped) == 1, dumped
result(trace=len(trace), html=len(html))
"""


def test_bridge_history_snapshot_memory_viz_and_oom_observer(child_env):
    r = run_scenario(child_env, BRIDGE_HISTORY)
    assert r["trace"] > 0 and r["html"] > 1000


BRIDGE_MEMPOOL = """
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    x = torch.ones(8 * MiB, dtype=torch.uint8, device="cuda")
y = torch.ones(MiB, dtype=torch.uint8, device="cuda")
rows = [g for g in cudapool.graph_pools() if tuple(g["id"]) == tuple(pool.id)]
assert rows and rows[0]["allocated"] >= 8 * MiB, cudapool.graph_pools()
assert pool.use_count() >= 1
assert int(x.sum()) == 8 * MiB
del x
del pool
torch.cuda.empty_cache()
result(ok=True)
"""


def test_bridge_mem_pool_and_use_mem_pool_under_enable(child_env):
    import torch

    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        pytest.skip(f"torch {torch.__version__} has no torch.cuda.MemPool")
    assert run_scenario(child_env, BRIDGE_MEMPOOL)["ok"]


BRIDGE_NCCL = """
import torch.distributed as dist
if not dist.is_available() or not dist.is_nccl_available():
    result(skipped="no NCCL in this torch")
    sys.exit(0)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
os.environ.setdefault("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "1")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
t = torch.ones(4 * MiB, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
assert float(t[0]) == 1.0
dist.destroy_process_group()
result(value=float(t[0]))
"""


def test_bridge_one_process_nccl_group_with_the_register_hook(child_env):
    r = run_scenario(child_env, BRIDGE_NCCL)
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert r["value"] == 1.0

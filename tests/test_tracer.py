"""The allocation tracer (cudapool.fakegpu.tracer) and the workload scripts (benchmarks/workloads).

The tracer tests need torch (they skip without it); the rmm_random generator tests do not.
The small captures of the torch workloads take a few seconds each on fake CUDA tensors.
"""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cudapool.lab.trace import ALLOC, FREE, load, save

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from workloads import WORKLOADS, lstm, moe, rmm_random, unet, vit  # noqa: E402
from workloads._common import peak_live_bytes  # noqa: E402

try:
    import torch
except Exception:  # not installed, or a broken install
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not importable")

if torch is not None:
    from cudapool.fakegpu.tracer import Tracer

GiB = 1 << 30
MiB = 1 << 20


def allocs(tr):
    return [e for e in tr.events if e[0] == ALLOC]


def check_ids(trace):
    """Every id is allocated once, freed at most once, after its allocation, with the same size."""
    live, done = {}, set()
    for action, ident, size, stream, device, _t in trace:
        if action == ALLOC:
            assert ident not in live and ident not in done, f"id {ident} allocated twice"
            live[ident] = (size, stream, device)
        else:
            assert ident in live, f"free of id {ident}, which is not live"
            assert live.pop(ident) == (size, stream, device), f"free of id {ident} differs from its allocation"
            done.add(ident)
    return live


def shape_of(trace):
    """What a replay depends on: the actions, sizes, streams and which earlier event each free undoes."""
    index, out = {}, []
    for i, (action, ident, size, stream, device, _t) in enumerate(trace):
        if action == ALLOC:
            index[ident] = i
            out.append((action, size, stream, device))
        else:
            out.append((action, index[ident], stream, device))
    return out


# ---- the tracer ------------------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_known_sequence(device):
    with Tracer(device=device) as tr:
        a = torch.empty(1000, dtype=torch.float32, device=device)
        assert [e[:3] for e in tr.events] == [(ALLOC, 1, 4000)]
        ida = tr.ident_of(a)
        assert ida == 1
        b = a + 1
        assert [e[:3] for e in tr.events[1:]] == [(ALLOC, 2, 4000)]
        n = len(tr.events)
        v = a[10:20]  # views
        w = a.view(10, 100).t()
        d = a.detach()
        a.mul_(2)  # in place
        b.add_(a)
        torch.add(a, b, out=b)
        assert len(tr.events) == n, "views and in-place ops allocate nothing"
        del a, d
        assert len(tr.events) == n, "the storage lives on in its views"
        del v, w
        assert tr.events[n][:3] == (FREE, ida, 4000)
        del b
        assert tr.events[-1][:3] == (FREE, 2, 4000)
        assert tr.live_count == 0 and tr.live_bytes == 0
    assert tr.peak_bytes == 8000
    times = [e[5] for e in tr.events]
    assert times == sorted(times) and times[0] > 0


@needs_torch
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_factories_and_dtypes(device):
    with Tracer(device=device) as tr:
        made = [
            torch.zeros(3, 5, device=device),
            torch.ones(7, dtype=torch.float16, device=device),
            torch.randn(2, 8, device=device),
            torch.full((4,), 2, dtype=torch.int64, device=device),
            torch.arange(10, device=device),
            torch.empty_strided((2, 3), (1, 2), device=device),
            torch.empty(5, dtype=torch.bool, device=device),
            torch.zeros_like(torch.empty(0, device=device)),  # zero bytes: no allocation
        ]
        for t in made[:-1]:
            assert tr.ident_of(t) is not None
    assert [e[2] for e in allocs(tr)] == [60, 14, 64, 32, 80, 24, 5]


@needs_torch
def test_storages_made_outside_dispatch_are_adopted_at_first_use():
    before = torch.ones(6, device="meta")
    with Tracer(device="meta") as tr:
        t = torch.tensor([1.0, 2.0, 3.0], device="meta")  # made below the dispatcher on meta
        assert tr.ident_of(t) is None and tr.ident_of(before) is None
        u = t * 2
        assert tr.ident_of(t) == 1 and tr.ident_of(u) == 2
        before.add_(1)
        assert tr.ident_of(before) == 3
        del t, before
    assert [e[:3] for e in tr.events] == [(ALLOC, 1, 12), (ALLOC, 2, 12), (ALLOC, 3, 24), (FREE, 1, 12), (FREE, 3, 24)]
    with Tracer(device="cpu", adopt_inputs=False) as tr:
        x = torch.tensor([1.0, 2.0])  # on the CPU, torch.tensor goes through lift_fresh
        assert tr.ident_of(x) == 1
        _ = torch.ones(3, device="meta") + 1  # another device: ignored
    assert [e[:3] for e in tr.events] == [(ALLOC, 1, 8)]


@needs_torch
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_linear_forward_backward_sees_grads(device):
    with Tracer(device=device) as tr:
        lin = torch.nn.Linear(16, 8, device=device)
        x = torch.randn(4, 16, device=device, requires_grad=True)
        sizes = {tr.ident_of(lin.weight): 512, tr.ident_of(lin.bias): 32, tr.ident_of(x): 256}
        n = len(tr.events)
        loss = lin(x).square().sum()
        loss.backward()
        grads = {"weight": lin.weight.grad, "bias": lin.bias.grad, "x": x.grad}
        ids = {k: tr.ident_of(g) for k, g in grads.items()}
        assert None not in ids.values(), f"gradients not seen: {ids}"
        by_id = {e[1]: e[2] for e in allocs(tr)}
        assert {k: by_id[i] for k, i in ids.items()} == {"weight": 512, "bias": 32, "x": 256}
        assert all(n <= [e[1] for e in tr.events].index(i) for i in ids.values()), "grads come after the forward"
        assert all(by_id[i] == s for i, s in sizes.items())
        # The forward output [4, 8] is saved for square's backward: 128 bytes, freed by then.
        assert 128 in [e[2] for e in allocs(tr)[3:]]
        del grads
        lin.zero_grad(set_to_none=True)
        freed = {e[1] for e in tr.events if e[0] == FREE}
        assert ids["weight"] in freed and ids["bias"] in freed
    check_ids(tr.trace())


@needs_torch
def test_optimizer_state_and_host_tensors():
    with Tracer(device="meta") as tr:
        lin = torch.nn.Linear(32, 16, device="meta")
        opt = torch.optim.AdamW(lin.parameters(), foreach=True)
        lin(torch.randn(4, 32, device="meta")).sum().backward()
        opt.step()
        state = opt.state[lin.weight]
        assert tr.ident_of(state["exp_avg"]) is not None
        assert tr.ident_of(state["exp_avg_sq"]) is not None
        # AdamW keeps its step counter on the host, also in a GPU run: not a device allocation.
        assert state["step"].device.type == "cpu" and tr.ident_of(state["step"]) is None
        # foreach AdamW's temporaries (the sqrt of exp_avg_sq) come and go within the step.
        assert len(tr.events) > 2 * tr.live_count


@needs_torch
def test_grown_storage_is_realloc():
    with Tracer(device="cpu") as tr:
        x = torch.empty(10)
        x.resize_(100)
        x.resize_(20)  # shrinking keeps the block
    assert [e[:3] for e in tr.events] == [(ALLOC, 1, 40), (ALLOC, 2, 400), (FREE, 1, 40)]


@needs_torch
def test_streams_and_exit():
    with Tracer(device="cpu", device_index=3) as tr:
        a = torch.ones(8)
        with tr.stream(2):
            b = torch.ones(8)
            with tr.stream(5):
                c = torch.ones(8)
            d = torch.ones(8)
        del b, c, d
        kept = torch.ones(16)
    del a, kept  # after the with block: not recorded
    assert [(e[0], e[3], e[4]) for e in tr.events] == [
        (ALLOC, 0, 3),
        (ALLOC, 2, 3),
        (ALLOC, 5, 3),
        (ALLOC, 2, 3),
        (FREE, 2, 3),
        (FREE, 5, 3),
        (FREE, 2, 3),
        (ALLOC, 0, 3),
    ]
    trace = tr.trace(meta={"x": 1})
    assert trace.meta["x"] == 1 and trace.meta["traced_device"] == "cpu"
    assert set(check_ids(trace)) == {1, 5}  # a and kept stay live


@needs_torch
def test_watch_existing_tensors():
    model = torch.nn.Linear(4, 4)
    with Tracer(device="cpu") as tr:
        assert tr.watch(model) == 2
        assert tr.watch(model, model.weight) == 0
    assert sorted(e[2] for e in allocs(tr)) == [16, 64]


@needs_torch
def test_meta_and_cpu_give_the_same_trace():
    def step(device):
        torch.manual_seed(0)
        with Tracer(device=device) as tr:
            model = torch.nn.Sequential(
                torch.nn.Linear(24, 48, device=device),
                torch.nn.LayerNorm(48, device=device),
                torch.nn.GELU(),
                torch.nn.Linear(48, 10, device=device),
            )
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
            for batch in (8, 5):
                x = torch.randn(batch, 24, device=device)
                y = torch.randint(0, 10, (batch,), device=device)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            del model, opt, x, y
        return tr.trace()

    cpu, meta = step("cpu"), step("meta")
    assert len(cpu) > 40
    assert shape_of(cpu) == shape_of(meta)
    assert check_ids(cpu) == {} and check_ids(meta) == {}


@needs_torch
@pytest.mark.parametrize(
    "name,kw",
    [
        ("gpt", dict(layers=2, d_model=32, heads=2, vocab=256, steps=3, max_seq=64, optimizer="sgd")),
        ("cnn", dict(batch=3, image=16, width=8, blocks=(1, 1), steps=2)),
        ("kvcache", dict(layers=2, d_model=32, heads=2, vocab=256, requests=3, max_prompt=40, max_new=12)),
        (
            "kvcache",
            dict(
                layers=2,
                d_model=32,
                heads=2,
                vocab=256,
                requests=3,
                max_prompt=40,
                max_new=12,
                cache="chunked",
                chunk=8,
            ),
        ),
        ("lstm", dict(layers=2, embed=8, hidden=16, vocab=50, batch=3, min_len=2, max_len=6, steps=2, optimizer="sgd")),
    ],
)
def test_workloads_meta_equals_cpu(name, kw):
    cpu = WORKLOADS[name](device="cpu", **kw)
    meta = WORKLOADS[name](device="meta", **kw)
    assert shape_of(cpu) == shape_of(meta)


# ---- rmm_random ------------------------------------------------------------------------------


def test_rmm_random_probability_cap_and_final_frees():
    # Sizes small enough that the cap never binds: the choices follow p_alloc alone.
    t = rmm_random.generate(20000, 1 * MiB, 16 * GiB, seed=1)
    m = t.meta
    assert m["cap_frees"] == 0
    p = m["random_allocs"] / (m["random_allocs"] + m["random_frees"])
    assert abs(p - 0.73) < 0.015, p
    assert m["random_allocs"] + m["empty_allocs"] == 20000
    assert check_ids(t) == {}, "everything is freed at the end"
    assert sum(1 for e in t if e[0] == ALLOC) == 20000
    sizes = [e[2] for e in t if e[0] == ALLOC]
    assert 1 <= min(sizes) and max(sizes) <= MiB
    assert abs(sum(sizes) / len(sizes) - MiB / 2) < MiB * 0.02  # uniform: mean near max/2


def test_rmm_random_default_sizes_hit_the_cap_never_cross_it():
    t = rmm_random.capture("small", seed=3)
    cap = 16 * GiB
    assert t.meta["cap"] == cap and t.meta["max_size"] == 4096 * MiB
    assert t.meta["cap_frees"] > 0, "with sizes up to 4 GiB the cap binds"
    live = peak = 0
    sizes = {}
    for action, ident, size, *_ in t:
        if action == ALLOC:
            sizes[ident] = size
            live += size
        else:
            live -= sizes[ident]
        assert live <= cap
        peak = max(peak, live)
    assert live == 0 and check_ids(t) == {}
    assert peak == t.meta["peak_live_bytes"] == peak_live_bytes(t) > cap - 4096 * MiB
    assert sum(1 for e in t if e[0] == ALLOC) == 1000
    assert max(sizes.values()) <= 4096 * MiB


def test_rmm_random_is_seeded_and_streams():
    a = rmm_random.capture(count=500, seed=7, streams=4)
    b = rmm_random.capture(count=500, seed=7, streams=4)
    c = rmm_random.capture(count=500, seed=8, streams=4)
    assert a.data == b.data and a.data != c.data
    assert {e[3] for e in a} == {0, 1, 2, 3}
    check_ids(a)  # a free names its allocation's stream
    with pytest.raises(ValueError):
        rmm_random.generate(10, 2 * GiB, 1 * GiB)
    with pytest.raises(ValueError):
        rmm_random.capture(scale="huge")


# ---- the model families: vit, unet, moe, lstm ------------------------------------------------


@needs_torch
@pytest.mark.parametrize("name", ["vit", "unet", "moe", "lstm"])
def test_model_family_is_deterministic_and_balanced(name):
    """Two captures of the small scale (2 steps) with one seed: the same trace, every allocation freed."""
    a = WORKLOADS[name]("small", seed=3, steps=2)
    b = WORKLOADS[name]("small", seed=3, steps=2)
    assert len(a) > 1000 and shape_of(a) == shape_of(b)
    assert check_ids(a) == {}, "everything is freed at the end"
    assert peak_live_bytes(a) == peak_live_bytes(b) > 0
    assert a.meta["workload"] == name and a.meta["config"]["steps"] == 2


def test_model_family_shapes_vary_with_the_step_and_the_seed():
    cfg = dict(vit.SCALES["small"], steps=30)
    sizes = vit.draw_images(0, cfg)
    assert sizes == vit.draw_images(0, cfg) != vit.draw_images(1, cfg)
    assert len({h * w for h, w in sizes}) > 5, "the number of patches changes from step to step"
    assert all(cfg["min_image"] <= x <= cfg["max_image"] and x % cfg["patch"] == 0 for hw in sizes for x in hw)

    cfg = dict(unet.SCALES["medium"], steps=30)
    sizes = unet.draw_sizes(0, cfg)
    assert len(set(sizes)) > 3 and all(64 <= s <= 256 and s % 32 == 0 for s in sizes)

    cfg = dict(moe.SCALES["small"], steps=5)
    routing = moe.draw_routing(0, cfg)
    tokens = cfg["batch"] * cfg["seq"]
    assert len(routing) == 5 and all(len(step) == cfg["layers"] for step in routing)
    counts = [c for step in routing for c in step]
    assert all(sum(c) == tokens * cfg["top_k"] and max(c) <= tokens and len(c) == cfg["experts"] for c in counts)
    assert len({tuple(c) for c in counts}) == len(counts), "each expert's batch changes with the step and layer"
    skewed = moe.draw_routing(0, dict(cfg, router_alpha=0.05))
    assert max(max(c) for s in skewed for c in s) == tokens, "a skewed router sends every token to one expert"

    cfg = dict(lstm.SCALES["small"], steps=20)
    batches = lstm.draw_batches(0, cfg)
    assert batches != lstm.draw_batches(1, cfg)
    for src, tgt in batches:
        for lengths in (src, tgt):
            assert len(lengths) == cfg["batch"] and max(lengths) == lengths[0]
            assert cfg["min_len"] <= min(lengths) and max(lengths) - min(lengths) <= max(lengths) // 4
    assert len({max(s) for s, _ in batches}) > 5


@needs_torch
@pytest.mark.parametrize(
    "name,kw",
    [
        ("vit", dict(min_image=4, max_image=7)),
        ("unet", dict(mults=())),
        ("moe", dict(top_k=9)),
        ("moe", dict(router_alpha=0.0)),
        ("lstm", dict(min_len=40)),
        ("vit", dict(dim=100)),
    ],
)
def test_model_family_refuses_bad_settings(name, kw):
    with pytest.raises(ValueError):
        WORKLOADS[name]("small", steps=1, **kw)
    with pytest.raises(TypeError):
        WORKLOADS[name]("small", no_such_setting=1)


# ---- every workload at the small scale -------------------------------------------------------


def _small(name):
    marks = [] if name == "rmm_random" else [needs_torch]
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_small(n) for n in WORKLOADS])
def test_small_capture(name, tmp_path):
    trace = WORKLOADS[name]("small")
    assert len(trace) > 1000
    live = check_ids(trace)
    assert not live, f"{len(live)} allocations never freed"
    peak = peak_live_bytes(trace)
    assert peak > 0
    path = tmp_path / f"{name}.cptrace"
    save(trace, path)
    assert path.stat().st_size < 2_000_000
    back = load(path)
    assert back.data == trace.data and back.meta["workload"] == name


def test_cli_writes_trace(tmp_path):
    out = tmp_path / "r.cptrace"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "workloads" / "rmm_random.py"), "--count", "300", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "events=600" in r.stdout and "peak live bytes=" in r.stdout
    with gzip.open(out, "rb") as f:
        header = json.loads(f.readline())
    assert header["events"] == 600 and header["meta"]["count"] == 300

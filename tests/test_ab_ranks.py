"""``ab --simulate --nproc-per-node N``: a torchrun job's ranks traced on the fake GPU.

Each script below is written as people write multi-GPU scripts (torchrun's variables,
``init_process_group("nccl")``, DDP, FSDP2's ``fully_shard``, DTensor's ``parallelize_module``, a
2-D device mesh, activation checkpointing) and runs unchanged. The checks compare the prediction
with what the configuration says a rank must hold (parameters, gradients, shards, optimizer
state), worked out here from the model's sizes, not from the trace.
"""

import json
import os
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cudapool.ab import ranks  # noqa: E402
from cudapool.fakegpu.native import why_unavailable  # noqa: E402
from test_ab_simulate import simulate as run_simulate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if k not in ranks.TORCHRUN_VARS}
ENV["PYTHONPATH"] = str(ROOT / "python")
NATIVE_WHY = why_unavailable()
needs_native = pytest.mark.skipif(NATIVE_WHY is not None, reason=f"the native engine cannot run here: {NATIVE_WHY}")
MiB = 1 << 20


def simulate(tmp_path: Path, source: str, *argv: str, args: tuple = (), expect: int = 0, env: dict = ENV) -> tuple:
    """Run ab --simulate on ``source`` (written to job.py) with ``argv`` before ``--`` and the
    script's ``args`` after it; (the completed process, the JSON result or None)."""
    (tmp_path / "job.py").write_text(textwrap.dedent(source))
    out = tmp_path / "out.json"
    if out.exists():
        out.unlink()
    done = run_simulate(tmp_path, "--json", str(out), *argv, "--", "job.py", *args, expect=expect, env=env)
    return done, (json.loads(out.read_text()) if out.exists() else None)


def peak(result: dict, rank: int = 0, allocator: str = "builtin") -> int:
    rr = next(r for r in result["rank_rows"] if r["rank"] == rank)
    return next(r for r in rr["rows"] if r["allocator"] == allocator)["peak_allocated"]


# -- the world ------------------------------------------------------------------------------------


def test_rank_env_is_torchruns() -> None:
    world = ranks.World(4, 2)
    env = ranks.rank_env(world, 6)
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "6", "2", "1", "8", "4",
    )  # fmt: skip
    assert ranks.from_torchrun_env(env) == (world, 6)
    assert ranks.from_torchrun_env({"RANK": "1"}) is None
    assert ranks.from_torchrun_env({"RANK": "9", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) is None


@pytest.mark.parametrize(
    "text, expect", [("all", list(range(8))), ("0,7", [0, 7]), ("2-4,0", [0, 2, 3, 4]), (" 5 ", [5]), ("1,1", [1])]
)
def test_ranks_parse(text: str, expect: list) -> None:
    assert ranks.parse_ranks(text, ranks.World(8)) == expect


@pytest.mark.parametrize(
    "text, says",
    [("8", "rank 8 is not in a world of 8"), ("a", "'a' is not a rank"), ("3-1", "empty"), (",", "no rank")],
)
def test_bad_ranks_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ranks.parse_ranks(text, ranks.World(8))


def test_ranks_text_and_groups() -> None:
    assert ranks.ranks_text([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert ranks.group_ranks({0: "a", 3: "b", 1: "a"}) == [[0, 1], [3]]
    assert ranks.default_ranks(ranks.World(8, 2)) == [0, 15]
    assert ranks.default_ranks(ranks.World(1)) == [0]


def test_a_fingerprint_ignores_times_and_the_devices_number() -> None:
    from cudapool.lab._events import EVENT

    def data(device: int, time: int) -> bytes:
        return EVENT.pack(0, device, 1, 512, 0, time) + EVENT.pack(1, device, 1, 512, 0, time + 5)

    assert ranks.fingerprint(data(0, 10), 0) == ranks.fingerprint(data(3, 99), 3)
    assert ranks.fingerprint(data(0, 10), 0) != ranks.fingerprint(data(0, 10), 1)  # not on its own GPU
    alloc = lambda i: EVENT.pack(0, 0, i, 512, 0, 0)  # noqa: E731
    free = lambda i: EVENT.pack(1, 0, i, 512, 0, 0)  # noqa: E731
    # frees between two allocations: a set; allocations: an order
    one = alloc(1) + alloc(2) + free(1) + free(2) + alloc(3)
    assert ranks.fingerprint(one, 0) == ranks.fingerprint(alloc(1) + alloc(2) + free(2) + free(1) + alloc(3), 0)
    assert ranks.fingerprint(one, 0) != ranks.fingerprint(alloc(2) + alloc(1) + free(1) + free(2) + alloc(3), 0)
    assert ranks.fingerprint(one, 0) != ranks.fingerprint(alloc(1) + alloc(2) + free(1) + alloc(3) + free(2), 0)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node must be 1..64"),
        (["--nproc-per-node", "65"], "--nproc-per-node must be 1..64"),
        (["--nnodes", "2"], "--nnodes goes with --nproc-per-node"),
        (["--ranks", "0"], "--ranks goes with --nproc-per-node"),
        (["--nproc-per-node", "2", "--ranks", "2"], "rank 2 is not in a world of 2"),
        (["--nproc-per-node", "2", "--engine", "python"], "ranks need the native engine"),
    ],
)
def test_bad_command_lines_exit_2(tmp_path: Path, argv: list, says: str) -> None:
    done, _ = simulate(tmp_path, "pass\n", *argv, expect=2)
    assert says in done.stderr


# -- scripts -------------------------------------------------------------------------------------

TORCHRUN_HEAD = """
import os
import torch
import torch.distributed as dist
import torch.nn as nn

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
rank, world = dist.get_rank(), dist.get_world_size()
"""

DDP = (
    TORCHRUN_HEAD
    + """
import sys
from torch.nn.parallel import DistributedDataParallel as DDP

view = sys.argv[1:] == ["view"]
model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)]).cuda()
ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=view)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for step in range(3):
    ddp(torch.randn(16, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
dist.destroy_process_group()
"""
)


@needs_native
def test_ddp_buckets_hold_a_copy_of_the_gradients_unless_they_are_views(tmp_path: Path) -> None:
    # 8 layers of 1024 x 1024 fp32: 32 MiB of parameters. DDP's buckets (25 MiB each, the first
    # 1 MiB) hold every gradient; with gradient_as_bucket_view the gradients are those buckets,
    # without it each gradient is a tensor of its own beside them: 32 MiB more.
    P = 8 * 1024 * 1024 * 4
    _, copies = simulate(tmp_path, DDP, "--nproc-per-node", "2", "--allocators", "builtin")
    _, views = simulate(tmp_path, DDP, "--nproc-per-node", "2", "--allocators", "builtin", args=("view",))
    assert peak(copies) - peak(views) == P
    # At the peak (in the backward): the parameters, the buckets and the gradients, each the
    # parameters' size; the cuBLAS workspaces of the forward's thread and autograd's; the layer
    # gradient being made (4 MiB); the saved activations of the step (the input and 8 outputs
    # of 16 x 1024 fp32: 64 KiB each); DDP's two 4-byte counters (512 bytes each, rounded).
    W = 32 * MiB  # an H100's cuBLAS workspace
    assert peak(copies) == 3 * P + 2 * W + 4 * MiB + 9 * 64 * 1024 + 2 * 512
    assert copies["groups"] == [[0, 1]]  # the two ranks traced the same program
    assert [r["stands_for"] for r in copies["rank_rows"]] == [[0, 1]]


FSDP2 = (
    TORCHRUN_HEAD
    + """
import sys
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

reshard = sys.argv[1] == "reshard"
model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)]).cuda()
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model:
    fully_shard(layer, reshard_after_forward=reshard, mp_policy=mp)
fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
opt = torch.optim.AdamW(model.parameters())
for step in range(2):
    model(torch.randn(32, 2048, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
print("rank", rank, "shard", model[0].weight.to_local().shape)
"""
)


@needs_native
@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp2_shards_fall_with_the_world(tmp_path: Path, nproc: int) -> None:
    # 8 layers of 2048 x 2048 fp32 = 128 MiB of parameters; sharded over the world, each rank
    # holds its shard of the parameters, the gradients and AdamW's two states: 4 x 128 MiB / N,
    # and the unsharded bf16 layers it all-gathers (at most all 8 without resharding: 64 MiB).
    P = 8 * 2048 * 2048 * 4
    done, res = simulate(tmp_path, FSDP2, "--nproc-per-node", str(nproc), "--allocators", "builtin", args=("reshard",))
    assert f"| [rank 0] rank 0 shard torch.Size([{2048 // nproc}, 2048])" in done.stderr
    sharded = 4 * P // nproc
    assert sharded <= peak(res) <= sharded + P // 2 + 96 * MiB
    # FSDP2 all-gathers and reduce-scatters on streams of its own: their buffers are allocated there.
    rank_trace = res["traces"]["0"]
    assert rank_trace["fake_gpu"]["devices"] == nproc
    assert len(res["rank_rows"]) == 1 and res["rank_rows"][0]["stands_for"] == list(range(nproc))


TP_2D = """
import os
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
world = int(os.environ["WORLD_SIZE"])
mesh = init_device_mesh("cuda", (world // 2, 2), mesh_dim_names=("dp", "tp"))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(1024, 4096, bias=False)
        self.w2 = nn.Linear(4096, 1024, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLP() for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


model = Net().cuda()
for layer in model.layers:
    parallelize_module(layer, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fully_shard(layer, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
print("local weight", tuple(model.layers[0].w1.weight.to_local().shape))
opt = torch.optim.AdamW(model.parameters())
for step in range(2):
    model(torch.randn(8, 128, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


@needs_native
def test_fsdp_by_tensor_parallel_on_a_2d_mesh(tmp_path: Path) -> None:
    done, res = simulate(tmp_path, TP_2D, "--nproc-per-node", "4", "--allocators", "builtin,cudapool")
    # 4096 x 1024 split in 2 by tensor parallelism, then in 2 by FSDP: 1024 rows of 1024 here.
    assert "| [rank 0] local weight (1024, 1024)" in done.stderr
    world = res["traces"]["0"]["world"]
    # the world's group, and the rank's dp and tp groups of 2: three NCCL communicators
    assert sorted(len(g["ranks"]) for g in world["groups"]) == [2, 2, 4]
    assert "NCCL: 3 communicators" in done.stdout
    # each rank holds 1/4 of the 32 MiB of weights, their gradients and AdamW's two states
    assert peak(res) >= 4 * (8 * 1024 * 4096 * 4) // 4


ASYMMETRIC = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
if dist.get_rank() == 0:  # rank 0 evaluates
    y = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
print("node", os.environ["GROUP_RANK"], "local", os.environ["LOCAL_RANK"], "rank", os.environ["RANK"])
"""


@needs_native
def test_ranks_that_differ_have_rows_of_their_own_and_the_worst_answers(tmp_path: Path) -> None:
    done, res = simulate(tmp_path, ASYMMETRIC, "--nproc-per-node", "2", "--nnodes", "3", "--allocators", "builtin")
    # ranks 0 and 5 differ, so rank 1 is traced too: it is rank 5's program
    assert sorted(int(r) for r in res["traces"]) == [0, 1, 5]
    assert [(r["rank"], r["stands_for"]) for r in res["rank_rows"]] == [(0, [0]), (1, [1, 2, 3, 4, 5])]
    assert "| [rank 5] node 2 local 1 rank 5" in done.stderr
    assert peak(res, 0) == 320 * MiB and peak(res, 1) == 64 * MiB
    assert res["worst"]["builtin"]["rank"] == 0
    assert "the most GPU memory a rank needs is rank 0's" in done.stdout
    # --ranks: exactly those, each its own row unless the same
    _, picked = simulate(tmp_path, ASYMMETRIC, "--nproc-per-node", "2", "--ranks", "1", "--allocators", "builtin")
    assert [(r["rank"], r["stands_for"]) for r in picked["rank_rows"]] == [(1, [0, 1])]


@needs_native
def test_outside_memory_decides_fits_and_the_smallest_gpu(tmp_path: Path) -> None:
    # 1 GiB of tensors on a 2 GB GPU fits one process without ranks; a rank also holds a CUDA
    # context and NCCL buffers, and then it does not.
    source = ASYMMETRIC.replace("64 << 20", "1 << 30").replace("256 << 20", "1")
    done, res = simulate(tmp_path, source, "--nproc-per-node", "2", "--gpu", "2GB", "--allocators", "builtin")
    rr = res["rank_rows"][0]
    row = rr["rows"][0]
    assert rr["outside"]["context"] > 0 and rr["outside"]["nccl"] > 0
    assert row["peak_reserved"] < 2 * 1000**3 < row["peak_reserved"] + rr["outside"]["total"]
    assert not row["fits"] and not res["worst"]["builtin"]["fits"]
    assert row["min_capacity"] >= row["peak_reserved"] + rr["outside"]["total"]
    assert "does NOT fit on every rank" in done.stdout


@needs_native
def test_a_job_launched_by_torchrun_is_answered_by_rank_0(tmp_path: Path) -> None:
    env = dict(ENV, **ranks.rank_env(ranks.World(2, 2), 2))
    done, res = simulate(tmp_path, ASYMMETRIC, "--allocators", "builtin", env=env)
    assert "rank 2 of torchrun's job: rank 0 prints the prediction" in done.stderr and res is None
    env = dict(ENV, **ranks.rank_env(ranks.World(2, 2), 0))
    done, res = simulate(tmp_path, ASYMMETRIC, "--allocators", "builtin", env=env)
    assert res["options"]["nproc_per_node"] == 2 and res["options"]["nnodes"] == 2
    assert "4 ranks (2 node(s) of 2 GPUs)" in done.stdout


@needs_native
def test_a_script_that_needs_ranks_and_has_none_says_how_to_give_them(tmp_path: Path) -> None:
    done, _ = simulate(tmp_path, TORCHRUN_HEAD.replace('dist.init_process_group("nccl")\n', ""), expect=1)
    assert "KeyError: 'LOCAL_RANK' (torchrun sets LOCAL_RANK: give its ranks as torchrun would" in done.stderr
    assert "--nproc-per-node N" in done.stderr
    done, _ = simulate(tmp_path, TORCHRUN_HEAD, expect=1)
    assert 'job.py:7: `dist.init_process_group("nccl")`: the script initialises torch.distributed' in done.stderr
    assert "Traceback" not in done.stderr


FIND_MAX = """
import argparse, os
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=1)
args = p.parse_args()
dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
x = torch.empty(args.batch_size << 20, dtype=torch.uint8, device="cuda")
"""


@needs_native
def test_find_max_batch_is_the_largest_that_fits_on_every_rank(tmp_path: Path) -> None:
    done, res = simulate(
        tmp_path, FIND_MAX, "--nproc-per-node", "2", "--gpu", "4GB", "--allocators", "builtin",
        "--find-max-batch", "--batch-size", "--max-batch-range", "1:8192", "--max-batch-step", "1",
    )  # fmt: skip
    best = res["max_batch"]["results"]["builtin"]["max"]
    outside = res["rank_rows"][0]["outside"]["total"]
    # the largest whole MiB that fits beside the outside memory (the built-in allocator rounds
    # a large request up to 2 MiB)
    room = 4 * 1000**3 - outside
    assert best is not None and (best + 1) * MiB > room - 2 * MiB and best * MiB <= room


OTHER_PARALLELISMS = {
    "fsdp1": """
import os, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
dist.init_process_group("nccl"); torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
m = FSDP(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).cuda())
opt = torch.optim.AdamW(m.parameters())
for i in range(2):
    m(torch.randn(16, 1024, device="cuda")).sum().backward(); opt.step(); opt.zero_grad()
""",
    "fsdp2 cpu offload": """
import os, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import fully_shard, CPUOffloadPolicy
dist.init_process_group("nccl"); torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
for layer in m: fully_shard(layer, offload_policy=CPUOffloadPolicy())
fully_shard(m, offload_policy=CPUOffloadPolicy())
opt = torch.optim.AdamW(m.parameters())
for i in range(2):
    m(torch.randn(16, 1024, device="cuda")).sum().backward(); opt.step(); opt.zero_grad()
""",
    "ddp static graph, gloo objects": """
import os, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl"); torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
cpu = dist.new_group(backend="gloo")
got = [None] * dist.get_world_size()
dist.all_gather_object(got, {"rank": dist.get_rank()}, group=cpu)
assert got[0] == {"rank": dist.get_rank()}
m = DDP(nn.Linear(512, 512).cuda(), static_graph=True)
for i in range(3):
    m(torch.randn(8, 512, device="cuda")).sum().backward()
dist.barrier()
""",
}


@needs_native
@pytest.mark.parametrize("name", sorted(OTHER_PARALLELISMS))
def test_other_parallelisms_run(tmp_path: Path, name: str) -> None:
    done, res = simulate(tmp_path, OTHER_PARALLELISMS[name], "--nproc-per-node", "2", "--allocators", "builtin")
    assert res["rank_rows"][0]["rows"][0]["peak_allocated"] > 0
    if name.startswith("ddp"):
        groups = res["traces"]["0"]["world"]["groups"]
        assert [g["backend"] for g in groups] == ["nccl", "gloo"]
        assert "NCCL: 1 communicator" in done.stdout  # the gloo group has none
        assert "object collectives (1 all_gather_object)" in done.stdout


@needs_native
def test_pipeline_shape_inference_is_not_simulated_and_says_so(tmp_path: Path) -> None:
    source = """
import os, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
dist.init_process_group("nccl"); r = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(r)
stage = PipelineStage(nn.Linear(256, 256).cuda(), r, 2, torch.device("cuda", r))
sched = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda o, t: o.sum())
x = torch.randn(16, 256, device="cuda")
sched.step(x) if r == 0 else sched.step(target=x, losses=[])
"""
    done, _ = simulate(tmp_path, source, "--nproc-per-node", "2", expect=1)
    assert "recv_object_list: the objects another rank sends are not known" in done.stderr
    assert "pipeline stages of torch.distributed.pipelining exchange their shapes so" in done.stderr
    assert "(rank 0)" in done.stderr and "Traceback" not in done.stderr


@needs_native
def test_what_only_another_rank_knows_is_refused_naming_the_rank_to_trace(tmp_path: Path) -> None:
    source = """
import os, torch, torch.distributed as dist
dist.init_process_group("nccl"); torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
shapes = [{"w": (1024, 1024)}] if dist.get_rank() == 0 else [{}]  # rank 0 read a checkpoint
dist.broadcast_object_list(shapes, src=0)
config = [{"lr": 0.1}]  # every rank made the same
dist.broadcast_object_list(config, src=0)
w = torch.empty(shapes[0]["w"], device="cuda")
"""
    done, _ = simulate(tmp_path, source, "--nproc-per-node", "2", expect=1)
    assert "broadcast_object_list: rank 1 receives objects only rank 0 has" in done.stderr
    assert "(--ranks 0)" in done.stderr
    _, res = simulate(tmp_path, source, "--nproc-per-node", "2", "--ranks", "0", "--allocators", "builtin")
    assert peak(res) == 4 * MiB
    assert res["traces"]["0"]["world"]["object_collectives"] == {"broadcast_object_list": 2}


@needs_native
def test_a_ranks_files_are_its_own_and_the_scripts_folder_is_untouched(tmp_path: Path) -> None:
    # Rank 0 saves a checkpoint at the end; a rank traced at the same time or later must not find
    # it at the start (on a GPU every rank looks before rank 0 saves), and nothing is left behind.
    source = """
import os, torch, torch.distributed as dist
dist.init_process_group("nccl"); torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
resumed = os.path.exists("snap.pt") or os.path.isdir("ck")
w = torch.load("snap.pt")["w"] if resumed else torch.zeros(1024, 1024, device="cuda")
print("rank", dist.get_rank(), "resumed", resumed)
if dist.get_rank() == 0:
    torch.save({"w": w}, "snap.pt")
    assert torch.load("snap.pt")["w"].shape == (1024, 1024)  # its own file, read back
    os.makedirs("ck/step-1", exist_ok=True)  # a checkpoint folder of its own making
    with open("ck/step-1/meta.json", "w") as f:
        f.write("{}")
    assert os.listdir("ck") == ["step-1"] and open("ck/step-1/meta.json").read() == "{}"
"""
    for _ in range(2):
        done, res = simulate(tmp_path, source, "--nproc-per-node", "4", "--ranks", "all", "--allocators", "builtin")
        assert done.stderr.count("resumed False") == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py", "out.json"]
    assert res["traces"]["0"]["fake_gpu"]["scratch_files"] == 2
    assert (
        "the script wrote 2 file(s) on rank 0 (torch.save, and open() in folders it made): into a scratch folder"
        in done.stdout
    )

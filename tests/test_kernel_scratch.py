"""The scratch buffers of CUDA kernels the tracer models (cudapool.fakegpu.kernel_scratch), against the
sizes GPU snapshots recorded (public runs of benchmarks/tracer_public.py, torch 2.11)."""

import pytest

try:
    import torch
except Exception:  # not installed, or a broken install
    torch = None

pytestmark = pytest.mark.skipif(torch is None, reason="torch is not importable")

if torch is not None:
    from cudapool.fakegpu import kernel_scratch as ks
    from cudapool.fakegpu.tracer import Tracer
    from cudapool.lab.trace import ALLOC, FREE


def _contiguous_strides(shape):
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


# (input shape, reduced dims, the staging recorded: (buffer, semaphores) or none). A gradient of
# a [d] weight summed over every token is the column reduction that stages; row reductions over
# the last dimension (norms, softmax sums, up to 10,000 wide) do not.
RECORDED = [
    ((4, 128, 1024), (0, 1), ()),
    ((4, 256, 1024), (0, 1), (8388608, 32)),
    ((4, 512, 1024), (0, 1), (16777216, 32)),
    ((4, 1024, 1024), (0, 1), (33554432, 32)),
    ((32, 256, 768), (0, 1), (50331648, 24)),
    ((4, 256, 1024), (2,), ()),
    ((4, 16, 1024, 1024), (3,), ()),
    ((4, 1024, 10000), (2,), ()),
    ((32, 256, 10000), (2,), ()),
    ((32, 256, 768), (2,), ()),
]


@pytest.mark.parametrize("shape,dims,staging", RECORDED)
def test_reduction_staging_as_recorded(shape, dims, staging):
    steps = ks.reduction_steps(shape, _contiguous_strides(shape), dims, 4, 4)
    assert steps == ((staging[0], staging[1], -2, -1) if staging else ())


def test_a_smaller_gpu_splits_over_fewer_blocks():
    # 8 multiprocessors of 2048 threads: 128 blocks of 128 threads at once, 6 output blocks:
    # 22 blocks per output instead of 128.
    shape = (32, 256, 768)
    steps = ks.reduction_steps(shape, _contiguous_strides(shape), (0, 1), 4, 4, gpu=(8, 2048))
    assert steps == (4 * 768 * 22 * 128, 24, -2, -1)


def test_layouts_not_modelled_give_nothing():
    assert ks.reduction_steps((4, 8), (0, 1), (0,), 4, 4) == ()  # a broadcast (zero stride)
    assert ks.reduction_steps((4, 8), (8, 1), (), 4, 4) == ()  # nothing reduced


def test_index_put_scratch_sizes_as_recorded():
    for n, cub in ((512, 1), (1024, 1), (2048, 1), (4096, 72191), (8192, 138751)):
        steps = ks.index_put_steps(n)
        assert [s for s in steps if s > 0] == [8 * n] * 5 + [cub]
        assert sorted(-s for s in steps if s < 0) == [1, 2, 3, 4, 5, 6]
    assert ks.index_put_steps(0) == ()


def test_gpu_shapes():
    assert ks.gpu_shape(None) == ks.DEFAULT_GPU == (132, 2048)
    assert ks.gpu_shape((108, 2048)) == (108, 2048)
    assert ks.gpu_shape({"multi_processor_count": 128, "max_threads_per_multi_processor": 1536}) == (128, 1536)

    class Props:
        multi_processor_count = 82
        max_threads_per_multi_processor = 1536

    assert ks.gpu_shape(Props()) == (82, 1536)
    with pytest.raises(ValueError, match="positive"):
        ks.gpu_shape((0, 2048))
    with pytest.raises(ValueError, match="positive"):
        Tracer(device="meta", gpu=(132, -1))


def test_the_tracer_emits_staging_after_the_result_and_frees_it():
    x = torch.empty(4, 256, 1024, device="meta")
    with Tracer(device="meta", record_ops=True) as tr:
        y = x.sum((0, 1))
        z = x.mean(-1)
    allocs = [(tr.alloc_ops[e[1]], e[2]) for e in tr.events if e[0] == ALLOC]
    assert allocs[1:] == [
        ("aten.sum.dim_IntList", 4096),
        ("reduction staging", 8388608),
        ("reduction staging", 32),
        ("aten.mean.dim", 4 * 256 * 4),
    ]
    kinds = [(e[0], e[2]) for e in tr.events][2:6]
    assert kinds == [(ALLOC, 8388608), (ALLOC, 32), (FREE, 32), (FREE, 8388608)]
    meta = tr.trace().meta
    assert meta["kernel_scratch"] is True and meta["gpu"]["multi_processor_count"] == 132
    del y, z


def test_no_scratch_when_asked_or_on_the_cpu():
    for kw in ({"device": "meta", "kernel_scratch": False}, {"device": "cpu"}):
        dev = kw["device"]
        x = torch.empty(4, 256, 1024, device=dev)
        with Tracer(record_ops=True, **kw) as tr:
            y = x.sum((0, 1))
        assert "reduction staging" not in tr.alloc_ops.values()
        unseen = tr.trace().meta["unseen"]
        assert any(u.startswith("kernel_scratch: not modelled") for u in unseen)
        del y

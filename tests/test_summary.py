"""cudapool's summary table against torch's own memory_summary, line for line.

torch.cuda.memory.memory_summary(device=0) reads nothing but memory_stats(device=0) (and
resolves the integer device without touching CUDA), so with memory_stats monkeypatched to
return our stats it formats them without a GPU. Our table must equal torch's in every line
but the title line, which names cudapool instead of PyTorch: that is the only difference,
and it is deliberate.
"""

import itertools
import random

import pytest

torch = pytest.importorskip("torch", reason="the comparison needs torch's own formatter")
import torch.cuda.memory as tcm  # noqa: E402
from cudapool import _C  # noqa: E402
from cudapool.sim import Pool as SimPool  # noqa: E402
from cudapool.summary import DEFAULT_TITLE, format_summary  # noqa: E402


def Pool(*args, **kwargs):
    """A simulated pool under torch's built-in rules, which these tests check (sim.Pool's own
    default is cudapool's policy)."""
    kwargs.setdefault("policy", "builtin")
    return SimPool(*args, **kwargs)


# torch's formatter, taken before anything could replace it (cudapool patches torch only in
# the process that calls enable(), which this one never does).
TORCH_MEMORY_SUMMARY = tcm.memory_summary
assert TORCH_MEMORY_SUMMARY.__module__ == "torch.cuda.memory"

KiB = 1 << 10
MiB = 1 << 20
TITLE_LINE = 1  # index of the title line in both tables


def torch_summary(monkeypatch, stats, abbreviated):
    monkeypatch.setattr(tcm, "memory_stats", lambda device=None: stats)
    return TORCH_MEMORY_SUMMARY(device=0, abbreviated=abbreviated)


def assert_same_but_title(ours, theirs):
    our_lines, their_lines = ours.splitlines(), theirs.splitlines()
    assert len(our_lines) == len(their_lines), f"\n{ours}\n{theirs}"
    for i, (a, b) in enumerate(zip(our_lines, their_lines)):
        if i == TITLE_LINE:
            assert len(a) == len(b) == 77
            assert "PyTorch CUDA memory summary, device ID 0" in b
            continue
        assert a == b, f"line {i} differs:\nours:  {a!r}\ntorch: {b!r}"
    assert ours.endswith("|\n") and theirs.endswith("|\n")


def all_stat_keys():
    keys = [f"{f}.{k}.{m}" for f, k, m in itertools.product(_C.STAT_FAMILIES, _C.POOL_KINDS, _C.STAT_METRICS)]
    keys += [f"oversize_{x}.{m}" for x in ("allocations", "segments") for m in _C.STAT_METRICS]
    keys += list(_C.STAT_COUNTERS) + ["max_split_size"]
    return keys


@pytest.fixture
def busy_pool_stats():
    """Stats of a sim pool after a mix of small, large and oversize allocations, frees,
    a retry and an OOM."""
    with Pool(512 * MiB, max_split_size_mb=64) as pool:
        live = [pool.alloc(s) for s in (1000, 100, 3 * MiB, 12 * MiB, 700 * KiB, 80 * MiB, 90 * MiB)]
        pool.free(live.pop(2))
        pool.free(live.pop(0))
        with pytest.raises(MemoryError):
            pool.alloc(2048 * MiB)
        stats = pool.memory_stats()
        assert pool.check() == 0
        yield stats


@pytest.mark.parametrize("abbreviated", [False, True])
def test_sim_pool_summary_matches_torch(monkeypatch, busy_pool_stats, abbreviated):
    ours = format_summary(busy_pool_stats, 0, abbreviated)
    theirs = torch_summary(monkeypatch, busy_pool_stats, abbreviated)
    assert_same_but_title(ours, theirs)
    assert ours.splitlines()[TITLE_LINE].strip("| ") == f"{DEFAULT_TITLE}, device ID 0"
    assert busy_pool_stats["num_ooms"] == 1
    assert busy_pool_stats["oversize_allocations.current"] == 2


@pytest.mark.parametrize("abbreviated", [False, True])
def test_empty_pool_summary_matches_torch(monkeypatch, abbreviated):
    with Pool(64 * MiB) as pool:
        stats = pool.memory_stats()
    assert_same_but_title(format_summary(stats, 0, abbreviated), torch_summary(monkeypatch, stats, abbreviated))


def test_sim_pool_method_uses_the_same_table(monkeypatch, busy_pool_stats):
    with Pool(64 * MiB) as pool:
        pool.alloc(5 * MiB)
        text = pool.memory_summary()
        short = pool.memory_summary(abbreviated=True)
        stats = pool.memory_stats()
    assert_same_but_title(text, torch_summary(monkeypatch, stats, False))
    assert_same_but_title(short, torch_summary(monkeypatch, stats, True))
    assert "cudapool" in text.splitlines()[TITLE_LINE]
    assert len(short.splitlines()) == len(text.splitlines()) - 2 * 9


# Values at and around every unit boundary of both formatters (bytes: 768 of a unit moves
# up; counts: 750 thousand), plus huge ones.
BOUNDARIES = sorted(
    {0, 1, 2, 511, 512, 1023, 1024, 1025, 749_999, 750_000, 750_001, 749_999_999, 750_000_000}
    | {768 * KiB * (1 << (10 * i)) + d for i in range(5) for d in (-1, 0, 1)}
    | {(1 << 62) - 1, 10**15, 7 << 50}
)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("abbreviated", [False, True])
def test_synthetic_stats_match_torch_at_unit_boundaries(monkeypatch, seed, abbreviated):
    rng = random.Random(seed)
    stats = {key: rng.choice(BOUNDARIES) for key in all_stat_keys()}
    stats["num_ooms"] = rng.choice([0, 3, 10**13])  # wider than its field, in both
    stats["num_alloc_retries"] = rng.choice([0, 7, 10**9])
    ours = format_summary(stats, 0, abbreviated)
    assert_same_but_title(ours, torch_summary(monkeypatch, stats, abbreviated))


def test_every_line_is_75_columns_inside_the_box():
    with Pool(64 * MiB) as pool:
        pool.alloc(1)
        text = pool.memory_summary()
    for line in text.splitlines():
        assert len(line) == 77 and line[0] == line[-1] == "|", repr(line)


def test_title_names_the_device_and_fits():
    stats = {key: 0 for key in all_stat_keys()}
    line = format_summary(stats, 3).splitlines()[TITLE_LINE]
    assert line == "|" + f"{' ' * 18}{DEFAULT_TITLE}, device ID 3".ljust(75) + "|"
    long = format_summary(stats, 12, title="x" * 70).splitlines()[TITLE_LINE]
    assert "device ID 12" in long and long.startswith("| ") and long.endswith("|")


def test_missing_key_is_named():
    stats = {key: 0 for key in all_stat_keys()}
    del stats["active_bytes.small_pool.peak"]
    with pytest.raises(KeyError, match="active_bytes.small_pool.peak"):
        format_summary(stats, 0)

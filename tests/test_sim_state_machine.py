"""A stateful property test of the sim pool: Hypothesis drives cudapool.sim.Pool with random
allocations, frees, record_stream, stream completions and cache flushes, and after every step
the pool is compared with a small pure-Python model of what it promises (docs/design.md, "How the pool
decides" and "Statistics"). No torch, no GPU."""

import pytest

hypothesis = pytest.importorskip("hypothesis")

from cudapool.sim import OutOfMemoryError  # noqa: E402
from cudapool.sim import Pool as SimPool  # noqa: E402
from hyp import examples  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402


def Pool(*args, **kwargs):
    """A simulated pool under torch's built-in rules, which these tests check (sim.Pool's own
    default is cudapool's policy)."""
    kwargs.setdefault("policy", "builtin")
    return SimPool(*args, **kwargs)


MiB = 1 << 20
CAPACITY = 64 * MiB
GRANULE = 512
SMALL_SIZE = 1 * MiB  # requests up to this come from the small pool
LARGE_SPLIT_SLACK = 1 * MiB  # a large block is split only when more than this remains
STREAMS = st.integers(min_value=0, max_value=3)

SIZES = st.one_of(
    st.just(0),
    st.integers(min_value=1, max_value=4096),
    st.integers(min_value=1, max_value=(12 * MiB) // GRANULE).map(lambda k: k * GRANULE),
    st.integers(min_value=1, max_value=12 * MiB),
)
HUGE_SIZES = st.one_of(
    st.sampled_from([CAPACITY + 1, 65 * MiB, 1 << 30, 1 << 40, 1 << 62, 1 << 63, (1 << 64) - 1]),
    st.integers(min_value=CAPACITY + 1, max_value=1 << 48),
)


def rounded(size):
    return (size + GRANULE - 1) // GRANULE * GRANULE


def overlaps(a, alen, b, blen):
    return a < b + blen and b < a + alen


class Block:
    __slots__ = ("ptr", "size", "rounded", "stream", "uses")

    def __init__(self, ptr, size, stream):
        self.ptr = ptr
        self.size = size
        self.rounded = rounded(size)
        self.stream = stream
        self.uses = set()  # streams added with record_stream

    @property
    def small(self):
        return self.rounded <= SMALL_SIZE


class SimPoolMachine(RuleBasedStateMachine):
    """Model:

    live     -- ptr -> Block handed out and not freed.
    pending  -- ptr -> (Block, streams whose events must complete): freed after record_stream;
                its range is handed to no one until those streams complete, or the pool
                synchronizes (empty_cache, the retry step of the OOM ladder).
    cached   -- [(ptr, len, stream)]: ranges freed on a stream (or pending ones whose events
                completed). The segment belongs to that stream, so no other stream gets any
                of it until the pool gives wholly free segments back to the device.
    freed    -- every pointer freed once (for double frees).
    """

    def __init__(self):
        super().__init__()
        # Addresses not backed by host memory are the same in every run, so the pool's
        # choices (best fit breaks ties by address) and the drawn data are reproducible.
        self.pool = Pool(CAPACITY, touch_memory=False)
        self.live = {}
        self.pending = {}
        self.cached = []
        self.freed = set()
        # Work launched on each stream, and how much of it the device has run: an event waits
        # for the launches before it (Note [Simulated asynchrony] in csrc/backend/sim.h).
        self.launched = {}
        self.done = {}
        self.pending_seq = {}  # ptr -> {stream: launches its free's event waits for}

    # -- helpers ----------------------------------------------------------------------------------

    def stats(self):
        return self.pool.memory_stats()

    def _after_pool_effects(self, before, after):
        """Apply what the pool may have done on its own during one call: synchronize pending
        frees (counted in num_sync_all_streams) and give segments back (num_device_free)."""
        if after["num_sync_all_streams"] != before["num_sync_all_streams"]:
            self._all_pending_done()
        if after["num_device_free"] != before["num_device_free"]:
            # cudaFree waits for the whole device: every launch has run.
            self.done = dict(self.launched)
            self._all_pending_done()
            # Only wholly free segments go back; the model cannot tell which ones, so it forgets
            # every free range (live blocks keep their segments).
            self.cached = []

    def _launch(self, ptr, stream):
        self.pool.launch(ptr, stream)
        self.launched[stream] = self.launched.get(stream, 0) + 1

    def _all_pending_done(self):
        # Waiting for the events ran each stream up to its event.
        for seqs in self.pending_seq.values():
            for s, q in seqs.items():
                self.done[s] = max(self.done.get(s, 0), q)
        for blk, _ in self.pending.values():
            self.cached.append((blk.ptr, blk.rounded, blk.stream))
        self.pending.clear()
        self.pending_seq.clear()

    def _stream_done(self, stream):
        for ptr in list(self.pending):
            blk, waiting = self.pending[ptr]
            waiting.discard(stream)
            if not waiting:
                del self.pending[ptr]
                del self.pending_seq[ptr]
                self.cached.append((blk.ptr, blk.rounded, blk.stream))

    def _check_new_block(self, blk):
        assert blk.ptr % GRANULE == 0, hex(blk.ptr)
        for other in self.live.values():
            assert not overlaps(blk.ptr, blk.rounded, other.ptr, other.rounded), (
                f"new block {blk.ptr:#x}+{blk.rounded} overlaps live {other.ptr:#x}+{other.rounded}"
            )
        for other, waiting in self.pending.values():
            assert not overlaps(blk.ptr, blk.rounded, other.ptr, other.rounded), (
                f"new block {blk.ptr:#x}+{blk.rounded} on stream {blk.stream} reuses "
                f"{other.ptr:#x}+{other.rounded} while streams {sorted(waiting)} may still use it"
            )
        for ptr, length, stream in self.cached:
            if stream != blk.stream:
                assert not overlaps(blk.ptr, blk.rounded, ptr, length), (
                    f"new block {blk.ptr:#x}+{blk.rounded} on stream {blk.stream} lies in "
                    f"{ptr:#x}+{length}, cached for stream {stream}"
                )

    def _expect_oom(self, size, stream):
        before = self.stats()
        info_before = self.pool.info()
        with pytest.raises(OutOfMemoryError) as exc:
            self.pool.alloc(size, stream)
        assert "Tried to allocate" in str(exc.value)
        after = self.stats()
        assert after["num_ooms"] == before["num_ooms"] + 1
        # Nothing handed out, nothing taken back: only the cache may have shrunk (step 4 of
        # the ladder synchronizes pending frees and returns wholly free segments).
        for key in ("allocation.all.current", "allocated_bytes.all.current"):
            assert after[key] == before[key], key
        assert self.pool.info()["live_blocks"] == info_before["live_blocks"]
        assert after["reserved_bytes.all.current"] <= before["reserved_bytes.all.current"]
        self._after_pool_effects(before, after)

    # -- rules ------------------------------------------------------------------------------------

    @rule(size=SIZES, stream=STREAMS)
    def alloc(self, size, stream):
        before = self.stats()
        try:
            ptr = self.pool.alloc(size, stream)
        except OutOfMemoryError as e:
            assert size > 0
            assert "Tried to allocate" in str(e)
            after = self.stats()
            assert after["num_ooms"] == before["num_ooms"] + 1
            assert after["allocation.all.current"] == before["allocation.all.current"]
            assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
            self._after_pool_effects(before, after)
            return
        after = self.stats()
        self._after_pool_effects(before, after)
        if size == 0:
            assert ptr == 0
            return
        assert ptr != 0
        assert ptr not in self.live
        blk = Block(ptr, size, stream)
        self._check_new_block(blk)
        self.live[ptr] = blk
        self.freed.discard(ptr)
        self._launch(ptr, stream)  # work on its stream uses it (runs behind the host)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_live(self, data):
        ptr = data.draw(st.sampled_from(sorted(self.live)), label="ptr")
        self.pool.free(ptr)
        blk = self.live.pop(ptr)
        self.freed.add(ptr)
        # An event recorded on a stream waits for the work launched there before it: only the
        # streams still busy keep the block pending.
        seqs = {s: self.launched[s] for s in blk.uses if self.done.get(s, 0) < self.launched.get(s, 0)}
        if seqs:
            self.pending[ptr] = (blk, set(seqs))
            self.pending_seq[ptr] = seqs
        else:
            self.cached.append((blk.ptr, blk.rounded, blk.stream))

    @rule(data=st.data())
    def free_bad_pointer(self, data):
        candidates = set(self.freed)
        for blk in self.live.values():
            candidates.add(blk.ptr + GRANULE)  # inside a block, or past its end
        candidates |= {0x1234_0000, 512, (1 << 47) - 512}
        candidates = sorted(c for c in candidates if c not in self.live and c != 0)
        ptr = data.draw(st.sampled_from(candidates), label="bad ptr")
        before = self.stats()
        info_before = self.pool.info()
        with pytest.raises(ValueError):
            self.pool.free(ptr)
        assert self.stats() == before
        assert self.pool.info() == info_before

    @precondition(lambda self: self.live)
    @rule(data=st.data(), stream=st.integers(min_value=0, max_value=5))
    def record_stream(self, data, stream):
        ptr = data.draw(st.sampled_from(sorted(self.live)), label="ptr")
        blk = self.live[ptr]
        if stream == blk.stream:
            stream = (stream + 1) % 6
        self.pool.record_stream(ptr, stream)
        self._launch(ptr, stream)  # work there uses it
        blk.uses.add(stream)

    @rule(stream=st.integers(min_value=0, max_value=5))
    def complete(self, stream):
        before = self.stats()
        self.pool.complete(stream)
        after = self.stats()
        # Completing work is the device's business: the pool notices at its next allocation.
        assert after == before
        self.done[stream] = self.launched.get(stream, 0)
        self._stream_done(stream)

    @rule()
    def complete_all(self):
        self.pool.complete_all()
        self.done = dict(self.launched)
        self._all_pending_done()

    @rule()
    def empty_cache(self):
        before = self.stats()
        self.pool.empty_cache()
        after = self.stats()
        self._all_pending_done()
        self.cached = []
        assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
        assert after["allocation.all.current"] == before["allocation.all.current"]
        # Every pending free was waited for: requested and active cover the live blocks only.
        assert after["requested_bytes.all.current"] == sum(b.size for b in self.live.values())
        assert after["active.all.current"] == len(self.live)
        # What stays reserved holds a live block in each segment.
        assert after["segment.all.current"] <= len(self.live)
        if not self.live:
            assert after["reserved_bytes.all.current"] == 0

    @rule(size=HUGE_SIZES, stream=STREAMS)
    def alloc_huge(self, size, stream):
        self._expect_oom(size, stream)

    # -- invariants ---------------------------------------------------------------------------------

    @invariant()
    def pool_is_consistent(self):
        assert self.pool.check() == 0, self.pool.check_report()

    @invariant()
    def no_device_fault(self):
        # Nothing handed to another stream, unmapped or given back under queued work.
        assert self.pool.device_faults() == []

    @invariant()
    def live_ranges_are_disjoint_and_aligned(self):
        spans = sorted((b.ptr, b.rounded) for b in self.live.values())
        for p, _ in spans:
            assert p % GRANULE == 0
        for (a, alen), (b, _) in zip(spans, spans[1:]):
            assert a + alen <= b, f"{a:#x}+{alen} overlaps {b:#x}"

    @invariant()
    def statistics_match_the_model(self):
        s = self.stats()
        small = [b for b in self.live.values() if b.small]
        large = [b for b in self.live.values() if not b.small]
        assert s["allocation.all.current"] == len(self.live)
        assert s["allocation.small_pool.current"] == len(small)
        assert s["allocation.large_pool.current"] == len(large)
        # Small blocks split whenever 512 B remain: each is exactly its rounded size.
        assert s["allocated_bytes.small_pool.current"] == sum(b.rounded for b in small)
        # A large block is split only when more than 1 MiB remains, so a reused one may be
        # up to 1 MiB larger than the rounded request (allocated_bytes counts whole blocks,
        # as the built-in allocator does).
        large_rounded = sum(b.rounded for b in large)
        large_bytes = s["allocated_bytes.large_pool.current"]
        assert large_rounded <= large_bytes <= large_rounded + len(large) * LARGE_SPLIT_SLACK
        assert s["allocated_bytes.all.current"] == s["allocated_bytes.small_pool.current"] + large_bytes
        # requested_bytes and active count live blocks plus frees still waiting for events
        # (the pool learns that events completed only when it next polls them).
        live_req = sum(b.size for b in self.live.values())
        pend_req = sum(b.size for b, _ in self.pending.values())
        req = s["requested_bytes.all.current"]
        active = s["active.all.current"]
        assert req >= live_req
        assert active >= len(self.live)
        info = self.pool.info()
        assert info["live_blocks"] == len(self.live)
        assert info["pending_blocks"] >= len(self.pending)
        if info["pending_blocks"] == len(self.pending):
            assert req == live_req + pend_req
            assert active == len(self.live) + len(self.pending)
        assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]
        assert s["reserved_bytes.all.current"] == info["reserved"]
        assert s["reserved_bytes.all.current"] <= CAPACITY

    # -- teardown ---------------------------------------------------------------------------------

    def teardown(self):
        try:
            for ptr in sorted(self.live):
                self.pool.free(ptr)
            self.live.clear()
            self.pool.complete_all()
            self.pool.empty_cache()
            s = self.stats()
            assert s["reserved_bytes.all.current"] == 0
            assert s["allocated_bytes.all.current"] == 0
            assert s["requested_bytes.all.current"] == 0
            assert s["active.all.current"] == 0
            assert self.pool.sim_reserved_bytes() == 0
            assert self.pool.check() == 0, self.pool.check_report()
        finally:
            self.pool.close()


SimPoolMachine.TestCase.settings = settings(
    max_examples=examples(60), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_sim_pool_state_machine = SimPoolMachine.TestCase

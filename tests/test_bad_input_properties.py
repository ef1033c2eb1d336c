"""Bad input, generated: Hypothesis drives the public Python entry points with wrong types,
negative, zero and huge sizes, wrong streams and devices, double and foreign frees, NaN and
out-of-range fractions and caps, bad region names, malformed configuration text and keyword
options, and trace files of any bytes. Each call either works or raises a clear error (an
exception of the kinds the entry points document, with a message); nothing else escapes, and
afterwards the pool is whole: its checker finds nothing, no simulated device fault happened,
and the allocations it counts are the blocks handed out and not freed.

docs/testing.md ("Bad input") lists the entry points and what each case must end in; the
hand-written cases of tests/test_bad_input.py keep the exact messages.
"""

import gzip
import math
import os
import pickle
import tempfile
import warnings

import cudapool
import pytest
from cudapool import _C, _config
from cudapool.lab import replay as lab_replay
from cudapool.lab import trace as lab_trace
from cudapool.lab._events import EVENT
from cudapool.sim import OutOfMemoryError, Pool
from hyp import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

MiB = 1 << 20
CAPACITY = 96 * MiB
U64 = (1 << 64) - 1

# What a bad argument may raise: the argument's type or value is wrong (TypeError, ValueError,
# OverflowError for integers past 64 bits), or there is no memory for it (OutOfMemoryError).
CLEAR = (TypeError, ValueError, OverflowError, OutOfMemoryError)
# Pausing, resuming and allocating in a region may also meet a pool in the wrong state (no
# page-mapped memory to pause, a region still paused): RuntimeError.
STATE = CLEAR + (RuntimeError,)

ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=6),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.just(object()),
)
SIZES = st.one_of(
    st.sampled_from([0, 1, -1, 512, CAPACITY, CAPACITY + 1, 1 << 40, 1 << 63, U64, U64 + 1, -(1 << 63)]),
    st.integers(min_value=-(1 << 66), max_value=1 << 66),
    ANYTHING,
)
STREAMS = st.one_of(st.integers(min_value=0, max_value=3), st.sampled_from([-1, U64, U64 + 1, 1 << 80]), ANYTHING)
FRACTIONS = st.one_of(
    st.sampled_from([0.0, 1.0, 0.5, -0.0, 1e-300, math.nan, math.inf, -math.inf, -0.25, 1.5]),
    st.floats(allow_nan=True, allow_infinity=True),
    ANYTHING,
)
TAGS = st.one_of(
    st.sampled_from(["kv_cache", "weights", "", "x" * 300, "a\nb", "\x00"]),
    st.text(max_size=40),
    st.lists(st.one_of(st.text(max_size=8), st.integers()), max_size=3),
    ANYTHING,
)


def clear_error(exc, kinds=CLEAR):
    """An error the caller can act on: of a documented kind, with a message."""
    assert isinstance(exc, kinds), f"{type(exc).__name__}: {exc}"
    assert str(exc).strip(), f"{type(exc).__name__} without a message"


def attempt(fn, *args, kinds=CLEAR, **kwargs):
    """fn's result, or None after a clear error of `kinds` (anything else fails the test)."""
    try:
        return fn(*args, **kwargs)
    except kinds as exc:
        clear_error(exc, kinds)
        return None


# The simulated device's addresses are host addresses, different in every run: a block is chosen
# by its place in the order the test's own steps made (a dict keeps the order of the handouts),
# through an index drawn from a fixed range. Hypothesis replays an example by its choices, so no
# choice's range may depend on the state (a list of freed addresses shrinks where the host hands
# an address out again).
INDEX = st.integers(min_value=0, max_value=1023)


def pick(items, index):
    return items[index % len(items)]


class BadCalls(RuleBasedStateMachine):
    """A pool under one policy, driven with good and bad calls alike; the model is the set of
    blocks handed out and not freed."""

    policy = "cudapool"

    def __init__(self):
        super().__init__()
        # A region under a policy without page-mapped memory warns (it cannot pause): expected here.
        warnings.simplefilter("ignore", RuntimeWarning)
        self.pool = Pool(CAPACITY, policy=self.policy)
        self.live = {}  # address -> requested bytes
        self.freed = []  # addresses freed and not handed out again

    def _took(self, ptr, size):
        if ptr:  # 0: a request of 0 bytes
            assert ptr not in self.live, f"{ptr:#x} handed out twice"
            self.live[ptr] = size
            if ptr in self.freed:
                self.freed.remove(ptr)

    @rule(size=st.integers(min_value=0, max_value=12 * MiB), stream=st.integers(min_value=0, max_value=3))
    def alloc(self, size, stream):
        ptr = attempt(self.pool.alloc, size, stream)
        if ptr:
            self._took(ptr, size)
            self.pool.launch(ptr, stream)  # work queued on it: a pause or empty_cache waits for it

    @rule(size=SIZES, stream=STREAMS)
    def alloc_anything(self, size, stream):
        ptr = attempt(self.pool.alloc, size, stream)
        if ptr is not None:
            self._took(ptr, size)

    @rule(index=INDEX)
    def free_live(self, index):
        if not self.live:
            return
        ptr = pick(list(self.live), index)
        self.pool.free(ptr)
        del self.live[ptr]
        self.freed.append(ptr)

    @rule(
        other=st.one_of(st.integers(min_value=1, max_value=(1 << 48)), ANYTHING),
        freed=INDEX,
        live=INDEX,
        inside=st.integers(1, 511),
        which=INDEX,
    )
    def free_anything(self, other, freed, live, inside, which):
        """A double free, an address the pool never gave, an interior address, or no address at all."""
        choices = [other, 0]
        if self.freed:
            choices.append(pick(self.freed, freed))
        if self.live:
            choices.append(pick(list(self.live), live) + inside)
        ptr = pick(choices, which)
        if (
            isinstance(ptr, int) and ptr in self.live
        ):  # an address past a live block's start may be another live block's
            return
        try:
            self.pool.free(ptr)
        except CLEAR as exc:
            clear_error(exc)
        else:
            assert isinstance(ptr, int) and ptr == 0, f"free({ptr!r}) of no live block was accepted"

    @rule(
        live=st.booleans(),
        index=INDEX,
        other=st.one_of(st.integers(min_value=-5, max_value=1 << 66), ANYTHING),
        stream=STREAMS,
    )
    def record_stream(self, live, index, other, stream):
        if live and self.live:
            ptr = pick(list(self.live), index)
        else:
            ptr = other
            if isinstance(ptr, int) and ptr in self.live:
                return
        attempt(self.pool.record_stream, ptr, stream)

    @rule(fraction=FRACTIONS)
    def memory_fraction(self, fraction):
        attempt(self.pool.set_memory_fraction, fraction)

    @rule(cap=SIZES)
    def memory_cap(self, cap):
        attempt(self.pool.set_memory_cap, cap)

    @rule()
    def lift_limits(self):
        self.pool.set_memory_cap(0)
        self.pool.set_memory_fraction(0.0)

    @rule(tag=TAGS, backup=st.one_of(st.none(), st.booleans(), ANYTHING))
    def pause_and_resume(self, tag, backup):
        """A region paused (its live blocks copied out and back) and resumed, or refused."""
        attempt(self.pool.pause, tag, backup, kinds=STATE)
        attempt(self.pool.resume, tag, kinds=STATE)
        attempt(self.pool.resume, None, kinds=STATE)  # nothing stays paused between steps

    @rule(tag=TAGS, size=st.integers(min_value=1, max_value=4 * MiB))
    def alloc_in_region(self, tag, size):
        try:
            ctx = self.pool.region(tag)
            with ctx:
                ptr = attempt(self.pool.alloc, size, 0, kinds=STATE)
        except CLEAR as exc:
            clear_error(exc)
            return
        if ptr is not None:
            self._took(ptr, size)

    @rule(stream=STREAMS)
    def complete(self, stream):
        attempt(self.pool.complete, stream)

    @rule()
    def empty_cache(self):
        self.pool.empty_cache()

    @rule(abbreviated=ANYTHING)
    def look(self, abbreviated):
        assert "memory summary" in self.pool.memory_summary(abbreviated=bool(abbreviated))
        self.pool.memory_stats()
        self.pool.snapshot()
        self.pool.info()

    @invariant()
    def whole(self):
        assert self.pool.check() == 0, self.pool.check_report()
        assert self.pool.device_faults() == []
        stats = self.pool.memory_stats()
        # As torch counts them: allocations end at the free; requested bytes stay while a freed
        # block waits for the streams it was used on (record_stream).
        assert stats["allocation.all.current"] == len(self.live)
        assert stats["requested_bytes.all.current"] >= sum(self.live.values())
        assert stats["allocated_bytes.all.current"] >= sum(self.live.values())

    def teardown(self):
        for ptr in list(self.live):
            self.pool.free(ptr)
        self.pool.complete_all()
        self.pool.empty_cache()
        assert self.pool.check() == 0, self.pool.check_report()
        assert self.pool.memory_stats()["allocated_bytes.all.current"] == 0
        self.pool.close()


SETTINGS = settings(
    max_examples=examples(150),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class BadCallsBuiltin(BadCalls):
    policy = "builtin"


class BadCallsExpandable(BadCalls):
    policy = "expandable"


TestBadCallsCudapool = BadCalls.TestCase
TestBadCallsCudapool.settings = SETTINGS
TestBadCallsBuiltin = BadCallsBuiltin.TestCase
TestBadCallsBuiltin.settings = SETTINGS
TestBadCallsExpandable = BadCallsExpandable.TestCase
TestBadCallsExpandable.settings = SETTINGS


# ---- Configuration text and keyword options ------------------------------------------------

KEYS = ["max_split_size_mb", "garbage_collection_threshold", "expandable_segments", "roundup_power2_divisions",
        "page_stitching", "memory_fraction", "memory_cap_mb", "policy", "release_before_grow", "small_size_mb",
        "large_segment_mb", "granule_bytes", "no_such_key", "", "MAX_SPLIT_SIZE_MB"]  # fmt: skip
VALUES = ["1", "0", "-1", "64", "0.8", "nan", "inf", "-inf", "1e309", "True", "False", "true", "yes", "",
          "[1:2,256:4]", "[", "]", "18446744073709551616", "0x10", "1_000", " 5 ", "\u00e9", "builtin", "cudapool"]  # fmt: skip
CONFIG_TEXT = st.one_of(
    st.lists(
        st.tuples(st.sampled_from(KEYS), st.sampled_from([":", "=", "", "::"]), st.sampled_from(VALUES)).map(
            lambda t: "".join(t)
        ),
        max_size=5,
    ).map(lambda parts: ",".join(parts)),
    st.text(alphabet=st.sampled_from(list("abcdefghijklmnopqrstuvwxyz_:,[]0123456789.-+ \t\n")), max_size=60),
    st.text(max_size=30),
)


@settings(max_examples=examples(400), deadline=None)
@given(text=CONFIG_TEXT)
def test_configuration_text_of_any_shape(text):
    """The C parser behind CUDAPOOL_CONF and enable(): a configuration, always the same one for
    its own output, or a ValueError that says what is wrong."""
    try:
        effective = _C.parse_config(text)
    except ValueError as exc:
        assert str(exc).strip()
        return
    assert _C.parse_config(effective) == effective


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.dictionaries(
        st.sampled_from(KEYS[:-3] + ["bogus"]), st.one_of(st.sampled_from(VALUES), ANYTHING), max_size=4
    ),
    env=CONFIG_TEXT,
)
def test_keyword_options_and_environment(config, env):
    """What enable() checks before it changes anything (CUDAPOOL_CONF under keyword options over
    a policy): a configuration the pool accepts, or a ValueError naming the option or the text;
    a simulated pool made from the same options agrees."""
    try:
        text = _config.resolve(config, env={_config.ENV_VAR: env}, use_policy=True)
    except ValueError as exc:
        assert "config" in str(exc) or "policy" in str(exc), str(exc)
        return
    _config.effective(text)
    options = {k: v for k, v in config.items() if k != "policy"}
    try:
        pool = Pool(CAPACITY, **options)
    except CLEAR as exc:
        clear_error(exc)
        return
    assert pool.check() == 0
    ptr = attempt(pool.alloc, 4096)  # a cap below one segment is out of memory, and says so
    if ptr:
        pool.free(ptr)
    assert pool.check() == 0
    pool.close()


@settings(max_examples=examples(100), deadline=None)
@given(bad=st.text(alphabet="abcdefghij_", min_size=1, max_size=10), value=ANYTHING)
def test_enable_refuses_bad_options_before_anything_changes(bad, value):
    """An unknown option: ValueError naming it, and cudapool is still not the allocator."""
    assert not cudapool.enabled()
    with pytest.raises(ValueError, match="zz_" + bad):
        cudapool.enable(**{"zz_" + bad: value})
    assert not cudapool.enabled()


# ---- Sizes and devices at the module's entry points ----------------------------------------


@settings(max_examples=examples(200), deadline=None)
@given(device=st.one_of(st.integers(min_value=-(1 << 40), max_value=1 << 40), ANYTHING))
def test_module_functions_with_any_device(device):
    """Before enable(): the statistics of a device, or a clear error for what is not one."""
    for fn in (cudapool.memory_stats, cudapool.memory_allocated, cudapool.memory_reserved, cudapool.memory_summary):
        try:
            fn(device)
        except (TypeError, ValueError, RuntimeError) as exc:
            assert str(exc).strip()


# ---- Trace files -----------------------------------------------------------------------------


def _event(action, device, ident, size, stream, time_ns):
    return EVENT.pack(action, device, ident, size, stream, time_ns)


EVENTS = st.lists(
    st.builds(
        _event,
        st.integers(min_value=0, max_value=255),
        st.integers(min_value=-(1 << 31), max_value=(1 << 31) - 1),
        st.integers(min_value=0, max_value=8),
        st.one_of(st.integers(min_value=0, max_value=8 * MiB), st.integers(min_value=0, max_value=U64)),
        st.integers(min_value=0, max_value=3),
        st.integers(min_value=-1, max_value=1 << 40),
    ),
    max_size=40,
).map(b"".join)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-5, max_value=50), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)


def _header(fields):
    import json

    return json.dumps(fields).encode() + b"\n"


TRACE_FILES = st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=300).map(gzip.compress),
    st.tuples(
        st.fixed_dictionaries(
            {"format": st.sampled_from(["cudapool-trace", "other", 5])},
            optional={
                "version": st.one_of(st.just(1), JSON_VALUES),
                "events": st.one_of(st.integers(min_value=-2, max_value=50), JSON_VALUES),
                "meta": JSON_VALUES,
                "builtin_reserved": JSON_VALUES,
            },
        ).map(_header),
        EVENTS,
        st.binary(max_size=41),
    ).map(lambda t: gzip.compress(t[0] + t[1] + t[2][: len(t[2]) % 3])),
    JSON_VALUES.map(lambda v: gzip.compress(_header(v))),
    st.one_of(JSON_VALUES, st.fixed_dictionaries({"segments": JSON_VALUES, "device_traces": JSON_VALUES})).map(
        lambda v: pickle.dumps(v, protocol=4)
    ),
)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=TRACE_FILES, policy=st.sampled_from(["builtin", "expandable", "cudapool"]))
def test_trace_files_of_any_bytes(content, policy):
    """cudapool replay and the lab read a trace file: a trace whose replay ends in a result
    (events it cannot replay counted as bad), or a ValueError that names the file."""
    fd, path = tempfile.mkstemp(suffix=".cptrace")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        try:
            trace = lab_trace.load(path)
        except ValueError as exc:
            assert path in str(exc) or os.path.basename(path) in str(exc), str(exc)
            return
        try:
            result = lab_replay.replay(trace, policy=policy, capacity="256MB")
        except ValueError as exc:  # e.g. a trace with events on no device
            assert str(exc).strip()
            return
        assert result["events"] == len(trace)
    finally:
        os.unlink(path)

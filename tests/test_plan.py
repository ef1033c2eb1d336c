"""The step plan (policy ``planned``, ``plan_steps:True``; Note [Learning the step] in
csrc/core/plan.h) through the replay lab, the Pool binding and ``ab``'s allocator names: a
training-like loop is learned, served by position with no device call once planned, counted in
torch's statistics as any allocation, and every figure of a loop that never repeats is the
default policy's. The C tests (tests/c/test_plan.c) cover each way off the plan."""

from __future__ import annotations

import pytest
from cudapool import _C, policies
from cudapool.ab import common
from cudapool.lab.replay import PLAN_FIELDS, replay
from cudapool.lab.trace import ALLOC, FREE, Trace

MiB = 1 << 20


def training_loop(steps: int, shapes=None):
    """Parameters, then `steps` steps: activations saved for a backward pass (freed in reverse),
    temporaries, a gradient carried into the next step. `shapes(step)` scales a step's sizes."""
    ev, ids = [], iter(range(1, 10**9))
    params = [next(ids) for _ in range(4)]
    ev += [(ALLOC, p, 8 * MiB) for p in params]
    carry = None
    for s in range(steps):
        k = shapes(s) if shapes else 1
        if carry is not None:
            ev.append((FREE, carry, 0))
        acts = []
        for i, mb in enumerate((3, 5, 2, 7, 1, 4)):
            a = next(ids)
            ev.append((ALLOC, a, mb * k * MiB + 1000 * (i + 1)))
            acts.append(a)
            t = next(ids)
            ev += [(ALLOC, t, k * MiB // 2), (FREE, t, 0)]
        carry = next(ids)
        ev.append((ALLOC, carry, 2 * k * MiB))
        ev += [(FREE, a, 0) for a in reversed(acts)]
    ev.append((FREE, carry, 0))
    ev += [(FREE, p, 0) for p in params]
    return Trace.from_events(ev)


def test_planned_is_a_policy_and_its_key_is_written_only_when_true():
    assert "plan_steps:True" in policies.config_for("planned")
    assert policies.config_for("cudapool") in policies.config_for("planned")
    assert "plan_steps" not in _C.Pool(1 << 30, policies.config_for("cudapool"), auto_complete=True).config()
    assert "plan_steps:True" in _C.Pool(1 << 30, policies.config_for("planned"), auto_complete=True).config()


def test_a_repeating_step_is_planned_and_served_without_device_calls():
    trace = training_loop(40)
    planned, default = replay(trace, policy="planned"), replay(trace, policy="cudapool")
    plan = planned["plan"]
    assert set(plan) == set(PLAN_FIELDS)
    assert plan["plans"] == 1 and plan["plan_drops"] == 0 and plan["plan_missed"] == 0
    assert plan["plan_step_allocs"] == 13 and plan["plan_planned"] == 13
    # Learned in two steps, adopted at the third's start: the rest served by position.
    assert plan["plan_served"] >= 13 * 35
    assert planned["device_calls_after_warmup_total"] == 0
    # What torch counts is the same: planned blocks are allocations like any other.
    assert planned["peak_allocated"] == default["peak_allocated"]
    assert planned["peak_requested"] == default["peak_requested"]
    assert planned["oom"] is False and planned["device_faults"] == 0
    assert default["plan"]["plan_state"] == 0 and default["plan"]["plans"] == 0


def test_a_loop_that_never_repeats_is_the_default_policy():
    trace = training_loop(12, shapes=lambda s: 1 + s)
    planned, default = replay(trace, policy="planned"), replay(trace, policy="cudapool")
    assert planned["plan"]["plans"] == 0
    for key in ("peak_allocated", "peak_reserved", "device_calls_total", "device_calls_after_warmup_total"):
        assert planned[key] == default[key], key


def test_a_changed_shape_is_learned_again():
    trace = training_loop(30, shapes=lambda s: 1 if s < 12 else 2)
    plan = replay(trace, policy="planned")["plan"]
    assert plan["plans"] == 2 and plan["plan_drops"] == 1
    assert plan["plan_state"] == 4  # serving the second shape


def test_the_plan_under_a_tight_device_never_fails_where_the_default_fits():
    from cudapool.lab.capacity import min_capacity

    trace = training_loop(30)
    planned, default = min_capacity(trace, policy="planned"), min_capacity(trace, policy="cudapool")
    assert planned["min_capacity"] <= default["min_capacity"]
    assert planned["at_min"]["plan"]["plans"] == 1  # planned there too


def test_pool_info_names_the_plan_and_its_memory():
    pool = _C.Pool(1 << 30, policies.config_for("planned"), auto_complete=True)
    live = []
    for s in range(6):
        acts = [pool.alloc(mb * MiB + 4096) for mb in (3, 5, 2)]
        tmp = pool.alloc(MiB)
        pool.free(tmp)
        for a in reversed(acts):
            pool.free(a)
        live.append(s)
    info = pool.info()
    assert info["plans"] == 1 and info["plan_state"] == 4
    assert info["plan_bytes"] >= 10 * MiB
    assert info["reserved"] >= info["plan_bytes"]
    assert info["allocated"] == 0
    assert pool.check() == 0
    pool.empty_cache()  # nothing planned in use: the plan's memory goes back
    assert pool.info()["plan_bytes"] == 0


@pytest.mark.parametrize("name", ["planned", "cudapool:policy=planned"])
def test_ab_names_the_planned_policy(name):
    (alloc,) = common.parse_allocators(name)
    assert alloc.cudapool_conf == "policy:planned"


def test_the_replay_report_says_what_the_plan_did():
    from cudapool.lab.replay_report import format_report, plan_line

    planned = replay(training_loop(20), policy="planned")
    text = format_report(planned)
    assert "step plan       serving: 1 plan(s) adopted, 0 dropped; a step of 13 allocations, 13 planned;" in text
    assert "cudapool" not in plan_line(planned["plan"])
    never = replay(training_loop(12, shapes=lambda s: 1 + s), policy="planned")
    assert plan_line(never["plan"]).startswith("learning: no plan adopted")
    assert "step plan" not in format_report(replay(training_loop(20), policy="cudapool"))

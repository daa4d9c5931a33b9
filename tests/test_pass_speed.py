"""A prediction re-priced at the speed a run's passes ran: a profile's
layers scaled (:func:`at_layer_speed`), and the ratio read off a run
(:func:`pass_time_ratio`), which leaves out warm-up, non-pass work, the
per-pass overheads a measured pass's span holds little of, and what the
prediction already charges a pass for sharing its core."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.sim.engine.core import simulate as run_engine
from pipesim.sim.engine.results import Span
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.ir.core import PASS_OPS, B, F
from pipesim.sim.strategies import ScheduleSpec, build_schedule
from pipesim.sim.workloads.profile import LayerCost, Profile, WorkloadError, at_layer_speed
from pipesim.sim.workloads.stages import split_at
from pipesim.validate.reconcile import iteration_time, pass_time_ratio

IDEAL = load_hardware("ideal")  # free links and updates: time is the passes' and the bubbles'
#: Layers of unequal passes, so stages differ and bubbles are not all alike.
PROFILE = Profile(
    "unequal",
    tuple(
        LayerCost(
            f"l{i}",
            1e-3 * (i + 1),
            2.5e-3 - 4e-4 * i,
            1 << 20,
            1 << 18,
            1 << 20,
            backward_input_s=1e-3,
            fixed_forward_s=1e-4,
            fixed_backward_s=2e-4,
            w_held_bytes=1 << 16,
        )
        for i in range(4)
    ),
)
#: (strategy, parallel pipelines): AvgPipe's two replicas run the same stages.
STRATEGIES = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("zb-h1", 1),
    ("pipedream-2bw", 1),
    ("spectrain", 1),
    ("interleaved-1f1b", 1),
    ("avgpipe", 2),
)


def run(strategy: str, profile: Profile = PROFILE, iterations: int = 3, width: int = 1):
    schedule = build_schedule(ScheduleSpec(strategy, 2, 4, iterations=iterations, width=width))
    per = profile.num_layers // schedule.num_stages
    return run_engine(schedule, split_at(profile, list(range(0, profile.num_layers, per))), IDEAL)


@settings(max_examples=25, deadline=None)
@given(ratio=st.floats(0.25, 4.0), case=st.sampled_from(STRATEGIES))
def test_a_machine_r_times_slower_takes_r_times_as_long(ratio, case):
    """With nothing but the layers costing time, every pass r times longer
    is every bubble and the iteration r times longer too; and the ratio
    read off the slower run is r."""
    strategy, width = case
    plain = run(strategy, width=width)
    slow = run(strategy, at_layer_speed(PROFILE, ratio), width=width)
    assert iteration_time(slow) == pytest.approx(ratio * iteration_time(plain), rel=1e-9)
    assert pass_time_ratio(plain, slow, PROFILE) == pytest.approx(ratio, rel=1e-9)


@given(ratio=st.floats(0.1, 10.0))
def test_only_the_layer_times_change(ratio):
    prof = replace(PROFILE, overhead_forward_s=2e-4, overhead_backward_s=5e-4)
    fast = at_layer_speed(prof, ratio)
    assert (fast.overhead_forward_s, fast.overhead_backward_s) == (2e-4, 5e-4)
    for la, fa in zip(prof.layers, fast.layers, strict=True):
        assert (fa.forward_s, fa.backward_s, fa.backward_input, fa.backward_weight) == pytest.approx(
            (ratio * la.forward_s, ratio * la.backward_s, ratio * la.backward_input, ratio * la.backward_weight)
        )
        # a kernel launch's fixed cost runs at the machine's speed too
        assert (fa.fixed_forward_s, fa.fixed_backward_s) == pytest.approx(
            (ratio * la.fixed_forward_s, ratio * la.fixed_backward_s)
        )
        assert (fa.param_bytes, fa.activation_bytes, fa.stash_bytes, fa.w_held_bytes) == (
            la.param_bytes,
            la.activation_bytes,
            la.stash_bytes,
            la.w_held_bytes,
        )


@pytest.mark.parametrize("ratio", [0.0, -1.0, float("nan"), float("inf")])
def test_a_ratio_that_is_not_positive_is_refused(ratio):
    with pytest.raises(WorkloadError, match="positive"):
        at_layer_speed(PROFILE, ratio)


def test_the_ratio_is_the_steady_state_layers_only():
    """A first iteration three times slower (warm-up), updates that take a
    millisecond where predicted free (priced from the hardware, not the
    profile), and a per-pass overhead the simulator puts inside every pass
    and the run's spans leave outside: the ratio of the layers alone is
    still read back."""
    prof = replace(PROFILE, overhead_forward_s=3e-4, overhead_backward_s=7e-4)
    res = run("1f1b", prof)
    m = res.schedule.num_microbatches
    overhead = {F: prof.overhead_forward_s, B: prof.overhead_backward_s}

    def measured(s: Span) -> float:
        a = s.action
        if a.op not in PASS_OPS:
            return s.duration + 1e-3
        return 1.5 * (s.duration - overhead[a.op]) * (3.0 if a.microbatch < m else 1.0)

    assert any(s.action.op not in PASS_OPS for s in res.by_stream()["compute"])
    # durations are all the ratio reads: starts may stay where they were
    spans = [Span(s.device, s.stream, s.action, s.start, s.start + measured(s)) for s in res.spans]
    assert pass_time_ratio(res, replace(res, spans=spans), prof) == pytest.approx(1.5)
    # one iteration has no steady state: every pass counts
    single = run("1f1b", iterations=1)
    doubled = [Span(s.device, s.stream, s.action, s.start, s.start + 2 * s.duration) for s in single.spans]
    assert pass_time_ratio(single, replace(single, spans=doubled), PROFILE) == pytest.approx(2.0)


def test_passes_the_cores_stretch_are_not_counted_slower():
    """A pass the prediction already has sharing its core (twice as long)
    and the run measures as long ran at the profile's speed: the ratio
    compares the passes as predicted, not the profile's layers alone."""
    res = run("gpipe")
    shared = {(s.device, s.action) for s in res.by_stream()["compute"] if s.device == 0 and s.action.op is F}

    def stretched(s: Span) -> Span:
        return Span(s.device, s.stream, s.action, s.start, s.start + 2 * s.duration)

    both = replace(res, spans=[stretched(s) if (s.device, s.action) in shared else s for s in res.spans])
    assert pass_time_ratio(both, both, PROFILE) == pytest.approx(1.0)
    assert pass_time_ratio(res, both, PROFILE) > 1.1  # the run's alone: slower

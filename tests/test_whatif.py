"""Costs read off a measured run, its reconciliation and its "what if"
(pipesim.sim.planning.whatif), held to runs whose costs are known."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipesim.sim.engine.core import simulate
from pipesim.sim.engine.metrics import bubble_fractions
from pipesim.sim.planning.plan import steady_throughput
from pipesim.sim.planning.whatif import (
    NOMINAL_BANDWIDTH,
    MeasuredCosts,
    WhatIfError,
    measured_costs,
    measured_hardware,
    reconcile,
    regroup,
    stage_costs,
    what_if,
)
from pipesim.sim.strategies import ScheduleSpec, build_schedule


def known_run(strategy: str, devices: int, m: int, costs: MeasuredCosts, iterations: int = 3):
    schedule = build_schedule(ScheduleSpec(strategy, devices, m, iterations=iterations))
    split = strategy == "zb-h1"
    return simulate(
        schedule, stage_costs(regroup(costs, schedule.num_stages), split_backward=split), measured_hardware(devices)
    )


def costs_of(stages: int, f: list[float], ratio: float, transfer: list[float], update: float = 0.0) -> MeasuredCosts:
    return MeasuredCosts(
        forward_s=tuple(f[:stages]),
        backward_s=tuple(ratio * x for x in f[:stages]),
        backward_input_s=tuple(ratio * x / 2 for x in f[:stages]),
        backward_weight_s=tuple(ratio * x / 2 for x in f[:stages]),
        transfer_s=tuple(transfer[: stages - 1]),
        update_s=(update,) * stages,
    )


times = st.lists(st.floats(1e-3, 1e-1), min_size=4, max_size=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    strategy=st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
    devices=st.integers(2, 4),
    m=st.integers(2, 6),
    f=times,
    transfer=st.lists(st.floats(0.0, 2e-2), min_size=3, max_size=3),
    ratio=st.floats(1.0, 3.0),
)
def test_costs_read_off_a_run_are_the_costs_it_ran_with(strategy, devices, m, f, transfer, ratio) -> None:
    """A run priced with known costs gives them back (transfers to the
    rounding of bytes at the nominal bandwidth), and its reconciliation is
    the run itself."""
    known = costs_of(devices, f, ratio, transfer)
    run = known_run(strategy, devices, m, known)
    got = measured_costs(run)
    assert got.forward_s == pytest.approx(known.forward_s, rel=1e-9)
    assert got.backward_s == pytest.approx(known.backward_s, rel=1e-9)
    assert got.transfer_s == pytest.approx(known.transfer_s, abs=2 / NOMINAL_BANDWIDTH)
    again = reconcile(run, got)
    assert again.makespan == pytest.approx(run.makespan, rel=1e-6)
    assert steady_throughput(again) == pytest.approx(steady_throughput(run), rel=1e-6)


def test_a_late_sender_is_not_transfer_time() -> None:
    """A measured receive is posted before its sender is ready (its span
    holds the wait): moving every receive's start 0.1 s earlier leaves
    the measured transfer as it was."""
    known = MeasuredCosts((0.01, 0.01), (0.02, 0.2), (None, None), (None, None), (0.005,), (0.0, 0.0))
    run = known_run("1f1b", 2, 4, known)
    run.spans = [replace(s, start=s.start - 0.1) if s.stream == "recv" else s for s in run.spans]
    assert measured_costs(run).transfer_s == pytest.approx((0.005,), abs=1e-9)


def test_regrouping_merges_and_splits_stages() -> None:
    c = costs_of(4, [1.0, 2.0, 3.0, 4.0], 2.0, [0.1, 0.2, 0.3])
    two = regroup(c, 2)
    assert two.forward_s == (3.0, 7.0) and two.backward_s == (6.0, 14.0) and two.transfer_s == (0.2,)
    eight = regroup(c, 8)
    assert eight.forward_s == (0.5, 0.5, 1.0, 1.0, 1.5, 1.5, 2.0, 2.0)
    assert eight.transfer_s == pytest.approx((0.2, 0.1, 0.2, 0.2, 0.2, 0.3, 0.2))
    assert any("split" in a for a in eight.assumptions)
    with pytest.raises(WhatIfError, match="neither merge nor split"):
        regroup(c, 3)


def test_what_if_ranks_schedules_as_their_bubbles_say() -> None:
    """Uniform stages, free links: 1F1B's and GPipe's iteration is
    (m + p - 1)(F + B); GPipe stashes all m micro-batches on stage 0,
    1F1B p; interleaving two chunks cuts the bubble."""
    p, f, b = 4, 0.01, 0.02
    c = MeasuredCosts((f,) * p, (b,) * p, (None,) * p, (None,) * p, (0.0,) * (p - 1), (0.0,) * p)
    rows = {(r.strategy, r.microbatches): r for r in what_if(c, ["gpipe", "1f1b", "interleaved-1f1b"], [8, 16], p)}
    for m in (8, 16):
        for name in ("gpipe", "1f1b"):
            assert rows[(name, m)].iteration_s == pytest.approx((m + p - 1) * (f + b), rel=1e-6)
            assert rows[(name, m)].bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-6)
        assert rows[("gpipe", m)].peak_stash == m and rows[("1f1b", m)].peak_stash == p
        assert rows[("interleaved-1f1b", m)].iteration_s < rows[("1f1b", m)].iteration_s
        assert rows[("interleaved-1f1b", m)].stages == 2 * p
    assert rows[("1f1b", 8)].peak_unit == "micro-batches"


def test_what_if_refuses_bad_requests() -> None:
    c = costs_of(2, [1.0, 1.0], 2.0, [0.1])
    with pytest.raises(WhatIfError, match="micro-batch counts"):
        what_if(c, ["1f1b"], [0], 2)
    with pytest.raises(ValueError, match="nosuch"):
        what_if(c, ["nosuch"], [4], 2)
    note = what_if(c, ["1f1b"], [4], 3)[0]  # 2 measured stages cannot make 3
    assert note.iteration_s is None and "neither merge nor split" in note.note


def test_measured_costs_round_trip_through_json() -> None:
    c = costs_of(3, [1.0, 2.0, 3.0], 2.0, [0.1, 0.2])
    assert MeasuredCosts.from_json(c.to_json()) == c
    with pytest.raises(WhatIfError, match="malformed"):
        MeasuredCosts.from_json({"forward_s": [1.0]})


def test_bubble_of_the_reconciled_run_is_the_measured_one() -> None:
    known = costs_of(3, [0.01, 0.03, 0.01], 2.0, [0.002, 0.002])
    run = known_run("1f1b", 3, 6, known)
    again = reconcile(run)
    assert bubble_fractions(again) == pytest.approx(bubble_fractions(run), rel=1e-6)

"""The simulator benchmark's ceiling: the bare SimPy model it measures must
be the same schedule as the engine's, or its rate says nothing about it."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipesim.experiments.bench.sim import bare_model_seconds, ceiling, render
from pipesim.sim.api import simulate
from pipesim.sim.ir.core import ScheduleError
from pipesim.sim.strategies import ScheduleSpec, StrategyError, build_schedule

#: The strategies whose programs are F, B and UPDATE of one replica per stage.
BARE = ("gpipe", "1f1b", "interleaved-1f1b", "pipedream", "pipedream-2bw")


@settings(max_examples=40, deadline=None)
@given(
    strategy=st.sampled_from(BARE),
    p=st.integers(1, 6),
    m=st.integers(1, 10),
    model=st.sampled_from(("uniform", "vgg16")),
)
def test_bare_model_ends_when_the_engine_does(strategy, p, m, model) -> None:
    spec = ScheduleSpec(strategy, p, m)
    try:
        schedule = build_schedule(spec)
    except StrategyError:  # a size the strategy refuses (2BW needs m >= p, interleaving whole rounds)
        assume(False)
    result = simulate(spec, model)
    assert bare_model_seconds(schedule, result.stage_costs)[1] == result.makespan


@pytest.mark.parametrize("strategy", ["spectrain", "zb-h1", "avgpipe", "data-parallel"])
def test_bare_model_refuses_what_it_does_not_model(strategy) -> None:
    spec = ScheduleSpec(strategy, 4, 8)
    result = simulate(spec)
    with pytest.raises(ScheduleError, match="bare model runs F, B and UPDATE"):
        bare_model_seconds(build_schedule(spec), result.stage_costs)


def test_ceiling_reports_both_runs_against_raw_simpy() -> None:
    out = ceiling("1f1b", 4, 8)
    for name in ("bare_model", "object_floor", "engine_run"):
        row = out[name]
        assert row["compute_actions"] == 4 * 8 * 2 + 4  # passes and one update per stage
        assert row["actions_per_s"] > 0 and row["raw_simpy_timeouts_per_s"] > 0
        expected = row["actions_per_s"] / row["raw_simpy_timeouts_per_s"]
        assert row["ratio_to_raw_simpy"] == pytest.approx(expected, rel=1e-3)
    text = render({"raw_simpy_timeouts_per_s": 1, "cases": [], "target": {}, "ceiling": out})
    assert "the bare SimPy model" in text and "the engine's SimPy run" in text and "floor of an object IR" in text
    floor = out["object_floor"]
    # its parts are what it says: every span of the engine's run, an Action per transfer end
    result = simulate(ScheduleSpec("1f1b", 4, 8))
    assert floor["spans"] == len(result.spans)
    assert floor["transfer_ends"] == sum(s.stream in ("send", "recv") for s in result.spans) == 2 * 3 * 8 * 2
    assert floor["seconds"] == pytest.approx(floor["build_s"] + floor["event_loop_s"] + floor["objects_s"], abs=3e-4)
    # the bare loop is one of its parts
    assert floor["event_loop_s"] <= floor["seconds"]

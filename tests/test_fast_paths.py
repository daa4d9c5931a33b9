"""The simulator's fast paths for plain programs (F, B, UPDATE only) agree
with the general walks they short-cut: the version plan's and the
validator's. Each fast path gives up (None / False) on anything else, so
they are held here against the general code on the schedules that take them,
and on ones that must not."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipesim.sim.checks import _ProgramWalk, split_stages
from pipesim.sim.strategies import ScheduleSpec, build_schedule, strategy_names
from pipesim.sim.strategies._common import StrategyError
from pipesim.sim.trackers import _plain_versions, _program_versions

#: Strategies whose programs read only the current version (PREDICT and a
#: split backward included; AVERAGE moves no version) and have no REDUCE_GRAD.
PLAIN = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "spectrain", "avgpipe"]


def _schedule(name, p, m, iterations=2):
    try:
        return build_schedule(ScheduleSpec(name, p, m, iterations=iterations))
    except StrategyError:  # sizes the strategy does not take
        assume(False)


def _general_versions(dev, prog):
    fwd, bwd, upd, held_max, changes = {}, {}, {}, {}, {}
    _program_versions(dev, prog, fwd, bwd, upd, held_max, changes)
    return fwd, bwd, upd, held_max, changes


@given(name=st.sampled_from(PLAIN), p=st.integers(1, 4), m=st.integers(1, 8), iterations=st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_plain_versions_equal_the_general_walk(name, p, m, iterations):
    s = _schedule(name, p, m, iterations)
    for dev, prog in enumerate(s.programs):
        plain = _plain_versions(prog)
        assert plain is not None, f"{name}: device {dev} should take the fast path"
        fwd, bwd, upd, held_max, changes = _general_versions(dev, prog)
        assert plain == (fwd, bwd, upd)
        assert not changes.get(dev) and all(v <= 1 for v in held_max.values())


@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw", "data-parallel"])
def test_programs_that_keep_versions_or_reduce_leave_the_fast_path(name):
    s = build_schedule(ScheduleSpec(name, 4, 8, iterations=2))
    assert any(_plain_versions(prog) is None for prog in s.programs)


@given(name=st.sampled_from(strategy_names()), p=st.integers(1, 4), m=st.integers(1, 8))
@settings(max_examples=40, deadline=None)
def test_plain_check_records_what_the_general_walk_records(name, p, m):
    """Whether a program takes the validator's fast path or falls back from
    it, it leaves the passes recorded as the per-action walk does."""
    s = _schedule(name, p, m)
    fast, slow = _ProgramWalk(split_stages(s), s.replicas), _ProgramWalk(split_stages(s), s.replicas)
    slow.plain = False
    for dev, prog in enumerate(s.programs):
        fast.check(dev, prog)
        slow.check(dev, prog)
    assert fast.seen == slow.seen

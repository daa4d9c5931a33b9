"""The simulator's fast paths agree with the general code they short-cut:
the version plan's and the validator's for plain programs (F, B, UPDATE
only), the one-pass lowering and compilation of compute-only schedules, and
the engine's skipping of ring steps where a ring has its links to itself.
Each fast path gives up (None / False) on anything else, so they are held
here against the general code on the schedules that take them, and on ones
that must not."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipesim.sim.engine.trackers import _plain_versions, _program_versions
from pipesim.sim.ir.checks import _ProgramWalk, split_stages
from pipesim.sim.ir.core import Schedule, parse_cell
from pipesim.sim.ir.dataflow import compile_lowered, compile_plan
from pipesim.sim.ir.lowering import lower, plan
from pipesim.sim.strategies import ScheduleSpec, build_schedule, strategy_names
from pipesim.sim.strategies._common import StrategyError

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


def _entries_both_ways(s, recv_lookahead):
    """The engine's entries of ``s`` by the one-pass compiler and by the
    lowering and compilation it replaces."""
    return compile_lowered(s, recv_lookahead), compile_plan(s, plan(s, recv_lookahead=recv_lookahead))


@given(
    name=st.sampled_from(strategy_names()),
    p=st.integers(1, 4),
    m=st.integers(1, 8),
    iterations=st.integers(1, 3),
    recv_lookahead=st.integers(0, 3),
)
@settings(max_examples=60, deadline=None)
def test_one_pass_compilation_equals_lowering_then_compiling(name, p, m, iterations, recv_lookahead):
    """Every built-in strategy (collectives and split backwards included)."""
    s = _schedule(name, p, m, iterations)
    fast, general = _entries_both_ways(s, recv_lookahead)
    assert fast is not None, f"{name}: a compute-only schedule should take the one pass"
    assert fast == general
    # equal tuples are not enough: a token's kind is its type
    assert [[type(t) for e in dev for t in e.waits] for dev in fast] == [
        [type(t) for e in dev for t in e.waits] for dev in general
    ]


@pytest.mark.parametrize("replicas,width", [((3, 1), 1), ((2, 2), 1), (None, 2)])
def test_one_pass_compilation_routes_replicas_as_the_lowering_does(replicas, width):
    s = build_schedule(ScheduleSpec("1f1b", 2 if replicas else 3, 6, replicas=replicas, width=width))
    for recv_lookahead in (0, 1, 2):
        fast, general = _entries_both_ways(s, recv_lookahead)
        assert fast == general


def test_one_pass_compilation_numbers_fsdp_actions_as_the_general_path_does():
    rows = [
        "0UNSHARD 0F0@v0 0F1@v0 0B0@v0 0B1@v0 0UPDATE@v1 0RESHARD 0UNSHARD 0F2@v1 0B2@v1 0UPDATE@v2 0RESHARD",
        "1UNSHARD 1F0@v0 1B0@v0 1F1@v0 1B1@v0 1F2@v0 1B2@v0 1UPDATE@v1 1RESHARD",
    ]
    s = Schedule("t", 2, 3, [[a for c in r.split() for a in parse_cell(c)] for r in rows])
    fast, general = _entries_both_ways(s, 1)
    assert fast == general


def test_schedules_with_communication_or_overlapped_pairs_leave_the_one_pass():
    s = build_schedule(ScheduleSpec("1f1b", 2, 4))
    assert compile_lowered(lower(s)) is None
    pair = Schedule(
        "t", 1, 2, [[a for c in "0F0@v0 (0F1@v0;0B0@v0)OVERLAP_F_B 0B1@v0 0UPDATE@v1".split() for a in parse_cell(c)]]
    )
    assert compile_lowered(pair) is None


@pytest.mark.parametrize(
    "strategy,p,m,model,hardware,kw",
    [
        ("1f1b", 4, 8, "bert-large", "pcie-4gpu", {}),  # links shared in the host bridge: transfers queue
        ("gpipe", 2, 8, "bert-large", "pcie-4gpu", {"width": 2}),  # events with several callbacks
        ("data-parallel", 4, 8, "vgg16", "pcie-4gpu", {}),  # gradient all-reduces over rings
        ("pipedream-2bw", 4, 8, "gpt-1.3b", "dgx1-v100", {}),
        ("avgpipe", 4, 8, "vgg16", "dgx1-v100", {}),  # elastic averaging
        ("interleaved-1f1b", 4, 8, "uniform", "ideal", {}),
    ],
)
def test_inlined_event_loop_runs_as_simpy_does(monkeypatch, strategy, p, m, model, hardware, kw):
    """The engine's event loop against ``env.run()``: the same spans and summary."""
    from pipesim.sim.api import simulate
    from pipesim.sim.engine import core as engine
    from pipesim.sim.engine.metrics import summarize

    spec = ScheduleSpec(strategy, p, m, iterations=2, **kw)
    fast = simulate(spec, model, hardware)
    monkeypatch.setattr(engine, "_run_events", lambda env: env.run())
    general = simulate(spec, model, hardware)
    assert fast.spans == general.spans and summarize(fast) == summarize(general)


def test_inlined_event_loop_crashes_on_a_failed_process_as_simpy_does(monkeypatch):
    """A transfer process that raises crashes the run with a copy of its
    error, caused by it, through either loop."""
    from pipesim.sim.api import simulate
    from pipesim.sim.engine import core as engine

    def broken_move(self, *args):
        yield self.env.timeout(0)
        raise KeyError("lost")

    monkeypatch.setattr(engine._Run, "move", broken_move)
    errors = []
    for loop in (engine._run_events, lambda env: env.run()):
        monkeypatch.setattr(engine, "_run_events", loop)
        with pytest.raises(KeyError, match="lost") as caught:
            simulate(ScheduleSpec("1f1b", 2, 2), "bert-large", "pcie-4gpu")
        errors.append((type(caught.value), caught.value.args, type(caught.value.__cause__)))
    assert errors[0] == errors[1]


# -- a ring that has its links to itself skips its steps ---------------------


def _spans_and_memory(result):
    return (
        [(s.device, s.stream, tuple(s.action), s.start, s.end, s.peer, s.flow, s.nbytes) for s in result.spans],
        [(m.device, list(m.times), list(m.totals)) for m in result.memory],
    )


def _step_by_step(monkeypatch):
    """Every ring simulated step by step, as before the skip existed."""
    from pipesim.sim.engine import core as engine

    monkeypatch.setattr(engine._Run, "ring_alone", lambda self, stage, devices, edges, shared_ok=False: False)


def _links_only(name: str):
    """Preset ``name`` with its collectives priced as rings over its links
    (no NCCL model): the ring whose steps queue on shared links."""
    import dataclasses

    from pipesim.sim.hardware import load_hardware

    return dataclasses.replace(load_hardware(name), collectives=None)


def _counting_rings(monkeypatch) -> list:
    from pipesim.sim.engine import core as engine

    seen, real = [], engine._Run.ring_alone
    monkeypatch.setattr(
        engine._Run, "ring_alone", lambda self, *args, **kw: seen.append(real(self, *args, **kw)) or seen[-1]
    )
    return seen


@given(
    hardware=st.sampled_from(["dgx-h100-x2", "dgx1-v100-x4", "p3.16xlarge-x8", "pipedream-cluster-b-x2"]),
    devices=st.integers(2, 16),
    m_per=st.integers(1, 2),
    iterations=st.integers(1, 2),
    model=st.sampled_from(["uniform", "vgg16", "gpt-1.3b"]),
    nccl=st.booleans(),
)
@settings(max_examples=25, deadline=None)
def test_data_parallel_rings_skip_their_steps_to_the_same_result(hardware, devices, m_per, iterations, model, nccl):
    """Data parallelism has no other traffic: its gradient ring skips all
    but its last step, and every span and memory change is where the
    step-by-step ring puts it, to the last bit; with NCCL's model (and its
    DDP buckets) or rings over the links alone."""
    from pipesim.sim.api import simulate
    from pipesim.sim.hardware import load_hardware

    hardware = load_hardware(hardware) if nccl else _links_only(hardware)

    spec = ScheduleSpec("data-parallel", devices, devices * m_per, iterations=iterations)
    with pytest.MonkeyPatch.context() as mp:
        seen = _counting_rings(mp)
        fast = simulate(spec, model, hardware)
    assert seen and all(seen)  # the skip was taken, by every ring
    with pytest.MonkeyPatch.context() as mp:
        _step_by_step(mp)
        slow = simulate(spec, model, hardware)
    assert _spans_and_memory(fast) == _spans_and_memory(slow)
    assert fast.link_bytes == slow.link_bytes


@pytest.mark.parametrize(
    ("spec", "hardware"),
    [
        (ScheduleSpec("1f1b", 2, 4, width=2, iterations=2), "dgx1-v100-x4"),
        (ScheduleSpec("pipedream", 2, 8, replicas=(4, 1), iterations=2), "dgx1-v100-x4"),
        (ScheduleSpec("pipedream", 2, 8, replicas=(2, 2), iterations=2), "p3.16xlarge-x8"),
        (ScheduleSpec("gpipe", 4, 8, width=2, iterations=2), "pipedream-cluster-b-x2"),
        (ScheduleSpec("pipedream-2bw", 4, 8, width=2, iterations=2), "dgx1-v100"),
    ],
)
def test_pipelines_rings_beside_their_transfers_skip_to_the_same_result(spec, hardware):
    """On an NVLink mesh a replicated stage's ring runs over links no
    transfer of the pipelines uses, so its steps are skipped while the
    pipelines' transfers go on beside it: every span, memory change and
    link byte is still the step-by-step ring's."""
    from pipesim.sim.api import simulate

    for machine in (hardware, _links_only(hardware)):
        with pytest.MonkeyPatch.context() as mp:
            seen = _counting_rings(mp)
            fast = simulate(spec, "vgg16", machine)
        assert seen and all(seen)
        with pytest.MonkeyPatch.context() as mp:
            _step_by_step(mp)
            slow = simulate(spec, "vgg16", machine)
        assert _spans_and_memory(fast) == _spans_and_memory(slow)
        assert fast.link_bytes == slow.link_bytes


@pytest.mark.parametrize(
    ("spec", "hardware", "why"),
    [
        (ScheduleSpec("1f1b", 2, 4, width=4), "dgx-h100-x2", "its transfers use the rings' ports"),
        (ScheduleSpec("data-parallel", 4, 8), "pcie-4gpu", "every edge of the ring crosses the one bus"),
    ],
)
def test_a_ring_that_shares_its_links_is_simulated_step_by_step(spec, hardware, why, monkeypatch):
    from pipesim.sim.api import simulate

    seen = _counting_rings(monkeypatch)
    simulate(spec, "vgg16", _links_only(hardware))
    assert seen and not any(seen), why


def test_skipping_a_ring_that_shares_its_links_would_be_wrong(monkeypatch):
    """The conditions matter: on a bus, where a ring's edges queue for the
    bus within each step, skipping steps as if they did not gives another
    (shorter) run."""
    from pipesim.sim.api import simulate
    from pipesim.sim.engine import core as engine

    spec = ScheduleSpec("data-parallel", 4, 8)
    bus = _links_only("pcie-4gpu")
    right = simulate(spec, "vgg16", bus).makespan
    monkeypatch.setattr(engine._Run, "ring_alone", lambda self, stage, devices, edges, shared_ok=False: True)
    assert simulate(spec, "vgg16", bus).makespan < right


def test_collectives_posted_before_the_last_was_awaited_are_not_serial():
    from pipesim.sim.api import simulate
    from pipesim.sim.engine.core import prepared_run
    from pipesim.sim.hardware.machines import load_hardware
    from pipesim.sim.ir.core import UPDATE

    result = simulate(ScheduleSpec("data-parallel", 4, 8, iterations=2), "vgg16", "dgx-h100")
    run = prepared_run(result.schedule, result.stage_costs, load_hardware("dgx-h100"))
    assert all(run.collectives_serial(0, dev) for dev in range(4))
    # the same programs with each device's UPDATE no longer waiting for its all-reduce
    run.programs = [
        [
            entry._replace(waits=()) if entry.action is not None and entry.action.op is UPDATE else entry
            for entry in program
        ]
        for program in run.programs
    ]
    assert not any(run.collectives_serial(0, dev) for dev in range(4))

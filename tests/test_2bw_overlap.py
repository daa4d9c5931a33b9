"""PipeDream-2BW hides a replicated stage's gradient all-reduce behind the
next window: the REDUCE_GRAD right after the window's last backward closes
its gradient, and the UPDATE that waits for it comes just before the first
forward reading the version it makes. Versions, staleness and memory stay
what they were; only the stall goes (analytic cases on uniform stages)."""

from __future__ import annotations

import dataclasses

import pytest

from pipesim.sim.api import simulate_schedule
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.ir.checks import validate
from pipesim.sim.ir.core import REDUCE_GRAD, UPDATE, Action, B, F, Schedule, ScheduleError
from pipesim.sim.planning.grid import GridRequest, Shape, _Grid
from pipesim.sim.planning.plan import steady_throughput
from pipesim.sim.strategies import ScheduleSpec, build_schedule
from pipesim.sim.strategies._common import warmup
from pipesim.sim.workloads.profile import LayerCost, Profile

MIB = 1 << 20
F_S, B_S = 1e-3, 2e-3
P, M = 4, 8
# stage k's ring of width 2 joins devices k and k + 4 over NVLink; the
# hiding is held on it with NCCL's kernels taking nothing from the passes
# they overlap, and the slowdown they do cost in a test of its own
SLOWED = load_hardware("dgx1-v100")
DGX = dataclasses.replace(
    SLOWED, collectives=dataclasses.replace(SLOWED.collectives, processor_usage=(("nvlink", 0.0),))
)


def uniform(weights: int) -> Profile:
    """One layer per stage; nothing sent between stages, so only the all-reduce communicates."""
    return Profile("u", tuple(LayerCost(f"l{i}", F_S, B_S, weights, 0, MIB) for i in range(P)))


def run(width: int, weights: int, iterations: int = 6, hardware=DGX):
    s = build_schedule(ScheduleSpec("pipedream-2bw", P, M, iterations=iterations, width=width))
    return simulate_schedule(s, uniform(weights), hardware, starts=range(P))


def test_an_allreduce_shorter_than_the_window_costs_nothing():
    """Stage k's all-reduce has (m - warm-up(k)) passes of the next window
    to hide behind (the first forward of the window after next comes
    warm-up(k) passes before the next window ends): 15 ms on stage 0 here.
    A 64 MiB ring takes about 2.8 ms, so 2 pipelines run exactly as fast
    each as one does without any all-reduce; the update right after the
    REDUCE_GRAD (what the engine ran before) would stall every window by it."""
    one, two = run(1, 64 * MIB), run(2, 64 * MIB)
    reduce_s = [sp.end - sp.start for sp in two.by_stream()["collective"]]
    assert reduce_s and 1e-3 < min(reduce_s) and max(reduce_s) < (M - warmup((2,) * P, 0)) * (F_S + B_S)
    assert steady_throughput(two) == pytest.approx(2 * steady_throughput(one), rel=1e-9)


def test_a_hidden_allreduce_still_slows_the_passes_it_overlaps():
    """NCCL's kernels take SMs: the passes under a hidden all-reduce run
    1 / (1 - 0.15) times as long on NVLink, so two pipelines lose a little
    against twice one, and at most the slowdown of every stage's all-reduce
    span (a stage's late pass delays the stages after it)."""
    one, two = run(1, 64 * MIB), run(2, 64 * MIB, hardware=SLOWED)
    reduce_s = max(sp.end - sp.start for sp in two.by_stream()["collective"])
    per_window_one = M / steady_throughput(one)
    per_window_two = 2 * M / steady_throughput(two)
    assert per_window_one < per_window_two <= per_window_one + P * SLOWED.collectives.slowdown("nvlink") * reduce_s


def test_a_longer_allreduce_shows():
    """Past the hiding window the all-reduce stalls the update: slower than
    one pipeline, but by less than blocking on it every window would cost."""
    one, two = run(1, 1024 * MIB), run(2, 1024 * MIB)
    reduce_s = max(sp.end - sp.start for sp in two.by_stream()["collective"])
    hidden = (M - warmup((2,) * P, 0)) * (F_S + B_S)
    assert reduce_s > hidden
    per_window_one = M / steady_throughput(one)  # one sample per micro-batch
    per_window_two = 2 * M / steady_throughput(two)
    assert per_window_one < per_window_two <= per_window_one + reduce_s + 1e-9


def test_updates_come_just_before_the_first_forward_of_their_version():
    s = build_schedule(ScheduleSpec("pipedream-2bw", P, M, iterations=5, width=2))
    validate(s)
    for prog in s.programs:
        for pos, a in enumerate(prog):
            if a.op is UPDATE and a.version < 4:  # the last two windows' updates go to the end
                nxt = next(x for x in prog[pos + 1 :] if x.op is not REDUCE_GRAD)
                assert nxt.op is F and nxt.version == a.version
                assert all(x.version < a.version for x in prog[:pos] if x.op in (F, B))
    one = build_schedule(ScheduleSpec("pipedream-2bw", P, M, iterations=5))
    assert all(prog[pos - 1].op is B for prog in one.programs for pos, a in enumerate(prog) if a.op is UPDATE)


def test_memory_is_unchanged():
    """While an update waits, the stage holds the closed gradient instead of
    a second weight version: every device peaks at what one pipeline holds
    (2 versions + gradients + Adam-free SGD state + stash), and the last
    stage, whose deferred update comes after its old version's last read,
    holds it as gradients. The closed form agrees."""
    w = 64 * MIB
    one, two = run(1, w), run(2, w)
    for k in range(P):
        assert two.memory[k].peak_bytes == two.memory[k + P].peak_bytes == one.memory[k].peak_bytes
        bd = two.memory[k].peak_breakdown
        assert bd["weights"] + bd["gradients"] == 3 * w
    last = two.memory[P - 1].peak_breakdown
    assert (last["weights"], last["gradients"]) == (w, 2 * w)
    assert two.max_versions_held[(0, P - 1)] == 1 and two.max_versions_held[(0, 0)] == 2
    req = GridRequest(
        "pipedream-2bw", lambda b: uniform(w), DGX, 2 * P, 2 * M, microbatch_sizes=(1,), recompute=(False,), confirm=0
    )
    cand = _Grid(req, float("inf")).candidate(Shape(2, P, 1, M, False))
    assert cand.peak_memory_bytes == max(t.peak_bytes for t in two.memory)


def test_staleness_is_still_one():
    s = run(2, MIB, iterations=4)
    for v in s.versions:
        assert v.forward_version == v.backward_version == max(v.microbatch // (2 * M) - 1, 0)
        assert v.update_version - v.forward_version == (0 if v.microbatch < 2 * M else 1)


def test_a_second_reduce_before_the_update_is_refused():
    prog = (
        Action(F, 0, 0, version=0),
        Action(B, 0, 0, version=0),
        Action(REDUCE_GRAD, 0),
        Action(F, 0, 1, version=0),
        Action(B, 0, 1, version=0),
        Action(REDUCE_GRAD, 0),
        Action(UPDATE, 0, version=1),
        Action(UPDATE, 0, version=2),
    )
    s = Schedule(strategy="custom", num_stages=1, num_microbatches=1, programs=(prog,), num_iterations=2)
    with pytest.raises(ScheduleError, match="previous REDUCE_GRAD"):
        validate(s)

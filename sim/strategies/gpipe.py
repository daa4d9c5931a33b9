"""GPipe (Huang et al. 2019): all forwards, then all backwards, flush, update.

Stage ``k`` runs ``F0 .. F(m-1)`` and then ``B0 .. B(m-1)``; it stashes all m
micro-batches' activations. The backwards run in *forward* order because that
is what torch 2.13's ``ScheduleGPipe`` does (the per-rank compute order must
equal torch's); with uniform stages the bubble is (p-1)/(m+p-1) either way.
Flush semantics (versions, UPDATE after the last backward, REDUCE_GRAD for
width > 1) come from :func:`~pipesim.sim.strategies._common.flush_schedule`.
"""

from __future__ import annotations

from pipesim.sim.ir import Action, B, F, Schedule
from pipesim.sim.strategies._common import ScheduleSpec, check_spec, flush_schedule

NAME = "gpipe"
#: Spec options this strategy reads besides stages, microbatches, iterations, optimizer.
OPTIONS: tuple[str, ...] = ("width",)


def stage_order(stage: int, m: int) -> list[Action]:
    """One iteration of one stage (local micro-batch ids)."""
    return [Action(F, stage, i) for i in range(m)] + [Action(B, stage, i) for i in range(m)]


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=OPTIONS)
    p, m = spec.stages, spec.microbatches
    return flush_schedule(spec, p, [stage_order(k, m) for k in range(p)])

"""GPipe (Huang et al. 2019): all forwards, then all backwards, flush, update.

Stage ``k`` runs ``F0 .. F(m-1)`` and then ``B0 .. B(m-1)``; it stashes all m
micro-batches' activations. The backwards run in *forward* order because that
is what torch 2.13's ``ScheduleGPipe`` does (the per-rank compute order must
equal torch's); with uniform stages the bubble is (p-1)/(m+p-1) either way.
Flush semantics (versions, UPDATE after the last backward, REDUCE_GRAD for
width > 1) come from :func:`~pipesim.sim.strategies._common.flush_schedule`.
"""

from __future__ import annotations

from pipesim.sim.ir.core import B, F, Schedule
from pipesim.sim.strategies._common import (
    ScheduleSpec,
    Strategy,
    check_spec,
    flushed,
    replicated_schedule,
    stage_replicas,
)

NAME = "gpipe"


def stage_order(stage: int, n: int, warm: int) -> list[tuple]:
    """One iteration of one stage replica over its n micro-batches (indexes):
    every forward, then every backward, whatever the warm-up."""
    return [(F, i) for i in range(n)] + [(B, i) for i in range(n)]


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    return replicated_schedule(spec, flushed(stage_order, stage_replicas(spec)))


STRATEGY = Strategy(
    name=NAME,
    build=build,
    options=("width", "replicas"),
    torch_equivalent="ScheduleGPipe",
    summary="all forwards, then all backwards (torch's order), flush, one update",
    planners=("replicas", "width-depth"),
)

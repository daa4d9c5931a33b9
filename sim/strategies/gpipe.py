"""GPipe (Huang et al. 2019): all forwards, then all backwards, flush, update.

Stage ``k`` runs ``F0 .. F(m-1)`` and then ``B0 .. B(m-1)``; it stashes all m
micro-batches' activations. The backwards run in *forward* order because that
is what torch 2.13's ``ScheduleGPipe`` does (the per-rank compute order must
equal torch's); with uniform stages the bubble is (p-1)/(m+p-1) either way.
Flush semantics (versions, UPDATE after the last backward, REDUCE_GRAD for
width > 1) come from :func:`~pipesim.sim.strategies._common.flush_schedule`.

``flushes`` > 1 splits an iteration into that many flushes of consecutive
micro-batches, each all forwards then all backwards, their gradients
accumulated into the iteration's one update: gradient accumulation over
GPipe steps, what a batch whose stash does not fit in one flush needs (a
stage then holds m / flushes micro-batches, and each flush pays its own fill
and drain). The update's semantics are those of one flush of all m.
"""

from __future__ import annotations

from functools import partial

from pipesim.sim.ir.core import B, F, Schedule
from pipesim.sim.strategies._common import (
    ScheduleSpec,
    Strategy,
    StrategyError,
    check_spec,
    flushed,
    replicated_schedule,
    stage_replicas,
)

NAME = "gpipe"


def stage_order(stage: int, n: int, warm: int, flushes: int = 1) -> list[tuple]:
    """One iteration of one stage replica over its n micro-batches (indexes):
    in each of ``flushes`` runs of consecutive micro-batches (sizes differing
    by at most one, the first ones larger), every forward, then every
    backward, whatever the warm-up."""
    order: list[tuple] = []
    first = 0
    for f in range(min(flushes, n)):
        size = n // flushes + (f < n % flushes)
        run = range(first, first + size)
        order += [(F, i) for i in run] + [(B, i) for i in run]
        first += size
    return order


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    if spec.flushes > spec.microbatches:
        raise StrategyError(
            f"flushes={spec.flushes} is more than the {spec.microbatches} micro-batches of an iteration"
        )
    order = partial(stage_order, flushes=spec.flushes)
    recorded = {"flushes": spec.flushes} if spec.flushes > 1 else {}
    return replicated_schedule(spec, flushed(order, stage_replicas(spec)), options=recorded)


STRATEGY = Strategy(
    name=NAME,
    build=build,
    options=("width", "replicas", "flushes"),
    torch_equivalent="ScheduleGPipe",
    summary="all forwards, then all backwards (torch's order), flush, one update",
    planners=("replicas", "width-depth"),
)

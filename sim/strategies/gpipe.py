"""GPipe (Huang et al. 2019): all forwards, then all backwards, flush, update.

Stage ``k`` runs ``F0 .. F(m-1)`` and then ``B0 .. B(m-1)``; it stashes all m
micro-batches' activations. The backwards run in *forward* order because that
is what torch 2.13's ``ScheduleGPipe`` does (the per-rank compute order must
equal torch's); with uniform stages the bubble is (p-1)/(m+p-1) either way.
Flush semantics (versions, UPDATE after the last backward, REDUCE_GRAD for
width > 1) come from :func:`~pipesim.sim.strategies._common.flush_schedule`.

``flushes`` > 1 splits an iteration into that many flushes of consecutive
micro-batches (sizes differing by at most one, the first ones larger), each
all forwards then all backwards, their gradients accumulated into the
iteration's one update: gradient accumulation over GPipe steps, what a batch
whose stash does not fit in one flush needs (a stage then holds m / flushes
micro-batches, and each flush pays its own fill and drain). A flush is a
range of the iteration's micro-batch ids, the same on every stage, so a
stage replica runs, in each flush, those of its micro-batches that fall in
it, whatever its stage's replica count. The update's semantics are those of
one flush of all m.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import partial
from itertools import accumulate

from pipesim.sim.ir.core import B, F, Schedule
from pipesim.sim.strategies._common import (
    ScheduleSpec,
    Strategy,
    StrategyError,
    check_spec,
    flush_options,
    flush_sizes,
    flushed,
    iteration_microbatches,
    replicated_schedule,
    stage_replicas,
)

NAME = "gpipe"


def flush_starts(per_iteration: int, flushes: int) -> list[int]:
    """Where each flush of an iteration's ``per_iteration`` micro-batch ids
    starts (its sizes differ by at most one, the first ones larger)."""
    return list(accumulate(flush_sizes(per_iteration, flushes)[:-1], initial=0))


def stage_order(stage: int, batch: range, warm: int, *, flushes: int, per_iteration: int) -> list[tuple]:
    """One iteration of one stage replica over its micro-batch ids ``batch``
    (indexes into it): in each flush (:func:`flush_starts` of the
    iteration's ``per_iteration`` ids), every forward of the replica's ids
    in it, then every backward, whatever the warm-up."""
    starts = flush_starts(per_iteration, flushes)
    runs: dict[int, list[int]] = {}
    for index, mb in enumerate(batch):
        runs.setdefault(bisect_right(starts, mb % per_iteration) - 1, []).append(index)
    order: list[tuple] = []
    for run in (runs[f] for f in sorted(runs)):
        order += [(F, i) for i in run] + [(B, i) for i in run]
    return order


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    if spec.flushes > spec.microbatches:
        raise StrategyError(
            f"flushes={spec.flushes} is more than the {spec.microbatches} micro-batches of an iteration"
        )
    order = partial(stage_order, flushes=spec.flushes, per_iteration=iteration_microbatches(spec))
    return replicated_schedule(spec, flushed(order, stage_replicas(spec)), options=flush_options(spec.flushes))


STRATEGY = Strategy(
    name=NAME,
    build=build,
    options=("width", "replicas", "flushes"),
    torch_equivalent="ScheduleGPipe",
    summary="all forwards, then all backwards (torch's order), flush, one update",
    planners=("replicas", "width-depth"),
)

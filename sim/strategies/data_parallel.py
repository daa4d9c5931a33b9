"""Data parallelism: every device holds the whole model as one stage.

``stages * width`` devices (the CLI's ``--stages P`` means P devices, so P
replicas); each is replica r of the single stage 0. The m micro-batches of an
iteration are split evenly (m must be a multiple of the device count): each
replica runs ``F0 B0 F1 B1 ...`` over its m/n local micro-batches (gradient
accumulation, one micro-batch of activations at a time), then REDUCE_GRAD
(ring all-reduce across the replicas, omitted for one device) and
``UPDATE@v(t+1)``. The Schedule's ``num_microbatches`` is the per-replica
count m/n, since micro-batch ids are per replica.
"""

from __future__ import annotations

from pipesim.sim.ir.core import Action, B, F, Schedule
from pipesim.sim.strategies._common import ScheduleSpec, Strategy, StrategyError, check_spec, flush_schedule, ring_steps

NAME = "data-parallel"


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    n = spec.stages * spec.width
    m = spec.microbatches
    if m % n:
        raise StrategyError(
            f"data-parallel splits the {m} micro-batches over {n} devices: microbatches must be a multiple of {n}"
        )
    local = m // n
    order = [Action(op, 0, i) for i in range(local) for op in (F, B)]
    return flush_schedule(
        spec,
        1,
        [order],
        num_microbatches=local,
        width=n,
        options={"devices": n, "global_microbatches": m, "width": n, "depth": 1},
    )


def stage_passes(spec: ScheduleSpec) -> int:
    """Whole-model passes, one per micro-batch, split over the devices."""
    return spec.microbatches * spec.iterations


def ring_transfers(spec: ScheduleSpec) -> int:
    """One all-reduce over every device per iteration."""
    return spec.iterations * ring_steps(spec.stages * spec.width)


STRATEGY = Strategy(
    name=NAME,
    build=build,
    options=("width",),
    stage_passes=stage_passes,
    ring_transfers=ring_transfers,
    summary="whole model per device, stages x width devices, all-reduce, update",
)

"""PipeDream, asynchronous (Narayanan et al. SOSP'19): 1F1B with no flush.

All K*m micro-batches run as one 1F1B stream (stage ``k``: ``p-k-1`` warm-up
forwards, then one forward / one backward), and every backward is followed at
once by an UPDATE of that stage: the mini-batch is one micro-batch.

Versions. Stage ``k`` has done ``j`` updates before the forward of the
``j``-th steady-state step, so forward ``i`` reads ``max(i - (p-k-1), 0)``;
between F(i) and B(i) the stage applies ``p-k-1`` updates (staleness
``p-k-1`` once the pipeline is full) and must keep ``p-k`` versions:

* ``stashing=True`` (weight stashing): B(i) reads the version F(i) read, so
  forward and backward are consistent;
* ``stashing=False`` ("vanilla" asynchronous pipelining): B(i) reads the
  current version, so forward and backward of a micro-batch see different
  weights on every stage but the last.

The UPDATE after B(i) produces version ``i+1``.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipesim.sim.ir.core import REDUCE_GRAD, UPDATE, Action, B, F, Schedule
from pipesim.sim.strategies._common import (
    ScheduleSpec,
    Strategy,
    StrategyError,
    asynchronous_schedule,
    check_spec,
    one_f_one_b,
    ring_steps,
    stage_replicas,
    warmup,
)

NAME = "pipedream"


def stage_program(
    stage: int, replica: int, ids: list[int], warm: int, stashing: bool, replicated: bool
) -> list[Action]:
    """One stage replica over its micro-batches ``ids``: 1F1B after ``warm``
    forwards, an update after every backward. A replicated stage reduces
    each step's gradients over its replicas first (PipeDream: every replica
    updates after the all-reduce of its own step), so the replicas stay in
    step: version v is the same weights on every replica of the stage."""
    out: list[Action] = []
    current = 0
    read: dict[int, int] = {}
    for op, i in one_f_one_b(len(ids), warm):
        mb = ids[i]
        if op is F:
            read[mb] = current
            out.append(Action(F, stage, mb, version=current, replica=replica))
        else:
            out.append(Action(B, stage, mb, version=read.pop(mb) if stashing else current, replica=replica))
            current += 1
            if replicated:
                out.append(Action(REDUCE_GRAD, stage, replica=replica))
            out.append(Action(UPDATE, stage, version=current, replica=replica))
    return out


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    reps = stage_replicas(spec)
    total = spec.microbatches * spec.iterations
    uneven = [r for r in reps if total % r]
    if uneven:  # every step's all-reduce needs one gradient from every replica
        raise StrategyError(
            f"pipedream with replicas {list(reps)} needs microbatches x iterations ({total}) to be a "
            f"multiple of every stage's replicas (not of {uneven[0]})"
        )
    return asynchronous_schedule(
        spec,
        lambda k, r, ids, warm: stage_program(k, r, ids, warm, spec.stashing, reps[k] > 1),
        {"stashing": spec.stashing},
    )


def weight_versions(options: Mapping[str, object], stage: int, stages: int) -> int:
    """Stashing keeps the versions read between a forward and its backward:
    p - k, or a replica's share of the micro-batches in flight at its stage
    when stages are replicated (its warm-up plus one); vanilla updates in place.
    A stashed version is the passes' copy of the weights (16-bit in mixed
    precision: ``StageCost.weight_bytes``), since only a backward reads it;
    the master weights and optimizer state are updated in place, one copy."""
    if not options.get("stashing", True):
        return 1
    reps = options.get("replicas") or [1] * stages
    return warmup(reps, stage) + 1


def ring_transfers(spec: ScheduleSpec) -> int:
    """A replicated stage all-reduces after every step of its replicas."""
    if spec.replicas is None:  # one replica per stage, nothing to all-reduce (not listed: a size check runs this)
        return 0
    total = spec.microbatches * spec.iterations
    return sum(-(-total // r) * ring_steps(r) for r in spec.replicas)


STRATEGY = Strategy(
    name=NAME,
    build=build,
    options=("stashing", "replicas"),
    asynchronous=True,
    weight_versions=weight_versions,
    ring_transfers=ring_transfers,
    summary="asynchronous 1F1B, an update after every backward; weight stashing, or vanilla without",
    planners=("replicas",),
)

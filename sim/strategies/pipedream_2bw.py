"""PipeDream-2BW (Narayanan et al. ICML'21): double-buffered weights, no flush.

All K*m micro-batches run as one 1F1B stream per stage (``p-k-1`` warm-up
forwards), never flushed. The gradients of each window of m micro-batches are
coalesced into one UPDATE, placed right after the window's last backward on
that stage. Micro-batch ``i`` (0-based) reads version ``max(i//m - 1, 0)``
in both passes, i.e. a window computes on the weights from two updates ago
except the first two windows, which read version 0:
``W(t+1) = W(t) - lr * grad f(W(t-1))``.

Consequences (checked statically in the tests): staleness is 0 in the first
window and exactly 1 afterwards, and a stage never holds more than 2 versions.
The version a forward reads exists only if the update that produced it ran
before that forward, which in 1F1B order needs ``m >= p - k - 1`` on stage k;
the paper requires m >= p and so does pipesim.

Width w (w pipelines, devices ``r*p .. r*p+p-1``) or per-stage
``replicas``: a window's m micro-batches are the iteration's, over every
replica (``m*w`` of them with width), shared round robin by each stage's
replicas; each replica's UPDATE waits for a REDUCE_GRAD (all-reduce of the
stage's coalesced gradient across its replicas). A replica's share of a
window must cover its warm-up, the replicated form of m >= p.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..ir import REDUCE_GRAD, UPDATE, Action, B, Schedule
from ._common import (
    ScheduleSpec,
    Strategy,
    StrategyError,
    check_spec,
    iteration_microbatches,
    one_f_one_b,
    replicated_schedule,
    stage_replicas,
    warmup,
)

NAME = "pipedream-2bw"


def read_version(i: int, m: int) -> int:
    """Version micro-batch ``i`` (0-based) reads in both passes."""
    return max(i // m - 1, 0)


def stage_program(stage: int, replica: int, ids: list[range], warm: int, reduce: bool, m: int) -> list[Action]:
    """One stage replica over its micro-batches, ``ids[t]`` those of window
    (iteration) t of ``m``: 1F1B after ``warm`` forwards across the windows,
    the window's update right after its last backward on this replica (after
    the replicas' REDUCE_GRAD when the stage has several)."""
    closes = {batch[-1] for batch in ids if len(batch)}  # each window's last micro-batch here
    stream = [i for batch in ids for i in batch]
    out: list[Action] = []
    for op, j in one_f_one_b(len(stream), warm):
        mb = stream[j]
        out.append(Action(op, stage, mb, version=read_version(mb, m), replica=replica))
        if op is B and mb in closes:
            if reduce:
                out.append(Action(REDUCE_GRAD, stage, replica=replica))
            out.append(Action(UPDATE, stage, version=mb // m + 1, replica=replica))
    return out


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    reps = stage_replicas(spec)
    per_window = iteration_microbatches(spec)
    for k, r in enumerate(reps):
        # a window's forwards read the version the window before last made,
        # which exists only if each replica's share of a window covers its
        # warm-up: m >= p for a straight pipeline (the paper's condition)
        if per_window // r < warmup(reps, k) + 1:
            if spec.replicas is None:
                raise StrategyError(f"pipedream-2bw needs microbatches >= stages (m={spec.microbatches} < "
                                    f"p={spec.stages})")
            raise StrategyError(f"pipedream-2bw needs at least {(warmup(reps, k) + 1) * r} micro-batches per "
                                f"iteration for stage {k}'s {r} replicas (m={spec.microbatches})")
    return replicated_schedule(spec, lambda k, r, ids, warm: stage_program(k, r, ids, warm, reps[k] > 1, per_window))


def weight_versions(options: Mapping[str, object], stage: int, stages: int) -> int:
    """Double buffering: the version being read and the one being written."""
    return 2


STRATEGY = Strategy(
    name=NAME, build=build, options=("width", "replicas"), asynchronous=True, needs_m_ge_p=True,
    weight_versions=weight_versions,
    summary="1F1B without flush, one update per m micro-batches, double-buffered weights (staleness 1)",
    planners=("width-depth", "replicas"),
)

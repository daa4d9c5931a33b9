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
replicas. A replica's share of a window must cover its warm-up, the
replicated form of m >= p.

On a replicated stage the window's gradient is all-reduced across the
replicas, and that all-reduce is hidden behind the next window, as 2BW's
implementation and its planner's model (all-reduce / m per micro-batch,
overlapped) have it: each replica posts ``REDUCE_GRAD`` right after the
window's last backward (which closes the window's gradient: later
backwards accumulate into a second buffer, see :mod:`pipesim.sim.ir.core`), and
the ``UPDATE`` that applies it, the only action waiting for the
all-reduce, is deferred to just before the first pass that reads the
version it makes: the first forward of window t+2 for window t's update
(or before the next window's ``REDUCE_GRAD`` where that comes first, on a
stage without warm-up; after the stream's last backward for the last two
windows). Versions read and staleness are those of the update right after
the window: the version an update makes is first read a window after it
would have run. Memory is unchanged in total: while the update waits the
stage holds the closed gradient (a second ``gradient_bytes``) instead of the
second weight version (``weight_bytes``; the two are the same size in fp32
and in 16-bit mixed precision, so weights + gradients stay at three copies:
:mod:`pipesim.sim.engine.trackers`). A stage
with one replica has no all-reduce to hide and keeps its update right
after the window's last backward.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipesim.sim.ir.core import REDUCE_GRAD, UPDATE, Action, B, F, Schedule
from pipesim.sim.strategies._common import (
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
    (iteration) t of ``m``: 1F1B after ``warm`` forwards across the windows.
    Without replicas to reduce over, the window's update right after its
    last backward on this replica; with them, the window's REDUCE_GRAD
    there and its update deferred (:func:`defer_updates`)."""
    closes = {batch[-1] for batch in ids if len(batch)}  # each window's last micro-batch here
    stream = [i for batch in ids for i in batch]
    out: list[Action] = []
    for op, j in one_f_one_b(len(stream), warm):
        mb = stream[j]
        out.append(Action(op, stage, mb, version=read_version(mb, m), replica=replica))
        if op is B and mb in closes:
            if reduce:
                out.append(Action(REDUCE_GRAD, stage, replica=replica))
            else:
                out.append(Action(UPDATE, stage, version=mb // m + 1, replica=replica))
    return defer_updates(out, stage, replica, m) if reduce else out


def defer_updates(program: list[Action], stage: int, replica: int, m: int) -> list[Action]:
    """Insert the update of each window's REDUCE_GRAD (the t-th REDUCE_GRAD
    makes version t+1) as late as 2BW allows: right before the first
    forward that reads version t+1 (micro-batch (t+2)m on), or before the
    next REDUCE_GRAD if that comes first (an update applies the gradient of
    the REDUCE_GRAD before it, so they alternate), or at the end."""
    out: list[Action] = []
    due: int | None = None  # the version whose update is still to place
    last_b = None
    for a in program:
        if a.op is REDUCE_GRAD:
            if due is not None:
                out.append(Action(UPDATE, stage, version=due, replica=replica))
            due = last_b // m + 1  # the window of the backward it follows
        elif a.op is F and due is not None and read_version(a.microbatch, m) >= due:
            out.append(Action(UPDATE, stage, version=due, replica=replica))
            due = None
        elif a.op is B:
            last_b = a.microbatch
        out.append(a)
    if due is not None:
        out.append(Action(UPDATE, stage, version=due, replica=replica))
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
                raise StrategyError(
                    f"pipedream-2bw needs microbatches >= stages (m={spec.microbatches} < p={spec.stages})"
                )
            raise StrategyError(
                f"pipedream-2bw needs at least {(warmup(reps, k) + 1) * r} micro-batches per "
                f"iteration for stage {k}'s {r} replicas (m={spec.microbatches})"
            )
    return replicated_schedule(spec, lambda k, r, ids, warm: stage_program(k, r, ids, warm, reps[k] > 1, per_window))


def weight_versions(options: Mapping[str, object], stage: int, stages: int) -> int:
    """Double buffering: the version being read and the one being written.
    The second buffer is the passes' copy of the weights (16-bit in mixed
    precision: ``StageCost.weight_bytes``), since the in-flight window's
    passes read it; the optimizer updates one master copy."""
    return 2


STRATEGY = Strategy(
    name=NAME,
    build=build,
    options=("width", "replicas"),
    asynchronous=True,
    needs_m_ge_p=True,
    weight_versions=weight_versions,
    summary="1F1B without flush, one update per m micro-batches, double-buffered weights (staleness 1)",
    planners=("width-depth", "replicas"),
)

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

Width w: w replicas of the pipeline on devices ``r*p .. r*p+p-1``; each
UPDATE waits for a REDUCE_GRAD (all-reduce of the stage's coalesced gradient
across the w replicas).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..ir import REDUCE_GRAD, UPDATE, Action, B, Schedule
from ._common import ScheduleSpec, Strategy, StrategyError, check_spec, one_f_one_b, schedule_of

NAME = "pipedream-2bw"


def read_version(i: int, m: int) -> int:
    """Version micro-batch ``i`` (0-based) reads in both passes."""
    return max(i // m - 1, 0)


def stage_program(stage: int, p: int, m: int, n: int, replica: int, reduce: bool) -> list[Action]:
    out: list[Action] = []
    for op, i in one_f_one_b(n, p - stage - 1):
        out.append(Action(op, stage, i, version=read_version(i, m), replica=replica))
        if op is B and i % m == m - 1:
            if reduce:
                out.append(Action(REDUCE_GRAD, stage, replica=replica))
            out.append(Action(UPDATE, stage, version=i // m + 1, replica=replica))
    return out


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    p, m, w = spec.stages, spec.microbatches, spec.width
    if m < p:
        raise StrategyError(f"pipedream-2bw needs microbatches >= stages (m={m} < p={p})")
    n = m * spec.iterations
    programs = [
        tuple(stage_program(k, p, m, n, r, reduce=w > 1)) for r in range(w) for k in range(p)
    ]
    return schedule_of(spec, programs, num_replicas=w)


def weight_versions(options: Mapping[str, object], stage: int, stages: int) -> int:
    """Double buffering: the version being read and the one being written."""
    return 2


STRATEGY = Strategy(
    name=NAME, build=build, options=("width",), asynchronous=True, needs_m_ge_p=True,
    weight_versions=weight_versions,
    summary="1F1B without flush, one update per m micro-batches, double-buffered weights (staleness 1)",
)

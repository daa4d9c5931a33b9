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

from ..ir import UPDATE, Action, B, F, Schedule
from ._common import ScheduleSpec, Strategy, asynchronous_schedule, check_spec, one_f_one_b

NAME = "pipedream"


def stage_program(stage: int, p: int, n: int, stashing: bool) -> list[Action]:
    out: list[Action] = []
    current = 0
    read: dict[int, int] = {}
    for op, i in one_f_one_b(n, p - stage - 1):
        if op is F:
            read[i] = current
            out.append(Action(F, stage, i, version=current))
        else:
            out.append(Action(B, stage, i, version=read.pop(i) if stashing else current))
            current += 1
            out.append(Action(UPDATE, stage, version=current))
    return out


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    return asynchronous_schedule(spec, lambda k, p, n: stage_program(k, p, n, spec.stashing),
                                 {"stashing": spec.stashing})


def weight_versions(options: Mapping[str, object], stage: int, stages: int) -> int:
    """Stashing keeps the p-k versions read between a forward and its
    backward; vanilla updates in place."""
    return stages - stage if options.get("stashing", True) else 1


STRATEGY = Strategy(
    name=NAME, build=build, options=("stashing",), asynchronous=True, weight_versions=weight_versions,
    summary="asynchronous 1F1B, an update after every backward; weight stashing, or vanilla without",
)

"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24).

The backward is split into I (gradient w.r.t. the stage input, on the
critical path to the previous stage) and W (gradient w.r.t. the weights,
needed only by the update). ZB-H1 keeps 1F1B's order of F and I and *defers W*
to fill the bubbles:

* stage ``k`` runs 1F1B over F and I: ``p-k-1`` warm-up forwards, then one F
  and one I alternately, then the remaining I's;
* after every I, the oldest pending W's run until at most ``k`` are pending
  (FIFO); whatever is still pending after the last I runs at the end.

So the last stage, whose I is what every earlier stage waits for, holds back
``p-1`` W's, stage 0 none; in the cool-down each stage's I follows its
successor's I after T_F + T_I instead of T_F + T_I + T_W, and the deferred W's
fill the holes. With T_W <= T_F the makespan is
``m(T_F+T_I+T_W) + (p-1)(T_F+T_I-T_W)``, the paper's ZB-H1 bubble (checked
with a timing model in the tests). Every stage keeps at most ``min(p, m)``
micro-batches between their F and their W: 1F1B's peak (stage 0's p), though
later stages now reach it too. This is the same job list as PaddlePaddle's
ZBH1 pass, except that pipesim runs the deferred W's oldest-first.
torch's ScheduleZBVZeroBubble / ScheduleInterleavedZeroBubble are different
(V-shaped / interleaved) schedules and served only as hints.
"""

from __future__ import annotations

from collections import deque

from pipesim.sim.ir.core import B, F, I, Schedule, W
from pipesim.sim.strategies._common import (
    ScheduleSpec,
    Strategy,
    check_spec,
    flushed,
    one_f_one_b,
    replicated_schedule,
    stage_replicas,
)

NAME = "zb-h1"


def stage_order(stage: int, batch: range, warm: int) -> list[tuple]:
    """One iteration of one stage replica over its micro-batches ``batch`` (indexes into it)."""
    out: list[tuple] = []
    pending: deque[int] = deque()
    for op, i in one_f_one_b(len(batch), warm):
        if op is F:
            out.append((F, i))
            continue
        assert op is B
        out.append((I, i))
        pending.append(i)
        while len(pending) > stage:
            out.append((W, pending.popleft()))
    out.extend((W, i) for i in pending)
    return out


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    return replicated_schedule(spec, flushed(stage_order, stage_replicas(spec)))


STRATEGY = Strategy(
    name=NAME,
    build=build,
    options=("width",),
    needs_m_ge_p=True,
    summary="zero bubble H1: backward split into I and W, W deferred (<= k pending on stage k)",
)

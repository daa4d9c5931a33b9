"""SpecTrain (Chen, Yang, Cheng, arXiv 1809.02839): asynchronous 1F1B with weight prediction.

The order and the updates are PipeDream's (one 1F1B stream of K*m
micro-batches, an UPDATE after every backward), but a stage stores ONE
version and every pass reads the current one. Instead of stashing, each pass
computes on weights predicted ``s`` updates ahead, ``W_hat = W - s*lr*v``
(v the momentum), aiming at the version current when the micro-batch's round
trip ends on stage 0. The distances are those of the authors' reference code,
stage k of N:

    s_fwd(k) = k//2 + N - k - 1,    s_bwd(k) = k//2

In the IR a ``PREDICT@v<c>+p<s>`` materialises the predicted weights from the
current version c and the pass then reads ``version=c, distance=s``. A
PREDICT is skipped when s = 0 (the pass reads the stored weights) and when
the stage's previous PREDICT already materialised the same (version,
distance) with no update since -- consecutive warm-up forwards, and the last
stage, whose two distances coincide, share one.

The predicted weights take one buffer of the passes' width
(``StageCost.weight_bytes``, 16-bit in mixed precision), since only the
passes read them; the master and the momentum they are predicted from stay
one copy.
"""

from __future__ import annotations

from pipesim.sim.ir.core import PREDICT, UPDATE, Action, B, F, Schedule
from pipesim.sim.strategies._common import ScheduleSpec, Strategy, asynchronous_schedule, check_spec, one_f_one_b

NAME = "spectrain"


def s_fwd(k: int, n: int) -> int:
    return k // 2 + n - k - 1


def s_bwd(k: int, n: int) -> int:
    return k // 2


def stage_program(stage: int, p: int, ids: list[int], warm: int) -> list[Action]:
    out: list[Action] = []
    current = 0
    materialised: tuple[int, int] | None = None
    for op, i in one_f_one_b(len(ids), warm):
        s = s_fwd(stage, p) if op is F else s_bwd(stage, p)
        if s and materialised != (current, s):
            out.append(Action(PREDICT, stage, version=current, distance=s))
            materialised = (current, s)
        out.append(Action(op, stage, ids[i], version=current, distance=s))
        if op is B:
            current += 1
            out.append(Action(UPDATE, stage, version=current))
            materialised = None
    return out


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    p = spec.stages
    return asynchronous_schedule(
        spec,
        lambda k, r, ids, warm: stage_program(k, p, ids, warm),
        {
            "s_fwd": [s_fwd(k, p) for k in range(p)],
            "s_bwd": [s_bwd(k, p) for k in range(p)],
            "distance_formula": "s_fwd(k) = k//2 + N - k - 1; s_bwd(k) = k//2 (N stages, stage k 0-based)",
        },
    )


STRATEGY = Strategy(
    name=NAME,
    build=build,
    asynchronous=True,
    summary="asynchronous 1F1B with weight prediction, s_fwd(k) = k//2+N-k-1, s_bwd(k) = k//2",
)

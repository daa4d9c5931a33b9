"""1F1B with flush (PipeDream-Flush, DAPPLE): one update per iteration.

Stage ``k`` runs ``p-k-1`` warm-up forwards, then alternates one forward and
one backward (forward first, as torch 2.13's ``Schedule1F1B``), then drains
the remaining backwards. It therefore holds at most ``min(p-k, m)``
micro-batches of activations instead of GPipe's m, with the same bubble.

torch's Schedule1F1B numbers the last rank's forwards ``F1 .. Fm`` (its
``forward_mb`` starts at 0 and is incremented before the first steady-state
forward when there is no warm-up); pipesim uses the true ids ``F0 .. F(m-1)``.
Unlike torch, m < p is accepted: the warm-up is capped at m, which makes the
schedule GPipe-like on the early stages.
"""

from __future__ import annotations

from pipesim.sim.ir.core import Schedule
from pipesim.sim.strategies._common import (
    ScheduleSpec,
    Strategy,
    check_spec,
    flushed,
    one_f_one_b,
    replicated_schedule,
    stage_replicas,
)

NAME = "1f1b"


def stage_order(stage: int, batch: range, warm: int):
    """One iteration of one stage replica over its micro-batches ``batch`` (indexes into it)."""
    return one_f_one_b(len(batch), warm)


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    return replicated_schedule(spec, flushed(stage_order, stage_replicas(spec)))


STRATEGY = Strategy(
    name=NAME,
    build=build,
    options=("width", "replicas"),
    torch_equivalent="Schedule1F1B",
    summary="PipeDream-Flush / DAPPLE: p-k-1 warm-up forwards, 1F1B, flush (torch's order)",
    planners=("replicas", "width-depth"),
)

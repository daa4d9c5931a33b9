"""Interleaved 1F1B (Narayanan et al. SC'21), as torch 2.13's ScheduleInterleaved1F1B.

Each of the p devices of a pipeline holds ``v`` model chunks: chunk ``c`` of
rank ``r`` is model stage ``c*p + r``, so a replica has ``v*p`` model stages.
Micro-batches go through the chunks in *rounds* of ``per_round`` micro-batches
("depth first": a round is pushed through chunk 0, then chunk 1, ...):

* ``rounds = max(1, m // p)``, ``per_round = m // rounds``; m must be a
  multiple of ``rounds`` (torch's relaxation of Megatron's ``m % p == 0``;
  torch raises otherwise and so do we);
* rank ``r`` issues ``warmup = min((v-1)*per_round + 2*(p-1-r), v*m)``
  forwards, then alternates forward/backward, then drains the backwards;
* the n-th forward of a rank runs chunk ``(n // per_round) % v``, the n-th
  steady/cool-down backward chunk ``v-1 - ((n - warmup) // per_round) % v``,
  each chunk taking its micro-batches in order.

That is exactly torch's ``_get_warmup_ops`` / ``_get_1f1b_rank_ops`` without
the idle slots, so the per-rank compute orders are equal (checked in the
tests). Flush semantics per model stage come from ``flush_schedule``.
"""

from __future__ import annotations

from collections import defaultdict

from pipesim.sim.ir.core import Action, B, F, Schedule
from pipesim.sim.strategies._common import (
    ScheduleSpec,
    Strategy,
    StrategyError,
    check_spec,
    flush_schedule,
    pipeline_passes,
    replica_ring_transfers,
)

NAME = "interleaved-1f1b"


def rounds(p: int, m: int) -> tuple[int, int]:
    """(number of rounds, micro-batches per round) as torch computes them."""
    n_rounds = max(1, m // p)
    return n_rounds, m // n_rounds


def rank_order(rank: int, p: int, v: int, m: int) -> list[Action]:
    """One iteration of one rank (local micro-batch ids, model stage ids)."""
    _, per_round = rounds(p, m)
    total = v * m  # forwards (and backwards) this rank runs
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)
    next_mb: dict[tuple, int] = defaultdict(int)

    def take(op, chunk: int) -> Action:
        stage = chunk * p + rank
        mb = next_mb[(op, stage)]
        next_mb[(op, stage)] = mb + 1
        return Action(op, stage, mb)

    def fwd(n: int) -> Action:
        return take(F, (n // per_round) % v)

    def bwd(n: int) -> Action:
        return take(B, v - 1 - ((n - warmup) // per_round) % v)

    out = [fwd(n) for n in range(warmup)]
    for n in range(warmup, total):
        out.append(fwd(n))
        out.append(bwd(n))
    for n in range(total, total + warmup):
        out.append(bwd(n))
    return out


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    p, m, v = spec.stages, spec.microbatches, spec.chunks
    n_rounds, _ = rounds(p, m)
    if m % n_rounds:
        raise StrategyError(
            f"interleaved-1f1b needs microbatches to be a multiple of max(1, m // stages) = {n_rounds} "
            f"(torch's rounds), got m={m} with stages={p}"
        )
    return flush_schedule(spec, v * p, [rank_order(r, p, v, m) for r in range(p)], options={"chunks": v})


def stage_passes(spec: ScheduleSpec) -> int:
    """Every device runs ``chunks`` model stages."""
    return pipeline_passes(spec) * spec.chunks


def ring_transfers(spec: ScheduleSpec) -> int:
    """Each of the ``chunks`` model stages of a device reduces on its own."""
    return replica_ring_transfers(spec) * spec.chunks


STRATEGY = Strategy(
    name=NAME,
    build=build,
    options=("width", "chunks"),
    needs_m_ge_p=True,
    stage_passes=stage_passes,
    ring_transfers=ring_transfers,
    torch_equivalent="ScheduleInterleaved1F1B",
    summary="Megatron interleaving: v model chunks per device, stage c*p+r on rank r (torch's order)",
)

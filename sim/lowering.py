"""Lowering pass: add point-to-point sends and receives to a compute order.

Strategies only say which device computes what, in which order. Every data
dependency that crosses devices (a forward's output going to the next stage,
an input gradient going to the previous one) becomes a ``SEND`` on the
producer's device and a ``RECV`` on the consumer's.

Placement is chosen for overlap and safety:

* the send goes right after the pass that produced the data, so the
  transfer starts as soon as it can;
* the receive is posted ``recv_lookahead`` compute actions before the pass
  that consumes it, so the transfer overlaps the compute before it (the
  double buffering every real runtime does) while at most that many receive
  buffers per consumer are held. ``recv_lookahead=0`` posts it right before
  the consumer, like torch's runtime does.

Because sends never block and receives are posted before their consumers,
lowering a schedule whose compute order is free of deadlock never creates one
(the validator still checks the result).
"""

from __future__ import annotations

from pipesim.sim.dataflow import SEND_FOR, consumer_stage, split_stages
from pipesim.sim.ir import (
    COMPUTE_OPS,
    P2P_OPS,
    RECV_B,
    RECV_F,
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
)


def lower(schedule: Schedule, *, recv_lookahead: int = 1) -> Schedule:
    """Return ``schedule`` with SEND/RECV actions for cross-device data."""
    if recv_lookahead < 0:
        raise ScheduleError("recv_lookahead must be >= 0")
    if any(a.op in P2P_OPS for prog in schedule.programs for a in prog):
        return schedule  # already lowered (e.g. imported with communication)
    placement = schedule.placement()
    split = split_stages(schedule)
    last = schedule.num_stages - 1
    programs = []
    for dev, prog in enumerate(schedule.programs):
        # Which receive each action needs, and where it is posted: before
        # the compute action ``recv_lookahead`` compute actions earlier.
        compute_index = []  # position in ``prog`` of the c-th compute action
        posts: dict[int, list[Action]] = {}
        for pos, a in enumerate(prog):
            if a.op not in COMPUTE_OPS:
                continue
            compute_index.append(pos)
            recv = _recv_needed(a, dev, placement, last)
            if recv is not None:
                at = compute_index[max(len(compute_index) - 1 - recv_lookahead, 0)]
                posts.setdefault(at, []).append(recv)
        out: list[Action] = []
        for pos, a in enumerate(prog):
            out.extend(posts.get(pos, ()))
            out.append(a)
            send = _send_needed(a, dev, placement, last, split)
            if send is not None:
                out.append(send)
        programs.append(tuple(out))
    return schedule.with_programs(programs)


def _recv_needed(a: Action, dev: int, placement, last: int) -> Action | None:
    if a.op is F and a.stage > 0 and placement.get((a.replica, a.stage - 1)) != dev:
        return Action(RECV_F, a.stage, a.microbatch, replica=a.replica)
    if a.op in (B, I) and a.stage < last and placement.get((a.replica, a.stage + 1)) != dev:
        return Action(RECV_B, a.stage, a.microbatch, replica=a.replica)
    return None


def _send_needed(a: Action, dev: int, placement, last: int, split) -> Action | None:
    send_op = SEND_FOR.get(a.op)
    if send_op is None or (a.op is F and a.stage == last) or (a.op is not F and a.stage == 0):
        return None
    if a.op is B and (a.replica, a.stage) in split:
        return None  # the I pass already sent the input gradient
    if placement.get((a.replica, consumer_stage(a))) == dev:
        return None
    return Action(send_op, a.stage, a.microbatch, replica=a.replica)

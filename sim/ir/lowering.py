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

Executors consume the *plan* form: per device, each compute action with the
communication posted just before it (:data:`Slot`). Posting never blocks, so
"posted right after compute j" and "posted right before compute j+1" are
the same moment; the plan is just a flat program grouped at its compute
actions, and :func:`lower` flattens it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pipesim.sim.ir.core import (
    COMPUTE_OPS,
    FLOW,
    OVERLAP_F_B,
    P2P_OPS,
    RECV_OF,
    SEND_OF,
    SEND_OPS,
    Action,
    Schedule,
    ScheduleError,
)
from pipesim.sim.ir.dataflow import Arrival, Post, transfer_key


class Slot(NamedTuple):
    """Communication and collectives posted, in order, right before compute
    ``action`` (``None`` for what trails a program's last one). Each post's
    token is its transfer's :class:`~pipesim.sim.ir.dataflow.Arrival`, or
    ``None`` for a collective or an FSDP action, whose token
    :func:`~pipesim.sim.ir.dataflow.compile_plan` numbers."""

    posts: tuple[Post, ...]
    action: Action | None


_new = tuple.__new__  # NamedTuples without their Python-level __new__ (see dataflow)


@dataclass
class Plan:
    """A lowered schedule grouped at its compute actions.

    ``slots[d]`` is device d's list of :data:`Slot`. The lowering also notes
    what the compiler would otherwise rescan every action for: the tokens of
    transfers that have a receive, whether any collective or FSDP action is
    posted, and ``overlaps[d]``, the indices j of device d's slots whose
    action is the forward of an OVERLAP_F_B (slot j+1 holds its backward,
    with nothing posted before it).
    """

    slots: list[list[Slot]]
    received: set = field(default_factory=set)
    has_collectives: bool = False
    overlaps: dict[int, list[int]] = field(default_factory=dict)


def group(schedule: Schedule) -> Plan:
    """The plan form of a schedule as it stands (lowered or not)."""
    out = Plan([])
    received = out.received
    for dev, prog in enumerate(schedule.programs):
        slots, pending = [], []
        for a in prog:
            op = a.op
            if op in COMPUTE_OPS:
                slots.append(_new(Slot, (tuple(pending), a)))
                pending = []
            elif op in P2P_OPS:
                tok = transfer_key(a)
                pending.append(_new(Post, (a, tok)))
                if op not in SEND_OPS:
                    received.add(tok)
            elif op is OVERLAP_F_B:  # the next two slots form the pair
                out.overlaps.setdefault(dev, []).append(len(slots))
            else:  # a collective or an FSDP action
                pending.append(_new(Post, (a, None)))
                out.has_collectives = True
        if pending:
            slots.append(_new(Slot, (tuple(pending), None)))
        out.slots.append(slots)
    return out


def plan(schedule: Schedule, *, recv_lookahead: int = 1) -> Plan:
    """Lowered plan: sends after their producers, receives ``recv_lookahead``
    compute actions ahead of their consumers. A schedule that already has
    communication is grouped as it is.

    Nothing is posted inside an OVERLAP_F_B pair: receives due between its
    forward and backward are posted before the pair, sends after it (torch
    sends a pair's results once both ran).

    This visits every action of every simulation, so it is written flat.
    """
    if recv_lookahead < 0:
        raise ScheduleError("recv_lookahead must be >= 0")
    if any(a.op in P2P_OPS for prog in schedule.programs for a in prog):
        return group(schedule)
    reps = schedule.replicas
    # device_of[k][r]: where replica r of stage k runs (-1 past either end)
    where = schedule.placement()
    device_of = [[where[(r, k)] for r in range(n)] for k, n in enumerate(reps)] + [[-1]]
    device_of.insert(0, [-1])  # stage -1: nothing upstream of stage 0
    out = Plan([])
    received = out.received
    flow = FLOW.get
    for dev, prog in enumerate(schedule.programs):
        computes: list[Action] = []
        posts: list[list] = [[]]  # posts[j]: before compute j; one extra for the tail
        overlaps: list[int] = []
        for a in prog:
            op, stage, mb, _, _, rep = a  # one unpacking, not four field reads
            if op not in COMPUTE_OPS:  # a collective or FSDP action already in the program
                if op is OVERLAP_F_B:
                    overlaps.append(len(computes))
                    continue
                posts[-1].append(_new(Post, (a, None)))
                out.has_collectives = True
                continue
            j = len(computes)
            computes.append(a)
            after: list = []
            posts.append(after)
            step = flow(op)
            if step is None:  # W, UPDATE, PREDICT: no data crosses stages
                continue
            # the input comes from stage - step, the output goes to stage +
            # step, each on the replica there that runs this micro-batch
            src, dst = device_of[stage - step + 1], device_of[stage + step + 1]
            if src[0] >= 0 and src[mb % len(src)] != dev:  # receive it ahead of this pass
                tok = _new(Arrival, (SEND_OF[op], stage - step, mb))
                received.add(tok)
                posts[j - recv_lookahead if j > recv_lookahead else 0].append(
                    _new(Post, (_new(Action, (RECV_OF[op], stage, mb, None, 0, rep)), tok))
                )
            if dst[0] >= 0 and dst[mb % len(dst)] != dev:  # send it right after
                send = SEND_OF[op]
                after.append(
                    _new(Post, (_new(Action, (send, stage, mb, None, 0, rep)), _new(Arrival, (send, stage, mb))))
                )
        for j in overlaps:  # empty what would be posted inside each pair
            if j + 1 >= len(computes):
                raise ScheduleError(f"OVERLAP_F_B on device {dev} is not followed by its forward and backward")
            inside = posts[j + 1]
            posts[j].extend(x for x in inside if x.action.op not in SEND_OPS)
            posts[j + 2][:0] = [x for x in inside if x.action.op in SEND_OPS]
            posts[j + 1] = []
        if overlaps:
            out.overlaps[dev] = overlaps
        slots = [_new(Slot, pair) for pair in zip(map(tuple, posts), computes)]
        if posts[-1]:
            slots.append(_new(Slot, (tuple(posts[-1]), None)))
        out.slots.append(slots)
    return out


def flatten(plan_: Plan) -> list[tuple[Action, ...]]:
    """The flat per-device programs of a plan (an OVERLAP_F_B's marker right
    before its forward)."""
    out = []
    for dev, slots in enumerate(plan_.slots):
        pairs = set(plan_.overlaps.get(dev, ()))
        prog = []
        for j, (posts, a) in enumerate(slots):
            prog.extend(x for x, _ in posts)
            if j in pairs:
                prog.append(Action(OVERLAP_F_B, a.stage, replica=a.replica))
            if a is not None:
                prog.append(a)
        out.append(tuple(prog))
    return out


def lower(schedule: Schedule, *, recv_lookahead: int = 1) -> Schedule:
    """Return ``schedule`` with SEND/RECV actions for cross-device data."""
    if any(a.op in P2P_OPS for prog in schedule.programs for a in prog):
        return schedule  # already lowered (e.g. imported with communication)
    return schedule.with_programs(flatten(plan(schedule, recv_lookahead=recv_lookahead)))

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

from pipesim.sim.dataflow import split_stages, transfer_key
from pipesim.sim.ir import (
    COMPUTE_OPS,
    P2P_OPS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
)

#: ``(posts, action)``: communication and collectives posted, in order,
#: right before compute ``action`` (``None`` for what trails the last one).
#: Each post is ``(action, token)``: a transfer's token
#: (:func:`~pipesim.sim.dataflow.transfer_key`), or ``None`` for a
#: collective, whose token :func:`~pipesim.sim.dataflow.compile_plan` numbers.
Slot = tuple


@dataclass
class Plan:
    """A lowered schedule grouped at its compute actions.

    ``slots[d]`` is device d's list of :data:`Slot`. The lowering also notes
    what the compiler would otherwise rescan every action for: the tokens of
    transfers that have a receive, and whether any collective is posted.
    """

    slots: list[list[Slot]]
    received: set = field(default_factory=set)
    has_collectives: bool = False


def _post(x: Action) -> tuple:
    return (x, transfer_key(x) if x.op in P2P_OPS else None)


def group(schedule: Schedule) -> Plan:
    """The plan form of a schedule as it stands (lowered or not)."""
    out = Plan([])
    for prog in schedule.programs:
        slots, pending = [], []
        for a in prog:
            if a.op in COMPUTE_OPS:
                slots.append((tuple(pending), a))
                pending = []
            else:
                post = _post(a)
                pending.append(post)
                if a.op is RECV_F or a.op is RECV_B:
                    out.received.add(post[1])
                elif post[1] is None:
                    out.has_collectives = True
        if pending:
            slots.append((tuple(pending), None))
        out.slots.append(slots)
    return out


def plan(schedule: Schedule, *, recv_lookahead: int = 1) -> Plan:
    """Lowered plan: sends after their producers, receives ``recv_lookahead``
    compute actions ahead of their consumers. A schedule that already has
    communication is grouped as it is.

    This visits every action of every simulation, so it is written flat.
    """
    if recv_lookahead < 0:
        raise ScheduleError("recv_lookahead must be >= 0")
    if any(a.op in P2P_OPS for prog in schedule.programs for a in prog):
        return group(schedule)
    home = schedule.placement().get
    split = split_stages(schedule)
    last = schedule.num_stages - 1
    out = Plan([])
    received = out.received
    for dev, prog in enumerate(schedule.programs):
        # Per (replica, stage) on this device: which neighbours live elsewhere.
        remote: dict[tuple[int, int], tuple[bool, bool]] = {}
        computes: list[Action] = []
        posts: list[list] = [[]]  # posts[j]: before compute j; one extra for the tail
        for a in prog:
            op = a.op
            if op not in COMPUTE_OPS:  # a collective already in the program
                posts[-1].append((a, None))
                out.has_collectives = True
                continue
            j = len(computes)
            computes.append(a)
            after: list = []
            posts.append(after)
            stage, rep, mb = a.stage, a.replica, a.microbatch
            key = (rep, stage)
            flags = remote.get(key)
            if flags is None:
                flags = remote[key] = (stage > 0 and home((rep, stage - 1)) != dev,
                                       stage < last and home((rep, stage + 1)) != dev)
            # tokens spelled inline as transfer_key() would: this loop is hot
            if op is F:
                if flags[0]:
                    tok = (SEND_F, rep, stage - 1, mb)
                    received.add(tok)
                    posts[j - recv_lookahead if j > recv_lookahead else 0].append(
                        (Action(RECV_F, stage, mb, None, 0, rep), tok))
                if flags[1]:
                    after.append((Action(SEND_F, stage, mb, None, 0, rep), (SEND_F, rep, stage, mb)))
            elif op is B or op is I:
                if flags[1]:
                    tok = (SEND_B, rep, stage + 1, mb)
                    received.add(tok)
                    posts[j - recv_lookahead if j > recv_lookahead else 0].append(
                        (Action(RECV_B, stage, mb, None, 0, rep), tok))
                if flags[0] and not (op is B and key in split):
                    after.append((Action(SEND_B, stage, mb, None, 0, rep), (SEND_B, rep, stage, mb)))
        slots = list(zip(map(tuple, posts), computes))
        if posts[-1]:
            slots.append((tuple(posts[-1]), None))
        out.slots.append(slots)
    return out


def flatten(plan_: Plan) -> list[tuple[Action, ...]]:
    """The flat per-device programs of a plan."""
    out = []
    for slots in plan_.slots:
        prog = []
        for posts, a in slots:
            prog.extend(x for x, _ in posts)
            if a is not None:
                prog.append(a)
        out.append(tuple(prog))
    return out


def lower(schedule: Schedule, *, recv_lookahead: int = 1) -> Schedule:
    """Return ``schedule`` with SEND/RECV actions for cross-device data."""
    if any(a.op in P2P_OPS for prog in schedule.programs for a in prog):
        return schedule  # already lowered (e.g. imported with communication)
    return schedule.with_programs(flatten(plan(schedule, recv_lookahead=recv_lookahead)))

"""What each action waits for and what it makes available: the dataflow of a schedule.

Both the validator's zero-time dry run and the SimPy engine need the same
answer to "when may this action run?", so it is computed once, here, as
*tokens*: hashable names for things that become available during execution.

* a pass's completion: the bare pass ``Action`` (version dropped);
* a transfer's arrival: ``("F"|"B", replica, source stage, micro-batch)``,
  shared by the SEND and the RECV that carry it;
* a collective's completion: ``(op, stage, round)`` where round counts that
  stage's collectives of that op on each replica.

A compute action waits for the tokens in its ``waits``; communication and
collectives never block the device's walk. This module encodes the execution
model documented in :mod:`pipesim.sim.ir`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from pipesim.sim.ir import (
    AVERAGE,
    COLLECTIVE_OPS,
    COMPUTE_OPS,
    P2P_OPS,
    PASS_OPS,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    UPDATE,
    Action,
    B,
    F,
    I,
    Schedule,
)

SEND_FOR = {F: SEND_F, B: SEND_B, I: SEND_B}


class Step(NamedTuple):
    """One action of a device program with its dataflow."""

    action: Action
    waits: tuple  # tokens a compute action needs before it may start
    token: object  # what this action makes available (pass, transfer or collective)


def bare(a: Action) -> Action:
    return Action(a.op, a.stage, a.microbatch, replica=a.replica)


def split_stages(schedule: Schedule) -> set[tuple[int, int]]:
    """(replica, stage) pairs whose backward is split into I and W."""
    return {(a.replica, a.stage) for prog in schedule.programs for a in prog if a.op is I}


def producer_of(a: Action, num_stages: int, split: set[tuple[int, int]]) -> Action | None:
    """The pass on a neighbouring stage whose output the pass ``a`` consumes."""
    if a.op is F:
        if a.stage == 0:
            return None
        return Action(F, a.stage - 1, a.microbatch, replica=a.replica)
    if a.op in (B, I):
        if a.stage == num_stages - 1:
            return None
        nxt = (a.replica, a.stage + 1)
        return Action(I if nxt in split else B, a.stage + 1, a.microbatch, replica=a.replica)
    return None


def consumer_stage(a: Action) -> int:
    """The stage that consumes the output of pass ``a`` (F: next, B/I: previous)."""
    return a.stage + 1 if a.op is F else a.stage - 1


def transfer_key(a: Action) -> tuple:
    """Identity of a transfer, shared by the send and its receive."""
    op = a.op
    if op is SEND_F:
        return ("F", a.replica, a.stage, a.microbatch)
    if op is RECV_F:
        return ("F", a.replica, a.stage - 1, a.microbatch)
    if op is SEND_B:
        return ("B", a.replica, a.stage, a.microbatch)
    return ("B", a.replica, a.stage + 1, a.microbatch)


def steps(schedule: Schedule) -> list[list[Step]]:
    """Per device, every action with the tokens it waits for and provides."""
    p = schedule.num_stages
    split = split_stages(schedule)
    received = {
        transfer_key(a) for prog in schedule.programs for a in prog if a.op in (RECV_F, RECV_B)
    }
    rounds: dict[tuple, int] = defaultdict(int)
    out = []
    for prog in schedule.programs:
        last_coll: dict[tuple, tuple] = {}
        dev_steps = []
        for a in prog:
            op = a.op
            waits: tuple = ()
            token: object = None
            if op in PASS_OPS:
                token = bare(a)
                prod = producer_of(a, p, split)
                if prod is not None:
                    recv_op = RECV_F if op is F else RECV_B
                    key = transfer_key(Action(recv_op, a.stage, a.microbatch, replica=a.replica))
                    waits = (key,) if key in received else (prod,)
            elif op in P2P_OPS:
                token = transfer_key(a)
            elif op in COLLECTIVE_OPS:
                k = (op, a.stage, a.replica)
                token = (op.value, a.stage, rounds[k])
                rounds[k] += 1
                last_coll[(op, a.replica, a.stage)] = token
            if op in COMPUTE_OPS:
                avg = last_coll.pop((AVERAGE, a.replica, a.stage), None)
                if avg is not None:
                    waits += (avg,)
                if op is UPDATE:
                    red = last_coll.pop((REDUCE_GRAD, a.replica, a.stage), None)
                    if red is not None:
                        waits += (red,)
            dev_steps.append(Step(a, waits, token))
        out.append(dev_steps)
    return out

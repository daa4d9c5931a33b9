"""What each action waits for and what it makes available: the dataflow of a schedule.

Both the validator's zero-time dry run and the SimPy engine need the same
answer to "when may this action run?", so it is computed once, here, as
*tokens*: hashable names for things that become available during execution.

* a pass's completion: ``(op, replica, stage, micro-batch)`` (:func:`bare`);
* a transfer's arrival: ``(SEND_F|SEND_B, replica, source stage, micro-batch)``,
  shared by the SEND and the RECV that carry it. The tag is the send's op, never
  a plain ``"F"``: ``Op`` is a ``str`` enum, so ``(Op.F, ...)`` would equal
  ``("F", ...)`` and a forward's completion would pass for its output's arrival;
* a collective's completion: ``(op, stage, round)`` where round counts that
  stage's collectives of that op on each replica.

A compute action waits for the tokens in its ``waits``; communication and
collectives never block the device's walk. This module encodes the execution
model documented in :mod:`pipesim.sim.ir`.
"""

from __future__ import annotations

from collections import defaultdict
from pipesim.sim.ir import (
    AVERAGE,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    UPDATE,
    Action,
    B,
    F,
    I,
    W,
    Schedule,
    format_action,
)



#: One compute action of a device program with its dataflow:
#: ``(posts, action, waits, token)``. ``posts`` are ``(action, token)`` pairs
#: of the communication and collectives posted right before it (see
#: :func:`pipesim.sim.lowering.plan`); ``waits`` are the tokens the compute
#: action needs before it may start; ``token`` is what it makes available.
#: ``action`` is ``None`` for the posts that trail a program. Plain tuples,
#: because the engine builds one per action and reads them in its hot loop.
Entry = tuple


def bare(a: Action) -> tuple:
    """Token of pass ``a``'s completion (version and distance dropped)."""
    return (a.op, a.replica, a.stage, a.microbatch)


def split_stages(schedule: Schedule) -> set[tuple[int, int]]:
    """(replica, stage) pairs whose backward is split into I and W."""
    return {(a.replica, a.stage) for prog in schedule.programs for a in prog if a.op is I}


def producer_of(a: Action, num_stages: int, split: set[tuple[int, int]]) -> tuple | None:
    """Token of the pass on a neighbouring stage whose output pass ``a`` consumes."""
    if a.op is F:
        if a.stage == 0:
            return None
        return (F, a.replica, a.stage - 1, a.microbatch)
    if a.op is B or a.op is I:
        if a.stage == num_stages - 1:
            return None
        nxt = (a.replica, a.stage + 1)
        return (I if nxt in split else B, a.replica, a.stage + 1, a.microbatch)
    return None


def token_name(token) -> str:
    """Readable name of a token for error messages: the pass, or the send
    that carries a transfer, or the collective."""
    if len(token) == 4:
        op, rep, stage, mb = token
        return format_action(Action(op, stage, mb, replica=rep))
    op, stage, rnd = token
    return f"{op} of stage {stage} (round {rnd}) on every replica"


def transfer_key(a: Action) -> tuple:
    """Identity of a transfer, shared by the send and its receive."""
    op = a.op
    if op is SEND_F:
        return (SEND_F, a.replica, a.stage, a.microbatch)
    if op is RECV_F:
        return (SEND_F, a.replica, a.stage - 1, a.microbatch)
    if op is SEND_B:
        return (SEND_B, a.replica, a.stage, a.microbatch)
    return (SEND_B, a.replica, a.stage + 1, a.microbatch)


def compile_plan(schedule: Schedule, plan) -> list[list[Entry]]:
    """Per device, every compute action with its posts, waits and token.

    ``plan`` is a :class:`pipesim.sim.lowering.Plan` (from
    :func:`~pipesim.sim.lowering.plan` or :func:`~pipesim.sim.lowering.group`),
    whose posts already carry their transfer tokens. Written for speed: it visits every action the engine
    runs, so producer keys are built inline.
    """
    last = schedule.num_stages - 1
    split = split_stages(schedule)
    received = plan.received
    has_collectives = plan.has_collectives
    rounds: dict[tuple, int] = defaultdict(int)
    out = []
    for slots in plan.slots:
        last_coll: dict[tuple, tuple] = {}
        entries = []
        append = entries.append
        for posts, a in slots:
            if has_collectives and posts:
                # number each replica's collectives of a stage: round r of
                # every replica is one collective
                posted = []
                for x, tok in posts:
                    if tok is None:
                        k = (x.op, x.stage, x.replica)
                        tok = (x.op.value, x.stage, rounds[k])
                        rounds[k] += 1
                        last_coll[(x.op, x.replica, x.stage)] = tok
                    posted.append((x, tok))
                posts = tuple(posted)
            if a is None:
                append((posts, None, (), None))
                continue
            op, stage, rep, mb = a.op, a.stage, a.replica, a.microbatch
            waits: tuple = ()
            token = (op, rep, stage, mb)
            if op is F:
                if stage:
                    key = (SEND_F, rep, stage - 1, mb)  # through a receive if lowered
                    waits = (key,) if key in received else ((F, rep, stage - 1, mb),)
            elif op is B or op is I:
                if stage < last:
                    key = (SEND_B, rep, stage + 1, mb)
                    waits = (key,) if key in received else (
                        (I if (rep, stage + 1) in split else B, rep, stage + 1, mb),)
            elif op is not W:  # UPDATE, PREDICT
                token = None
            if has_collectives:
                avg = last_coll.pop((AVERAGE, rep, stage), None)
                if avg is not None:
                    waits += (avg,)
                if op is UPDATE:
                    red = last_coll.pop((REDUCE_GRAD, rep, stage), None)
                    if red is not None:
                        waits += (red,)
            append((posts, a, waits, token))
        out.append(entries)
    return out

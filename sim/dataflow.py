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
  stage's collectives of that op on each replica;
* an ``UNSHARD``'s completion: ``(UNSHARD, replica, stage, round)``, round
  counting that (replica, stage)'s unshards: the all-gather is within the
  stage's own shard group, not across replicas.

A compute action waits for the tokens in its ``waits``; communication and
collectives never block the device's walk. The forward of an ``OVERLAP_F_B``
also waits for what its backward needs, so the pair starts as one unit. This
module encodes the execution model documented in :mod:`pipesim.sim.ir`.
"""

from __future__ import annotations

from collections import defaultdict

from .ir import (
    AVERAGE,
    PASS_OPS,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    UNSHARD,
    UPDATE,
    Action,
    B,
    F,
    I,
    Op,
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


def split_stages(schedule: Schedule) -> dict[tuple[int, int], frozenset[int] | None]:
    """(replica, stage) pairs that split some backward into I and W.

    The value is ``None`` when every backward of the stage is split (ZB-H1),
    else the micro-batches that are: the stage mixes full B and I/W per
    micro-batch, as torch's DualPipeV does. Membership (``in``) answers "is
    anything split here"; :func:`backward_op` answers it per micro-batch.
    Computed once per schedule (schedules are immutable): the validator, the
    lowering, the compiler and the trackers all ask.
    """
    cached = schedule.__dict__.get("_split")
    if cached is not None:
        return cached
    split: dict[tuple[int, int], frozenset[int] | None] = dict.fromkeys(
        (a.replica, a.stage) for prog in schedule.programs for a in prog if a.op is I)
    if split:
        mixed = {(a.replica, a.stage) for prog in schedule.programs for a in prog
                 if a.op is B and (a.replica, a.stage) in split}
        if mixed:
            mbs: dict[tuple[int, int], set[int]] = defaultdict(set)
            for prog in schedule.programs:
                for a in prog:
                    if a.op is I and (a.replica, a.stage) in mixed:
                        mbs[(a.replica, a.stage)].add(a.microbatch)
            split.update((key, frozenset(v)) for key, v in mbs.items())
    object.__setattr__(schedule, "_split", split)
    return split


def backward_op(split: dict, replica: int, stage: int, mb: int) -> Op:
    """The pass that makes micro-batch ``mb``'s input gradient on (replica,
    stage): I where that backward is split (see :func:`split_stages`), else B."""
    mbs = split.get((replica, stage), False)
    if mbs is False:
        return B
    return I if mbs is None or mb in mbs else B


def producer_of(a: Action, num_stages: int, split: dict) -> tuple | None:
    """Token of the pass on a neighbouring stage whose output pass ``a`` consumes.

    ``split`` is :func:`split_stages` of the schedule."""
    if a.op is F:
        if a.stage == 0:
            return None
        return (F, a.replica, a.stage - 1, a.microbatch)
    if a.op is B or a.op is I:
        if a.stage == num_stages - 1:
            return None
        return (backward_op(split, a.replica, a.stage + 1, a.microbatch), a.replica, a.stage + 1, a.microbatch)
    return None


def token_name(token) -> str:
    """Readable name of a token for error messages: the pass, or the send
    that carries a transfer, or the unshard, or the collective."""
    if len(token) == 4:
        op, rep, stage, mb = token
        if op is UNSHARD:
            return f"{format_action(Action(op, stage, replica=rep))} (its all-gather)"
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
    runs, so producer keys are built inline; the rare OVERLAP_F_B pairs are
    joined afterwards (``plan.overlaps``), outside the loop.
    """
    last = schedule.num_stages - 1
    split = split_stages(schedule)
    received = plan.received
    has_collectives = plan.has_collectives
    overlaps = plan.overlaps
    rounds: dict[tuple, int] = defaultdict(int)
    out = []
    for slots in plan.slots:
        last_coll: dict[tuple, tuple] = {}
        entries = []
        append = entries.append
        for posts, a in slots:
            if has_collectives and posts and None in [tok for _, tok in posts]:
                # number each replica's collectives of a stage: round r of
                # every replica is one collective
                posted = []
                for x, tok in posts:
                    if tok is None and x.op is not RESHARD:  # a RESHARD is waited for by nobody
                        k = (x.op, x.stage, x.replica)
                        if x.op is UNSHARD:
                            tok = (UNSHARD, x.replica, x.stage, rounds[k])
                        else:
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
                        (backward_op(split, rep, stage + 1, mb), rep, stage + 1, mb),)
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
                elif op in PASS_OPS:  # passes compute on gathered parameters
                    gathered = last_coll.pop((UNSHARD, rep, stage), None)
                    if gathered is not None:
                        waits += (gathered,)
            append((posts, a, waits, token))
        for j in overlaps.get(len(out), ()):
            # the pair starts as one unit: the forward waits for the
            # backward's inputs too (plan/group post nothing between them)
            fposts, f, fwaits, ftoken = entries[j]
            bposts, b, bwaits, btoken = entries[j + 1]
            entries[j] = (fposts, f, fwaits + bwaits, ftoken)
            entries[j + 1] = (bposts, b, (), btoken)
        out.append(entries)
    return out

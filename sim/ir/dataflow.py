"""What each action waits for and what it makes available: the dataflow of a schedule.

Both the validator's zero-time dry run and the SimPy engine (and the
real-tensor executors in ``pipesim.validate``) need the same answer to "when
may this action run?", so it is computed once, here, as *tokens*: small typed
names for things that become available during execution.

* :class:`PassDone`: a pass has finished, so its output exists on its device;
* :class:`Arrival`: a transfer's data has reached the receiving device. The
  send and the receive carrying it share the token, named by the send's op
  and the sending stage (:func:`transfer_key`);
* :class:`Gathered`: an ``UNSHARD`` has gathered its stage's parameters
  (round r of that replica's stage: the all-gather is within the stage's own
  shard group, not across replicas);
* :class:`CollectiveDone`: round r of a collective (``REDUCE_GRAD``,
  ``AVERAGE``) of a stage, which every replica takes part in.

Tokens are NamedTuples: hashable and as cheap as tuples in the hot loops, and
told apart by their type, never by their length. Two tokens of different
kinds can never be equal, because their first fields differ (a pass's op, a
send's op, a replica number, a collective's op). Each knows how to name
itself in an error message (``describe``).

A compute action waits for the tokens in its ``waits``; communication and
collectives never block the device's walk. The forward of an ``OVERLAP_F_B``
also waits for what its backward needs, so the pair starts as one unit. This
module encodes the execution model documented in :mod:`pipesim.sim.ir.core`.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import repeat
from typing import NamedTuple, Union

from pipesim.sim.ir.core import (
    ALLREDUCE,
    AVERAGE,
    COMPUTE_OPS,
    FLOW,
    OVERLAP_F_B,
    P2P_OPS,
    PASS_OPS,
    RECV_OF,
    REDUCE_GRAD,
    RESHARD,
    SEND_OF,
    SEND_OPS,
    UNSHARD,
    UPDATE,
    Action,
    B,
    F,
    I,
    Op,
    Schedule,
    W,
    format_action,
)


class PassDone(NamedTuple):
    """Pass ``op`` of (replica, stage, micro-batch) has finished on its device."""

    op: Op
    replica: int
    stage: int
    microbatch: int

    def describe(self) -> str:
        return format_action(Action(self.op, self.stage, self.microbatch, replica=self.replica))


class Arrival(NamedTuple):
    """The data that ``send`` (SEND_F or SEND_B) of ``stage`` sends for
    ``microbatch`` has arrived. Which replica sends it follows from the
    routing (:meth:`~pipesim.sim.ir.core.Schedule.replica_of`), so it is not part
    of the name: both ends can spell it without knowing each other."""

    send: Op
    stage: int
    microbatch: int

    def describe(self) -> str:
        return format_action(Action(self.send, self.stage, self.microbatch))


class Gathered(NamedTuple):
    """Round ``round`` of a stage's UNSHARD has gathered its parameters."""

    replica: int
    stage: int
    round: int

    def describe(self) -> str:
        return f"{format_action(Action(UNSHARD, self.stage, replica=self.replica))} (its all-gather)"


class CollectiveDone(NamedTuple):
    """Round ``round`` of collective ``op`` of ``stage`` has run on every replica."""

    op: Op
    stage: int
    round: int

    def describe(self) -> str:
        return f"{self.op.value} of stage {self.stage} (round {self.round}) on every replica"


Token = Union[PassDone, Arrival, Gathered, CollectiveDone]


class Post(NamedTuple):
    """Communication or a collective posted without blocking, and its token
    (``None`` for a RESHARD, which nothing waits for)."""

    action: Action
    token: Token | None


class Entry(NamedTuple):
    """One compute action of a device program with its dataflow.

    ``posts`` go out right before it (see :func:`pipesim.sim.ir.lowering.plan`);
    ``waits`` are the tokens it needs before it may start; ``token`` is what
    it makes available (``None`` for an UPDATE or PREDICT). ``action`` is
    ``None`` for the posts that trail a program.
    """

    posts: tuple[Post, ...]
    action: Action | None
    waits: tuple[Token, ...]
    token: Token | None


#: ``tuple.__new__``: building a NamedTuple through it skips the Python-level
#: ``__new__`` the class call runs, which the hot loops below would pay per action.
_new = tuple.__new__


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
        (a.replica, a.stage) for prog in schedule.programs for a in prog if a.op is I
    )
    if split:
        mixed = {
            (a.replica, a.stage)
            for prog in schedule.programs
            for a in prog
            if a.op is B and (a.replica, a.stage) in split
        }
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


def producer_of(a: Action, replicas: tuple[int, ...], split: dict) -> PassDone | None:
    """Token of the pass on a neighbouring stage whose output pass ``a``
    consumes, on the replica of that stage that runs the micro-batch.

    ``replicas`` is the schedule's per-stage count, ``split`` its
    :func:`split_stages`."""
    step = FLOW.get(a.op) if a.op in PASS_OPS else None
    src = a.stage - step if step else -1
    if not 0 <= src < len(replicas):  # the first forward, the last backward, W
        return None
    rep = a.microbatch % replicas[src]
    op = F if a.op is F else backward_op(split, rep, src, a.microbatch)
    return PassDone(op, rep, src, a.microbatch)


def token_name(token: Token) -> str:
    """Readable name of a token for error messages."""
    return token.describe()


def transfer_key(a: Action) -> Arrival:
    """Identity of a transfer, shared by the send and its receive (called
    for every end of every imported transfer, so built without the class call)."""
    op = a.op
    return _new(Arrival, (SEND_OF[op], a.stage if op in SEND_OPS else a.stage - FLOW[op], a.microbatch))


def compile_plan(schedule: Schedule, plan) -> list[list[Entry]]:
    """Per device, every compute action with its posts, waits and token.

    ``plan`` is a :class:`pipesim.sim.ir.lowering.Plan` (from
    :func:`~pipesim.sim.ir.lowering.plan` or :func:`~pipesim.sim.ir.lowering.group`),
    whose posts already carry their transfer tokens. Written for speed: it
    visits every action the engine runs, so tokens are built inline (as
    :func:`producer_of` and :func:`transfer_key` would); the rare
    OVERLAP_F_B pairs are joined afterwards (``plan.overlaps``), outside the
    loop.
    """
    last = schedule.num_stages - 1
    reps = schedule.replicas
    split = split_stages(schedule)
    received = plan.received
    has_collectives = plan.has_collectives
    overlaps = plan.overlaps
    rounds: dict[tuple, int] = defaultdict(int)
    flow, send_of = FLOW.get, SEND_OF.get
    out = []
    for slots in plan.slots:
        last_coll: dict[tuple, Token] = {}
        entries: list[Entry] = []
        append = entries.append
        for posts, a in slots:
            if has_collectives and posts and None in [tok for _, tok in posts]:
                posts = _number_collectives(posts, rounds, last_coll)
            if a is None:
                append(_new(Entry, (posts, None, (), None)))
                continue
            op, stage, mb, _, _, rep = a  # one unpacking, not four field reads
            waits: tuple = ()
            token = _new(PassDone, (op, rep, stage, mb)) if op in PASS_OPS else None
            step = flow(op) if op is not W else None
            if step is not None:
                src = stage - step  # the stage whose output this pass consumes
                if 0 <= src <= last:
                    key = _new(Arrival, (send_of(op), src, mb))  # through a receive if lowered
                    if key not in received:  # made on this device, by the replica that runs mb
                        src_rep = mb % reps[src]
                        key = _new(PassDone, (F if op is F else backward_op(split, src_rep, src, mb), src_rep, src, mb))
                    waits = (key,)
            if has_collectives:
                waits += _collective_waits(op, rep, stage, last_coll)
            append(_new(Entry, (posts, a, waits, token)))
        for j in overlaps.get(len(out), ()):
            # the pair starts as one unit: the forward waits for the
            # backward's inputs too (plan/group post nothing between them)
            f, b = entries[j], entries[j + 1]
            entries[j] = f._replace(waits=f.waits + b.waits)
            entries[j + 1] = b._replace(waits=())
        out.append(entries)
    return out


def compile_lowered(schedule: Schedule, recv_lookahead: int = 1) -> list[list[Entry]] | None:
    """``compile_plan(schedule, plan(schedule, recv_lookahead=...))`` in one
    pass, for a compute-only schedule: the entries the engine runs, built
    straight from the programs with no plan in between.

    The lowering (:func:`pipesim.sim.ir.lowering.plan`) and the compilation
    each visit every action and build a slot or an entry per compute action
    and a token per transfer twice; here each transfer's token is built
    once, serving its receive's post and its consumer's wait. Every pass
    runs once (the validator's rule), so a consumer waits for a receive
    exactly when its producer is on another device. ``None`` for a schedule
    that carries its own communication or pairs passes in an OVERLAP_F_B
    (whose posts the lowering moves across slots), which the two passes
    handle.
    """
    where = schedule.placement()
    # device_of[k + 1][r]: where replica r of stage k runs ([-1] past either end)
    device_of = [[-1]] + [[where[(r, k)] for r in range(n)] for k, n in enumerate(schedule.replicas)] + [[-1]]
    split = split_stages(schedule)
    rounds: dict[tuple, int] = defaultdict(int)
    out = []
    for dev, prog in enumerate(schedule.programs):
        entries = _device_entries(dev, prog, device_of, split, rounds, recv_lookahead)
        if entries is None:
            return None
        out.append(entries)
    return out


def _device_entries(dev: int, prog, device_of: list, split: dict, rounds: dict, lookahead: int) -> list[Entry] | None:
    """:func:`compile_lowered`'s entries of one program (``None`` at its first
    transfer or OVERLAP_F_B). Written flat: it visits every action of every
    simulation."""
    computes: list[Action] = []
    waits_of: list[tuple] = []
    tokens: list = []
    posts: list[list] = [[]]  # posts[j]: before compute j; one extra for the tail
    last_coll: dict[tuple, Token] = {}
    flow = FLOW.get
    for a in prog:
        op, stage, mb, _, _, rep = a  # one unpacking, not four field reads
        if op not in COMPUTE_OPS:
            if op in P2P_OPS or op is OVERLAP_F_B:
                return None
            posts[-1].append(_numbered(a, rounds, last_coll))  # a collective or FSDP action
            continue
        j = len(computes)
        computes.append(a)
        after: list = []
        posts.append(after)
        tokens.append(_new(PassDone, (op, rep, stage, mb)) if op in PASS_OPS else None)
        waits: tuple = ()
        step = flow(op)
        if step is not None:  # W, UPDATE and PREDICT move no data across stages
            # the input comes from stage - step, the output goes to stage +
            # step, each on the replica there that runs this micro-batch
            src_stage = stage - step
            src, dst = device_of[src_stage + 1], device_of[stage + step + 1]
            if src[0] >= 0:
                src_rep = mb % len(src)
                if src[src_rep] != dev:  # received, posted ahead of this pass
                    key = _new(Arrival, (SEND_OF[op], src_stage, mb))
                    posts[j - lookahead if j > lookahead else 0].append(
                        _new(Post, (_new(Action, (RECV_OF[op], stage, mb, None, 0, rep)), key))
                    )
                else:  # made on this device
                    key = _new(
                        PassDone, (F if op is F else backward_op(split, src_rep, src_stage, mb), src_rep, src_stage, mb)
                    )
                waits = (key,)
            if dst[0] >= 0 and dst[mb % len(dst)] != dev:  # sent right after
                send = SEND_OF[op]
                after.append(
                    _new(Post, (_new(Action, (send, stage, mb, None, 0, rep)), _new(Arrival, (send, stage, mb))))
                )
        if last_coll:
            waits += _collective_waits(op, rep, stage, last_coll)
        waits_of.append(waits)
    entries = list(map(_new, repeat(Entry), zip(map(tuple, posts), computes, waits_of, tokens)))
    if posts[-1]:
        entries.append(_new(Entry, (tuple(posts[-1]), None, (), None)))
    return entries


def _number_collectives(posts: tuple, rounds: dict, last_coll: dict) -> tuple:
    """Give each posted collective and UNSHARD its token (:func:`_numbered`)."""
    return tuple(_numbered(x, rounds, last_coll) if tok is None else Post(x, tok) for x, tok in posts)


def _numbered(x: Action, rounds: dict, last_coll: dict) -> Post:
    """The post of collective or FSDP action ``x`` with its token: round r
    of every replica's collective of a stage is one collective; each
    (replica, stage)'s UNSHARDs are numbered on their own. ``last_coll``
    keeps the latest token of each, for the compute action that must wait
    for it. A RESHARD keeps no token: nobody waits for it."""
    if x.op is RESHARD:
        return Post(x, None)
    k = (x.op, x.stage, x.replica)
    if x.op is UNSHARD:
        tok = Gathered(x.replica, x.stage, rounds[k])
    else:
        tok = CollectiveDone(x.op, x.stage, rounds[k])
    rounds[k] += 1
    last_coll[(x.op, x.replica, x.stage)] = tok
    return Post(x, tok)


def _collective_waits(op: Op, rep: int, stage: int, last_coll: dict) -> tuple:
    """What a compute action of (replica, stage) waits for besides its data:
    any compute action waits for the stage's last AVERAGE, an UPDATE for its
    REDUCE_GRAD, a pass for its UNSHARD (passes compute on gathered weights)."""
    waits: tuple = ()
    avg = last_coll.pop((AVERAGE, rep, stage), None)
    if avg is not None:
        waits += (avg,)
    act = last_coll.pop((ALLREDUCE, rep, stage), None)  # tensor parallelism: the next pass needs the sum
    if act is not None:
        waits += (act,)
    if op is UPDATE:
        red = last_coll.pop((REDUCE_GRAD, rep, stage), None)
        if red is not None:
            waits += (red,)
    elif op in PASS_OPS:
        gathered = last_coll.pop((UNSHARD, rep, stage), None)
        if gathered is not None:
            waits += (gathered,)
    return waits

"""Validation pass: reject a broken schedule before anything executes it.

Two kinds of check run here, in one walk over the programs:

* **Structure and versions.** Ids in range; each (replica, stage,
  micro-batch) has exactly one forward and either one full backward or one
  I and one W (a stage may choose per micro-batch, as DualPipeV does);
  forward before backward and I before W in program order; a stage lives on
  one device; an OVERLAP_F_B pairs a forward and a full backward whose own
  forward ran before the pair; a stage with FSDP actions computes only
  between an UNSHARD and the next RESHARD, on its own device; updates produce versions 1, 2, 3, ... and every
  gradient is consumed by a later update; every pass reads a version that
  exists (an update for it ran earlier on that device); a pass on predicted
  weights follows a PREDICT that materialised exactly that (version,
  distance); sends and receives pair up; collectives have the same count on
  every replica.
* **Deadlock.** An abstract execution of the execution model in
  :mod:`pipesim.sim.ir.core` with zero durations: devices advance while their next
  action is ready. If some device never finishes, the schedule would hang on
  any executor, and the error names the chain of actions that wait on each
  other, e.g. ``1F0 (device 1) waits for 1RECV_F0 (device 1), which waits
  for 0SEND_F0 (device 0) ...``.

Every executor calls :func:`validate` first, so none of them needs its own
hang detection for well-formed input.
"""

from __future__ import annotations

from collections import defaultdict, deque

from pipesim.sim.ir.core import (
    COLLECTIVE_OPS,
    FLOW,
    FSDP_OPS,
    MICROBATCH_OPS,
    OVERLAP_F_B,
    PASS_OPS,
    PREDICT,
    RECV_B,
    RECV_F,
    RECV_OF,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    SEND_OPS,
    UNSHARD,
    UPDATE,
    WEIGHT_GRADIENT_OPS,
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    format_action,
    program_cells,
    routed,
)
from pipesim.sim.ir.dataflow import Arrival, Gathered, backward_op, compile_plan, producer_of, split_stages, token_name
from pipesim.sim.ir.dataflow import transfer_key as send_key


def validate(schedule: Schedule, *, deadlock: bool = True) -> None:
    """Raise :class:`ScheduleError` naming the first problem found.

    ``deadlock=False`` skips the dry run, for callers that execute the
    schedule right away: the engine stops when no event is left and reports
    a stuck schedule with the same wait-cycle message, so checking twice
    would only cost time.
    """
    _check_structure(schedule)
    if deadlock:
        _check_deadlock(schedule)


def _name(op, replica: int, stage: int, mb=None) -> str:
    return format_action(Action(op, stage, mb, replica=replica))


def _check_ranges(s: Schedule) -> None:
    """Ids in range, checked a whole program at a time (the common case is
    fine, so only a failing program is walked action by action)."""
    p, r_count, total = s.num_stages, s.num_replicas, s.total_microbatches
    uniform = len(set(s.replicas)) == 1
    for dev, prog in enumerate(s.programs):
        if not prog:
            continue
        ops, stages, mbs, _, distances, reps = zip(*prog)  # the fields as columns, transposed in C
        mbs = [mb for op, mb in zip(ops, mbs) if op in MICROBATCH_OPS]
        if (
            min(stages) >= 0
            and max(stages) < p
            and min(reps) >= 0
            and max(reps) < r_count
            and (not mbs or (min(mbs) >= 0 and max(mbs) < total))
            and min(distances) >= 0
            and (uniform or all(a.replica < s.replicas[a.stage] for a in prog))
        ):
            continue
        for a in prog:
            if not 0 <= a.stage < p:
                raise ScheduleError(f"{a} on device {dev}: stage {a.stage} out of range 0..{p - 1}")
            if not 0 <= a.replica < s.replicas[a.stage]:
                raise ScheduleError(
                    f"{a} on device {dev}: replica {a.replica} out of range "
                    f"0..{s.replicas[a.stage] - 1} (stage {a.stage} has {s.replicas[a.stage]})"
                )
            if a.op in MICROBATCH_OPS and not 0 <= a.microbatch < total:
                raise ScheduleError(f"{a} on device {dev}: micro-batch {a.microbatch} out of range 0..{total - 1}")
            if a.distance < 0:
                raise ScheduleError(f"{a}: negative prediction distance")


def _check_structure(s: Schedule) -> None:
    _check_ranges(s)
    placement = s.placement()
    split = split_stages(s)
    walk = _ProgramWalk(split, s.replicas)
    for dev, prog in enumerate(s.programs):
        walk.check(dev, prog)
    for stage, n in enumerate(s.replicas):
        for rep in range(n):
            if (rep, stage) not in placement:
                raise ScheduleError(f"replica {rep} stage {stage} has no actions on any device")
    if walk.sharded:
        _check_shards(s, placement)
    _check_complete(s, walk.seen, placement, split)
    if walk.sends or walk.recvs:
        _check_transfers(s, walk.seen, walk.sends, walk.recvs, placement, split)
    _check_collectives(s)


class _ProgramWalk:
    """Checks each action of a device's program against what the program did
    before it, with one check per kind of action (dispatched on the op).

    Across devices it collects ``seen`` (each pass's position; its device is
    ``placement``'s) and the two ends of every transfer (token -> (device,
    position)) for the checks that need every device.
    """

    def __init__(self, split: dict, replicas: tuple[int, ...]) -> None:
        self.split = split
        self.replicas = replicas
        self.seen: dict[tuple, int] = {}
        self.sends: dict[tuple, tuple[int, int]] = {}
        self.recvs: dict[tuple, tuple[int, int]] = {}
        self.sharded = False  # any UNSHARD/RESHARD: checked in a walk of their own
        self.plain = not split  # no split backward anywhere: programs may take the fast path
        self.routed = max(replicas) > 1

    def check(self, dev: int, prog) -> None:
        if self.plain and self._check_plain(prog):
            return
        self.dev, self.prog = dev, prog
        self.current: dict[tuple[int, int], int] = defaultdict(int)  # version now
        self.pending: dict[tuple[int, int], Action] = {}  # first unconsumed gradient
        # gradients a REDUCE_GRAD closed for the next UPDATE (None: it closed none)
        self.closed: dict[tuple[int, int], Action | None] = {}
        self.predicted: dict[tuple[int, int], tuple[int, int]] = {}
        checks = _CHECKS
        for pos, a in enumerate(prog):
            check = checks.get(a.op)
            if check is not None:  # collectives are checked across replicas afterwards
                check(self, a, pos)
        left = [a for a in (*self.pending.values(), *self.closed.values()) if a is not None]
        if left:
            a = min(left)
            raise ScheduleError(
                f"the gradient of {a} is never applied: no UPDATE of stage {a.stage} follows it on device {dev}"
            )

    def _check_plain(self, prog) -> bool:
        """The checks of :meth:`check` for the common program, full
        backwards (F, B) and UPDATEs only, in one loop instead of a method
        call per action (a large schedule has a hundred thousand passes).

        True if the program has nothing else and passes every check (its
        passes are then in ``seen``); False otherwise, with nothing
        recorded, so the walk names the problem or checks what this does not.
        """
        seen = self.seen
        before = len(seen)
        current: dict[tuple[int, int], int] = {}  # version now, where an update ran
        pending: set[tuple[int, int]] = set()  # gradients not applied yet
        replicas, routed = self.replicas, self.routed
        ok = True
        for pos, (op, stage, mb, v, dist, rep) in enumerate(prog):
            if op is UPDATE:
                rs = (rep, stage)
                if v != current.get(rs, 0) + 1:
                    ok = False
                    break
                current[rs] = v
                pending.discard(rs)
                continue
            key = (op, rep, stage, mb)
            if (
                (op is not F and op is not B)
                or v is None
                or dist
                or (v and v > current.get((rep, stage), 0))
                or (routed and mb % replicas[stage] != rep)
                or key in seen
            ):
                ok = False
                break
            if op is B:
                if (F, rep, stage, mb) not in seen:
                    ok = False
                    break
                pending.add((rep, stage))
            seen[key] = pos
        if ok and not pending:
            return True
        for key in list(seen)[before:]:  # undo: dicts keep insertion order
            del seen[key]
        return False

    def forward(self, a: Action, pos: int) -> None:
        self._pass(a, pos)

    def backward(self, a: Action, pos: int) -> None:
        """B, I or W: after what it needs (F, or I for a W), once per
        micro-batch (a backward is B, or I then W), its gradient pending."""
        op, rep, stage, mb = a.op, a.replica, a.stage, a.microbatch
        seen, rs = self.seen, (rep, stage)
        if rs in self.split and op is not W:
            other = I if op is B else B
            if (other, rep, stage, mb) in seen:
                raise ScheduleError(
                    f"{a} on device {self.dev}: micro-batch {mb} of stage {stage} already ran "
                    f"{_name(other, rep, stage, mb)}; a backward is either B, or I then W"
                )
        before = I if op is W else F
        if (before, rep, stage, mb) not in seen:
            raise ScheduleError(f"{a} on device {self.dev} runs before {_name(before, rep, stage, mb)}")
        if op in WEIGHT_GRADIENT_OPS and rs not in self.pending:
            self.pending[rs] = a
        self._pass(a, pos)

    def _pass(self, a: Action, pos: int) -> None:
        """Every pass: once only, on a version that exists, on predicted
        weights only after the PREDICT that made them."""
        rs = (a.replica, a.stage)
        key = (a.op, a.replica, a.stage, a.microbatch)
        if key in self.seen:
            raise ScheduleError(f"{a} appears twice on device {self.dev}")
        n = self.replicas[a.stage]
        if n > 1 and a.microbatch % n != a.replica:
            raise ScheduleError(
                f"{a} on device {self.dev}: micro-batch {a.microbatch} of stage {a.stage} runs on "
                f"its replica {a.microbatch % n} (round robin over {n}), not replica {a.replica}"
            )
        self.seen[key] = pos
        v = a.version
        if v is None:
            raise ScheduleError(f"{a} names no weight version")
        if v and v > self.current[rs]:
            raise ScheduleError(
                f"{a} reads version {v} but stage {a.stage} holds version "
                f"{self.current[rs]} at that point on device {self.dev}"
            )
        if a.distance and self.predicted.get(rs) != (v, a.distance):
            raise ScheduleError(
                f"{a} reads weights predicted {a.distance} ahead of version {v} "
                f"but no PREDICT@v{v}+p{a.distance} of stage {a.stage} precedes it"
            )

    def transfer_end(self, a: Action, pos: int) -> None:
        ends = self.sends if a.op in SEND_OPS else self.recvs
        key = send_key(a)
        if key in ends:
            raise ScheduleError(f"{a} appears twice (devices {ends[key][0]} and {self.dev})")
        ends[key] = (self.dev, pos)

    def update(self, a: Action, pos: int) -> None:
        rs = (a.replica, a.stage)
        if a.version != self.current[rs] + 1:
            raise ScheduleError(
                f"{a} on device {self.dev}: stage {a.stage} is at version {self.current[rs]}, "
                f"so its next update produces version {self.current[rs] + 1}"
            )
        self.current[rs] = a.version
        if rs in self.closed:  # it applies what its REDUCE_GRAD closed; later gradients wait
            del self.closed[rs]
        else:
            self.pending.pop(rs, None)
        self.predicted.pop(rs, None)

    def reduce(self, a: Action, pos: int) -> None:
        """REDUCE_GRAD closes the gradients accumulated so far for the next
        UPDATE (see :mod:`pipesim.sim.ir.core`); one at a time. Its replicas are
        checked across devices afterwards."""
        rs = (a.replica, a.stage)
        if rs in self.closed:
            raise ScheduleError(
                f"{a} on device {self.dev}: the gradients the previous REDUCE_GRAD of stage "
                f"{a.stage} closed are not applied yet: an UPDATE must come between"
            )
        self.closed[rs] = self.pending.pop(rs, None)

    def predict(self, a: Action, pos: int) -> None:
        rs = (a.replica, a.stage)
        if a.version is None or a.version > self.current[rs]:
            raise ScheduleError(f"{a} predicts from a version stage {a.stage} does not hold")
        self.predicted[rs] = (a.version, a.distance)

    def overlap(self, a: Action, pos: int) -> None:
        _check_overlap(self.prog, pos, self.dev, self.seen)

    def shard(self, a: Action, pos: int) -> None:
        self.sharded = True


#: The check of each kind of action (a table on the class rather than of
#: bound methods, which would keep the walk alive in a reference cycle).
_CHECKS = {
    F: _ProgramWalk.forward,
    B: _ProgramWalk.backward,
    I: _ProgramWalk.backward,
    W: _ProgramWalk.backward,
    SEND_F: _ProgramWalk.transfer_end,
    SEND_B: _ProgramWalk.transfer_end,
    RECV_F: _ProgramWalk.transfer_end,
    RECV_B: _ProgramWalk.transfer_end,
    UPDATE: _ProgramWalk.update,
    REDUCE_GRAD: _ProgramWalk.reduce,
    PREDICT: _ProgramWalk.predict,
    OVERLAP_F_B: _ProgramWalk.overlap,
    UNSHARD: _ProgramWalk.shard,
    RESHARD: _ProgramWalk.shard,
}


def _check_complete(s: Schedule, seen: dict, placement: dict, split: dict) -> None:
    """Every micro-batch runs every stage forward and backward, on the
    replica it is routed to. Pass keys are unique, in range and routed, and
    no micro-batch has both B and I, so a full count means none is missing;
    only a short count is searched for the missing pass."""
    total = s.total_microbatches
    expected = 2 * total * s.num_stages
    for (rep, stage), mbs in split.items():
        expected += len(routed(0, total, s.replicas[stage], rep)) if mbs is None else len(mbs)
    if len(seen) == expected:
        return
    for stage in range(s.num_stages):
        for mb in range(total):
            rep = s.replica_of(stage, mb)
            split_here = backward_op(split, rep, stage, mb) is I
            for op in (F, I, W) if split_here else (F, B):
                if (op, rep, stage, mb) not in seen:
                    raise ScheduleError(
                        f"{_name(op, rep, stage, mb)} is missing: every micro-batch needs "
                        f"one forward and one backward per stage"
                    )


def _check_collectives(s: Schedule) -> None:
    """Every replica of a stage takes part in its collectives the same number of times."""
    counts: dict[tuple, int] = defaultdict(int)
    for prog in s.programs:
        for a in prog:
            if a.op in COLLECTIVE_OPS:
                counts[(a.op, a.stage, a.replica)] += 1
    for (op, stage, rep), n in sorted(counts.items(), key=str):
        for other in range(s.replicas[stage]):
            if counts.get((op, stage, other), 0) != n:
                raise ScheduleError(
                    f"stage {stage}: replica {rep} runs {op.value} {n} times but replica {other} "
                    f"{counts.get((op, stage, other), 0)} times; collectives need every replica"
                )


def _check_overlap(prog, pos: int, dev: int, seen: dict) -> None:
    """An OVERLAP_F_B marker is followed by a forward and a full backward; the
    two run as one unit, so the backward's own forward must have run before."""
    pair = prog[pos + 1 : pos + 3]
    if len(pair) < 2 or pair[0].op is not F or pair[1].op is not B:
        got = " ".join(map(str, pair)) or "nothing"
        raise ScheduleError(f"OVERLAP_F_B on device {dev} must be followed by a forward and a full backward, got {got}")
    b = pair[1]
    if (F, b.replica, b.stage, b.microbatch) not in seen:
        cell = program_cells(prog[pos : pos + 3])[0]
        raise ScheduleError(
            f"{cell} on device {dev}: {b}'s forward {_name(F, b.replica, b.stage, b.microbatch)} "
            f"must run before the pair, whose halves start together"
        )


def _check_shards(s: Schedule, placement: dict) -> None:
    """FSDP actions: on their stage's device, UNSHARD and RESHARD alternating
    per stage, and every pass of a stage that has them between an UNSHARD
    and the next RESHARD (what torch's runtime asserts for FSDP stages)."""
    sharded = {(a.replica, a.stage) for prog in s.programs for a in prog if a.op in FSDP_OPS}
    for dev, prog in enumerate(s.programs):
        gathered: set[tuple[int, int]] = set()
        for a in prog:
            rs = (a.replica, a.stage)
            if rs not in sharded:
                continue
            op = a.op
            if op is UNSHARD or op is RESHARD:
                if placement.get(rs, dev) != dev:
                    raise ScheduleError(
                        f"{a} on device {dev}: replica {a.replica} stage {a.stage} runs on device {placement[rs]}"
                    )
                if (op is UNSHARD) == (rs in gathered):
                    state = (
                        "already unsharded (no RESHARD since its last UNSHARD)"
                        if op is UNSHARD
                        else "not unsharded (no UNSHARD precedes it)"
                    )
                    raise ScheduleError(f"{a} on device {dev}: stage {a.stage} is {state}")
                if op is UNSHARD:
                    gathered.add(rs)
                else:
                    gathered.discard(rs)
            elif op in PASS_OPS and rs not in gathered:
                raise ScheduleError(
                    f"{a} on device {dev} computes on stage {a.stage}'s sharded parameters: "
                    f"no UNSHARD precedes it since the last RESHARD"
                )


def _check_transfers(s: Schedule, seen: dict, sends: dict, recvs: dict, placement: dict, split: dict) -> None:
    """Sends and receives pair up; a send follows its producer and a receive
    precedes its consumer, each on the right device; every pass whose input
    comes from another device has a receive.

    ``sends`` and ``recvs`` map each transfer's token to the (device,
    position) of that end. Every imported torch schedule with communication
    is checked here before it is simulated, so the pairs are matched by token
    and counted rather than by looking every pass up."""
    if sends.keys() != recvs.keys():
        key = min(sends.keys() ^ recvs.keys(), key=str)
        if key in sends:
            raise ScheduleError(f"{key.describe()} on device {sends[key][0]} has no matching receive")
        cstage = key.stage + FLOW[key.send]
        recv = _name(RECV_OF[key.send], s.replica_of(cstage, key.microbatch), cstage, key.microbatch)
        raise ScheduleError(f"{recv} on device {recvs[key][0]} has no matching send")
    crossing = 0  # receives of data that really crosses devices
    get, home, reps = seen.get, placement.get, s.replicas
    for key, (sdev, spos) in sends.items():
        op, stage, mb = key
        cstage = stage + FLOW[op]
        rep, crep = mb % reps[stage], mb % reps[cstage]  # the replicas that run mb on either side
        if op is SEND_F:
            prod, consumer = (F, rep, stage, mb), (F, crep, cstage, mb)
        else:
            prod = (backward_op(split, rep, stage, mb), rep, stage, mb)
            consumer = (backward_op(split, crep, cstage, mb), crep, cstage, mb)
        pdev = home((rep, stage))
        ppos = get(prod)
        if pdev != sdev or ppos is None or ppos > spos:
            raise ScheduleError(f"{key.describe()} is not after {_name(*prod)} on device {pdev}")
        rdev, rpos = recvs[key]
        cdev = home((crep, cstage))
        cpos = get(consumer)
        if rdev != cdev or cpos is None or cpos < rpos:
            raise ScheduleError(
                f"{_name(*consumer)} on device {cdev} needs data from device {pdev} but no "
                f"{_name(RECV_OF[op], crep, cstage, mb)} precedes it"
            )
        crossing += cdev != pdev
    if crossing == _crossings(s, placement):
        return
    for (op, rep, stage, mb), pos in seen.items():  # name a pass whose input never arrives
        if op is W:
            continue
        a = Action(op, stage, mb, replica=rep)
        prod = producer_of(a, s.replicas, split)
        dev = placement[(rep, stage)]
        if (
            prod is not None
            and placement[(prod.replica, prod.stage)] != dev
            and send_key(Action(RECV_OF[op], stage, mb, replica=rep)) not in recvs
        ):
            raise ScheduleError(
                f"{a} on device {dev} needs data from device {placement[(prod.replica, prod.stage)]} "
                f"but no {_name(RECV_OF[op], rep, stage, mb)} precedes it"
            )


def _crossings(s: Schedule, placement: dict) -> int:
    """Transfers a complete schedule needs: a forward and a backward for every
    micro-batch whose two neighbouring stages run it on different devices."""
    needed = 0
    reps, total = s.replicas, s.total_microbatches
    for stage in range(s.num_stages - 1):
        r0, r1 = reps[stage], reps[stage + 1]
        if r0 == r1:  # the common case: replica r feeds replica r, the same for every mb
            needed += 2 * sum(
                len(routed(0, total, r0, r)) for r in range(r0) if placement[(r, stage)] != placement[(r, stage + 1)]
            )
        else:
            needed += 2 * sum(
                1 for mb in range(total) if placement[(mb % r0, stage)] != placement[(mb % r1, stage + 1)]
            )
    return needed


def _check_deadlock(s: Schedule) -> None:
    """Abstract execution with zero durations; raise naming a waiting cycle."""
    from pipesim.sim.ir.lowering import group  # lowering builds on this module

    programs = compile_plan(s, group(s))
    where = providers(programs)
    # posts of a token before it is done: both ends of a transfer, the one
    # UNSHARD of its stage, or every replica of a collective's stage
    done: set = set()
    posted: dict[object, int] = defaultdict(int)  # transfer/collective -> participants posted
    pc = [0] * s.num_devices
    waiting_on: dict[object, list[int]] = defaultdict(list)
    blocked: dict[int, tuple] = {}
    ready = deque(range(s.num_devices))

    def finish(token) -> None:
        done.add(token)
        ready.extend(waiting_on.pop(token, ()))

    while ready:
        dev = ready.popleft()
        prog = programs[dev]
        n = len(prog)
        i = pc[dev]
        while i < n:
            posts, a, waits, token = prog[i]
            if dev not in blocked:  # posts go out before the compute waits, once
                for x, tok in posts:  # transfers need both ends, collectives every replica
                    if tok is None:  # a RESHARD: nothing waits for it
                        continue
                    posted[tok] += 1
                    kind = type(tok)
                    if posted[tok] == (2 if kind is Arrival else 1 if kind is Gathered else s.replicas[tok.stage]):
                        finish(tok)
            blocked.pop(dev, None)
            need = next((t for t in waits if t not in done), None)
            if need is not None:
                blocked[dev] = (a, need)
                waiting_on[need].append(dev)
                break
            i += 1
            if token is not None:
                finish(token)
        pc[dev] = i
    stuck = [d for d in range(s.num_devices) if pc[d] < len(programs[d])]
    if stuck:
        raise ScheduleError("schedule deadlocks: " + describe_wait_cycle(stuck, blocked, where, s))


def providers(programs) -> dict:
    """Token -> the device whose progress provides it (a pass, or a transfer's send)."""
    where = {}
    for dev, prog in enumerate(programs):
        for posts, _, _, token in prog:
            if token is not None:
                where[token] = dev
            for x, tok in posts:
                if x.op in SEND_OPS or x.op is UNSHARD:
                    where[tok] = dev
    return where


def _waiting_name(schedule: Schedule | None, dev: int, action: Action) -> str:
    """How a waiting action is named: the pair it starts if it is the forward
    of an OVERLAP_F_B (which waits for its backward's inputs too)."""
    if schedule is not None and action.op is F:
        prog = schedule.programs[dev]
        pos = prog.index(action)
        if pos and prog[pos - 1].op is OVERLAP_F_B:
            return program_cells(prog[pos - 1 : pos + 2])[0]
    return str(action)


def describe_wait_cycle(stuck, blocked, where, schedule: Schedule | None = None) -> str:
    """Follow 'action on device waits for token provided by device' links
    from the first stuck device until a device repeats."""
    parts, seen_devs = [], []
    dev = stuck[0]
    while dev is not None and dev not in seen_devs and dev in blocked:
        seen_devs.append(dev)
        action, token = blocked[dev]
        action = _waiting_name(schedule, dev, action)
        nxt = where.get(token)
        if nxt is None:  # a collective: some other stuck replica has not posted it
            others = [d for d in stuck if d != dev and d in blocked]
            nxt = others[0] if others else None
        parts.append(
            f"{action} (device {dev}) waits for {token_name(token)}"
            + (f" (device {nxt})" if nxt is not None else " (never issued)")
        )
        dev = nxt
    if dev is not None and dev in seen_devs:
        parts.append(f"which waits on device {dev} again")
    return "; ".join(parts)

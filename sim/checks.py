"""Validation pass: reject a broken schedule before anything executes it.

Two kinds of check run here, in one walk over the programs:

* **Structure and versions.** Ids in range; each (replica, stage,
  micro-batch) has exactly one forward and either one full backward or one
  I and one W; forward before backward and I before W in program order; a
  stage lives on one device; updates produce versions 1, 2, 3, ... and every
  gradient is consumed by a later update; every pass reads a version that
  exists (an update for it ran earlier on that device); a pass on predicted
  weights follows a PREDICT that materialised exactly that (version,
  distance); sends and receives pair up; collectives have the same count on
  every replica.
* **Deadlock.** An abstract execution of the execution model in
  :mod:`pipesim.sim.ir` with zero durations: devices advance while their next
  action is ready. If some device never finishes, the schedule would hang on
  any executor, and the error names the chain of actions that wait on each
  other, e.g. ``1F0 (device 1) waits for 1RECV_F0 (device 1), which waits
  for 0SEND_F0 (device 0) ...``.

Every executor calls :func:`validate` first, so none of them needs its own
hang detection for well-formed input.
"""

from __future__ import annotations

from collections import defaultdict, deque

from pipesim.sim.dataflow import bare as _bare
from pipesim.sim.dataflow import producer_of, split_stages, steps
from pipesim.sim.dataflow import transfer_key as send_key
from pipesim.sim.ir import (
    COLLECTIVE_OPS,
    COMPUTE_OPS,
    MICROBATCH_OPS,
    P2P_OPS,
    PASS_OPS,
    PREDICT,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    UPDATE,
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    format_action,
)

def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the first problem found."""
    _check_structure(schedule)
    _check_deadlock(schedule)


def _check_structure(s: Schedule) -> None:
    p, r_count, total = s.num_stages, s.num_replicas, s.total_microbatches
    placement = s.placement()
    split = split_stages(s)
    seen: dict[Action, tuple[int, int]] = {}  # bare pass/comm -> (device, position)
    for dev, prog in enumerate(s.programs):
        current: dict[tuple[int, int], int] = defaultdict(int)  # version now
        pending: dict[tuple[int, int], Action] = {}  # first unconsumed gradient
        predicted: dict[tuple[int, int], tuple[int, int]] = {}
        for pos, a in enumerate(prog):
            name = format_action(a)
            if not 0 <= a.stage < p:
                raise ScheduleError(f"{name} on device {dev}: stage {a.stage} out of range 0..{p - 1}")
            if not 0 <= a.replica < r_count:
                raise ScheduleError(f"{name} on device {dev}: replica {a.replica} out of range 0..{r_count - 1}")
            if a.op in MICROBATCH_OPS and not 0 <= a.microbatch < total:
                raise ScheduleError(
                    f"{name} on device {dev}: micro-batch {a.microbatch} out of range 0..{total - 1}"
                )
            if a.distance < 0:
                raise ScheduleError(f"{name}: negative prediction distance")
            rs = (a.replica, a.stage)
            op = a.op
            if op in PASS_OPS or op in P2P_OPS:
                bare = _bare(a)
                if bare in seen:
                    raise ScheduleError(f"{name} appears twice (devices {seen[bare][0]} and {dev})")
                seen[bare] = (dev, pos)
            if op in PASS_OPS:
                if op is B and rs in split:
                    raise ScheduleError(
                        f"{name}: replica {a.replica} stage {a.stage} mixes full backward B with split I/W"
                    )
                if op is not F:
                    before = F if op in (B, I) else I
                    if Action(before, a.stage, a.microbatch, replica=a.replica) not in seen:
                        raise ScheduleError(
                            f"{name} on device {dev} runs before {format_action(Action(before, a.stage, a.microbatch, replica=a.replica))}"
                        )
                if a.version is None:
                    raise ScheduleError(f"{name} names no weight version")
                if a.version > current[rs]:
                    raise ScheduleError(
                        f"{name} reads version {a.version} but stage {a.stage} holds version "
                        f"{current[rs]} at that point on device {dev}"
                    )
                if a.distance and predicted.get(rs) != (a.version, a.distance):
                    raise ScheduleError(
                        f"{name} reads weights predicted {a.distance} ahead of version {a.version} "
                        f"but no PREDICT@v{a.version}+p{a.distance} of stage {a.stage} precedes it"
                    )
                if op in (B, W):
                    pending.setdefault(rs, a)
            elif op is UPDATE:
                if a.version != current[rs] + 1:
                    raise ScheduleError(
                        f"{name} on device {dev}: stage {a.stage} is at version {current[rs]}, "
                        f"so its next update produces version {current[rs] + 1}"
                    )
                current[rs] = a.version
                pending.pop(rs, None)
                predicted.pop(rs, None)
            elif op is PREDICT:
                if a.version is None or a.version > current[rs]:
                    raise ScheduleError(f"{name} predicts from a version stage {a.stage} does not hold")
                predicted[rs] = (a.version, a.distance)
        if pending:
            a = min(pending.values())
            raise ScheduleError(
                f"the gradient of {format_action(a)} is never applied: no UPDATE of "
                f"stage {a.stage} follows it on device {dev}"
            )

    # Completeness: every micro-batch runs every stage forward and backward.
    for (rep, stage) in sorted(placement):
        bwd = (I, W) if (rep, stage) in split else (B,)
        for mb in range(total):
            for op in (F, *bwd):
                if Action(op, stage, mb, replica=rep) not in seen:
                    raise ScheduleError(
                        f"{format_action(Action(op, stage, mb, replica=rep))} is missing: every "
                        f"micro-batch needs one forward and one backward per stage"
                    )
    for rep in range(r_count):
        for stage in range(p):
            if (rep, stage) not in placement:
                raise ScheduleError(f"replica {rep} stage {stage} has no actions on any device")

    # Point-to-point pairs: send after its producer, receive before its consumer.
    sends, recvs = {}, {}
    for bare, (dev, pos) in seen.items():
        if bare.op in (SEND_F, SEND_B):
            sends[send_key(bare)] = (bare, dev, pos)
        elif bare.op in (RECV_F, RECV_B):
            recvs[send_key(bare)] = (bare, dev, pos)
    for key in sends.keys() | recvs.keys():
        if key not in recvs:
            a = sends[key][0]
            raise ScheduleError(f"{format_action(a)} on device {sends[key][1]} has no matching receive")
        if key not in sends:
            a = recvs[key][0]
            raise ScheduleError(f"{format_action(a)} on device {recvs[key][1]} has no matching send")
        send, sdev, spos = sends[key]
        prod = Action(F if send.op is SEND_F else (I if (send.replica, send.stage) in split else B),
                      send.stage, send.microbatch, replica=send.replica)
        pdev, ppos = seen[prod]
        if pdev != sdev or ppos > spos:
            raise ScheduleError(f"{format_action(send)} is not after {format_action(prod)} on device {pdev}")
    lowered = bool(sends)
    if lowered:
        for bare, (dev, pos) in seen.items():
            if bare.op not in (F, B, I):
                continue
            prod = producer_of(bare, p, split)
            if prod is None or seen[prod][0] == dev:
                continue
            recv_op = RECV_F if bare.op is F else RECV_B
            key = send_key(Action(recv_op, bare.stage, bare.microbatch, replica=bare.replica))
            if key not in recvs or recvs[key][1] != dev or recvs[key][2] > pos:
                raise ScheduleError(
                    f"{format_action(bare)} on device {dev} needs data from device {seen[prod][0]} "
                    f"but no {recv_op.value} precedes it"
                )

    # Collectives: every replica of a stage takes part the same number of times.
    counts: dict[tuple, int] = defaultdict(int)
    for prog in s.programs:
        for a in prog:
            if a.op in COLLECTIVE_OPS:
                counts[(a.op, a.stage, a.replica)] += 1
    for (op, stage, rep), n in counts.items():
        for other in range(r_count):
            if counts.get((op, stage, other), 0) != n:
                raise ScheduleError(
                    f"stage {stage}: replica {rep} runs {op.value} {n} times but replica {other} "
                    f"{counts.get((op, stage, other), 0)} times; collectives need every replica"
                )


def _check_deadlock(s: Schedule) -> None:
    """Abstract execution with zero durations; raise naming a waiting cycle."""
    programs = steps(s)
    # Who provides each token: the device of a pass, or of a transfer's send.
    where = {st.token: dev for dev, prog in enumerate(programs) for st in prog
             if st.action.op in PASS_OPS or st.action.op in (SEND_F, SEND_B)}
    done: set = set()
    posted: dict[object, int] = defaultdict(int)  # transfer/collective -> participants posted
    pc = [0] * s.num_devices
    waiting_on: dict[object, list[int]] = defaultdict(list)
    blocked: dict[int, tuple] = {}
    ready = deque(range(s.num_devices))

    def finish(token) -> None:
        done.add(token)
        for d in waiting_on.pop(token, ()):
            blocked.pop(d, None)
            ready.append(d)

    while ready:
        dev = ready.popleft()
        prog = programs[dev]
        while pc[dev] < len(prog):
            st = prog[pc[dev]]
            need = next((t for t in st.waits if t not in done), None)
            if need is not None:
                blocked[dev] = (st.action, need)
                waiting_on[need].append(dev)
                break
            pc[dev] += 1
            op = st.action.op
            if op in COMPUTE_OPS:
                if st.token is not None:
                    finish(st.token)
            else:  # transfers need both ends posted, collectives every replica
                posted[st.token] += 1
                if posted[st.token] == (2 if op in P2P_OPS else s.num_replicas):
                    finish(st.token)
    stuck = [d for d in range(s.num_devices) if pc[d] < len(programs[d])]
    if stuck:
        raise ScheduleError("schedule deadlocks: " + _describe_cycle(stuck, blocked, where))


def _describe_cycle(stuck, blocked, where) -> str:
    """Follow 'device waits for action on device' links until one repeats."""

    def holder(token) -> tuple[str, int | None]:
        # The device whose walk must progress to provide ``token``.
        if isinstance(token, Action):
            return format_action(token), where.get(token)
        if token[0] in ("F", "B"):
            kind, rep, src, mb = token
            send = Action(SEND_F if kind == "F" else SEND_B, src, mb, replica=rep)
            return format_action(send), where.get(token)
        op, stage, rnd = token
        return f"{op} of stage {stage} (round {rnd}) on every replica", None

    parts, seen_devs = [], []
    dev = stuck[0]
    while dev is not None and dev not in seen_devs and dev in blocked:
        seen_devs.append(dev)
        action, token = blocked[dev]
        what, nxt = holder(token)
        if nxt is None and not isinstance(token, Action) and token[0] not in ("F", "B"):
            others = [d for d in stuck if d != dev and d in blocked]
            nxt = others[0] if others else None
        parts.append(f"{format_action(action)} (device {dev}) waits for {what}"
                     + (f" (device {nxt})" if nxt is not None else " (never issued)"))
        dev = nxt
    if dev is not None and dev in seen_devs:
        parts.append(f"which waits on device {dev} again")
    return "; ".join(parts)


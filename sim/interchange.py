"""Bring schedules in from torch.distributed.pipelining and send them back.

torch's CSV holds compute order (and optionally communication and FSDP's
UNSHARD/RESHARD) only: no weight versions and no optimizer step, because every
torch schedule is a flush schedule with one step after the iteration.
Importing therefore adds exactly the semantics pipesim's own flush strategies
have, from the same definition
(:func:`~pipesim.sim.strategies._common.flush_iteration`): micro-batch ``i``
belongs to iteration ``t = i // m``, its passes read version ``t``, and each
stage applies ``UPDATE@v(t+1)`` right after its last backward of the
iteration on its device (after the communication posted with that backward,
among which torch's ``REDUCE_GRAD`` sits, which the update replaces: torch's
CSV is one pipeline, with no replicas to reduce over). A CSV written by
pipesim with versions and its own actions is taken as it is.

The imported schedule is validated (by the engine, when it is simulated right
away), so a broken torch order is rejected with the action at fault. One torch order is known
to be broken: torch 2.13's Schedule1F1B numbers the last rank's forwards
1..m instead of 0..m-1, and that pattern gets a message of its own saying
what to do.
"""

from __future__ import annotations

from pipesim.sim.files import read_text
from pipesim.sim.ir.checks import validate
from pipesim.sim.ir.core import (
    MICROBATCH_OPS,
    OVERLAP_F_B,
    PASS_OPS,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    UPDATE,
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
    csv_header,
    parse_csv,
    to_csv,
)
from pipesim.sim.strategies._common import flush_iteration
from pipesim.sim.workloads.profile import OPTIMIZER_STATE_MULTIPLIER

__all__ = ["schedule_from_csv", "schedule_from_runs", "to_csv", "load_schedule_csv"]


def schedule_from_csv(
    text: str,
    *,
    microbatches: int | None = None,
    iterations: int | None = None,
    strategy: str | None = None,
    check: bool = True,
) -> Schedule:
    """A :class:`Schedule` from a torch or pipesim schedule CSV.

    A pipesim CSV's header gives the strategy name, m, the iterations and
    the strategy's options; arguments given here take precedence. A torch
    CSV carries none of them: ``iterations`` defaults to 1, the strategy to
    "imported", and ``microbatches`` (m) is inferred as one more than the
    largest micro-batch id found (over ``iterations``), which is what
    torch's own loader assumes. With ``check`` the result is validated,
    deadlock dry run included; a caller that simulates it right away can
    leave that to the engine (see :func:`pipesim.sim.engine.core.simulate`).
    """
    header, text = csv_header(text)
    _check_header(header)
    microbatches = header.get("microbatches") if microbatches is None else microbatches
    iterations = header.get("iterations", 1) if iterations is None else iterations
    strategy = header.get("strategy", "imported") if strategy is None else strategy
    if not isinstance(iterations, int) or (microbatches is not None and not isinstance(microbatches, int)):
        raise ScheduleError(
            f"microbatches and iterations must be whole numbers, got {microbatches!r} and {iterations!r}"
        )
    programs = parse_csv(text)
    actions = [a for prog in programs for a in prog]
    num_stages = max(a.stage for a in actions) + 1
    mbs = [a.microbatch for a in actions if a.op in MICROBATCH_OPS]
    if not mbs:
        raise ScheduleError("the schedule CSV has no forward or backward passes")
    if iterations < 1:
        raise ScheduleError(f"iterations must be >= 1, got {iterations}")
    has_versions = any(a.version is not None for a in actions if a.op in PASS_OPS)
    if not has_versions:
        _check_torch_1f1b_numbering(actions, num_stages)
    if microbatches is None:
        microbatches = -(-(max(mbs) + 1) // iterations)
    if microbatches < 1:
        raise ScheduleError(f"microbatches must be >= 1, got {microbatches}")
    if max(mbs) >= microbatches * iterations:  # a run too short for the ids: say what m counts
        said = f" (its header says {header['microbatches']})" if "microbatches" in header else ""
        raise ScheduleError(
            f"the CSV's passes run micro-batches 0..{max(mbs)}, more than m={microbatches} x {iterations} "
            f"iteration(s) hold: an imported schedule's m counts every micro-batch of an iteration, over all "
            f"its replicas{said}"
        )
    replicas = header.get("replicas") or [
        1 + max((a.replica for a in actions if a.stage == k), default=0) for k in range(num_stages)
    ]
    if not has_versions:
        if max(replicas) > 1:
            raise ScheduleError("a CSV with replicas must carry weight versions (pipesim spelling)")
        one = max(mbs) < microbatches
        programs = [_flush_program(prog, microbatches, dev, one) for dev, prog in enumerate(programs)]
    schedule = Schedule(
        strategy=str(strategy),
        num_stages=num_stages,
        num_microbatches=microbatches,
        programs=programs,
        replicas=tuple(replicas),
        num_iterations=iterations,
        options=header.get("options", {}),
    )
    if check:
        validate(schedule)
    return schedule


def _check_header(header: dict) -> None:
    """The header is pipesim's own (``--format csv`` writes it). Its
    strategy is the schedule's name: one this pipesim does not build (an
    imported schedule written back, ``imported``) labels the schedule and
    runs as imported. An optimizer it does not price is named here as the
    header's, not blamed later on the model's profile."""
    name = header.get("strategy")
    if name is not None and not isinstance(name, str):
        raise ScheduleError(f"row 1: the pipesim header's strategy must be a name, got {name!r}")
    optimizer = header.get("options", {}).get("optimizer")
    if optimizer is not None and (not isinstance(optimizer, str) or optimizer not in OPTIMIZER_STATE_MULTIPLIER):
        raise ScheduleError(
            f"row 1: the pipesim header's optimizer must be one of "
            f"{', '.join(OPTIMIZER_STATE_MULTIPLIER)}, got {optimizer!r}"
        )


def _flush_program(prog: list[Action], m: int, dev: int, one_iteration: bool) -> list[Action]:
    """Flush semantics for one device of a torch schedule (one replica).

    The program is cut into iterations at its passes (an OVERLAP_F_B marker
    goes with the forward it precedes; communication and FSDP actions stay
    where they are; ``one_iteration`` says there is nothing to cut, as in
    every CSV torch writes) and each piece gets
    :func:`~pipesim.sim.strategies._common.flush_iteration`. torch's
    REDUCE_GRAD is dropped: with one replica the update takes its place.
    """
    prog = [a for a in prog if a.op is not REDUCE_GRAD]
    ahead = receives_ahead(prog)
    if one_iteration:
        return flush_iteration(prog, 0, reduce=False, receives_ahead=ahead)
    out: list[Action] = []
    start, t, first = 0, 0, None
    for pos, a in enumerate(prog):
        if a.op not in PASS_OPS:
            continue
        it = a.microbatch // m
        if first is None:
            first = a
            t = it
        elif it < t:
            raise ScheduleError(
                f"{a} (iteration {it}) runs after {first} (iteration {t}) on device {dev}: a torch schedule "
                f"imports as a flush schedule, whose iterations do not overlap; give the right --microbatches "
                f"(micro-batch i belongs to iteration i // m, here m = {m})"
            )
        elif it > t:
            cut = pos - 1 if pos and prog[pos - 1].op is OVERLAP_F_B else pos
            out += flush_iteration(prog[start:cut], t, reduce=False, receives_ahead=ahead)
            start, t, first = cut, it, a
    out += flush_iteration(prog[start:], t, reduce=False, receives_ahead=ahead)
    return out


def receives_ahead(prog: list[Action]) -> bool:
    """Whether a program posts its receives ahead of the passes that consume
    them (a lowering with ``recv_lookahead`` of 1 or more): some receive is
    followed by another compute action before its own. A torch CSV has no
    updates, so this is what says on which side of a receive the update
    that was between them went (:func:`flush_iteration`)."""
    waiting: list[Action] = []  # receives posted, their pass not reached yet
    unit: list[Action] = []  # the passes of the compute action under way (an OVERLAP_F_B has two)
    paired = 0  # passes still to come of an OVERLAP_F_B unit
    for a in prog:
        if a.op in (RECV_F, RECV_B):
            waiting.append(a)
        elif a.op is OVERLAP_F_B:
            paired = 2
        elif a.op in PASS_OPS:
            unit.append(a)
            paired = max(paired - 1, 0)
            if paired:
                continue
            if any(not any(_consumes(p, r) for p in unit) for r in waiting):
                return True
            waiting.clear()
            unit.clear()
    return False


def _consumes(a: Action, recv: Action) -> bool:
    """Whether pass ``a`` is the one that ``recv`` brings the input of."""
    return (a.stage, a.microbatch) == (recv.stage, recv.microbatch) and (a.op is F) == (recv.op is RECV_F)


def _check_torch_1f1b_numbering(actions: list[Action], num_stages: int) -> None:
    """Name the one known broken torch order: torch 2.13's Schedule1F1B numbers
    the last rank's forwards 1..n (its ``forward_mb`` is incremented before
    the first steady-state forward when the rank has no warm-up), while its
    backwards and every other stage run 0..n-1."""
    last = num_stages - 1
    if 0 in [a.microbatch for a in actions if a.op is F and a.stage == last]:
        return  # every sound schedule leaves here
    fwd: dict[int, list[int]] = {}
    bwd: list[int] = []
    for a in actions:
        if a.op is F:
            fwd.setdefault(a.stage, []).append(a.microbatch)
        elif (a.op is B or a.op is I) and a.stage == last:
            bwd.append(a.microbatch)
    n = len(bwd)
    if not n or sorted(fwd.get(last, ())) != list(range(1, n + 1)) or sorted(bwd) != list(range(n)):
        return
    if any(sorted(ids) != list(range(n)) for stage, ids in fwd.items() if stage != last):
        return
    raise ScheduleError(
        f"forward of micro-batch 0 missing on stage {last}: its forwards are {last}F1..{last}F{n} but its "
        f"backwards run micro-batches 0..{n - 1}. torch 2.13's Schedule1F1B numbers the last rank's forwards "
        f"from 1 (an off-by-one in the order it exports; its runtime runs 0..{n - 1}), so its CSV "
        f"is not a valid schedule: subtract 1 from every forward id in the last rank's row, or write the same "
        f"order with `pipesim schedule --strategy 1f1b --stages {num_stages} --microbatches {n} --format "
        f"torch-csv`, and import that"
    )


def load_schedule_csv(path, **kwargs) -> Schedule:
    """Read a schedule CSV file; a missing or unreadable file is a ScheduleError."""
    return schedule_from_csv(read_text(path, "schedule", ScheduleError), **kwargs)


def schedule_from_runs(programs, *, microbatches: int, iterations: int, strategy: str = "imported") -> Schedule:
    """The schedule pipesim's own runtime executed, from each device's
    actions in the order it ran them (read from a trace, where a label may
    leave a version out): an ``UPDATE`` without a version makes the next
    one of its (replica, stage); a forward without one reads the versions
    its (replica, stage) has made so far on that device, and a backward the
    version its forward read (weight stashing), which is what every pipesim
    strategy without prediction does."""
    out = []
    stages = 0
    reps: dict[int, int] = {}
    for acts in programs:
        made: dict[tuple[int, int], int] = {}
        read: dict[tuple, int] = {}
        prog = []
        for a in acts:
            stages = max(stages, a.stage + 1)
            reps[a.stage] = max(reps.get(a.stage, 1), a.replica + 1)
            key = (a.replica, a.stage)
            version = a.version
            if a.op is UPDATE:
                made[key] = version if version is not None else made.get(key, 0) + 1
                version = made[key]
            elif a.op in PASS_OPS and version is None:
                if a.op is F:
                    version = read[key + (a.microbatch,)] = made.get(key, 0)
                else:
                    version = read.get(key + (a.microbatch,), made.get(key, 0))
            prog.append(a._replace(version=version))
        out.append(tuple(prog))
    return Schedule(
        strategy=strategy,
        num_stages=stages,
        num_microbatches=microbatches,
        programs=tuple(out),
        num_iterations=max(1, iterations),
        replicas=tuple(reps.get(k, 1) for k in range(stages)),
    )

"""Bring schedules in from torch.distributed.pipelining and send them back.

torch's CSV holds compute order (and optionally communication) only: no weight
versions and no optimizer step, because every torch schedule is a flush
schedule with one step after the iteration. Importing therefore adds exactly
those semantics: every pass reads version 0 and each stage applies one
``UPDATE@v1`` right after its last backward on its device (where torch's
``REDUCE_GRAD`` sits, which it replaces when there is one replica). A CSV
written by pipesim with versions and its own actions is taken as it is.

The imported schedule is validated, deadlock check included, so a broken
torch order (torch 2.13's Schedule1F1B numbers the last rank's forwards
1..m instead of 0..m-1) is rejected with the action at fault.
"""

from __future__ import annotations

from pipesim.sim.checks import validate
from pipesim.sim.ir import (
    MICROBATCH_OPS,
    PASS_OPS,
    REDUCE_GRAD,
    UPDATE,
    Action,
    B,
    Schedule,
    ScheduleError,
    W,
    parse_csv,
    to_csv,
)

__all__ = ["schedule_from_csv", "to_csv", "load_schedule_csv"]


def schedule_from_csv(
    text: str,
    *,
    microbatches: int | None = None,
    iterations: int = 1,
    strategy: str = "imported",
    check: bool = True,
) -> Schedule:
    """A validated :class:`Schedule` from a torch or pipesim schedule CSV.

    ``microbatches`` is m; by default it is inferred as one more than the
    largest micro-batch id found (over ``iterations``), which is what
    torch's own loader assumes. The CSV carries neither, so a round trip
    passes them back in.
    """
    programs = parse_csv(text)
    actions = [a for prog in programs for a in prog]
    num_stages = max(a.stage for a in actions) + 1
    mbs = [a.microbatch for a in actions if a.op in MICROBATCH_OPS]
    if not mbs:
        raise ScheduleError("the schedule CSV has no forward or backward passes")
    if iterations < 1:
        raise ScheduleError(f"iterations must be >= 1, got {iterations}")
    if microbatches is None:
        microbatches = -(-(max(mbs) + 1) // iterations)
    if microbatches < 1:
        raise ScheduleError(f"microbatches must be >= 1, got {microbatches}")
    num_replicas = max(a.replica for a in actions) + 1
    has_versions = any(a.version is not None for a in actions if a.op in PASS_OPS)
    if not has_versions:
        if num_replicas > 1:
            raise ScheduleError("a CSV with replicas must carry weight versions (pipesim spelling)")
        programs = [_add_flush_semantics(prog) for prog in programs]
    schedule = Schedule(
        strategy=strategy,
        num_stages=num_stages,
        num_microbatches=microbatches,
        programs=programs,
        num_replicas=num_replicas,
        num_iterations=iterations,
    )
    if check:
        validate(schedule)
    return schedule


def _add_flush_semantics(prog: list[Action]) -> list[Action]:
    """Version 0 for every pass and one UPDATE per stage after its last backward."""
    last_bwd: dict[int, int] = {}
    for pos, a in enumerate(prog):
        if a.op is B or a.op is W:
            last_bwd[a.stage] = pos
    out = []
    for pos, a in enumerate(prog):
        if a.op is REDUCE_GRAD:
            continue  # one replica: the update takes its place
        out.append(a._replace(version=0) if a.op in PASS_OPS else a)
        for stage, last in last_bwd.items():
            if last == pos:
                out.append(Action(UPDATE, stage, version=1))
    return out


def load_schedule_csv(path, **kwargs) -> Schedule:
    """Read a schedule CSV file; a missing or unreadable file is a ScheduleError."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise ScheduleError(f"cannot read schedule file {path}: {e.strerror}") from None
    return schedule_from_csv(text, **kwargs)

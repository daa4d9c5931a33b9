"""The schedule IR: what every device does, in order, and which weights it reads.

A :class:`Schedule` is, for each device, the ordered tuple of :class:`Action` s
that device executes. The same object feeds the SimPy engine, the
single-process emulator and the distributed runtime, so everything a strategy
means lives here as data:

* every forward/backward names the weight **version** it reads (and, for
  prediction strategies, the prediction **distance**), so stashing, double
  buffering and prediction are visible in the schedule rather than hidden in
  an executor;
* an ``UPDATE`` names the version it produces;
* micro-batch ids are global across iterations, so asynchronous schedules run
  many iterations without a flush (iteration ``t`` owns micro-batches
  ``t*m .. t*m+m-1``);
* ``replica`` distinguishes parallel pipelines (width x depth, AvgPipe, data
  parallelism).

Execution model, shared by every executor
-----------------------------------------
Each device walks its tuple in order. Compute actions (F, B, I, W, UPDATE,
PREDICT) run on the device's compute stream and block the walk until they
finish. Communication actions never block the walk: ``SEND_*`` is issued
and completes once its data exists and the matching ``RECV_*`` has been
posted; ``RECV_*`` is posted when reached and completes when the data has
arrived. ``REDUCE_GRAD`` (gradient all-reduce across replicas) and ``AVERAGE``
(elastic averaging of the replicas with their centre) are collectives: posted
like a receive, they run on the collective stream once every replica of the
stage has posted them (replicas may share a device). ``ALLREDUCE`` (tensor
parallelism) is one too: the activation all-reduces of one pass of the
stage, summed across its replicas (the tensor-parallel group). The next
``UPDATE`` of that (replica, stage) waits for its ``REDUCE_GRAD``; the next
compute action of that (replica, stage) waits for its ``AVERAGE`` and its
``ALLREDUCE``. A compute action waits
for the data it consumes (a receive, or a producer on the same device).

Gradients: a (replica, stage) accumulates the weight gradient of every
``B`` (or ``W``) into its gradient buffer, and an ``UPDATE`` applies the
gradients accumulated since the previous one, unless a ``REDUCE_GRAD``
came between: a ``REDUCE_GRAD`` *closes* the gradients accumulated so far
(those are what it all-reduces and what the next ``UPDATE`` applies), and
passes after it accumulate into a second buffer until that ``UPDATE``. So
the update may come later than the all-reduce's post, with passes in
between (PipeDream-2BW hides the all-reduce behind the next window this
way); a second ``REDUCE_GRAD`` before that ``UPDATE`` is an error. Flush
strategies place the ``UPDATE`` right after its ``REDUCE_GRAD``, where the
two readings coincide.

A micro-batch's backward on a stage is either one full ``B`` or an ``I``
followed later by a ``W``; a stage may choose per micro-batch (DualPipeV
does). Whichever pass it is produces the input gradient the previous stage
consumes.

``UNSHARD`` / ``RESHARD`` (torch's FSDP actions) are posted like a receive:
``UNSHARD`` gathers a stage's sharded parameters (an all-gather; instant when
nothing is sharded) and the stage's next pass waits for it; ``RESHARD``
frees them. A stage that has them computes only between an ``UNSHARD`` and
the next ``RESHARD``.

``OVERLAP_F_B`` (torch's DualPipeV) runs a forward and a full backward as one
unit: it starts once both have their inputs, runs the two back to back, and
sends both results after it. In a program it is a marker action followed by
its two passes, so everything that reads passes sees ordinary F and B; CSVs
spell the three as one cell, ``(0F7;7B3)OVERLAP_F_B``, as torch does.

Spelling
--------
Actions that torch.distributed.pipelining has are spelled as torch spells
them (``0F1``, ``2B0``, ``1I3``, ``1W3``, ``0SEND_F1``, ``1RECV_B2``,
``0REDUCE_GRAD``); torch's own parser reads the leading part of every
pipesim spelling. pipesim adds::

    [r<replica>.]<stage><TYPE>[<microbatch>][@v<version>][+p<distance>]

e.g. ``r1.2F7@v3`` (replica 1, stage 2, forward of micro-batch 7 reading
version 3), ``0F5@v2+p3`` (forward on weights predicted 3 updates ahead of
version 2), ``1UPDATE@v4`` (stage 1's optimizer step producing version 4),
``1PREDICT@v2+p3`` and ``0AVERAGE``.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from pipesim.sim.errors import InputError


class ScheduleError(InputError):
    """A schedule is malformed, inconsistent or would deadlock."""


class Op(str, Enum):
    """Action types. Values are the spelling used in action strings."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"  # zero-bubble split: gradient w.r.t. the input
    BACKWARD_WEIGHT = "W"  # zero-bubble split: gradient w.r.t. the weights
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    REDUCE_GRAD = "REDUCE_GRAD"  # gradient all-reduce across replicas
    UPDATE = "UPDATE"  # optimizer step; pipesim only
    PREDICT = "PREDICT"  # weight prediction (SpecTrain); pipesim only
    AVERAGE = "AVERAGE"  # elastic averaging of replicas (AvgPipe); pipesim only
    UNSHARD = "UNSHARD"  # FSDP: gather a stage's sharded parameters
    RESHARD = "RESHARD"  # FSDP: free the gathered parameters
    OVERLAP_F_B = "OVERLAP_F_B"  # marker: the next F and B run as one overlapped unit
    ALLREDUCE = "ALLREDUCE"  # tensor parallelism: all-reduce of activations; pipesim only

    def __str__(self) -> str:
        return self.value

    # Enum's default __hash__ runs in Python; ops are hashed in every token
    # and set lookup of the hot loops, so use str's C hash (equal members
    # are equal strings, so hashing stays consistent with equality).
    __hash__ = str.__hash__


F = Op.FORWARD
B = Op.BACKWARD
I = Op.BACKWARD_INPUT  # noqa: E741 - the name torch and the papers use
W = Op.BACKWARD_WEIGHT
SEND_F, RECV_F, SEND_B, RECV_B = Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B
REDUCE_GRAD, UPDATE, PREDICT, AVERAGE = Op.REDUCE_GRAD, Op.UPDATE, Op.PREDICT, Op.AVERAGE
UNSHARD, RESHARD, OVERLAP_F_B = Op.UNSHARD, Op.RESHARD, Op.OVERLAP_F_B
ALLREDUCE = Op.ALLREDUCE

#: Passes over a micro-batch. These read a weight version.
PASS_OPS = frozenset({F, B, I, W})
#: Everything that occupies the compute stream and blocks the device's walk.
COMPUTE_OPS = frozenset({F, B, I, W, UPDATE, PREDICT})
#: Collectives across the replicas of a stage: posted without blocking, run
#: once every replica has posted them.
COLLECTIVE_OPS = frozenset({REDUCE_GRAD, AVERAGE, ALLREDUCE})
#: Point-to-point communication, added by :func:`pipesim.sim.ir.lowering.lower`.
P2P_OPS = frozenset({SEND_F, RECV_F, SEND_B, RECV_B})
#: FSDP's parameter gathering and freeing, posted without blocking.
FSDP_OPS = frozenset({UNSHARD, RESHARD})
#: Types torch.distributed.pipelining knows; the rest are pipesim's own.
TORCH_OPS = frozenset({F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, REDUCE_GRAD, UNSHARD, RESHARD, OVERLAP_F_B})
#: Ops that carry a micro-batch id.
MICROBATCH_OPS = PASS_OPS | P2P_OPS
#: Passes that make a micro-batch's input gradient (what goes upstream): B, or I when split.
INPUT_GRADIENT_OPS = frozenset({B, I})
#: Passes that make a micro-batch's weight gradient (what an UPDATE consumes): B, or W when split.
WEIGHT_GRADIENT_OPS = frozenset({B, W})
#: What places a (replica, stage) on a device (:meth:`Schedule.placement`).
_PLACED_OPS = COMPUTE_OPS | COLLECTIVE_OPS
#: The sending end of a point-to-point transfer (the rest are receives).
SEND_OPS = frozenset({SEND_F, SEND_B})

# Which way data moves between stages: the one definition every pass,
# executor and check uses. A forward's output (an activation) goes down the
# pipeline to stage + 1, carried by a SEND_F and a RECV_F; a backward's
# output (the input gradient, made by B, or by I when the backward is split)
# goes up to stage - 1, carried by a SEND_B and a RECV_B. W makes nothing
# another stage needs.

#: Stage offset from an action's data source to its destination.
FLOW: dict[Op, int] = {F: 1, SEND_F: 1, RECV_F: 1, B: -1, I: -1, SEND_B: -1, RECV_B: -1}
#: The send of the transfer that carries a pass's output, or that an end belongs to.
SEND_OF: dict[Op, Op] = {
    F: SEND_F,
    SEND_F: SEND_F,
    RECV_F: SEND_F,
    B: SEND_B,
    I: SEND_B,
    SEND_B: SEND_B,
    RECV_B: SEND_B,
}
#: The passes whose output each send carries (a stage's backward is B, or I when split).
PRODUCERS_OF: dict[Op, tuple[Op, ...]] = {
    send: tuple(op for op in (F, B, I) if SEND_OF[op] is send) for send in (SEND_F, SEND_B)
}
#: The receive that takes a pass's output on the neighbouring stage.
RECV_OF: dict[Op, Op] = {F: RECV_F, B: RECV_B, I: RECV_B, SEND_F: RECV_F, SEND_B: RECV_B}


def transfer_stages(a: Action) -> tuple[int, int]:
    """(sending stage, receiving stage) of the transfer a SEND or RECV is one end of."""
    step = FLOW[a.op]
    return (a.stage, a.stage + step) if a.op in SEND_OPS else (a.stage - step, a.stage)


def boundary_stage(a: Action) -> int:
    """The stage whose output a SEND or RECV carries across a stage boundary:
    the upstream side, whose activation (or its gradient) is what moves."""
    return min(transfer_stages(a))


class Action(NamedTuple):
    """One step of one device's program.

    ``version`` is the weight version a pass reads, or the version an UPDATE
    produces, or the version a PREDICT starts from. ``distance`` is the
    prediction distance s: a pass with ``distance > 0`` computes on the
    weights a PREDICT with the same (version, distance) materialised, whose
    effective version is ``version + distance``.
    """

    op: Op
    stage: int
    microbatch: int | None = None
    version: int | None = None
    distance: int = 0
    replica: int = 0

    def __str__(self) -> str:
        return format_action(self)

    @property
    def key(self) -> tuple[int, int, int | None]:
        """(replica, stage, microbatch): what identifies a pass's data."""
        return (self.replica, self.stage, self.microbatch)


_ACTION_RE = re.compile(
    r"^(?:r(?P<replica>\d+)\.)?(?P<stage>\d+)"
    r"(?P<op>SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD|UPDATE|PREDICT|AVERAGE|ALLREDUCE|UNSHARD|RESHARD|F|B|I|W)"
    r"(?P<mb>\d+)?(?:@v(?P<version>\d+))?(?:\+p(?P<distance>\d+))?$"
)
#: A compound cell as torch writes it: ``(0F7;7B3)OVERLAP_F_B``.
_COMPOUND_RE = re.compile(r"^\((?P<subs>[^()]*)\)(?P<op>[A-Z_]+)$")
#: Op by spelling: a dict lookup is several times cheaper than ``Op(text)``.
_OP_OF = {op.value: op for op in Op}
#: Every well-formed plain cell of a CSV row, found by one ``findall`` per row
#: (a large torch CSV has hundreds of thousands of cells). The alternatives
#: encode which ops take a micro-batch id, so a cell that breaks that rule,
#: like any other malformed cell, is not matched and the row is parsed again
#: cell by cell to name it.
_ROW_CELL_RE = re.compile(
    r"(?:^|,)(?:r(\d+)\.)?(\d+)"
    r"(?:(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)|(PREDICT)(\d*)|(REDUCE_GRAD|UPDATE|AVERAGE|ALLREDUCE|UNSHARD|RESHARD))"
    r"(?:@v(\d+))?(?:\+p(\d+))?(?=,|$)"
)


def format_action(a: Action, *, torch_only: bool = False) -> str:
    """Spell an action. ``torch_only`` drops what torch cannot read."""
    s = f"{a.stage}{a.op.value}"
    if a.microbatch is not None:
        s += str(a.microbatch)
    if torch_only:
        return s
    if a.replica:
        s = f"r{a.replica}.{s}"
    if a.version is not None:
        s += f"@v{a.version}"
    if a.distance:
        s += f"+p{a.distance}"
    return s


def parse_action(text: str) -> Action:
    """Parse one action string (pipesim or torch spelling).

    Importing a large torch CSV parses every cell, so the match is unpacked
    once and the op looked up in a dict rather than through ``Op(...)``.
    """
    text = text.strip()
    m = _ACTION_RE.match(text)
    if not m:
        if "OVERLAP_F_B" in text:
            raise ScheduleError(
                f"cannot parse action {text!r}: an overlapped pair is one cell, e.g. (0F7;7B3)OVERLAP_F_B"
            )
        raise ScheduleError(f"cannot parse action {text!r}: expected e.g. 0F1, 2B0, 1SEND_F3, 0UPDATE@v1")
    replica, stage, op, mb, version, distance = m.groups()
    op = _OP_OF[op]
    if mb is not None:
        if op not in MICROBATCH_OPS and op is not PREDICT:
            raise ScheduleError(f"action {text!r} takes no micro-batch id")
        mb = int(mb)
    elif op in MICROBATCH_OPS:
        raise ScheduleError(f"action {text!r} needs a micro-batch id")
    return Action(
        op,
        int(stage),
        mb,
        None if version is None else int(version),
        0 if distance is None else int(distance),
        0 if replica is None else int(replica),
    )


def overlapped(forward: Action, backward: Action) -> tuple[Action, Action, Action]:
    """The program entries of an OVERLAP_F_B of ``forward`` and ``backward``:
    the marker (carrying the forward's stage and replica), then the two passes."""
    return (Action(OVERLAP_F_B, forward.stage, replica=forward.replica), forward, backward)


def parse_cell(text: str) -> tuple[Action, ...]:
    """The actions of one CSV cell: one action, or the three program entries
    of a compound ``(F;B)OVERLAP_F_B`` (see :func:`overlapped`)."""
    text = text.strip()
    if not text.startswith("("):
        return (parse_action(text),)
    m = _COMPOUND_RE.match(text)
    subs = m["subs"].split(";") if m else []
    if not m or m["op"] != OVERLAP_F_B.value or len(subs) != 2:
        raise ScheduleError(
            f"cannot parse {text!r}: a compound action is written (F;B)OVERLAP_F_B, e.g. (0F7;7B3)OVERLAP_F_B"
        )
    return overlapped(parse_action(subs[0]), parse_action(subs[1]))


def program_cells(prog: Iterable[Action], *, torch_only: bool = False) -> list[str]:
    """One program as CSV cells: one per action, an OVERLAP_F_B marker and its
    two passes as the one cell ``(F;B)OVERLAP_F_B`` torch writes."""
    prog = tuple(prog)
    cells = []
    pos, n = 0, len(prog)
    while pos < n:
        a = prog[pos]
        if a.op is OVERLAP_F_B:
            if pos + 2 >= n:
                raise ScheduleError(f"OVERLAP_F_B at position {pos} is not followed by its forward and backward")
            pair = ";".join(format_action(x, torch_only=torch_only) for x in prog[pos + 1 : pos + 3])
            cells.append(f"({pair}){OVERLAP_F_B.value}")
            pos += 3
            continue
        cells.append(format_action(a, torch_only=torch_only))
        pos += 1
    return cells


@dataclass(frozen=True, eq=False)
class Schedule:
    """Per-device programs plus the sizes they were built for.

    ``num_stages`` is the pipeline depth, counted in model stages
    (``chunks * devices-per-pipeline`` for interleaved schedules).
    ``num_microbatches`` is m, the micro-batches of one iteration entering
    the pipeline, over all replicas; micro-batch ids run over
    ``range(num_microbatches * num_iterations)`` and name the data (id i is
    sample batch i of the stream).

    ``replicas[k]`` is how many replicas stage k has (an int gives every
    stage that many). A stage with several replicas is data-parallel inside
    the pipeline: micro-batch i runs on its replica ``i % replicas[k]``
    (PipeDream's deterministic round-robin routing, :meth:`replica_of`), the
    same replica for its forward and its backward, and the replicas reduce
    their gradients (REDUCE_GRAD) before they update. w identical pipelines
    side by side (width x depth) are every stage replicated w times;
    AvgPipe's parallel pipelines and data parallelism are replicas too (they
    average, or reduce, in their own way).

    ``options`` records strategy parameters (SpecTrain distances, AvgPipe's
    alpha and tau, ...) so the result of a simulation is self-describing.
    """

    strategy: str
    num_stages: int
    num_microbatches: int
    programs: tuple[tuple[Action, ...], ...]
    num_iterations: int = 1
    replicas: tuple[int, ...] | int = 1
    options: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "programs", tuple(tuple(p) for p in self.programs))
        object.__setattr__(self, "options", dict(self.options))
        for name in ("num_stages", "num_microbatches", "num_iterations"):
            if getattr(self, name) < 1:
                raise ScheduleError(f"{name} must be >= 1, got {getattr(self, name)}")
        reps = self.replicas
        reps = (reps,) * self.num_stages if isinstance(reps, int) else tuple(reps)
        if len(reps) != self.num_stages or any(not isinstance(r, int) or r < 1 for r in reps):
            raise ScheduleError(f"replicas must be one count >= 1 per stage ({self.num_stages}), got {self.replicas!r}")
        object.__setattr__(self, "replicas", reps)
        if not self.programs:
            raise ScheduleError("a schedule needs at least one device")

    @property
    def num_replicas(self) -> int:
        """The most replicas any stage has (w for w pipelines side by side)."""
        return max(self.replicas)

    def replica_of(self, stage: int, microbatch: int) -> int:
        """The replica of ``stage`` that runs ``microbatch``: round-robin, the
        one rule every pass, check and executor routes by."""
        return microbatch % self.replicas[stage]

    @property
    def num_devices(self) -> int:
        return len(self.programs)

    @property
    def total_microbatches(self) -> int:
        """Micro-batch ids across all iterations (every replica's)."""
        return self.num_microbatches * self.num_iterations

    def placement(self) -> dict[tuple[int, int], int]:
        """(replica, stage) -> device, read off the compute actions (cached)."""
        cached = self.__dict__.get("_placement")
        if cached is not None:
            return dict(cached)
        where: dict[tuple[int, int], int] = {}
        for dev, prog in enumerate(self.programs):
            # each program's (replica, stage) pairs in bulk, in order of appearance
            # (a comprehension and a dict, not a method call per action)
            hosted = dict.fromkeys([(a.replica, a.stage) for a in prog if a.op in _PLACED_OPS])
            if not all(where.setdefault(rs, dev) == dev for rs in hosted):
                self._placement_conflict(where, dev, prog)
        object.__setattr__(self, "_placement", where)
        return dict(where)

    @staticmethod
    def _placement_conflict(where: dict, dev: int, prog) -> None:
        """Name the first action of ``prog`` (on ``dev``) whose stage
        ``where`` places on another device."""
        for a in prog:
            if a.op in _PLACED_OPS:
                prev = where.get((a.replica, a.stage), dev)
                if prev != dev:
                    raise ScheduleError(
                        f"replica {a.replica} stage {a.stage} has actions on devices "
                        f"{prev} and {dev} ({format_action(a)}); a stage lives on one device"
                    )

    def actions(self) -> Iterator[tuple[int, int, Action]]:
        """(device, position, action) over every program."""
        for dev, prog in enumerate(self.programs):
            for pos, a in enumerate(prog):
                yield dev, pos, a

    def compute_only(self) -> Schedule:
        """The same schedule with communication actions removed."""
        return self.with_programs(tuple(a for a in prog if a.op not in P2P_OPS) for prog in self.programs)

    def with_programs(self, programs: Iterable[Iterable[Action]]) -> Schedule:
        return Schedule(
            strategy=self.strategy,
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            programs=tuple(tuple(p) for p in programs),
            num_iterations=self.num_iterations,
            replicas=self.replicas,
            options=self.options,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return (
            self.strategy,
            self.num_stages,
            self.num_microbatches,
            self.num_iterations,
            self.replicas,
            self.programs,
        ) == (
            other.strategy,
            other.num_stages,
            other.num_microbatches,
            other.num_iterations,
            other.replicas,
            other.programs,
        )

    __hash__ = None  # type: ignore[assignment]


def routed(first: int, count: int, replicas: int, replica: int) -> range:
    """The micro-batch ids among ``first .. first+count-1`` that ``replica`` of
    a stage with ``replicas`` replicas runs (:meth:`Schedule.replica_of`:
    round robin, id % replicas)."""
    return range(first + (replica - first) % replicas, first + count, replicas)


def shift_versions(schedule: Schedule, by: int) -> Schedule:
    """The same schedule reading and producing versions ``by`` later: what a
    run that continues training from ``by`` applied updates executes.
    (Validation assumes a run starts at version 0, so only executors use this.)"""
    if not by:
        return schedule
    return schedule.with_programs(
        tuple(a._replace(version=a.version + by) if a.version is not None else a for a in prog)
        for prog in schedule.programs
    )


# --------------------------------------------------------------------------
# CSV interchange
# --------------------------------------------------------------------------


def to_csv(schedule: Schedule, *, torch_only: bool = False) -> str:
    """One row per device, one action per cell, like torch's ``_dump_csv``.

    With ``torch_only`` the pipesim-only actions (UPDATE, PREDICT, AVERAGE)
    are dropped and versions are not written, so torch's ``_load_csv`` reads
    the result; replicas other than 0 cannot be expressed there. Otherwise a
    first line ``# pipesim {...}`` records what the rows cannot (the
    strategy, m, the iterations and the strategy's options, AvgPipe's
    averaging rate among them), so the schedule round-trips exactly.
    """
    buf = io.StringIO()
    if not torch_only:
        buf.write(_HEADER + json.dumps(_header_of(schedule), sort_keys=True, separators=(",", ":")) + "\n")
    writer = csv.writer(buf, lineterminator="\n")
    for prog in schedule.programs:
        if torch_only:
            for a in prog:
                if a.replica:
                    raise ScheduleError(
                        f"{format_action(a)}: torch's CSV holds one pipeline and this schedule has "
                        "replicas; --format csv keeps them"
                    )
            prog = [a for a in prog if a.op in TORCH_OPS]
        writer.writerow(program_cells(prog, torch_only=torch_only))
    return buf.getvalue()


#: The first line of a pipesim CSV, followed by :func:`_header_of` as JSON.
_HEADER = "# pipesim "


def _header_of(schedule: Schedule) -> dict:
    return {
        "strategy": schedule.strategy,
        "microbatches": schedule.num_microbatches,
        "iterations": schedule.num_iterations,
        "replicas": list(schedule.replicas),
        "options": dict(schedule.options),
    }


def csv_header(text: str) -> tuple[dict, str]:
    """The ``# pipesim {...}`` header of a schedule CSV (``{}`` when it has
    none, as torch's do) and the text of its rows."""
    if not text.startswith(_HEADER):
        return {}, text
    line, _, rows = text.partition("\n")
    try:
        header = json.loads(line[len(_HEADER) :])
    except ValueError as e:
        raise ScheduleError(f"row 1: malformed pipesim header: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("options", {}), dict):
        raise ScheduleError("row 1: the pipesim header must be a JSON object with an options object")
    return header, rows


def parse_csv(text: str) -> list[list[Action]]:
    """Per-device action lists from a CSV (after :func:`csv_header`); empty
    cells (idle slots) are skipped."""
    programs: list[list[Action]] = []
    quoted = '"' in text  # quoted cells: only the csv module reads those right
    rows = csv.reader(io.StringIO(text)) if quoted else text.splitlines()
    for lineno, row in enumerate(rows, start=1):
        prog = None if quoted else _parse_plain_row(row)
        if prog is None:
            prog = []
            for cell in row if quoted else row.split(","):
                if not cell.strip():
                    continue
                try:
                    prog.extend(parse_cell(cell))
                except ScheduleError as e:
                    raise ScheduleError(f"row {lineno}: {e}") from None
        programs.append(prog)
    while programs and not programs[-1]:
        programs.pop()
    if not programs:
        raise ScheduleError("the schedule CSV holds no actions")
    return programs


def _parse_plain_row(line: str) -> list[Action] | None:
    """The actions of a row whose cells are all plain, well-formed actions;
    None if any is not (a compound, a blank, an error to report)."""
    found = _ROW_CELL_RE.findall(line)
    cells = line.split(",")
    if len(found) != len(cells) - cells.count(""):
        return None
    op_of, new = _OP_OF, tuple.__new__
    # tuple.__new__ is what Action(...) calls, without the Python-level frame
    return [
        new(
            Action,
            (
                op_of[op or op2 or op3],
                int(stage),
                int(mb or mb2) if mb or mb2 else None,
                int(version) if version else None,
                int(distance) if distance else 0,
                int(replica) if replica else 0,
            ),
        )
        for replica, stage, op, mb, op2, mb2, op3, version, distance in found
    ]

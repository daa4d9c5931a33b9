"""A schedule's micro-batch stream, cut into the parts that successive ``step()`` calls run.

An asynchronous schedule (PipeDream, SpecTrain, 2BW) never flushes: its
``K × m`` micro-batches are one stream, and ten runs of two iterations, each
filled and drained, train differently from one run of twenty. So
:class:`~pipesim.validate.schedule.PipelineSchedule` runs, at step ``s``,
part ``s`` of **one long stream**: the schedule its strategy builds for many
steps' worth of iterations, ``L_H`` for H steps. Part ``s`` of a device's
program is what lies between two *cuts*:

* the cut after step ``s`` on a device is right before its first forward of
  a micro-batch of step ``s + 1`` (ids ``≥ (s+1)·T``, T the step's
  micro-batches per replica), less any PREDICT just before it, which belongs
  to that forward. This is the longest common prefix of the program of a
  stream of ``s + 1`` steps and of any longer one, so whether a ``flush()``
  drains the pipeline there or the next step continues it, every stage runs
  exactly the actions, in exactly the order, of one run of that length:
  the executors' results are then bit-identical to it
  (:mod:`pipesim.validate.numerics`).
* Cutting every device's program somewhere leaves data in flight: a
  forward's output whose consumer on the next stage runs in the next part, a
  gradient sent back to a backward that runs later. Each transfer (its send
  and its receive) therefore runs in the part of the pass that *consumes*
  it; a send whose producer ran in an earlier part is posted at the start of
  its device's part, from the output the producer's stage kept
  (:meth:`~pipesim.validate.executor.DeviceExecutor.park`). A collective
  runs in the part of the compute action that waits for it.
* ``flush()`` after step ``s`` runs the rest of the stream of exactly
  ``s + 1`` steps: the drain.

A stage announces the readers of each weight version ahead
(:meth:`~pipesim.validate.stage.PipelineStage.prepare`), so the reads of
the parts to come are announced before part ``s`` runs, as far ahead as a
version's readers reach (:attr:`Stream.reach`, measured on the stream).
Too short a reach would fail loudly (a version read after it was
overwritten raises), never silently.

Schedules whose steps are self-contained (flush schedules, data
parallelism, imported torch schedules) are streams too: their strategy
builds them longer (AvgPipe's averaging every τ iterations counts
iterations across steps), or, when no strategy reproduces them, they are
repeated with micro-batch ids and versions moved on.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

from pipesim.sim.errors import InputError
from pipesim.sim.ir.core import COMPUTE_OPS, PASS_OPS, PREDICT, UPDATE, Action, F, Schedule
from pipesim.sim.ir.dataflow import compile_plan
from pipesim.sim.ir.lowering import group, lower
from pipesim.sim.strategies import find_strategy, spec_of


class StreamError(InputError):
    """A schedule whose stream cannot be continued across steps (one line)."""


# ---------------------------------------------------------------- building


def moved(a: Action, microbatches: int, versions: dict) -> Action:
    """``a`` with its micro-batch id ``microbatches`` later and its version
    ``versions[(replica, stage)]`` later (what a stream that follows others runs)."""
    return a._replace(
        microbatch=a.microbatch + microbatches if a.microbatch is not None else None,
        version=a.version + versions.get((a.replica, a.stage), 0) if a.version is not None else None,
    )


def moved_on(schedule: Schedule, microbatches: int, versions: dict) -> Schedule:
    """Every action of ``schedule`` :func:`moved`; the placement stays the schedule's."""
    if not microbatches and not any(versions.values()):
        return schedule
    out = schedule.with_programs(tuple(moved(a, microbatches, versions) for a in prog) for prog in schedule.programs)
    object.__setattr__(out, "_placement", schedule.placement())
    return out


def updates(schedule: Schedule) -> Counter:
    """UPDATEs per (replica, stage)."""
    return Counter((a.replica, a.stage) for prog in schedule.programs for a in prog if a.op is UPDATE)


def _repeated(schedule: Schedule, steps: int) -> Schedule:
    """``steps`` copies of a self-contained schedule, one after the other."""
    per = updates(schedule)
    ids = schedule.total_microbatches
    parts = [moved_on(schedule, j * ids, {k: j * n for k, n in per.items()}) for j in range(steps)]
    return Schedule(
        strategy=schedule.strategy,
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        programs=tuple(sum((p.programs[d] for p in parts), ()) for d in range(schedule.num_devices)),
        num_iterations=schedule.num_iterations * steps,
        replicas=schedule.replicas,
        options=schedule.options,
    )


def stream_builder(schedule: Schedule) -> Callable[[int], Schedule]:
    """``steps -> the schedule of that many steps`` continuing ``schedule``'s stream.

    The schedule's strategy builds the longer schedule when it rebuilds
    ``schedule`` exactly from its recorded options; otherwise a schedule
    whose steps are self-contained (not :attr:`Strategy.asynchronous`) is
    repeated, and an asynchronous one that its strategy does not reproduce
    (an edited IR) is refused."""
    strategy = find_strategy(schedule.strategy)
    spec = spec_of(schedule)
    if spec is not None:
        try:
            again = strategy.build(spec)
        except InputError:
            again = None
        if again == schedule:
            return lambda steps: strategy.build(replace(spec, iterations=spec.iterations * steps))
    if strategy is None or not strategy.asynchronous:
        return lambda steps: _repeated(schedule, steps)
    raise StreamError(
        f"step() continues an asynchronous {schedule.strategy} pipeline by building its stream longer, and "
        f"{schedule.strategy} does not build this schedule from its options (an edited IR?); "
        "use build_schedule's schedule, or emulate() to run this one once"
    )


# ---------------------------------------------------------------- cutting


def cuts(programs, per_step: int, steps: int) -> list[list[int]]:
    """Per device, the compute index where each of ``steps`` parts ends.

    ``programs`` are compute-only; micro-batch ids of step s start at
    ``s * per_step``. See the module doc for the rule."""
    out = []
    for prog in programs:
        compute = [a for a in prog if a.op in COMPUTE_OPS]
        ends, s = [], 0
        for j, a in enumerate(compute):
            while s < steps and a.op is F and a.microbatch >= (s + 1) * per_step:
                end = j
                while end > 0 and compute[end - 1].op is PREDICT:
                    end -= 1
                ends.append(end)
                s += 1
        ends += [len(compute)] * (steps - len(ends))
        out.append(ends)
    return out


@dataclass
class Part:
    """What one ``step()`` (or the drain) runs: a lowered schedule and the
    simulated start and end of each of its compute actions, per device."""

    schedule: Schedule
    times: list[list[tuple[float, float]]]

    def by_stream(self) -> dict[str, list]:
        """The compute spans :func:`~pipesim.validate.executor.emulate` orders
        the part by (a :class:`~pipesim.sim.engine.results.SimResult` look-alike)."""
        return {"compute": [_Span(d, s, e) for d, times in enumerate(self.times) for s, e in times]}


@dataclass(frozen=True)
class _Span:
    device: int
    start: float
    end: float


@dataclass
class _Layout:
    """A lowered stream: per device its compiled entries, the part each
    compute action runs in, the part each awaited token's waiter runs in,
    and the simulated (start, end) of each compute action."""

    lowered: Schedule
    entries: list
    step_of: list[list[int]]
    waiter: dict
    times: list[list[tuple[float, float]]]
    parts: int  # cuts per device: posts trailing a program belong after the last

    def select(self, keep: Callable[[int], bool]) -> Part:
        """The part made of the actions whose part number ``keep`` accepts.

        A transfer or collective belongs to the part of the compute action
        that waits for it; one nothing waits for, to the part of the compute
        action it is posted before (after every part, if it trails)."""
        programs, kept_times = [], []
        for d, prog in enumerate(self.entries):
            out, times = [], []
            for j, entry in enumerate(prog):
                own = self.step_of[d][j] if entry.action is not None else self.parts
                for x, tok in entry.posts:
                    if keep(self.waiter.get(tok, own)):
                        out.append(x)
                if entry.action is not None and keep(own):
                    out.append(entry.action)
                    times.append(self.times[d][j])
            programs.append(tuple(out))
            kept_times.append(times)
        part = self.lowered.with_programs(programs)
        # a device may only post in a part (a send of an earlier output): the
        # placement is the stream's, not what the part's own compute implies
        object.__setattr__(part, "_placement", self.lowered.placement())
        return Part(part, kept_times)


class Stream:
    """The long schedule of a stream and the step each of its actions runs in.

    ``build(h)`` gives the stream of h steps (compute-only, micro-batch ids
    from 0); ``per_step`` is T, the micro-batch ids per replica one step
    covers. ``simulate(schedule)`` gives the timeline an emulation orders
    itself by. With ``steps`` the stream has exactly that many steps, the
    last of which drains it; without, it grows as steps are asked for.
    """

    def __init__(
        self,
        build: Callable[[int], Schedule],
        per_step: int,
        recv_lookahead: int,
        simulate: Callable[[Schedule], object],
        steps: int | None = None,
    ):
        self.build, self.per_step = build, per_step
        self.recv_lookahead, self.simulate = recv_lookahead, simulate
        self.fixed = steps is not None
        self.reach = 0
        self._grow(steps if self.fixed else 4)
        # how many parts ahead a version is read: all of a fixed stream's
        self.reach = steps if self.fixed else self._measure_reach()

    # -- the long schedule ------------------------------------------------
    def _layout(self, schedule: Schedule, ends: list[list[int]]) -> _Layout:
        """``schedule`` lowered, with the part of every action given the
        compute index where each part ends on each device (``ends``)."""
        lowered = lower(schedule, recv_lookahead=self.recv_lookahead)
        entries = compile_plan(lowered, group(lowered))
        waiter: dict = {}
        step_of: list[list[int]] = []
        for d, prog in enumerate(entries):
            parts, s = [], 0
            for j, entry in enumerate(prog):
                if entry.action is None:
                    continue
                while s < len(ends[d]) and j >= ends[d][s]:
                    s += 1
                parts.append(s)
                for w in entry.waits:
                    waiter[w] = s
            step_of.append(parts)
        starts, stops = defaultdict(list), defaultdict(list)
        for span in self.simulate(schedule).by_stream()["compute"]:
            starts[span.device].append(span.start)
            stops[span.device].append(span.end)
        times = [list(zip(sorted(starts[d]), sorted(stops[d]))) for d in range(len(entries))]
        return _Layout(lowered, entries, step_of, waiter, times, len(ends[0]) if ends else 0)

    def _grow(self, horizon: int) -> None:
        self.horizon = horizon
        schedule = self.build(horizon)
        self.ends = cuts(schedule.programs, self.per_step, horizon)
        self.layout = self._layout(schedule, self.ends)

    def ensure(self, step: int) -> None:
        """Make a growing stream reach far enough for step ``step`` and the
        reads ``reach`` steps after it (its last part, which drains, never runs)."""
        need = step + self.reach + 2
        if not self.fixed and need > self.horizon:
            self._grow(max(need, 2 * self.horizon))

    # -- parts -------------------------------------------------------------
    def part(self, step: int) -> Part:
        """The actions step ``step`` runs (``ensure(step)`` first)."""
        return self.layout.select(lambda s: s == step)

    def drain(self, steps: int) -> Part:
        """What is left of the stream of exactly ``steps`` steps once they ran:
        its program past the cuts of the long one (a common prefix)."""
        layout = self._layout(self.build(steps), [ends[:steps] for ends in self.ends])
        return layout.select(lambda s: s >= steps)

    def reads(self, first: int, last: int) -> dict[tuple[int, int], list[Action]]:
        """Per (replica, stage), the actions of steps ``first..last`` (the
        stage counts each once, whatever it was told before)."""
        out: dict[tuple[int, int], list[Action]] = defaultdict(list)
        for d, prog in enumerate(self.layout.entries):
            for j, entry in enumerate(prog):
                a = entry.action
                if a is not None and first <= self.layout.step_of[d][j] <= last:
                    out[(a.replica, a.stage)].append(a)
        return out

    def _measure_reach(self) -> int:
        """How many steps after the one that makes a version its last read
        comes, at most (over the versions made in the first half of the
        stream, whose reads it holds whole); the stream grows until that is clear."""
        while True:
            made: dict = {}
            reach = 0
            half = (self.horizon - 1) // 2
            for d, prog in enumerate(self.layout.entries):
                for j, entry in enumerate(prog):
                    a = entry.action
                    if a is None:
                        continue
                    s = self.layout.step_of[d][j]
                    if a.op is UPDATE:
                        made[(a.replica, a.stage, a.version)] = s
                    elif (a.op in PASS_OPS and not a.distance) or a.op is PREDICT:
                        born = made.get((a.replica, a.stage, a.version), 0)
                        if born < half:
                            reach = max(reach, s - born)
            if reach + 2 < half:
                return reach
            self._grow(2 * self.horizon)

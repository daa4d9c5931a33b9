"""What the cost model needs to know about a schedule, stage by stage.

A :class:`Layout` says where each model stage's replicas run and what the
schedule asks of one replica per iteration: how many passes it runs, how many
micro-batches it keeps stashed at once, how many optimizer steps (each after
an all-reduce when the stage is replicated) it takes, and how many weight
versions it holds. It does not depend on how the layers are split, so one
layout costs every split of a profile.

There are two ways to get one:

* :func:`layout_of` reads it off a built :class:`~pipesim.sim.ir.core.Schedule`
  (the IR is the truth: the partitioner of the simulate path uses it, and the
  planner uses it for every candidate it ranks);
* :func:`layout_for` computes it for a schedule not built yet, a strategy with
  per-stage replicas, from :class:`Traits` measured once per strategy on a
  small probe schedule the strategy builds itself. The planner's search tries
  thousands of replica vectors and cannot build them all.

``Strategy`` does not say how many micro-batches a replica stashes or how
often it steps, so :func:`traits_of` measures both on that probe: GPipe
stashes its whole share of an iteration, the 1F1B family its warm-up plus one
(:func:`~pipesim.sim.strategies._common.warmup`); PipeDream steps after every
pass, flush schedules and 2BW once per iteration. A strategy that does
neither is costed by the safe side: stashing its whole share.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import TypeVar

from pipesim.sim.errors import InputError
from pipesim.sim.ir.core import (
    AVERAGE,
    COMPUTE_OPS,
    INPUT_GRADIENT_OPS,
    PASS_OPS,
    PREDICT,
    REDUCE_GRAD,
    UPDATE,
    WEIGHT_GRADIENT_OPS,
    F,
    Op,
    Schedule,
)
from pipesim.sim.strategies import ScheduleSpec, build_schedule, find_strategy, get_strategy
from pipesim.sim.strategies._common import flush_sizes, warmup

T = TypeVar("T")


@dataclass(frozen=True)
class Wait:
    """What hides the receive a pass consumes, in steady state.

    The lowering posts a receive ``recv_lookahead`` compute actions before its
    consumer, so only those actions (``window``) overlap the transfer; and the
    pass before them (``prior``) has just posted its own send, which goes
    first on a link the two share. Each action is ``(op, stage offset)``
    relative to the receiving pass's stage.
    """

    window: tuple[tuple[Op, int], ...] = ()
    prior: tuple[Op, int] | None = None


#: Index of a pass's receive in ``Layout.waits[k]``: the forward's input, and
#: the input gradient the backward (B, or I when split) consumes.
FORWARD, BACKWARD = 0, 1


@dataclass(frozen=True)
class Layout:
    """Placement and per-iteration duties of every model stage (see the module doc).

    ``devices[k][r]`` is the device of replica r of stage k (devices may host
    several stages: interleaved and AvgPipe's shared placement do).
    ``passes[k]``, ``updates[k]`` are the most forward passes and optimizer
    steps one replica of stage k runs per iteration; ``inflight[k]`` the most
    micro-batches one replica keeps stashed at once; ``versions[k]`` the
    weight versions it keeps; ``buffers[k]`` buffers of the passes' weights
    besides (SpecTrain's predicted weights); ``centres[k]`` buffers of the
    master weights (AvgPipe's centre; empty: none). ``waits[k]``: the
    :class:`Wait` of its forward's and its backward's receive. ``streamed``:
    the iterations run as one stream without a flush (``Strategy.asynchronous``).
    ``flushes``: the fills and drains of one iteration (GPipe's flushes per
    update; 1 for every other flushed strategy).
    """

    devices: tuple[tuple[int, ...], ...]
    microbatches: int
    iterations: int
    streamed: bool
    passes: tuple[float, ...]
    inflight: tuple[int, ...]
    updates: tuple[float, ...]
    versions: tuple[int, ...]
    buffers: tuple[int, ...]
    waits: tuple[tuple[Wait, Wait], ...]
    #: per stage: its replicas' gradient all-reduce runs behind later passes
    #: (the UPDATE that waits for it comes after them: 2BW) instead of
    #: holding the device until the update
    hidden_reduce: tuple[bool, ...] = ()
    #: per stage: buffers at the master weights' width (the averaging centre)
    centres: tuple[int, ...] = ()
    flushes: int = 1

    @property
    def stages(self) -> int:
        return len(self.devices)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(len(d) for d in self.devices)

    @property
    def num_devices(self) -> int:
        return 1 + max(max(d) for d in self.devices)

    def stages_on(self) -> dict[int, int]:
        """device -> how many distinct model stages it hosts."""
        hosted: dict[int, set] = defaultdict(set)
        for k, devs in enumerate(self.devices):
            for d in devs:
                hosted[d].add(k)
        return {d: len(s) for d, s in hosted.items()}


def layout_of(schedule: Schedule, recv_lookahead: int = 1) -> Layout:
    """The layout of a built schedule, read off its IR (one pass over every
    action); ``recv_lookahead`` as the lowering will post receives."""
    placement = schedule.placement()
    p = schedule.num_stages
    passes: dict[tuple[int, int], int] = defaultdict(int)
    updates: dict[tuple[int, int], int] = defaultdict(int)
    peak: dict[tuple[int, int], int] = defaultdict(int)
    predicts: set[tuple[int, int]] = set()
    averages: set[tuple[int, int]] = set()
    hidden: set[int] = set()  # stages with a pass between a REDUCE_GRAD and its UPDATE
    for prog in schedule.programs:
        live: dict[tuple[int, int], int] = defaultdict(int)
        reducing: set[tuple[int, int]] = set()
        for a in prog:
            op = a.op
            if op is REDUCE_GRAD:
                reducing.add((a.replica, a.stage))
            elif op is UPDATE:
                reducing.discard((a.replica, a.stage))
            elif op in PASS_OPS and (a.replica, a.stage) in reducing:
                hidden.add(a.stage)
            if op is F:
                rs = (a.replica, a.stage)
                passes[rs] += 1
                live[rs] += 1
                peak[rs] = max(peak[rs], live[rs])
            elif op in WEIGHT_GRADIENT_OPS:
                live[(a.replica, a.stage)] -= 1
            elif op is UPDATE:
                updates[(a.replica, a.stage)] += 1
            elif op is PREDICT:
                predicts.add((a.replica, a.stage))
            elif op is AVERAGE:
                averages.add((a.replica, a.stage))
    k_iter = schedule.num_iterations
    strategy = find_strategy(schedule.strategy)
    if strategy is not None:
        versions = [strategy.weight_versions(schedule.options, k, p) for k in range(p)]
    else:  # an imported schedule: count what its IR keeps
        from pipesim.sim.engine.trackers import version_plan

        held = version_plan(schedule)[1]
        versions = [max((n for (_, st), n in held.items() if st == k), default=1) for k in range(p)]
    devices, per_pass, per_update, stashed, extra, centres = [], [], [], [], [], []
    for k in range(p):
        reps = range(schedule.replicas[k])
        devices.append(tuple(placement[(r, k)] for r in reps))
        per_pass.append(max(passes[(r, k)] for r in reps) / k_iter)
        per_update.append(max(updates[(r, k)] for r in reps) / k_iter)
        stashed.append(max(peak[(r, k)] for r in reps))
        extra.append(int(any((r, k) in predicts for r in reps)))
        centres.append(int((0, k) in averages))
    return Layout(
        devices=tuple(devices),
        microbatches=schedule.num_microbatches,
        iterations=k_iter,
        streamed=bool(strategy is not None and strategy.asynchronous),
        passes=tuple(per_pass),
        inflight=tuple(stashed),
        updates=tuple(per_update),
        versions=tuple(versions),
        buffers=tuple(extra),
        waits=_waits(schedule, recv_lookahead),
        hidden_reduce=tuple(k in hidden for k in range(p)),
        centres=tuple(centres),
        flushes=int(schedule.options.get("flushes", 1)),
    )


def _waits(schedule: Schedule, lookahead: int) -> tuple[tuple[Wait, Wait], ...]:
    """Per stage, the most frequent :class:`Wait` of its forwards and of its
    backwards over the whole program (first seen wins a tie)."""
    seen: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for prog in schedule.programs:
        compute = [a for a in prog if a.op in COMPUTE_OPS]
        for t, a in enumerate(compute):
            kind = FORWARD if a.op is F else BACKWARD if a.op in INPUT_GRADIENT_OPS else None
            if kind is None:
                continue
            first = max(t - lookahead, 0)
            window = tuple((x.op, x.stage - a.stage) for x in compute[first:t])
            before = compute[first - 1] if first else None
            prior = (before.op, before.stage - a.stage) if before is not None and before.op in PASS_OPS else None
            seen[(a.stage, kind)][Wait(window, prior)] += 1
    none = Wait()
    return tuple(
        tuple(seen[(k, kind)].most_common(1)[0][0] if seen[(k, kind)] else none for kind in (FORWARD, BACKWARD))
        for k in range(schedule.num_stages)
    )


def fewest_flushes(outcome: Callable[[int], T], fits: Callable[[T], bool], most: int) -> tuple[int, T]:
    """The fewest flushes per update, 1 .. ``most``, whose ``outcome`` fits,
    with that outcome: found by bisection, since what a stage holds only
    falls with more flushes (each flush pays a fill and a drain, so fewer
    are faster); one flush and its outcome where none fits."""
    one = outcome(1)
    if fits(one) or most <= 1:
        return 1, one
    high, found = most, outcome(most)
    if not fits(found):
        return 1, one
    low = 1  # low does not fit, high does
    while high - low > 1:
        mid = (low + high) // 2
        tried = outcome(mid)
        if fits(tried):
            high, found = mid, tried
        else:
            low = mid
    return high, found


def chooses_flushes(traits: Traits, options: Mapping[str, object]) -> bool:
    """Whether a planner picks the flushes per update: the strategy takes
    them, a replica stashes every micro-batch of its flush (so more flushes
    hold fewer) and the request does not fix them."""
    return "flushes" in get_strategy(traits.strategy).options and traits.holds_share and "flushes" not in options


@dataclass(frozen=True)
class Traits:
    """How a strategy stashes and steps, measured on a probe (see the module doc).

    ``holds_share``: a replica stashes every micro-batch of its share of an
    iteration (GPipe) rather than its 1F1B warm-up plus one.
    ``steps_each_pass``: an optimizer step (and all-reduce) after every
    backward (PipeDream) rather than one per iteration. ``waits``: the
    :class:`Wait` of a forward's and a backward's receive, relative to the
    stage, as the probe's first stage shows them.
    """

    strategy: str
    streamed: bool
    holds_share: bool
    steps_each_pass: bool
    waits: tuple[Wait, Wait]
    hides_reduce: bool = False  # a replicated stage's all-reduce runs behind later passes

    def share(self, replicas: int, microbatches: int) -> float:
        """Passes one replica runs per iteration: ``m / r`` over a stream
        (the remainder evens out), the most any replica gets when flushed."""
        return microbatches / replicas if self.streamed else math.ceil(microbatches / replicas)

    def inflight(self, replicas: int, suffix: int, microbatches: int, iterations: int, flushes: int = 1) -> int:
        """Micro-batches one replica of a stage with ``replicas`` replicas keeps
        stashed, ``suffix`` devices running the later stages. An update in
        ``flushes`` flushes (GPipe's gradient accumulation) holds at most
        its largest flush, ``ceil(m / flushes)`` micro-batches."""
        held = math.ceil(flush_sizes(microbatches, flushes)[0] * (iterations if self.streamed else 1) / replicas)
        if self.holds_share:
            return held
        return min(held, warmup((replicas, suffix) if suffix else (replicas,), 0) + 1)

    def steps(self, replicas: int, microbatches: int) -> float:
        """Optimizer steps one replica takes per iteration."""
        return self.share(replicas, microbatches) if self.steps_each_pass else 1.0


#: The probe :func:`traits_of` builds: two stages, eight micro-batches (most
#: of them in steady state), one iteration.
_PROBE_STAGES, _PROBE_MICROBATCHES = 2, 8


@cache
def traits_of(strategy: str, recv_lookahead: int = 1) -> Traits:
    """Measure ``strategy``'s :class:`Traits` on a small probe schedule it builds."""
    found = get_strategy(strategy)
    probe = layout_of(build_schedule(ScheduleSpec(strategy, _PROBE_STAGES, _PROBE_MICROBATCHES)), recv_lookahead)
    one_f_one_b = probe.inflight[0] == warmup((1,) * _PROBE_STAGES, 0) + 1
    return Traits(
        strategy=strategy,
        streamed=found.asynchronous,
        holds_share=not one_f_one_b,
        steps_each_pass=probe.updates[0] >= _PROBE_MICROBATCHES,
        waits=probe.waits[0],
        hides_reduce=_hides_reduce(strategy, recv_lookahead),
    )


def _hides_reduce(strategy: str, recv_lookahead: int) -> bool:
    """Whether a replicated first stage's all-reduce runs behind later
    passes, read off a probe of three iterations with two replicas of it
    (False where the strategy takes no replicas)."""
    try:
        probe = build_schedule(
            ScheduleSpec(
                strategy, _PROBE_STAGES, _PROBE_MICROBATCHES, iterations=3, replicas=(2,) + (1,) * (_PROBE_STAGES - 1)
            )
        )
    except InputError:
        return False
    return layout_of(probe, recv_lookahead).hidden_reduce[0]


def consecutive_devices(replicas: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Stage k's replicas on consecutive devices after stage k-1's (how
    ``ScheduleSpec(replicas=...)`` places them)."""
    out, first = [], 0
    for r in replicas:
        out.append(tuple(range(first, first + r)))
        first += r
    return tuple(out)


def layout_for(
    traits: Traits, replicas: tuple[int, ...], microbatches: int, iterations: int, options: dict | None = None
) -> Layout:
    """The layout a strategy with per-stage ``replicas`` would build, without building it."""
    strategy = get_strategy(traits.strategy)
    opts = strategy.option_defaults() | (options or {}) | {"replicas": list(replicas)}
    p = len(replicas)
    total = sum(replicas)
    suffix = [total - sum(replicas[: k + 1]) for k in range(p)]
    flushes = int(opts.get("flushes", 1))
    return Layout(
        devices=consecutive_devices(replicas),
        microbatches=microbatches,
        iterations=iterations,
        streamed=traits.streamed,
        passes=tuple(traits.share(r, microbatches) for r in replicas),
        inflight=tuple(traits.inflight(r, s, microbatches, iterations, flushes) for r, s in zip(replicas, suffix)),
        updates=tuple(traits.steps(r, microbatches) for r in replicas),
        versions=tuple(strategy.weight_versions(opts, k, p) for k in range(p)),
        buffers=(0,) * p,
        waits=(traits.waits,) * p,
        hidden_reduce=tuple(traits.hides_reduce and r > 1 for r in replicas),
        flushes=flushes,
    )

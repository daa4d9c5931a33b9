"""What every strategy module shares: the spec, the error, and the building blocks.

A strategy module turns a :class:`ScheduleSpec` into a compute-only
:class:`~pipesim.sim.ir.core.Schedule` (F/B/I/W, UPDATE, PREDICT, AVERAGE,
REDUCE_GRAD; the lowering pass adds SEND/RECV later). The pieces here are the
ones several strategies need:

* :func:`one_f_one_b` -- the per-stage 1F1B order of ``n`` items with a given
  warm-up, used by 1F1B, PipeDream, 2BW, SpecTrain, ZB-H1 and AvgPipe;
* :func:`flush_iteration` / :func:`flush_schedule` -- flush (synchronous)
  semantics: every pass of iteration ``t`` reads version ``t``, each
  (replica, stage) gets one ``UPDATE@v(t+1)`` right after its last backward of
  the iteration on its device (torch places its REDUCE_GRAD there too),
  preceded by a ``REDUCE_GRAD`` when replicas must agree on the gradient.
  Imported torch schedules get their meaning from the same function;
* the replica/device layout: replica ``r`` of a ``p``-device pipeline occupies
  devices ``r*p .. r*p+p-1``.

Nothing here imports torch: the simulator never does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields

from pipesim.sim.ir.core import (
    AVERAGE,
    COMPUTE_OPS,
    OVERLAP_F_B,
    PASS_OPS,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    UPDATE,
    WEIGHT_GRADIENT_OPS,
    Action,
    B,
    F,
    Op,
    Schedule,
    routed,
)
from pipesim.sim.strategies.registry import StrategyError, find_strategy, strategies

_new = tuple.__new__  # see flush_iteration
#: Receives, which flush_iteration's update goes before (they serve a later pass).
_RECV_OPS = frozenset({RECV_F, RECV_B})


PLACEMENTS = ("shared", "disjoint")
OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class ScheduleSpec:
    """What to build.

    ``stages`` is the pipeline depth in *devices* per replica (interleaved
    schedules put ``chunks`` model stages on each). ``iterations`` is K:
    flush schedules repeat K flushed iterations; asynchronous ones run
    K iterations' micro-batches without a flush.

    Replication, two ways (:func:`stage_replicas`):

    * ``width`` is w replicas of the whole pipeline: w parallel pipelines
      (width x depth) for the flush schedules and 2BW, AvgPipe's number of
      pipelines N_p (default 2 when left ``None``), and a device multiplier
      for data-parallel; ``None`` means 1 for every other strategy. After
      construction ``width`` is an int. Pipeline r occupies devices
      ``r*p .. r*p+p-1``.
    * ``replicas`` gives each stage its own count, PipeDream's hybrid of
      data and pipeline parallelism (``(15, 1)``: the first stage on 15
      devices, the second on one); stage k's replicas occupy consecutive
      devices after stage k-1's.

    ``microbatches`` is m, the micro-batches of an iteration: per pipeline
    with ``width`` (the iteration has m*w), in all with ``replicas``, and in
    all for data-parallel (split over its devices). Micro-batch i runs on
    replica ``i % r`` of a stage with r replicas.
    """

    strategy: str
    stages: int
    microbatches: int
    iterations: int = 1
    width: int | None = None
    chunks: int = 2  # interleaved-1f1b: model chunks per device
    stashing: bool = True  # pipedream: False = vanilla asynchronous pipelining
    alpha: float = 0.25  # avgpipe: elastic averaging rate
    tau: int = 1  # avgpipe: average every tau iterations
    advance: int = 1  # avgpipe: forwards issued ahead of the 1F1B warm-up
    placement: str = "shared"  # avgpipe: "shared" or "disjoint"
    replicas: tuple[int, ...] | None = None  # per-stage replication (PipeDream's "15-1")
    flushes: int = 1  # gpipe: flushes per iteration, their gradients accumulated into one update
    optimizer: str = "sgd"  # "sgd" (momentum) or "adam"; recorded in options

    def __post_init__(self) -> None:
        if isinstance(self.replicas, list):
            object.__setattr__(self, "replicas", tuple(self.replicas))
        if self.width is None:
            found = find_strategy(self.strategy)
            object.__setattr__(self, "width", found.default_width if found else 1)


#: The strategy-specific options of :class:`ScheduleSpec` and the values they
#: take when a strategy does not use them (read off the spec's own defaults,
#: so there is one definition). ``width`` is not among them: its default
#: depends on the strategy (:attr:`Strategy.default_width`).
OPTION_DEFAULTS: dict[str, object] = {
    f.name: f.default
    for f in fields(ScheduleSpec)
    if f.name not in ("strategy", "stages", "microbatches", "iterations", "width", "optimizer")
}


def stage_replicas(spec: ScheduleSpec, num_stages: int | None = None) -> tuple[int, ...]:
    """How many replicas each model stage runs on: ``replicas`` when given,
    else ``width`` for every one of ``num_stages`` (default ``spec.stages``)."""
    if spec.replicas is not None:
        return tuple(spec.replicas)
    return (spec.width,) * (spec.stages if num_stages is None else num_stages)


def flush_sizes(microbatches: int, flushes: int) -> list[int]:
    """How ``microbatches`` consecutive micro-batches fall into ``flushes``
    flushes (GPipe's per update): sizes differing by at most one, the first
    ones larger (0 where there are fewer micro-batches than flushes)."""
    return [microbatches // flushes + (f < microbatches % flushes) for f in range(flushes)]


def flush_options(flushes: int) -> dict:
    """The schedule option of ``flushes`` per update (``ScheduleSpec.flushes``)
    as a schedule, a plan or a candidate records it: none for the one flush
    every strategy runs, so records of other strategies, and of GPipe in one
    flush, stay as they are without it."""
    return {"flushes": flushes} if flushes > 1 else {}


def iteration_microbatches(spec: ScheduleSpec) -> int:
    """Micro-batches entering the pipeline per iteration: m for each of the
    ``width`` pipelines, or m in all when stages have their own ``replicas``."""
    return spec.microbatches if spec.replicas is not None else spec.microbatches * spec.width


def warmup(replicas: Sequence[int], stage: int) -> int:
    """1F1B warm-up forwards of one replica of ``stage``.

    In a balanced pipeline a micro-batch spends one period on every replica
    it passes, so the micro-batches in flight at stage k, from its forward to
    its backward, are one per replica of stage k and of every later stage,
    ``sum(replicas[k:])``, shared round robin by stage k's replicas. A
    replica holds its share and starts its first backward after share - 1
    forwards: p - k - 1 with one replica per stage, and PipeDream's
    NUM_OPT_ACTIVE_MINIBATCHES - 1 at the input stage.
    """
    share = -(-sum(replicas[stage:]) // replicas[stage])
    return share - 1


def layout(replicas: Sequence[int], *, pipelines: bool) -> list[tuple[int, int]]:
    """(replica, stage) on each device, by device. ``pipelines``: whole
    replicas of the pipeline side by side (every stage has the same count;
    pipeline r on devices r*p .. r*p+p-1); otherwise each stage's replicas
    on consecutive devices, stage after stage."""
    if pipelines:
        return [(r, k) for r in range(replicas[0]) for k in range(len(replicas))]
    return [(r, k) for k, n in enumerate(replicas) for r in range(n)]


def one_version(options: Mapping[str, object], stage: int, stages: int) -> int:
    """Weight versions of a strategy that updates in place: one."""
    return 1


def pipeline_passes(spec: ScheduleSpec) -> int:
    """Stage passes of a pipeline of ``stages`` stages over every micro-batch
    of every iteration (forwards; as many backwards), whatever the replicas."""
    return spec.stages * iteration_microbatches(spec) * spec.iterations


def ring_steps(devices: int) -> int:
    """Transfers of one ring all-reduce over ``devices``: 2(n-1) steps of n each."""
    return 2 * (devices - 1) * devices


def replica_ring_transfers(spec: ScheduleSpec) -> int:
    """Every stage's gradients all-reduced over its replicas once per
    iteration (flush schedules, 2BW): none for a stage with one replica."""
    if spec.replicas is None:  # every stage on width replicas: counted, not listed (a size check runs this)
        return spec.iterations * spec.stages * ring_steps(spec.width)
    return spec.iterations * sum(ring_steps(r) for r in spec.replicas)


@dataclass(frozen=True)
class Strategy:
    """What callers may ask a strategy: each module declares one as ``STRATEGY``.

    Front ends, metrics and executors read these facts instead of testing a
    strategy's name, so everything about a strategy stays in its module.

    * ``options``: the :class:`ScheduleSpec` fields it reads besides stages,
      microbatches, iterations and optimizer (``"width"`` if it supports
      replicas); a non-default value of any other option is an error.
    * ``default_width``: the replicas it runs when ``width`` is not given.
    * ``asynchronous``: no flush; all iterations run as one stream and
      weights are updated between micro-batches of one iteration, so
      forward versions can differ across stages (metrics report the
      inconsistency).
    * ``needs_m_ge_p``: defined only for at least as many micro-batches per
      iteration as pipeline stages (sweeps skip smaller m).
    * ``weight_versions(options, stage, stages)``: the most weight versions
      stage ``stage`` of a ``stages``-deep pipeline keeps at once in steady
      state (stashing p−k, double buffering 2, in place 1), given the
      schedule's ``options``; the trackers measure the same from the IR.
      A version is the passes' copy of the weights (``StageCost.weight_bytes``).
    * ``torch_equivalent``: the torch.distributed.pipelining schedule class
      with the same per-rank compute order, if there is one.
    * ``stage_passes(spec)``: how many forward passes of a model stage the
      schedule runs (as many backwards), known before building it: the size
      of a simulation, for limits and progress.
    * ``ring_transfers(spec)``: the transfers of the ring all-reduces its
      collectives run (the engine simulates each), for progress.
    * ``planners``: the planners (:mod:`pipesim.sim.planning`) that choose
      its configuration, the one ``pipesim plan`` uses by default first:
      ``"replicas"`` (PipeDream's search over splits and per-stage
      replicas), ``"width-depth"`` (PipeDream-2BW's over width, depth,
      micro-batch size and recomputation), ``"tuner"`` (AvgPipe's, over
      pipelines and micro-batches by simulation); empty: nothing to plan.
    * ``device_costs(profile, stage_costs, options)``: what one device's
      share of each model stage costs, when devices split a stage's layers
      among them (tensor parallelism: 1/d of the work, plus the activation
      all-reduces of each pass); None: a device runs the whole stage.
    * ``shards(options)``: how many micro-batch ids make up one micro-batch
      (the shards of the devices that split it); metrics count samples
      once per micro-batch.
    * ``executable``: the emulator and the runtime can run its schedules
      on real tensors; False: they refuse it (:func:`check_executable`).
    """

    name: str
    build: Callable[[ScheduleSpec], Schedule]
    summary: str
    options: tuple[str, ...] = ()
    default_width: int = 1
    asynchronous: bool = False
    needs_m_ge_p: bool = False
    weight_versions: Callable[[Mapping[str, object], int, int], int] = field(default=one_version)
    torch_equivalent: str | None = None
    stage_passes: Callable[[ScheduleSpec], int] = field(default=pipeline_passes)
    ring_transfers: Callable[[ScheduleSpec], int] = field(default=replica_ring_transfers)
    planners: tuple[str, ...] = ()
    device_costs: Callable[..., list] | None = None
    shards: Callable[[Mapping[str, object]], int] = field(default=lambda options: 1)
    executable: bool = True

    @property
    def planner(self) -> str | None:
        """The planner ``pipesim plan`` uses by default (None: none)."""
        return self.planners[0] if self.planners else None

    def option_defaults(self) -> dict[str, object]:
        """The default of every option this strategy reads."""
        return {name: (self.default_width if name == "width" else OPTION_DEFAULTS[name]) for name in self.options}


def check_executable(strategy_name: str, executor: str) -> None:
    """Refuse, in one line, a schedule whose strategy says real tensors cannot run it."""

    found = find_strategy(strategy_name)
    if found is not None and not found.executable:
        raise StrategyError(
            f"the {executor} cannot run {strategy_name}: it needs layers split across devices "
            f"on real tensors, which only the simulator models"
        )


def check_spec(spec: ScheduleSpec, uses: Iterable[str] = ()) -> None:
    """Reject sizes < 1, out-of-range options, and options the strategy ignores.

    ``uses`` names the strategy-specific options the strategy reads (keys of
    :data:`OPTION_DEFAULTS`, and ``"width"`` if it supports replicas); a
    non-default value of any other one is an error rather than silently
    ignored (front ends can ask :func:`~pipesim.sim.strategies.strategy_options`
    which ones to pass).
    """
    for name in _CHECKED_FIELDS:
        check_field(name, getattr(spec, name), stages=spec.stages)
    if spec.replicas is not None:
        if len(spec.replicas) != spec.stages:
            raise StrategyError(
                f"replicas {','.join(map(str, spec.replicas))} name {len(spec.replicas)} "
                f"stage(s), but the schedule has {spec.stages}: give one count per stage"
            )
        if spec.width != 1:
            raise StrategyError("give either width (whole pipelines side by side) or replicas (per stage), not both")
    uses = set(uses)
    if "width" not in uses and spec.width != 1:
        wide = [s.name for s in strategies() if "width" in s.options]
        raise StrategyError(
            f"{spec.strategy} does not support width > 1 (got {spec.width}); width applies to {', '.join(wide)}"
        )
    for name, default in OPTION_DEFAULTS.items():
        if name not in uses and getattr(spec, name) != default:
            raise StrategyError(f"option {name}={getattr(spec, name)!r} does not apply to {spec.strategy}")


#: The spec fields whose values :func:`check_field` checks on their own.
_CHECKED_FIELDS = (
    "stages",
    "microbatches",
    "iterations",
    "width",
    "chunks",
    "tau",
    "advance",
    "alpha",
    "stashing",
    "placement",
    "optimizer",
    "replicas",
    "flushes",
)


def check_field(name: str, value, *, stages: int | None = None) -> None:
    """Reject a value of spec field ``name`` that no strategy and no other
    field could make valid (a size < 1, an unknown placement); a sweep
    checks each value of its axes with it before running any point.
    ``stages``, when known, is named in the replicas' message."""
    if name in ("stages", "microbatches", "iterations", "width", "chunks", "tau", "flushes"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise StrategyError(f"{name} must be an integer, got {value!r}")
        if value < 1:
            raise StrategyError(f"{name} must be >= 1, got {value}")
    elif name == "advance":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StrategyError(f"advance must be an integer >= 0, got {value!r}")
    elif name == "alpha":
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 < value <= 1.0):
            raise StrategyError(f"alpha must be a number in (0, 1], got {value!r}")
    elif name == "stashing":
        if not isinstance(value, bool):
            raise StrategyError(f"stashing must be True or False, got {value!r}")
    elif name == "placement":
        if value not in PLACEMENTS:
            raise StrategyError(f"placement must be one of {', '.join(PLACEMENTS)}, got {value!r}")
    elif name == "optimizer":
        if value not in OPTIMIZERS:
            raise StrategyError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {value!r}")
    elif name == "replicas" and value is not None:
        if (
            not isinstance(value, tuple)
            or not value
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in value)
        ):
            each = "each stage" if stages is None else f"each of the {stages} stages"
            raise StrategyError(f"replicas must give {each} a count >= 1, got {value!r}")


def one_f_one_b(n: int, warmup: int) -> Iterator[tuple[Op, int]]:
    """1F1B order of items ``0..n-1`` on one stage: ``(F|B, index)``.

    ``warmup`` forwards first (capped at ``n``), then strictly one forward and
    one backward (forward first, as torch's Schedule1F1B), then the remaining
    backwards. With warm-up ``p-k-1`` on stage ``k`` this is the classic
    schedule: at most ``min(p-k, n)`` items are between their F and their B.
    ``warmup >= n`` gives GPipe's all-forwards-then-all-backwards.
    """
    warmup = max(0, min(warmup, n))
    for i in range(warmup):
        yield F, i
    for j in range(n - warmup):
        yield F, warmup + j
        yield B, j
    for j in range(n - warmup, n):
        yield B, j


def flush_iteration(
    order: Sequence[Action],
    t: int,
    *,
    reduce: bool,
    average: bool = False,
    receives_ahead: bool = False,
) -> list[Action]:
    """One flushed iteration ``t`` of one device, with versions and updates.

    This is the one definition of flush semantics: the flush strategies build
    their schedules with it and :mod:`pipesim.sim.interchange` gives imported
    torch schedules their meaning with it.

    ``order`` is the device's order for iteration ``t`` (replica, stage and
    micro-batch ids set; no version, or already ``t``). Every pass reads version ``t``; right after
    the last backward (B or W) of each (replica, stage) comes ``[REDUCE_GRAD]
    UPDATE@v(t+1) [AVERAGE]``. In an order that carries communication (an
    imported schedule) the update is the next compute action: it goes after
    the sends and FSDP actions posted right after that backward (torch's
    REDUCE_GRAD is among them), which are posted the moment the backward
    ends, as the lowering pass places them. A receive there serves a later
    pass: posted right before it (torch's way, ``--recv-lookahead 0``), it
    comes after the update; posted ahead of it (``receives_ahead``, a
    lookahead of 1 or more), before, since the update is a compute action
    it was posted ahead of. Either way the lowering's order comes back.
    Other actions keep their place.
    """
    last: dict[tuple[int, int], int] = {}
    for pos, a in enumerate(order):
        if a.op in WEIGHT_GRADIENT_OPS:
            last[(a.replica, a.stage)] = pos
    n = len(order)
    ends: dict[int, tuple[int, int]] = {}
    for rs, pos in last.items():
        while (
            pos + 1 < n
            and order[pos + 1].op not in COMPUTE_OPS
            and order[pos + 1].op is not OVERLAP_F_B
            and (receives_ahead or order[pos + 1].op not in _RECV_OPS)
        ):
            pos += 1
        ends[pos] = rs
    out: list[Action] = []
    for pos, a in enumerate(order):
        op = a.op
        if op in PASS_OPS and a.version != t:  # a pass built with its version is kept as it is
            # built through tuple.__new__: the class call (and _replace) cost far more per action
            a = _new(Action, (op, a.stage, a.microbatch, t, a.distance, a.replica))
        out.append(a)
        rs = ends.get(pos)
        if rs is not None:
            out.extend(_update(rs[1], rs[0], t, reduce, average))
    return out


def _update(stage: int, replica: int, t: int, reduce: bool, average: bool = False) -> list[Action]:
    """The end of iteration t of a (replica, stage): ``[REDUCE_GRAD]
    UPDATE@v(t+1) [AVERAGE]``."""
    return (
        [Action(REDUCE_GRAD, stage, replica=replica)] * reduce
        + [Action(UPDATE, stage, version=t + 1, replica=replica)]
        + [Action(AVERAGE, stage, replica=replica)] * average
    )


def flush_schedule(
    spec: ScheduleSpec,
    num_stages: int,
    iteration_order: Sequence[Sequence[Action]],
    *,
    num_microbatches: int | None = None,
    width: int | None = None,
    options: dict | None = None,
) -> Schedule:
    """K flushed iterations of ``width`` whole replicas of a per-device order.

    For schedules whose devices each run several stages (interleaved) or the
    whole model (data parallelism). ``iteration_order[d]`` is device ``d``'s
    order for one iteration of replica 0 with local micro-batch ids
    ``0..m-1`` (``num_microbatches`` and ``width`` override the spec's m and
    w). Replica ``r`` runs the same order on devices ``r*len(iteration_order)
    + d``, on its own micro-batches: local id l of iteration t is id
    ``(t*m + l)*w + r``, the round-robin rule of :func:`routed`. With more
    than one replica every UPDATE waits for a REDUCE_GRAD of its stage.
    """
    m = spec.microbatches if num_microbatches is None else num_microbatches
    w = spec.width if width is None else width
    programs = []
    for r in range(w):
        for order in iteration_order:
            prog: list[Action] = []
            for t in range(spec.iterations):
                mapped = [
                    _new(
                        Action,
                        (
                            a.op,
                            a.stage,
                            None if a.microbatch is None else (t * m + a.microbatch) * w + r,
                            a.version,
                            a.distance,
                            r,
                        ),
                    )
                    for a in order
                ]
                prog.extend(flush_iteration(mapped, t, reduce=w > 1))
            programs.append(tuple(prog))
    return schedule_of(spec, programs, num_stages=num_stages, num_microbatches=m * w, replicas=w, options=options)


def replicated_schedule(
    spec: ScheduleSpec,
    replica_program: Callable[[int, int, list[range], int], list[Action]],
    *,
    options: dict | None = None,
) -> Schedule:
    """A pipeline whose stages each run on one or more replicas
    (:func:`stage_replicas`), one stage replica per device (:func:`layout`).

    ``replica_program(stage, replica, ids, warm)`` is the whole program of
    that replica: ``ids[t]`` are the micro-batch ids it runs in iteration t
    (round robin, :func:`routed`) and ``warm`` its 1F1B warm-up
    (:func:`warmup`). Width x depth (w identical pipelines) is the case of
    every stage replicated w times.
    """
    reps = stage_replicas(spec)
    per_iteration = iteration_microbatches(spec)
    programs = []
    for r, k in layout(reps, pipelines=spec.replicas is None):
        ids = [routed(t * per_iteration, per_iteration, reps[k], r) for t in range(spec.iterations)]
        programs.append(tuple(replica_program(k, r, ids, warmup(reps, k))))
    recorded = {"replicas": list(reps)} if spec.replicas is not None else {}
    return schedule_of(
        spec, programs, num_microbatches=per_iteration, replicas=reps, options=recorded | (options or {})
    )


def flushed(stage_order: Callable[[int, range, int], Iterable[tuple[Op, int]]], reps: Sequence[int]):
    """``replica_program`` of :func:`replicated_schedule` for a flush
    strategy: each iteration, ``stage_order(stage, batch, warm)`` over the
    replica's micro-batch ids ``batch`` (``(op, index into batch)`` pairs),
    then the update (after the REDUCE_GRAD of the stage's replicas when it
    has several)."""

    def program(stage: int, replica: int, ids: list[range], warm: int) -> list[Action]:
        reduce = reps[stage] > 1
        out: list[Action] = []
        for t, batch in enumerate(ids):
            if not batch:  # fewer micro-batches than replicas: still reduce (nothing) and update,
                out.extend(_update(stage, replica, t, reduce))  # so every replica stays at version t+1
                continue
            # passes built with version t, so flush_iteration need not build them again
            order = [_new(Action, (op, stage, batch[i], t, 0, replica)) for op, i in stage_order(stage, batch, warm)]
            out.extend(flush_iteration(order, t, reduce=reduce))
        return out

    return program


def schedule_of(
    spec: ScheduleSpec,
    programs,
    *,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    replicas: int | Sequence[int] = 1,
    options: dict | None = None,
) -> Schedule:
    """The :class:`Schedule` a strategy built for ``spec`` from per-device
    ``programs`` (by default ``spec.stages`` stages and ``spec.microbatches``
    micro-batches), recording the options every schedule records and the
    strategy's own ``options``."""
    return Schedule(
        strategy=spec.strategy,
        num_stages=spec.stages if num_stages is None else num_stages,
        num_microbatches=spec.microbatches if num_microbatches is None else num_microbatches,
        programs=tuple(programs),
        num_iterations=spec.iterations,
        replicas=replicas if isinstance(replicas, int) else tuple(replicas),
        options=base_options(spec) | (options or {}),
    )


def base_options(spec: ScheduleSpec) -> dict:
    """Options every schedule records."""
    return {"optimizer": spec.optimizer, "width": spec.width, "depth": spec.stages}


def asynchronous_schedule(spec: ScheduleSpec, stage_program, options: dict | None = None) -> Schedule:
    """A pipeline running all its iterations' micro-batches as one stream,
    without a flush, each stage on one or more replicas (:func:`replicated_schedule`).

    ``stage_program(stage, replica, ids, warm)`` returns that replica's
    actions for the micro-batch ids it runs (all iterations, in order) after
    ``warm`` warm-up forwards.
    """
    return replicated_schedule(
        spec, lambda k, r, ids, warm: stage_program(k, r, [i for batch in ids for i in batch], warm), options=options
    )

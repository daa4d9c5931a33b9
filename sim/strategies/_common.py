"""What every strategy module shares: the spec, the error, and the building blocks.

A strategy module turns a :class:`ScheduleSpec` into a compute-only
:class:`~pipesim.sim.ir.Schedule` (F/B/I/W, UPDATE, PREDICT, AVERAGE,
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

from ..errors import InputError
from ..ir import (
    AVERAGE,
    COMPUTE_OPS,
    OVERLAP_F_B,
    PASS_OPS,
    REDUCE_GRAD,
    UPDATE,
    WEIGHT_GRADIENT_OPS,
    Action,
    B,
    F,
    Op,
    Schedule,
)


_new = tuple.__new__  # see flush_iteration


class StrategyError(InputError):
    """A schedule spec that no strategy can build (one-line message)."""


PLACEMENTS = ("shared", "disjoint")
OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class ScheduleSpec:
    """What to build. Sizes are per replica unless said otherwise.

    ``stages`` is the pipeline depth in *devices* per replica (interleaved
    schedules put ``chunks`` model stages on each). ``microbatches`` is m per
    iteration per replica (data-parallel: per iteration in all, split over
    the devices). ``iterations`` is K: flush schedules repeat K flushed
    iterations; asynchronous ones run K*m micro-batches without a flush.
    ``width`` is w replicas: w parallel pipelines (width x depth) for the
    flush schedules and 2BW, AvgPipe's number of pipelines N_p (default 2 when
    left ``None``), and a device multiplier for data-parallel; ``None`` means
    1 for every other strategy. After construction ``width`` is an int.
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
    optimizer: str = "sgd"  # "sgd" (momentum) or "adam"; recorded in options

    def __post_init__(self) -> None:
        if self.width is None:
            from . import find_strategy  # the registry imports this module

            found = find_strategy(self.strategy)
            object.__setattr__(self, "width", found.default_width if found else 1)


#: The strategy-specific options of :class:`ScheduleSpec` and the values they
#: take when a strategy does not use them (read off the spec's own defaults,
#: so there is one definition). ``width`` is not among them: its default
#: depends on the strategy (:attr:`Strategy.default_width`).
OPTION_DEFAULTS: dict[str, object] = {
    f.name: f.default for f in fields(ScheduleSpec)
    if f.name not in ("strategy", "stages", "microbatches", "iterations", "width", "optimizer")
}


def one_version(options: Mapping[str, object], stage: int, stages: int) -> int:
    """Weight versions of a strategy that updates in place: one."""
    return 1


def pipeline_passes(spec: ScheduleSpec) -> int:
    """Stage passes of ``width`` pipelines of ``stages`` stages over every
    micro-batch of every iteration (forwards; as many backwards)."""
    return spec.stages * spec.microbatches * spec.iterations * spec.width


def ring_steps(devices: int) -> int:
    """Transfers of one ring all-reduce over ``devices``: 2(n-1) steps of n each."""
    return 2 * (devices - 1) * devices


def replica_ring_transfers(spec: ScheduleSpec) -> int:
    """Every model stage's gradients all-reduced over the ``width`` replicas
    once per iteration (width x depth, 2BW): none with one replica."""
    return spec.iterations * spec.stages * ring_steps(spec.width)


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
    * ``torch_equivalent``: the torch.distributed.pipelining schedule class
      with the same per-rank compute order, if there is one.
    * ``stage_passes(spec)``: how many forward passes of a model stage the
      schedule runs (as many backwards), known before building it: the size
      of a simulation, for limits and progress.
    * ``ring_transfers(spec)``: the transfers of the ring all-reduces its
      collectives run (the engine simulates each), for progress.
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

    def option_defaults(self) -> dict[str, object]:
        """The default of every option this strategy reads."""
        return {name: (self.default_width if name == "width" else OPTION_DEFAULTS[name]) for name in self.options}


def check_spec(spec: ScheduleSpec, uses: Iterable[str] = ()) -> None:
    """Reject sizes < 1, out-of-range options, and options the strategy ignores.

    ``uses`` names the strategy-specific options the strategy reads (keys of
    :data:`OPTION_DEFAULTS`, and ``"width"`` if it supports replicas); a
    non-default value of any other one is an error rather than silently
    ignored (front ends can ask :func:`~pipesim.sim.strategies.strategy_options`
    which ones to pass).
    """
    for name in ("stages", "microbatches", "iterations", "width", "chunks", "tau"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise StrategyError(f"{name} must be an integer, got {value!r}")
        if value < 1:
            raise StrategyError(f"{name} must be >= 1, got {value}")
    if isinstance(spec.advance, bool) or not isinstance(spec.advance, int) or spec.advance < 0:
        raise StrategyError(f"advance must be an integer >= 0, got {spec.advance!r}")
    alpha_ok = isinstance(spec.alpha, (int, float)) and not isinstance(spec.alpha, bool)
    if not (alpha_ok and 0.0 < spec.alpha <= 1.0):
        raise StrategyError(f"alpha must be a number in (0, 1], got {spec.alpha!r}")
    if not isinstance(spec.stashing, bool):
        raise StrategyError(f"stashing must be True or False, got {spec.stashing!r}")
    if spec.placement not in PLACEMENTS:
        raise StrategyError(f"placement must be one of {', '.join(PLACEMENTS)}, got {spec.placement!r}")
    if spec.optimizer not in OPTIMIZERS:
        raise StrategyError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {spec.optimizer!r}")
    uses = set(uses)
    if "width" not in uses and spec.width != 1:
        from . import strategies  # the registry imports this module

        wide = [s.name for s in strategies() if "width" in s.options]
        raise StrategyError(
            f"{spec.strategy} does not support width > 1 (got {spec.width}); width applies to {', '.join(wide)}"
        )
    for name, default in OPTION_DEFAULTS.items():
        if name not in uses and getattr(spec, name) != default:
            raise StrategyError(f"option {name}={getattr(spec, name)!r} does not apply to {spec.strategy}")


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
    m: int,
    *,
    reduce: bool,
    average: bool = False,
    global_ids: bool = False,
) -> list[Action]:
    """One flushed iteration ``t`` of one device, with versions and updates.

    This is the one definition of flush semantics: the flush strategies build
    their schedules with it and :mod:`pipesim.sim.interchange` gives imported
    torch schedules their meaning with it.

    ``order`` is the device's order for iteration ``t`` (replica and stage
    set, no version), with local micro-batch ids ``0..m-1``, or global ids
    ``t*m ..`` with ``global_ids``. Every pass reads version ``t``; right after
    the last backward (B or W) of each (replica, stage) comes ``[REDUCE_GRAD]
    UPDATE@v(t+1) [AVERAGE]``. In an order that carries communication (an
    imported schedule) the update is the next compute action: it goes after
    the sends, receives and FSDP actions posted right after that backward
    (torch's REDUCE_GRAD is among them), which are posted the moment the
    backward ends, as the lowering pass places them. Other actions keep their
    place; those with a micro-batch id get the same offset as the passes.
    """
    last: dict[tuple[int, int], int] = {}
    for pos, a in enumerate(order):
        if a.op in WEIGHT_GRADIENT_OPS:
            last[(a.replica, a.stage)] = pos
    n = len(order)
    ends: dict[int, tuple[int, int]] = {}
    for rs, pos in last.items():
        while pos + 1 < n and order[pos + 1].op not in COMPUTE_OPS and order[pos + 1].op is not OVERLAP_F_B:
            pos += 1
        ends[pos] = rs
    out: list[Action] = []
    offset = 0 if global_ids else t * m
    for pos, a in enumerate(order):
        op = a.op
        # built through tuple.__new__: the class call (and _replace) cost far more per action
        if op in PASS_OPS:
            out.append(_new(Action, (op, a.stage, a.microbatch + offset, t, a.distance, a.replica)))
        elif a.microbatch is None or not offset:
            out.append(a)
        else:
            out.append(Action(op, a.stage, a.microbatch + offset, a.version, a.distance, a.replica))
        rs = ends.get(pos)
        if rs is not None:
            rep, stage = rs
            if reduce:
                out.append(Action(REDUCE_GRAD, stage, replica=rep))
            out.append(Action(UPDATE, stage, version=t + 1, replica=rep))
            if average:
                out.append(Action(AVERAGE, stage, replica=rep))
    return out


def flush_schedule(
    spec: ScheduleSpec,
    num_stages: int,
    iteration_order: Sequence[Sequence[Action]],
    *,
    num_microbatches: int | None = None,
    width: int | None = None,
    options: dict | None = None,
) -> Schedule:
    """K flushed iterations of ``width`` replicas of a per-device order.

    ``iteration_order[d]`` is device ``d``'s order for one iteration of
    replica 0 (local micro-batch ids ``0..m-1``; ``num_microbatches`` and
    ``width`` override the spec's m and w). Replica ``r`` runs the same order on devices
    ``r*len(iteration_order) + d``; with more than one replica every UPDATE
    waits for a REDUCE_GRAD (gradient all-reduce) of its stage.
    """
    m = spec.microbatches if num_microbatches is None else num_microbatches
    w = spec.width if width is None else width
    programs = []
    for r in range(w):
        for order in iteration_order:
            order_r = order if r == 0 else [Action(a.op, a.stage, a.microbatch, a.version, a.distance, r)
                                            for a in order]
            prog: list[Action] = []
            for t in range(spec.iterations):
                prog.extend(flush_iteration(order_r, t, m, reduce=w > 1))
            programs.append(tuple(prog))
    return schedule_of(spec, programs, num_stages=num_stages, num_microbatches=m, num_replicas=w, options=options)


def schedule_of(spec: ScheduleSpec, programs, *, num_stages: int | None = None, num_microbatches: int | None = None,
                num_replicas: int = 1, options: dict | None = None) -> Schedule:
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
        num_replicas=num_replicas,
        options=base_options(spec) | (options or {}),
    )


def base_options(spec: ScheduleSpec) -> dict:
    """Options every schedule records."""
    return {"optimizer": spec.optimizer, "width": spec.width, "depth": spec.stages}


def asynchronous_schedule(spec: ScheduleSpec, stage_program, options: dict | None = None) -> Schedule:
    """One pipeline running all ``iterations * m`` micro-batches without a flush.

    ``stage_program(stage, p, n)`` returns stage ``stage``'s actions for ``n``
    micro-batches on a ``p``-stage pipeline, one stage per device.
    """
    p, n = spec.stages, spec.microbatches * spec.iterations
    return schedule_of(spec, (tuple(stage_program(k, p, n)) for k in range(p)), options=options)

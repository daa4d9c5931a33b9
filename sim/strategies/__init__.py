"""Schedule generators: one small module per strategy, all producing the IR.

``build_schedule(ScheduleSpec(strategy, stages, microbatches, ...))`` returns a
compute-only :class:`~pipesim.sim.ir.core.Schedule` (F/B/I/W, UPDATE, PREDICT,
AVERAGE, REDUCE_GRAD; :func:`pipesim.sim.ir.lowering.lower` adds SEND/RECV).
Schedule logic lives only here: weight versions, updates, predictions,
all-reduces and averaging are explicit actions, and the engine, emulator and
runtime just execute them. Micro-batch ids are global across iterations
(iteration t owns ``t*m .. t*m+m-1``); replica r of a p-device pipeline runs
on devices ``r*p .. r*p+p-1`` (AvgPipe's shared placement and data
parallelism excepted, see their modules).

Layer 2 of :mod:`pipesim.sim`: it imports only the IR and the foundations,
so a schedule is the same whichever executor runs it. Each module declares
its :class:`Strategy` as ``STRATEGY``; :mod:`.registry` holds them by name,
in the order this package registers them (listings and comparisons use it).
"""

from __future__ import annotations

from pipesim.sim.ir.core import Schedule
from pipesim.sim.strategies import (
    avgpipe,
    data_parallel,
    gpipe,
    interleaved,
    one_f_one_b,
    pipedream,
    pipedream_2bw,
    spectrain,
    tensor_parallel,
    zero_bubble,
)
from pipesim.sim.strategies._common import (
    OPTION_DEFAULTS,
    PLACEMENTS,
    ScheduleSpec,
    Strategy,
    StrategyError,
    check_field,
)
from pipesim.sim.strategies.registry import find_strategy, get_strategy, register, strategies, strategy_names

__all__ = [
    "OPTION_DEFAULTS",
    "PLACEMENTS",
    "ScheduleSpec",
    "Strategy",
    "StrategyError",
    "build_schedule",
    "check_field",
    "find_strategy",
    "get_strategy",
    "schedule_option",
    "spec_of",
    "strategies",
    "strategy_names",
    "strategy_options",
]

register(
    gpipe.STRATEGY,
    one_f_one_b.STRATEGY,
    interleaved.STRATEGY,
    zero_bubble.STRATEGY,
    pipedream.STRATEGY,
    pipedream_2bw.STRATEGY,
    spectrain.STRATEGY,
    avgpipe.STRATEGY,
    data_parallel.STRATEGY,
    tensor_parallel.STRATEGY,
)


def strategy_options(name: str) -> tuple[str, ...]:
    """Spec fields ``name`` reads besides stages, microbatches, iterations and
    optimizer (e.g. ``("width", "chunks")``). A non-default value of any other
    option makes ``build_schedule`` raise, so a front end comparing several
    strategies passes each only the options it lists."""
    return get_strategy(name).options


def schedule_option(schedule: Schedule, name: str) -> object:
    """The value of strategy option ``name`` (a :class:`ScheduleSpec` field,
    e.g. AvgPipe's ``alpha``) that ``schedule`` runs with: what its strategy
    recorded in its options, else the spec's default (an imported schedule
    without options still averages at the default rate)."""
    return schedule.options.get(name, OPTION_DEFAULTS[name])


def build_schedule(spec: ScheduleSpec) -> Schedule:
    """The compute-only schedule ``spec`` asks for; StrategyError if it cannot be built."""
    return get_strategy(spec.strategy).build(spec)


def spec_of(schedule: Schedule) -> ScheduleSpec | None:
    """The spec the schedule's strategy would rebuild it from, read off what
    every schedule records (its options), or None if no strategy has its
    name. Micro-batches are the inverse of
    :func:`~._common.iteration_microbatches`: m per pipeline, unless stages
    have their own replicas (then m in all)."""
    strategy = find_strategy(schedule.strategy)
    if strategy is None:
        return None
    opts = {name: schedule.options[name] for name in strategy.options if name in schedule.options}
    if "replicas" in opts:
        opts["replicas"] = tuple(opts["replicas"])
    per_pipeline = 1 if "replicas" in opts else schedule.options.get("width", 1)
    return ScheduleSpec(
        strategy=schedule.strategy,
        stages=schedule.num_stages,
        microbatches=schedule.num_microbatches // per_pipeline,
        iterations=schedule.num_iterations,
        optimizer=schedule.options.get("optimizer", "sgd"),
        **opts,
    )

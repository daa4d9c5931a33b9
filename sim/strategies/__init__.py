"""Schedule generators: one small module per strategy, all producing the IR.

``build_schedule(ScheduleSpec(strategy, stages, microbatches, ...))`` returns a
compute-only :class:`~pipesim.sim.ir.Schedule` (F/B/I/W, UPDATE, PREDICT,
AVERAGE, REDUCE_GRAD; :func:`pipesim.sim.lowering.lower` adds SEND/RECV).
Schedule logic lives only here: weight versions, updates, predictions,
all-reduces and averaging are explicit actions, and the engine, emulator and
runtime just execute them. Micro-batch ids are global across iterations
(iteration t owns ``t*m .. t*m+m-1``); replica r of a p-device pipeline runs
on devices ``r*p .. r*p+p-1`` (AvgPipe's shared placement and data
parallelism excepted, see their modules).
"""

from __future__ import annotations

from collections.abc import Callable

from pipesim.sim.ir import Schedule
from pipesim.sim.strategies import (
    avgpipe,
    data_parallel,
    gpipe,
    interleaved,
    one_f_one_b,
    pipedream,
    pipedream_2bw,
    spectrain,
    zero_bubble,
)
from pipesim.sim.strategies._common import ScheduleSpec, StrategyError

__all__ = ["ScheduleSpec", "StrategyError", "build_schedule", "strategy_names", "strategy_options"]

_MODULES = (
    gpipe,
    one_f_one_b,
    interleaved,
    zero_bubble,
    pipedream,
    pipedream_2bw,
    spectrain,
    avgpipe,
    data_parallel,
)
_BUILDERS: dict[str, Callable[[ScheduleSpec], Schedule]] = {mod.NAME: mod.build for mod in _MODULES}
_OPTIONS: dict[str, tuple[str, ...]] = {mod.NAME: mod.OPTIONS for mod in _MODULES}


def strategy_names() -> list[str]:
    """The strategy names ``build_schedule`` accepts, in a stable order."""
    return list(_BUILDERS)


def strategy_options(name: str) -> tuple[str, ...]:
    """Spec fields ``name`` reads besides stages, microbatches, iterations and
    optimizer (e.g. ``("width", "chunks")``). A non-default value of any other
    option makes ``build_schedule`` raise, so a front end comparing several
    strategies passes each only the options it lists."""
    try:
        return _OPTIONS[name]
    except KeyError:
        raise StrategyError(f"unknown strategy {name!r}; choose one of {', '.join(_OPTIONS)}") from None


def build_schedule(spec: ScheduleSpec) -> Schedule:
    """The compute-only schedule ``spec`` asks for; StrategyError if it cannot be built."""
    try:
        builder = _BUILDERS[spec.strategy]
    except KeyError:
        raise StrategyError(
            f"unknown strategy {spec.strategy!r}; choose one of {', '.join(_BUILDERS)}"
        ) from None
    return builder(spec)

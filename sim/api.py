"""One call from "strategy, model, machine" to a simulated result.

This is the seam every front end uses (the CLI, the figures, the validation
harness): build the schedule, cost the model on the machine's device, split
it into balanced stages, run the engine.

Before building a spec, front ends ask :mod:`pipesim.sim.engine.size` whether it
fits in this machine's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from pipesim.sim._gc import gc_paused
from pipesim.sim.engine.core import check_on_spans, check_run_options
from pipesim.sim.engine.core import simulate as run_engine
from pipesim.sim.engine.results import SimResult
from pipesim.sim.engine.size import check_size
from pipesim.sim.hardware.machines import Hardware, load_hardware
from pipesim.sim.ir.core import P2P_OPS, Schedule
from pipesim.sim.partition.split import check_split, partition
from pipesim.sim.strategies import ScheduleSpec, build_schedule, find_strategy
from pipesim.sim.workloads.catalog import model_profile
from pipesim.sim.workloads.profile import Profile, WorkloadError, check_microbatch_size
from pipesim.sim.workloads.stages import StageCost, recomputed, split_at


def resolve_hardware(hardware: str | Hardware) -> Hardware:
    return hardware if isinstance(hardware, Hardware) else load_hardware(hardware)


def model_for(
    schedule: Schedule,
    model: str,
    hardware: Hardware,
    microbatch_size: int | None,
    pipeline_depth: int = 1,
    uniform_layers: int | None = None,
) -> Profile:
    """The catalog model costed on ``hardware``'s device.

    ``uniform`` gets one layer per model stage, so each stage costs exactly
    F = 1 ms, B = 2 ms. A single-stage schedule (data parallelism) gets
    ``pipeline_depth`` layers instead, the depth the strategy was asked for, so
    each device holds the whole model a pipeline of that depth would split.
    ``uniform_layers`` fixes the count instead, so several schedules run one
    model (``pipesim compare``: interleaving's two model stages per device
    would otherwise get twice the layers of the others).
    """
    if microbatch_size is not None:
        check_microbatch_size(microbatch_size)
    layers = None
    if model == "uniform":
        layers = uniform_layers or (schedule.num_stages if schedule.num_stages > 1 else pipeline_depth)
    # a tensor-parallel schedule gets one rank's shard, its GEMMs at the shard's shapes
    shards = int(schedule.options.get("tensor_parallel", 1))
    return model_profile(model, hardware.device, microbatch_size, layers=layers, tensor_parallel=shards)


#: A simulation is small enough to confirm its split when this many runs of
#: it fit in :data:`CONFIRM_ACTIONS`; it then runs as many of the cost model's
#: best splits as fit there (see :func:`split_candidates`).
CONFIRM_SPLITS = 4
#: The actions all confirming runs of one simulation hold together (a few
#: tens of milliseconds).
CONFIRM_ACTIONS = 4000


def budgeted_actions(schedule: Schedule) -> int:
    """The actions of ``schedule`` that :data:`CONFIRM_ACTIONS` counts:
    all but its sends and receives. The lowering adds those to a
    compute-only schedule as the run starts, so a schedule that carries
    them (a lowered CSV read back) must not count them either, or it would
    confirm fewer splits than its own compute order and run on another
    split (6% slower for AvgPipe with advance 2 on pcie-4gpu). A schedule
    of more actions than the whole budget confirms nothing whatever it
    carries (a lowered one carries at most two transfers per pass), so it
    is not looked through."""
    total = sum(map(len, schedule.programs))
    if total > CONFIRM_ACTIONS:
        return total
    return sum(a.op not in P2P_OPS for program in schedule.programs for a in program)


def simulate_schedule(
    schedule: Schedule,
    profile: Profile,
    hardware: str | Hardware,
    *,
    recv_lookahead: int = 1,
    meta: dict | None = None,
    starts: Sequence[int] | None = None,
    recompute: bool = False,
    on_spans: Callable[[SimResult], None] | None = None,
) -> SimResult:
    """Split ``profile`` over the schedule's stages and run the engine.

    ``recompute``: activation recomputation (every backward re-runs its
    stage's forward; a micro-batch keeps only its layers' inputs until then,
    checkpointed per layer: :func:`~pipesim.sim.workloads.stages.recomputed`), for
    every strategy alike;
    the split is chosen for it and ``meta`` records it.

    ``starts`` gives the split (the first layer of every stage, e.g. a
    plan's). By default the split is :func:`split_for`'s; a small run
    (:data:`CONFIRM_ACTIONS`) instead runs as many of the splits the cost
    model ranks best as that budget holds (every split of a small model) and
    keeps the fastest that fits in memory (the first on a tie), so the
    model's misjudgements cost nothing where checking them is cheap.

    ``on_spans`` is called once, with the result returned, as soon as its
    spans are final: before its memory is tracked when one run is made
    (:func:`pipesim.sim.engine.core.simulate`), after the runs otherwise (the
    choice among several needs their memory).
    """
    check_run_options(recv_lookahead=recv_lookahead)
    check_recompute(recompute)
    check_on_spans(on_spans)
    schedule, profile = one_optimizer(schedule, profile)
    hw = resolve_hardware(hardware)
    info = {"model": profile.name, "hardware": hw.name, "optimizer": profile.optimizer}
    if recompute:
        info["recompute"] = True
    info.update(meta or {})

    strategy = find_strategy(schedule.strategy)  # None for an imported schedule
    shard = strategy.device_costs if strategy is not None else None
    if shard is None and profile.tensor_parallel != 1:
        raise WorkloadError(
            f"profile {profile.name!r} is one rank's shard of {profile.tensor_parallel}-way tensor parallelism; "
            "only the tensor-parallel strategy of that degree runs it"
        )

    def run(stage_costs: list[StageCost], on_spans=None) -> SimResult:
        if shard is not None:  # devices split each stage's layers (tensor parallelism)
            stage_costs = shard(profile, stage_costs, schedule.options)
        return run_engine(
            schedule,
            recomputed(stage_costs) if recompute else stage_costs,
            hw,
            microbatch_size=profile.microbatch_size,
            optimizer=profile.optimizer,
            recv_lookahead=recv_lookahead,
            meta=info,
            on_spans=on_spans,
        )

    if starts is not None:
        return run(_given_split(profile, starts, schedule), on_spans)
    actions = budgeted_actions(schedule)
    # as many of the model's best splits as the budget holds (every split of a
    # small model), so a small run's split is the engine's choice, not the model's
    limit = max(1, CONFIRM_ACTIONS // actions) if actions * CONFIRM_SPLITS <= CONFIRM_ACTIONS else 1
    candidates = split_candidates(schedule, profile, hw, limit, recv_lookahead, recompute)
    if len(candidates) == 1:
        return run(candidates[0], on_spans)
    chosen = min(map(run, candidates), key=lambda r: (any(t.out_of_memory for t in r.memory), r.makespan))
    if on_spans is not None:
        on_spans(chosen)
    return chosen


#: The optimizer a schedule records when its spec names none.
DEFAULT_OPTIMIZER = ScheduleSpec.optimizer  # the dataclass field's default


def one_optimizer(schedule: Schedule, profile: Profile) -> tuple[Schedule, Profile]:
    """The schedule and profile agreeing on the optimizer the run prices
    (update traffic, optimizer state) and records: the schedule's when it
    names another than the default (``ScheduleSpec(optimizer="adam")``, a
    sweep of ``optimizer``), else the model's (BERT and GPT train with
    Adam). A summary whose options said sgd beside Adam's memory
    contradicted itself, and a swept optimizer changed nothing. (The
    default cannot be told from a spec that names SGD: an Adam model runs
    with SGD only from a profile that says so.)"""
    named = schedule.options.get("optimizer", DEFAULT_OPTIMIZER)
    chosen = named if named != DEFAULT_OPTIMIZER else profile.optimizer
    if profile.optimizer != chosen:
        profile = replace(profile, optimizer=chosen)
    if named != chosen:
        schedule = replace(schedule, options={**schedule.options, "optimizer": chosen})
    return schedule, profile


def check_recompute(recompute) -> None:
    """``recompute`` must be a bool (a string "false" would switch it on)."""
    if not isinstance(recompute, bool):
        raise WorkloadError(f"recompute must be True or False, got {recompute!r}")


def split_for(
    schedule: Schedule, profile: Profile, hardware: Hardware, recv_lookahead: int = 1, recompute: bool = False
) -> list[StageCost]:
    """The split a simulation runs by default (the first of :func:`split_candidates`)."""
    return split_candidates(schedule, profile, hardware, 1, recv_lookahead, recompute)[0]


def split_candidates(
    schedule: Schedule,
    profile: Profile,
    hardware: Hardware,
    limit: int = 1,
    recv_lookahead: int = 1,
    recompute: bool = False,
) -> list[list[StageCost]]:
    """Up to ``limit`` splits of ``profile`` for ``schedule``, the choice first.

    Communication-aware (transfers across each boundary over the links it
    crosses, each replicated stage's all-reduce, memory as this schedule
    holds it: :func:`pipesim.sim.partition.search.ranked_splits`) on a machine
    whose devices are joined by links, for schedules that run one model stage
    per device. Compute-only elsewhere, one split: on the ``ideal`` machine
    every transfer is free and the two agree, and where a device runs
    several stages (interleaved chunks, AvgPipe's shared placement) the cost
    model's fill and drain do not describe the schedule.
    """
    limit_bytes = hardware.device.memory_bytes
    p = schedule.num_stages
    if (hardware.intra_node.kind != "ideal" or hardware.nodes > 1) and check_split(profile, p):
        from pipesim.sim.partition.layout import layout_of
        from pipesim.sim.partition.search import CostSetting, Tables, ranked_splits

        hardware.check_devices(schedule.num_devices)
        layout = layout_of(schedule, recv_lookahead)
        if max(layout.stages_on().values()) == 1:
            tables = Tables(profile, recompute)
            setting = CostSetting.of(profile, hardware, limit_bytes)
            return [tables.split(s) for s in ranked_splits(tables, layout, setting, limit)]
    # compute-only: the split balances forward + backward; with recomputation
    # every stage's extra forward is added afterwards (the memory test here
    # counts whole stashes, so it errs on the safe side)
    return [partition(profile, p, memory_limit_bytes=limit_bytes)]


def _given_split(profile: Profile, starts: Sequence[int], schedule: Schedule) -> list[StageCost]:
    starts = list(starts)
    if len(starts) != schedule.num_stages:
        raise WorkloadError(f"the split gives {len(starts)} stages; the schedule has {schedule.num_stages}")
    return split_at(profile, starts)


def simulate(
    spec: ScheduleSpec,
    model: str = "uniform",
    hardware: str | Hardware = "ideal",
    *,
    profile: Profile | None = None,
    microbatch_size: int | None = None,
    recv_lookahead: int = 1,
    recompute: bool = False,
    on_spans: Callable[[SimResult], None] | None = None,
) -> SimResult:
    """Simulate strategy ``spec`` on a catalog ``model`` (or a ``profile``),
    with activation recomputation if ``recompute``, calling ``on_spans`` as
    soon as the spans are final (:func:`simulate_schedule`).

    Every argument is checked before anything is built: an
    :class:`~pipesim.sim.errors.InputError` names the one that is wrong, and
    :class:`SizeError` refuses a run too large for this machine's memory.
    """
    _check_simulate_arguments(spec, model, profile)
    check_run_options(recv_lookahead=recv_lookahead)
    if microbatch_size is not None:
        check_microbatch_size(microbatch_size)
    check_recompute(recompute)
    check_on_spans(on_spans)
    check_size(spec)
    hw = resolve_hardware(hardware)
    with gc_paused():
        schedule = build_schedule(spec)
    if profile is None:
        profile = model_for(schedule, model, hw, microbatch_size, pipeline_depth=spec.stages)
    elif microbatch_size is not None:
        profile = replace(profile, microbatch_size=microbatch_size)
    return simulate_schedule(
        schedule, profile, hw, recv_lookahead=recv_lookahead, recompute=recompute, on_spans=on_spans
    )


def _check_simulate_arguments(spec, model, profile) -> None:
    from pipesim.sim.strategies import StrategyError
    from pipesim.sim.workloads.profile import WorkloadError

    if not isinstance(spec, ScheduleSpec):
        raise StrategyError(f"spec must be a ScheduleSpec, got {type(spec).__name__}")
    if not isinstance(spec.strategy, str):  # build_schedule would look an unhashable one up as a key
        raise StrategyError(f"strategy must be a strategy name, got {type(spec.strategy).__name__}")
    if not isinstance(model, str):
        raise WorkloadError(f"model must be a catalog model name, got {type(model).__name__}")
    if profile is not None and not isinstance(profile, Profile):
        raise WorkloadError(
            f"profile must be a pipesim.sim.workloads.profile.Profile or None, got {type(profile).__name__}"
        )

"""One call from "strategy, model, machine" to a simulated result.

This is the seam every front end uses (the CLI, the figures, the validation
harness): build the schedule, cost the model on the machine's device, split
it into balanced stages, run the engine.

Size. A simulation keeps every action, span and memory event until it ends,
so its memory grows with the stage passes it computes (one micro-batch
through one model stage: a forward, a backward, their transfers and their
share of updates). :func:`check_size` estimates that count from the spec
alone and refuses, before anything is built, a run whose memory would exceed
what this machine has available (:class:`SizeError`).
"""

from __future__ import annotations

import os
from dataclasses import replace

from ._gc import gc_paused
from .engine import check_run_options
from .engine import simulate as run_engine
from .hardware import Hardware, load_hardware
from .ir import Schedule
from .models import model_profile
from .partition import partition
from .results import SimResult
from .strategies import ScheduleSpec, build_schedule, find_strategy
from .workload import Profile, check_microbatch_size

from .errors import InputError

#: Memory one stage pass costs a simulation, upper bound. Measured (peak RSS
#: over m = 256 -> 1024 on 16 stages): 3.3-4.6 KiB for every strategy on the
#: ideal machine, about 6 KiB on a real interconnect with trace.json and
#: timeline.html written; rounded up.
BYTES_PER_PASS = 8 * 1024


class SizeError(InputError):
    """A run too large to simulate in this machine's memory."""


def estimate_passes(spec: ScheduleSpec) -> int | None:
    """Stage passes ``spec`` computes: model stages x micro-batches x
    iterations x replicas (data parallelism: whole-model passes, one per
    micro-batch). None when the spec's sizes are not positive integers
    (building it will say why)."""
    sizes = (spec.stages, spec.microbatches, spec.iterations, spec.width, spec.chunks)
    strategy = find_strategy(spec.strategy)
    if strategy is None or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
        return None
    return strategy.stage_passes(spec)


def available_memory_bytes() -> int | None:
    """Memory this process may still fill: Linux's MemAvailable, else the
    physical memory, else None (unknown: no limit)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_size(spec: ScheduleSpec) -> None:
    """Refuse a spec whose simulation would not fit in memory, before building it."""
    passes = estimate_passes(spec)
    available = available_memory_bytes()
    if passes is None or available is None or passes * BYTES_PER_PASS <= available:
        return
    raise SizeError(
        f"{spec.strategy} with {spec.stages} stages, {spec.microbatches} micro-batches and {spec.iterations} "
        f"iteration(s) computes {passes:,} stage passes; at {BYTES_PER_PASS // 1024} KiB each that needs "
        f"{_gib(passes * BYTES_PER_PASS)} and this machine has {_gib(available)} available (at most "
        f"{available // BYTES_PER_PASS:,} passes): use fewer micro-batches, iterations or stages"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def resolve_hardware(hardware: str | Hardware) -> Hardware:
    return hardware if isinstance(hardware, Hardware) else load_hardware(hardware)


def model_for(schedule: Schedule, model: str, hardware: Hardware, microbatch_size: int | None,
              pipeline_depth: int = 1) -> Profile:
    """The catalog model costed on ``hardware``'s device.

    ``uniform`` gets one layer per model stage, so each stage costs exactly
    F = 1 ms, B = 2 ms. A single-stage schedule (data parallelism) gets
    ``pipeline_depth`` layers instead, the depth the strategy was asked for, so
    each device holds the whole model a pipeline of that depth would split.
    """
    if microbatch_size is not None:
        check_microbatch_size(microbatch_size)
    layers = None
    if model == "uniform":
        layers = schedule.num_stages if schedule.num_stages > 1 else pipeline_depth
    return model_profile(model, hardware.device, microbatch_size, layers=layers)


def simulate_schedule(
    schedule: Schedule,
    profile: Profile,
    hardware: str | Hardware,
    *,
    recv_lookahead: int = 1,
    meta: dict | None = None,
) -> SimResult:
    """Partition ``profile`` over the schedule's stages and run the engine."""
    check_run_options(recv_lookahead=recv_lookahead)
    hw = resolve_hardware(hardware)
    stage_costs = partition(profile, schedule.num_stages, memory_limit_bytes=hw.device.memory_bytes)
    info = {"model": profile.name, "hardware": hw.name, "optimizer": profile.optimizer}
    info.update(meta or {})
    return run_engine(
        schedule,
        stage_costs,
        hw,
        microbatch_size=profile.microbatch_size,
        optimizer=profile.optimizer,
        recv_lookahead=recv_lookahead,
        meta=info,
    )


def simulate(
    spec: ScheduleSpec,
    model: str = "uniform",
    hardware: str | Hardware = "ideal",
    *,
    profile: Profile | None = None,
    microbatch_size: int | None = None,
    recv_lookahead: int = 1,
) -> SimResult:
    """Simulate strategy ``spec`` on a catalog ``model`` (or a ``profile``).

    Every argument is checked before anything is built: an
    :class:`~pipesim.sim.errors.InputError` names the one that is wrong, and
    :class:`SizeError` refuses a run too large for this machine's memory.
    """
    _check_simulate_arguments(spec, model, profile)
    check_run_options(recv_lookahead=recv_lookahead)
    if microbatch_size is not None:
        check_microbatch_size(microbatch_size)
    check_size(spec)
    hw = resolve_hardware(hardware)
    with gc_paused():
        schedule = build_schedule(spec)
    if profile is None:
        profile = model_for(schedule, model, hw, microbatch_size, pipeline_depth=spec.stages)
    elif microbatch_size is not None:
        profile = replace(profile, microbatch_size=microbatch_size)
    return simulate_schedule(schedule, profile, hw, recv_lookahead=recv_lookahead)


def _check_simulate_arguments(spec, model, profile) -> None:
    from .strategies import StrategyError
    from .workload import WorkloadError

    if not isinstance(spec, ScheduleSpec):
        raise StrategyError(f"spec must be a ScheduleSpec, got {type(spec).__name__}")
    if not isinstance(spec.strategy, str):  # build_schedule would look an unhashable one up as a key
        raise StrategyError(f"strategy must be a strategy name, got {type(spec.strategy).__name__}")
    if not isinstance(model, str):
        raise WorkloadError(f"model must be a catalog model name, got {type(model).__name__}")
    if profile is not None and not isinstance(profile, Profile):
        raise WorkloadError(f"profile must be a pipesim.sim.workload.Profile or None, got {type(profile).__name__}")

"""How big a simulation will be, known from its spec before anything is built.

A simulation keeps every action, span and memory event until it ends, so its
memory grows with the stage passes it computes (one micro-batch through one
model stage: a forward, a backward, their transfers and their share of
updates). :func:`check_size` estimates that count from the spec alone (each
strategy says how many passes it runs: ``Strategy.stage_passes``) and
refuses, before anything is built, a run whose memory would exceed what this
machine has available (:class:`SizeError`). Its time grows with the passes
too, and with the steps of its gradient all-reduces, which the engine
simulates link by link: :func:`estimate_work` counts both, for the progress
bar (an upper bound: a ring that has its links to itself, as data
parallelism's does on a switched machine, runs only its last step:
:meth:`pipesim.sim.engine.core._Run.ring_steps`).

This module imports only the strategies, so a command that merely prints a
schedule pays for no engine, numpy or SimPy at start-up.
"""

from __future__ import annotations

import os

from pipesim.sim.errors import InputError
from pipesim.sim.strategies import ScheduleSpec, find_strategy

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


def estimate_devices(spec: ScheduleSpec) -> int | None:
    """Devices ``spec`` runs on, at most: its stages' replicas summed, or its
    stages times its width (pipelines that share devices use fewer). None
    when the sizes are not positive integers."""
    reps = spec.replicas
    if reps is not None:
        if not isinstance(reps, tuple) or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in reps):
            return None
        return sum(reps)
    sizes = (spec.stages, spec.width)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
        return None
    return spec.stages * spec.width


def estimate_work(spec: ScheduleSpec) -> int | None:
    """Stage passes plus the ring steps of the run's collectives (each a
    transfer the engine simulates): what a simulation's time grows with."""
    passes = estimate_passes(spec)
    if passes is None:
        return None
    return passes + find_strategy(spec.strategy).ring_transfers(spec)


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
    """Refuse a spec whose simulation would not fit in memory, before building it.

    Every device costs at least what a pass does (its program, its walk, its
    memory track), so a run of few passes on an enormous replica count is
    refused too, not built."""
    passes = estimate_passes(spec)
    devices = estimate_devices(spec)
    available = available_memory_bytes()
    if passes is None or devices is None or available is None:
        return
    if devices * BYTES_PER_PASS > available:  # the devices alone do not fit, whatever the passes
        raise SizeError(
            f"{spec.strategy} with {devices:,} devices would need at least {_gib(devices * BYTES_PER_PASS)} "
            f"({BYTES_PER_PASS // 1024} KiB per device) and this machine has {_gib(available)} available: "
            "use fewer replicas or stages"
        )
    if (passes + devices) * BYTES_PER_PASS <= available:
        return
    raise SizeError(
        f"{spec.strategy} with {spec.stages} stages, {spec.microbatches} micro-batches and {spec.iterations} "
        f"iteration(s) computes {passes:,} stage passes; at {BYTES_PER_PASS // 1024} KiB each that needs "
        f"{_gib(passes * BYTES_PER_PASS)} and this machine has {_gib(available)} available (at most "
        f"{max(0, available // BYTES_PER_PASS - devices):,} passes on its {devices:,} devices): use fewer "
        "micro-batches, iterations or stages"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"

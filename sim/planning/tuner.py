"""AvgPipe's tuner: the number of parallel pipelines and of micro-batches, by simulation.

AvgPipe (Chen, Xu, Qian, Zhou, PPoPP'23) picks the number of pipelines N and
the micro-batches m per pipeline with a profiling-based tuner: it measures
candidate (N, m), keeps those that fit in device memory and takes the
fastest. pipesim's tuner does the same with the engine in place of
profiling runs (docs/concepts/strategies.md; AvgPipe's full text was not available,
so the strategy itself is pipesim's interpretation):

* every N in ``pipelines`` and every m in ``microbatches`` (default: the
  divisors of the batch up to :data:`MAX_MICROBATCHES`), each pipeline
  training on ``batch_size`` samples per iteration in m micro-batches of
  ``batch_size / m`` (the model costed at that size: ``profile_for``), so an
  iteration trains on N x batch_size samples;
* the pipeline depth is the one whose schedule occupies exactly the GPUs
  (the default shared placement runs every pipeline on all of them, a
  disjoint one gives each GPUs / N);
* each candidate is simulated for ``iterations`` iterations with the split
  a simulation picks, measured in steady state
  (:func:`.plan.steady_throughput`) and checked against memory by the
  engine's accounting; the fastest that fits wins.

There is no analytic model: every candidate is simulated, so a candidate's
``analytic_samples_per_s`` is its simulated throughput too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipesim.sim.errors import InputError
from pipesim.sim.hardware.machines import Hardware
from pipesim.sim.planning.plan import (
    ITERATIONS,
    MAX_GPUS,
    Candidate,
    Plan,
    PlanError,
    Stage,
    check_counts,
    check_plan_options,
    check_served,
    memory_limit,
    out_of_memory,
    steady_state,
)
from pipesim.sim.strategies import ScheduleSpec, StrategyError, build_schedule
from pipesim.sim.workloads.profile import Profile

PLANNER = "tuner"
#: Pipeline counts tried by default.
PIPELINES = (1, 2, 3, 4)
#: Most micro-batches per pipeline tried by default.
MAX_MICROBATCHES = 32


@dataclass(frozen=True)
class TuneRequest:
    """What to tune: ``strategy`` on the first ``gpus`` devices of
    ``hardware``, each pipeline training on ``batch_size`` samples per
    iteration; ``profile_for(b)`` is the model at micro-batch size b. The
    grid is ``pipelines`` x ``microbatches`` (see the module doc)."""

    strategy: str
    profile_for: Callable[[int], Profile]
    hardware: Hardware
    gpus: int
    batch_size: int
    pipelines: tuple[int, ...] = PIPELINES
    microbatches: tuple[int, ...] | None = None
    iterations: int = ITERATIONS
    options: dict = field(default_factory=dict)
    recv_lookahead: int = 1
    recompute: bool = False
    memory_limit_bytes: float | None = None
    model: str | None = None
    profile_path: str | None = None


def check_tune_request(req: TuneRequest) -> None:
    """One-line errors for a request the tuner cannot serve."""
    check_served(req.strategy, PLANNER, "the tuner")
    check_counts(req, ("gpus", "batch_size", "iterations"))
    for name in ("pipelines", "microbatches"):
        v = getattr(req, name)
        if v is not None and (not v or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v)):
            raise PlanError(f"{name} must be whole numbers >= 1, got {v!r}")
    if req.gpus > MAX_GPUS:
        raise PlanError(f"the planner searches up to {MAX_GPUS} devices, not {req.gpus}")
    if req.hardware.num_devices is not None and req.gpus > req.hardware.num_devices:
        raise PlanError(f"{req.hardware.name} has {req.hardware.num_devices} devices, not {req.gpus}")
    if not isinstance(req.recompute, bool):
        raise PlanError(f"recompute must be True or False, got {req.recompute!r}")
    check_plan_options(req.strategy, req.options, {"width"}, "the tuner chooses the pipelines")


def grid(req: TuneRequest) -> list[tuple[int, int]]:
    """(pipelines, micro-batches) to simulate: m must divide the batch."""
    ms = req.microbatches or tuple(m for m in range(1, MAX_MICROBATCHES + 1) if req.batch_size % m == 0)
    out = [(n, m) for n in sorted(set(req.pipelines)) for m in sorted(set(ms)) if req.batch_size % m == 0]
    if not out:
        raise PlanError(f"no micro-batch count tried divides the batch of {req.batch_size}")
    return out


def schedule_on_gpus(req: TuneRequest, pipelines: int, microbatches: int):
    """The schedule of ``pipelines`` x ``microbatches`` that occupies exactly
    the GPUs (all of them per pipeline when pipelines share devices, else
    GPUs / N each), or the reason there is none."""
    for depth in dict.fromkeys((req.gpus, req.gpus // pipelines)):
        if depth < 1:
            continue
        spec = ScheduleSpec(
            req.strategy, depth, microbatches, iterations=req.iterations, width=pipelines, **req.options
        )
        try:
            from pipesim.sim.engine.size import check_size

            check_size(spec)
            schedule = build_schedule(spec)
        except (StrategyError, InputError) as e:
            return None, f"not simulated: {e}"
        if schedule.num_devices == req.gpus:
            return schedule, ""
    return None, f"not simulated: {pipelines} pipelines do not fill {req.gpus} devices"


def measure(req: TuneRequest, pipelines: int, microbatches: int, profiles: dict) -> Candidate | str:
    """One (N, m) simulated with the engine (see the module doc), or why it
    cannot run on the GPUs."""
    from pipesim.sim.api import simulate_schedule

    b = req.batch_size // microbatches
    if b not in profiles:
        profiles[b] = req.profile_for(b)
    params = {"pipelines": pipelines, "microbatches": microbatches, "microbatch_size": b}
    name = f"N={pipelines} m={microbatches}"
    schedule, note = schedule_on_gpus(req, pipelines, microbatches)
    if schedule is None:
        return note
    result = simulate_schedule(
        schedule, profiles[b], req.hardware, recv_lookahead=req.recv_lookahead, recompute=req.recompute
    )
    rate, steady = steady_state(result)
    peak = max(t.peak_bytes for t in result.memory)
    stages = tuple(Stage(c.first_layer, c.last_layer, pipelines) for c in result.stage_costs)
    return Candidate(
        config=name,
        stages=stages,
        source="tuner",
        analytic_samples_per_s=rate,
        simulated_samples_per_s=rate,
        steady=steady,
        microbatches=microbatches,
        iterations=req.iterations,
        peak_memory_bytes=peak,
        out_of_memory=out_of_memory(result, _limit(req)),
        bottleneck="measured by the engine",
        params=params | {"depth": schedule.num_stages},
    )


def _limit(req: TuneRequest) -> float:
    return memory_limit(req.hardware, req.memory_limit_bytes)


def tune(req: TuneRequest, progress: Callable[[str], None] | None = None) -> Plan:
    """Simulate every (N, m) of the grid and choose the fastest that fits."""
    say = progress or (lambda msg: None)
    started = time.perf_counter()
    check_tune_request(req)
    profiles: dict[int, Profile] = {}
    found: list[Candidate] = []
    why = ""
    for n, m in grid(req):
        say(f"simulating {n} pipelines of {m} micro-batches")
        got = measure(req, n, m, profiles)
        if isinstance(got, str):
            why = why or got
        else:
            found.append(got)
    if not found:
        raise PlanError(f"no (pipelines, micro-batches) of the grid runs on {req.gpus} devices: {why}")
    chosen = max(range(len(found)), key=lambda i: (not found[i].out_of_memory, found[i].samples_per_s))
    best = found[chosen].params
    return Plan(
        strategy=req.strategy,
        model=req.model or profiles[best["microbatch_size"]].name,
        hardware=req.hardware.name,
        hardware_spec=req.hardware.to_json(),
        gpus=req.gpus,
        microbatches=best["microbatches"],
        iterations=req.iterations,
        microbatch_size=best["microbatch_size"],
        options=dict(req.options),
        candidates=tuple(found),
        chosen=chosen,
        data_parallel_samples_per_s=None,
        memory_limit_bytes=_limit(req),
        planner_seconds=time.perf_counter() - started,
        recv_lookahead=req.recv_lookahead,
        profile=req.profile_path,
        planner=PLANNER,
        width=best["pipelines"],
        recompute=req.recompute,
        batch_size=req.batch_size,
    )

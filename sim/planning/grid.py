"""The width x depth planner: PipeDream-2BW's, and the flush baselines'.

PipeDream-2BW (Narayanan et al., ICML'21, "Memory-Efficient Pipeline-Parallel
DNN Training") runs w identical pipelines of depth d on w x d devices and
plans over (w, d), the micro-batch size b and activation recomputation for a
global batch B (m = B / (w b) micro-batches per pipeline per update). Its
planner scores every configuration with a closed-form model and keeps the
fastest that fits in memory. The same planner serves PipeDream-Flush
(``1f1b``) and GPipe, so baselines are compared at their best configuration
too (``Strategy.planners`` says which strategies use it).

Candidates
    every d dividing the GPUs (at most one stage per layer), w = GPUs / d,
    every micro-batch size b (powers of two, or the ones asked for) with
    w b dividing B, recomputation off and on; a strategy that needs m >= d
    (2BW: ``Strategy.needs_m_ge_p``) is not offered fewer. Each gets the
    split of the layers into d stages that balances per-stage compute under
    the memory model below (:func:`~pipesim.sim.partition.balance.balanced`).
Time (the paper's model, per micro-batch in steady state)
    stage k costs its compute (forward and backward; with recomputation the
    forward twice) plus its incoming communication (the activation from
    stage k-1 and the gradient from stage k+1, over the links between the
    devices of pipeline 0), plus its optimizer step spread over the m
    micro-batches of an update; the data-parallel all-reduce of its
    gradients (``StageCost.gradient_bytes``, as the engine's REDUCE_GRAD
    moves them) over its w replicas (a ring over those devices) runs once per
    update. 2BW never flushes, so the all-reduce overlaps the next
    micro-batches and counts only when it is longer, amortised over m:
    time per update = m x max over stages of max(compute + communication,
    all-reduce / m). A flushed schedule (1F1B, GPipe) pays its fill and
    drain and then the all-reduce and step: (m + d - 1) x max over stages
    of (compute + communication) + max over stages of (all-reduce + step).
    Throughput = B / time per update.
Memory (per device, stage k)
    weights x the versions the strategy keeps (``Strategy.weight_versions``:
    2BW two, flush one), gradients, optimizer state (the profile's
    optimizer), a send and a receive buffer per boundary tensor, and the
    activations of the micro-batches in flight at stage k (the 1F1B family
    d - k, GPipe all m: :func:`~.layout.traits_of` measures which), each
    its full stash or, with recomputation (checkpointed per layer), only
    its layers' inputs, and one of them its backward's peak while it
    recomputes layer after layer (:func:`.cost.held_activations`).
    Byte counts are the profile's, each copy of the weights at its
    :class:`~pipesim.sim.workloads.profile.Precision` (a catalog model on a
    mixed-precision device: 16-bit weights for the passes and their
    versions, 16-bit gradients, fp32 master weights and optimizer state),
    activations in the device's precision.

:data:`CONFIRM` configurations that fit are simulated with the engine, the
model's best of every (width, depth, recompute) shape first
(:func:`confirmation_order`) (``ScheduleSpec(width=w)``, the chosen
split, ``recompute``), in steady state (:func:`.plan.steady_throughput`),
and the fastest confirmed configuration that fits in the engine's memory
accounting wins. The answer is a :class:`~.plan.Plan` whose candidates carry
(width, depth, micro-batch size, micro-batches, recompute) in ``params``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from pipesim.sim.engine.core import bucketed_exposure, gradient_buckets
from pipesim.sim.errors import InputError
from pipesim.sim.hardware.machines import Hardware
from pipesim.sim.partition.balance import balanced
from pipesim.sim.partition.cost import LinkModel, stage_memory, update_seconds
from pipesim.sim.partition.layout import chooses_flushes, fewest_flushes, traits_of
from pipesim.sim.partition.search import Tables, memory_terms
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
from pipesim.sim.strategies import ScheduleSpec, StrategyError, build_schedule, get_strategy
from pipesim.sim.strategies._common import flush_options
from pipesim.sim.workloads.profile import Profile
from pipesim.sim.workloads.stages import StageCost

PLANNER = "width-depth"
#: Configurations confirmed with the engine.
CONFIRM = 6
#: Largest micro-batch size tried by default (powers of two up to it).
MAX_MICROBATCH_SIZE = 64
#: Most micro-batches per pipeline per update a candidate may have: its
#: confirming run holds iterations x m x GPUs passes (the grid's smallest b
#: for a big B would otherwise ask for long simulations).
MAX_MICROBATCHES = 512
#: How w pipelines of depth d sit on the devices (:attr:`Shape.grouping`):
#: "pipelines" puts pipeline r on devices r*d .. r*d+d-1 (a stage's
#: replicas all-reduce across the pipelines' devices); "stages" puts stage
#: k's w replicas on devices k*w .. k*w+w-1, the rank order of Megatron-LM's
#: ``initialize_model_parallel`` (data-parallel groups of consecutive ranks,
#: pipelines strided), which PipeDream-2BW's runtime uses: on a multi-server
#: machine the all-reduces stay inside a server and the activations cross
#: the network instead.
GROUPINGS = ("pipelines", "stages")


@dataclass(frozen=True)
class GridRequest:
    """What to plan: ``strategy`` on the first ``gpus`` devices of
    ``hardware`` for a global batch of ``batch_size`` samples per update.
    ``profile_for(b)`` is the model at micro-batch size b (the catalog costs
    it at any b; a measured profile only at its own). ``microbatch_sizes``
    (default: powers of two up to :data:`MAX_MICROBATCH_SIZE`) and
    ``recompute`` (the choices searched) bound the grid; ``confirm``
    configurations are simulated, each for ``iterations`` updates."""

    strategy: str
    profile_for: Callable[[int], Profile]
    hardware: Hardware
    gpus: int
    batch_size: int
    microbatch_sizes: tuple[int, ...] | None = None
    recompute: tuple[bool, ...] = (False, True)
    iterations: int = ITERATIONS
    confirm: int = CONFIRM
    options: dict = field(default_factory=dict)
    recv_lookahead: int = 1
    memory_limit_bytes: float | None = None
    model: str | None = None
    profile_path: str | None = None


@dataclass(frozen=True)
class Shape:
    """One configuration of the grid."""

    width: int
    depth: int
    microbatch_size: int
    microbatches: int
    recompute: bool
    grouping: str = "pipelines"
    #: flushes per update (GPipe's gradient accumulation, ``ScheduleSpec.flushes``)
    flushes: int = 1

    @property
    def params(self) -> dict:
        found = {
            "width": self.width,
            "depth": self.depth,
            "microbatch_size": self.microbatch_size,
            "microbatches": self.microbatches,
            "recompute": self.recompute,
            "grouping": self.grouping,
        }
        return found | flush_options(self.flushes)

    @property
    def name(self) -> str:
        return f"{self.width}x{self.depth}" + (" by stage" if self.grouping == "stages" else "")

    def device(self, replica: int, stage: int) -> int:
        """The device of ``replica`` of ``stage`` under the shape's grouping."""
        if self.grouping == "stages":
            return stage * self.width + replica
        return replica * self.depth + stage


def shape_spec(strategy: str, params: dict, iterations: int, options: dict) -> ScheduleSpec:
    """The schedule of a grid configuration (``Shape.params``): w pipelines
    side by side, or, grouped by stage, each stage's w replicas on
    consecutive devices with the w pipelines' micro-batches in one count."""
    w, d, m = params["width"], params["depth"], params["microbatches"]
    options = options | flush_options(params.get("flushes", 1))
    if params.get("grouping", "pipelines") == "stages":
        return ScheduleSpec(strategy, d, m * w, iterations=iterations, replicas=(w,) * d, **options)
    return ScheduleSpec(strategy, d, m, iterations=iterations, width=w, **options)


@dataclass(frozen=True)
class Score:
    """The closed-form model's answer for one configuration and split."""

    samples_per_s: float
    bottleneck: str
    memory_bytes: tuple[int, ...]  # per stage (every replica of it holds the same)


def check_grid_request(req: GridRequest) -> None:
    """One-line errors for a request the grid cannot plan."""
    check_served(req.strategy, PLANNER, "width x depth")
    check_counts(req, ("gpus", "batch_size", "iterations"))
    check_counts(req, ("confirm",), minimum=0)
    if req.gpus > MAX_GPUS:
        raise PlanError(f"the planner searches up to {MAX_GPUS} devices, not {req.gpus}")
    if req.hardware.num_devices is not None and req.gpus > req.hardware.num_devices:
        raise PlanError(f"{req.hardware.name} has {req.hardware.num_devices} devices, not {req.gpus}")
    if req.microbatch_sizes is not None and (
        not req.microbatch_sizes
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in req.microbatch_sizes)
    ):
        raise PlanError(f"micro-batch sizes must be whole numbers >= 1, got {req.microbatch_sizes!r}")
    if not req.recompute or any(not isinstance(r, bool) for r in req.recompute):
        raise PlanError(f"recompute choices must be True and/or False, got {req.recompute!r}")
    check_plan_options(req.strategy, req.options, {"replicas", "width"}, "the planner chooses the width")


def shapes(req: GridRequest, layers: int) -> list[Shape]:
    """Every configuration of the grid the strategy can run (see the module doc)."""
    needs_m_ge_p = get_strategy(req.strategy).needs_m_ge_p
    sizes = req.microbatch_sizes or tuple(2**i for i in range(MAX_MICROBATCH_SIZE.bit_length()))
    out = []
    for d in (d for d in range(1, req.gpus + 1) if req.gpus % d == 0 and d <= layers):
        w = req.gpus // d
        for b in sorted(set(sizes)):
            if req.batch_size % (w * b):
                continue
            m = req.batch_size // (w * b)
            if (needs_m_ge_p and m < d) or m > MAX_MICROBATCHES:
                continue
            for grouping in groupings(req, w, d):
                out.extend(Shape(w, d, b, m, r, grouping) for r in sorted(set(req.recompute)))
    if not out:
        raise PlanError(
            f"no width x depth configuration of {req.gpus} devices divides a batch of "
            f"{req.batch_size} into micro-batches of the sizes tried"
            + (" with at least as many micro-batches as stages" if needs_m_ge_p else "")
        )
    return out


def groupings(req: GridRequest, width: int, depth: int) -> tuple[str, ...]:
    """The groupings worth scoring: both where the devices span several
    servers and neither dimension is 1 (elsewhere the two place the same
    traffic on equivalent links)."""
    if width > 1 and depth > 1 and req.gpus > req.hardware.local_devices:
        return GROUPINGS
    return GROUPINGS[:1]


class _Grid:
    """One planning run's caches: a profile and its tables per micro-batch
    size (and recomputation), links, the strategy's traits."""

    def __init__(self, req: GridRequest, limit: float) -> None:
        self.req = req
        self.limit = limit
        self.strategy = get_strategy(req.strategy)
        self.traits = traits_of(req.strategy, req.recv_lookahead)
        self.links = LinkModel(req.hardware)
        self._profiles: dict[int, Profile] = {}
        self._tables: dict[tuple[int, bool], Tables] = {}

    def profile(self, b: int) -> Profile:
        if b not in self._profiles:
            self._profiles[b] = self.req.profile_for(b)
        return self._profiles[b]

    def tables(self, b: int, recompute: bool) -> Tables:
        key = (b, recompute)
        if key not in self._tables:
            self._tables[key] = Tables(self.profile(b), recompute)
        return self._tables[key]

    def inflight(self, shape: Shape, k: int) -> int:
        return self.traits.inflight(1, shape.depth - k - 1, shape.microbatches, self.req.iterations, shape.flushes)

    def fewest_flushes(self, shape: Shape) -> Shape:
        """``shape`` with the fewest flushes per update whose split fits
        (:func:`~pipesim.sim.partition.layout.fewest_flushes`), where the
        planner picks them; else as it is."""
        if not chooses_flushes(self.traits, self.req.options):
            return shape
        flushes, _ = fewest_flushes(
            lambda f: self.split(replace(shape, flushes=f)), lambda found: bool(found[1]), shape.microbatches
        )
        return replace(shape, flushes=flushes)

    def versions(self, shape: Shape, k: int) -> int:
        opts = self.strategy.option_defaults() | self.req.options | {"width": shape.width}
        return self.strategy.weight_versions(opts, k, shape.depth)

    def split(self, shape: Shape) -> tuple[tuple[int, ...], bool]:
        """The split balancing compute among those where every stage fits
        (and whether one fits; if none does, the compute-balanced one)."""
        t = self.tables(shape.microbatch_size, shape.recompute)
        opt = self.profile(shape.microbatch_size).optimizer_state_multiplier

        def term(k: int) -> np.ndarray:
            mem = memory_terms(
                t,
                inflight=self.inflight(shape, k),
                versions=self.versions(shape, k),
                buffers=0,
                optimizer_multiplier=opt,
            )
            return np.where(t.valid & (mem <= self.limit), t.time, np.inf)

        starts = balanced(term, shape.depth)
        if starts is not None:
            return tuple(starts), True
        return tuple(balanced(lambda k: np.where(t.valid, t.time, np.inf), shape.depth)), False

    def score(self, shape: Shape, costs: list[StageCost]) -> Score:
        """The closed-form model (see the module doc)."""
        hw = self.req.hardware
        w, d, m = shape.width, shape.depth, shape.microbatches
        profile = self.profile(shape.microbatch_size)
        per_mb, reduce_s, exposed, memory = [], [], [], []
        for k, c in enumerate(costs):
            inbound = [(k - 1, costs[k - 1].activation_bytes)] if k else []
            inbound += [(k + 1, c.activation_bytes)] if k + 1 < d else []
            comm = sum(hw.transfer_time(shape.device(0, j), shape.device(0, k), n) for j, n in inbound)
            # the w replicas' transfers that share a link run one after another
            link_bound = max((self.shared_transfer(shape, j, k, n) for j, n in inbound), default=0.0)
            step = update_seconds(c.param_bytes, profile.optimizer, hw.device.kernel_bandwidth("update"))
            group = self.links.ring(tuple(shape.device(r, k) for r in range(w)))
            ring = group.seconds(c.gradient_bytes) if w > 1 else 0.0
            per_mb.append((max(c.forward_s + c.backward_s + comm, link_bound), step))
            reduce_s.append(ring)
            spec = hw.collectives
            if ring and spec is not None and spec.bucket_bytes and not self.traits.streamed:
                # a flush's all-reduce runs in DDP's buckets beside the last backward
                buckets = gradient_buckets(c, spec.first_bucket_bytes, spec.bucket_bytes)
                exposed.append(bucketed_exposure(buckets, c.backward_s, group.seconds))
            else:
                exposed.append(ring)
            boundary = c.input_bytes + (c.activation_bytes if k + 1 < d else 0)
            memory.append(
                stage_memory(
                    c, self.inflight(shape, k), self.versions(shape, k), 0, profile.optimizer_state_multiplier, boundary
                )
            )
        if self.traits.streamed:  # no flush: the all-reduce overlaps the next update's micro-batches
            periods = [max(t + step / m, ring / m) for (t, step), ring in zip(per_mb, reduce_s)]
            slowest = int(np.argmax(periods))
            update_s = m * periods[slowest]
            what = "all-reduce" if reduce_s[slowest] / m > per_mb[slowest][0] + per_mb[slowest][1] / m else "compute"
        else:  # each flush fills and drains the pipeline
            slowest = int(np.argmax([t for t, _ in per_mb]))
            tail = max(ring + step for (_, step), ring in zip(per_mb, exposed))
            update_s = (m + shape.flushes * (d - 1)) * per_mb[slowest][0] + tail
            what = "compute"
        return Score(
            samples_per_s=self.req.batch_size / update_s if update_s > 0 else math.inf,
            bottleneck=f"stage {slowest} ({what})",
            memory_bytes=tuple(memory),
        )

    def shared_transfer(self, shape: Shape, src_stage: int, dst_stage: int, nbytes: float) -> float:
        """Seconds the busiest link of a boundary spends on one micro-batch
        of every replica: the replicas whose transfers cross replica 0's
        links queue on them (one NIC carries all w when a stage's replicas
        share a server and its neighbour sits on another)."""
        hw = self.req.hardware
        first = {link.name for link in hw.route(shape.device(0, src_stage), shape.device(0, dst_stage))}
        sharing = sum(
            1
            for r in range(shape.width)
            if first & {link.name for link in hw.route(shape.device(r, src_stage), shape.device(r, dst_stage))}
        )
        return sharing * hw.transfer_time(shape.device(0, src_stage), shape.device(0, dst_stage), nbytes)

    def candidate(self, shape: Shape) -> Candidate:
        given = self.req.options.get("flushes")
        shape = self.fewest_flushes(shape) if given is None else replace(shape, flushes=given)
        starts, _ = self.split(shape)
        t = self.tables(shape.microbatch_size, shape.recompute)
        costs = t.split(starts)
        score = self.score(shape, costs)
        stages = tuple(Stage(c.first_layer, c.last_layer, shape.width) for c in costs)
        peak = max(score.memory_bytes)
        return Candidate(
            config=shape.name,
            stages=stages,
            source="closed form",
            analytic_samples_per_s=score.samples_per_s,
            peak_memory_bytes=peak,
            out_of_memory=peak > self.limit,
            bottleneck=score.bottleneck,
            boundary_bytes=int(sum(t.cut[a] for a in starts[1:])),
            params=shape.params,
        )

    def confirm(self, cand: Candidate) -> Candidate:
        """``cand`` simulated with the engine, or a note saying why not."""
        from pipesim.sim.api import simulate_schedule
        from pipesim.sim.engine.size import check_size

        p = cand.params
        req = self.req
        spec = shape_spec(req.strategy, p, req.iterations, req.options)
        try:
            check_size(spec)
            schedule = build_schedule(spec)
        except (StrategyError, InputError) as e:
            return replace(cand, note=f"not simulated: {e}")
        result = simulate_schedule(
            schedule,
            self.profile(p["microbatch_size"]),
            req.hardware,
            recv_lookahead=req.recv_lookahead,
            starts=cand.starts,
            recompute=p["recompute"],
        )
        peak = max(t.peak_bytes for t in result.memory)
        rate, steady = steady_state(result)
        return replace(
            cand,
            simulated_samples_per_s=rate,
            steady=steady,
            microbatches=spec.microbatches,
            iterations=req.iterations,
            peak_memory_bytes=peak,
            out_of_memory=out_of_memory(result, self.limit),
        )


def confirmation_order(ranked: list[Candidate]) -> list[int]:
    """Indices of the candidates that fit, in the order the engine confirms
    them: the model's best of every (width, depth, recompute) shape first,
    best first, then the others by score.

    Micro-batch sizes of one shape score within a fraction of a percent of
    each other, while the closed form misjudges whole shapes (it assumes a
    replicated stage's all-reduce overlaps, which the engine does not): by
    score alone the confirmations would go to one shape's near-ties and never
    test the shape that wins."""
    fitting = [i for i, c in enumerate(ranked) if not c.out_of_memory]
    seen: set[tuple] = set()
    first = []
    for i in fitting:
        p = ranked[i].params
        shape = (p["width"], p["depth"], p["recompute"], p["grouping"])
        if shape not in seen:
            seen.add(shape)
            first.append(i)
    return first + [i for i in fitting if i not in set(first)]


def plan_grid(req: GridRequest, progress: Callable[[str], None] | None = None) -> Plan:
    """Enumerate, score, confirm and choose (see the module doc)."""
    say = progress or (lambda msg: None)
    started = time.perf_counter()
    check_grid_request(req)
    limit = memory_limit(req.hardware, req.memory_limit_bytes)
    grid = _Grid(req, limit)
    sizes = req.microbatch_sizes or (1,)
    layers = grid.profile(sizes[0]).num_layers
    say("scoring width x depth configurations")
    found = [grid.candidate(s) for s in shapes(req, layers)]
    ranked = sorted(found, key=lambda c: (c.out_of_memory, -c.analytic_samples_per_s))
    for i in confirmation_order(ranked)[: req.confirm]:
        say(f"confirming {ranked[i].config} with the engine")
        ranked[i] = grid.confirm(ranked[i])
    chosen = max(
        range(len(ranked)), key=lambda i: (not ranked[i].out_of_memory, ranked[i].simulated, ranked[i].samples_per_s)
    )
    best = ranked[chosen].params
    return Plan(
        strategy=req.strategy,
        model=req.model or grid.profile(best["microbatch_size"]).name,
        hardware=req.hardware.name,
        hardware_spec=req.hardware.to_json(),
        gpus=req.gpus,
        microbatches=best["microbatches"] * (best["width"] if best["grouping"] == "stages" else 1),
        iterations=req.iterations,
        microbatch_size=best["microbatch_size"],
        options=dict(req.options) | flush_options(best.get("flushes", 1)),
        candidates=tuple(ranked),
        chosen=chosen,
        data_parallel_samples_per_s=None,
        memory_limit_bytes=limit,
        planner_seconds=time.perf_counter() - started,
        recv_lookahead=req.recv_lookahead,
        profile=req.profile_path,
        planner=PLANNER,
        width=None if best["grouping"] == "stages" else best["width"],
        recompute=best["recompute"],
        batch_size=req.batch_size,
    )

"""The planner: which configuration to run, and how fast it will be.

:func:`plan` answers for one strategy that takes per-stage ``replicas``
(``Strategy.options``; gpipe, 1f1b, pipedream, pipedream-2bw) on the first N
devices of a machine:

1. **Search** (:mod:`.search`): a dynamic program over layer splits and
   replication factors gives the best configuration for every replica count
   of the last stage (pure data parallelism, "N", among them) and the best
   straight pipeline; local search on the full cost model moves each
   configuration's cuts (the program costs a split by its stages alone),
   then starts from the :data:`SEEDS` best and proposes the
   :data:`NEIGHBOURS` best configurations it met; a second pass sweeps
   (:meth:`.search.Planner.improve` with ``sweep``) and proposes the best
   split of each replica count nothing else proposed. Every candidate is
   costed by the full model (:mod:`.cost`). A request held to one configuration
   (:attr:`PlanRequest.replicas`, e.g. PipeDream's "15-1", or
   :attr:`PlanRequest.straight`) searches only its cuts: a dynamic program
   over its stages (:meth:`.search.Planner.best_split`), then local search
   sweeping them.
2. **Confirmation**: the :data:`CONFIRM` candidates the model ranks first
   (among those that fit in memory), and pure data parallelism, the best
   straight pipeline and the sweep's proposals, are simulated with the engine, in short
   runs (``iterations`` x ``microbatches``; a strategy that needs the run to
   give every replica the same number of micro-batches, as PipeDream's
   per-step all-reduce does, gets the next run length that does), and the
   fastest in the simulator wins. Its throughput, and data parallelism's on
   the same devices (the ``data-parallel`` strategy, the micro-batches
   rounded up to a multiple of N), are measured in steady state
   (:func:`steady_throughput`), so deep pipelines are not charged for a fill
   and drain that short runs exaggerate.
3. **Refinement**: confirmation simulates one split per configuration, the
   model's, and among near splits of one configuration the model's error
   decides more than its ranking; so up to :data:`REFINE` other splits of
   the chosen pipeline (its own and its best split's neighbours, rated
   within :data:`REFINE_WITHIN` of it) are confirmed too, and the fastest
   of all wins.

The answer is a :class:`Plan`: the configuration in PipeDream's notation
(:func:`notation`), its stages, the predicted and data-parallel throughput,
the speedup, every candidate with its analytic and (if confirmed) simulated
throughput and peak memory, and the planner's own time. ``Plan.to_json`` is
``plan.json`` (byte-identical for the same inputs but for
``planner_seconds``, a measurement); :func:`load_plan` reads it back, and
``pipesim simulate --plan`` runs it. Other planners (PipeDream-2BW's width,
depth and micro-batch size; an AvgPipe tuner) record their answers in the
same :class:`Plan`, free parameters in each candidate's ``params``, and
``pipesim.experiments.plans`` draws any plan's Pareto figure.
"""

from __future__ import annotations

import json
import math
import os
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipesim.sim.engine.metrics import round_sig
from pipesim.sim.engine.results import SimResult
from pipesim.sim.engine.size import SizeError, check_size
from pipesim.sim.errors import InputError
from pipesim.sim.files import parse_json, read_text
from pipesim.sim.hardware.machines import Hardware
from pipesim.sim.ir.core import PASS_OPS, UPDATE, F, Schedule
from pipesim.sim.partition.cost import Estimate
from pipesim.sim.partition.layout import traits_of
from pipesim.sim.partition.search import MIN_GAIN, Config, CostSetting, Planner, Tables
from pipesim.sim.strategies import ScheduleSpec, StrategyError, build_schedule, find_strategy, get_strategy, strategies
from pipesim.sim.strategies._common import flush_options, flush_sizes
from pipesim.sim.workloads.profile import Profile

PLAN_VERSION = 1
#: Candidates confirmed with the engine, besides the landmarks and the sweep's.
CONFIRM = 8
#: Local search starts from this many of the search's best configurations ...
SEEDS = 2
#: ... and proposes this many of the best configurations it met.
NEIGHBOURS = 6
#: Other splits of the chosen pipeline confirmed once it is chosen (as many
#: as a search held to its configuration proposes) ...
REFINE = NEIGHBOURS
#: ... among those the model rates within this fraction of it: the model's
#: error on splits a few layers from its choice reached -23% (VGG-16's 15-1
#: on Cluster-B); splits rated further below are not worth a run.
REFINE_WITHIN = 0.25
#: Sources of candidates always confirmed (when they fit): PipeDream's two
#: reference points, pure data parallelism and the straight pipeline, and the
#: best split of a configuration the request holds the search to.
LANDMARKS = ("data parallelism", "straight", "held")
#: Sources of candidates confirmed besides the budget: the sweep's, at most
#: :data:`NEIGHBOURS` replica counts nothing else proposed (the model rates
#: them among its near neighbours' errors, and they would otherwise take
#: the runs of the near search's candidates).
BESIDES_BUDGET = ("sweep",)
#: The landmarks every plan is measured against, simulated whatever run
#: their replicas need (data parallelism's is one multiple of the devices,
#: the straight pipeline's the run asked for): a held configuration's
#: replicas may need a run hundreds of times longer, and keep the limit.
UNSTRETCHED = ("data parallelism", "straight")
#: The most devices a plan is searched for (the search grows with their
#: square: GPT-1.3B on DGX H100s takes about 3 s at 64 and 8 s at 128 here).
MAX_GPUS = 128
#: The baseline every plan is compared with.
DATA_PARALLEL = "data-parallel"
#: Iterations of a confirmation run by default: the steady-state window is
#: iterations 1 .. K-2, so four leave two.
ITERATIONS = 3
#: A confirmation run is at most this many times the requested length (a
#: strategy that needs the micro-batches to divide evenly over odd replica
#: counts would otherwise ask for very long runs); longer ones are skipped.
MAX_RUN_STRETCH = 8


class PlanError(InputError):
    """A planning request that cannot be met, or a malformed plan file."""


class NothingRunsError(PlanError):
    """The strategy runs none of the configurations the search found at the
    micro-batches asked for (a caller planning several strategies may go on
    without this one)."""


def notation(replicas) -> str:
    """PipeDream's name for a configuration: replicas per stage joined by
    dashes ("15-1"), "straight" for one replica per stage, "16" for one stage
    on 16 devices (pure data parallelism)."""
    replicas = list(replicas)
    if len(replicas) > 1 and all(r == 1 for r in replicas):
        return "straight"
    return "-".join(map(str, replicas))


def plannable(planner: str | None = None) -> list[str]:
    """The strategies some planner serves (``Strategy.planners``), or, given
    ``planner``, those that one serves (:func:`plan`: ``"replicas"``)."""
    return [s.name for s in strategies() if (planner in s.planners if planner else s.planners)]


def memory_limit(hardware: Hardware, requested: float | None) -> float:
    """The bytes per device a plan must fit in: the request's limit, else the
    device's memory. Every planner marks a candidate, costed or simulated,
    out of memory against this one figure (the engine's own flag compares
    with the device's memory, which a request may lower)."""
    return hardware.device.memory_bytes if requested is None else requested


def out_of_memory(result: SimResult, limit: float) -> bool:
    """Whether a confirming run's peak on some device exceeds ``limit``."""
    return max(t.peak_bytes for t in result.memory) > limit


def check_served(strategy: str, planner: str, what: str) -> None:
    """``strategy`` must name ``planner`` among its planners (``what``: how
    the error names the planner)."""
    if planner not in get_strategy(strategy).planners:
        raise PlanError(f"{strategy} is not planned by {what}; it serves {', '.join(plannable(planner))}")


def check_counts(req, names, minimum: int = 1) -> None:
    """Each of ``req``'s fields ``names`` must be a whole number >= ``minimum``
    (None allowed where the field is optional and None)."""
    for name in names:
        v = getattr(req, name)
        if v is None and name in OPTIONAL_COUNTS:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise PlanError(f"{name} must be a whole number >= {minimum}, got {v!r}")


#: Request fields that may be None (the planner then chooses them).
OPTIONAL_COUNTS = frozenset({"microbatches"})


# ---------------------------------------------------------------------------
# The record
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One stage of a plan: layers ``first .. last`` (inclusive) on ``replicas`` devices."""

    first: int
    last: int
    replicas: int

    def to_json(self) -> dict:
        return {"layers": [self.first, self.last], "replicas": self.replicas}


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner considered.

    ``source`` says where it came from; ``boundary_bytes`` is what one
    micro-batch's activations across its cuts weigh; ``samples_per_s`` is the simulated
    steady-state throughput when it was confirmed (``simulated``), else the
    analytic one; ``microbatches`` and ``iterations`` its confirmation run
    (or None); ``params`` holds free parameters of other planners (width, depth,
    micro-batch size, ...); ``note`` why it was not confirmed, if so;
    ``refused`` that the strategy builds no schedule of it at the run asked
    for (the note says why): it is listed, never chosen.
    """

    config: str
    stages: tuple[Stage, ...]
    source: str
    analytic_samples_per_s: float
    peak_memory_bytes: int
    out_of_memory: bool
    simulated_samples_per_s: float | None = None
    microbatches: int | None = None
    iterations: int | None = None
    bottleneck: str = ""
    boundary_bytes: int = 0
    note: str = ""
    params: dict = field(default_factory=dict)
    refused: bool = False
    #: whether the simulated throughput is a steady state (its run had a
    #: window leaving out the fill and drain: :func:`steady_state`), not
    #: the whole run's, and whether that window was seen to have settled
    #: (:func:`steady_measure`; the choice is run longer until it has)
    steady: bool = True
    settled: bool = True

    @property
    def simulated(self) -> bool:
        return self.simulated_samples_per_s is not None

    @property
    def samples_per_s(self) -> float:
        return self.simulated_samples_per_s if self.simulated else self.analytic_samples_per_s

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(s.replicas for s in self.stages)

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(s.first for s in self.stages)

    def to_json(self) -> dict:
        d = {
            "config": self.config,
            "stages": [s.to_json() for s in self.stages],
            "source": self.source,
            "analytic_samples_per_s": round_sig(self.analytic_samples_per_s),
            "simulated_samples_per_s": None
            if self.simulated_samples_per_s is None
            else round_sig(self.simulated_samples_per_s),
            "microbatches": self.microbatches,
            "iterations": self.iterations,
            "peak_memory_bytes": int(self.peak_memory_bytes),
            "out_of_memory": bool(self.out_of_memory),
            "bottleneck": self.bottleneck,
            "boundary_bytes": int(self.boundary_bytes),
        }
        if self.simulated:
            d["steady_state"] = self.steady
            d["settled"] = self.settled
        if self.note:
            d["note"] = self.note
        if self.refused:
            d["refused"] = True
        if self.params:
            d["params"] = {k: self.params[k] for k in sorted(self.params)}
        return d


@dataclass(frozen=True)
class Plan:
    """A planner's answer (see the module doc); ``chosen`` indexes ``candidates``.

    ``microbatches`` and ``iterations`` are the run asked for; the record's
    ``microbatches`` and ``iterations`` are the chosen configuration's run
    (what ``simulate --plan`` runs), ``requested_microbatches`` the former.
    """

    strategy: str
    model: str
    hardware: str
    gpus: int
    microbatches: int
    iterations: int
    microbatch_size: int
    options: dict
    candidates: tuple[Candidate, ...]
    chosen: int
    data_parallel_samples_per_s: float | None
    memory_limit_bytes: float
    planner_seconds: float
    profile: str | None = None
    #: which planner answered (``Strategy.planners``), and what it fixes
    #: beyond the stages: width x depth (``width``: pipelines of the chosen
    #: configuration; None when each stage has its own replicas), activation
    #: recomputation, the global batch it planned for
    planner: str = "replicas"
    width: int | None = None
    recompute: bool = False
    batch_size: int | None = None
    #: the configuration the search was held to (:func:`notation`; None: free)
    held_to: str | None = None
    #: the machine planned for, whole (``Hardware.to_json``): ``simulate
    #: --plan`` runs on it, not on whatever preset or file bears its name now
    hardware_spec: dict | None = None
    #: receives posted this many compute actions ahead in every run
    recv_lookahead: int = 1

    @property
    def best(self) -> Candidate:
        return self.candidates[self.chosen]

    @property
    def predicted_samples_per_s(self) -> float:
        return self.best.samples_per_s

    @property
    def speedup_vs_dp(self) -> float | None:
        dp = self.data_parallel_samples_per_s
        return self.predicted_samples_per_s / dp if dp else None

    def to_json(self) -> dict:
        best = self.best
        speedup = self.speedup_vs_dp
        return (
            {
                "plan_version": PLAN_VERSION,
                "strategy": self.strategy,
                "model": self.model,
                "profile": self.profile,
                "hardware": self.hardware,
                "gpus": self.gpus,
                "requested_microbatches": self.microbatches,
                "microbatches": best.microbatches or self.microbatches,
                "iterations": best.iterations or self.iterations,
                "microbatch_size": self.microbatch_size,
                "options": {k: self.options[k] for k in sorted(self.options)},
                "config": best.config,
                "stages": [s.to_json() for s in best.stages],
                "predicted_samples_per_s": round_sig(self.predicted_samples_per_s),
                "predicted_is_simulated": best.simulated,
                "predicted_is_steady": best.steady,  # the cost model's figure is a steady state too
                "analytic_samples_per_s": round_sig(best.analytic_samples_per_s),
                "data_parallel_samples_per_s": None
                if self.data_parallel_samples_per_s is None
                else round_sig(self.data_parallel_samples_per_s),
                "speedup_vs_dp": None if speedup is None else round_sig(speedup),
                "peak_memory_bytes": int(best.peak_memory_bytes),
                "memory_limit_bytes": None if math.isinf(self.memory_limit_bytes) else self.memory_limit_bytes,
                "out_of_memory": bool(best.out_of_memory),
                "bottleneck": best.bottleneck,
                "planner_seconds": round(self.planner_seconds, 3),
                "chosen": self.chosen,
                "candidates": [c.to_json() for c in self.candidates],
                "planner": self.planner,
                "recompute": bool(self.recompute),
                "recv_lookahead": self.recv_lookahead,
            }
            | ({} if self.hardware_spec is None else {"hardware_spec": self.hardware_spec})
            | ({} if self.width is None else {"width": self.width})
            | ({} if self.batch_size is None else {"batch_size": self.batch_size})
            | ({} if self.held_to is None else {"held_to": self.held_to})
        )


#: The planners whose plans run w pipelines of one depth: side by side when
#: the plan has a ``width``, grouped by stage (each stage's w replicas on
#: consecutive devices) when it has none.
WIDTH_PLANNERS = frozenset({"width-depth", "tuner"})

#: Every field ``Plan.to_json`` writes: :func:`plan_file` refuses any other
#: (a misspelt field would otherwise be ignored).
PLAN_KEYS = frozenset(
    {
        "plan_version",
        "strategy",
        "model",
        "profile",
        "hardware",
        "hardware_spec",
        "gpus",
        "requested_microbatches",
        "microbatches",
        "iterations",
        "microbatch_size",
        "options",
        "config",
        "stages",
        "predicted_samples_per_s",
        "predicted_is_simulated",
        "predicted_is_steady",
        "analytic_samples_per_s",
        "data_parallel_samples_per_s",
        "speedup_vs_dp",
        "peak_memory_bytes",
        "memory_limit_bytes",
        "out_of_memory",
        "bottleneck",
        "planner_seconds",
        "chosen",
        "candidates",
        "planner",
        "recompute",
        "recv_lookahead",
        "width",
        "batch_size",
        "held_to",
    }
)


def dumps(plan: Plan | dict) -> str:
    """``plan.json``'s text: sorted keys, trailing newline."""
    return json.dumps(plan.to_json() if isinstance(plan, Plan) else plan, indent=1, sort_keys=True) + "\n"


# ---------------------------------------------------------------------------
# Reading a plan back
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanFile:
    """What ``simulate --plan`` needs of a plan: the strategy and its options,
    the split and replicas, the run, and what it was planned for."""

    strategy: str
    starts: tuple[int, ...]
    replicas: tuple[int, ...]
    layers: int
    microbatches: int
    iterations: int
    microbatch_size: int
    options: dict
    model: str | None
    profile: str | None
    hardware: str
    predicted_samples_per_s: float
    width: int | None = None
    recompute: bool = False
    name: str | None = None
    #: the machine planned for (``Hardware.to_json``), when the plan records it
    hardware_spec: dict | None = None
    recv_lookahead: int = 1
    #: the devices the plan runs on, when it says (a run must use as many)
    gpus: int | None = None
    #: whether ``predicted_samples_per_s`` came from the engine (not the
    #: cost model alone) and is a steady state (not a whole run too short
    #: for one; the cost model's figure always is)
    predicted_is_simulated: bool = True
    predicted_is_steady: bool = True

    def machine(self) -> Hardware | str:
        """The machine to run the plan on: the one it was planned for when
        the plan records it whole, else its ``hardware`` name or path."""
        return self.hardware if self.hardware_spec is None else Hardware.from_json(self.hardware_spec)

    @property
    def config(self) -> str:
        return self.name or notation(self.replicas)

    def spec(self, microbatches: int | None = None, iterations: int | None = None) -> ScheduleSpec:
        """The spec that runs the plan (the planned run unless told otherwise):
        ``width`` pipelines of the stages when the plan has a width (then
        ``microbatches`` are per pipeline), else each stage's replicas. At
        other ``microbatches`` a plan in several flushes (GPipe) keeps the
        size of its flushes, so a stage stashes what was planned: as many
        flushes as that takes."""
        shape = {"replicas": self.replicas} if self.width is None else {"width": self.width}
        m = microbatches or self.microbatches
        options = dict(self.options)
        if "flushes" in options and m != self.microbatches:
            per_flush = flush_sizes(self.microbatches, int(options.pop("flushes")))[0]
            options |= flush_options(-(-m // per_flush))
        try:
            return ScheduleSpec(
                self.strategy,
                len(self.replicas),
                m,
                iterations=iterations or self.iterations,
                **shape,
                **options,
            )
        except TypeError as e:  # an option no spec has
            raise PlanError(f"plan options {sorted(self.options)} are not all schedule options: {e}") from None


def load_plan(path) -> PlanFile:
    """Read ``plan.json`` (from :func:`plan` or another planner); a one-line
    :class:`PlanError` naming the file and the problem if it is not one."""
    data = parse_json(read_text(path, "plan", PlanError), f"plan file {path}", PlanError)
    try:
        found = plan_file(data)
    except PlanError as e:
        raise PlanError(f"plan file {path}: {e}") from None
    return _profile_beside(found, Path(path).parent)


def _profile_beside(found: PlanFile, folder: Path) -> PlanFile:
    """``found`` with a relative profile path read from ``folder`` (the plan
    file's) when the profile is there: a plan written by hand, or moved with
    its profile. (Plans pipesim writes record absolute paths.)"""
    if found.profile is None or os.path.isabs(found.profile):
        return found
    beside = folder / found.profile
    return replace(found, profile=str(beside)) if beside.is_file() else found


def _field(d: dict, key: str, kind, what: str):
    if key not in d:
        raise PlanError(f"missing field {key!r}")
    v = d[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise PlanError(f"{key!r} must be {what}, got {v!r}")
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
        raise PlanError(f"{key!r} must be {what}, got {v!r}")
    if kind is str and (not isinstance(v, str) or not v):
        raise PlanError(f"{key!r} must be {what}, got {v!r}")
    return v


def plan_file(d: Any) -> PlanFile:
    """The :class:`PlanFile` of a plan record (``Plan.to_json()`` or ``plan.json``'s content)."""
    if not isinstance(d, dict):
        raise PlanError("a plan must be a JSON object")
    unknown = sorted(set(d) - PLAN_KEYS)
    if unknown:
        raise PlanError(f"unknown field {unknown[0]!r} (a plan's fields are those `pipesim plan` writes)")
    version = d.get("plan_version", PLAN_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= PLAN_VERSION:
        raise PlanError(f"'plan_version' {version!r} is not one this pipesim reads (1 to {PLAN_VERSION})")
    planners = sorted({name for s in strategies() for name in s.planners})
    planner = d.get("planner", "replicas")
    if planner not in planners:
        raise PlanError(f"'planner' must be one of {', '.join(planners)}, got {d['planner']!r}")
    if "batch_size" in d:
        _field(d, "batch_size", int, "a whole number >= 1")
    strategy = _field(d, "strategy", str, "a strategy name")
    get_strategy(strategy)  # a one-line StrategyError naming the choices
    check_served(strategy, planner, f"the {planner} planner this plan names")
    stages = d.get("stages")
    if not isinstance(stages, list) or not stages:
        raise PlanError('\'stages\' must be a non-empty list of {"layers": [first, last], "replicas": r}')
    starts, reps, expected = [], [], 0
    for k, st in enumerate(stages):
        layers = st.get("layers") if isinstance(st, dict) else None
        r = st.get("replicas") if isinstance(st, dict) else None
        if (
            not isinstance(layers, list)
            or len(layers) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in layers)
            or isinstance(r, bool)
            or not isinstance(r, int)
            or r < 1
        ):
            raise PlanError(
                f'stage {k} must be {{"layers": [first, last], "replicas": r}} with whole numbers '
                f"and r >= 1, got {st!r}"
            )
        first, last = layers
        if first != expected or last < first:
            raise PlanError(
                f"stage {k} covers layers {first}..{last}, but must start at layer {expected} and end "
                f"at or after it (stages cover consecutive layers from 0)"
            )
        starts.append(first)
        reps.append(r)
        expected = last + 1
    options = d.get("options", {})
    if not isinstance(options, dict):
        raise PlanError("'options' must be a JSON object")
    model, profile = d.get("model"), d.get("profile")
    for key, v in (("model", model), ("profile", profile)):
        if v is not None and not isinstance(v, str):
            raise PlanError(f"{key!r} must be a string or null, got {v!r}")
    width = _field(d, "width", int, "a whole number >= 1") if "width" in d else None
    gpus = _field(d, "gpus", int, "a whole number >= 1") if "gpus" in d else None
    if width is None and gpus is not None and gpus != sum(reps):  # (pipelines of a width may share devices)
        raise PlanError(f"'gpus' is {gpus}, but the stages' replicas use {sum(reps)} devices")
    if width is not None and any(r != width for r in reps):
        raise PlanError(f"a plan of width {width} runs every stage on {width} replicas, got {reps}")
    if planner in WIDTH_PLANNERS and width is None and len(set(reps)) != 1:
        # without a width, a width x depth plan groups each stage's replicas (every stage has w)
        raise PlanError(f"a plan of the {planner} planner runs every stage on as many replicas, got {reps}")
    recompute = d.get("recompute", False)
    if not isinstance(recompute, bool):
        raise PlanError(f"'recompute' must be true or false, got {recompute!r}")
    name = d.get("config")
    if name is not None and not isinstance(name, str):
        raise PlanError(f"'config' must be a string, got {name!r}")
    if planner == "replicas" and name is not None and name != notation(reps):  # others name their own shapes
        raise PlanError(f"'config' is {name!r}, but the stages' replicas are {notation(reps)}")
    lookahead = d.get("recv_lookahead", 1)
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise PlanError(f"'recv_lookahead' must be a whole number >= 0, got {lookahead!r}")
    simulated = d.get("predicted_is_simulated", True)
    steady = d.get("predicted_is_steady", True)  # plans from before the field: every figure a steady state
    for key, v in (("predicted_is_simulated", simulated), ("predicted_is_steady", steady)):
        if not isinstance(v, bool):
            raise PlanError(f"{key!r} must be true or false, got {v!r}")
    machine = d.get("hardware_spec")
    if machine is not None:
        try:
            Hardware.from_json(machine, source="'hardware_spec'")
        except InputError as e:
            raise PlanError(str(e)) from None
    return PlanFile(
        strategy=strategy,
        starts=tuple(starts),
        replicas=tuple(reps),
        layers=expected,
        microbatches=_field(d, "microbatches", int, "a whole number >= 1"),
        iterations=_field(d, "iterations", int, "a whole number >= 1"),
        microbatch_size=_field(d, "microbatch_size", int, "a whole number >= 1"),
        options=dict(options),
        model=model,
        profile=profile,
        hardware=_field(d, "hardware", str, "a hardware preset or file"),
        predicted_samples_per_s=float(_field(d, "predicted_samples_per_s", float, "a number >= 0")),
        width=width,
        recompute=recompute,
        name=name,
        hardware_spec=machine,
        recv_lookahead=lookahead,
        gpus=gpus,
        predicted_is_simulated=simulated,
        predicted_is_steady=steady,
    )


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


def steady_throughput(result: SimResult) -> float:
    """Samples per second in steady state, without the pipeline's fill and drain.

    A flushed schedule repeats identical iterations: the samples of
    iterations 1 .. K-2 over the time from the end of iteration 0 to the end
    of iteration K-2 (an iteration ends with its last micro-batch's last
    pass). A stream (``Strategy.asynchronous``) finishes micro-batches one by
    one, in bursts where replicated stages step together: with the M
    completion times sorted, the micro-batches completed between the m-th
    and a later one over the time between, the window a whole number of
    periods (:func:`_stream_period`) so it starts and ends at the same point
    of one, and ending before the drain (at the m-th completion from the end
    at the latest, and at the first after the last micro-batch's entry).
    Runs too short for a window (:func:`steady_state` says which): their
    whole-run throughput. A micro-batch run as several ids (tensor
    parallelism's shards, ``Strategy.shards``) counts once.
    """
    return steady_state(result)[0]


def steady_state(result: SimResult) -> tuple[float, bool]:
    """:func:`steady_throughput`, and whether the run was long enough for it
    to leave out the fill and drain (a flushed schedule's three iterations
    or more; a stream's, at least one whole period between its fill and its
    drain, which three iterations do not always hold); else the throughput
    is the whole run's. One pass over the spans answers both."""
    rate, windowed, _ = steady_measure(result)
    return rate, windowed


def steady_measure(result: SimResult) -> tuple[float, bool, bool]:
    """:func:`steady_state`, and whether the window is seen to be settled:
    a flushed schedule's always is (its iterations repeat); a stream's when
    its last two periods took the same time (or its last two double
    periods: some alternate), the window then reaching back over every
    period that did. A stream still settling when the run ends (2BW's 8-8
    at m = 16 takes four windows) has a window, but not a settled one: a
    planner runs it longer."""
    s = result.schedule
    strategy = find_strategy(s.strategy)
    shards = strategy.shards(s.options) if strategy is not None else 1  # tensor parallelism: d ids per sample
    window = _steady_window(result)
    if window is None:
        whole = result.makespan
        return (s.total_microbatches * result.microbatch_size / shards / whole if whole > 0 else 0.0), False, False
    span, seconds, settled = window
    return span * result.microbatch_size / shards / seconds, True, settled


#: Periods of a stream this close in duration count as equal (a settled
#: stream repeats them to float rounding).
SETTLED_REL = 1e-6
#: Multiples of the period tried for a settled stream (some alternate two
#: patterns of one period).
PERIOD_MULTIPLES = (1, 2, 3, 4)


def _steady_window(result: SimResult) -> tuple[int, float, bool] | None:
    """(micro-batch ids, seconds, settled) of :func:`steady_throughput`'s
    window, None when the run has none."""
    s = result.schedule
    k, m = s.num_iterations, s.num_microbatches
    last: dict[int, float] = {}
    entered = -math.inf  # when the last micro-batch entered the pipeline (its first stage's forward)
    for sp in result.by_stream()["compute"]:
        a = sp.action
        if a.op in PASS_OPS and sp.end > last.get(a.microbatch, -math.inf):
            last[a.microbatch] = sp.end
        if a.op is F and a.stage == 0 and sp.start > entered:
            entered = sp.start
    strategy = find_strategy(s.strategy)
    if strategy is not None and strategy.asynchronous:
        done = sorted(last.values())
        # The window ends before the drain: at the m-th completion from the
        # end at the latest, and no later than the completion that follows
        # the last micro-batch's entry (the micro-batches then in flight are
        # the drain: with nothing new entering, the stages finish them
        # faster). Without the second bound a 15-1 plan at m = 15, 30 of
        # whose 45 micro-batches were in flight at the last entry, ended its
        # window on the drain's quicker burst: +16% in 3 iterations.
        limit = min(len(done) - m, bisect_right(done, entered))
        return _settled_window(done, m, limit, _stream_period(s))
    done = [max(last[i] for i in range(t * m, (t + 1) * m)) for t in range(k)]  # iteration ends
    if k < 3 or done[k - 2] <= done[0]:
        return None
    return (k - 2) * m, done[k - 2] - done[0], True


def _settled_window(done: list[float], m: int, limit: int, period: int) -> tuple[int, float, bool] | None:
    """The window of a stream's sorted completion times ``done``: whole
    periods, on boundaries m + j·period, ending at the last at or before
    ``limit``. Settled where its last block of one period (or of a few:
    :data:`PERIOD_MULTIPLES`) took as long as the block before it; then it
    starts at the earliest block that did too, leaving out the start-up's
    slower or quicker ones. Otherwise every period from the m-th
    completion, not settled."""
    if limit - m < period:
        return None
    end = m + (limit - m) // period * period
    for q in PERIOD_MULTIPLES:
        size = q * period
        if end - 2 * size < 0:
            break
        block = done[end] - done[end - size]
        start = end - size
        # back over every block that took as long, the m-th completion's
        # boundary no limit: a block before it that did is settled too
        while start - size >= 0 and math.isclose(done[start] - done[start - size], block, rel_tol=SETTLED_REL):
            start -= size
        if start < end - size:
            return end - start, done[end] - done[start], True
    if done[end] <= done[m]:
        return None
    return end - m, done[end] - done[m], False


def _stream_period(schedule: Schedule) -> int:
    """Completions after which a steady stream repeats itself: a burst, the
    replica counts' least common multiple, where a step follows every pass
    (PipeDream, SpecTrain); else a whole window of m micro-batches too
    (2BW's every m-th completion waits for its update's version flip), so
    a window of whole periods measures the mean rate."""
    burst = math.lcm(*schedule.replicas)
    program = schedule.programs[0]
    steps_each_pass = sum(a.op is UPDATE for a in program) >= sum(a.op is F for a in program)
    return burst if steps_each_pass else math.lcm(burst, schedule.num_microbatches)


# ---------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: ``strategy`` (one that takes ``replicas``) with
    ``options`` for ``profile`` on the first ``gpus`` devices of ``hardware``;
    ``microbatches`` per iteration (default: one per device), confirmation
    runs of ``iterations``; ``confirm`` candidates simulated; ``model`` and
    ``profile_path`` name the model in the record."""

    strategy: str
    profile: Profile
    hardware: Hardware
    gpus: int
    microbatches: int | None = None
    iterations: int = ITERATIONS
    options: dict = field(default_factory=dict)
    confirm: int = CONFIRM
    recv_lookahead: int = 1
    memory_limit_bytes: float | None = None
    model: str | None = None
    profile_path: str | None = None
    recompute: bool = False
    #: hold the search to this configuration, replicas per stage summing to
    #: ``gpus`` (PipeDream's "15-1" is (15, 1)): only its cuts are searched
    replicas: tuple[int, ...] | None = None
    #: hold it to a straight pipeline, one device per stage on every device
    #: (what PipeDream's optimizer returns under ``--straight_pipeline``)
    straight: bool = False
    #: other splits of the chosen configuration confirmed after the choice
    #: (:func:`_refinements`; ignored by a held search, which confirms its
    #: splits, and with ``confirm=0``)
    refine: int = REFINE

    @property
    def held(self) -> tuple[int, ...] | None:
        """The configuration the search is held to, if any."""
        return (1,) * self.gpus if self.straight else self.replicas


def check_request(req: PlanRequest) -> None:
    """One-line errors for a request that cannot be planned."""
    strategy = get_strategy(req.strategy)
    if "replicas" not in strategy.planners or "replicas" not in strategy.options:
        raise PlanError(
            f"{req.strategy} takes no per-stage replicas, so there is nothing to plan; plannable: "
            f"{', '.join(plannable('replicas'))}"
        )
    check_counts(req, ("gpus", "iterations", "microbatches"))
    check_counts(req, ("confirm", "refine"), minimum=0)
    for flag in ("recompute", "straight"):
        if not isinstance(getattr(req, flag), bool):
            raise PlanError(f"{flag} must be True or False, got {getattr(req, flag)!r}")
    if req.hardware.num_devices is not None and req.gpus > req.hardware.num_devices:
        raise PlanError(f"{req.hardware.name} has {req.hardware.num_devices} devices, not {req.gpus}")
    if req.gpus > MAX_GPUS:
        raise PlanError(f"the planner searches up to {MAX_GPUS} devices, not {req.gpus}")
    _check_held(req)  # after the machine's count: a limit the machine sets is the one to name
    _check_run_size(req)
    check_plan_options(req.strategy, req.options, {"replicas", "width"}, "the planner chooses the replicas")
    flushes, m = req.options.get("flushes", 1), req.microbatches or req.gpus
    if isinstance(flushes, int) and flushes > m:
        raise PlanError(
            f"flushes={flushes} is more than the {m} micro-batches of an iteration: "
            "plan with fewer flushes or more micro-batches"
        )


def check_plan_options(strategy: str, options: dict, chosen: set[str], why: str) -> None:
    """One-line errors for ``options`` a planner cannot plan with: one it
    chooses itself (``chosen``, ``why`` says so), or one ``strategy`` does not
    take (naming those it does)."""
    mine = sorted(set(options) & chosen)
    if mine:
        raise PlanError(f"option {mine[0]!r} is not a plan option of {strategy} ({why})")
    takes = set(get_strategy(strategy).options)
    unknown = sorted(set(options) - takes)
    if unknown:
        raise PlanError(
            f"{strategy} has no option {unknown[0]!r} to plan with (it takes: "
            f"{', '.join(sorted(takes - chosen)) or 'none'})"
        )


def _check_run_size(req: PlanRequest) -> None:
    """Refuse, before any search, confirmation runs too large for this
    machine's memory: the straight pipeline's, one stage per device, runs
    the most stage passes of any candidate."""
    m = req.microbatches or req.gpus
    check_size(ScheduleSpec(req.strategy, min(req.gpus, req.profile.num_layers), m, iterations=req.iterations))


def _check_held(req: PlanRequest) -> None:
    """One-line errors for a configuration the search cannot be held to."""
    if req.replicas is None:
        if req.straight and not 1 < req.gpus <= req.profile.num_layers:
            raise PlanError(
                f"a straight pipeline on {req.gpus} devices needs 2 to {req.profile.num_layers} "
                f"devices (one stage of at least one layer each; {req.profile.name} has "
                f"{req.profile.num_layers} layers)"
            )
        return
    if req.straight:
        raise PlanError("give replicas or straight, not both (straight is one replica per stage)")
    reps = req.replicas
    if not isinstance(reps, tuple) or not reps or any(type(r) is not int or r < 1 for r in reps):
        raise PlanError(f"replicas must be a non-empty tuple of positive ints, got {reps!r}")
    if sum(reps) != req.gpus:
        raise PlanError(f"replicas {_listed(reps)} use {sum(reps)} devices, not the {req.gpus} planned for")
    if len(reps) > req.profile.num_layers:
        raise PlanError(
            f"replicas {_listed(reps)} make {len(reps)} stages, but {req.profile.name} has "
            f"{req.profile.num_layers} layers"
        )


def _listed(replicas: tuple[int, ...]) -> str:
    """Replicas as ``--replicas`` spells them (``15,1``; ``1,1,1``, where
    :func:`notation` would say "straight")."""
    return ",".join(map(str, replicas))


def plan(req: PlanRequest, progress: Callable[[str], None] | None = None) -> Plan:
    """Search, cost, confirm and choose (see the module doc)."""
    say = progress or (lambda msg: None)
    started = time.perf_counter()
    check_request(req)
    m = req.microbatches or req.gpus
    limit = memory_limit(req.hardware, req.memory_limit_bytes)
    planner = Planner(
        tables=Tables(req.profile, req.recompute),
        traits=traits_of(req.strategy, req.recv_lookahead),
        microbatches=m,
        iterations=req.iterations,
        devices=req.gpus,
        setting=CostSetting.of(req.profile, req.hardware, limit),
        options=dict(req.options),
    )
    held = req.held
    say("searching splits and replicas" if held is None else f"searching splits of {notation(held)}")
    found = _candidates(planner) if held is None else _held_candidates(planner, held)
    out = sorted(found, key=_rank)
    landmarks, others = _confirmation_order(out) if req.confirm > 0 else ([], [])
    confirmed = 0
    for i in landmarks + others:
        if i in others and confirmed >= req.confirm:
            break
        say(f"confirming {out[i].config} with the engine")
        out[i] = _confirm(out[i], req, m, planner)
        confirmed += out[i].simulated and i in others
    chosen = _best(out)
    if (
        held is None
        and req.refine > 0
        and out[chosen].simulated
        and not out[chosen].out_of_memory
        and len(out[chosen].stages) > 1
    ):
        say(f"confirming other splits of {out[chosen].config}")
        out = sorted(out + _refinements(planner, out, chosen, req, m), key=_rank)
    chosen = _settled_choice(out, req, m, planner, say)
    chosen = _runnable_choice(out, req, m, planner)
    say("simulating data parallelism")
    dp = data_parallel_throughput(req)
    return Plan(
        strategy=req.strategy,
        model=req.model or req.profile.name,
        hardware=req.hardware.name,
        hardware_spec=req.hardware.to_json(),
        gpus=req.gpus,
        microbatches=m,
        iterations=req.iterations,
        microbatch_size=req.profile.microbatch_size,
        options=_schedule_options(out[chosen], req),
        candidates=tuple(out),
        chosen=chosen,
        data_parallel_samples_per_s=dp,
        memory_limit_bytes=limit,
        planner_seconds=time.perf_counter() - started,
        recv_lookahead=req.recv_lookahead,
        profile=req.profile_path,
        recompute=req.recompute,
        held_to=None if held is None else notation(held),
    )


def _rank(c: Candidate) -> tuple:
    """How candidates are listed: those that fit first, best modelled first."""
    return (c.out_of_memory, -c.analytic_samples_per_s)


def _best(cands: list[Candidate]) -> int:
    """The index of the choice: the fastest confirmed candidate that fits
    and that the strategy can run."""
    return max(
        range(len(cands)),
        key=lambda i: (not cands[i].refused, not cands[i].out_of_memory, cands[i].simulated, cands[i].samples_per_s),
    )


def _settled_choice(out: list[Candidate], req: PlanRequest, m: int, planner: Planner, say) -> int:
    """:func:`_best`, its figure from a settled window: a choice whose
    window had not settled (:func:`steady_measure`) is run longer until it
    has (:func:`_longer_run`), and the choice made again, until the choice
    has settled or cannot run longer. Only the choice pays for it: the
    others' figures from three iterations rank them (a stream still
    settling was off by up to 14% either way)."""
    tried: set[int] = set()
    while True:
        i = _best(out)
        c = out[i]
        if not c.simulated or c.settled or i in tried:
            return i
        tried.add(i)
        say(f"running {c.config} longer, until its steady state settles")
        out[i] = _confirm(c, req, m, planner, settle=True)


def _runnable_choice(out: list[Candidate], req: PlanRequest, m: int, planner: Planner) -> int:
    """:func:`_best`, once its run is known. A choice nobody simulated (with
    ``confirm=0``, or whose run was too long to confirm) gets the run that
    suits its replicas (:func:`_run_for`), which ``simulate --plan`` runs;
    one the strategy refuses is marked in ``out`` and passed over. A
    :class:`NothingRunsError` when the strategy refuses every candidate."""
    while True:
        i = _best(out)
        c = out[i]
        if c.refused:
            raise NothingRunsError(
                f"{req.strategy} runs none of the configurations found with {m} micro-batches "
                f"per iteration (the best, {c.config}: {c.note.removeprefix('not simulated: ')}); "
                "plan with more micro-batches"
            )
        if c.simulated or c.microbatches is not None:
            return i
        spec, _, note = _run_for(c, req, m)
        out[i] = replace(c, refused=True, note=note) if spec is None else _at_run(planner, c, spec)


def _refinements(planner: Planner, out: list[Candidate], chosen: int, req: PlanRequest, m: int) -> list[Candidate]:
    """Other splits of the chosen configuration, confirmed: the best
    :attr:`PlanRequest.refine` that local search moving only its cuts (from
    the chosen split and from the program's best split of its replicas)
    meets, that are not listed already (confirmed or not) and that the
    model rates within :data:`REFINE_WITHIN` of the chosen one.
    Confirmation picks one split per configuration, the model's; among the
    near splits of one configuration the model's error (queueing behind big
    transfers, lock-step replicas) decides more than its ranking."""
    c = out[chosen]
    starts = [Config(c.starts, c.replicas), planner.best_split(c.replicas)]
    met = _splits_met(
        planner,
        [s for s in starts if s is not None],
        skip={Config(x.starts, x.replicas) for x in out},
        limit=req.refine,
        floor=(1 - REFINE_WITHIN) * c.analytic_samples_per_s,
    )
    return [_confirm(_candidate(planner, cfg, "refinement", est), req, m, planner) for cfg, est in met]


def _splits_met(
    planner: Planner, starts: list[Config], *, skip, limit: int, floor: float = 0.0, sweep: bool = False
) -> list[tuple[Config, Estimate]]:
    """The ``limit`` best splits that local search moving only the cuts of
    ``starts`` (near moves, or a ``sweep``) meets, best first with their
    estimates: those that fit, are not in ``skip`` and are rated at
    ``floor`` samples/s or more."""
    visited: dict[Config, Estimate] = {}
    for start in starts:
        planner.improve(start, cache=visited, fixed_replicas=True, sweep=sweep)
    met = sorted(
        (
            x
            for x in visited
            if x not in skip and planner.setting.fits(visited[x]) and visited[x].samples_per_s >= floor
        ),
        key=lambda x: visited[x].iteration_s,
    )
    return [(x, visited[x]) for x in met[:limit]]


def _candidates(planner: Planner) -> list[Candidate]:
    """Every configuration the search proposes, costed by the full model, each once."""
    proposals: dict[Config, str] = {}
    by_last = planner.dynamic_program()
    for r, cfg in sorted(by_last.items()):
        proposals.setdefault(cfg, "search" if len(cfg.replicas) > 1 else "data parallelism")
    n = planner.devices
    if planner.tables.n >= n > 1:  # the straight pipeline, shown even if it does not fit
        straight = planner.dynamic_program(allowed=(1,)) or planner.dynamic_program(allowed=(1,), memory=False)
        for cfg in straight.values():
            proposals.setdefault(cfg, "straight")
    proposals.setdefault(Config((0,), (n,)), "data parallelism")
    costed = {cfg: planner.estimate(cfg) for cfg in proposals}
    fitting = [c for c in costed if planner.setting.fits(costed[c])]
    seeds = sorted(fitting, key=lambda c: costed[c].iteration_s)[:SEEDS]
    near = _local_search(planner, fitting, seeds, sweep=False)
    # the best configurations local search met, not only where it stopped:
    # the model's ranking of near neighbours is within its error
    met = sorted((c for c in near if c not in costed), key=lambda c: near[c].iteration_s)[:NEIGHBOURS]
    for cfg in met:
        proposals[cfg] = "local search"
        costed[cfg] = near[cfg]
    # then the sweep's best configuration of each replica count not yet
    # proposed (many of its splits tie in the model: one stage sets the
    # time, so six splits of one would crowd out the rest), among those the
    # model rates within REFINE_WITHIN of the best proposal: each costs a run
    far = _local_search(planner, fitting, seeds, sweep=True)
    known = {c.replicas for c in proposals}
    rated = [e.samples_per_s for e in costed.values() if planner.setting.fits(e)]
    floor = (1 - REFINE_WITHIN) * max(rated, default=0.0)
    swept = _best_of_each(
        (c for c in far if c.replicas not in known and far[c].samples_per_s >= floor),
        key=lambda c: far[c].iteration_s,
        group=lambda c: c.replicas,
    )
    for cfg in swept[:NEIGHBOURS]:
        proposals[cfg] = "sweep"
        costed[cfg] = far[cfg]
    return [_candidate(planner, cfg, source, costed[cfg]) for cfg, source in proposals.items()]


def _local_search(planner: Planner, fitting: list[Config], seeds: list[Config], *, sweep: bool) -> dict:
    """Every fitting configuration local search costs on its way: each
    configuration's cuts moved on the full model first (the program costs a
    split by its stages alone, and misses what the full model sees: a
    stage's fan-in through one NIC, the slowest replica's wait), then every
    move from the ``seeds`` (:meth:`Planner.improve`, near moves or a
    ``sweep``)."""
    visited: dict[Config, Estimate] = {}
    for cfg in fitting:
        if len(cfg.replicas) > 1:
            planner.improve(cfg, cache=visited, fixed_replicas=True, sweep=sweep)
    for seed in seeds:
        planner.improve(seed, cache=visited, sweep=sweep)
    return {c: e for c, e in visited.items() if planner.setting.fits(e)}


def _best_of_each(items, key, group) -> list:
    """The best of ``items`` by ``key`` in each ``group``, best first (the
    first met wins a tie)."""
    best: dict = {}
    for x in sorted(items, key=key):
        best.setdefault(group(x), x)
    return list(best.values())


def _held_candidates(planner: Planner, replicas: tuple[int, ...]) -> list[Candidate]:
    """The best split of ``replicas`` by the dynamic program over its stages
    (shown out of memory when none fits), and the best ones local search
    meets sweeping its cuts."""
    start = planner.best_split(replicas) or planner.best_split(replicas, memory=False)
    met = _splits_met(planner, [start], skip={start}, limit=NEIGHBOURS, sweep=True)
    return [_candidate(planner, start, "held", planner.estimate(start))] + [
        _candidate(planner, cfg, "local search", est) for cfg, est in met
    ]


def _confirmation_order(ranked: list[Candidate]) -> tuple[list[int], list[int]]:
    """The order to simulate candidates in: the landmarks and the sweep's
    (always, :data:`BESIDES_BUDGET`), then the others, one per
    configuration first. The model ranks near neighbours
    (the same replicas, a cut moved a layer or two) within its error and
    misses the queueing that big transfers bring, so each configuration is
    represented by the split with the fewest bytes crossing its cuts among
    those within :data:`~.search.MIN_GAIN` of its best; other splits of the
    same replicas follow once every configuration has had its turn. Runs
    that the strategy refuses (too few micro-batches for some replicas) do
    not use up the budget."""
    fits = [i for i, c in enumerate(ranked) if not c.out_of_memory]
    landmarks = [i for i in fits if ranked[i].source in LANDMARKS + BESIDES_BUDGET]
    groups: dict[str, list[int]] = {}
    for i in fits:
        if i not in landmarks:
            groups.setdefault(ranked[i].config, []).append(i)
    firsts = []
    for members in groups.values():  # in the order of each group's best
        top = ranked[members[0]].analytic_samples_per_s
        near = [i for i in members if ranked[i].analytic_samples_per_s >= top * (1 - MIN_GAIN)]
        firsts.append(min(near, key=lambda i: (ranked[i].boundary_bytes, i)))
    rest = [i for i in fits if i not in landmarks and i not in firsts]
    return landmarks, firsts + rest


def _candidate(planner: Planner, cfg: Config, source: str, est) -> Candidate:
    n = planner.tables.n
    ends = [*cfg.starts[1:], n]
    stages = tuple(Stage(a, b - 1, r) for a, b, r in zip(cfg.starts, ends, cfg.replicas))
    cuts = int(sum(planner.tables.cut[a] for a in cfg.starts[1:]))
    return Candidate(
        config=notation(cfg.replicas),
        stages=stages,
        source=source,
        analytic_samples_per_s=est.samples_per_s,
        peak_memory_bytes=est.peak_memory_bytes,
        out_of_memory=not planner.setting.fits(est),
        bottleneck=est.bottleneck,
        boundary_bytes=cuts,
        params=flush_options(est.flushes),
    )


def _schedule_options(cand: Candidate, req: PlanRequest) -> dict:
    """The schedule options of a candidate's runs: the request's and the
    flushes per update the search picked for it."""
    return req.options | flush_options(cand.params.get("flushes", 1))


def _runs(microbatches: int, iterations: int, replicas: tuple[int, ...], traits) -> list[tuple[int, int]]:
    """(micro-batches, iterations) to try for a confirmation run: as asked,
    then, for a strategy that needs every replica of a stage to run as many
    micro-batches as the others over the run (PipeDream all-reduces after
    every step), the nearest run that does. Where a step follows every pass,
    an iteration's size is only how the stream is counted, so the
    micro-batches per iteration grow to a multiple of the replicas' least
    common multiple; otherwise they mean a mini-batch, and the iterations grow."""
    cycle = math.lcm(*replicas)
    if traits.steps_each_pass:
        even = (-(-microbatches // cycle) * cycle, iterations)
    else:
        step = cycle // math.gcd(cycle, microbatches)
        even = (microbatches, -(-iterations // step) * step)
    return [(microbatches, iterations)] if even == (microbatches, iterations) else [(microbatches, iterations), even]


def _run_for(cand: Candidate, req: PlanRequest, m: int):
    """The run that suits ``cand``'s replicas: the first of :func:`_runs`
    the strategy builds, as (its spec, its schedule, ""); (spec, None, why)
    when it is longer than a confirmation may be (:data:`MAX_RUN_STRETCH`,
    which data parallelism and the straight pipeline are never held to:
    :data:`UNSTRETCHED`) or too large for this machine's memory;
    (None, None, why) when the strategy refuses every run."""
    note = ""
    for mb, k in _runs(m, req.iterations, cand.replicas, traits_of(req.strategy, req.recv_lookahead)):
        spec = ScheduleSpec(
            req.strategy, len(cand.stages), mb, iterations=k, replicas=cand.replicas, **_schedule_options(cand, req)
        )
        if _too_long(mb * k, cand, req, m):
            # too long to confirm; whether the strategy builds it at all shows in the fewest
            # iterations that spread its micro-batches evenly over every stage's replicas (a run
            # hundreds of times the one asked for would take as long to build as to run)
            cycle = math.lcm(*cand.replicas)
            probe = replace(spec, iterations=min(k, cycle // math.gcd(cycle, mb)))
            try:
                check_size(probe)  # replicas of a huge least common multiple: not even that is built
                build_schedule(probe)
            except SizeError:
                return (
                    spec,
                    None,
                    (
                        f"not simulated: a run that suits these replicas needs {mb * k} micro-batches, "
                        "more than this machine's memory holds"
                    ),
                )
            except StrategyError as e:
                note = f"not simulated: {e}"
                continue
            return spec, None, f"not simulated: a run that suits these replicas needs {mb * k} micro-batches"
        try:
            check_size(spec)
            schedule = build_schedule(spec)
        except SizeError:
            return (
                spec,
                None,
                (
                    f"not simulated: a run that suits these replicas ({mb * k} micro-batches) does not "
                    "fit in this machine's memory"
                ),
            )
        except StrategyError as e:
            note = f"not simulated: {e}"
            continue
        return spec, schedule, ""
    return None, None, note


def _too_long(microbatches: int, cand: Candidate, req: PlanRequest, m: int) -> bool:
    """Whether a run of ``microbatches`` in all is longer than a confirmation
    of ``cand`` may be: :data:`MAX_RUN_STRETCH` times the run asked for, a
    limit data parallelism and the straight pipeline are not held to
    (:data:`UNSTRETCHED`)."""
    return microbatches > MAX_RUN_STRETCH * m * req.iterations and cand.source not in UNSTRETCHED


def _confirm(cand: Candidate, req: PlanRequest, m: int, planner: Planner, *, settle: bool = False) -> Candidate:
    """``cand`` simulated with the engine, or a note saying why it was not
    (and ``refused`` if the strategy cannot run it). A run with no steady
    window (``settle``: or with one not settled yet) is run again with
    twice the iterations (:func:`_longer_run`)."""
    from pipesim.sim.api import simulate_schedule

    spec, schedule, note = _run_for(cand, req, m)
    if spec is None:
        return replace(cand, note=note, refused=True)
    if schedule is None:
        return replace(_at_run(planner, cand, spec), note=note)
    while True:
        result = simulate_schedule(
            schedule,
            req.profile,
            req.hardware,
            recv_lookahead=req.recv_lookahead,
            starts=cand.starts,
            recompute=req.recompute,
        )
        rate, steady, settled = steady_measure(result)
        longer = _longer_run(spec, settled if settle else steady, cand, req, m)
        if longer is None:
            break
        spec, schedule = longer
    peak = max(t.peak_bytes for t in result.memory)
    return replace(
        cand,
        simulated_samples_per_s=rate,
        steady=steady,
        settled=settled,
        microbatches=spec.microbatches,
        iterations=spec.iterations,
        peak_memory_bytes=peak,
        out_of_memory=out_of_memory(result, memory_limit(req.hardware, req.memory_limit_bytes)),
        note="",
    )


def _at_run(planner: Planner, cand: Candidate, spec: ScheduleSpec) -> Candidate:
    """``cand`` (not simulated) with the run ``spec`` gives it, costed by the
    model at that run: its memory is the run's (a 15-1 planned at one
    micro-batch runs 15 per iteration and holds what they stash), and it is
    out of memory if that does not fit."""
    at = replace(
        planner,
        microbatches=spec.microbatches,
        iterations=spec.iterations,
        options=planner.options | {"flushes": spec.flushes},  # the run's, not picked again
    )
    est = at.estimate(Config(cand.starts, cand.replicas))
    return replace(
        cand,
        microbatches=spec.microbatches,
        iterations=spec.iterations,
        analytic_samples_per_s=est.samples_per_s,
        peak_memory_bytes=est.peak_memory_bytes,
        out_of_memory=not at.setting.fits(est),
    )


def _longer_run(spec: ScheduleSpec, enough: bool, cand: Candidate, req: PlanRequest, m: int):
    """The run to simulate instead of ``spec``'s when its window was not
    ``enough`` (none, or not settled: :func:`steady_measure`) though a
    steady state was asked for (:data:`ITERATIONS` or more): twice its
    iterations, as (spec, schedule), within the stretch :func:`_run_for`
    allows (and never past that many times the iterations asked for); else
    None. A stream whose micro-batches per iteration are only a burst or
    two of its replicas (PipeDream's 15-1 at m = 15) has no burst between
    its fill and its drain in three iterations; 2BW's 8-8 at m = 16
    settles in its fifth."""
    if enough or req.iterations < ITERATIONS:
        return None
    longer = replace(spec, iterations=spec.iterations * 2)
    if longer.iterations > MAX_RUN_STRETCH * req.iterations or _too_long(
        longer.microbatches * longer.iterations, cand, req, m
    ):
        return None
    try:
        check_size(longer)
        return longer, build_schedule(longer)
    except (StrategyError, InputError):
        return None


def data_parallel_throughput(req: PlanRequest) -> float | None:
    """Steady-state throughput of data parallelism on the request's devices,
    the micro-batches per iteration rounded up to a multiple of them (the
    baseline every plan's speedup is over)."""
    from pipesim.sim.api import simulate

    n, m = req.gpus, req.microbatches or req.gpus
    spec = ScheduleSpec(DATA_PARALLEL, n, -(-m // n) * n, iterations=req.iterations)
    try:
        result = simulate(
            spec, profile=req.profile, hardware=req.hardware, recv_lookahead=req.recv_lookahead, recompute=req.recompute
        )
    except InputError:
        return None
    return steady_throughput(result)

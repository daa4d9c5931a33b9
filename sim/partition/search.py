"""Searching splits and replication factors under the cost model of :mod:`.cost`.

Two searches share one set of tables (:class:`Tables`: every stage's compute,
weights and stash for every contiguous layer range, as (layers + 1)² arrays):

* :func:`ranked_splits`, the communication-aware partitioner: the stage count
  and placement are fixed (a built schedule's :class:`~.layout.Layout`) and
  only the cuts move. The partitioner's dynamic program
  (:func:`~pipesim.sim.partition.balance.balanced`) runs on three terms per stage:
  compute only (today's split, with the layout's memory), and the stage's
  busy time per micro-batch (passes, steps, all-reduce) or its incoming
  boundary's busiest link, a link several boundaries share charged once or
  to each in full. A local search moves each cut a layer or two while the
  full model (:func:`.cost.estimate`: shared links summed, exposed receives,
  fill and drain) says the run gets shorter, and the split expected to finish
  first wins, the compute-only one unless another gains :data:`MIN_GAIN`.
  It can rank more splits for a caller that confirms them with the engine.
* :class:`Planner`, the planner's search: stage count, cuts and per-stage
  replicas all vary, over the first N devices of a machine in node-major
  order (stage k's replicas on the devices after stage k-1's, as the
  strategies place them). :meth:`Planner.dynamic_program` runs over (last
  layer, devices used, replicas of the last stage) and minimises the
  slowest stage's time per micro-batch: compute over its replicas, its steps
  and blocking all-reduces over its replicas' topology, and its incoming
  boundary's transfers over the links that boundary's replica pairs cross
  (which needs the previous stage's replicas, hence the third index). Memory
  is a hard constraint per stage replica. It returns the best configuration
  for every replica count of the last stage (so pure data parallelism, N
  replicas of one stage, is always among them); restricted to one replica,
  the best straight pipeline. PipeDream's optimizer solves one level of the
  machine hierarchy at a time; this program sees the whole topology through
  the link model instead, in O(layers² x devices²) array operations.
  :meth:`Planner.improve` is local search on the full model from a
  configuration: move a cut, move a replica to a neighbouring stage, merge
  two stages, split one; near moves shift a cut by a layer or two, a sweep
  moves it to any layer between its neighbours, and a replica with it.

Times are compared with a relative tolerance of 1e-9, so rounding never
decides a tie.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipesim.sim.hardware.machines import Hardware
from pipesim.sim.partition.balance import REL_TOL, balanced
from pipesim.sim.partition.cost import Estimate, LinkModel, envelope, estimate, held_activations, update_seconds
from pipesim.sim.partition.layout import Layout, Traits, chooses_flushes, fewest_flushes, layout_for
from pipesim.sim.strategies._common import flush_options
from pipesim.sim.workloads.profile import Profile
from pipesim.sim.workloads.stages import StageCost, recomputed, stage_cost

#: Rounds of local search at most (each takes the best neighbour).
MAX_ROUNDS = 40
#: Up to this many devices a stage may take any replica count in the
#: planner's dynamic program (see :meth:`Planner.replica_counts`).
ANY_REPLICAS_UP_TO = 32
#: Devices per node assumed where the hardware does not say (one node holds all).
SERVER = 8


class Tables:
    """Per-range sums of a profile as (layers + 1)² arrays: entry [i, j] is
    the stage of layers i .. j-1 (inf / 0 below the diagonal).

    ``recompute``: activation recomputation (:func:`~pipesim.sim.workloads.stages.recomputed`):
    a stage's time counts its checkpointed layers' forward twice, and
    :meth:`split` gives recomputing stage costs; memory then counts what the
    stage's layers keep between the passes (``checkpoints``: a checkpointed
    layer's input, another layer's whole stash) and the backward's peak
    (``peak``: what the layers below one layer keep plus its full stash, the
    largest over the layers), as
    :attr:`~pipesim.sim.workloads.stages.StageCost.full_stash_bytes` does."""

    def __init__(self, profile: Profile, recompute: bool = False) -> None:
        self.profile = profile
        self.recompute = recompute
        layers = profile.layers
        n = self.n = len(layers)
        overhead = profile.overhead_forward_s + profile.overhead_backward_s
        if recompute:
            overhead += profile.overhead_forward_s

        def ranges(values) -> np.ndarray:
            prefix = np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=float))))
            return prefix[None, :] - prefix[:, None]

        idx = np.arange(n + 1)
        self.valid = idx[:, None] < idx[None, :]
        # the backward re-runs the checkpointed layers' forward first
        again = [2 if recompute and la.recomputed else 1 for la in layers]
        self.time = np.where(
            self.valid, ranges([a * la.forward_s + la.backward_s for a, la in zip(again, layers)]) + overhead, np.inf
        )
        self.params = np.where(self.valid, ranges([la.param_bytes for la in layers]), 0.0)
        # the backward alone (with its recomputed forward), which DDP's buckets overlap
        self.backward = np.where(
            self.valid,
            ranges([(a - 1) * la.forward_s + la.backward_s for a, la in zip(again, layers)])
            + profile.overhead_backward_s,
            0.0,
        )
        # The other copies of the weights per byte of ``params`` (the master's
        # width) at the profile's precision: powers of two, so the products
        # are exact and equal StageCost's sums (every layer holds whole
        # parameters).
        self.weight_ratio, self.gradient_ratio, self.master_ratio = profile.precision.ratios()
        self.stash = np.where(self.valid, ranges([la.stash_bytes for la in layers]), 0.0)
        # bytes crossing the cut before layer i (nothing before layer 0 or after the last)
        self.cut = np.array([0.0] + [float(la.activation_bytes) for la in layers[:-1]] + [0.0])
        self._costs: dict[tuple[int, int], StageCost] = {}
        if recompute:
            # what layer l keeps between the passes: its input (what it receives) or its stash
            stashes = np.array([float(la.stash_bytes) for la in layers])
            kept = np.where([la.recomputed for la in layers], self.cut[:n], stashes)
            self.checkpoints = np.where(self.valid, ranges(kept), 0.0)
            # peak[i, j] = max over l in i..j-1 of (P[l] - P[i] + max(stash_l, kept_l)), P the kept bytes' prefix
            below = np.concatenate(([0.0], np.cumsum(kept)))
            top = below[:n] + np.maximum(stashes, kept)
            rows = np.where(idx[:n, None] <= idx[None, :n], top[None, :], -np.inf)
            best = np.maximum.accumulate(rows, axis=1)  # best[i, l]: max over i..l
            peak = np.zeros((n + 1, n + 1))
            peak[:n, 1:] = best - below[:n, None]
            self.peak = np.where(self.valid, peak, 0.0)

    def split(self, starts: tuple[int, ...]) -> list[StageCost]:
        """Stage costs of the split beginning at ``starts`` (cached per range)."""
        out = []
        for a, b in zip(starts, [*starts[1:], self.n]):
            c = self._costs.get((a, b))
            if c is None:
                c = stage_cost(self.profile, a, b - 1)
                c = self._costs[(a, b)] = recomputed([c])[0] if self.recompute else c
            out.append(c)
        return out

    def held(self, inflight: int) -> np.ndarray:
        """Activation bytes a stage replica holds with ``inflight``
        micro-batches in flight, for every layer range (the stage of layers
        i .. j-1 receives ``cut[i]`` bytes; its layer l receives ``cut[l]``)."""
        if self.recompute:
            return held_activations(self.stash, inflight, self.checkpoints, self.peak)
        return held_activations(self.stash, inflight)


def line_of(line: tuple[float, float], nbytes: np.ndarray) -> np.ndarray:
    """``a + b * bytes`` where bytes > 0, else 0, elementwise."""
    a, b = line
    return np.where(nbytes > 0, a + b * nbytes, 0.0)


def stage_terms(
    tables: Tables,
    devices: tuple[int, ...],
    links: LinkModel,
    *,
    passes: float,
    steps: float,
    microbatches: int,
    optimizer: str,
    hidden: bool = False,
) -> np.ndarray:
    """Seconds per micro-batch of the pipeline that one replica of a stage on
    ``devices`` is busy, for every layer range: its passes, and its steps,
    each after an all-reduce over the replicas when there are several (with
    ``hidden``, as 2BW runs it, only what outlasts a window's passes:
    :func:`.cost.estimate`)."""
    hw = links.hw
    step = update_seconds(1.0, optimizer, hw.device.kernel_bandwidth("update")) * tables.params
    if len(devices) > 1:
        ring = envelope(links.ring(devices).time)
        gradients = tables.params * tables.gradient_ratio
        reduce = line_of(ring, gradients)
        spec = hw.collectives
        if hidden and steps:
            reduce = np.maximum(0.0, reduce - passes / steps * tables.time)
        elif spec is not None and spec.bucket_bytes:
            # DDP's buckets overlap the backward; at least the last bucket
            # (at most a cap's bytes) runs after it (:func:`.cost.estimate`
            # prices the chosen split's buckets exactly)
            last = line_of(ring, np.minimum(gradients, spec.bucket_bytes))
            reduce = np.maximum(last, reduce - tables.backward)
        step = step + reduce
    return (passes * tables.time + steps * step) / microbatches


def memory_terms(
    tables: Tables, *, inflight: int, versions: int, buffers: int, optimizer_multiplier: int, centres: int = 0
) -> np.ndarray:
    """Bytes one replica of a stage holds, for every layer range (see
    :func:`.cost.stage_memory`: the same terms, as arrays)."""
    boundary = tables.cut[:, None] + tables.cut[None, :]
    copies = (
        tables.weight_ratio * (versions + buffers)
        + tables.gradient_ratio
        + tables.master_ratio
        + optimizer_multiplier
        + centres
    )
    return tables.params * copies + tables.held(inflight) + 2 * boundary


# ---------------------------------------------------------------------------
# The partitioner: fixed stages and placement, the cuts move
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CostSetting:
    """What a search costs with, besides the profile: the machine's links, the
    optimizer and the memory available per device."""

    links: LinkModel
    optimizer: str
    optimizer_multiplier: int
    microbatch_size: int
    memory_limit_bytes: float | None

    @classmethod
    def of(cls, profile: Profile, hardware: Hardware, memory_limit_bytes: float | None = None) -> CostSetting:
        return cls(
            LinkModel(hardware),
            profile.optimizer,
            profile.optimizer_state_multiplier,
            profile.microbatch_size,
            memory_limit_bytes,
        )

    def estimate(self, costs: list[StageCost], layout: Layout) -> Estimate:
        return estimate(
            costs,
            layout,
            self.links,
            optimizer=self.optimizer,
            optimizer_multiplier=self.optimizer_multiplier,
            microbatch_size=self.microbatch_size,
        )

    def fits(self, est: Estimate) -> bool:
        return self.memory_limit_bytes is None or est.peak_memory_bytes <= self.memory_limit_bytes


#: How much faster the full model must expect a communication-aware split to
#: be before it replaces the compute-only one: its resolution (it does not
#: see queueing behind other transfers, and fill and drain only roughly).
MIN_GAIN = 0.01


#: Splits enumerated and ranked by the full model when there are at most this many.
ENUMERATE_SPLITS = 64


def ranked_splits(tables: Tables, layout: Layout, setting: CostSetting, limit: int = 1) -> list[tuple[int, ...]]:
    """Up to ``limit`` splits (stage starts) for ``layout``, the
    communication-aware choice first (see the module doc), then the others
    the full model ranks best: those the other programs found, and every
    split when there are at most :data:`ENUMERATE_SPLITS`, else the
    neighbours of the first (a cut moved a layer or two).

    Three dynamic programs propose a split: compute only (today's
    partitioner, the layout's memory), and the full per-stage terms with a
    shared link charged once, or to every boundary sharing it in full. Each
    is improved by local search on its cuts, and the one the full model
    expects to finish first wins, but the compute-only split stays unless
    another is expected at least :data:`MIN_GAIN` faster, so splits change
    only where the model sees a real gain. When no split fits in memory, the
    same without the memory test (the engine then reports the overflow).
    """
    for memory in (True, False):
        found = []
        for shared in (None, False, True):
            terms = _layout_terms(tables, layout, setting, memory=memory, shared=shared)
            starts = balanced(terms.__getitem__, layout.stages)
            if starts is None:
                continue
            starts, value = _improve_cuts(tables, tuple(starts), layout, setting, memory=memory)
            if value is not None:
                found.append((value * (1 - MIN_GAIN) if shared is None else value, starts))
        if found:
            break
    else:
        raise AssertionError("a split without the memory test always exists")
    first = min(found, key=lambda x: x[0])[1]
    if limit <= 1:
        return [first]
    n, p = tables.n, layout.stages
    if math.comb(n - 1, p - 1) <= ENUMERATE_SPLITS:
        others = [(0, *cuts) for cuts in itertools.combinations(range(1, n), p - 1)]
    else:
        others = [s for _, s in found] + list(_cut_moves(first, n))

    def cost(s: tuple[int, ...]) -> tuple[bool, float]:
        est = setting.estimate(tables.split(s), layout)
        return (memory and not setting.fits(est), est.makespan_s)

    ranked = sorted(dict.fromkeys(s for s in others if s != first), key=cost)
    return [first, *ranked[: limit - 1]]


def split_for_layout(tables: Tables, layout: Layout, setting: CostSetting) -> list[StageCost]:
    """The communication-aware split (the first of :func:`ranked_splits`)."""
    return tables.split(ranked_splits(tables, layout, setting)[0])


def _layout_terms(
    tables: Tables, layout: Layout, setting: CostSetting, *, memory: bool, shared: bool | None
) -> list[np.ndarray]:
    """Per stage k, the [i, j] matrix of its dynamic-program term: its busy
    time per micro-batch, or its incoming boundary's busiest link, whichever
    is larger (``shared``: that link's load multiplied by the boundaries
    sharing it; None: compute only); inf where it does not fit its share of
    a device."""
    links = setting.links
    boundaries = [links.boundary(layout.devices[k - 1], layout.devices[k]) for k in range(1, layout.stages)]
    users: dict[str, int] = {}
    for b in boundaries:
        for name in b.links:
            users[name] = users.get(name, 0) + 1 if shared else 1
    hosted = layout.stages_on()
    terms = []
    for k, devs in enumerate(layout.devices):
        if shared is None:
            term = tables.time.copy()
        else:
            term = stage_terms(
                tables,
                devs,
                links,
                passes=layout.passes[k],
                steps=layout.updates[k],
                microbatches=layout.microbatches,
                optimizer=setting.optimizer,
                hidden=bool(layout.hidden_reduce and layout.hidden_reduce[k]),
            )
        if k and shared is not None:
            line = envelope((users[name] * a, users[name] * b) for name, (a, b) in boundaries[k - 1].links.items())
            term = np.maximum(term, line_of(line, tables.cut)[:, None])
        if memory and setting.memory_limit_bytes is not None:
            mem = memory_terms(
                tables,
                inflight=layout.inflight[k],
                versions=layout.versions[k],
                buffers=layout.buffers[k],
                optimizer_multiplier=setting.optimizer_multiplier,
                centres=layout.centres[k] if layout.centres else 0,
            )
            share = setting.memory_limit_bytes / max(hosted[d] for d in devs)
            term = np.where(mem <= share, term, np.inf)
        terms.append(np.where(tables.valid, term, np.inf))
    return terms


def _improve_cuts(
    tables: Tables, starts: tuple[int, ...], layout: Layout, setting: CostSetting, *, memory: bool
) -> tuple[tuple[int, ...], float | None]:
    """Move cuts one or two layers while the estimated run gets shorter: the
    cuts reached and the run's estimated time (None if they do not fit)."""

    def cost(s: tuple[int, ...]) -> float | None:
        est = setting.estimate(tables.split(s), layout)
        return est.makespan_s if (not memory or setting.fits(est)) else None

    return _descend(starts, cost, lambda s: _cut_moves(s, tables.n))


#: How far a near move shifts a cut, in layers.
NEAR = 2


def _cut_moves(starts: tuple[int, ...], n: int, reach: int | None = NEAR):
    """Every split that moves one cut, by at most ``reach`` layers (None:
    anywhere between its neighbours), cut by cut, nearest layers first."""
    for c in range(1, len(starts)):
        yield from _cut_sweep(starts, n, c, reach)


def _cut_sweep(starts: tuple[int, ...], n: int, c: int, reach: int | None = None):
    """Every split that moves cut ``c`` (stage c's first layer) to another
    layer between its neighbours, at most ``reach`` layers away (None: any)."""
    bounds = [*starts, n]
    lo, hi = bounds[c - 1] + 1, bounds[c + 1]
    if reach is not None:
        lo, hi = max(lo, starts[c] - reach), min(hi, starts[c] + reach + 1)
    for x in range(lo, hi):
        if x != starts[c]:
            yield starts[:c] + (x,) + starts[c + 1 :]


def _descend(start, cost: Callable, moves: Callable, rounds: int = MAX_ROUNDS):
    """Steepest descent: take the best neighbour while it improves by more than
    the tolerance. Returns (point, its cost)."""
    here, value = start, cost(start)
    for _ in range(rounds):
        best, best_value = None, value
        for cand in moves(here):
            v = cost(cand)
            if v is not None and (best_value is None or v < best_value * (1 - REL_TOL)):
                best, best_value = cand, v
        if best is None:
            break
        here, value = best, best_value
    return here, value


# ---------------------------------------------------------------------------
# The planner's search: stages, cuts and replicas
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """A pipeline configuration: where each stage starts, and its replicas."""

    starts: tuple[int, ...]
    replicas: tuple[int, ...]

    @property
    def devices(self) -> int:
        return sum(self.replicas)


@dataclass
class Planner:
    """One search's fixed inputs: the tables, the strategy's traits, the
    iteration (m micro-batches, K iterations), N devices and the setting."""

    tables: Tables
    traits: Traits
    microbatches: int
    iterations: int
    devices: int
    setting: CostSetting
    options: dict

    #: whether the search picks each configuration's flushes per update
    #: (:func:`~.layout.chooses_flushes`: GPipe, unless the request fixes them)
    chooses_flushes: bool = field(init=False)

    def __post_init__(self) -> None:
        self.chooses_flushes = chooses_flushes(self.traits, self.options)

    def layout(self, replicas: tuple[int, ...], flushes: int | None = None) -> Layout:
        options = self.options if flushes is None else self.options | flush_options(flushes)
        return layout_for(self.traits, replicas, self.microbatches, self.iterations, options)

    def least_stash_layout(self, replicas: tuple[int, ...]) -> Layout:
        """The layout the memory terms of a search hold a stage to: where the
        search picks each configuration's flushes, the most of them (one
        micro-batch a flush), so that no configuration some flush count fits
        is left out; :meth:`estimate` then takes the fewest that fit."""
        return self.layout(replicas, self.microbatches if self.chooses_flushes else None)

    def estimate(self, config: Config) -> Estimate:
        """The full model's estimate of ``config``; where the search picks
        the flushes per update, at the fewest that fit (``Estimate.flushes``)."""
        costs = self.tables.split(config.starts)
        if not self.chooses_flushes:
            return self.setting.estimate(costs, self.layout(config.replicas))
        _, found = fewest_flushes(
            lambda f: self.setting.estimate(costs, self.layout(config.replicas, f)),
            self.setting.fits,
            self.microbatches,
        )
        return found

    # -- the dynamic program ------------------------------------------------
    def dynamic_program(self, allowed: tuple[int, ...] | None = None, memory: bool = True) -> dict[int, Config]:
        """The best configuration on all N devices ending in a stage of r
        replicas, for every r the program reaches (see the module doc);
        ``allowed`` limits every stage's replica count."""
        t, n, big_n = self.tables, self.tables.n, self.devices
        allowed = self.replica_counts() if allowed is None else allowed
        links = self.setting.links
        inf = np.inf
        best = np.full((n + 1, big_n + 1, big_n + 1), inf)  # [j, d, r]
        arg_i = np.zeros((n + 1, big_n + 1, big_n + 1), dtype=np.int64)
        arg_r: dict[tuple[int, int], np.ndarray] = {}
        for d in range(1, big_n + 1):
            for r in allowed:
                o = d - r
                if o < 0:
                    continue
                term = self._stage_matrix(o, r, memory)
                if o == 0:
                    v = np.full(n + 1, inf)
                    v[0] = 0.0
                else:
                    cands = []
                    prev_rs = [q for q in allowed if q <= o and np.isfinite(best[:, o, q]).any()]
                    if not prev_rs:
                        continue
                    for q in prev_rs:
                        bnd = links.boundary(tuple(range(o - q, o)), tuple(range(o, o + r)))
                        cands.append(np.maximum(best[:, o, q], line_of(envelope(bnd.links.values()), t.cut)))
                    stack = np.vstack(cands)
                    pick = stack.argmin(axis=0)
                    v = stack[pick, np.arange(n + 1)]
                    v[0] = inf
                    arg_r[(d, r)] = np.asarray(prev_rs)[pick]
                total = np.maximum(v[:, None], term)
                arg_i[:, d, r] = total.argmin(axis=0)
                best[:, d, r] = total[arg_i[:, d, r], np.arange(n + 1)]
        out = {}
        for r in allowed:
            if r <= big_n and np.isfinite(best[n, big_n, r]):
                out[r] = self._backtrack(arg_i, arg_r, r)
        return out

    def replica_counts(self) -> tuple[int, ...]:
        """The replica counts a stage may take in the dynamic program: any, up
        to :data:`ANY_REPLICAS_UP_TO` devices; beyond, up to a node's devices
        or whole nodes (the program's boundary terms grow with devices³, and
        a stage's replicas spread over part of a node plus whole nodes are
        what PipeDream's hierarchy allows anyway). Local search still moves
        single replicas."""
        big_n = self.devices
        if big_n <= ANY_REPLICAS_UP_TO:
            return tuple(range(1, big_n + 1))
        per_node = min(self.setting.links.hw.devices_per_node or SERVER, big_n)
        return tuple(sorted(set(range(1, per_node + 1)) | set(range(per_node, big_n + 1, per_node))))

    def _stage_matrix(
        self, first_device: int, r: int, memory: bool, held: tuple[Layout, int] | None = None
    ) -> np.ndarray:
        """The [i, j] terms of a stage of r replicas on devices first_device ..
        first_device + r - 1 followed by the remaining devices: its busy time,
        inf where it does not fit. Its memory is that of stage ``k`` of
        layout ``held`` = (layout, k) when the whole configuration is known,
        else that of the first of two stages, (r, the remaining devices)."""
        t, m = self.tables, self.microbatches
        devs = tuple(range(first_device, first_device + r))
        term = stage_terms(
            t,
            devs,
            self.setting.links,
            passes=self.traits.share(r, m),
            steps=self.traits.steps(r, m),
            microbatches=m,
            optimizer=self.setting.optimizer,
            hidden=self.traits.hides_reduce,
        )
        if memory and self.setting.memory_limit_bytes is not None:
            if held is None:
                suffix = self.devices - first_device - r
                held = (self.least_stash_layout((r, suffix) if suffix else (r,)), 0)
            probe, k = held
            mem = memory_terms(
                t,
                inflight=probe.inflight[k],
                versions=probe.versions[k],
                buffers=0,
                optimizer_multiplier=self.setting.optimizer_multiplier,
            )
            term = np.where(mem <= self.setting.memory_limit_bytes, term, np.inf)
        return np.where(t.valid, term, np.inf)

    def best_split(self, replicas: tuple[int, ...], memory: bool = True) -> Config | None:
        """The cuts that minimise the slowest stage's time for a configuration
        held to ``replicas`` (stage k on the r_k devices after stage k-1's),
        by the dynamic program's terms over stages instead of devices; each
        stage's memory is its own in that configuration's layout. ``None``
        when no split fits (or there are fewer layers than stages)."""
        t, n = self.tables, self.tables.n
        layout = self.least_stash_layout(tuple(replicas))
        best = np.full(n + 1, np.inf)
        best[0] = 0.0  # the first stage starts at layer 0
        picks, first, prev = [], 0, None
        for k, r in enumerate(replicas):
            devs = tuple(range(first, first + r))
            v = best
            if prev is not None:  # the boundary into stage k, where it is cut
                v = np.maximum(best, line_of(envelope(self.setting.links.boundary(prev, devs).links.values()), t.cut))
                v[0] = np.inf
            total = np.maximum(v[:, None], self._stage_matrix(first, r, memory, held=(layout, k)))
            pick = total.argmin(axis=0)
            best = total[pick, np.arange(n + 1)]
            picks.append(pick)
            first, prev = first + r, devs
        if not np.isfinite(best[n]):
            return None
        starts, j = [], n
        for pick in reversed(picks):
            j = int(pick[j])
            starts.append(j)
        return Config(tuple(reversed(starts)), tuple(replicas))

    def _backtrack(self, arg_i, arg_r, r_last: int) -> Config:
        starts, reps = [], []
        j, d, r = self.tables.n, self.devices, r_last
        while True:
            i = int(arg_i[j, d, r])
            starts.append(i)
            reps.append(r)
            if i == 0:
                break
            r, d, j = int(arg_r[(d, r)][i]), d - r, i
        return Config(tuple(reversed(starts)), tuple(reversed(reps)))

    # -- local search ------------------------------------------------------
    def improve(
        self,
        config: Config,
        *,
        memory: bool = True,
        cache: dict[Config, Estimate] | None = None,
        fixed_replicas: bool = False,
        sweep: bool = False,
    ) -> tuple[Config, Estimate]:
        """Local search on the full model from ``config`` (see the module doc):
        the configuration with the most samples per second it reaches.
        ``cache`` keeps every configuration it costed, with its estimate;
        ``fixed_replicas`` moves cuts only (a straight pipeline stays one).

        Near moves (the default) move a cut by a layer or two and a replica
        without its cut. ``sweep`` moves a cut to any layer between its
        neighbours, and a replica with the cut between its two stages
        anywhere: the full model's cost over one cut is far from convex (a
        cut after a pooling layer sends a quarter of the bytes of one before
        it), and near moves stop at the first dip (VGG-16's 12-4 on
        Cluster-B: cut after layer 16, rated 21% below the cut after layer
        24; the 15-1 PipeDream ran is out of their reach)."""
        cache = {} if cache is None else cache

        def est(c: Config) -> Estimate:
            e = cache.get(c)
            if e is None:
                e = cache[c] = self.estimate(c)
            return e

        def cost(c: Config) -> float | None:
            e = est(c)
            return e.iteration_s if (not memory or self.setting.fits(e)) else None

        def moves(c: Config):
            return self._moved_cuts(c, sweep) if fixed_replicas else self._moves(c, sweep)

        here, _ = _descend(config, cost, moves)
        return here, est(here)

    def _moved_cuts(self, c: Config, sweep: bool):
        for s in _cut_moves(c.starts, self.tables.n, None if sweep else NEAR):
            yield Config(s, c.replicas)

    def _moves(self, c: Config, sweep: bool):
        n = self.tables.n
        starts, reps = c.starts, c.replicas
        p = len(starts)
        yield from self._moved_cuts(c, sweep)
        bounds = [*starts, n]
        for k in range(p - 1):  # a replica to the neighbour, either way (sweep: the cut between them anywhere)
            moved = []
            if reps[k] > 1:
                moved.append(reps[:k] + (reps[k] - 1, reps[k + 1] + 1) + reps[k + 2 :])
            if reps[k + 1] > 1:
                moved.append(reps[:k] + (reps[k] + 1, reps[k + 1] - 1) + reps[k + 2 :])
            for r in moved:
                yield Config(starts, r)
                if sweep:
                    for s in _cut_sweep(starts, n, k + 1):
                        yield Config(s, r)
            yield Config(starts[: k + 1] + starts[k + 2 :], reps[:k] + (reps[k] + reps[k + 1],) + reps[k + 2 :])
        for k in range(p):  # split a stage at its compute midpoint
            a, b = bounds[k], bounds[k + 1]
            if b - a >= 2 and reps[k] >= 2:
                times = self.tables.time[a, a + 1 : b]
                mid = a + 1 + int(np.argmin(np.abs(times - self.tables.time[a, b] / 2)))
                mid = min(max(mid, a + 1), b - 1)
                half = reps[k] // 2
                yield Config(
                    starts[: k + 1] + (mid,) + starts[k + 1 :], reps[:k] + (reps[k] - half, half) + reps[k + 1 :]
                )

"""Split a profile's layers into contiguous pipeline stages.

The objective is the pipeline's throughput bound: the slowest stage's
forward + backward time. :func:`partition` finds a contiguous split that
minimises it exactly (dynamic programming over split points), and among the
splits that reach that minimum picks the one with the smallest sum of squared
stage times, so stages that are not the bottleneck are balanced too (a
lopsided non-bottleneck stage still lengthens warm-up and drain). Remaining
ties go to the split whose later stages hold more layers: in 1F1B-style
schedules later stages keep fewer micro-batches in flight, so that is the
cheaper place for extra activations.

That is the compute-only split. Given the hardware and a layout (where each
stage's replicas run and what the schedule asks of them), :func:`partition`
splits communication-aware instead (:mod:`pipesim.sim.planning.search`):
the same dynamic program (:func:`balanced`) over each stage's full cost,
transfers and all-reduces included.

Memory: with ``memory_limit_bytes``, a stage k holding weights ``W`` and
stashing ``A`` per micro-batch needs ``W * (2 + optimizer multiplier) +
A * inflight(k)`` (weights, gradients, optimizer state, activations of the
micro-batches in flight), and only splits where every stage fits are
considered. If none fits, the unconstrained time-balanced split is returned
anyway: the engine then reports the overflow as out-of-memory, which says
more than an exception here would.

Times are compared with a relative tolerance of 1e-9, so splits whose
bottlenecks differ only by floating-point rounding count as ties and the
tie-break above, not rounding, decides.

Size: the dynamic program works on (layers + 1)² tables, a few at a time
(each stage's is made when it is needed), so its time grows with layers² ×
stages and its memory with layers². One
stage, or one layer per stage (the ``uniform`` model on any depth), has a
single contiguous split and needs no tables at all. Otherwise
:data:`MAX_DP_LAYERS` and :data:`MAX_DP_CELLS` bound it (see there) and a
larger request is a :class:`~pipesim.sim.workload.WorkloadError` before
anything is allocated.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from pipesim.sim.models import UNIFORM_PARAM_BYTES, UNIFORM_STASH_BYTES
from pipesim.sim.workload import Profile, WorkloadError

if TYPE_CHECKING:
    from pipesim.sim.hardware import Hardware
    from pipesim.sim.planning.layout import Layout

_REL_TOL = 1e-9

#: At most this many layers for the dynamic program: it keeps about ten
#: (layers + 1)² float64 tables alive at once, 32 MiB each at 2048 layers,
#: so the split stays far below a machine's memory (~350 MB at the limit).
MAX_DP_LAYERS = 2048
#: At most stages × (layers + 1)² table cells: the work (about 10 ns a cell,
#: a second or two at the limit).
MAX_DP_CELLS = 2**27


@dataclass(frozen=True)
class StageCost:
    """What one stage costs per micro-batch: the engine's view of a stage.

    ``activation_bytes`` is what the stage sends forward (its last layer's
    output; the input gradient sent back has the same size).
    ``backward_input_s + backward_weight_s == backward_s`` up to rounding,
    plus the profile's per-pass overhead once more (a split backward is two
    passes).

    ``input_bytes`` is what the stage receives per micro-batch (the previous
    layer's ``activation_bytes``; 0 for the first stage, whose input is the
    data batch the loader holds). ``layer_input_bytes`` and
    ``layer_stash_bytes``: the same two facts per layer of the stage, in
    order (empty for a stage built by hand: it then counts as one layer).

    ``recompute``: activation recomputation, checkpointed per layer
    (:func:`recomputed`): between its forward and its backward a micro-batch
    keeps only the input of every layer of the stage (:attr:`held_bytes`),
    and its backward, which re-runs the forward first (already included in
    ``backward_s``), rematerialises one layer at a time, from the last: while
    it runs the micro-batch holds at most the inputs of the layers below one
    layer plus that layer's full stash (:attr:`full_stash_bytes`).
    """

    first_layer: int
    last_layer: int  # inclusive
    forward_s: float
    backward_s: float
    backward_input_s: float
    backward_weight_s: float
    param_bytes: int
    activation_bytes: int
    stash_bytes: int
    input_bytes: int = 0
    recompute: bool = False
    layer_input_bytes: tuple[int, ...] = ()
    layer_stash_bytes: tuple[int, ...] = ()
    #: Tensor parallelism: the activation all-reduces one forward (or one
    #: backward) of the stage runs, in bytes each, in order (the
    #: strategy's costs set them; empty for every other strategy).
    allreduce_bytes: tuple[int, ...] = ()

    @property
    def held_bytes(self) -> int:
        """Bytes a micro-batch keeps from its forward until its backward
        starts: its whole stash, or with recomputation only its layers'
        inputs (the checkpoints)."""
        if not self.recompute:
            return self.stash_bytes
        return sum(self.layer_input_bytes) if self.layer_input_bytes else self.input_bytes

    @property
    def full_stash_bytes(self) -> int:
        """Bytes a micro-batch's activations take at most while its backward
        runs: its stash, or with recomputation the checkpoints of the layers
        below the one being rematerialised plus that layer's full stash (its
        input among it, so at least that), the largest over the layers."""
        if not self.recompute:
            return self.stash_bytes
        if not self.layer_input_bytes:
            return max(self.stash_bytes, self.input_bytes)
        return recompute_peak(self.layer_input_bytes, self.layer_stash_bytes)

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1

    @property
    def time_s(self) -> float:
        """Forward + backward: the quantity the partitioner balances."""
        return self.forward_s + self.backward_s

    def memory_bytes(self, inflight: int, optimizer_state_multiplier: int = 1) -> int:
        """Weights, gradients, optimizer state and ``inflight`` micro-batches of
        stash (with recomputation: their layers' inputs, one of them at its
        backward's peak)."""
        held = (inflight - 1) * self.held_bytes + self.full_stash_bytes if inflight > 0 else 0
        return self.param_bytes * (2 + optimizer_state_multiplier) + held


def stage_cost(profile: Profile, first: int, last: int) -> StageCost:
    """The cost of layers ``first..last`` (inclusive) as one stage."""
    if not (0 <= first <= last < len(profile.layers)):
        raise WorkloadError(f"no layers {first}..{last} in a profile of {len(profile.layers)} layers")
    layers = profile.layers[first : last + 1]
    o_f, o_b = profile.overhead_forward_s, profile.overhead_backward_s
    return StageCost(
        first_layer=first,
        last_layer=last,
        forward_s=math.fsum(la.forward_s for la in layers) + o_f,
        backward_s=math.fsum(la.backward_s for la in layers) + o_b,
        # a split backward is two passes, each with the fixed overhead
        backward_input_s=math.fsum(la.backward_input for la in layers) + o_b,
        backward_weight_s=math.fsum(la.backward_weight for la in layers) + o_b,
        param_bytes=sum(la.param_bytes for la in layers),
        activation_bytes=layers[-1].activation_bytes,
        stash_bytes=sum(la.stash_bytes for la in layers),
        input_bytes=profile.layers[first - 1].activation_bytes if first else 0,
        layer_input_bytes=tuple(profile.layers[k - 1].activation_bytes if k else 0 for k in range(first, last + 1)),
        layer_stash_bytes=tuple(la.stash_bytes for la in layers),
    )


def recompute_peak(inputs: Sequence[int], stashes: Sequence[int]) -> int:
    """Most bytes a micro-batch's activations take while a backward with
    per-layer recomputation runs over layers with these inputs and stashes:
    max over layers j of (inputs of the layers before j) + max(stash_j, input_j)."""
    below, peak = 0, 0
    for x, st in zip(inputs, stashes, strict=True):
        peak = max(peak, below + max(st, x))
        below += x
    return peak


def recomputed(costs: Sequence[StageCost]) -> list[StageCost]:
    """``costs`` with activation recomputation (idempotent): every backward
    first re-runs its stage's forward, so the backward (and, split, its
    input-gradient half, which needs the recomputed activations) takes
    ``forward_s`` longer, and a micro-batch keeps only its layers' inputs
    until then (see :class:`StageCost`). Expressed in stage costs, so the
    engine, the trackers and the cost model need nothing else.

    Checkpoints are per layer of the profile, as Megatron-LM's
    ``--checkpoint-activations --checkpoint-num-layers 1`` (which
    PipeDream-2BW's GPipe, PipeDream-Flush and 2BW runs used) and
    ``torch.utils.checkpoint`` around each block keep them. GPipe's paper
    re-materialised per partition instead (only the stage input, the whole
    stage's activations at once in the backward): for a stage of one layer
    the two coincide; for a deep stage per-layer keeps more between the
    passes (every layer's input, which is what makes GPipe, holding all m
    micro-batches of a flush, fit fewer) and less during the backward (one
    layer's activations at a time). pipesim models the per-layer form only.
    """
    return [c if c.recompute else replace(c, backward_s=c.backward_s + c.forward_s,
                                          backward_input_s=c.backward_input_s + c.forward_s, recompute=True)
            for c in costs]


def split_at(profile: Profile, starts: Sequence[int]) -> list[StageCost]:
    """Stages beginning at the given layer indices (``starts[0]`` must be 0).

    For hand-chosen or paper-given splits; :func:`partition` chooses one.
    """
    starts = list(starts)
    n = len(profile.layers)
    if not starts or starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)) or starts[-1] >= n:
        raise WorkloadError(
            f"stage starts {starts} must begin at 0 and strictly increase below {n} (the layer count)"
        )
    bounds = [*starts, n]
    return [stage_cost(profile, a, b - 1) for a, b in itertools.pairwise(bounds)]


def partition(
    profile: Profile,
    num_stages: int,
    *,
    memory_limit_bytes: float | None = None,
    inflight: Callable[[int], int] | None = None,
    hardware: Hardware | None = None,
    layout: Layout | None = None,
) -> list[StageCost]:
    """Contiguous split of ``profile`` into ``num_stages`` stages.

    Compute only by default: balanced by time, ``inflight(k)`` micro-batches
    stashed by stage k for the memory test (default ``num_stages - k``, the
    1F1B / PipeDream steady state; only used with ``memory_limit_bytes``).

    With ``hardware`` and ``layout`` (where each stage's replicas run and
    what the schedule asks of them, :func:`pipesim.sim.planning.layout_of` of
    a built schedule), communication-aware: transfers across every boundary
    over the links it crosses and each replicated stage's all-reduce count
    too, and memory is the layout's (``inflight`` does not apply); see
    :mod:`pipesim.sim.planning.search`. See the module doc for the objective,
    tie-breaks and what happens when nothing fits.
    """
    n = len(profile.layers)
    limit = _check_limit(memory_limit_bytes)
    if (hardware is None) != (layout is None):
        raise WorkloadError("a communication-aware split needs both hardware and layout")
    if layout is not None and layout.stages != num_stages:
        raise WorkloadError(f"the layout has {layout.stages} stages, not {num_stages}")
    if not check_split(profile, num_stages):  # a single contiguous split: nothing to choose
        return split_at(profile, range(0, n, n // num_stages))
    if layout is not None:
        from pipesim.sim.planning.search import CostSetting, Tables, split_for_layout

        return split_for_layout(Tables(profile), layout, CostSetting.of(profile, hardware, limit))
    times = np.array([la.forward_s + la.backward_s for la in profile.layers], dtype=float)
    prefix = np.concatenate(([0.0], np.cumsum(times)))
    cost = prefix[None, :] - prefix[:, None]  # cost[i, j]: layers i .. j-1
    idx = np.arange(n + 1)
    valid = idx[:, None] < idx[None, :]

    fits = None
    if limit is not None:
        inflight = inflight or (lambda k: num_stages - k)
        w = np.concatenate(([0.0], np.cumsum([float(la.param_bytes) for la in profile.layers])))
        a = np.concatenate(([0.0], np.cumsum([float(la.stash_bytes) for la in profile.layers])))
        weights = (w[None, :] - w[:, None]) * (2 + profile.optimizer_state_multiplier)
        stash = a[None, :] - a[:, None]

        def fits(k: int) -> np.ndarray:
            m = inflight(k)
            if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
                raise WorkloadError(f"inflight({k}) must be an integer >= 0, got {m!r}")
            return weights + stash * int(m) <= limit

    def term(k: int) -> np.ndarray:
        allowed = valid & fits(k) if fits else valid
        return np.where(allowed, cost, np.inf)

    starts = balanced(term, num_stages)
    if starts is None:  # nothing fits: time-balanced anyway, the engine reports OOM
        starts = balanced(lambda k: np.where(valid, cost, np.inf), num_stages)
    assert starts is not None
    return split_at(profile, starts)


def check_split(profile: Profile, num_stages: int) -> bool:
    """Check a request to split ``profile`` into ``num_stages`` stages (a
    :class:`WorkloadError` if it cannot be, or its tables would be too big):
    whether there is a choice to make (False for one stage, or one layer per
    stage: a single contiguous split)."""
    n = len(profile.layers)
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or not (1 <= num_stages <= n):
        raise WorkloadError(f"cannot split {n} layers into {num_stages} stages")
    if num_stages in (1, n):
        return False
    _check_dp_size(n, num_stages)
    return True


def _check_dp_size(layers: int, stages: int) -> None:
    """Refuse a split whose tables would not fit (see MAX_DP_LAYERS, MAX_DP_CELLS)."""
    cells = stages * (layers + 1) ** 2
    if layers > MAX_DP_LAYERS or cells > MAX_DP_CELLS:
        raise WorkloadError(
            f"cannot split {layers} layers into {stages} stages exactly: the partitioner's tables grow with "
            f"stages x (layers+1)^2 = {cells:,} cells; the limits are {MAX_DP_LAYERS} layers and "
            f"{MAX_DP_CELLS:,} cells (memory and time); merge layers in the profile or use fewer stages"
        )


def _check_limit(limit: float | None) -> float | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or math.isnan(limit) or limit < 0:
        raise WorkloadError(f"memory limit must be a number >= 0, got {limit!r}")
    return None if math.isinf(limit) else float(limit)


def balanced(term: Callable[[int], np.ndarray], num_stages: int) -> list[int] | None:
    """Stage start indices of the best split, or None if none has finite terms.

    ``term(k)`` is stage k's (layers + 1)² matrix: entry [i, j] is what stage
    k costs holding layers i .. j-1 (inf where it may not: below the
    diagonal, or where it does not fit). The split minimises the largest
    term, then the sum of squared terms; remaining ties go to the split whose
    later stages hold more layers. Matrices are asked for one at a time (three
    times each), so memory stays at a few of them whatever the stage count.
    """
    n = term(0).shape[0] - 1

    # Pass 1: the smallest achievable bottleneck.
    best = np.full(n + 1, np.inf)
    best[1:] = term(0)[0, 1:]
    for k in range(1, num_stages):
        best = np.maximum(best[:, None], term(k)).min(axis=0)
    bottleneck = best[n]
    if not np.isfinite(bottleneck):
        return None

    # Pass 2: among splits within the bottleneck, the smallest sum of squares.
    cap = bottleneck + _REL_TOL * abs(bottleneck)

    def squares(k: int) -> np.ndarray:
        t = term(k)
        return np.where(t <= cap, t * t, np.inf)

    tables = []
    ss = np.full(n + 1, np.inf)
    ss[1:] = squares(0)[0, 1:]
    tables.append(ss)
    for k in range(1, num_stages):
        ss = (ss[:, None] + squares(k)).min(axis=0)
        tables.append(ss)

    # Backtrack: for each stage from the last, the earliest start among the
    # (near-)optimal ones, i.e. later stages take as many layers as ties allow.
    starts = [0] * num_stages
    j = n
    for k in range(num_stages - 1, 0, -1):
        col = tables[k - 1] + squares(k)[:, j]
        m = col.min()
        i = int(np.flatnonzero(col <= m + _REL_TOL * abs(m))[0])
        starts[k] = i
        j = i
    return starts


def stage_costs_uniform(
    num_stages: int,
    forward_s: float = 1e-3,
    backward_s: float = 2e-3,
    *,
    param_bytes: int = UNIFORM_PARAM_BYTES,
    stash_bytes: int = UNIFORM_STASH_BYTES,
    activation_bytes: int = 0,
) -> list[StageCost]:
    """Identical one-layer stages for analytic tests (I = W = B / 2).

    Same defaults as the ``uniform`` model: nothing sent, 1 MiB of weights
    and 1 MiB of stash per micro-batch.
    """
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise WorkloadError(f"num_stages must be a positive integer, got {num_stages!r}")
    return [
        StageCost(
            first_layer=k,
            last_layer=k,
            forward_s=forward_s,
            backward_s=backward_s,
            backward_input_s=backward_s / 2,
            backward_weight_s=backward_s / 2,
            param_bytes=param_bytes,
            activation_bytes=activation_bytes,
            stash_bytes=stash_bytes,
            layer_input_bytes=(0,),  # as input_bytes: nothing counted in
            layer_stash_bytes=(stash_bytes,),
        )
        for k in range(num_stages)
    ]

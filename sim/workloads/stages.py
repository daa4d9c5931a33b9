"""A stage: a contiguous run of a profile's layers, and what it costs.

:class:`StageCost` is what the engine charges a stage for each pass and
holds in memory; the partitioner (:mod:`pipesim.sim.partition`) chooses
where stages begin, and :func:`split_at` turns chosen starts into costs.
Activation recomputation (:func:`recomputed`) is expressed here, in stage
costs, so the engine, the trackers and the cost model need nothing else.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipesim.sim.workloads.profile import Profile, WorkloadError


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
    keeps only the input of every checkpointed layer of the stage and the
    whole stash of the others (:attr:`held_bytes`; ``layer_recomputed`` says
    which are checkpointed, empty: all), and its backward, which re-runs the
    checkpointed layers' forward first (``rerun_forward_s``, already included
    in ``backward_s``), rematerialises one layer at a time, from the last:
    while it runs the micro-batch holds at most what the layers below one
    layer keep plus that layer's full stash (:attr:`full_stash_bytes`).
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
    #: The weights the passes read (one version of them; what a stashed
    #: version holds), summed over the stage's layers at the profile's
    #: :class:`~pipesim.sim.workloads.profile.Precision`; None: ``param_bytes``.
    weight_bytes: int | None = None
    #: The stage's gradients, what its REDUCE_GRAD all-reduces (16-bit in
    #: mixed precision); None: ``param_bytes``.
    gradient_bytes: int | None = None
    #: A master copy of the weights kept beside the passes' copy (mixed
    #: precision: the fp32 weights the optimizer updates); 0 when the passes
    #: read the master itself. ``param_bytes`` is always the master's size,
    #: and the optimizer state is counted in it.
    master_copy_bytes: int = 0
    #: Per layer of the stage, in order: its gradients' bytes and the share
    #: of the stage's backward it takes (fractions summing to 1), so a
    #: data-parallel all-reduce can start on the last layers' gradients
    #: while the backward still runs on the first (DDP's buckets,
    #: :mod:`pipesim.sim.engine.core`). Empty for a stage built by hand:
    #: its gradients are one bucket, ready when its backward ends.
    layer_gradient_bytes: tuple[int, ...] = ()
    layer_backward_share: tuple[float, ...] = ()
    #: What a micro-batch's input-gradient pass (I) leaves held for its
    #: weight-gradient pass (W) beyond the stash, from the end of I to the
    #: end of W: the layers' ``w_held_bytes`` summed.
    w_held_bytes: int = 0
    #: Per layer of the stage, in order: whether recomputation checkpoints it
    #: (:attr:`LayerCost.recomputed <pipesim.sim.workloads.profile.LayerCost.recomputed>`);
    #: empty: every layer.
    layer_recomputed: tuple[bool, ...] = ()
    #: The forward seconds recomputation runs again before a backward: the
    #: checkpointed layers' (and the pass's fixed overhead); None: ``forward_s``.
    rerun_forward_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("weight_bytes", "gradient_bytes"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.param_bytes)
        if self.rerun_forward_s is None:
            object.__setattr__(self, "rerun_forward_s", self.forward_s)

    def _kept(self) -> tuple[int, ...]:
        """Per layer, what a micro-batch keeps of it between its passes under
        recomputation: its input, or its whole stash if it is not checkpointed."""
        flags = self.layer_recomputed or (True,) * len(self.layer_input_bytes)
        return tuple(
            x if again else st
            for x, st, again in zip(self.layer_input_bytes, self.layer_stash_bytes, flags, strict=True)
        )

    @property
    def held_bytes(self) -> int:
        """Bytes a micro-batch keeps from its forward until its backward
        starts: its whole stash, or with recomputation only its layers'
        inputs (the checkpoints)."""
        if not self.recompute:
            return self.stash_bytes
        return sum(self._kept()) if self.layer_input_bytes else self.input_bytes

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
        return recompute_peak(self._kept(), self.layer_stash_bytes)

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1

    @property
    def time_s(self) -> float:
        """Forward + backward: the quantity the partitioner balances."""
        return self.forward_s + self.backward_s

    def resident_bytes(self, optimizer_state_multiplier: int = 1) -> int:
        """What one replica holds throughout: one version of the passes'
        weights, the gradients, the master copy (if apart) and the optimizer
        state (``optimizer_state_multiplier`` buffers at the master's width).
        One precision throughout: ``param_bytes * (2 + multiplier)``; mixed
        precision holds the same total (see :class:`~pipesim.sim.workloads.profile.Precision`)."""
        return (
            self.weight_bytes
            + self.gradient_bytes
            + self.master_copy_bytes
            + optimizer_state_multiplier * self.param_bytes
        )

    def memory_bytes(self, inflight: int, optimizer_state_multiplier: int = 1) -> int:
        """Weights, gradients, optimizer state (:meth:`resident_bytes`) and
        ``inflight`` micro-batches of stash (with recomputation: their layers'
        inputs, one of them at its backward's peak)."""
        held = (inflight - 1) * self.held_bytes + self.full_stash_bytes if inflight > 0 else 0
        return self.resident_bytes(optimizer_state_multiplier) + held


def stage_cost(profile: Profile, first: int, last: int) -> StageCost:
    """The cost of layers ``first..last`` (inclusive) as one stage."""
    if not (0 <= first <= last < len(profile.layers)):
        raise WorkloadError(f"no layers {first}..{last} in a profile of {len(profile.layers)} layers")
    layers = profile.layers[first : last + 1]
    o_f, o_b = profile.overhead_forward_s, profile.overhead_backward_s
    pr = profile.precision
    flags = tuple(la.recomputed for la in layers)
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
        weight_bytes=sum(pr.weights(la.param_bytes) for la in layers),
        gradient_bytes=sum(pr.gradients(la.param_bytes) for la in layers),
        master_copy_bytes=sum(pr.master_copy(la.param_bytes) for la in layers),
        layer_gradient_bytes=tuple(pr.gradients(la.param_bytes) for la in layers),
        layer_backward_share=backward_shares([la.backward_s for la in layers]),
        w_held_bytes=sum(la.w_held_bytes for la in layers),
        layer_recomputed=() if all(flags) else flags,
        rerun_forward_s=math.fsum(la.forward_s for la in layers if la.recomputed) + o_f,
    )


def backward_shares(times: Sequence[float]) -> tuple[float, ...]:
    """Each layer's share of the backward over ``times`` (equal shares when
    every time is zero)."""
    total = math.fsum(times)
    if total <= 0:
        return tuple(1 / len(times) for _ in times)
    return tuple(t / total for t in times)


def recompute_peak(kept: Sequence[int], stashes: Sequence[int]) -> int:
    """Most bytes a micro-batch's activations take while a backward with
    per-layer recomputation runs over layers that keep ``kept`` between the
    passes (a checkpointed layer its input, another its stash) and have
    these stashes: max over layers j of (what the layers before j keep) +
    max(stash_j, kept_j)."""
    below, peak = 0, 0
    for x, st in zip(kept, stashes, strict=True):
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
    return [
        c
        if c.recompute
        else replace(
            c,
            backward_s=c.backward_s + c.rerun_forward_s,
            backward_input_s=c.backward_input_s + c.rerun_forward_s,
            recompute=True,
        )
        for c in costs
    ]


def split_at(profile: Profile, starts: Sequence[int]) -> list[StageCost]:
    """Stages beginning at the given layer indices (``starts[0]`` must be 0).

    For hand-chosen or paper-given splits; :func:`pipesim.sim.partition.split.partition` chooses one.
    """
    starts = list(starts)
    n = len(profile.layers)
    if not starts or starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)) or starts[-1] >= n:
        raise WorkloadError(f"stage starts {starts} must begin at 0 and strictly increase below {n} (the layer count)")
    bounds = [*starts, n]
    return [stage_cost(profile, a, b - 1) for a, b in itertools.pairwise(bounds)]

"""Tensor model parallelism in Megatron-LM's style (Shoeybi et al. 2019).

Each of ``d = stages * width`` devices (the CLI's ``--stages d``) holds 1/d
of every layer: the attention heads and the MLP's hidden units are split
across devices, so every device runs every micro-batch on its shard of the
weights. The partial results meet in all-reduces of the full activation:
two per transformer layer in the forward (after attention and after the
MLP) and their two conjugates in the backward, over the group, which spans
servers when d exceeds one.

How it is expressed in the IR: one model stage replicated d times, replica
r on device r, as data parallelism lays devices out; micro-batch l of
iteration t is the d ids ``(t*m + l)*d + r``, one shard per device (so
``num_microbatches`` is m*d and :attr:`Strategy.shards` tells metrics to
count each micro-batch once). Each device runs ``F ALLREDUCE B ALLREDUCE``
per micro-batch (one at a time, as Megatron without pipelining does), then
``UPDATE`` of its own shard: no gradient all-reduce, since no weight is
replicated. One ``ALLREDUCE`` action stands for all of a pass's all-reduces
(2 per layer: :func:`device_costs` lists them), which the engine runs one
after another over the group's devices on the real topology; the next pass
waits for it. This keeps the action count at four per micro-batch and
device while charging every all-reduce, latency included. Within one pass
the all-reduces follow all of its compute instead of sitting between
layers; on one device the sum is the same.

Simplifications: a catalog model on a device with the GEMM shape model is
costed per shard, each GEMM at its shard's shape
(:func:`pipesim.sim.workloads.catalog.model_profile`'s ``tensor_parallel``);
for any other profile the compute, weights and stash of every layer are
divided by d, except the fixed part of each pass (a layer's kernel launches,
``LayerCost.fixed_forward_s`` / ``fixed_backward_s``, and the profile's
per-pass overhead), which every device pays in full (Megatron replicates LayerNorm and dropout inputs, so the real stash
is somewhat larger); embedding and output layers all-reduce their hidden
state like a block; activation recomputation does not repeat the forward's
all-reduces. Combining it with data parallelism (a gradient all-reduce
across groups) or with pipelining is out of scope. The emulator and runtime
cannot run it (it needs split layers on real tensors) and refuse it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from pipesim.sim.ir.core import ALLREDUCE, Action, B, F, Schedule
from pipesim.sim.strategies._common import (
    ScheduleSpec,
    Strategy,
    StrategyError,
    check_spec,
    flush_iteration,
    ring_steps,
    schedule_of,
)

NAME = "tensor-parallel"

#: Activation all-reduces per layer in each pass (after attention and after the MLP).
ALLREDUCES_PER_LAYER = 2


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    d = spec.stages * spec.width
    m = spec.microbatches
    programs = []
    for r in range(d):
        prog: list[Action] = []
        for t in range(spec.iterations):
            order = []
            for local in range(m):
                mb = (t * m + local) * d + r
                order += [
                    Action(F, 0, mb, replica=r),
                    Action(ALLREDUCE, 0, replica=r),
                    Action(B, 0, mb, replica=r),
                    Action(ALLREDUCE, 0, replica=r),
                ]
            prog.extend(flush_iteration(order, t, reduce=False))
        programs.append(tuple(prog))
    return schedule_of(
        spec,
        programs,
        num_stages=1,
        num_microbatches=m * d,
        replicas=d,
        options={"devices": d, "tensor_parallel": d, "width": 1, "depth": 1},
    )


def device_costs(profile, stage_costs: list, options: Mapping[str, object]) -> list:
    """One device's share of the (single) stage: compute, weights and stash
    divided by d (each layer's stash too; every copy of the weights, the
    passes', the gradients and the master, as the device holds a shard of
    each at the profile's precision), the fixed part of each pass
    (kernel launches, the profile's per-pass overhead) not, since every
    device launches every kernel on its shard; its inputs whole (every rank
    holds the hidden state the all-reduce made); and the stage's activation
    all-reduces of one pass: two per layer, each of the layer's hidden state
    (the larger of its input and its output, so the loss layer, which
    outputs nothing, still counts).

    A profile that is already one rank's shard (``profile.tensor_parallel
    == d``: a catalog model on a device with the GEMM shape model, its GEMMs
    priced at the shard's shapes, where an 8-way split runs far below the
    whole layer's efficiency) keeps its times and sizes; only the
    all-reduces are added."""
    d = int(options.get("tensor_parallel", 1))
    given = profile.tensor_parallel
    if given not in (1, d):
        raise StrategyError(f"the profile is one shard of {given}-way tensor parallelism; this run is {d}-way")
    out = []
    for c in stage_costs:
        layers = profile.layers[c.first_layer : c.last_layer + 1]
        buffers = activation_allreduces(profile, c.first_layer, c.last_layer)
        if given == d:  # already one rank's shard (its GEMMs priced at their shapes): only the all-reduces
            out.append(replace(c, allreduce_bytes=tuple(buffers) if d > 1 else ()))
            continue
        fixed = fixed_costs(profile, layers)

        def share(t: float, fixed: float) -> float:
            return (t - fixed) / d + fixed

        out.append(
            replace(
                c,
                forward_s=share(c.forward_s, fixed["forward"]),
                rerun_forward_s=share(c.rerun_forward_s, fixed["rerun_forward"]),
                backward_s=share(c.backward_s, fixed["backward"]),
                backward_input_s=share(c.backward_input_s, fixed["backward_input"]),
                backward_weight_s=share(c.backward_weight_s, fixed["backward_weight"]),
                param_bytes=-(-c.param_bytes // d),
                weight_bytes=-(-c.weight_bytes // d),
                gradient_bytes=-(-c.gradient_bytes // d),
                master_copy_bytes=-(-c.master_copy_bytes // d),
                stash_bytes=-(-c.stash_bytes // d),
                layer_stash_bytes=tuple(-(-x // d) for x in c.layer_stash_bytes),
                layer_gradient_bytes=tuple(-(-x // d) for x in c.layer_gradient_bytes),
                allreduce_bytes=tuple(buffers) if d > 1 else (),
            )
        )
    return out


def activation_allreduces(profile, first: int, last: int) -> list[int]:
    """The bytes of each activation all-reduce of one pass of layers
    ``first`` .. ``last``: two per layer, each of the layer's hidden state
    (the larger of its input and its output, so the loss layer, which
    outputs nothing, still counts)."""
    out: list[int] = []
    for k in range(first, last + 1):
        hidden = max(profile.layers[k].activation_bytes, profile.layers[k - 1].activation_bytes if k else 0)
        out += [hidden] * ALLREDUCES_PER_LAYER
    return out


def fixed_costs(profile, layers) -> dict[str, float]:
    """What every rank pays in full of each pass of ``layers`` (kernel
    launches, the profile's per-pass overhead), by pass: ``forward``,
    ``backward`` and its halves (a layer's fixed backward splits between
    them as its backward does), and ``rerun_forward``, the forward that
    recomputation runs again (its checkpointed layers only)."""
    o_f, o_b = profile.overhead_forward_s, profile.overhead_backward_s
    backward = math.fsum(la.fixed_backward_s for la in layers) + o_b
    backward_input = (
        math.fsum(la.fixed_backward_s * (la.backward_input / la.backward_s) for la in layers if la.backward_s) + o_b
    )
    return {
        "forward": math.fsum(la.fixed_forward_s for la in layers) + o_f,
        "rerun_forward": math.fsum(la.fixed_forward_s for la in layers if la.recomputed) + o_f,
        "backward": backward,
        "backward_input": backward_input,
        "backward_weight": backward - backward_input + o_b,
    }


def shards(options: Mapping[str, object]) -> int:
    """Every micro-batch runs as d ids, one shard per device."""
    return int(options.get("tensor_parallel", 1))


def stage_passes(spec: ScheduleSpec) -> int:
    """Every device runs every micro-batch (on its shard)."""
    return spec.microbatches * spec.stages * spec.width * spec.iterations


def ring_transfers(spec: ScheduleSpec) -> int:
    """At least one all-reduce per pass (the layer count is not known before
    the model is: two per layer in fact), for progress."""
    return 2 * spec.microbatches * spec.iterations * ring_steps(spec.stages * spec.width)


STRATEGY = Strategy(
    name=NAME,
    build=build,
    options=("width",),
    stage_passes=stage_passes,
    ring_transfers=ring_transfers,
    device_costs=device_costs,
    shards=shards,
    executable=False,
    summary="every layer split over stages x width devices, 2+2 activation all-reduces per layer (Megatron)",
)

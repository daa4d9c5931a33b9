"""Measure a real model on the target device: the profile ``pipesim simulate`` takes.

Per layer, the forward, backward and input-gradient time of one
micro-batch, its parameter bytes, output bytes and stashed bytes; plus what
the runtime costs around the layers, so the simulator predicts the runtime
and not an idealised kernel timeline:

* **in model order**: every layer runs as its own
  :class:`~pipesim.validate.stage.PipelineStage` and the layers are chained
  as in training (all forwards in order, all backwards in reverse, then the
  updates), and each pass is timed inside that sequence. Timing one layer
  in a tight loop keeps its weights in the core's cache, which a real step,
  touching every layer in turn, does not: on a CPU with 4 MiB of L2 that
  alone made the mlp's layers look 30-50% faster than they run.
* **pass overhead**: a pass through a stage (binding weights, autograd
  bookkeeping) costs a fixed amount on top of its layers. Chaining single
  layers charges it once per *layer*; it is measured on an empty stage,
  subtracted from every layer and written to the profile as ``overhead``,
  which the simulator charges once per *stage* pass.
* **kernel bandwidths** (:func:`kernel_bandwidths`): the optimizer step,
  SpecTrain's prediction and AvgPipe's averaging, each run by the runtime's
  code on the whole model right after its forward and backward, expressed
  as the bandwidth at which the simulator's byte count for that kernel (an
  SGD step 5 |W|, a prediction 3 |W|, ...) takes that long; they go into the
  hardware JSON as the device's ``update_bandwidth``, ``predict_bandwidth``
  and ``average_bandwidth`` (the step's also as ``mem_bandwidth``).

Every time is the mean (:func:`expected`) over repeated training steps after
a warm-up, measured with the code path the runtime executes, on one thread when the
device is a CPU (as each gloo worker runs).

:func:`profile_layers` measures the layers alone (``pipesim profile
--device``, and every model that is not a catalog name: ``hf:``,
``torchvision:``, a factory): the same chained steps, on the model's own
layers (no copies, for models of billions of parameters), in the run's
optimizer and dtype; it also measures each layer's optimizer state after
the updates. No links, no kernel bandwidths. A model that is not a catalog
model runs in :class:`~pipesim.validate.boundary.TupleStage` stages
(:func:`stage_class_for`), in every measurement here, so that a boundary
may carry several tensors.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipesim.sim.ir.core import UPDATE, Action, B, F, I
from pipesim.sim.workloads.profile import LayerCost, Profile
from pipesim.validate.allocator import keep_freed_memory
from pipesim.validate.boundary import stage_class_for
from pipesim.validate.models import LayerChain, RealModel, layer_stats, repeated_layers, to_device
from pipesim.validate.stage import HeldActivations, OptimizerConfig, PipelineStage


@dataclass(frozen=True)
class ProfileSettings:
    microbatch_size: int = 32
    warmup: int = 3
    repeats: int = 15


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def expected(samples) -> float:
    """The figure a cost is taken as from its timed samples: their mean.

    The simulator adds costs up, and a sum's expectation is the sum of the
    means; pass times are skewed to the right (interrupts, page faults, the
    other rank's traffic through the shared cache), so a median
    underestimates them. On the mlp the medians of its layers' backwards
    summed to 8% less than their means, and every strategy was predicted
    too fast."""
    return statistics.fmean(samples)


def _mean_time(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter_ns()
        fn()
        _sync(device)
        times.append(time.perf_counter_ns() - t0)
    return expected(times) / 1e9


def time_stage(
    module: nn.Module,
    x: torch.Tensor,
    *,
    first: bool,
    last: bool,
    loss_fn,
    target,
    device: torch.device,
    settings: ProfileSettings,
) -> tuple[float, float, float]:
    """Median (forward, backward, backward-input) seconds of ``module`` as a
    stage, in a tight loop (used for the empty stage that gives the overhead)."""
    stage = _stage(module, first, last, loss_fn, device)
    k = stage.stage_index
    x = x.to(device)
    target = target.to(device) if target is not None else None
    fa, ba, ia = Action(F, k, 0, 0), Action(B, k, 0, 0), Action(I, k, 0, 0)
    with torch.no_grad():
        out = module(x) if not last else None
    grad = torch.randn_like(out) if out is not None else None

    def fwd():
        stage.forward(fa, x, target)
        stage.inflight.pop(0)

    def fwd_bwd(op):
        def run():
            stage.forward(fa, x, target)
            stage.backward(op, grad)
            stage.inflight.pop(0, None)

        return run

    t_f = _mean_time(fwd, device, settings.warmup, settings.repeats)
    t_fb = _mean_time(fwd_bwd(ba), device, settings.warmup, settings.repeats)
    t_fi = _mean_time(fwd_bwd(ia), device, settings.warmup, settings.repeats)
    return t_f, max(t_fb - t_f, 0.0), max(t_fi - t_f, 0.0)


def _stage(module, first, last, loss_fn, device, optimizer=OptimizerConfig(), stage_class=PipelineStage, reads=10**9):
    k = 0 if first else 1
    n = k + 1 if last else k + 2
    stage = stage_class(module, k, n, device, loss_fn=loss_fn if last else None)
    stage.optim = optimizer
    if reads:
        stage.pool.expect(0, reads)  # a tight loop reads version 0 forever
    return stage


def _now(device: torch.device) -> int:
    _sync(device)
    return time.perf_counter_ns()


@dataclass(frozen=True)
class LayerTimes:
    """Per layer, mean seconds of each pass inside whole training steps
    (:func:`time_layers`), the optimizer state each stage held after
    its updates, and what its input-gradient pass left held for W beyond
    what its forward held (``w_held_bytes``), in bytes."""

    forward: list[float]
    backward: list[float]
    backward_input: list[float]
    update: list[float]
    optimizer_state_bytes: list[int]
    w_held_bytes: list[int]


def time_layers(
    model: RealModel,
    device: torch.device,
    settings: ProfileSettings,
    optimizer: OptimizerConfig = OptimizerConfig(),
    *,
    stage_class=PipelineStage,
    progress=None,
    in_place: bool | None = None,
    same_as: Sequence[int] | None = None,
) -> LayerTimes:
    """Per layer: mean forward, backward, backward-input and update seconds,
    each timed inside whole training steps of single-layer stages, with each
    stage's optimizer state and what its I leaves for W; ``stage_class`` :class:`~pipesim.validate.boundary.TupleStage` for
    boundaries of several tensors. ``progress(done, total)`` after each step.

    ``in_place`` (default: for every model but the catalog's): each step
    announces the reads it makes (a forward and a backward, or I), so an
    update finds no reader left and writes in place, as a flush schedule's
    does, and the next step reads the new weights: one buffer of weights per
    stage, however many steps. Without it (the catalog's models, whose
    validated accuracy was measured so), every pass reads version 0, held
    for good, and every update writes a fresh buffer that is never freed:
    a copy of the weights per step, which a model of billions of
    parameters cannot afford.

    ``same_as`` (:func:`~pipesim.validate.models.repeated_layers`) names,
    per layer, the layer whose times it takes: only the layers that stand
    for themselves are built into the steps, chained in model order, and
    each repeat gets its first's times, optimizer state and held bytes."""
    n = model.num_layers
    same_as = list(range(n)) if same_as is None else list(same_as)
    if in_place is None:
        in_place = model.origin != "catalog"
    chain = sorted(set(same_as))  # the layers timed, in model order
    stages = [
        _stage(
            model.layers[i],
            i == 0,
            i == n - 1,
            model.loss_fn,
            device,
            optimizer,
            stage_class,
            reads=0 if in_place else 10**9,
        )
        for i in chain
    ]
    data = model.data(settings.microbatch_size)
    fwd, bwd, inp, upd = ([[] for _ in stages] for _ in range(4))
    after_forward, w_held = [0] * len(stages), [0] * len(stages)
    steps = settings.warmup + settings.repeats
    for step in range(2 * steps):
        if progress is not None and step:
            progress(step, 2 * steps)
        split = step % 2 == 1  # odd steps time the input-gradient half (zero-bubble's I)
        x, y = data.batch(step)
        h, target = to_device(x, device), y.to(device)
        timed = step // 2 >= settings.warmup
        # the bytes I leaves for W, counted in the first split step (untimed unless there is no warm-up)
        counting = step == 1
        # read by F, then by B (or I); else version 0, held for good
        version = [st.pool.expect(st.pool.version, 2) if in_place else 0 for st in stages]
        for i, st in enumerate(stages):
            st.split_backward = split  # I as the runtime splits it (its forward keeps what W needs)
            st.held = HeldActivations() if counting else None
            t0 = _now(device)
            h = st.forward(Action(F, st.stage_index, 0, version[i]), h, target if st.is_last else None)
            if timed and not split:
                fwd[i].append(_now(device) - t0)
            if counting:
                after_forward[i] = st.held.level([st])
        g = None
        for i in reversed(range(len(stages))):
            st = stages[i]
            op = I if split else B
            t0 = _now(device)
            g = st.backward(Action(op, st.stage_index, 0, version[i]), g)
            if timed:
                (inp if split else bwd)[i].append(_now(device) - t0)
            if counting:
                w_held[i] = max(st.held.level([st]) - after_forward[i], 0)
        if split:
            for st in stages:
                st.inflight.clear()
                st.held = None
            continue
        for i, st in enumerate(stages):
            st.accumulated = 1
            t0 = _now(device)
            st.update(Action(UPDATE, st.stage_index, None, st.pool.version + 1))
            if timed:
                upd[i].append(_now(device) - t0)
            if not in_place:
                st.pool.expect(st.pool.version, 10**9)
    if progress is not None:
        progress(2 * steps, 2 * steps)
    at = {layer: j for j, layer in enumerate(chain)}
    per_layer = [at[first] for first in same_as]  # each layer's place in the chain

    def spread(values: list) -> list:
        return [values[j] for j in per_layer]

    means = [spread([expected(v) / 1e9 for v in lst]) for lst in (fwd, bwd, inp, upd)]
    state = spread([sum(t.nbytes for ts in st.state.values() for t in ts) for st in stages])
    return LayerTimes(*means, optimizer_state_bytes=state, w_held_bytes=spread(w_held))


def _layer_costs(stats, t: LayerTimes, o_f: float, o_b: float, o_i: float) -> list[LayerCost]:
    """Each layer's LayerCost: its times from :func:`time_layers` less the
    empty stage's pass overheads (charged once per stage instead), its
    bytes from :func:`~pipesim.validate.models.layer_stats`."""
    layers = []
    for i, s in enumerate(stats):
        t_b = max(t.backward[i] - o_b, 1e-7)
        layers.append(
            LayerCost(
                name=s.name,
                forward_s=max(t.forward[i] - o_f, 1e-7),
                backward_s=t_b,
                backward_input_s=min(max(t.backward_input[i] - o_i, 0.0), t_b),
                param_bytes=s.param_bytes,
                activation_bytes=s.activation_bytes,
                stash_bytes=s.stash_bytes,
                w_held_bytes=t.w_held_bytes[i],
            )
        )
    return layers


#: Timed passes of the empty stage whose cost is the per-pass overhead, at least.
OVERHEAD_REPEATS = 50


@dataclass(frozen=True)
class _Measured:
    """What both profilers measure of a model's layers."""

    stats: list  # LayerStats per layer (bytes)
    times: LayerTimes
    costs: list[LayerCost]
    overhead_forward_s: float
    overhead_backward_s: float
    same_as: list[int]  # per layer, the layer whose times it takes
    allocator: str  # how freed memory is kept (allocator.py)


def _pass_overheads(microbatch_size: int, device: torch.device, settings: ProfileSettings):
    """The runtime's fixed cost per pass: an empty stage in the middle of a
    pipeline, timed (forward, backward, input-gradient). Tens of
    microseconds a pass, so cheap to time well whatever the layers' repeats."""
    empty = ProfileSettings(
        microbatch_size, warmup=max(settings.warmup, 3), repeats=max(settings.repeats, OVERHEAD_REPEATS)
    )
    probe = torch.randn(microbatch_size, 8)
    return time_stage(
        nn.Sequential(), probe, first=False, last=False, loss_fn=None, target=None, device=device, settings=empty
    )


def _measure(
    model: RealModel,
    device: torch.device,
    settings: ProfileSettings,
    optimizer: OptimizerConfig,
    *,
    in_place: bool,
    every_layer: bool | None,
    progress=None,
) -> _Measured:
    """Each layer's bytes (one forward, :func:`layer_stats`), the pass
    overheads (:func:`_pass_overheads`) and its times (:func:`time_layers`,
    repeated layers timed once), as LayerCosts. ``in_place`` trains the
    model's own layers, moved to ``device``; otherwise copies, leaving the
    model as it was."""
    allocator = keep_freed_memory()  # as the runtime's workers run (see allocator.py)
    b = settings.microbatch_size
    if in_place:
        for layer in model.layers:
            layer.to(device)
    # in place, the timed steps run the backward that proves the graph
    stats = layer_stats(model, b, device=device, copy_layers=not in_place, backward=not in_place)
    o_f, o_b, o_i = _pass_overheads(b, device, settings)
    same_as = _timed_as(model, stats, every_layer)
    t = time_layers(
        model if in_place else _fresh(model),
        device,
        settings,
        optimizer,
        stage_class=stage_class_for(model),
        progress=progress,
        same_as=same_as,
    )
    return _Measured(stats, t, _layer_costs(stats, t, o_f, o_b, o_i), o_f, o_b, same_as, str(allocator))


def profile_model(
    model: RealModel,
    *,
    device: torch.device | str = "cpu",
    settings: ProfileSettings = ProfileSettings(),
    progress=None,
    every_layer: bool | None = None,
) -> Profile:
    """Per-layer costs of ``model`` for one micro-batch on ``device``, as a simulator Profile.

    Times copies of the layers, so the model is left as it was (``pipesim
    validate`` runs it next). A layer that repeats the one before it takes
    that one's times (:func:`~pipesim.validate.models.repeated_layers`)
    unless ``every_layer`` (default: for the catalog's models only)."""
    device = torch.device(device)
    got = _measure(model, device, settings, OptimizerConfig(), in_place=False, every_layer=every_layer)
    if progress is not None:
        progress(len(got.costs), len(got.costs))
    return Profile(
        name=f"{model.name}-measured",
        layers=tuple(got.costs),
        microbatch_size=settings.microbatch_size,
        optimizer="sgd",
        overhead_forward_s=got.overhead_forward_s,
        overhead_backward_s=got.overhead_backward_s,
        notes=(
            f"measured by pipesim profile on {device} ({torch.get_num_threads()} thread(s)), "
            f"{model.description}; per layer, means of {settings.repeats} training steps with every "
            "layer in turn; pass overheads measured on an empty stage and charged once per stage; "
            "w_held_bytes what a split backward's I leaves held for W beyond what the forward held, counted "
            f"once; {_repeats_note(model, got.same_as)}; freed memory {got.allocator}"
        ),
    )


@dataclass(frozen=True)
class LayerMeasure:
    """What :func:`profile_layers` measured of one layer beyond its
    :class:`~pipesim.sim.workloads.profile.LayerCost`."""

    name: str
    weight_s: float  # backward less its input-gradient part: zero-bubble's W
    optimizer_state_bytes: int
    outputs: tuple  # (shape, dtype, carries a gradient) of each tensor a cut after it carries


def device_name(device: torch.device) -> str:
    """The device in words: the GPU's name, or the CPU's."""
    import platform

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def profile_layers(
    model: RealModel,
    *,
    device: torch.device | str = "cpu",
    settings: ProfileSettings = ProfileSettings(warmup=1, repeats=3),
    optimizer: OptimizerConfig = OptimizerConfig(),
    dtype: str = "fp32",
    progress=None,
    every_layer: bool | None = None,
) -> tuple[Profile, list[LayerMeasure]]:
    """The layers of ``model`` on ``device`` as a simulator Profile, and
    what else was measured of each (module doc).

    Trains the model's own layers (moved to ``device``; nothing is
    copied): build it for this. The profile's ``optimizer`` is
    ``optimizer.kind``; its notes say what was measured, on what and how,
    and are the same for the same model, settings and machine (only the
    times vary from run to run). A layer that repeats the one before it
    takes that one's times (:func:`~pipesim.validate.models.repeated_layers`:
    a transformer's blocks are timed once) unless ``every_layer`` (default:
    for the catalog's models only)."""
    device = torch.device(device)
    b = settings.microbatch_size
    got = _measure(model, device, settings, optimizer, in_place=True, every_layer=every_layer, progress=progress)
    stats, t, layers, same_as = got.stats, got.times, got.costs, got.same_as
    extra = [
        LayerMeasure(s.name, c.backward_s - c.backward_input_s, t.optimizer_state_bytes[i], s.outputs)
        for i, (s, c) in enumerate(zip(stats, layers, strict=True))
    ]
    params = sum(s.param_bytes for s in stats)
    state = sum(t.optimizer_state_bytes)
    several = [s.name for s in stats if len(s.outputs) > 1]
    threads = f", {torch.get_num_threads()} intra-op thread(s)" if device.type == "cpu" else ""
    notes = (
        f"measured by pipesim profile, layers only, on {device} ({device_name(device)}{threads}), {dtype}, "
        f"torch {torch.__version__}; {model.description}; micro-batch {b}. Per layer, the mean of "
        f"{settings.repeats} training steps after {settings.warmup} warm-up, every layer its own stage, chained "
        "in model order (forwards, backwards, updates); backward_input_s (zero-bubble's I) timed in steps of "
        "its own, W = backward_s - backward_input_s; pass overheads measured on an empty stage and charged "
        "once per stage. Bytes from one forward and backward: param_bytes the weights, activation_bytes every "
        "tensor a cut after the layer carries, stash_bytes what autograd saves (a tensor the next layer "
        "saves too counted there), w_held_bytes what a split backward's I leaves held for W beyond what the "
        f"forward held (counted in a warm-up step); {_repeats_note(model, same_as)}. "
        f"Optimizer {optimizer.kind}: {state:,} bytes of state measured after the "
        f"updates, {state / params if params else 0:.2f}x the {params:,} bytes of weights"
        + (f"; cuts after {', '.join(several)} carry several tensors (counted in activation_bytes)" if several else "")
        + f"; freed memory {got.allocator}"
    )
    prof = Profile(
        name=f"{model.name}-measured",
        layers=tuple(layers),
        microbatch_size=b,
        optimizer=optimizer.kind,
        overhead_forward_s=got.overhead_forward_s,
        overhead_backward_s=got.overhead_backward_s,
        notes=notes,
    )
    return prof, extra


def _timed_as(model: RealModel, stats, every_layer: bool | None) -> list[int]:
    """Per layer, the layer whose times it takes: itself with ``every_layer``,
    which defaults to true for the catalog's models (small, quick to time
    whole, and validated so) and false for every other."""
    if every_layer is None:
        every_layer = model.origin == "catalog"
    return list(range(model.num_layers)) if every_layer else repeated_layers(model, stats)


def _repeats_note(model: RealModel, same_as: Sequence[int]) -> str:
    """What the profile's notes say of the layers timed."""
    names = model.layer_names
    runs: dict[int, list[int]] = {}
    for i, first in enumerate(same_as):
        if first != i:
            runs.setdefault(first, []).append(i)
    if not runs:
        return "every layer timed"
    said = [
        f"{names[r[0]]}{'-' + names[r[-1]] if len(r) > 1 else ''} take {names[first]}'s times"
        for first, r in sorted(runs.items())
    ]
    return (
        f"{len(set(same_as))} of {len(same_as)} layers timed, each repeat of the layer before it (same modules, "
        f"configuration and shapes) given its run's first's times: {'; '.join(said)}"
    )


def _fresh(model: RealModel) -> RealModel:
    """A copy whose layers profiling may train without touching the caller's."""
    import copy
    import dataclasses

    return dataclasses.replace(model, layers=copy.deepcopy(model.layers))


#: Local replicas in the averaging measurement (AvgPipe's pipelines on one device).
AVERAGE_REPLICAS = 2


def kernel_bandwidths(
    model: RealModel,
    *,
    device: torch.device | str = "cpu",
    settings: ProfileSettings = ProfileSettings(),
    optimizer: OptimizerConfig = OptimizerConfig(),
) -> dict[str, float]:
    """Bytes/s at which the simulator's byte count for each memory-bound
    kernel (:class:`pipesim.sim.engine.core.CostModel`) matches the time the
    runtime's own code takes for it, the whole model as one stage, each
    right after a forward and backward (the gradients warm, the rest not):

    * ``update``: the optimizer step in place (flush schedules; stashing
      writes the next version into a recycled buffer of the same size),
      5 |W| for SGD with momentum, 7 |W| for Adam;
    * ``predict``: SpecTrain's PREDICT into its scratch buffer, 3 |W| (4 |W|);
    * ``average``: AvgPipe's AVERAGE of :data:`AVERAGE_REPLICAS` replicas
      held on one device (flatten, elastic averaging, copy back),
      (2n + 2) |W|.

    One figure per kernel, not one for all: on a CPU they reach very
    different fractions of the memory system (SpecTrain's update ran three
    times as long as one bandwidth for all predicted).

    Weights far larger than the last-level cache (:data:`CACHE_MULTIPLE`
    times :func:`last_level_cache_bytes`) leave nothing of themselves in it
    after a forward and backward, so passes between the kernels would change
    nothing they read: the replicas then run one forward and backward (for
    their gradients) and the kernels are timed back to back. A 4-block GPT-2
    (425 MB of weights) needed 62 forwards and backwards, minutes on a CPU.
    """
    from pipesim.sim.engine.core import CostModel
    from pipesim.sim.ir.core import AVERAGE, PREDICT
    from pipesim.validate.executor import run_collective

    device = torch.device(device)
    keep_freed_memory()
    fresh = _fresh(model)
    replicas = [_whole(fresh, device, optimizer) for _ in range(AVERAGE_REPLICAS)]
    stage = replicas[0]
    data = fresh.data(settings.microbatch_size)
    centre = torch.cat([w.detach().reshape(-1) for w in stage.weights()]).clone()
    times: dict[str, list[int]] = {"update": [], "predict": [], "average": []}
    repeats = max(3 * settings.repeats, 30)  # each kernel is short, and noisy
    weight_bytes = sum(w.numel() * w.element_size() for w in stage.weights())
    passes_between = weight_bytes <= CACHE_MULTIPLE * last_level_cache_bytes(device)
    for step in range(settings.warmup + repeats):
        timed = step >= settings.warmup
        for st in replicas:
            if passes_between or step == 0:
                x, y = data.batch(step)
                v = st.pool.expect(st.pool.version, 2)  # the forward and backward read it, then let it go
                st.forward(Action(F, 0, 0, v), to_device(x, device), y.to(device))
                st.backward(Action(B, 0, 0, v), None)
            st.accumulated = 4  # as after a mini-batch of micro-batches: scaled once
        t0 = _now(device)
        stage.update(Action(UPDATE, 0, None, stage.pool.version + 1))
        t1 = _now(device)
        stage.scratch_key = None  # predict afresh, as after each update
        stage.pool.expect(stage.pool.version, 1)
        stage.predict(Action(PREDICT, 0, None, stage.pool.version, 1))
        t2 = _now(device)
        run_collective(Action(AVERAGE, 0), replicas, {0: centre}, 0.5)
        t3 = _now(device)
        for other in replicas[1:]:
            other.update(Action(UPDATE, 0, None, other.pool.version + 1))
        if timed:
            times["update"].append(t1 - t0)
            times["predict"].append(t2 - t1)
            times["average"].append(t3 - t2)
    params = sum(t.numel() * t.element_size() for t in stage.weights())
    costs = CostModel((), 1.0, optimizer.kind)
    moved = {
        "update": costs.traffic(UPDATE) * params,
        "predict": costs.traffic(PREDICT) * params,
        "average": (2 * AVERAGE_REPLICAS + 2) * params,
    }
    return {k: moved[k] / (expected(v) / 1e9) for k, v in times.items()}


#: Weights this many times the last-level cache keep no passes between the kernels timed on them.
CACHE_MULTIPLE = 8
#: The last-level cache assumed where the system does not say (a server CPU's L3).
DEFAULT_LAST_LEVEL_CACHE_BYTES = 32 << 20


def last_level_cache_bytes(device: torch.device) -> int:
    """The size of ``device``'s last-level cache: a GPU's L2, a CPU's largest
    cache as Linux lists it (``/sys/devices/system/cpu/cpu0/cache``), else
    :data:`DEFAULT_LAST_LEVEL_CACHE_BYTES`."""
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(size) or DEFAULT_LAST_LEVEL_CACHE_BYTES
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=DEFAULT_LAST_LEVEL_CACHE_BYTES)


def _whole(model: RealModel, device: torch.device, optimizer: OptimizerConfig) -> PipelineStage:
    """The whole model as one stage whose updates are in place (no reader
    holds an old version)."""
    stage = stage_class_for(model)(LayerChain(*copy.deepcopy(model.layers)), 0, 1, device, loss_fn=model.loss_fn)
    stage.optim = optimizer
    return stage


# ---------------------------------------------------------------- runtime dispatch


class _Relay(nn.Module):
    """A stage that does (almost) nothing: x * w with one scalar weight, so the
    runtime's whole path (binding, autograd, sends, receives) runs around it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.w


class _RelayData:
    def __init__(self, numel: int):
        self.x = torch.ones(numel)
        self.y = torch.zeros(numel)

    def batch(self, index):
        return self.x, self.y


def _relay_loss(out, target):
    return (out - target).square().mean()


def _dispatch_worker(ctx, numel: int, microbatches: int, iterations: int):
    from pipesim.sim.strategies import ScheduleSpec, build_schedule
    from pipesim.validate.runtime import execute

    sched = build_schedule(ScheduleSpec(strategy="gpipe", stages=2, microbatches=microbatches, iterations=iterations))
    k = ctx.rank
    stages = {(0, k): PipelineStage(_Relay(), k, 2, ctx.device, loss_fn=_relay_loss if k == 1 else None)}
    specs = [(((numel,), torch.float32, True),)] * 2  # runtime.boundary_specs: one tensor a cut
    return execute(ctx, sched, stages, _RelayData(numel), specs, OptimizerConfig())


def measure_dispatch(
    backend: str = "gloo",
    nbytes: int = 1 << 17,
    *,
    microbatches: int = 16,
    iterations: int = 3,
    timeout_s: float = 120.0,
) -> tuple[float, float]:
    """Seconds per pass the distributed runtime costs around a stage that does nothing.

    Two ranks run GPipe on stages that only scale their input, sending
    ``nbytes`` per micro-batch. Stage 0's forwards and the last stage's
    backwards each run back to back, so their period (start to start) is the
    runtime's own cost per pass: the walker's bookkeeping, binding weights,
    autograd, posting the pass's send and the CPU the
    backend spends pushing it out. On GPUs most of that overlaps the device;
    on CPUs it is taken from the core the passes run on. Returns the mean
    period of a forward and of a backward;
    :func:`pipesim.validate.harness.profile` uses them as the profile's
    per-pass overhead when they exceed the in-process figure.
    """
    from pipesim.validate.launch import launch
    from pipesim.validate.runtime import launch_settings

    numel = max(1, nbytes // 4)
    out = launch(
        _dispatch_worker,
        2,
        args=(numel, microbatches, iterations),
        backend=backend,
        timeout_s=timeout_s,
        **launch_settings(backend),
    )[0]
    gaps = {"F": [], "B": []}
    for dev, op, stage in ((0, F, 0), (1, B, 1)):
        comp = sorted((r for r in out.records if r.stream == "compute" and r.device == dev), key=lambda r: r.start)
        for prev, cur in zip(comp, comp[1:]):
            if cur.action.op is op and prev.action.op is op and cur.action.stage == stage:
                gaps[op.value].append((cur.start - prev.start) / 1e9)
    return expected(gaps["F"]), expected(gaps["B"])

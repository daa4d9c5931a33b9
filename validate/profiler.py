"""Measure a real model on the target device: the profile ``pipesim simulate`` takes.

Per layer, the forward, backward and input-gradient time of one
micro-batch, its parameter bytes, output bytes and stashed bytes; plus what
the runtime costs around the layers, so the simulator predicts the runtime
and not an idealised kernel timeline:

* **pass overhead**: a pass through :class:`~pipesim.validate.stage.PipelineStage`
  (binding weights, autograd bookkeeping) costs a fixed amount on top of its
  layers. Timing each layer alone would charge that once per *layer*; it is
  measured once on an empty stage, subtracted from every layer and written to
  the profile as ``overhead`` (forward and backward), which the simulator
  charges once per *stage* pass.
* **update bandwidth**: the optimizer step is timed on the whole model and
  expressed as the memory bandwidth at which the simulator's byte count for
  an update (5 |W| for SGD with momentum) takes that long; it goes into the
  hardware JSON as the device's ``mem_bandwidth``.

Every time is the median of repeated runs after a warm-up, measured with the
same code path the runtime executes (so Python overheads are included), on
one thread when the device is a CPU.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from pipesim.sim.ir import Action, B, F, I, UPDATE
from pipesim.sim.workload import LayerCost, Profile
from pipesim.validate.models import RealModel, layer_stats
from pipesim.validate.stage import OptimizerConfig, PipelineStage
from torch import nn


@dataclass(frozen=True)
class ProfileSettings:
    microbatch_size: int = 32
    warmup: int = 3
    repeats: int = 15


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter_ns()
        fn()
        _sync(device)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e9


def time_stage(module: nn.Module, x: torch.Tensor, *, first: bool, last: bool, loss_fn, target,
               device: torch.device, settings: ProfileSettings) -> tuple[float, float, float]:
    """Median (forward, backward, backward-input) seconds of ``module`` as a runtime stage."""
    k = 0 if first else 1
    n = k + 1 if last else k + 2
    stage = PipelineStage(module, k, n, device, loss_fn=loss_fn if last else None)
    stage.optim = OptimizerConfig()
    # every pass reads version 0 forever: announce plenty of reads
    stage.pool.expect(0, 10 ** 9)
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

    t_f = _median_time(fwd, device, settings.warmup, settings.repeats)
    t_fb = _median_time(fwd_bwd(ba), device, settings.warmup, settings.repeats)
    t_fi = _median_time(fwd_bwd(ia), device, settings.warmup, settings.repeats)
    return t_f, max(t_fb - t_f, 0.0), max(t_fi - t_f, 0.0)


def profile_model(model: RealModel, *, device: torch.device | str = "cpu",
                  settings: ProfileSettings = ProfileSettings(), progress=None) -> Profile:
    """Per-layer costs of ``model`` for one micro-batch on ``device``, as a simulator Profile."""
    device = torch.device(device)
    b = settings.microbatch_size
    stats = layer_stats(model, b, device=device)
    data = model.data(b)
    x, target = data.batch(0)
    n = model.num_layers
    # the runtime's fixed cost per pass: an empty stage in the middle of a pipeline
    probe = torch.randn(b, 8)
    o_f, o_b, o_i = time_stage(nn.Sequential(), probe, first=False, last=False, loss_fn=None, target=None,
                               device=device, settings=settings)
    layers = []
    h = x
    for i, layer in enumerate(model.layers):
        last = i == n - 1
        t_f, t_b, t_i = time_stage(layer, h, first=i == 0, last=last, loss_fn=model.loss_fn, target=target,
                                   device=device, settings=settings)
        with torch.no_grad():
            h = layer.to(device)(h.to(device)).cpu()
        s = stats[i]
        t_b_net = max(t_b - o_b, 1e-7)
        layers.append(LayerCost(
            name=s.name,
            forward_s=max(t_f - o_f, 1e-7),
            backward_s=t_b_net,
            backward_input_s=min(max(t_i - o_i, 0.0), t_b_net),
            param_bytes=s.param_bytes,
            activation_bytes=s.activation_bytes,
            stash_bytes=s.stash_bytes,
        ))
        if progress is not None:
            progress(i + 1, n)
    return Profile(
        name=f"{model.name}-measured",
        layers=tuple(layers),
        microbatch_size=b,
        optimizer="sgd",
        overhead_forward_s=o_f,
        overhead_backward_s=o_b,
        notes=(f"measured by pipesim profile on {device} ({torch.get_num_threads()} thread(s)), "
               f"{model.description}; medians of {settings.repeats} runs; pass overheads measured on "
               "an empty stage and charged once per stage"),
    )


def update_bandwidth(model: RealModel, *, device: torch.device | str = "cpu",
                     settings: ProfileSettings = ProfileSettings(), optimizer: OptimizerConfig = OptimizerConfig()
                     ) -> float:
    """Bytes/s at which the simulator's update traffic (5 |W|, SGD) matches the measured step."""
    device = torch.device(device)
    stage = PipelineStage(model.sequential(), 0, 2, device)
    stage.prepare([], optimizer)
    params = sum(t.numel() * t.element_size() for t in stage.weights())
    for g in stage.grads:
        g.normal_()
    v = [0]

    def step():
        v[0] += 1
        stage.accumulated = 4  # as after a mini-batch of micro-batches (scaled once)
        stage.update(Action(UPDATE, 0, None, v[0]))
    t = _median_time(step, device, settings.warmup, settings.repeats)
    return 5 * params / t

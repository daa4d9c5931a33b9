"""Held activations: what a stage keeps for its pending backwards, measured
from the tensors (pipesim.validate.stage.HeldActivations), against hand
counts, against the schedule (GPipe holds m micro-batches, 1F1B p - k) and
against the simulator's prediction."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipesim.sim.engine.core import simulate
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.ir.core import Action, F, I
from pipesim.sim.ir.core import B as BACKWARD
from pipesim.sim.partition.split import partition, stage_costs_uniform
from pipesim.sim.strategies import ScheduleSpec, build_schedule
from pipesim.sim.workloads.profile import LayerCost, Profile
from pipesim.validate.executor import emulate
from pipesim.validate.harness import ValidateConfig, build, model_of
from pipesim.validate.models import layer_stats
from pipesim.validate.reconcile import activation_peaks, compare_held_activations
from pipesim.validate.runtime import Job, build_stages
from pipesim.validate.stage import HeldActivations, OptimizerConfig, PipelineStage

B, D_IN, D_OUT = 8, 16, 24
F32 = 4


def test_linear_saves_its_input_not_its_weight():
    lin = nn.Linear(D_IN, D_OUT)
    x = torch.randn(B, D_IN, requires_grad=True)
    held = HeldActivations()
    with held.hooks(list(lin.parameters())):
        y = lin(x)
    assert held.live == B * D_IN * F32  # the input; the weight is the weights' memory
    torch.autograd.grad(y.sum(), [x])
    assert held.live == 0  # the backward freed what it saved
    with held.hooks([]):  # told no weights: the weight's storage counts too
        y = lin(x)
    assert held.live == B * D_IN * F32 + D_OUT * D_IN * F32


def test_relu_saves_its_output_and_views_share_a_storage():
    x = torch.randn(B, D_IN, requires_grad=True)
    held = HeldActivations()
    with held.hooks([]):
        y = torch.relu(x * 2)  # mul by a number saves nothing; relu saves its result
    assert held.live == B * D_IN * F32
    with held.hooks([]):
        a, b = torch.randn(B, 2 * D_IN, requires_grad=True).split(D_IN, dim=1)
        z = (a * b).sum()  # saves a and b: two views of one storage
    assert held.live == B * D_IN * F32 + B * 2 * D_IN * F32
    del y, z
    assert held.live == 0  # graphs dropped without a backward release their tensors too


def test_a_retained_graph_is_freed_once_dropped():
    """A node that saves its own output (ReLU) under the counter's hooks must
    not keep itself alive: zero bubble's I and W retain the graph."""
    x = torch.randn(B, D_IN, requires_grad=True)
    held = HeldActivations()
    with held.hooks([]):
        y = torch.relu(x @ torch.randn(D_IN, D_OUT))
    torch.autograd.grad(y.sum(), [x], retain_graph=True)
    assert held.live > 0
    del y
    assert held.live == 0


def _stage_module(k: int) -> nn.Module:
    torch.manual_seed(k)
    if k == 0:
        return nn.Sequential(nn.Linear(D_IN, D_IN), nn.Tanh())
    return nn.Sequential(nn.Linear(D_IN, 3))


class _Data:
    def batch(self, mb):
        g = torch.Generator().manual_seed(mb)
        return torch.randn(B, D_IN, generator=g), torch.randint(0, 3, (B,), generator=g)


def _held_peaks(strategy: str, m: int) -> dict[int, int]:
    sched = build_schedule(ScheduleSpec(strategy=strategy, stages=2, microbatches=m, iterations=2))
    timeline = simulate(sched, stage_costs_uniform(2), load_hardware("ideal"))
    stages = {
        (rep, k): PipelineStage(copy.deepcopy(_stage_module(k)), k, 2, loss_fn=nn.CrossEntropyLoss(), replica=rep)
        for rep, k in sched.placement()
    }
    return emulate(sched, stages, _Data(), OptimizerConfig(), timeline, held=True).held_activations


def test_gpipe_holds_every_microbatch_1f1b_holds_p_minus_k():
    m = 4
    # stage 0 keeps, per micro-batch, the data batch its Linear saves and the
    # Tanh's output (saved by Tanh, and the output the stage sends)
    per_mb = 2 * B * D_IN * F32
    gpipe, one_f_one_b = _held_peaks("gpipe", m), _held_peaks("1f1b", m)
    assert gpipe[0] == m * per_mb
    assert one_f_one_b[0] == 2 * per_mb  # p - k = 2 micro-batches in flight
    assert gpipe[1] == m * one_f_one_b[1]  # the last stage: m against 1
    assert one_f_one_b[1] > B * D_IN * F32  # its received input, at least


@pytest.mark.parametrize("strategy", ["gpipe", "1f1b"])
def test_prediction_within_ten_percent_on_gpt_small(strategy):
    """The simulator's activation peak (the profile's stash_bytes, measured by
    layer_stats) against what the single-process run holds."""
    b = 4
    cfg = ValidateConfig(
        strategy=strategy,
        stages=2,
        microbatches=4,
        model="gpt-small",
        backend="single",
        iterations=2,
        microbatch_size=b,
        model_width=32,
        model_depth=2,
    )
    schedule = build(cfg)
    model = model_of(cfg)
    layers = tuple(
        LayerCost(
            name=s.name,
            forward_s=1e-3,
            backward_s=2e-3,
            backward_input_s=1e-3,
            param_bytes=s.param_bytes,
            activation_bytes=s.activation_bytes,
            stash_bytes=s.stash_bytes,
        )
        for s in layer_stats(model, b)
    )
    costs = partition(Profile(name="t", layers=layers, microbatch_size=b, optimizer="sgd"), 2)
    predicted = simulate(schedule, costs, load_hardware("pcie-4gpu"), microbatch_size=b)
    job = Job(
        schedule=schedule,
        model="gpt-small",
        starts=tuple(c.first_layer for c in costs),
        microbatch_size=b,
        width=32,
        depth=2,
    )
    _, _, stages, data = build_stages(job, schedule.placement(), torch.device("cpu"))
    out = emulate(schedule, stages, data, OptimizerConfig(), predicted, held=True)
    rows = compare_held_activations(predicted, out.held_activations)
    assert [r["device"] for r in rows] == [0, 1]
    for r in rows:
        assert r["measured_bytes"] > 0
        assert abs(r["error"]) <= 0.10, rows
    # the last stage holds the loss's log-softmax (the logits' size), which the profile counts
    assert rows[1]["predicted_bytes"] == activation_peaks(predicted)[1]
    per_mb = costs[1].stash_bytes
    held_mbs = 4 if strategy == "gpipe" else 1
    assert rows[1]["predicted_bytes"] == held_mbs * per_mb


def test_a_split_forward_keeps_what_an_unsplit_one_keeps():
    """Zero bubble's W needs each module's output for its place in the graph,
    not for its values: the logits before the loss, which autograd does not
    save (cross-entropy keeps its log-softmax), are freed after the forward
    in a split stage too, instead of held until W."""
    x, y = _Data().batch(0)
    levels = []
    for split in (False, True):
        st = PipelineStage(copy.deepcopy(_stage_module(1)), 1, 2, loss_fn=nn.CrossEntropyLoss())
        st.pool.expect(0, 10)
        st.split_backward = split
        st.held = HeldActivations()
        st.forward(Action(F, 1, 0, 0), x, y)
        levels.append(st.held.level([st]))
        st.backward(Action(I if split else BACKWARD, 1, 0, 0), None)
    unsplit, split = levels
    assert split == unsplit  # held until W, the logits (B x 3) would be counted on top
    assert unsplit >= B * D_IN * F32 + B * 3 * F32  # the input Linear saves, and the log-softmax

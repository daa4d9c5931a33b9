"""The single-process emulator executes every strategy's IR with real tensors.

Flush schedules and data parallelism must train exactly like plain
mini-batch SGD (up to float summation order); 2BW must follow its update
rule W(t+1) = W(t) − lr·mom(∇f(W(t−1))); asynchronous schedules must read
the versions the simulator says they read.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from toy import SeededData, tanh_layers

from pipesim.sim.engine.core import simulate
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.ir.core import Action, Op
from pipesim.sim.partition.split import stage_costs_uniform
from pipesim.sim.strategies import ScheduleSpec, build_schedule
from pipesim.validate.executor import emulate, iteration_losses
from pipesim.validate.stage import OptimizerConfig, PipelineStage, RuntimeSemanticsError

#: numerics tests: CI runs them again with lesser ATen and MKL kernels (.ci/run)
pytestmark = pytest.mark.numerics

D, CLASSES, BATCH = 12, 3, 4
LR, MOM = 0.1, 0.9
loss_fn = nn.CrossEntropyLoss()


def make_layers(n=4):
    return tanh_layers(n, D, CLASSES, seed=1, weight_scale=0.4)


def Data():  # noqa: N802 (a data source, as the tests construct it)
    return SeededData(BATCH, D, CLASSES, first_seed=100)


def run(strategy, *, stages=2, m=4, iters=3, optim=None, **kw):
    sched = build_schedule(ScheduleSpec(strategy=strategy, stages=stages, microbatches=m, iterations=iters, **kw))
    timeline = simulate(sched, stage_costs_uniform(sched.num_stages), load_hardware("ideal"))
    layers = make_layers()
    per = len(layers) // sched.num_stages
    mods = {}
    for rep, k in sched.placement():
        mod = nn.Sequential(*copy.deepcopy(layers[k * per : (k + 1) * per]))
        mods[(rep, k)] = PipelineStage(mod, k, sched.num_stages, loss_fn=loss_fn, replica=rep)
    out = emulate(sched, mods, Data(), optim or OptimizerConfig(lr=LR, momentum=MOM), timeline)
    return sched, timeline, out


def summation_tolerance(terms: int, rounds: int = 3, dtype=torch.float32) -> float:
    """Relative tolerance for comparing against plain mini-batch SGD.

    The emulator accumulates a gradient micro-batch by micro-batch while the
    reference backpropagates one loss summed over the whole mini-batch, so
    the same ``terms`` products are added in another order. Recursive
    summation of n terms is off by at most about n·eps relative to the sum of
    their magnitudes (Higham, Accuracy and Stability of Numerical
    Algorithms, §4.2); each side may be off by that much, and an error made
    in one iteration's gradient carries into the next ``rounds`` updates.
    Bit-exact comparison is not possible here and would be wrong to ask for;
    a tolerance far above this bound would hide real bugs (a gradient counted
    twice is off by 100%, a version off by one by the whole update).
    """
    return 2 * terms * rounds * torch.finfo(dtype).eps


def flat_weights(out, replica=0):
    return torch.cat([t.flatten() for (r, _), w in out.weights.items() if r == replica for t in w.values()])


def reference_sgd(m, iters, replicas=1, version_lag=0):
    """Plain mini-batch SGD with momentum; ``version_lag=1`` evaluates each
    iteration's gradient on the previous weights (2BW's rule)."""
    model = nn.Sequential(*make_layers())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOM)
    prev = copy.deepcopy(model)
    d = Data()
    losses = []
    for t in range(iters):
        at = prev if version_lag and t > 0 else model
        at.zero_grad()
        total = 0
        for i in range(t * m, (t + 1) * m):
            for r in range(replicas):
                x, y = d.batch(i * replicas + r)
                total = total + loss_fn(at(x), y)
        total = total / (m * replicas)
        total.backward()
        losses.append(total.item())
        snapshot = copy.deepcopy(model)
        for p, q in zip(model.parameters(), at.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        prev = snapshot
    return torch.cat([p.detach().flatten() for p in model.parameters()]), losses


@pytest.mark.parametrize(
    "strategy,kw",
    [("gpipe", {}), ("gpipe", {"flushes": 2}), ("1f1b", {}), ("zb-h1", {}), ("interleaved-1f1b", {"chunks": 2})],
)
def test_flush_schedules_train_like_minibatch_sgd(strategy, kw):
    sched, _, out = run(strategy, **kw)
    ref, ref_losses = reference_sgd(4, 3)
    tol = summation_tolerance(4 * BATCH)
    torch.testing.assert_close(flat_weights(out), ref, rtol=tol, atol=tol)
    assert iteration_losses(out.losses, 4) == pytest.approx(ref_losses, rel=tol)


def test_data_parallel_averages_replica_gradients():
    _, _, out = run("data-parallel", stages=2, m=2)
    ref, _ = reference_sgd(1, 3, replicas=2)  # m=2 split over 2 replicas: 1 each
    tol = summation_tolerance(2 * BATCH)
    for r in (0, 1):
        torch.testing.assert_close(flat_weights(out, r), ref, rtol=tol, atol=tol)
    assert torch.equal(flat_weights(out, 0), flat_weights(out, 1))


def test_2bw_applies_gradients_of_the_previous_version():
    _, _, out = run("pipedream-2bw", m=4)
    ref, _ = reference_sgd(4, 3, version_lag=1)
    tol = summation_tolerance(4 * BATCH)
    torch.testing.assert_close(flat_weights(out), ref, rtol=tol, atol=tol)
    plain, _ = reference_sgd(4, 3)
    assert not torch.allclose(flat_weights(out), plain, atol=1e-4)


@pytest.mark.parametrize(
    "strategy,kw",
    [
        ("pipedream", {}),
        ("pipedream", {"stashing": False}),
        ("pipedream-2bw", {}),
        ("spectrain", {}),
        ("gpipe", {}),
        ("avgpipe", {"width": 2}),
    ],
)
def test_versions_read_are_those_the_simulator_predicts(strategy, kw):
    sched, timeline, out = run(strategy, stages=3 if strategy != "avgpipe" else 2, m=3, iters=3, **kw)
    # rebuild the layers for 3 stages: 4 layers split 1/1/2 is not uniform, so use the
    # simulator's own tracker of versions for the comparison
    predicted = {}
    for pv in timeline.versions:
        predicted[(pv.replica, pv.stage, "F", pv.microbatch)] = (pv.forward_version, pv.forward_distance)
        predicted[(pv.replica, pv.stage, "B", pv.microbatch)] = (pv.backward_version, pv.backward_distance)
    used = {(r, s, op, mb): (v, d) for (r, s), lst in out.versions_used.items() for op, mb, v, d in lst}
    assert used == predicted
    assert out.unscheduled_predictions == 0


def test_pipedream_stashing_changes_the_result():
    _, _, stash = run("pipedream")
    _, _, vanilla = run("pipedream", stashing=False)
    assert not torch.allclose(flat_weights(stash), flat_weights(vanilla), atol=1e-5)


def test_spectrain_prediction_is_the_momentum_extrapolation():
    stage = PipelineStage(nn.Linear(3, 2), 0, 2)
    acts = [Action(Op.UPDATE, 0, None, 1), Action(Op.PREDICT, 0, 0, 1, 2)]
    stage.prepare(acts, OptimizerConfig(lr=0.5, momentum=0.9))
    for g in stage.grads:
        g.fill_(1.0)
    stage.accumulated = 1
    stage.update(acts[0])
    w = [t.clone() for t in stage.weights()]
    stage.predict(Action(Op.PREDICT, 0, 0, 1, 2))
    for pred, cur, mom in zip(stage.scratch, w, stage.state["momentum"]):
        torch.testing.assert_close(pred, cur - 2 * 0.5 * mom)


def test_avgpipe_averaging_pulls_replicas_together():
    def spread(alpha):
        _, _, out = run("avgpipe", width=2, m=2, iters=4, alpha=alpha, tau=1)
        return (flat_weights(out, 0) - flat_weights(out, 1)).abs().max().item()

    assert spread(0.4) < 0.5 * spread(0.01)


def test_reading_a_version_that_was_overwritten_is_an_error():
    sched = build_schedule(ScheduleSpec(strategy="pipedream", stages=2, microbatches=2, iterations=1))
    # make device 0's backward of micro-batch 1 claim version 0 after the in-place
    # update of a vanilla-like program: drop the stash by reading a future version
    progs = [list(p) for p in sched.programs]
    j = next(i for i, a in enumerate(progs[0]) if a.op is Op.BACKWARD and a.microbatch == 1)
    progs[0][j] = progs[0][j]._replace(version=5)
    bad = sched.with_programs(progs)
    timeline = simulate(sched, stage_costs_uniform(2), load_hardware("ideal"))
    layers = make_layers()
    mods = {(0, k): PipelineStage(nn.Sequential(*layers[2 * k : 2 * k + 2]), k, 2, loss_fn=loss_fn) for k in (0, 1)}
    with pytest.raises(RuntimeSemanticsError, match="version 5"):
        emulate(bad, mods, Data(), OptimizerConfig(), timeline)


def test_missing_stage_is_a_clear_error():
    sched = build_schedule(ScheduleSpec(strategy="gpipe", stages=2, microbatches=2))
    timeline = simulate(sched, stage_costs_uniform(2), load_hardware("ideal"))
    mods = {(0, 0): PipelineStage(nn.Linear(D, D), 0, 2)}
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        emulate(sched, mods, Data(), OptimizerConfig(), timeline)

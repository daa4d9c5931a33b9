"""Every strategy against an independent reference written from its paper's update rule.

The references below import nothing from pipesim. Each is a plain loop over
micro-batches on a small float64 network (one Linear layer per pipeline
stage, tanh between them, cross-entropy at the end) whose forward and
backward are written out by hand, so the reference shares neither autograd's
graph tricks nor pipesim's version pool, prediction kernel or optimizer.
What each reference encodes is the rule as the papers (and
``docs/concepts/strategies.md``) state it:

* flush schedules (GPipe, 1F1B, ZB-H1, interleaved 1F1B) and data
  parallelism: mini-batch SGD with momentum; the gradient of iteration t is
  the mean over its micro-batches (and replicas) at W(t);
* PipeDream with weight stashing (SOSP'19): stage k computes micro-batch i's
  forward and backward on its version max(i − (N−k−1), 0) and applies the
  gradient as its update i+1;
* vanilla asynchronous pipelining: the forward as above, the backward with
  the current weights W_k(i) on the activations that forward saved;
* SpecTrain (arXiv 1809.02839): forward on Ŵ = W(c) − s_fwd(k)·lr·v(c) with
  c = max(i − (N−k−1), 0), backward on W(i) − s_bwd(k)·lr·v(i), v the
  momentum buffer; s_fwd(k) = ⌊k/2⌋ + N − k − 1, s_bwd(k) = ⌊k/2⌋;
* PipeDream-2BW (ICML'21): window j of m micro-batches (every replica's)
  computes on W(max(j − 1, 0)) and W(j+1) = W(j) − lr·mom(mean gradient);
* AvgPipe (pipesim's reading, EASGD): each replica does mini-batch SGD on
  its own micro-batches, then every τ iterations
  x_r ← x_r − α(x_r − x̃), x̃ ← x̃ + α Σ_r (x_r − x̃) with values from before.

Momentum is torch's form (v ← μv + g, W ← W − lr·v; the first v is g).

Tolerance. Both sides compute in float64 and differ only in how sums are
rounded: the reference sums a batch's products in its own order (``δᵀx``
written out, the softmax gradient as p − onehot), the pipeline through
autograd's kernels and gradient accumulation micro-batch by micro-batch.
Recursive summation of n terms is off by at most about n·ε relative to the
sum of magnitudes (Higham, §4.2). A weight entry after U updates has been
through U gradients, each a sum of BATCH·m products that went through up to
2·LAYERS dependent layers (forward and backward), so we allow
``2 · (BATCH·m + 2·LAYERS) · U · ε₆₄`` relative to the weights' scale:
about 1e-12 here. A version off by one, a gradient counted twice or a
prediction from the wrong momentum moves a weight by about lr·|g| ≈ 1e-2,
ten orders of magnitude more.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipesim.sim.engine.core import simulate
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.partition.split import stage_costs_uniform
from pipesim.sim.strategies import ScheduleSpec, build_schedule, get_strategy, strategy_names
from pipesim.validate.executor import emulate
from pipesim.validate.stage import OptimizerConfig, PipelineStage

#: numerics tests: CI runs them again with lesser ATen and MKL kernels (.ci/run)
pytestmark = pytest.mark.numerics

DTYPE = torch.float64
D, CLASSES, BATCH = 6, 3, 5
LR, MOM = 0.2, 0.9


# --------------------------------------------------------------- the network


def initial_weights(layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(W, b) per layer: D -> D with tanh, the last D -> CLASSES."""
    g = torch.Generator().manual_seed(7)
    out = []
    for k in range(layers):
        rows = D if k < layers - 1 else CLASSES
        out.append(
            (torch.randn(rows, D, generator=g, dtype=DTYPE) * 0.5, torch.randn(rows, generator=g, dtype=DTYPE) * 0.1)
        )
    return out


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(BATCH, D, generator=g, dtype=DTYPE), torch.randint(0, CLASSES, (BATCH,), generator=g)


def sample_index(replica: int, mb: int, replicas: int) -> int:
    """The id of a replica's ``mb``-th micro-batch, which is also the data
    batch it trains on: ids run over every replica, id i on replica
    i % replicas (the IR's routing, ``Schedule.replica_of``), the one
    convention the references share with pipesim."""
    return mb * replicas + replica


def layer_forward(k: int, layers: int, w, x):
    """One layer; returns (output, what its backward needs: input and output)."""
    z = x @ w[0].T + w[1]
    a = torch.tanh(z) if k < layers - 1 else z
    return a, (x, a)


def loss_and_grad(z, y):
    """Mean cross-entropy over the batch and its gradient with respect to the logits."""
    zmax = z.max(dim=1, keepdim=True).values
    logp = z - zmax - torch.log(torch.exp(z - zmax).sum(dim=1, keepdim=True))
    loss = -logp[torch.arange(len(y)), y].mean()
    grad = torch.exp(logp)
    grad[torch.arange(len(y)), y] -= 1
    return loss, grad / len(y)


def layer_backward(k: int, layers: int, w_backward, saved, g):
    """Gradients of one layer: the weights' gradient from the saved input and
    output, the input's gradient through ``w_backward`` (vanilla
    pipelining's backward reads other weights than its forward)."""
    x, a = saved
    delta = g * (1 - a * a) if k < layers - 1 else g
    return (delta.T @ x, delta.sum(0)), delta @ w_backward[0]


def micro_batch(layers: int, forward_w, backward_w, x, y):
    """Forward on ``forward_w``, backward on ``backward_w`` (per layer); (loss, grads)."""
    saved = []
    for k in range(layers):
        x, s = layer_forward(k, layers, forward_w[k], x)
        saved.append(s)
    loss, g = loss_and_grad(x, y)
    grads = [None] * layers
    for k in reversed(range(layers)):
        grads[k], g = layer_backward(k, layers, backward_w[k], saved[k], g)
    return loss, grads


class Momentum:
    """torch's SGD momentum for one layer: v <- mu*v + g (v = g at first), W <- W - lr*v."""

    def __init__(self):
        self.v = None

    def step(self, w, g):
        self.v = [gi.clone() for gi in g] if self.v is None else [MOM * v + gi for v, gi in zip(self.v, g)]
        return tuple(wi - LR * vi for wi, vi in zip(w, self.v))

    def predict(self, w, distance):
        if self.v is None or not distance:
            return w
        return tuple(wi - distance * LR * vi for wi, vi in zip(w, self.v))


def mean(grads_list):
    n = len(grads_list)
    return [tuple(sum(g[k][i] for g in grads_list) / n for i in range(2)) for k in range(len(grads_list[0]))]


# -------------------------------------------------------------- references


def reference_minibatch(layers, m, iterations, replicas=1):
    """Flush schedules and data parallelism: mean gradient of an iteration at W(t)."""
    w = initial_weights(layers)
    opt = [Momentum() for _ in range(layers)]
    losses = {}
    for t in range(iterations):
        grads = []
        for mb in range(t * m, (t + 1) * m):
            for r in range(replicas):
                loss, g = micro_batch(layers, w, w, *sample(sample_index(r, mb, replicas)))
                losses[(r, sample_index(r, mb, replicas))] = loss
                grads.append(g)
        g = mean(grads)
        w = [opt[k].step(w[k], g[k]) for k in range(layers)]
    return [w] * replicas, losses


def reference_asynchronous(layers, stages, n, rule):
    """PipeDream (stashed or vanilla) and SpecTrain: an update per micro-batch
    and stage, layers split evenly over ``stages``. ``rule(k, i, history,
    momentum)`` gives the (forward, backward) weights of a layer of stage k
    for micro-batch i, from the layer's history (history[v] is W(v)) and its
    momentum buffers (momentum[v]: the one that made W(v), None for v = 0)."""
    history = [[w] for w in initial_weights(layers)]
    opt = [Momentum() for _ in range(layers)]
    momentum = [[None] for _ in range(layers)]
    per = layers // stages
    losses = {}
    for i in range(n):
        fw, bw = zip(*(rule(k // per, i, history[k], momentum[k]) for k in range(layers)))
        loss, grads = micro_batch(layers, fw, bw, *sample(i))
        losses[(0, i)] = loss
        for k in range(layers):
            history[k].append(opt[k].step(history[k][-1], grads[k]))
            momentum[k].append(opt[k].v)
    return [[h[-1] for h in history]], losses


def stale(k, i, stages):
    """Version stage k's forward of micro-batch i reads in asynchronous 1F1B."""
    return max(i - (stages - k - 1), 0)


def stashing_rule(stages):
    def rule(k, i, history, _):
        v = history[stale(k, i, stages)]
        return v, v

    return rule


def vanilla_rule(stages):
    def rule(k, i, history, _):
        return history[stale(k, i, stages)], history[i]

    return rule


def spectrain_rule(stages):
    def predicted(history, momentum, version, distance):
        w, v = history[version], momentum[version]
        if v is None or not distance:
            return w
        return tuple(wi - distance * LR * vi for wi, vi in zip(w, v))

    def rule(k, i, history, momentum):
        s_fwd, s_bwd = k // 2 + stages - k - 1, k // 2
        return (predicted(history, momentum, stale(k, i, stages), s_fwd), predicted(history, momentum, i, s_bwd))

    return rule


def reference_2bw(layers, m, iterations, replicas=1):
    """W(t+1) = W(t) - lr*mom(grad f(W(t-1))), window t reading max(t-1, 0)."""
    history = [initial_weights(layers)]
    opt = [Momentum() for _ in range(layers)]
    losses = {}
    for t in range(iterations):
        read = history[max(t - 1, 0)]
        grads = []
        for mb in range(t * m, (t + 1) * m):
            for r in range(replicas):
                loss, g = micro_batch(layers, read, read, *sample(sample_index(r, mb, replicas)))
                losses[(r, sample_index(r, mb, replicas))] = loss
                grads.append(g)
        g = mean(grads)
        history.append([opt[k].step(history[-1][k], g[k]) for k in range(layers)])
    return [history[-1]] * replicas, losses


def reference_avgpipe(layers, m, iterations, replicas, alpha, tau):
    """Each replica: mini-batch SGD on its own micro-batches; EASGD every tau iterations."""
    w = [initial_weights(layers) for _ in range(replicas)]
    centre = initial_weights(layers)
    opt = [[Momentum() for _ in range(layers)] for _ in range(replicas)]
    losses = {}
    for t in range(iterations):
        for r in range(replicas):
            grads = []
            for mb in range(t * m, (t + 1) * m):
                loss, g = micro_batch(layers, w[r], w[r], *sample(sample_index(r, mb, replicas)))
                losses[(r, sample_index(r, mb, replicas))] = loss
                grads.append(g)
            g = mean(grads)
            w[r] = [opt[r][k].step(w[r][k], g[k]) for k in range(layers)]
        if (t + 1) % tau == 0:
            new_centre = []
            for k in range(layers):
                c = centre[k]
                pull = [tuple(xi - ci for xi, ci in zip(w[r][k], c)) for r in range(replicas)]
                new_centre.append(tuple(ci + alpha * sum(p[i] for p in pull) for i, ci in enumerate(c)))
                for r in range(replicas):
                    w[r][k] = tuple(xi - alpha * pi for xi, pi in zip(w[r][k], pull[r]))
            centre = new_centre
    return w, losses


# ------------------------------------------------------------ the pipeline


class Data:
    def batch(self, index):
        return sample(index)


def run_pipeline(spec: ScheduleSpec, layers: int):
    """Emulate ``spec`` with one layer per model stage (the whole network on
    one stage for data parallelism); final weights per replica and losses."""
    sched = build_schedule(spec)
    timeline = simulate(sched, stage_costs_uniform(sched.num_stages), load_hardware("ideal"))
    per = layers // sched.num_stages
    init = initial_weights(layers)
    stages = {}
    for rep, k in sched.placement():
        mods = []
        for j in range(k * per, (k + 1) * per):
            lin = nn.Linear(D, init[j][0].shape[0], dtype=DTYPE)
            with torch.no_grad():
                lin.weight.copy_(init[j][0])
                lin.bias.copy_(init[j][1])
            mods.append(nn.Sequential(lin, nn.Tanh()) if j < layers - 1 else lin)
        stages[(rep, k)] = PipelineStage(
            nn.Sequential(*mods), k, sched.num_stages, replica=rep, loss_fn=nn.CrossEntropyLoss()
        )
    out = emulate(sched, stages, Data(), OptimizerConfig(lr=LR, momentum=MOM), timeline)
    weights = []
    for rep in range(sched.num_replicas):
        flat = []
        for k in range(sched.num_stages):
            state = out.weights[(rep, k)]
            for j in range(per):
                flat.append(
                    (
                        state[f"{j}.0.weight" if k * per + j < layers - 1 else f"{j}.weight"],
                        state[f"{j}.0.bias" if k * per + j < layers - 1 else f"{j}.bias"],
                    )
                )
        weights.append(flat)
    return weights, out.losses


def tolerance(layers: int, m: int, updates: int) -> float:
    """The bound of the module doc: 2 (BATCH m + 2 LAYERS) U eps, relative."""
    return 2 * (BATCH * m + 2 * layers) * updates * torch.finfo(DTYPE).eps


def assert_matches(got, want, tol):
    got_w, got_losses = got
    want_w, want_losses = want
    scale = max(t.abs().max().item() for rep in want_w for layer in rep for t in layer)
    assert len(got_w) == len(want_w)
    for r, (gr, wr) in enumerate(zip(got_w, want_w)):
        for k, (gl, wl) in enumerate(zip(gr, wr)):
            for gt, wt in zip(gl, wl):
                err = (gt - wt).abs().max().item()
                assert err <= tol * scale, f"replica {r} layer {k}: off by {err:.3g} (allowed {tol * scale:.3g})"
    assert got_losses.keys() == want_losses.keys()
    for key, loss in want_losses.items():
        assert got_losses[key] == pytest.approx(loss.item(), rel=tol, abs=tol), key


LAYERS = 4
M, ITERS = 4, 3
N_ASYNC = M * ITERS  # micro-batches (and updates) of the asynchronous cases


def case(strategy, kw, reference, updates, iterations=ITERS):
    return strategy, kw, reference, updates, iterations


#: case -> (strategy, spec options, reference, updates applied, iterations)
CASES = {
    "gpipe": case("gpipe", dict(stages=4), lambda: reference_minibatch(LAYERS, M, ITERS), ITERS),
    "1f1b": case("1f1b", dict(stages=4), lambda: reference_minibatch(LAYERS, M, ITERS), ITERS),
    "zb-h1": case("zb-h1", dict(stages=4), lambda: reference_minibatch(LAYERS, M, ITERS), ITERS),
    "interleaved-1f1b": case(
        "interleaved-1f1b", dict(stages=2, chunks=2), lambda: reference_minibatch(LAYERS, M, ITERS), ITERS
    ),
    # m = 4 in all, 2 per replica
    "data-parallel": case(
        "data-parallel", dict(stages=2), lambda: reference_minibatch(LAYERS, M // 2, ITERS, replicas=2), ITERS
    ),
    "pipedream": case(
        "pipedream", dict(stages=4), lambda: reference_asynchronous(LAYERS, 4, N_ASYNC, stashing_rule(4)), N_ASYNC
    ),
    "pipedream-vanilla": case(
        "pipedream",
        dict(stages=4, stashing=False),
        lambda: reference_asynchronous(LAYERS, 4, N_ASYNC, vanilla_rule(4)),
        N_ASYNC,
    ),
    # two layers per stage: vanilla's backward reads new weights inside a stage too
    "pipedream-vanilla-2-stages": case(
        "pipedream",
        dict(stages=2, stashing=False),
        lambda: reference_asynchronous(LAYERS, 2, N_ASYNC, vanilla_rule(2)),
        N_ASYNC,
    ),
    "spectrain": case(
        "spectrain", dict(stages=4), lambda: reference_asynchronous(LAYERS, 4, N_ASYNC, spectrain_rule(4)), N_ASYNC
    ),
    "spectrain-2-stages": case(
        "spectrain", dict(stages=2), lambda: reference_asynchronous(LAYERS, 2, N_ASYNC, spectrain_rule(2)), N_ASYNC
    ),
    "pipedream-2bw": case(
        "pipedream-2bw", dict(stages=4), lambda: reference_2bw(LAYERS, M, ITERS + 1), ITERS + 1, ITERS + 1
    ),
    "pipedream-2bw-width-2": case(
        "pipedream-2bw",
        dict(stages=2, width=2),
        lambda: reference_2bw(LAYERS, M, ITERS + 1, replicas=2),
        ITERS + 1,
        ITERS + 1,
    ),
    "avgpipe": case(
        "avgpipe", dict(stages=2, width=2, alpha=0.3), lambda: reference_avgpipe(LAYERS, M, ITERS, 2, 0.3, 1), ITERS
    ),
    "avgpipe-disjoint-tau-2": case(
        "avgpipe",
        dict(stages=2, width=2, alpha=0.3, tau=2, placement="disjoint"),
        lambda: reference_avgpipe(LAYERS, M, ITERS + 1, 2, 0.3, 2),
        ITERS + 1,
        ITERS + 1,
    ),
}


def test_every_strategy_has_a_reference():
    """Every strategy real tensors can run (a simulator-only one, tensor
    parallelism, says it cannot: ``Strategy.executable``)."""
    runnable = {name for name in strategy_names() if get_strategy(name).executable}
    assert {strategy for strategy, *_ in CASES.values()} == runnable


@pytest.mark.parametrize("name", list(CASES))
def test_strategy_follows_its_papers_update_rule(name):
    strategy, kw, reference, updates, iterations = CASES[name]
    spec = ScheduleSpec(strategy=strategy, microbatches=M, iterations=iterations, **kw)
    assert_matches(run_pipeline(spec, LAYERS), reference(), tolerance(LAYERS, M, updates))


def test_the_tolerance_separates_the_rules():
    """The references are far apart at this tolerance, so a pipeline matching
    one of them could not be matching another by accident."""
    rules = {"stash": stashing_rule(4), "vanilla": vanilla_rule(4), "spectrain": spectrain_rule(4)}
    finals = {name: reference_asynchronous(LAYERS, 4, N_ASYNC, rule)[0][0] for name, rule in rules.items()}
    finals["sgd"] = reference_minibatch(LAYERS, 1, N_ASYNC)[0][0]
    tol = tolerance(LAYERS, M, N_ASYNC)
    names = sorted(finals)
    for a in names:
        for b in names:
            if a < b:
                diff = max((x - y).abs().max().item() for la, lb in zip(finals[a], finals[b]) for x, y in zip(la, lb))
                assert diff > 1e6 * tol, (a, b, diff)

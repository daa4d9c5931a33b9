"""Convergence under staleness: train a strategy with real tensors, evaluate on held-out data.

One *run* trains one strategy on one model from the seed's initial weights,
on the seed's sample stream, for a fixed number of updates of a fixed
update batch, and evaluates the held-out split at regular intervals
(:func:`train`). Runs are comparable across strategies by construction
(:func:`plan`, the fairness rules):

* **update batch B** (default 32 samples): every strategy's weight update
  averages the gradients of exactly B samples (``scale_grads``; replicas'
  gradients averaged), and every strategy makes the same number of updates U,
  so all see U·B samples, **the same samples in the same order** (the
  streams are addressed by sample, :mod:`pipesim.validate.data`);
* **m = p** micro-batches per iteration and replica on p stages; the
  micro-batch size b follows from B: b = B·u / (m·R), with u the updates a
  stage makes per iteration and R the replicas whose micro-batches the
  iteration runs. So 1F1B, GPipe and 2BW take p micro-batches of B/p;
  PipeDream and SpecTrain update after every micro-batch, of B samples;
  data parallelism has p replicas of one micro-batch of B/p; AvgPipe's N_p
  pipelines each update on B/N_p samples (p micro-batches of B/(N_p·p)),
  which keeps B samples per update step in all;
* the same model split into p contiguous stages (layers dealt evenly in
  order, the remainder to the last stages), the same optimizer (SGD with
  momentum, or Adam), one learning rate and one warm-up for every strategy:
  a stage's update u uses ``lr·min(1, u/N)`` with N the warm-up updates
  (:meth:`~pipesim.validate.stage.OptimizerConfig.lr_at`), read where every
  strategy reads its rate, the optimizer step and SpecTrain's prediction.

What is evaluated: between steps every stage holds its latest weights
(replica 0's where there are replicas, AvgPipe included); in an
asynchronous pipeline mid-run, stage k is then up to p−k−1 updates behind
the last stage, as a user of ``step()`` would see it. The last point is
after the pipeline has drained. A run *diverges* when a loss is no longer
finite or the held-out loss exceeds :data:`DIVERGENCE_FACTOR` times the
untrained model's (it stops there), or when it ends no better than the
untrained model (a blow-up that settled at chance, its units dead).

Training goes through :class:`~pipesim.validate.schedule.PipelineSchedule`,
one ``step()`` per evaluation interval: emulated in one process
(:func:`train`) or on the distributed runtime (:func:`train_distributed`),
which gives the same bits.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from pipesim.sim.errors import InputError
from pipesim.sim.ir.core import REDUCE_GRAD, UPDATE, WEIGHT_GRADIENT_OPS, F
from pipesim.sim.strategies import ScheduleSpec, build_schedule, get_strategy, strategies
from pipesim.sim.strategies._common import check_executable
from pipesim.validate.models import build_model, split
from pipesim.validate.numerics import EXECUTOR_THREADS, intra_op_threads
from pipesim.validate.schedule import PipelineSchedule
from pipesim.validate.stage import OptimizerConfig, PipelineStage

#: A run has diverged once its held-out loss exceeds this many times the untrained model's.
DIVERGENCE_FACTOR = 2.0
#: Strategies under another name than their registry's: option values of a registered strategy.
VARIANTS: dict[str, tuple[str, dict]] = {"pipedream-nostash": ("pipedream", {"stashing": False})}
#: Width and depth of each catalog model in convergence runs: deep enough for 8 stages, quick on a CPU.
#: A catalog model not named here runs at the catalog's size unless
#: ``--model-width``/``--model-depth`` say otherwise (:func:`build_run_model`).
MODEL_SIZES = {"mlp": (128, 8), "vgg-small": (16, 6), "gpt-small": (64, 6), "lstm": (64, 6)}
#: Adam's (beta1, beta2) and eps unless a run says otherwise: torch.optim.Adam's
#: defaults, which are also Megatron-LM's ``--adam-beta1/--adam-beta2/--adam-eps``.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


class ConvergeError(InputError):
    """A convergence run that cannot be set up as asked (one line)."""


def strategy_names() -> list[str]:
    """What a run may name: every strategy real tensors can run, and :data:`VARIANTS`."""
    return [s.name for s in strategies() if s.executable] + list(VARIANTS)


def resolve(name: str) -> tuple[str, dict]:
    """(registered strategy, its options) of a run's strategy name."""
    strategy, options = VARIANTS[name] if name in VARIANTS else (name, {})
    get_strategy(strategy)  # a StrategyError naming the choices
    check_executable(strategy, "real-tensor executors")  # refused here, before any run trains
    return strategy, options


@dataclass(frozen=True)
class Setup:
    """What every run of a comparison shares."""

    model: str = "mlp"
    updates: int = 400
    update_batch: int = 32
    eval_every: int = 40
    momentum: float = 0.9  # SGD's; Adam's first moment is betas[0]
    model_width: int | None = None  # None: MODEL_SIZES
    model_depth: int | None = None
    optimizer: str = "sgd"  # or "adam" (pipesim.validate.stage.OPTIMIZERS)
    warmup_steps: int = 0  # linear warm-up of the lr over this many updates
    betas: tuple[float, float] = ADAM_BETAS  # Adam's
    eps: float = ADAM_EPS  # Adam's

    def size(self) -> tuple[int | None, int | None]:
        width, depth = MODEL_SIZES.get(self.model, (None, None))
        return (self.model_width or width, self.model_depth or depth)

    def optimizer_config(self, lr: float) -> OptimizerConfig:
        """What every stage of a run at ``lr`` runs (its checks raise OptimizerError)."""
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ConvergeError(f"Adam's betas must be in [0, 1), got {b1} {b2}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ConvergeError(f"Adam's eps must be a finite number > 0, got {self.eps}")
        return OptimizerConfig(
            kind=self.optimizer,
            lr=lr,
            momentum=self.momentum,
            betas=tuple(self.betas),
            eps=self.eps,
            warmup_steps=self.warmup_steps,
        )


@dataclass(frozen=True)
class Run:
    """One strategy at one depth, learning rate and seed."""

    setup: Setup
    strategy: str
    stages: int
    lr: float
    seed: int


@dataclass(frozen=True)
class Plan:
    """How a run is laid out (the fairness rules of the module doc)."""

    spec: ScheduleSpec  # one step: ``iterations`` iterations
    microbatch_size: int
    updates_per_step: int
    steps: int

    @property
    def updates(self) -> int:
        return self.updates_per_step * self.steps


@functools.lru_cache(maxsize=1024)
def plan(run: Run) -> Plan:
    """m, micro-batch size, iterations per step and steps of ``run`` (cached:
    checking, ordering and training a run each ask for it)."""
    setup = run.setup
    strategy, options = resolve(run.strategy)
    p = run.stages
    probe = build_schedule(ScheduleSpec(strategy=strategy, stages=p, microbatches=p, **options))
    key = next(iter(sorted(probe.placement())))
    per_iteration = sum(1 for prog in probe.programs for a in prog if a.op is UPDATE and (a.replica, a.stage) == key)
    micro = probe.num_microbatches  # micro-batches one iteration runs, every replica's
    b, rest = divmod(setup.update_batch * per_iteration, micro)
    if rest or b < 1:
        raise ConvergeError(
            f"{run.strategy} on {p} stages runs {micro} micro-batches per iteration and "
            f"{per_iteration} updates: an update batch of {setup.update_batch} does not split "
            f"into whole micro-batches (choose a multiple of {micro // math.gcd(micro, per_iteration)})"
        )
    # Exactly U updates, evaluated after the same updates, for every strategy: a
    # step rounded up (eval_every not a multiple of u) once gave PipeDream and
    # SpecTrain 320 updates where the flushed schedules made 300.
    if setup.eval_every % per_iteration:
        raise ConvergeError(
            f"{run.strategy} on {p} stages makes {per_iteration} updates per iteration (m = p): "
            f"--eval-every {setup.eval_every} is not a multiple of that, so it could not be "
            f"evaluated after the same updates as the others (choose a multiple of {per_iteration})"
        )
    if setup.updates % setup.eval_every:
        raise ConvergeError(
            f"--updates {setup.updates} is not a multiple of --eval-every {setup.eval_every}: "
            "every run makes exactly the same updates and is evaluated after each eval-every"
        )
    iterations = setup.eval_every // per_iteration
    spec = ScheduleSpec(strategy=strategy, stages=p, microbatches=p, iterations=iterations, **options)
    return Plan(spec, b, setup.eval_every, setup.updates // setup.eval_every)


def build_run_model(setup: Setup, seed: int = 0):
    """The model every run of ``setup`` trains, from ``seed``'s weights: the
    one place a convergence run builds its model. Catalog models today;
    ``hf:`` models (a 4-layer ``hf:gpt2``, say) plug in here once the
    catalog builds them with a training stream and a held-out split of real
    data (``data(b, seed=, split="train")`` and ``heldout()``, as the
    character models have), which is all a run asks of a model."""
    width, depth = setup.size()
    return build_model(setup.model, width=width, depth=depth, seed=seed)


def stage_starts(layers: int, stages: int) -> list[int]:
    """First layer of each of ``stages`` contiguous stages, layers dealt
    evenly in order, the remainder to the last stages."""
    if stages > layers:
        raise ConvergeError(
            f"{stages} stages need at least as many layers; the model has {layers} (raise --model-depth)"
        )
    return [k * (layers // stages) + max(0, k - (stages - layers % stages)) for k in range(stages)]


def evaluate(
    parts: list[tuple[nn.Module, dict[str, torch.Tensor]]], inputs: torch.Tensor, targets: torch.Tensor, loss_fn
) -> tuple[float, float]:
    """Held-out (loss, accuracy) of a model given as its stages' modules,
    each with the weights to compute with (by parameter name). A prediction
    from non-finite logits counts as wrong."""
    x = inputs
    with torch.no_grad():
        for module, weights in parts:
            x = torch.func.functional_call(module, weights, (x,))
        loss = float(loss_fn(x, targets))
        logits = x.reshape(-1, x.shape[-1])
        right = (logits.argmax(-1) == targets.reshape(-1)) & torch.isfinite(logits).all(-1)
    return loss, float(right.float().mean())


def latest(stage: PipelineStage) -> dict[str, torch.Tensor]:
    """A stage's latest weights by parameter name (no copy)."""
    return dict(zip(stage.names, stage.weights()))


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class _Trainer:
    """The state of one run: its model's stages, data and schedule, on this process."""

    def __init__(self, run: Run, keys=None, device: torch.device | str = "cpu"):
        self.run, self.plan = run, plan(run)
        model = build_run_model(run.setup, run.seed)
        self.model = model
        sched = build_schedule(self.plan.spec)
        modules = split(model, stage_starts(model.num_layers, sched.num_stages))
        keys = sorted(sched.placement()) if keys is None else sorted(keys)
        self.stages = {
            (r, k): PipelineStage(
                copy.deepcopy(modules[k]), k, sched.num_stages, device, replica=r, loss_fn=model.loss_fn
            )
            for r, k in keys
        }
        self.data = model.data(self.plan.microbatch_size, seed=run.seed, split="train")
        self.optimizer = run.setup.optimizer_config(run.lr)
        self.runner = PipelineSchedule(sched, self.stages.values(), self.optimizer, steps=self.plan.steps)
        self.num_stages = sched.num_stages

    def step(self) -> list[float] | None:
        return self.runner.step(self.data)


class _Curve:
    """Held-out evaluation after each step, and the divergence rule."""

    def __init__(self, run: Run, trainer: _Trainer, plan_: Plan):
        self.run, self.plan = run, plan_
        self.inputs, self.targets = trainer.model.heldout()
        self.loss_fn = trainer.model.loss_fn
        self.points: list[dict] = []
        self.diverged = False
        self.initial: float | None = None

    def add(self, parts: list[tuple[nn.Module, dict]], steps_done: int, train_loss: float | None) -> bool:
        """Evaluate the model ``parts`` make up; whether training should go on."""
        loss, acc = evaluate(parts, self.inputs, self.targets, self.loss_fn)
        if self.initial is None:
            self.initial = loss
        self.points.append(
            {
                "samples": steps_done * self.plan.updates_per_step * self.run.setup.update_batch,
                "heldout_accuracy": acc,
                "heldout_loss": _finite(loss),
                "train_loss": _finite(train_loss),
            }
        )
        bad = not math.isfinite(loss) or (train_loss is not None and not math.isfinite(train_loss))
        self.diverged = bad or loss > DIVERGENCE_FACTOR * self.initial
        return not self.diverged

    def record(self) -> dict:
        last = self.points[-1]
        # a run that blew up and settled at chance (dead units) made nothing of the data either
        self.diverged = self.diverged or not (last["heldout_loss"] is not None and last["heldout_loss"] < self.initial)
        return {
            "model": self.run.setup.model,
            "strategy": self.run.strategy,
            "stages": self.run.stages,
            "lr": self.run.lr,
            "optimizer": self.run.setup.optimizer,
            "warmup_steps": self.run.setup.warmup_steps,
            "seed": self.run.seed,
            "updates": self.plan.updates,
            "final_heldout_accuracy": last["heldout_accuracy"],
            "final_heldout_loss": last["heldout_loss"],
            "diverged": self.diverged,
            "microbatch_size": self.plan.microbatch_size,
            "microbatches": self.plan.spec.microbatches,
            "curve": self.points,
        }


def _mean(losses: list[float] | None) -> float | None:
    return None if not losses else sum(losses) / len(losses)


def train(run: Run) -> dict:
    """One run in this process (the emulator): the record ``curves.json`` holds."""
    with intra_op_threads(EXECUTOR_THREADS):
        trainer = _Trainer(run)
        curve = _Curve(run, trainer, trainer.plan)
        replica0 = [trainer.stages[(0, k)] for k in range(trainer.num_stages)]

        def parts():
            return [(st.module, latest(st)) for st in replica0]

        curve.add(parts(), 0, None)
        for s in range(trainer.plan.steps):
            losses = trainer.step()
            if not curve.add(parts(), s + 1, _mean(losses)):
                break
        return curve.record()


def _distributed_worker(ctx, run: Run) -> dict | None:
    """One rank of :func:`train_distributed`: its stages train; after each
    step rank 0 gathers replica 0's latest weights, evaluates, and tells
    every rank whether to go on."""
    import torch.distributed as dist

    sched = build_schedule(plan(run).spec)
    keys = [k for k, d in sched.placement().items() if d == ctx.rank]
    trainer = _Trainer(run, keys, ctx.device)
    curve = _Curve(run, trainer, trainer.plan) if ctx.rank == 0 else None
    modules = split(trainer.model, stage_starts(trainer.model.num_layers, trainer.num_stages))

    def evaluated(steps_done: int, train_loss: float | None) -> bool:
        mine = {k: {n: w.cpu() for n, w in latest(s).items()} for k, s in trainer.stages.items() if k[0] == 0}
        every = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        go = [None]
        if ctx.rank == 0:
            held = {k: w for part in every for k, w in part.items()}
            go = [curve.add([(modules[k], held[(0, k)]) for k in range(len(modules))], steps_done, train_loss)]
        dist.broadcast_object_list(go, src=0)
        return go[0]

    with torch.no_grad():  # the model as built: the first point
        evaluated(0, None)
    for s in range(trainer.plan.steps):
        if not evaluated(s + 1, _mean(trainer.step())):
            break
    return curve.record() if curve else None


def train_distributed(run: Run, *, timeout_s: float = 600.0) -> dict:
    """One run on the distributed runtime (gloo, one process per device);
    bit-identical to :func:`train`."""
    from pipesim.validate.launch import launch

    devices = build_schedule(plan(run).spec).num_devices
    return launch(
        _distributed_worker, devices, args=(run,), backend="gloo", timeout_s=timeout_s, threads=EXECUTOR_THREADS
    )[0]


def describe(run: Run) -> dict:
    """The settings of a run, for the record of a comparison."""
    p = plan(run)
    return {
        "strategy": run.strategy,
        "stages": run.stages,
        "microbatches": p.spec.microbatches,
        "microbatch_size": p.microbatch_size,
        "iterations_per_step": p.spec.iterations,
        **{k: v for k, v in asdict(run.setup).items() if k != "model"},
        "updates": p.updates,
    }


# ---------------------------------------------------------------- stability on a quadratic


def update_rule(strategy: str, stages: int) -> list[tuple[int, int]]:
    """Per stage, (delay, prediction distance) of the forward that computes
    a gradient, read off the strategy's IR in steady state: the gradient of
    a micro-batch is applied to version u − 1 (its UPDATE makes u) after a
    forward that read version v at distance s, so delay = u − 1 − v.
    Flush schedules: (0, 0); 2BW: (1, 0); PipeDream: (p−k−1, 0); SpecTrain:
    (p−k−1, s_fwd(k))."""
    name, options = resolve(strategy)
    sched = build_schedule(ScheduleSpec(strategy=name, stages=stages, microbatches=stages, iterations=8, **options))
    out = []
    for k in range(sched.num_stages):
        prog = [a for d in sched.programs for a in d if (a.replica, a.stage) == (0, k)]
        forwards = {a.microbatch: a for a in prog if a.op is F}
        mb = sorted(forwards)[len(forwards) // 2]  # a micro-batch of the steady state
        last = max(j for j, a in enumerate(prog) if a.op in WEIGHT_GRADIENT_OPS and a.microbatch == mb)
        # the next UPDATE applies it, or the one after the REDUCE_GRAD that closes it (2BW defers that one)
        closing = next(a for a in prog[last:] if a.op in (UPDATE, REDUCE_GRAD))
        made = next(a.version for a in prog[prog.index(closing, last) :] if a.op is UPDATE)
        out.append((made - 1 - forwards[mb].version, forwards[mb].distance))
    return out


def stability_threshold(delay: int, distance: int = 0, momentum: float = 0.9) -> float:
    """The largest lr·h for which SGD with momentum stays stable on f(w) = h·w²/2
    when the gradient is taken ``delay`` updates late at the point predicted
    ``distance`` updates ahead (ŵ = w − distance·lr·v, SpecTrain's rule):

        v(t+1) = μ·v(t) + h·(w(t−delay) − distance·lr·v(t−delay)),  w(t+1) = w(t) − lr·v(t+1).

    The recurrence is linear, so it is stable exactly when its companion
    matrix's spectral radius is below 1; the threshold is found on a grid
    of lr·h and refined by bisection at the first crossing. Closed forms:
    2(1+μ) without delay, 1−μ with a delay of one.
    """
    import numpy as np

    def radius(a: float) -> float:
        n = delay + 1  # w(t..t-delay), v(t..t-delay)
        m = np.zeros((2 * n, 2 * n))
        # v(t+1) = mu v(t) + w(t-d) - s a v(t-d);  w(t+1) = w(t) - a v(t+1)
        vrow = np.zeros(2 * n)
        vrow[n] += momentum
        vrow[delay] += 1.0
        vrow[n + delay] -= distance * a
        wrow = -a * vrow
        wrow[0] += 1.0
        m[0], m[n] = wrow, vrow
        for i in range(1, n):
            m[i, i - 1] = 1.0
            m[n + i, n + i - 1] = 1.0
        return float(max(abs(np.linalg.eigvals(m))))

    grid = np.linspace(1e-4, 4.0, 4001)
    lo = 0.0
    for a in grid:
        if radius(a) >= 1.0:
            hi = a
            break
        lo = a
    else:
        return float(grid[-1])
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if radius(mid) < 1.0 else (lo, mid)
    return float(lo)


def layer_curvature(
    setup: Setup, *, lr: float, updates: int = 40, seed: int = 0, samples: int = 128, iterations: int = 12
) -> list[float]:
    """Top Hessian eigenvalue of each layer's parameter block, after ``updates``
    synchronous SGD updates (batch ``setup.update_batch``, ``setup.momentum``)
    at ``lr`` from the seed's weights, on ``samples`` training samples the
    run has not seen.

    Why: a delayed update rule is stable on a direction of curvature h only
    while lr·h stays under its threshold (:func:`stability_threshold`), and
    the rules delay different stages (2BW every stage, PipeDream and SpecTrain
    all but the last), so where the curvature sits decides which rule fails
    first (README, "Convergence"). Power iteration with Hessian-vector
    products (``iterations`` of them; the eigenvalue of largest magnitude).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build_run_model(setup, seed)
    net = model.sequential()
    src = model.data(setup.update_batch, seed=seed, split="train")
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=setup.momentum)
    for i in range(updates):
        x, y = src.batch(i)
        opt.zero_grad()
        model.loss_fn(net(x), y).backward()
        opt.step()
    probe = model.data(samples, seed=seed, split="train")
    x, y = probe.batch(math.ceil((updates + 1) * setup.update_batch / samples))  # past what trained
    out = []
    with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have no double backward on CPU
        for layer in model.layers:
            params = [p for p in layer.parameters() if p.requires_grad]
            g = torch.Generator().manual_seed(0)
            v = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
            lam = 0.0
            for _ in range(iterations):
                norm = torch.sqrt(sum((t * t).sum() for t in v))
                v = [t / norm for t in v]
                grads = torch.autograd.grad(model.loss_fn(net(x), y), params, create_graph=True)
                hv = torch.autograd.grad(grads, params, grad_outputs=v)
                lam = float(sum((a * b).sum() for a, b in zip(hv, v)))
                v = [h.detach() for h in hv]
            out.append(lam)
    return out

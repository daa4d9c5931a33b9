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

**Models from elsewhere** (``hf:``, ``torchvision:``, a factory;
:mod:`pipesim.validate.usermodels`) train on what
:func:`~pipesim.validate.usermodels.training_source` gives them: the
character corpus (causal language models), the digits as images (image
classifiers), the factory's own data, or, with ``Setup.synthetic``, random
samples of their inputs' shapes, addressed by sample like the real streams
(then the held-out loss is only a loss curve: accuracy is ``None`` and only
a non-finite or blown-up loss counts as divergence). The same rules hold
for them. Their stages are
:class:`~pipesim.validate.boundary.TupleStage` (a cut may carry several
tensors), and each forward draws its random numbers (dropout) from a
generator seeded by (seed, stage, micro-batch), so the emulator and the
distributed runtime give the same bits for these models too, whatever order
the passes run in; the distributed runtime's untimed warm-up leaves
buffers (BatchNorm's running statistics) as they were. The held-out set is
evaluated in eval mode (dropout off, BatchNorm on its running statistics,
which every training forward updated), in chunks of :data:`EVAL_CHUNK`
samples when the loss is pipesim's cross-entropy.
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
from pipesim.validate.boundary import TupleStage
from pipesim.validate.models import build_model, cross_entropy, split
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
#: Held-out samples evaluated at once for a model from elsewhere (a large
#: vocabulary's logits over the whole held-out set would not fit).
EVAL_CHUNK = 64


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
    synthetic: bool = False  # random samples of the model's input shapes (models from elsewhere only)

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


def build_run_model(setup: Setup, seed: int = 0, *, memory_check: bool = False):
    """The model every run of ``setup`` trains, from ``seed``'s weights, its
    ``source_fn`` the data it trains on (:func:`run_data`): the one place a
    convergence run builds its model. Any ``--model`` that ``pipesim
    validate`` takes; a factory is called with the update batch (the same
    call for every strategy, so every strategy trains the same layers).
    ``memory_check`` refuses a model from elsewhere too big to train here."""
    model = _built(setup, seed, memory_check)
    model.source_fn = _training_data(model, setup.synthetic).source_fn
    return model


def run_data(setup: Setup):
    """What the runs of ``setup`` train on
    (:class:`~pipesim.validate.usermodels.TrainingData`: the source, its
    description, whether it is random samples); a one-line
    :class:`~pipesim.validate.usermodels.NoTrainingData` where there is none."""
    return _training_data(_built(setup, 0, False), setup.synthetic)


def _built(setup: Setup, seed: int, memory_check: bool):
    from pipesim.validate.models import model_names

    if setup.model in model_names():
        width, depth = setup.size()
        return build_model(setup.model, width=width, depth=depth, seed=seed)
    from pipesim.validate.usermodels import resolve_model

    named = ":" in setup.model  # else an unknown name, refused as such before its sizes
    return resolve_model(
        setup.model,
        width=setup.model_width if named else None,
        depth=setup.model_depth if named else None,
        seed=seed,
        microbatch_size=setup.update_batch,
        optimizer=setup.optimizer,
        memory_check=memory_check,
    )


def _training_data(model, synthetic: bool):
    from pipesim.validate.usermodels import training_source

    return training_source(model, synthetic=synthetic)


def stage_starts(layers: int, stages: int, *, remedy: str = "raise --model-depth") -> list[int]:
    """First layer of each of ``stages`` contiguous stages, layers dealt
    evenly in order, the remainder to the last stages."""
    if stages > layers:
        raise ConvergeError(f"{stages} stages need at least as many layers; the model has {layers} ({remedy})")
    return [k * (layers // stages) + max(0, k - (stages - layers % stages)) for k in range(stages)]


def evaluate(
    parts: list[tuple[nn.Module, dict[str, torch.Tensor]]],
    inputs,
    targets: torch.Tensor,
    loss_fn,
    *,
    chunk: int | None = None,
) -> tuple[float, float | None]:
    """Held-out (loss, accuracy) of a model given as its stages' modules,
    each with the weights (and buffers) to compute with, by name. The
    modules run in eval mode (dropout off, BatchNorm on its running
    statistics) and are put back as they were. A prediction from non-finite
    logits counts as wrong; accuracy is ``None`` where the output is no
    logits over the targets' classes (a regression, say). ``inputs`` is a
    tensor or a tuple of tensors. With ``chunk``, ``chunk`` samples at a
    time, the loss (a mean over every prediction, as
    :func:`~pipesim.validate.models.cross_entropy` takes it) weighted by
    their predictions."""
    n = int(targets.shape[0])
    step = n if chunk is None else chunk
    modes = [m.training for m, _ in parts]
    total, right, counted, scored = 0.0, 0, 0, True
    try:
        for m, _ in parts:
            m.eval()
        with torch.no_grad():
            for lo in range(0, n, step):
                x = _rows(inputs, lo, lo + step) if chunk is not None else inputs
                y = targets[lo : lo + step] if chunk is not None else targets
                for module, weights in parts:
                    x = torch.func.functional_call(module, weights, (x,))
                loss = float(loss_fn(x, y))
                if chunk is None:
                    total, counted = loss, 1
                else:
                    total += loss * y.numel()
                    counted += y.numel()
                if scored and _scores(x, y):
                    logits = x.reshape(-1, x.shape[-1])
                    right += int(((logits.argmax(-1) == y.reshape(-1)) & torch.isfinite(logits).all(-1)).sum())
                else:
                    scored = False
    finally:
        for (m, _), mode in zip(parts, modes):
            m.train(mode)
    accuracy = right / targets.numel() if scored and targets.numel() else None
    return total / counted, accuracy


def _rows(x, lo: int, hi: int):
    return tuple(t[lo:hi] for t in x) if isinstance(x, tuple) else x[lo:hi]


def _scores(out, targets: torch.Tensor) -> bool:
    """Whether ``out`` holds one row of logits per target class index."""
    return (
        isinstance(out, torch.Tensor)
        and out.dim() >= 1
        and not targets.is_floating_point()
        and out.shape[-1] > 0
        and out.numel() // out.shape[-1] == targets.numel()
    )


def latest(stage: PipelineStage) -> dict[str, torch.Tensor]:
    """A stage's latest weights by parameter name (no copy), and its module's
    buffers (BatchNorm's running statistics; none in the catalog's models)."""
    return {**dict(stage.module.named_buffers()), **dict(zip(stage.names, stage.weights()))}


#: Tags the generator of a forward's random numbers apart from other streams.
_PASS_TAG = 31


class SeededStage(TupleStage):
    """A :class:`~pipesim.validate.boundary.TupleStage` whose forwards draw
    their random numbers (dropout) from a generator seeded by (``seed``,
    stage, micro-batch), not from the process's: a forward's masks are the
    same whichever process runs it and whatever ran before, so emulated and
    distributed runs give the same bits. Its untimed warm-up leaves the
    module's buffers (BatchNorm's running statistics) as they were."""

    def __init__(self, *args, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed = seed

    def _pass_seed(self, microbatch: int) -> int:
        import numpy as np

        words = [_PASS_TAG, self.seed, self.stage_index, microbatch]
        return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0])

    def forward(self, a, x, target=None):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._pass_seed(a.microbatch))
            return super().forward(a, x, target)

    def warm_up(self, x, target=None) -> None:
        kept = [b.detach().clone() for b in self.module.buffers()]
        with torch.random.fork_rng(devices=[]):
            super().warm_up(x, target)
        with torch.no_grad():
            for b, k in zip(self.module.buffers(), kept):
                b.copy_(k)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class _Trainer:
    """The state of one run: its model's stages, data and schedule, on this process."""

    def __init__(self, run: Run, keys=None, device: torch.device | str = "cpu", *, distributed: bool = False):
        self.run, self.plan = run, plan(run)
        model = build_run_model(run.setup, run.seed)
        self.model = model
        sched = build_schedule(self.plan.spec)
        self.modules = modules = split(model, stage_starts(model.num_layers, sched.num_stages))
        keys = sorted(sched.placement()) if keys is None else sorted(keys)
        # catalog models keep PipelineStage (one tensor a cut, no randomness): their bits are as they were
        catalog = model.origin == "catalog"
        extra = {} if catalog else {"seed": run.seed}
        stage_class = PipelineStage if catalog else SeededStage
        self.stages = {
            (r, k): stage_class(
                copy.deepcopy(modules[k]), k, sched.num_stages, device, replica=r, loss_fn=model.loss_fn, **extra
            )
            for r, k in keys
        }
        self.data = model.data(self.plan.microbatch_size, seed=run.seed, split="train")
        self.optimizer = run.setup.optimizer_config(run.lr)
        specs = None
        if distributed and not catalog:
            # what every cut carries, a tuple's every tensor (the schedule's own inference knows one
            # tensor a cut, and runs the stages' modules, which would move BatchNorm's statistics)
            from pipesim.validate.runtime import boundary_specs

            specs = boundary_specs(copy.deepcopy(modules), self.data)
        self.runner = PipelineSchedule(sched, self.stages.values(), self.optimizer, steps=self.plan.steps, specs=specs)
        self.num_stages = sched.num_stages

    def step(self) -> list[float] | None:
        return self.runner.step(self.data)


class _Curve:
    """Held-out evaluation after each step, and the divergence rule."""

    def __init__(self, run: Run, trainer: _Trainer, plan_: Plan):
        self.run, self.plan = run, plan_
        self.inputs, self.targets = trainer.model.heldout()
        self.loss_fn = trainer.model.loss_fn
        model = trainer.model
        # chunked where the loss is pipesim's mean cross-entropy, for models from elsewhere (the
        # catalog's held-out sets are small, and their figures keep the bits of one pass)
        self.chunk = {"chunk": EVAL_CHUNK} if model.origin != "catalog" and model.loss_fn is cross_entropy else {}
        self.synthetic = run.setup.synthetic
        self.points: list[dict] = []
        self.diverged = False
        self.initial: float | None = None

    def add(self, parts: list[tuple[nn.Module, dict]], steps_done: int, train_loss: float | None) -> bool:
        """Evaluate the model ``parts`` make up; whether training should go on."""
        loss, acc = evaluate(parts, self.inputs, self.targets, self.loss_fn, **self.chunk)
        if self.synthetic:
            acc = None  # random targets: the accuracy means nothing
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
        # a run that blew up and settled at chance (dead units) made nothing of the data either;
        # on random samples nothing is there to learn, so only a blow-up counts
        self.diverged = self.diverged or (
            not (last["heldout_loss"] is not None and last["heldout_loss"] < self.initial)
            if not self.synthetic
            else last["heldout_loss"] is None
        )
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
    trainer = _Trainer(run, keys, ctx.device, distributed=True)
    curve = _Curve(run, trainer, trainer.plan) if ctx.rank == 0 else None
    modules = trainer.modules

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

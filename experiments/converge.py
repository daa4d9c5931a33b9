r"""``pipesim converge``: accuracy under staleness, every strategy on the same footing.

:func:`converge` trains every (strategy, stages, learning rate, seed) of a
:class:`ConvergeConfig` with :func:`pipesim.validate.convergence.train`
(the emulator, one process per run, runs spread over ``jobs`` worker
processes) or :func:`~pipesim.validate.convergence.train_distributed`
(``backend="gloo"``, bit-identical), under the fairness rules of
:mod:`pipesim.validate.convergence`, and writes into its output folder:

* ``curves.json``: ``{"runs": [...], "summary": {...}, "settings": {...},
  "published": {...}}``; each run ``{"model", "strategy", "stages", "lr",
  "optimizer", "warmup_steps", "seed", "updates", "final_heldout_accuracy", "final_heldout_loss",
  "diverged", "curve": [{"samples", "heldout_accuracy", "heldout_loss",
  "train_loss"}]}`` (a non-finite loss is ``null``; the accuracy is ``null``
  where it means nothing: random samples, or an output that is no class
  logits); ``settings`` say what the model trained on (``data``,
  ``synthetic``) and what the runs are compared on (``compared_on``:
  ``accuracy``, or ``heldout_loss`` where no run has an accuracy, when the
  summary's cells hold the final held-out loss); ``summary`` holds, per
  depth, the *reference learning rate* (the largest at which data
  parallelism, or the first strategy run without it, converges in every
  seed) and every strategy's final accuracy at each learning rate, mean,
  minimum and maximum over seeds; ``quadratic_stability``, per
  depth, strategy and stage, the delay and prediction distance of its update
  rule (read off the IR) and the largest lr·h that rule survives on a
  quadratic with the run's momentum;
* ``learning_curves.html``: held-out accuracy and loss against samples, one
  line per strategy (the mean over seeds) with a band from the worst seed to
  the best, one row per depth and learning rate;
* ``final_accuracy.html``: final held-out accuracy per strategy and depth at
  the reference learning rate, the bar the mean over seeds and the whisker
  the spread;
* ``stability.html``: per strategy a map of learning rate × depth, the
  colour the mean final accuracy, cells where some seed diverged marked
  with the number that did;
* the PNGs of the three figures when a browser is present
  (:mod:`pipesim.experiments.export`).

Every stage runs ``optimizer`` (SGD with momentum, or Adam) with one
learning rate for every strategy, warmed up linearly over ``warmup_steps``
updates (:meth:`pipesim.validate.stage.OptimizerConfig.lr_at`); both are in
``settings``, in every run's record and in the figures' titles.

``model`` is any ``--model`` ``pipesim validate`` takes (catalog, ``hf:``,
``torchvision:``, a factory); what each trains on is
:func:`pipesim.validate.usermodels.training_source`'s, ``synthetic``
random samples of its inputs' shapes.

Same inputs, byte-identical files. :data:`PUBLISHED` holds the accuracies
the papers report, for drawing beside these.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipesim.sim.engine.metrics import round_sig
from pipesim.sim.errors import InputError

#: Accuracies (%) the papers publish, by their setting and strategy name as
#: ``pipesim converge`` spells it ("pipedream-nostash" is vanilla
#: asynchronous pipelining; "1f1b" stands for 2BW's synchronous baseline).
PUBLISHED: dict[str, dict] = {
    "spectrain-lstm-imdb": {
        "source": "SpecTrain (Chen, Yang, Cheng, arXiv 1809.02839), its authors' PyTorch port, 4 GPUs",
        "model": "residual LSTM",
        "data": "IMDb",
        "stages": 4,
        "accuracy": {"data-parallel": 81.74, "pipedream-nostash": 78.11, "pipedream": 78.24, "spectrain": 81.24},
    },
    "spectrain-vgg16-cifar10": {
        "source": "SpecTrain (Chen, Yang, Cheng, arXiv 1809.02839), its authors' PyTorch port, 4 GPUs",
        "model": "VGG-16",
        "data": "CIFAR-10",
        "stages": 4,
        "accuracy": {"data-parallel": 91.10, "pipedream-nostash": 88.31, "pipedream": 88.91, "spectrain": 88.11},
    },
    "pipedream-2bw-bert-mnli": {
        "source": "PipeDream-2BW (Narayanan et al., ICML'21, arXiv 2006.09503)",
        "model": "BERT",
        "data": "MNLI",
        "stages": None,
        "accuracy": {"1f1b": 87.77, "pipedream-2bw": 87.82},
    },
}

DEFAULT_STRATEGIES = ("data-parallel", "1f1b", "pipedream-2bw", "pipedream", "pipedream-nostash", "spectrain")
DEFAULT_LRS = (0.01, 0.02, 0.05)
#: The optimizers a run may use (:data:`pipesim.validate.stage.OPTIMIZERS`, named
#: here so that the command line parses without importing torch).
OPTIMIZERS = ("sgd", "adam")
#: The learning rates swept when none are given, per optimizer: Adam's step is
#: about lr per coordinate whatever the gradient's scale, so its rates are
#: ten times smaller than SGD's (1e-3 is torch's and Kingma and Ba's default).
DEFAULT_LRS_BY_OPTIMIZER = {"sgd": DEFAULT_LRS, "adam": (0.0005, 0.001, 0.002)}
#: The warm-up when none is given, as a fraction of the updates, per optimizer:
#: none for SGD (as before), a tenth of the run for Adam.
DEFAULT_WARMUP_FRACTION = {"sgd": 0.0, "adam": 0.1}
#: The strategy whose stability sets each depth's reference learning rate.
BASELINE = "data-parallel"


@dataclass(frozen=True)
class ConvergeConfig:
    """What ``pipesim converge`` runs (every list is swept in full)."""

    model: str = "mlp"
    stages: tuple[int, ...] = (4, 8)
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    lrs: tuple[float, ...] | None = None  # None: DEFAULT_LRS_BY_OPTIMIZER
    seeds: tuple[int, ...] = (0, 1)
    updates: int = 400
    update_batch: int = 32
    eval_every: int = 40  # a multiple of 4 and 8: PipeDream's and SpecTrain's updates per iteration (m = p)
    momentum: float = 0.9
    model_width: int | None = None
    model_depth: int | None = None
    backend: str = "emulator"
    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)
    timeout_s: float = 600.0
    optimizer: str = "sgd"
    warmup_steps: int | None = None  # None: DEFAULT_WARMUP_FRACTION of the updates
    adam_betas: tuple[float, float] = (0.9, 0.999)  # pipesim.validate.convergence.ADAM_BETAS
    adam_eps: float = 1e-8
    synthetic: bool = False  # random samples of the model's input shapes (models from elsewhere)

    def __post_init__(self) -> None:
        # the optimizer's defaults; an unknown optimizer is left for runs_of to refuse
        if self.lrs is None:
            object.__setattr__(self, "lrs", DEFAULT_LRS_BY_OPTIMIZER.get(self.optimizer, DEFAULT_LRS))
        if self.warmup_steps is None and isinstance(self.updates, int):
            fraction = DEFAULT_WARMUP_FRACTION.get(self.optimizer, 0.0)
            object.__setattr__(self, "warmup_steps", int(fraction * self.updates))

    def setup(self):
        """The :class:`~pipesim.validate.convergence.Setup` every run shares."""
        from pipesim.validate.convergence import Setup

        return Setup(
            model=self.model,
            updates=self.updates,
            update_batch=self.update_batch,
            eval_every=self.eval_every,
            momentum=self.momentum,
            model_width=self.model_width,
            model_depth=self.model_depth,
            optimizer=self.optimizer,
            warmup_steps=self.warmup_steps,
            betas=tuple(self.adam_betas),
            eps=self.adam_eps,
            synthetic=self.synthetic,
        )


BACKENDS = ("emulator", "gloo")


def runs_of(cfg: ConvergeConfig) -> list:
    """Every run, each checked (sizes, fairness) before anything trains."""
    from pipesim.validate.convergence import Run, build_run_model, plan, resolve, stage_starts

    if cfg.backend not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
    if cfg.optimizer not in OPTIMIZERS:
        raise InputError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}")
    w = cfg.warmup_steps
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        raise InputError(f"--warmup-steps must be a whole number >= 0, got {w!r}")
    if isinstance(cfg.updates, int) and w > cfg.updates:
        raise InputError(
            f"--warmup-steps {w} is longer than --updates {cfg.updates}: the learning rate would never reach --lr"
        )
    for name, values in (("stages", cfg.stages), ("seeds", cfg.seeds), ("strategies", cfg.strategies), ("lr", cfg.lrs)):
        if not values:
            raise InputError(f"give at least one value for {name}")
        if len(set(values)) != len(values):
            raise InputError(f"{name} repeats a value: {' '.join(map(str, values))}")
    for lr in cfg.lrs:
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise InputError(f"learning rates must be finite numbers > 0, got {lr}")
    for name in cfg.strategies:
        resolve(name)
    setup = cfg.setup()
    for lr in cfg.lrs:  # the optimizer's own checks (momentum in [0, 1), Adam's betas) before anything trains
        setup.optimizer_config(float(lr))
    # a bad model, or one without data (NoTrainingData): one line, before anything trains
    model = build_run_model(setup, memory_check=True)
    layers = model.num_layers
    remedy = "raise --model-depth" if model.origin == "catalog" else "choose a model with more layers"
    runs = []
    for p in cfg.stages:
        stage_starts(layers, p, remedy=remedy)
        for name in cfg.strategies:
            for lr in cfg.lrs:
                for seed in cfg.seeds:
                    run = Run(setup, name, p, float(lr), seed)
                    plan(run)
                    runs.append(run)
    return runs


def _one(run, backend: str, timeout_s: float) -> dict:
    from pipesim.validate.convergence import train, train_distributed

    return train(run) if backend == "emulator" else train_distributed(run, timeout_s=timeout_s)


def _cost(run) -> float:
    """A run's expected work (micro-batch passes), to start the longest first."""
    from pipesim.validate.convergence import plan

    p = plan(run)
    return p.steps * p.spec.iterations * p.spec.microbatches * run.stages


def train_all(cfg: ConvergeConfig, progress: Callable[[int, int, dict], None] | None = None) -> list[dict]:
    """Every run's record, in the configuration's order whatever order they finished in."""
    runs = runs_of(cfg)
    order = sorted(range(len(runs)), key=lambda i: -_cost(runs[i]))
    records: list[dict | None] = [None] * len(runs)
    jobs = 1 if cfg.backend == "gloo" else max(1, min(cfg.jobs, len(runs)))
    if jobs == 1:
        for done, i in enumerate(order, start=1):
            records[i] = _one(runs[i], cfg.backend, cfg.timeout_s)
            if progress:
                progress(done, len(runs), records[i])
        return records
    import multiprocessing

    # a multiprocessing pool, not concurrent.futures: a failed run or Ctrl-C
    # must stop the runs still training, which only Pool.terminate does
    pool = multiprocessing.get_context("spawn").Pool(jobs)
    try:
        tasks = [(i, runs[i], cfg.backend, cfg.timeout_s) for i in order]  # the longest first
        for done, (i, record) in enumerate(pool.imap_unordered(_one_indexed, tasks), start=1):
            records[i] = record
            if progress:
                progress(done, len(runs), record)
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()
    return records


def _one_indexed(task: tuple) -> tuple[int, dict]:
    i, run, backend, timeout_s = task
    return i, _one(run, backend, timeout_s)


# ---------------------------------------------------------------- summary


def _spread(values: Sequence[float | None]) -> dict:
    finite = [v for v in values if v is not None]
    if not finite:
        return {"mean": None, "min": None, "max": None}
    return {"mean": statistics.fmean(finite), "min": min(finite), "max": max(finite)}


def metric(records: list[dict]) -> str:
    """What the runs are compared on: ``"accuracy"`` (held-out), or
    ``"heldout_loss"`` where no run has an accuracy (random samples, or a
    model whose output is no class logits)."""
    return "accuracy" if any(r["final_heldout_accuracy"] is not None for r in records) else "heldout_loss"


def summarize(records: list[dict]) -> dict:
    """Per depth: the reference learning rate (the largest at which
    :data:`BASELINE`, or the first strategy run if it was not, converges in
    every seed) and each strategy's final accuracy at every learning rate
    (mean, min, max over seeds; diverged seeds), under ``"accuracy"``; where
    no run has an accuracy (:func:`metric`), the final held-out loss, under
    ``"heldout_loss"``."""
    key = metric(records)
    field_ = "final_heldout_accuracy" if key == "accuracy" else "final_heldout_loss"
    cells: dict = defaultdict(list)
    for r in records:
        cells[(r["stages"], r["lr"], r["strategy"])].append(r)
    out = {}
    for p in sorted({r["stages"] for r in records}):
        lrs = sorted({r["lr"] for r in records if r["stages"] == p})
        table = {}
        for (stages, lr, name), rs in sorted(cells.items()):
            if stages == p:
                accs = [r[field_] for r in rs]
                table.setdefault(name, {})[str(lr)] = {
                    **_spread(accs),
                    "seeds": len(rs),
                    "diverged": sum(r["diverged"] for r in rs),
                }
        reference = BASELINE if BASELINE in table else next(iter(dict.fromkeys(r["strategy"] for r in records)))
        base = table.get(reference, {})
        stable = [lr for lr in lrs if str(lr) in base and not base[str(lr)]["diverged"]]
        out[str(p)] = {
            "reference_lr": max(stable) if stable else None,
            "reference_strategy": reference,
            key: table,
        }
    return out


def _rounded(x):
    if isinstance(x, float):
        return round_sig(x)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def quadratic_stability(
    strategies: Sequence[str], stages: Sequence[int], momentum: float, optimizer: str = "sgd"
) -> dict:
    """Per depth and strategy, each stage's (delay, distance) of its update
    rule and the largest lr·h that rule survives on a quadratic
    (:func:`~pipesim.validate.convergence.stability_threshold`). The
    threshold is SGD with momentum's; under Adam, whose step is not linear
    in the gradient, it is ``None``."""
    from pipesim.validate.convergence import stability_threshold, update_rule

    out: dict = {}
    for p in stages:
        for name in strategies:
            rule = update_rule(name, p)
            out.setdefault(str(p), {})[name] = [
                {
                    "delay": d,
                    "distance": s,
                    "max_lr_h": stability_threshold(d, s, momentum) if optimizer == "sgd" else None,
                }
                for d, s in rule
            ]
    return out


def lr_schedule(cfg: ConvergeConfig) -> str:
    """The learning-rate schedule in words, for the record."""
    if not cfg.warmup_steps:
        return "constant"
    return f"linear warm-up: update u (from 0) uses lr * min(1, u / {cfg.warmup_steps}), then constant"


def document(cfg: ConvergeConfig, records: list[dict]) -> dict:
    """The content of ``curves.json``."""
    from pipesim.validate.convergence import DIVERGENCE_FACTOR, Run, describe, run_data

    setup = cfg.setup()
    width, depth = setup.size()
    data = run_data(setup)
    layouts = [describe(Run(setup, name, p, cfg.lrs[0], cfg.seeds[0])) for p in cfg.stages for name in cfg.strategies]
    return _rounded(
        {
            "runs": records,
            "summary": summarize(records),
            "settings": {
                "model": cfg.model,
                "model_width": width,
                "model_depth": depth,
                "data": data.description,
                "synthetic": data.synthetic,
                "compared_on": metric(records),
                "optimizer": cfg.optimizer,
                "momentum": cfg.momentum,  # SGD's; unused under Adam
                "warmup_steps": cfg.warmup_steps,
                "lr_schedule": lr_schedule(cfg),
                **({"adam_betas": list(cfg.adam_betas), "adam_eps": cfg.adam_eps} if cfg.optimizer == "adam" else {}),
                "update_batch": cfg.update_batch,
                "updates": cfg.updates,
                "eval_every": cfg.eval_every,
                "backend": cfg.backend,
                "divergence": f"a non-finite loss, a held-out loss above {DIVERGENCE_FACTOR} x the untrained "
                "model's (the run stops there), or a final held-out loss no lower than it",
                "layouts": [
                    {
                        k: v
                        for k, v in lay.items()
                        if k
                        in ("strategy", "stages", "microbatches", "microbatch_size", "iterations_per_step", "updates")
                    }
                    for lay in layouts
                ],
            },
            "published": PUBLISHED,
            "quadratic_stability": quadratic_stability(cfg.strategies, cfg.stages, cfg.momentum, cfg.optimizer),
        }
    )


# ---------------------------------------------------------------- figures


COLORS = (
    "#1F77B4",
    "#FF7F0E",
    "#2CA02C",
    "#D62728",
    "#9467BD",
    "#8C564B",
    "#E377C2",
    "#7F7F7F",
    "#BCBD22",
    "#17BECF",
    "#393B79",
)


def _color(names: list[str], name: str) -> str:
    return COLORS[names.index(name) % len(COLORS)]


def _band_color(hex_color: str, alpha: float = 0.15) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def optimizer_label(doc: dict) -> str:
    """The optimizer and its warm-up in a few words, for the figures' titles."""
    st = doc.get("settings", {})
    if st.get("optimizer", "sgd") == "adam":
        b1, b2 = st.get("adam_betas", (0.9, 0.999))
        label = f"Adam (betas {b1:g}, {b2:g}, eps {st.get('adam_eps', 1e-8):g})"
    else:
        label = f"SGD, momentum {st.get('momentum', 0.9):g}"
    warmup = st.get("warmup_steps")
    return label + (f", lr warm-up {warmup} updates" if warmup else "")


def learning_curves_figure(doc: dict):
    """Held-out accuracy and loss against samples: a row per (depth, lr),
    a line per strategy (mean over seeds) in a band from worst to best seed."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    runs = doc["runs"]
    names = list(dict.fromkeys(r["strategy"] for r in runs))
    rows = sorted({(r["stages"], r["lr"]) for r in runs})
    fig = make_subplots(
        rows=len(rows),
        cols=2,
        shared_xaxes=True,
        vertical_spacing=0.25 / max(len(rows), 1),
        subplot_titles=[f"{p} stages, lr {lr}: held-out {what}" for p, lr in rows for what in ("accuracy", "loss")],
    )
    for row, (p, lr) in enumerate(rows, start=1):
        for name in names:
            rs = [r for r in runs if r["stages"] == p and r["lr"] == lr and r["strategy"] == name]
            if not rs:
                continue
            for col, key in ((1, "heldout_accuracy"), (2, "heldout_loss")):
                by_samples: dict = defaultdict(list)
                for r in rs:
                    for pt in r["curve"]:
                        if pt[key] is not None:
                            by_samples[pt["samples"]].append(pt[key])
                xs = sorted(by_samples)
                mean = [statistics.fmean(by_samples[x]) for x in xs]
                color = _color(names, name)
                diverged = sum(r["diverged"] for r in rs)
                label = name + (f" ({diverged}/{len(rs)} diverged)" if diverged else "")
                fig.add_trace(
                    go.Scatter(
                        x=xs + xs[::-1],
                        y=[max(by_samples[x]) for x in xs] + [min(by_samples[x]) for x in xs][::-1],
                        fill="toself",
                        fillcolor=_band_color(color),
                        line={"width": 0},
                        hoverinfo="skip",
                        showlegend=False,
                        legendgroup=name,
                    ),
                    row=row,
                    col=col,
                )
                fig.add_trace(
                    go.Scatter(
                        x=xs,
                        y=mean,
                        mode="lines",
                        name=name,
                        legendgroup=name,
                        showlegend=row == 1 and col == 1,
                        line={"color": color, "width": 2},
                        hovertemplate=f"{label}<br>%{{x}} samples<br>{key} %{{y:.4g}}<extra></extra>",
                    ),
                    row=row,
                    col=col,
                )
        fig.update_yaxes(range=[0, 1], row=row, col=1)
        fig.update_yaxes(type="log", row=row, col=2)
    fig.update_xaxes(title_text="training samples", row=len(rows))
    model = runs[0]["model"] if runs else ""
    fig.update_layout(
        title={
            "text": f"{model}, {optimizer_label(doc)}: held-out accuracy and loss (mean over seeds, band: worst to best)"
        },
        template="plotly_white",
        height=300 * len(rows) + 120,
        width=1300,
    )
    return fig


def compared_on(doc: dict) -> str:
    """The summary's key, as the document's settings say it:
    ``"accuracy"``, or ``"heldout_loss"`` for runs without an accuracy
    (:func:`metric`); a document without the setting is read by the keys
    its summary has."""
    said = doc.get("settings", {}).get("compared_on")
    if said:
        return said
    return "heldout_loss" if any("heldout_loss" in info for info in doc["summary"].values()) else "accuracy"


def final_accuracy_figure(doc: dict):
    """Final accuracy (or held-out loss, :func:`compared_on`) per strategy
    and depth at each depth's reference learning rate."""
    import plotly.graph_objects as go

    summary = doc["summary"]
    key = compared_on(doc)
    what = "accuracy" if key == "accuracy" else "held-out loss"
    names = list(dict.fromkeys(r["strategy"] for r in doc["runs"]))
    fig = go.Figure()
    for p, info in summary.items():
        lr = info["reference_lr"]
        if lr is None:
            continue
        xs, ys, lo, hi = [], [], [], []
        for name in names:
            cell = info[key].get(name, {}).get(str(lr))
            if cell and cell["mean"] is not None:
                xs.append(name)
                ys.append(cell["mean"])
                lo.append(cell["mean"] - cell["min"])
                hi.append(cell["max"] - cell["mean"])
        fig.add_trace(
            go.Bar(
                x=xs,
                y=ys,
                name=f"{p} stages (lr {lr})",
                error_y={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo},
                hovertemplate=f"%{{x}}<br>{what} %{{y:.4f}}<extra></extra>",
            )
        )
    fig.update_layout(
        barmode="group",
        template="plotly_white",
        width=1100,
        height=520,
        yaxis={"title": f"final {what}", **({"range": [0, 1]} if key == "accuracy" else {})},
        title={
            "text": f"{optimizer_label(doc)}: final {what} at the largest learning rate where data "
            "parallelism converges in every seed (whiskers: worst and best seed)"
        },
    )
    return fig


def stability_figure(doc: dict):
    """Per strategy, learning rate × depth: mean final accuracy, diverged seeds marked."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    summary = doc["summary"]
    key = compared_on(doc)
    what = "accuracy" if key == "accuracy" else "held-out loss"
    names = list(dict.fromkeys(r["strategy"] for r in doc["runs"]))
    depths = sorted(int(p) for p in summary)
    lrs = sorted({r["lr"] for r in doc["runs"]})
    cols = min(3, len(names))
    nrows = math.ceil(len(names) / cols)
    fig = make_subplots(
        rows=nrows, cols=cols, subplot_titles=names, horizontal_spacing=0.08, vertical_spacing=0.3 / nrows
    )
    for i, name in enumerate(names):
        z, text = [], []
        for p in depths:
            cells = summary[str(p)][key].get(name, {})
            z.append([cells[str(lr)]["mean"] if str(lr) in cells else None for lr in lrs])
            text.append(
                [
                    (
                        f"× {cells[str(lr)]['diverged']}/{cells[str(lr)]['seeds']}"
                        if cells.get(str(lr), {}).get("diverged")
                        else f"{cells[str(lr)]['mean']:.3f}"
                        if str(lr) in cells and cells[str(lr)]["mean"] is not None
                        else ""
                    )
                    for lr in lrs
                ]
            )
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=[str(lr) for lr in lrs],
                y=[f"{p} stages" for p in depths],
                text=text,
                texttemplate="%{text}",
                **(
                    {"zmin": 0, "zmax": 1, "colorscale": "Viridis"}
                    if key == "accuracy"
                    else {"colorscale": "Viridis_r"}
                ),
                showscale=i == 0,
                colorbar={"title": what},
                hovertemplate=f"{name}<br>%{{y}}, lr %{{x}}<br>%{{text}}<extra></extra>",
            ),
            row=i // cols + 1,
            col=i % cols + 1,
        )
    fig.update_xaxes(title_text="learning rate", type="category")
    fig.update_layout(
        template="plotly_white",
        width=1300,
        height=280 * nrows + 120,
        title={"text": f"Stability, {optimizer_label(doc)}: mean final {what}; × k/n: k of n seeds diverged"},
    )
    return fig


FIGURES = {
    "learning_curves": learning_curves_figure,
    "final_accuracy": final_accuracy_figure,
    "stability": stability_figure,
}


def write(doc: dict, out: Path, *, png: bool = True) -> list[Path]:
    """``curves.json`` and every figure (HTML, and PNG when possible)."""
    from pipesim.experiments.export import write_png

    written = [out / "curves.json"]
    written[0].write_text(json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")
    for name, make in FIGURES.items():
        fig = make(doc)
        path = out / f"{name}.html"
        fig.write_html(
            path,
            include_plotlyjs=True,
            full_html=True,
            div_id=f"pipesim-{name.replace('_', '-')}",
            config={"displaylogo": False},
        )
        written.append(path)
        if png and write_png(fig, out / f"{name}.png"):
            written.append(out / f"{name}.png")
    return written


def converge(
    cfg: ConvergeConfig, out: Path, *, progress: Callable[[int, int, dict], None] | None = None
) -> tuple[dict, list[Path]]:
    """Train every run of ``cfg``, write ``curves.json`` and the figures into ``out``."""
    records = train_all(cfg, progress)
    doc = document(cfg, records)
    return doc, write(doc, out)


def table(doc: dict) -> list[list[str]]:
    """Rows for the console: per depth, the reference lr and each strategy's
    final accuracy there in % (the held-out loss where the runs have no
    accuracy, :func:`compared_on`; mean, worst..best seed, diverged seeds). Where the
    reference diverged at every lr, a row says so and the others follow at
    the smallest lr run, where they were least likely to diverge too."""
    rows = []
    key = compared_on(doc)
    # in the order --strategies named them (the document's keys are sorted)
    order = list(dict.fromkeys(lay["strategy"] for lay in doc["settings"]["layouts"]))

    def shown(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}" if key == "accuracy" else f"{x:.4f}"

    for p, info in doc["summary"].items():
        lr = None if info["reference_lr"] is None else str(info["reference_lr"])
        if lr is None:
            rows.append([p, "-", f"{info['reference_strategy']} diverged at every learning rate", "", ""])
            lr = min((x for cells in info[key].values() for x in cells), key=float, default=None)
            if lr is None:
                continue
        for name in sorted(info[key], key=lambda n: (order.index(n) if n in order else len(order), n)):
            cell = info[key][name].get(lr)
            if cell:
                rows.append(
                    [
                        p,
                        lr,
                        name,
                        shown(cell["mean"]),
                        f"{shown(cell['min'])}..{shown(cell['max'])}"
                        + (f" ({cell['diverged']}/{cell['seeds']} diverged)" if cell["diverged"] else ""),
                    ]
                )
    return rows

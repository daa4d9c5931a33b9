"""``pipesim converge``: train every strategy on the same samples and compare
held-out accuracy under staleness (:mod:`pipesim.experiments.converge`)."""

from __future__ import annotations

import argparse
import sys

from pipesim.experiments.cli.common import output_dir, table
from pipesim.experiments.cliargs import list_choices, nonnegative, positive, seconds


def _real_models() -> list[str]:
    from pipesim.validate.models import model_names

    return model_names()


def _converge_strategies() -> list[str]:
    from pipesim.validate.convergence import strategy_names

    return strategy_names()


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_parser(subparsers) -> None:
    from pipesim.experiments.converge import (
        DEFAULT_LRS_BY_OPTIMIZER,
        DEFAULT_WARMUP_FRACTION,
        OPTIMIZERS,
        ConvergeConfig,
    )

    d = ConvergeConfig()
    p = subparsers.add_parser("converge", help="train every strategy on the same samples and compare held-out accuracy")
    list_choices(
        p.add_argument(
            "--model",
            default=d.model,
            help="real model: the catalog's (digits: mlp, vgg-small; characters: lstm, gpt-small); "
            "hf:MODEL_TYPE[?field=value&...] or hf:config.json (causal LMs on characters, image classifiers "
            "on digits); torchvision:NAME; module.path:factory or file.py:factory (its own data)",
        ),
        _real_models,
    )
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="train a model without data (a factory that gives none, hf:bert) on random samples of its "
        "inputs' shapes: a loss curve only",
    )
    p.add_argument("--stages", type=positive, nargs="+", default=list(d.stages), help="pipeline depths")
    list_choices(
        p.add_argument(
            "--strategies",
            nargs="+",
            default=list(d.strategies),
            help="strategies (pipedream-nostash: PipeDream without weight stashing)",
        ),
        _converge_strategies,
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=d.optimizer,
        help="every stage's optimizer: sgd (with --momentum) or adam (betas --adam-betas, eps --adam-eps)",
    )
    p.add_argument(
        "--lr",
        type=_positive_float,
        nargs="+",
        default=None,
        help="learning rates, every strategy runs each (default: "
        + "; ".join(f"{' '.join(f'{x:g}' for x in lrs)} for {name}" for name, lrs in DEFAULT_LRS_BY_OPTIMIZER.items())
        + ")",
    )
    p.add_argument(
        "--warmup-steps",
        type=nonnegative,
        default=None,
        help="linear learning-rate warm-up: update u (from 0) uses lr*min(1, u/N), then lr, in every strategy "
        "(default: "
        + "; ".join(
            f"{f'{round(100 * f)}%% of --updates' if f else 'none'} for {name}"
            for name, f in DEFAULT_WARMUP_FRACTION.items()
        )
        + ")",
    )
    p.add_argument(
        "--seeds", type=nonnegative, nargs="+", default=list(d.seeds), help="seeds of the weights and the data order"
    )
    p.add_argument("--updates", type=positive, default=d.updates, help="weight updates per run")
    p.add_argument(
        "--update-batch", type=positive, default=d.update_batch, help="samples per weight update, every strategy"
    )
    p.add_argument(
        "--eval-every",
        type=positive,
        default=d.eval_every,
        help="updates between held-out evaluations (a multiple of the depth for pipedream and spectrain, "
        "which update p times per iteration; --updates a multiple of it)",
    )
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum, in [0, 1) (unused by adam)")
    p.add_argument(
        "--adam-betas",
        type=float,
        nargs=2,
        default=list(d.adam_betas),
        metavar=("BETA1", "BETA2"),
        help="Adam's moment decays, each in [0, 1) (torch's and Megatron-LM's defaults)",
    )
    p.add_argument("--adam-eps", type=_positive_float, default=d.adam_eps, help="Adam's epsilon")
    p.add_argument("--model-width", type=positive, default=None, help="model width (default: the model's for converge)")
    p.add_argument(
        "--model-depth",
        type=positive,
        default=None,
        help="model depth (default: the model's for converge, enough layers for 8 stages)",
    )
    p.add_argument(
        "--backend",
        choices=("emulator", "gloo"),
        default=d.backend,
        help="emulator: one process per run; gloo: the distributed runtime (bit-identical, slower)",
    )
    p.add_argument("--jobs", type=positive, default=d.jobs, help="runs trained at once (emulator)")
    p.add_argument("--timeout", type=seconds, default=d.timeout_s, help="seconds one gloo run may take")
    p.add_argument("--out", default="out/converge", help="output folder")
    p.set_defaults(func=run)


def run(args) -> int:
    from pipesim.experiments.converge import ConvergeConfig, compared_on, converge, runs_of
    from pipesim.experiments.converge import table as accuracy_rows

    out = output_dir(args.out)
    cfg = ConvergeConfig(
        model=args.model,
        stages=tuple(args.stages),
        strategies=tuple(args.strategies),
        lrs=None if args.lr is None else tuple(args.lr),
        seeds=tuple(args.seeds),
        updates=args.updates,
        update_batch=args.update_batch,
        eval_every=args.eval_every,
        momentum=args.momentum,
        model_width=args.model_width,
        model_depth=args.model_depth,
        backend=args.backend,
        jobs=args.jobs,
        timeout_s=args.timeout,
        optimizer=args.optimizer,
        warmup_steps=args.warmup_steps,
        adam_betas=tuple(args.adam_betas),
        adam_eps=args.adam_eps,
        synthetic=args.synthetic,
    )
    total = len(runs_of(cfg))  # every run checked before any trains
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    with tqdm(
        total=total, desc="converge", unit="run", file=sys.stderr, mininterval=0.5 if tty else 10.0, leave=True
    ) as bar:

        def progress(done: int, n: int, record: dict) -> None:
            bar.set_postfix_str(f"{record['strategy']}, {record['stages']} stages, lr {record['lr']}", refresh=False)
            bar.update(1)

        doc, written = converge(cfg, out, progress=progress)
    settings = doc["settings"]
    print(f"{cfg.model} on {settings['data']}")
    shown = "accuracy %" if compared_on(doc) == "accuracy" else "held-out loss"
    print(table(accuracy_rows(doc), ["stages", "lr", "strategy", shown, "seeds (worst..best)"], limit=64))
    if settings["synthetic"]:
        print("random samples: the held-out figures are a loss curve only (no accuracy; nothing there to learn)")
    print(f"wrote {', '.join(p.name for p in written)} to {out}")
    return 0

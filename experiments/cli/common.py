"""What the ``pipesim`` sub-commands share: the schedule, machine and real
model options, the ScheduleSpec and the profile they ask for, the output
folder's check, one simulation with its output files (``simulate`` and
``compare``), the profile a plan is made for (``plan`` and ``compare
--planned``), and the plain-text tables and numbers they print."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

from pipesim.experiments.background import TraceWriter
from pipesim.experiments.cliargs import (
    UsageError,
    list_choices,
    nonnegative,
    positive,
    replica_counts,
)
from pipesim.experiments.progress import no_progress, phase_bar
from pipesim.sim._gc import kept_until_exit, retain
from pipesim.sim.errors import InputError

COMPARE_MODEL, COMPARE_HARDWARE = "vgg16", "pcie-4gpu"
DEFAULT_STAGES = 4
PROGRESS_SPANS = 50_000  # above this, say what is being written and skip the PNG

#: Whether this process is the one-shot console script, which leaves through
#: ``os._exit`` (:func:`pipesim.experiments.cli.console_main`): then ``pipesim
#: simulate`` keeps its one run's objects until exit rather than free them one
#: by one (:func:`pipesim.sim._gc.kept_until_exit`; ``compare`` lets each
#: result go, to bound memory). :func:`pipesim.experiments.cli.main` called in
#: a longer-lived process keeps nothing.
ONE_SHOT = False


class OutputError(InputError):
    """An output folder that cannot be created or written to."""


def output_dir(path: str) -> Path:
    """``path`` created and proven writable, so that a bad ``--out`` (under a
    regular file, read-only) fails in one line before any work, not after a
    long run."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise OutputError(f"cannot write to output folder {path}: {e.strerror or e}") from None
    return out


def strategy_names() -> list[str]:
    from pipesim.sim.strategies import strategy_names as names

    return names()


def executable_strategy_names() -> list[str]:
    """The strategies real tensors can run (the emulator and the runtime): a
    strategy says so itself (``Strategy.executable``)."""
    from pipesim.sim.strategies import strategies

    return [s.name for s in strategies() if s.executable]


def catalog_models() -> list[str]:
    from pipesim.sim.workloads.catalog import measured_model_names, model_names

    return model_names() + measured_model_names()


def hardware_presets() -> list[str]:
    from pipesim.sim.hardware.machines import preset_names

    return preset_names()


#: Strategy options on the command line: spec field -> (flag's type, help).
#: Their defaults are the spec's own (``OPTION_DEFAULTS``), shown in the help.
STRATEGY_FLAGS = {
    "chunks": (positive, "model chunks per device for interleaved-1f1b (v)"),
    "alpha": (float, "AvgPipe: elastic averaging rate"),
    "tau": (positive, "AvgPipe: average every tau iterations"),
    "advance": (nonnegative, "AvgPipe: forwards issued ahead of the 1F1B warm-up"),
    "placement": (str, "AvgPipe: where the replicas run"),
    "flushes": (
        positive,
        "GPipe: flushes per iteration, each of m / flushes micro-batches, their gradients accumulated into one update",
    ),
    "replicas": (
        replica_counts,
        "replicas of each stage, PipeDream's notation: 15,1 runs the first stage on 15 "
        "devices and the second on one (gpipe, 1f1b, pipedream, pipedream-2bw)",
    ),
}


def add_schedule_args(
    p: argparse.ArgumentParser,
    *,
    strategy_required: bool = False,
    one_strategy: bool = True,
    iterations: int = 1,
    stages: int = DEFAULT_STAGES,
    imports_csv: bool = False,
    executable: bool = False,
) -> None:
    """The flags that shape a schedule; ``one_strategy`` adds ``--strategy``
    (``compare`` names several with ``--strategies`` instead), ``iterations``
    and ``stages`` are the defaults the help states, ``imports_csv`` whether
    the command also takes a schedule CSV (whose own sizes then apply),
    ``executable`` whether it runs real tensors (its help then lists only the
    strategies that can)."""
    from pipesim.sim.strategies import OPTION_DEFAULTS, PLACEMENTS

    if one_strategy:
        list_choices(
            p.add_argument("--strategy", required=strategy_required, help="schedule to build"),
            executable_strategy_names if executable else strategy_names,
        )
    p.add_argument(
        "--stages",
        type=positive,
        default=None,
        help="pipeline depth in devices per replica (data-parallel: devices) "
        f"(default: {stages}, or as many as --replicas names)",
    )
    p.add_argument(
        "--microbatches",
        type=positive,
        default=None,
        help="micro-batches per iteration per replica, m (default: 8"
        + ("; an imported CSV: the one a pipesim CSV records, else inferred)" if imports_csv else ")"),
    )
    p.add_argument(
        "--iterations",
        type=positive,
        default=None,
        help=f"iterations K (asynchronous schedules run K*m micro-batches) (default: {iterations}"
        + ("; an imported pipesim CSV: the one it records)" if imports_csv else ")"),
    )
    p.add_argument(
        "--width",
        type=positive,
        default=None,
        help="parallel pipelines w (width x depth; AvgPipe's N_p) (default: the strategy's, 1; avgpipe 2)",
    )
    p.add_argument("--no-stashing", action="store_true", help="pipedream without weight stashing (vanilla)")
    for name, (kind, text) in STRATEGY_FLAGS.items():
        p.add_argument(
            f"--{name}",
            type=kind,
            default=None,
            choices=PLACEMENTS if name == "placement" else None,
            help=f"{text} (default: {OPTION_DEFAULTS[name]})",
        )


def add_machine_args(
    p: argparse.ArgumentParser, *, model: str = "uniform", hardware: str = "ideal", takes_plan: bool = False
) -> None:
    """The model and machine flags; ``model`` and ``hardware`` are the defaults the help states,
    ``takes_plan`` whether the command also takes ``--plan`` (whose run overrides a default)."""
    g = p.add_mutually_exclusive_group()
    list_choices(g.add_argument("--model", default=None, help=f"catalog model (default: {model})"), catalog_models)
    g.add_argument(
        "--profile",
        default=None,
        help="per-layer cost profile: JSON (from `pipesim profile` or hand-written) or PipeDream's graph.txt",
    )
    list_choices(
        p.add_argument(
            "--hardware", default=None, help=f"preset, preset-xN (N nodes) or a JSON file (default: {hardware})"
        ),
        hardware_presets,
    )
    p.add_argument(
        "--microbatch-size", type=positive, default=None, help="samples per micro-batch (default: the model's)"
    )
    p.add_argument(
        "--recv-lookahead",
        type=nonnegative,
        default=None,
        help="post receives this many compute actions early (0 = right before use) "
        + ("(default: 1; with --plan, the plan's)" if takes_plan else "(default: 1)"),
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="activation recomputation, checkpointed per layer: every backward re-runs its stage's "
        "forward, and a micro-batch keeps only its layers' inputs until then",
    )


#: What ``--model`` takes, for ``model_args``'s help.
MODEL_HELP = (
    "real model: mlp, gpt-small, vgg-small or lstm; hf:MODEL_TYPE[?field=value&...] or hf:path/to/config.json "
    "(transformers, random weights: gpt2, bert, llama, mistral, qwen2, resnet, vit; e.g. hf:gpt2?n_layer=4); "
    "torchvision:NAME; module.path:factory or path/to/file.py:factory (docs/how-to/bring-your-own-model.md)"
)


def model_args(p: argparse.ArgumentParser) -> None:
    """The real model's flags (``profile`` and ``validate``)."""
    p.add_argument("--model", default="mlp", help=MODEL_HELP)
    p.add_argument("--model-width", type=positive, default=None, help="model width (hidden size / channels)")
    p.add_argument("--model-depth", type=positive, default=None, help="model depth (hidden layers / blocks)")
    p.add_argument("--microbatch-size", type=positive, default=32, help="samples per micro-batch")
    p.add_argument("--seed", type=nonnegative, default=0, help="seed of the weights and the data order")


def schedule_spec(args, strategy: str | None = None):
    """The ScheduleSpec the arguments ask for.

    With ``strategy`` given (``compare``), options that strategy does not
    take are left out, so one set of flags can drive every strategy;
    otherwise an option the strategy does not use is an error.
    """
    from pipesim.sim.strategies import ScheduleSpec, StrategyError, get_strategy
    from pipesim.sim.strategies import strategy_options as options_of

    name = strategy if strategy is not None else args.strategy
    options = given_strategy_options(args, strategy)
    if strategy is None:  # a flag given for an option the strategy ignores is a mistake, even at its default
        get_strategy(name)  # an unknown name first, naming the choices
        ignored = sorted(set(options) - set(options_of(name)))
        if ignored:
            raise StrategyError(f"{flag_of(ignored[0])} does not apply to {name}")
    return ScheduleSpec(
        strategy=name,
        stages=args.stages,
        microbatches=args.microbatches or 8,
        iterations=args.iterations or 1,
        **options,
    )


def given_strategy_options(args, strategy: str | None = None) -> dict:
    """The strategy options given on the command line (see :func:`schedule_spec`)."""
    from pipesim.sim.strategies import strategy_options as options_of

    given = {}
    if args.no_stashing:
        given["stashing"] = False
    for option in (*STRATEGY_FLAGS, "width"):
        value = getattr(args, option, None)
        if value is not None:
            given[option] = value
    if strategy is not None:
        given = {k: v for k, v in given.items() if k in options_of(strategy)}
    return given


def flag_of(option: str) -> str:
    """The command-line flag that sets strategy option ``option``."""
    return "--no-stashing" if option == "stashing" else f"--{option}"


def _profile_file(args):
    """``--profile``'s profile at ``--microbatch-size`` (one rule for every
    command: :func:`~pipesim.sim.workloads.profile.at_microbatch_size`)."""
    from pipesim.sim.workloads.profile import at_microbatch_size
    from pipesim.sim.workloads.readers import load_profile

    return at_microbatch_size(load_profile(args.profile), args.microbatch_size)


def _profile(args, hardware, schedule, uniform_layers: int | None = None):
    from pipesim.sim.api import model_for

    if args.profile:
        return _profile_file(args)
    return model_for(
        schedule,
        args.model or "uniform",
        hardware,
        args.microbatch_size,
        pipeline_depth=args.stages,
        uniform_layers=uniform_layers,
    )


def plan_profile(args, hardware, devices: int):
    """The profile a plan is made for: ``--profile``, or the catalog model on
    the hardware's device (``uniform``: one layer per device, as a pipeline of
    that depth gets)."""
    from pipesim.sim.workloads.catalog import model_profile

    if args.profile:
        return _profile_file(args)
    model = args.model or "uniform"
    return model_profile(model, hardware.device, args.microbatch_size, layers=devices if model == "uniform" else None)


def recorded_path(path: str | None) -> str | None:
    """A file a plan records (its profile): absolute, so the plan runs from
    any folder."""
    return None if path is None else os.path.abspath(path)


def simulate_one(
    args,
    strategy: str | None,
    out: Path | None,
    *,
    outputs: bool = True,
    keep: bool = False,
    plan=None,
    spec=None,
    built=None,
    uniform_layers: int | None = None,
) -> dict:
    """Simulate one schedule: ``plan`` (a :class:`~pipesim.sim.planning.plan.PlanFile`)
    gives the strategy, replicas and split, ``spec`` its run (default: the
    plan's, with the command line's micro-batches and iterations); else
    ``--schedule``, or the strategy with the command line's options.
    ``built``: that schedule, already built (and its size checked) by the
    caller; ``uniform_layers``: the ``uniform`` model's layers, where
    several runs must share one model (:func:`pipesim.experiments.cli.compare._uniform_layers`)."""
    from pipesim.sim.api import resolve_hardware, simulate_schedule
    from pipesim.sim.engine.metrics import summarize, write_summary
    from pipesim.sim.engine.size import check_size, estimate_work
    from pipesim.sim.strategies import build_schedule

    hw = resolve_hardware(args.hardware or "ideal")
    phases = ["simulating", "summarizing"]
    if out is not None and outputs:  # in the order simulate_one steps through them
        phases = ["simulating", "writing trace.json", "summarizing", "writing timeline.html"]
    if getattr(args, "schedule", None):
        from pipesim.sim.interchange import load_schedule_csv

        # the engine validates the structure and names a deadlock itself, so
        # the import's own checks would only run everything twice
        schedule = load_schedule_csv(
            args.schedule, microbatches=args.microbatches, iterations=args.iterations, check=False
        )
        spec, passes = None, sum(map(len, schedule.programs)) // 2
    else:
        if spec is None:
            spec = plan.spec(args.microbatches, args.iterations) if plan is not None else schedule_spec(args, strategy)
        if built is None:
            check_size(spec)
            phases.insert(0, "building the schedule")
        passes = estimate_work(spec) or 0
    with phase_bar(phases, passes) as step:
        if spec is not None:
            schedule = built
            if schedule is None:
                step("building the schedule")
                schedule = build_schedule(spec)
        profile = _profile(args, hw, schedule, uniform_layers)
        if plan is not None and plan.layers != len(profile.layers):
            raise UsageError(f"the plan splits {plan.layers} layers; {profile.name} has {len(profile.layers)}")
        if plan is not None and plan.gpus is not None and schedule.num_devices != plan.gpus:
            raise UsageError(f"the plan says {plan.gpus} devices, but its stages run on {schedule.num_devices}")
        step("simulating")
        # trace.json, the slowest file, is written beside the tracking, the
        # summary and the timeline (pipesim.experiments.background)
        trace = _trace_writer(out, step) if out is not None and outputs else None
        with trace or nullcontext():
            with kept_until_exit(keep and ONE_SHOT):
                result = simulate_schedule(
                    schedule,
                    profile,
                    hw,
                    recv_lookahead=args.recv_lookahead,
                    starts=None if plan is None else plan.starts,
                    recompute=bool(getattr(args, "recompute", False) or (plan is not None and plan.recompute)),
                    on_spans=None if trace is None else trace.start,
                )
                retain(result)
            if trace is not None:
                trace.hand_over(result)
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
            step("summarizing")
            summary = summarize(result)
            if plan is not None:
                from pipesim.sim.engine.metrics import round_sig
                from pipesim.sim.planning.plan import steady_state

                rate, windowed = steady_state(result)
                summary["plan"] = {
                    "config": plan.config,
                    "predicted_samples_per_s": plan.predicted_samples_per_s,
                    "predicted_is_simulated": plan.predicted_is_simulated,
                    "predicted_is_steady": plan.predicted_is_steady,
                    "steady_samples_per_s": round_sig(rate),
                    "steady_window": windowed,
                }
            if out is not None:
                write_summary(summary, out / "summary.json")
                if outputs:
                    _write_timeline(result, out, step)
    return summary


def _trace_writer(out: Path, step) -> TraceWriter:
    """The writer of ``out/trace.json``, which says, when it starts on a big
    run, that the slow files are being written (a progress bar names the
    phase itself)."""

    def announce(spans: int) -> None:
        if spans > PROGRESS_SPANS and step is no_progress:
            print(f"writing trace.json and timeline.html ({spans:,} spans) ...", file=sys.stderr, flush=True)
        step("writing trace.json")

    return TraceWriter(out / "trace.json", announce=announce)


def _write_timeline(result, out: Path, step) -> None:
    """timeline.html and, for small runs with a browser at hand, timeline.png."""
    from pipesim.experiments.export import png_supported, write_png
    from pipesim.experiments.timeline import timeline_figure, write_timeline_html

    step("writing timeline.html")
    write_timeline_html(result, out / "timeline.html")
    if len(result.spans) <= PROGRESS_SPANS and png_supported():  # a browser renders it; skip for huge timelines
        write_png(timeline_figure(result), out / "timeline.png")


def rate(samples_per_s: float | None) -> str:
    """A throughput; n/a when the run took no time (a profile of zero costs)."""
    return "n/a" if samples_per_s is None else f"{samples_per_s:.1f}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def table(rows: list[list[str]], header: list[str], *, limit: int = 16) -> str:
    """A plain-text table; beyond ``limit`` rows, runs of rows equal but for
    their first column are merged ("0-63"), and what is left is elided in
    the middle so a 64-device run stays readable."""
    merged: list[list[str]] = []
    for r in rows:
        if merged and merged[-1][1:] == r[1:] and len(rows) > limit:
            first = merged[-1][0].split("-")[0]
            merged[-1] = [f"{first}-{r[0]}", *r[1:]]
        else:
            merged.append(list(r))
    rows = merged
    if len(rows) > limit:
        keep = limit // 2
        rows = rows[:keep] + [["..."] + [""] * (len(header) - 1)] + rows[-keep:]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows
    ]
    return "\n".join(out)


def progress(msg: str) -> None:
    """A progress line on stderr (``profile`` and ``validate``)."""
    print(msg, file=sys.stderr, flush=True)

"""The ``pipesim`` command line.

Sub-commands:

* ``simulate``: one strategy (or an imported schedule CSV) on a model and a
  machine; prints a table, writes summary.json, trace.json, timeline.html;
* ``compare``: several strategies on the same model and machine (the
  default job: ``pipesim compare`` with no arguments);
* ``schedule``: print a strategy's per-device order (torch CSV or pipesim CSV);
* ``sweep``: a grid of configurations (strategy x stages x micro-batches x
  hardware x model x options) on local workers or Ray; sweep.json, sweep.csv,
  sweep.html (:mod:`pipesim.experiments.sweep`);
* ``figure``: paper-style figures (``bubbles``);
* ``profile``: measure a real model and this machine's links, writing the
  profile and hardware JSON that ``simulate`` takes;
* ``validate``: profile, simulate, run for real (gloo, NCCL or one device)
  and reconcile: report.json, overlay.html, trace.json;
* ``bench``: every benchmark, by the layer it measures (:mod:`pipesim.experiments.bench`);
* ``converge``: train every strategy on the same samples and compare held-out
  accuracy under staleness (:mod:`pipesim.experiments.converge`).

Exit codes tell the truth (:mod:`pipesim.sim.errors`):

* **2**, one line on stderr: bad input. Every library check raises an
  :class:`~pipesim.sim.errors.InputError` with a one-line message, and the
  argument parser is told to behave the same way.
* **1**, with the failing rank's traceback and a hint: a run that failed
  (:class:`~pipesim.sim.errors.RunError`: a worker raised or died, a launch
  or a collective timed out).
* **1**, with the full traceback: anything else, which is a bug in pipesim
  and is never disguised as bad input.
* **130**: interrupted (Ctrl-C); every worker is stopped first.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from pipesim.experiments.background import TraceWriter
from pipesim.experiments.progress import no_progress, phase_bar
from pipesim.sim._gc import kept_until_exit, retain
from pipesim.experiments.cliargs import (
    Parser,
    UsageError,
    list_choices,
    nonnegative,
    positive,
    replica_counts,
    run_command,
    seconds,
)
from pipesim.sim.errors import InputError

COMPARE_MODEL, COMPARE_HARDWARE = "vgg16", "pcie-4gpu"
COMPARE_ITERATIONS = 4
DEFAULT_STAGES = 4
PROGRESS_SPANS = 50_000  # above this, say what is being written and skip the PNG

#: Whether this process is the one-shot console script, which leaves through
#: ``os._exit`` (:func:`console_main`): then ``pipesim simulate`` keeps its one
#: run's objects until exit rather than free them one by one
#: (:func:`pipesim.sim._gc.kept_until_exit`; ``compare`` lets each result go,
#: to bound memory). :func:`main` called in a longer-lived process keeps nothing.
_ONE_SHOT = False


class OutputError(InputError):
    """An output folder that cannot be created or written to."""


def _output_dir(path: str) -> Path:
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


def _strategy_names() -> list[str]:
    from pipesim.sim.strategies import strategy_names

    return strategy_names()


def _catalog_models() -> list[str]:
    from pipesim.sim.workloads.catalog import measured_model_names, model_names

    return model_names() + measured_model_names()


def _hardware_presets() -> list[str]:
    from pipesim.sim.hardware.machines import preset_names

    return preset_names()


def _plannable() -> list[str]:
    from pipesim.sim.planning.plan import plannable

    return plannable()


def _real_models() -> list[str]:
    from pipesim.validate.models import model_names

    return model_names()


#: Strategy options on the command line: spec field -> (flag's type, help).
#: Their defaults are the spec's own (``OPTION_DEFAULTS``), shown in the help.
_STRATEGY_FLAGS = {
    "chunks": (positive, "model chunks per device for interleaved-1f1b (v)"),
    "alpha": (float, "AvgPipe: elastic averaging rate"),
    "tau": (positive, "AvgPipe: average every tau iterations"),
    "advance": (nonnegative, "AvgPipe: forwards issued ahead of the 1F1B warm-up"),
    "placement": (str, "AvgPipe: where the replicas run"),
    "replicas": (replica_counts, "replicas of each stage, PipeDream's notation: 15,1 runs the first stage on 15 "
                                 "devices and the second on one (gpipe, 1f1b, pipedream, pipedream-2bw)"),
}


def _add_schedule_args(p: argparse.ArgumentParser, *, strategy_required: bool = False, one_strategy: bool = True,
                       iterations: int = 1, stages: int = DEFAULT_STAGES, imports_csv: bool = False) -> None:
    """The flags that shape a schedule; ``one_strategy`` adds ``--strategy``
    (``compare`` names several with ``--strategies`` instead), ``iterations``
    and ``stages`` are the defaults the help states, ``imports_csv`` whether
    the command also takes a schedule CSV (whose own sizes then apply)."""
    from pipesim.sim.strategies import OPTION_DEFAULTS, PLACEMENTS

    if one_strategy:
        list_choices(p.add_argument("--strategy", required=strategy_required, help="schedule to build"),
                     _strategy_names)
    p.add_argument("--stages", type=positive, default=None,
                   help="pipeline depth in devices per replica (data-parallel: devices) "
                        f"(default: {stages}, or as many as --replicas names)")
    p.add_argument("--microbatches", type=positive, default=None,
                   help="micro-batches per iteration per replica, m (default: 8"
                        + ("; an imported CSV: the one a pipesim CSV records, else inferred)" if imports_csv else ")"))
    p.add_argument("--iterations", type=positive, default=None,
                   help=f"iterations K (asynchronous schedules run K*m micro-batches) (default: {iterations}"
                        + ("; an imported pipesim CSV: the one it records)" if imports_csv else ")"))
    p.add_argument("--width", type=positive, default=None,
                   help="parallel pipelines w (width x depth; AvgPipe's N_p) (default: the strategy's, 1; avgpipe 2)")
    p.add_argument("--no-stashing", action="store_true", help="pipedream without weight stashing (vanilla)")
    for name, (kind, text) in _STRATEGY_FLAGS.items():
        p.add_argument(f"--{name}", type=kind, default=None, choices=PLACEMENTS if name == "placement" else None,
                       help=f"{text} (default: {OPTION_DEFAULTS[name]})")


def _add_machine_args(p: argparse.ArgumentParser, *, model: str = "uniform", hardware: str = "ideal",
                      takes_plan: bool = False) -> None:
    """The model and machine flags; ``model`` and ``hardware`` are the defaults the help states,
    ``takes_plan`` whether the command also takes ``--plan`` (whose run overrides a default)."""
    g = p.add_mutually_exclusive_group()
    list_choices(g.add_argument("--model", default=None, help=f"catalog model (default: {model})"), _catalog_models)
    g.add_argument("--profile", default=None,
                   help="per-layer cost profile: JSON (from `pipesim profile` or hand-written) or PipeDream's "
                        "graph.txt")
    list_choices(p.add_argument("--hardware", default=None,
                                help=f"preset, preset-xN (N nodes) or a JSON file (default: {hardware})"),
                 _hardware_presets)
    p.add_argument("--microbatch-size", type=positive, default=None,
                   help="samples per micro-batch (default: the model's)")
    p.add_argument("--recv-lookahead", type=nonnegative, default=None,
                   help="post receives this many compute actions early (0 = right before use) "
                        + ("(default: 1; with --plan, the plan's)" if takes_plan else "(default: 1)"))
    p.add_argument("--recompute", action="store_true",
                   help="activation recomputation, checkpointed per layer: every backward re-runs its stage's "
                        "forward, and a micro-batch keeps only its layers' inputs until then")


def _spec(args, strategy: str | None = None):
    """The ScheduleSpec the arguments ask for.

    With ``strategy`` given (``compare``), options that strategy does not
    take are left out, so one set of flags can drive every strategy;
    otherwise an option the strategy does not use is an error.
    """
    from pipesim.sim.strategies import ScheduleSpec, StrategyError, get_strategy, strategy_options

    name = strategy if strategy is not None else args.strategy
    options = _strategy_options(args, strategy)
    if strategy is None:  # a flag given for an option the strategy ignores is a mistake, even at its default
        get_strategy(name)  # an unknown name first, naming the choices
        ignored = sorted(set(options) - set(strategy_options(name)))
        if ignored:
            raise StrategyError(f"{_flag_of(ignored[0])} does not apply to {name}")
    return ScheduleSpec(strategy=name, stages=args.stages, microbatches=args.microbatches or 8,
                        iterations=args.iterations or 1, **options)


def _strategy_options(args, strategy: str | None = None) -> dict:
    """The strategy options given on the command line (see :func:`_spec`)."""
    from pipesim.sim.strategies import strategy_options

    given = {}
    if args.no_stashing:
        given["stashing"] = False
    for option in (*_STRATEGY_FLAGS, "width"):
        value = getattr(args, option, None)
        if value is not None:
            given[option] = value
    if strategy is not None:
        given = {k: v for k, v in given.items() if k in strategy_options(strategy)}
    return given


def _option_flags(args) -> list[str]:
    """The flags that gave the command line's strategy options, as typed."""
    return list(map(_flag_of, _strategy_options(args)))


def _flag_of(option: str) -> str:
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
    return model_for(schedule, args.model or "uniform", hardware, args.microbatch_size, pipeline_depth=args.stages,
                     uniform_layers=uniform_layers)


def _simulate_one(args, strategy: str | None, out: Path | None, *, outputs: bool = True,
                  keep: bool = False, plan=None, spec=None, built=None, uniform_layers: int | None = None) -> dict:
    """Simulate one schedule: ``plan`` (a :class:`~pipesim.sim.planning.plan.PlanFile`)
    gives the strategy, replicas and split, ``spec`` its run (default: the
    plan's, with the command line's micro-batches and iterations); else
    ``--schedule``, or the strategy with the command line's options.
    ``built``: that schedule, already built (and its size checked) by the
    caller; ``uniform_layers``: the ``uniform`` model's layers, where
    several runs must share one model (:func:`_uniform_layers`)."""
    from pipesim.sim.api import resolve_hardware, simulate_schedule
    from pipesim.sim.engine.metrics import summarize, write_summary
    from pipesim.sim.engine.size import check_size, estimate_work
    from pipesim.sim.strategies import build_schedule

    hw = resolve_hardware(args.hardware or "ideal")
    phases = ["simulating", "summarizing"]
    if out is not None and outputs:  # in the order _simulate_one steps through them
        phases = ["simulating", "writing trace.json", "summarizing", "writing timeline.html"]
    if getattr(args, "schedule", None):
        from pipesim.sim.interchange import load_schedule_csv

        # the engine validates the structure and names a deadlock itself, so
        # the import's own checks would only run everything twice
        schedule = load_schedule_csv(args.schedule, microbatches=args.microbatches, iterations=args.iterations,
                                     check=False)
        spec, passes = None, sum(map(len, schedule.programs)) // 2
    else:
        if spec is None:
            spec = plan.spec(args.microbatches, args.iterations) if plan is not None else _spec(args, strategy)
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
            with kept_until_exit(keep and _ONE_SHOT):
                result = simulate_schedule(schedule, profile, hw, recv_lookahead=args.recv_lookahead,
                                           starts=None if plan is None else plan.starts,
                                           recompute=bool(getattr(args, "recompute", False) or (plan is not None and plan.recompute)),
                                           on_spans=None if trace is None else trace.start)
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
                summary["plan"] = {"config": plan.config, "predicted_samples_per_s": plan.predicted_samples_per_s,
                                   "predicted_is_simulated": plan.predicted_is_simulated,
                                   "predicted_is_steady": plan.predicted_is_steady,
                                   "steady_samples_per_s": round_sig(rate), "steady_window": windowed}
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


def _rate(samples_per_s: float | None) -> str:
    """A throughput; n/a when the run took no time (a profile of zero costs)."""
    return "n/a" if samples_per_s is None else f"{samples_per_s:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]], header: list[str], *, limit: int = 16) -> str:
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
    out += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in rows]
    return "\n".join(out)


def _print_summary(s: dict) -> None:
    print(f"{s['strategy']}: {s['stages']} stages on {s['devices_count']} devices, "
          f"{s['microbatches']} micro-batches x {s['iterations']} iterations "
          f"({s['meta'].get('model')} on {s['meta'].get('hardware')})")
    print(f"iteration time {s['iteration_time_s'] * 1e3:.3f} ms, throughput "
          f"{_rate(s['throughput_samples_per_s'])} samples/s, bubble {s['bubble_fraction']:.3f}")
    rows = []
    for d in s["devices"]:
        rows.append([str(d["id"]), f"{d['bubble_fraction']:.3f}", _fmt_bytes(d["peak_memory_bytes"]),
                     _fmt_bytes(d["memory_breakdown"]["activations"]), "OOM" if d["out_of_memory"] else ""])
    print(_table(rows, ["device", "bubble", "peak memory", "activations", ""]))
    rows = []
    for st in s["stages_info"]:
        row = [str(st["stage"]), str(st["weight_versions"]), str(st["staleness_max"]), f"{st['staleness_mean']:.2f}"]
        if "prediction_distance_fwd" in st:
            row += [str(st["prediction_distance_fwd"]), str(st["prediction_distance_bwd"])]
        rows.append(row)
    header = ["stage", "versions", "staleness max", "staleness mean"]
    if rows and len(rows[0]) > 4:
        header += ["s_fwd", "s_bwd"]
    print(_table(rows, header))


def cmd_simulate(args) -> int:
    plan = _plan_arguments(args) if args.plan else None
    if not args.strategy and not args.schedule:
        raise UsageError("pipesim simulate: give --strategy NAME, --schedule FILE.csv or --plan FILE")
    if args.schedule and (args.strategy or _strategy_options(args)):
        given = ["--strategy"] * bool(args.strategy) + _option_flags(args)
        raise UsageError(f"pipesim simulate: {', '.join(given)} configure a strategy to build, but --schedule "
                         "imports one whose order is given; leave them out")
    out = _output_dir(args.out)
    started = time.perf_counter()
    summary = _simulate_one(args, None, out, outputs=not args.summary_only, keep=True, plan=plan)
    if args.json:
        from pipesim.sim.engine.metrics import dumps

        sys.stdout.write(dumps(summary))
    else:
        _print_summary(summary)
        if plan is not None:
            p = summary["plan"]
            if p["steady_window"]:
                this_run = (f"this run {p['steady_samples_per_s']:.1f} in steady state, "
                            f"{_rate(summary['throughput_samples_per_s'])} over the whole run "
                            "(fill and drain included)")
            else:  # nothing to leave out: say so rather than call the whole run steady
                this_run = (f"this run {_rate(summary['throughput_samples_per_s'])} over the whole run, too short "
                            "for a steady state (no whole period between its fill and its drain: run more iterations)")
            planned = "in steady state" if p["predicted_is_steady"] else "over its whole run"
            if not p["predicted_is_simulated"]:
                planned += " (the cost model's)"
            print(f"plan {p['config']}: planned {p['predicted_samples_per_s']:.1f} samples/s {planned}; " + this_run)
        written = "summary.json" if args.summary_only else "summary.json, trace.json, timeline.html"
        print(f"wrote {written} to {out} in {time.perf_counter() - started:.2f} s")
    return 0


def _plan_arguments(args):
    """Read ``--plan``: its strategy, replicas and split, and by default its
    model, hardware and run; a flag that would contradict it is an error."""
    from pipesim.sim.planning.plan import load_plan

    if args.schedule:
        raise UsageError("pipesim simulate: --plan and --schedule both give the schedule; choose one")
    plan = load_plan(args.plan)
    if args.strategy and args.strategy != plan.strategy:
        raise UsageError(f"pipesim simulate: the plan is for {plan.strategy}, not {args.strategy}")
    fixed = [f"--{k}" for k in ("replicas", "width") if getattr(args, k, None) is not None] + \
        ["--stages"] * (args.stages_given and args.stages != len(plan.replicas))
    if fixed:
        raise UsageError(f"pipesim simulate: the plan fixes the stages and their replicas; leave out {fixed[0]}")
    options = _option_flags(args)
    if options:
        raise UsageError(f"pipesim simulate: the plan fixes the strategy's options (it was chosen with them); "
                         f"leave out {options[0]}")
    args.strategy = plan.strategy
    if not args.model and not args.profile:
        if plan.model is None and plan.profile is None:
            raise UsageError("pipesim simulate: the plan names no model or profile; give --model or --profile")
        args.model, args.profile = plan.model if plan.profile is None else None, plan.profile
    args.hardware = args.hardware or plan.machine()
    if args.recv_lookahead is None:
        args.recv_lookahead = plan.recv_lookahead
    args.microbatch_size = args.microbatch_size or plan.microbatch_size
    return plan


def _compared(names: str | None) -> list[str]:
    """The strategies ``--strategies`` names (default: all), each once, all
    checked before the first is simulated."""
    from pipesim.sim.strategies import get_strategy

    if names is None:
        return _strategy_names()
    chosen = list(dict.fromkeys(n.strip() for n in names.split(",")))
    for name in chosen:
        get_strategy(name)  # a one-line StrategyError naming the choices
    return chosen


def cmd_compare(args) -> int:
    from pipesim.sim.engine.metrics import dumps

    if args.one_strategy is not None:
        raise UsageError(f"pipesim compare: name the strategies to compare with --strategies (comma-separated), "
                         f"e.g. --strategies {args.one_strategy}")
    strategies = _compared(args.strategies)
    built, depths = _check_compared(args, strategies)
    layers = _uniform_layers(args, depths)
    out = _output_dir(args.out)
    plans, left_out = _compare_plans(args, strategies, out, layers) if args.planned else ({}, {})
    strategies = [name for name in strategies if name not in left_out]
    if not strategies:
        raise UsageError("pipesim compare: nothing left to compare: " + "; ".join(left_out.values()))
    for name, why in left_out.items():
        print(f"left out {name}: {why}", file=sys.stderr, flush=True)
    rows, summaries = [], {}
    base = None
    for i, strategy in enumerate(strategies, 1):
        print(f"[{i}/{len(strategies)}] simulating {strategy} ...", file=sys.stderr, flush=True)
        planned = plans[strategy][0] if strategy in plans else None
        s = _simulate_one(args, strategy, out / strategy, outputs=True, plan=planned,
                          spec=None if planned is None else planned.spec(), built=built.pop(strategy, None),
                          uniform_layers=layers)
        summaries[strategy] = s
        if base is None:
            base = s["throughput_samples_per_s"]
        row = [
            strategy, str(s["devices_count"]), f"{s['iteration_time_s'] * 1e3:.2f}",
            _rate(s["throughput_samples_per_s"]), _ratio(s["throughput_samples_per_s"], base),
            f"{s['bubble_fraction']:.3f}", _fmt_bytes(s["peak_memory_bytes_max"]),
            str(max(st["staleness_max"] for st in s["stages_info"])),
            "yes" if s["out_of_memory"] else "",
        ]
        if args.planned:
            row[1:1] = [s["plan"]["config"] if "plan" in s else "", f"{s['microbatches']}x{s['iterations']}"]
        rows.append(row)
    first = next(iter(summaries.values()))
    print(f"{first['meta'].get('model')} on {first['meta'].get('hardware')}, "
          f"{args.stages} {'devices' if args.planned else 'stages'}, {args.microbatches or 8} micro-batches, "
          f"{args.iterations} iteration(s)" + (" (a planned run may need another: run = m x iterations)"
                                                if args.planned else ""))
    header = ["strategy", "devices", "iter ms", "samples/s", f"vs {strategies[0]}", "bubble", "peak mem", "staleness",
              "OOM"]
    if args.planned:
        header[1:1] = ["config", "run"]
    print(_table(rows, header))
    # sorted keys keep the JSON byte-stable; "order" keeps the table's order
    document = {"order": strategies, "strategies": summaries}
    if plans:
        document["plans"] = {name: _without_time(record) for name, (_, record) in plans.items()}
    if left_out:
        document["left_out"] = left_out
        print("left out (no configuration it can run was planned): " + ", ".join(left_out))
    (out / "comparison.json").write_text(dumps(document))
    from pipesim.experiments.figures import write_comparison

    write_comparison(strategies, summaries, out)
    print(f"wrote {out}/comparison.html, comparison.json and {out}/<strategy>/timeline.html, trace.json, summary.json"
          + (", plan.json, pareto.html" if plans else ""))
    return 0


def cmd_sweep(args) -> int:
    from pipesim.experiments import sweep

    grid = sweep.grid_from_args(args)  # every value checked before any work
    if args.ray is not None:
        sweep.check_ray_address(args.ray)
        sweep.import_ray()
    out = _output_dir(args.out)
    started = time.perf_counter()
    doc = sweep.run_sweep(grid, workers=args.workers, ray=args.ray)
    seconds = time.perf_counter() - started
    written = sweep.write_outputs(doc, out)  # before any printing: a reader that stops early loses no file
    ran = sweep.local_workers(len(doc["points"]), args.workers)
    where = (f"Ray ({args.ray})" if args.ray else f"{ran} local worker(s)"
             + (f" of the {args.workers} asked for (one per chunk of points)"
                if args.workers and ran < args.workers else ""))
    print(f"{len(doc['points'])} points: {doc['simulated']} simulated, {doc['skipped']} skipped, "
          f"{sum(bool(p.get('out_of_memory')) for p in doc['points'])} out of memory; "
          f"{seconds:.2f} s on {where}")
    for reason, count in list(sweep.skip_reasons(doc).items())[:3]:
        print(f"  skipped {count}: {reason}")
    rows = [[p["model"], p["hardware"], sweep.label(p, doc["axes"]),
             _rate(p["throughput_samples_per_s"]), _fmt_bytes(p["peak_memory_bytes_max"])]
            for p in sweep.best_points(doc)]
    if rows:
        print("fastest configuration that fits in memory:")
        print(_table(rows, ["model", "hardware", "configuration", "samples/s", "peak mem"]))
    else:
        print("no point ran and fit in memory: nothing to recommend")
    print(f"wrote {', '.join(written)} to {out}")
    return 0


def _uniform_layers(args, depths: dict) -> int | None:
    """The layers of the one ``uniform`` model every compared strategy runs:
    as many as the most model stages any of them has (``depths``, by
    strategy: interleaving's p·v), and at least ``--stages``, so each gets
    whole layers. None for any other model (a catalog model's layers are
    its own)."""
    if args.profile or (args.model or COMPARE_MODEL) != "uniform":
        return None
    return max([args.stages, *depths.values()])


def _check_compared(args, strategies: list[str]) -> tuple[dict, dict]:
    """Refuse, in one line and before any planning or simulating, what one
    of the compared strategies cannot run: a machine with fewer devices than
    asked for, and, for each strategy simulated as asked (not planned), the
    sizes it refuses (data parallelism splits the micro-batches evenly over
    the devices, 2BW needs at least as many as stages). Returns the
    schedules built for the check, by strategy, for the runs to use: as many
    as half this machine's available memory holds together (each alone
    passed the size check; a strategy whose schedule is not kept builds it
    again for its run); and every checked strategy's model stages."""
    from pipesim.sim.api import resolve_hardware
    from pipesim.sim.planning.plan import plannable
    from pipesim.sim.engine.size import BYTES_PER_PASS, available_memory_bytes, check_size, estimate_passes
    from pipesim.sim.strategies import build_schedule

    hw = resolve_hardware(args.hardware or "ideal")
    if args.planned:
        hw.check_devices(args.stages)
    built, depths = {}, {}
    available = available_memory_bytes()
    keep = None if available is None else available // 2 // BYTES_PER_PASS  # passes the kept schedules may hold
    for name in strategies:
        if not (args.planned and name in plannable("replicas")):
            spec = _spec(args, name)
            check_size(spec)  # before building: a run too large for memory is refused, not built
            schedule = build_schedule(spec)
            hw.check_devices(schedule.num_devices)
            depths[name] = schedule.num_stages
            passes = estimate_passes(spec) or 0
            if keep is None or passes <= keep:  # kept for its run; one too big to keep beside the rest is rebuilt
                built[name] = schedule
                keep = None if keep is None else keep - passes
            del schedule
    return built, depths


def _without_time(record: dict) -> dict:
    """A plan record without its one measured field, so comparison.json stays byte-identical."""
    return {k: v for k, v in record.items() if k != "planner_seconds"}


def _compare_plans(args, strategies: list[str], out: Path, uniform_layers: int | None = None) -> dict:
    """``compare --planned``: plan every strategy that takes per-stage replicas
    on the ``--stages`` devices (written to ``<out>/<strategy>/plan.json`` and
    ``pareto.html``): strategy -> (its PlanFile, its record), and strategy ->
    why it is left out, for a strategy that runs none of the configurations
    found (PipeDream-2BW needs more micro-batches than 8 to replicate a
    stage 15 times): the others are still compared."""
    from pipesim.sim.api import resolve_hardware
    from pipesim.sim.planning.plan import NothingRunsError, PlanRequest, plan, plan_file, plannable

    if args.replicas is not None or args.width is not None:
        raise UsageError("pipesim compare: --planned chooses the replicas; leave out --replicas and --width")
    from pipesim.experiments.plans import write_plan

    hw = resolve_hardware(args.hardware or "ideal")
    profile = _plan_profile(args, hw, uniform_layers or args.stages)
    planned, left_out = {}, {}
    for name in strategies:
        if name not in plannable("replicas"):  # compare plans splits and replicas
            continue
        print(f"planning {name} on {args.stages} devices ...", file=sys.stderr, flush=True)
        options = {k: v for k, v in _strategy_options(args, name).items() if k not in ("replicas", "width")}
        try:
            record = plan(PlanRequest(name, profile, hw, args.stages, microbatches=args.microbatches or 8,
                                      iterations=args.iterations, options=options, recv_lookahead=args.recv_lookahead,
                                      model=args.model, profile_path=_recorded_path(args.profile))).to_json()
        except NothingRunsError as e:  # said once: by cmd_compare, as a note or as its error
            left_out[name] = str(e)
            continue
        write_plan(record, out / name)
        planned[name] = (plan_file(record), record)
    return planned, left_out


def _recorded_path(path: str | None) -> str | None:
    """A file a plan records (its profile): absolute, so the plan runs from
    any folder."""
    return None if path is None else os.path.abspath(path)


def _plan_profile(args, hardware, devices: int):
    """The profile a plan is made for: ``--profile``, or the catalog model on
    the hardware's device (``uniform``: one layer per device, as a pipeline of
    that depth gets)."""
    from pipesim.sim.workloads.catalog import model_profile

    if args.profile:
        return _profile_file(args)
    model = args.model or "uniform"
    return model_profile(model, hardware.device, args.microbatch_size, layers=devices if model == "uniform" else None)


def cmd_plan(args) -> int:
    from pipesim.experiments.plans import render_plan, write_plan
    from pipesim.sim.api import resolve_hardware
    from pipesim.sim.planning.plan import dumps

    hw = resolve_hardware(args.hardware)
    gpus = args.gpus or (sum(args.replicas) if args.replicas else hw.num_devices)
    if gpus is None:
        raise UsageError(f"pipesim plan: {hw.name} has no fixed device count; give --gpus N")
    planner = _planner(args)
    out = _output_dir(args.out)
    from pipesim.sim.planning.plan import ITERATIONS

    m = args.microbatches or gpus
    with _plan_progress(gpus * m * (args.iterations or ITERATIONS)) as say:
        record = _PLANNERS[planner](args, hw, gpus, say).to_json()
    written = write_plan(record, out)
    if args.json:
        sys.stdout.write(dumps(record))
    else:
        print(render_plan(record))
        print(f"wrote {', '.join(p.name for p in written)} to {out} "
              f"(pipesim simulate --plan {shlex.quote(str(out / 'plan.json'))})")
    if record["out_of_memory"]:  # the files show every candidate; the answer is that none will do
        from pipesim.sim.planning.plan import PlanError

        limit = record["memory_limit_bytes"]
        raise PlanError(f"no configuration of {args.strategy} the planner found fits in memory: the fastest, "
                        f"{record['config']}, needs {_fmt_bytes(record['peak_memory_bytes'])} per device"
                        + ("" if limit is None else f" of {_fmt_bytes(limit)}")
                        + f" ({out}/plan.json and pareto.html list every candidate)")
    return 0


def _planner(args) -> str:
    """The planner the strategy uses (``Strategy.planners``; ``--planner``
    picks another it allows), and the flags that planner takes checked."""
    from pipesim.sim.planning.plan import PlanError, plannable
    from pipesim.sim.strategies import get_strategy

    strategy = get_strategy(args.strategy)
    if not strategy.planners:
        raise PlanError(f"{args.strategy} takes no per-stage replicas and has no planner, so there is nothing to "
                        f"plan; plannable: {', '.join(plannable())}")
    planner = args.planner or strategy.planner
    if planner not in strategy.planners:
        raise PlanError(f"{args.strategy} is planned by {' or '.join(strategy.planners)}, not {planner}")
    if args.refine is not None and (args.replicas is not None or args.straight or args.confirm == 0):
        held = "--replicas" if args.replicas is not None else "--straight" if args.straight else "--confirm 0"
        raise UsageError(f"pipesim plan: --refine does nothing with {held} (a held search confirms its own splits; "
                         "--confirm 0 simulates nothing)")
    if planner == "replicas" and args.batch_size is not None:
        raise UsageError("pipesim plan: --batch-size is for the width-depth and tuner planners; the replicas planner "
                         "takes --microbatches (per iteration) and --microbatch-size")
    why = {"--microbatches": "it chooses the micro-batches from --batch-size",
           "--no-stashing": "weight stashing is PipeDream's, planned by the replicas planner",
           "--replicas": "its stages are never replicated one by one",
           "--straight": "its stages are never replicated one by one",
           "--refine": "its splits are balanced, not searched"}
    given = [flag for flag, on in (("--microbatches", args.microbatches is not None),
                                   ("--no-stashing", args.no_stashing), ("--replicas", args.replicas is not None),
                                   ("--straight", args.straight), ("--refine", args.refine is not None)) if on]
    if planner != "replicas" and given:
        flag = given[0]
        raise UsageError(f"pipesim plan: {flag} is not an option of the {planner} planner ({why[flag]})")
    return planner


#: Strategy options ``pipesim plan`` passes to a planner (AvgPipe's; a
#: strategy that does not take one refuses it in one line).
_PLAN_OPTION_FLAGS = ("alpha", "tau", "advance", "placement")


def _plan_options(args) -> dict:
    """The strategy options the plan command line gives."""
    options = {name: getattr(args, name) for name in _PLAN_OPTION_FLAGS if getattr(args, name) is not None}
    return options | ({"stashing": False} if args.no_stashing else {})


def _plan_replicas(args, hw, gpus: int, say):
    """PipeDream's planner: splits and per-stage replicas."""
    from pipesim.sim.planning.plan import PlanRequest, plan

    profile = _plan_profile(args, hw, gpus)
    options = _plan_options(args)
    given = {k: getattr(args, k) for k in ("iterations", "confirm", "refine") if getattr(args, k) is not None}
    return plan(PlanRequest(args.strategy, profile, hw, gpus, microbatches=args.microbatches, options=options,
                            recv_lookahead=args.recv_lookahead, model=args.model,
                            profile_path=_recorded_path(args.profile),
                            recompute=args.recompute, replicas=args.replicas, straight=args.straight, **given),
                progress=say)


def _profile_for(args, hw, gpus: int):
    """(the model at micro-batch size b, the sizes the planner may try: None
    for any, a measured profile's own, or --microbatch-size), and the
    batch size: --batch-size, else 4 micro-batches of the model's size per GPU."""
    from dataclasses import replace

    from pipesim.sim.workloads.catalog import model_profile

    default = _plan_profile(args, hw, gpus)
    batch = args.batch_size or 4 * gpus * default.microbatch_size
    if args.profile:  # one size: the profile's, or --microbatch-size's (at_microbatch_size)
        return (lambda b: replace(default, microbatch_size=b)), (default.microbatch_size,), batch
    model = args.model or "uniform"
    layers = gpus if model == "uniform" else None
    sizes = None if args.microbatch_size is None else (args.microbatch_size,)
    return (lambda b: model_profile(model, hw.device, b, layers=layers)), sizes, batch


def _plan_width_depth(args, hw, gpus: int, say):
    """PipeDream-2BW's planner: width, depth, micro-batch size, recomputation."""
    from pipesim.sim.planning.grid import GridRequest, plan_grid

    profile_for, sizes, batch = _profile_for(args, hw, gpus)
    given = {k: getattr(args, k) for k in ("iterations", "confirm") if getattr(args, k) is not None}
    return plan_grid(GridRequest(args.strategy, profile_for, hw, gpus, batch, microbatch_sizes=sizes,
                                 recompute=(True,) if args.recompute else (False, True), options=_plan_options(args),
                                 recv_lookahead=args.recv_lookahead, model=args.model,
                                 profile_path=_recorded_path(args.profile), **given), progress=say)


def _plan_tuner(args, hw, gpus: int, say):
    """AvgPipe's tuner: pipelines and micro-batches, by simulation."""
    from pipesim.sim.planning.tuner import TuneRequest, tune

    if args.confirm is not None:
        raise UsageError("pipesim plan: the tuner simulates every candidate; leave out --confirm")
    profile_for, sizes, batch = _profile_for(args, hw, gpus)
    microbatches = None if sizes is None else tuple(m for m in range(1, batch + 1)
                                                     if batch % m == 0 and batch // m in sizes)
    given = {"iterations": args.iterations} if args.iterations is not None else {}
    return tune(TuneRequest(args.strategy, profile_for, hw, gpus, batch, microbatches=microbatches or None,
                            options=_plan_options(args),
                            recv_lookahead=args.recv_lookahead, recompute=args.recompute, model=args.model,
                            profile_path=_recorded_path(args.profile), **given), progress=say)


#: What each planner (``Strategy.planners``) runs.
_PLANNERS = {"replicas": _plan_replicas, "width-depth": _plan_width_depth, "tuner": _plan_tuner}


@contextmanager
def _plan_progress(passes: int):
    """A progress line on stderr for a terminal (after a second): what the
    planner is doing. Elsewhere (a log, a pipe) nothing for the usual plan
    of a second or two, but one line per step when its confirmation runs
    are long (``passes``, a straight pipeline's stage passes, past
    :data:`~.progress.PROGRESS_PASSES`, as for a simulation)."""
    if not sys.stderr.isatty():
        from pipesim.experiments.progress import PROGRESS_PASSES

        yield None if passes < PROGRESS_PASSES else (lambda msg: print(f"planning: {msg}", file=sys.stderr,
                                                                       flush=True))
        return
    from tqdm import tqdm

    bar = tqdm(total=None, file=sys.stderr, delay=1.0, leave=False, bar_format="planning: {desc} {elapsed}")
    try:
        yield lambda msg: (bar.set_description_str(msg, refresh=False), bar.update(0))
    finally:
        bar.close()


def cmd_schedule(args) -> int:
    from pipesim.sim.ir.core import program_cells, to_csv
    from pipesim.sim.engine.size import check_size
    from pipesim.sim.strategies import build_schedule, get_strategy, strategies

    if args.list:
        width = max(len(s.name) for s in strategies())
        print("\n".join(f"{s.name:<{width}}  {s.summary}" for s in strategies()))
        return 0
    if not args.strategy:
        raise UsageError("pipesim schedule: give --strategy NAME (or --list)")
    if args.devices is not None and "chunks" in get_strategy(args.strategy).options:
        # --stages counts model stages here: they are dealt over the devices in chunks
        if args.stages % args.devices:
            raise UsageError(f"pipesim schedule: {args.stages} stages do not split evenly over {args.devices} devices")
        args.chunks, args.stages = args.stages // args.devices, args.devices
    if args.recv_lookahead is not None and not args.lowered:
        raise UsageError("pipesim schedule: --recv-lookahead applies to --lowered schedules")
    spec = _spec(args)
    check_size(spec)
    schedule = build_schedule(spec)
    if args.devices is not None and schedule.num_devices != args.devices:
        raise UsageError(f"pipesim schedule: {args.strategy} with {args.stages} stages uses "
                         f"{schedule.num_devices} devices, not {args.devices}")
    if args.lowered:
        from pipesim.sim.ir.lowering import lower

        # torch's dry run (_simulate_comms_compute) blocks a rank on a posted
        # receive, so it accepts receives only right before their consumer
        lookahead = args.recv_lookahead
        if lookahead is None:
            lookahead = 0 if args.format == "torch-csv" else 1
        schedule = lower(schedule, recv_lookahead=lookahead)
    if args.format == "torch-csv":
        if get_strategy(args.strategy).asynchronous:  # said, not refused: torch's order of passes is still right
            print(f"note: torch's CSV has no updates or weight versions, so {args.strategy} read back from it "
                  "is a flushed schedule; --format csv keeps them", file=sys.stderr)
        sys.stdout.write(to_csv(schedule, torch_only=True))
    elif args.format == "csv":
        sys.stdout.write(to_csv(schedule))
    else:
        for dev, prog in enumerate(schedule.programs):
            print(f"device {dev}: " + " ".join(program_cells(prog)))
    return 0


def cmd_bench(args) -> int:
    from pipesim.experiments.bench import run

    return run(args.name, args.args)


def cmd_figure(args) -> int:
    from pipesim.experiments.figures import bubble_figure

    path = bubble_figure(_output_dir(args.out))
    print(f"wrote {path} and {path.with_suffix('.json').name} (its data)")
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="mlp", help="real model: mlp, gpt-small, vgg-small or lstm")
    p.add_argument("--model-width", type=positive, default=None, help="model width (hidden size / channels)")
    p.add_argument("--model-depth", type=positive, default=None, help="model depth (hidden layers / blocks)")
    p.add_argument("--microbatch-size", type=positive, default=32, help="samples per micro-batch")
    p.add_argument("--seed", type=nonnegative, default=0, help="seed of the weights and the data order")


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cmd_profile(args) -> int:
    import json

    from pipesim.sim.workloads.readers import save_profile
    from pipesim.validate.harness import ValidateConfig, check_fits, hardware_for, model_of, profile, torch_device

    out = _output_dir(args.out)
    cfg = ValidateConfig(strategy="gpipe", model=args.model, backend=args.backend,
                         microbatch_size=args.microbatch_size, model_width=args.model_width,
                         model_depth=args.model_depth, seed=args.seed, profile_repeats=args.repeats)
    device = torch_device(args.backend)
    model = model_of(cfg)
    check_fits(cfg, model)
    _progress(f"measuring {args.backend} point-to-point links and the optimizer's bandwidth ...")
    hw = hardware_for(cfg, device, args.devices, model=model)
    _progress(f"profiling {args.model} layers on {device} (micro-batch {args.microbatch_size}) ...")
    prof = profile(cfg, device, model=model, hardware=hw)
    save_profile(prof, out / "profile.json")
    (out / "hardware.json").write_text(json.dumps(hw.to_json(), indent=1) + "\n")
    rows = [[la.name, f"{la.forward_s * 1e3:.3f}", f"{la.backward_s * 1e3:.3f}", _fmt_bytes(la.param_bytes),
             _fmt_bytes(la.activation_bytes), _fmt_bytes(la.stash_bytes)] for la in prof.layers]
    print(_table(rows, ["layer", "F ms", "B ms", "params", "output", "stash"], limit=64))
    print(f"per-pass overhead: forward {prof.overhead_forward_s * 1e6:.1f} us, backward "
          f"{prof.overhead_backward_s * 1e6:.1f} us; optimizer bandwidth {hw.device.mem_bandwidth / 1e9:.2f} GB/s")
    written = "profile.json and hardware.json"
    if hw.intra_node.kind != "ideal":
        from pipesim.validate.commprofile import measure_allreduce
        from pipesim.validate.harness import ring_allreduce_prediction

        print(f"{args.backend} link: latency {hw.intra_node.latency * 1e6:.1f} us, "
              f"bandwidth {hw.intra_node.bandwidth / 1e9:.3f} GB/s")
        _progress(f"measuring all-reduce over {args.devices} {args.backend} ranks ...")
        coll = measure_allreduce(args.backend, args.devices)
        (out / "collectives.json").write_text(json.dumps(coll.to_json(), indent=1) + "\n")
        written = "profile.json, hardware.json and collectives.json"
        rows = [[_fmt_bytes(n), f"{t * 1e3:.3f}", f"{ring_allreduce_prediction(hw, args.devices, n) * 1e3:.3f}"]
                for n, t in zip(coll.sizes, coll.allreduce_s)]
        print(_table(rows, ["all-reduce size", "measured ms", "ring model ms"], limit=64))
    print(f"wrote {written} to {out} "
          f"(pipesim simulate --profile {out}/profile.json --hardware {out}/hardware.json)")
    return 0


def cmd_validate(args) -> int:
    import json

    from pipesim.experiments.overlay import write_merged_trace, write_overlay_html
    from pipesim.sim.engine.metrics import dumps
    from pipesim.sim.planning.plan import notation as notation_of
    from pipesim.sim.workloads.readers import save_profile
    from pipesim.validate.harness import ValidateConfig, run_validation
    from pipesim.validate.stage import OptimizerConfig

    out = _output_dir(args.out)
    options = _strategy_options(args)
    options.pop("width", None)  # replicas, below
    cfg = ValidateConfig(
        strategy=args.strategy, stages=args.stages, microbatches=args.microbatches or 8, model=args.model,
        backend=args.backend, iterations=args.iterations, microbatch_size=args.microbatch_size,
        replicas=args.width or 1, model_width=args.model_width, model_depth=args.model_depth, seed=args.seed,
        optimizer=OptimizerConfig(kind=args.optimizer, lr=args.lr, momentum=args.momentum),
        synthetic=args.synthetic, recv_lookahead=args.recv_lookahead, timeout_s=args.timeout,
        profile_path=args.profile, hardware_path=args.hardware, oversubscribe=args.oversubscribe,
        strategy_options=tuple(sorted(options.items())),
    )
    v = run_validation(cfg, progress=_progress)
    r = v.report
    (out / "report.json").write_text(dumps(r))
    save_profile(v.profile, out / "profile.json")
    (out / "hardware.json").write_text(json.dumps(v.hardware.to_json(), indent=1) + "\n")
    flagged = r["flagged_actions"]
    replicas = dict(cfg.strategy_options).get("replicas")
    shape = (f"stages replicated {notation_of(replicas)}" if replicas else
             f"{r['stages']} stages" + (f" x {cfg.replicas} pipelines" if cfg.replicas > 1 else ""))
    title = (f"{cfg.strategy}, {shape}, {cfg.model}, {cfg.backend}: iteration "
             f"{r['iteration_time_measured_s'] * 1e3:.2f} ms measured, {r['iteration_time_predicted_s'] * 1e3:.2f} ms "
             f"predicted ({r['iteration_time_error']:+.1%})")
    write_overlay_html(v.measured, v.predicted, out / "overlay.html", title=title, flagged=flagged)
    write_merged_trace(v.measured, v.predicted, out / "trace.json")
    a = r["action_errors"]
    print(title)
    print(_table([
        ["iteration time (ms)", f"{r['iteration_time_measured_s'] * 1e3:.3f}",
         f"{r['iteration_time_predicted_s'] * 1e3:.3f}", f"{r['iteration_time_error']:+.1%}"],
        ["bubble fraction", f"{r['bubble_fraction_measured']:.3f}", f"{r['bubble_fraction_predicted']:.3f}",
         f"{r['bubble_fraction_predicted'] - r['bubble_fraction_measured']:+.3f}"],
    ], ["", "measured", "predicted", "error"]))
    print(f"per action: |start error| median {a['start_error_s']['median'] * 1e3:.3f} ms, p90 "
          f"{a['start_error_s']['p90'] * 1e3:.3f} ms; |duration error| median {a['duration_error']['median']:.1%}, "
          f"p90 {a['duration_error']['p90']:.1%}; {a['flagged_count']} of {a['compared']} actions over the thresholds")
    for f in flagged[:5]:
        print(f"  device {f['device']} {f['action']}: {f['duration_measured_s'] * 1e3:.3f} ms measured, "
              f"{f['duration_predicted_s'] * 1e3:.3f} ms predicted")
    wv = r["weight_versions"]
    print(f"weight versions: {'as predicted' if wv['match'] else str(wv['mismatches']) + ' passes differ'} "
          f"({wv['passes_compared']} passes); losses " + ", ".join(f"{x:.4f}" for x in r["losses"]))
    print(f"wrote {out}/report.json, overlay.html, trace.json, profile.json, hardware.json")
    return 0


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


def cmd_converge(args) -> int:
    from pipesim.experiments.converge import ConvergeConfig, converge, runs_of, table

    out = _output_dir(args.out)
    cfg = ConvergeConfig(model=args.model, stages=tuple(args.stages), strategies=tuple(args.strategies),
                         lrs=tuple(args.lr), seeds=tuple(args.seeds), updates=args.updates,
                         update_batch=args.update_batch, eval_every=args.eval_every, momentum=args.momentum,
                         model_width=args.model_width, model_depth=args.model_depth, backend=args.backend,
                         jobs=args.jobs, timeout_s=args.timeout)
    total = len(runs_of(cfg))  # every run checked before any trains
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    with tqdm(total=total, desc="converge", unit="run", file=sys.stderr, mininterval=0.5 if tty else 10.0,
              leave=True) as bar:
        def progress(done: int, n: int, record: dict) -> None:
            bar.set_postfix_str(f"{record['strategy']}, {record['stages']} stages, lr {record['lr']}", refresh=False)
            bar.update(1)

        doc, written = converge(cfg, out, progress=progress)
    print(_table(table(doc), ["stages", "lr", "strategy", "accuracy %", "seeds (worst..best)"], limit=64))
    print(f"wrote {', '.join(p.name for p in written)} to {out}")
    return 0


def cmd_reproduce(args) -> int:
    """Predict a paper's published figures, write results.json, report.md and
    the figures to ``--out``/<paper>/, and print the report."""
    from pipesim.experiments.reproduce.runner import papers_for, run

    papers_for(args.paper)  # an unknown or missing paper fails in one line before any work
    out = _output_dir(args.out)
    started = time.perf_counter()
    outcomes = run(args.paper, out)
    if len(outcomes) > 1:
        print(f"reproduced {', '.join(o.paper.name for o in outcomes)} in {time.perf_counter() - started:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pipesim", description="Simulate, validate and plot pipeline-parallel training schedules.")
    parser.add_argument("--version", action=_Version, help="print pipesim's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("simulate", help="simulate one strategy or an imported schedule")
    _add_schedule_args(p, imports_csv=True)
    p.add_argument("--schedule", default=None, help="schedule CSV (torch or pipesim spelling) instead of --strategy")
    _add_machine_args(p, takes_plan=True)
    p.add_argument("--out", default="out/simulate", help="output folder")
    p.add_argument("--json", action="store_true", help="print summary.json instead of the table")
    p.add_argument("--summary-only", action="store_true", help="write only summary.json (skip trace and timeline)")
    p.add_argument("--plan", default=None,
                   help="plan.json from `pipesim plan`: its strategy, stages, replicas and split, and by default its "
                        "model, hardware and run")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("compare", help="simulate several strategies on one model and machine")
    _add_schedule_args(p, one_strategy=False, iterations=COMPARE_ITERATIONS)
    # asynchronous schedules are compared in steady state, not on their warm-up
    p.set_defaults(iterations=COMPARE_ITERATIONS)
    p.add_argument("--strategies", default=None, help="comma-separated (default: all)")
    p.add_argument("--strategy", dest="one_strategy", default=None, help=argparse.SUPPRESS)  # refused: see cmd_compare
    p.add_argument("--planned", action="store_true",
                   help="plan each strategy that takes per-stage replicas on the --stages devices first "
                        "(pipesim plan) and simulate the configuration it chooses")
    _add_machine_args(p, model=COMPARE_MODEL, hardware=COMPARE_HARDWARE)
    p.add_argument("--out", default="out/compare", help="output folder")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("plan", help="choose the fastest configuration (stages, splits, replicas) for a strategy",
                       description="Run the strategy's planner (PipeDream's splits and per-stage replicas; "
                                   "PipeDream-2BW's width, depth, micro-batch size and recomputation; AvgPipe's "
                                   "tuner), confirm the best with the engine, print the plan and write plan.json "
                                   "and pareto.html.")
    list_choices(p.add_argument("--strategy", default="pipedream",
                                help="a strategy some planner serves (its first planner by default: pipedream, "
                                     "gpipe, 1f1b replicas; pipedream-2bw width-depth; avgpipe tuner)"), _plannable)
    p.add_argument("--planner", choices=("replicas", "width-depth", "tuner"), default=None,
                   help="replicas: splits and per-stage replicas (PipeDream); width-depth: width, depth, micro-batch "
                        "size and recomputation for --batch-size (PipeDream-2BW; also gpipe, 1f1b); tuner: "
                        "pipelines and micro-batches by simulation (AvgPipe) (default: the strategy's)")
    p.add_argument("--batch-size", type=positive, default=None,
                   help="width-depth: global batch B per update (m = B / (width x micro-batch size)); tuner: "
                        "samples per pipeline per iteration (default: 4 micro-batches of the model's size per GPU)")
    p.add_argument("--recompute", action="store_true",
                   help="activation recomputation: replicas and tuner plan with it; width-depth searches it anyway "
                        "and with this flag only configurations that recompute")
    g = p.add_mutually_exclusive_group()
    list_choices(g.add_argument("--model", default=None, help=f"catalog model (default: {COMPARE_MODEL})"),
                 _catalog_models)
    g.add_argument("--profile", default=None, help="per-layer cost profile (JSON or PipeDream's graph.txt)")
    list_choices(p.add_argument("--hardware", default=COMPARE_HARDWARE, help="preset, preset-xN or a JSON file"),
                 _hardware_presets)
    p.add_argument("--gpus", type=positive, default=None, help="devices to plan for (default: all the hardware has)")
    p.add_argument("--microbatches", type=positive, default=None,
                   help="micro-batches per iteration (default: one per device)")
    p.add_argument("--iterations", type=positive, default=None,
                   help="iterations of each confirming simulation (steady state is measured on all but the "
                        "first and the last) (default: 3)")
    p.add_argument("--microbatch-size", type=positive, default=None,
                   help="samples per micro-batch (default: the model's; width-depth and tuner: every power of two "
                        "that divides the batch, or only this one)")
    p.add_argument("--no-stashing", action="store_true", help="pipedream without weight stashing (vanilla)")
    from pipesim.sim.strategies import OPTION_DEFAULTS, PLACEMENTS

    for name in _PLAN_OPTION_FLAGS:
        kind, text = _STRATEGY_FLAGS[name]
        p.add_argument(f"--{name}", type=kind, default=None, choices=PLACEMENTS if name == "placement" else None,
                       help=f"{text} (default: {OPTION_DEFAULTS[name]})")
    held = p.add_mutually_exclusive_group()
    held.add_argument("--replicas", type=replica_counts, default=None,
                      help="replicas planner: hold the search to this configuration, replicas per stage in "
                           "PipeDream's notation (15,1 for 15-1), summing to the GPUs; only the cuts are searched")
    held.add_argument("--straight", action="store_true",
                      help="replicas planner: hold the search to a straight pipeline, one stage on each of the "
                           "--gpus devices (what PipeDream's optimizer returns under --straight_pipeline; its paper "
                           "ran GNMT-16 as 14 such stages: --gpus 14)")
    p.add_argument("--confirm", type=nonnegative, default=None,
                   help="candidates confirmed with the engine, besides data parallelism and the straight pipeline "
                        "(0: the cost model alone) (default: 8; width-depth: 6, no landmarks)")
    p.add_argument("--refine", type=nonnegative, default=None,
                   help="replicas planner: other splits of the chosen pipeline confirmed once it is chosen "
                        "(0: none) (default: 6)")
    p.add_argument("--recv-lookahead", type=nonnegative, default=1,
                   help="post receives this many compute actions early (0 = right before use)")
    p.add_argument("--json", action="store_true", help="print plan.json instead of the summary")
    p.add_argument("--out", default="out/plan", help="output folder (plan.json, pareto.html)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("schedule", help="print a strategy's per-device order")
    _add_schedule_args(p, strategy_required=False)
    p.add_argument("--devices", type=positive, default=None, help="devices (interleaved: stages/devices chunks)")
    p.add_argument("--format", choices=("torch-csv", "csv", "text"), default="text")
    p.add_argument("--lowered", action="store_true", help="include the sends and receives")
    p.add_argument("--recv-lookahead", type=nonnegative, default=None,
                   help="with --lowered: post receives this many compute actions early "
                        "(default: 0 for torch-csv, which torch's dry run requires; else 1)")
    p.add_argument("--list", action="store_true", help="list strategy names")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser("profile", help="measure a real model and this machine's links for the simulator")
    _model_args(p)
    p.add_argument("--backend", choices=("gloo", "nccl", "single"), default="gloo",
                   help="what to measure links on (single: no links)")
    p.add_argument("--devices", type=positive, default=2, help="devices the hardware JSON describes")
    p.add_argument("--repeats", type=positive, default=15, help="timed repetitions per layer (median)")
    p.add_argument("--out", default="out/profile", help="output folder")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("validate", help="run a schedule for real and reconcile it with the simulation")
    _add_schedule_args(p, strategy_required=True, iterations=4, stages=2)
    p.set_defaults(stages=2, iterations=4)
    _model_args(p)
    p.add_argument("--backend", choices=("gloo", "nccl", "single"), default="gloo",
                   help="gloo: CPU processes; nccl: one process per GPU; single: every stage on one device")
    p.add_argument("--profile", default=None, help="use this profile JSON instead of profiling")
    p.add_argument("--hardware", default=None, help="use this hardware JSON instead of measuring links")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--synthetic", action="store_true", help="random inputs of the right shapes (timing only)")
    p.add_argument("--recv-lookahead", type=nonnegative, default=1,
                   help="post receives this many compute actions early (0 = right before use)")
    p.add_argument("--timeout", type=seconds, default=600.0, help="seconds before the workers are stopped")
    p.add_argument("--oversubscribe", action="store_true", help="allow more worker processes than cores")
    p.add_argument("--out", default="out/validate", help="output folder")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("sweep", help="simulate a grid of configurations in parallel (local workers or Ray)")
    from pipesim.experiments.sweep import add_arguments as sweep_arguments

    sweep_arguments(p)
    p.set_defaults(func=cmd_sweep)

    from pipesim.experiments.bench import BENCHES, describe

    p = sub.add_parser("bench", help="benchmarks: print their figures (tables, or --json)",
                       description="Run one benchmark; `pipesim bench NAME --help` lists its options.",
                       epilog="benchmarks:\n" + describe(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=list(BENCHES), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    p.set_defaults(func=cmd_bench)

    from pipesim.experiments.converge import ConvergeConfig

    d = ConvergeConfig()
    p = sub.add_parser("converge", help="train every strategy on the same samples and compare held-out accuracy")
    list_choices(p.add_argument("--model", default=d.model, help="real model (digits: mlp, vgg-small; characters: "
                                "lstm, gpt-small)"), _real_models)
    p.add_argument("--stages", type=positive, nargs="+", default=list(d.stages), help="pipeline depths")
    list_choices(p.add_argument("--strategies", nargs="+", default=list(d.strategies),
                                help="strategies (pipedream-nostash: PipeDream without weight stashing)"),
                 _converge_strategies)
    p.add_argument("--lr", type=_positive_float, nargs="+", default=list(d.lrs),
                   help="learning rates (every strategy runs each)")
    p.add_argument("--seeds", type=nonnegative, nargs="+", default=list(d.seeds),
                   help="seeds of the weights and the data order")
    p.add_argument("--updates", type=positive, default=d.updates, help="weight updates per run")
    p.add_argument("--update-batch", type=positive, default=d.update_batch,
                   help="samples per weight update, every strategy")
    p.add_argument("--eval-every", type=positive, default=d.eval_every,
                   help="updates between held-out evaluations (a multiple of the depth for pipedream and spectrain, "
                        "which update p times per iteration; --updates a multiple of it)")
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum, in [0, 1)")
    p.add_argument("--model-width", type=positive, default=None, help="model width (default: the model's for converge)")
    p.add_argument("--model-depth", type=positive, default=None,
                   help="model depth (default: the model's for converge, enough layers for 8 stages)")
    p.add_argument("--backend", choices=("emulator", "gloo"), default=d.backend,
                   help="emulator: one process per run; gloo: the distributed runtime (bit-identical, slower)")
    p.add_argument("--jobs", type=positive, default=d.jobs, help="runs trained at once (emulator)")
    p.add_argument("--timeout", type=seconds, default=d.timeout_s, help="seconds one gloo run may take")
    p.add_argument("--out", default="out/converge", help="output folder")
    p.set_defaults(func=cmd_converge)

    p = sub.add_parser("reproduce", help="predict the papers' published figures and compare (PipeDream, "
                       "PipeDream-2BW, SpecTrain)")
    p.add_argument("paper", choices=("pipedream", "2bw", "spectrain", "all"),
                   help="the paper (all: every one this build reproduces)")
    p.add_argument("--out", default="out/reproduce", help="output folder (one subfolder per paper)")
    p.set_defaults(func=cmd_reproduce)

    p = sub.add_parser("figure", help="paper-style figures")
    p.add_argument("name", choices=("bubbles",))
    p.add_argument("--out", default="out/figures")
    p.set_defaults(func=cmd_figure)
    return parser


class _Version(argparse.Action):
    """``--version``, looking the version up only when asked (importlib.metadata
    costs every other command 10 ms of start-up)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {_version()}")
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipesim")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: _dispatch(argv))


def _dispatch(argv: list[str] | None) -> int:
    """Parse ``argv`` and run the sub-command it names."""
    args = build_parser().parse_args(argv)
    args.stages_given = getattr(args, "stages", None) is not None
    if args.command in ("simulate", "compare") and args.recv_lookahead is None and not getattr(args, "plan", None):
        args.recv_lookahead = 1  # a plan's own is read with it (_plan_arguments)
    if getattr(args, "stages", 0) is None:  # a schedule's depth: what --replicas says, else 4
        args.stages = len(args.replicas) if getattr(args, "replicas", None) else DEFAULT_STAGES
    if args.command in ("compare", "plan") and getattr(args, "model", None) is None and not args.profile:
        args.model = COMPARE_MODEL  # the default model, unless a profile replaces it
        if args.hardware is None:
            args.hardware = COMPARE_HARDWARE
    from pipesim.sim._gc import gc_paused

    with gc_paused():  # bulk construction of actions and spans: see pipesim.sim._gc
        return args.func(args)


def console_main() -> None:
    """The ``pipesim`` console script: :func:`main`, then exit at once.

    A large simulation leaves about a million small objects; freeing them one
    by one took 0.16 s of a 2 s run (131k compute actions) only for the
    process to end right after. So the result and the run's temporaries stay
    referenced (:func:`pipesim.sim._gc.kept_until_exit`), the cyclic
    collector stays off for this one-shot process (else its first pass after
    the run would scan every one of those objects), and once the streams are
    flushed the process exits without tearing down its heap. Every output
    file is closed by then.
    """
    global _ONE_SHOT
    _ONE_SHOT = True
    gc.disable()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console_main()

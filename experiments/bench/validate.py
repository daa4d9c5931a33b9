"""Benchmark: how well does the simulator predict real runs of every strategy?

``pipesim bench validate`` (or ``python -m pipesim.experiments.bench.validate``) profiles a model once on this machine
(per-layer costs, pass overhead, optimizer bandwidth, point-to-point links),
then validates every strategy with 2 (``--stages``) pipeline stages against that one
profile: each strategy is simulated and run for real (gloo, one process per
device, each pinned to a core, round-robin when there are more devices than
cores, as the measured hardware's ``cpu`` section tells the simulator), and
the steady-state iteration times are compared. It prints one
row per strategy and the median absolute error, the figure the validation
target is stated in (median |error| <= 5%).

Runs are repeated (``--repeats``) and the median error of each strategy is
reported, because a shared 2-core machine is noisy; every figure comes from
runs made in this one invocation.

``--model`` and ``--stages`` take comma-separated lists (``--model
mlp,gpt-small --stages 2,4``, the issue's whole grid): each model and stage
count is profiled and validated in turn, and everything is printed as one
table, with the median and worst error per configuration and over all rows.
``--model`` may also be given several times, and takes any model ``pipesim
validate`` takes (``hf:gpt2?n_layer=4``, ``path/to/file.py:factory``; one
per ``--model``, since their queries hold commas).

Targets: a catalog model's median |error| <= 5% and every strategy <= 15%; a
model from elsewhere (``hf:``, a factory), whose layers pipesim did not
write, <= 10% and <= 20% (:data:`TARGETS`).

Run to run: ``--fresh`` makes every run measure its own profile and
hardware, as separate ``pipesim validate`` invocations do, so the spread of a
strategy's errors over ``--repeats`` is the spread a user sees between
invocations (target: 5 points). Each row also gives how far the predicted
and the measured iteration times moved over the repeats, which says whether
the spread came from the profile, the run or both, and the error at the
run's own pass speed (``pipesim validate``'s ``pass_time_ratio``), whose
spread is the schedule's alone: what is left when the machine's speed
drifting between the profile and the run is taken out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from pipesim.experiments.cliargs import bench_main, int_list, positive, run_command
from pipesim.sim.errors import RunError
from pipesim.sim.strategies import ScheduleSpec, build_schedule, get_strategy, strategy_names
from pipesim.sim.strategies._common import check_executable
from pipesim.sim.workloads.readers import save_profile
from pipesim.validate.models import model_names


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(
    model: str = "mlp",
    microbatch_size: int = 64,
    microbatches: int = 8,
    iterations: int = 8,
    repeats: int = 2,
    backend: str = "gloo",
    strategies=None,
    model_width=None,
    model_depth=None,
    stages: int = 2,
    fresh: bool = False,
) -> dict:
    from pipesim.validate.harness import (
        ValidateConfig,
        ValidateError,
        hardware_for,
        model_of,
        profile,
        run_validation,
        torch_device,
    )

    chosen = default_strategies() if strategies is None else list(strategies)
    for name in chosen:  # before any measuring: one line, as `pipesim validate` refuses them
        check_executable(name, "real-tensor executors")
    schedules = [build_schedule(ScheduleSpec(name, stages, microbatches)) for name in chosen]
    if model_depth is None and model in model_names():
        model_depth = _depth_for(model, max(s.num_stages for s in schedules))
    base = ValidateConfig(
        strategy="1f1b",
        stages=stages,
        microbatches=microbatches,
        model=model,
        backend=backend,
        iterations=iterations,
        microbatch_size=microbatch_size,
        model_width=model_width,
        model_depth=model_depth,
        oversubscribe=True,
    )
    device = torch_device(backend)
    real = model_of(base)
    for name, schedule in zip(chosen, schedules, strict=True):
        if schedule.num_stages > real.num_layers:
            raise ValidateError(
                f"{name}: {schedule.num_stages} stages need at least that many layers; {model} has "
                f"{real.num_layers} (raise --model-depth)"
            )
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipesim-bench-") as tmp:
        if fresh:  # every run measures its own, as an invocation of `pipesim validate` does
            measured, hw = base, None
        else:
            measured, hw = _measure_once(base, schedules, device, real, Path(tmp), hardware_for, profile)
        for i, name in enumerate(chosen, 1):
            reports, failure = [], None
            for r in range(repeats):
                _say(f"[{i}/{len(chosen)}] {name}, run {r + 1}/{repeats}{' (measuring afresh)' if fresh else ''} ...")
                try:
                    reports.append(run_validation(replace(measured, strategy=name)).report)
                except RunError as e:  # a worker died or timed out: the other strategies still run
                    failure = str(e).splitlines()[0]
                    _say(f"[{i}/{len(chosen)}] {name} failed: {failure}")
                    break
            rows.append(_row(name, reports) if failure is None else _failed_row(name, failure))
    # the links measured (fresh: by the last run that ran; each run's own are in its report)
    link = next((r["last_report"]["hardware"] for r in reversed(rows) if "last_report" in r), None)
    if link is None:
        raise RunError(f"{model}: every strategy's run failed ({rows[0]['failed']})")
    ran = [r for r in rows if "failed" not in r]
    median_target, each_target = TARGETS["catalog" if real.origin == "catalog" else "elsewhere"]
    return {
        "model": model,
        "model_depth": model_depth,
        "stages": stages,
        "microbatch_size": microbatch_size,
        "microbatches": microbatches,
        "iterations": iterations,
        "backend": backend,
        "fresh": fresh,
        "target_median": median_target,
        "target_each": each_target,
        "rows": rows,
        "cores": list(hw.cpu.cores) if hw is not None and hw.cpu else None,
        "transfer_cpu": hw.to_json().get("cpu") if hw is not None else None,
        "median_abs_error": statistics.median(abs(r["error"]) for r in ran),
        "link_latency_s": link["link_latency_s"],
        "link_bandwidth_Bps": link["link_bandwidth_Bps"] or float("inf"),
        "update_bandwidth_Bps": link["mem_bandwidth_Bps"],
    }


#: (median |error|, every strategy's |error|) a configuration is held to: the
#: catalog's models, and models from elsewhere (issue 26's targets).
TARGETS = {"catalog": (0.05, 0.15), "elsewhere": (0.10, 0.20)}
#: Points of error two runs of one strategy may differ by (``--fresh``: two invocations).
SPREAD_TARGET = 0.05


def _measure_once(base, schedules, device, real, tmp: Path, hardware_for, profile):
    """Profile the model and measure the links once, for every strategy's runs
    (the most devices any chosen strategy needs, AvgPipe's pipelines and data
    parallelism's replicas, each pinned to its core)."""
    _say(f"profiling {base.model} (micro-batch {base.microbatch_size}, depth {base.model_depth}) on {device} ...")
    hw = hardware_for(base, device, max(s.num_devices for s in schedules), model=real)
    save_profile(profile(base, device, model=real, hardware=hw), tmp / "profile.json")
    (tmp / "hardware.json").write_text(json.dumps(hw.to_json()))
    return replace(base, profile_path=str(tmp / "profile.json"), hardware_path=str(tmp / "hardware.json")), hw


def _depth_for(model: str, stages: int) -> int:
    """The model's default depth, deepened until it has a layer for each of
    ``stages`` (interleaved 1F1B's virtual stages: two per device)."""
    from pipesim.validate.models import build_model

    default = build_model(model)
    return default.config["depth"] + max(0, stages - default.num_layers)


def default_strategies() -> list[str]:
    """Every strategy real tensors can run (tensor parallelism is simulated only)."""
    return [n for n in strategy_names() if get_strategy(n).executable]


def _row(strategy: str, reports: list[dict]) -> dict:
    """One strategy's medians over its repeats (bubbles from the last), and
    how far its error, prediction and measurement moved between them."""
    errors = [r["iteration_time_error"] for r in reports]
    plain = [
        r["iteration_time_error_without_cpu_model"] for r in reports if "iteration_time_error_without_cpu_model" in r
    ]
    starts = [r["action_errors"]["start_error_fraction_of_makespan"]["p90"] for r in reports]
    predicted = [r["iteration_time_predicted_s"] for r in reports]
    measured = [r["iteration_time_measured_s"] for r in reports]
    # the prediction at each run's own pass speed: its spread is the schedule's, the rest the profile's speed
    at_speed = [r["iteration_time_error_at_run_speed"] for r in reports if "iteration_time_error_at_run_speed" in r]
    ratios = [r["pass_time_ratio"] for r in reports if "pass_time_ratio" in r]
    return {
        "strategy": strategy,
        "errors": errors,
        "error": statistics.median(errors),
        "spread": max(errors) - min(errors),
        "predicted_spread": _relative_range(predicted),
        "measured_spread": _relative_range(measured),
        "errors_at_run_speed": at_speed,
        "error_at_run_speed": statistics.median(at_speed) if at_speed else None,
        "spread_at_run_speed": max(at_speed) - min(at_speed) if at_speed else None,
        "pass_time_ratios": ratios,
        "error_without_cpu_model": statistics.median(plain) if plain else None,
        "start_error_p90": statistics.median(starts),
        "measured_s": statistics.median(measured),
        "predicted_s": statistics.median(predicted),
        "bubble_measured": reports[-1]["bubble_fraction_measured"],
        "bubble_predicted": reports[-1]["bubble_fraction_predicted"],
        "held_activations": reports[-1].get("held_activations"),
        "last_report": {"hardware": reports[-1].get("hardware")},
    }


def _failed_row(strategy: str, failure: str) -> dict:
    """A strategy whose run failed (a worker killed, a timeout): the first line of why."""
    return {"strategy": strategy, "failed": failure}


def _relative_range(values: list[float]) -> float:
    """(max - min) / median: how far a figure moved over the repeats."""
    return (max(values) - min(values)) / statistics.median(values)


#: Micro-batch size per catalog model when none is given: gpt-small's passes are long enough at 32.
DEFAULT_MICROBATCH_SIZE = {"gpt-small": 32}
#: ... and for a model from elsewhere (the issue's targets are stated at 8).
ELSEWHERE_MICROBATCH_SIZE = 8


def _names_of(what: str, known):
    """An argparse type: a comma-separated list of ``known()`` names."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in known()]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown) or text!r}; choose from {', '.join(known())}"
            )
        return names

    return parse


def _models(text: str) -> list[str]:
    """An argparse type: catalog model names, comma-separated, or one model
    from elsewhere (``hf:...``, ``torchvision:...``, ``module:factory``),
    which ``pipesim validate`` resolves (and refuses in one line)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names and all(n in model_names() for n in names):
        return names
    if ":" in text:
        return [text]
    return _names_of("model", model_names)(text)


def add_arguments(p) -> None:
    p.add_argument(
        "--model",
        type=_models,
        action="append",
        default=None,
        help="real model(s) to validate: catalog names comma-separated (mlp, gpt-small, lstm, vgg-small), or "
        "any model `pipesim validate --model` takes, one per --model (repeat it); default mlp",
    )
    p.add_argument(
        "--microbatch-size",
        type=positive,
        default=None,
        help=f"samples per micro-batch (default: 32 for gpt-small, {ELSEWHERE_MICROBATCH_SIZE} for models from "
        "elsewhere, 64 otherwise)",
    )
    p.add_argument(
        "--model-width", type=positive, default=None, help="hidden width of the model (its default if unset)"
    )
    p.add_argument(
        "--model-depth",
        type=positive,
        default=None,
        help="layers of the model (its default if unset; interleaved 1F1B needs 2 per stage)",
    )
    p.add_argument(
        "--stages",
        type=int_list,
        default="2",
        help="pipeline stages, comma-separated (more devices than cores share them, as the simulator models)",
    )
    p.add_argument("--microbatches", type=positive, default=8, help="micro-batches per iteration")
    p.add_argument("--iterations", type=positive, default=8, help="iterations per run (pipesim validate's default)")
    p.add_argument("--repeats", type=positive, default=2, help="runs per strategy (the median is reported)")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="every run measures its own profile and links, as separate `pipesim validate` invocations do "
        "(the spread over --repeats is then the run-to-run spread)",
    )
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "single"), help="how the devices run")
    p.add_argument(
        "--strategies",
        type=_names_of("strategy", strategy_names),
        default=None,
        help="comma-separated subset (default: all)",
    )


def run_bench(args) -> dict:
    started = time.perf_counter()
    configs = []
    for model in [m for given in args.model or [["mlp"]] for m in given]:
        b = args.microbatch_size or (
            DEFAULT_MICROBATCH_SIZE.get(model, 64) if model in model_names() else ELSEWHERE_MICROBATCH_SIZE
        )
        for stages in args.stages:
            configs.append(
                run(
                    model,
                    b,
                    args.microbatches,
                    args.iterations,
                    args.repeats,
                    args.backend,
                    args.strategies,
                    args.model_width,
                    args.model_depth,
                    stages=stages,
                    fresh=args.fresh,
                )
            )
    rows = [r for c in configs for r in c["rows"] if "failed" not in r]
    return {
        "configs": configs,
        "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
        "seconds": round(time.perf_counter() - started, 1),
    }


def render(res: dict) -> str:
    """Every configuration's rows in one table, a verdict per configuration and over all."""
    labels = [_label(c["model"], i) for i, c in enumerate(res["configs"])]
    lines = [_measured_line(c, label) for c, label in zip(res["configs"], labels, strict=True)]
    lines.append(
        f"{'model':10} {'p':>2} {'strategy':18} {'measured ms':>12} {'predicted ms':>13} {'error':>8}  "
        f"{'runs':24} {'spread':>7} {'at run speed':>12} {'no cpu model':>12} {'start p90':>9} {'bubble m/p':>10}"
    )
    for c, label in zip(res["configs"], labels, strict=True):
        for r in c["rows"]:
            if "failed" in r:
                lines.append(f"{label:10} {c['stages']:>2} {r['strategy']:18} failed: {r['failed']}")
                continue
            runs = " ".join(f"{e:+.1%}" for e in r["errors"])
            plain = "" if r.get("error_without_cpu_model") is None else f"{r['error_without_cpu_model']:+.1%}"
            spread = f"{r['spread'] * 100:.1f}" if len(r["errors"]) > 1 else ""
            at_speed = "" if r.get("error_at_run_speed") is None else f"{r['error_at_run_speed']:+.1%}"
            lines.append(
                f"{label:10} {c['stages']:>2} {r['strategy']:18} {r['measured_s'] * 1e3:12.2f} "
                f"{r['predicted_s'] * 1e3:13.2f} {r['error']:+8.1%}  {runs:24} {spread:>7} {at_speed:>12} {plain:>12} "
                f"{r['start_error_p90']:9.1%} {r['bubble_measured']:.2f}/{r['bubble_predicted']:.2f}"
            )
    for c, label in zip(res["configs"], labels, strict=True):
        targets = (c.get("target_median", TARGETS["catalog"][0]), c.get("target_each", TARGETS["catalog"][1]))
        lines.append(f"{label}, {c['stages']} stages: " + _verdict(c["rows"], *targets))
        if any(len(r.get("errors", ())) > 1 for r in c["rows"]):
            lines += _spread_lines(c, label)
            lines.append(f"{label}, {c['stages']} stages, run to run: " + _spread_verdict(c))
    if len(res["configs"]) > 1:
        kinds = {
            (c.get("target_median", TARGETS["catalog"][0]), c.get("target_each", TARGETS["catalog"][1]))
            for c in res["configs"]
        }
        targets = kinds.pop() if len(kinds) == 1 else TARGETS["catalog"]
        lines.append("all: " + _verdict([r for c in res["configs"] for r in c["rows"]], *targets))
    lines.append(f"({res['seconds']:.0f} s)")
    return "\n".join(lines)


def _label(model: str, index: int) -> str:
    """The model's name in the table: itself, or ``#k`` when it is too long (named in its header line)."""
    return model if len(model) <= 10 else f"#{index + 1}"


def _measured_line(c: dict, label: str) -> str:
    name = c["model"] if label == c["model"] else f"{label} = {c['model']}"
    depth = f" depth {c['model_depth']}" if c.get("model_depth") is not None else ""
    return (
        f"{name}{depth}, {c['stages']} stages, micro-batch {c['microbatch_size']}, m={c['microbatches']}, "
        f"{c['iterations']} iterations, {c['backend']}{', measured afresh every run' if c.get('fresh') else ''}; "
        f"link {c['link_latency_s'] * 1e6:.0f} us + {c['link_bandwidth_Bps'] / 1e9:.2f} GB/s, "
        f"update bandwidth {c['update_bandwidth_Bps'] / 1e9:.1f} GB/s"
    )


def _verdict(rows: list[dict], median_target: float, each_target: float) -> str:
    """Median |error|, the worst strategy and the start-error p90 against the
    targets (a strategy whose run failed counts as outside them)."""
    failed = [r["strategy"] for r in rows if "failed" in r]
    rows = [r for r in rows if "failed" not in r]
    worst = max(rows, key=lambda r: abs(r["error"]))
    median = statistics.median(abs(r["error"]) for r in rows)
    starts = statistics.median(r["start_error_p90"] for r in rows)
    within = sum(abs(r["error"]) <= each_target for r in rows)
    return (
        f"median |error| {median:.1%} (target {median_target:.0%}), worst {worst['strategy']} {worst['error']:+.1%}, "
        f"{within} of {len(rows) + len(failed)} within {each_target:.0%}"
        + (f" ({', '.join(failed)} failed)" if failed else "")
        + f"; start error p90 median {starts:.1%} of the steady makespan (target 5%)"
    )


def _spread_lines(c: dict, label: str) -> list[str]:
    """Per strategy, every run's error, the same at the run's pass speed,
    and the pass-time ratios: the spread and what it is made of."""

    def errors(values: list[float], spread: float | None) -> str:
        return " ".join(f"{e:+.1%}" for e in values) + ("" if spread is None else f" ({spread * 100:.1f})")

    lines = [
        f"{label}, {c['stages']} stages, run to run: errors (spread, points) | at the run's pass speed | pass-time ratios"
    ]
    for r in c["rows"]:
        if "failed" not in r and len(r["errors"]) > 1:
            ratios = " ".join(f"x{x:.3f}" for x in r.get("pass_time_ratios", ()))
            lines.append(
                f"  {r['strategy']:18} {errors(r['errors'], r['spread']):32} | "
                f"{errors(r.get('errors_at_run_speed', []), r.get('spread_at_run_speed')):32} | {ratios}"
            )
    return lines


def _spread_verdict(c: dict) -> str:
    """The widest spread of one strategy's errors over its repeats, and what moved."""
    rows = [r for r in c["rows"] if "failed" not in r]
    widest = max(rows, key=lambda r: r["spread"])
    within = sum(r["spread"] <= SPREAD_TARGET for r in rows)
    line = (
        f"widest spread {widest['spread'] * 100:.1f} points ({widest['strategy']}: prediction moved "
        f"{widest['predicted_spread']:.1%}, measurement {widest['measured_spread']:.1%}), {within} of {len(rows)} "
        f"within {SPREAD_TARGET * 100:.0f} points"
        + ("" if c.get("fresh") else " (one profile for all runs: --fresh measures each run's own)")
    )
    at_speed = [r for r in rows if r.get("spread_at_run_speed") is not None]
    if at_speed:
        widest = max(at_speed, key=lambda r: r["spread_at_run_speed"])
        within = sum(r["spread_at_run_speed"] <= SPREAD_TARGET for r in at_speed)
        line += (
            f"; at the run's pass speed, widest {widest['spread_at_run_speed'] * 100:.1f} points "
            f"({widest['strategy']}), {within} of {len(at_speed)} within {SPREAD_TARGET * 100:.0f}"
        )
    return line


def main(argv=None, prog: str = "python -m pipesim.experiments.bench.validate") -> int:
    return bench_main(
        argv, prog=prog, description=__doc__.splitlines()[0], add_arguments=add_arguments, run=run_bench, render=render
    )


if __name__ == "__main__":
    raise SystemExit(run_command(main))

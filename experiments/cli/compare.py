"""``pipesim compare``: several strategies on the same model and machine (the
default job: ``pipesim compare`` with no arguments); ``--planned`` plans each
that takes per-stage replicas first. Writes comparison.html, comparison.json
and each strategy's files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipesim.experiments.cli.common import (
    COMPARE_HARDWARE,
    COMPARE_MODEL,
    add_machine_args,
    add_schedule_args,
    fmt_bytes,
    given_strategy_options,
    output_dir,
    plan_profile,
    rate,
    recorded_path,
    schedule_spec,
    simulate_one,
    strategy_names,
    table,
)
from pipesim.experiments.cliargs import UsageError

COMPARE_ITERATIONS = 4


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("compare", help="simulate several strategies on one model and machine")
    add_schedule_args(p, one_strategy=False, iterations=COMPARE_ITERATIONS)
    # asynchronous schedules are compared in steady state, not on their warm-up
    p.set_defaults(iterations=COMPARE_ITERATIONS)
    p.add_argument("--strategies", default=None, help="comma-separated (default: all)")
    p.add_argument("--strategy", dest="one_strategy", default=None, help=argparse.SUPPRESS)  # refused: see run
    p.add_argument(
        "--planned",
        action="store_true",
        help="plan each strategy that takes per-stage replicas on the --stages devices first "
        "(pipesim plan) and simulate the configuration it chooses",
    )
    add_machine_args(p, model=COMPARE_MODEL, hardware=COMPARE_HARDWARE)
    p.add_argument("--out", default="out/compare", help="output folder")
    p.set_defaults(func=run)


def run(args) -> int:
    from pipesim.sim.engine.metrics import dumps

    if args.one_strategy is not None:
        raise UsageError(
            f"pipesim compare: name the strategies to compare with --strategies (comma-separated), "
            f"e.g. --strategies {args.one_strategy}"
        )
    strategies = _compared(args.strategies)
    built, depths = _check_compared(args, strategies)
    layers = _uniform_layers(args, depths)
    out = output_dir(args.out)
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
        s = simulate_one(
            args,
            strategy,
            out / strategy,
            outputs=True,
            plan=planned,
            spec=None if planned is None else planned.spec(),
            built=built.pop(strategy, None),
            uniform_layers=layers,
        )
        summaries[strategy] = s
        if base is None:
            base = s["throughput_samples_per_s"]
        row = [
            strategy,
            str(s["devices_count"]),
            f"{s['iteration_time_s'] * 1e3:.2f}",
            rate(s["throughput_samples_per_s"]),
            _ratio(s["throughput_samples_per_s"], base),
            f"{s['bubble_fraction']:.3f}",
            fmt_bytes(s["peak_memory_bytes_max"]),
            str(max(st["staleness_max"] for st in s["stages_info"])),
            "yes" if s["out_of_memory"] else "",
        ]
        if args.planned:
            row[1:1] = [s["plan"]["config"] if "plan" in s else "", f"{s['microbatches']}x{s['iterations']}"]
        rows.append(row)
    first = next(iter(summaries.values()))
    print(
        f"{first['meta'].get('model')} on {first['meta'].get('hardware')}, "
        f"{args.stages} {'devices' if args.planned else 'stages'}, {args.microbatches or 8} micro-batches, "
        f"{args.iterations} iteration(s)"
        + (" (a planned run may need another: run = m x iterations)" if args.planned else "")
    )
    header = [
        "strategy",
        "devices",
        "iter ms",
        "samples/s",
        f"vs {strategies[0]}",
        "bubble",
        "peak mem",
        "staleness",
        "OOM",
    ]
    if args.planned:
        header[1:1] = ["config", "run"]
    print(table(rows, header))
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
    print(
        f"wrote {out}/comparison.html, comparison.json and {out}/<strategy>/timeline.html, trace.json, summary.json"
        + (", plan.json, pareto.html" if plans else "")
    )
    return 0


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def _compared(names: str | None) -> list[str]:
    """The strategies ``--strategies`` names (default: all), each once, all
    checked before the first is simulated."""
    from pipesim.sim.strategies import get_strategy

    if names is None:
        return strategy_names()
    chosen = list(dict.fromkeys(n.strip() for n in names.split(",")))
    for name in chosen:
        get_strategy(name)  # a one-line StrategyError naming the choices
    return chosen


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
    from pipesim.sim.engine.size import BYTES_PER_PASS, available_memory_bytes, check_size, estimate_passes
    from pipesim.sim.planning.plan import plannable
    from pipesim.sim.strategies import build_schedule

    hw = resolve_hardware(args.hardware or "ideal")
    if args.planned:
        hw.check_devices(args.stages)
    built, depths = {}, {}
    available = available_memory_bytes()
    keep = None if available is None else available // 2 // BYTES_PER_PASS  # passes the kept schedules may hold
    for name in strategies:
        if not (args.planned and name in plannable("replicas")):
            spec = schedule_spec(args, name)
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


def _compare_plans(
    args, strategies: list[str], out: Path, uniform_layers: int | None = None
) -> tuple[dict, dict[str, str]]:
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
    profile = plan_profile(args, hw, uniform_layers or args.stages)
    planned, left_out = {}, {}
    for name in strategies:
        if name not in plannable("replicas"):  # compare plans splits and replicas
            continue
        print(f"planning {name} on {args.stages} devices ...", file=sys.stderr, flush=True)
        options = {k: v for k, v in given_strategy_options(args, name).items() if k not in ("replicas", "width")}
        try:
            record = plan(
                PlanRequest(
                    name,
                    profile,
                    hw,
                    args.stages,
                    microbatches=args.microbatches or 8,
                    iterations=args.iterations,
                    options=options,
                    recv_lookahead=args.recv_lookahead,
                    model=args.model,
                    profile_path=recorded_path(args.profile),
                )
            ).to_json()
        except NothingRunsError as e:  # said once: by run, as a note or as its error
            left_out[name] = str(e)
            continue
        write_plan(record, out / name)
        planned[name] = (plan_file(record), record)
    return planned, left_out

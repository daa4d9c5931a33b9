"""``pipesim simulate``: one strategy (or an imported schedule CSV, or a plan
from ``pipesim plan``) on a model and a machine; prints a table, writes
summary.json, trace.json, timeline.html."""

from __future__ import annotations

import sys
import time

from pipesim.experiments.cli.common import (
    add_machine_args,
    add_schedule_args,
    flag_of,
    fmt_bytes,
    given_strategy_options,
    output_dir,
    rate,
    simulate_one,
    table,
)
from pipesim.experiments.cliargs import UsageError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="simulate one strategy or an imported schedule")
    add_schedule_args(p, imports_csv=True)
    p.add_argument("--schedule", default=None, help="schedule CSV (torch or pipesim spelling) instead of --strategy")
    add_machine_args(p, takes_plan=True)
    p.add_argument("--out", default="out/simulate", help="output folder")
    p.add_argument("--json", action="store_true", help="print summary.json instead of the table")
    p.add_argument("--summary-only", action="store_true", help="write only summary.json (skip trace and timeline)")
    p.add_argument(
        "--plan",
        default=None,
        help="plan.json from `pipesim plan`: its strategy, stages, replicas and split, and by default its "
        "model, hardware and run",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    plan = _plan_arguments(args) if args.plan else None
    if not args.strategy and not args.schedule:
        raise UsageError("pipesim simulate: give --strategy NAME, --schedule FILE.csv or --plan FILE")
    if args.schedule and (args.strategy or given_strategy_options(args)):
        given = ["--strategy"] * bool(args.strategy) + _option_flags(args)
        raise UsageError(
            f"pipesim simulate: {', '.join(given)} configure a strategy to build, but --schedule "
            "imports one whose order is given; leave them out"
        )
    out = output_dir(args.out)
    started = time.perf_counter()
    summary = simulate_one(args, None, out, outputs=not args.summary_only, keep=True, plan=plan)
    if args.json:
        from pipesim.sim.engine.metrics import dumps

        sys.stdout.write(dumps(summary))
    else:
        _print_summary(summary)
        if plan is not None:
            p = summary["plan"]
            if p["steady_window"]:
                this_run = (
                    f"this run {p['steady_samples_per_s']:.1f} in steady state, "
                    f"{rate(summary['throughput_samples_per_s'])} over the whole run "
                    "(fill and drain included)"
                )
            else:  # nothing to leave out: say so rather than call the whole run steady
                this_run = (
                    f"this run {rate(summary['throughput_samples_per_s'])} over the whole run, too short "
                    "for a steady state (no whole period between its fill and its drain: run more iterations)"
                )
            planned = "in steady state" if p["predicted_is_steady"] else "over its whole run"
            if not p["predicted_is_simulated"]:
                planned += " (the cost model's)"
            print(f"plan {p['config']}: planned {p['predicted_samples_per_s']:.1f} samples/s {planned}; " + this_run)
        written = "summary.json" if args.summary_only else "summary.json, trace.json, timeline.html"
        print(f"wrote {written} to {out} in {time.perf_counter() - started:.2f} s")
    return 0


def _option_flags(args) -> list[str]:
    """The flags that gave the command line's strategy options, as typed."""
    return list(map(flag_of, given_strategy_options(args)))


def _plan_arguments(args):
    """Read ``--plan``: its strategy, replicas and split, and by default its
    model, hardware and run; a flag that would contradict it is an error."""
    from pipesim.sim.planning.plan import load_plan

    if args.schedule:
        raise UsageError("pipesim simulate: --plan and --schedule both give the schedule; choose one")
    plan = load_plan(args.plan)
    if args.strategy and args.strategy != plan.strategy:
        raise UsageError(f"pipesim simulate: the plan is for {plan.strategy}, not {args.strategy}")
    fixed = [f"--{k}" for k in ("replicas", "width") if getattr(args, k, None) is not None] + ["--stages"] * (
        args.stages_given and args.stages != len(plan.replicas)
    )
    if fixed:
        raise UsageError(f"pipesim simulate: the plan fixes the stages and their replicas; leave out {fixed[0]}")
    options = _option_flags(args)
    if options:
        raise UsageError(
            f"pipesim simulate: the plan fixes the strategy's options (it was chosen with them); leave out {options[0]}"
        )
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


def _print_summary(s: dict) -> None:
    print(
        f"{s['strategy']}: {s['stages']} stages on {s['devices_count']} devices, "
        f"{s['microbatches']} micro-batches x {s['iterations']} iterations "
        f"({s['meta'].get('model')} on {s['meta'].get('hardware')})"
    )
    print(
        f"iteration time {s['iteration_time_s'] * 1e3:.3f} ms, throughput "
        f"{rate(s['throughput_samples_per_s'])} samples/s, bubble {s['bubble_fraction']:.3f}"
    )
    rows = []
    for d in s["devices"]:
        rows.append(
            [
                str(d["id"]),
                f"{d['bubble_fraction']:.3f}",
                fmt_bytes(d["peak_memory_bytes"]),
                fmt_bytes(d["memory_breakdown"]["activations"]),
                "OOM" if d["out_of_memory"] else "",
            ]
        )
    print(table(rows, ["device", "bubble", "peak memory", "activations", ""]))
    rows = []
    for st in s["stages_info"]:
        row = [str(st["stage"]), str(st["weight_versions"]), str(st["staleness_max"]), f"{st['staleness_mean']:.2f}"]
        if "prediction_distance_fwd" in st:
            row += [str(st["prediction_distance_fwd"]), str(st["prediction_distance_bwd"])]
        rows.append(row)
    header = ["stage", "versions", "staleness max", "staleness mean"]
    if rows and len(rows[0]) > 4:
        header += ["s_fwd", "s_bwd"]
    print(table(rows, header))

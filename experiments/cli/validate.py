"""``pipesim validate``: profile, simulate, run for real (gloo, NCCL or one
device) and reconcile: report.json, overlay.html, trace.json; with
``--profiler-trace``, torch.profiler's trace of each rank too."""

from __future__ import annotations

from pipesim.experiments.cli.common import (
    add_schedule_args,
    fmt_bytes,
    given_strategy_options,
    model_args,
    output_dir,
    progress,
    table,
)
from pipesim.experiments.cliargs import nonnegative, seconds

#: Iterations a validation runs by default (ValidateConfig's default too): seven steady-state
#: intervals, so one slow interval moves the mean a seventh as much (docs/how-to/validate.md#run-to-run).
ITERATIONS = 8


def held_activations_line(rows: list[dict]) -> str:
    """report.json's ``held_activations`` as one line: per device, measured,
    predicted and the error."""

    def one(h: dict) -> str:
        pred = "no prediction" if h["predicted_bytes"] is None else f"{fmt_bytes(h['predicted_bytes'])} predicted"
        err = f" ({h['error']:+.1%})" if h["error"] is not None else ""
        return f"device {h['device']} {fmt_bytes(h['measured_bytes'])} measured, {pred}{err}"

    return "held activations: " + ", ".join(one(h) for h in rows)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("validate", help="run a schedule for real and reconcile it with the simulation")
    add_schedule_args(p, strategy_required=True, iterations=ITERATIONS, stages=2, executable=True)
    p.set_defaults(stages=2, iterations=ITERATIONS)
    model_args(p)
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl", "single"),
        default="gloo",
        help="gloo: CPU processes; nccl: one process per GPU; single: every stage on one device",
    )
    p.add_argument("--profile", default=None, help="use this profile JSON instead of profiling")
    p.add_argument("--hardware", default=None, help="use this hardware JSON instead of measuring links")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--synthetic", action="store_true", help="random inputs of the right shapes (timing only)")
    p.add_argument(
        "--recv-lookahead",
        type=nonnegative,
        default=1,
        help="post receives this many compute actions early (0 = right before use)",
    )
    p.add_argument("--timeout", type=seconds, default=600.0, help="seconds before the workers are stopped")
    p.add_argument("--oversubscribe", action="store_true", help="allow more worker processes than cores")
    p.add_argument(
        "--profiler-trace",
        action="store_true",
        help="run the timed iterations under torch.profiler and write each rank's Kineto trace, every action "
        "labelled PP:<torch action> and/or pipesim:<action>, to OUT/profiler/rank<R>.json.gz (Perfetto opens it). "
        "The profiler adds about 1 us to each operator a pass runs (2-10%%, inside the measured times); "
        "a CPU rank first makes 256 MiB of heap resident, which spares it page faults an unprofiled run takes, "
        "so a profiled run may time faster than an unprofiled one: compare profiled runs with profiled runs. "
        "About 0.6 s a rank before and after the run",
    )
    p.add_argument("--out", default="out/validate", help="output folder")
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    from pathlib import Path

    from pipesim.experiments.overlay import write_merged_trace, write_overlay_html
    from pipesim.sim.engine.metrics import dumps
    from pipesim.sim.planning.plan import notation as notation_of
    from pipesim.sim.workloads.readers import save_profile
    from pipesim.validate.harness import ValidateConfig, run_validation
    from pipesim.validate.stage import OptimizerConfig

    out = output_dir(args.out)
    options = given_strategy_options(args)
    options.pop("width", None)  # replicas, below
    cfg = ValidateConfig(
        strategy=args.strategy,
        stages=args.stages,
        microbatches=args.microbatches or 8,
        model=args.model,
        backend=args.backend,
        iterations=args.iterations,
        microbatch_size=args.microbatch_size,
        replicas=args.width or 1,
        model_width=args.model_width,
        model_depth=args.model_depth,
        seed=args.seed,
        optimizer=OptimizerConfig(kind=args.optimizer, lr=args.lr, momentum=args.momentum),
        synthetic=args.synthetic,
        recv_lookahead=args.recv_lookahead,
        timeout_s=args.timeout,
        profile_path=args.profile,
        hardware_path=args.hardware,
        oversubscribe=args.oversubscribe,
        strategy_options=tuple(sorted(options.items())),
        profiler_trace=str(out / "profiler") if args.profiler_trace else None,
    )
    v = run_validation(cfg, progress=progress)
    r = v.report
    (out / "report.json").write_text(dumps(r))
    save_profile(v.profile, out / "profile.json")
    (out / "hardware.json").write_text(json.dumps(v.hardware.to_json(), indent=1) + "\n")
    flagged = r["flagged_actions"]
    replicas = dict(cfg.strategy_options).get("replicas")
    shape = (
        f"stages replicated {notation_of(replicas)}"
        if replicas
        else f"{r['stages']} stages" + (f" x {cfg.replicas} pipelines" if cfg.replicas > 1 else "")
    )
    title = (
        f"{cfg.strategy}, {shape}, {cfg.model}, {cfg.backend}: iteration "
        f"{r['iteration_time_measured_s'] * 1e3:.2f} ms measured, {r['iteration_time_predicted_s'] * 1e3:.2f} ms "
        f"predicted ({r['iteration_time_error']:+.1%})"
    )
    write_overlay_html(v.measured, v.predicted, out / "overlay.html", title=title, flagged=flagged)
    write_merged_trace(v.measured, v.predicted, out / "trace.json")
    a = r["action_errors"]
    print(title)
    rows = [
        [
            "iteration time (ms)",
            f"{r['iteration_time_measured_s'] * 1e3:.3f}",
            f"{r['iteration_time_predicted_s'] * 1e3:.3f}",
            f"{r['iteration_time_error']:+.1%}",
        ]
    ]
    if "pass_time_ratio" in r:  # the prediction again, every pass priced at the speed the run's passes ran
        rows.append(
            [
                f"  at the run's pass speed (x{r['pass_time_ratio']:.3f})",
                "",
                f"{r['iteration_time_predicted_at_run_speed_s'] * 1e3:.3f}",
                f"{r['iteration_time_error_at_run_speed']:+.1%}",
            ]
        )
    rows.append(
        [
            "bubble fraction",
            f"{r['bubble_fraction_measured']:.3f}",
            f"{r['bubble_fraction_predicted']:.3f}",
            f"{r['bubble_fraction_predicted'] - r['bubble_fraction_measured']:+.3f}",
        ]
    )
    print(table(rows, ["", "measured", "predicted", "error"]))
    print(
        f"per action: |start error| median {a['start_error_s']['median'] * 1e3:.3f} ms, p90 "
        f"{a['start_error_s']['p90'] * 1e3:.3f} ms; |duration error| median {a['duration_error']['median']:.1%}, "
        f"p90 {a['duration_error']['p90']:.1%}; {a['flagged_count']} of {a['compared']} actions over the thresholds"
    )
    for f in flagged[:5]:
        print(
            f"  device {f['device']} {f['action']}: {f['duration_measured_s'] * 1e3:.3f} ms measured, "
            f"{f['duration_predicted_s'] * 1e3:.3f} ms predicted"
        )
    wv = r["weight_versions"]
    print(
        f"weight versions: {'as predicted' if wv['match'] else str(wv['mismatches']) + ' passes differ'} "
        f"({wv['passes_compared']} passes); losses " + ", ".join(f"{x:.4f}" for x in r["losses"])
    )
    if r.get("held_activations"):
        print(held_activations_line(r["held_activations"]))
    print(f"wrote {out}/report.json, overlay.html, trace.json, profile.json, hardware.json")
    if cfg.profiler_trace is not None:
        traces = sorted(Path(cfg.profiler_trace).glob("rank*.json.gz"), key=lambda f: int(f.name[4:-8]))
        print(f"wrote {cfg.profiler_trace}/ (torch.profiler): " + ", ".join(f.name for f in traces))
    return 0

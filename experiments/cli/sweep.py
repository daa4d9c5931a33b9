"""``pipesim sweep``: a grid of configurations (strategy x stages x
micro-batches x hardware x model x options) on local workers or Ray;
sweep.json, sweep.csv, sweep.html (:mod:`pipesim.experiments.sweep`, which
also holds its options)."""

from __future__ import annotations

import time

from pipesim.experiments.cli.common import fmt_bytes, output_dir, rate, table


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="simulate a grid of configurations in parallel (local workers or Ray)")
    from pipesim.experiments.sweep import add_arguments as sweep_arguments

    sweep_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from pipesim.experiments import sweep

    grid = sweep.grid_from_args(args)  # every value checked before any work
    if args.ray is not None:
        sweep.check_ray_address(args.ray)
        sweep.import_ray()
    out = output_dir(args.out)
    started = time.perf_counter()
    doc = sweep.run_sweep(grid, workers=args.workers, ray=args.ray)
    seconds = time.perf_counter() - started
    written = sweep.write_outputs(doc, out)  # before any printing: a reader that stops early loses no file
    ran = sweep.local_workers(len(doc["points"]), args.workers)
    where = (
        f"Ray ({args.ray})"
        if args.ray
        else f"{ran} local worker(s)"
        + (f" of the {args.workers} asked for (one per chunk of points)" if args.workers and ran < args.workers else "")
    )
    print(
        f"{len(doc['points'])} points: {doc['simulated']} simulated, {doc['skipped']} skipped, "
        f"{sum(bool(p.get('out_of_memory')) for p in doc['points'])} out of memory; "
        f"{seconds:.2f} s on {where}"
    )
    for reason, count in list(sweep.skip_reasons(doc).items())[:3]:
        print(f"  skipped {count}: {reason}")
    rows = [
        [
            p["model"],
            p["hardware"],
            sweep.label(p, doc["axes"]),
            rate(p["throughput_samples_per_s"]),
            fmt_bytes(p["peak_memory_bytes_max"]),
        ]
        for p in sweep.best_points(doc)
    ]
    if rows:
        print("fastest configuration that fits in memory:")
        print(table(rows, ["model", "hardware", "configuration", "samples/s", "peak mem"]))
    else:
        print("no point ran and fit in memory: nothing to recommend")
    print(f"wrote {', '.join(written)} to {out}")
    return 0

"""Planner benchmark: ``pipesim bench plan`` (or ``python -m pipesim.experiments.bench.plan``).

Times :func:`pipesim.sim.planning.plan.plan` (search, cost model, and the
engine confirming the best candidates: all of what the planner's time is) on
PipeDream's published profiles over 16 GPUs of PipeDream's Cluster-A
(``pipedream-cluster-a-x4``), in this process: the time ``pipesim plan``
reports as ``planner_seconds``. The targets: VGG-16 under 0.5 s, ResNet-50
and GNMT-16 under 5 s (PipeDream's own optimizer took 0.5 s and 88 s on this
kind of machine). ``pipesim bench plan`` adds the end-to-end time of the
console script for the first case (interpreter start and imports included).

Nothing here asserts: the figures are for the reader.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from pipesim.experiments.cliargs import bench_main

#: (model, hardware, GPUs, target seconds)
CASES = (
    ("pipedream-vgg16", "pipedream-cluster-a-x4", 16, 0.5),
    ("pipedream-alexnet", "pipedream-cluster-a-x4", 16, 0.5),
    ("pipedream-resnet50", "pipedream-cluster-a-x4", 16, 5.0),
    ("pipedream-gnmt16", "pipedream-cluster-a-x4", 16, 5.0),
)

#: The width x depth planner (PipeDream-2BW's; the flush baselines'):
#: (model, hardware, GPUs, global batch, strategies).
GRID_CASES = (
    ("gpt-1.3b", "dgx1-v100", 8, 64, ("pipedream-2bw", "1f1b", "gpipe")),
    ("bert-large", "dgx1-v100", 8, 64, ("pipedream-2bw", "1f1b", "gpipe")),
)


def grid_seconds(
    model: str, hardware: str, gpus: int, batch: int, strategy: str, repeat: int
) -> tuple[list[float], dict]:
    """Sorted wall times of the width x depth planner, and the last record."""
    from pipesim.sim.hardware.machines import load_hardware
    from pipesim.sim.partition.layout import traits_of
    from pipesim.sim.planning.grid import GridRequest, plan_grid
    from pipesim.sim.workloads.catalog import model_profile

    hw = load_hardware(hardware)
    times, record = [], {}
    for _ in range(repeat):
        traits_of.cache_clear()
        start = time.perf_counter()
        record = plan_grid(
            GridRequest(strategy, lambda b: model_profile(model, hw.device, b), hw, gpus, batch, model=model)
        ).to_json()
        times.append(time.perf_counter() - start)
    return sorted(times), record


def plan_seconds(model: str, hardware: str, gpus: int, strategy: str, repeat: int) -> tuple[list[float], dict]:
    """Sorted wall times of planning ``model``, and the last plan's record."""
    from pipesim.sim.hardware.machines import load_hardware
    from pipesim.sim.partition.layout import traits_of
    from pipesim.sim.planning.plan import PlanRequest, plan
    from pipesim.sim.workloads.catalog import model_profile

    hw = load_hardware(hardware)
    profile = model_profile(model, hw.device)
    times, record = [], {}
    for _ in range(repeat):
        traits_of.cache_clear()  # every run measures the strategy's probe too
        start = time.perf_counter()
        record = plan(PlanRequest(strategy, profile, hw, gpus, model=model)).to_json()
        times.append(time.perf_counter() - start)
    return sorted(times), record


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strategy", default="pipedream", help="the strategy planned")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (best and median reported)")
    parser.add_argument("--quick", action="store_true", help="the first case only")


def run(args: argparse.Namespace) -> dict:
    cases = CASES[:1] if args.quick else CASES
    rows = []
    for i, (model, hardware, gpus, target) in enumerate(cases, 1):
        print(
            f"[{i}/{len(cases)}] planning {args.strategy} for {model} on {gpus} GPUs of {hardware} ...",
            file=sys.stderr,
            flush=True,
        )
        times, record = plan_seconds(model, hardware, gpus, args.strategy, args.repeat)
        rows.append(
            {
                "model": model,
                "hardware": hardware,
                "gpus": gpus,
                "strategy": args.strategy,
                "config": record["config"],
                "speedup_vs_dp": record["speedup_vs_dp"],
                "candidates": len(record["candidates"]),
                "simulated": sum(c["simulated_samples_per_s"] is not None for c in record["candidates"]),
                "best_s": round(times[0], 3),
                "median_s": round(statistics.median(times), 3),
                "target_s": target,
            }
        )
    grid_rows = []
    for model, hardware, gpus, batch, names in () if args.quick else GRID_CASES:
        for strategy in names:
            print(
                f"planning {strategy} (width x depth) for {model}, batch {batch}, on {gpus} GPUs of {hardware} ...",
                file=sys.stderr,
                flush=True,
            )
            times, record = grid_seconds(model, hardware, gpus, batch, strategy, args.repeat)
            best = record["candidates"][record["chosen"]]
            grid_rows.append(
                {
                    "model": model,
                    "hardware": hardware,
                    "gpus": gpus,
                    "batch_size": batch,
                    "strategy": strategy,
                    "width": record["width"],
                    "depth": len(record["stages"]),
                    "microbatch_size": record["microbatch_size"],
                    "recompute": record["recompute"],
                    "samples_per_s": record["predicted_samples_per_s"],
                    "peak_memory_gib": round(best["peak_memory_bytes"] / 2**30, 2),
                    "candidates": len(record["candidates"]),
                    "simulated": sum(c["simulated_samples_per_s"] is not None for c in record["candidates"]),
                    "best_s": round(times[0], 3),
                    "median_s": round(statistics.median(times), 3),
                }
            )
    return {"cases": rows, "width_depth": grid_rows}


def render(report: dict) -> str:
    lines = [
        f"{'model':<20} {'gpus':>4} {'config':<28} {'vs DP':>6} {'cands':>5} {'sims':>4} {'best s':>7} "
        f"{'median s':>8} {'target':>6}"
    ]
    for r in report["cases"]:
        config = r["config"] if len(r["config"]) <= 28 else r["config"][:25] + "..."
        lines.append(
            f"{r['model']:<20} {r['gpus']:>4} {config:<28} {r['speedup_vs_dp']:>5.2f}x {r['candidates']:>5} "
            f"{r['simulated']:>4} {r['best_s']:>7.3f} {r['median_s']:>8.3f} {r['target_s']:>5.1f}s"
        )
    if report.get("width_depth"):
        lines.append(
            f"{'width x depth planner':<22} {'strategy':<14} {'w x d':>5} {'b':>3} {'recompute':>9} "
            f"{'samples/s':>9} {'GiB':>6} {'cands':>5} {'sims':>4} {'best s':>7} {'median s':>8}"
        )
        for r in report["width_depth"]:
            lines.append(
                f"{r['model'] + ', B=' + str(r['batch_size']):<22} {r['strategy']:<14} "
                f"{str(r['width']) + 'x' + str(r['depth']):>5} {r['microbatch_size']:>3} "
                f"{'yes' if r['recompute'] else 'no':>9} {r['samples_per_s']:>9.1f} {r['peak_memory_gib']:>6.2f} "
                f"{r['candidates']:>5} {r['simulated']:>4} {r['best_s']:>7.3f} {r['median_s']:>8.3f}"
            )
    e2e = report.get("console_script")
    if e2e:
        lines.append(
            f"end to end, `pipesim plan --model {e2e['model']} ...`: best {e2e['best_s']:.2f} s, "
            f"median {e2e['median_s']:.2f} s of 3 (interpreter start and imports included)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m pipesim.experiments.bench.plan") -> int:
    return bench_main(
        argv, prog=prog, description=__doc__.split("\n")[0], add_arguments=add_arguments, run=run, render=render
    )


if __name__ == "__main__":
    from pipesim.experiments.cliargs import run_command

    sys.exit(run_command(main))

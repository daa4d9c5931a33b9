"""Benchmark: how well does the simulator predict real runs of every strategy?

``pipesim bench validate`` (or ``python -m pipesim.validate.bench``) profiles a model once on this machine
(per-layer costs, pass overhead, optimizer bandwidth, point-to-point links),
then validates every strategy with 2 pipeline stages against that one
profile: each strategy is simulated and run for real (gloo, one process per
device), and the steady-state iteration times are compared. It prints one
row per strategy and the median absolute error, the figure the validation
target is stated in (median |error| <= 5%).

Runs are repeated (``--repeats``) and the median error of each strategy is
reported, because a shared 2-core machine is noisy; every figure comes from
runs made in this one invocation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pipesim.sim.cliargs import bench_main, list_choices, positive, run_command
from pipesim.sim.strategies import strategy_names
from pipesim.sim.workload import save_profile
from .models import model_names

def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(model: str = "mlp", microbatch_size: int = 64, microbatches: int = 8, iterations: int = 4,
        repeats: int = 2, backend: str = "gloo", strategies=None, model_width=None, model_depth=None) -> dict:
    from .harness import ValidateConfig, hardware_for, model_of, profile, run_validation, torch_device

    base = ValidateConfig(strategy="1f1b", stages=2, microbatches=microbatches, model=model, backend=backend,
                          iterations=iterations, microbatch_size=microbatch_size, model_width=model_width,
                          model_depth=model_depth)
    device = torch_device(backend)
    tmp = Path(tempfile.mkdtemp(prefix="pipesim-bench-"))
    _say(f"profiling {model} (micro-batch {microbatch_size}) on {device} ...")
    real = model_of(base)
    save_profile(profile(base, device, model=real), tmp / "profile.json")
    hw = hardware_for(base, device, 2, model=real)
    (tmp / "hardware.json").write_text(json.dumps(hw.to_json()))
    rows = []
    chosen = strategy_names() if strategies is None else list(strategies)
    for i, name in enumerate(chosen, 1):
        errors, meas, pred = [], [], []
        for r in range(repeats):
            _say(f"[{i}/{len(chosen)}] {name}, run {r + 1}/{repeats} ...")
            cfg = ValidateConfig(strategy=name, stages=2, microbatches=microbatches, model=model, backend=backend,
                                 iterations=iterations, microbatch_size=microbatch_size,
                                 model_width=model_width, model_depth=model_depth,
                                 profile_path=str(tmp / "profile.json"), hardware_path=str(tmp / "hardware.json"))
            rep = run_validation(cfg).report
            errors.append(rep["iteration_time_error"])
            meas.append(rep["iteration_time_measured_s"])
            pred.append(rep["iteration_time_predicted_s"])
        rows.append({"strategy": name, "measured_s": statistics.median(meas), "predicted_s": statistics.median(pred),
                     "error": statistics.median(errors), "errors": errors,
                     "bubble_measured": rep["bubble_fraction_measured"],
                     "bubble_predicted": rep["bubble_fraction_predicted"]})
    return {"model": model, "microbatch_size": microbatch_size, "microbatches": microbatches,
            "iterations": iterations, "backend": backend, "rows": rows,
            "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
            "link_latency_s": hw.intra_node.latency, "link_bandwidth_Bps": hw.intra_node.bandwidth,
            "update_bandwidth_Bps": hw.device.mem_bandwidth}


def add_arguments(p) -> None:
    list_choices(p.add_argument("--model", default="mlp", help="real model to validate"), model_names)
    p.add_argument("--microbatch-size", type=positive, default=64, help="samples per micro-batch")
    p.add_argument("--microbatches", type=positive, default=8, help="micro-batches per iteration")
    p.add_argument("--iterations", type=positive, default=4, help="iterations per run")
    p.add_argument("--repeats", type=positive, default=2, help="runs per strategy (the median is reported)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "single"), help="how the devices run")
    list_choices(p.add_argument("--strategies", default=None, help="comma-separated subset (default: all)"),
                 strategy_names)


def run_bench(args) -> dict:
    started = time.perf_counter()
    res = run(args.model, args.microbatch_size, args.microbatches, args.iterations, args.repeats, args.backend,
              args.strategies.split(",") if args.strategies else None)
    res["seconds"] = round(time.perf_counter() - started, 1)
    return res


def render(res: dict) -> str:
    lines = [f"{res['model']}, micro-batch {res['microbatch_size']}, m={res['microbatches']}, "
             f"{res['iterations']} iterations, {res['backend']}; link {res['link_latency_s'] * 1e6:.0f} us + "
             f"{res['link_bandwidth_Bps'] / 1e9:.2f} GB/s, update bandwidth {res['update_bandwidth_Bps'] / 1e9:.1f} GB/s",
             f"{'strategy':18} {'measured ms':>12} {'predicted ms':>13} {'error':>8}  {'runs':18} {'bubble m/p':>12}"]
    for r in res["rows"]:
        runs = " ".join(f"{e:+.1%}" for e in r["errors"])
        lines.append(f"{r['strategy']:18} {r['measured_s'] * 1e3:12.2f} {r['predicted_s'] * 1e3:13.2f} "
                     f"{r['error']:+8.1%}  {runs:18} {r['bubble_measured']:.2f}/{r['bubble_predicted']:.2f}")
    lines.append(f"median |error| over {len(res['rows'])} strategies: {res['median_abs_error']:.1%} "
                 f"({res['seconds']:.0f} s)")
    return "\n".join(lines)


def main(argv=None, prog: str = "python -m pipesim.validate.bench") -> int:
    return bench_main(argv, prog=prog, description=__doc__.splitlines()[0], add_arguments=add_arguments,
                      run=run_bench, render=render)


if __name__ == "__main__":
    raise SystemExit(run_command(main))

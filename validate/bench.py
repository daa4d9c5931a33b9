"""Benchmark: how well does the simulator predict real runs of every strategy?

``python -m pipesim.validate.bench`` profiles a model once on this machine
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

from pipesim.sim.workload import save_profile

#: (strategy, extra ScheduleSpec options, replicas): every strategy on two devices
STRATEGIES = (
    ("gpipe", (), 1),
    ("1f1b", (), 1),
    ("interleaved-1f1b", (("chunks", 2),), 1),
    ("zb-h1", (), 1),
    ("pipedream", (), 1),
    ("pipedream-2bw", (), 1),
    ("spectrain", (), 1),
    ("avgpipe", (), 2),
    ("data-parallel", (), 1),
)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(model: str = "mlp", microbatch_size: int = 64, microbatches: int = 8, iterations: int = 4,
        repeats: int = 2, backend: str = "gloo", strategies=None, model_width=None, model_depth=None) -> dict:
    from pipesim.validate.harness import ValidateConfig, hardware_for, model_of, profile, run_validation, torch_device

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
    chosen = [s for s in STRATEGIES if strategies is None or s[0] in strategies]
    for i, (name, options, replicas) in enumerate(chosen, 1):
        errors, meas, pred = [], [], []
        for r in range(repeats):
            _say(f"[{i}/{len(chosen)}] {name}, run {r + 1}/{repeats} ...")
            cfg = ValidateConfig(strategy=name, stages=2, microbatches=microbatches, model=model, backend=backend,
                                 iterations=iterations, microbatch_size=microbatch_size, replicas=replicas,
                                 model_width=model_width, model_depth=model_depth, strategy_options=options,
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipesim.validate.bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp")
    p.add_argument("--microbatch-size", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "single"))
    p.add_argument("--strategies", default=None, help="comma-separated subset")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    started = time.perf_counter()
    res = run(args.model, args.microbatch_size, args.microbatches, args.iterations, args.repeats, args.backend,
              args.strategies.split(",") if args.strategies else None)
    print(f"{res['model']}, micro-batch {res['microbatch_size']}, m={res['microbatches']}, "
          f"{res['iterations']} iterations, {res['backend']}; link {res['link_latency_s'] * 1e6:.0f} us + "
          f"{res['link_bandwidth_Bps'] / 1e9:.2f} GB/s, update bandwidth {res['update_bandwidth_Bps'] / 1e9:.1f} GB/s")
    print(f"{'strategy':18} {'measured ms':>12} {'predicted ms':>13} {'error':>8}  {'runs':18} {'bubble m/p':>12}")
    for r in res["rows"]:
        runs = " ".join(f"{e:+.1%}" for e in r["errors"])
        print(f"{r['strategy']:18} {r['measured_s'] * 1e3:12.2f} {r['predicted_s'] * 1e3:13.2f} {r['error']:+8.1%}  "
              f"{runs:18} {r['bubble_measured']:.2f}/{r['bubble_predicted']:.2f}")
    print(f"median |error| over {len(res['rows'])} strategies: {res['median_abs_error']:.1%} "
          f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

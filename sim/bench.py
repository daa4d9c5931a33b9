"""Simulator benchmark: ``python -m pipesim.sim.bench [--json]``.

Prints, measured in one process so the ratios hold on a noisy machine:

* SimPy's raw rate: one process yielding bare timeouts (the ceiling any
  SimPy model can reach);
* simulated compute actions per second of the full ``simulate()`` path
  (validation, lowering, engine, trackers, summary) for several sizes, and
  its ratio to the raw rate;
* the time of the issue's target, ``pipesim simulate --strategy 1f1b
  --stages 64 --microbatches 1024`` (131,072 compute actions), run end to
  end through the CLI in a fresh interpreter, with ``--summary-only`` and
  with every output (trace.json, timeline.html) written.

Nothing here asserts: the figures are for the reader (and the issue note).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import simpy

from pipesim.sim._gc import gc_paused
from pipesim.sim.api import simulate
from pipesim.sim.metrics import summarize
from pipesim.sim.strategies import ScheduleSpec


def raw_simpy_rate(n: int = 300_000) -> float:
    """Bare timeouts per second in one SimPy process."""

    def proc(env):
        for _ in range(n):
            yield env.timeout(1)

    env = simpy.Environment()
    env.process(proc(env))
    start = time.perf_counter()
    with gc_paused():
        env.run()
    return n / (time.perf_counter() - start)


def simulate_rate(strategy: str, p: int, m: int, model: str = "uniform", hardware: str = "ideal",
                  iterations: int = 1) -> dict:
    spec = ScheduleSpec(strategy, p, m, iterations=iterations)
    start = time.perf_counter()
    result = simulate(spec, model, hardware)
    summary = summarize(result)
    elapsed = time.perf_counter() - start
    actions = summary["compute_actions"]
    return {"strategy": strategy, "stages": p, "microbatches": m, "model": model, "hardware": hardware,
            "compute_actions": actions, "seconds": round(elapsed, 4), "actions_per_s": round(actions / elapsed)}


def cli_seconds(args: list[str], repeat: int = 3) -> tuple[float, float]:
    """(best, median) wall time of ``pipesim <args>`` over ``repeat`` fresh
    interpreters (imports and exit included)."""
    times = []
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "pipesim.experiments.cli", *args, "--out", out]
        for _ in range(repeat):
            start = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONHASHSEED": "0"})
            times.append(time.perf_counter() - start)
    times.sort()
    return times[0], times[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipesim.sim.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--quick", action="store_true", help="small sizes only (skip the 131k-action target)")
    args = parser.parse_args(argv)

    raw = raw_simpy_rate()
    cases = [("1f1b", 8, 64, "uniform", "ideal"), ("pipedream", 8, 64, "uniform", "ideal"),
             ("gpipe", 16, 128, "gpt-1.3b", "dgx-h100-x2"), ("spectrain", 4, 256, "vgg16", "pcie-4gpu")]
    if not args.quick:
        cases.append(("1f1b", 64, 1024, "uniform", "ideal"))
    rows = []
    for i, (strategy, p, m, model, hw) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {strategy} p={p} m={m} on {hw} ...", file=sys.stderr, flush=True)
        row = simulate_rate(strategy, p, m, model, hw)
        row["ratio_to_raw_simpy"] = round(row["actions_per_s"] / raw, 4)
        rows.append(row)
    target = {}
    if not args.quick:
        base = ["simulate", "--strategy", "1f1b", "--stages", "64", "--microbatches", "1024"]
        print("[cli] pipesim simulate ... p=64 m=1024 (summary only, then all outputs)", file=sys.stderr, flush=True)
        best, median = cli_seconds([*base, "--summary-only"])
        all_best, all_median = cli_seconds(base, repeat=1)
        target = {"cli_summary_only_best_s": round(best, 3), "cli_summary_only_median_s": round(median, 3),
                  "cli_all_outputs_s": round(all_best, 3), "target_s": 2.0}
    report = {"raw_simpy_timeouts_per_s": round(raw), "cases": rows, "target": target}
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    print(f"SimPy raw timeouts/s: {raw:,.0f}")
    print(f"{'strategy':<10} {'p':>3} {'m':>5} {'model':<9} {'hardware':<12} {'actions':>8} {'s':>7} "
          f"{'actions/s':>10} {'vs raw':>7}")
    for r in rows:
        print(f"{r['strategy']:<10} {r['stages']:>3} {r['microbatches']:>5} {r['model']:<9} {r['hardware']:<12} "
              f"{r['compute_actions']:>8} {r['seconds']:>7.3f} {r['actions_per_s']:>10,} {r['ratio_to_raw_simpy']:>7.3f}")
    if target:
        print(f"CLI, 1f1b p=64 m=1024 (131,072 compute actions), --summary-only: best "
              f"{target['cli_summary_only_best_s']:.2f} s, median {target['cli_summary_only_median_s']:.2f} s of 3 "
              f"(target {target['target_s']:.1f} s); writing trace.json and timeline.html too: "
              f"{target['cli_all_outputs_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

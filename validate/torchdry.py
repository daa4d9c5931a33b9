"""pipesim against torch's own dry run of a torch schedule: ``python -m pipesim.validate.torchdry``.

A user who only wants to know whether a torch schedule runs, and how, can ask
torch (``_simulate_comms_compute``, the dry run behind
``_PipelineScheduleRuntime._simulate``) or pipesim (``pipesim simulate
--schedule X.csv --summary-only``, which also times it on a machine model).
This benchmark times both on torch's own schedules:

* **torch**: the schedule class builds its per-rank order with communication
  (``pipeline_order_with_comms``, stage stand-ins: no processes needed), and
  ``_simulate_comms_compute`` runs on it, timed alone: torch already imported,
  the order already built. It cannot simulate UNSHARD, RESHARD or
  REDUCE_GRAD, so those are left out of what it is given;
* **pipesim**: the CSV torch writes for the same schedule (``_dump_csv``,
  everything included), simulated end to end with ``pipesim simulate
  --schedule X.csv --summary-only``: once in a fresh interpreter (start-up and
  imports included, best of ``repeat``) and once in-process through the CLI's
  ``main`` (best of ``repeat``).

The ratio is torch's seconds over pipesim's: above 1, pipesim answers sooner.
Nothing here asserts; the figures are for the reader. Importing this module
imports no torch (it is imported inside the torch-side functions).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

#: (ranks p, stages per rank v, micro-batches m) timed by default.
DEFAULT_SIZES = ((4, 2, 16), (8, 2, 64), (16, 2, 128), (16, 2, 256), (32, 2, 512))
#: Schedule classes whose comm order torch's dry run can simulate.
SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


def torch_schedule(name: str, p: int, v: int, m: int):
    """torch's ``name`` schedule for p ranks of v stages each and m
    micro-batches, built from stand-in stages (the classes read only the
    stage layout while planning)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    stages = [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=c * p, submod=None)
              for c in range(v)]
    return get_schedule_class(name)(stages, m)


def torch_dry_run_seconds(schedule, repeat: int = 1) -> float:
    """Best time of torch's ``_simulate_comms_compute`` on ``schedule``'s order
    with communication (without the action types it cannot simulate)."""
    from torch.distributed.pipelining import schedules as S

    simulated = {S.F, S.B, S.I, S.W, S.SEND_F, S.RECV_F, S.SEND_B, S.RECV_B}
    order = {rank: [a for a in acts if a.computation_type in simulated]
             for rank, acts in schedule.pipeline_order_with_comms.items()}
    home = schedule.stage_index_to_group_rank
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # it prints the schedule when stuck
            S._simulate_comms_compute(order, lambda s: home[s], schedule._num_stages)
        best = min(best, time.perf_counter() - start)
    return best


def pipesim_cli_seconds(csv_path: Path, repeat: int = 3) -> float:
    """Best wall time of ``pipesim simulate --schedule csv_path --summary-only``
    in a fresh interpreter (start-up and imports included)."""
    best = float("inf")
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "pipesim.experiments.cli", "simulate", "--schedule", str(csv_path),
               "--summary-only", "--out", out]
        for _ in range(repeat):
            start = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONHASHSEED": "0"})
            best = min(best, time.perf_counter() - start)
    return best


def pipesim_inprocess_seconds(csv_path: Path, repeat: int = 3) -> float:
    """Best time of the same command through the CLI's ``main`` in this process."""
    from pipesim.experiments.cli import main

    best = float("inf")
    with tempfile.TemporaryDirectory() as out:
        argv = ["simulate", "--schedule", str(csv_path), "--summary-only", "--out", out]
        for _ in range(repeat):
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                code = main(argv)
            best = min(best, time.perf_counter() - start)
            if code:
                raise RuntimeError(f"pipesim simulate --schedule {csv_path} exited {code}")
    return best


def compare(sizes=DEFAULT_SIZES, schedule: str = "Interleaved1F1B", repeat: int = 3, progress=None) -> list[dict]:
    """One row per (p, v, m): torch's dry-run seconds, pipesim's (fresh
    interpreter and in-process) and the ratios torch / pipesim."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (p, v, m) in enumerate(sizes, 1):
            if progress:
                progress(f"[{i}/{len(sizes)}] {schedule} p={p} v={v} m={m} ...")
            sched = torch_schedule(schedule, p, v, m)
            path = Path(tmp) / f"{schedule}-{p}-{v}-{m}.csv"
            sched._dump_csv(str(path))  # torch's own file, communication included
            actions = sum(len(acts) for acts in sched.pipeline_order_with_comms.values())
            torch_s = torch_dry_run_seconds(sched, repeat)
            cli_s = pipesim_cli_seconds(path, repeat)
            inproc_s = pipesim_inprocess_seconds(path, repeat)
            rows.append({
                "schedule": schedule, "ranks": p, "stages_per_rank": v, "microbatches": m, "actions": actions,
                "torch_dry_run_s": _sig(torch_s), "pipesim_cli_s": _sig(cli_s), "pipesim_inprocess_s": _sig(inproc_s),
                "ratio_cli": _sig(torch_s / cli_s), "ratio_inprocess": _sig(torch_s / inproc_s),
            })
    return rows


def _sig(x: float) -> float:
    """Four significant digits: enough for timings on a noisy machine."""
    return float(f"{x:.4g}")


def _sizes(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        sizes = tuple(tuple(int(x) for x in item.split(",")) for item in text.split())
    except ValueError:
        sizes = ()
    if not sizes or any(len(s) != 3 or min(s) < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"expected sizes like '4,2,16 8,2,64' (p,v,m), got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipesim.validate.torchdry",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="Interleaved1F1B", help="torch schedule class")
    parser.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES,
                        help="space-separated p,v,m triples (ranks, stages per rank, micro-batches)")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs of each side")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = compare(args.sizes, args.schedule, args.repeat,
                   progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    print(f"torch {args.schedule}: torch's _simulate_comms_compute against `pipesim simulate --schedule X.csv "
          f"--summary-only` (best of {args.repeat}; ratio = torch s / pipesim s, above 1 pipesim is faster)")
    print(f"{'p':>3} {'v':>2} {'m':>5} {'actions':>8} {'torch s':>8} {'pipesim s':>10} {'ratio':>6} "
          f"{'in-process s':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['ranks']:>3} {r['stages_per_rank']:>2} {r['microbatches']:>5} {r['actions']:>8} "
              f"{r['torch_dry_run_s']:>8.3f} {r['pipesim_cli_s']:>10.3f} {r['ratio_cli']:>6.2f} "
              f"{r['pipesim_inprocess_s']:>13.3f} {r['ratio_inprocess']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

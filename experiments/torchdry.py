"""pipesim against torch's own dry run of a torch schedule: ``python -m pipesim.experiments.torchdry``.

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
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from pipesim.experiments.cliargs import bench_main, positive, run_command

#: (ranks p, stages per rank v, micro-batches m) timed by default.
DEFAULT_SIZES = ((4, 2, 16), (8, 2, 64), (16, 2, 128), (16, 2, 256), (32, 2, 512))
#: Schedule classes whose comm order torch's dry run can simulate.
SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


def torch_schedule(name: str, p: int, v: int, m: int):
    """torch's ``name`` schedule for p ranks of v stages each and m
    micro-batches, built from stand-in stages (the classes read only the
    stage layout while planning)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    stages = [
        SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=c * p, submod=None) for c in range(v)
    ]
    return get_schedule_class(name)(stages, m)


def torch_dry_run_seconds(schedule, repeat: int = 1) -> float:
    """Best time of torch's ``_simulate_comms_compute`` on ``schedule``'s order
    with communication (without the action types it cannot simulate)."""
    from torch.distributed.pipelining import schedules as S

    simulated = {S.F, S.B, S.I, S.W, S.SEND_F, S.RECV_F, S.SEND_B, S.RECV_B}
    order = {
        rank: [a for a in acts if a.computation_type in simulated]
        for rank, acts in schedule.pipeline_order_with_comms.items()
    }
    home = schedule.stage_index_to_group_rank
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # it prints the schedule when stuck
            S._simulate_comms_compute(order, lambda s: home[s], schedule._num_stages)
        best = min(best, time.perf_counter() - start)
    return best


def torch_end_to_end_seconds(name: str, p: int, v: int, m: int, repeat: int = 3) -> float:
    """Best wall time of what a user pays for torch's dry run from a fresh
    interpreter: start-up, ``import torch``, building the order, the dry run."""
    script = (
        "import sys; from pipesim.experiments.torchdry import torch_schedule, torch_dry_run_seconds; "
        f"torch_dry_run_seconds(torch_schedule({name!r}, {p}, {v}, {m}))"
    )
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", script], check=True, stdout=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - start)
    return best


def pipesim_cli_seconds(csv_path: Path, repeat: int = 3) -> float:
    """Best wall time of ``pipesim simulate --schedule csv_path --summary-only``
    in a fresh interpreter (start-up and imports included)."""
    best = float("inf")
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "pipesim.experiments.cli",
            "simulate",
            "--schedule",
            str(csv_path),
            "--summary-only",
            "--out",
            out,
        ]
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
            torch_e2e_s = torch_end_to_end_seconds(schedule, p, v, m, repeat)
            cli_s = pipesim_cli_seconds(path, repeat)
            inproc_s = pipesim_inprocess_seconds(path, repeat)
            rows.append(
                {
                    "schedule": schedule,
                    "ranks": p,
                    "stages_per_rank": v,
                    "microbatches": m,
                    "actions": actions,
                    "torch_dry_run_s": _sig(torch_s),
                    "torch_end_to_end_s": _sig(torch_e2e_s),
                    "pipesim_cli_s": _sig(cli_s),
                    "pipesim_inprocess_s": _sig(inproc_s),
                    "ratio_cli": _sig(torch_s / cli_s),
                    "ratio_inprocess": _sig(torch_s / inproc_s),
                    "ratio_end_to_end": _sig(torch_e2e_s / cli_s),
                }
            )
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


def add_arguments(parser) -> None:
    parser.add_argument("--schedule", choices=SCHEDULES, default="Interleaved1F1B", help="torch schedule class")
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=DEFAULT_SIZES,
        help="space-separated p,v,m triples (ranks, stages per rank, micro-batches)",
    )
    parser.add_argument("--repeat", type=positive, default=3, help="best of this many runs of each side")


def run_bench(args) -> dict:
    rows = compare(args.sizes, args.schedule, args.repeat, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    return {"schedule": args.schedule, "repeat": args.repeat, "rows": rows}


def render(report: dict) -> str:
    lines = [
        f"torch {report['schedule']}: torch's _simulate_comms_compute against `pipesim simulate --schedule "
        f"X.csv --summary-only` (best of {report['repeat']}; ratios = torch s / pipesim s, above 1 pipesim "
        "answers sooner)",
        "  torch fn: the dry-run function alone (torch imported, order built); torch e2e: a fresh interpreter "
        "that imports torch, builds the order and runs it",
        "  pipesim e2e: the console command in a fresh interpreter; in-proc: the same through the CLI's main",
        f"{'p':>3} {'v':>2} {'m':>5} {'actions':>8} {'torch fn':>9} {'torch e2e':>10} {'pipesim e2e':>12} "
        f"{'e2e ratio':>10} {'fn/e2e':>7} {'in-proc':>8} {'fn/in-proc':>10}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['ranks']:>3} {r['stages_per_rank']:>2} {r['microbatches']:>5} {r['actions']:>8} "
            f"{r['torch_dry_run_s']:>9.3f} {r['torch_end_to_end_s']:>10.3f} {r['pipesim_cli_s']:>12.3f} "
            f"{r['ratio_end_to_end']:>10.2f} {r['ratio_cli']:>7.2f} {r['pipesim_inprocess_s']:>8.3f} "
            f"{r['ratio_inprocess']:>10.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m pipesim.experiments.torchdry") -> int:
    return bench_main(
        argv, prog=prog, description=__doc__.split("\n")[0], add_arguments=add_arguments, run=run_bench, render=render
    )


if __name__ == "__main__":
    sys.exit(run_command(main))

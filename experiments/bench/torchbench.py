"""`pipesim bench torch`: pipesim's distributed runtime against
torch.distributed.pipelining, on one machine, in one run.

The comparison and its report are :mod:`pipesim.validate.torchbench`'s;
this module is their command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipesim.experiments.cliargs import bench_main, nonnegative, positive, run_command, seconds
from pipesim.validate import torchbench


def _starts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected first layers like 0,3, got {text!r}") from None


def add_arguments(p) -> None:
    schedules = torchbench.SCHEDULES
    p.add_argument("--model", default="mlp", help="real model (mlp, gpt-small, vgg-small)")
    p.add_argument("--stages", type=positive, default=2, help="pipeline stages, one rank each")
    p.add_argument(
        "--starts", type=_starts, default=None, help="first layer of each stage, e.g. 0,3 (default: a balanced split)"
    )
    p.add_argument("--width", type=positive, default=None, help="model width (default: the model's)")
    p.add_argument("--depth", type=positive, default=None, help="model depth (default: the model's)")
    p.add_argument("--microbatch-size", type=positive, default=64, help="samples per micro-batch")
    p.add_argument("--microbatches", type=positive, default=8, help="micro-batches per iteration")
    p.add_argument("--iterations", type=positive, default=6, help="timed iterations")
    p.add_argument("--warmup-iterations", type=nonnegative, default=2, help="untimed iterations first")
    p.add_argument("--repeats", type=positive, default=3, help="launches per side, alternating")
    p.add_argument("--schedules", default=",".join(schedules), help="comma-separated subset of " + ",".join(schedules))
    p.add_argument("--seed", type=nonnegative, default=0, help="seed of the weights and the data order")
    p.add_argument("--timeout", type=seconds, default=300.0, help="seconds per launch")


def run(a) -> dict:
    return torchbench.compare_with_torch(
        a.model,
        a.stages,
        a.microbatches,
        a.microbatch_size,
        a.iterations,
        a.warmup_iterations,
        tuple(s.strip() for s in a.schedules.split(",") if s.strip()),
        a.width,
        a.depth,
        a.seed,
        a.timeout,
        starts=a.starts,
        repeats=a.repeats,
        progress=True,
    )


def main(argv: Sequence[str] | None = None, prog: str = "python -m pipesim.experiments.bench.torchbench") -> int:
    return bench_main(
        argv,
        prog=prog,
        description=torchbench.__doc__.split("\n")[0],
        add_arguments=add_arguments,
        run=run,
        render=torchbench.format_report,
    )


if __name__ == "__main__":
    sys.exit(run_command(main))

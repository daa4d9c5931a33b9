"""`pipesim bench comm`: what communication and memory traffic cost on this
machine's backend, set against the models the simulator prices them with.

The measurements and the report are :mod:`pipesim.validate.commprofile`'s;
this module is their command line.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipesim.experiments.cliargs import bench_main, int_at_least, positive, run_command
from pipesim.validate import commprofile


def add_arguments(ap) -> None:
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"), help="what the ranks talk over")
    ap.add_argument("--world-size", type=int_at_least(2), default=2, help="ranks for the all-reduce timing")
    ap.add_argument("--repeats", type=positive, default=20, help="timed repetitions per size (median)")
    ap.add_argument("--all-gather", action="store_true", help="time all-gather as well")


def run(opts) -> dict:
    return commprofile.run_bench(opts.backend, opts.world_size, opts.repeats, opts.all_gather)


def main(argv: Sequence[str] | None = None, prog: str = "python -m pipesim.experiments.bench.comm") -> int:
    return bench_main(
        argv,
        prog=prog,
        description=commprofile.__doc__.split("\n")[0],
        add_arguments=add_arguments,
        run=run,
        render=commprofile.render,
    )


if __name__ == "__main__":
    raise SystemExit(run_command(main))

"""``pipesim bench``: every benchmark, by the layer it measures
(:mod:`pipesim.experiments.bench`, which holds each one's options)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    from pipesim.experiments.bench import BENCHES, describe

    p = subparsers.add_parser(
        "bench",
        help="benchmarks: print their figures (tables, or --json)",
        description="Run one benchmark; `pipesim bench NAME --help` lists its options.",
        epilog="benchmarks:\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", choices=list(BENCHES), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    p.set_defaults(func=run)


def run(args) -> int:
    from pipesim.experiments.bench import run as run_bench

    return run_bench(args.name, args.args)

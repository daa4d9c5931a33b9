"""Measure what communication costs against the simulator's models: on this machine's backend, or NCCL's published curves.

``pipesim bench comm`` measures this machine's point-to-point transfers,
all-reduces and memory bandwidth and sets each against the model the
simulator would price it with; with ``--against nccl-tests`` it sets the
engine's all-reduce against NCCL's own published measurements of GPU
systems instead. The measurements of this machine and their report are
:mod:`pipesim.validate.commprofile`'s; the published curves are
:mod:`pipesim.sim.hardware.measured`'s. This module is their command line.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipesim.experiments.cliargs import UsageError, bench_main, int_at_least, positive, run_command

#: What ``--against`` accepts: sources of collective measurements made elsewhere.
AGAINST = ("nccl-tests",)


def add_arguments(ap) -> None:
    # no argparse defaults: --against must tell a flag given from one left out
    ap.add_argument("--backend", choices=("gloo", "nccl"), help="what the ranks talk over (default: gloo)")
    ap.add_argument("--world-size", type=int_at_least(2), help="ranks for the all-reduce timing (default: 2)")
    ap.add_argument("--repeats", type=positive, help="timed repetitions per size, median (default: 20)")
    ap.add_argument("--all-gather", action="store_true", help="time all-gather as well")
    ap.add_argument(
        "--against",
        default=None,
        choices=AGAINST,
        help="instead of measuring this machine, set the engine's all-reduce against published measurements "
        "(nccl-tests: all_reduce_perf on 2-8 V100s and A100s)",
    )


def engine_allreduce_seconds(hardware, ranks: int, nbytes: int) -> float:
    """How long the engine takes to all-reduce ``nbytes`` of gradients over
    devices ``0 .. ranks-1`` of ``hardware``: data parallelism of one layer
    whose passes take no time, so its gradient all-reduce is all there is."""
    from pipesim.sim.api import simulate
    from pipesim.sim.strategies import ScheduleSpec
    from pipesim.sim.workloads.profile import LayerCost, Profile

    profile = Profile(name=f"allreduce-{nbytes}", layers=(LayerCost("gradients", 0.0, 0.0, nbytes, 0, 0),))
    result = simulate(
        ScheduleSpec("data-parallel", stages=ranks, microbatches=ranks), hardware=hardware, profile=profile
    )
    spans = [s for s in result.spans if s.stream == "collective"]
    return max(s.end for s in spans) - min(s.start for s in spans)


def against_nccl_tests() -> dict:
    """Every point of every committed nccl-tests curve beside the engine's time for it."""
    from pipesim.sim.hardware import load_hardware
    from pipesim.sim.hardware.measured import bus_bandwidth, nccl_tests_curves

    curves = []
    for curve in nccl_tests_curves():
        entry = {
            "skipped": None,
            "name": curve.name,
            "system": curve.system,
            "source": curve.source,
            "preset": curve.preset,
            "gpus": curve.gpus,
            "points": [],
        }
        if curve.preset is None:
            entry["skipped"] = "no pipesim preset of this system yet"
        elif curve.devices != tuple(range(curve.gpus)):
            entry["skipped"] = "measured on devices other than the first ones, which data parallelism runs on"
        else:
            hardware = load_hardware(curve.preset)
            for point in curve.points:
                predicted = engine_allreduce_seconds(hardware, curve.gpus, point.nbytes)
                chosen = (
                    hardware.allreduce_estimate(range(curve.gpus), point.nbytes)
                    if hardware.collectives is not None
                    else None
                )
                entry["points"].append(
                    {
                        "bytes": point.nbytes,
                        "measured_s": point.seconds,
                        "predicted_s": predicted,
                        "error": predicted / point.seconds - 1,
                        "measured_busbw_GBps": point.busbw_GBps,
                        "predicted_busbw_GBps": bus_bandwidth(point.nbytes, predicted, curve.gpus) / 1e9,
                        # what NCCL's model picks for the message (None: no collectives model)
                        "algorithm": chosen.algorithm if chosen else None,
                        "protocol": chosen.protocol if chosen else None,
                    }
                )
        curves.append(entry)
    return {"against": "nccl-tests", "curves": curves}


def render_against(report: dict) -> str:
    lines = []
    for curve in report["curves"]:
        lines.append(f"{curve['name']}: {curve['system']} ({curve['source']})")
        if curve["skipped"]:
            lines += [f"  {curve['skipped']}", ""]
            continue
        lines.append(f"  pipesim: {curve['preset']}, devices 0-{curve['gpus'] - 1}")
        lines.append(
            f"  {'size':>8} {'measured ms':>12} {'pipesim ms':>11} {'error':>8} {'busbw GB/s':>11} {'pipesim':>8}"
            f"  {'NCCL model picks'}"
        )
        for p in curve["points"]:
            lines.append(
                f"  {p['bytes'] / 2**20:>6.0f} MiB {p['measured_s'] * 1e3:>12.3f} {p['predicted_s'] * 1e3:>11.3f} "
                f"{p['error']:>+8.1%} {p['measured_busbw_GBps']:>11.1f} {p['predicted_busbw_GBps']:>8.1f}"
                + (f"  {p['algorithm']}/{p['protocol']}" if p["algorithm"] else "")
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def run(opts) -> dict:
    local = {"--backend": opts.backend, "--world-size": opts.world_size, "--repeats": opts.repeats}
    if opts.against is not None:
        given = [flag for flag, value in local.items() if value is not None] + (
            ["--all-gather"] if opts.all_gather else []
        )
        if given:
            raise UsageError(
                f"--against sets the engine against published measurements: it takes no {', '.join(given)} "
                "(those measure this machine)"
            )
        return against_nccl_tests()
    from pipesim.validate import commprofile

    return commprofile.run_bench(opts.backend or "gloo", opts.world_size or 2, opts.repeats or 20, opts.all_gather)


def render(report: dict) -> str:
    if report.get("against") == "nccl-tests":
        return render_against(report)
    from pipesim.validate import commprofile

    return commprofile.render(report)


def main(argv: Sequence[str] | None = None, prog: str = "python -m pipesim.experiments.bench.comm") -> int:
    return bench_main(
        argv, prog=prog, description=__doc__.split("\n")[0], add_arguments=add_arguments, run=run, render=render
    )


if __name__ == "__main__":
    raise SystemExit(run_command(main))

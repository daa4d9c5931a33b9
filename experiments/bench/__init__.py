"""``pipesim bench {sim,plan,kernels,validate,profile,catalog,torch,torch-dry-run,comm,trace,sweep}``: every benchmark behind one command.

Each benchmark is a module with a ``main(argv, prog)`` (most of them in this
package; the sweep's and torch's dry run's beside the code they measure,
:mod:`pipesim.experiments.sweep`, :mod:`pipesim.experiments.torchdry`), or a
``main`` given in :data:`BENCHES`; this module only dispatches to it
(importing it, and torch with it, only when it is asked for). Every one prints tables, or its
report as JSON with ``--json``; ``pipesim bench NAME --help`` lists its
options with their defaults.

``pipesim bench sim`` also times the simulator's target end to end through
the installed console script (interpreter start and imports included), the
one figure only this top layer can measure.
"""

from __future__ import annotations

import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipesim.experiments.cliargs import bench_main


def describe() -> str:
    """The list of benchmarks, for ``pipesim bench --help``."""
    width = max(map(len, BENCHES))
    return "\n".join(f"  {name:<{width}}  {b.summary}" for name, b in BENCHES.items())


def run(name: str, argv: list[str]) -> int:
    """Run benchmark ``name`` with its own arguments ``argv``."""
    bench = BENCHES[name]
    if bench.main is not None:
        return bench.main(argv)
    return importlib.import_module(bench.module).main(argv, prog=f"pipesim bench {name}")


def console_command() -> list[str]:
    """This installation's ``pipesim`` console script, or the module when it has none."""
    exe = shutil.which("pipesim")
    if exe is not None and os.path.dirname(exe) == os.path.dirname(sys.executable):
        return [exe]
    return [sys.executable, "-m", "pipesim.experiments.cli"]


def console_script_seconds(args: list[str], repeat: int = 3) -> list[float]:
    """Sorted wall times of ``pipesim <args>`` in fresh interpreters."""
    cmd = console_command()
    times = []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(repeat):
            start = time.perf_counter()
            subprocess.run(
                [*cmd, *args, "--out", out],
                check=True,
                stdout=subprocess.DEVNULL,
                env={**os.environ, "PYTHONHASHSEED": "0"},
            )
            times.append(time.perf_counter() - start)
    return sorted(times)


def _sim_with_console_script(argv: list[str]) -> int:
    from pipesim.experiments.bench import sim as sim_bench

    def run_all(args) -> dict:
        report = sim_bench.run(args)
        if report["target"]:
            t = report["target"]
            print(
                "[target] library path with trace.json and timeline.html too, 3 times ...", file=sys.stderr, flush=True
            )
            times, _ = sim_bench.target_seconds(outputs=_Outputs)
            t["library_outputs_best_s"] = round(times[0], 3)
            t["library_outputs_median_s"] = round(statistics.median(times), 3)
            command = [
                "simulate",
                "--strategy",
                t["strategy"],
                "--stages",
                str(t["stages"]),
                "--microbatches",
                str(t["microbatches"]),
            ]
            for key, extra in (("console_script", ["--summary-only"]), ("console_script_outputs", [])):
                print(
                    f"[target] through the pipesim console script ({'summary only' if extra else 'every output'}), "
                    "3 times ...",
                    file=sys.stderr,
                    flush=True,
                )
                times = console_script_seconds(command + extra)
                t[f"{key}_best_s"] = round(times[0], 3)
                t[f"{key}_median_s"] = round(statistics.median(times), 3)
        return report

    def render(report: dict) -> str:
        text = sim_bench.render(report)
        t = report["target"]
        if "console_script_best_s" in t:
            text += (
                f"\nlibrary path with trace.json + timeline.html too: best {t['library_outputs_best_s']:.2f} s, "
                f"median {t['library_outputs_median_s']:.2f} s of 3"
                f"\nend to end, `pipesim simulate ... --summary-only`: best {t['console_script_best_s']:.2f} s, "
                f"median {t['console_script_median_s']:.2f} s of 3"
                f"\nend to end, `pipesim simulate ...` (summary, trace, timeline): best "
                f"{t['console_script_outputs_best_s']:.2f} s, median {t['console_script_outputs_median_s']:.2f} s "
                f"of 3 (target {t['seconds']:.1f} s)"
            )
        return text

    return bench_main(
        argv,
        prog="pipesim bench sim",
        description=sim_bench.__doc__.split("\n")[0],
        add_arguments=sim_bench.add_arguments,
        run=run_all,
        render=render,
    )


class _Outputs:
    """trace.json and timeline.html, as ``pipesim simulate`` writes them: the
    trace started as soon as the spans exist (in a forked child where that
    pays, :class:`~pipesim.experiments.background.TraceWriter`), the
    timeline beside it."""

    def __init__(self, out: Path) -> None:
        from pipesim.experiments.background import TraceWriter

        self.out = out
        self.trace = TraceWriter(out / "trace.json")
        self.start = self.trace.start

    def finish(self, result) -> None:
        from pipesim.experiments.timeline import write_timeline_html

        self.trace.hand_over(result)
        write_timeline_html(result, self.out / "timeline.html")

    def __enter__(self) -> _Outputs:
        return self

    def __exit__(self, *exc) -> None:
        self.trace.__exit__(*exc)


def _plan_with_console_script(argv: list[str]) -> int:
    from pipesim.experiments.bench import plan as plan_bench

    def run_all(args) -> dict:
        report = plan_bench.run(args)
        first = report["cases"][0]
        print(f"[end to end] pipesim plan --model {first['model']}, 3 times ...", file=sys.stderr, flush=True)
        times = console_script_seconds(
            [
                "plan",
                "--strategy",
                first["strategy"],
                "--model",
                first["model"],
                "--hardware",
                first["hardware"],
                "--gpus",
                str(first["gpus"]),
            ]
        )
        report["console_script"] = {
            "model": first["model"],
            "best_s": round(times[0], 3),
            "median_s": round(statistics.median(times), 3),
        }
        return report

    return bench_main(
        argv,
        prog="pipesim bench plan",
        description=plan_bench.__doc__.split("\n")[0],
        add_arguments=plan_bench.add_arguments,
        run=run_all,
        render=plan_bench.render,
    )


@dataclass(frozen=True)
class Bench:
    module: str
    summary: str
    main: Callable[[list[str]], int] | None = None  # instead of the module's own main


BENCHES: dict[str, Bench] = {
    "sim": Bench(
        "pipesim.experiments.bench.sim",
        "simulated actions/s, the ratio to raw SimPy, the 131k-action target, memory per action",
        main=_sim_with_console_script,
    ),
    "plan": Bench(
        "pipesim.experiments.bench.plan",
        "the planner's time on PipeDream's profiles, 16 GPUs of Cluster-A",
        main=_plan_with_console_script,
    ),
    "kernels": Bench("pipesim.experiments.bench.kernels", "kernel bandwidth against a plain copy and a Python loop"),
    "validate": Bench("pipesim.experiments.bench.validate", "prediction error of every strategy on this machine"),
    "profile": Bench(
        "pipesim.experiments.bench.profile", "seconds `pipesim profile --model` takes, and its determinism"
    ),
    "catalog": Bench(
        "pipesim.experiments.bench.catalog",
        "a measured profile against the catalog's model of the same shape: winners, throughput, per-layer ratios",
    ),
    "torch": Bench("pipesim.experiments.bench.torchbench", "runtime throughput against torch.distributed.pipelining"),
    "torch-dry-run": Bench(
        "pipesim.experiments.torchdry", "simulating a torch schedule: pipesim against torch's own dry run"
    ),
    "comm": Bench("pipesim.experiments.bench.comm", "point-to-point and all-reduce times against their models"),
    "trace": Bench("pipesim.experiments.traceimport", "importing a synthetic 8-rank set of Kineto traces: MB/s"),
    "sweep": Bench(
        "pipesim.experiments.sweep",
        "a 1,000-point sweep on 1 and 2 local workers and on Ray: speedups",
        main=lambda argv: importlib.import_module("pipesim.experiments.sweep").bench(argv),
    ),
}

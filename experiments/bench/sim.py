"""Simulator benchmark: ``pipesim bench sim`` (or ``python -m pipesim.experiments.bench.sim``).

Prints, measured in one process so the ratios hold on a noisy machine:

* SimPy's raw rate: one process yielding bare timeouts (the ceiling any
  SimPy model can reach);
* simulated compute actions per second of the full ``simulate()`` path
  (validation, lowering, engine, trackers, summary) for several sizes, and
  its ratio to the raw rate;
* the issue's target, ``pipesim simulate --strategy 1f1b --stages 64
  --microbatches 1024 --summary-only`` (131,072 compute actions): the same
  library calls that command makes (build, cost, partition, simulate,
  summarise, write summary.json), timed in this process. ``pipesim bench
  sim`` adds the console script's end-to-end time (interpreter start and
  imports included), which only the command-line layer can measure;
* what SimPy's event loop alone costs for the target: the leanest SimPy
  model of its schedule, recording nothing (:func:`bare_model_seconds`),
  the floor under any simulator that keeps the IR and the result as Python
  objects (:func:`object_floor`), and the engine's own SimPy run alone, each
  against the raw rate;
* peak memory of that path for m = 256 ... 2048 at p = 64, each in a fresh
  interpreter, as bytes per compute action: a flat column means memory grows
  linearly with the actions.

Nothing here asserts: the figures are for the reader (and the issue note).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from heapq import heappush
from itertools import starmap
from operator import attrgetter
from pathlib import Path

import simpy
from simpy.events import NORMAL

from pipesim.experiments.cliargs import bench_main
from pipesim.sim._gc import gc_paused
from pipesim.sim.api import model_for, simulate, split_for
from pipesim.sim.engine.core import CostModel, _run_events, _Signal, _Walker, prepared_run
from pipesim.sim.engine.metrics import summarize, write_summary
from pipesim.sim.engine.results import Span
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.ir.core import COMPUTE_OPS, UPDATE, Action, B, F, Schedule, ScheduleError
from pipesim.sim.strategies import ScheduleSpec, build_schedule

#: The machine of every timed case but the small real-model ones: transfers are free.
IDEAL = load_hardware("ideal")
IDEAL_DEVICE = IDEAL.device

#: The issue's target: 1F1B, p = 64, m = 1024 (131,072 compute actions) in 2 s.
TARGET = {"strategy": "1f1b", "stages": 64, "microbatches": 1024, "seconds": 2.0}
CASES = (
    ("1f1b", 8, 64, "uniform", "ideal"),
    ("pipedream", 8, 64, "uniform", "ideal"),
    ("gpipe", 16, 128, "gpt-1.3b", "dgx-h100-x2"),
    ("spectrain", 4, 256, "vgg16", "pcie-4gpu"),
    # a ring over 1,024 GPUs: its steps skipped (engine.ring_steps), else half a minute
    ("data-parallel", 1024, 1024, "uniform", "dgx-h100-x128"),
)


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


#: The ops a bare model (:func:`bare_model_seconds`) runs: the passes and the
#: optimizer step of a compute-only pipeline of one replica per stage.
_BARE_OPS = frozenset({F, B, UPDATE})


def bare_model_seconds(schedule: Schedule, stage_costs) -> tuple[float, float]:
    """Run the leanest SimPy model of ``schedule`` on the ``ideal`` machine
    that pipesim knows how to write, recording nothing, and return (wall
    seconds, simulated makespan).

    Each device's walk runs under the engine's own event machinery (its
    lean walker, one reusable timer and one reusable wake-up event per
    device, the timer scheduled straight onto SimPy's heap, the inlined
    event loop: :mod:`pipesim.sim.engine.core`). A pass or update holds the
    timer for its duration; a forward waits for its micro-batch's forward
    on the stage before, a backward for the backward on the stage after,
    and only a walk that finds its input missing arms a wake-up; a finished
    pass is otherwise one set insertion. No transfers (on ``ideal`` they
    take no time), no spans, no validation, no accounting. Its makespan must
    be the engine's (a test holds the two together), so it is the same
    schedule, and its rate measures what SimPy's event loop alone costs for
    it: what is left of a speed target once that is paid is the budget for
    everything else a simulation does.

    Only programs of F, B and UPDATE with one replica per stage qualify
    (GPipe, 1F1B, interleaved 1F1B, PipeDream, 2BW); anything else raises
    :class:`~pipesim.sim.ir.core.ScheduleError`.
    """
    programs = _bare_steps(schedule, stage_costs)
    env = simpy.Environment()
    done: set[tuple] = set()
    waiting: dict[tuple, _Signal] = {}
    queue, eid = env._queue, env._eid

    def walk(steps):
        clock, wake = _Signal(env), _Signal(env)
        for duration, need, made in steps:
            if need is not None and need not in done:
                waiting[need] = wake.arm()
                yield wake
            if duration:  # as the engine schedules a compute action's timer
                clock.callbacks = []
                heappush(queue, (env._now + duration, NORMAL, next(eid), clock))
                yield clock
            if made is not None:
                done.add(made)
                ev = waiting.pop(made, None)
                if ev is not None:
                    ev.fire()

    for steps in programs:
        _Walker(env, walk(steps))
    start = time.perf_counter()
    with gc_paused():
        _run_events(env)
    return time.perf_counter() - start, env.now


def _bare_steps(schedule: Schedule, stage_costs) -> list[list[tuple]]:
    """Each device's (duration, the pass it waits for or None, the pass it
    makes or None) per action, for :func:`bare_model_seconds`."""
    costs = CostModel.for_device(stage_costs, IDEAL_DEVICE)
    last = schedule.num_stages - 1
    programs = []
    for program in schedule.programs:
        steps = []
        for a in program:
            if a.op not in _BARE_OPS or a.replica:
                raise ScheduleError(f"the bare model runs F, B and UPDATE of one replica per stage, not {a}")
            need = None
            if a.op is F and a.stage > 0:
                need = (F, a.stage - 1, a.microbatch)
            elif a.op is B and a.stage < last:
                need = (B, a.stage + 1, a.microbatch)
            made = None if a.op is UPDATE else (a.op, a.stage, a.microbatch)  # an update feeds no other device
            steps.append((costs.compute(a), need, made))
        programs.append(steps)
    return programs


def _uniform_on_ideal(strategy: str, p: int, m: int) -> tuple[Schedule, list, int]:
    """The schedule of (strategy, p, m), the uniform model's split over its
    stages on ``ideal``, and its compute actions: what the ceiling runs."""
    schedule = build_schedule(ScheduleSpec(strategy, p, m))
    stage_costs = split_for(schedule, model_for(schedule, "uniform", IDEAL, None), IDEAL)
    return schedule, stage_costs, sum(a.op in COMPUTE_OPS for program in schedule.programs for a in program)


def bare_model_rate(strategy: str, p: int, m: int, repeat: int = 3) -> dict:
    """The best of ``repeat`` runs of :func:`bare_model_seconds` for
    ``strategy`` at p stages and m micro-batches of the uniform model, in
    compute actions per second (the wall time counts the run, not building
    its programs)."""
    schedule, stage_costs, actions = _uniform_on_ideal(strategy, p, m)
    seconds = min(bare_model_seconds(schedule, stage_costs)[0] for _ in range(repeat))
    return {"compute_actions": actions, "seconds": round(seconds, 4), "actions_per_s": round(actions / seconds)}


def engine_run_rate(strategy: str, p: int, m: int, repeat: int = 3) -> dict:
    """The best of ``repeat`` SimPy runs of the engine itself on the same
    schedule and machine as :func:`bare_model_rate`: ``execute()`` of a
    :func:`~pipesim.sim.engine.core.prepared_run` alone (its compile, the
    validation before it and the accounting after it are not timed; its
    spans and transfers are)."""
    schedule, stage_costs, actions = _uniform_on_ideal(strategy, p, m)
    times = []
    for _ in range(repeat):
        with gc_paused():
            run = prepared_run(schedule, stage_costs, IDEAL)
            start = time.perf_counter()
            run.execute()
            times.append(time.perf_counter() - start)
            del run
    return {"compute_actions": actions, "seconds": round(min(times), 4), "actions_per_s": round(actions / min(times))}


def simulate_rate(
    strategy: str, p: int, m: int, model: str = "uniform", hardware: str = "ideal", iterations: int = 1
) -> dict:
    spec = ScheduleSpec(strategy, p, m, iterations=iterations)
    start = time.perf_counter()
    result = simulate(spec, model, hardware)
    summary = summarize(result)
    elapsed = time.perf_counter() - start
    actions = summary["compute_actions"]
    return {
        "strategy": strategy,
        "stages": p,
        "microbatches": m,
        "model": model,
        "hardware": hardware,
        "compute_actions": actions,
        "seconds": round(elapsed, 4),
        "actions_per_s": round(actions / elapsed),
    }


def target_seconds(repeat: int = 3, outputs=None) -> tuple[list[float], int]:
    """Sorted wall times of what ``pipesim simulate`` does for the target, in
    this process, and its compute actions. ``outputs(folder)``, if given,
    makes the writer of what the command writes besides summary.json (the
    trace and timeline live in layers above this one): a context manager
    whose ``start(result)`` is the simulator's ``on_spans`` and whose
    ``finish(result)`` runs once the summary is written."""
    times = []
    spec = ScheduleSpec(TARGET["strategy"], TARGET["stages"], TARGET["microbatches"])
    with tempfile.TemporaryDirectory() as out:
        for _ in range(repeat):
            start = time.perf_counter()
            with gc_paused():
                writer = outputs(Path(out)) if outputs is not None else None
                with writer if writer is not None else nullcontext():
                    result = simulate(spec, on_spans=None if writer is None else writer.start)
                    summary = summarize(result)
                    write_summary(summary, Path(out) / "summary.json")
                    if writer is not None:
                        writer.finish(result)
            times.append(time.perf_counter() - start)
            del result
    return sorted(times), summary["compute_actions"]


#: Micro-batch counts (at p = 64) whose peak memory shows how it grows.
MEMORY_SIZES = (256, 512, 1024, 2048)

#: What a fresh interpreter runs to measure one size: the peak resident set
#: after the imports, then after the simulation.
_PEAK_RSS_CHILD = """
import sys
from pipesim.experiments.bench.sim import peak_rss_child
peak_rss_child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
"""


def peak_rss_child(strategy: str, p: int, m: int) -> None:
    """In a fresh interpreter: print the peak resident set in bytes after
    the imports and after ``simulate`` and ``summarize`` of (strategy, p, m)."""
    from pipesim.sim.engine.metrics import summarize as summarize_

    before = peak_rss_bytes()
    with gc_paused():
        summary = summarize_(simulate(ScheduleSpec(strategy, p, m)))
    print(before, peak_rss_bytes(), summary["compute_actions"])


def peak_rss_bytes() -> int:
    """This process's peak resident set: Linux's VmHWM, which starts afresh
    in a new program (ru_maxrss keeps the parent's peak across exec, so a
    child started by a big benchmark would report the benchmark's)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def memory_rows(strategy: str = "1f1b", p: int = 64, sizes=MEMORY_SIZES) -> list[dict]:
    """Peak memory of ``simulate`` + ``summarize`` per size, each in a fresh
    interpreter (the peak resident set only ever grows within a process)."""
    rows = []
    for m in sizes:
        out = subprocess.run(
            [sys.executable, "-c", _PEAK_RSS_CHILD, strategy, str(p), str(m)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        before, after, actions = map(int, out[-3:])
        rows.append(
            {
                "strategy": strategy,
                "stages": p,
                "microbatches": m,
                "compute_actions": actions,
                "peak_rss_bytes": after,
                "imports_rss_bytes": before,
                "bytes_per_action": round((after - before) / actions),
            }
        )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes only (skip the 131k-action target)")


def run(args: argparse.Namespace) -> dict:
    raw = raw_simpy_rate()
    cases = list(CASES)
    if not args.quick:
        cases.append((TARGET["strategy"], TARGET["stages"], TARGET["microbatches"], "uniform", "ideal"))
    rows = []
    for i, (strategy, p, m, model, hw) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {strategy} p={p} m={m} on {hw} ...", file=sys.stderr, flush=True)
        row = simulate_rate(strategy, p, m, model, hw)
        row["ratio_to_raw_simpy"] = round(row["actions_per_s"] / raw, 4)
        rows.append(row)
    report = {"raw_simpy_timeouts_per_s": round(raw), "cases": rows, "target": {}}
    if not args.quick:
        print(
            "[target] 1f1b p=64 m=1024, as pipesim simulate --summary-only does it, 3 times ...",
            file=sys.stderr,
            flush=True,
        )
        times, actions = target_seconds()
        report["target"] = {
            **TARGET,
            "compute_actions": actions,
            "library_best_s": round(times[0], 3),
            "library_median_s": round(statistics.median(times), 3),
            "ratio_to_raw_simpy": round(actions / times[0] / raw, 4),
        }
        print(
            "[ceiling] the bare SimPy model of the target and the engine's SimPy run alone, 3 times each, "
            "beside SimPy's raw rate ...",
            file=sys.stderr,
            flush=True,
        )
        report["ceiling"] = ceiling(TARGET["strategy"], TARGET["stages"], TARGET["microbatches"])
        print(
            f"[memory] peak resident set for m = {', '.join(map(str, MEMORY_SIZES))} at p = 64, "
            "each in a fresh interpreter ...",
            file=sys.stderr,
            flush=True,
        )
        report["memory"] = memory_rows()
    return report


def object_floor(strategy: str, p: int, m: int, repeat: int = 3) -> dict:
    """A floor under the time of any simulator of this schedule that keeps
    pipesim's IR and result as Python objects (:class:`~pipesim.sim.ir.core.Action`
    s in, :class:`~pipesim.sim.engine.results.Span` s out), whatever else it does
    better: building the schedule, the bare model's event loop
    (:func:`bare_model_seconds`), and creating, with nothing else done, the
    objects a run must add: the Action of each transfer end the lowering
    posts, and every Span of the engine's result. Each part is the best of
    ``repeat``; their sum, as a rate, is the most such a simulator reaches.
    No validation, dataflow, transfer handling, memory or version
    accounting or summary is in it."""
    spec = ScheduleSpec(strategy, p, m)
    schedule, stage_costs, actions = _uniform_on_ideal(strategy, p, m)
    with gc_paused():
        run = prepared_run(schedule, stage_costs, IDEAL)
        run.execute()
    fields = attrgetter("device", "stream", "action", "start", "end", "peer", "flow", "nbytes")
    span_args = list(map(fields, run.spans))
    ends = [s.action for s in run.spans if s.stream in ("send", "recv")]
    del run
    make_action = partial(tuple.__new__, Action)
    parts = {
        "build_s": _best(lambda: build_schedule(spec), repeat),
        "event_loop_s": min(bare_model_seconds(schedule, stage_costs)[0] for _ in range(repeat)),
        "objects_s": _best(lambda: (list(map(make_action, ends)), list(starmap(Span, span_args))), repeat),
    }
    seconds = sum(parts.values())
    return {
        "compute_actions": actions,
        "transfer_ends": len(ends),
        "spans": len(span_args),
        **{k: round(v, 4) for k, v in parts.items()},
        "seconds": round(seconds, 4),
        "actions_per_s": round(actions / seconds),
    }


def _best(fn, repeat: int) -> float:
    """The shortest of ``repeat`` wall times of ``fn()``, the collector paused."""
    times = []
    for _ in range(repeat):
        with gc_paused():
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return min(times)


def ceiling(strategy: str, p: int, m: int) -> dict:
    """How much of SimPy's raw rate the event loop of this schedule uses up
    before anything is recorded, and how much the engine's run: the
    rates of :func:`bare_model_rate` and :func:`engine_run_rate`, each as a
    fraction of the best of three raw rates measured right before it (the
    machine's speed drifts between the parts of a bench, and a raw rate
    caught in a slow moment would flatter the ratio)."""
    out = {}
    for name, rate in (
        ("bare_model", bare_model_rate),
        ("object_floor", object_floor),
        ("engine_run", engine_run_rate),
    ):
        raw = max(raw_simpy_rate() for _ in range(3))
        row = rate(strategy, p, m)
        out[name] = {
            **row,
            "raw_simpy_timeouts_per_s": round(raw),
            "ratio_to_raw_simpy": round(row["actions_per_s"] / raw, 4),
        }
    return out


def render(report: dict) -> str:
    lines = [
        f"SimPy raw timeouts/s: {report['raw_simpy_timeouts_per_s']:,}",
        f"{'strategy':<13} {'p':>4} {'m':>5} {'model':<9} {'hardware':<13} {'actions':>8} {'s':>7} "
        f"{'actions/s':>10} {'vs raw':>7}",
    ]
    for r in report["cases"]:
        lines.append(
            f"{r['strategy']:<13} {r['stages']:>4} {r['microbatches']:>5} {r['model']:<9} "
            f"{r['hardware']:<13} {r['compute_actions']:>8} {r['seconds']:>7.3f} {r['actions_per_s']:>10,} "
            f"{r['ratio_to_raw_simpy']:>7.3f}"
        )
    target = report["target"]
    if target:
        lines.append(
            f"target, 1f1b p=64 m=1024 ({target['compute_actions']:,} compute actions), "
            f"library path of --summary-only: best "
            f"{target['library_best_s']:.2f} s, median {target['library_median_s']:.2f} s of 3 "
            f"(target {target['seconds']:.1f} s end to end); best as a rate: "
            f"{target['ratio_to_raw_simpy']:.3f}x raw SimPy (target 0.3x)"
        )
    ceil = report.get("ceiling")
    if ceil:
        for name, what in (
            ("bare_model", "the bare SimPy model of it (the engine's event loop, nothing recorded)"),
            (
                "object_floor",
                "floor of an object IR (build + that event loop + creating the "
                "transfer ends' Actions and the result's Spans)",
            ),
            ("engine_run", "the engine's SimPy run of it alone (spans and transfers included)"),
        ):
            r = ceil.get(name)
            if r is None:
                continue
            lines.append(
                f"  {what}: best {r['seconds']:.3f} s, {r['actions_per_s']:,} actions/s, "
                f"{r['ratio_to_raw_simpy']:.3f}x raw SimPy ({r['raw_simpy_timeouts_per_s']:,}/s)"
            )
            if name == "object_floor":
                lines.append(
                    f"    = build {r['build_s']:.3f} s + event loop {r['event_loop_s']:.3f} s + "
                    f"{r['transfer_ends']:,} Actions and {r['spans']:,} Spans {r['objects_s']:.3f} s"
                )
    if report.get("memory"):
        lines.append(
            f"{'peak memory':<12} {'m':>5} {'actions':>8} {'peak RSS':>10} {'after imports':>14} {'bytes/action':>13}"
        )
        for r in report["memory"]:
            lines.append(
                f"{'1f1b p=64':<12} {r['microbatches']:>5} {r['compute_actions']:>8} "
                f"{r['peak_rss_bytes'] / 2**20:>7.0f} MiB {r['imports_rss_bytes'] / 2**20:>10.0f} MiB "
                f"{r['bytes_per_action']:>13,}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m pipesim.experiments.bench.sim") -> int:
    return bench_main(
        argv, prog=prog, description=__doc__.split("\n")[0], add_arguments=add_arguments, run=run, render=render
    )


if __name__ == "__main__":
    from pipesim.experiments.cliargs import run_command

    sys.exit(run_command(main))

"""``pipesim trace import``'s outputs and ``pipesim bench trace``.

:func:`write_outputs` puts an imported run (:mod:`pipesim.validate.traceimport`)
through the accounting a simulation gets and writes, to the output folder:

* ``summary.json``: :func:`pipesim.sim.engine.metrics.summarize` of the
  measured timeline over the profiled steps, the keys a simulation's has
  (``bubble_fraction``, ``compute_actions``, per device ...);
* ``timeline.html`` (:mod:`pipesim.experiments.timeline`; ``timeline.png``
  too where a browser renders it, as ``pipesim simulate`` does) and
  ``trace.json`` for Perfetto (:mod:`pipesim.experiments.trace`);
* ``imported.json``: what re-creates the run without the traces
  (:func:`pipesim.validate.traceimport.load_imported`): spans, schedule,
  per-rank, per-stage and per-boundary figures;
* ``report.txt``: the one-screen report :func:`report` prints.

A trace with no pipeline gets ``imported.json`` and ``report.txt`` only.

The report names the largest bubble, the longest time a device's compute
stream stood idle, and its cause (:func:`largest_bubble`), judged from the
measured spans in this order:

1. before the device's first compute or after its last: **warm-up/drain**;
2. across an iteration boundary (the idle time runs into the first pass of
   the next iteration): **warm-up/drain** of the flush;
3. the device's thread was blocked posting or waiting on a send or a
   receive for half the gap or more (gloo's send waits for its receiver):
   **a slow link**;
4. the pass after the gap had its input on the device (it needs none from
   another stage, or its receive completed within the first tenth of the
   gap): nothing kept it waiting but its own rank, **a straggler rank**
   (host-side work, another process on its core);
5. it waited for a receive: a transfer that took half the gap or more is
   **a slow link**; else the producing pass finished late: taking 1.5x its
   (stage, op) median or more, that pass was **a straggler rank**'s; its
   stage the slowest, 1.2x the mean stage or more, **a slow stage**; else
   the schedule's own dependency, **warm-up/drain**.

``pipesim bench trace`` writes a synthetic set of Kineto traces (the shape
torch's runtime writes: ``PP:`` labels around nested ``aten`` operators,
``gloo`` ranges, ``ProfilerStep`` and optimizer ranges) and imports it,
printing the JSON rate and peak memory against the largest file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pipesim.sim.engine.metrics import summarize, write_summary
from pipesim.sim.engine.results import SimResult
from pipesim.sim.ir.core import PASS_OPS, RECV_B, RECV_F, UPDATE, B, F, I, W

__all__ = ["largest_bubble", "main", "report", "synthetic_run", "write_outputs"]

#: a producing pass this many times its (stage, op) median made a straggler
STRAGGLER_FACTOR = 1.5
#: a stage this many times the mean stage time is a slow stage
SLOW_STAGE_FACTOR = 1.2
#: a transfer this share of the gap or more is a slow link
SLOW_LINK_SHARE = 0.5


def write_outputs(run, out: Path, *, title: str | None = None) -> list[str]:
    """Write the run's files to ``out`` (see the module doc); the names written."""
    from pipesim.validate.traceimport import dumps_imported

    out = Path(out)
    written = []
    summary = None
    if run.result is not None:
        from pipesim.experiments.timeline import write_timeline_html
        from pipesim.experiments.trace import write_trace

        summary = summarize(run.result)
        write_summary(summary, out / "summary.json")
        write_trace(run.result, out / "trace.json")
        title = title or _title(run, summary)
        write_timeline_html(run.result, out / "timeline.html", title=title)
        written += ["summary.json", "trace.json", "timeline.html"]
        written += _timeline_png(run.result, out, title)
    (out / "imported.json").write_text(dumps_imported(run), encoding="utf-8")
    text = report(run, summary)
    (out / "report.txt").write_text(text + "\n", encoding="utf-8")
    return written + ["imported.json", "report.txt"]


def _timeline_png(result: SimResult, out: Path, title: str) -> list[str]:
    """timeline.png beside timeline.html where a browser can render it, for
    timelines small enough, as ``pipesim simulate`` does (``PIPESIM_PNG=0``
    turns it off)."""
    from pipesim.experiments.cli.common import PROGRESS_SPANS
    from pipesim.experiments.export import png_supported, write_png
    from pipesim.experiments.timeline import timeline_figure

    if len(result.spans) > PROGRESS_SPANS or not png_supported():
        return []
    write_png(timeline_figure(result, title=title), out / "timeline.png")
    return ["timeline.png"]


def _title(run, summary: dict) -> str:
    return (
        f"measured ({run.source}, {run.device}): {summary['devices_count']} ranks, {summary['stages']} stages, "
        f"{run.microbatches} micro-batches x {run.steps} steps, bubble {summary['bubble_fraction']:.3f}"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def report(run, summary: dict | None = None) -> str:
    """The one-screen text report of an imported run."""
    from pipesim.experiments.cli.common import table

    lines = []
    files = run.files
    mb = sum(f["json_bytes"] for f in files) / 1e6
    if run.result is None:
        lines.append(f"{len(files)} traces ({mb:.1f} MB of JSON, {run.device}): no pipeline actions found")
        rows = [
            [str(r.rank), _ms(r.compute_s), _ms(r.communication_s), _ms(r.idle_s), _ms(r.span_s)] for r in run.per_rank
        ]
        lines.append(f"{run.steps} profiled step(s); per rank (ms):")
        lines.append(table(rows, ["rank", "compute", "communication", "idle", "span"]))
        lines += [f"warning: {w}" for w in run.warnings]
        return "\n".join(lines)
    summary = summary or summarize(run.result)
    res = run.result
    lines.append(
        f"{len(files)} traces ({mb:.1f} MB of JSON, {run.device}, {run.source}): {summary['devices_count']} ranks, "
        f"{summary['stages']} stages, {run.microbatches} micro-batches x {run.steps} profiled step(s)"
    )
    per_dev = "  ".join(f"{d['id']}: {d['bubble_fraction']:.3f}" for d in summary["devices"])
    from pipesim.validate.reconcile import iteration_time

    steady = iteration_time(res) if run.steps > 1 else None
    lines.append(
        f"iteration {_ms(summary['iteration_time_s'])} ms (makespan {_ms(summary['makespan_s'])} ms / {run.steps} steps"
        + ("" if steady is None else f"; {_ms(steady)} ms after the first, as `pipesim trace reconcile` counts")
        + f"), bubble {summary['bubble_fraction']:.3f} (per device {per_dev})"
    )
    rows = [
        [str(r.rank), _ms(r.compute_s), _ms(r.communication_s), _ms(r.wait_s), _ms(r.idle_s), _ms(r.span_s)]
        for r in run.per_rank
    ]
    lines.append(table(rows, ["rank", "compute ms", "comm ms", "recv wait ms", "idle ms", "span ms"]))
    rows = [
        [str(s["stage"]), s["op"], str(s["count"]), _ms(s["mean"]), _ms(s["p50"]), _ms(s["p90"])]
        for s in run.stage_times
    ]
    lines.append(table(rows, ["stage", "op", "n", "mean ms", "p50 ms", "p90 ms"], limit=12))
    if run.boundaries:
        rows = [
            [
                f"{b['from_stage']}->{b['to_stage']} {b['direction']}",
                f"{b['from_rank']}->{b['to_rank']}",
                str(b["transfer_s"]["count"]),
                _ms(b["transfer_s"]["mean"]),
                _ms(b["transfer_s"]["p90"]),
                _ms(b["wait_s"]["mean"]),
                _ms(b["wait_s"]["p90"]),
            ]
            for b in run.boundaries
        ]
        lines.append(table(rows, ["boundary", "ranks", "n", "transfer ms", "p90", "wait ms", "p90"], limit=8))
    mem = [m for m in res.memory if m.peak_bytes]
    if mem:
        lines.append("peak memory: " + ", ".join(f"{m.device}: {m.peak_bytes / 2**20:.1f} MiB" for m in mem))
    big = largest_bubble(res, run.blocking)
    if big is not None:
        lines.append(
            f"largest bubble: device {big['device']}, {_ms(big['duration_s'])} ms idle from "
            f"{_ms(big['start_s'])} ms{' before ' + big['before'] if big['before'] else ''}: "
            f"{big['cause']} ({big['why']})"
        )
    lines += [f"warning: {w}" for w in run.warnings]
    return "\n".join(lines)


def largest_bubble(result: SimResult, blocking=()) -> dict | None:
    """The longest idle stretch of any device's compute stream, and its cause
    (see the module doc): ``device``, ``start_s``, ``duration_s``,
    ``before`` (the action after it, '' at the end), ``cause`` (warm-up/drain,
    a slow stage, a slow link, a straggler rank) and ``why``. ``blocking``
    is :attr:`~pipesim.validate.traceimport.ImportedRun.blocking`."""
    compute = result.by_stream()["compute"]
    if not compute:
        return None
    lo, hi = min(s.start for s in compute), max(s.end for s in compute)
    per_dev: dict[int, list] = {}
    for s in compute:
        per_dev.setdefault(s.device, []).append(s)
    best = None
    for dev, spans in sorted(per_dev.items()):
        spans.sort(key=lambda s: s.start)
        gaps = [(spans[0].start - lo, lo, None, spans[0])]
        gaps += [(b.start - a.end, a.end, a, b) for a, b in zip(spans, spans[1:])]
        gaps.append((hi - spans[-1].end, spans[-1].end, spans[-1], None))
        for g in gaps:
            if best is None or g[0] > best[1][0] + 1e-12:
                best = (dev, g)
    dev, (length, start, prev, nxt) = best
    cause, why = _cause(result, dev, length, start, prev, nxt, blocking)
    return {
        "device": dev,
        "start_s": start,
        "duration_s": length,
        "before": str(nxt.action) if nxt is not None else "",
        "cause": cause,
        "why": why,
    }


def _medians(result: SimResult) -> dict:
    acc: dict[tuple, list[float]] = {}
    for s in result.by_stream()["compute"]:
        acc.setdefault((s.action.stage, s.action.op), []).append(s.duration)
    return {k: statistics.median(v) for k, v in acc.items()}


def _cause(result: SimResult, dev: int, length: float, start: float, prev, nxt, blocking) -> tuple[str, str]:
    if nxt is None:
        return "warm-up/drain", "after the device's last compute: the pipeline drains"
    if prev is None:
        return "warm-up/drain", "before the device's first compute: the pipeline fills"
    m = result.schedule.num_microbatches
    a, p = nxt.action, prev.action
    if p.op is UPDATE or (a.op in PASS_OPS and p.op in PASS_OPS and a.microbatch // m != p.microbatch // m):
        return "warm-up/drain", "between two iterations: the flush, the optimizer and the next fill"
    end = start + length
    held = [(min(e, end) - max(s, start), name) for d, name, s, e in blocking if d == dev and s < end and e > start]
    if held and sum(h for h, _ in held) >= SLOW_LINK_SHARE * length:
        worst = max(held)
        return (
            "a slow link",
            f"device {dev}'s thread was blocked {_ms(worst[0])} ms in {worst[1]} (on gloo a send waits for its receiver)",
        )
    recv = _receive_of(result, dev, a)
    if recv is None or recv.end <= start + 0.1 * length:
        return "a straggler rank", f"device {dev} idled with {a}'s input already there (host-side delay)"
    transfer = recv.end - recv.start
    if transfer >= SLOW_LINK_SHARE * length:
        return "a slow link", f"{recv.action} from device {recv.peer} took {_ms(transfer)} ms of the wait"
    producer = _producer_of(result, recv)
    if producer is None:
        return "warm-up/drain", f"{a} waited for {recv.action}"
    medians = _medians(result)
    typical = medians.get((producer.action.stage, producer.action.op), producer.duration)
    if typical > 0 and producer.duration >= STRAGGLER_FACTOR * typical:
        return (
            "a straggler rank",
            f"{producer.action} on device {producer.device} took {_ms(producer.duration)} ms, "
            f"{producer.duration / typical:.1f}x its median",
        )
    stage_time: dict[int, float] = {}
    for (stage, op), v in medians.items():
        if op in (F, B, I, W):
            stage_time[stage] = stage_time.get(stage, 0.0) + v
    mean = sum(stage_time.values()) / len(stage_time) if stage_time else 0.0
    k = producer.action.stage
    if mean > 0 and stage_time.get(k, 0.0) >= SLOW_STAGE_FACTOR * mean and k == max(stage_time, key=stage_time.get):
        return "a slow stage", f"stage {k}'s passes take {stage_time[k] / mean:.2f}x the mean stage's"
    return "warm-up/drain", f"{a} waited for {producer.action} on device {producer.device} (the schedule's order)"


def _receive_of(result: SimResult, dev: int, a):
    """The receive span that brought pass ``a``'s input to ``dev``."""
    if a.op is F:
        op = RECV_F
    elif a.op in (B, I):
        op = RECV_B
    else:
        return None
    for s in result.by_stream()["recv"]:
        r = s.action
        if s.device == dev and r.op is op and r.stage == a.stage and r.microbatch == a.microbatch:
            return s
    return None


def _producer_of(result: SimResult, recv):
    """The compute span whose output ``recv`` carried."""
    r = recv.action
    if r.op is RECV_F:
        stage, ops = r.stage - 1, (F,)
    else:
        stage, ops = r.stage + 1, (B, I)
    for s in result.by_stream()["compute"]:
        a = s.action
        if a.stage == stage and a.op in ops and a.microbatch == r.microbatch:
            return s
    return None


# ----------------------------------------------------------------------------- pipesim bench trace


def synthetic_run(out: Path, *, ranks: int = 8, mb_per_rank: float = 4.0, seed: int = 0) -> list[Path]:
    """Write a synthetic Kineto trace per rank, about ``mb_per_rank`` MB of
    JSON each (uncompressed ``.json``, in Kineto's layout), of 1F1B with m =
    8 on ``ranks`` stages, labelled as torch's runtime labels it: ``PP:``
    ranges around nested CPU operators (:data:`OPS_PER_PASS` a pass),
    ``c10d::``/``gloo:`` ranges for the transfers, ``ProfilerStep`` and
    optimizer ranges. The times are a pipesim simulation of that schedule
    (forward 1 ms, backward 2 ms, with noise), step after step, so the set
    is consistent across ranks."""
    import gc

    was = gc.isenabled()
    gc.enable()  # json.dumps(indent=...) leaves reference cycles behind, and the console script turns gc off
    try:
        return _synthetic_run(out, ranks, mb_per_rank, seed)
    finally:
        if not was:
            gc.collect()
            gc.disable()


def _synthetic_run(out: Path, ranks: int, mb_per_rank: float, seed: int) -> list[Path]:
    from pipesim.sim.api import simulate
    from pipesim.sim.strategies import ScheduleSpec

    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    sim = simulate(ScheduleSpec("1f1b", stages=ranks, microbatches=8), recv_lookahead=0)
    step_us = sim.makespan * 1e6 + 1000.0
    per_dev: dict[int, list] = {}
    for sp in sim.spans:
        if sp.stream in ("compute", "recv"):
            per_dev.setdefault(sp.device, []).append(sp)
    target = mb_per_rank * 1e6
    info = {"backend": "gloo", "world_size": ranks, "pg_count": 1}
    info["pg_config"] = [{"pg_name": "0", "pg_size": ranks, "ranks": list(range(ranks))}]
    paths = []
    for rank in range(ranks):
        path = out / f"rank{rank}.json"
        paths.append(path)
        spans = sorted(per_dev.get(rank, []), key=lambda sp: (sp.start, sp.stream != "recv"))
        with open(path, "w", encoding="utf-8") as f:
            head = {**info, "rank": rank}
            f.write(
                '{\n  "schemaVersion": 1,\n  "deviceProperties": [],\n  "distributedInfo": '
                + json.dumps(head)
                + ',\n  "baseTimeNanoseconds": 1700000000000000000,\n  "traceEvents": [\n'
            )
            sep = ""
            step = 0
            while f.tell() < target or step == 0:
                base = 1e6 + step * step_us
                events = [_x("user_annotation", f"ProfilerStep#{step}", base - 200, step_us - 100, rank)]
                events += _rank_events(spans, base, rank, ranks, rng)
                for ev in events:
                    f.write(sep + "  " + json.dumps(ev, indent=2).replace("\n", "\n  "))
                    sep = ",\n"
                step += 1
            f.write('\n  ],\n  "traceName": "' + path.name + '"\n}\n')
    return paths


def _rank_events(spans, base: float, rank: int, ranks: int, rng) -> list[dict]:
    """The events torch's runtime records for one rank's simulated step.

    A pass's label covers 85-90% of its simulated span; its send is posted
    right after it, the next pass's receive right after that (in the 10%
    left), and the receive is waited for until its data arrives (the
    simulated transfer): so every send is posted before its data arrives,
    as on a real run."""
    from pipesim.sim.ir.core import RECV_B, RECV_F, SEND_B, SEND_F, Action

    out = []
    free = base - 100.0  # when the rank's CPU thread is next free
    arrival = {}
    for sp in spans:
        if sp.stream == "recv":
            arrival[(sp.action.op, sp.action.microbatch)] = base + sp.end * 1e6
    for sp in spans:
        if sp.stream != "compute":
            continue
        a = sp.action
        t0, t1 = base + sp.start * 1e6, base + sp.end * 1e6
        if a.op is UPDATE:
            out.append(_x("user_annotation", "Optimizer.step#SGD.step", t0, max(t1 - t0, 50.0), rank))
            free = t0 + max(t1 - t0, 50.0)
            continue
        need = RECV_F if a.op is F and a.stage > 0 else RECV_B if a.op is B and a.stage < ranks - 1 else None
        if need is not None:
            post = free + 5.0
            done = max(arrival.get((need, a.microbatch), post), post + 20.0)
            out += [
                _x("user_annotation", f"PP:{format_torch(Action(need, a.stage, a.microbatch))}", post, 30.0, rank),
                _x("cpu_op", "c10d::recv_", post + 5, 20.0, rank),
                _x("user_annotation", "gloo:recv", post + 10, done - post - 10, rank),
            ]
        dur = (t1 - t0) * (0.85 + 0.05 * rng.random())
        out.append(_x("user_annotation", f"PP:{format_torch(a)}", t0, dur, rank))
        out += _nested_ops(t0, dur, OPS_PER_PASS, a.op is B, rank, rng)
        free = t0 + dur
        send = SEND_F if a.op is F and a.stage < ranks - 1 else SEND_B if a.op is B and a.stage > 0 else None
        if send is not None:
            post = free + 5.0
            out += [
                _x("user_annotation", f"PP:{format_torch(Action(send, a.stage, a.microbatch))}", post, 30.0, rank),
                _x("cpu_op", "c10d::send", post + 5, 20.0, rank),
                _x("user_annotation", "gloo:send", post + 10, 500.0, rank),
            ]
            free = post + 30.0
    return out


#: Operators inside a synthetic pass (half top level, half nested in them).
OPS_PER_PASS = 60


def format_torch(a) -> str:
    """An action as torch spells it (no version)."""
    from pipesim.sim.ir.core import format_action

    return format_action(a, torch_only=True)


def _x(cat: str, name: str, ts: float, dur: float, rank: int) -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 1000 + rank,
        "tid": 1000 + rank,
        "ts": round(ts, 3),
        "dur": round(dur, 3),
        "args": {"External id": 1, "Record function id": 0},
    }


_FWD = ("aten::linear", "aten::addmm", "aten::relu", "aten::layer_norm", "aten::add", "aten::mul")
_BWD = ("AddmmBackward0", "ReluBackward0", "NativeLayerNormBackward0", "AddBackward0")


def _nested_ops(t: float, dur: float, n: int, backward: bool, rank: int, rng) -> list[dict]:
    """``n`` operators inside a pass, half of them top-level with a child
    each, the way a module's forward or the autograd engine's steps nest."""
    out = []
    step = dur / (n // 2 + 1)
    for i in range(n // 2):
        s = t + 2 + i * step
        if backward:
            name = _BWD[i % len(_BWD)]
            out.append(_x("cpu_op", f"autograd::engine::evaluate_function: {name}", s, step * 0.9, rank))
            out.append(_x("cpu_op", name, s + 0.5, step * 0.8, rank))
        else:
            out.append(_x("cpu_op", _FWD[i % len(_FWD)], s, step * 0.9, rank))
            out.append(_x("cpu_op", "aten::empty", s + 0.5, step * 0.1 * rng.random(), rank))
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ranks", type=int, default=8, help="ranks (trace files) in the synthetic set")
    ap.add_argument("--size-mb", type=float, default=4.0, help="MB of JSON per rank (the target's: --size-mb 100)")
    ap.add_argument("--gzip", action="store_true", help="write the traces gzipped (.json.gz)")
    ap.add_argument("--workers", type=int, default=None, help="reading processes (default: one per core)")
    ap.add_argument("--no-memory", action="store_true", help="skip the second import, which measures memory")
    ap.add_argument("--keep", default=None, help="write the set to this folder and keep it")


def run(args) -> dict:
    """Write the synthetic set and import it twice: timed (as ``pipesim trace
    import`` does: the default reading processes, no tracing), then, unless
    ``--no-memory``, in this one process under :mod:`tracemalloc`, whose peak
    is every Python allocation of the whole import, the reading included
    (tracing slows it, hence the separate timed run)."""
    import resource
    import tracemalloc

    from pipesim.validate.kineto import json_size, plan_workers
    from pipesim.validate.traceimport import import_run

    if args.ranks < 2:
        from pipesim.experiments.cliargs import UsageError

        raise UsageError("pipesim bench trace: --ranks must be >= 2")
    import torch.distributed.pipelining.schedules  # noqa: F401 -- the labels' parser, not part of the timing

    with tempfile.TemporaryDirectory(prefix="pipesim-bench-trace-") as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        print(f"[trace] writing {args.ranks} synthetic traces of ~{args.size_mb:g} MB ...", file=sys.stderr, flush=True)
        paths = synthetic_run(folder, ranks=args.ranks, mb_per_rank=args.size_mb)
        if args.gzip:
            paths = [_gzip(p) for p in paths]
        sizes = [p.stat().st_size for p in paths]
        json_sizes = [json_size(p) for p in paths]
        workers = plan_workers(paths, args.workers)
        print(f"[trace] importing ({workers} reading process(es)) ...", file=sys.stderr, flush=True)
        cpu0 = _cpu_seconds()
        started = time.perf_counter()
        imported = import_run(paths, workers=args.workers)
        seconds = time.perf_counter() - started
        cpu = _cpu_seconds() - cpu0
        json_bytes = sum(f["json_bytes"] for f in imported.files)
        summary = summarize(imported.result)
        report = {
            "ranks": args.ranks,
            "files_bytes": sum(sizes),
            "largest_file_bytes": max(sizes),
            "largest_json_bytes": max(json_sizes),
            "json_bytes": json_bytes,
            "events": sum(f["events"] for f in imported.files),
            "gzip": bool(args.gzip),
            "workers": workers,
            "import_s": round(seconds, 3),
            "json_mb_per_s": round(json_bytes / seconds / 1e6, 1),
            # CPU time of this process and its reading processes: on a machine
            # shared with other work the wall time stretches, this does not
            "cpu_s": round(cpu, 3),
            "json_mb_per_cpu_s": round(json_bytes / cpu / 1e6, 1) if cpu > 0 else None,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "compute_actions": summary["compute_actions"],
            "bubble_fraction": summary["bubble_fraction"],
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "python_heap_peak_bytes": None,
        }
        del imported, summary
        if not args.no_memory:
            print("[trace] importing again in one process under tracemalloc ...", file=sys.stderr, flush=True)
            tracemalloc.start()
            try:
                import_run(paths, workers=1)
                report["python_heap_peak_bytes"] = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        return report


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process and its waited-for children."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _gzip(path: Path) -> Path:
    gz = path.with_suffix(".json.gz")
    with open(path, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    path.unlink()
    return gz


def render(r: dict) -> str:
    mb = 1e6
    heap = r["python_heap_peak_bytes"]
    return "\n".join(
        [
            f"{r['ranks']} ranks, {r['json_bytes'] / mb:.1f} MB of JSON ({r['events']:,} events; "
            f"{r['files_bytes'] / mb:.1f} MB on disk{', gzipped' if r['gzip'] else ''}), on {r['cpus']} CPUs",
            f"imported in {r['import_s']:.2f} s with {r['workers']} reading process(es): "
            f"{r['json_mb_per_s']:.1f} MB/s of JSON ({r['cpu_s']:.2f} CPU-s, {r['json_mb_per_cpu_s']} MB per CPU-s)",
            (
                f"peak memory: Python heap {heap / mb:.1f} MB (tracemalloc, whole import in one process); "
                if heap
                else ""
            )
            + f"process RSS {r['max_rss_bytes'] / mb:.1f} MB (torch's libraries included); "
            + f"largest file {r['largest_json_bytes'] / mb:.1f} MB of JSON"
            + (f" ({r['largest_file_bytes'] / mb:.1f} MB gzipped)" if r["gzip"] else ""),
            f"found {r['compute_actions']:,} compute actions, bubble {r['bubble_fraction']:.3f}",
        ]
    )


def main(argv: list[str] | None = None, prog: str = "pipesim bench trace") -> int:
    from pipesim.experiments.cliargs import bench_main

    return bench_main(
        argv,
        prog=prog,
        description="import a synthetic 8-rank set of Kineto traces: MB/s of JSON and peak memory",
        add_arguments=add_arguments,
        run=run,
        render=render,
    )

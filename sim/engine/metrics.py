"""The numbers people compare schedules by, and the ``summary.json`` contract.

Definitions follow ``docs/concepts/accounting.md``: a device's bubble fraction is one
minus its busy compute time over the makespan (first action of any device to
the last); the overall bubble is the mean over devices; staleness of a
micro-batch on a stage is the version at the update consuming its gradient
minus the version its forward read.

``summarize`` returns plain dicts and lists with deterministic ordering and
floats rounded to 12 significant digits, so the same inputs serialise to
byte-identical JSON on every run and machine.
"""

from __future__ import annotations

import json
from collections import defaultdict
from itertools import chain
from operator import attrgetter
from pathlib import Path

from pipesim.sim.engine.results import SimResult
from pipesim.sim.ir.core import PASS_OPS
from pipesim.sim.strategies import find_strategy

SUMMARY_VERSION = 1


def round_sig(x: float) -> float:
    """Round to 12 significant digits, so JSON is identical across platforms."""
    return float(f"{x:.12g}")


_r = round_sig


def device_busy(result: SimResult) -> list[float]:
    """Seconds each device's compute stream was busy."""
    compute = result.by_stream()["compute"]
    # a measured timeline may name more devices than the schedule it ran
    n = max([result.schedule.num_devices] + [s.device + 1 for s in compute])
    busy = [0.0] * n
    for s in compute:
        busy[s.device] += s.end - s.start
    return busy


def bubble_fractions(result: SimResult, busy: list[float] | None = None, makespan: float | None = None) -> list[float]:
    makespan = result.makespan if makespan is None else makespan
    busy = device_busy(result) if busy is None else busy
    if makespan <= 0:
        return [0.0] * len(busy)
    return [max(0.0, 1.0 - b / makespan) for b in busy]


def summarize(result: SimResult) -> dict:
    """The ``summary.json`` document for one execution."""
    s = result.schedule
    makespan = result.makespan
    busy = device_busy(result)
    bubbles = bubble_fractions(result, busy, makespan)
    found = find_strategy(s.strategy)
    shards = found.shards(s.options) if found is not None else 1  # tensor parallelism: d ids per micro-batch
    samples = s.total_microbatches * result.microbatch_size // shards  # ids are global over replicas
    compute_actions = len(result.by_stream()["compute"])

    devices = []
    for dev, (bubble, mem) in enumerate(zip(bubbles, result.memory, strict=True)):
        devices.append(
            {
                "id": dev,
                "bubble_fraction": _r(bubble),
                "busy_s": _r(busy[dev]),
                "peak_memory_bytes": int(mem.peak_bytes),
                "peak_memory_time_s": _r(mem.peak_time),
                "memory_capacity_bytes": mem.capacity_bytes if mem.capacity_bytes != float("inf") else None,
                "memory_breakdown": dict(mem.peak_breakdown),
                "out_of_memory": bool(mem.out_of_memory),
            }
        )

    # any distance at all (a C-level scan), then whether a pass has one
    predicting = any(map(attrgetter("distance"), chain.from_iterable(s.programs))) and any(
        a.distance for p in s.programs for a in p if a.op in PASS_OPS
    )
    stale = defaultdict(list)
    dist_f: dict[int, set] = defaultdict(set)
    dist_b: dict[int, set] = defaultdict(set)
    for pv in result.versions:  # one per pass: staleness inline, distances only where reported
        if pv.update_version is not None:
            stale[pv.stage].append(pv.update_version - pv.forward_version)
        if predicting:
            dist_f[pv.stage].add(pv.forward_distance)
            dist_b[pv.stage].add(pv.backward_distance)
    held: dict[int, int] = {}  # most versions of each stage held by any replica (one pass, not one per stage)
    for (_, st), n in result.max_versions_held.items():
        held[st] = max(held[st], n) if st in held else n
    stages_info = []
    for stage in range(s.num_stages):
        vals = stale.get(stage, [])
        info = {
            "stage": stage,
            "weight_versions": held.get(stage, 1),
            "staleness_max": max(vals) if vals else 0,
            "staleness_mean": _r(sum(vals) / len(vals)) if vals else 0.0,
        }
        if result.stage_costs:
            c = result.stage_costs[stage]
            info.update(
                forward_s=_r(c.forward_s),
                backward_s=_r(c.backward_s),
                param_bytes=int(c.param_bytes),
                stash_bytes=int(c.stash_bytes),
                activation_bytes=int(c.activation_bytes),
            )
        if predicting:
            info["prediction_distance_fwd"] = max(dist_f.get(stage, {0}))
            info["prediction_distance_bwd"] = max(dist_b.get(stage, {0}))
        stages_info.append(info)

    strategy = find_strategy(s.strategy)  # None for an imported schedule
    asynchronous = strategy is not None and strategy.asynchronous
    inconsistency = _inconsistency(result) if predicting or asynchronous else None
    summary = {
        "summary_version": SUMMARY_VERSION,
        "strategy": s.strategy,
        "stages": s.num_stages,
        "devices_count": s.num_devices,
        "replicas": s.num_replicas,
        "stage_replicas": list(s.replicas),
        "microbatches": s.num_microbatches // shards,  # tensor parallelism: m, not its m*d shard ids
        "iterations": s.num_iterations,
        "microbatch_size": result.microbatch_size,
        "makespan_s": _r(makespan),
        "iteration_time_s": _r(makespan / s.num_iterations),
        "throughput_samples_per_s": _r(samples / makespan) if makespan > 0 else None,
        "bubble_fraction": _r(sum(bubbles) / len(bubbles)),
        "peak_memory_bytes_max": max((d["peak_memory_bytes"] for d in devices), default=0),
        "out_of_memory": any(d["out_of_memory"] for d in devices),
        "compute_actions": compute_actions,
        "devices": devices,
        "stages_info": stages_info,
        "link_bytes": {k: int(v) for k, v in sorted(result.link_bytes.items())},
        "options": {k: _jsonable(v) for k, v in sorted(s.options.items())},
        "meta": {k: _jsonable(v) for k, v in sorted(result.meta.items())},
    }
    if inconsistency is not None:
        summary["inconsistency_max"] = inconsistency
    return summary


def _inconsistency(result: SimResult) -> int:
    """Max over micro-batches of (max - min) effective forward version across stages."""
    eff: dict[tuple[int, int], list[int]] = defaultdict(list)
    for pv in result.versions:
        eff[(pv.replica, pv.microbatch)].append(pv.forward_version + pv.forward_distance)
    return max((max(v) - min(v) for v in eff.values()), default=0)


def _jsonable(v):
    if isinstance(v, float):
        return _r(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in sorted(v.items())}
    return v


def dumps(summary: dict) -> str:
    """Canonical JSON text: sorted keys, fixed separators, trailing newline."""
    return json.dumps(summary, indent=2, sort_keys=True) + "\n"


def write_summary(summary: dict, path: str | Path) -> None:
    Path(path).write_text(dumps(summary))

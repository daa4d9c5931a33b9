"""Reconcile a measured timeline with the simulated one.

A measured run comes back as :class:`~pipesim.validate.executor.Record` s
(host nanoseconds on one clock). :func:`measured_result` turns them into the
simulator's own :class:`~pipesim.sim.engine.results.SimResult`, so both timelines
go through the same metrics, trace writer and plots, and :func:`compare`
matches them action by action: the same (device, action) is the same unit
of work in both, because both executed the same IR.

Iteration time is measured the same way on both sides, in steady state:
iteration t ends when the last device finishes the compute it does before
its first pass of iteration t+1 (its update, for flush schedules), and the
iteration time is the mean spacing of those ends after the first one. The
first iteration is left out because on real hardware it also pays for
allocator and cache warm-up, which no simulator should try to predict.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from pipesim.sim.engine.metrics import bubble_fractions, round_sig
from pipesim.sim.engine.results import SimResult, Span
from pipesim.sim.engine.trackers import activation_peaks
from pipesim.sim.ir.core import COMPUTE_OPS, PASS_OPS, B, F, I, Schedule, W
from pipesim.sim.workloads.profile import Profile

#: relative duration error (|pred − meas| / meas) above which an action is flagged
DURATION_THRESHOLD = 0.25
#: start error, as a fraction of the measured makespan, above which an action is flagged
START_THRESHOLD = 0.10
#: flagged actions listed in a report (worst first)
FLAGGED_LIMIT = 25


def measured_result(
    schedule: Schedule, records, *, microbatch_size: int = 1, stage_costs=(), meta: dict | None = None
) -> SimResult:
    """The records of a real run as a SimResult (seconds from the first compute action)."""
    compute = [r for r in records if r.stream == "compute"]
    if not compute:
        raise ValueError("the run recorded no compute actions")
    t0 = min(r.start for r in compute)
    spans = []
    for r in sorted(records, key=lambda r: (r.start, r.device, r.stream)):
        end = r.end if r.end is not None else r.start
        spans.append(Span(r.device, r.stream, r.action, (r.start - t0) / 1e9, (end - t0) / 1e9, r.peer, None, r.nbytes))
    return SimResult(
        schedule=schedule,
        spans=spans,
        memory=[],
        versions=[],
        max_versions_held={},
        link_bytes={},
        microbatch_size=microbatch_size,
        meta=dict(meta or {}),
        stage_costs=tuple(stage_costs),
    )


def _compute_by_device(result: SimResult) -> dict[int, list[Span]]:
    out: dict[int, list[Span]] = defaultdict(list)
    for s in result.by_stream()["compute"]:
        out[s.device].append(s)
    for spans in out.values():
        spans.sort(key=lambda s: s.start)
    return out


def iteration_ends(result: SimResult) -> list[float]:
    """When each iteration's work is done (see the module doc), from the first compute start."""
    sched = result.schedule
    m, k = sched.num_microbatches, sched.num_iterations
    by_dev = _compute_by_device(result)
    t0 = min(s.start for spans in by_dev.values() for s in spans)
    ends = [t0] * k
    for spans in by_dev.values():
        it = 0
        for i, s in enumerate(spans):
            a = s.action
            if a.op in PASS_OPS:
                while a.microbatch >= (it + 1) * m and it < k - 1:
                    if i:
                        ends[it] = max(ends[it], spans[i - 1].end)
                    it += 1
        for t in range(it, k):
            ends[t] = max(ends[t], spans[-1].end)
    return [e - t0 for e in ends]


def iteration_time(result: SimResult) -> float:
    """Steady-state seconds per iteration (the whole run when it has one iteration)."""
    ends = iteration_ends(result)
    if len(ends) == 1:
        return ends[0]
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    vals = sorted(values)
    pos = q * (len(vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def _stats(values: list[float]) -> dict:
    return {
        "median": round_sig(_quantile(values, 0.5)),
        "p90": round_sig(_quantile(values, 0.9)),
        "max": round_sig(max(values, default=0.0)),
    }


def steady_actions(schedule: Schedule) -> set[tuple[int, object]]:
    """(device, action) of every compute action a device runs from its first
    pass of the second iteration on, in program order: the same set on both
    sides, whatever the timings."""
    m = schedule.num_microbatches
    out = set()
    for dev, prog in enumerate(schedule.programs):
        steady = False
        for a in prog:
            if a.op in PASS_OPS and a.microbatch >= m:
                steady = True
            if steady and a.op in COMPUTE_OPS:
                out.add((dev, a))
    return out


def compare_actions(predicted: SimResult, measured: SimResult) -> tuple[dict, list[dict]]:
    """Per compute action of the steady state: start and duration errors,
    matched by (device, action).

    As for the iteration time, the first iteration is left out when there
    are more: its allocator and cache warm-up delays every later action by
    about the same amount, which would count once per action. Starts are
    measured from the end of the first iteration on each side
    (:func:`iteration_ends`), and a start error is a fraction of the
    measured makespan from there on.
    """
    pred = {(s.device, s.action): s for s in predicted.by_stream()["compute"]}
    meas = {(s.device, s.action): s for s in measured.by_stream()["compute"]}
    if set(pred) != set(meas):
        missing = sorted(map(str, (a for _, a in set(pred) ^ set(meas))))[:3]
        raise ValueError(f"the measured and simulated runs executed different actions: {', '.join(missing)}")
    p0 = min(s.start for s in pred.values())
    m0 = min(s.start for s in meas.values())
    span = measured.makespan or 1.0
    if predicted.schedule.num_iterations > 1:  # from the end of the first iteration on
        p0 += iteration_ends(predicted)[0]
        m_first = iteration_ends(measured)[0]
        m0 += m_first
        span = (measured.makespan - m_first) or 1.0
        steady = steady_actions(predicted.schedule)
        pred = {k: v for k, v in pred.items() if k in steady}
    starts, durs, starts_rel = [], [], []
    rows = []
    for key in sorted(pred, key=lambda k: (k[0], meas[k].start)):
        p, m = pred[key], meas[key]
        se = (p.start - p0) - (m.start - m0)
        de = p.duration - m.duration
        rel = de / m.duration if m.duration > 0 else 0.0
        starts.append(abs(se))
        starts_rel.append(abs(se) / span)
        durs.append(abs(rel))
        if abs(rel) > DURATION_THRESHOLD or abs(se) / span > START_THRESHOLD:
            rows.append(
                {
                    "device": key[0],
                    "action": str(key[1]),
                    "start_measured_s": round_sig(m.start - m0),
                    "start_predicted_s": round_sig(p.start - p0),
                    "duration_measured_s": round_sig(m.duration),
                    "duration_predicted_s": round_sig(p.duration),
                    "duration_error": round_sig(rel),
                    "start_error_s": round_sig(se),
                    "_score": max(abs(rel) / DURATION_THRESHOLD, abs(se) / span / START_THRESHOLD),
                }
            )
    rows.sort(key=lambda r: (-r["_score"], r["device"], r["start_measured_s"]))
    for r in rows:
        del r["_score"]
    summary = {
        "compared": len(pred),
        "start_error_s": _stats(starts),
        "start_error_fraction_of_makespan": _stats(starts_rel),
        "duration_error": _stats(durs),
        "thresholds": {"duration_error": DURATION_THRESHOLD, "start_error_fraction": START_THRESHOLD},
        "flagged_count": len(rows),
    }
    return summary, rows[:FLAGGED_LIMIT]


def compare_stage_times(predicted: SimResult, measured: SimResult) -> list[dict]:
    """Mean duration of each (stage, op) measured against predicted."""
    acc: dict[tuple, list] = defaultdict(lambda: [[], []])
    for i, res in enumerate((predicted, measured)):
        for s in res.by_stream()["compute"]:
            acc[(s.action.stage, s.action.op.value)][i].append(s.duration)
    out = []
    for (stage, op), (p, m) in sorted(acc.items()):
        mp, mm = statistics.fmean(p), statistics.fmean(m)
        out.append(
            {
                "stage": stage,
                "op": op,
                "count": len(m),
                "predicted_s": round_sig(mp),
                "measured_s": round_sig(mm),
                "error": round_sig((mp - mm) / mm) if mm > 0 else None,
            }
        )
    return out


def pass_time_ratio(predicted: SimResult, measured: SimResult, profile: Profile) -> float | None:
    """How long the run's passes (F, B, I, W) took, summed, over how long
    the prediction had the same passes take less the profile's per-pass
    overhead: above 1, the machine ran them slower than its profile said.
    Steady state only, as for the iteration time (:func:`steady_actions`),
    when the run has several iterations; None when nothing was compared.
    ``predicted`` is the simulated run itself (not single-device mode's
    serialized timeline), whose passes hold what the cores' model charges
    them, as the measured ones do.

    A machine's speed drifts while it is shared (a CPU's by a few percent
    over seconds, a GPU's with its clocks), so a profile measured a minute
    before a run prices its passes at that minute's speed. The prediction
    again with the layers this many times as long
    (:func:`~pipesim.sim.workloads.profile.at_layer_speed`) leaves the error
    that is the schedule's: bubbles, transfers, overheads, updates.

    The overheads are left out of the prediction's side: they are the
    runtime's cost per pass, start to start, mostly bookkeeping between
    passes, of which a measured pass's span holds little (the simulator
    puts it all inside)."""
    overhead = {F: profile.overhead_forward_s, B: profile.overhead_backward_s}
    overhead[I] = overhead[W] = profile.overhead_backward_s
    steady = steady_actions(predicted.schedule) if predicted.schedule.num_iterations > 1 else None

    def passes(result: SimResult) -> dict:
        return {
            (s.device, s.action): s.duration
            for s in result.by_stream()["compute"]
            if s.action.op in PASS_OPS and (steady is None or (s.device, s.action) in steady)
        }

    pred, meas = passes(predicted), passes(measured)
    both = pred.keys() & meas.keys()  # fsum is exact: their order does not matter
    run = math.fsum(meas[k] for k in both)
    layers = math.fsum(pred[k] - overhead[k[1].op] for k in both)
    return run / layers if run > 0 and layers > 0 else None


def compare_versions(predicted: SimResult, versions_used: dict) -> dict:
    """Weight versions each pass really read against the simulator's account."""
    want = {}
    for pv in predicted.versions:
        want[(pv.replica, pv.stage, "F", pv.microbatch)] = (pv.forward_version, pv.forward_distance)
        want[(pv.replica, pv.stage, "B", pv.microbatch)] = (pv.backward_version, pv.backward_distance)
    got = {}
    for (rep, stage), lst in versions_used.items():
        for op, mb, v, d in lst:
            if op in ("B", "W"):  # the backward's weights are those of its last part
                got[(rep, stage, "B", mb)] = (v, d)
            elif op == "F":
                got[(rep, stage, "F", mb)] = (v, d)
    mismatches = []
    for key in sorted(set(want) | set(got), key=lambda k: (k[0], k[1], k[3], k[2])):
        if want.get(key) != got.get(key):
            rep, stage, op, mb = key
            mismatches.append(
                {
                    "replica": rep,
                    "stage": stage,
                    "pass": op,
                    "microbatch": mb,
                    "predicted": list(want[key]) if key in want else None,
                    "used": list(got[key]) if key in got else None,
                }
            )
    per_stage = defaultdict(lambda: {"passes": 0, "versions": set()})
    for (rep, stage, op, mb), (v, d) in got.items():
        per_stage[stage]["passes"] += 1
        per_stage[stage]["versions"].add(v + d)
    return {
        "match": not mismatches,
        "passes_compared": len(want),
        "mismatches": len(mismatches),
        "first_mismatches": mismatches[:10],
        "per_stage": [
            {"stage": s, "passes": v["passes"], "distinct_effective_versions": len(v["versions"])}
            for s, v in sorted(per_stage.items())
        ],
    }


def compare_held_activations(predicted: SimResult, measured: dict[int, int]) -> list[dict]:
    """Per device, the peak bytes held for pending backwards that the run
    measured (:class:`~pipesim.validate.stage.HeldActivations`) against the
    simulation's peak of its activations (:func:`activation_peaks`)."""
    peaks = activation_peaks(predicted)
    out = []
    for d in sorted(measured):
        pred = peaks[d] if d < len(peaks) else None
        meas = int(measured[d])
        out.append(
            {
                "device": d,
                "measured_bytes": meas,
                "predicted_bytes": pred,
                "error": round_sig((pred - meas) / meas) if pred is not None and meas else None,
            }
        )
    return out


def compare(
    predicted: SimResult,
    measured: SimResult,
    *,
    losses: list[float],
    versions_used: dict,
    peak_memory: dict[int, int] | None = None,
    held_activations: dict[int, int] | None = None,
    held_reference: SimResult | None = None,
) -> dict:
    """The reconciliation part of ``report.json``.

    ``held_activations`` (device -> measured peak bytes) is compared with
    the activations of ``held_reference`` (default ``predicted``): the
    simulated parallel run, whose devices hold what the run's devices
    hold, also where ``predicted`` is single-device mode's serialized
    timeline."""
    t_meas = iteration_time(measured)
    t_pred = iteration_time(predicted)
    b_meas = bubble_fractions(measured)
    b_pred = bubble_fractions(predicted)
    actions, flagged = compare_actions(predicted, measured)
    report = {
        "iteration_time_measured_s": round_sig(t_meas),
        "iteration_time_predicted_s": round_sig(t_pred),
        "iteration_time_error": round_sig((t_pred - t_meas) / t_meas) if t_meas > 0 else None,
        "makespan_measured_s": round_sig(measured.makespan),
        "makespan_predicted_s": round_sig(predicted.makespan),
        "bubble_fraction_measured": round_sig(sum(b_meas) / len(b_meas)),
        "bubble_fraction_predicted": round_sig(sum(b_pred) / len(b_pred)),
        "bubble_fraction_per_device": [
            {"device": d, "measured": round_sig(bm), "predicted": round_sig(bp)}
            for d, (bm, bp) in enumerate(zip(b_meas, b_pred))
        ],
        "action_errors": actions,
        "flagged_actions": flagged,
        "stage_times": compare_stage_times(predicted, measured),
        "losses": [round_sig(x) for x in losses],
        "weight_versions": compare_versions(predicted, versions_used),
    }
    if peak_memory:
        report["peak_memory"] = [
            {
                "device": d,
                "measured_bytes": int(peak_memory[d]),
                "predicted_bytes": int(predicted.memory[d].peak_bytes) if d < len(predicted.memory) else None,
                "error": round_sig((predicted.memory[d].peak_bytes - peak_memory[d]) / peak_memory[d])
                if d < len(predicted.memory) and peak_memory[d]
                else None,
            }
            for d in sorted(peak_memory)
        ]
    if held_activations:
        report["held_activations"] = compare_held_activations(held_reference or predicted, held_activations)
    return report

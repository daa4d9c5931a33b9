"""What if this run had used another schedule? Costs read off a measured run.

A measured timeline (a :class:`~pipesim.sim.engine.results.SimResult` whose
spans came from a real run: ``pipesim validate``, or a torch.profiler trace
imported by ``pipesim trace import``) already says what each pass of each
stage and each transfer across each boundary took. This module turns those
durations back into the engine's inputs, so the same run can be

* **reconciled** (:func:`reconcile`): its own schedule simulated on its own
  measured costs. What the simulation gets wrong then is what the schedule
  alone cannot explain (stragglers, noise, waits a runtime adds), not a
  cost model's error;
* **asked "what if"** (:func:`what_if`): other strategies and micro-batch
  counts on the same devices, priced with the same measured costs.

How the costs are read (:func:`measured_costs`):

* a stage's forward, backward, input-gradient and weight-gradient passes: the
  mean of their spans after the first iteration (where there are later
  ones: the first pays for warm-up) (a full backward ``B`` where the run had one, else
  ``I + W``); an update: the mean ``UPDATE``. The mean, not the median: an
  iteration takes the sum of its passes, and a run's slow passes are part
  of what it took;
* a boundary's transfer: for every matched send and receive, the time from
  when both ends were posted to when the receive completed (``recv.end -
  max(send.start, recv.start)``): the wait for a late sender is not
  transfer. The median over both directions (an activation and its
  gradient have the same size), not the mean: where a runtime only learns
  of an arrival when the consumer waits for it (torch's on gloo), a
  measured transfer also holds whatever the consumer did first, an upper
  bound sometimes far above the wire time, and the median resists those.

* a stage's **host overhead**: the mean gap before its passes that no input
  held up (:func:`host_overhead`), the runtime's own time between passes,
  added to each pass; such a gap after an update (the training loop's own
  step between iterations) is added to the update instead.

How they are fed to the engine (:func:`stage_costs`, :func:`measured_hardware`):
a machine of ``switch``-connected devices at a nominal
:data:`NOMINAL_BANDWIDTH`, with no latency and no collective model, where a
stage's ``activation_bytes`` are its boundary's measured seconds times that
bandwidth, so an uncontended transfer takes exactly its measured time, and
its ``param_bytes`` are what makes an update take its measured time at the
device's memory bandwidth. Stash bytes are the trace's where it has them
(:attr:`MeasuredCosts.stash_bytes`); otherwise each stashed micro-batch counts
one byte, and a what-if's "peak memory" is the most micro-batches a device
holds at once (:attr:`WhatIf.peak_unit`). These byte counts are units of the
calibration, not the run's memory, and nothing else reads them.

Another depth than the run's regroups the measured stages
(:func:`regroup`): merging consecutive stages sums their passes; splitting
one into r equal parts divides them by r, each new inner boundary costing
the mean measured transfer (an assumption, listed in
:attr:`MeasuredCosts.assumptions` of the result).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pipesim.sim.engine.core import simulate
from pipesim.sim.engine.metrics import bubble_fractions, round_sig
from pipesim.sim.engine.results import SimResult, Span
from pipesim.sim.errors import InputError
from pipesim.sim.hardware.machines import DeviceSpec, Hardware, Interconnect
from pipesim.sim.ir.core import RECV_B, RECV_F, UPDATE, B, F, I, Schedule, W, boundary_stage
from pipesim.sim.planning.plan import steady_state
from pipesim.sim.strategies import ScheduleSpec, StrategyError, build_schedule, get_strategy
from pipesim.sim.workloads.stages import StageCost

#: Bytes per second of the calibrated links and memory: a unit that turns
#: measured seconds into the byte counts the engine prices.
NOMINAL_BANDWIDTH = 1e9
#: Memory passes of an SGD-with-momentum update (``CostModel.traffic``).
_SGD_UPDATE_TRAFFIC = 5


class WhatIfError(InputError):
    """A measured run that cannot be calibrated, or a what-if it cannot answer."""


@dataclass(frozen=True)
class MeasuredCosts:
    """Per-stage pass times and per-boundary transfer times of a measured run."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    #: None where the run had no split backward (I and W) for the stage
    backward_input_s: tuple[float | None, ...]
    backward_weight_s: tuple[float | None, ...]
    #: boundary k sits between stage k and stage k + 1
    transfer_s: tuple[float, ...]
    update_s: tuple[float, ...]
    #: per stage, the host's own time before each pass whose inputs were
    #: there (:func:`host_overhead`): a runtime's per-pass cost
    overhead_s: tuple[float, ...] | None = None
    microbatch_size: int = 1
    #: bytes a micro-batch stashes on each stage, where the trace says
    stash_bytes: tuple[int, ...] | None = None
    #: how many spans each figure is the mean of: "F0" (op and stage) -> count
    samples: dict = field(default_factory=dict, compare=False)
    assumptions: tuple[str, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.forward_s)

    def to_json(self) -> dict:
        return {
            "forward_s": [round_sig(x) for x in self.forward_s],
            "backward_s": [round_sig(x) for x in self.backward_s],
            "backward_input_s": [None if x is None else round_sig(x) for x in self.backward_input_s],
            "backward_weight_s": [None if x is None else round_sig(x) for x in self.backward_weight_s],
            "transfer_s": [round_sig(x) for x in self.transfer_s],
            "update_s": [round_sig(x) for x in self.update_s],
            "overhead_s": None if self.overhead_s is None else [round_sig(x) for x in self.overhead_s],
            "microbatch_size": self.microbatch_size,
            "stash_bytes": None if self.stash_bytes is None else list(self.stash_bytes),
            "assumptions": list(self.assumptions),
        }

    @classmethod
    def from_json(cls, d: dict) -> MeasuredCosts:
        try:
            return cls(
                forward_s=tuple(float(x) for x in d["forward_s"]),
                backward_s=tuple(float(x) for x in d["backward_s"]),
                backward_input_s=tuple(None if x is None else float(x) for x in d["backward_input_s"]),
                backward_weight_s=tuple(None if x is None else float(x) for x in d["backward_weight_s"]),
                transfer_s=tuple(float(x) for x in d["transfer_s"]),
                update_s=tuple(float(x) for x in d["update_s"]),
                overhead_s=None if d.get("overhead_s") is None else tuple(float(x) for x in d["overhead_s"]),
                microbatch_size=int(d.get("microbatch_size", 1)),
                stash_bytes=None if d.get("stash_bytes") is None else tuple(int(x) for x in d["stash_bytes"]),
                assumptions=tuple(str(x) for x in d.get("assumptions", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise WhatIfError(f"measured costs are malformed ({type(e).__name__}: {e})") from None


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def _first_version(result: SimResult) -> int | None:
    """The weight version the first iteration's passes read, where later
    passes read others (else None: the run is one iteration, keep it all).
    The first iteration also pays for warm-up, and the iteration time a
    reconciliation compares leaves it out too."""
    versions = {s.action.version for s in result.by_stream().get("compute", ()) if s.action.op in (F, B, I, W)}
    return min(versions) if len(versions) > 1 else None


@dataclass(frozen=True)
class _Steady:
    """What a calibration reads, the first iteration left out (computed
    once per run): the compute spans, and the micro-batches whose transfers
    count (None: all of them)."""

    passes: list
    microbatches: frozenset | None

    @classmethod
    def of(cls, result: SimResult) -> _Steady:
        compute = result.by_stream().get("compute", ())
        first = _first_version(result)
        if first is None:
            return cls(list(compute), None)
        # an UPDATE names the version it produces: the first iteration's makes first + 1
        passes = [
            s for s in compute if s.action.version is not None and s.action.version > first + (s.action.op is UPDATE)
        ]
        return cls(passes, frozenset(s.action.microbatch for s in passes if s.action.op is F))

    def transfers(self, spans: Sequence[Span]) -> list[Span]:
        if self.microbatches is None:
            return list(spans)
        return [s for s in spans if s.action.microbatch in self.microbatches]


def _pass_times(steady: _Steady) -> dict[tuple, list[float]]:
    times: dict[tuple, list[float]] = defaultdict(list)
    for s in steady.passes:
        times[(s.action.op, s.action.stage)].append(s.duration)
    return times


def _transfer_key(s: Span) -> tuple:
    a = s.action
    return (boundary_stage(a), a.microbatch, a.replica, a.op.value.split("_")[1])


def transfer_times(result: SimResult, steady: _Steady | None = None) -> dict[int, list[float]]:
    """Per boundary, the pure transfer time of every matched send/receive
    pair: from when both ends were posted to the receive's end (a
    receive's wait for a late sender left out). Pairs match by their
    ``flow`` id where the executor set one, else by boundary, micro-batch,
    replica and direction, in order."""
    streams = result.by_stream()
    steady = steady or _Steady.of(result)
    sends = steady.transfers(streams.get("send", ()))
    recvs = steady.transfers(streams.get("recv", ()))
    out: dict[int, list[float]] = defaultdict(list)
    by_flow = {s.flow: s for s in sends if s.flow is not None}
    unmatched: dict[tuple, list[Span]] = defaultdict(list)
    for s in sends:
        if s.flow is None:
            unmatched[_transfer_key(s)].append(s)
    for r in recvs:
        send = by_flow.get(r.flow) if r.flow is not None else None
        if send is None:
            queue = unmatched.get(_transfer_key(r))
            send = queue.pop(0) if queue else None
        if send is None:
            continue
        out[boundary_stage(r.action)].append(max(0.0, r.end - max(send.start, r.start)))
    return out


def host_overhead(
    result: SimResult, steady: _Steady | None = None
) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Per stage, the gaps before its passes that no input held up: a
    device's pass starting after its previous compute ended although the
    receive it consumes (if any) had already completed and none of the
    device's transfers or collectives ran in the gap (a blocking send
    holds a rank's thread until its receiver takes it). That time is the
    runtime's own (Python, the schedule's bookkeeping, posting the
    communication), which a pass's span does not hold and the engine would
    otherwise not charge. Returned apart: the gaps after an ``UPDATE``
    (between two iterations: the training loop's own step, its optimizer
    and loss bookkeeping, once an iteration) and the others (once a pass)."""
    streams = result.by_stream()
    arrived: dict[tuple, float] = {}
    for r in streams.get("recv", ()):
        a = r.action
        arrived[(r.device, a.op, a.stage, a.microbatch, a.replica)] = r.end
    busy = _merged_intervals(
        (s.device, s.start, s.end) for name in ("send", "recv", "collective") for s in streams.get(name, ())
    )
    per_pass: dict[int, list[float]] = defaultdict(list)
    per_step: dict[int, list[float]] = defaultdict(list)
    by_device: dict[int, list[Span]] = defaultdict(list)
    for sp in (steady or _Steady.of(result)).passes:
        by_device[sp.device].append(sp)
    for dev, spans in by_device.items():
        spans.sort(key=lambda x: x.start)
        for prev, nxt in zip(spans, spans[1:]):
            a = nxt.action
            if a.op not in (F, B, I, W):
                continue
            needs = RECV_F if a.op is F else RECV_B
            ready = arrived.get((dev, needs, a.stage, a.microbatch, a.replica), 0.0)
            if ready <= prev.end and nxt.start >= prev.end and not _overlaps(busy.get(dev), prev.end, nxt.start):
                if prev.action.op is UPDATE:
                    per_step[prev.action.stage].append(nxt.start - prev.end)
                else:
                    per_pass[a.stage].append(nxt.start - prev.end)
    return per_pass, per_step


def _merged_intervals(items) -> dict[int, tuple[list[float], list[float]]]:
    """Per device, its communication's time ranges merged into disjoint
    ones: (starts, ends), sorted."""
    raw: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for dev, start, end in items:
        if end > start:
            raw[dev].append((start, end))
    out = {}
    for dev, spans in raw.items():
        spans.sort()
        starts, ends = [spans[0][0]], [spans[0][1]]
        for a, b in spans[1:]:
            if a <= ends[-1]:
                ends[-1] = max(ends[-1], b)
            else:
                starts.append(a)
                ends.append(b)
        out[dev] = (starts, ends)
    return out


def _overlaps(merged: tuple[list[float], list[float]] | None, start: float, end: float) -> bool:
    """Whether ``(start, end)`` meets one of the merged ranges."""
    if merged is None or end <= start:
        return False
    starts, ends = merged
    i = bisect.bisect_left(starts, end)  # ranges starting before the gap ends
    return i > 0 and ends[i - 1] > start


def measured_costs(result: SimResult, stash_bytes: Sequence[int] | None = None) -> MeasuredCosts:
    """The costs a measured run shows (see the module doc); a
    :class:`WhatIfError` when a stage has no forward or no backward."""
    n = result.schedule.num_stages
    steady = _Steady.of(result)
    times = _pass_times(steady)
    assumptions = []
    fwd, bwd, bin_, bw_ = [], [], [], []
    for k in range(n):
        f = times.get((F, k))
        full = times.get((B, k))
        i, w = times.get((I, k)), times.get((W, k))
        if not f or not (full or i):
            raise WhatIfError(f"stage {k} has no measured forward or backward: nothing to calibrate it with")
        fwd.append(_mean(f))
        if full:
            bwd.append(_mean(full))
        else:
            bwd.append(_mean(i) + _mean(w or []))
        bin_.append(_mean(i) if i else None)
        bw_.append(_mean(w) if w else None)
    moved = transfer_times(result, steady)
    transfer = []
    for k in range(n - 1):
        if moved.get(k):
            transfer.append(statistics.median(moved[k]))
        else:
            transfer.append(0.0)
            if result.schedule.num_devices > 1:
                assumptions.append(f"boundary {k}: no matched transfer measured, taken as free")
    per_pass, per_step = host_overhead(result, steady)
    # an update carries the loop's own time before the next iteration's first pass
    update = [_mean(times.get((UPDATE, k), [])) + _mean(per_step.get(k, [])) for k in range(n)]
    overhead = tuple(_mean(per_pass.get(k, [])) for k in range(n))
    samples = {
        f"{op.value}{k}": len(v) for (op, k), v in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0].value))
    }
    return MeasuredCosts(
        tuple(fwd),
        tuple(bwd),
        tuple(bin_),
        tuple(bw_),
        tuple(transfer),
        tuple(update),
        overhead_s=overhead,
        microbatch_size=result.microbatch_size,
        stash_bytes=None if stash_bytes is None else tuple(int(x) for x in stash_bytes),
        samples=samples,
        assumptions=tuple(assumptions),
    )


def regroup(costs: MeasuredCosts, num_stages: int) -> MeasuredCosts:
    """The costs on ``num_stages`` stages: consecutive measured stages merged,
    or each split into equal parts (see the module doc)."""
    n = costs.num_stages
    if num_stages == n:
        return costs
    if num_stages < 1:
        raise WhatIfError(f"a pipeline needs at least one stage, not {num_stages}")
    if n % num_stages == 0:
        return _merged(costs, n // num_stages)
    if num_stages % n == 0:
        return _split(costs, num_stages // n)
    raise WhatIfError(
        f"the run measured {n} stages; {num_stages} stages neither merge nor split them evenly "
        f"(ask for a multiple or a divisor of {n})"
    )


def _opt_sum(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def _merged(c: MeasuredCosts, r: int) -> MeasuredCosts:
    groups = [range(g * r, (g + 1) * r) for g in range(c.num_stages // r)]
    return replace(
        c,
        forward_s=tuple(sum(c.forward_s[k] for k in g) for g in groups),
        backward_s=tuple(sum(c.backward_s[k] for k in g) for g in groups),
        backward_input_s=tuple(_opt_sum(c.backward_input_s[k] for k in g) for g in groups),
        backward_weight_s=tuple(_opt_sum(c.backward_weight_s[k] for k in g) for g in groups),
        transfer_s=tuple(c.transfer_s[g[-1]] for g in groups[:-1]),
        update_s=tuple(sum(c.update_s[k] for k in g) for g in groups),
        overhead_s=None
        if c.overhead_s is None
        else tuple(statistics.fmean(c.overhead_s[k] for k in g) for g in groups),
        stash_bytes=None if c.stash_bytes is None else tuple(sum(c.stash_bytes[k] for k in g) for g in groups),
        assumptions=c.assumptions + (f"stages merged {r} to 1: their passes summed",),
    )


def _split(c: MeasuredCosts, r: int) -> MeasuredCosts:
    inner = statistics.fmean(c.transfer_s) if c.transfer_s else 0.0
    transfer = []
    for k in range(c.num_stages):
        transfer.extend([inner] * (r - 1))
        if k + 1 < c.num_stages:
            transfer.append(c.transfer_s[k])

    def parts(values, scale=True):
        return tuple(v if v is None else (v / r if scale else v) for v in values for _ in range(r))

    return replace(
        c,
        forward_s=parts(c.forward_s),
        backward_s=parts(c.backward_s),
        backward_input_s=parts(c.backward_input_s),
        backward_weight_s=parts(c.backward_weight_s),
        transfer_s=tuple(transfer),
        update_s=parts(c.update_s),
        overhead_s=None if c.overhead_s is None else parts(c.overhead_s, scale=False),
        stash_bytes=None if c.stash_bytes is None else tuple(int(s // r) for s in c.stash_bytes for _ in range(r)),
        assumptions=c.assumptions
        + (
            f"each measured stage split into {r} equal parts; a new boundary inside one costs the mean "
            f"measured transfer ({inner:.3g} s)",
        ),
    )


def stage_costs(costs: MeasuredCosts, *, split_backward: bool = False) -> list[StageCost]:
    """The engine's stage costs reproducing ``costs`` on :func:`measured_hardware`.

    ``split_backward``: the schedule runs I and W apart; a stage measured
    without the split gets half its backward each (listed as an assumption by
    :func:`what_if`)."""
    out = []
    for k in range(costs.num_stages):
        extra = 0.0 if costs.overhead_s is None else costs.overhead_s[k]  # the runtime's own, per pass
        back = costs.backward_s[k] + extra
        bin_, bw_ = costs.backward_input_s[k], costs.backward_weight_s[k]
        if bin_ is None or bw_ is None:
            bin_, bw_ = (back - extra) / 2, (back - extra) / 2
        bin_, bw_ = bin_ + extra, bw_ + extra
        sent = costs.transfer_s[k] if k + 1 < costs.num_stages else 0.0
        stash = 1 if costs.stash_bytes is None else costs.stash_bytes[k]
        out.append(
            StageCost(
                first_layer=k,
                last_layer=k,
                forward_s=costs.forward_s[k] + extra,
                backward_s=bin_ + bw_ if split_backward else back,
                backward_input_s=bin_,
                backward_weight_s=bw_,
                param_bytes=round(costs.update_s[k] * NOMINAL_BANDWIDTH / _SGD_UPDATE_TRAFFIC),
                activation_bytes=round(sent * NOMINAL_BANDWIDTH),
                stash_bytes=stash,
                input_bytes=round(costs.transfer_s[k - 1] * NOMINAL_BANDWIDTH) if k else 0,
            )
        )
    return out


def measured_hardware(devices: int) -> Hardware:
    """``devices`` calibrated devices: unbounded memory, links at
    :data:`NOMINAL_BANDWIDTH` through a switch (a device's sends queue on its
    own port, as a rank's do), no latency, no collective model."""
    return Hardware(
        name="measured",
        device=DeviceSpec(
            # FLOP/s price nothing here: every pass time is a measured one
            name="measured",
            flops=1e12,
            mem_bandwidth=NOMINAL_BANDWIDTH,
            memory_bytes=math.inf,
            dtype_bytes=4,
        ),
        num_devices=devices,
        intra_node=Interconnect(kind="switch", bandwidth=NOMINAL_BANDWIDTH, latency=0.0, label="measured"),
        notes="Calibrated from a measured run (pipesim.sim.planning.whatif): byte counts are measured seconds "
        "times the nominal bandwidth.",
    )


def _uses_split_backward(schedule: Schedule) -> bool:
    return any(a.op is I for prog in schedule.programs for a in prog)


def reconcile(result: SimResult, costs: MeasuredCosts | None = None) -> SimResult:
    """The measured run's own schedule simulated on its own measured costs."""
    costs = costs or measured_costs(result)
    schedule = result.schedule
    return simulate(
        schedule,
        stage_costs(regroup(costs, schedule.num_stages), split_backward=_uses_split_backward(schedule)),
        measured_hardware(schedule.num_devices),
        microbatch_size=costs.microbatch_size,
        meta={"calibrated_from": "measured run"},
    )


@dataclass(frozen=True)
class WhatIf:
    """One strategy at one micro-batch count, on the measured costs."""

    strategy: str
    microbatches: int
    stages: int
    iteration_s: float | None
    samples_per_s: float | None
    bubble_fraction: float | None
    #: most stashed micro-batches (or bytes, with measured stash bytes) on a device
    peak_stash: int | None
    peak_unit: str
    note: str = ""

    def to_json(self) -> dict:
        return {
            "strategy": self.strategy,
            "microbatches": self.microbatches,
            "stages": self.stages,
            "iteration_s": None if self.iteration_s is None else round_sig(self.iteration_s),
            "samples_per_s": None if self.samples_per_s is None else round_sig(self.samples_per_s),
            "bubble_fraction": None if self.bubble_fraction is None else round_sig(self.bubble_fraction),
            "peak_stash": self.peak_stash,
            "peak_unit": self.peak_unit,
            "note": self.note,
        }


#: Iterations each what-if runs: steady state leaves out the first and last.
WHATIF_ITERATIONS = 4


def what_if(
    costs: MeasuredCosts,
    strategies: Sequence[str],
    microbatches: Sequence[int],
    devices: int,
    *,
    iterations: int = WHATIF_ITERATIONS,
) -> list[WhatIf]:
    """Every strategy at every micro-batch count on ``devices`` devices, one
    pipeline, priced with ``costs`` (regrouped to each schedule's stages)."""
    for name in strategies:
        get_strategy(name)  # a one-line StrategyError naming the choices
    if devices < 1:
        raise WhatIfError(f"devices must be >= 1, got {devices}")
    if not microbatches or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in microbatches):
        raise WhatIfError(f"micro-batch counts must be whole numbers >= 1, got {list(microbatches)!r}")
    unit = "bytes" if costs.stash_bytes is not None else "micro-batches"
    out = []
    for name in strategies:
        for m in microbatches:
            out.append(_one(costs, name, m, devices, iterations, unit))
    return out


def _one(costs: MeasuredCosts, name: str, m: int, devices: int, iterations: int, unit: str) -> WhatIf:
    try:
        schedule = build_schedule(ScheduleSpec(name, devices, m, iterations=iterations))
        regrouped = regroup(costs, schedule.num_stages)
    except (StrategyError, InputError) as e:
        return WhatIf(name, m, devices, None, None, None, None, unit, note=f"not simulated: {e}")
    result = simulate(
        schedule,
        stage_costs(regrouped, split_backward=_uses_split_backward(schedule)),
        measured_hardware(schedule.num_devices),
        microbatch_size=costs.microbatch_size,
    )
    rate, _ = steady_state(result)
    per_iteration = m * schedule.num_replicas * costs.microbatch_size
    bubbles = bubble_fractions(result)
    peak = max((t.peak_breakdown.get("activations", 0) for t in result.memory), default=0)
    notes = [a for a in regrouped.assumptions if a not in costs.assumptions]
    if _uses_split_backward(schedule) and any(x is None for x in regrouped.backward_input_s):
        notes.append("the run had no split backward: I and W taken as half the backward each")
    return WhatIf(
        strategy=name,
        microbatches=m,
        stages=schedule.num_stages,
        iteration_s=per_iteration / rate if rate > 0 else None,
        samples_per_s=rate,
        bubble_fraction=sum(bubbles) / len(bubbles) if bubbles else None,
        peak_stash=int(peak),
        peak_unit=unit,
        note="; ".join(notes),
    )

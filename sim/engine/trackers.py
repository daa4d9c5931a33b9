"""Memory, weight versions and staleness, derived from spans and the schedule.

Nothing here runs inside the simulation loop. Which versions a stage must
keep, which micro-batches' activations are stashed and which gradient each
update consumes all follow from the program order of the stage's device,
which the schedule fixes; *when* each of those changes happens comes from the
spans. Keeping the accounting out of the engine means a timeline measured on
real devices is accounted exactly like a simulated one.

Memory of a device, per category (see :data:`~pipesim.sim.engine.results.MEMORY_CATEGORIES`):

* weights: the weights the passes read (``StageCost.weight_bytes``, |W|
  at the profile's :class:`~pipesim.sim.workloads.profile.Precision`) per
  (replica, stage) it hosts, plus that again for every older version still
  awaiting a read (PipeDream stashing, 2BW's shadow copy: a stashed version
  is what a later pass reads, the passes' copy, while the master and the
  optimizer state are updated in place): an update keeps the old version
  alive only if a later pass reads it, and the last such read frees it;
* gradients (``gradient_bytes``) and optimizer state, held throughout: the
  master copy where it is kept apart (``master_copy_bytes``, mixed
  precision's fp32 weights, counted as optimizer state as ZeRO counts it)
  and 1x ``param_bytes`` for SGD momentum, 2x for Adam; and a second
  ``gradient_bytes`` while passes accumulate after a REDUCE_GRAD closed the
  first for an UPDATE still to come (PipeDream-2BW's deferred update);
* activations: a micro-batch's stash from the start of its forward to the
  end of its backward (of W when that micro-batch's backward is split), and
  when it is split, what I leaves for W beyond the stash
  (``StageCost.w_held_bytes``) from the end of I to the end of W; with
  activation recomputation only its layers' inputs until its backward
  starts, and from then on the most its backward holds while it
  rematerialises layer after layer (``StageCost.full_stash_bytes``);
* comm_buffers: a send buffer for the duration of the transfer, a receive
  buffer from the start of the transfer until its consumer starts;
* prediction: one buffer of the passes' weights (``weight_bytes``) for the
  predicted weights of a stage that predicts, since the passes read them;
  averaging: the centre variable on the device of replica 0, at the
  master's width (``param_bytes``), as elastic averaging averages the
  master weights (:class:`~pipesim.sim.engine.core.CostModel`).

Simultaneous changes free before they allocate, as a stream does.
"""

from __future__ import annotations

from collections import defaultdict
from operator import attrgetter

import numpy as np

from pipesim.sim.engine.results import MEMORY_CATEGORIES, MemoryTrack, PassVersions, SimResult
from pipesim.sim.ir.core import (
    AVERAGE,
    COMPUTE_OPS,
    INPUT_GRADIENT_OPS,
    PASS_OPS,
    PREDICT,
    RECV_F,
    REDUCE_GRAD,
    UPDATE,
    WEIGHT_GRADIENT_OPS,
    Action,
    B,
    F,
    I,
    Op,
    Schedule,
    W,
)
from pipesim.sim.ir.dataflow import backward_op, split_stages
from pipesim.sim.workloads.profile import WorkloadError

_CAT = {name: i for i, name in enumerate(MEMORY_CATEGORIES)}


def version_plan(schedule: Schedule) -> tuple[list[PassVersions], dict[tuple[int, int], int], dict]:
    """Static weight-version facts of a schedule.

    Returns the per-(replica, stage, micro-batch) versions, the most versions
    of each (replica, stage) held at once, and for the memory tracker the
    program positions where an extra version is created (at an update) and
    freed (at its last read), and where a second gradient buffer is taken (at
    the first weight-gradient pass after a REDUCE_GRAD, which closed the first
    one for its UPDATE: :mod:`pipesim.sim.ir.core`) and freed (at that UPDATE):
    ``{device: [(position, +1|-1, (replica, stage), "weights"|"gradients")]}``.
    """
    fwd: dict = {}
    bwd: dict = {}
    upd: dict = {}
    held_max: dict[tuple[int, int], int] = {}
    changes: dict[int, list] = defaultdict(list)
    for dev, prog in enumerate(schedule.programs):
        plain = _plain_versions(prog)
        if plain is not None:  # the common program: nothing to track but its passes' versions
            fwd.update(plain[0])
            bwd.update(plain[1])
            upd.update(plain[2])
        else:
            _program_versions(dev, prog, fwd, bwd, upd, held_max, changes)
    for rs in schedule.placement():
        held_max.setdefault(rs, 1)
    versions = []
    # dict order is program order, the same on every run: no sort needed
    for key, (fv, fd) in fwd.items():
        bv, bd = bwd.get(key, (fv, 0))
        versions.append(PassVersions(key[0], key[1], key[2], fv, bv, fd, bd, upd.get(key)))
    return versions, held_max, changes


def _plain_versions(prog) -> tuple[dict, dict, dict] | None:
    """:func:`version_plan`'s facts of a program that keeps no older weight
    version and no second gradient buffer, the common case (every flush
    strategy without replicas): no REDUCE_GRAD, updates that raise the
    version, and every pass and PREDICT reading the version current at that
    point. Then no version is ever extra, and a backward's gradient is
    applied at the next UPDATE of its stage, to the version it read.

    Returns the forward, backward and update versions of its passes, or
    None for a program that is not so plain (:func:`_program_versions`
    handles it). One loop with no per-action bookkeeping: it visits every
    action of every simulation.
    """
    fwd: dict = {}
    bwd: dict = {}
    upd: dict = {}
    current: dict[tuple[int, int], int] = {}
    applying: dict[tuple[int, int], list] = {}  # gradients the next UPDATE applies
    for op, stage, mb, ver, dist, rep in prog:
        if op is F:
            if ver != current.get((rep, stage), 0):
                return None
            fwd[(rep, stage, mb)] = (ver, dist)
        elif op is B or op is I or op is W:
            rs = (rep, stage)
            if ver != current.get(rs, 0):
                return None
            if op is not W:
                bwd[(rep, stage, mb)] = (ver, dist)
            if op is not I:
                grads = applying.get(rs)
                if grads is None:
                    applying[rs] = [mb]
                else:
                    grads.append(mb)
        elif op is UPDATE:
            rs = (rep, stage)
            old = current.get(rs, 0)
            if ver is None or ver <= old:
                return None
            for m in applying.pop(rs, ()):
                upd[(rep, stage, m)] = old
            current[rs] = ver
        elif op is REDUCE_GRAD or (op is PREDICT and ver != current.get((rep, stage), 0)):
            return None
    return fwd, bwd, upd


def _program_versions(dev: int, prog, fwd: dict, bwd: dict, upd: dict, held_max: dict, changes: dict) -> None:
    """:func:`version_plan`'s walk of one program in general: versions kept
    for later reads, second gradient buffers (into ``held_max`` and
    ``changes``), and the passes' versions."""
    reads = PASS_OPS | {PREDICT}
    # Actions are unpacked as (op, stage, microbatch, version, distance,
    # replica) tuples: this visits every action, and a field access costs
    # more than the unpacking.
    last_read = {(rep, stage, ver): pos for pos, (op, stage, _, ver, _, rep) in enumerate(prog) if op in reads}
    last_positions = set(last_read.values())  # cheap first test: most reads are not a last read
    current: dict[tuple[int, int], int] = defaultdict(int)
    extra: dict[tuple[int, int], int] = defaultdict(int)
    awaiting: dict[tuple[int, int], list] = defaultdict(list)  # gradients not yet applied
    closed: dict[tuple[int, int], list] = {}  # what a REDUCE_GRAD closed for the next UPDATE
    second: set[tuple[int, int]] = set()  # accumulating into a second buffer meanwhile
    for pos, (op, stage, mb, ver, dist, rep) in enumerate(prog):
        if op is REDUCE_GRAD:
            closed[(rep, stage)] = awaiting.pop((rep, stage), [])
            continue
        if op is UPDATE:
            rs = (rep, stage)
            for m in closed.pop(rs) if rs in closed else awaiting.pop(rs, ()):
                upd[(rep, stage, m)] = current[rs]
            if rs in second:  # the closed buffer is applied: the second one is the only one again
                second.discard(rs)
                changes[dev].append((pos, -1, rs, "gradients"))
            old = current[rs]
            current[rs] = ver
            if last_read.get((rep, stage, old), -1) > pos:
                extra[rs] += 1
                changes[dev].append((pos, +1, rs, "weights"))
                held_max[rs] = max(held_max.get(rs, 1), 1 + extra[rs])
            continue
        if op is F:
            fwd[(rep, stage, mb)] = (ver, dist)
        elif op in INPUT_GRADIENT_OPS:  # the backward's read: B, or I when split
            bwd[(rep, stage, mb)] = (ver, dist)
        if op in WEIGHT_GRADIENT_OPS:  # the gradient the next UPDATE consumes: B, or W when split
            awaiting[(rep, stage)].append(mb)
            if closed and (rep, stage) in closed and (rep, stage) not in second:
                second.add((rep, stage))
                changes[dev].append((pos, +1, (rep, stage), "gradients"))
        if pos in last_positions:
            rs = (rep, stage)
            if ver < current[rs]:  # the last read of an older version frees it
                extra[rs] -= 1
                changes[dev].append((pos, -1, rs, "weights"))


def track(result: SimResult, stage_costs, hardware, *, optimizer: str = "sgd") -> None:
    """Fill ``result.memory``, ``result.versions`` and ``result.max_versions_held``."""
    schedule = result.schedule
    versions, held_max, changes = version_plan(schedule)
    result.versions = versions
    result.max_versions_held = dict(sorted(held_max.items()))
    result.memory = memory_tracks(result, stage_costs, hardware.device.memory_bytes, changes, optimizer)


def _may_overflow(deltas: np.ndarray) -> bool:
    """Whether some memory level could pass int64's range: every level is a
    partial sum of the deltas, so their absolute sum bounds them all (a cheap
    test that real sizes never fail; profiles keep single sizes below 2**53)."""
    return float(np.abs(deltas).sum(dtype=np.float64)) >= 2.0**62


def _check_levels(deltas: np.ndarray, device: int) -> None:
    """Refuse a device whose memory int64 cannot count, before cumsum wraps it
    to a negative peak (GPipe with m = 1024 and a 2**53-byte stash)."""
    levels = np.abs(np.cumsum(deltas, axis=0, dtype=np.float64)).sum(axis=1)
    if levels.max(initial=0.0) >= 2.0**62:
        raise WorkloadError(
            f"memory accounting overflows on device {device}: it would hold {levels.max():.3g} bytes, beyond "
            "2**62; param_bytes, stash_bytes or activation_bytes are too large for this schedule"
        )


def memory_tracks(result: SimResult, stage_costs, capacity: float, changes, optimizer: str) -> list[MemoryTrack]:
    """Per-device memory over time: every allocation and free as an event,
    accumulated per device and category (:func:`_tracks`)."""
    events = _Events()
    bounds = result.span_bounds()
    t0 = bounds[0] if bounds is not None else 0.0
    _resident_state(events, result.schedule, stage_costs, optimizer, t0)
    _extra_versions(events, result, stage_costs, changes)
    _activations(events, result, stage_costs)
    _comm_buffers(events, result)
    return _tracks(events, result.schedule.num_devices, capacity)


#: Span fields read in bulk (``map`` over a C getter, not a comprehension per field).
_DEVICE, _START, _END = attrgetter("device"), attrgetter("start"), attrgetter("end")
_OP, _STAGE = attrgetter("action.op"), attrgetter("action.stage")
#: Each op's number in the op column of :func:`_activations`.
_OP_CODE = {op: code for code, op in enumerate(Op)}


class _Events:
    """Memory changes (device, time, bytes, category), gathered in bulk as
    columns, one chunk per call: a large simulation has a few hundred
    thousand, most of them added as numpy arrays."""

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []

    def add(self, devs, times, deltas, cat: str) -> None:
        """Append changes; each argument is a sequence or array, one item per change."""
        self.chunks.append(
            (
                np.asarray(devs, dtype=np.int64),
                np.asarray(times, dtype=float),
                np.asarray(deltas, dtype=np.int64),
                _CAT[cat],
            )
        )

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Device, time, bytes and category of every change, in the order added."""
        if not self.chunks:
            return (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        devs, times, deltas, cats = zip(*self.chunks)
        return (
            np.concatenate(devs),
            np.concatenate(times),
            np.concatenate(deltas),
            np.repeat(np.asarray(cats, dtype=np.int64), [len(d) for d in devs]),
        )


def _resident_state(events: _Events, schedule: Schedule, stage_costs, optimizer: str, t0: float) -> None:
    """What every (replica, stage) holds from the start: one version of its
    weights, their gradients and optimizer state, a prediction buffer if it
    predicts, and the averaging centre on replica 0's device."""
    opt_mult = 2 if optimizer == "adam" else 1
    predicting = {(a.replica, a.stage) for p in schedule.programs for a in p if a.op is PREDICT}
    averaging = {a.stage for p in schedule.programs for a in p if a.op is AVERAGE}
    for (rep, stage), dev in sorted(schedule.placement().items()):
        c = stage_costs[stage]
        events.add([dev], [t0], [c.weight_bytes], "weights")
        events.add([dev], [t0], [c.gradient_bytes], "gradients")
        events.add([dev], [t0], [c.master_copy_bytes + opt_mult * c.param_bytes], "optimizer")
        if (rep, stage) in predicting:
            events.add([dev], [t0], [c.weight_bytes], "prediction")
        if rep == 0 and stage in averaging:
            events.add([dev], [t0], [c.param_bytes], "averaging")


#: The size of an extra weight version (the passes' copy) and of a second gradient buffer.
_VERSION_BYTES = {"weights": "weight_bytes", "gradients": "gradient_bytes"}


def _extra_versions(events: _Events, result: SimResult, stage_costs, changes: dict) -> None:
    """Older weight versions kept for a later read and second gradient
    buffers (``version_plan``'s changes), timed by the compute action at
    that position: its end, but the start of the pass that first needs a
    second gradient buffer."""
    by_dev: dict[int, list] = defaultdict(list)
    for s in result.by_stream()["compute"]:
        by_dev[s.device].append(s)
    for dev, prog in enumerate(result.schedule.programs):
        positions = [pos for pos, a in enumerate(prog) if a.op in COMPUTE_OPS]
        dev_spans = by_dev.get(dev, [])
        if len(dev_spans) != len(positions):
            raise ValueError(f"device {dev}: {len(dev_spans)} compute spans for {len(positions)} compute actions")
        if dev in changes:
            at = dict(zip(positions, dev_spans, strict=True))
            for cat in ("weights", "gradients"):
                rows = [r for r in changes[dev] if r[3] == cat]
                if rows:
                    events.add(
                        [dev] * len(rows),
                        [at[pos].start if cat == "gradients" and d > 0 else at[pos].end for pos, d, _, _ in rows],
                        [d * getattr(stage_costs[rs[1]], _VERSION_BYTES[cat]) for _, d, rs, _ in rows],
                        cat,
                    )


def _activations(events: _Events, result: SimResult, stage_costs) -> None:
    """A micro-batch's stash, from the start of its forward to the end of the
    backward that makes its weight gradient (B, or W when split). With
    activation recomputation (``StageCost.recompute``) only its layers'
    inputs from the forward on (``held_bytes``), and from the start of its
    backward (B, or I when split), which recomputes it, the most that
    backward holds (``full_stash_bytes``).

    The compute spans are read once into columns and filtered with numpy:
    per-span filters and field reads cost more than the arithmetic."""
    compute = result.by_stream()["compute"]
    n = len(compute)
    dev = np.fromiter(map(_DEVICE, compute), np.int64, n)
    start = np.fromiter(map(_START, compute), float, n)
    end = np.fromiter(map(_END, compute), float, n)
    op = np.fromiter(map(_OP_CODE.__getitem__, map(_OP, compute)), np.int64, n)
    stage = np.fromiter(map(_STAGE, compute), np.int64, n)
    held = np.asarray([c.held_bytes for c in stage_costs], dtype=np.int64)
    fwd = op == _OP_CODE[F]
    events.add(dev[fwd], start[fwd], held[stage[fwd]], "activations")
    if any(c.recompute for c in stage_costs):
        # per stage, in Python numbers as they come, then as bytes
        grows = np.asarray([c.full_stash_bytes > c.held_bytes for c in stage_costs], dtype=bool)
        growth = np.asarray([c.full_stash_bytes - c.held_bytes for c in stage_costs], dtype=np.int64)
        again = np.isin(op, [_OP_CODE[o] for o in INPUT_GRADIENT_OPS]) & grows[stage]
        events.add(dev[again], start[again], growth[stage[again]], "activations")
    freed_bytes = np.asarray([-c.full_stash_bytes for c in stage_costs], dtype=np.int64)
    freed = np.isin(op, [_OP_CODE[o] for o in WEIGHT_GRADIENT_OPS])
    events.add(dev[freed], end[freed], freed_bytes[stage[freed]], "activations")
    w_held = np.asarray([c.w_held_bytes for c in stage_costs], dtype=np.int64)
    if w_held.any():  # a split backward: what I leaves for W, from I's end to W's
        after_i, after_w = (op == _OP_CODE[I]) & (w_held[stage] > 0), (op == _OP_CODE[W]) & (w_held[stage] > 0)
        events.add(dev[after_i], end[after_i], w_held[stage[after_i]], "activations")
        events.add(dev[after_w], end[after_w], -w_held[stage[after_w]], "activations")


def activation_peaks(result: SimResult) -> list[int]:
    """Per device, the most bytes of activations it holds at once: the peak
    of the ``activations`` memory category alone (the events of
    :func:`_activations`), which is not the activations at the device's
    total peak (summary.json's breakdown)."""
    events = _Events()
    _activations(events, result, result.stage_costs)
    # only activations were added, so each device's total is its activations
    return [int(t.peak_bytes) for t in _tracks(events, result.schedule.num_devices, float("inf"))]


def _comm_buffers(events: _Events, result: SimResult) -> None:
    """A send buffer for the transfer's duration; a receive buffer from the
    start of the transfer until the pass that consumes it starts."""
    by_stream = result.by_stream()
    sends = [s for s in by_stream["send"] if s.nbytes]
    events.add([s.device for s in sends], [s.start for s in sends], [s.nbytes for s in sends], "comm_buffers")
    events.add([s.device for s in sends], [s.end for s in sends], [-s.nbytes for s in sends], "comm_buffers")
    recvs = [s for s in by_stream["recv"] if s.nbytes]
    if not recvs:
        return
    split = split_stages(result.schedule)
    started = {
        (s.action.op, s.action.replica, s.action.stage, s.action.microbatch): s.start
        for s in by_stream["compute"]
        if s.action.op in PASS_OPS
    }

    def consumer(a: Action) -> tuple:
        op = F if a.op is RECV_F else backward_op(split, a.replica, a.stage, a.microbatch)
        return (op, a.replica, a.stage, a.microbatch)

    events.add([s.device for s in recvs], [s.start for s in recvs], [s.nbytes for s in recvs], "comm_buffers")
    events.add(
        [s.device for s in recvs],
        [max(started.get(consumer(s.action), s.end), s.end) for s in recvs],
        [-s.nbytes for s in recvs],
        "comm_buffers",
    )


def _tracks(events: _Events, num_devices: int, capacity: float) -> list[MemoryTrack]:
    """Accumulate the events per device and category, in time order (frees
    before allocations at equal times, as a stream does), with numpy."""
    dev_a, t_a, d_a, c_a = events.columns()  # each delta <= 4 * 2**53 (see pipesim.sim.limits.MAX_BYTES)
    risky = _may_overflow(d_a)
    # By device, then time; frees before allocations at equal times; then
    # recording order (lexsort is stable).
    order = np.lexsort((d_a > 0, t_a, dev_a))
    dev_a, t_a, d_a, c_a = dev_a[order], t_a[order], d_a[order], c_a[order]
    bounds = np.searchsorted(dev_a, np.arange(num_devices + 1))
    tracks = []
    for dev in range(num_devices):
        track_ = MemoryTrack(device=dev, capacity_bytes=capacity)
        lo, hi = bounds[dev], bounds[dev + 1]
        if hi > lo:
            deltas = np.zeros((hi - lo, len(MEMORY_CATEGORIES)), dtype=np.int64)
            deltas[np.arange(hi - lo), c_a[lo:hi]] = d_a[lo:hi]
            if risky:
                _check_levels(deltas, dev)
            levels = np.cumsum(deltas, axis=0)
            totals = levels.sum(axis=1)
            times = t_a[lo:hi]
            peak = int(np.argmax(totals))
            last = np.r_[times[1:] != times[:-1], True]  # level after the last change at each time
            track_.times = times[last].tolist()
            track_.totals = totals[last].tolist()
            track_.peak_bytes = int(totals[peak])
            track_.peak_time = float(times[peak])
            track_.peak_breakdown = {name: int(levels[peak, i]) for i, name in enumerate(MEMORY_CATEGORIES)}
        else:
            track_.peak_breakdown = {name: 0 for name in MEMORY_CATEGORIES}
        tracks.append(track_)
    return tracks

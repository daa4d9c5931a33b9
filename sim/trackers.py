"""Memory, weight versions and staleness, derived from spans and the schedule.

Nothing here runs inside the simulation loop. Which versions a stage must
keep, which micro-batches' activations are stashed and which gradient each
update consumes all follow from the program order of the stage's device,
which the schedule fixes; *when* each of those changes happens comes from the
spans. Keeping the accounting out of the engine means a timeline measured on
real devices is accounted exactly like a simulated one.

Memory of a device, per category (see :data:`~pipesim.sim.results.MEMORY_CATEGORIES`):

* weights: |W| per (replica, stage) it hosts, plus |W| for every older
  version still awaiting a read (PipeDream stashing, 2BW's shadow copy): an
  update keeps the old version alive only if a later pass reads it, and the
  last such read frees it;
* gradients |W| and optimizer state (1x for SGD momentum, 2x for Adam), held
  throughout;
* activations: a micro-batch's stash from the start of its forward to the
  end of its backward (of W when the backward is split);
* comm_buffers: a send buffer for the duration of the transfer, a receive
  buffer from the start of the transfer until its consumer starts;
* prediction: one |W| buffer for the predicted weights of a stage that
  predicts; averaging: the centre variable (|W|) on the device of replica 0.

Simultaneous changes free before they allocate, as a stream does.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from pipesim.sim.dataflow import bare
from pipesim.sim.ir import (
    AVERAGE,
    COMPUTE_OPS,
    PASS_OPS,
    PREDICT,
    RECV_F,
    UPDATE,
    B,
    F,
    I,
    Schedule,
    W,
)
from pipesim.sim.results import MEMORY_CATEGORIES, MemoryTrack, PassVersions, SimResult

_CAT = {name: i for i, name in enumerate(MEMORY_CATEGORIES)}


def version_plan(schedule: Schedule) -> tuple[list[PassVersions], dict[tuple[int, int], int], dict]:
    """Static weight-version facts of a schedule.

    Returns the per-(replica, stage, micro-batch) versions, the most versions
    of each (replica, stage) held at once, and for the memory tracker the
    program positions where an extra version is created (at an update) and
    freed (at its last read): ``{device: [(position, +1|-1, (replica, stage))]}``.
    """
    fwd: dict = {}
    bwd: dict = {}
    upd: dict = {}
    held_max: dict[tuple[int, int], int] = {}
    changes: dict[int, list] = defaultdict(list)
    split = {(a.replica, a.stage) for prog in schedule.programs for a in prog if a.op is I}
    for dev, prog in enumerate(schedule.programs):
        last_read: dict[tuple, int] = {}
        for pos, a in enumerate(prog):
            if (a.op in PASS_OPS or a.op is PREDICT) and a.version is not None:
                last_read[(a.replica, a.stage, a.version)] = pos
        current: dict[tuple[int, int], int] = defaultdict(int)
        extra: dict[tuple[int, int], int] = defaultdict(int)
        awaiting: dict[tuple[int, int], list] = defaultdict(list)  # gradients not yet applied
        for pos, a in enumerate(prog):
            rs = (a.replica, a.stage)
            held_max.setdefault(rs, 1)
            op = a.op
            if op is F:
                fwd[(a.replica, a.stage, a.microbatch)] = (a.version, a.distance)
            elif op is B or op is I:
                bwd[(a.replica, a.stage, a.microbatch)] = (a.version, a.distance)
            if (op is B and rs not in split) or op is W:
                awaiting[rs].append(a.microbatch)
            if op is UPDATE:
                for mb in awaiting.pop(rs, ()):
                    upd[(a.replica, a.stage, mb)] = current[rs]
                old = current[rs]
                current[rs] = a.version
                if last_read.get((a.replica, a.stage, old), -1) > pos:
                    extra[rs] += 1
                    changes[dev].append((pos, +1, rs))
                    held_max[rs] = max(held_max[rs], 1 + extra[rs])
            elif (op in PASS_OPS or op is PREDICT) and a.version is not None:
                v = a.version
                if v < current[rs] and last_read.get((a.replica, a.stage, v)) == pos:
                    extra[rs] -= 1
                    changes[dev].append((pos, -1, rs))
    versions = []
    for key in sorted(fwd):
        fv, fd = fwd[key]
        bv, bd = bwd.get(key, (fv, 0))
        versions.append(PassVersions(key[0], key[1], key[2], fv, bv, fd, bd, upd.get(key)))
    return versions, held_max, changes


def track(result: SimResult, stage_costs, hardware, *, optimizer: str = "sgd") -> None:
    """Fill ``result.memory``, ``result.versions`` and ``result.max_versions_held``."""
    schedule = result.schedule
    versions, held_max, changes = version_plan(schedule)
    result.versions = versions
    result.max_versions_held = dict(sorted(held_max.items()))
    result.memory = memory_tracks(result, stage_costs, hardware.device.memory_bytes, changes, optimizer)


def memory_tracks(result: SimResult, stage_costs, capacity: float, changes, optimizer: str) -> list[MemoryTrack]:
    schedule = result.schedule
    placement = schedule.placement()
    opt_mult = 2 if optimizer == "adam" else 1
    t0 = min((s.start for s in result.spans), default=0.0)
    per_dev: dict[int, list] = defaultdict(list)  # (time, delta, seq, category)
    seq = 0

    def add(dev: int, t: float, cat: str, delta: int) -> None:
        nonlocal seq
        if delta:
            per_dev[dev].append((t, delta, seq, _CAT[cat]))
            seq += 1

    predicting = {(a.replica, a.stage) for p in schedule.programs for a in p if a.op is PREDICT}
    averaging = {a.stage for p in schedule.programs for a in p if a.op is AVERAGE}
    for (rep, stage), dev in sorted(placement.items()):
        w = stage_costs[stage].param_bytes
        add(dev, t0, "weights", w)
        add(dev, t0, "gradients", w)
        add(dev, t0, "optimizer", opt_mult * w)
        if (rep, stage) in predicting:
            add(dev, t0, "prediction", w)
        if rep == 0 and stage in averaging:
            add(dev, t0, "averaging", w)

    split = {(a.replica, a.stage) for prog in schedule.programs for a in prog if a.op is I}
    compute_spans: dict[int, list] = defaultdict(list)
    for s in result.spans:
        if s.stream == "compute":
            compute_spans[s.device].append(s)
    consumer_start: dict[tuple, float] = {}
    for dev, prog in enumerate(schedule.programs):
        spans = compute_spans.get(dev, [])
        compute_actions = [a for a in prog if a.op in COMPUTE_OPS]
        if len(spans) != len(compute_actions):
            raise ValueError(f"device {dev}: {len(spans)} compute spans for {len(compute_actions)} compute actions")
        pos_to_span = {}
        ci = 0
        for pos, a in enumerate(prog):
            if a.op in COMPUTE_OPS:
                pos_to_span[pos] = spans[ci]
                ci += 1
        for pos, delta, (rep, stage) in changes.get(dev, ()):
            add(dev, pos_to_span[pos].end, "weights", delta * stage_costs[stage].param_bytes)
        for span in spans:
            a = span.action
            op = a.op
            if op in PASS_OPS:
                consumer_start[bare(a)] = span.start
            stash = stage_costs[a.stage].stash_bytes
            if op is F:
                add(dev, span.start, "activations", stash)
            elif (op is B and (a.replica, a.stage) not in split) or op is W:
                add(dev, span.end, "activations", -stash)

    for s in result.spans:
        if s.stream == "send":
            add(s.device, s.start, "comm_buffers", s.nbytes)
            add(s.device, s.end, "comm_buffers", -s.nbytes)
        elif s.stream == "recv":
            a = s.action
            if a.op is RECV_F:
                consumer = (F, a.replica, a.stage, a.microbatch)
            else:
                consumer = (I if (a.replica, a.stage) in split else B, a.replica, a.stage, a.microbatch)
            add(s.device, s.start, "comm_buffers", s.nbytes)
            add(s.device, max(consumer_start.get(consumer, s.end), s.end), "comm_buffers", -s.nbytes)

    tracks = []
    for dev in range(schedule.num_devices):
        track_ = MemoryTrack(device=dev, capacity_bytes=capacity)
        events = per_dev.get(dev)
        if events:
            # Frees before allocations at equal times, then in recording order.
            events.sort(key=lambda e: (e[0], e[1] > 0, e[2]))
            times = np.fromiter((e[0] for e in events), dtype=float, count=len(events))
            deltas = np.zeros((len(events), len(MEMORY_CATEGORIES)), dtype=np.int64)
            deltas[np.arange(len(events)), [e[3] for e in events]] = [e[1] for e in events]
            levels = np.cumsum(deltas, axis=0)
            totals = levels.sum(axis=1)
            peak = int(np.argmax(totals))
            # Step samples: the level after the last change at each time.
            last = np.r_[times[1:] != times[:-1], True]
            track_.times = times[last].tolist()
            track_.totals = totals[last].astype(int).tolist()
            track_.peak_bytes = int(totals[peak])
            track_.peak_time = float(times[peak])
            track_.peak_breakdown = {name: int(levels[peak, i]) for i, name in enumerate(MEMORY_CATEGORIES)}
        else:
            track_.peak_breakdown = {name: 0 for name in MEMORY_CATEGORIES}
        tracks.append(track_)
    return tracks

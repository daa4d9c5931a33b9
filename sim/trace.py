"""Chrome trace event JSON for a :class:`~pipesim.sim.results.SimResult`.

The output opens in Perfetto (https://ui.perfetto.dev) and chrome://tracing,
in the same format torch.profiler writes (see ``docs/semantics.md``, "Trace
format"):

* one **process** per device (``pid`` = device, named ``"device N"`` and
  sorted by N through ``ph: "M"`` metadata events);
* one **thread** per stream of that device, in the fixed order compute, send,
  recv, collective (``tid`` 1, 2, ...). A stream whose spans overlap (several
  transfers in flight at once) is spread over extra lanes named ``"send 1"``,
  ``"send 2"``, ... placed right after the stream's first lane, so that no two
  slices on one track ever overlap and the track nests trivially;
* one complete event (``ph: "X"``) per span: ``name`` is the action spelling
  (``"1F3@v0"``), ``cat`` the op type (``"F"``, ``"SEND_F"``, ...), ``ts`` and
  ``dur`` in microseconds with nanosecond resolution, ``args`` holding stage,
  replica, distance, bytes and, when they apply, micro-batch, version and
  peer device;
* a flow arrow (``ph: "s"`` at the send, ``ph: "f"`` with ``"bp": "e"`` at the
  receive, same ``id``, ``cat`` and ``name``) for every send/receive pair that
  shares a ``flow`` id; both ends sit at the middle of their slice so viewers
  bind them to it;
* a counter (``ph: "C"``, name ``"memory"``, ``args {"bytes": ...}``) per
  device from its :class:`~pipesim.sim.results.MemoryTrack`.

Times are the executor's own clock (simulated seconds from 0 for the engine),
converted to integer nanoseconds before anything else, so slice boundaries
that coincide in the result coincide in the trace and rounding can never make
two slices on a track overlap. The same result always serialises to the same
bytes: events are emitted in a fixed order and keys are sorted.

Pure Python: no numpy, torch or plotly needed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from pipesim.sim.ir import Op
from pipesim.sim.results import STREAMS, SimResult, Span

#: Flow arrows are v1 flow events; Perfetto matches them by (cat, name, id).
FLOW_CAT = "transfer"

_SEND_OPS = frozenset({Op.SEND_F, Op.SEND_B})
_RECV_OPS = frozenset({Op.RECV_F, Op.RECV_B})


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _us(ns: int) -> float | int:
    """Microseconds from nanoseconds; whole values stay ints for compact JSON."""
    if ns % 1000 == 0:
        return ns // 1000
    return ns / 1000


def _jsonable(v):
    """Deterministic, JSON-safe copy of provenance values."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            return None
        return float(f"{v:.12g}")
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted((_jsonable(x) for x in v), key=repr)
    if hasattr(v, "item") and callable(v.item):  # numpy scalars
        try:
            return _jsonable(v.item())
        except (TypeError, ValueError):
            pass
    return str(v)


def _stream_key(stream: str) -> tuple[int, str]:
    try:
        return (STREAMS.index(stream), "")
    except ValueError:
        return (len(STREAMS), stream)


def assign_lanes(intervals: Iterable[tuple[int, int]]) -> list[int]:
    """Lane of each ``(start, end)`` interval so that no lane holds two
    overlapping intervals (touching ends are fine).

    Intervals are taken in (start, end, input position) order and each goes to
    the lowest-numbered lane that is free at its start: deterministic, and it
    uses as many lanes as the most intervals open at one instant.
    """
    items = list(intervals)
    order = sorted(range(len(items)), key=lambda i: (items[i][0], items[i][1], i))
    lane_end: list[int] = []
    lanes = [0] * len(items)
    for i in order:
        start, end = items[i]
        for lane, last in enumerate(lane_end):
            if last <= start:
                break
        else:
            lane = len(lane_end)
            lane_end.append(end)
        lane_end[lane] = end
        lanes[i] = lane
    return lanes


def _lane_name(stream: str, lane: int) -> str:
    return stream if lane == 0 else f"{stream} {lane}"


def _span_args(span: Span) -> dict:
    a = span.action
    args: dict[str, object] = {
        "stage": a.stage,
        "replica": a.replica,
        "distance": a.distance,
        "bytes": int(span.nbytes),
    }
    if a.microbatch is not None:
        args["microbatch"] = a.microbatch
    if a.version is not None:
        args["version"] = a.version
    if span.peer is not None:
        args["peer"] = span.peer
    if span.flow is not None:
        args["flow"] = span.flow
    return args


def chrome_trace(result: SimResult) -> dict:
    """The Chrome trace event document for ``result`` (see the module doc)."""
    spans = result.spans
    devices = set(range(result.schedule.num_devices))
    devices.update(s.device for s in spans)
    devices.update(m.device for m in result.memory)

    times = [(_ns(s.start), _ns(s.end)) for s in spans]

    # Lanes per (device, stream): spread overlapping slices over extra tids.
    by_track: dict[tuple[int, str], list[int]] = defaultdict(list)
    for idx, s in enumerate(spans):
        by_track[(s.device, s.stream)].append(idx)
    lane_of = [0] * len(spans)
    lanes_used: dict[tuple[int, str], int] = {}
    for track, idxs in by_track.items():
        lanes = assign_lanes(times[i] for i in idxs)
        for i, lane in zip(idxs, lanes, strict=True):
            lane_of[i] = lane
        lanes_used[track] = max(lanes) + 1

    # tids per device: every known stream always gets lane 0, in STREAMS order.
    tid_of: dict[tuple[int, str, int], int] = {}
    meta: list[dict] = []
    for dev in sorted(devices):
        meta.append({"ph": "M", "pid": dev, "tid": 0, "name": "process_name",
                     "args": {"name": f"device {dev}"}})
        meta.append({"ph": "M", "pid": dev, "tid": 0, "name": "process_sort_index",
                     "args": {"sort_index": dev}})
        streams = set(STREAMS) | {st for (d, st) in lanes_used if d == dev}
        tid = 0
        for stream in sorted(streams, key=_stream_key):
            for lane in range(lanes_used.get((dev, stream), 1)):
                tid += 1
                tid_of[(dev, stream, lane)] = tid
                meta.append({"ph": "M", "pid": dev, "tid": tid, "name": "thread_name",
                             "args": {"name": _lane_name(stream, lane)}})
                meta.append({"ph": "M", "pid": dev, "tid": tid, "name": "thread_sort_index",
                             "args": {"sort_index": tid}})

    slices: list[tuple[tuple, dict]] = []
    for idx, s in enumerate(spans):
        start, end = times[idx]
        tid = tid_of[(s.device, s.stream, lane_of[idx])]
        ev = {
            "ph": "X",
            "pid": s.device,
            "tid": tid,
            "ts": _us(start),
            "dur": _us(end - start),
            "name": str(s.action),
            "cat": s.action.op.value,
            "args": _span_args(s),
        }
        slices.append(((s.device, tid, start, -(end - start), ev["name"], idx), ev))
    slices.sort(key=lambda t: t[0])

    # Flow arrows: one send span and one recv span sharing a flow id.
    ends: dict[int, dict[str, list[int]]] = defaultdict(lambda: {"s": [], "f": []})
    for idx, s in enumerate(spans):
        if s.flow is None:
            continue
        if s.action.op in _SEND_OPS or (s.stream == "send" and s.action.op not in _RECV_OPS):
            ends[s.flow]["s"].append(idx)
        elif s.action.op in _RECV_OPS or s.stream == "recv":
            ends[s.flow]["f"].append(idx)
    flows: list[dict] = []
    for flow_id in sorted(ends):
        pair = ends[flow_id]
        if len(pair["s"]) != 1 or len(pair["f"]) != 1:
            continue
        si, ri = pair["s"][0], pair["f"][0]
        name = spans[si].action.op.value
        for ph, i in (("s", si), ("f", ri)):
            start, end = times[i]
            ev = {
                "ph": ph,
                "id": flow_id,
                "pid": spans[i].device,
                "tid": tid_of[(spans[i].device, spans[i].stream, lane_of[i])],
                "ts": _us(start + (end - start) // 2),
                "cat": FLOW_CAT,
                "name": name,
            }
            if ph == "f":
                ev["bp"] = "e"
            flows.append(ev)

    counters: list[dict] = []
    for track in sorted(result.memory, key=lambda m: m.device):
        for t, total in zip(track.times, track.totals, strict=False):
            counters.append({"ph": "C", "pid": track.device, "tid": 0, "ts": _us(_ns(t)),
                             "name": "memory", "args": {"bytes": int(total)}})

    sched = result.schedule
    other = {
        "generator": "pipesim",
        "strategy": sched.strategy,
        "num_stages": sched.num_stages,
        "num_microbatches": sched.num_microbatches,
        "num_iterations": sched.num_iterations,
        "num_replicas": sched.num_replicas,
        "num_devices": sched.num_devices,
        "makespan_s": _jsonable(float(result.makespan)),
        "microbatch_size": result.microbatch_size,
        "options": _jsonable(dict(sched.options)),
        "meta": _jsonable(dict(result.meta)),
        "memory_capacity_bytes": {
            str(m.device): _jsonable(float(m.capacity_bytes)) for m in sorted(result.memory, key=lambda m: m.device)
        },
        "peak_memory_bytes": {str(m.device): int(m.peak_bytes) for m in sorted(result.memory, key=lambda m: m.device)},
    }
    return {
        "traceEvents": meta + [ev for _, ev in slices] + flows + counters,
        "displayTimeUnit": "ms",
        "otherData": other,
    }


def dumps(trace: dict) -> str:
    """Canonical text of a trace document: sorted keys, compact separators,
    one event per line so diffs stay readable, trailing newline."""
    events = trace.get("traceEvents", [])
    head = {k: v for k, v in trace.items() if k != "traceEvents"}
    enc = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)
    body = ",\n".join(map(enc.encode, events))
    rest = enc.encode(head)[1:-1]
    text = '{"traceEvents":[\n' + body + "\n]"
    if rest:
        text += "," + rest
    return text + "}\n"


def write_trace(result: SimResult, path: str | Path) -> Path:
    """Write ``chrome_trace(result)`` to ``path`` (byte-identical for the same
    result) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(chrome_trace(result)), encoding="utf-8")
    return path

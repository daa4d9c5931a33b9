"""Chrome trace event JSON for a :class:`~pipesim.sim.engine.results.SimResult`.

The output opens in Perfetto (https://ui.perfetto.dev) and chrome://tracing,
in the same format torch.profiler writes (see ``docs/how-to/simulate-and-compare.md``,
"trace.json"):

* one **process** per device (``pid`` = device, named ``"device N"`` and
  sorted by N through ``ph: "M"`` metadata events);
* one **thread** per stream of that device, in the fixed order compute, send,
  recv, collective (``tid`` 1, 2, ...). A stream whose spans overlap (several
  transfers in flight at once) is spread over extra lanes named ``"send 1"``,
  ``"send 2"``, ... placed right after the stream's first lane, so that no two
  slices on one track ever overlap and the track nests trivially;
* one complete event (``ph: "X"``) per span: ``name`` is the action spelling
  (``"1F3@v0"``), ``cat`` the op type (``"F"``, ``"SEND_F"``, ...), ``ts`` and
  ``dur`` in microseconds with nanosecond resolution. The name already spells
  stage, micro-batch, replica, weight version and prediction distance and the
  track names the device, so ``args`` holds only what nothing else shows: the
  bytes moved (left out when 0) and the peer device of a transfer; a span with
  neither has no ``args``. Leaving out what the name and track already say
  cuts the file by a third (97 to 67 MB for 1F1B with p = 64, m = 1,024);
* a flow arrow (``ph: "s"`` at the send, ``ph: "f"`` with ``"bp": "e"`` at the
  receive, same ``id``, ``cat`` and ``name``) for every send/receive pair that
  shares a ``flow`` id; both ends sit at the middle of their slice so viewers
  bind them to it (the arrow carries the id, so the slices do not repeat it);
* a counter (``ph: "C"``, name ``"memory"``, ``args {"bytes": ...}``) per
  device from its :class:`~pipesim.sim.engine.results.MemoryTrack`.

Times are the executor's own clock (simulated seconds from 0 for the engine),
converted to integer nanoseconds before anything else, so slice boundaries
that coincide in the result coincide in the trace and rounding can never make
two slices on a track overlap. The same result always serialises to the same
bytes: events are emitted in a fixed order and keys are sorted.

:func:`write_trace` formats the events by hand and streams them to the file
(hundreds of thousands of spans take about a second); it writes exactly
``dumps(chrome_trace(result))``, which stays the reference.

Pure Python: no numpy, torch or plotly needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from itertools import groupby, islice
from operator import itemgetter
from pathlib import Path

from pipesim.sim._gc import gc_paused
from pipesim.sim.engine.results import STREAMS, SimResult, Span
from pipesim.sim.ir.core import Action, Op

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


#: ``op.value`` per op: ``Enum.value`` is a slow descriptor, while ops hash as
#: their str, so this is one C-speed lookup.
_OP_VALUE: dict[object, str] = {op: op.value for op in Op}
#: JSON text of each op value (all from the alphabet [A-Z_]).
_OP_JSON: dict[object, str] = {op: json.dumps(v) for op, v in _OP_VALUE.items()}
_FLOW_CAT_JSON = json.dumps(FLOW_CAT)
#: Text of a complete event from its category to its duration.
_CAT_DUR: dict[object, str] = {op: f'"cat":{cat},"dur":' for op, cat in _OP_JSON.items()}


def _op_value(op) -> str:
    v = _OP_VALUE.get(op)
    return op.value if v is None else v


def _span_args(span: Span) -> dict:
    """What a slice shows beyond its name, category and track (see the
    module doc): bytes moved, unless 0, and the peer device."""
    args: dict[str, object] = {}
    nbytes = int(span.nbytes)
    if nbytes:
        args["bytes"] = nbytes
    if span.peer is not None:
        args["peer"] = span.peer
    return args


class _Fallback(Exception):
    """A value the fast writer does not format by hand (see :func:`write_trace`)."""


def _action_name(a) -> str:
    """``str(a)``: :func:`~pipesim.sim.ir.core.format_action`, inlined for actions."""
    if type(a) is Action and (v := _OP_VALUE.get(a[0])) is not None:
        _, stage, mb, ver, dist, rep = a
        name = f"{stage}{v}" if mb is None else f"{stage}{v}{mb!s}"
        if rep:
            name = f"r{rep}.{name}"
        if ver is not None:
            name = f"{name}@v{ver}"
        if dist:
            name = f"{name}+p{dist}"
        return name
    return str(a)


def _guess_tid(stream: str) -> int:
    """The tid of ``stream``'s first lane when no stream of its device has
    extra lanes (0, never a tid, for a stream not in STREAMS)."""
    try:
        return STREAMS.index(stream) + 1
    except ValueError:
        return 0


def _x_tail(dev: int, tid: int) -> str:
    """The text of a complete event on thread (dev, tid) from "ph" to "ts"."""
    if type(dev) is not int:
        raise _Fallback
    return f',"ph":"X","pid":{dev},"tid":{tid},"ts":'


#: Flow end of each transfer op: True at a send, False at a receive.
_FLOW_END: dict[object, bool] = {Op.SEND_F: True, Op.SEND_B: True, Op.RECV_F: False, Op.RECV_B: False}


def _order_track(track: list[int], spans: list[Span]) -> tuple[list[int], list[int] | None]:
    """The spans of one track in event order (start, longest first, name,
    input position) and, when some overlap, the lane of each (in the order
    of ``track``, the input order), else None."""
    keyed = [(_ns(spans[i].start), _ns(spans[i].start) - _ns(spans[i].end), i) for i in track]
    keyed.sort()
    prev_start, prev_neg, _ = keyed[0]
    last_end = prev_start - prev_neg
    ties = overlap = False
    for start, neg_dur, _ in islice(keyed, 1, None):
        if start < last_end:
            overlap = True
        if start == prev_start and neg_dur == prev_neg:
            ties = True
        prev_start, prev_neg = start, neg_dur
        last_end = start - neg_dur
    if ties:  # each run of (start, duration) ties by name, input position
        out: list[tuple[int, int, int]] = []
        for _, run in groupby(keyed, key=lambda k: k[:2]):
            run = list(run)
            if len(run) > 1:
                run.sort(key=lambda k: (_action_name(spans[k[2]].action), k[2]))
            out.extend(run)
        keyed = out
    order = [k[2] for k in keyed]
    if not overlap:
        return order, None
    return order, assign_lanes([(k[0], k[0] - k[1]) for k in sorted(keyed, key=itemgetter(2))])


class _Layout:
    """What both serialisations share: integer-ns times, lanes and tids, the
    order of the events and the flow pairs. :func:`chrome_trace` builds dicts
    from it and :func:`write_trace` formats text from it, so the two cannot
    disagree on which events there are or in which order they come.

    With ``text``, ``lines[i]`` is the text of the complete event of span
    ``i`` as :func:`dumps` writes it (keys sorted), formatted by hand in the
    pass over the spans (in their order in memory: much faster than in event
    order). The tid in it is the one the track's first lane gets when no
    stream of the device has extra lanes (:func:`_guess_tid`);
    :func:`_complete_lines` corrects the others. Every value formatted is an
    exact int, a time from :func:`_us` (an int, or a float, whose ``str`` is
    the repr json writes), an op type or an action name spelled from those,
    which JSON needs no escapes for; anything else raises :class:`_Fallback`.
    """

    __slots__ = ("counters", "flows", "lines", "slices", "spans", "tails", "threads")

    def __init__(self, result: SimResult, *, text: bool = False, tracked=None):
        self.spans = result.spans
        tracks, unusual, ends = self._scan(text)
        if tracked is not None:  # the spans are done; what follows reads the memory tracks
            tracked()
        lanes_of, lane_of_span = _lanes(tracks, unusual, self.spans)
        tid_of, self.threads = _threads(result, tracks, lanes_of)
        #: (device, tid, stream, span indices in event order) per thread with
        #: spans, by (device, tid)
        self.slices: list[tuple[int, int, str, list[int]]] = sorted(
            (
                (dev, tid_of[(dev, stream, lane)], stream, items)
                for (dev, stream), per_lane in lanes_of.items()
                for lane, items in enumerate(per_lane)
            ),
            key=lambda t: (t[0], t[1]),
        )
        self.flows = _pair_flows(ends, tracks, tid_of, lane_of_span)
        self.counters = _counters(result.memory)

    def _scan(self, text: bool):
        """One pass over the spans: times as integer nanoseconds before
        anything else, the event text (with ``text``), the tracks, the flow
        ends. Returns the tracks (span indices in input order per (device,
        stream)), the tracks that are not simply in order, and the flow ends."""
        spans = self.spans
        tracks: dict[tuple[int, str], list[int]] = {}
        #: per track, [its span indices, its tail, start and end of its last span]
        entries: dict[tuple[int, str], list] = {}
        #: tracks whose spans do not each start after the end and the start
        #: of the one before: unsorted, overlapping or with ties
        unusual: set[tuple[int, str]] = set()
        #: per track, the text of its events from "ph" to "ts", with the tid
        #: its first lane gets when no stream of the device has extra lanes
        self.tails: dict[tuple[int, str], str | None] = {}
        self.lines: list[str] = []
        line = self.lines.append
        ends = _FlowEnds()
        send_at, recv_at, not_pairs = ends.send_at, ends.recv_at, ends.not_pairs
        flow_end, op_value, cat_durs, action_type = _FLOW_END, _OP_VALUE, _CAT_DUR, Action
        for i, s in enumerate(spans):
            start = round(s.start * 1e9)
            end = round(s.end * 1e9)
            key = (s.device, s.stream)
            entry = entries.get(key)
            if entry is None:
                tracks[key] = [i]
                tail = self.tails[key] = _x_tail(key[0], _guess_tid(key[1])) if text else None
                entries[key] = [tracks[key], tail, start, end]
            else:
                entry[0].append(i)
                if start <= entry[2] or start < entry[3]:
                    unusual.add(key)
                entry[2] = start
                entry[3] = end
                tail = entry[1]
            flow = s.flow
            if text:
                # _span_text's two common shapes, inlined: this runs per span
                a = s.action
                if type(a) is action_type and (v := op_value.get(a[0])) is not None:
                    op, stage, mb, ver, dist, rep = a
                    nb = s.nbytes
                    peer = s.peer
                    if (
                        rep == 0 == dist
                        and type(mb) is int
                        and type(stage) is int
                        and type(nb) is int
                        and type(rep) is int
                        and type(dist) is int
                    ):
                        dur = end - start
                        us = dur // 1000 if dur % 1000 == 0 else dur / 1000
                        ts = start // 1000 if start % 1000 == 0 else start / 1000
                        if flow is None and peer is None and nb == 0 and type(ver) is int:
                            line(f'{{{cat_durs[op]}{us},"name":"{stage}{v}{mb}@v{ver}"{tail}{ts}}}')
                        elif type(flow) is type(peer) is int and ver is None:
                            args = f'"bytes":{nb},"peer":{peer}' if nb else f'"peer":{peer}'
                            line(f'{{"args":{{{args}}},{cat_durs[op]}{us},"name":"{stage}{v}{mb}"{tail}{ts}}}')
                        else:
                            line(_span_text(s, start, end, tail))
                    else:
                        line(_span_text(s, start, end, tail))
                else:
                    line(_span_text(s, start, end, tail))
            if flow is not None:
                # _FlowEnds.add, inlined
                op = s.action.op
                is_send = flow_end.get(op)
                if is_send is None:  # an action of no transfer type: its stream says which end
                    if key[1] not in ("send", "recv"):
                        continue
                    is_send = key[1] == "send"
                side = send_at if is_send else recv_at
                if flow in side:
                    not_pairs.add(flow)
                else:
                    side[flow] = (i, key, start + (end - start) // 2, op)
        return tracks, unusual, ends


class _FlowEnds:
    """The send and receive ends of each flow id, as the spans are scanned
    (filled by :meth:`_Layout._scan`)."""

    __slots__ = ("not_pairs", "recv_at", "send_at")

    def __init__(self) -> None:
        self.send_at: dict[int, tuple[int, tuple[int, str], int, object]] = {}
        self.recv_at: dict[int, tuple[int, tuple[int, str], int, object]] = {}
        self.not_pairs: set[int] = set()  # flow ids with several sends or receives


def _span_text(s: Span, start: int, end: int, tail: str) -> str:
    """The text of span ``s``'s complete event (see :class:`_Layout`)."""
    a = s.action
    if type(a) is not Action or (v := _OP_VALUE.get(a[0])) is None:
        raise _Fallback
    op, stage, mb, ver, dist, rep = a
    if not type(stage) is type(dist) is type(rep) is int:
        raise _Fallback
    nb = s.nbytes
    if type(nb) is not int:
        nb = int(nb)
    # _us of duration and start; f"{x}" of a float is its repr
    dur = end - start
    us = dur // 1000 if dur % 1000 == 0 else dur / 1000
    ts = start // 1000 if start % 1000 == 0 else start / 1000
    flow, peer = s.flow, s.peer
    cat_dur = _CAT_DUR[op]
    # The two shapes of nearly every span first, a pass and a transfer,
    # with each number turned into text once.
    if rep == 0 == dist and type(mb) is int:
        if flow is None and peer is None and nb == 0 and type(ver) is int:
            return f'{{{cat_dur}{us},"name":"{stage}{v}{mb}@v{ver}"{tail}{ts}}}'
        if type(flow) is type(peer) is int and ver is None:
            args = f'"bytes":{nb},"peer":{peer}' if nb else f'"peer":{peer}'
            return f'{{"args":{{{args}}},{cat_dur}{us},"name":"{stage}{v}{mb}"{tail}{ts}}}'
    return _x_text(nb, flow, mb, peer, ver, cat_dur, us, _action_name(a), tail, ts)


def _lanes(tracks: dict, unusual: set, spans: list[Span]) -> tuple[dict, dict[int, int]]:
    """Order each track and spread overlapping spans over extra lanes
    (tids). A track whose every span starts after the end and the start of
    the one before is in order already, on one lane. Returns the lanes of
    each track (span indices in event order) and the lane of every span of a
    track with several."""
    lanes_of: dict[tuple[int, str], list[list[int]]] = {}
    lane_of_span: dict[int, int] = {}  # only spans of tracks with lanes
    for key, track in tracks.items():
        if key not in unusual:
            lanes_of[key] = [track]
            continue
        order, lanes = _order_track(track, spans)
        if lanes is None:
            lanes_of[key] = [order]
            continue
        lane_of_span.update(zip(track, lanes, strict=True))
        per_lane: list[list[int]] = [[] for _ in range(max(lanes) + 1)]
        for i in order:  # in order, so each lane stays in order
            per_lane[lane_of_span[i]].append(i)
        lanes_of[key] = per_lane
    return lanes_of, lane_of_span


def _threads(result: SimResult, tracks: dict, lanes_of: dict):
    """tids per device: every known stream always gets lane 0, in STREAMS
    order; a stream's extra lanes follow its first. Returns the tid of each
    (device, stream, lane) and, per device, its (tid, thread name) list."""
    devices = set(range(result.schedule.num_devices))
    devices.update(m.device for m in result.memory)
    devices.update(d for d, _ in tracks)
    tid_of: dict[tuple[int, str, int], int] = {}
    threads: list[tuple[int, list[tuple[int, str]]]] = []
    for dev in sorted(devices):
        streams = set(STREAMS) | {st for (d, st) in tracks if d == dev}
        tid = 0
        named: list[tuple[int, str]] = []
        for stream in sorted(streams, key=_stream_key):
            for lane in range(len(lanes_of.get((dev, stream), ((),)))):
                tid += 1
                tid_of[(dev, stream, lane)] = tid
                named.append((tid, _lane_name(stream, lane)))
        threads.append((dev, named))
    return tid_of, threads


def _pair_flows(ends: _FlowEnds, tracks: dict, tid_of: dict, lane_of_span: dict) -> list[tuple]:
    """(flow id, name, pid, tid, ts ns of the start, pid, tid, ts ns of the
    finish) per send/receive pair (one send span and one recv span sharing a
    flow id), by flow id; both ends at the middle of their slice, the name is
    the send's op type."""
    flows = []
    first_tid = {key: tid_of[(key[0], key[1], 0)] for key in tracks}
    for flow_id, (si, skey, sts, sop) in sorted(ends.send_at.items()):
        got = ends.recv_at.get(flow_id)
        if got is None or (ends.not_pairs and flow_id in ends.not_pairs):
            continue
        ri, rkey, rts, _ = got
        stid, rtid = first_tid[skey], first_tid[rkey]
        if lane_of_span:
            stid += lane_of_span.get(si, 0)
            rtid += lane_of_span.get(ri, 0)
        flows.append((flow_id, _op_value(sop), skey[0], stid, sts, rkey[0], rtid, rts))
    return flows


def _counters(memory) -> list[tuple[int, list[int], list[int]]]:
    """(device, times in ns, totals) per memory track, by device."""
    out = []
    for track in sorted(memory, key=lambda m: m.device):
        times, totals = track.times, track.totals
        out.append(
            (
                track.device,
                [round(t * 1e9) for t, _ in zip(times, totals, strict=False)],  # _ns
                [int(b) for _, b in zip(times, totals, strict=False)],
            )
        )
    return out


def _x_text(nb, flow, mb, peer, ver, cat_dur, us, name, tail, ts) -> str:
    """The text of a complete event of any shape (see :class:`_Layout`).
    The flow id, micro-batch and version are not written here but checked:
    the flow events and the name spell them, and :func:`dumps` would not
    write a value that is not an exact int the same way."""
    for v in (flow, mb, peer, ver):
        if v is not None and type(v) is not int:
            raise _Fallback
    args = []
    if nb:
        args.append(f'"bytes":{nb}')
    if peer is not None:
        args.append(f'"peer":{peer}')
    head = f'{{"args":{{{",".join(args)}}},' if args else "{"
    return f'{head}{cat_dur}{us},"name":"{name}"{tail}{ts}}}'


def _other_data(result: SimResult) -> dict:
    sched = result.schedule
    memory = sorted(result.memory, key=lambda m: m.device)
    return {
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
        "memory_capacity_bytes": {str(m.device): _jsonable(float(m.capacity_bytes)) for m in memory},
        "peak_memory_bytes": {str(m.device): int(m.peak_bytes) for m in memory},
    }


def _metadata(threads: list[tuple[int, list[tuple[int, str]]]]) -> list[dict]:
    meta: list[dict] = []
    for dev, named in threads:
        meta.append({"ph": "M", "pid": dev, "tid": 0, "name": "process_name", "args": {"name": f"device {dev}"}})
        meta.append({"ph": "M", "pid": dev, "tid": 0, "name": "process_sort_index", "args": {"sort_index": dev}})
        for tid, name in named:
            meta.append({"ph": "M", "pid": dev, "tid": tid, "name": "thread_name", "args": {"name": name}})
            meta.append({"ph": "M", "pid": dev, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    return meta


def chrome_trace(result: SimResult) -> dict:
    """The Chrome trace event document for ``result`` (see the module doc)."""
    with gc_paused():
        return _chrome_trace(result)


def _chrome_trace(result: SimResult) -> dict:
    lay = _Layout(result)
    spans = lay.spans
    events = _metadata(lay.threads)
    for dev, tid, _, items in lay.slices:
        for i in items:
            s = spans[i]
            start = _ns(s.start)
            event = {
                "ph": "X",
                "pid": dev,
                "tid": tid,
                "ts": _us(start),
                "dur": _us(_ns(s.end) - start),
                "name": _action_name(s.action),
                "cat": _op_value(s.action.op),
            }
            args = _span_args(s)
            if args:
                event["args"] = args
            events.append(event)
    for flow_id, name, spid, stid, sts, fpid, ftid, fts in lay.flows:
        events.append(
            {"ph": "s", "id": flow_id, "pid": spid, "tid": stid, "ts": _us(sts), "cat": FLOW_CAT, "name": name}
        )
        events.append(
            {
                "ph": "f",
                "id": flow_id,
                "pid": fpid,
                "tid": ftid,
                "ts": _us(fts),
                "cat": FLOW_CAT,
                "name": name,
                "bp": "e",
            }
        )
    for dev, times, totals in lay.counters:
        for ts, total in zip(times, totals, strict=True):
            events.append({"ph": "C", "pid": dev, "tid": 0, "ts": _us(ts), "name": "memory", "args": {"bytes": total}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": _other_data(result),
    }


def _encoder() -> json.JSONEncoder:
    return json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False)


def dumps(trace: dict) -> str:
    """Canonical text of a trace document: sorted keys, compact separators,
    one event per line so diffs stay readable, trailing newline."""
    events = trace.get("traceEvents", [])
    head = {k: v for k, v in trace.items() if k != "traceEvents"}
    enc = _encoder()
    body = ",\n".join(map(enc.encode, events))
    rest = enc.encode(head)[1:-1]
    text = '{"traceEvents":[\n' + body + "\n]"
    if rest:
        text += "," + rest
    return text + "}\n"


#: Events formatted between two writes to the file.
_BATCH = 1 << 15


def _complete_lines(lay: _Layout) -> Iterator[list[str]]:
    """The text of the complete events of a ``text`` layout, as :func:`dumps`
    writes them, in batches."""
    batch: list[str] = []
    lines = lay.lines
    for dev, tid, stream, items in lay.slices:
        if tid == _guess_tid(stream):  # the text is complete
            batch.extend(map(lines.__getitem__, items))
        else:  # the device has extra lanes: correct the tid
            guessed = lay.tails[(dev, stream)]
            tail = _x_tail(dev, tid)
            for i in items:
                head, _, ts = lines[i].rpartition(guessed)
                batch.append(f"{head}{tail}{ts}")
        if len(batch) >= _BATCH:
            yield batch
            batch = []
    yield batch


def _other_lines(lay: _Layout) -> Iterator[list[str]]:
    """The text of the flow and counter events of a ``text`` layout, as
    :func:`dumps` writes them, in batches. (The layout checked that flow ids
    and the devices of tracks are ints, :func:`_write_fast` those of
    counters; times and byte counts are ints by construction.)"""
    batch: list[str] = []
    line = batch.append
    name_part: dict[str, str] = {}
    for flow_id, name, spid, stid, sts, fpid, ftid, fts in lay.flows:
        mid = name_part.get(name)
        if mid is None:
            mid = name_part[name] = f',"name":{json.dumps(name)},"ph":'
        head = f'"cat":{_FLOW_CAT_JSON},"id":{flow_id}{mid}'
        sts = sts // 1000 if sts % 1000 == 0 else sts / 1000
        fts = fts // 1000 if fts % 1000 == 0 else fts / 1000
        line(f'{{{head}"s","pid":{spid},"tid":{stid},"ts":{sts}}}')
        line(f'{{"bp":"e",{head}"f","pid":{fpid},"tid":{ftid},"ts":{fts}}}')
        if len(batch) >= _BATCH:
            yield batch
            batch = []
            line = batch.append
    for dev, times, totals in lay.counters:
        tail = f'}},"name":"memory","ph":"C","pid":{dev},"tid":0,"ts":'
        for ts, total in zip(times, totals, strict=True):
            line(f'{{"args":{{"bytes":{total}{tail}{ts // 1000 if ts % 1000 == 0 else ts / 1000}}}')
        if len(batch) >= _BATCH:
            yield batch
            batch = []
            line = batch.append
    yield batch


def _write_fast(result: SimResult, path: Path, tracked) -> None:
    lay = _Layout(result, text=True, tracked=tracked)
    if any(type(dev) is not int for dev, _, _ in lay.counters):
        raise _Fallback
    enc = _encoder()
    rest = enc.encode({"displayTimeUnit": "ms", "otherData": _other_data(result)})[1:-1]
    with path.open("w", encoding="utf-8") as f:
        f.write('{"traceEvents":[\n')
        f.write(",\n".join(map(enc.encode, _metadata(lay.threads))))
        sep = ",\n" if lay.threads else ""
        for batches in (_complete_lines(lay), _other_lines(lay)):
            for batch in batches:
                if batch:
                    f.write(sep)
                    f.write(",\n".join(batch))
                    sep = ",\n"
        f.write(f"\n],{rest}}}\n")


def write_trace(result: SimResult, path: str | Path, *, tracked: Callable[[], None] | None = None) -> Path:
    """Write ``dumps(chrome_trace(result))`` to ``path`` (byte-identical for
    the same result) and return the path. Prints nothing.

    The events are formatted by hand from the layout :func:`chrome_trace`
    uses and streamed to the file, without building the document or encoding
    a dict per event: several times faster on big results. A result holding
    a value that hand-formatting could get wrong (an action that is not an
    :class:`~pipesim.sim.ir.core.Action` of a known op, a field that is not an
    exact int) is written through ``dumps(chrome_trace(result))`` instead.

    ``tracked``, if given, is called once before anything reads
    ``result.memory``, after the pass over the spans: a writer started as
    soon as the spans exist (a forked child, ``pipesim simulate``) fills
    the memory tracks there, once the parent has tracked them.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    once = _Once(tracked)
    with gc_paused():
        try:
            _write_fast(result, path, once)
        except _Fallback:
            once()
            path.write_text(dumps(chrome_trace(result)), encoding="utf-8")
    return path


class _Once:
    """``fn`` (or nothing), called at most once however often this is."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


def write_trace_once_tracked(result: SimResult, path: str | Path, receive: Callable[[], list]) -> Path:
    """:func:`write_trace` of a result whose memory tracks are not tracked
    yet: ``receive()`` returns them, and is called only once the spans are
    formatted (a writer forked as soon as the spans exist, see
    :class:`pipesim.experiments.background.TraceWriter`)."""

    def tracked() -> None:
        result.memory = receive()

    return write_trace(result, path, tracked=tracked)

"""Chrome trace export: structure, units, flows, nesting, counters, determinism."""

from __future__ import annotations

import json
from collections import defaultdict
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.sim.ir import RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, UPDATE, Action, B, F, Schedule
from pipesim.sim.results import MemoryTrack, SimResult, Span
from pipesim.sim.trace import assign_lanes, chrome_trace, dumps, write_trace

MS = 1e-3


def make_result() -> SimResult:
    """Two devices, one stage each; three forward transfers from device 0 to
    device 1 that overlap in time (as several in-flight transfers do)."""
    programs = (
        (Action(F, 0, 0, version=0), Action(F, 0, 1, version=0), Action(B, 0, 0, version=0)),
        (Action(F, 1, 0, version=0), Action(B, 1, 0, version=0)),
    )
    sched = Schedule("test", num_stages=2, num_microbatches=2, programs=programs)
    spans = [
        Span(0, "compute", Action(F, 0, 0, version=0), 0.0, 1 * MS),
        Span(0, "compute", Action(F, 0, 1, version=0), 1 * MS, 2 * MS),
        # 0.1 + 0.2 != 0.3 in floating point: the boundary must still coincide.
        Span(0, "compute", Action(B, 0, 0, version=0), 2 * MS, (0.1 + 0.2) * 1e-2),
        Span(0, "compute", Action(UPDATE, 0, version=1), 0.3e-2, 3.5 * MS),
        Span(1, "compute", Action(F, 1, 0, version=0), 1.5 * MS, 2.5 * MS),
        Span(1, "compute", Action(B, 1, 0, version=0), 2.5 * MS, 2.75 * MS),
        # transfers: [1.0, 1.5], [1.2, 1.8] (partial overlap), [1.3, 1.4] (inside both)
        Span(0, "send", Action(SEND_F, 0, 0), 1.0 * MS, 1.5 * MS, peer=1, flow=0, nbytes=4096),
        Span(1, "recv", Action(RECV_F, 1, 0), 1.0 * MS, 1.5 * MS, peer=0, flow=0, nbytes=4096),
        Span(0, "send", Action(SEND_F, 0, 1), 1.2 * MS, 1.8 * MS, peer=1, flow=1, nbytes=4096),
        Span(1, "recv", Action(RECV_F, 1, 1), 1.2 * MS, 1.8 * MS, peer=0, flow=1, nbytes=4096),
        Span(0, "send", Action(SEND_F, 0, 7), 1.3 * MS, 1.4 * MS, peer=1, flow=2, nbytes=8),
        Span(1, "recv", Action(RECV_F, 1, 7), 1.3 * MS, 1.4 * MS, peer=0, flow=2, nbytes=8),
        Span(1, "send", Action(SEND_B, 1, 0), 2.75 * MS, 2.875 * MS, peer=0, flow=3, nbytes=4096),
        Span(0, "recv", Action(RECV_B, 0, 0), 2.75 * MS, 2.875 * MS, peer=1, flow=3, nbytes=4096),
        Span(1, "collective", Action(REDUCE_GRAD, 1), 2.9 * MS, 3.0 * MS, nbytes=100),
    ]
    memory = [
        MemoryTrack(0, capacity_bytes=float("inf"), times=[0.0, 1 * MS, 2.5 * MS], totals=[100, 200, 150],
                    peak_bytes=200, peak_time=1 * MS),
        MemoryTrack(1, capacity_bytes=1e9, times=[0.0, 1.5 * MS], totals=[50, 80], peak_bytes=80,
                    peak_time=1.5 * MS),
    ]
    return SimResult(schedule=sched, spans=spans, memory=memory, versions=[], max_versions_held={},
                     link_bytes={"l0": 8200}, meta={"model": "toy", "x": 0.1 + 0.2})


def _events(trace, ph):
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def _thread_names(trace):
    return {(e["pid"], e["tid"]): e["args"]["name"]
            for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}


def test_top_level_and_process_metadata():
    tr = chrome_trace(make_result())
    assert set(tr) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert tr["displayTimeUnit"] == "ms"
    procs = {e["pid"]: e["args"]["name"] for e in tr["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "device 0", 1: "device 1"}
    sort = {e["pid"]: e["args"]["sort_index"] for e in tr["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_sort_index"}
    assert sort == {0: 0, 1: 1}
    assert tr["otherData"]["strategy"] == "test"
    assert tr["otherData"]["memory_capacity_bytes"] == {"0": None, "1": 1e9}


def test_thread_names_fixed_order_and_extra_lanes():
    tr = chrome_trace(make_result())
    names = _thread_names(tr)
    sort_index = {(e["pid"], e["tid"]): e["args"]["sort_index"] for e in tr["traceEvents"]
                  if e["ph"] == "M" and e["name"] == "thread_sort_index"}
    # device 0 has three overlapping sends -> lanes "send", "send 1", "send 2"
    dev0 = [names[k] for k in sorted((k for k in names if k[0] == 0), key=lambda k: sort_index[k])]
    assert dev0 == ["compute", "send", "send 1", "send 2", "recv", "collective"]
    dev1 = [names[k] for k in sorted((k for k in names if k[0] == 1), key=lambda k: sort_index[k])]
    assert dev1 == ["compute", "send", "recv", "recv 1", "recv 2", "collective"]
    # compute is always tid 1
    assert names[(0, 1)] == names[(1, 1)] == "compute"


def test_complete_events_units_names_args():
    res = make_result()
    tr = chrome_trace(res)
    xs = _events(tr, "X")
    assert len(xs) == len(res.spans)
    names = _thread_names(tr)
    by_name = {(e["pid"], e["name"]): e for e in xs}
    f = by_name[(0, "0F1@v0")]
    assert (f["ts"], f["dur"]) == (1000, 1000)  # microseconds
    assert f["cat"] == "F"
    assert names[(0, f["tid"])] == "compute"
    assert f["args"] == {"stage": 0, "microbatch": 1, "replica": 0, "version": 0, "distance": 0, "bytes": 0}
    b1 = by_name[(1, "1B0@v0")]
    assert (b1["ts"], b1["dur"]) == (2500, 250)
    upd = by_name[(0, "0UPDATE@v1")]
    assert upd["cat"] == "UPDATE" and "microbatch" not in upd["args"] and upd["args"]["version"] == 1
    send = by_name[(0, "0SEND_F7")]
    assert send["cat"] == "SEND_F"
    assert send["args"]["peer"] == 1 and send["args"]["bytes"] == 8 and send["args"]["microbatch"] == 7
    assert abs(send["ts"] - 1300) < 1e-9 and abs(send["dur"] - 100) < 1e-9
    assert names[(0, send["tid"])].startswith("send")
    red = by_name[(1, "1REDUCE_GRAD")]
    assert names[(1, red["tid"])] == "collective"
    # the float-noise boundary (0.1 + 0.2) * 1e-2 vs 0.3e-2 coincides after conversion
    b0 = by_name[(0, "0B0@v0")]
    assert b0["ts"] + b0["dur"] == upd["ts"] == 3000


def test_slices_on_each_track_never_partially_overlap():
    res = make_result()
    # precondition: the input really has overlapping spans on one stream
    sends = sorted((s.start, s.end) for s in res.spans if s.device == 0 and s.stream == "send")
    assert sends[0][1] > sends[1][0] and sends[1][1] > sends[0][1]
    tr = chrome_trace(res)
    tracks = defaultdict(list)
    for e in _events(tr, "X"):
        tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for track, ivs in tracks.items():
        ivs.sort()
        for i, (s1, e1) in enumerate(ivs):
            for s2, e2 in ivs[i + 1:]:
                # s2 >= s1: either disjoint or nested
                assert s2 >= e1 or e2 <= e1, (track, (s1, e1), (s2, e2))


def test_flow_pairs():
    res = make_result()
    tr = chrome_trace(res)
    xs = _events(tr, "X")
    starts, finishes = _events(tr, "s"), _events(tr, "f")
    assert sorted(e["id"] for e in starts) == [0, 1, 2, 3]
    assert sorted(e["id"] for e in finishes) == [0, 1, 2, 3]
    names = _thread_names(tr)
    for s in starts:
        f = next(e for e in finishes if e["id"] == s["id"])
        assert f["bp"] == "e" and "bp" not in s
        assert (s["cat"], s["name"]) == (f["cat"], f["name"])
        # bound to the enclosing send / recv slice on the same track
        send = [x for x in xs if x["pid"] == s["pid"] and x["tid"] == s["tid"]
                and x["ts"] <= s["ts"] <= x["ts"] + x["dur"]]
        recv = [x for x in xs if x["pid"] == f["pid"] and x["tid"] == f["tid"]
                and x["ts"] <= f["ts"] <= x["ts"] + x["dur"]]
        assert len(send) == 1 and send[0]["args"]["flow"] == s["id"]
        assert len(recv) == 1 and recv[0]["args"]["flow"] == s["id"]
        assert names[(s["pid"], s["tid"])].startswith("send")
        assert names[(f["pid"], f["tid"])].startswith("recv")
        assert send[0]["cat"].startswith("SEND") and recv[0]["cat"].startswith("RECV")
    s3 = next(e for e in starts if e["id"] == 3)
    assert (s3["pid"], s3["name"]) == (1, "SEND_B")


def test_unpaired_flow_is_not_emitted():
    res = make_result()
    res.spans = [s for s in res.spans if not (s.stream == "recv" and s.flow == 3)]
    tr = chrome_trace(res)
    assert 3 not in {e["id"] for e in tr["traceEvents"] if e["ph"] in "sf"}


def test_memory_counters():
    tr = chrome_trace(make_result())
    cs = _events(tr, "C")
    assert all(c["name"] == "memory" for c in cs)
    got = [(c["pid"], c["ts"], c["args"]["bytes"]) for c in cs]
    assert got == [(0, 0, 100), (0, 1000, 200), (0, 2500, 150), (1, 0, 50), (1, 1500, 80)]


def test_deterministic_bytes(tmp_path):
    p1, p2 = tmp_path / "a.json", tmp_path / "b.json"
    write_trace(make_result(), p1)
    write_trace(make_result(), p2)
    assert p1.read_bytes() == p2.read_bytes()
    doc = json.loads(p1.read_text())
    assert doc == json.loads(json.dumps(chrome_trace(make_result())))
    # independent of the order the executor listed its spans in
    res = make_result()
    res.spans = list(reversed(res.spans))
    assert dumps(chrome_trace(res)) == p1.read_text()


def test_empty_result_still_valid():
    sched = Schedule("empty", 1, 1, programs=((Action(F, 0, 0),),))
    res = SimResult(sched, spans=[], memory=[], versions=[], max_versions_held={}, link_bytes={})
    doc = json.loads(dumps(chrome_trace(res)))
    assert [e for e in doc["traceEvents"] if e["ph"] == "X"] == []
    assert any(e["ph"] == "M" and e["args"].get("name") == "device 0" for e in doc["traceEvents"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=40))
def test_assign_lanes_never_overlaps_and_is_minimal(raw):
    ivs = [(s, s + d) for s, d in raw]
    lanes = assign_lanes(ivs)
    per_lane = defaultdict(list)
    for iv, lane in zip(ivs, lanes, strict=True):
        per_lane[lane].append(iv)
    for items in per_lane.values():
        items.sort()
        for (_, e1), (s2, _) in pairwise(items):
            assert e1 <= s2
    # as many lanes as intervals open at one instant (when no interval is empty)
    if ivs and all(e > s for s, e in ivs):
        depth = max(sum(1 for s, e in ivs if s <= t < e) for t, _ in ivs)
        assert max(lanes) + 1 == depth
    assert sorted(set(lanes)) == list(range(len(set(lanes))))


def test_engine_result_end_to_end():
    """A real simulation (transfers cost time on PCIe): every transfer gets an
    arrow, tracks nest, every device has a memory counter."""
    from pipesim.sim.api import simulate
    from pipesim.sim.strategies import ScheduleSpec

    res = simulate(ScheduleSpec("1f1b", 4, 8, iterations=2), model="uniform", hardware="pcie-4gpu")
    tr = json.loads(dumps(chrome_trace(res)))
    xs = _events(tr, "X")
    assert len(xs) == len(res.spans)
    sends = [s for s in res.spans if s.stream == "send"]
    assert sends and len(_events(tr, "s")) == len(_events(tr, "f")) == len(sends)
    tracks = defaultdict(list)
    for e in xs:
        tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for ivs in tracks.values():
        ivs.sort()
        for i, (_, e1) in enumerate(ivs):
            for s2, e2 in ivs[i + 1:]:
                assert s2 >= e1 or e2 <= e1
    assert {c["pid"] for c in _events(tr, "C")} == set(range(res.schedule.num_devices))
    compute = _thread_names(tr)
    assert all(compute[(e["pid"], e["tid"])] == "compute" for e in xs if e["cat"] in ("F", "B", "UPDATE"))

"""Chrome trace export: structure, units, flows, nesting, counters, determinism."""

from __future__ import annotations

import json
from collections import defaultdict
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.experiments.trace import assign_lanes, chrome_trace, dumps, write_trace
from pipesim.sim.engine.results import MemoryTrack, SimResult, Span
from pipesim.sim.ir.core import RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, UPDATE, Action, B, F, Schedule

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
        MemoryTrack(
            0,
            capacity_bytes=float("inf"),
            times=[0.0, 1 * MS, 2.5 * MS],
            totals=[100, 200, 150],
            peak_bytes=200,
            peak_time=1 * MS,
        ),
        MemoryTrack(1, capacity_bytes=1e9, times=[0.0, 1.5 * MS], totals=[50, 80], peak_bytes=80, peak_time=1.5 * MS),
    ]
    return SimResult(
        schedule=sched,
        spans=spans,
        memory=memory,
        versions=[],
        max_versions_held={},
        link_bytes={"l0": 8200},
        meta={"model": "toy", "x": 0.1 + 0.2},
    )


def _events(trace, ph):
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def _thread_names(trace):
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def test_top_level_and_process_metadata():
    tr = chrome_trace(make_result())
    assert set(tr) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert tr["displayTimeUnit"] == "ms"
    procs = {e["pid"]: e["args"]["name"] for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "device 0", 1: "device 1"}
    sort = {
        e["pid"]: e["args"]["sort_index"]
        for e in tr["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_sort_index"
    }
    assert sort == {0: 0, 1: 1}
    assert tr["otherData"]["strategy"] == "test"
    assert tr["otherData"]["memory_capacity_bytes"] == {"0": None, "1": 1e9}


def test_thread_names_fixed_order_and_extra_lanes():
    tr = chrome_trace(make_result())
    names = _thread_names(tr)
    sort_index = {
        (e["pid"], e["tid"]): e["args"]["sort_index"]
        for e in tr["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_sort_index"
    }
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
    # the name spells stage, micro-batch, replica, version and distance: a
    # pass moving no bytes to no peer has no args
    assert "args" not in f
    b1 = by_name[(1, "1B0@v0")]
    assert (b1["ts"], b1["dur"]) == (2500, 250)
    upd = by_name[(0, "0UPDATE@v1")]
    assert upd["cat"] == "UPDATE" and "args" not in upd
    send = by_name[(0, "0SEND_F7")]
    assert send["cat"] == "SEND_F"
    assert send["args"] == {"peer": 1, "bytes": 8}
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
            for s2, e2 in ivs[i + 1 :]:
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
        send = [
            x for x in xs if x["pid"] == s["pid"] and x["tid"] == s["tid"] and x["ts"] <= s["ts"] <= x["ts"] + x["dur"]
        ]
        recv = [
            x for x in xs if x["pid"] == f["pid"] and x["tid"] == f["tid"] and x["ts"] <= f["ts"] <= x["ts"] + x["dur"]
        ]
        flow = {sp.flow: sp for sp in res.spans if sp.flow is not None and sp.stream == "send"}[s["id"]]
        assert len(send) == 1 and send[0]["name"] == str(flow.action) and send[0]["pid"] == flow.device
        assert len(recv) == 1 and recv[0]["pid"] == flow.peer and recv[0]["args"]["peer"] == flow.device
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
            for s2, e2 in ivs[i + 1 :]:
                assert s2 >= e1 or e2 <= e1
    assert {c["pid"] for c in _events(tr, "C")} == set(range(res.schedule.num_devices))
    compute = _thread_names(tr)
    assert all(compute[(e["pid"], e["tid"])] == "compute" for e in xs if e["cat"] in ("F", "B", "UPDATE"))


# --- write_trace's fast writer against chrome_trace ---------------------------------------


def _with_spans(res: SimResult, spans) -> SimResult:
    return SimResult(
        schedule=res.schedule,
        spans=list(spans),
        memory=res.memory,
        versions=[],
        max_versions_held={},
        link_bytes={},
        meta=res.meta,
    )


class _OddAction(Action):
    """An Action whose spelling JSON must escape (write_trace falls back)."""

    __slots__ = ()

    def __str__(self) -> str:
        return 'odd "name" \\ é\n'


def _odd_result() -> SimResult:
    """Streams outside STREAMS (one with characters JSON escapes), ties on
    (start, duration), a span ending before it starts, replicas, prediction
    distances, a shared flow id, a collective with a flow."""
    res = make_result()
    odd = 'h2d "copy" \\ é'
    spans = [
        Span(0, odd, Action(F, 0, 3, version=0), 0.0, 1 * MS),
        Span(0, odd, Action(F, 0, 2, version=0), 0.0, 1 * MS),  # overlaps the one above
        Span(0, "zz", Action(B, 0, 4, version=1, distance=2, replica=1), 1 * MS, 1 * MS),
        Span(0, "zz", Action(B, 0, 3, version=1, distance=2, replica=1), 1 * MS, 1 * MS),  # tie
        Span(0, "zz", Action(F, 0, 5), 2 * MS, 1.5 * MS),  # ends before it starts
        Span(1, "send", Action(SEND_F, 1, 9, replica=1), 0.1e-6, 0.1e-6 + 1.5e-9, peer=0, flow=7, nbytes=5.0),
        Span(0, "recv", Action(RECV_F, 0, 9, replica=1), 0.2e-6, 0.3e-6, peer=1, flow=7),
        Span(0, "send", Action(SEND_B, 0, 1), 3 * MS, 4 * MS, peer=1, flow=8),  # flow 8: two sends
        Span(1, "send", Action(SEND_B, 1, 1), 3 * MS, 4 * MS, peer=0, flow=8),
        Span(1, "recv", Action(RECV_B, 1, 1), 3 * MS, 4 * MS, peer=0, flow=8),
        Span(1, "collective", Action(REDUCE_GRAD, 1, replica=1), 5 * MS, 6 * MS, flow=9),
    ]
    return _with_spans(res, res.spans + spans)


def _engine_results() -> dict[str, SimResult]:
    from pipesim.sim.api import simulate
    from pipesim.sim.strategies import ScheduleSpec

    return {
        "1f1b-pcie": simulate(ScheduleSpec("1f1b", 4, 8, iterations=2), hardware="pcie-4gpu"),
        "1f1b-replicas": simulate(ScheduleSpec("1f1b", 2, 4, iterations=2, width=2), hardware="pcie-4gpu"),
        "spectrain": simulate(ScheduleSpec("spectrain", 4, 8, iterations=2), hardware="pcie-4gpu"),
        "zb-h1-ideal": simulate(ScheduleSpec("zb-h1", 4, 8)),
    }


def _assert_written_as_chrome_trace(res: SimResult, path) -> None:
    write_trace(res, path)
    text = path.read_text(encoding="utf-8")
    with path.open(encoding="utf-8") as f:
        assert json.load(f) == chrome_trace(res)  # same events, key order aside
    assert text == dumps(chrome_trace(res))  # and in fact the same bytes


def test_write_trace_matches_chrome_trace(tmp_path):
    res = make_result()
    cases = {
        "overlapping-transfers": res,
        "reversed": _with_spans(res, reversed(res.spans)),
        "odd": _odd_result(),
        "odd-reversed": _with_spans(res, reversed(_odd_result().spans)),
        "odd-action": _with_spans(res, [*res.spans, Span(1, "compute", _OddAction(F, 1, 1), 0.0, 1 * MS)]),
        "empty": _with_spans(res, []),
        **_engine_results(),
    }
    for name, case in cases.items():
        _assert_written_as_chrome_trace(case, tmp_path / f"{name}.json")
    # what the odd cases exercise is there
    odd = chrome_trace(cases["odd"])
    names = _thread_names(odd)
    assert {'h2d "copy" \\ é', 'h2d "copy" \\ é 1', "zz"} <= set(names.values())
    assert 8 not in {e["id"] for e in odd["traceEvents"] if e["ph"] in "sf"}
    assert 7 in {e["id"] for e in odd["traceEvents"] if e["ph"] in "sf"}
    xs = [e for e in odd["traceEvents"] if e["ph"] == "X" and names[(e["pid"], e["tid"])] == "zz"]
    assert [e["name"] for e in xs] == ["r1.0B3@v1+p2", "r1.0B4@v1+p2", "0F5"]
    assert xs[2]["dur"] == -500
    assert 'odd \\"name\\" \\\\ \\u00e9\\n' in (tmp_path / "odd-action.json").read_text()


def test_write_trace_formats_engine_results_by_hand(tmp_path, monkeypatch):
    """Engine results take the fast writer, not the chrome_trace fallback."""
    from pipesim.experiments import trace

    results = _engine_results()
    expected = {name: dumps(chrome_trace(res)) for name, res in results.items()}

    def no_fallback(result):
        raise AssertionError("write_trace fell back to chrome_trace")

    monkeypatch.setattr(trace, "chrome_trace", no_fallback)
    for name, res in results.items():
        write_trace(res, tmp_path / f"{name}.json")
        assert (tmp_path / f"{name}.json").read_text() == expected[name]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # device
            st.sampled_from(["compute", "send", "recv", "collective", 'x"y']),
            st.sampled_from([F, B, SEND_F, RECV_F, SEND_B, RECV_B, UPDATE, REDUCE_GRAD]),
            st.integers(0, 3),  # stage
            st.one_of(st.none(), st.integers(0, 4)),  # micro-batch
            st.one_of(st.none(), st.integers(0, 2)),  # version
            st.integers(0, 1),  # replica
            st.integers(0, 6),  # start, in 0.5 us
            st.integers(-1, 4),  # duration, in 0.25 us
            st.one_of(st.none(), st.integers(0, 3)),  # flow
        ),
        max_size=25,
    )
)
def test_write_trace_matches_chrome_trace_on_any_spans(raw):
    import tempfile
    from pathlib import Path

    spans = [
        Span(
            dev,
            stream,
            Action(op, stage, mb, ver, replica=rep),
            t * 0.5e-6,
            t * 0.5e-6 + d * 0.25e-6,
            peer=None if flow is None else 1 - dev % 2,
            flow=flow,
            nbytes=8,
        )
        for dev, stream, op, stage, mb, ver, rep, t, d, flow in raw
    ]
    res = _with_spans(make_result(), spans)
    with tempfile.TemporaryDirectory() as tmp:
        _assert_written_as_chrome_trace(res, Path(tmp) / "t.json")


def test_write_trace_bytes_independent_of_hash_seed(tmp_path):
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from pipesim.sim.api import simulate\n"
        "from pipesim.sim.strategies import ScheduleSpec\n"
        "from pipesim.experiments.trace import write_trace\n"
        "write_trace(simulate(ScheduleSpec('1f1b', 2, 4, iterations=2, width=2), hardware='pcie-4gpu'), sys.argv[1])\n"
    )
    outs = []
    for seed in ("0", "12345"):
        out = tmp_path / f"seed{seed}.json"
        env = {**__import__("os").environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", script, str(out)], check=True, env=env)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_write_trace_prints_nothing(tmp_path, capsys):
    write_trace(make_result(), tmp_path / "t.json")
    assert capsys.readouterr() == ("", "")

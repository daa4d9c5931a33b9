"""Measured-vs-simulated overlay figure and merged Chrome trace."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from pipesim.experiments import overlay
from pipesim.experiments.overlay import (
    DIV_ID,
    FLAG_COLOR,
    SIMULATED_PID_OFFSET,
    merged_trace,
    overlay_figure,
    write_merged_trace,
    write_overlay_html,
)
from pipesim.experiments.timeline import PALETTE
from pipesim.experiments.trace import chrome_trace, dumps
from pipesim.sim.api import simulate
from pipesim.sim.engine.results import SimResult, Span
from pipesim.sim.ir.core import Op
from pipesim.sim.strategies import ScheduleSpec

SLOW = 1.1  # the fake measurement runs everything 10% slower than predicted


@pytest.fixture(scope="module")
def predicted() -> SimResult:
    return simulate(ScheduleSpec(strategy="1f1b", stages=2, microbatches=4), "uniform", "ideal")


@pytest.fixture(scope="module")
def measured(predicted) -> SimResult:
    # same spans (flow ids included, so the merged trace has ids to collide),
    # times stretched, and nothing but spans, like validate's measured result
    spans = [
        Span(s.device, s.stream, s.action, s.start * SLOW, s.end * SLOW, s.peer, s.flow, s.nbytes)
        for s in predicted.spans
    ]
    return SimResult(
        schedule=predicted.schedule, spans=spans, memory=[], versions=[], max_versions_held={}, link_bytes={}
    )


def _rows(fig) -> dict[int, str]:
    ya = fig.layout.yaxis
    return dict(zip(ya.tickvals, ya.ticktext, strict=True))


def _bars(fig, kind: str | None = None, stream: str = "compute"):
    """(row label, action text, base, width, hover, outline width) of every bar."""
    rows = _rows(fig)
    out = []
    for t in fig.data:
        if t.meta["stream"] != stream or (kind and t.meta["row_kind"] != kind):
            continue
        widths = t.marker.line.width
        for k, (y, b, x, txt, hv) in enumerate(zip(t.y, t.base, t.x, t.text, t.hovertext, strict=True)):
            w = widths[k] if hasattr(widths, "__len__") else (widths or 0)
            out.append((rows[int(y)], txt, b, x, hv, w))
    return out


def _compute(res):
    return [s for s in res.spans if s.stream == "compute"]


# ---------------------------------------------------------------------------
# overlay_figure
# ---------------------------------------------------------------------------


def test_rows_measured_directly_above_simulated(measured, predicted):
    fig = overlay_figure(measured, predicted)
    ya = fig.layout.yaxis
    assert list(ya.ticktext) == ["d0 measured", "d0 simulated", "d1 measured", "d1 simulated"]
    # the axis runs top-down, so the first tick (d0 measured) is the top row
    assert list(ya.tickvals) == sorted(ya.tickvals)
    assert ya.range[0] > ya.range[1]
    assert fig.layout.xaxis.title.text == "time (ms)"
    assert fig.layout.barmode == "overlay"


def test_every_compute_span_once_per_row_in_ms(measured, predicted):
    fig = overlay_figure(measured, predicted)
    got = Counter((row, txt) for row, txt, *_ in _bars(fig))
    want = Counter(
        [(f"d{s.device} measured", str(s.action)) for s in _compute(measured)]
        + [(f"d{s.device} simulated", str(s.action)) for s in _compute(predicted)]
    )
    assert got == want
    assert max(got.values()) == 1
    # positions in milliseconds from t = 0, on the right row
    pos = {(row, txt): (b, x) for row, txt, b, x, *_ in _bars(fig)}
    for kind, res in (("measured", measured), ("simulated", predicted)):
        for s in _compute(res):
            b, x = pos[(f"d{s.device} {kind}", str(s.action))]
            assert b == pytest.approx(s.start * 1e3, abs=1e-6)
            assert x == pytest.approx((s.end - s.start) * 1e3, abs=1e-6)
    # communication is not drawn by default
    assert not _bars(fig, stream="comm")
    assert fig.layout.xaxis.range[1] == pytest.approx(measured.makespan * 1e3)


def test_one_trace_per_op_and_row_kind_with_timeline_colours(measured, predicted):
    fig = overlay_figure(measured, predicted)
    keys = [(t.meta["row_kind"], t.name) for t in fig.data]
    assert len(keys) == len(set(keys))
    ops = {s.action.op.value for s in _compute(predicted)}
    assert set(keys) == {(k, op) for k in ("measured", "simulated") for op in ops}
    for t in fig.data:
        assert t.type == "bar" and t.orientation == "h"
        assert t.marker.color == PALETTE[Op(t.name)]
    # one legend entry per op, toggling both rows together
    assert sorted(t.name for t in fig.data if t.showlegend is not False) == sorted(ops)
    assert all(t.legendgroup == t.name for t in fig.data)


def test_hover_of_measured_span_names_predicted_duration_and_error(measured, predicted):
    fig = overlay_figure(measured, predicted)
    hover = {(row, txt): hv for row, txt, _, _, hv, _ in _bars(fig)}
    hv = hover[("d1 measured", "1B2@v0")]
    assert "1B2@v0" in hv
    assert "duration 2.2000 ms" in hv  # measured: 2 ms x 1.1
    assert "predicted 2.0000 ms" in hv
    assert "-9.1%" in hv  # (pred - meas) / meas, report.json's convention
    assert f"start {0.008 * SLOW * 1e3:.4f} ms" in hv
    sim = hover[("d1 simulated", "1B2@v0")]
    assert "duration 2.0000 ms" in sim and "predicted" not in sim


def test_measured_action_missing_from_prediction(measured, predicted):
    extra = Span(0, "compute", measured.spans[0].action._replace(microbatch=99), 0.0, 0.001)
    meas = SimResult(
        schedule=measured.schedule,
        spans=[*measured.spans, extra],
        memory=[],
        versions=[],
        max_versions_held={},
        link_bytes={},
    )
    hover = {(row, txt): hv for row, txt, _, _, hv, _ in _bars(overlay_figure(meas, predicted))}
    assert "not simulated" in hover[("d0 measured", "0F99@v0")]


def test_flagged_actions_outlined_on_measured_row_only(measured, predicted):
    flagged = [
        {"device": 1, "action": "1B2@v0", "duration_error": -0.09},
        {"device": "0", "action": "0F3@v0"},
    ]  # as read back from report.json
    fig = overlay_figure(measured, predicted, flagged=flagged)
    outlined = {(row, txt) for row, txt, *_, w in _bars(fig) if w > 0}
    assert outlined == {("d1 measured", "1B2@v0"), ("d0 measured", "0F3@v0")}
    for t in fig.data:
        if t.meta["row_kind"] == "measured" and t.name in ("B", "F"):
            assert t.marker.line.color == FLAG_COLOR
    hover = {(row, txt): hv for row, txt, _, _, hv, _ in _bars(fig)}
    assert "flagged" in hover[("d1 measured", "1B2@v0")]
    assert "flagged" not in hover[("d1 measured", "1B1@v0")]
    # nothing flagged, nothing outlined
    assert not any(w > 0 for *_, w in _bars(overlay_figure(measured, predicted)))


def test_show_comm_draws_thin_bars_on_the_same_rows(measured, predicted):
    fig = overlay_figure(measured, predicted, show_comm=True)
    comm = _bars(fig, stream="comm")
    want = Counter(
        [(f"d{s.device} measured", str(s.action)) for s in measured.spans if s.stream != "compute"]
        + [(f"d{s.device} simulated", str(s.action)) for s in predicted.spans if s.stream != "compute"]
    )
    assert Counter((row, txt) for row, txt, *_ in comm) == want
    widths = {t.meta["stream"]: t.width for t in fig.data}
    assert widths["comm"] < widths["compute"]
    assert list(fig.layout.yaxis.ticktext) == overlay.row_labels(2)


def test_title(measured, predicted):
    assert overlay_figure(measured, predicted, title="run 7").layout.title.text == "run 7"
    auto = overlay_figure(measured, predicted).layout.title.text
    assert "1f1b" in auto and "measured" in auto and "simulated" in auto


# ---------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------


def test_html_self_contained_and_byte_identical(tmp_path, measured, predicted):
    flagged = [{"device": 1, "action": "1B2@v0"}]
    a = write_overlay_html(measured, predicted, tmp_path / "a.html", flagged=flagged)
    b = write_overlay_html(measured, predicted, tmp_path / "sub" / "b.html", flagged=flagged)
    assert a == tmp_path / "a.html" and a.is_file() and b.is_file()
    assert a.read_bytes() == b.read_bytes()
    html = a.read_text()
    assert "Plotly.newPlot" in html and f'id="{DIV_ID}"' in html
    assert not re.search(r"<script[^>]*\bsrc=", html)
    assert len(html) > 1_000_000  # plotly.js inlined
    assert "d0 measured" in html and "d1 simulated" in html
    assert not (tmp_path / "a.png").exists()  # PIPESIM_PNG=0 in the tests


def test_png_written_next_to_html_when_supported(tmp_path, monkeypatch, measured, predicted):
    calls = []
    monkeypatch.setattr(overlay, "png_supported", lambda: True)
    monkeypatch.setattr(overlay, "write_png", lambda fig, path, **kw: calls.append(path) or True)
    write_overlay_html(measured, predicted, tmp_path / "o.html")
    assert calls == [tmp_path / "o.png"]


# ---------------------------------------------------------------------------
# merged Chrome trace
# ---------------------------------------------------------------------------


def _meta(trace, name):
    return {e["pid"]: e["args"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == name}


def test_merged_trace_processes_named_and_interleaved(measured, predicted):
    tr = merged_trace(measured, predicted)
    names = {pid: a["name"] for pid, a in _meta(tr, "process_name").items()}
    assert names == {
        0: "measured device 0",
        1: "measured device 1",
        SIMULATED_PID_OFFSET: "simulated device 0",
        SIMULATED_PID_OFFSET + 1: "simulated device 1",
    }
    sort = {pid: a["sort_index"] for pid, a in _meta(tr, "process_sort_index").items()}
    assert sorted(sort, key=sort.get) == [0, SIMULATED_PID_OFFSET, 1, SIMULATED_PID_OFFSET + 1]
    # thread names survive on both halves
    threads = {
        (e["pid"], e["args"]["name"]) for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert (0, "compute") in threads and (SIMULATED_PID_OFFSET + 1, "compute") in threads


def test_merged_trace_holds_every_complete_event_of_both(measured, predicted):
    tr = merged_trace(measured, predicted)
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]

    def key(e, pid_shift=0):
        return (e["pid"] + pid_shift, e["tid"], e["name"], e["ts"], e["dur"])

    m_x = [e for e in chrome_trace(measured)["traceEvents"] if e["ph"] == "X"]
    p_x = [e for e in chrome_trace(predicted)["traceEvents"] if e["ph"] == "X"]
    assert len(m_x) == len(measured.spans) and len(p_x) == len(predicted.spans)
    assert Counter(map(key, xs)) == Counter([key(e) for e in m_x] + [key(e, SIMULATED_PID_OFFSET) for e in p_x])
    assert {e["pid"] for e in xs} == {0, 1, SIMULATED_PID_OFFSET, SIMULATED_PID_OFFSET + 1}
    # the simulated half keeps its memory counters, moved with its processes
    assert {e["pid"] for e in tr["traceEvents"] if e["ph"] == "C"} == {SIMULATED_PID_OFFSET, SIMULATED_PID_OFFSET + 1}
    assert set(tr["otherData"]["measured"]) >= {"strategy", "makespan_s"}
    assert tr["otherData"]["simulated"]["strategy"] == "1f1b"


def test_merged_trace_flow_ids_do_not_collide(measured, predicted):
    tr = merged_trace(measured, predicted)
    flows = [e for e in tr["traceEvents"] if e["ph"] in ("s", "f")]
    m_ids = {e["id"] for e in flows if e["pid"] < SIMULATED_PID_OFFSET}
    p_ids = {e["id"] for e in flows if e["pid"] >= SIMULATED_PID_OFFSET}
    n_pairs = sum(1 for s in predicted.spans if s.action.op in (Op.SEND_F, Op.SEND_B))
    assert len(m_ids) == len(p_ids) == n_pairs  # both halves really have flows
    assert not m_ids & p_ids
    # every id has exactly one start and one finish, both in the same half
    per_id = Counter((e["id"], e["ph"]) for e in flows)
    assert set(per_id.values()) == {1} and len(per_id) == 2 * len(m_ids | p_ids)
    # slices do not repeat the flow id (the arrow carries it), so none can go stale
    assert not any("flow" in e.get("args", {}) for e in tr["traceEvents"] if e["ph"] == "X")


def test_merged_trace_is_valid_byte_stable_json(tmp_path, measured, predicted):
    tr = merged_trace(measured, predicted)
    assert json.loads(dumps(tr)) == json.loads(json.dumps(tr))
    a = write_merged_trace(measured, predicted, tmp_path / "a.json")
    b = write_merged_trace(measured, predicted, tmp_path / "b.json")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_text() == dumps(tr)
    assert json.loads(a.read_text())["displayTimeUnit"] == "ms"
    # the inputs are left alone
    assert {e["pid"] for e in chrome_trace(predicted)["traceEvents"] if e["ph"] == "X"} == {0, 1}


def test_merged_trace_rejects_devices_that_would_clash(measured, predicted):
    far = Span(SIMULATED_PID_OFFSET, "compute", measured.spans[0].action, 0.0, 0.001)
    meas = SimResult(
        schedule=measured.schedule,
        spans=[*measured.spans, far],
        memory=[],
        versions=[],
        max_versions_held={},
        link_bytes={},
    )
    with pytest.raises(ValueError, match="device ids"):
        merged_trace(meas, predicted)

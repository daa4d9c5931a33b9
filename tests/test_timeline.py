"""Timeline HTML, PNG export guard and the bubble figure."""

from __future__ import annotations

import json
import pathlib
import re
import time
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipesim.experiments import export, figures, timeline
from pipesim.experiments.figures import (
    bubble_figure,
    bubble_gpipe,
    bubble_interleaved,
    bubble_zb_h1,
    needs_m_ge_p,
)
from pipesim.experiments.timeline import DIV_ID, PALETTE, timeline_figure, write_timeline_html
from pipesim.sim.errors import InputError
from pipesim.sim.ir.core import Op


def _load_trace_tests():
    # the synthetic SimResult lives in test_trace.py; load it by path so this
    # works under any pytest import mode
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_pipesim_test_trace", Path(__file__).with_name("test_trace.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_result = _load_trace_tests().make_result


def _embedded_data(html: str, div_id: str) -> list:
    """The trace list passed to Plotly.newPlot in a written HTML page."""
    call = html.index("Plotly.newPlot(")
    pos = html.index(f'"{div_id}",', call) + len(div_id) + 3
    while html[pos].isspace():
        pos += 1
    data, _ = json.JSONDecoder().raw_decode(html, pos)
    return data


def _ops_present(res, compute_only=False):
    return {s.action.op.value for s in res.spans if not compute_only or s.stream == "compute"}


# ---------------------------------------------------------------------------
# timeline_figure
# ---------------------------------------------------------------------------


def test_one_horizontal_bar_trace_per_action_type():
    res = make_result()
    fig = timeline_figure(res)
    names = [t.name for t in fig.data]
    assert len(names) == len(set(names))
    assert set(names) == _ops_present(res)
    for t in fig.data:
        assert t.type == "bar" and t.orientation == "h"
        n = sum(1 for s in res.spans if s.action.op.value == t.name)
        assert len(t.x) == len(t.base) == len(t.y) == len(t.text) == n
    assert fig.layout.barmode == "overlay"  # grouped bars would shift rows
    # consistent palette: distinct colours, fixed per type
    colors = {t.name: t.marker.color for t in fig.data}
    assert colors["F"] == PALETTE[Op.FORWARD] and colors["B"] == PALETTE[Op.BACKWARD]
    assert len(set(PALETTE.values())) == len(PALETTE)
    for op in ("F", "B", "I", "W", "UPDATE", "PREDICT", "AVERAGE"):
        assert Op(op) in PALETTE


def test_bars_in_ms_on_the_right_rows():
    res = make_result()
    fig = timeline_figure(res)
    by = {t.name: t for t in fig.data}
    ticks = dict(zip(fig.layout.yaxis.tickvals, fig.layout.yaxis.ticktext, strict=True))
    f = by["F"]
    got = sorted(
        (ticks[int(y)].split(" (")[0], b, x, txt) for y, b, x, txt in zip(f.y, f.base, f.x, f.text, strict=True)
    )
    assert got == [("device 0", 0.0, 1.0, "0F0@v0"), ("device 0", 1.0, 1.0, "0F1@v0"), ("device 1", 1.5, 1.0, "1F0@v0")]
    send = by["SEND_F"]
    assert {ticks[int(y)] for y in send.y} == {"device 0 comm"}
    assert {ticks[int(y)] for y in by["RECV_F"].y} == {"device 1 comm"}
    # thin comm bars, full compute bars
    assert send.width < f.width
    # hover carries action, stage, mb, version, start, duration
    for key in ("%{text}", "stage", "mb", "version", "%{base", "duration"):
        assert key in f.hovertemplate
    assert "mb" not in by["UPDATE"].hovertemplate


def test_rows_labels_bubbles_and_order():
    res = make_result()
    fig = timeline_figure(res)
    ya = fig.layout.yaxis
    labels = list(ya.ticktext)
    # device 0 at the top: its tick is first and the axis runs top-down
    assert labels[0].startswith("device 0") and labels[2].startswith("device 1")
    assert ya.tickvals[0] < ya.tickvals[2]
    assert ya.range[0] > ya.range[1]
    # bubble = 1 - busy / makespan: device 0 busy 3.5 of 3.5 ms, device 1 busy 1.25
    assert labels[0] == "device 0 (bubble 0.0%)"
    assert labels[2] == "device 1 (bubble 64.3%)"
    assert labels[1] == "device 0 comm"
    assert timeline.device_bubbles(res) == pytest.approx([0.0, 1 - 1.25 / 3.5])
    assert fig.layout.xaxis.title.text == "time (ms)"
    assert fig.layout.plot_bgcolor == timeline.IDLE_COLOR


def test_large_results_drop_comm_with_a_note():
    res = make_result()
    fig = timeline_figure(res, max_spans=5)
    assert {t.name for t in fig.data} == _ops_present(res, compute_only=True)
    assert not any("comm" in t for t in fig.layout.yaxis.ticktext)
    assert any("omitted" in a.text for a in fig.layout.annotations)
    # explicit request wins
    assert {t.name for t in timeline_figure(res, show_comm=True, max_spans=5).data} == _ops_present(res)


def test_html_self_contained_and_byte_identical(tmp_path):
    a, b = tmp_path / "a.html", tmp_path / "b.html"
    write_timeline_html(make_result(), a)
    write_timeline_html(make_result(), b)
    assert a.read_bytes() == b.read_bytes()
    html = a.read_text()
    assert html.startswith("<html>") or "<html" in html[:200]
    assert "Plotly.newPlot" in html and f'id="{DIV_ID}"' in html
    assert not re.search(r"<script[^>]*\bsrc=", html)  # plotly.js inlined, nothing fetched
    assert len(html) > 1_000_000  # ... and it really is in the file
    # one bar trace per action type in the embedded figure
    data = _embedded_data(html, DIV_ID)
    assert [t["type"] for t in data] == ["bar"] * len(_ops_present(make_result()))
    assert {t["name"] for t in data} == _ops_present(make_result())
    assert "device 1 (bubble 64.3%)" in html


def _plotly_written(result, path, **kwargs):
    """The page as plotly writes a validated figure: the reference
    write_timeline_html must match byte for byte."""
    timeline_figure(result, **kwargs).write_html(
        path, include_plotlyjs=True, full_html=True, div_id=DIV_ID, config={"displaylogo": False, "scrollZoom": True}
    )


@pytest.mark.parametrize(
    "case",
    [
        {"spec": ("1f1b", 4, 8), "model": "uniform", "hardware": "ideal"},
        {"spec": ("pipedream", 2, 12, {"replicas": (3, 1)}), "model": "vgg16", "hardware": "pcie-4gpu"},
        {"spec": ("zb-h1", 4, 8), "model": "gpt-1.3b", "hardware": "dgx-h100", "max_spans": 50},
        {"spec": ("avgpipe", 2, 4), "model": "uniform", "hardware": "pcie-4gpu"},
    ],
)
def test_html_without_validation_is_what_plotly_writes(tmp_path, case):
    from pipesim.sim.api import simulate
    from pipesim.sim.strategies import ScheduleSpec

    strategy, p, m, *options = case["spec"]
    res = simulate(ScheduleSpec(strategy, p, m, **(options[0] if options else {})), case["model"], case["hardware"])
    kwargs = {"max_spans": case["max_spans"]} if "max_spans" in case else {}
    ours, ref = tmp_path / "ours.html", tmp_path / "ref.html"
    write_timeline_html(res, ours, **kwargs)
    _plotly_written(res, ref, **kwargs)
    assert ours.read_bytes() == ref.read_bytes()


def test_html_of_a_synthetic_result_is_what_plotly_writes(tmp_path):
    ours, ref = tmp_path / "ours.html", tmp_path / "ref.html"
    write_timeline_html(make_result(), ours, title="t")
    _plotly_written(make_result(), ref, title="t")
    assert ours.read_bytes() == ref.read_bytes()


_TIMES = st.sampled_from([0.0, 1e-3, 1e-3, 2e-3, (0.1 + 0.2) * 1e-2, 3e-3])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),
            _TIMES,
            _TIMES,
            st.integers(0, 3),
            st.integers(0, 3),
            st.one_of(st.none(), st.integers(0, 2)),
            st.integers(0, 1),
            st.integers(0, 1),
        ),
        min_size=1,
        max_size=40,
    )
)
@example([(0, 1e-3, 1e-3, 3, 1, 0, 0, 0), (0, 0.0, 1e-3, 0, 0, 0, 0, 0), (0, 1e-3, 1e-3, 1, 1, 0, 0, 0)])
def test_bars_are_spans_sorted_by_device_time_and_name(rows):
    """Each op's bars are its spans sorted by (device, start, end, name),
    name spelt as ``str(action)``: the numpy sort and the inline spelling
    must give what the plain definition gives, ties on all three times
    (which only the name breaks) included."""
    from pipesim.sim.engine.results import Span
    from pipesim.sim.ir.core import Action

    spans = [
        Span(dev, "compute", Action(op, stage, mb, version=ver, distance=dist, replica=rep), a, a + b)
        for (dev, a, b, stage, mb, ver, dist, rep), op in zip(rows, [Op.FORWARD, Op.BACKWARD] * len(rows))
    ]
    res = make_result()
    res.spans = spans
    for op, bars in timeline._spans_by_op(spans, has_comm=False):
        expected = sorted(
            (s for s in spans if s.action.op is op), key=lambda s: (s.device, s.start, s.end, str(s.action))
        )
        assert bars.spans == expected
        assert bars.starts.tolist() == [s.start for s in expected]
        props = timeline._op_bar(op, bars, 1, 0.0)
        assert props["text"] == [str(s.action) for s in expected]
        assert props["y"].tolist() == [s.device for s in expected]


# ---------------------------------------------------------------------------
# PNG export guard
# ---------------------------------------------------------------------------


def test_write_png_false_without_kaleido(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "kaleido_available", lambda: False)
    out = tmp_path / "x.png"
    assert export.write_png(timeline_figure(make_result()), out) is False
    assert not out.exists()


def test_write_png_false_without_browser(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "kaleido_available", lambda: True)
    monkeypatch.setattr(export, "find_browser", lambda: None)
    out = tmp_path / "x.png"
    assert export.write_png(timeline_figure(make_result()), out) is False
    assert not out.exists()


def test_find_browser_uses_path(tmp_path, monkeypatch):
    exe = tmp_path / "chromium"
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    monkeypatch.delenv("BROWSER_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert export.find_browser() == str(exe)


@pytest.fixture
def fake_renderer(monkeypatch):
    """``write_png`` with a stand-in export child (no kaleido, no browser): ``use(script)``."""
    monkeypatch.setattr(export, "png_supported", lambda: True)
    export.close_renderer()

    def use(script: str) -> None:
        monkeypatch.setattr(export, "_CHILD", script)

    yield use
    export.close_renderer()


#: A stand-in export child speaking the real one's protocol: a JSON job per
#: line in, "done ID ok" per job out, in one write with a line of noise before
#: it (as a library might print); it writes the job's size and its own pid.
FAKE_CHILD = (
    "import json, os, sys\n"
    "for line in sys.stdin:\n"
    "    job = json.loads(line)\n"
    "    open(job['out'], 'w').write(f\"{job['width']}x{job['height']} {os.getpid()}\")\n"
    "    print('noise a library printed', flush=False)\n"
    "    print('done', job['id'], 'ok', flush=True)\n"
)


def test_write_png_false_when_export_fails(tmp_path, fake_renderer):
    # kaleido "present", a browser "present", but the child export fails
    fake_renderer("import sys; sys.exit(3)")
    out = tmp_path / "x.png"
    assert export.write_png(timeline_figure(make_result()), out) is False
    assert not out.exists()


def test_write_png_false_when_the_child_reports_an_error(tmp_path, fake_renderer):
    fake_renderer(
        "import json, sys\nfor line in sys.stdin:\n    print('done', json.loads(line)['id'], 'error ValueError', flush=True)\n"
    )
    out = tmp_path / "x.png"
    assert export.write_png(timeline_figure(make_result()), out) is False
    assert not out.exists()


def test_write_png_success_path_copies_the_child_output(tmp_path, fake_renderer):
    fake_renderer(FAKE_CHILD)
    out = tmp_path / "sub" / "x.png"
    fig = timeline_figure(make_result())
    assert export.write_png(fig, out, width=800) is True
    assert out.read_text().split()[0] == f"800x{fig.layout.height}"


def test_one_export_child_serves_every_figure(tmp_path, fake_renderer):
    # a browser starts once per command, not once per figure
    fake_renderer(FAKE_CHILD)
    fig = timeline_figure(make_result())
    paths = [tmp_path / f"{k}.png" for k in range(3)]
    assert all(export.write_png(fig, p) for p in paths)
    pids = {p.read_text().split()[1] for p in paths}
    assert len(pids) == 1
    child = export._Renderer.proc
    export.close_renderer()
    assert child.poll() is not None  # closed with the command: nothing left behind


def test_write_png_times_out_and_ends_everything_the_child_started(tmp_path, fake_renderer):
    # a child that hangs for good, having started a process in a session of its own
    # (as the browser driver starts the browser): the timeout fires, both end, and
    # no later figure waits on a renderer that already hung
    pid_file = tmp_path / "grandchild.pid"
    fake_renderer(
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(600)\n"
    )
    out = tmp_path / "x.png"
    started = time.monotonic()
    assert export.write_png(timeline_figure(make_result()), out, timeout=2) is False
    assert time.monotonic() - started < 8
    assert not out.exists()
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pathlib.Path(f"/proc/{grandchild}").exists():
        state = pathlib.Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":  # dead, waiting to be reaped by init
            break
        time.sleep(0.1)
    else:
        assert not pathlib.Path(f"/proc/{grandchild}").exists(), "the child's own process outlived the timeout"
    started = time.monotonic()
    assert export.write_png(timeline_figure(make_result()), tmp_path / "y.png", timeout=2) is False
    assert time.monotonic() - started < 1  # not tried again


# ---------------------------------------------------------------------------
# bubble figure
# ---------------------------------------------------------------------------


def test_analytic_curves():
    assert Fraction(bubble_gpipe(4, 4)).limit_denominator(1000) == Fraction(3, 7)
    assert bubble_gpipe(8, 1) == pytest.approx(7 / 8)
    assert bubble_gpipe(8, 64) == pytest.approx(7 / 71)
    # interleaved, v chunks: r = (p-1)/(v m) of ideal time -> r / (1 + r) of the makespan
    assert bubble_interleaved(4, 4, 2) == pytest.approx(3 / 11)
    assert bubble_interleaved(8, 16, 4) == pytest.approx(7 / 71)
    assert bubble_interleaved(4, 8, 1) == pytest.approx(bubble_gpipe(4, 8))
    # ZB-H1 with unit F, I, W: (p-1)/(3m+p-1)
    assert bubble_zb_h1(4, 4) == pytest.approx(3 / 15)
    assert bubble_zb_h1(8, 8) == pytest.approx(7 / 31)
    # with T_W = 0 it degenerates to 1F1B with T_B = T_F + T_I
    assert bubble_zb_h1(4, 4, 1, 1, 0) == pytest.approx(bubble_gpipe(4, 4))


def test_needs_m_ge_p_asks_the_strategy():
    for name in ("interleaved-1f1b", "pipedream-2bw", "zb-h1"):
        assert needs_m_ge_p(name), name
    for name in ("gpipe", "1f1b", "pipedream", "spectrain", "avgpipe", "data-parallel", "not-a-strategy"):
        assert not needs_m_ge_p(name), name


class FakeSim:
    def __init__(self):
        self.calls = []

    def __call__(self, strategy, stages, microbatches):
        self.calls.append((strategy, stages, microbatches))
        if strategy == "broken" and microbatches == 2:
            raise InputError("m must be even-ish")
        if strategy == "interleaved-1f1b":
            return bubble_interleaved(stages, microbatches, 2)
        return bubble_gpipe(stages, microbatches) * (0.5 if strategy == "half" else 1.0)


def test_bubble_figure_with_fake_simulator(tmp_path, capsys):
    sim = FakeSim()
    mbs = (1, 2, 4, 8, 16)
    html = bubble_figure(
        tmp_path,
        stages=(4, 8),
        microbatches=mbs,
        strategies=["gpipe", "interleaved-1f1b", "half", "broken"],
        simulate=sim,
        png=False,
    )
    assert html == tmp_path / "bubbles.html"
    assert html.is_file() and (tmp_path / "bubbles.json").is_file()
    assert not (tmp_path / "bubbles.png").exists()
    # strategies needing m >= p are never simulated below p
    assert ("interleaved-1f1b", 4, 2) not in sim.calls and ("interleaved-1f1b", 4, 4) in sim.calls
    assert not any(s == "interleaved-1f1b" and p == 8 and m < 8 for s, p, m in sim.calls)
    assert len(sim.calls) == 2 * 5 * 3 + 3 + 2  # gpipe/half/broken everywhere, interleaved m>=p
    data = json.loads((tmp_path / "bubbles.json").read_text())
    assert data["stages"] == [4, 8] and data["microbatches"] == list(mbs)
    g4 = data["simulated"]["4"]["gpipe"]
    assert g4["m"] == list(mbs) and g4["bubble"][2] == pytest.approx(3 / 7)
    assert data["simulated"]["4"]["interleaved-1f1b"]["m"] == [4, 8, 16]
    assert data["simulated"]["8"]["half"]["bubble"][0] == pytest.approx(7 / 16)
    # the ValueError point is skipped and reported, the rest of the series is kept
    assert data["simulated"]["4"]["broken"]["m"] == [1, 4, 8, 16]
    reasons = {(s["strategy"], s["stages"], s["microbatches"]): s["reason"] for s in data["skipped"]}
    assert "m must be even-ish" in reasons[("broken", 4, 2)]
    assert reasons[("interleaved-1f1b", 8, 4)] == "drawn for m >= p only, where the strategy is defined"
    # analytic curves
    a4, a8 = data["analytic"]["4"], data["analytic"]["8"]
    assert a4["gpipe_1f1b"]["bubble"][a4["gpipe_1f1b"]["m"].index(4)] == pytest.approx(3 / 7)
    assert a4["interleaved"]["m"] == [4, 8, 16]
    assert a4["interleaved"]["bubble"][0] == pytest.approx(3 / 11)
    assert a4["zb_h1"]["bubble"][0] == pytest.approx(3 / 15)
    assert a8["zb_h1"]["m"] == [8, 16] and a8["zb_h1"]["bubble"][0] == pytest.approx(7 / 31)
    assert a8["gpipe_1f1b"]["bubble"][0] == pytest.approx(7 / 8)
    # progress on stderr, one line per simulated point
    err = capsys.readouterr().err
    assert err.count("p=4 m=8 gpipe: bubble 0.2727") == 1
    assert len([ln for ln in err.splitlines() if ln.startswith("[")]) == len(sim.calls)
    # the HTML holds both subplots, every strategy and the dashed analytic curves
    text = html.read_text()
    assert "p = 4" in text and "p = 8" in text
    for name in ("gpipe", "interleaved-1f1b", "half", "broken"):
        assert f'"name":"{name}"' in text
    traces = _embedded_data(text, "pipesim-bubbles")
    assert sum(1 for t in traces if t.get("line", {}).get("dash") == "dash") == 2 * 3
    assert sum(1 for t in traces if t["mode"] == "lines+markers") == 2 * 4
    assert not re.search(r"<script[^>]*\bsrc=", text)


def test_bubble_figure_deterministic(tmp_path):
    outs = []
    for sub in ("a", "b"):
        bubble_figure(
            tmp_path / sub,
            stages=(4,),
            microbatches=(1, 4, 16),
            strategies=["gpipe", "zb-h1"],
            simulate=FakeSim(),
            progress=False,
            png=False,
        )
        outs.append(((tmp_path / sub / "bubbles.json").read_bytes(), (tmp_path / sub / "bubbles.html").read_bytes()))
    assert outs[0] == outs[1]


def test_bubble_figure_figure_layout(tmp_path):
    data = figures.bubble_data((4, 8), (1, 2, 4, 8), ["gpipe"], FakeSim(), progress=False)
    fig = figures.figure_from_data(data)
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis2.type == "log"
    assert list(fig.layout.xaxis.tickvals) == [1, 2, 4, 8]
    sim_traces = [t for t in fig.data if t.mode == "lines+markers"]
    assert len(sim_traces) == 2 and all(t.name == "gpipe" for t in sim_traces)
    dashed = [t for t in fig.data if t.line.dash == "dash"]
    assert len(dashed) == 6


def test_import_errors_of_the_simulator_are_not_swallowed(tmp_path):
    def sim(strategy, stages, microbatches):
        raise ImportError("no api yet")

    with pytest.raises(ImportError):
        bubble_figure(
            tmp_path, stages=(4,), microbatches=(4,), strategies=["gpipe"], simulate=sim, progress=False, png=False
        )


def test_default_strategies_are_the_registry():
    from pipesim.sim.strategies import strategy_names

    assert figures.default_strategies() == strategy_names()
    assert "gpipe" in figures.default_strategies()


def test_bubbles_agree_with_metrics_and_default_simulate():
    from pipesim.sim.api import simulate
    from pipesim.sim.engine.metrics import bubble_fractions
    from pipesim.sim.strategies import ScheduleSpec

    res = simulate(ScheduleSpec("gpipe", 4, 4), model="uniform", hardware="ideal")
    assert timeline.device_bubbles(res) == pytest.approx(bubble_fractions(res))
    assert figures.default_simulate("gpipe", 4, 4) == pytest.approx(3 / 7)
    assert figures.default_simulate("zb-h1", 4, 4) == pytest.approx(bubble_zb_h1(4, 4))

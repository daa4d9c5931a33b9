"""Measured against simulated, on one time axis: where the model is wrong.

``pipesim validate`` ends with two :class:`~pipesim.sim.engine.results.SimResult` s of
the same schedule, one measured and one predicted. Their numbers are compared
in ``report.json`` (:mod:`pipesim.validate.reconcile`); this module is for
*seeing* where they diverge, which a table of errors does not show (a late
start that cascades down the pipeline, a stage that is slow every time, a
bubble the simulator did not expect).

:func:`overlay_figure` stacks, for every device, the measured row directly
above the simulated row so the eye compares the same work at the same height;
:func:`merged_trace` puts both timelines in one Chrome trace so Perfetto shows
them side by side with its own zooming and search.

Both results are drawn from their own first action (t = 0), so a constant
launch offset never reads as a modelling error. Per-action errors use the
convention of :func:`pipesim.validate.reconcile.compare_actions`,
(predicted − measured) / measured, so the hover text and ``report.json``
agree on sign and size; that module is not imported (it is the validation
layer's, and these plots must work on any two results).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import plotly.graph_objects as go

from pipesim.experiments.export import png_supported, write_png
from pipesim.experiments.timeline import OP_ORDER, PALETTE, apply_timeline_layout
from pipesim.experiments.trace import chrome_trace, dumps
from pipesim.sim.engine.results import SimResult, Span

DIV_ID = "pipesim-overlay"

#: Kinds of row, in their top-to-bottom order within a device.
ROW_KINDS = ("measured", "simulated")

#: Outline of an action the reconciliation flagged.
FLAG_COLOR = "#FF0000"
FLAG_WIDTH = 2.5

#: pid of simulated device d in :func:`merged_trace`: far enough above any
#: real device id that the two halves never share a process.
SIMULATED_PID_OFFSET = 1000

_COMPUTE_WIDTH = 0.8
# with comm drawn, compute keeps the top of the row and comm a strip below it
_COMPUTE_WIDTH_WITH_COMM = 0.62
_COMM_WIDTH = 0.14
_COMM_OFFSET = 0.24  # from the row's centre, downwards on the reversed axis
_SIMULATED_OPACITY = 0.7  # a hint of which row is which, colours stay the palette's


def row_labels(n_devices: int) -> list[str]:
    """Labels of the rows from top to bottom."""
    return [f"d{d} {kind}" for d in range(n_devices) for kind in ROW_KINDS]


def _row(device: int, kind: str) -> int:
    return 2 * device + ROW_KINDS.index(kind)


def _n_devices(*results: SimResult) -> int:
    n = 0
    for res in results:
        n = max(n, int(getattr(res.schedule, "num_devices", 0) or 0))
        n = max(n, 1 + max((s.device for s in res.spans), default=-1))
    return n


def _t0(result: SimResult) -> float:
    return min((s.start for s in result.spans), default=0.0)


def _flag_keys(flagged: Iterable[dict] | None) -> set[tuple[int, str]]:
    # reports round-trip through JSON, so the device may come back a string
    return {(int(f["device"]), str(f["action"])) for f in (flagged or ())}


def _fmt_error(rel: float | None) -> str:
    return "n/a" if rel is None else f"{100 * rel:+.1f}%"


def _op_order(ops: Iterable) -> list:
    present = set(ops)
    return [op for op in OP_ORDER if op in present] + sorted(present - set(OP_ORDER), key=lambda o: o.value)


def _relative_error(measured_s: float, predicted_s: float) -> float | None:
    return (predicted_s - measured_s) / measured_s if measured_s > 0 else None


def overlay_figure(
    measured: SimResult,
    predicted: SimResult,
    *,
    title: str = "",
    flagged: list[dict] | None = None,
    show_comm: bool = False,
) -> go.Figure:
    """Measured and simulated timelines of every device, interleaved by row
    (see the module doc).

    ``flagged``: rows of ``report.json``'s ``flagged_actions`` (only
    ``device`` and ``action`` are read); those actions get a red outline on
    the measured row. ``show_comm``: also draw sends, receives and
    collectives as a thin strip under the compute bars; off by default since
    measured transfers are host-side timestamps and mostly noise at this
    scale. An empty ``title`` gets one summarising both makespans.
    """
    n_dev = _n_devices(measured, predicted)
    flags = _flag_keys(flagged)
    # first occurrence wins, as the reconciliation keys by (device, action) too
    pred_dur: dict[tuple[int, str], float] = {}
    for s in predicted.spans:
        if s.stream == "compute":
            pred_dur.setdefault((s.device, str(s.action)), s.end - s.start)

    groups: dict[tuple, list[Span]] = defaultdict(list)  # (kind, is_comm, op) -> spans
    for kind, res in zip(ROW_KINDS, (measured, predicted), strict=True):
        for s in res.spans:
            is_comm = s.stream != "compute"
            if is_comm and not show_comm:
                continue
            groups[(kind, is_comm, s.action.op)].append(s)

    fig = go.Figure()
    t0s = {"measured": _t0(measured), "simulated": _t0(predicted)}
    ops = _op_order(op for _, _, op in groups)
    legend_done: set = set()
    # comm first so compute is drawn over it; measured before simulated per op
    for is_comm in (True, False):
        for op in ops:
            for kind in ROW_KINDS:
                items = groups.get((kind, is_comm, op))
                if not items:
                    continue
                items.sort(key=lambda s: (s.device, s.start, s.end, str(s.action)))
                fig.add_trace(
                    _bars(
                        items,
                        kind,
                        is_comm,
                        op,
                        t0s[kind],
                        pred_dur,
                        flags,
                        show_comm,
                        showlegend=op not in legend_done,
                    )
                )
                legend_done.add(op)

    ms_m, ms_p = measured.makespan * 1e3, predicted.makespan * 1e3
    if not title:
        sched = predicted.schedule
        err = _fmt_error(_relative_error(ms_m, ms_p))
        title = (
            f"{sched.strategy}: measured vs simulated · makespan measured {ms_m:.4g} ms, "
            f"simulated {ms_p:.4g} ms ({err})" + (f" · {len(flags)} flagged" if flags else "")
        )
    labels = row_labels(n_dev)
    apply_timeline_layout(
        fig, title=title, tickvals=list(range(len(labels))), ticktext=labels, x_max_ms=max(ms_m, ms_p)
    )
    # a faint line between devices, so each measured/simulated pair reads as one
    for d in range(1, n_dev):
        fig.add_hline(y=2 * d - 0.5, line={"color": "#BBBBBB", "width": 1})
    return fig


def _bars(
    items: list[Span],
    kind: str,
    is_comm: bool,
    op,
    t0: float,
    pred_dur: dict[tuple[int, str], float],
    flags: set[tuple[int, str]],
    show_comm: bool,
    *,
    showlegend: bool,
) -> go.Bar:
    n = len(items)
    y = np.empty(n, dtype=np.int32)
    base = np.empty(n, dtype=np.float64)
    dur = np.empty(n, dtype=np.float64)
    line_w = np.zeros(n, dtype=np.float64)
    text: list[str] = []
    hover: list[str] = []
    measured = kind == "measured"
    for k, s in enumerate(items):
        name = str(s.action)
        y[k] = _row(s.device, kind)
        start_ms = (s.start - t0) * 1e3
        dur_ms = (s.end - s.start) * 1e3
        base[k] = start_ms
        dur[k] = dur_ms
        text.append(name)
        lines = [f"<b>{name}</b> · d{s.device} {kind}", f"start {start_ms:.4f} ms · duration {dur_ms:.4f} ms"]
        if is_comm:
            peer = "" if s.peer is None else f"peer device {s.peer} · "
            lines.append(f"{peer}{int(s.nbytes):,d} bytes")
        elif measured:
            p = pred_dur.get((s.device, name))
            if p is None:
                lines.append("predicted: not simulated")
            else:
                rel = _relative_error(s.end - s.start, p)
                lines.append(f"predicted {p * 1e3:.4f} ms · error {_fmt_error(rel)}")
            if (s.device, name) in flags:
                line_w[k] = FLAG_WIDTH
                lines.append("<b>flagged</b>")
        hover.append("<br>".join(lines))
    if is_comm:
        width, offset = _COMM_WIDTH, _COMM_OFFSET - _COMM_WIDTH / 2
    elif show_comm:
        width, offset = _COMPUTE_WIDTH_WITH_COMM, -_COMPUTE_WIDTH / 2
    else:
        width, offset = _COMPUTE_WIDTH, None
    marker: dict = {"color": PALETTE.get(op, "#7F7F7F")}
    if measured and not is_comm and line_w.any():
        marker["line"] = {"color": FLAG_COLOR, "width": line_w}
    else:
        marker["line"] = {"width": 0}
    bar = go.Bar(
        name=op.value,
        legendgroup=op.value,
        showlegend=showlegend,
        orientation="h",
        y=y,
        base=np.round(base, 9).tolist(),
        x=np.round(dur, 9),
        width=width,
        marker=marker,
        opacity=(0.5 if is_comm else 1.0) * (1.0 if measured else _SIMULATED_OPACITY),
        text=text,
        textposition="none",
        hovertext=hover,
        hovertemplate="%{hovertext}<extra>%{fullData.name}</extra>",
        legendrank=OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER),
        meta={"row_kind": kind, "stream": "comm" if is_comm else "compute"},
    )
    if offset is not None:
        bar.offset = offset
    return bar


def write_overlay_html(measured: SimResult, predicted: SimResult, path: str | Path, **kw) -> Path:
    """Write the overlay as a self-contained page (plotly.js inlined, fixed
    ``div_id``, so the same inputs give the same bytes) and, where a browser
    for kaleido exists, a PNG of it next to the page. Keyword arguments go to
    :func:`overlay_figure`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = overlay_figure(measured, predicted, **kw)
    fig.write_html(
        path, include_plotlyjs=True, full_html=True, div_id=DIV_ID, config={"displaylogo": False, "scrollZoom": True}
    )
    if png_supported():
        write_png(fig, path.with_suffix(".png"))
    return path


# ---------------------------------------------------------------------------
# merged Chrome trace
# ---------------------------------------------------------------------------


def _rename_processes(events: list[dict], label: str, pid_offset: int, flow_offset: int) -> list[dict]:
    """Copies of ``events`` moved to pid + ``pid_offset``, processes renamed
    and sorted pairwise, flow ids shifted by ``flow_offset``."""
    sort_bias = 0 if pid_offset == 0 else 1
    out = []
    for ev in events:
        ev = dict(ev)
        dev = ev.get("pid")
        if dev is not None:
            ev["pid"] = dev + pid_offset
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            ev["args"] = {"name": f"{label} device {dev}"}
        elif ev.get("ph") == "M" and ev.get("name") == "process_sort_index":
            ev["args"] = {"sort_index": 2 * dev + sort_bias}
        elif ev.get("ph") in ("s", "f") and flow_offset:
            ev["id"] = ev["id"] + flow_offset
        out.append(ev)
    return out


def _flow_ids(events: list[dict]) -> list[int]:
    return [ev["id"] for ev in events if ev.get("ph") in ("s", "f")]


def _flow_offset(measured_ids: list[int], predicted_ids: list[int]) -> int:
    """Shift for the simulated flow ids: the smallest power of ten that lifts
    them all above the measured ones, so a shifted id still reads as its
    original (1007 is simulated flow 7 when the offset is 1000)."""
    if not measured_ids or not predicted_ids:
        return 0
    need = max(measured_ids) - min(predicted_ids) + 1
    if need <= 0:
        return 0
    offset = 10
    while offset < need:
        offset *= 10
    return offset


def merged_trace(measured: SimResult, predicted: SimResult) -> dict:
    """One Chrome trace of both runs: measured device d as pid d ("measured
    device d"), simulated device d as pid 1000 + d ("simulated device d"),
    ordered measured d0, simulated d0, measured d1, ...

    Times stay each executor's own (both start at their first action); flow
    ids of the simulated half are shifted (see :func:`_flow_offset`) because
    Perfetto binds flow arrows by id across the whole trace.
    """
    devices = [s.device for s in measured.spans] + [s.device for s in predicted.spans]
    if any(d >= SIMULATED_PID_OFFSET or d < 0 for d in devices):
        raise ValueError(f"device ids must lie in [0, {SIMULATED_PID_OFFSET}) to merge traces")
    m, p = chrome_trace(measured), chrome_trace(predicted)
    m_events, p_events = m["traceEvents"], p["traceEvents"]
    offset = _flow_offset(_flow_ids(m_events), _flow_ids(p_events))
    events = _rename_processes(m_events, "measured", 0, 0) + _rename_processes(
        p_events, "simulated", SIMULATED_PID_OFFSET, offset
    )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "pipesim",
            "merged": True,
            "simulated_pid_offset": SIMULATED_PID_OFFSET,
            "simulated_flow_offset": offset,
            "measured": m.get("otherData", {}),
            "simulated": p.get("otherData", {}),
        },
    }


def write_merged_trace(measured: SimResult, predicted: SimResult, path: str | Path) -> Path:
    """Write :func:`merged_trace` with :func:`pipesim.experiments.trace.dumps` (same
    inputs, same bytes) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(merged_trace(measured, predicted)), encoding="utf-8")
    return path

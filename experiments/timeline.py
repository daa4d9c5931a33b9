"""Interactive timeline of one execution: who computes what, when.

:func:`timeline_figure` turns a :class:`~pipesim.sim.engine.results.SimResult` into a
plotly figure with one row per device (``device 0`` at the top), compute spans
as horizontal bars coloured by action type and, on a thinner sub-row
``device N comm`` under each device, sends, receives and collectives. Idle
time is left empty on a light-grey background, so bubbles are the grey gaps;
each row label carries the device's bubble fraction (1 − busy compute time /
makespan, as in ``docs/concepts/accounting.md``).

Bars are grouped into **one trace per action type** (F, B, I, W, UPDATE,
PREDICT, SEND_F, RECV_F, SEND_B, RECV_B, REDUCE_GRAD, AVERAGE), never one
trace per span; numbers travel as binary arrays, so a 100k-span schedule stays
a few megabytes of HTML. Beyond ``max_spans`` spans in total the communication
rows are dropped (compute is always drawn in full) and a note says so; the
Chrome trace (:mod:`pipesim.experiments.trace`) always holds everything.

:func:`write_timeline_html` writes a self-contained page (plotly.js inlined,
fixed ``div_id``): the same result gives byte-identical HTML.
"""

from __future__ import annotations

from collections import defaultdict
from operator import attrgetter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from _plotly_utils.utils import to_typed_array_spec

from pipesim.sim.engine.metrics import bubble_fractions
from pipesim.sim.engine.results import SimResult
from pipesim.sim.ir.core import MICROBATCH_OPS, P2P_OPS, Op, format_action

#: Fixed colour of every action type, shared by all pipesim figures.
PALETTE: dict[Op, str] = {
    Op.FORWARD: "#4C78A8",  # blue
    Op.BACKWARD: "#F58518",  # orange
    Op.BACKWARD_INPUT: "#E45756",  # red
    Op.BACKWARD_WEIGHT: "#54A24B",  # green
    Op.UPDATE: "#7B3294",  # purple
    Op.PREDICT: "#EECA3B",  # yellow
    Op.AVERAGE: "#8C564B",  # brown
    Op.REDUCE_GRAD: "#D62728",  # dark red
    Op.SEND_F: "#17BECF",  # cyan
    Op.RECV_F: "#9EDAE5",  # light cyan
    Op.SEND_B: "#BCBD22",  # olive
    Op.RECV_B: "#DBDB8D",  # light olive
}

#: Trace (and legend) order.
OP_ORDER: tuple[Op, ...] = tuple(PALETTE)

#: Background of the plot area: what an idle (bubble) slot looks like.
IDLE_COLOR = "#EDEDED"

DIV_ID = "pipesim-timeline"
DEFAULT_MAX_SPANS = 20_000

_COMPUTE_WIDTH = 0.8
_COMM_WIDTH = 0.45

#: Span fields read in bulk (``map`` over a C getter, not a comprehension per field).
_DEVICE, _START, _END = attrgetter("device"), attrgetter("start"), attrgetter("end")
_STREAM, _ACTION = attrgetter("stream"), attrgetter("action")


def device_bubbles(result: SimResult) -> list[float]:
    """Bubble fraction of every device (:func:`pipesim.sim.engine.metrics.bubble_fractions`)."""
    return bubble_fractions(result)


def _hovertemplate(op: Op, all_versions: bool, comm: bool) -> str:
    # customdata columns: stage, microbatch, version, duration (ms)[, peer, bytes]
    parts = ["stage %{customdata[0]:d}"]
    if op in MICROBATCH_OPS:
        parts.append("mb %{customdata[1]:d}")
    if all_versions:
        parts.append("version %{customdata[2]:d}")
    lines = [
        "<b>%{text}</b>",
        " · ".join(parts),
        "start %{base:.4f} ms · duration %{customdata[3]:.4f} ms",
    ]
    if comm:
        peer = "peer device %{customdata[4]:d} · " if op in P2P_OPS else ""
        lines.append(peer + "%{customdata[5]:,d} bytes")
    return "<br>".join(lines) + "<extra>%{fullData.name}</extra>"


def timeline_layout(*, title: str, tickvals: list, ticktext: list, x_max_ms: float) -> dict:
    """The look every timeline shares, as ``update_layout`` arguments: rows
    top to bottom on an idle-coloured background, time in ms, the legend of
    actions on top."""
    n_rows = len(tickvals)
    return {
        "title": {"text": title},
        "barmode": "overlay",
        "plot_bgcolor": IDLE_COLOR,
        "paper_bgcolor": "white",
        "height": int(170 + 34 * max(n_rows, 1)),
        "margin": {"l": 10, "r": 10, "t": 80, "b": 50},
        "legend": {
            "orientation": "h",
            "yanchor": "bottom",
            "y": 1.0,
            "xanchor": "left",
            "x": 0.0,
            "title": {"text": "action"},
        },
        "hoverlabel": {"align": "left"},
        "xaxis": {
            "title": {"text": "time (ms)"},
            "range": [0, x_max_ms if x_max_ms > 0 else 1],
            "showgrid": False,
            "zeroline": False,
        },
        "yaxis": {
            "tickmode": "array",
            "tickvals": tickvals,
            "ticktext": ticktext,
            "range": [n_rows - 0.5, -0.5],
            "showgrid": False,
            "zeroline": False,
            "automargin": True,
        },
    }


def apply_timeline_layout(fig: go.Figure, *, title: str, tickvals: list, ticktext: list, x_max_ms: float) -> None:
    """Give ``fig`` the look every timeline shares (:func:`timeline_layout`)."""
    fig.update_layout(**timeline_layout(title=title, tickvals=tickvals, ticktext=ticktext, x_max_ms=x_max_ms))


def timeline_figure(
    result: SimResult,
    title: str | None = None,
    *,
    show_comm: bool | None = None,
    max_spans: int = DEFAULT_MAX_SPANS,
) -> go.Figure:
    """Timeline of ``result`` (see the module doc).

    ``show_comm``: draw the ``device N comm`` rows; ``None`` (default) draws
    them unless the result has more than ``max_spans`` spans in all.
    """
    bars, fig = _timeline_parts(result, title, show_comm, max_spans)
    for props in bars:
        fig.add_trace(go.Bar(**props))
    return fig


def timeline_dict(
    result: SimResult,
    title: str | None = None,
    *,
    show_comm: bool | None = None,
    max_spans: int = DEFAULT_MAX_SPANS,
) -> dict:
    """``timeline_figure(...).to_dict()``, without plotly's validation.

    A figure object checks and copies every element of every array it is
    given, and again when it is written: over a second for 131k bars. The
    bar properties built here are valid by construction, so they go straight
    into the dict, arrays encoded as plotly's typed-array specs exactly as
    the figure would encode them; only the small layout goes through plotly.
    """
    bars, fig = _timeline_parts(result, title, show_comm, max_spans)
    layout = fig.to_dict()["layout"]
    return {"data": [_plain_bar(props) for props in bars], "layout": layout}


def _plain_bar(props: dict) -> dict:
    """A bar trace as ``Figure.to_dict()`` spells it: properties in plotly's
    (alphabetical) order, numpy arrays as typed-array specs, then its type."""
    out = {k: to_typed_array_spec(v) if isinstance(v, np.ndarray) else v for k, v in sorted(props.items())}
    out["type"] = "bar"
    return out


def _timeline_parts(
    result: SimResult, title: str | None, show_comm: bool | None, max_spans: int
) -> tuple[list[dict], go.Figure]:
    """The bar properties of every trace (in trace order) and a figure with
    no traces that holds the layout."""
    spans = result.spans
    bubbles = device_bubbles(result)
    comm_spans = sum(map("compute".__ne__, map(_STREAM, spans)))
    if show_comm is None:
        show_comm = len(spans) <= max_spans
    comm_dropped = 0 if show_comm else comm_spans
    has_comm = show_comm and comm_spans > 0
    rows_per_dev = 2 if has_comm else 1
    bounds = result.span_bounds()
    t0 = bounds[0] if bounds is not None else 0.0

    bars = [_op_bar(op, items, rows_per_dev, t0) for op, items in _spans_by_op(spans, has_comm)]
    fig = go.Figure()
    tickvals, ticktext = _rows(bubbles, has_comm)
    makespan_ms = result.makespan * 1e3
    apply_timeline_layout(
        fig,
        title=title if title is not None else _title(result, bubbles),
        tickvals=tickvals,
        ticktext=ticktext,
        x_max_ms=makespan_ms,
    )
    if comm_dropped:
        fig.add_annotation(
            text=(
                f"communication rows omitted: {comm_dropped} transfer/collective spans "
                f"(more than {max_spans} spans in all; the Chrome trace has them)"
            ),
            xref="paper",
            yref="paper",
            x=0.0,
            y=-0.02,
            yanchor="top",
            xanchor="left",
            showarrow=False,
            font={"size": 11, "color": "#555555"},
        )
    return bars, fig


def _rows(bubbles: list[float], has_comm: bool) -> tuple[list[int], list[str]]:
    """Row positions and labels: device d's compute row, then (optionally) its comm row."""
    rows_per_dev = 2 if has_comm else 1
    tickvals: list[int] = []
    ticktext: list[str] = []
    for d, bubble in enumerate(bubbles):
        tickvals.append(d * rows_per_dev)
        ticktext.append(f"device {d} (bubble {100 * bubble:.1f}%)")
        if has_comm:
            tickvals.append(d * rows_per_dev + 1)
            ticktext.append(f"device {d} comm")
    return tickvals, ticktext


def _spans_by_op(spans, has_comm: bool) -> list[tuple[Op, "_Bars"]]:
    """``(op, bars)`` in trace order, each op's spans sorted by device and
    time (:func:`_sorted_bars`); communication spans only when their rows
    are drawn."""
    groups: dict[Op, list] = defaultdict(list)
    for s in spans:
        if has_comm or s.stream == "compute":
            groups[s.action.op].append(s)
    out = []
    for op in OP_ORDER + tuple(sorted(set(groups) - set(OP_ORDER), key=lambda o: o.value)):
        items = groups.get(op)
        if items:
            out.append((op, _sorted_bars(items)))
    return out


class _Bars(NamedTuple):
    """One op's spans in drawing order, with the columns the bars need."""

    spans: list
    devices: np.ndarray
    starts: np.ndarray
    ends: np.ndarray


def _sorted_bars(items: list) -> _Bars:
    """``items`` sorted by (device, start, end, action name), as columns.

    The three numeric keys are sorted as numpy columns (``lexsort`` is
    stable, like Python's sort); only runs of ties on all three need the
    action's name, which costs more to spell than the sort, so only those
    runs spell it."""
    n = len(items)
    devices = np.fromiter(map(_DEVICE, items), dtype=np.int64, count=n)
    starts = np.fromiter(map(_START, items), dtype=np.float64, count=n)
    ends = np.fromiter(map(_END, items), dtype=np.float64, count=n)
    order = np.lexsort((ends, starts, devices))
    devices, starts, ends = devices[order], starts[order], ends[order]
    spans = [items[i] for i in order.tolist()]
    tied = (devices[1:] == devices[:-1]) & (starts[1:] == starts[:-1]) & (ends[1:] == ends[:-1])
    for i, j in _runs(tied):
        spans[i:j] = sorted(spans[i:j], key=lambda s: str(s.action))
    return _Bars(spans, devices, starts, ends)


def _runs(tied: np.ndarray) -> list[tuple[int, int]]:
    """``[i, j)`` of every run of two or more items where ``tied[k]`` says
    item k+1 equals item k."""
    if not tied.any():
        return []
    edges = np.diff(np.concatenate(([0], tied.astype(np.int8), [0])))
    return list(zip(np.flatnonzero(edges == 1).tolist(), (np.flatnonzero(edges == -1) + 1).tolist()))


def _names(op: Op, actions: list) -> list[str]:
    """Every action's spelling (``str``), the common shape of a pass (replica
    0, no prediction distance, a micro-batch and a version) spelt inline:
    this runs once per bar."""
    v = op.value
    return [
        f"{stage}{v}{mb}@v{ver}" if rep == 0 == dist and mb is not None and ver is not None else format_action(a)
        for a in actions
        for (_, stage, mb, ver, dist, rep) in (a,)
    ]


def _op_bar(op: Op, bars: _Bars, rows_per_dev: int, t0: float) -> dict:
    """The ``go.Bar`` properties of one trace holding every span of one
    action type, numbers as numpy arrays (binary in the page)."""
    items, starts, ends = bars.spans, bars.starts, bars.ends
    comm = items[0].stream != "compute"
    actions = list(map(_ACTION, items))
    y = bars.devices.astype(np.int32) * np.int32(rows_per_dev)
    if rows_per_dev > 1:  # the comm row under each device
        y += np.fromiter((s.stream != "compute" for s in items), dtype=np.int32, count=len(items))
    base = (starts - t0) * 1e3
    dur = (ends - starts) * 1e3
    columns = [
        [a.stage for a in actions],
        [-1 if a.microbatch is None else a.microbatch for a in actions],
        [-1 if a.version is None else a.version for a in actions],
    ]
    all_versions = all(a.version is not None for a in actions)
    if comm:
        columns += [[-1 if s.peer is None else s.peer for s in items], [s.nbytes for s in items]]
    # compute traces: float32 is exact for ids below 2**24 and ample for
    # hover durations, and halves the HTML; comm keeps float64 for bytes.
    custom = np.empty((len(items), 6 if comm else 4), dtype=np.float64 if comm else np.float32)
    for k, col in enumerate(columns[:3]):
        custom[:, k] = col
    custom[:, 3] = dur
    for k, col in enumerate(columns[3:], 4):
        custom[:, k] = col
    return {
        "name": op.value,
        "orientation": "h",
        "y": y,
        "base": np.round(base, 9).tolist(),
        "x": np.round(dur, 9),
        "width": _COMM_WIDTH if comm else _COMPUTE_WIDTH,
        "marker": {"color": PALETTE.get(op, "#7F7F7F"), "line": {"width": 0}},
        "opacity": 0.85 if comm else 1.0,
        "text": _names(op, actions),
        "textposition": "none",
        "customdata": np.round(custom, 9) if comm else custom,
        "hovertemplate": _hovertemplate(op, all_versions, comm),
        "legendrank": OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER),
    }


def _title(result: SimResult, bubbles: list[float]) -> str:
    sched = result.schedule
    overall = sum(bubbles) / len(bubbles) if bubbles else 0.0
    return (
        f"{sched.strategy}: {sched.num_stages} stages, {sched.num_devices} devices, "
        f"m = {sched.num_microbatches}"
        + (f", {sched.num_iterations} iterations" if sched.num_iterations > 1 else "")
        + (f", {sched.num_replicas} replicas" if sched.num_replicas > 1 else "")
        + f" · makespan {result.makespan * 1e3:.4g} ms · bubble {100 * overall:.1f}%"
    )


def write_timeline_html(result: SimResult, path: str | Path, title: str | None = None, **kwargs) -> Path:
    """Write the timeline as a self-contained HTML page (plotly.js inlined);
    byte-identical for the same result. Extra keyword arguments go to
    :func:`timeline_figure`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = timeline_dict(result, title=title, **kwargs)
    html = pio.to_html(
        fig,
        validate=False,
        include_plotlyjs=True,
        full_html=True,
        div_id=DIV_ID,
        config={"displaylogo": False, "scrollZoom": True},
    )
    path.write_text(html, "utf-8")
    return path

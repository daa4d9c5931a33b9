"""The "what if" figure and table: other schedules beside a measured run.

:func:`pipesim.sim.planning.whatif.what_if` prices strategies and
micro-batch counts with a measured run's own costs; this module draws them
beside the run (three panels: throughput, bubble fraction, peak stash,
one group of bars per micro-batch count, one colour per strategy, the
measured run as a dashed line) and prints them as a table.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pipesim.experiments.export import write_png
from pipesim.experiments.figures import STRATEGY_COLORS
from pipesim.sim.engine.metrics import round_sig
from pipesim.sim.planning.whatif import WhatIf


def whatif_figure(rows: Sequence[WhatIf], measured: dict, title: str) -> go.Figure:
    """Bars of every what-if row; ``measured`` holds the run's own
    ``strategy``, ``microbatches``, ``samples_per_s``, ``bubble_fraction``
    and ``peak_stash`` (any may be None), drawn as dashed lines."""
    unit = rows[0].peak_unit if rows else "micro-batches"
    panels = [
        ("throughput (samples/s)", "samples_per_s"),
        ("bubble fraction", "bubble_fraction"),
        (f"peak stash ({unit}, worst device)", "peak_stash"),
    ]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[t for t, _ in panels], horizontal_spacing=0.08)
    strategies = list(dict.fromkeys(r.strategy for r in rows))
    for i, name in enumerate(strategies):
        mine = [r for r in rows if r.strategy == name]
        for col, (label, key) in enumerate(panels, start=1):
            fig.add_trace(
                go.Bar(
                    x=[f"m = {r.microbatches}" for r in mine],
                    y=[getattr(r, key) for r in mine],
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    marker_color=STRATEGY_COLORS[i % len(STRATEGY_COLORS)],
                    hovertemplate=f"{name}, %{{x}}<br>{label}: %{{y:.4g}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
    run = f"measured: {measured.get('strategy') or 'the run'}, m = {measured.get('microbatches')}"
    for col, (_, key) in enumerate(panels, start=1):
        value = measured.get(key)
        if value is not None:
            fig.add_hline(
                y=value,
                line_dash="dash",
                line_color="#333333",
                row=1,
                col=col,
                annotation_text=run if col == 1 else "measured",
                annotation_position="top left",
            )
    fig.update_layout(title={"text": title}, barmode="group", template="plotly_white", height=480, margin={"t": 90})
    return fig


def write_whatif(rows: Sequence[WhatIf], measured: dict, title: str, out_dir: str | Path) -> Path:
    """``whatif.json``, ``whatif.html`` and ``whatif.png`` (where a browser is present) in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"measured": {k: _rounded(v) for k, v in sorted(measured.items())}, "what_if": [r.to_json() for r in rows]}
    (out_dir / "whatif.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    fig = whatif_figure(rows, measured, title)
    html = out_dir / "whatif.html"
    fig.write_html(html, include_plotlyjs=True, full_html=True, div_id="pipesim-whatif")
    write_png(fig, out_dir / "whatif.png", width=1500, height=480)
    return html


def _rounded(v):
    return round_sig(v) if isinstance(v, float) else v


def format_whatif(rows: Sequence[WhatIf], measured: dict) -> str:
    """The rows as a text table, the measured run first."""
    unit = rows[0].peak_unit if rows else "micro-batches"
    head = f"{'strategy':<18} {'m':>4} {'iteration':>11} {'bubble':>7} {'peak stash':>11}  note"
    lines = [head, "-" * len(head)]

    def cell(v, fmt):
        """``v`` formatted, or a dash as wide (``fmt`` starts ">WIDTH")."""
        width = fmt[1:].split(".")[0].rstrip("gd%")
        return format("-", f">{width}") if v is None else format(v, fmt)

    lines.append(
        f"{'measured ' + str(measured.get('strategy') or ''):<18} {cell(measured.get('microbatches'), '>4')} "
        f"{cell(measured.get('iteration_s'), '>10.4g')}s {cell(measured.get('bubble_fraction'), '>7.1%')} "
        f"{cell(measured.get('peak_stash'), '>11')}"
    )
    for r in rows:
        lines.append(
            f"{r.strategy:<18} {r.microbatches:>4} {cell(r.iteration_s, '>10.4g')}s "
            f"{cell(r.bubble_fraction, '>7.1%')} {cell(r.peak_stash, '>11')}  {r.note}"
        )
    lines.append(f"(peak stash in {unit} per device; iteration = one update's micro-batches)")
    return "\n".join(lines)

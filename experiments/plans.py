"""What a plan looks like to a reader: its table, ``plan.json`` and the Pareto figure.

Every function here takes the plan *record*, the JSON document of
:class:`pipesim.sim.planning.plan.Plan` (``Plan.to_json()``, or ``plan.json``
read back), so any planner that writes that record (PipeDream's here;
PipeDream-2BW's width, depth and micro-batch search, an AvgPipe tuner) gets the
same outputs without code of its own:

* :func:`render_plan`: the terminal summary (the configuration, its stages,
  the predicted and data-parallel throughput, the best candidates);
* :func:`pareto_figure`: throughput against peak memory per device, one point
  per candidate (filled when the engine confirmed it, hollow when only the
  cost model did), candidates that do not fit in memory apart (red crosses,
  right of the device's capacity line), the frontier of those that fit, the
  chosen one starred, data parallelism's throughput as a dashed line;
* :func:`write_plan`: ``plan.json``, ``pareto.html`` (self-contained) and
  ``pareto.png`` when a browser is present.
"""

from __future__ import annotations

import json
from pathlib import Path

import plotly.graph_objects as go

from pipesim.experiments.export import write_png

GIB = 2**30
#: Rows of candidates :func:`render_plan` lists.
SHOWN_CANDIDATES = 8


def _throughput(c: dict) -> float:
    s = c.get("simulated_samples_per_s")
    return c["analytic_samples_per_s"] if s is None else s


def _label(c: dict) -> str:
    params = "".join(f", {k} {v}" for k, v in sorted(c.get("params", {}).items()))
    return f"{c['config']}{_cuts(c)} ({c['source']}{params})"


def _cuts(c: dict) -> str:
    """Where a pipeline is cut (" |9,12": after layers 9 and 12), so that
    two splits of one configuration can be told apart."""
    cuts = ",".join(str(s["layers"][1]) for s in c["stages"][:-1])
    return f" |{cuts}" if cuts else ""


def _hover(c: dict) -> str:
    stages = " | ".join(f"{s['layers'][0]}-{s['layers'][1]} x{s['replicas']}" for s in c["stages"])
    sim = c.get("simulated_samples_per_s")
    return (
        f"<b>{c['config']}</b> ({c['source']})<br>layers x replicas: {stages}<br>"
        f"analytic {c['analytic_samples_per_s']:.1f} samples/s<br>"
        + (f"simulated {sim:.1f} samples/s<br>" if sim is not None else "not simulated<br>")
        + f"peak memory {c['peak_memory_bytes'] / GIB:.2f} GiB<br>bottleneck: {c.get('bottleneck', '')}"
    )


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other beats on both counts (less memory, more throughput),
    by memory."""
    out: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not out or y > out[-1][1]:
            out.append((x, y))
    return out


def pareto_figure(plan: dict) -> go.Figure:
    """The Pareto figure of a plan record (see the module doc)."""
    cands = plan["candidates"]
    chosen = plan["chosen"]
    fig = go.Figure()
    groups = (
        (
            "confirmed by the engine",
            lambda c: not c["out_of_memory"] and c.get("simulated_samples_per_s") is not None,
            {"symbol": "circle", "size": 11, "color": "#1F77B4"},
        ),
        (
            "cost model only",
            lambda c: not c["out_of_memory"] and c.get("simulated_samples_per_s") is None,
            {"symbol": "circle-open", "size": 11, "color": "#1F77B4", "line": {"width": 2}},
        ),
        ("out of memory", lambda c: c["out_of_memory"], {"symbol": "x", "size": 11, "color": "#C0392B"}),
    )
    for name, keep, marker in groups:
        picked = [c for c in cands if keep(c)]
        if picked:
            fig.add_trace(
                go.Scatter(
                    x=[c["peak_memory_bytes"] / GIB for c in picked],
                    y=[_throughput(c) for c in picked],
                    mode="markers",
                    name=name,
                    marker=marker,
                    text=[_hover(c) for c in picked],
                    hovertemplate="%{text}<extra></extra>",
                )
            )
    front = frontier([(c["peak_memory_bytes"] / GIB, _throughput(c)) for c in cands if not c["out_of_memory"]])
    if len(front) > 1:
        fig.add_trace(
            go.Scatter(
                x=[x for x, _ in front],
                y=[y for _, y in front],
                mode="lines",
                name="Pareto frontier",
                line={"color": "#7F7F7F", "dash": "dot", "shape": "hv"},
                hoverinfo="skip",
            )
        )
    best = cands[chosen]
    fig.add_trace(
        go.Scatter(
            x=[best["peak_memory_bytes"] / GIB],
            y=[_throughput(best)],
            mode="markers+text",
            name=f"chosen: {best['config']}",
            text=[best["config"]],
            textposition="top center",
            marker={"symbol": "star", "size": 20, "color": "#FFB000", "line": {"width": 1, "color": "#000000"}},
            hovertext=[_hover(best)],
            hovertemplate="%{hovertext}<extra></extra>",
        )
    )
    limit = plan.get("memory_limit_bytes")
    if limit:
        fig.add_vline(
            x=limit / GIB,
            line_dash="dash",
            line_color="#C0392B",
            annotation_text="device memory",
            annotation_position="top left",
        )
    dp = plan.get("data_parallel_samples_per_s")
    if dp:
        fig.add_hline(
            y=dp,
            line_dash="dash",
            line_color="#2CA02C",
            annotation_text=f"data parallelism, {dp:.0f} samples/s",
            annotation_position="bottom right",
        )
    speedup = plan.get("speedup_vs_dp")
    fig.update_layout(
        title={
            "text": f"{plan['strategy']} on {plan['gpus']} devices of {plan['hardware']}, {plan['model']}: "
            f"chose {plan['config']}" + (f", {speedup:.2f}x data parallelism" if speedup else "")
        },
        xaxis_title="peak memory per device (GiB)",
        yaxis_title="throughput (samples/s)",
        template="plotly_white",
        width=1100,
        height=600,
        legend={"x": 1.01, "y": 1.0},
    )
    return fig


def write_plan(plan: dict, out_dir: str | Path) -> list[Path]:
    """``plan.json``, ``pareto.html`` and, when possible, ``pareto.png`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "plan.json"
    path.write_text(json.dumps(plan, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    fig = pareto_figure(plan)
    html = out / "pareto.html"
    fig.write_html(html, include_plotlyjs=True, full_html=True, div_id="pipesim-pareto", config={"displaylogo": False})
    written = [path, html]
    if write_png(fig, out / "pareto.png", width=1100, height=600):
        written.append(out / "pareto.png")
    return written


def render_plan(plan: dict) -> str:
    """The plan as text for a terminal."""
    best = plan["candidates"][plan["chosen"]]
    width = plan.get("width")
    per = (
        f"{plan['microbatches']} micro-batches per iteration"
        if width is None
        else f"{plan['microbatches']} micro-batches per pipeline per iteration, {plan['microbatches'] * width} in all"
    )
    lines = [
        f"{plan['strategy']} on {plan['gpus']} devices of {plan['hardware']}, {plan['model']} "
        f"(micro-batch {plan['microbatch_size']}, {per})"
    ]
    if not plan["predicted_is_simulated"]:
        how = "cost model only: no candidate simulated"
    elif plan.get("predicted_is_steady", True):
        how = "simulated, steady state"
    else:
        how = f"simulated over the whole run of {plan['iterations']} iteration(s), too short for a steady state"
    held = f" among splits of {plan['held_to']} only" if plan.get("held_to") else ""
    flushes = best.get("params", {}).get("flushes")  # an update in several flushes (GPipe)
    runs = f" in {flushes} flushes" if flushes else ""
    lines.append(f"chosen{held}: {plan['config']}{runs}, {plan['predicted_samples_per_s']:.1f} samples/s ({how})")
    dp, speedup = plan.get("data_parallel_samples_per_s"), plan.get("speedup_vs_dp")
    if dp:
        lines.append(f"data parallelism on the same {plan['gpus']} devices: {dp:.1f} samples/s; speedup {speedup:.2f}x")
    lines.append(
        f"peak memory {best['peak_memory_bytes'] / GIB:.2f} GiB per device"
        + (f" of {plan['memory_limit_bytes'] / GIB:.2f} GiB" if plan.get("memory_limit_bytes") else "")
        + f"; bottleneck: {best.get('bottleneck', '')}"
    )
    lines.append("stages:")
    for k, s in enumerate(best["stages"]):
        # a width plan's stage has one replica in each pipeline; pipelines may share devices (AvgPipe)
        where = (
            (f"in each of {width} pipelines" if width > 1 else "in its one pipeline")
            if width is not None
            else f"on {s['replicas']} device{'s' if s['replicas'] > 1 else ''}"
        )
        lines.append(f"  stage {k}: layers {s['layers'][0]}-{s['layers'][1]} {where}")
    lines.append(f"candidates ({len(plan['candidates'])}, best first; planner {plan['planner_seconds']:.2f} s):")
    ranked = sorted(
        range(len(plan["candidates"])),
        key=lambda i: (
            plan["candidates"][i]["out_of_memory"],
            plan["candidates"][i].get("simulated_samples_per_s") is None,
            -_throughput(plan["candidates"][i]),
        ),
    )
    for i in ranked[:SHOWN_CANDIDATES]:
        c = plan["candidates"][i]
        sim = c.get("simulated_samples_per_s")
        lines.append(
            f"  {'*' if i == plan['chosen'] else ' '} {_label(c):48s} "
            f"{'sim ' + format(sim, '9.1f') if sim is not None else 'model ' + format(c['analytic_samples_per_s'], '7.1f')}"
            f"  {c['peak_memory_bytes'] / GIB:6.2f} GiB{'  OOM' if c['out_of_memory'] else ''}"
            f"{'  ' + c['note'] if c.get('note') else ''}"
        )
    return "\n".join(lines)

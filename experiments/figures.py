r"""Paper-style figures built from many simulations.

:func:`bubble_figure` draws the bubble fraction against the number of
micro-batches m for every strategy at p = 4 and p = 8 pipeline stages,
simulated on the ``uniform`` model and ``ideal`` hardware, beside the analytic
curves. It writes ``bubbles.html`` (self-contained), ``bubbles.json`` (the
plotted numbers) and ``bubbles.png`` when :func:`pipesim.experiments.export.write_png`
can.

Analytic curves
---------------
Bubble fraction here is always a fraction of the makespan, as the simulator
counts it: 1 − busy / makespan for a device (``docs/concepts/accounting.md``). With
every device doing the same work the makespan is ideal time + bubble time, so a
formula stated as "bubble = r × ideal time" becomes ``r / (1 + r)`` of the
makespan.

* GPipe and 1F1B-flush: ideal time m(T_F+T_B), bubble (p−1)(T_F+T_B), so the
  fraction is (p−1)(T_F+T_B) / ((m+p−1)(T_F+T_B)) = **(p−1)/(m+p−1)**.
* Interleaved 1F1B with v chunks per device (Narayanan et al. SC'21): each
  chunk costs (T_F+T_B)/v, the warm-up and drain shrink to
  (p−1)(T_F+T_B)/v, i.e. bubble = (p−1)/(v·m) of the ideal time
  m(T_F+T_B). As a fraction of the makespan:
  r/(1+r) with r = (p−1)/(v·m), that is **(p−1)/(v·m + p−1)**.
  Drawn for m ≥ p (Megatron's form needs m a multiple of p).
* ZB-H1 (Qi et al. ICLR'24), backward split into input gradient I and weight
  gradient W: ideal time per device m(T_F+T_I+T_W), bubble
  (p−1)(T_F+T_I−T_W), so the fraction is
  (p−1)(T_F+T_I−T_W) / (m(T_F+T_I+T_W) + (p−1)(T_F+T_I−T_W)).
  With T_F = T_I = T_W = 1 (the uniform model: T_B = 2 T_F split evenly):
  **(p−1)/(3m + p−1)**. Drawn for m ≥ p, where ZB-H1 is defined.

Strategies that say they need m ≥ p (``Strategy.needs_m_ge_p``: interleaved,
2BW, zero-bubble) are not drawn below p, where their papers do not define them
(2BW refuses such a run; interleaved and zero-bubble build one, which
``simulate`` runs, but it is not the schedule the curves describe); a simulation that rejects its
parameters (an :class:`~pipesim.sim.errors.InputError`) is skipped and listed
in ``bubbles.json`` under ``"skipped"``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pipesim.experiments.export import png_skipped_reason, write_png
from pipesim.sim.engine.metrics import round_sig
from pipesim.sim.errors import InputError

DEFAULT_MICROBATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_STAGES: tuple[int, ...] = (4, 8)

#: Colours of the simulated strategies, by position in the strategy list.
STRATEGY_COLORS: tuple[str, ...] = (
    "#1F77B4",
    "#FF7F0E",
    "#2CA02C",
    "#D62728",
    "#9467BD",
    "#8C564B",
    "#E377C2",
    "#7F7F7F",
    "#BCBD22",
    "#17BECF",
    "#393B79",
    "#AD494A",
)
ANALYTIC_STYLE = {
    "gpipe_1f1b": ("analytic GPipe / 1F1B: (p−1)/(m+p−1)", "#000000"),
    "interleaved": ("analytic interleaved: (p−1)/({v}m+p−1)", "#555555"),  # v: the chunks drawn
    "zb_h1": ("analytic ZB-H1: (p−1)/(3m+p−1)", "#2E7D32"),
}

Simulate = Callable[[str, int, int], float]


# ---------------------------------------------------------------------------
# Analytic bubble fractions (fractions of the makespan)
# ---------------------------------------------------------------------------


def bubble_gpipe(p: int, m: int) -> float:
    """GPipe / 1F1B-flush: (p−1)/(m+p−1)."""
    return (p - 1) / (m + p - 1)


def bubble_interleaved(p: int, m: int, v: int = 2) -> float:
    """Interleaved 1F1B, v chunks: bubble (p−1)/(v·m) of ideal time, i.e.
    (p−1)/(v·m + p−1) of the makespan."""
    r = (p - 1) / (v * m)
    return r / (1 + r)


def bubble_zb_h1(p: int, m: int, t_f: float = 1.0, t_i: float = 1.0, t_w: float = 1.0) -> float:
    """ZB-H1: bubble (p−1)(T_F+T_I−T_W) over makespan
    m(T_F+T_I+T_W) + (p−1)(T_F+T_I−T_W); (p−1)/(3m+p−1) for unit times."""
    bubble = (p - 1) * (t_f + t_i - t_w)
    return bubble / (m * (t_f + t_i + t_w) + bubble)


def needs_m_ge_p(strategy: str) -> bool:
    """Whether the strategy is defined only for m >= p (it says so itself);
    a name no strategy has is simulated, and skipped if it is rejected."""
    from pipesim.sim.strategies import find_strategy

    found = find_strategy(strategy)
    return found is not None and found.needs_m_ge_p


# ---------------------------------------------------------------------------
# Default simulation hook (the lead's API, imported lazily)
# ---------------------------------------------------------------------------


def default_simulate(strategy: str, stages: int, microbatches: int) -> float:
    """Bubble fraction of one simulation on the ``uniform`` model and
    ``ideal`` hardware, through :func:`pipesim.sim.api.simulate`."""
    from pipesim.sim.api import simulate
    from pipesim.sim.engine.metrics import summarize
    from pipesim.sim.strategies import ScheduleSpec

    spec = ScheduleSpec(strategy=strategy, stages=stages, microbatches=microbatches)
    result = simulate(spec, model="uniform", hardware="ideal")
    return float(summarize(result)["bubble_fraction"])


def default_strategies() -> list[str]:
    """Every registered strategy (:func:`pipesim.sim.strategies.strategy_names`)."""
    from pipesim.sim.strategies import strategy_names

    return strategy_names()


# ---------------------------------------------------------------------------
# The figure
# ---------------------------------------------------------------------------


_r = round_sig


def bubble_data(
    stages: Sequence[int] = DEFAULT_STAGES,
    microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
    strategies: Iterable[str] | None = None,
    simulate: Simulate | None = None,
    *,
    chunks: int = 2,
    progress: bool = True,
) -> dict:
    """Simulated and analytic numbers behind :func:`bubble_figure` (the
    content of ``bubbles.json``)."""
    stages = [int(p) for p in stages]
    microbatches = sorted({int(m) for m in microbatches})
    strategies = list(default_strategies() if strategies is None else strategies)
    sim = default_simulate if simulate is None else simulate

    plan = []
    skipped: list[dict] = []
    for p in stages:
        for name in strategies:
            for m in microbatches:
                if needs_m_ge_p(name) and m < p:
                    skipped.append(
                        {
                            "strategy": name,
                            "stages": p,
                            "microbatches": m,
                            "reason": "drawn for m >= p only, where the strategy is defined",
                        }
                    )
                else:
                    plan.append((p, name, m))
    simulated: dict[str, dict[str, dict[str, list]]] = {str(p): {} for p in stages}
    for k, (p, name, m) in enumerate(plan, start=1):
        try:
            value = float(sim(name, p, m))
        except InputError as e:  # the strategy rejects these sizes
            skipped.append({"strategy": name, "stages": p, "microbatches": m, "reason": str(e)})
            if progress:
                print(f"[{k}/{len(plan)}] p={p} m={m} {name}: skipped ({e})", file=sys.stderr, flush=True)
            continue
        if progress:
            print(f"[{k}/{len(plan)}] p={p} m={m} {name}: bubble {value:.4f}", file=sys.stderr, flush=True)
        series = simulated[str(p)].setdefault(name, {"m": [], "bubble": []})
        series["m"].append(m)
        series["bubble"].append(_r(value))

    analytic: dict[str, dict] = {}
    for p in stages:
        big = [m for m in microbatches if m >= p]
        analytic[str(p)] = {
            "gpipe_1f1b": {"m": list(microbatches), "bubble": [_r(bubble_gpipe(p, m)) for m in microbatches]},
            "interleaved": {"m": big, "bubble": [_r(bubble_interleaved(p, m, chunks)) for m in big]},
            "zb_h1": {"m": big, "bubble": [_r(bubble_zb_h1(p, m)) for m in big]},
        }
    return {
        "figure": "bubble fraction against micro-batches",
        "bubble_definition": "1 - busy compute time / makespan, mean over devices",
        "model": "uniform",
        "hardware": "ideal",
        "stages": stages,
        "microbatches": microbatches,
        "strategies": strategies,
        "interleaved_chunks": chunks,
        "zb_h1_times": {"T_F": 1, "T_I": 1, "T_W": 1},
        "analytic_formulas": {
            "gpipe_1f1b": "(p-1)/(m+p-1)",
            "interleaved": "(p-1)/(v*m+p-1)  [= r/(1+r), r=(p-1)/(v*m) of ideal time]",
            "zb_h1": "(p-1)(T_F+T_I-T_W)/(m(T_F+T_I+T_W)+(p-1)(T_F+T_I-T_W)) = (p-1)/(3m+p-1)",
        },
        "simulated": simulated,
        "analytic": analytic,
        "skipped": skipped,
    }


MARKERS = ("circle", "square", "diamond", "cross", "x", "triangle-up", "star", "hexagon", "triangle-down")


def figure_from_data(data: dict) -> go.Figure:
    """The plotly figure for a :func:`bubble_data` document."""
    stages = data["stages"]
    microbatches = data["microbatches"]
    strategies = data["strategies"]
    fig = make_subplots(
        rows=1,
        cols=len(stages),
        shared_yaxes=True,
        subplot_titles=[f"p = {p}" for p in stages],
        horizontal_spacing=0.06,
    )
    for col, p in enumerate(stages, start=1):
        for idx, name in enumerate(strategies):
            series = data["simulated"][str(p)].get(name)
            if not series or not series["m"]:
                continue
            fig.add_trace(
                go.Scatter(
                    x=series["m"],
                    y=series["bubble"],
                    mode="lines+markers",
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    line={"color": STRATEGY_COLORS[idx % len(STRATEGY_COLORS)], "width": 2},
                    # Several strategies share a curve exactly (1F1B, PipeDream,
                    # 2BW and SpecTrain have GPipe's bubble on uniform stages):
                    # later ones get smaller markers of another shape so the
                    # earlier ones still show underneath.
                    marker={
                        "size": max(14 - 1.2 * idx, 5),
                        "symbol": MARKERS[idx % len(MARKERS)],
                        "line": {"width": 1, "color": "white"},
                    },
                    hovertemplate=f"{name}<br>p = {p}, m = %{{x}}<br>bubble %{{y:.4f}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        for key, (template, color) in ANALYTIC_STYLE.items():
            label = template.format(v=data["interleaved_chunks"])
            series = data["analytic"][str(p)][key]
            if not series["m"]:
                continue
            fig.add_trace(
                go.Scatter(
                    x=series["m"],
                    y=series["bubble"],
                    mode="lines",
                    name=label,
                    legendgroup=key,
                    showlegend=col == 1,
                    line={"color": color, "width": 1.5, "dash": "dash"},
                    hovertemplate=f"{label}<br>p = {p}, m = %{{x}}<br>bubble %{{y:.4f}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(
            type="log",
            tickmode="array",
            tickvals=list(microbatches),
            ticktext=[str(m) for m in microbatches],
            title_text="micro-batches m (log₂ scale)",
            row=1,
            col=col,
        )
    fig.update_yaxes(title_text="bubble fraction", range=[0, 1.02], row=1, col=1)
    fig.update_yaxes(range=[0, 1.02])
    fig.update_layout(
        title={"text": f"Bubble fraction vs micro-batches ({data['model']} model, {data['hardware']} hardware)"},
        template="plotly_white",
        width=1300,
        height=560,
        legend={"orientation": "v", "x": 1.01, "y": 1.0},
    )
    return fig


def bubble_figure(
    out_dir: str | Path,
    stages: Sequence[int] = DEFAULT_STAGES,
    microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
    strategies: Iterable[str] | None = None,
    simulate: Simulate | None = None,
    *,
    chunks: int = 2,
    progress: bool = True,
    png: bool = True,
) -> Path:
    """Simulate, plot and write ``bubbles.html``, ``bubbles.json`` and, when
    possible, ``bubbles.png`` into ``out_dir``; return the HTML path.

    ``simulate(strategy, stages, microbatches) -> bubble fraction`` defaults
    to :func:`default_simulate`. ``chunks`` is v of the interleaved curve.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = bubble_data(stages, microbatches, strategies, simulate, chunks=chunks, progress=progress)
    (out / "bubbles.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    fig = figure_from_data(data)
    html = out / "bubbles.html"
    fig.write_html(html, include_plotlyjs=True, full_html=True, div_id="pipesim-bubbles", config={"displaylogo": False})
    if png:
        ok = write_png(fig, out / "bubbles.png", width=1300, height=560)
        if progress:
            print(
                "wrote bubbles.png" if ok else f"bubbles.png skipped ({png_skipped_reason()})",
                file=sys.stderr,
                flush=True,
            )
    return html


def comparison_figure(order: Sequence[str], summaries: dict[str, dict]) -> go.Figure:
    """Strategies side by side: throughput, bubble, peak memory, staleness.

    One bar per strategy in each panel, in the order they were simulated;
    the memory panel marks each device's capacity so out-of-memory shows.
    """
    first = summaries[order[0]]
    panels = [
        ("throughput (samples/s)", lambda s: s["throughput_samples_per_s"] or 0.0),
        ("bubble fraction", lambda s: s["bubble_fraction"]),
        ("peak memory (GiB, worst device)", lambda s: s["peak_memory_bytes_max"] / 2**30),
        ("max staleness (updates)", lambda s: max(i["staleness_max"] for i in s["stages_info"])),
    ]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[t for t, _ in panels], horizontal_spacing=0.07)
    colors = [STRATEGY_COLORS[i % len(STRATEGY_COLORS)] for i in range(len(order))]
    for col, (title, value) in enumerate(panels, start=1):
        ys = [value(summaries[name]) for name in order]
        fig.add_trace(
            go.Bar(
                x=list(order),
                y=ys,
                marker_color=colors,
                showlegend=False,
                hovertemplate=f"%{{x}}<br>{title}: %{{y:.4g}}<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.update_xaxes(tickangle=-45, row=1, col=col)
    capacity = first["devices"][0].get("memory_capacity_bytes") if first["devices"] else None
    if capacity:
        fig.add_hline(
            y=capacity / 2**30,
            line_dash="dash",
            line_color="#c0392b",
            row=1,
            col=3,
            annotation_text="device memory",
            annotation_position="top left",
        )
    meta = first.get("meta", {})
    fig.update_layout(
        title={
            "text": f"{meta.get('model')} on {meta.get('hardware')}: {first['stages']} stages, "
            f"{first['microbatches']} micro-batches, {first['iterations']} iteration(s)"
        },
        template="plotly_white",
        height=480,
        margin={"t": 90, "b": 120},
    )
    return fig


def write_comparison(order: Sequence[str], summaries: dict[str, dict], out_dir: str | Path) -> Path:
    """``comparison.html`` (self-contained) and ``comparison.png`` when a browser is present."""
    out_dir = Path(out_dir)
    fig = comparison_figure(order, summaries)
    html = out_dir / "comparison.html"
    fig.write_html(html, include_plotlyjs=True, full_html=True, div_id="pipesim-comparison")
    write_png(fig, out_dir / "comparison.png", width=1500, height=480)
    return html

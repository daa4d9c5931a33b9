"""What every paper's reproduction shares: its shape, the comparison with the
published values, and the figure of predicted bars beside published ones.

A paper's module (``pipesim.experiments.reproduce.<paper>``) defines one
:class:`Paper`. Prediction and comparison are kept apart on purpose:
``predict`` computes every figure from the presets, the models and the
simulator alone and must not read ``published``; ``compare`` then pairs each
prediction with its published value. A test replaces ``published`` with
nonsense and checks that ``predict`` gives the same results, so no published
number can leak into a prediction.

``results.json`` of a paper is ``{"paper", "title", "predicted",
"comparisons"}``: ``predicted`` is whatever the paper's ``predict`` returns
(JSON values only), ``comparisons`` the :class:`Comparison` records.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: ``progress(done, total, what)``: a paper's prediction reports its steps.
Progress = Callable[[int, int, str], None]


def no_progress(done: int, total: int, what: str) -> None:
    """The progress callback of a run that shows none."""


@dataclass(frozen=True)
class Comparison:
    """One predicted figure beside its published value.

    ``experiment`` names the published figure or table ("fig6a", "table1");
    ``label`` the bar or cell ("PipeDream-2BW, batch 64"); ``tolerance`` the
    relative error the issue allows for it (0.2 for ±20%); ``note`` says why
    a gap is what it is (required reading when the figure is outside its
    tolerance).
    """

    experiment: str
    label: str
    predicted: float | None
    published: float | None
    unit: str
    tolerance: float
    note: str = ""

    @property
    def ratio_error(self) -> float | None:
        """predicted / published − 1, or None when either is missing."""
        if self.predicted is None or not self.published:
            return None
        return self.predicted / self.published - 1.0

    @property
    def within(self) -> bool | None:
        err = self.ratio_error
        return None if err is None else abs(err) <= self.tolerance + 1e-12

    def to_json(self) -> dict:
        out = asdict(self)
        out["ratio_error"] = self.ratio_error
        out["within_tolerance"] = self.within
        return out


@dataclass(frozen=True)
class Paper:
    """One paper's reproduction.

    * ``predict(progress)`` -> the predicted figures (JSON values; no
      published value read);
    * ``published``: the values read off the paper, as the paper's module
      keeps them (any JSON-like mapping);
    * ``compare(predicted, published)`` -> the :class:`Comparison` records;
    * ``figures(predicted, comparisons, out_dir)`` -> the files written (a
      figure per published figure: HTML, PNG when a browser exists);
    * ``report(predicted, comparisons)`` -> ``report.md``'s text.
    """

    name: str
    title: str
    predict: Callable[[Progress], dict]
    published: Mapping
    compare: Callable[[dict, Mapping], list[Comparison]]
    figures: Callable[[dict, list[Comparison], Path], list[Path]]
    report: Callable[[dict, list[Comparison]], str]
    steps: int = 1  # how many progress steps ``predict`` reports, for the bar's total
    sources: tuple[str, ...] = field(default_factory=tuple)  # the papers, as cited in the report


def comparison_table(comparisons: Sequence[Comparison]) -> str:
    """A markdown table: predicted against published, the ratio error, whether
    it is within tolerance, and the note."""
    rows = ["| experiment | what | predicted | published | error | within | note |",
            "|---|---|---|---|---|---|---|"]
    for c in comparisons:
        err = c.ratio_error
        rows.append("| {} | {} | {} | {} | {} | {} | {} |".format(
            c.experiment, c.label.replace(" | ", " · "), _num(c.predicted, c.unit), _num(c.published, c.unit),
            "" if err is None else f"{err:+.0%}",
            {True: "yes", False: "**no**", None: ""}[c.within], c.note))
    return "\n".join(rows)


def _num(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if math.isinf(v):
        return "∞"
    return f"{v:.3g} {unit}".strip()


def bars_beside_published(comparisons: Sequence[Comparison], title: str, yaxis: str):
    """Grouped bars, one group per ``label``'s prefix before " | " (or one
    group), predicted as filled bars with the published value beside it as an
    outlined bar, the ratio error written on each predicted bar."""
    import plotly.graph_objects as go

    groups = [c.label.split(" | ")[0] if " | " in c.label else "" for c in comparisons]
    series = [c.label.split(" | ", 1)[1] if " | " in c.label else c.label for c in comparisons]
    fig = go.Figure()
    fig.add_bar(x=[groups, series], y=[c.predicted for c in comparisons], name="pipesim (predicted)",
                text=["" if c.ratio_error is None else f"{c.ratio_error:+.0%}" for c in comparisons],
                textposition="outside", marker={"color": "#1f77b4"})
    fig.add_bar(x=[groups, series], y=[c.published for c in comparisons], name="published",
                marker={"color": "rgba(0,0,0,0)", "line": {"color": "#d62728", "width": 2}})
    fig.update_layout(title=title, yaxis_title=yaxis, barmode="group", template="plotly_white",
                      width=1100, height=520)
    return fig


def write_figure(fig, out_dir: Path, name: str, width: int = 1100, height: int = 520) -> list[Path]:
    """``name.html`` (self-contained) and ``name.png`` when a browser exists."""
    from ..export import write_png

    out_dir.mkdir(parents=True, exist_ok=True)
    html = out_dir / f"{name}.html"
    fig.write_html(html, include_plotlyjs=True, full_html=True, config={"displaylogo": False})
    written = [html]
    if write_png(fig, out_dir / f"{name}.png", width=width, height=height):
        written.append(out_dir / f"{name}.png")
    return written

"""What every paper's reproduction shares: its shape, the published values
kept apart from the predictions, and the figure of predicted bars beside
published ones.

A paper's module (``pipesim.experiments.reproduce.<paper>``) defines one
:class:`Paper`. Prediction and comparison are kept apart on purpose:
``predict`` computes every :class:`Row` and :class:`Claim` from the presets,
the models and the simulator alone, with ``published`` left None, and must
not read the paper's published values; :func:`with_published` then fills
them in from the module's table, keyed by :func:`row_key` (rows) and ``id``
(claims). A test replaces the table with nonsense and checks that the
predictions do not move, so no published number can leak into one.

``DIR/<paper>/results.json`` is ``{"rows": [...], "claims": [...]}``, each
record as its ``to_json`` writes it (the issue's keys, plus ``note``,
``tolerance`` and ``ratio_error``).

A metric in :data:`DIFFERENCE_METRICS` is a difference in points
(``accuracy_gap_pts``), not a rate: the ratio of two such gaps means
nothing (a gap of -8.9 points against -0.5 is not "+1680%"), so its rows
have no ``ratio_error`` (None) and the report compares them by
predicted - published, in points.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

#: ``progress(done, total, what)``: a paper's prediction reports its steps.
Progress = Callable[[int, int, str], None]


def no_progress(done: int, total: int, what: str) -> None:
    """The progress callback of a run that shows none."""


def _ratio_error(predicted: float | None, published: float | None) -> float | None:
    """predicted / published − 1, or None when either is missing."""
    if predicted is None or not published:
        return None
    return predicted / published - 1.0


class _Compared:
    """What a predicted value beside a published one offers (rows and claims)."""

    predicted: float | None
    published: float | None
    tolerance: float

    @property
    def ratio_error(self) -> float | None:
        return _ratio_error(self.predicted, self.published)

    @property
    def within_tolerance(self) -> bool:
        """A ratio error is known and no larger than ``tolerance``."""
        err = self.ratio_error
        return err is not None and abs(err) <= self.tolerance + 1e-12

    def to_json(self) -> dict:
        return {**asdict(self), "ratio_error": self.ratio_error}


#: Metrics that are differences in points, compared by difference, never by
#: ratio: ``accuracy_gap_pts`` is a strategy's final held-out top-1 accuracy
#: minus its synchronous baseline's (data parallelism; 2BW's paper: the same
#: model trained with the vanilla, synchronous optimizer), in percentage
#: points. Such a row's ``tolerance`` is unused: the gaps of different models
#: are compared by sign and order, not held to a bound.
DIFFERENCE_METRICS = frozenset({"accuracy_gap_pts"})


@dataclass(frozen=True)
class Row(_Compared):
    """One predicted figure of a paper's figure or table.

    ``figure`` is the paper's label ("6a", "7", "table1"); ``technique`` one
    of inter-layer, tensor, gpipe, pipedream-flush, pipedream-2bw, pipedream,
    pipedream-nostash (PipeDream without weight stashing), data-parallel,
    spectrain; ``metric`` one of throughput_seq_s, memory_gb (None
    predicted: out of memory), max_params_b, speedup_vs_dp,
    accuracy_gap_pts (:data:`DIFFERENCE_METRICS`); ``config``
    the configuration run, ``{"w", "d", "b", "recompute", "replicas"}``;
    ``tolerance`` the relative error the issue allows (0.2 for ±20%);
    ``note`` why a gap is what it is (the report prints it for gaps over 20%).
    """

    paper: str
    figure: str
    model: str
    hardware: str
    gpus: int
    global_batch: int | None
    technique: str
    metric: str
    predicted: float | None
    published: float | None = None
    config: dict | None = None
    tolerance: float = 0.2
    note: str = ""

    @property
    def ratio_error(self) -> float | None:
        """As :class:`_Compared`'s, but None for a difference in points."""
        return None if self.metric in DIFFERENCE_METRICS else _ratio_error(self.predicted, self.published)

    @property
    def difference(self) -> float | None:
        """predicted - published, for a metric of :data:`DIFFERENCE_METRICS`; else None."""
        if self.metric not in DIFFERENCE_METRICS or self.predicted is None or self.published is None:
            return None
        return self.predicted - self.published


@dataclass(frozen=True)
class Claim(_Compared):
    """A ratio a paper states in its text ("2BW up to 1.3x faster than tensor MP")."""

    id: str
    text: str
    predicted: float | None
    published: float | None = None
    tolerance: float = 0.2
    note: str = ""


def row_key(row: Row) -> tuple:
    """How a published value is found for a row."""
    return (row.figure, row.model, row.global_batch, row.technique, row.metric)


def with_published(
    rows: Sequence[Row],
    claims: Sequence[Claim],
    published_rows: Mapping[tuple, float],
    published_claims: Mapping[str, float],
    key: Callable[[Row], tuple] = row_key,
) -> tuple[list[Row], list[Claim]]:
    """The predictions with their published values filled in (None where the
    paper gives none); ``key`` finds a row's value (:func:`row_key`, or a
    paper's own where two rows differ only in their hardware)."""
    return (
        [replace(r, published=published_rows.get(key(r))) for r in rows],
        [replace(c, published=published_claims.get(c.id)) for c in claims],
    )


@dataclass(frozen=True)
class Paper:
    """One paper's reproduction.

    * ``predict(progress)`` -> (rows, claims), every ``published`` None;
    * ``published_rows`` (``row_key`` -> value) and ``published_claims``
      (claim id -> value): the values read off the paper;
    * ``figures(rows, claims, out_dir)`` -> the files written (a figure per
      published figure: HTML, PNG when a browser exists);
    * ``steps``: how many progress steps ``predict`` reports (the bar's total);
    * ``key``: how ``published_rows`` is keyed; ``notes``: the report's text
      after its tables.
    """

    name: str
    title: str
    predict: Callable[[Progress], tuple[list[Row], list[Claim]]]
    published_rows: Mapping[tuple, float]
    published_claims: Mapping[str, float]
    figures: Callable[[list[Row], list[Claim], Path], list[Path]]
    steps: int = 1
    sources: tuple[str, ...] = field(default_factory=tuple)  # the papers, as cited in the report
    #: how ``published_rows`` is keyed (:func:`row_key` unless a paper's rows
    #: need more, e.g. the hardware)
    key: Callable[[Row], tuple] = row_key
    #: ``notes(rows, claims)`` -> markdown the report adds after its tables
    #: (the rows carry their published values by then); None for none
    notes: Callable[[list[Row], list[Claim]], str] | None = None


class Causes:
    """The causes of a report's gaps, each printed once: a row or claim whose
    gap needs its note gets a numbered reference to it (:meth:`cite`), and
    :meth:`section` lists every note cited, in the order first cited. Many
    rows share one cause (every GPipe bar of a figure), and a cause of a
    few hundred words repeated in each row's table cell buried the table."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}

    def cite(self, r: Row | Claim) -> str:
        """The cell of ``r``'s note: a link to its cause, or nothing when
        its gap is within tolerance (or it has no note)."""
        text = _note(r)
        if not text:
            return ""
        n = self._numbers.setdefault(text, len(self._numbers) + 1)
        return f"[cause {n}](#cause-{n})"

    def section(self) -> str:
        """Every cause cited, numbered, each with its anchor ("" if none)."""
        return "\n\n".join(f'<a id="cause-{n}"></a>**Cause {n}.** {text}' for text, n in self._numbers.items())


def comparison_table(rows: Sequence[Row], hardware: bool = False, causes: Causes | None = None) -> str:
    """A markdown table of rows: predicted against published, the ratio error,
    whether it is within tolerance, and the note (``hardware``: a column for
    each row's hardware and GPUs too; ``causes``: the note as a reference to
    its cause, each cause printed once by :meth:`Causes.section`)."""
    hw = "hardware | GPUs | " if hardware else ""
    out = [
        f"| figure | model | {hw}technique | batch | metric | predicted | published | error | note |",
        "|---|---|" + ("---|---|" if hardware else "") + "---|---|---|---|---|---|---|",
    ]
    for r in rows:
        where = f"{r.hardware} | {r.gpus} | " if hardware else ""
        note = causes.cite(r) if causes is not None else _note(r)
        out.append(
            f"| {r.figure} | {r.model} | {where}{r.technique} | {r.global_batch or ''} | {r.metric} | "
            f"{three_figures(r.predicted)} | {three_figures(r.published)} | {_error(r)} | {note} |"
        )
    return "\n".join(out)


def claims_table(claims: Sequence[Claim], causes: Causes | None = None) -> str:
    out = ["| claim | predicted | published | error | note |", "|---|---|---|---|---|"]
    for c in claims:
        note = causes.cite(c) if causes is not None else _note(c)
        out.append(f"| {c.text} | {three_figures(c.predicted)} | {three_figures(c.published)} | {_error(c)} | {note} |")
    return "\n".join(out)


def _error(r: Row | Claim) -> str:
    diff = getattr(r, "difference", None)
    if diff is not None:
        return f"{diff:+.1f} pts"
    err = r.ratio_error
    if err is None:
        return ""
    return f"{err:+.0%}" + ("" if r.within_tolerance else " **outside**")


def _note(r: Row | Claim) -> str:
    if getattr(r, "difference", None) is not None:
        return r.note  # compared qualitatively: always say how
    err = r.ratio_error
    return r.note if err is not None and abs(err) > 0.2 else ""


def three_figures(v: float | None) -> str:
    """A value as the reports print it: three significant figures, "—" for none."""
    if v is None:
        return "—"
    if math.isinf(v):
        return "∞"
    return f"{v:.3g}"


def bars_beside_published(rows: Sequence[Row], title: str, yaxis: str, group: Callable[[Row], str]):
    """Grouped bars as in the papers: one group per ``group(row)`` (e.g. the
    batch size), one bar per technique, the predicted bar filled with its
    ratio error written on it and the published value beside it as an
    outlined bar (out of memory: no bar, "OOM" written)."""
    import plotly.graph_objects as go

    x = [[group(r) for r in rows], [r.technique for r in rows]]
    fig = go.Figure()
    fig.add_bar(
        x=x,
        y=[r.predicted for r in rows],
        name="pipesim (predicted)",
        text=[
            "OOM" if r.predicted is None else ("" if r.ratio_error is None else f"{r.ratio_error:+.0%}") for r in rows
        ],
        textposition="outside",
        marker={"color": "#1f77b4"},
    )
    fig.add_bar(
        x=x,
        y=[r.published for r in rows],
        name="published",
        marker={"color": "rgba(0,0,0,0)", "line": {"color": "#d62728", "width": 2}},
    )
    fig.update_layout(title=title, yaxis_title=yaxis, barmode="group", template="plotly_white", width=1100, height=520)
    return fig


def write_figure(fig, out_dir: Path, name: str, width: int = 1100, height: int = 520) -> list[Path]:
    """``name.html`` (self-contained) and ``name.png`` when a browser exists."""
    from pipesim.experiments.export import write_png

    out_dir.mkdir(parents=True, exist_ok=True)
    html = out_dir / f"{name}.html"
    fig.write_html(html, include_plotlyjs=True, full_html=True, config={"displaylogo": False})
    written = [html]
    if write_png(fig, out_dir / f"{name}.png", width=width, height=height):
        written.append(out_dir / f"{name}.png")
    return written

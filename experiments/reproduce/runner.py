"""Running the papers' reproductions: ``pipesim reproduce {pipedream,2bw,spectrain,all}``.

A paper is found by its module: ``pipedream`` is
``pipesim.experiments.reproduce.pipedream``, ``2bw`` ``...twobw``,
``spectrain`` ``...spectrain``, each defining ``PAPER``
(:class:`~.base.Paper`). ``all`` runs every one of them this build has.

For each paper :func:`run_paper` predicts (``PAPER.predict``, which never
sees a published value), fills the published values in afterwards
(:func:`~.base.with_published`), and writes to ``DIR/<paper>/``:

* ``results.json``: ``{"rows": [...], "claims": [...]}``, every record's
  ``to_json()``, floats to 6 significant figures: byte-identical for the
  same build (no timings in it);
* ``report.md``: the comparison table, the claims table, the paper's notes
  and the runtime (the only place a timing goes, besides stdout);
* the paper's figures (HTML, PNG when a browser exists).
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipesim.experiments.reproduce.base import (
    Causes,
    Claim,
    Paper,
    Progress,
    Row,
    claims_table,
    comparison_table,
    with_published,
)
from pipesim.sim.errors import InputError

#: The papers ``pipesim reproduce`` knows, and the module that reproduces each.
PAPERS = {"pipedream": "pipedream", "2bw": "twobw", "spectrain": "spectrain"}
PACKAGE = "pipesim.experiments.reproduce"


class PaperError(InputError):
    """A paper that is not known, or whose module this build lacks."""


def load_paper(name: str) -> Paper:
    """The ``PAPER`` of ``name``'s module (one-line :class:`PaperError` if
    the name is unknown or the module is missing)."""
    if name not in PAPERS:
        raise PaperError(f"unknown paper {name!r}; choose one of {', '.join(PAPERS)} or all")
    module = f"{PACKAGE}.{PAPERS[name]}"
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise PaperError(f"paper {name}: its reproduction ({module}) is not in this build") from None
    return mod.PAPER


def available() -> list[str]:
    """The papers whose module this build has, in :data:`PAPERS` order."""
    out = []
    for name in PAPERS:
        try:
            load_paper(name)
        except PaperError:
            continue
        out.append(name)
    return out


def papers_for(target: str) -> list[Paper]:
    """``target``'s papers: one name, or ``all`` (every one this build has)."""
    if target == "all":
        return [load_paper(n) for n in available()]
    return [load_paper(target)]


@dataclass(frozen=True)
class Outcome:
    """What :func:`run_paper` did: the rows and claims (published values
    filled in), the report's text, the files written and the seconds taken."""

    paper: Paper
    rows: list[Row]
    claims: list[Claim]
    report: str
    written: list[Path]
    seconds: float


def _clean(v):
    """A JSON value with floats to 6 significant figures and no NaN or
    infinity (null instead), recursively."""
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, float):
        return float(f"{v:.6g}") if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def results_json(rows: list[Row], claims: list[Claim]) -> str:
    """``results.json``'s text: deterministic for the same records."""
    doc = {"rows": [_clean(r.to_json()) for r in rows], "claims": [_clean(c.to_json()) for c in claims]}
    return json.dumps(doc, indent=1, allow_nan=False) + "\n"


def report_md(paper: Paper, rows: list[Row], claims: list[Claim], seconds: float | None) -> str:
    """``report.md``: predicted against published, the claims, the cause of
    every gap beyond the tolerance (each once, the tables linking to it),
    the notes and the runtime (left out when ``seconds`` is None)."""
    out = [f"# {paper.title}", ""]
    if paper.sources:
        out += ["Sources: " + "; ".join(paper.sources), ""]
    outside = [r for r in [*rows, *claims] if r.ratio_error is not None and not r.within_tolerance]
    compared = [r for r in [*rows, *claims] if r.ratio_error is not None]
    in_points = [r for r in rows if r.difference is not None]
    points = f"; {len(in_points)} differences in points compared by their sign and size" if in_points else ""
    out += [
        f"{len(compared) - len(outside)} of {len(compared)} compared values within tolerance{points}; "
        f"{len(rows) + len(claims) - len(compared) - len(in_points)} without a published value.",
        "",
    ]
    causes = Causes()
    if rows:
        several = len({(r.hardware, r.gpus) for r in rows}) > 1
        out += ["## Predicted against published", "", comparison_table(rows, hardware=several, causes=causes), ""]
    if claims:
        out += ["## Claims in the text", "", claims_table(claims, causes=causes), ""]
    cited = causes.section()
    if cited:
        out += ["## Causes of the gaps", "", cited, ""]
    if paper.notes is not None:
        text = paper.notes(rows, claims).strip()
        if text:
            out += ["## Notes", "", text, ""]
    if seconds is not None:
        out += [f"Runtime: {seconds:.1f} s.", ""]
    return "\n".join(out)


#: Progress steps after a paper's predictions: its figures, then its report
#: (whose notes may simulate more, e.g. 2BW's bars at the authors' micro-batch).
WRITING_STEPS = 2


def run_paper(paper: Paper, out: Path, progress: Progress | None = None) -> Outcome:
    """Predict ``paper``, compare, and write ``out/<paper.name>/`` (see the
    module doc). ``progress`` counts the predictions' steps and then
    :data:`WRITING_STEPS` more, so it ends only once the report is written."""
    say = progress or (lambda done, total, what: None)
    started = time.perf_counter()
    rows, claims = paper.predict(lambda done, total, what: say(done, total + WRITING_STEPS, what))
    rows, claims = with_published(rows, claims, paper.published_rows, paper.published_claims, key=paper.key)
    folder = out / paper.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(results_json(rows, claims))
    written = [folder / "results.json"]
    total = paper.steps + WRITING_STEPS
    say(paper.steps, total, "figures")
    written += paper.figures(rows, claims, folder)
    seconds = time.perf_counter() - started
    say(paper.steps + 1, total, "report")
    report = report_md(paper, rows, claims, seconds)
    (folder / "report.md").write_text(report)
    written.insert(1, folder / "report.md")
    say(total, total, "done")
    return Outcome(paper, rows, claims, report, written, seconds)


def run(target: str, out: Path, echo: Callable[[str], None] = print, bar: bool = True) -> list[Outcome]:
    """Run ``target``'s papers (one name or ``all``) into ``out``, a progress
    bar on stderr (tqdm, as ``pipesim converge`` shows one), and ``echo``
    each report as it is written."""
    papers = papers_for(target)
    if not papers:
        raise PaperError("no paper's reproduction is in this build")
    outcomes = []
    for paper in papers:
        outcomes.append(_run_with_bar(paper, out) if bar else run_paper(paper, out))
        o = outcomes[-1]
        echo(o.report)
        echo(f"wrote {', '.join(p.name for p in o.written)} to {out / paper.name}")
    return outcomes


def _run_with_bar(paper: Paper, out: Path) -> Outcome:
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    with tqdm(
        total=paper.steps + WRITING_STEPS,
        desc=f"reproduce {paper.name}",
        unit="step",
        file=sys.stderr,
        mininterval=0.2 if tty else 5.0,
        leave=True,
    ) as t:

        def progress(done: int, total: int, what: str) -> None:
            if total != t.total:
                t.total = total
            t.set_postfix_str(what, refresh=False)
            t.update(max(0, done - t.n))

        outcome = run_paper(paper, out, progress)
        t.set_postfix_str("done", refresh=False)
        t.update(max(0, t.total - t.n))
    return outcome

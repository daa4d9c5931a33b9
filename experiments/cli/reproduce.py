"""``pipesim reproduce``: predict the papers' published figures (PipeDream,
PipeDream-2BW, SpecTrain) and compare (:mod:`pipesim.experiments.reproduce`)."""

from __future__ import annotations

import time

from pipesim.experiments.cli.common import output_dir
from pipesim.experiments.cliargs import list_choices


def _papers() -> list[str]:
    """The runner's papers (read when help is shown; a wrong name is the runner's one-line error)."""
    from pipesim.experiments.reproduce.runner import PAPERS

    return [*PAPERS, "all"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "reproduce", help="predict the papers' published figures and compare (PipeDream, PipeDream-2BW, SpecTrain)"
    )
    list_choices(
        p.add_argument("paper", help="the paper (all: every one this build reproduces)"),
        _papers,
    )
    p.add_argument("--out", default="out/reproduce", help="output folder (one subfolder per paper)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Predict a paper's published figures, write results.json, report.md and
    the figures to ``--out``/<paper>/, and print the report."""
    from pipesim.experiments.reproduce.runner import papers_for
    from pipesim.experiments.reproduce.runner import run as run_papers

    papers_for(args.paper)  # an unknown or missing paper fails in one line before any work
    out = output_dir(args.out)
    started = time.perf_counter()
    outcomes = run_papers(args.paper, out)
    if len(outcomes) > 1:
        print(f"reproduced {', '.join(o.paper.name for o in outcomes)} in {time.perf_counter() - started:.1f} s")
    return 0

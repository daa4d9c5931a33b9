"""A progress bar over the phases of one simulation (tqdm, on stderr).

Long work shows its progress: a simulation of a million actions takes many
seconds in phases of very different cost, and the engine reports nothing
until it is done, so the bar advances by phase (weighted by their measured
share of the time) and, on a terminal, a ticker keeps its clock moving.
stdout, where ``--json`` goes, is never touched.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

#: Stage passes above which a simulation shows its progress bar even when
#: stderr is not a terminal (a log): about 200k compute actions, several seconds.
PROGRESS_PASSES = 100_000
#: Relative time of each phase of a simulation, per action (1f1b, p = 64,
#: m = 1024: building 0.15 s; simulating 1.5 s, of which validation 0.1,
#: lowering 0.3, engine 0.7, memory and version tracking 0.3; summary 0.1 s;
#: trace.json 1.2 s; timeline.html 1.3 s).
PHASE_WEIGHTS = {
    "building the schedule": 1,
    "simulating": 10,
    "summarizing": 1,
    "writing trace.json": 8,
    "writing timeline.html": 8,
}


def no_progress(phase: str) -> None:
    """The step function of a run that shows no progress bar."""


@contextmanager
def phase_bar(phases: list[str], passes: int):
    """A progress bar on stderr over ``phases``; yields ``step(phase)``, to be
    called as each phase begins.

    On a terminal the bar appears once the run has taken a second; elsewhere
    (a log, a pipe) it is shown only for long runs (``passes`` >=
    :data:`PROGRESS_PASSES`), one line per phase.
    """
    tty = sys.stderr.isatty()
    if not tty and passes < PROGRESS_PASSES:
        yield no_progress
        return
    from tqdm import tqdm

    # a terminal's bar is redrawn in place and cleared at the end; a log gets
    # one line per phase and keeps the last
    bar = tqdm(
        total=sum(PHASE_WEIGHTS[p] for p in phases),
        desc=phases[0],
        file=sys.stderr,
        delay=1.0 if tty else 0.0,
        mininterval=0.1 if tty else 0.0,
        miniters=0,
        leave=not tty,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}",
    )
    underway: list[int] = []  # the weight of the phase in progress
    stop = threading.Event()

    def step(phase: str) -> None:
        bar.set_description_str(phase, refresh=False)  # update() draws, once the delay has passed
        bar.update(underway.pop() if underway else 0)
        underway.append(PHASE_WEIGHTS[phase])

    def tick() -> None:
        if not stop.wait(1.0):
            while not stop.wait(0.5):
                bar.refresh()

    ticker = threading.Thread(target=tick, name="pipesim-progress", daemon=True) if tty else None
    if ticker:
        ticker.start()
    try:
        yield step
        bar.set_description_str("done", refresh=False)
        bar.update(bar.total - bar.n)
    finally:
        stop.set()
        if ticker:
            ticker.join()
        bar.close()

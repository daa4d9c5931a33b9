"""Pause Python's cyclic garbage collector during bulk construction.

A simulation allocates a few hundred thousand small tuples (actions, tokens,
spans) that stay alive until it ends. Each allocation burst triggers the
cyclic collector, which rescans the ever larger heap: on a 131k-action
schedule that doubled the run time. Nothing built here forms cycles that must
be reclaimed mid-run, so collection waits until the bulk work is done.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def gc_paused():
    """Disable the cyclic collector inside the block (re-entrant)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


#: Objects kept until the process exits rather than freed (:func:`kept_until_exit`).
_kept: list = []
_keeping = False


@contextmanager
def kept_until_exit(enabled: bool = True):
    """Inside the block, :func:`retain` keeps what it is given until the
    process exits; outside it (or with ``enabled`` false) it does nothing.

    Freeing a large simulation's objects one by one is real work (about a
    million small tuples and spans for 131k compute actions: 0.1 s for the
    run's temporaries when ``simulate`` returns, as much again for the
    result), wasted in a process that ends right after. So only a caller
    that leaves through ``os._exit`` once its work is done (the ``pipesim``
    console script, for its one simulation) opens this block; a library
    caller, a sweep or ``compare`` keeps the normal lifetimes and bounded
    memory."""
    global _keeping
    was = _keeping
    _keeping = bool(enabled)
    try:
        yield
    finally:
        _keeping = was


def retain(obj) -> None:
    """Keep ``obj`` until exit inside :func:`kept_until_exit`; a no-op elsewhere."""
    if _keeping:
        _kept.append(obj)

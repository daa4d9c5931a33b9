"""The dynamic program both splits share: contiguous stages that minimise the bottleneck.

:func:`balanced` takes a stage's cost as a table over (first layer, last
layer + 1) and finds the stage starts whose slowest stage is fastest, then,
among those, the smallest sum of squares. The compute-only split
(:mod:`pipesim.sim.partition.split`) and the communication-aware one
(:mod:`pipesim.sim.partition.search`) differ only in the tables they pass.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: Relative tolerance under which two costs count as equal (rounding, not a real difference).
REL_TOL = 1e-9


def balanced(term: Callable[[int], np.ndarray], num_stages: int) -> list[int] | None:
    """Stage start indices of the best split, or None if none has finite terms.

    ``term(k)`` is stage k's (layers + 1)² matrix: entry [i, j] is what stage
    k costs holding layers i .. j-1 (inf where it may not: below the
    diagonal, or where it does not fit). The split minimises the largest
    term, then the sum of squared terms; remaining ties go to the split whose
    later stages hold more layers. Matrices are asked for one at a time (three
    times each), so memory stays at a few of them whatever the stage count.
    """
    n = term(0).shape[0] - 1

    # Pass 1: the smallest achievable bottleneck.
    best = np.full(n + 1, np.inf)
    best[1:] = term(0)[0, 1:]
    for k in range(1, num_stages):
        best = np.maximum(best[:, None], term(k)).min(axis=0)
    bottleneck = best[n]
    if not np.isfinite(bottleneck):
        return None

    # Pass 2: among splits within the bottleneck, the smallest sum of squares.
    cap = bottleneck + REL_TOL * abs(bottleneck)

    def squares(k: int) -> np.ndarray:
        t = term(k)
        return np.where(t <= cap, t * t, np.inf)

    tables = []
    ss = np.full(n + 1, np.inf)
    ss[1:] = squares(0)[0, 1:]
    tables.append(ss)
    for k in range(1, num_stages):
        ss = (ss[:, None] + squares(k)).min(axis=0)
        tables.append(ss)

    # Backtrack: for each stage from the last, the earliest start among the
    # (near-)optimal ones, i.e. later stages take as many layers as ties allow.
    starts = [0] * num_stages
    j = n
    for k in range(num_stages - 1, 0, -1):
        col = tables[k - 1] + squares(k)[:, j]
        m = col.min()
        i = int(np.flatnonzero(col <= m + REL_TOL * abs(m))[0])
        starts[k] = i
        j = i
    return starts

"""Splitting a model into pipeline stages.

Layer 6 of :mod:`pipesim.sim`: above the engine (whose cost model it reuses),
below :mod:`pipesim.sim.api` (which calls it to choose a split) and
:mod:`pipesim.sim.planning` (which searches over configurations).

* :mod:`.split`: :func:`partition`, the entry point, and the compute-only split;
* :mod:`.balance`: the dynamic program both splits share (the bottleneck, then the
  sum of squares, over contiguous stages);
* :mod:`.layout`: what a schedule asks of each model stage (placement, passes, stash,
  steps, weight versions);
* :mod:`.cost`: the analytic cost model (compute, transfers over the links they cross,
  all-reduces over their topology, memory);
* :mod:`.search`: the communication-aware split and the search over splits and
  per-stage replicas that the planner drives.
"""

from pipesim.sim.partition.split import (  # the package's public names, where users import them
    MAX_DP_CELLS,
    MAX_DP_LAYERS,
    balanced,
    check_split,
    partition,
    stage_costs_uniform,
)

__all__ = [
    "balanced",
    "check_split",
    "MAX_DP_CELLS",
    "MAX_DP_LAYERS",
    "partition",
    "stage_costs_uniform",
]

"""Split a profile's layers into contiguous pipeline stages.

The objective is the pipeline's throughput bound: the slowest stage's
forward + backward time. :func:`partition` finds a contiguous split that
minimises it exactly (dynamic programming over split points), and among the
splits that reach that minimum picks the one with the smallest sum of squared
stage times, so stages that are not the bottleneck are balanced too (a
lopsided non-bottleneck stage still lengthens warm-up and drain). Remaining
ties go to the split whose later stages hold more layers: in 1F1B-style
schedules later stages keep fewer micro-batches in flight, so that is the
cheaper place for extra activations.

That is the compute-only split. Given the hardware and a layout (where each
stage's replicas run and what the schedule asks of them), :func:`partition`
splits communication-aware instead (:mod:`pipesim.sim.partition.search`):
the same dynamic program (:func:`balanced`) over each stage's full cost,
transfers and all-reduces included.

Memory: with ``memory_limit_bytes``, a stage k holding weights ``W`` and
stashing ``A`` per micro-batch needs ``W * (2 + optimizer multiplier) +
A * inflight(k)`` (weights, gradients, optimizer state, activations of the
micro-batches in flight; the weights, gradients and master copy at their
widths of the profile's :class:`~pipesim.sim.workloads.profile.Precision`,
as :meth:`~pipesim.sim.workloads.stages.StageCost.resident_bytes` counts
them: the same total in fp32 and in 16-bit mixed precision), and only
splits where every stage fits are considered. If none fits, the
unconstrained time-balanced split is returned anyway: the engine then
reports the overflow as out-of-memory, which says more than an exception
here would.

Times are compared with a relative tolerance of 1e-9, so splits whose
bottlenecks differ only by floating-point rounding count as ties and the
tie-break above, not rounding, decides.

Size: the dynamic program works on (layers + 1)² tables, a few at a time
(each stage's is made when it is needed), so its time grows with layers² ×
stages and its memory with layers². One
stage, or one layer per stage (the ``uniform`` model on any depth), has a
single contiguous split and needs no tables at all. Otherwise
:data:`MAX_DP_LAYERS` and :data:`MAX_DP_CELLS` bound it (see there) and a
larger request is a :class:`~pipesim.sim.workloads.profile.WorkloadError` before
anything is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pipesim.sim.partition.balance import balanced
from pipesim.sim.workloads.catalog import UNIFORM_PARAM_BYTES, UNIFORM_STASH_BYTES
from pipesim.sim.workloads.profile import Profile, WorkloadError
from pipesim.sim.workloads.stages import StageCost, split_at

if TYPE_CHECKING:
    from pipesim.sim.hardware.machines import Hardware
    from pipesim.sim.partition.layout import Layout


#: At most this many layers for the dynamic program: it keeps about ten
#: (layers + 1)² float64 tables alive at once, 32 MiB each at 2048 layers,
#: so the split stays far below a machine's memory (~350 MB at the limit).
MAX_DP_LAYERS = 2048
#: At most stages × (layers + 1)² table cells: the work (about 10 ns a cell,
#: a second or two at the limit).
MAX_DP_CELLS = 2**27


def partition(
    profile: Profile,
    num_stages: int,
    *,
    memory_limit_bytes: float | None = None,
    inflight: Callable[[int], int] | None = None,
    hardware: Hardware | None = None,
    layout: Layout | None = None,
) -> list[StageCost]:
    """Contiguous split of ``profile`` into ``num_stages`` stages.

    Compute only by default: balanced by time, ``inflight(k)`` micro-batches
    stashed by stage k for the memory test (default ``num_stages - k``, the
    1F1B / PipeDream steady state; only used with ``memory_limit_bytes``).

    With ``hardware`` and ``layout`` (where each stage's replicas run and
    what the schedule asks of them, :func:`pipesim.sim.partition.layout.layout_of` of
    a built schedule), communication-aware: transfers across every boundary
    over the links it crosses and each replicated stage's all-reduce count
    too, and memory is the layout's (``inflight`` does not apply); see
    :mod:`pipesim.sim.partition.search`. See the module doc for the objective,
    tie-breaks and what happens when nothing fits.
    """
    n = len(profile.layers)
    limit = _check_limit(memory_limit_bytes)
    if (hardware is None) != (layout is None):
        raise WorkloadError("a communication-aware split needs both hardware and layout")
    if layout is not None and layout.stages != num_stages:
        raise WorkloadError(f"the layout has {layout.stages} stages, not {num_stages}")
    if not check_split(profile, num_stages):  # a single contiguous split: nothing to choose
        return split_at(profile, range(0, n, n // num_stages))
    if layout is not None:
        from pipesim.sim.partition.search import CostSetting, Tables, split_for_layout

        return split_for_layout(Tables(profile), layout, CostSetting.of(profile, hardware, limit))
    times = np.array([la.forward_s + la.backward_s for la in profile.layers], dtype=float)
    prefix = np.concatenate(([0.0], np.cumsum(times)))
    cost = prefix[None, :] - prefix[:, None]  # cost[i, j]: layers i .. j-1
    idx = np.arange(n + 1)
    valid = idx[:, None] < idx[None, :]

    fits = None
    if limit is not None:
        inflight = inflight or (lambda k: num_stages - k)
        w = np.concatenate(([0.0], np.cumsum([float(la.param_bytes) for la in profile.layers])))
        a = np.concatenate(([0.0], np.cumsum([float(la.stash_bytes) for la in profile.layers])))
        # the passes' weights, gradients, master copy and optimizer state (StageCost.resident_bytes)
        weights = (w[None, :] - w[:, None]) * (sum(profile.precision.ratios()) + profile.optimizer_state_multiplier)
        stash = a[None, :] - a[:, None]

        def fits(k: int) -> np.ndarray:
            m = inflight(k)
            if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
                raise WorkloadError(f"inflight({k}) must be an integer >= 0, got {m!r}")
            return weights + stash * int(m) <= limit

    def term(k: int) -> np.ndarray:
        allowed = valid & fits(k) if fits else valid
        return np.where(allowed, cost, np.inf)

    starts = balanced(term, num_stages)
    if starts is None:  # nothing fits: time-balanced anyway, the engine reports OOM
        starts = balanced(lambda k: np.where(valid, cost, np.inf), num_stages)
    assert starts is not None
    return split_at(profile, starts)


def check_split(profile: Profile, num_stages: int) -> bool:
    """Check a request to split ``profile`` into ``num_stages`` stages (a
    :class:`WorkloadError` if it cannot be, or its tables would be too big):
    whether there is a choice to make (False for one stage, or one layer per
    stage: a single contiguous split)."""
    n = len(profile.layers)
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or not (1 <= num_stages <= n):
        raise WorkloadError(f"cannot split {n} layers into {num_stages} stages")
    if num_stages in (1, n):
        return False
    _check_dp_size(n, num_stages)
    return True


def _check_dp_size(layers: int, stages: int) -> None:
    """Refuse a split whose tables would not fit (see MAX_DP_LAYERS, MAX_DP_CELLS)."""
    cells = stages * (layers + 1) ** 2
    if layers > MAX_DP_LAYERS or cells > MAX_DP_CELLS:
        raise WorkloadError(
            f"cannot split {layers} layers into {stages} stages exactly: the partitioner's tables grow with "
            f"stages x (layers+1)^2 = {cells:,} cells; the limits are {MAX_DP_LAYERS} layers and "
            f"{MAX_DP_CELLS:,} cells (memory and time); merge layers in the profile or use fewer stages"
        )


def _check_limit(limit: float | None) -> float | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or math.isnan(limit) or limit < 0:
        raise WorkloadError(f"memory limit must be a number >= 0, got {limit!r}")
    return None if math.isinf(limit) else float(limit)


def stage_costs_uniform(
    num_stages: int,
    forward_s: float = 1e-3,
    backward_s: float = 2e-3,
    *,
    param_bytes: int = UNIFORM_PARAM_BYTES,
    stash_bytes: int = UNIFORM_STASH_BYTES,
    activation_bytes: int = 0,
) -> list[StageCost]:
    """Identical one-layer stages for analytic tests (I = W = B / 2).

    Same defaults as the ``uniform`` model: nothing sent, 1 MiB of weights
    and 1 MiB of stash per micro-batch.
    """
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise WorkloadError(f"num_stages must be a positive integer, got {num_stages!r}")
    return [
        StageCost(
            first_layer=k,
            last_layer=k,
            forward_s=forward_s,
            backward_s=backward_s,
            backward_input_s=backward_s / 2,
            backward_weight_s=backward_s / 2,
            param_bytes=param_bytes,
            activation_bytes=activation_bytes,
            stash_bytes=stash_bytes,
            layer_input_bytes=(0,),  # as input_bytes: nothing counted in
            layer_stash_bytes=(stash_bytes,),
            layer_gradient_bytes=(param_bytes,),
            layer_backward_share=(1.0,),
        )
        for k in range(num_stages)
    ]

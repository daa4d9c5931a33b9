"""Elastic averaging (EASGD, as AvgPipe uses it across parallel pipelines).

Every τ iterations each replica is pulled toward a centre and the centre
toward the replicas: with d_r = α(x_r − x̃) from the values *before* the
call, x_r ← x_r − d_r and x̃ ← x̃ + Σ_r d_r. The symmetric form matters: the
total Σ x_r + x̃ is conserved, which a sequential replica-by-replica update
(each d_r seeing the centre already moved) would not do.
"""

from __future__ import annotations

import torch

from pipesim.kernels._checks import as_tensor_list, check_aligned, check_reference, group_indices, take
from pipesim.kernels.prediction import _bump, impl_for


def elastic_average(replicas, center, alpha: float, *, backend: str | None = None) -> None:
    """In place: x_r ← x_r − α(x_r − x̃) for every replica r, x̃ ← x̃ + α Σ_r (x_r − x̃).

    ``replicas`` is a sequence of N tensor lists, each aligned with ``center``.
    The centre may be float32 next to 16-bit replicas (arithmetic in float32,
    rounded once). Each element of every replica and of the centre is read
    once and written once by the Triton kernel; the foreach path does the
    same per CPU tile.
    """
    try:
        reps = list(replicas)
    except TypeError:
        raise ValueError("replicas must be a sequence of tensor lists") from None
    if not reps:
        raise ValueError("replicas is empty: elastic averaging needs at least one replica")
    reps = [as_tensor_list(f"replicas[{r}]", rep) for r, rep in enumerate(reps)]
    center = as_tensor_list("center", center)
    check_reference("replicas[0]", reps[0])
    for r in range(1, len(reps)):
        check_aligned("replicas[0]", reps[0], f"replicas[{r}]", reps[r], state=False)
    check_aligned("replicas[0]", reps[0], "center", center, state=True)
    for i, c in enumerate(center):
        if not c.numel():
            continue
        seen = {c.data_ptr(): "center"}
        for r, rep in enumerate(reps):
            ptr = rep[i].data_ptr()
            if ptr in seen:
                raise ValueError(f"replicas[{r}][{i}] is the same memory as {seen[ptr]}[{i}]")
            seen[ptr] = f"replicas[{r}]"
    alpha = float(alpha)
    with torch.no_grad():
        for idx in group_indices(*reps, center):
            xs = [take(rep, idx) for rep in reps]
            c = take(center, idx)
            impl_for([*xs, c], backend).elastic(xs, c, alpha)
        for rep in reps:
            _bump(rep)
        _bump(center)

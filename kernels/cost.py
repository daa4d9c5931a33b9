"""Bytes each kernel must move, for costing it from memory bandwidth.

The simulator charges a kernel ``bytes_moved(...) / bandwidth``; the
benchmark divides the same number by the measured time, so "percent of copy
bandwidth" and the simulator's cost model agree on what a kernel must touch.
Counts are the minimum traffic of a fused implementation: every operand read
once, every result written once.
"""

from __future__ import annotations

import torch

from pipesim.kernels._checks import FLOAT_DTYPES

# kernel -> (weight-sized reads+writes, state-sized reads+writes, per-replica weight traffic)
_TRAFFIC = {
    "copy": (2, 0, 0),  # read src, write dst
    "predict_sgd": (2, 1, 0),  # read W, read v, write Ŵ
    "predict_adam": (2, 2, 0),  # read W, m, v, write Ŵ
    "predict_sgd_": (3, 1, 0),  # read W, write backup, read v, write W (restore: "copy")
    "predict_adam_": (3, 2, 0),
    "elastic_average": (0, 2, 2),  # read+write the centre; read+write every replica
    "weight_stash": (2, 0, 0),  # snapshot of one version
    "double_buffer": (2, 1, 0),  # read current and gradient, write the shadow
}

KERNELS = tuple(_TRAFFIC)


def _size(dtype) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}")
    return torch.empty((), dtype=dtype).element_size()


def bytes_moved(kernel: str, numel: int, dtype=torch.float32, *, state_dtype=None, replicas: int = 2) -> int:
    """Minimum bytes read plus written by ``kernel`` over ``numel`` parameters.

    ``dtype`` is the weights' dtype, ``state_dtype`` (default: the same) that
    of optimizer state, gradients or the averaging centre; ``replicas`` only
    matters for ``"elastic_average"``.
    """
    if kernel not in _TRAFFIC:
        raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(KERNELS)}")
    w = _size(dtype)
    s = w if state_dtype is None else _size(state_dtype)
    n_w, n_s, n_r = _TRAFFIC[kernel]
    return int(numel) * (n_w * w + n_s * s + n_r * replicas * w)

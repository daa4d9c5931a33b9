"""Input validation and grouping shared by every kernel.

The kernels walk several aligned tensor lists at once (weights, optimizer
state, outputs, replicas). A mismatch there would not fail loudly: a foreach
op broadcasts or promotes, a raw-pointer Triton kernel reads past the end of a
buffer. So every public entry point checks its lists first and names the
offending index, e.g. ``momentum_buffers[3] has shape (4, 5), params[3] has
(4, 6)``, before any work is done.

Precision rule (the same for all kernels): optimizer state and averaging
centres may be float32 next to bfloat16/float16 weights ("bf16 weights with
fp32 state"); everything is then computed in float32 and rounded once into the
low-precision result. Outputs and replicas must match the weights exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic is done in: float32 for 16-bit floats, else itself."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def _shape(t: Tensor) -> str:
    dims = tuple(t.shape)
    return "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"


def as_tensor_list(name: str, tensors) -> list[Tensor]:
    """Accept any sequence (or a single tensor) and check every item is a tensor."""
    if isinstance(tensors, Tensor):
        tensors = [tensors]
    try:
        out = list(tensors)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of tensors, got {type(tensors).__name__}") from None
    for i, t in enumerate(out):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}[{i}] is a {type(t).__name__}, not a tensor")
    return out


def check_reference(name: str, tensors: Sequence[Tensor]) -> None:
    """The reference list (weights, centre) must hold floating tensors."""
    for i, t in enumerate(tensors):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}[{i}] has dtype {t.dtype}; kernels support float32, float64, bfloat16 and float16")


def check_aligned(ref_name: str, ref: Sequence[Tensor], name: str, other: Sequence[Tensor], *, state: bool) -> None:
    """Check ``other`` against ``ref`` index by index.

    ``state=True`` allows the float32-state-next-to-16-bit-weights case;
    ``state=False`` (outputs, replicas) demands the exact dtype.
    """
    if len(other) != len(ref):
        raise ValueError(f"{name} has {len(other)} tensors, {ref_name} has {len(ref)}")
    for i, (r, o) in enumerate(zip(ref, other)):
        if o.shape != r.shape:
            raise ValueError(f"{name}[{i}] has shape {_shape(o)}, {ref_name}[{i}] has {_shape(r)}")
        if o.device != r.device:
            raise ValueError(f"{name}[{i}] is on {o.device}, {ref_name}[{i}] is on {r.device}")
        if o.dtype != r.dtype:
            mixed_ok = state and o.dtype == torch.float32 and r.dtype in LOW_PRECISION
            if not mixed_ok:
                allowed = f"{r.dtype}" + (" or torch.float32" if state and r.dtype in LOW_PRECISION else "")
                raise ValueError(f"{name}[{i}] has dtype {o.dtype}, {ref_name}[{i}] has {r.dtype} (expected {allowed})")


def check_no_alias(ref_name: str, ref: Sequence[Tensor], name: str, other: Sequence[Tensor]) -> None:
    """Out-of-place kernels promise not to write their inputs; refuse an output that is one."""
    for i, (r, o) in enumerate(zip(ref, other)):
        if r.numel() and o.data_ptr() == r.data_ptr():
            raise ValueError(
                f"{name}[{i}] is the same memory as {ref_name}[{i}]; use the in-place form to overwrite the weights"
            )


def check_distance(distance) -> float:
    d = float(distance)
    if not d >= 0.0:  # also rejects NaN
        raise ValueError(f"distance must be >= 0, got {distance}")
    return d


def group_indices(*lists: Sequence[Tensor]) -> list[list[int]]:
    """Split indices into runs that one kernel launch can serve.

    One launch needs one device and one dtype per operand; a model with fp32
    norms next to bf16 matrices or a stage spread over two devices yields one
    group per combination. Order inside a group is preserved so that
    flattened-buffer layouts stay recognisable.
    """
    n = len(lists[0])
    first = tuple((lst[0].device, lst[0].dtype) for lst in lists) if n else None
    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        key = tuple((lst[i].device, lst[i].dtype) for lst in lists)
        if key == first:
            groups.setdefault(first, []).append(i)
        else:
            groups.setdefault(key, []).append(i)
    return list(groups.values())


def take(lst: Sequence[Tensor], idx: list[int]) -> list[Tensor]:
    if len(idx) == len(lst):
        return list(lst)
    return [lst[i] for i in idx]


#: The Triton kernels' launch shape, (elements, warps) per program, unless
#: ``triton_kernels.launch_shape`` says otherwise; the kernels' targets are
#: judged at it (here, where no Triton import is needed).
DEFAULT_LAUNCH = (4096, 8)


def check_launch_shape(block: int, warps: int) -> None:
    """``ValueError`` unless ``block`` is a power of two from 128 to 65536
    and ``warps`` one from 1 to 32: the launch shapes the Triton kernels
    take (checked here, where no Triton import is needed)."""
    for name, v, lo, hi in (("block", block, 128, 1 << 16), ("warps", warps, 1, 32)):
        if type(v) is not int or not lo <= v <= hi or v & (v - 1):
            raise ValueError(f"{name} must be a power of two from {lo} to {hi}, got {v!r}")

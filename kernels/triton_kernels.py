"""Fused Triton kernels: one launch over every tensor of a group.

Imported only when the Triton backend is selected (see
:mod:`pipesim.kernels.backend`), so CPU-only installs never need Triton.

Layout: the tensors are not copied into a flat buffer. Each launch gets a
*pointer table* (one row of raw addresses per operand list) and a *block
table* (for every program: which tensor, which element offset). A program
loads its addresses from the tables, casts them to typed pointers and works
on ``BLOCK`` elements, so one launch covers a model of any shape and every
operand is read once and written once: the minimum traffic, which is why
this path beats the foreach path (several launches, a pass per op).

Both tables depend only on the tensors' addresses and sizes, which are
stable from step to step (optimizers update in place), so they are cached on
the device: with the same weights, state and a reused ``out=`` buffer a call
costs one launch and no host-to-device copy.

Performance details that matter on a GPU: full blocks take an unmasked
branch (a mask built from a runtime length would stop vectorisation), and
when every address is 16-byte aligned the kernels say so, allowing 128-bit
loads. Numerics: values are upcast to float32, computed, and rounded once
to the destination dtype (round to nearest even); ``sqrt_rn`` and
``div_rn`` keep Adam's denominator IEEE-exact instead of Triton's fast
approximations. float64 groups are left to the foreach path (Triton passes
Python scalars as float32).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from pipesim.kernels._checks import DEFAULT_LAUNCH, check_launch_shape
from pipesim.kernels.foreach import flat_view

#: Elements and warps per program of every launch (:func:`launch_shape`
#: changes them inside a ``with``: the kernels benchmark sweeps them).
BLOCK, NUM_WARPS = DEFAULT_LAUNCH

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@contextmanager
def launch_shape(block: int, warps: int):
    """Launch with ``block`` elements and ``warps`` warps per program inside
    the ``with``; the results are the same bits whatever the shape (every
    element is computed alone)."""
    global BLOCK, NUM_WARPS
    check_launch_shape(block, warps)
    saved = BLOCK, NUM_WARPS
    BLOCK, NUM_WARPS = block, warps
    try:
        yield
    finally:
        BLOCK, NUM_WARPS = saved


def supports(lists: list[list[Tensor]]) -> bool:
    """Dtypes Triton handles here, and layouts a flat offset can address."""
    return all(lst[0].dtype in _TL for lst in lists) and all(t.is_contiguous() for lst in lists for t in lst)


# --------------------------------------------------------------------- device code


@triton.jit
def _typed(table, t, TY: tl.constexpr, ALIGNED: tl.constexpr):
    p = tl.load(table + t).to(tl.pointer_type(TY))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _axpy_body(x_ptr, y_ptr, o_ptr, offs, mask, alpha, O_TY: tl.constexpr):
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    tl.store(o_ptr + offs, (x + alpha * y).to(O_TY), mask=mask)


@triton.jit
def _axpy_kernel(
    X,
    Y,
    O,
    NUMELS,
    BLK_T,
    BLK_OFF,
    alpha,
    X_TY: tl.constexpr,
    Y_TY: tl.constexpr,
    O_TY: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """o = x + alpha * y  (SGD prediction with alpha = -s*lr; 2BW update)."""
    pid = tl.program_id(0)
    t = tl.load(BLK_T + pid)
    start = tl.multiple_of(tl.load(BLK_OFF + pid), BLOCK)  # keeps offs' alignment known
    n = tl.load(NUMELS + t)
    x_ptr = _typed(X, t, X_TY, ALIGNED)
    y_ptr = _typed(Y, t, Y_TY, ALIGNED)
    o_ptr = _typed(O, t, O_TY, ALIGNED)
    offs = start + tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
    if start + BLOCK <= n:
        _axpy_body(x_ptr, y_ptr, o_ptr, offs, None, alpha, O_TY)
    else:
        _axpy_body(x_ptr, y_ptr, o_ptr, offs, offs < n, alpha, O_TY)


@triton.jit
def _adam_body(w_ptr, m_ptr, v_ptr, o_ptr, offs, mask, neg_c, eps, O_TY: tl.constexpr):
    w = tl.load(w_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    den = tl.sqrt_rn(v) + eps
    tl.store(o_ptr + offs, (w + neg_c * tl.div_rn(m, den)).to(O_TY), mask=mask)


@triton.jit
def _adam_kernel(
    W,
    M,
    V,
    O,
    NUMELS,
    BLK_T,
    BLK_OFF,
    neg_c,
    eps,
    W_TY: tl.constexpr,
    M_TY: tl.constexpr,
    V_TY: tl.constexpr,
    O_TY: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """o = w - c * m / (sqrt(v) + eps'), bias corrections folded into c and eps'."""
    pid = tl.program_id(0)
    t = tl.load(BLK_T + pid)
    start = tl.multiple_of(tl.load(BLK_OFF + pid), BLOCK)  # keeps offs' alignment known
    n = tl.load(NUMELS + t)
    w_ptr = _typed(W, t, W_TY, ALIGNED)
    m_ptr = _typed(M, t, M_TY, ALIGNED)
    v_ptr = _typed(V, t, V_TY, ALIGNED)
    o_ptr = _typed(O, t, O_TY, ALIGNED)
    offs = start + tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
    if start + BLOCK <= n:
        _adam_body(w_ptr, m_ptr, v_ptr, o_ptr, offs, None, neg_c, eps, O_TY)
    else:
        _adam_body(w_ptr, m_ptr, v_ptr, o_ptr, offs, offs < n, neg_c, eps, O_TY)


@triton.jit
def _elastic_body(
    X,
    n_tensors,
    t,
    c_ptr,
    offs,
    mask,
    alpha,
    N_REP: tl.constexpr,
    X_TY: tl.constexpr,
    C_TY: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    c = tl.load(c_ptr + offs, mask=mask).to(tl.float32)
    acc = c * 0.0
    for r in tl.static_range(N_REP):
        x_ptr = _typed(X + r * n_tensors, t, X_TY, ALIGNED)
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        acc += x - c
        tl.store(x_ptr + offs, (x + alpha * (c - x)).to(X_TY), mask=mask)
    tl.store(c_ptr + offs, (c + alpha * acc).to(C_TY), mask=mask)


@triton.jit
def _elastic_kernel(
    X,
    C,
    n_tensors,
    NUMELS,
    BLK_T,
    BLK_OFF,
    alpha,
    N_REP: tl.constexpr,
    X_TY: tl.constexpr,
    C_TY: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """EASGD: every replica and the centre read once and written once.

    Replica r's pointers are row r of the (N_REP, n_tensors) table ``X``. The
    centre is stored last, so each d_r = alpha (x_r - c) uses old values.
    """
    pid = tl.program_id(0)
    t = tl.load(BLK_T + pid)
    start = tl.multiple_of(tl.load(BLK_OFF + pid), BLOCK)  # keeps offs' alignment known
    n = tl.load(NUMELS + t)
    c_ptr = _typed(C, t, C_TY, ALIGNED)
    offs = start + tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
    if start + BLOCK <= n:
        _elastic_body(X, n_tensors, t, c_ptr, offs, None, alpha, N_REP, X_TY, C_TY, ALIGNED)
    else:
        _elastic_body(X, n_tensors, t, c_ptr, offs, offs < n, alpha, N_REP, X_TY, C_TY, ALIGNED)


# ----------------------------------------------------------------------- host code


@lru_cache(maxsize=32)
def _block_table(numels: tuple[int, ...], device: torch.device, block: int):
    counts = torch.tensor([(n + block - 1) // block for n in numels], dtype=torch.int64)
    nblocks = int(counts.sum())
    blk_t = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first = torch.cumsum(counts, 0) - counts
    blk_off = (torch.arange(nblocks) - first[blk_t]) * block
    return (
        torch.tensor(numels, dtype=torch.int64, device=device),
        blk_t.to(torch.int32).to(device),
        blk_off.to(device),
        nblocks,
    )


_ptr_cache: OrderedDict = OrderedDict()


def _ptr_table(lists: list[list[Tensor]], device: torch.device) -> Tensor:
    ptrs = tuple(tuple(t.data_ptr() for t in lst) for lst in lists)
    key = (device, ptrs)
    table = _ptr_cache.get(key)
    if table is None:
        table = torch.tensor(ptrs, dtype=torch.int64).to(device)
        _ptr_cache[key] = table
        if len(_ptr_cache) > 64:
            _ptr_cache.popitem(last=False)
    else:
        _ptr_cache.move_to_end(key)
    return table


def _prepare(lists: list[list[Tensor]]):
    """Collapse back-to-back layouts to one tensor; build (or fetch) both tables."""
    flats = [flat_view(lst) for lst in lists]
    if all(f is not None for f in flats):
        lists = [[f] for f in flats]
    device = lists[0][0].device
    numels, blk_t, blk_off, nblocks = _block_table(tuple(t.numel() for t in lists[0]), device, BLOCK)
    aligned = all(t.data_ptr() % 16 == 0 for lst in lists for t in lst)
    return _ptr_table(lists, device), numels, blk_t, blk_off, nblocks, aligned, len(lists[0])


def axpy(out: list[Tensor], x: list[Tensor], y: list[Tensor], alpha: float) -> None:
    table, numels, blk_t, blk_off, nblocks, aligned, _ = _prepare([x, y, out])
    if nblocks:
        _axpy_kernel[(nblocks,)](
            table[0],
            table[1],
            table[2],
            numels,
            blk_t,
            blk_off,
            float(alpha),
            X_TY=_TL[x[0].dtype],
            Y_TY=_TL[y[0].dtype],
            O_TY=_TL[out[0].dtype],
            ALIGNED=aligned,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )


def adam_apply(out: list[Tensor], w: list[Tensor], m: list[Tensor], v: list[Tensor], c: float, eps: float) -> None:
    table, numels, blk_t, blk_off, nblocks, aligned, _ = _prepare([w, m, v, out])
    if nblocks:
        _adam_kernel[(nblocks,)](
            table[0],
            table[1],
            table[2],
            table[3],
            numels,
            blk_t,
            blk_off,
            -float(c),
            float(eps),
            W_TY=_TL[w[0].dtype],
            M_TY=_TL[m[0].dtype],
            V_TY=_TL[v[0].dtype],
            O_TY=_TL[out[0].dtype],
            ALIGNED=aligned,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )


def elastic(replicas: list[list[Tensor]], center: list[Tensor], alpha: float) -> None:
    lists = [*replicas, center]
    table, numels, blk_t, blk_off, nblocks, aligned, n_tensors = _prepare(lists)
    if nblocks:
        # Rows 0..N-1 of the table are the replicas, contiguous as the kernel expects.
        _elastic_kernel[(nblocks,)](
            table,
            table[len(replicas)],
            n_tensors,
            numels,
            blk_t,
            blk_off,
            float(alpha),
            N_REP=len(replicas),
            X_TY=_TL[replicas[0][0].dtype],
            C_TY=_TL[center[0].dtype],
            ALIGNED=aligned,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )

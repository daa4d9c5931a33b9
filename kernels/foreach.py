"""Multi-tensor path: ``torch._foreach_*`` ops, runs on every device.

Why the structure below: these kernels are memory-bound, so their cost is
the number of passes over main memory, plus per-op overhead for the many
small tensors (biases, norms) of a model.

* foreach ops replace the per-tensor Python loop: one call walks all tensors
  in C++ (on CUDA, a handful of multi-tensor-apply launches).
* On CPU a kernel of several ops (Adam prediction: sqrt, add, addcdiv) is run
  **tile by tile**: the lists are cut into tiles of :data:`TILE_NUMEL`
  elements (big tensors split, small ones packed together) and all ops of the
  kernel run on one tile before the next. Temporaries then live in the L2
  cache, so main memory sees each operand once, as in a fused kernel. GPUs
  gain nothing from this (per-launch cost dominates), so there the whole
  lists are processed op by op.
* Lists laid out back to back in one storage (a flattened parameter buffer,
  :class:`~pipesim.kernels.buffers.WeightStash` slots, outputs this module
  allocates) are treated as one flat tensor: fewer, larger ops.
* ``out=`` forms (``torch.add(..., out=)``) are used where a tile is a single
  tensor, saving the copy-then-update pass that foreach (which has no
  ``out=``) would need.

* Big tensors are cut into chunks starting on 4 KiB boundaries: misaligned
  chunks (split cache lines) cost ~25%.

Arithmetic for 16-bit weights is done in float32 and rounded once: operands
are converted into float32 scratch tiles, computed on, and the result is
converted back by one copy. (Mixed-dtype torch ops would also round once but
run a scalar loop about ten times slower.)
"""

from __future__ import annotations

import os
import threading
from functools import lru_cache

import torch
from torch import Tensor

from pipesim.kernels._checks import opmath_dtype


def _l2_bytes() -> int:
    """Size of one core's L2 cache, from the OS; 1 MiB when it does not say."""
    try:
        size = os.sysconf("SC_LEVEL2_CACHE_SIZE")
        if size > 0:
            return int(size)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        base = "/sys/devices/system/cpu/cpu0/cache"
        for entry in sorted(os.listdir(base)):
            with open(f"{base}/{entry}/level") as f:
                if f.read().strip() != "2":
                    continue
            with open(f"{base}/{entry}/size") as f:
                text = f.read().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
            return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return 1 << 20


def _tile_numel() -> int:
    """Elements per CPU tile, from this machine's caches and torch's threads.

    One fp32 operand tile is as large as the L2 caches of the threads that
    share it (rounded down to a power of two, at least 64K elements). The
    whole working set of a tile (weights, state, output, scratch) then spills
    into L3, which still spares main memory, while every op on a tile keeps
    enough elements per thread to amortise its fixed cost (a parallel region
    per op, ~10 µs). Measured on a 2-core EPYC (1 MiB L2 each, 32 MiB L3):
    256K–1M elements are within noise of each other, 128K loses ~5% on Adam
    and bf16, 32K ~40%, whole-list processing 15–45%.
    """
    per_operand = _l2_bytes() * max(1, torch.get_num_threads()) // 4
    return max(1 << 16, 1 << (per_operand.bit_length() - 1))


TILE_NUMEL = _tile_numel()
"""Elements per CPU tile (see :func:`_tile_numel`); tests shrink it."""

_local = threading.local()


def _scratch(device: torch.device, dtype: torch.dtype, numel: int, slot: int) -> Tensor:
    """A reused per-thread buffer: allocating 1 MiB per call costs page faults."""
    cache = getattr(_local, "bufs", None)
    if cache is None:
        cache = _local.bufs = {}
    key = (device, dtype, slot)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def flat_view(tensors: list[Tensor]) -> Tensor | None:
    """One 1-D view over ``tensors`` if they lie back to back in one storage."""
    if not tensors:
        return None
    t0 = tensors[0]
    if not t0.is_contiguous():
        return None
    if len(tensors) == 1:
        return t0.view(-1)
    base = t0.untyped_storage().data_ptr()
    step = t0.element_size()
    expect = t0.data_ptr()
    total = 0
    for t in tensors:
        if t.data_ptr() != expect or not t.is_contiguous():
            return None
        n = t.numel()
        expect += n * step
        total += n
    # Adjacent addresses can belong to two allocations; only one storage may be viewed.
    if any(t.untyped_storage().data_ptr() != base for t in tensors[1:]):
        return None
    return t0.as_strided((total,), (1,))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@lru_cache(maxsize=64)
def _plan(numels: tuple[int, ...], tile: int, split: bool) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Cut the tensors into tiles of at most ``tile`` elements (unless ``split`` is off).

    A tile is a tuple of pieces ``(tensor index, start, stop)``. A tensor of at
    least half a tile gets tiles of its own, cut into equal chunks (whole when
    ``split`` is off), so such tiles are one piece and can use ``out=`` ops;
    smaller tensors are packed together, in order.
    """
    tiles: list[tuple[tuple[int, int, int], ...]] = []
    cur: list[tuple[int, int, int]] = []
    fill = 0
    for i, n in enumerate(numels):
        if n == 0:
            continue
        if 2 * n >= tile:
            chunks = _ceil_div(n, tile) if split else 1
            # Chunks start at multiples of 1024 elements (see the module docstring).
            align = min(1024, tile)
            step = _ceil_div(_ceil_div(n, chunks), align) * align
            tiles.extend(((i, a, min(n, a + step)),) for a in range(0, n, step))
            continue
        if fill + n > tile:
            tiles.append(tuple(cur))
            cur, fill = [], 0
        cur.append((i, 0, n))
        fill += n
    if cur:
        tiles.append(tuple(cur))
    return tuple(tiles)


def run(
    body,
    operands: list[list[Tensor]],
    scratch: tuple[torch.dtype, ...] = (),
    *,
    split: bool = True,
    tile: int | None = None,
) -> None:
    """Apply ``body(ops, scratch_lists)`` over aligned operand lists.

    ``body`` receives lists of equal-shaped tensors (whole tensors, or 1-D
    pieces on CPU) and, for each requested scratch dtype, a list of matching
    scratch tensors. It must be elementwise: pieces are independent.
    ``split=False`` keeps big tensors whole (single-pass kernels gain nothing
    from tiling); ``tile`` overrides :data:`TILE_NUMEL`.
    """
    first = operands[0]
    if not first:
        return
    device = first[0].device
    tile = TILE_NUMEL if tile is None else tile
    numels = [t.numel() for t in first]
    total = sum(numels)
    if device.type != "cpu" or total <= tile:
        scr = []
        for k, dt in enumerate(scratch):
            buf = (
                _scratch(device, dt, total, k) if device.type == "cpu" else torch.empty(total, dtype=dt, device=device)
            )
            scr.append([p.view(t.shape) for p, t in zip(buf.split(numels), first)])
        body(operands, scr)
        return

    flats = [flat_view(lst) for lst in operands]
    if all(f is not None for f in flats):
        views = [[f] for f in flats]
        numels = [total]
    else:
        contiguous = [all(lst[i].is_contiguous() for lst in operands) for i in range(len(first))]
        if not all(contiguous):
            # Rare (e.g. channels-last weights): run those tensors whole, the rest tiled.
            odd = [i for i, c in enumerate(contiguous) if not c]
            good = [i for i, c in enumerate(contiguous) if c]
            if good:
                run(body, [[lst[i] for i in good] for lst in operands], scratch, split=split, tile=tile)
            sub = [[lst[i] for i in odd] for lst in operands]
            body(sub, [[torch.empty(t.shape, dtype=dt, device=device) for t in sub[0]] for dt in scratch])
            return
        # 1-D views are made per piece below, only where a tensor is cut or
        # packed: a view per tensor per call costs ~1 µs each, 5-10% of a kernel.
        views = operands

    plan = _plan(tuple(numels), tile, split)
    if scratch:
        longest = max(b - a for t in plan for _, a, b in t)
        bufs = [_scratch(device, dt, max(longest, tile), k) for k, dt in enumerate(scratch)]
    else:
        bufs = []
    for pieces in plan:
        if len(pieces) == 1:
            i, a, b = pieces[0]
            whole = a == 0 and b == numels[i]
            if whole and not bufs:
                ops = [[v[i]] for v in views]
            else:
                ops = [[v[i].view(-1)[a:b]] for v in views]
            scr = [[buf[: b - a]] for buf in bufs]
        else:
            ops = [[v[i].view(-1) for i, _, _ in pieces] for v in views]
            lens = [b for _, _, b in pieces]
            n = sum(lens)
            scr = [list(buf[:n].split(lens)) for buf in bufs]
        body(ops, scr)


# ---------------------------------------------------------------- tile bodies


def _aliased(a: list[Tensor], b: list[Tensor]) -> bool:
    """``a`` is ``b`` (in-place call). Empty tensors may share address 0, so they do not count."""
    return all(x.data_ptr() == y.data_ptr() for x, y in zip(a, b) if x.numel())


def _same(*lists: list[Tensor]) -> bool:
    dt = lists[0][0].dtype
    return all(lst[0].dtype == dt for lst in lists)


def axpy(out: list[Tensor], x: list[Tensor], y: list[Tensor], alpha: float) -> None:
    """out = x + alpha * y (SGD prediction, 2BW update). ``out`` may be ``x``.

    16-bit weights go through float32 scratch: with mixed dtypes torch's CPU
    kernels fall back to a scalar loop (~10x slower), and an all-bf16
    ``torch.add(..., alpha=)`` rounds ``alpha`` to bf16 and misses the
    single-rounding result in ~1% of elements.
    """
    if _same(x, y) and opmath_dtype(x[0].dtype) == x[0].dtype:

        def body(ops, _):
            x_, y_, o_ = ops
            if len(o_) == 1:
                torch.add(x_[0], y_[0], alpha=alpha, out=o_[0])
            else:
                if not _aliased(o_, x_):
                    torch._foreach_copy_(o_, x_)
                torch._foreach_add_(o_, y_, alpha=alpha)

        run(body, [x, y, out], split=False)
        return

    f32 = opmath_dtype(x[0].dtype)
    y_up = y[0].dtype != f32

    def body_low(ops, scr):
        x_, y_, o_ = ops
        s_ = scr[0]
        if y_up:
            torch._foreach_copy_(scr[1], y_)
            y_ = scr[1]
        torch._foreach_copy_(s_, x_)
        torch._foreach_add_(s_, y_, alpha=alpha)
        torch._foreach_copy_(o_, s_)  # the one rounding to the weights' dtype

    run(body_low, [x, y, out], (f32, f32) if y_up else (f32,))


def adam_apply(out: list[Tensor], w: list[Tensor], m: list[Tensor], v: list[Tensor], c: float, eps: float) -> None:
    """out = w - c * m / (sqrt(v) + eps). ``out`` may be ``w``."""
    f32 = opmath_dtype(w[0].dtype)
    if _same(w, m, v) and f32 == w[0].dtype:

        def body(ops, scr):
            w_, m_, v_, o_ = ops
            s_ = scr[0]
            if len(o_) == 1:
                torch.sqrt(v_[0], out=s_[0])
                s_[0].add_(eps)
                torch.addcdiv(w_[0], m_[0], s_[0], value=-c, out=o_[0])
            else:
                torch._foreach_copy_(s_, v_)
                torch._foreach_sqrt_(s_)
                torch._foreach_add_(s_, eps)
                if not _aliased(o_, w_):
                    torch._foreach_copy_(o_, w_)
                torch._foreach_addcdiv_(o_, m_, s_, value=-c)

        run(body, [w, m, v, out], (f32,))
        return

    # 16-bit weights: every operand upcast into float32 scratch, one rounding at the end.
    m_up = m[0].dtype != f32

    def body_low(ops, scr):
        w_, m_, v_, o_ = ops
        s_, t_ = scr[0], scr[1]
        torch._foreach_copy_(s_, v_)
        torch._foreach_sqrt_(s_)
        torch._foreach_add_(s_, eps)
        if m_up:
            u_ = scr[2]
            torch._foreach_copy_(u_, m_)
            m_ = u_
        torch._foreach_copy_(t_, w_)
        torch._foreach_addcdiv_(t_, m_, s_, value=-c)
        torch._foreach_copy_(o_, t_)

    run(body_low, [w, m, v, out], (f32, f32, f32) if m_up else (f32, f32))


def _mean_into(a: list[Tensor], xs: list[list[Tensor]]) -> None:
    """a = mean of xs as a running lerp: one pass per replica, no separate scaling."""
    if len(a) == 1 and len(xs) >= 2:
        torch.lerp(xs[0][0], xs[1][0], 0.5, out=a[0])
        rest = 2
    else:
        torch._foreach_copy_(a, xs[0])
        rest = 1
    for r in range(rest, len(xs)):
        torch._foreach_lerp_(a, xs[r], 1.0 / (r + 1))


def elastic(replicas: list[list[Tensor]], center: list[Tensor], alpha: float) -> None:
    """EASGD step in place; every d_r uses the values from before the call.

    Rewritten with lerps to minimise passes: x_r <- lerp(x_r, c, alpha) is
    x_r - alpha (x_r - c), and c + alpha sum_r (x_r - c) is
    lerp(c, mean_r x_r, N alpha); the mean is taken before any replica moves
    and the centre moves last.
    """
    n = len(replicas)
    f32 = opmath_dtype(center[0].dtype)
    if _same(*replicas, center) and f32 == center[0].dtype:

        def body(ops, scr):
            *xs, c = ops
            a = scr[0]
            _mean_into(a, xs)
            for x in xs:
                torch._foreach_lerp_(x, c, alpha)
            torch._foreach_lerp_(c, a, n * alpha)

        run(body, [*replicas, center], (f32,))
        return

    # 16-bit replicas (centre 16-bit or float32): float32 copies per tile.
    c_up = center[0].dtype != f32

    def body_low(ops, scr):
        *xs, c = ops
        a, *xs32 = scr[: n + 1]
        c32 = scr[n + 1] if c_up else c
        for x32, x in zip(xs32, xs):
            torch._foreach_copy_(x32, x)
        if c_up:
            torch._foreach_copy_(c32, c)
        _mean_into(a, xs32)
        for x32, x in zip(xs32, xs):
            torch._foreach_lerp_(x32, c32, alpha)
            torch._foreach_copy_(x, x32)
        torch._foreach_lerp_(c32, a, n * alpha)
        if c_up:
            torch._foreach_copy_(c, c32)

    k = n + 2 if c_up else n + 1
    tile = max(min(TILE_NUMEL, 1024), 2 * TILE_NUMEL // k // 1024 * 1024)  # k scratch tiles in cache
    run(body_low, [*replicas, center], (f32,) * k, tile=tile)


def copy(dst: list[Tensor], src: list[Tensor]) -> None:
    fd, fs = flat_view(dst), flat_view(src)
    if fd is not None and fs is not None and fd.dtype == fs.dtype:
        fd.copy_(fs)
    else:
        torch._foreach_copy_(dst, src)


# ------------------------------------------------- exact in-place prediction

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _delta_sgd(d: list[Tensor], v: list[Tensor], c: float) -> None:
    """d = c * v, each step exactly rounded so a later call reproduces it bit for bit."""
    torch._foreach_copy_(d, v)
    torch._foreach_mul_(d, c)


def _delta_adam(d: list[Tensor], m: list[Tensor], v: list[Tensor], c: float, eps: float) -> None:
    """d = c * m / (sqrt(v) + eps), one exactly rounded op at a time."""
    torch._foreach_copy_(d, v)
    torch._foreach_sqrt_(d)
    torch._foreach_add_(d, eps)
    for di, mi in zip(d, m):
        torch.div(mi, di, out=di)
    torch._foreach_mul_(d, c)


def residual_predict(w: list[Tensor], k: list[Tensor], state: list[list[Tensor]], delta) -> list:
    """Overwrite ``w`` with ``w - delta`` and keep what restores it exactly.

    ``delta(d, state_pieces)`` fills opmath scratch ``d``. Restore recomputes
    r = (w - delta) + delta with the same exactly rounded ops, so r is known
    then too; the weights differ from r by a few units in the last place, and
    that difference of the raw bit patterns fits in int8 (``k``). Elements
    where it does not (weights far smaller than their update, or a sign flip)
    are kept as exceptions: their index and old value, or a copy of the whole
    piece when more than 1/8 of it is exceptional.
    """
    bits = _BITS[w[0].element_size()]
    wdt = w[0].dtype
    exceptions: list = []

    def body(ops, scr):
        w_, k_, *st = ops
        d_, p_, r_ = scr
        delta(d_, *st)
        torch._foreach_copy_(p_, w_)
        torch._foreach_sub_(p_, d_)  # p = w - d, rounded once to the weight dtype
        torch._foreach_copy_(r_, p_)
        torch._foreach_add_(r_, d_)  # r = p + d, what restore will recompute
        for wi, ki, ri in zip(w_, k_, r_):
            diff = wi.view(bits) - ri.view(bits)
            d8 = diff.to(torch.int8)  # (Tensor.copy_ into int8 takes a ~100x slower path)
            if not torch.equal(d8.to(bits), diff):
                bad = (diff < -128) | (diff > 127)
                nbad = int(bad.sum())
                if nbad * 8 > diff.numel():
                    exceptions.append((wi, None, wi.clone()))
                    diff.zero_()
                else:
                    idx = bad.nonzero(as_tuple=True)
                    exceptions.append((wi, idx, wi[idx].clone()))
                    diff[idx] = 0
                d8 = diff.to(torch.int8)
            ki.copy_(d8)
        torch._foreach_copy_(w_, p_)

    with torch.no_grad():
        run(body, [w, k, *state], (opmath_dtype(wdt), wdt, wdt))
    return exceptions


def residual_restore(w: list[Tensor], k: list[Tensor], state: list[list[Tensor]], delta, exceptions: list) -> None:
    bits = _BITS[w[0].element_size()]

    def body(ops, scr):
        w_, k_, *st = ops
        d_ = scr[0]
        delta(d_, *st)
        torch._foreach_add_(w_, d_)  # w = p + d = r, bit for bit as at predict time
        for wi, ki in zip(w_, k_):
            wi.view(bits).add_(ki)

    with torch.no_grad():
        run(body, [w, k, *state], (opmath_dtype(w[0].dtype),))
        for wi, idx, vals in exceptions:
            if idx is None:
                wi.copy_(vals)
            else:
                wi[idx] = vals

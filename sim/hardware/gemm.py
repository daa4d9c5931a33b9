"""The time of one GEMM from its shape: tile and wave quantisation, or a measured table.

A GPU computes ``C = A @ B`` (A is M x K, B is K x N, ``batch`` such products
in one kernel) in output tiles of ``tm x tn``: each tile is one thread block
that walks the whole K dimension, and the tiles are dealt to the device's
streaming multiprocessors (SMs) in waves. Two quantisations follow (NVIDIA,
"Matrix Multiplication Background User's Guide", DU-09799-001, sections
"Tile Quantization" and "Wave Quantization"):

* **tile quantisation**: a dimension that is not a multiple of the tile
  computes whole tiles anyway, ``ceil(M / tm) * tm`` rows;
* **wave quantisation**: ``tiles = ceil(M / tm) * ceil(N / tn) * batch`` tiles
  on ``sms`` SMs run in ``ceil(tiles / sms)`` waves where ``tiles / sms`` would
  suffice, so 133 tiles on an H100's 132 SMs take as long as 264.

A GEMM of fewer tiles than SMs is split along K (split-K, as cuBLAS and
cuDNN do for such shapes): each tile's K is cut into ``s`` slices, so
``tiles * s`` work units of ``ceil(K / s)`` run at once, at most one wave of
them (``s <= sms // tiles``); the ``s`` that takes least time is used. So one
GEMM takes

    t = fixed_s + ceil(tiles * s / sms) * sms * 2 * tm * tn * (ceil(K / s) + k_overhead) / (peak_flops * max_efficiency)

which is ``flops / (peak_flops * efficiency) + fixed_s`` with ``flops = 2 M N K
batch`` and, for ``s = 1``,

    efficiency = max_efficiency
                 * (tiles / sms) / ceil(tiles / sms)          # wave quantisation
                 * M N batch / (tiles * tm * tn)              # tile quantisation
                 * K / (K + k_overhead)                        # each tile's fixed K work

``max_efficiency`` is what the best shapes reach (whole waves, whole tiles,
long K). ``k_overhead`` is the part of a work unit's time that does not
shrink with K: filling its load pipeline before the first multiply and
writing (or, split, adding up) its tm x tn output after the last (the
prologue and epilogue of every CUTLASS main loop), expressed as the K
elements of multiply it costs; a GEMM with a short K spends a larger share
of its time there, and every slice of a split K pays it again, which
bounds what splitting gains. (The split partial sums' reduction is not
priced apart: it is part of that fixed work.)
``fixed_s`` is the device time every GEMM kernel takes whatever its size
(the host's launch gap is separate: ``DeviceSpec.kernel_overhead_s``).

A GEMM cannot beat the traffic of its operands either:
:func:`gemm_seconds` takes ``fixed_s + max(compute, (M K + K N + M N) * batch
* dtype_bytes / mem_bandwidth)``.

Where a device names a measured table (``DeviceSpec.gemm_table``, a file
``measurements/<name>.json``), the table replaces the model within its range:
its points are interpolated multilinearly in log space (log of each of b, m,
n, k; the log of the achieved FLOP/s), between the nearest measured shapes
on every axis, so a measured shape comes back as measured. Outside the range
a shape is clamped onto it per axis, and the model carries it the rest of
the way: ``t = t_table(clamped) * t_model(shape) / t_model(clamped)``.

Held against XLA's measured H100 table (all 375 shapes, b 1-4 and m, n, k
256-4096; ``measurements/gemm-h100-bf16.json``), the model with its three
constants fitted (:func:`fit_model`) prices each shape within 8.4% root mean
square, with medians of 0.98-1.02 of the measured time in every band of
waves from under a quarter to many (a model without split-K, fitted to the
shapes of a full wave or more, prices those under half a wave 1.3-1.6x too
slow; with ``k_overhead`` held at 0 the best fit's error is 9.6%). The tile
is one size for every shape, where cuBLAS picks among several.

The module is pure (no torch, no device): :func:`model_seconds` and
:func:`efficiency` take the constants; :func:`gemm_seconds` reads them from a
:class:`~pipesim.sim.hardware.machines.DeviceSpec`.
"""

from __future__ import annotations

import functools
import importlib.resources
import itertools
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipesim.sim.errors import InputError
from pipesim.sim.files import parse_json, read_text

if TYPE_CHECKING:
    from pipesim.sim.hardware.machines import DeviceSpec

#: The output tile of one thread block when a device names none: 128 x 128,
#: the tile NVIDIA's Matrix Multiplication Background guide uses for its
#: quantisation examples, and a common cuBLAS tensor-core tile.
DEFAULT_TILE = (128, 128)

#: Prefix of a measured table's file name in ``measurements/``.
TABLE_PREFIX = "gemm-"


class GemmError(InputError):
    """A GEMM shape or a measured GEMM table is not usable."""


def _check_shape(m: int, n: int, k: int, batch: int) -> None:
    for name, v in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise GemmError(f"GEMM {name} must be a positive integer, got {v!r}")


def tiles(m: int, n: int, batch: int = 1, tile: Sequence[int] = DEFAULT_TILE) -> int:
    """Output tiles of ``batch`` products of M x N outputs."""
    return -(-m // tile[0]) * -(-n // tile[1]) * batch


def _tile_steps(t: int, k: int, sms: int, k_overhead: float) -> tuple[float, int]:
    """(the least waves x K-length of a work unit, its split s) over the
    splits of K the model allows (module doc); ties to fewer slices."""
    best = None
    for s in range(1, max(1, min(sms // t, k)) + 1):
        steps = math.ceil(t * s / sms) * (-(-k // s) + k_overhead)
        if best is None or steps < best[0]:
            best = (steps, s)
    assert best is not None
    return best


def split_k(
    m: int, n: int, k: int, batch: int = 1, *, sms: int, tile: Sequence[int] = DEFAULT_TILE, k_overhead: float = 0.0
) -> int:
    """The number of slices the model cuts K into (1: no split; more only
    when the GEMM has fewer tiles than the device has SMs)."""
    _check_shape(m, n, k, batch)
    return _tile_steps(tiles(m, n, batch, tile), k, sms, k_overhead)[1]


def efficiency(
    m: int,
    n: int,
    k: int,
    batch: int = 1,
    *,
    sms: int,
    max_efficiency: float,
    tile: Sequence[int] = DEFAULT_TILE,
    k_overhead: float = 0.0,
) -> float:
    """The fraction of peak one GEMM's multiply reaches (the module doc's
    formula; ``fixed_s`` aside): ``max_efficiency`` times the wave, tile and
    K factors, so at most ``max_efficiency``."""
    _check_shape(m, n, k, batch)
    steps, _ = _tile_steps(tiles(m, n, batch, tile), k, sms, k_overhead)
    return max_efficiency * (m * n * k * batch) / (steps * sms * tile[0] * tile[1])


def model_seconds(
    m: int,
    n: int,
    k: int,
    batch: int = 1,
    *,
    peak_flops: float,
    sms: int,
    max_efficiency: float,
    tile: Sequence[int] = DEFAULT_TILE,
    k_overhead: float = 0.0,
    fixed_s: float = 0.0,
) -> float:
    """Seconds of ``batch`` products (m x k) @ (k x n) by the tile and wave
    model alone: ``fixed_s + flops / (peak_flops * efficiency)``."""
    _check_shape(m, n, k, batch)
    steps, _ = _tile_steps(tiles(m, n, batch, tile), k, sms, k_overhead)
    return fixed_s + steps * sms * 2.0 * tile[0] * tile[1] / (peak_flops * max_efficiency)


# ---------------------------------------------------------------------------
# Measured tables
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class GemmTable:
    """Achieved FLOP/s of a full grid of shapes (every combination of the
    axes' values is measured), interpolated in log space."""

    name: str
    source: str
    #: the measured values of b, m, n, k, each ascending
    axes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    #: log(FLOP/s) by grid index (ib, im, in, ik)
    log_rate: dict

    def clamp(self, b: int, m: int, n: int, k: int) -> tuple[int, int, int, int]:
        """The shape moved onto the table's range, axis by axis."""
        return tuple(min(max(v, ax[0]), ax[-1]) for v, ax in zip((b, m, n, k), self.axes))  # type: ignore[return-value]

    def contains(self, b: int, m: int, n: int, k: int) -> bool:
        return self.clamp(b, m, n, k) == (b, m, n, k)

    def rate(self, b: int, m: int, n: int, k: int) -> float:
        """Achieved FLOP/s at a shape within the range: the measured value at a
        measured shape, else multilinear in (log b, log m, log n, log k)
        between the nearest measured values of each axis."""
        if not self.contains(b, m, n, k):
            raise GemmError(f"shape b={b} m={m} n={n} k={k} is outside table {self.name}")
        brackets = []
        for v, ax in zip((b, m, n, k), self.axes):
            hi = next(i for i, a in enumerate(ax) if a >= v)
            if ax[hi] == v or hi == 0:
                brackets.append(((hi, 1.0),))
            else:
                w = (math.log(v) - math.log(ax[hi - 1])) / (math.log(ax[hi]) - math.log(ax[hi - 1]))
                brackets.append(((hi - 1, 1.0 - w), (hi, w)))
        corners = list(itertools.product(*brackets))
        if len(corners) == 1:
            return math.exp(self.log_rate[tuple(i for i, _ in corners[0])])
        total = math.fsum(math.prod(w for _, w in c) * self.log_rate[tuple(i for i, _ in c)] for c in corners)
        return math.exp(total)

    def seconds(self, b: int, m: int, n: int, k: int) -> float:
        """Seconds of a shape within the range: its FLOPs at :meth:`rate`."""
        return 2.0 * b * m * n * k / self.rate(b, m, n, k)

    def points(self) -> Iterable[tuple[int, int, int, int, float]]:
        """Every measured (b, m, n, k, FLOP/s), in grid order."""
        for idx in itertools.product(*(range(len(ax)) for ax in self.axes)):
            yield (*(ax[i] for ax, i in zip(self.axes, idx)), math.exp(self.log_rate[idx]))


def _measurements():
    return importlib.resources.files("pipesim.sim.hardware").joinpath("measurements")


def table_names() -> list[str]:
    """Names of the committed GEMM tables (``measurements/gemm-*.json``)."""
    return sorted(
        p.name[: -len(".json")]
        for p in _measurements().iterdir()
        if p.name.startswith(TABLE_PREFIX) and p.name.endswith(".json")
    )


def is_table(name: str) -> bool:
    """Whether ``name`` names a committed table or a table file."""
    return isinstance(name, str) and (name in table_names() or (name.endswith(".json") and os.path.isfile(name)))


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> GemmTable:
    """A committed GEMM table by name (see :func:`table_names`), or a table
    file's path (``pipesim profile --gemm-table`` writes one)."""
    if name in table_names():
        source = f"measurements/{name}.json"
        text = _measurements().joinpath(f"{name}.json").read_text(encoding="utf-8")
    elif is_table(name):
        source = name
        text = read_text(name, "GEMM table", GemmError)
    else:
        raise GemmError(
            f"unknown GEMM table {name!r}; known: {', '.join(table_names()) or 'none'} (or a table file's path)"
        )
    data = parse_json(text, source, GemmError)
    if not isinstance(data, dict) or data.get("columns") != ["b", "m", "n", "k", "flops_per_s"]:
        raise GemmError(f"{source}: columns must be b, m, n, k, flops_per_s")
    values: dict[tuple[int, int, int, int], float] = {}
    for p in data.get("points", []):
        if (
            not isinstance(p, list)
            or len(p) != 5
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in p[:4])
            or not (isinstance(p[4], (int, float)) and not isinstance(p[4], bool) and 0 < p[4] < math.inf)
        ):
            raise GemmError(f"{source}: a point must be [b, m, n, k, flops_per_s] with positive values, got {p!r}")
        key = (p[0], p[1], p[2], p[3])
        if key in values:
            raise GemmError(f"{source}: shape {list(key)} is listed twice")
        values[key] = float(p[4])
    axes = tuple(tuple(sorted({key[i] for key in values})) for i in range(4))
    if not values or len(values) != math.prod(len(ax) for ax in axes):
        raise GemmError(f"{source}: the points must be a full grid of b, m, n, k values")
    index = [{v: i for i, v in enumerate(ax)} for ax in axes]
    log_rate = {tuple(ix[v] for ix, v in zip(index, key)): math.log(r) for key, r in values.items()}
    return GemmTable(name=name, source=str(data.get("source", "")), axes=axes, log_rate=log_rate)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# A device's GEMM
# ---------------------------------------------------------------------------


def _device_model(device: DeviceSpec, b: int, m: int, n: int, k: int) -> float:
    """The model's seconds with the memory roofline, on ``device``."""
    assert device.peak_flops is not None and device.sms is not None and device.gemm_max_efficiency is not None
    compute = model_seconds(
        m,
        n,
        k,
        b,
        peak_flops=device.peak_flops,
        sms=device.sms,
        max_efficiency=device.gemm_max_efficiency,
        tile=device.gemm_tile,
        k_overhead=device.gemm_k_overhead,
    )
    moved = (m * k + k * n + m * n) * b * device.dtype_bytes
    return device.gemm_fixed_s + max(compute, moved / device.mem_bandwidth)


@functools.lru_cache(maxsize=1 << 16)
def gemm_seconds(device: DeviceSpec, m: int, n: int, k: int, batch: int = 1) -> float:
    """Seconds of ``batch`` products (m x k) @ (k x n) in one kernel on ``device``.

    By the device's measured table where it has one (the model scaling a
    shape outside the table's range from the nearest shape within it), else
    by the tile and wave model with the memory roofline (the module doc). The
    device must have the shape model (``device.peak_flops`` set)."""
    _check_shape(m, n, k, batch)
    if device.peak_flops is None:
        raise GemmError(f"device {device.name!r} has no GEMM shape model (no peak_flops)")
    if device.gemm_table is None:
        return _device_model(device, batch, m, n, k)
    table = load_table(device.gemm_table)
    near = table.clamp(batch, m, n, k)
    measured = table.seconds(*near)
    if near == (batch, m, n, k):
        return measured
    return measured * _device_model(device, batch, m, n, k) / _device_model(device, *near)


def fit_model(
    points: Iterable[tuple[int, int, int, int, float]],
    *,
    peak_flops: float,
    sms: int,
    tile: Sequence[int] = DEFAULT_TILE,
    k_overheads: Iterable[int] = range(0, 1025),
) -> tuple[float, int, float, float]:
    """Fit the model's ``max_efficiency``, ``k_overhead`` and ``fixed_s`` to
    measured (b, m, n, k, FLOP/s) points: least squares of the relative
    error of the time, ``fixed_s`` and ``1 / max_efficiency`` solved exactly
    for each whole ``k_overhead`` tried, the best kept. Returns
    (max_efficiency, k_overhead, fixed_s, root mean square relative error).
    This is how the H100 presets' constants were derived from XLA's table
    (``tests/test_gemm.py`` derives them again)."""
    import numpy as np

    used = list(points)
    if len(used) < 3:
        raise GemmError("fitting the GEMM model needs at least 3 measured shapes")
    measured = np.array([2.0 * b * m * n * k / r for b, m, n, k, r in used])
    best = None
    for k0 in k_overheads:
        # t = fixed + x * steps * sms * 2 tm tn / peak, x = 1 / max_efficiency
        steps = np.array([_tile_steps(tiles(m, n, b, tile), k, sms, k0)[0] for b, m, n, k, _ in used])
        per_x = steps * sms * 2.0 * tile[0] * tile[1] / peak_flops
        a = np.stack([1.0 / measured, per_x / measured], axis=1)
        (fixed, x), *_ = np.linalg.lstsq(a, np.ones(len(used)), rcond=None)
        residual = a @ np.array([fixed, x]) - 1.0
        err = float(residual @ residual)
        if best is None or err < best[0]:
            best = (err, k0, float(fixed), float(x))
    assert best is not None
    err, k0, fixed, x = best
    return 1.0 / x, k0, fixed, math.sqrt(err / len(used))

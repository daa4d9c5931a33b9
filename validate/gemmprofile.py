"""Measure a device's GEMM throughput by shape: the table the simulator's
GEMM model reads (:mod:`pipesim.sim.hardware.gemm`).

``pipesim profile --gemm-table`` times ``torch.matmul`` of ``b`` independent
(m x k) @ (k x n) products over a full grid of shapes (every combination of
the axes' values, as the table format requires) on this machine's CPU or
GPU, and writes the points in the format of XLA's H100 table
(``sim/hardware/measurements/gemm-h100-bf16.json``): a device in a hardware
file names the written file as its ``gemm_table``, and every catalog layer's
GEMMs are then priced by interpolating the measured points. This is how a
user brings the efficiency of the GPU they will rent: the committed table
only covers the H100.

Each shape is timed as the mean of ``repeats`` calls after ``warmup`` calls
(the simulator adds times up, so it takes means, :func:`pipesim.validate.profiler.expected`),
synchronising a CUDA device around each; the operands are random and
allocated once per shape.
"""

from __future__ import annotations

import itertools
import platform
import time
from collections.abc import Callable, Sequence

import torch

from pipesim.validate.profiler import expected

#: The grid of XLA's table: b 1, 2, 4 and m, n, k 256 ... 4096 (375 shapes).
GPU_BATCHES = (1, 2, 4)
GPU_SIZES = (256, 512, 1024, 2048, 4096)
#: A grid a CPU measures in about a minute (2 cores: a 1024^3 product takes
#: tens of milliseconds).
CPU_BATCHES = (1, 2)
CPU_SIZES = (64, 128, 256, 512, 1024)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_grid(device: torch.device) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(batches, sizes) measured when none are given: XLA's grid on a GPU."""
    return (GPU_BATCHES, GPU_SIZES) if device.type == "cuda" else (CPU_BATCHES, CPU_SIZES)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_matmul(
    device: torch.device, dtype: torch.dtype, b: int, m: int, n: int, k: int, warmup: int = 2, repeats: int = 5
) -> float:
    """Mean seconds of one call of ``b`` (m x k) @ (k x n) products."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(b, m, k, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(b, k, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(b, m, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, w, out=out)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter_ns()
        torch.matmul(a, w, out=out)
        _sync(device)
        times.append(time.perf_counter_ns() - t0)
    return expected(times) / 1e9


def measure_table(
    device: torch.device,
    dtype: str = "fp32",
    batches: Sequence[int] | None = None,
    sizes: Sequence[int] | None = None,
    *,
    warmup: int = 2,
    repeats: int = 5,
    on_point: Callable[[int, int], None] | None = None,
) -> dict:
    """The GEMM table of ``device`` over the full grid of ``batches`` x
    ``sizes`` (m, n and k each take every size), as the simulator reads it.
    ``on_point(done, total)`` is called after each shape (a progress bar)."""
    default_b, default_s = default_grid(device)
    batches = tuple(sorted(set(batches or default_b)))
    sizes = tuple(sorted(set(sizes or default_s)))
    shapes = list(itertools.product(batches, sizes, sizes, sizes))
    points = []
    for i, (b, m, n, k) in enumerate(shapes):
        seconds = time_matmul(device, DTYPES[dtype], b, m, n, k, warmup, repeats)
        points.append([b, m, n, k, 2.0 * b * m * n * k / seconds])
        if on_point is not None:
            on_point(i + 1, len(shapes))
    name = device_name(device)
    return {
        "what": f"Achieved {dtype} GEMM throughput of {name} by shape, measured by `pipesim profile --gemm-table`: "
        "each point is b independent products (m x k) @ (k x n) by torch.matmul, and flops_per_s = "
        "2*b*m*n*k / the mean time of one call.",
        "device": name,
        "dtype": dtype,
        "source": f"measured with torch {torch.__version__} on {device.type} ({name}), {repeats} timed calls "
        f"after {warmup} per shape",
        "columns": ["b", "m", "n", "k", "flops_per_s"],
        "points": points,
    }

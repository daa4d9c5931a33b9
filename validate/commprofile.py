"""Measure what communication and memory traffic cost on this machine's backend.

The simulator prices a transfer as ``latency + bytes / bandwidth`` per link and
an optimizer step as ``bytes / mem_bandwidth``. To compare a real run with a
prediction, those numbers have to come from the same processes, backend and
thread settings the run uses, so everything here runs through
:func:`pipesim.validate.launch.launch` (one process per rank, gloo or NCCL):

* :func:`measure_p2p` ping-pongs float32 tensors between two ranks, takes the
  median one-way time per size (half a round trip: the round trip needs no
  clock agreement between processes), and fits the simulator's link model.
* :func:`measure_allreduce` times ``all_reduce`` (and optionally
  ``all_gather``) so ring-all-reduce predictions can be checked too.
* :func:`measure_memory_bandwidth` times ``c = a + alpha * b``, the access
  pattern of an optimizer step or a weight prediction.
* :func:`hardware_json` turns the numbers into a hardware description that
  :meth:`pipesim.sim.hardware.machines.Hardware.from_json` accepts.

Medians, not means: a single scheduler hiccup on a shared CPU box would
otherwise dominate. On a box with fewer idle cores than threads wanting to
run (each gloo rank has a main thread plus gloo's I/O threads), a woken
receiver can wait for the next scheduler tick (4 ms at HZ=250), and
round trips become bimodal: tens of microseconds or one tick. The profile
keeps the fastest sample per size next to the median so that shows. Every size gets warm-up iterations first (the first
send between a pair sets up connections and, with NCCL, communicators).
On CUDA the timed region is bracketed by ``torch.cuda.synchronize()``, since
NCCL calls return once the work is queued, not when it is done.

Run ``pipesim bench comm`` (:mod:`pipesim.experiments.bench.comm`) to print a profile.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipesim.sim.hardware.machines import Hardware
from pipesim.validate.launch import LaunchContext, launch
from pipesim.validate.numerics import intra_op_threads

__all__ = [
    "DEFAULT_COLLECTIVE_SIZES",
    "DEFAULT_P2P_SIZES",
    "CollectiveProfile",
    "P2PProfile",
    "fit_latency_bandwidth",
    "hardware_json",
    "measure_allreduce",
    "measure_memory_bandwidth",
    "measure_p2p",
]

#: 4 B .. 16 MiB: small sizes pin the latency, large ones the bandwidth.
DEFAULT_P2P_SIZES = (4, 1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
DEFAULT_COLLECTIVE_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)

_F32 = 4


@dataclass(frozen=True)
class P2PProfile:
    """Point-to-point costs between two ranks and the link model fitted to them."""

    backend: str
    sizes: tuple[int, ...]  # bytes actually sent (whole float32 elements)
    one_way_s: tuple[float, ...]  # median one-way time per size
    min_one_way_s: tuple[float, ...]  # fastest one-way time per size: far below the median = contended CPUs
    latency_s: float
    bandwidth_Bps: float
    repeats: int
    device: str
    #: CPU seconds one message of each size cost the sending and the receiving
    #: process (all its threads: the caller's posting and the backend's
    #: copying), medians per size; with gloo only (a GPU's copies run beside
    #: its kernels), else None. See :func:`measure_transfer_cpu`.
    send_cpu_s: tuple[float, ...] | None = None
    recv_cpu_s: tuple[float, ...] | None = None

    def predict(self, nbytes: float) -> float:
        """The fitted model's one-way time, the simulator's ``transfer_time`` for a switch link."""
        return self.latency_s + nbytes / self.bandwidth_Bps

    def cpu_costs(self) -> dict[str, dict[str, float]] | None:
        """``{"send": {"fixed_s", "bytes_per_s"}, "recv": ...}`` fitted to the
        CPU times (as latency + bytes / bandwidth), the hardware file's
        ``cpu`` costs; None when not measured."""
        if self.send_cpu_s is None or self.recv_cpu_s is None:
            return None
        out = {}
        for end, times in (("send", self.send_cpu_s), ("recv", self.recv_cpu_s)):
            fixed, rate = fit_latency_bandwidth(self.sizes, [max(t, 1e-9) for t in times])
            out[end] = {"fixed_s": fixed, "bytes_per_s": rate}
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CollectiveProfile:
    """Median collective times per size over ``world_size`` ranks.

    Per iteration the slowest rank's time counts (the collective is done
    when the last rank is), then the median over iterations. ``busbw_Bps``
    follows nccl-tests: ``bytes / time * 2(n-1)/n``, the per-link bandwidth a
    ring all-reduce achieved, directly comparable with a p2p bandwidth.
    ``allgather_s`` is per *input* size (each rank contributes ``size`` bytes).
    """

    backend: str
    world_size: int
    sizes: tuple[int, ...]
    allreduce_s: tuple[float, ...]
    busbw_Bps: tuple[float, ...]
    allgather_s: tuple[float, ...] | None
    repeats: int
    device: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------
# Point-to-point
# ---------------------------------------------------------------------------


def measure_p2p(
    backend: str = "gloo",
    sizes: Sequence[int] = DEFAULT_P2P_SIZES,
    repeats: int = 20,
    *,
    warmup: int = 3,
    timeout_s: float = 120.0,
    devices: Sequence[int] | None = None,
) -> P2PProfile:
    """Ping-pong between two fresh ranks and fit ``latency + bytes / bandwidth``.

    ``sizes`` are in bytes and rounded down to whole float32 elements (at
    least one). At least two distinct sizes are needed for the fit.
    """
    elems = _elements(sizes)
    if len(set(elems)) < 2:
        raise ValueError("measure_p2p: needs at least two distinct sizes to fit latency and bandwidth")
    _check_counts(repeats, warmup)
    results = launch(
        _p2p_worker,
        2,
        args=(elems, repeats, warmup),
        backend=backend,
        timeout_s=timeout_s,
        devices=devices,
        # measured the way the runtime runs: a core per rank, kept awake
        pin_cores=backend == "gloo",
        keep_cores_awake=backend == "gloo",
    )
    one_way, fastest, device, send_cpu, recv_cpu = results[0]
    nbytes = [n * _F32 for n in elems]
    latency, bandwidth = fit_latency_bandwidth(nbytes, one_way)
    return P2PProfile(
        backend=backend,
        sizes=tuple(nbytes),
        one_way_s=tuple(one_way),
        min_one_way_s=tuple(fastest),
        latency_s=latency,
        bandwidth_Bps=bandwidth,
        repeats=repeats,
        device=device,
        send_cpu_s=None if send_cpu is None else tuple(send_cpu),
        recv_cpu_s=None if recv_cpu is None else tuple(recv_cpu),
    )


#: how long a receiver sits idle before each timed message (see _p2p_worker)
IDLE_BEFORE_SEND_S = 0.002


def _p2p_worker(ctx: LaunchContext, elems: list[int], repeats: int, warmup: int):
    """One-way times in the runtime's own pattern: the receive is posted ahead
    (``irecv``) and waited on by a thread that has been idle for a while (a
    pipeline stage waiting for its input), the send is an ``isend`` of a
    freshly written tensor. Both ranks share the host's monotonic clock, so
    the receiver's wake-up minus the sender's stamp is the one-way time.

    Blocking ``send``/``recv`` in a tight loop measure a hot path the runtime
    never takes: on this project's 2-vCPU CI machine they gave 35-85 us, where
    a receiver idle for milliseconds wakes 175-230 us after the send (the
    virtual CPU has to be woken first), so a fit on them under-predicts
    every transfer.
    """
    peer = 1 - ctx.rank
    cuda = ctx.device.type == "cuda"
    medians, fastest = [], []
    stamp = torch.zeros(1, dtype=torch.int64)
    for n in elems:
        buf = torch.ones(n, dtype=torch.float32, device=ctx.device)
        samples = []
        for i in range(warmup + repeats):
            dist.barrier()
            if ctx.rank == 1:
                dist.irecv(buf, peer, tag=i).wait()
                _sync(cuda)
                woke = time.perf_counter_ns()
                dist.recv(stamp, peer)
                if i >= warmup:
                    samples.append((woke - int(stamp.item())) * 1e-9)
            else:
                time.sleep(IDLE_BEFORE_SEND_S)
                buf.add_(1.0)
                _sync(cuda)
                t0 = time.perf_counter_ns()
                work = dist.isend(buf, peer, tag=i)
                stamp.fill_(t0)
                work.wait()
                dist.send(stamp, peer)
        _sync(cuda)
        samples = [max(x, 0.0) for x in samples]
        medians.append(statistics.median(samples) if samples else None)
        fastest.append(min(samples) if samples else None)
    cpu = measure_transfer_cpu(ctx, elems, repeats) if not cuda else None
    out = (medians, fastest, _device_name(ctx.device))
    # rank 1 measured; hand its numbers to rank 0, whose result launch returns first
    box = [out]
    dist.broadcast_object_list(box, src=1)
    medians, fastest, device = box[0]
    # rank 0 measured the sender's CPU, rank 1 the receiver's
    box = [cpu]
    dist.broadcast_object_list(box, src=1)
    recv_cpu = box[0]
    return medians, fastest, device, cpu, recv_cpu


#: How long the sender pauses before each message of the CPU-time
#: measurement: the receiver has posted its next receive and gone idle, as
#: a pipeline stage waiting for its input has.
CPU_GAP_S = 0.001


def measure_transfer_cpu(ctx: LaunchContext, elems: list[int], repeats: int) -> list[float]:
    """CPU seconds per message of each size, for this rank's end: rank 0
    sends, rank 1 receives (called on both).

    The runtime's pattern again (a receive posted ahead, an ``isend`` of a
    freshly written tensor), but timed by the process's CPU clock, which
    counts every thread: the caller posting and waiting, and the backend's
    own threads copying the bytes into or out of the transport. On a CPU
    that is time taken from the core the passes run on, which is what the
    simulator's ``Hardware.cpu`` charges. The sender's pause between
    messages is spent asleep and costs nothing; the tensor write before each
    send is left out of the sender's count.
    """
    peer = 1 - ctx.rank
    per_size = []
    for n in elems:
        buf = torch.ones(n, dtype=torch.float32)
        dist.barrier()
        spent = 0
        for i in range(repeats):
            if ctx.rank == 1:
                work = dist.irecv(buf, peer, tag=1000 + i)
                t0 = time.process_time_ns()
                work.wait()
                spent += time.process_time_ns() - t0
            else:
                time.sleep(CPU_GAP_S)
                buf.add_(1.0)
                t0 = time.process_time_ns()
                dist.isend(buf, peer, tag=1000 + i).wait()
                spent += time.process_time_ns() - t0
        dist.barrier()
        per_size.append(spent * 1e-9 / repeats)
    return per_size


def fit_latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = latency + bytes / bandwidth`` in *relative* error.

    Sizes span orders of magnitude; a plain least-squares fit lets the
    largest message decide everything and leaves the intercept (latency) as
    noise, often negative. Dividing each equation by its measured time
    weighs every size equally. Latency is clamped at 0; when noise makes
    the slope non-positive, the bandwidth falls back to the largest
    message's throughput so it stays positive and finite.
    """
    x = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if x.shape != t.shape or x.size < 2 or np.unique(x).size < 2:
        raise ValueError("fit_latency_bandwidth: needs matching sizes and times with at least two distinct sizes")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"fit_latency_bandwidth: times must be positive and finite, got {t.tolist()}")
    a = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
    (lat, inv_bw), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    lat = max(float(lat), 0.0)
    if not inv_bw > 0:
        big = int(np.argmax(x))
        inv_bw = max(t[big] - lat, t[big] * 1e-3) / x[big]
    return lat, float(1.0 / inv_bw)


# ---------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------


def measure_allreduce(
    backend: str = "gloo",
    world_size: int = 2,
    sizes: Sequence[int] = DEFAULT_COLLECTIVE_SIZES,
    repeats: int = 10,
    *,
    warmup: int = 2,
    all_gather: bool = False,
    timeout_s: float = 120.0,
    threads: int = 1,
    devices: Sequence[int] | None = None,
) -> CollectiveProfile:
    """Median ``all_reduce`` (sum, float32) time per size in bytes, over ``world_size`` ranks."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"measure_allreduce: world_size must be an integer >= 2, got {world_size!r}")
    elems = _elements(sizes)
    _check_counts(repeats, warmup)
    per_rank = launch(
        _collective_worker,
        world_size,
        args=(elems, repeats, warmup, all_gather),
        backend=backend,
        timeout_s=timeout_s,
        threads=threads,
        devices=devices,
    )
    return _collective_profile(backend, elems, repeats, per_rank)


def _collective_profile(backend: str, elems: list[int], repeats: int, per_rank: list) -> CollectiveProfile:
    """Reduce the workers' raw timings; separate from the launch so it can be checked without one."""
    world_size = len(per_rank)
    all_gather = bool(per_rank[0][1])
    ar = _slowest_median([r[0] for r in per_rank])
    ag = _slowest_median([r[1] for r in per_rank]) if all_gather else None
    nbytes = [n * _F32 for n in elems]
    factor = 2 * (world_size - 1) / world_size
    return CollectiveProfile(
        backend=backend,
        world_size=world_size,
        sizes=tuple(nbytes),
        allreduce_s=tuple(ar),
        busbw_Bps=tuple(b / t * factor for b, t in zip(nbytes, ar)),
        allgather_s=tuple(ag) if ag is not None else None,
        repeats=repeats,
        device=per_rank[0][2],
    )


def _collective_worker(ctx: LaunchContext, elems: list[int], repeats: int, warmup: int, all_gather: bool):
    cuda = ctx.device.type == "cuda"

    def timed(op) -> list[float]:
        out = []
        for i in range(warmup + repeats):
            dist.barrier()  # start together, so one rank's lateness is not timed as the collective's
            _sync(cuda)
            t0 = time.perf_counter_ns()
            op()
            _sync(cuda)
            if i >= warmup:
                out.append((time.perf_counter_ns() - t0) * 1e-9)
        return out

    ar, ag = [], []
    for n in elems:
        buf = torch.ones(n, dtype=torch.float32, device=ctx.device)
        ar.append(timed(lambda buf=buf: dist.all_reduce(buf)))
        if all_gather:
            outs = [torch.empty_like(buf) for _ in range(ctx.world_size)]
            ag.append(timed(lambda outs=outs, buf=buf: dist.all_gather(outs, buf)))
    return ar, ag, _device_name(ctx.device)


def _slowest_median(per_rank: list[list[list[float]]]) -> list[float]:
    """Per size: median over iterations of the slowest rank's time."""
    sizes = len(per_rank[0])
    return [statistics.median(max(col) for col in zip(*(r[s] for r in per_rank))) for s in range(sizes)]


# ---------------------------------------------------------------------------
# Memory bandwidth
# ---------------------------------------------------------------------------


def measure_memory_bandwidth(
    device: str | torch.device = "cpu", nbytes: int = 1 << 26, repeats: int = 10, *, warmup: int = 2
) -> float:
    """Sustained bytes/s of ``c = a + alpha * b`` on float32 tensors of ``nbytes`` each.

    That is the access pattern of an SGD/momentum update or a weight
    prediction (read two, write one), so it counts ``3 * nbytes`` per call.
    ``nbytes`` should be well beyond the last-level cache. Runs in the
    calling process with its current ``torch.get_num_threads()``: call it
    where the real run's thread count applies (inside a launched worker
    for a per-rank figure).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < _F32:
        raise ValueError(f"measure_memory_bandwidth: nbytes must be an integer >= 4, got {nbytes!r}")
    _check_counts(repeats, warmup)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    n = nbytes // _F32
    a = torch.ones(n, dtype=torch.float32, device=dev)
    b = torch.ones(n, dtype=torch.float32, device=dev)
    c = torch.empty(n, dtype=torch.float32, device=dev)
    samples = []
    for i in range(warmup + repeats):
        _sync(cuda)
        t0 = time.perf_counter_ns()
        torch.add(a, b, alpha=0.5, out=c)
        _sync(cuda)
        if i >= warmup:
            samples.append((time.perf_counter_ns() - t0) * 1e-9)
    return 3 * n * _F32 / statistics.median(samples)


# ---------------------------------------------------------------------------
# Hardware description
# ---------------------------------------------------------------------------


def hardware_json(
    name: str,
    device_name: str,
    flops: float,
    mem_bandwidth: float,
    memory_bytes: float,
    p2p: P2PProfile,
    world_size: int,
    *,
    dtype_bytes: int = 4,
    device_notes: str = "",
    cores: Sequence[int] | None = None,
    wake_slice_s: float = 0.0,
) -> dict[str, Any]:
    """A preset-file dict for one node of ``world_size`` ranks linked as ``p2p`` measured.

    With ``cores`` (the core each rank is pinned to) and CPU times in
    ``p2p``, the dict has a ``cpu`` section: ranks on one core share it, and
    each transfer costs its ends the CPU time fitted to ``p2p``'s, and a pass
    starting beside another runs alone for ``wake_slice_s`` first.

    The interconnect is a ``switch``: each device has its own tx/rx port, so
    disjoint pairs do not contend. That is how separate processes on one
    host behave over loopback TCP (gloo) and how NVSwitch/NVLink-P2P GPUs
    behave under NCCL; a PCIe box whose peers share a host bridge would be a
    ``bus`` instead, which two ranks cannot tell apart. The dict is checked
    with :meth:`Hardware.from_json` before it is returned.
    """
    sizes = ", ".join(_fmt_bytes(s) for s in p2p.sizes)
    d: dict[str, Any] = {
        "name": name,
        "notes": (
            f"Measured by pipesim.validate.commprofile on {platform.node() or 'this host'} "
            f"(torch {torch.__version__}, backend {p2p.backend}, {p2p.device}): {world_size} ranks, one process "
            f"each. Link numbers fitted as latency + bytes/bandwidth (least squares in relative error) to "
            f"median one-way times of float32 send/recv ping-pongs ({p2p.repeats} repeats of {sizes})."
        ),
        "device": {
            "name": device_name,
            "flops": float(flops),
            "mem_bandwidth": float(mem_bandwidth),
            "memory_bytes": float(memory_bytes),
            "dtype_bytes": dtype_bytes,
        },
        "num_devices": world_size,
        "devices_per_node": world_size,
        "intra_node": {
            "kind": "switch",
            "label": p2p.backend,
            "bandwidth": float(p2p.bandwidth_Bps),
            "latency": float(p2p.latency_s),
            "notes": (
                f"{p2p.backend} point-to-point between processes on one host: "
                f"latency {p2p.latency_s * 1e6:.1f} us, bandwidth {p2p.bandwidth_Bps / 1e9:.3f} GB/s."
            ),
        },
    }
    if device_notes:
        d["device"]["notes"] = device_notes
    cpu = p2p.cpu_costs()
    if cores is not None and cpu is not None:
        d["cpu"] = {
            "cores": list(cores)[:world_size],
            **cpu,
            "wake_slice_s": wake_slice_s,
            "notes": (
                "core each rank is pinned to; CPU seconds per message on each end (process CPU "
                "time of the sender around isend + wait, of the receiver around wait, receivers "
                "idle before each message), fitted as fixed + bytes / rate; wake_slice_s: how "
                "long a thread woken beside a busy one keeps the core, median of 30 wake-ups "
                "(measured only where ranks share cores)"
            ),
        }
    Hardware.from_json(d, source=f"measured hardware {name!r}")
    return d


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _elements(sizes: Sequence[int]) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise ValueError(f"sizes must be a non-empty sequence of byte counts, got {sizes!r}")
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"sizes must be positive integers (bytes), got {list(sizes)}")
    return [max(1, s // _F32) for s in sizes]


def _check_counts(repeats: int, warmup: int) -> None:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s))"


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def run_bench(backend: str, world_size: int, repeats: int, all_gather: bool) -> dict:
    """Measure the links, the collectives and the memory bandwidth, and set
    each against the model the simulator would price it with
    (``pipesim bench comm``, :mod:`pipesim.experiments.bench.comm`)."""
    t0 = time.perf_counter()
    p2p = measure_p2p(backend, repeats=repeats)
    ar = measure_allreduce(backend, world_size, repeats=repeats, all_gather=all_gather)
    if backend == "nccl":
        mem = measure_memory_bandwidth("cuda")
    else:
        with intra_op_threads():  # what each launched CPU rank uses
            mem = measure_memory_bandwidth("cpu")
    hw = Hardware.from_json(hardware_json("measured", p2p.device, 1e12, mem, 1e12, p2p, world_size))
    ranks = list(range(world_size))
    return {
        "p2p": p2p.to_json(),
        "p2p_model_s": [p2p.predict(n) for n in p2p.sizes],
        "allreduce": ar.to_json(),
        "allreduce_ring_model_s": [hw.ring_allreduce_time(ranks, n) for n in ar.sizes],
        "mem_bandwidth_Bps": mem,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def render(report: dict) -> str:
    p2p, ar = report["p2p"], report["allreduce"]
    lines = [
        f"{p2p['backend']} point to point on {p2p['device']}: latency {p2p['latency_s'] * 1e6:.1f} us, "
        f"bandwidth {p2p['bandwidth_Bps'] / 1e9:.3f} GB/s (fitted)",
        f"{'size':>10} {'one-way ms':>11} {'fastest ms':>11} {'model ms':>9}",
    ]
    for n, t, fast, model in zip(p2p["sizes"], p2p["one_way_s"], p2p["min_one_way_s"], report["p2p_model_s"]):
        lines.append(f"{_fmt_bytes(n):>10} {t * 1e3:11.3f} {fast * 1e3:11.3f} {model * 1e3:9.3f}")
    lines += [
        "",
        f"all-reduce over {ar['world_size']} ranks:",
        f"{'size':>10} {'measured ms':>12} {'ring model ms':>14} {'busbw GB/s':>11}",
    ]
    for n, t, model, bus in zip(ar["sizes"], ar["allreduce_s"], report["allreduce_ring_model_s"], ar["busbw_Bps"]):
        lines.append(f"{_fmt_bytes(n):>10} {t * 1e3:12.3f} {model * 1e3:14.3f} {bus / 1e9:11.3f}")
    lines += [
        "",
        f"memory bandwidth (c = a + alpha * b): {report['mem_bandwidth_Bps'] / 1e9:.2f} GB/s; "
        f"{report['seconds']:.1f} s in all",
    ]
    return "\n".join(lines)

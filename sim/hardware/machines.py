"""Devices, links and topologies: where a transfer goes and what it shares.

The engine treats every :class:`Link` as a resource that one transfer holds at
a time for its whole uncontended duration; two transfers contend exactly when
their routes name the same link. So the topology model here is nothing more
than a deterministic map ``(src, dst) -> tuple of shared links``. Choosing
which physical resources become one link is the whole modelling decision:

* ``ideal``: no links at all; every transfer is free.
* ``bus``: one link per node for every intra-node transfer. That is the
  2018-era workstation SpecTrain measured on, four GPUs behind one PCIe host
  bridge, where peer traffic serialises on the bridge. Modelled as
  half-duplex on purpose: it is the conservative reading and the one that
  reproduces a communication-bound 4-GPU PCIe box.
* ``switch``: NVSwitch (DGX H100). Each GPU has one egress and one ingress
  port into a non-blocking switch, so a transfer holds the sender's ``tx``
  port and the receiver's ``rx`` port. Two sends from one GPU contend; sends
  between disjoint pairs do not.
* ``mesh``: point-to-point NVLink (DGX-1's hybrid cube mesh). Each directly
  wired ordered pair has its own link of ``lanes x bandwidth``; pairs without
  NVLink go through the host (PCIe, CPU socket link), modelled as one shared
  ``host`` link per node.

Across nodes a transfer holds the sender node's NIC ``tx`` and the receiver
node's NIC ``rx``; the switched fabric between NICs is assumed non-blocking.
A device uses NIC ``local_index * nics_per_node // devices_per_node``, which is
how DGX machines wire NICs to GPUs (DGX-1: one NIC per GPU pair's PCIe
switch; DGX H100: one NIC per GPU).

Latency is charged once per hop, on the sending side's link (the ``rx`` side
of a port or NIC has zero latency), so :meth:`Hardware.transfer_time` =
sum of latencies on the route + bytes / narrowest bandwidth.

Devices that are CPU cores (``pipesim validate`` on gloo) carry a
:class:`HostCpu`: which core each device computes on, and how much CPU time a
transfer takes from its sender's and its receiver's core. A GPU's copy engines
and NIC move data beside its kernels; a CPU's communication threads run on the
very core the passes need, at higher priority, so every transfer stretches the
pass it interrupts, and devices that share a core share its speed. The
engine applies both (:mod:`pipesim.sim.engine.core`); hardware without ``cpu``
(every GPU preset) is untouched.

Devices are numbered node-major: devices ``0 .. d-1`` on node 0, ``d .. 2d-1``
on node 1, and so on.

Numbers are checked where they enter: FLOP/s finite and at least 1;
bandwidths (bytes/s) at least 1 or unbounded (``"inf"``); memory positive or
unbounded; latencies finite seconds within
:data:`~pipesim.sim.limits.MAX_SECONDS`; counts integers, never booleans.
With those floors every derived time (bytes / bandwidth, FLOPs / FLOP/s) is
finite, so no run can end with an infinite or, from infinitely fast
devices, a zero makespan.
"""

from __future__ import annotations

import functools
import importlib.resources
import itertools
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipesim.sim.errors import InputError
from pipesim.sim.files import parse_json, read_text
from pipesim.sim.hardware import collectives, gemm
from pipesim.sim.hardware.collectives import CollectiveSpec, Estimate, Group
from pipesim.sim.limits import MAX_SECONDS, is_number, shown


class HardwareError(InputError):
    """A hardware description is unknown, malformed, or too small for a schedule."""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator.

    ``flops`` is *sustained* FLOP/s for training kernels in the precision the
    preset trains in, not the datasheet peak: without the GEMM shape model
    (below), compute times are FLOPs divided by it. ``mem_bandwidth``
    (bytes/s, sustained) prices memory-bound kernels:
    optimizer steps, weight prediction, elementwise layers.
    ``dtype_bytes`` is the size of one activation element in that precision
    (4 for fp32, 2 for fp16/bf16 mixed precision).

    ``update_bandwidth``, ``predict_bandwidth`` and ``average_bandwidth``,
    when given, price the optimizer step, SpecTrain's weight prediction and
    AvgPipe's elastic averaging instead of ``mem_bandwidth``: measured per
    kernel (``pipesim profile``), as the runtime runs each, since on a CPU
    they reach very different fractions of the memory system (a step
    touches its optimizer state cold, a prediction writes a scratch copy,
    averaging flattens and copies back).

    ``kernel_overhead_s`` is the fixed time one kernel launch adds to a
    layer pass whatever its size (the launch latency between one kernel and
    the next): catalog profiles charge it once per kernel a layer launches
    (:mod:`pipesim.sim.workloads.catalog`), so a pass costs a fixed part plus a part
    proportional to the micro-batch. 0 (the default) charges none, as a
    preset whose ``flops`` is an average sustained rate (launches included)
    does; measured profiles never see it (their times include it).

    The GEMM shape model (:mod:`pipesim.sim.hardware.gemm`), optional: with
    ``peak_flops`` (the datasheet's dense tensor peak in the training
    precision), ``sms`` (streaming multiprocessors) and
    ``gemm_max_efficiency`` (the fraction of peak the best shapes reach), a
    catalog layer's GEMMs are priced by their shapes, tile and wave
    quantisation included, instead of at ``flops``. ``gemm_tile`` is the
    output tile of one thread block (default 128 x 128), ``gemm_k_overhead``
    the K elements of multiply a tile's prologue and epilogue cost (default
    0), ``gemm_fixed_s`` the device time of any GEMM kernel (default 0).
    ``gemm_table`` names a measured table (``measurements/<name>.json``) that
    replaces the model within its range. The three first go together; the
    others need them.
    """

    name: str
    flops: float
    mem_bandwidth: float
    memory_bytes: float
    dtype_bytes: int = 4
    update_bandwidth: float | None = None
    predict_bandwidth: float | None = None
    average_bandwidth: float | None = None

    #: kernel -> field of its own bandwidth (None: ``mem_bandwidth``)
    KERNELS = {"update": "update_bandwidth", "predict": "predict_bandwidth", "average": "average_bandwidth"}

    def kernel_bandwidth(self, kernel: str) -> float:
        """Bytes/s of a memory-bound kernel: its own figure, else ``mem_bandwidth``."""
        own = getattr(self, self.KERNELS[kernel])
        return self.mem_bandwidth if own is None else own

    kernel_overhead_s: float = 0.0
    peak_flops: float | None = None
    sms: int | None = None
    gemm_max_efficiency: float | None = None
    gemm_tile: tuple[int, int] = gemm.DEFAULT_TILE
    gemm_k_overhead: float = 0.0
    gemm_fixed_s: float = 0.0
    gemm_table: str | None = None

    #: the GEMM shape model's fields, in their preset-file order; the first three go together
    GEMM_FIELDS = (
        "peak_flops",
        "sms",
        "gemm_max_efficiency",
        "gemm_tile",
        "gemm_k_overhead",
        "gemm_fixed_s",
        "gemm_table",
    )

    @property
    def shape_model(self) -> bool:
        """Whether GEMMs are priced by their shapes (:mod:`pipesim.sim.hardware.gemm`)."""
        return self.peak_flops is not None

    def __post_init__(self) -> None:
        # a device of infinite FLOP/s would make every layer free (a zero makespan)
        if not _is_rate(self.flops) or math.isinf(self.flops):
            raise HardwareError(
                f"device {self.name!r}: flops must be a positive finite number >= 1 (FLOP/s), got {shown(self.flops)}"
            )
        if not _is_rate(self.mem_bandwidth):
            raise HardwareError(
                f'device {self.name!r}: mem_bandwidth must be a positive number >= 1 (bytes/s) or "inf", '
                f"got {shown(self.mem_bandwidth)}"
            )
        v = self.memory_bytes
        if not is_number(v) or not v > 0 or (isinstance(v, int) and v > sys.float_info.max):
            raise HardwareError(
                f'device {self.name!r}: memory_bytes must be a positive number or "inf", got {shown(v)}'
            )
        if isinstance(self.dtype_bytes, bool) or self.dtype_bytes not in (1, 2, 4, 8):
            raise HardwareError(f"device {self.name!r}: dtype_bytes must be 1, 2, 4 or 8, got {self.dtype_bytes!r}")
        for name in self.KERNELS.values():
            v = getattr(self, name)
            if v is not None and not _is_rate(v):
                raise HardwareError(
                    f'device {self.name!r}: {name} must be a positive number >= 1 (bytes/s) or "inf", got {shown(v)}'
                )
        k = self.kernel_overhead_s
        if not is_number(k) or not (0 <= k <= MAX_SECONDS):
            raise HardwareError(
                f"device {self.name!r}: kernel_overhead_s must be a finite number >= 0 and <= {MAX_SECONDS:g} "
                f"(seconds), got {shown(k)}"
            )
        self._check_gemm_model()

    def _check_gemm_model(self) -> None:
        where = f"device {self.name!r}"
        p = self.peak_flops
        if p is not None and (not _is_rate(p) or math.isinf(p)):
            raise HardwareError(f"{where}: peak_flops must be a positive finite number >= 1 (FLOP/s), got {shown(p)}")
        s = self.sms
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= _MAX_SMS):
            raise HardwareError(f"{where}: sms must be an integer between 1 and {_MAX_SMS}, got {shown(s)}")
        e = self.gemm_max_efficiency
        if e is not None and (not is_number(e) or not 0 < e <= 1 or (p is not None and p * e < 1)):
            raise HardwareError(f"{where}: gemm_max_efficiency must be a number in (0, 1], got {shown(e)}")
        tile = self.gemm_tile
        if (
            not isinstance(tile, (tuple, list))
            or len(tile) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= _MAX_TILE for x in tile)
        ):
            raise HardwareError(
                f"{where}: gemm_tile must be two integers between 1 and {_MAX_TILE} (rows, columns), got {tile!r}"
            )
        object.__setattr__(self, "gemm_tile", tuple(tile))
        k = self.gemm_k_overhead
        if not is_number(k) or not 0 <= k <= _MAX_K_OVERHEAD:
            raise HardwareError(
                f"{where}: gemm_k_overhead must be a number >= 0 and <= {_MAX_K_OVERHEAD:g} (elements of K), "
                f"got {shown(k)}"
            )
        f = self.gemm_fixed_s
        if not is_number(f) or not 0 <= f <= MAX_SECONDS:
            raise HardwareError(
                f"{where}: gemm_fixed_s must be a finite number >= 0 and <= {MAX_SECONDS:g} (seconds), got {shown(f)}"
            )
        table = self.gemm_table
        if table is not None and not gemm.is_table(table):
            known = ", ".join(gemm.table_names())
            raise HardwareError(
                f"{where}: gemm_table must name a GEMM table ({known}) or a table file's path, got {table!r}"
            )
        given = {name: getattr(self, name) is not None for name in self.GEMM_FIELDS[:3]}
        if any(given.values()) and not all(given.values()):
            missing = next(name for name, set_ in given.items() if not set_)
            raise HardwareError(
                f"{where}: {missing} is missing: the GEMM shape model needs peak_flops, sms and gemm_max_efficiency"
            )
        if not any(given.values()):
            extra = [
                name
                for name, default in zip(self.GEMM_FIELDS[3:], (gemm.DEFAULT_TILE, 0.0, 0.0, None))
                if getattr(self, name) != default
            ]
            if extra:
                raise HardwareError(
                    f"{where}: {extra[0]} needs the GEMM shape model (peak_flops, sms and gemm_max_efficiency)"
                )


@dataclass(frozen=True)
class Link:
    """A resource transfers hold while they move data.

    ``name`` identifies the link: the engine keys its contention and its
    per-link byte counts on it, so two routes share a link iff they contain a
    link of the same name (and :class:`Hardware` hands out the same object).
    """

    name: str
    bandwidth: float  # bytes/s; math.inf allowed
    latency: float  # seconds


@dataclass(frozen=True)
class Interconnect:
    """How the devices of one node talk to each other (see the module doc).

    ``bandwidth``/``latency`` are per link: the shared bus, one switch port
    in one direction, or one NVLink lane in one direction for ``mesh``.
    ``mesh`` lists ``(a, b, lanes)`` with node-local indices; each listed pair
    is wired both ways. ``host_bandwidth``/``host_latency`` are the path for
    ``mesh`` pairs without NVLink. ``label`` names the links (``pcie``,
    ``nvlink``) so reports read naturally. ``lanes``: for ``switch``, the
    NVLink lanes each GPU has into the switch (0: the switch is not NVLink);
    NCCL's channels drive every one, so a collective's bandwidth counts them
    (:meth:`Hardware.collective_group`).
    """

    kind: str = "ideal"
    bandwidth: float = math.inf
    latency: float = 0.0
    label: str = ""
    mesh: tuple[tuple[int, int, int], ...] = ()
    host_bandwidth: float = math.inf
    host_latency: float = 0.0
    lanes: int = 0

    KINDS = ("ideal", "bus", "switch", "mesh")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise HardwareError(f"intra_node.kind must be one of {', '.join(self.KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "mesh", tuple(tuple(int(x) for x in e) for e in self.mesh))
        if isinstance(self.lanes, bool) or not isinstance(self.lanes, int) or not 0 <= self.lanes <= _MAX_LANES:
            raise HardwareError(f"intra_node.lanes must be an integer between 0 and {_MAX_LANES}, got {self.lanes!r}")
        _check_link_numbers("intra_node", self.bandwidth, self.latency)
        _check_link_numbers("intra_node host path", self.host_bandwidth, self.host_latency)


@dataclass(frozen=True)
class NicSpec:
    """A node's network adapters: ``count`` NICs, each full duplex.

    ``bandwidth`` is the line rate per NIC and direction; ``efficiency`` the
    fraction of it that transfers reach (TCP sockets over Ethernet lose
    framing, copies and congestion control; InfiniBand's RDMA loses little),
    so a NIC's links carry ``bandwidth * efficiency``. ``latency`` is the
    NIC's own latency per message, which NCCL's model adds to every step
    that crosses the network (twice for its Simple protocol, which flushes).
    """

    count: int = 1
    bandwidth: float = math.inf  # bytes/s per NIC per direction
    latency: float = 0.0
    label: str = "nic"
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1:
            raise HardwareError(f"inter_node.count must be a positive integer, got {self.count!r}")
        _check_link_numbers("inter_node", self.bandwidth, self.latency)
        e = self.efficiency
        if not is_number(e) or not 0 < e <= 1 or self.bandwidth * e < 1:
            raise HardwareError(
                f"inter_node.efficiency must be a number in (0, 1] leaving at least 1 byte/s, got {shown(e)}"
            )

    @property
    def achieved(self) -> float:
        """Bytes/s one NIC carries per direction: line rate times efficiency."""
        return self.bandwidth * self.efficiency


def _is_rate(v: Any) -> bool:
    """A per-second rate: at least 1, possibly infinite (so any amount / rate is finite or zero)."""
    return is_number(v) and v >= 1 and (isinstance(v, float) or v <= sys.float_info.max)


def _check_link_numbers(where: str, bandwidth: float, latency: float) -> None:
    if not _is_rate(bandwidth):
        raise HardwareError(
            f'{where}: bandwidth must be a positive number >= 1 (bytes/s) or "inf", got {shown(bandwidth)}'
        )
    if not is_number(latency) or not (0 <= latency <= MAX_SECONDS):
        raise HardwareError(
            f"{where}: latency must be a finite number >= 0 and <= {MAX_SECONDS:g} (seconds), got {shown(latency)}"
        )


#: NVLink lanes of one mesh pair: far above any machine's (DGX-1: 1 or 2),
#: and a bound keeps lanes x bandwidth a float.
_MAX_LANES = 1024

#: Bounds of the GEMM shape model's counts, far above any device's (an H100
#: has 132 SMs, tiles are at most 256 x 256), so products of them stay exact.
_MAX_SMS = 1 << 20
_MAX_TILE = 1 << 16
#: K elements a tile's fixed work may cost: far above a fitted value (118 on H100).
_MAX_K_OVERHEAD = 1e9


@dataclass(frozen=True)
class CpuCost:
    """CPU time one end of a transfer costs its core: ``fixed_s`` per
    message plus the bytes at ``bytes_per_s`` (the copy into or out of the
    transport, which on one host is a memory copy through the kernel)."""

    fixed_s: float = 0.0
    bytes_per_s: float = math.inf

    def __post_init__(self) -> None:
        if not _is_rate(self.bytes_per_s):
            raise HardwareError(
                f'cpu transfer cost: bytes_per_s must be a positive number >= 1 or "inf", got {shown(self.bytes_per_s)}'
            )
        if not is_number(self.fixed_s) or not (0 <= self.fixed_s <= MAX_SECONDS):
            raise HardwareError(
                f"cpu transfer cost: fixed_s must be a finite number >= 0 and <= {MAX_SECONDS:g} "
                f"(seconds), got {shown(self.fixed_s)}"
            )

    def seconds(self, nbytes: float) -> float:
        return self.fixed_s + (0.0 if math.isinf(self.bytes_per_s) else nbytes / self.bytes_per_s)


@dataclass(frozen=True)
class HostCpu:
    """Devices that are cores of one host.

    ``cores[d]`` is the core device d computes on: devices given the same
    core share it as the OS time-slices them (ranks pinned round-robin when
    there are more ranks than cores): a pass that starts while others run
    there runs alone for up to ``wake_slice_s`` (measured: how long a thread
    woken beside a busy one keeps the core), then the running passes share
    it equally (:class:`pipesim.sim.engine.core._Core`). ``send`` and
    ``recv`` are the CPU time a transfer takes from the sender's and the
    receiver's core. That time preempts: a transfer handled while a pass runs
    on the core stretches the pass by it; on an idle core it delays the next
    pass until it is done. The transfer's own duration stays the link's.
    """

    cores: tuple[int, ...]
    send: CpuCost = field(default_factory=CpuCost)
    recv: CpuCost = field(default_factory=CpuCost)
    wake_slice_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.cores or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in self.cores):
            raise HardwareError(f"cpu.cores must be a non-empty list of core numbers >= 0, got {list(self.cores)!r}")
        if (
            isinstance(self.wake_slice_s, bool)
            or not isinstance(self.wake_slice_s, (int, float))
            or not 0 <= self.wake_slice_s < math.inf
        ):
            raise HardwareError(f"cpu.wake_slice_s must be a finite number of seconds >= 0, got {self.wake_slice_s!r}")

    @property
    def shared(self) -> bool:
        """Whether some devices share a core."""
        return len(set(self.cores)) < len(self.cores)


@dataclass(frozen=True)
class Hardware:
    """Homogeneous devices in ``num_devices // devices_per_node`` nodes.

    ``num_devices`` None means unbounded (only sensible with the ``ideal``
    interconnect and no NICs). ``devices_per_node`` None means one node
    holding every device. Links are built once, so :meth:`route` returns the
    same :class:`Link` objects every call.
    """

    name: str
    device: DeviceSpec
    num_devices: int | None = None
    devices_per_node: int | None = None
    intra_node: Interconnect = field(default_factory=Interconnect)
    inter_node: NicSpec | None = None
    notes: str = ""
    cpu: HostCpu | None = None
    #: how collectives and transfers are priced: NCCL's model
    #: (:mod:`~pipesim.sim.hardware.collectives`), or None for one ring at
    #: the links' bandwidth and latency (CPU hosts, ``ideal``)
    collectives: CollectiveSpec | None = None
    _links: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _groups: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _lanes: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _rings: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, d = self.num_devices, self.devices_per_node
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise HardwareError(f"{self.name}: num_devices must be a positive integer or null, got {n!r}")
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise HardwareError(f"{self.name}: devices_per_node must be a positive integer or null, got {d!r}")
        if n is None and d is not None:
            raise HardwareError(f"{self.name}: unbounded num_devices needs devices_per_node null")
        if n is not None and d is not None and n % d:
            raise HardwareError(f"{self.name}: {n} devices do not fill nodes of {d}")
        if self.nodes > 1 and self.inter_node is None:
            raise HardwareError(f"{self.name}: {self.nodes} nodes need an inter_node (NIC) description")
        if n is None and self.intra_node.kind != "ideal":
            raise HardwareError(f"{self.name}: unbounded num_devices needs the ideal interconnect")
        per_node = self.local_devices
        ic = self.intra_node
        if ic.kind == "mesh":
            for a, b, lanes in ic.mesh:
                if not (0 <= a < per_node and 0 <= b < per_node) or a == b or not 1 <= lanes <= _MAX_LANES:
                    raise HardwareError(
                        f"{self.name}: mesh entry {[a, b, lanes]} needs two distinct local devices "
                        f"below {per_node} and lanes between 1 and {_MAX_LANES}"
                    )
        if self.inter_node is not None and self.inter_node.count > per_node:
            raise HardwareError(f"{self.name}: {self.inter_node.count} NICs for {per_node} devices per node")
        if self.cpu is not None and (self.nodes > 1 or (n is not None and len(self.cpu.cores) < n)):
            raise HardwareError(f"{self.name}: cpu.cores must name a core for each of the {n} devices of one host")

    # -- shape --------------------------------------------------------------
    @property
    def local_devices(self) -> int | float:
        """Devices per node (inf when unbounded)."""
        if self.devices_per_node is not None:
            return self.devices_per_node
        return self.num_devices if self.num_devices is not None else math.inf

    @property
    def nodes(self) -> int:
        if self.num_devices is None or self.devices_per_node is None:
            return 1
        return self.num_devices // self.devices_per_node

    def node_of(self, device: int) -> int:
        self._check_index(device)
        if self.devices_per_node is None:
            return 0
        return device // self.devices_per_node

    def check_devices(self, n: int) -> None:
        """Raise when a schedule needs more devices than the hardware has."""
        if self.num_devices is not None and n > self.num_devices:
            raise HardwareError(f"{self.name} has {self.num_devices} devices; the schedule needs {n}")
        if self.cpu is not None and n > len(self.cpu.cores):
            raise HardwareError(f"{self.name} names cores for {len(self.cpu.cores)} devices; the schedule needs {n}")

    def _check_index(self, device: int) -> None:
        if not isinstance(device, int) or device < 0 or (self.num_devices is not None and device >= self.num_devices):
            raise HardwareError(f"{self.name} has no device {device!r} (devices 0..{self._last_device()})")

    def _last_device(self) -> str:
        return "inf" if self.num_devices is None else str(self.num_devices - 1)

    # -- routing ------------------------------------------------------------
    def _link(self, name: str, bandwidth: float, latency: float) -> Link:
        link = self._links.get(name)
        if link is None:
            link = self._links[name] = Link(name, float(bandwidth), float(latency))
        return link

    def route(self, src: int, dst: int) -> tuple[Link, ...]:
        """The shared links a ``src -> dst`` transfer occupies, in path order."""
        self._check_index(src)
        self._check_index(dst)
        if src == dst:
            return ()
        n_src, n_dst = self.node_of(src), self.node_of(dst)
        if n_src != n_dst:
            nic = self.inter_node
            assert nic is not None  # guaranteed by __post_init__ when nodes > 1
            i = self._nic_of(src)
            j = self._nic_of(dst)
            return (
                self._link(f"node{n_src}.{nic.label}{i}.tx", nic.achieved, nic.latency),
                self._link(f"node{n_dst}.{nic.label}{j}.rx", nic.achieved, 0.0),
            )
        ic = self.intra_node
        if ic.kind == "ideal":
            return ()
        if ic.kind == "bus":
            return (self._link(f"node{n_src}.{ic.label or 'bus'}", ic.bandwidth, ic.latency),)
        if ic.kind == "switch":
            label = ic.label or "port"
            return (
                self._link(f"gpu{src}.{label}.tx", ic.bandwidth, ic.latency),
                self._link(f"gpu{dst}.{label}.rx", ic.bandwidth, 0.0),
            )
        # mesh
        lanes = self._mesh_lanes().get((self._local(src), self._local(dst)))
        if lanes:
            label = ic.label or "link"
            return (self._link(f"gpu{src}->gpu{dst}.{label}", lanes * ic.bandwidth, ic.latency),)
        return (self._link(f"node{n_src}.host", ic.host_bandwidth, ic.host_latency),)

    def _local(self, device: int) -> int:
        return device if self.devices_per_node is None else device % self.devices_per_node

    def _nic_of(self, device: int) -> int:
        assert self.inter_node is not None and self.devices_per_node is not None
        return self._local(device) * self.inter_node.count // self.devices_per_node

    def _mesh_lanes(self) -> dict[tuple[int, int], int]:
        """(a, b) -> NVLink lanes, both directions; built on first use."""
        if not self._lanes and self.intra_node.mesh:
            for a, b, k in self.intra_node.mesh:
                self._lanes[(a, b)] = self._lanes[(b, a)] = k
        return self._lanes

    def transfer_time(self, src: int, dst: int, nbytes: float) -> float:
        """Uncontended time to move ``nbytes`` from ``src`` to ``dst``:
        :meth:`transfer_line`'s latency plus the bytes at its rate.

        Zero bytes cost nothing, not even latency: a transfer that carries no
        data (the ``uniform`` model) is a modelling artefact, not a message.
        """
        if nbytes < 0:
            raise HardwareError(f"cannot transfer {nbytes} bytes")
        latency, per_byte = self.transfer_line(src, dst)
        if nbytes == 0 or (latency == 0 and per_byte == 0):
            return 0.0
        return latency + nbytes * per_byte

    def transfer_line(self, src: int, dst: int) -> tuple[float, float]:
        """(latency seconds, seconds per byte) of a ``src -> dst`` transfer.

        The rate is the route's narrowest link. Without a collectives model
        the latency is the sum of the route's link latencies; with NCCL's,
        a transfer is one step of NCCL's send/receive in its Simple protocol
        (every pipeline activation is far above the 16 KiB below which NCCL
        switches to LL): the protocol's base latency, one step over the
        route's link type, and across nodes the NIC's own latency.
        """
        route = self.route(src, dst)
        if not route:
            return (0.0, 0.0)
        bandwidth = min(link.bandwidth for link in route)
        per_byte = 0.0 if math.isinf(bandwidth) else 1 / bandwidth
        if self.collectives is None:
            return (math.fsum(link.latency for link in route), per_byte)
        extra = self.inter_node.latency if self.node_of(src) != self.node_of(dst) and self.inter_node else 0.0
        return (collectives.p2p_latency(self.link_type(src, dst)) + extra, per_byte)

    def link_type(self, src: int, dst: int) -> str:
        """The link type NCCL prices a ``src -> dst`` step by: ``net`` across
        nodes, ``nvlink`` over NVLink lanes or an NVLink switch, else ``pci``
        (a PCIe bus, or a mesh pair without NVLink going through the host)."""
        if self.node_of(src) != self.node_of(dst):
            return "net"
        ic = self.intra_node
        if ic.kind == "mesh" and self._mesh_lanes().get((self._local(src), self._local(dst))):
            return "nvlink"
        if ic.kind == "switch" and ic.lanes:
            return "nvlink"
        return "pci"

    def ring_order(self, devices: Sequence[int]) -> tuple[int, ...]:
        """The order a ring all-reduce over ``devices`` visits them, as NCCL
        builds its rings from the topology rather than from rank numbers.

        Devices are grouped by node (node-major, so nodes in index order) and
        each node's devices form one segment: the ring enters and leaves every
        node once, so each NIC carries one chunk per step, not one per device.
        Within a node only the ``mesh`` interconnect makes orders differ (a
        bus is shared by every edge, a switch gives each device one port
        each way, ``ideal`` is free), so every other kind keeps device order.
        On a mesh the segment is the order whose busiest link carries the
        least per step (then the least latency): a Hamiltonian cycle over
        the node's devices when the ring stays in one node, a path when it
        chains nodes. Ties keep the earliest order in device order, so where
        device order is already optimal nothing moves. Without a
        collectives model the ring is the all-reduce (one ring, one
        direction); with NCCL's (:meth:`collective_group`), whose channels
        drive every lane at once, it only says which links the all-reduce
        holds. The search is exhaustive for up to
        :data:`RING_SEARCH_MAX` devices of a node; larger mesh groups keep
        device order.
        """
        return self._per_device_set(self._rings, devices, self._choose_ring)

    def _per_device_set(self, cache: dict, devices: Sequence[int], build):
        """``build(devs)`` for the sorted distinct valid ``devs`` of
        ``devices``, computed once per set and kept in ``cache``."""
        devs = tuple(sorted(set(devices)))
        found = cache.get(devs)
        if found is None:
            for d in devs:
                self._check_index(d)
            found = cache[devs] = build(devs)
        return found

    def _choose_ring(self, devs: tuple[int, ...]) -> tuple[int, ...]:
        """See :meth:`ring_order`; ``devs`` sorted, distinct, valid."""
        if self.intra_node.kind != "mesh" or len(devs) < 3:
            return devs
        segments = [tuple(g) for _, g in itertools.groupby(devs, key=self.node_of)]
        cycle = len(segments) == 1
        out: list[int] = []
        for seg in segments:
            base = seg[0] - self._local(seg[0])
            local = tuple(self._local(d) for d in seg)
            out.extend(base + i for i in _mesh_segment(self.intra_node, int(self.local_devices), local, cycle))
        return tuple(out)

    def ring_allreduce_time(self, devices: Sequence[int], nbytes: float) -> float:
        """Estimate of an all-reduce of ``nbytes`` over ``devices``.

        With a collectives model, NCCL's prediction (:meth:`allreduce_estimate`).
        Without one, a ring in :meth:`ring_order`: 2(n-1) steps; in each every
        device sends ``nbytes/n`` to its ring successor. Transfers sharing a
        link serialise, so a step lasts as long as its busiest link (sum of
        the transfer times through it) or its slowest transfer. The engine
        simulates the same steps event by event; this closed form is for
        planners and sanity checks.
        """
        if self.collectives is not None:
            return self.allreduce_estimate(devices, nbytes).seconds
        devs = self.ring_order(devices)
        n = len(devs)
        if n < 2 or nbytes == 0:
            return 0.0
        chunk = math.ceil(nbytes / n)
        busy: dict[str, float] = {}
        slowest = 0.0
        for i, src in enumerate(devs):
            dst = devs[(i + 1) % n]
            t = self.transfer_time(src, dst, chunk)
            slowest = max(slowest, t)
            for link in self.route(src, dst):
                busy[link.name] = busy.get(link.name, 0.0) + t
        step = max([slowest, *busy.values()])
        return 2 * (n - 1) * step

    # -- collectives (NCCL's model) -------------------------------------------
    def allreduce_estimate(self, devices: Sequence[int], nbytes: float) -> Estimate:
        """NCCL's algorithm, protocol and time for an all-reduce of ``nbytes``
        over ``devices`` (:func:`pipesim.sim.hardware.collectives.allreduce`);
        needs :attr:`collectives`."""
        if self.collectives is None:
            raise HardwareError(f"{self.name} has no collectives model")
        return collectives.allreduce(self.collectives, self.collective_group(devices), nbytes)

    def collective_group(self, devices: Sequence[int]) -> Group:
        """What NCCL's model needs of a collective over ``devices``.

        The bus bandwidth (bytes/s each rank sends) is the narrowest of:

        * inside each node, every device's NVLink lanes to the group's other
          devices of its node, each at the bandwidth NCCL credits a lane with
          on this GPU generation (NCCL builds as many channels as the lanes
          carry, so a DGX-1 V100 all-reduce over its 8 GPUs uses all 6 lanes
          of each); an NVLink switch's lanes per GPU likewise; a PCIe bus
          (or a mesh whose group has a device without NVLink to the others,
          which then goes through the host) shared by the node's devices of
          the group, so each gets its share;
        * across nodes, the NICs the group's devices on a node use, each at
          its achieved bandwidth (NCCL spreads its channels over them).

        Channels: the lanes (or NICs) that carry it, for NCCL's per-channel
        caps. Cached per device set.
        """
        return self._per_device_set(self._groups, devices, self._group)

    def _group(self, devs: tuple[int, ...]) -> Group:
        assert self.collectives is not None
        by_node: dict[int, list[int]] = {}
        for d in devs:
            by_node.setdefault(self.node_of(d), []).append(d)
        lane = collectives.nvlink_lane_bandwidth(self.collectives.arch)
        intra, lanes_used, link = math.inf, math.inf, "nvlink"
        for members in by_node.values():
            if len(members) < 2:
                continue
            bandwidth, lanes, kind = self._node_share(members, lane)
            intra, lanes_used = min(intra, bandwidth), min(lanes_used, lanes)
            if kind == "pci":  # any PCIe segment prices the steps as PCIe
                link = "pci"
        bus, channels = intra, lanes_used
        inter_latency = 0.0
        if len(by_node) > 1:
            nic = self.inter_node
            assert nic is not None
            nics = min(len({self._nic_of(d) for d in members}) for members in by_node.values())
            if nics * nic.achieved <= bus:
                bus, channels = nics * nic.achieved, nics
            inter_latency = nic.latency
        if math.isinf(channels):
            channels = 1
        return Group(len(devs), len(by_node), bus, max(1, int(channels)), link, inter_latency)

    def _node_share(self, members: list[int], lane: float) -> tuple[float, float, str]:
        """(bytes/s each device of ``members`` sends, lanes that carry it,
        link type) for the group's devices on one node."""
        ic = self.intra_node
        k = len(members)
        if ic.kind == "ideal":
            return (math.inf, math.inf, "nvlink")
        if ic.kind == "switch":
            if ic.lanes:
                return (min(ic.lanes * lane, ic.bandwidth), ic.lanes, "nvlink")
            return (ic.bandwidth, 1, "pci")
        if ic.kind == "mesh":
            lanes = self._mesh_lanes()
            local = [self._local(d) for d in members]
            own = [sum(lanes.get((a, b), 0) for b in local if b != a) for a in local]
            if min(own) > 0 and self._nvlink_connected(local):
                return (min(own) * lane, min(own), "nvlink")
            return (ic.host_bandwidth / k, 1, "pci")
        return (ic.bandwidth / k, 1, "pci")  # one bus, shared

    def _nvlink_connected(self, local: list[int]) -> bool:
        """Whether NVLink alone connects the node-local devices ``local``."""
        lanes = self._mesh_lanes()
        seen, todo = {local[0]}, [local[0]]
        while todo:
            a = todo.pop()
            for b in local:
                if b not in seen and lanes.get((a, b)):
                    seen.add(b)
                    todo.append(b)
        return len(seen) == len(local)

    # -- serialisation ------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The preset-file form, so results can record the exact hardware."""
        ic = self.intra_node
        d: dict[str, Any] = {
            "name": self.name,
            "notes": self.notes,
            "device": {
                "name": self.device.name,
                "flops": _num_out(self.device.flops),
                "mem_bandwidth": _num_out(self.device.mem_bandwidth),
                "memory_bytes": _num_out(self.device.memory_bytes),
                "dtype_bytes": self.device.dtype_bytes,
                **{
                    name: _num_out(getattr(self.device, name))
                    for name in DeviceSpec.KERNELS.values()
                    if getattr(self.device, name) is not None
                },
                # only when set, so presets without it keep their exact form
                **({"kernel_overhead_s": self.device.kernel_overhead_s} if self.device.kernel_overhead_s else {}),
                **_gemm_model_out(self.device),
            },
            "num_devices": self.num_devices,
            "devices_per_node": self.devices_per_node,
            "intra_node": {
                "kind": ic.kind,
                "bandwidth": _num_out(ic.bandwidth),
                "latency": ic.latency,
                "label": ic.label,
            },
        }
        if ic.lanes:
            d["intra_node"]["lanes"] = ic.lanes
        if ic.kind == "mesh":
            d["intra_node"]["mesh"] = [list(e) for e in ic.mesh]
            d["intra_node"]["host_bandwidth"] = _num_out(ic.host_bandwidth)
            d["intra_node"]["host_latency"] = ic.host_latency
        if self.inter_node is not None:
            nic = self.inter_node
            d["inter_node"] = {
                "count": nic.count,
                "bandwidth": _num_out(nic.bandwidth),
                "latency": nic.latency,
                "label": nic.label,
                **({"efficiency": nic.efficiency} if nic.efficiency != 1 else {}),
            }
        if self.collectives is not None:
            d["collectives"] = self.collectives.to_json()
        if self.cpu is not None:
            d["cpu"] = {
                "cores": list(self.cpu.cores),
                **{
                    end: {"fixed_s": cost.fixed_s, "bytes_per_s": _num_out(cost.bytes_per_s)}
                    for end, cost in (("send", self.cpu.send), ("recv", self.cpu.recv))
                },
                "wake_slice_s": self.cpu.wake_slice_s,
            }
        return d

    @classmethod
    def from_json(cls, d: Any, *, source: str = "hardware") -> Hardware:
        """Build from the preset-file form; :class:`HardwareError` naming ``source`` on bad input."""
        try:
            return _hardware_from_json(d)
        except HardwareError as e:
            raise HardwareError(f"{source}: {e}") from None

    def with_nodes(self, nodes: int) -> Hardware:
        """The same machine replicated ``nodes`` times (needs a NIC description)."""
        if self.devices_per_node is None or self.inter_node is None:
            raise HardwareError(f"{self.name} has no NICs; it cannot be replicated across nodes")
        if nodes < 1:
            raise HardwareError(f"node count must be >= 1, got {nodes}")
        base = self.name.rsplit("-x", 1)[0] if self.nodes > 1 else self.name
        return Hardware(
            name=f"{base}-x{nodes}" if nodes > 1 else base,
            device=self.device,
            num_devices=self.devices_per_node * nodes,
            devices_per_node=self.devices_per_node,
            intra_node=self.intra_node,
            inter_node=self.inter_node,
            notes=self.notes,
            collectives=self.collectives,
        )


#: Most devices of one node whose ring order is searched exhaustively: 8 is
#: a DGX-1's mesh, 7! cycles or 8! paths, pruned, well under a second once.
RING_SEARCH_MAX = 8


@functools.lru_cache(maxsize=None)
def _mesh_segment(ic: Interconnect, per_node: int, local: tuple[int, ...], cycle: bool) -> tuple[int, ...]:
    """The best order of ``local`` (sorted node-local indices) on mesh ``ic``
    of ``per_node`` devices:
    a ring over them (``cycle``) or a path that a multi-node ring passes
    through. Cached per (interconnect, group), so every node and every
    :class:`Hardware` built from one preset shares one search."""
    if len(local) > RING_SEARCH_MAX:
        return local
    node = Hardware("ring-search", _SEARCH_DEVICE, per_node, None, ic)
    edge = {(a, b): _edge_load(node.route(a, b)) for a in local for b in local if a != b}
    best: list = [None, local]  # [key, order]

    def extend(order: list[int], load: dict[str, list[float]], key: tuple[float, float]) -> None:
        if best[0] is not None and key >= best[0]:
            return  # loads only grow and ties keep the earlier order
        if len(order) == len(local):
            if cycle:
                key = _add_edge(load, edge[(order[-1], order[0])], key)
                if best[0] is not None and key >= best[0]:
                    return
            best[0], best[1] = key, tuple(order)
            return
        for nxt in local:
            if nxt in order:
                continue
            grown = {k: v[:] for k, v in load.items()}
            order.append(nxt)
            extend(order, grown, _add_edge(grown, edge[(order[-2], nxt)], key))
            order.pop()

    # a cycle is the same from any start: fix the first device
    for first in local[:1] if cycle else local:
        extend([first], {}, (0.0, 0.0))
    return best[1]


#: Any device will do: the search only looks at routes.
_SEARCH_DEVICE = DeviceSpec("ring-search", 1.0, 1.0, 1.0)


def _edge_load(route: tuple[Link, ...]) -> tuple[float, float, tuple[str, ...]]:
    """(seconds per byte, latency, link names) one ring edge puts on each link of its route."""
    if not route:
        return (0.0, 0.0, ())
    bandwidth = min(link.bandwidth for link in route)
    latency = math.fsum(link.latency for link in route)
    return (0.0 if math.isinf(bandwidth) else 1 / bandwidth, latency, tuple(link.name for link in route))


def _add_edge(
    load: dict[str, list[float]], edge: tuple[float, float, tuple[str, ...]], key: tuple[float, float]
) -> tuple[float, float]:
    """Add one edge's load to ``load`` (in place); the new (busiest per byte, busiest latency) key."""
    per_byte, latency, names = edge
    worst_b, worst_l = key
    for name in names:
        acc = load.setdefault(name, [0.0, 0.0])
        acc[0] += per_byte
        acc[1] += latency
        worst_b, worst_l = max(worst_b, acc[0]), max(worst_l, acc[1])
    return (worst_b, worst_l)


def _num_out(x: float) -> float | str:
    return "inf" if math.isinf(x) else x


def _gemm_model_out(device: DeviceSpec) -> dict[str, Any]:
    """The GEMM shape model's fields of the preset-file form: none without the
    model (so presets without it keep their exact form), and of the optional
    ones only those that differ from their defaults."""
    if not device.shape_model:
        return {}
    out: dict[str, Any] = {
        "peak_flops": device.peak_flops,
        "sms": device.sms,
        "gemm_max_efficiency": device.gemm_max_efficiency,
        "gemm_tile": list(device.gemm_tile),
    }
    if device.gemm_k_overhead:
        out["gemm_k_overhead"] = device.gemm_k_overhead
    if device.gemm_fixed_s:
        out["gemm_fixed_s"] = device.gemm_fixed_s
    if device.gemm_table is not None:
        out["gemm_table"] = device.gemm_table
    return out


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------

_TOP_KEYS = {
    "name",
    "notes",
    "device",
    "num_devices",
    "devices_per_node",
    "intra_node",
    "inter_node",
    "cpu",
    "collectives",
}
_COLLECTIVES_KEYS = {"library", "arch", "first_bucket_bytes", "bucket_bytes", "processor_usage", "notes"}
_CPU_KEYS = {"cores", "send", "recv", "wake_slice_s", "notes"}
_CPU_COST_KEYS = {"fixed_s", "bytes_per_s", "notes"}
_DEVICE_KEYS = {
    "name",
    "flops",
    "mem_bandwidth",
    "memory_bytes",
    "dtype_bytes",
    "kernel_overhead_s",
    "notes",
    "update_bandwidth",
    "predict_bandwidth",
    "average_bandwidth",
    *DeviceSpec.GEMM_FIELDS,
}
_INTRA_KEYS = {"kind", "bandwidth", "latency", "label", "mesh", "host_bandwidth", "host_latency", "lanes", "notes"}
_NIC_KEYS = {"count", "bandwidth", "latency", "label", "efficiency", "notes"}


def _num(d: dict, key: str, where: str, default: Any = None) -> float:
    """A number field; the string "inf" (JSON has no infinity) means unbounded."""
    if key not in d:
        if default is None:
            raise HardwareError(f"{where}: missing field {key!r}")
        return default
    v = d[key]
    if v == "inf":
        return math.inf
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > sys.float_info.max:
        raise HardwareError(f'{where}.{key} must be a number or "inf", got an integer of {v.bit_length()} bits')
    if not is_number(v) or math.isnan(v):
        raise HardwareError(f'{where}.{key} must be a number or "inf", got {v!r}')
    return float(v)


def _obj(d: Any, where: str, keys: set[str]) -> dict:
    if not isinstance(d, dict):
        raise HardwareError(f"{where} must be a JSON object")
    extra = sorted(set(d) - keys)
    if extra:
        raise HardwareError(f"{where}: unknown field {extra[0]!r} (known: {', '.join(sorted(keys))})")
    return d


def _int(d: dict, key: str, where: str, default: int) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise HardwareError(f"{where}.{key} must be an integer, got {v!r}")
    return v


def _opt_int(d: dict, key: str, where: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise HardwareError(f"{where}.{key} must be an integer or null, got {v!r}")
    return v


def _hardware_from_json(d: Any) -> Hardware:
    d = _obj(d, "hardware", _TOP_KEYS)
    name = d.get("name")
    if name is None or name == "":
        raise HardwareError("missing or empty field 'name'")
    if not isinstance(name, str):
        raise HardwareError(f"name must be a string, got {name!r}")
    dev = _obj(d.get("device"), "device", _DEVICE_KEYS) if "device" in d else None
    if dev is None:
        raise HardwareError("missing field 'device'")
    dtype = dev.get("dtype_bytes", 4)
    if isinstance(dtype, bool) or not isinstance(dtype, int):
        raise HardwareError(f"device.dtype_bytes must be an integer, got {dtype!r}")
    device = DeviceSpec(
        name=str(dev.get("name", name)),
        flops=_num(dev, "flops", "device"),
        mem_bandwidth=_num(dev, "mem_bandwidth", "device"),
        memory_bytes=_num(dev, "memory_bytes", "device"),
        dtype_bytes=dtype,
        **{name: _num(dev, name, "device") for name in DeviceSpec.KERNELS.values() if name in dev},
        kernel_overhead_s=_num(dev, "kernel_overhead_s", "device", 0.0),
        **_gemm_model_in(dev),
    )
    intra = _obj(d.get("intra_node", {"kind": "ideal"}), "intra_node", _INTRA_KEYS)
    kind = intra.get("kind")
    if kind not in Interconnect.KINDS:
        raise HardwareError(f"intra_node.kind must be one of {', '.join(Interconnect.KINDS)}, got {kind!r}")
    mesh = intra.get("mesh", [])
    if not isinstance(mesh, list) or not all(
        isinstance(e, list) and len(e) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in e)
        for e in mesh
    ):
        raise HardwareError("intra_node.mesh must be a list of [a, b, lanes] integer triples")
    if kind == "mesh" and not mesh:
        raise HardwareError("intra_node.kind 'mesh' needs a non-empty 'mesh' list")
    pairs = [frozenset(e[:2]) for e in mesh]
    twice = next((sorted(p) for i, p in enumerate(pairs) if p in pairs[:i]), None)
    if twice is not None:  # the lanes of one would silently replace the other's
        raise HardwareError(
            f"intra_node.mesh lists the pair {twice[0]}, {twice[-1]} twice (either direction); give its lanes once"
        )
    ic = Interconnect(
        kind=kind,
        bandwidth=_num(intra, "bandwidth", "intra_node", math.inf if kind == "ideal" else None),
        latency=_num(intra, "latency", "intra_node", 0.0),
        label=str(intra.get("label", "")),
        mesh=tuple(tuple(e) for e in mesh),
        host_bandwidth=_num(intra, "host_bandwidth", "intra_node", None if kind == "mesh" else math.inf),
        host_latency=_num(intra, "host_latency", "intra_node", 0.0),
        lanes=_int(intra, "lanes", "intra_node", 0),
    )
    nic = None
    if d.get("inter_node") is not None:
        nd = _obj(d["inter_node"], "inter_node", _NIC_KEYS)
        count = nd.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int):
            raise HardwareError(f"inter_node.count must be an integer, got {count!r}")
        nic = NicSpec(
            count=count,
            bandwidth=_num(nd, "bandwidth", "inter_node"),
            latency=_num(nd, "latency", "inter_node", 0.0),
            label=str(nd.get("label", "nic")),
            efficiency=_num(nd, "efficiency", "inter_node", 1.0),
        )
    notes = d.get("notes", "")
    if not isinstance(notes, str):
        raise HardwareError("'notes' must be a string")
    return Hardware(
        name=name,
        device=device,
        num_devices=_opt_int(d, "num_devices", "hardware"),
        devices_per_node=_opt_int(d, "devices_per_node", "hardware"),
        intra_node=ic,
        inter_node=nic,
        notes=notes,
        cpu=_cpu_from_json(d["cpu"]) if d.get("cpu") is not None else None,
        collectives=_collectives_from_json(d["collectives"]) if d.get("collectives") is not None else None,
    )


def _collectives_from_json(d: Any) -> CollectiveSpec:
    d = _obj(d, "collectives", _COLLECTIVES_KEYS)
    try:
        usage = d.get("processor_usage")
        if usage is not None and not isinstance(usage, dict):
            raise HardwareError("collectives.processor_usage must be an object of link type -> share")
        return CollectiveSpec(
            library=d.get("library", "nccl"),
            arch=d.get("arch", "volta"),
            first_bucket_bytes=d.get("first_bucket_bytes"),
            bucket_bytes=d.get("bucket_bytes"),
            processor_usage=tuple(usage.items()) if usage else None,
        )
    except InputError as e:
        raise HardwareError(str(e)) from None


def _gemm_model_in(dev: dict) -> dict[str, Any]:
    """The GEMM shape model's fields of a device object, as DeviceSpec takes
    them (absent fields keep their defaults; DeviceSpec checks the values)."""
    out: dict[str, Any] = {}
    for name in ("peak_flops", "gemm_max_efficiency", "gemm_k_overhead", "gemm_fixed_s"):
        if name in dev:
            out[name] = _num(dev, name, "device")
    if "sms" in dev:
        sms = dev["sms"]
        if isinstance(sms, bool) or not isinstance(sms, int):
            raise HardwareError(f"device.sms must be an integer, got {shown(sms)}")
        out["sms"] = sms
    if "gemm_tile" in dev:
        tile = dev["gemm_tile"]
        if not isinstance(tile, list):
            raise HardwareError(f"device.gemm_tile must be a list of two integers [rows, columns], got {tile!r}")
        out["gemm_tile"] = tuple(tile)
    if "gemm_table" in dev:
        table = dev["gemm_table"]
        if not isinstance(table, str):
            raise HardwareError(f"device.gemm_table must be the name of a GEMM table, got {table!r}")
        out["gemm_table"] = table
    return out


def _cpu_from_json(d: Any) -> HostCpu:
    d = _obj(d, "cpu", _CPU_KEYS)
    cores = d.get("cores")
    if not isinstance(cores, list):
        raise HardwareError(f"cpu.cores must be a list of core numbers, got {cores!r}")
    costs = {}
    for end in ("send", "recv"):
        c = _obj(d.get(end, {}), f"cpu.{end}", _CPU_COST_KEYS)
        costs[end] = CpuCost(
            fixed_s=_num(c, "fixed_s", f"cpu.{end}", 0.0), bytes_per_s=_num(c, "bytes_per_s", f"cpu.{end}", math.inf)
        )
    return HostCpu(cores=tuple(cores), **costs, wake_slice_s=_num(d, "wake_slice_s", "cpu", 0.0))


def _presets():
    return importlib.resources.files("pipesim.sim.hardware").joinpath("presets")


def preset_names() -> list[str]:
    """Names of the built-in hardware presets (``sim/hardware/presets/<name>.json``)."""
    return sorted(p.name[: -len(".json")] for p in _presets().iterdir() if p.name.endswith(".json"))


_NODES_RE = re.compile(r"^(?P<base>.+)-x(?P<nodes>\d+)$")


def load_hardware(name_or_path: str) -> Hardware:
    """A preset by name, ``<preset>-x<N>`` for N nodes of a preset, or a JSON file path."""
    key = str(name_or_path)
    names = preset_names()
    if key in names:
        res = _presets().joinpath(f"{key}.json")
        return _parse_text(res.read_text(encoding="utf-8"), f"preset {key}")
    m = _NODES_RE.match(key)
    if m and m["base"] in names and int(m["nodes"]) >= 1:
        base, nodes = load_hardware(m["base"]), int(m["nodes"])
        if base.nodes > 1:  # x4-x2: eight nodes, or two? neither is said: refused
            root = _NODES_RE.match(base.name)
            raise HardwareError(
                f"{m['base']} is already {base.nodes} nodes; name the node count once "
                f"({root['base'] if root else base.name}-x{base.nodes * nodes} for {base.nodes * nodes} nodes)"
            )
        return base.with_nodes(nodes)
    if os.path.isfile(key):
        return _parse_text(read_text(key, "hardware", HardwareError), f"hardware file {key}")
    if os.sep in key or "/" in key or key.endswith(".json"):
        raise HardwareError(f"hardware file {key} not found")
    raise HardwareError(
        f"unknown hardware {key!r}; presets: {', '.join(names)} (or <preset>-x<N>, or a JSON file path)"
    )


def _parse_text(text: str, source: str) -> Hardware:
    return Hardware.from_json(parse_json(text, source, HardwareError), source=source)

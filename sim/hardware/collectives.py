"""NCCL's own cost model of a collective: algorithm, protocol, latency, bandwidth.

A GPU all-reduce is not one ring at the links' nominal bandwidth. NCCL runs
it as one of two algorithms (ring, tree) in one of three protocols (LL,
LL128, Simple), over several *channels* that drive every NVLink lane and
every NIC at once, and before each call it picks the pair its own cost model
says is fastest. That model (``ncclTopoTuneModel`` in NVIDIA/nccl
``src/graph/tuning.cc``) is an alpha-beta model per (algorithm, protocol)::

    time = latency + bytes / algorithm bandwidth

    ring latency = base[p] + (steps - inter_steps) * intra[p] + inter_steps * inter[p]
    tree latency = base[p] + 2 * ((ranks_per_node - 1) * intra[p] + floor(log2(nodes)) * inter[p])
    ring bandwidth = bus bandwidth * ranks / steps           (steps = 2 (ranks - 1))
    tree bandwidth = bus bandwidth / 2

``base`` is a fixed cost per protocol, ``intra`` and ``inter`` the cost of
one step over the link type the step crosses (NVLink, PCIe, network), and
the bus bandwidth is what every rank sends per second: the channels'
bandwidth, less each protocol's framing (LL sends a flag with every 8
bytes: half; LL128 one per 128: x0.92), capped per channel and per GPU
generation. This module holds those constants (``constants/nccl-tuning.json``,
with its source) and evaluates the model; :class:`~pipesim.sim.hardware.machines.Hardware`
supplies the facts of a group of devices (ranks, nodes, the link type of a
step, the bus bandwidth its topology offers and how many channels carry it).

What pipesim does not take from NCCL: the topology search that finds the
channels (the machine model gives the group's bus bandwidth from its lanes
and NICs instead: :meth:`~pipesim.sim.hardware.machines.Hardware.collective_group`),
NVLS, CollNet and PAT (none of the presets' machines has them enabled for the
runs pipesim reproduces), and tuner plugins; the refinements NCCL applies
when it times one call (``ncclTopoGetAlgoTime``: the tree's bandwidth
correction per message size, a multi-node Simple ring's latency x1.9 before
Ampere and x1.4 from it) and the tree's x0.85 in NCCL's plain tree pattern;
and LL128's dependence on the path: NCCL enables it only where the GPUs are
NVLink-connected (and the NIC close), pipesim on every GPU from Volta on
(:attr:`CollectiveSpec.ll128`), a PCIe machine included.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
from dataclasses import dataclass
from typing import Any

from pipesim.sim.errors import InputError
from pipesim.sim.files import parse_json

PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("ring", "tree")
#: Link types NCCL prices a step by.
LINK_TYPES = ("nvlink", "pci", "net")
#: GPU generations NCCL's tables have rows for (Pascal uses Volta's).
ARCHES = ("pascal", "volta", "ampere", "hopper", "blackwell")

_US = 1e-6
_GB = 1e9


@dataclass(frozen=True)
class CollectiveSpec:
    """How a machine's collectives run.

    ``library``/``arch``: whose cost model (NCCL's) on which GPU generation
    (NCCL's caps differ per generation; LL128 is on from Volta).
    ``first_bucket_bytes``/``bucket_bytes``: how a data-parallel or
    replicated stage's gradients are all-reduced while its backward runs, as
    PyTorch's DistributedDataParallel does (the first bucket, then the
    rest, filled from the last layer; ``bucket_bytes`` 0: one all-reduce
    after the backward, as a framework without overlap runs it).
    ``processor_usage``: per link type, the share of the GPU a collective's
    kernels take, so compute overlapping a collective runs
    ``1 / (1 - usage)`` times as long. Defaults: ``constants/overlap.json``,
    with their sources.
    """

    library: str = "nccl"
    arch: str = "volta"
    first_bucket_bytes: int | None = None
    bucket_bytes: int | None = None
    processor_usage: tuple[tuple[str, float], ...] | None = None

    def __post_init__(self) -> None:
        if self.library != "nccl":
            raise InputError(f"collectives.library must be 'nccl', got {self.library!r}")
        if self.arch not in ARCHES:
            raise InputError(f"collectives.arch must be one of {', '.join(ARCHES)}, got {self.arch!r}")
        defaults = overlap_defaults()
        for name in ("first_bucket_bytes", "bucket_bytes"):
            v = getattr(self, name)
            if v is None:
                object.__setattr__(self, name, defaults["ddp_buckets"][name])
            elif isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 2**50:
                raise InputError(f"collectives.{name} must be a whole number of bytes >= 0, got {v!r}")
        usage = dict(self.processor_usage or {})
        unknown = sorted(set(usage) - set(LINK_TYPES))
        if unknown:
            raise InputError(f"collectives.processor_usage: unknown link type {unknown[0]!r} (known: nvlink, pci, net)")
        for link in LINK_TYPES:
            v = usage.setdefault(link, defaults["processor_usage"][link])
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise InputError(f"collectives.processor_usage.{link} must be a number in [0, 1), got {v!r}")
        object.__setattr__(self, "processor_usage", tuple((k, float(usage[k])) for k in LINK_TYPES))

    @property
    def ll128(self) -> bool:
        """Whether LL128 is among the options: compute capability 7.0 and
        later, as NCCL's default asks; NCCL also needs NVLink between the GPUs,
        which pipesim does not check (see the module doc)."""
        return self.arch != "pascal"

    def slowdown(self, link: str) -> float:
        """Extra compute time per second of overlap with a collective over ``link``:
        ``usage / (1 - usage)``."""
        usage = dict(self.processor_usage)[link]
        return usage / (1 - usage)

    def to_json(self) -> dict[str, Any]:
        return {
            "library": self.library,
            "arch": self.arch,
            "first_bucket_bytes": self.first_bucket_bytes,
            "bucket_bytes": self.bucket_bytes,
            "processor_usage": dict(self.processor_usage),
        }


@dataclass(frozen=True)
class Group:
    """The facts of one collective's devices the model needs.

    ``bus_bandwidth``: bytes/s each rank can send with every channel of the
    Simple protocol at work (the narrowest of the node-local lanes and the
    node's NICs); ``channels``: how many channels carry it (the per-channel
    caps multiply by it); ``intra_link`` / ``inter``: the link type of a step
    inside a node and the extra latency of a step across nodes (the NIC's
    own, seconds).
    """

    ranks: int
    nodes: int
    bus_bandwidth: float
    channels: int
    intra_link: str
    inter_latency_s: float = 0.0


@dataclass(frozen=True)
class Estimate:
    """NCCL's choice for one message and what it predicts."""

    algorithm: str
    protocol: str
    latency_s: float
    bandwidth: float  # algorithm bandwidth, bytes/s
    seconds: float


@functools.lru_cache(maxsize=1)
def constants() -> dict[str, Any]:
    """The tuning constants (``constants/nccl-tuning.json``)."""
    path = importlib.resources.files("pipesim.sim.hardware").joinpath("constants", "nccl-tuning.json")
    return parse_json(path.read_text(encoding="utf-8"), "nccl-tuning.json", InputError)


@functools.lru_cache(maxsize=1)
def overlap_defaults() -> dict[str, Any]:
    """DDP's bucket sizes and the collectives' processor usage (``constants/overlap.json``)."""
    path = importlib.resources.files("pipesim.sim.hardware").joinpath("constants", "overlap.json")
    return parse_json(path.read_text(encoding="utf-8"), "overlap.json", InputError)


def nvlink_lane_bandwidth(arch: str) -> float:
    """Bytes/s NCCL credits one NVLink lane with, per direction, on ``arch``."""
    return constants()["nvlink_lane_GBps"][arch] * _GB


def allreduce(spec: CollectiveSpec, group: Group, nbytes: float) -> Estimate:
    """The (algorithm, protocol) NCCL's model picks for an all-reduce of
    ``nbytes`` over ``group``, and its predicted time (zero for one rank or
    no bytes)."""
    if group.ranks < 2 or nbytes <= 0 or math.isinf(group.bus_bandwidth):
        return Estimate("ring", "Simple", 0.0, math.inf, 0.0)
    options = [
        (latency + nbytes / bandwidth, algorithm, protocol, latency, bandwidth)
        for algorithm, protocol, latency, bandwidth in allreduce_options(spec, group)
        if bandwidth > 0
    ]
    seconds, algorithm, protocol, latency, bandwidth = min(options)
    return Estimate(algorithm, protocol, latency, bandwidth, seconds)


def allreduce_options(spec: CollectiveSpec, group: Group) -> list[tuple[str, str, float, float]]:
    """Every enabled (algorithm, protocol, latency seconds, algorithm bandwidth bytes/s)."""
    return [
        (algorithm, protocol, _latency(spec, group, algorithm, protocol), _bandwidth(spec, group, algorithm, protocol))
        for algorithm in ALGORITHMS
        for protocol in PROTOCOLS
        if protocol != "LL128" or spec.ll128
    ]


def _latency(spec: CollectiveSpec, group: Group, algorithm: str, protocol: str) -> float:
    c = constants()
    hw = c["hw_latency_us"]
    base = c["base_latency_us"][algorithm][protocol]
    intra = hw[group.intra_link][algorithm][protocol]
    per_node = group.ranks // group.nodes
    # with one rank per node every step crosses the network: NCCL takes the tree's network latency
    inter = hw["net"]["tree" if per_node == 1 else algorithm][protocol]
    inter_s = inter * _US + group.inter_latency_s * (2 if protocol == "Simple" else 1)  # Simple adds a flush
    if algorithm == "tree":
        # NCCL's log2i: the whole levels of the tree across nodes (log2 rounded down)
        levels = group.nodes.bit_length() - 1
        return base * _US + 2 * ((per_node - 1) * intra * _US + levels * inter_s)
    steps = 2 * (group.ranks - 1)
    inter_steps = 2 * (group.nodes - 1)
    if group.nodes > 1:  # a multi-node ring launches every step through the network proxy
        overhead = c["net_overhead_us"] * (3 if protocol == "Simple" else 1)
        intra = max(intra, overhead)
    return base * _US + (steps - inter_steps) * intra * _US + inter_steps * inter_s


def _bandwidth(spec: CollectiveSpec, group: Group, algorithm: str, protocol: str) -> float:
    """Algorithm bandwidth (bytes/s): the bus bandwidth with NCCL's refinements, converted."""
    c = constants()
    f = c["factors"]
    arch = c["arch_index"][spec.arch]
    nodes = min(group.nodes, 3) - 1
    ll_max = c["ll_max_bw_GBps"][arch if group.nodes == 1 else 0][nodes] * _GB
    channels = group.channels
    bus = group.bus_bandwidth
    if algorithm == "ring":
        if protocol == "LL":
            bus = min(ll_max, bus * f["ring_ll"])
        elif protocol == "LL128":
            bus = min(bus * f["ring_ll128"], channels * c["ring_ll128_per_channel_GBps"][arch][nodes] * _GB)
        steps = 2 * (group.ranks - 1)
        return bus * group.ranks / steps
    bus = min(bus * f["tree_allreduce"], channels * c["tree_per_channel_GBps"][arch][nodes] * _GB)
    if protocol == "LL":
        bus = min(bus * f["tree_ll"], ll_max)
    elif protocol == "LL128":
        factor = f["tree_ll128_one_node"] if group.nodes == 1 else f["tree_ll128_nodes"]
        bus = min(bus * factor, channels * c["tree_ll128_per_channel_GBps"][arch][nodes] * _GB)
    return bus / 2


def p2p_latency(link: str) -> float:
    """Seconds one point-to-point message costs before its bytes: one step of
    NCCL's send/receive in the Simple protocol (the protocol's base latency
    and one step over ``link``). NCCL sends messages below 16 KiB in LL
    instead (``NCCL_P2P_LL_THRESHOLD``); a pipeline's activations are far
    above it, so pipesim prices every transfer as Simple."""
    c = constants()
    return (c["base_latency_us"]["ring"]["Simple"] + c["hw_latency_us"][link]["ring"]["Simple"]) * _US

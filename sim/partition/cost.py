"""The planner's analytic cost model: compute, transfers, all-reduces, memory.

A configuration (a split of the layers into stages, and a :class:`~.layout.Layout`
saying where each stage's replicas run and what they do per iteration) is
costed as the engine would run it, in steady state:

Resources
    Every device and every link is a resource; the steady-state time per
    micro-batch (``period_s``) is the load of the busiest one, per
    micro-batch of the whole pipeline:

    * a device: its passes (forward + backward), the part of each pass's
      receive that the compute before it does not hide (the lowering posts a
      receive ``recv_lookahead`` compute actions ahead, and a send posted
      just before goes first on a link the two share), and its optimizer
      steps, each after a blocking all-reduce of the stage's gradients over
      its replicas when it has several (``StageCost.gradient_bytes``, the
      bytes the engine's REDUCE_GRAD moves; the engine's UPDATE waits for its
      REDUCE_GRAD, so the device idles through it), except where the
      strategy hides the all-reduce behind the next window's passes (2BW:
      ``Layout.hidden_reduce``), where the device waits only for what of it
      outlasts them. A replicated stage that
      steps after every pass (PipeDream) runs in lock-step: a step's
      all-reduce waits for the last of its replicas' micro-batches, which
      the neighbouring stages hand over one at a time, so each step also
      waits (replicas - 1) times the slowest other stage's time per
      micro-batch, less the forward it runs meanwhile;
    * a link: every transfer whose route names it, for the transfer's whole
      duration (the engine holds each link of a route that long): the
      activation of every micro-batch across every stage boundary and its
      gradient back, routed replica to replica as the IR routes them
      (micro-batch i on replica ``i % r``), and the ring steps of every
      all-reduce. **Shared links are shared**: a PCIe bus or a NIC carrying
      several boundaries and rings adds all of their loads.
Latency
    A 1F1B replica holds only its warm-up plus one micro-batches in flight,
    so the pipeline cannot go faster than a stage's round trip (its own and
    every later stage's passes, plus the transfers there and back) divided
    by the micro-batches in flight at it (Little's law): the bound that
    slow links impose even when no link is busy.
Fill and drain
    A flushed iteration is ``m`` periods plus one micro-batch's path through
    the pipeline (every stage's passes and transfers) less the bottleneck's
    own pass for each of its flushes (one, or GPipe's ``flushes``), plus
    stage 0's final all-reduce and step; when every forward of a flush runs
    before any backward (GPipe), it is at least a forward phase and a
    backward phase a flush, each one micro-batch's path plus the flush's
    other passes of its slowest stage. A stream is ``m`` periods per
    iteration in steady state.
Memory
    Per device, for every stage replica it hosts: the passes' weights times
    the versions the strategy keeps, gradients, the master copy and
    optimizer state, each at the profile's precision
    (:class:`~pipesim.sim.workloads.profile.Precision`), the stash of the
    micro-batches in flight, weight-sized buffers (prediction at the passes'
    width, the averaging centre at the master's),
    and a send and a receive buffer for each boundary tensor in each
    direction. With activation recomputation a micro-batch in flight keeps
    only its layers' inputs, and one of them, while its backward recomputes
    layer after layer, the inputs below one layer and that layer's full
    stash at most (:func:`held_activations`).

Not modelled: queueing on a shared link beyond its average load (a transfer
delayed behind another can stall a pass, which the engine sees), and
all-reduces slowed by activation traffic on the links they share. That is
what confirming the best candidates with the engine is for.

Times are linear in the bytes that cross (latency + bytes / bandwidth), so
:class:`LinkModel` keeps, per device set, ``(a, b)`` pairs meaning ``a + b *
bytes`` seconds: the search evaluates them for every split at once.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from pipesim.sim.engine.core import CostModel, bucketed_exposure, gradient_buckets
from pipesim.sim.hardware import collectives
from pipesim.sim.hardware.machines import Hardware
from pipesim.sim.ir.core import INPUT_GRADIENT_OPS, UPDATE, Action, F
from pipesim.sim.partition.layout import BACKWARD, FORWARD, Layout, Wait
from pipesim.sim.strategies._common import flush_sizes
from pipesim.sim.workloads.stages import StageCost

#: ``(a, b)``: a + b * bytes seconds (a counts only when bytes > 0).
Line = tuple[float, float]


@dataclass(frozen=True)
class Boundary:
    """Transfers across one stage boundary, per micro-batch of the pipeline.

    ``links[name]``: seconds the link is held by the activation and its
    gradient of one micro-batch (averaged over the round-robin pattern),
    as a :data:`Line` in the boundary's bytes. ``transfer``: the mean
    uncontended time of one of the two transfers. ``forward`` and
    ``backward``: the links the activations and the gradients cross.
    """

    links: dict[str, Line]
    transfer: Line
    forward: frozenset[str]
    backward: frozenset[str]


@dataclass(frozen=True)
class Ring:
    """A ring all-reduce over a set of devices, as lines in the reduced bytes.

    ``time``: the lines whose maximum is its duration (each step lasts as long
    as its slowest transfer or its busiest link); ``links[name]``: seconds
    the link is held in all.
    """

    time: tuple[Line, ...]
    links: dict[str, Line]

    def seconds(self, nbytes: float) -> float:
        return max((a + b * nbytes for a, b in self.time), default=0.0) if nbytes > 0 else 0.0


class LinkModel:
    """Transfer and all-reduce costs on ``hardware``, cached by device sets."""

    def __init__(self, hardware: Hardware) -> None:
        self.hw = hardware
        self._pairs: dict[tuple[int, int], tuple[float, float, tuple[str, ...]]] = {}
        self._boundaries: dict[tuple, Boundary] = {}
        self._rings: dict[tuple[int, ...], Ring] = {}

    def pair(self, src: int, dst: int) -> tuple[float, float, tuple[str, ...]]:
        """(latency, seconds per byte, link names) of a ``src -> dst`` transfer."""
        key = (src, dst)
        found = self._pairs.get(key)
        if found is None:
            route = self.hw.route(src, dst)
            if route:
                found = (*self.hw.transfer_line(src, dst), tuple(link.name for link in route))
            else:
                found = (0.0, 0.0, ())
            self._pairs[key] = found
        return found

    def boundary(self, senders: tuple[int, ...], receivers: tuple[int, ...]) -> Boundary:
        """Forward and backward transfers of one micro-batch from the stage on
        ``senders`` to the stage on ``receivers``, averaged over the pattern
        micro-batch i -> (replica i % r1, replica i % r2) repeats with."""
        key = (senders, receivers)
        found = self._boundaries.get(key)
        if found is None:
            cycle = math.lcm(len(senders), len(receivers))
            links: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
            mean = [0.0, 0.0]
            crossed: tuple[set, set] = (set(), set())
            for i in range(cycle):
                s, d = senders[i % len(senders)], receivers[i % len(receivers)]
                for direction, (src, dst) in enumerate(((s, d), (d, s))):
                    lat, per_byte, names = self.pair(src, dst)
                    crossed[direction].update(names)
                    for name in names:
                        links[name][0] += lat / cycle
                        links[name][1] += per_byte / cycle
                    mean[0] += lat / (2 * cycle)
                    mean[1] += per_byte / (2 * cycle)
            found = self._boundaries[key] = Boundary(
                {k: (v[0], v[1]) for k, v in links.items()},
                (mean[0], mean[1]),
                frozenset(crossed[0]),
                frozenset(crossed[1]),
            )
        return found

    def ring(self, devices: tuple[int, ...]) -> Ring:
        """The ring all-reduce the engine runs over ``devices`` (in the
        hardware's :meth:`~pipesim.sim.hardware.machines.Hardware.ring_order`):
        2(n-1) steps, each moving bytes/n over every ring edge."""
        key = tuple(sorted(set(devices)))
        found = self._rings.get(key)
        if found is None and self.hw.collectives is not None and len(key) > 1:
            found = self._rings[key] = self._nccl_ring(key)
        if found is None:
            devs = self.hw.ring_order(key)
            n = len(devs)
            steps = 2 * (n - 1)
            edges: list[Line] = []
            busy: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
            for i, src in enumerate(devs if n > 1 else ()):
                lat, per_byte, names = self.pair(src, devs[(i + 1) % n])
                if not names:
                    continue
                edges.append((lat, per_byte / n))
                for name in names:
                    busy[name][0] += lat
                    busy[name][1] += per_byte / n
            time = tuple((steps * a, steps * b) for a, b in [*edges, *map(tuple, busy.values())])
            found = self._rings[key] = Ring(time, {k: (steps * v[0], steps * v[1]) for k, v in busy.items()})
        return found

    def _nccl_ring(self, devices: tuple[int, ...]) -> Ring:
        """An all-reduce priced by NCCL's model, as the engine runs it: one
        line, the (algorithm, protocol) NCCL picks for large messages (the
        highest bandwidth, then the lowest latency: gradient buffers are
        megabytes), holding every link of the ring's edges for its whole
        duration."""
        group = self.hw.collective_group(devices)
        options = collectives.allreduce_options(self.hw.collectives, group)
        _, _, latency, bandwidth = min(options, key=lambda o: (-o[3], o[2]))
        line = (latency, 0.0 if math.isinf(bandwidth) else 1 / bandwidth)
        order = self.hw.ring_order(devices)
        names = {link.name for i, src in enumerate(order) for link in self.hw.route(src, order[(i + 1) % len(order)])}
        return Ring((line,), {name: line for name in sorted(names)})


def envelope(lines) -> Line:
    """One line at or above every line of ``lines`` for bytes >= 0: the
    largest constant with the largest slope (exact when one line has both,
    off by at most a latency otherwise). The search's vectorised form."""
    lines = list(lines)
    if not lines:
        return (0.0, 0.0)
    return (max(a for a, _ in lines), max(b for _, b in lines))


@dataclass(frozen=True)
class Estimate:
    """The cost model's answer for one configuration (see the module doc).

    ``period_s`` per micro-batch of the pipeline in steady state (the
    resource bound and the latency bound, whichever is larger) and which
    resource sets it; ``iteration_s`` of one iteration (flushed: with its
    fill and drain); ``makespan_s`` of the whole run; ``memory_bytes`` per
    device (every device of the layout).
    """

    period_s: float
    bottleneck: str
    iteration_s: float
    makespan_s: float
    samples_per_s: float
    memory_bytes: tuple[int, ...]
    memory_limit_bytes: float
    #: the layout's flushes per update (GPipe's; 1 for every other strategy)
    flushes: int = 1

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.memory_bytes)

    @property
    def out_of_memory(self) -> bool:
        return self.peak_memory_bytes > self.memory_limit_bytes


def update_seconds(param_bytes, optimizer: str, bandwidth: float):
    """One optimizer step over ``param_bytes`` of weights (a number or an
    array) at the device's update ``bandwidth``, as the engine costs it."""
    traffic = CostModel((), bandwidth, optimizer).traffic(UPDATE)
    return 0.0 * param_bytes if math.isinf(bandwidth) else traffic * param_bytes / bandwidth


def held_activations(stash_bytes, inflight, checkpoint_bytes=None, peak_bytes=None):
    """Activation bytes one stage replica holds at most: the whole stash of
    each of the ``inflight`` micro-batches (numbers or arrays).

    With activation recomputation (``checkpoint_bytes`` given: what a
    micro-batch keeps between its forward and its backward, the inputs of the
    stage's layers) a micro-batch keeps only those until its backward, which
    re-runs the forward and holds at most ``peak_bytes`` while it runs
    (:attr:`~pipesim.sim.workloads.stages.StageCost.full_stash_bytes`; by default
    that of a one-layer stage, max(stash, input)): ``inflight - 1``
    checkpoints and one peak. Both memory checks (:func:`stage_memory`,
    :func:`.search.memory_terms`) call this, and the engine's tracker
    (:mod:`pipesim.sim.engine.trackers`) holds the same bytes over time."""
    if checkpoint_bytes is None:
        return stash_bytes * inflight
    full = np.maximum(stash_bytes, checkpoint_bytes) if peak_bytes is None else peak_bytes
    return np.where(np.asarray(inflight) > 0, (np.asarray(inflight) - 1) * checkpoint_bytes + full, 0 * full)


def stage_memory(
    cost: StageCost,
    inflight: int,
    versions: int,
    buffers: int,
    optimizer_multiplier: int,
    boundary_bytes: int,
    centres: int = 0,
) -> int:
    """One replica of a stage: the passes' weights x (versions + ``buffers``,
    the predicted weights), gradients, the master copy where it is apart,
    optimizer state and ``centres`` (averaging) at the master's width,
    stashed micro-batches, and a send and a receive buffer for each tensor
    across its boundaries (``boundary_bytes``: the activations in and out).
    The sizes are the stage's at its profile's precision, as the engine's
    tracker holds them (:mod:`pipesim.sim.engine.trackers`)."""
    held = (
        held_activations(cost.stash_bytes, inflight, cost.held_bytes, cost.full_stash_bytes)
        if cost.recompute
        else held_activations(cost.stash_bytes, inflight)
    )
    weights = (
        cost.weight_bytes * (versions + buffers)
        + cost.gradient_bytes
        + cost.master_copy_bytes
        + cost.param_bytes * (optimizer_multiplier + centres)
    )
    return int(weights + held + 2 * boundary_bytes)


def estimate(
    costs: list[StageCost],
    layout: Layout,
    links: LinkModel,
    *,
    optimizer: str,
    optimizer_multiplier: int,
    microbatch_size: int,
) -> Estimate:
    """Cost ``costs`` (one per stage) run as ``layout`` says (see the module doc)."""
    hw = links.hw
    m = layout.microbatches
    p = len(costs)
    engine_costs = CostModel.for_device(costs, hw.device, optimizer)
    boundaries = [links.boundary(layout.devices[k], layout.devices[k + 1]) for k in range(p - 1)]
    transfer = [
        b.transfer[0] + b.transfer[1] * costs[k].activation_bytes if costs[k].activation_bytes else 0.0
        for k, b in enumerate(boundaries)
    ]  # mean uncontended one-way time per boundary
    busy: dict[int, float] = defaultdict(float)
    load: dict[str, float] = defaultdict(float)
    memory: dict[int, int] = defaultdict(int)
    step_s = []  # per stage: one step (all-reduce + update)
    spec = hw.collectives
    for k, (c, devs) in enumerate(zip(costs, layout.devices, strict=True)):
        ring = links.ring(devs)
        reduce_s = ring.seconds(c.gradient_bytes) if len(devs) > 1 else 0.0
        update_s = engine_costs.compute(Action(UPDATE, k))
        exposed = sum(
            exposed_receive(k, kind, layout.waits[k][kind], boundaries, transfer, engine_costs)
            for kind in (FORWARD, BACKWARD)
        )
        if layout.hidden_reduce and layout.hidden_reduce[k] and layout.updates[k]:
            # 2BW: the all-reduce runs behind the passes of the next window;
            # the device waits only for what outlasts them
            window = layout.passes[k] / layout.updates[k] * (c.time_s + exposed)
            step = update_s + max(0.0, reduce_s - window)
        elif reduce_s and spec is not None and spec.bucket_bytes:
            # DDP's buckets: the update waits for what outlasts the last backward
            buckets = gradient_buckets(c, spec.first_bucket_bytes, spec.bucket_bytes)
            step = update_s + bucketed_exposure(buckets, c.backward_s, ring.seconds)
        else:  # the update waits for the all-reduce, and the device with it
            step = update_s + reduce_s
        step_s.append(step)
        for d in devs:
            busy[d] += layout.passes[k] * (c.time_s + exposed) + layout.updates[k] * step
        if len(devs) > 1 and c.gradient_bytes:
            for name, (a, b) in ring.links.items():
                load[name] += layout.updates[k] * (a + b * c.gradient_bytes)
        boundary = (costs[k - 1].activation_bytes if k else 0) + (c.activation_bytes if k + 1 < p else 0)
        centres = layout.centres[k] if layout.centres else 0
        mem = stage_memory(
            c, layout.inflight[k], layout.versions[k], layout.buffers[k], optimizer_multiplier, boundary, centres
        )
        for d in devs:
            memory[d] += mem
    # A stage that steps more than once an iteration on several replicas runs
    # in lock-step: each step's all-reduce waits for the last of its
    # micro-batches, which the other stages hand over one at a time.
    service = [
        (layout.passes[k] * c.time_s + layout.updates[k] * step_s[k]) / m for k, c in enumerate(costs)
    ]  # busy time per micro-batch of the pipeline
    for k, devs in enumerate(layout.devices):
        if len(devs) > 1 and layout.updates[k] > 1 and p > 1:
            group = len(devs) * layout.passes[k] / layout.updates[k]
            spread = (group - 1) * max(service[j] for j in range(p) if j != k)
            idle = max(0.0, spread - costs[k].forward_s)  # the next forward fills the start of the wait
            for d in devs:
                busy[d] += layout.updates[k] * idle
    for k, bnd in enumerate(boundaries):
        nbytes = costs[k].activation_bytes
        if nbytes:
            for name, (a, b) in bnd.links.items():
                load[name] += m * (a + b * nbytes)
    resources = [(busy[d] / m, f"device {d}") for d in sorted(busy)]
    resources += [(v / m, name) for name, v in sorted(load.items())]
    period, bottleneck = max(resources, key=lambda x: x[0])
    path = math.fsum(c.time_s for c in costs) + 2 * math.fsum(transfer)
    # a replica runs no more flushes than it has passes (the flushes of a
    # data-parallel GPipe outnumber each replica's micro-batches)
    f = max(1, min(layout.flushes, math.ceil(max(layout.passes)))) if layout.flushes > 1 else 1
    # every forward of a flush before any of its backwards (GPipe): the flush's phases
    # bound the iteration below
    phased = not layout.streamed and all(
        held >= -(-passes // f) for held, passes in zip(layout.inflight, layout.passes)
    )
    # Little's law at every stage: its round trip (its passes and every later
    # stage's, the transfers there and back) over the micro-batches in flight
    # there; not between the flushes of a GPipe update, where every micro-batch
    # of a flush is in flight and the flush's phases bound the time
    for k in range(0 if phased and f > 1 else p):
        in_flight = layout.inflight[k] * len(layout.devices[k])
        round_trip = math.fsum(c.time_s for c in costs[k:]) + 2 * math.fsum(transfer[k:])
        if in_flight and round_trip / in_flight > period:
            period, bottleneck = round_trip / in_flight, f"round trip of stage {k}"
    slowest = _stage_of(bottleneck, layout)
    # one micro-batch's path overlaps the bottleneck's own part of it
    own = costs[slowest].time_s if slowest is not None else period
    if layout.streamed:
        iteration = m * period
        makespan = layout.iterations * m * period + path - own
    else:
        tail = step_s[0] if slowest != 0 else 0.0
        iteration = m * period + f * (path - own) + tail
        if phased:
            sizes = [flush_sizes(math.ceil(n), f) for n in layout.passes]  # per stage, its passes in each flush
            phases = step_s[0] + math.fsum(
                flush_phases(costs, transfer, [per_stage[j] for per_stage in sizes]) for j in range(f)
            )
            if phases > iteration:
                iteration, bottleneck = phases, "forward and backward phases"
        makespan = layout.iterations * iteration
    dev_memory = tuple(memory[d] for d in range(layout.num_devices))
    return Estimate(
        period_s=period,
        bottleneck=bottleneck,
        iteration_s=iteration,
        makespan_s=makespan,
        samples_per_s=m * microbatch_size / iteration if iteration > 0 else math.inf,
        memory_bytes=dev_memory,
        memory_limit_bytes=hw.device.memory_bytes,
        flushes=layout.flushes,
    )


def flush_phases(costs: list[StageCost], transfer: list[float], passes: list[int]) -> float:
    """One flush that runs every forward before any backward (GPipe), each
    replica of stage k running ``passes[k]`` of them: a forward phase and a
    backward phase, each one micro-batch's path through the pipeline (its
    passes and transfers) plus the rest of the slowest stage's passes."""
    return 2 * math.fsum(transfer) + sum(
        math.fsum(t(c) for c in costs) + max(max(n - 1, 0) * t(c) for n, c in zip(passes, costs))
        for t in (lambda c: c.forward_s, lambda c: c.backward_s)
    )


def exposed_receive(
    k: int, kind: int, wait: Wait, boundaries: list[Boundary], transfer: list[float], engine_costs: CostModel
) -> float:
    """Seconds a pass of stage k waits for its receive in steady state (see
    :class:`~.layout.Wait`): the transfer, behind the prior pass's send when
    the two share a link, less what the window hides."""
    b = k - 1 if kind == FORWARD else k  # the boundary the receive crosses
    if not 0 <= b < len(boundaries) or not transfer[b]:
        return 0.0
    links_in = boundaries[b].forward if kind == FORWARD else boundaries[b].backward
    stages = len(boundaries) + 1
    window = math.fsum(engine_costs.compute(Action(op, k + off)) for op, off in wait.window if 0 <= k + off < stages)
    queued = 0.0
    if wait.prior is not None:
        op, off = wait.prior
        s = k + off
        out = s if op is F else s - 1  # the boundary the prior pass's output crosses
        if 0 <= s < stages and 0 <= out < len(boundaries) and (op is F or op in INPUT_GRADIENT_OPS):
            links_out = boundaries[out].forward if op is F else boundaries[out].backward
            if links_out & links_in:
                queued = transfer[out]
    return max(0.0, queued + transfer[b] - window)


def _stage_of(bottleneck: str, layout: Layout) -> int | None:
    """The (first) stage on the bottleneck device, None for a link."""
    if not bottleneck.startswith("device "):
        return None
    dev = int(bottleneck.split()[1])
    return next(k for k, devs in enumerate(layout.devices) if dev in devs)

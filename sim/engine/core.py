"""The SimPy engine: run a lowered schedule on a model of devices and links.

One SimPy process per device walks its program. Compute actions hold the
device's compute stream for their modelled duration; sends, receives and
collectives run beside it, so communication overlaps computation as it does on
a GPU with separate streams. Links are SimPy resources: transfers whose routes
share a link (one PCIe host bridge, a node's NIC) queue for it in request
order, which is SimPy's deterministic FIFO tie-break.

The engine only produces timed :class:`~pipesim.sim.engine.results.Span` s. Memory,
weight versions and staleness are derived from the spans and the schedule by
:mod:`pipesim.sim.engine.trackers`, so a measured timeline from real devices goes
through exactly the same accounting.

Speed matters (the target is 131k compute actions in well under two seconds),
so the hot loop is lean: dependencies are precomputed tokens
(:mod:`pipesim.sim.ir.dataflow`), satisfied tokens are skipped without yielding,
and transfers over free links complete without a process of their own.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from heapq import heappop, heappush
from itertools import chain, count
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

import simpy
from simpy.events import NORMAL

from pipesim.sim._gc import gc_paused, retain
from pipesim.sim.engine.results import SimResult, Span
from pipesim.sim.errors import InputError
from pipesim.sim.ir.checks import describe_wait_cycle, providers, validate
from pipesim.sim.ir.core import (
    ALLREDUCE,
    AVERAGE,
    COMPUTE_OPS,
    PREDICT,
    REDUCE_GRAD,
    RESHARD,
    SEND_OPS,
    UNSHARD,
    UPDATE,
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    boundary_stage,
)
from pipesim.sim.ir.dataflow import Arrival, Entry, compile_lowered, compile_plan
from pipesim.sim.ir.lowering import plan
from pipesim.sim.workloads.profile import OPTIMIZER_STATE_MULTIPLIER, WorkloadError, check_microbatch_size
from pipesim.sim.workloads.stages import StageCost

if TYPE_CHECKING:
    from pipesim.sim.hardware.machines import Hardware


@dataclass(frozen=True)
class CostModel:
    """How long each action takes, from stage costs and the device model.

    Optimizer steps, weight prediction and elastic averaging are memory-bound
    element-wise kernels (see :mod:`pipesim.kernels`), so they cost the bytes
    they must read and write divided by the device's memory bandwidth. The
    counts are those of a fused kernel and agree with
    ``pipesim.kernels.bytes_moved`` (a test holds them together; sim may not
    import kernels):

    * SGD with momentum update: read W, g, v; write W, v: 5 |W|.
      Adam: read W, g, m, v; write W, m, v: 7 |W|.
    * prediction: read W and the momentum (Adam: both moments); write the
      predicted copy: 3 |W| (Adam 4 |W|).
    * elastic averaging of n local replicas: read and write each replica and
      the centre: (2n + 2) |W|.

    |W| is ``param_bytes``: the weights at the optimizer's width (the fp32
    master in mixed precision, :class:`~pipesim.sim.workloads.profile.Precision`).
    With 16-bit weights and gradients beside it an update also reads the
    16-bit gradient and writes the 16-bit copy the passes read, the same
    bytes in all (SGD: 4 + 2 + 4 read, 4 + 4 + 2 written per parameter,
    20 = 5 x 4; Adam 28 = 7 x 4). Every precision pays these multiples of
    |W| (a 16-bit prediction, written at the passes' width, moves a little less).
    Collectives: REDUCE_GRAD all-reduces the gradients (``gradient_bytes``);
    AVERAGE all-reduces the master weights (``param_bytes``), which each
    replica's optimizer updates and elastic averaging must agree on
    (averaging the passes' 16-bit copies would round away what the master
    keeps), and its kernel and centre are at that width too; recasting the
    passes' copy from the averaged master is not charged.
    """

    stage_costs: tuple
    mem_bandwidth: float
    optimizer: str = "sgd"
    #: UPDATE / PREDICT / averaging bandwidths where measured apart (None: ``mem_bandwidth``)
    update_bandwidth: float | None = None
    predict_bandwidth: float | None = None
    average_bandwidth: float | None = None

    @classmethod
    def for_device(cls, stage_costs, device, optimizer: str = "sgd") -> CostModel:
        """The cost model of ``device`` (a :class:`~pipesim.sim.hardware.machines.DeviceSpec`),
        with its per-kernel bandwidths."""
        return cls(
            tuple(stage_costs),
            device.mem_bandwidth,
            optimizer,
            device.update_bandwidth,
            device.predict_bandwidth,
            device.average_bandwidth,
        )

    def compute(self, a: Action) -> float:
        c = self.stage_costs[a.stage]
        pass_time = _PASS_TIME.get(a.op)
        if pass_time is not None:
            return pass_time(c)
        bandwidth = self.update_bandwidth if a.op is UPDATE else self.predict_bandwidth
        return self.membound(self.traffic(a.op) * c.param_bytes, bandwidth)

    def traffic(self, op) -> int:
        """Weight-sized passes over memory of an UPDATE or PREDICT."""
        sgd = self.optimizer == "sgd"
        return {UPDATE: 5 if sgd else 7, PREDICT: 3 if sgd else 4}[op]

    def averaging(self, stage: int, local_replicas: int) -> float:
        return self.membound((2 * local_replicas + 2) * self.stage_costs[stage].param_bytes, self.average_bandwidth)

    def membound(self, nbytes: float, bandwidth: float | None = None) -> float:
        """Seconds a memory-bound kernel moving ``nbytes`` takes at ``bandwidth`` (default: the device's)."""
        bandwidth = self.mem_bandwidth if bandwidth is None else bandwidth
        if not nbytes or math.isinf(bandwidth):
            return 0.0
        return nbytes / bandwidth

    def transfer_bytes(self, a: Action) -> int:
        """Bytes a SEND/RECV carries: the activation crossing the stage
        boundary, or its gradient (the same size)."""
        return self.stage_costs[boundary_stage(a)].activation_bytes


#: How long each pass takes, read off its stage's costs.
_PASS_TIME = {
    F: attrgetter("forward_s"),
    B: attrgetter("backward_s"),
    I: attrgetter("backward_input_s"),
    W: attrgetter("backward_weight_s"),
}


def simulate(
    schedule: Schedule,
    stage_costs,
    hardware: Hardware,
    *,
    microbatch_size: int = 1,
    optimizer: str = "sgd",
    recv_lookahead: int = 1,
    check: bool = True,
    meta: dict | None = None,
    on_spans: Callable[[SimResult], None] | None = None,
) -> SimResult:
    """Execute ``schedule`` in simulated time and return its spans and trackers.

    ``stage_costs[k]`` is the :class:`~pipesim.sim.workloads.stages.StageCost` of
    model stage k (the same for every replica). A compute-only schedule runs
    as :func:`pipesim.sim.ir.lowering.plan` lowers it (sends after producers,
    receives ``recv_lookahead`` compute actions ahead); one that carries its
    own communication runs as it is. The result keeps the schedule as given;
    its spans record every transfer. The structure is validated first unless
    ``check`` is false; a schedule that deadlocks raises
    :class:`~pipesim.sim.ir.core.ScheduleError` naming the wait cycle once the
    event queue runs dry (SimPy stops by itself, so it never hangs).
    Arguments of the wrong type or out of range raise an
    :class:`~pipesim.sim.errors.InputError` here, before any work.

    ``on_spans``, if given, is called with the result as soon as its spans
    are final, before its memory, versions and version counts are tracked
    (they are filled in the same object afterwards): a consumer of the spans
    alone, like ``pipesim simulate``'s trace writer, can start meanwhile.
    """
    _check_arguments(schedule, stage_costs, hardware, check)
    check_on_spans(on_spans)
    check_run_options(microbatch_size=microbatch_size, optimizer=optimizer, recv_lookahead=recv_lookahead)
    with gc_paused():
        return _simulate(
            schedule,
            stage_costs,
            hardware,
            microbatch_size=microbatch_size,
            optimizer=optimizer,
            recv_lookahead=recv_lookahead,
            check=check,
            meta=meta,
            on_spans=on_spans,
        )


def check_run_options(*, microbatch_size: int = 1, optimizer: str = "sgd", recv_lookahead: int = 1) -> None:
    """Check the scalar options every simulation entry point passes down, so a
    bad value is named up front, not met as a TypeError deep in the lowering."""
    check_microbatch_size(microbatch_size)
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZER_STATE_MULTIPLIER:
        raise WorkloadError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_MULTIPLIER)}, got {optimizer!r}")
    if isinstance(recv_lookahead, bool) or not isinstance(recv_lookahead, int) or recv_lookahead < 0:
        raise ScheduleError(f"recv_lookahead must be an integer >= 0 (compute actions), got {recv_lookahead!r}")


def check_on_spans(on_spans) -> None:
    """``on_spans`` must be a callable or None: a wrong one is named before
    the run, not met as a TypeError once it is over."""
    if on_spans is not None and not callable(on_spans):
        raise InputError(f"on_spans must be a callable taking the result, or None; got {type(on_spans).__name__}")


def _check_arguments(schedule, stage_costs, hardware, check) -> None:
    from pipesim.sim.hardware.machines import Hardware, HardwareError

    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"schedule must be a pipesim.sim.ir.core.Schedule, got {type(schedule).__name__}")
    if not isinstance(hardware, Hardware):
        raise HardwareError(f"hardware must be a pipesim.sim.hardware.machines.Hardware, got {type(hardware).__name__}")
    if (
        isinstance(stage_costs, (str, bytes))
        or not isinstance(stage_costs, Sequence)
        or not all(isinstance(c, StageCost) for c in stage_costs)
    ):
        raise WorkloadError("stage_costs must be a sequence of pipesim.sim.workloads.stages.StageCost, one per stage")
    if not isinstance(check, bool):
        raise ScheduleError(f"check (validate the schedule first) must be True or False, got {check!r}")


def _simulate(schedule, stage_costs, hardware, *, microbatch_size, optimizer, recv_lookahead, check, meta, on_spans):
    from pipesim.sim.engine.trackers import track  # after the engine: derived accounting

    if len(stage_costs) != schedule.num_stages:
        raise ScheduleError(
            f"the schedule has {schedule.num_stages} stages but {len(stage_costs)} stage costs were given"
        )
    hardware.check_devices(schedule.num_devices)
    if check:
        # Structure only: the dry run would cost as much as the simulation,
        # which stops by itself on a deadlock and names the same wait cycle.
        validate(schedule, deadlock=False)
    run = prepared_run(schedule, stage_costs, hardware, optimizer=optimizer, recv_lookahead=recv_lookahead)
    run.execute()
    result = SimResult(
        schedule=schedule,
        spans=run.spans,
        memory=[],
        versions=[],
        max_versions_held={},
        link_bytes=dict(sorted(run.link_bytes.items())),
        microbatch_size=microbatch_size,
        meta=dict(meta or {}),
        stage_costs=tuple(stage_costs),
    )
    if on_spans is not None:
        on_spans(result)
    track(result, stage_costs, hardware, optimizer=optimizer)
    retain(run)  # a one-shot process leaves the run's temporaries unfreed (pipesim.sim._gc)
    return result


def prepared_run(
    schedule: Schedule, stage_costs, hardware: Hardware, *, optimizer: str = "sgd", recv_lookahead: int = 1
) -> _Run:
    """A run of ``schedule`` compiled and costed, ready for ``execute()``,
    which fills its ``spans`` and ``link_bytes`` (split from
    :func:`simulate` so the SimPy run can be timed alone: ``pipesim bench
    sim``). Nothing is checked here."""
    costs = CostModel.for_device(stage_costs, hardware.device, optimizer)
    return (_Run if hardware.cpu is None else _CpuRun)(schedule, compiled(schedule, recv_lookahead), costs, hardware)


def compiled(schedule: Schedule, recv_lookahead: int) -> list[list[Entry]]:
    """The entries the engine runs: :func:`~pipesim.sim.ir.dataflow.compile_plan`
    of the lowered plan, built in one pass where the schedule is compute-only
    (:func:`~pipesim.sim.ir.dataflow.compile_lowered`, the common case)."""
    programs = compile_lowered(schedule, recv_lookahead)
    if programs is None:
        programs = compile_plan(schedule, plan(schedule, recv_lookahead=recv_lookahead))
    return programs


class _Run:
    """State of one simulation: the environment, token events and spans."""

    def __init__(self, schedule: Schedule, programs: list[list[Entry]], costs: CostModel, hardware: Hardware) -> None:
        self.schedule = schedule
        self.costs = costs
        self.hw = hardware
        self.env = simpy.Environment()
        self.programs = programs
        # Only tokens somebody waits for need an event; a pass whose output
        # leaves the device is awaited through its transfer instead.
        self.awaited = set(
            chain.from_iterable(map(itemgetter(2), chain.from_iterable(self.programs)))
        )  # chained in C, not a comprehension
        #: seconds of each compute op on each stage, costed once per run
        self.pass_seconds = {
            op: [costs.compute(Action(op, k)) for k in range(schedule.num_stages)] for op in COMPUTE_OPS
        }
        # (src, dst, SEND_F|SEND_B, sending stage) -> (bytes, route, uncontended seconds)
        self.transfer_cost: dict[tuple, tuple] = {}
        self.events: dict[object, simpy.Event] = {}  # tokens a device is waiting for
        self.done: set = set()  # tokens available
        self.spans: list[Span] = []
        self.link_bytes: dict[str, int] = defaultdict(int)
        self.links: dict[str, simpy.Resource] = {}
        self.transfers: dict[tuple, tuple] = {}  # token -> (device, action) of the end posted first
        self.collectives: dict[tuple, list] = defaultdict(list)
        self.finished = [False] * schedule.num_devices
        self.blocked: dict[int, tuple] = {}
        self.flows = count()  # flow ids pairing each send with its receive
        #: (stage, ring devices) -> whether its ring has its links to itself (ring_alone)
        self.alone_rings: dict[tuple, bool] = {}
        #: the links point-to-point transfers and each stage's ring use (traffic_links), once asked
        self.traffic: tuple | None = None
        #: how a compute action runs when the device is a CPU core (_CpuRun)
        self.on_core = None
        spec = hardware.collectives
        #: the pass that ends each device's gradients for a REDUCE_GRAD, by
        #: its token -> the REDUCE_GRAD's (token, action): its buckets start
        #: during that pass (DDP's overlap); empty without a collectives model
        self.gradsync: dict = self.gradient_passes() if spec is not None and spec.bucket_bytes else {}
        #: REDUCE_GRAD tokens that run in buckets, not when posted
        self.bucketed: set = {tok for tok, _ in self.gradsync.values()}
        #: per stage, its gradients' buckets (gradient_buckets), once cut
        self.buckets: dict[int, list] = {}
        #: per REDUCE_GRAD token, (device, REDUCE_GRAD action, pass start, pass
        #: seconds) of each replica's last gradient pass
        self.grad_started: dict = defaultdict(list)
        #: per stage, the end of its latest bucketed all-reduce: the next one's
        #: buckets queue behind it on the stage's communication stream
        self.reduced: dict[int, simpy.Event] = {}
        #: per device, compute seconds owed to the collectives its passes overlapped
        self.debt = [0.0] * schedule.num_devices
        #: per device, (start, end) of the pass it runs now
        self.running: list = [_IDLE] * schedule.num_devices

    # -- tokens -----------------------------------------------------------
    def fire(self, token) -> None:
        """Make ``token`` available: wake its waiter, or note it for later.

        Most data arrives before its consumer looks for it (receives are
        posted ahead), so only a waiter that finds the token missing arms an
        event (its walk's :class:`_Signal`); the rest cost a set insertion,
        not a trip through SimPy's queue."""
        ev = self.events.pop(token, None)
        self.done.add(token)
        if ev is not None:
            ev.fire()

    # -- main -------------------------------------------------------------
    def execute(self) -> None:
        for dev in range(self.schedule.num_devices):
            _Walker(self.env, self.walk(dev))
        _run_events(self.env)
        if not all(self.finished):
            stuck = [d for d, ok in enumerate(self.finished) if not ok]
            where = providers(self.programs)
            raise ScheduleError(
                "simulation deadlocked: " + describe_wait_cycle(stuck, self.blocked, where, self.schedule)
            )

    def walk(self, dev: int):
        env = self.env
        spans = self.spans
        events = self.events
        awaited, done, fire = self.awaited, self.done, self.fire
        transfers, start_transfer, post = self.transfers, self.start_transfer, _POST
        on_core = self.on_core
        seconds = self.pass_seconds
        clock, wake = _Signal(env), _Signal(env)
        queue, eid = env._queue, env._eid
        gradsync, debt, running = self.gradsync, self.debt, self.running
        for posts, a, waits, token in self.programs[dev]:
            for x, tok in posts:
                if type(tok) is Arrival:  # the common case, inlined: runs per send and receive
                    first = transfers.pop(tok, None)
                    if first is None:  # the other end starts it
                        transfers[tok] = (dev, x)
                    else:
                        start_transfer(dev, x, tok, first)
                else:
                    post[x.op](self, dev, x, tok)
            if a is None:
                continue
            for need in waits:
                if need not in done:
                    ev = events.get(need)  # a collective may have several waiters
                    if ev is None:
                        ev = events[need] = wake.arm()
                    self.blocked[dev] = (a, need)
                    yield ev
            dur = seconds[a.op][a.stage]  # a table, not a tuple-keyed cache: no key to build per action
            start = end = env._now  # the clock's attribute, not its property: read per action
            if debt[dev]:  # collectives this device's compute overlapped slowed it: it pays here
                dur += debt[dev]
                debt[dev] = 0.0
            if gradsync and token in gradsync:
                self.start_buckets(dev, gradsync[token], start, dur)
            running[dev] = (start, start + dur)
            if on_core is not None:  # a CPU core, perhaps shared, that transfers interrupt
                start = yield from on_core(dev, dur)
                end = env.now
            elif dur:
                # the timer armed and scheduled as env.timeout(dur) would be
                # (normal priority, the next event id), inlined: runs per action
                end = start + dur
                clock.callbacks = []
                heappush(queue, (end, NORMAL, next(eid), clock))
                yield clock
                # SimPy's clock is now exactly end, the float sum it was
                # scheduled by: no second read of it
            spans.append(Span(dev, "compute", a, start, end))
            running[dev] = _IDLE
            if token in awaited:
                fire(token)
        self.blocked.pop(dev, None)
        self.finished[dev] = True

    # -- point-to-point ---------------------------------------------------
    def start_transfer(self, dev: int, a: Action, token, first: tuple) -> None:
        """``a`` on ``dev`` is the second end of a transfer posted: start it.

        ``first`` is the (device, action) of the end posted earlier. Runs
        for every transfer, so it keeps to plain tuples."""
        if a.op in SEND_OPS:
            (dst, recv), src, send = first, dev, a
        else:
            (src, send), dst, recv = first, dev, a
        key = (src, dst, token.send, send.stage)
        cost = self.transfer_cost.get(key)
        if cost is None:
            nbytes = self.costs.transfer_bytes(send)
            route = self.hw.route(src, dst)
            cost = self.transfer_cost[key] = (nbytes, route, self.hw.transfer_time(src, dst, nbytes))
        nbytes, route, duration = cost
        if nbytes:
            for link in route:
                self.link_bytes[link.name] += nbytes
        flow = next(self.flows)
        if duration == 0.0:
            now = self.env.now
            self.spans += (
                Span(src, "send", send, now, now, dst, flow, nbytes),
                Span(dst, "recv", recv, now, now, src, flow, nbytes),
            )
            ev = self.events.pop(token, None)  # fire(token), inlined: this runs per transfer
            self.done.add(token)
            if ev is not None:
                ev.fire()
        else:
            self.env.process(self.move((src, send, dst, recv, nbytes, flow), route, duration, token))

    def move(self, ends: tuple, route, duration: float, token):
        start = yield from self.occupy(route, duration, self.receiver_copy(ends))
        self.record_transfer(ends, start, self.env.now)
        self.fire(token)

    def receiver_copy(self, ends: tuple) -> tuple | None:
        """Work the receiving device does at the end of a transfer, as
        :meth:`occupy`'s ``before_end``: none on an accelerator."""
        return None

    def occupy(self, route, duration: float, before_end: tuple | None = None):
        """Hold every link of ``route`` for ``duration``; return the start time.

        Links are requested in name order, so two transfers never each hold a
        link the other waits for. ``before_end`` = (seconds, callback) calls
        the callback that long before the end (at the start if the transfer
        is shorter)."""
        requests = []
        for link in sorted(route, key=lambda lk: lk.name):
            res = self.links.get(link.name)
            if res is None:
                res = self.links[link.name] = simpy.Resource(self.env, capacity=1)
            req = res.request()
            requests.append((res, req))
            yield req
        start = self.env.now
        if before_end is None:
            yield self.env.timeout(duration)
        else:
            lead, callback = before_end
            first = max(duration - lead, 0.0)
            if first:
                yield self.env.timeout(first)
            callback()
            if duration - first:
                yield self.env.timeout(duration - first)
        for res, req in requests:
            res.release(req)
        return start

    def record_transfer(self, ends: tuple, start: float, end: float) -> None:
        src, send, dst, recv, nbytes, flow = ends
        self.spans.append(Span(src, "send", send, start, end, dst, flow, nbytes))
        self.spans.append(Span(dst, "recv", recv, start, end, src, flow, nbytes))

    # -- collectives ------------------------------------------------------
    def post_collective(self, dev: int, a: Action, token) -> None:
        """Post a collective; it runs once every replica has posted it (a
        bucketed REDUCE_GRAD has already started: :meth:`start_buckets`)."""
        if token in self.bucketed:
            return
        posted = self.collectives[token]
        posted.append((dev, a))
        if len(posted) == self.schedule.replicas[token.stage]:
            del self.collectives[token]
            self.env.process(self.collective(posted, token))

    def gradient_passes(self) -> dict:
        """Per device program, the pass after which each REDUCE_GRAD is
        posted that last produced its replica's weight gradients there (a
        B, or the W of a split backward), by the pass's token: DDP's buckets
        become ready while that pass runs. Passes and REDUCE_GRADs pair by
        (replica, stage), so replicas sharing a device each find their own.
        A REDUCE_GRAD with no such pass before it runs unbucketed, after its
        post."""
        found = {}
        for program in self.programs:
            last: dict[tuple[int, int], object] = {}
            for posts, a, _, token in program:
                for x, tok in posts:
                    if x.op is REDUCE_GRAD and (x.replica, x.stage) in last:
                        found[last.pop((x.replica, x.stage))] = (tok, x)
                if a is not None and a.op in _GRADIENT_OPS and token is not None:
                    last[(a.replica, a.stage)] = token
        # bucketed only where every replica's REDUCE_GRAD follows such a pass
        posts_of: dict = defaultdict(int)
        for tok, _ in found.values():
            posts_of[tok] += 1
        keep = {tok for tok, n in posts_of.items() if n == self.schedule.replicas[tok.stage]}
        return {k: v for k, v in found.items() if v[0] in keep}

    def start_buckets(self, dev: int, reduction: tuple, start: float, dur: float) -> None:
        """The pass ending ``dev``'s gradients for ``reduction`` (REDUCE_GRAD's
        token and action) starts: once every replica's has, run its buckets."""
        token, a = reduction
        started = self.grad_started[token]
        started.append((dev, a, start, dur))
        if len(started) == self.schedule.replicas[a.stage]:
            del self.grad_started[token]
            self.env.process(self.bucketed_reduce(started, token))

    def bucketed_reduce(self, started: list, token):
        """A stage's gradient all-reduce in DDP's buckets: bucket k is ready
        when every replica's last backward has produced its layers'
        gradients (its pass start plus the pass's share up to them); the
        buckets all-reduce one after another on the communication stream,
        each as soon as it is ready and the one before is done. The stage's
        previous all-reduce comes first on that stream: a backward that ends
        the next gradients (2BW's next window) can start before it is over."""
        a = started[0][1]
        cost = self.costs.stage_costs[a.stage]
        spec = self.hw.collectives
        first: dict[int, Action] = {}
        for d, act, _, _ in started:
            first.setdefault(d, act)
        devices = sorted(first)
        before = self.reduced.get(a.stage)
        done = self.reduced[a.stage] = self.env.event()
        begin = None
        buckets = self.buckets.get(a.stage)
        if buckets is None:  # the same every update: cut once per stage
            buckets = self.buckets[a.stage] = gradient_buckets(cost, spec.first_bucket_bytes, spec.bucket_bytes)
        for share, nbytes in buckets:
            ready = max(s + share * dur for _, _, s, dur in started)
            if ready > self.env.now:
                yield self.env.timeout(ready - self.env.now)
            if before is not None:
                if not before.triggered:
                    yield before
                before = None
            if begin is None:
                begin = self.env.now
            if len(devices) > 1:
                yield from self.ring_allreduce(devices, nbytes, stage=a.stage)
        end = self.env.now
        nbytes = cost.gradient_bytes if len(devices) > 1 else 0
        for dev in devices:
            self.spans.append(Span(dev, "collective", first[dev], begin, end, nbytes=nbytes))
        done.succeed()
        self.fire(token)

    def post_shard(self, dev: int, a: Action, token) -> None:
        """UNSHARD gathers the stage's parameters and RESHARD frees them. No
        parameter is sharded in pipesim's model, so both are instant; they
        are recorded on the collective stream so traces show them."""
        now = self.env.now
        self.spans.append(Span(dev, "collective", a, now, now))
        if token is not None:
            self.fire(token)

    def collective(self, posted: list, token):
        """Ring all-reduce of the stage's gradients (REDUCE_GRAD) or of its
        weights followed by the local averaging kernel (AVERAGE), over the
        distinct devices holding the replicas."""
        op = posted[0][1].op
        stage = posted[0][1].stage
        first: dict[int, Action] = {}  # each device's first replica's action
        local: dict[int, int] = defaultdict(int)  # replicas per device
        for d, act in posted:
            first.setdefault(d, act)
            local[d] += 1
        devices = sorted(first)
        cost = self.costs.stage_costs[stage]
        # ALLREDUCE: the stage's activation all-reduces of one pass, one after the other
        buffers = (
            cost.allreduce_bytes
            if op is ALLREDUCE
            else (cost.gradient_bytes if op is REDUCE_GRAD else cost.param_bytes,)
        )
        nbytes = sum(buffers)
        start = self.env.now
        if len(devices) > 1:
            for size in buffers:
                yield from self.ring_allreduce(devices, size, op is not AVERAGE, stage=stage)
        if op is AVERAGE:
            dur = self.costs.averaging(stage, max(local.values()))
            if dur:
                yield self.env.timeout(dur)
        end = self.env.now
        for dev in devices:
            self.spans.append(Span(dev, "collective", first[dev], start, end, nbytes=nbytes if len(devices) > 1 else 0))
        self.fire(token)

    def ring_allreduce(self, devices: list[int], nbytes: int, reduce: bool = True, *, stage: int | None = None):
        """2(n-1) steps; in each, every device sends 1/n of the buffer to its
        ring neighbour, and the step lasts until the slowest transfer is done.
        The ring follows :meth:`Hardware.ring_order`, as the closed form does.
        (``reduce``: whether the buffers are summed, not only exchanged;
        accelerators reduce inside the ring's steps at no extra time.
        ``stage``: whose collective it is, for :meth:`ring_steps`.)"""
        devices = list(self.hw.ring_order(devices))
        chunk = math.ceil(nbytes / len(devices))
        steps = 2 * (len(devices) - 1)
        if self.hw.collectives is not None:
            yield from self.nccl_steps(
                devices, chunk, steps, self.hw.allreduce_estimate(devices, nbytes).seconds, stage
            )
        else:
            yield from self.ring_steps(devices, chunk, steps, stage=stage)

    def nccl_steps(self, devices: list[int], chunk: int, steps: int, seconds: float, stage: int | None):
        """An all-reduce NCCL's model prices at ``seconds``, run as ``steps``
        equal steps, each holding every link of the ring's edges (``devices``
        in ring order) at once: NCCL's channels drive all of them together,
        and the model's bandwidth already counts what they share, so the
        collective's own edges do not queue on each other; other traffic on
        those links (a pipeline's transfers, another stage's collective)
        waits for a step to end and makes the collective wait in turn. A
        collective whose links nothing else uses (:meth:`ring_alone`) runs
        as one event."""
        links: dict[str, object] = {}
        for src, dst in _ring_pairs(devices):
            for link in self.hw.route(src, dst):
                self.link_bytes[link.name] += chunk * steps
                links.setdefault(link.name, link)
        if not links or not seconds:
            return
        route = tuple(links.values())
        start = self.env.now
        step = seconds / steps
        if steps > 1 and stage is not None and self.ring_alone(stage, devices, [(route, step)], shared_ok=True):
            yield self.skip_steps(steps - 1, step)
            steps = 1
        for _ in range(steps):
            yield from self.occupy(route, step)
        self.charge_overlap(devices, start, self.env.now)

    def charge_overlap(self, devices: list[int], start: float, end: float) -> None:
        """Compute that ran on ``devices`` while their collective did (from
        ``start`` to ``end``) ran slower: NCCL's kernels take SMs and memory
        bandwidth. Each device owes ``slowdown x overlap`` seconds, which
        its next pass pays (:meth:`walk`); the slowdown is the collective's
        link type's (:meth:`~pipesim.sim.hardware.collectives.CollectiveSpec.slowdown`)."""
        group = self.hw.collective_group(devices)
        factor = self.hw.collectives.slowdown("net" if group.nodes > 1 else group.intra_link)
        if not factor or end <= start:
            return
        members = set(devices)
        overlap = dict.fromkeys(devices, 0.0)
        # spans are appended as they end, so the passes that ended after
        # ``start`` are the last ones appended
        for span in reversed(self.spans):
            if span.end <= start:
                break
            if span.stream == "compute" and span.device in members:
                overlap[span.device] += min(span.end, end) - max(span.start, start)
        for dev in devices:
            s, e = self.running[dev]  # the pass running now, not appended yet
            if e > start:
                overlap[dev] += min(e, end) - max(s, start)
            if overlap[dev] > 0:
                self.debt[dev] += factor * overlap[dev]

    def ring_steps(self, devices: list[int], chunk: int, steps: int, *, stage: int | None = None):
        """``steps`` steps of a ring (``devices`` in ring order), each moving
        ``chunk`` bytes over every edge at once.

        Simulated step by step, a ring costs a process per edge per step:
        2n(n-1) for n devices, which made data parallelism over a thousand
        GPUs take half a minute. Where no other traffic of the run can ever
        touch the ring's links and no two of its edges share one
        (:meth:`ring_alone`, for ``stage``'s collective), every step lasts
        exactly its slowest edge, so all steps but the last are skipped in
        one event at the very time the step-by-step ring reaches (the same
        float sums); the last runs as usual, so the events that end the
        collective are the ones the step-by-step ring makes."""
        # every step moves a chunk over the same ring edges: look them up once
        edges = []
        for src, dst in _ring_pairs(devices):
            route = self.hw.route(src, dst)
            for link in route:
                self.link_bytes[link.name] += chunk * steps
            dur = self.hw.transfer_time(src, dst, chunk)
            if dur:
                edges.append((route, dur))
        if not edges:  # free links: the all-reduce takes no time
            return
        if steps > 1 and stage is not None and self.ring_alone(stage, devices, edges):
            # each step's all_of fires at its start plus its slowest edge
            yield self.skip_steps(steps - 1, max(dur for _, dur in edges))
            steps = 1
        for _ in range(steps):
            yield self.env.all_of([self.env.process(self.occupy(route, dur)) for route, dur in edges])

    def skip_steps(self, count: int, step: float) -> simpy.Event:
        """An event at the time ``count`` steps of ``step`` seconds reach
        from now, by the same float sums the steps would make one after
        another: the steps of a ring that has its links to itself, skipped."""
        at = self.env.now
        for _ in range(count):
            at += step
        skip = simpy.Event(self.env)
        skip._ok, skip._value = True, None
        heappush(self.env._queue, (at, NORMAL, next(self.env._eid), skip))
        return skip

    def ring_alone(self, stage: int, devices: list[int], edges: list, shared_ok: bool = False) -> bool:
        """Whether ``stage``'s ring over ``devices`` (its timed ``edges``,
        ``(route, seconds)``) has its links to itself, step after step: no
        two of its edges share a link, no point-to-point transfer of the run
        and no other stage's ring uses one of them, and the stage's
        collectives never overlap (on each of its devices, every collective
        of the stage is posted only after a compute action has waited for
        the one before). Then no request ever queues on its links."""
        key = (stage, tuple(devices))
        alone = self.alone_rings.get(key)
        if alone is None:
            names = [link.name for route, _ in edges for link in route]
            alone = (
                (shared_ok or len(set(names)) == len(names))
                and set(names).isdisjoint(self.links_besides(stage))
                and all(self.collectives_serial(stage, dev) for dev in devices)
            )
            self.alone_rings[key] = alone
        return alone

    def links_besides(self, stage: int) -> set[str]:
        """Names of the links that point-to-point transfers and the rings of
        the collectives of stages other than ``stage`` can use in this run."""
        if self.traffic is None:
            self.traffic = self.traffic_links()
        p2p, rings = self.traffic
        return p2p.union(*(links for k, links in rings.items() if k != stage))

    def traffic_links(self) -> tuple[set[str], dict[int, set[str]]]:
        """The links of every point-to-point transfer the programs post, and
        per stage with collectives the links of its ring (over the devices
        that post them), read once from the compiled programs."""
        senders: dict = {}  # transfer token -> the device that sends it
        receivers: dict = {}  # and the device that receives it
        groups: dict[int, set[int]] = defaultdict(set)
        for dev, program in enumerate(self.programs):
            for posts, _, _, _ in program:
                for x, tok in posts:
                    if type(tok) is Arrival:
                        (senders if x.op in SEND_OPS else receivers)[tok] = dev
                    elif x.op in _RING_OPS:
                        groups[x.stage].add(dev)
        pairs = {(src, receivers[tok]) for tok, src in senders.items() if tok in receivers}  # routes are directed
        p2p = {link.name for a, b in pairs for link in self.hw.route(a, b)}
        rings = {}
        for stage, devs in groups.items():
            rings[stage] = {
                link.name
                for src, dst in _ring_pairs(self.hw.ring_order(sorted(devs)))
                for link in self.hw.route(src, dst)
            }
        return p2p, rings

    def collectives_serial(self, stage: int, dev: int) -> bool:
        """Whether, on ``dev``, every collective of ``stage`` is posted only
        after some compute action has waited for the stage's collective
        before it."""
        pending = None
        for posts, _, waits, _ in self.programs[dev]:
            for x, tok in posts:
                if x.op in _RING_OPS and x.stage == stage:
                    if pending is not None:
                        return False
                    pending = tok
            if pending is not None and pending in waits:
                pending = None
        return True


def _ring_pairs(order: Sequence[int]) -> list[tuple[int, int]]:
    """The (sender, receiver) edges of a ring visiting ``order``."""
    return [(src, order[(i + 1) % len(order)]) for i, src in enumerate(order)]


def _run_events(env: simpy.Environment) -> None:
    """``env.run()``, with :meth:`simpy.Environment.step` inlined: the same
    heap pops, callbacks and crash on an undefused failed event, minus a
    method call per event (a large run processes a few hundred thousand).
    Nothing here stops a run early, so there is no ``until`` to honour."""
    queue = env._queue
    while queue:
        env._now, _, _, event = heappop(queue)
        callbacks, event.callbacks = event.callbacks, None
        for callback in callbacks:
            callback(event)
        if not event._ok and not hasattr(event, "_defused"):
            # as step() crashes the environment: a copy of the failure, caused by it
            exc = type(event._value)(*event._value.args)
            exc.__cause__ = event._value
            raise exc


class _Walker:
    """Drives one device's walk as :class:`simpy.Process` would, minus what
    a walk never needs: interrupts, failed events, a return value to wait
    for, the active-process bookkeeping. The walk resumes after every compute
    action and every wait, so this saves a third of SimPy's cost per step.

    It starts as a process does: an :class:`~simpy.events.Initialize` event,
    urgent at the current time, so the event order, and with it every result,
    is the one ``env.process`` gives. An exception in the walk propagates out
    of ``env.run`` as it is (a process would re-raise a copy).
    """

    __slots__ = ("send",)

    def __init__(self, env: simpy.Environment, walk) -> None:
        self.send = walk.send
        simpy.events.Initialize(env, self)  # calls self._resume first, as for a process

    def _resume(self, event: simpy.Event) -> None:
        send = self.send
        while True:
            try:
                event = send(event._value)
            except StopIteration:
                return
            if event.callbacks is not None:  # not processed yet: resume when it is
                event.callbacks.append(self._resume)
                return


class _Signal(simpy.Event):
    """A device's reusable event: its compute timer, or what it waits on.

    A walk waits for one thing at a time, so each device needs one timer
    and one wake-up event, each scheduled again whenever needed where
    ``env.timeout`` or ``env.event`` would build a new event (saving an
    allocation and a constructor per compute action and per wait).
    Scheduling is exactly a timeout's or a ``succeed``'s (normal priority,
    the next event id), so the event order is unchanged. Another walk that
    waits for the same token shares the event (its callbacks list).
    """

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.callbacks = None  # processed: not pending until armed
        self._ok = True  # as simpy.Timeout sets them: it always succeeds, with no value
        self._value = None

    def arm(self) -> _Signal:
        """Pending again, for a walk to yield."""
        self.callbacks = []
        return self

    def fire(self, delay: float = 0.0) -> None:
        """Trigger ``delay`` seconds from now (``succeed`` when 0)."""
        self.env.schedule(self, simpy.events.NORMAL, delay)


class _Core:
    """One CPU core, shared by the passes of the devices on it as Linux
    shares it between runnable threads of equal priority.

    A pass that starts while others run there preempts them at once and
    runs alone for up to ``wake_slice`` seconds (a thread woken by its data
    gets the core immediately and keeps it for a slice), then all running
    passes share the core equally, each progressing at 1/n of its speed
    (the scheduler alternates them every few milliseconds). Measured on this
    project's machine beside a spinning rank: work of up to 1–1.5 ms ran
    unstretched, 3 ms took 5.9–6.9 ms, 10 ms took 19.8–20.4 ms. Turn-taking,
    one pass to completion after another, is what neither does.

    Transfer work preempts every pass on the core: it blocks the core until
    ``blocked_until`` (from now, or after the block already there), which
    stretches each running pass by its length and, on an idle core, delays
    the next pass. ``jobs`` maps each running pass's completion event to the
    work it has left; ``alone`` is the pass running alone and how much of
    its slice is left; ``last`` is when all that was brought up to date.
    """

    __slots__ = ("alone", "blocked_until", "env", "generation", "jobs", "last", "wake_slice")

    #: Work left (seconds) below which a pass counts as finished: float
    #: sums of shares leave ~1e-17 s behind.
    DONE = 1e-12

    def __init__(self, env: simpy.Environment, wake_slice: float = 0.0) -> None:
        self.env = env
        self.wake_slice = wake_slice
        self.jobs: dict = {}
        self.alone: list | None = None  # [event, slice left]
        self.last = 0.0
        self.blocked_until = 0.0
        self.generation = 0

    def run(self, dur: float):
        """Run a pass of ``dur`` seconds of work here; return its start
        (when it first gets the core: after any block)."""
        env = self.env
        while self.blocked_until > env.now:  # transfer work in hand finishes first
            yield env.timeout(self.blocked_until - env.now)
        start = env.now
        if dur:
            self.advance()
            done = env.event()
            if self.jobs and self.wake_slice:
                self.alone = [done, min(dur, self.wake_slice)]
            self.jobs[done] = dur
            self.reschedule()
            yield done
        return start

    def block(self, seconds: float) -> None:
        """Transfer work of ``seconds`` on this core, from now (after any block in place)."""
        self.advance()
        self.blocked_until = max(self.blocked_until, self.env.now) + seconds
        if self.jobs:
            self.reschedule()

    def advance(self) -> None:
        """Give the running passes the core's time since ``last``: the pass
        running alone first, what is left of it shared equally."""
        now = self.env.now
        elapsed = now - max(self.last, self.blocked_until)
        self.last = now
        if elapsed <= 0 or not self.jobs:
            return
        jobs = self.jobs
        if self.alone is not None:
            job, left = self.alone
            took = min(elapsed, left)
            jobs[job] -= took
            elapsed -= took
            self.alone[1] = left - took
        if elapsed > 0:
            share = elapsed / len(jobs)
            for job in jobs:
                jobs[job] -= share

    def reschedule(self) -> None:
        """Wake when the pass running alone ends its slice, or when the pass
        with least work left is done (an earlier wake-up, made stale by a
        new pass or a block, is ignored)."""
        self.generation += 1
        generation = self.generation
        if self.alone is not None:
            wait = max(self.alone[1], 0.0)
        else:
            wait = max(min(self.jobs.values()), 0.0) * len(self.jobs)
        at = max(self.env.now, self.blocked_until) + wait
        self.env.timeout(at - self.env.now).callbacks.append(lambda _: self.finish(generation))

    def finish(self, generation: int) -> None:
        if generation != self.generation:
            return
        self.advance()
        if self.alone is not None and self.alone[1] <= self.DONE:
            self.alone = None
        for job in [j for j, left in self.jobs.items() if left <= self.DONE]:
            del self.jobs[job]
            if self.alone is not None and self.alone[0] is job:
                self.alone = None
            job.succeed()
        if self.jobs:
            self.reschedule()


class _CpuRun(_Run):
    """A run on devices that are CPU cores (:class:`~pipesim.sim.hardware.machines.HostCpu`).

    Two things differ from accelerators. Devices on one core share it, each
    pass running at 1/n of its speed while n run there (:class:`_Core`; k
    ranks on c < k cores stretch a compute-bound run by k / c). And a
    transfer costs CPU time on both ends, which the communication threads
    take at higher priority than the passes: the sender's share at the
    transfer's start, the receiver's at its end (the transfer's last
    ``recv`` seconds are the receiver's copy), each lengthening the passes
    running on that core, or, on an idle core, delaying the next pass until
    it is done. The transfer's own timing stays the link's: the measured
    one-way time already contains both copies.
    """

    def __init__(self, schedule: Schedule, programs: list[list[Entry]], costs: CostModel, hardware: Hardware) -> None:
        super().__init__(schedule, programs, costs, hardware)
        cpu = hardware.cpu
        self.core_of = cpu.cores
        self.cores = {c: _Core(self.env, cpu.wake_slice_s) for c in sorted(set(cpu.cores))}
        self.on_core = self.hold_core
        self.cpu_cost = {}  # nbytes -> (send, recv) CPU seconds

    def hold_core(self, dev: int, dur: float):
        """Run a pass of ``dur`` seconds on ``dev``'s core; return its start."""
        return (yield from self.cores[self.core_of[dev]].run(dur))

    def charge(self, dev: int, seconds: float) -> None:
        """Transfer work of ``seconds`` on ``dev``'s core, from now."""
        if seconds:
            self.cores[self.core_of[dev]].block(seconds)

    def transfer_cpu(self, nbytes: int) -> tuple[float, float]:
        cost = self.cpu_cost.get(nbytes)
        if cost is None:
            cpu = self.hw.cpu
            cost = self.cpu_cost[nbytes] = (cpu.send.seconds(nbytes), cpu.recv.seconds(nbytes))
        return cost

    def start_transfer(self, dev: int, a: Action, token, first: tuple) -> None:
        """As for accelerators, and the sender's core pays its share now (a
        transfer that takes no link time puts the receiver's on its core at
        once too; otherwise :meth:`receiver_copy` does, at the end)."""
        src, send = (dev, a) if a.op in SEND_OPS else first
        dst = first[0] if a.op in SEND_OPS else dev
        send_s, recv_s = self.transfer_cpu(self.costs.transfer_bytes(send))
        self.charge(src, send_s)
        super().start_transfer(dev, a, token, first)
        if token in self.done:  # it took no time on the link
            self.charge(dst, recv_s)

    def receiver_copy(self, ends: tuple) -> tuple:
        """The receiver's core is busy with the copy for the transfer's last
        ``recv`` seconds."""
        dst, nbytes = ends[2], ends[4]
        recv_s = self.transfer_cpu(nbytes)[1]
        return recv_s, lambda: self.charge(dst, recv_s)

    def ring_allreduce(self, devices: list[int], nbytes: int, reduce: bool = True, *, stage: int | None = None):
        """On cores, a collective is what pipesim's gloo runtime does
        (:mod:`pipesim.validate.runtime`: for bit-identical results every
        replica sends its whole buffer to every other and each reduces them
        all in replica order): CPU work on every device's core of n - 1
        sends and receives of the whole buffer, and, for a gradient
        all-reduce, n - 1 additions and a division (3(n - 1) + 2 buffers of
        traffic at the update bandwidth; AVERAGE's arithmetic is the
        averaging kernel, costed after). The collective lasts the longer of
        the ring's link time and that work, which is charged to the cores
        (it lengthens a pass running there)."""
        n = len(devices)
        send_s, recv_s = self.transfer_cpu(nbytes)
        work = (n - 1) * (send_s + recv_s)
        if reduce:
            work += self.costs.membound((3 * (n - 1) + 2) * nbytes, self.costs.update_bandwidth)
        start = self.env.now
        for d in devices:
            self.charge(d, work)
        yield from super().ring_allreduce(devices, nbytes, stage=stage)
        left = work - (self.env.now - start)
        if left > 0:
            yield self.env.timeout(left)


#: (start, end) of no pass: a device between passes.
_IDLE = (0.0, 0.0)

#: The passes that produce weight gradients (a whole backward, or its weight half).
_GRADIENT_OPS = frozenset({B, W})


def gradient_buckets(cost: StageCost, first_bytes: int, cap: int) -> list[tuple[float, int]]:
    """DDP's buckets of a stage's gradients: (share of the backward done when
    the bucket is ready, its bytes), in the order they all-reduce.

    Layers fill buckets from the last (the backward's order); a bucket
    closes once it holds at least its cap, ``first_bytes`` for the first
    and ``cap`` after. A layer is never split between buckets (PyTorch
    splits at parameter tensors, a layer's few). A stage with no per-layer
    figures is one bucket, ready when its backward ends."""
    if not cost.layer_gradient_bytes:
        return [(1.0, cost.gradient_bytes)]
    buckets: list[tuple[float, int]] = []
    done, size, ready = 0.0, 0, 0.0
    for nbytes, share in zip(reversed(cost.layer_gradient_bytes), reversed(cost.layer_backward_share), strict=True):
        done += share
        if nbytes:  # a layer without gradients adds nothing to wait for
            size += nbytes
            ready = min(done, 1.0)
        if size and size >= (first_bytes if not buckets else cap):
            buckets.append((ready, size))
            size = 0
    if size:  # the last, short bucket: ready with its earliest layer's gradients
        buckets.append((ready, size))
    return buckets or [(1.0, 0)]


def bucketed_exposure(
    buckets: Sequence[tuple[float, int]], backward_s: float, allreduce_s: Callable[[int], float]
) -> float:
    """Seconds a bucketed all-reduce runs past the end of the backward it
    overlaps: the buckets (:func:`gradient_buckets`) all-reduce one after
    another, each once ready (its share of ``backward_s``) and the one before
    is done, ``allreduce_s(bytes)`` each. What the engine's
    :meth:`_Run.bucketed_reduce` does, in closed form for the planners (no
    contention, no overlap slowdown)."""
    t = 0.0
    for share, nbytes in buckets:
        t = max(t, share * backward_s) + allreduce_s(nbytes)
    return max(0.0, t - backward_s)


#: The collectives that run as a ring over the stage's devices.
_RING_OPS = frozenset({REDUCE_GRAD, AVERAGE, ALLREDUCE})

#: How each kind of post that is not a transfer is posted. A table on the
#: class, not of bound methods on the run: those would form a reference cycle
#: that keeps a finished simulation's million objects for the cyclic collector.
_POST = {
    REDUCE_GRAD: _Run.post_collective,
    AVERAGE: _Run.post_collective,
    ALLREDUCE: _Run.post_collective,
    UNSHARD: _Run.post_shard,
    RESHARD: _Run.post_shard,
}

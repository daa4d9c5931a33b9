"""Execute a schedule's IR with real tensors: one walker, two ways to move data.

Every executor of pipesim reads the same compiled plan
(:func:`pipesim.sim.ir.dataflow.compile_plan` over
:func:`pipesim.sim.ir.lowering.plan`): per device, each compute action with the
sends, receives and collectives posted right before it, and the tokens it
waits for. :class:`DeviceExecutor` walks one device's entries and does the
tensor work through its :class:`~pipesim.validate.stage.PipelineStage` s; a
*comm* object moves data. Two comms exist:

* :class:`LocalComm` (here): a mailbox in one process. :func:`emulate` runs
  every device's walker in **simulated-time order** (the SimPy engine's
  timeline for the same schedule), which is a valid execution order because
  the simulator honours every dependency. This is the numerics reference
  and, timed, the single-device mode.
* ``DistComm`` (:mod:`pipesim.validate.runtime`): torch.distributed
  point-to-point and collectives, one process per device.

Collectives are computed by the same functions in both (:func:`reduce_mean`,
:func:`average_elastic`) on flat per-replica tensors in replica order, so a
distributed run is bit-identical to the emulator on CPU whatever the
backend's own reduction order would be.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.profiler import record_function

from pipesim.kernels import elastic_average
from pipesim.sim.ir.core import (
    ALLREDUCE,
    AVERAGE,
    FSDP_OPS,
    OVERLAP_F_B,
    P2P_OPS,
    PASS_OPS,
    PREDICT,
    PRODUCERS_OF,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    TORCH_OPS,
    UPDATE,
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    format_action,
)
from pipesim.sim.ir.dataflow import Arrival, CollectiveDone, PassDone, compile_plan
from pipesim.sim.ir.lowering import plan
from pipesim.sim.strategies import schedule_option
from pipesim.sim.strategies._common import check_executable
from pipesim.validate.models import boundary_tensors, to_device
from pipesim.validate.numerics import EXECUTOR_THREADS, intra_op_threads
from pipesim.validate.stage import HeldActivations, OptimizerConfig, PipelineStage, RuntimeSemanticsError

# ---------------------------------------------------------------- collectives


def flat(tensors: list[Tensor]) -> Tensor:
    """One contiguous copy of a tensor list (what a collective ships)."""
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def unflat(buf: Tensor, like: list[Tensor]) -> list[Tensor]:
    out, i = [], 0
    for t in like:
        out.append(buf[i : i + t.numel()].view_as(t))
        i += t.numel()
    return out


def reduce_mean(flats: list[Tensor], into: Tensor | None = None) -> Tensor:
    """Mean of the replicas' gradients, summed in replica order (deterministic).

    With two replicas the sum may go into ``into`` (one of them) in place:
    floating-point addition is commutative, so either replica gets the same
    bits as the ordered sum.
    """
    if into is not None and len(flats) == 2 and any(f is into for f in flats):
        other = flats[1] if flats[0] is into else flats[0]
        return into.add_(other).div_(2)
    acc = flats[0].clone()
    for f in flats[1:]:
        acc.add_(f)
    if len(flats) > 1:
        acc.div_(len(flats))
    return acc


def average_elastic(flats: list[Tensor], centre: Tensor, alpha: float) -> None:
    """EASGD in place on flat replicas (replica order) and the centre."""
    elastic_average([[f] for f in flats], [centre], alpha)


def stage_replicas(schedule: Schedule) -> dict[int, list[int]]:
    """stage -> replicas that hold it, in order."""
    out: dict[int, set] = defaultdict(set)
    for rep, stage in schedule.placement():
        out[stage].add(rep)
    return {s: sorted(r) for s, r in out.items()}


# ---------------------------------------------------------------- timing


class Clock:
    """Timestamps for spans: ``perf_counter_ns`` on CPU, CUDA events on a GPU
    (resolved to host nanoseconds once the run is over, against one
    synchronised reference event, so recording never stalls the stream)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
            torch.cuda.synchronize(device)
            self._ref_ns = time.perf_counter_ns()

    def now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter_ns()

    @staticmethod
    def host() -> int:
        return time.perf_counter_ns()

    def resolve(self, stamp: Any) -> int:
        if isinstance(stamp, int):
            return stamp
        return self._ref_ns + round(self._ref.elapsed_time(stamp) * 1e6)

    def resolve_records(self, records: list[Record], offset: int = 0) -> None:
        """Turn every record's stamps into host nanoseconds (plus ``offset``),
        once the device has been synchronised: an event's time is only known
        after it has happened."""
        for r in records:
            r.start = self.resolve(r.start) + offset
            r.end = self.resolve(r.end) + offset if r.end is not None else None


@dataclass
class Record:
    """One timed action on one stream of one device (host nanoseconds once resolved)."""

    device: int
    stream: str
    action: Action
    start: Any
    end: Any = None
    peer: int | None = None
    nbytes: int = 0


# ---------------------------------------------------------------- comm


class Comm(Protocol):
    """How a walker moves data. ``record`` (None when untimed) is the span
    of the posted operation; the comm stamps its ``end`` when it sees the
    operation complete."""

    def send(self, token: tuple, action: Action, tensor: Tensor, record: Record | None) -> None: ...
    def recv(self, token: tuple, action: Action, record: Record | None) -> None: ...
    def take(self, token: tuple) -> Tensor: ...
    def collective(self, token: tuple, action: Action, stage: PipelineStage, record: Record | None) -> None: ...
    def finish(self, token: tuple) -> None: ...
    def poll(self) -> None: ...
    def close(self) -> None: ...


class LocalComm:
    """Every device in one process: transfers are a mailbox, collectives run
    when the last replica posts them."""

    def __init__(self, schedule: Schedule, centres: dict[int, Tensor]):
        self.mail: dict[tuple, Tensor] = {}
        self.replicas = stage_replicas(schedule)
        self.alpha = float(schedule_option(schedule, "alpha"))
        self.centres = centres
        self.pending: dict[tuple, list] = defaultdict(list)
        self.done: set = set()
        self.clock: Clock | None = None

    def send(self, token, action, tensor, record=None):
        self.mail[token] = tensor
        if record is not None:
            record.end = record.start

    def recv(self, token, action, record=None):
        if record is not None:
            record.end = record.start

    def take(self, token):
        try:
            return self.mail.pop(token)
        except KeyError:
            raise RuntimeSemanticsError(
                f"data of {token} taken before it was sent: the execution order violates a dependency"
            ) from None

    def collective(self, token, action, stage, record=None):
        group = self.pending[token]
        group.append((stage, record))
        if len(group) == len(self.replicas[action.stage]):
            group.sort(key=lambda sr: sr[0].replica)
            run_collective(action, [s for s, _ in group], self.centres, self.alpha)
            for _, rec in group:
                if rec is not None:
                    rec.end = self.clock.now() if self.clock else rec.start
            del self.pending[token]
            self.done.add(token)

    def finish(self, token):
        if token not in self.done:
            raise RuntimeSemanticsError(f"collective {token} awaited before every replica posted it")

    def poll(self):
        pass

    def close(self):
        pass


def initial_centres(schedule: Schedule, stages: dict[tuple[int, int], PipelineStage]) -> dict[int, Tensor]:
    """EASGD's centre of every averaged stage starts at the initial weights
    (every replica starts from the same ones)."""
    averaged = {a.stage for prog in schedule.programs for a in prog if a.op is AVERAGE}
    out = {}
    for (rep, stage), s in sorted(stages.items()):
        if stage in averaged and stage not in out:
            out[stage] = flat(s.weights())
    return out


def apply_collective(
    action: Action, flats: list[Tensor], centre: Tensor | None, alpha: float, into: Tensor | None = None
) -> list[Tensor]:
    """The collective's result per replica (replica order), from their flat inputs.

    REDUCE_GRAD: the mean gradient (one tensor, shared; computed in ``into``
    when that is possible, see :func:`reduce_mean`). AVERAGE: each replica's
    averaged weights; ``centre`` moves in place.
    """
    if action.op is REDUCE_GRAD:
        mean = reduce_mean(flats, into)
        return [mean] * len(flats)
    average_elastic(flats, centre, alpha)
    return flats


def collective_input(action: Action, stage: PipelineStage) -> Tensor:
    """REDUCE_GRAD: the gradients it closed (``PipelineStage.close_gradients``,
    when it was posted); AVERAGE: the weights."""
    if action.op is REDUCE_GRAD:
        grad_flat, grads, _ = stage.closed
        return grad_flat if grad_flat is not None else flat(grads)  # no copy: reduced in place
    return flat(stage.weights())


def write_back(action: Action, stage: PipelineStage, result: Tensor) -> None:
    if action.op is REDUCE_GRAD and result is stage.closed[0]:
        return
    dst = stage.closed[1] if action.op is REDUCE_GRAD else stage.weights()
    with torch.no_grad():
        torch._foreach_copy_(dst, unflat(result, dst))


def run_collective(action: Action, stages: list[PipelineStage], centres: dict[int, Tensor], alpha: float) -> None:
    """REDUCE_GRAD or AVERAGE over every replica of a stage, all held locally."""
    flats = [collective_input(action, s) for s in stages]
    results = apply_collective(action, flats, centres.get(action.stage), alpha, into=flats[0])
    for s, r in zip(stages, results):
        write_back(action, s, r)


# ---------------------------------------------------------------- profiler labels


def profiler_label(a: Action) -> str:
    """The ``torch.profiler.record_function`` label of one executed action.

    ``PP:<torch spelling>`` for an op torch.distributed.pipelining has (what
    its own runtime writes), followed by `` pipesim:<pipesim spelling>`` when
    that says more (a replica, a weight version or a prediction distance);
    ``pipesim:<pipesim spelling>`` alone for pipesim's own ops. The grammar is
    in :mod:`pipesim.validate.runtime`'s docstring.
    """
    full = format_action(a)
    if a.op not in TORCH_OPS:
        return f"pipesim:{full}"
    short = format_action(a, torch_only=True)
    return f"PP:{short}" if full == short else f"PP:{short} pipesim:{full}"


def entry_labels(entries: list) -> dict[Action, str]:
    """:func:`profiler_label` of every action of one device's compiled entries
    (spelt once, before the walk)."""
    out: dict[Action, str] = {}
    for posts, a, _, _ in entries:
        for x, _ in posts:
            out[x] = profiler_label(x)
        if a is not None:
            out[a] = profiler_label(a)
    return out


#: What an action runs under when the walk is not annotated.
_UNANNOTATED = contextlib.nullcontext()


# ---------------------------------------------------------------- the walker


@dataclass
class RunOutput:
    """What executing (part of) a schedule produced, per device."""

    losses: dict[tuple[int, int], float] = field(default_factory=dict)  # (replica, mb) -> loss
    weights: dict[tuple[int, int], dict[str, Tensor]] = field(default_factory=dict)  # (replica, stage) -> state
    versions_used: dict[tuple[int, int], list] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    unscheduled_predictions: int = 0
    peak_memory: dict[int, int] = field(default_factory=dict)  # device -> bytes (CUDA only)
    #: device -> peak bytes held for pending backwards (:class:`~pipesim.validate.stage.HeldActivations`),
    #: when the run measured them
    held_activations: dict[int, int] = field(default_factory=dict)


def _boundary_bytes(value) -> int:
    """Bytes a transfer of ``value`` (a tensor, or a tuple whose Nones carry nothing) moves."""
    return sum(t.numel() * t.element_size() for t in boundary_tensors(value) if t is not None)


class DeviceExecutor:
    """Walks one device's compiled entries, doing the tensor work of each action."""

    def __init__(
        self,
        device: int,
        entries: list,
        stages: dict[tuple[int, int], PipelineStage],
        data,
        schedule: Schedule,
        comm: Comm,
        *,
        clock: Clock | None = None,
        peers: dict[tuple, int] | None = None,
        annotate: bool = False,
        held: bool = False,
    ):
        self.device = device
        self.entries = entries
        # with ``annotate``, every action runs inside a record_function of its
        # profiler_label, for a torch.profiler session around the walk
        self.labels: dict[Action, str] | None = entry_labels(entries) if annotate else None
        self.stages = stages
        self.data = data
        self.comm = comm
        self.clock = clock
        self.records: list[Record] = []
        self.local: dict[tuple, Tensor] = {}  # pass token -> output, for consumers on this device
        for s in stages.values():  # outputs an earlier part of a stream made (see park)
            self.local.update(s.parked)
            s.parked.clear()
        self.peers = peers or {}
        self.position = 0
        # with ``held``, the device's held activations are measured (HeldActivations):
        # counted in every forward and sampled after every compute action, outside its
        # timed span, in the first iteration only: the pipeline's fill reaches the most
        # micro-batches in flight there, and the steady state, which the iteration time
        # and the action errors are measured on, runs without the hooks' cost
        self.held: HeldActivations | None = None
        self._held_until = schedule.num_microbatches  # the first pass of a later micro-batch stops it
        if held:
            self.held = HeldActivations()
            for s in stages.values():
                s.held = self.held
        self._measuring_held = held

    def _batch(self, replica: int, mb: int) -> tuple[Tensor, Tensor]:
        x, y = self.data.batch(mb)  # micro-batch ids name the data, whichever replica runs them
        dev = next(iter(self.stages.values())).device
        return to_device(x, dev), y.to(dev, non_blocking=True)

    # -- posts -------------------------------------------------------------
    def post(self, posts) -> None:
        clock = self.clock
        labels = self.labels
        for x, tok in posts:
            with record_function(labels[x]) if labels is not None else _UNANNOTATED:
                record = _POST[x.op](self, x, tok, clock.now() if clock else None)
            if record is not None:
                self.records.append(record)

    def _post_send(self, x: Action, tok: Arrival, t0) -> Record | None:
        """Send the output of the pass that made it on this device: the
        forward, or the backward (B, or I where the backward is split)."""
        tensor = None
        for op in PRODUCERS_OF[x.op]:
            tensor = self.local.pop(PassDone(op, x.replica, x.stage, x.microbatch), None)
            if tensor is not None:
                break
        else:
            raise RuntimeSemanticsError(f"{x} on device {self.device}: no pass here made its data")
        rec = (
            Record(self.device, "send", x, t0, None, self.peers.get(tok), _boundary_bytes(tensor))
            if self.clock
            else None
        )
        self.comm.send(tok, x, tensor, rec)
        return rec

    def _post_recv(self, x: Action, tok: Arrival, t0) -> Record | None:
        rec = Record(self.device, "recv", x, t0, None, self.peers.get(tok)) if self.clock else None
        self.comm.recv(tok, x, rec)
        return rec

    def _post_collective(self, x: Action, tok: CollectiveDone, t0) -> Record | None:
        rec = Record(self.device, "collective", x, t0) if self.clock else None
        stage = self.stages[(x.replica, x.stage)]
        if x.op is REDUCE_GRAD:
            stage.close_gradients()
        self.comm.collective(tok, x, stage, rec)
        return rec

    # -- compute -----------------------------------------------------------
    def _input(self, tok) -> Tensor:
        """The data a pass waits for: arrived from another device, or made here."""
        if type(tok) is Arrival:
            return self.comm.take(tok)
        return self.local.pop(tok)

    def _stop_measuring_held(self) -> None:
        """The steady state starts (the device's first pass of the second
        iteration's micro-batches): no more hooks and samples."""
        self._measuring_held = False
        for s in self.stages.values():
            s.held = None

    def compute(self, a: Action, waits: tuple, token) -> None:
        if self._measuring_held and a.op in PASS_OPS and a.microbatch >= self._held_until:
            self._stop_measuring_held()
        stage = self.stages[(a.replica, a.stage)]
        data = None
        for w in waits:
            if type(w) is CollectiveDone:
                self.comm.finish(w)
            else:  # inputs are taken before the clock starts: waiting is not compute
                data = self._input(w)
        run = _COMPUTE[a.op]
        inputs = self._forward_inputs(a, stage, data) if a.op is F else data
        clock = self.clock
        labels = self.labels
        # the label's span holds the timed one: entering and leaving it is not the action's time
        with record_function(labels[a]) if labels is not None else _UNANNOTATED:
            t0 = clock.now() if clock else None
            out = run(stage, a, inputs)
            t1 = clock.now() if clock else None
        if out is not None:
            self.local[token] = out  # for a consumer on this device, or the send
        if clock:
            self.records.append(Record(self.device, "compute", a, t0, t1))
        if self._measuring_held:
            self.held.sample(self.stages.values())
        self.comm.poll()

    def _forward_inputs(self, a: Action, stage: PipelineStage, received: Tensor | None):
        """(input, target) of a forward: the micro-batch's data on the first
        stage, the activation received on the others; the target on the last."""
        x = target = None
        if stage.is_first or stage.is_last:
            x0, target = self._batch(a.replica, a.microbatch)
            x = x0 if stage.is_first else None
        return (received if received is not None else x), target

    def ready(self, j: int) -> bool:
        """Whether entry j's compute action has everything it waits for (emulator)."""
        comm = self.comm
        for w in self.entries[j].waits:
            kind = type(w)
            if kind is CollectiveDone:
                if w not in comm.done:
                    return False
            elif kind is Arrival:
                if w not in comm.mail:
                    return False
            elif w not in self.local:
                return False
        return True

    def step_entry(self, j: int, part: str) -> None:
        posts, a, waits, token = self.entries[j]
        if part == "posts":
            self.post(posts)
        elif a is not None:
            self.compute(a, waits, token)

    def run(self) -> None:
        for posts, a, waits, token in self.entries:
            self.post(posts)
            if a is not None:
                self.compute(a, waits, token)
        self.park()

    def park(self) -> None:
        """Hand outputs nothing here consumed or sent back to their stages:
        a part of a stream (``PipelineSchedule.step``) leaves them for the
        consumers or sends of the next part, whose walker takes them back."""
        for token, tensor in self.local.items():
            self.stages[(token.replica, token.stage)].parked[token] = tensor
        self.local.clear()

    def output(self, weights: bool = True) -> RunOutput:
        """What the walk produced; the stages' final weights (copies) only with ``weights``."""
        out = RunOutput(records=self.records)
        for key, s in sorted(self.stages.items()):
            if weights:
                out.weights[key] = s.state_dict()
            out.versions_used[key] = list(s.versions_used)
            out.unscheduled_predictions += s.unscheduled_predictions
            for mb, loss in s.losses.items():
                out.losses[(s.replica, mb)] = float(loss)
        if self.held is not None:
            out.held_activations = {self.device: self.held.peak}
        return out


def _forward(stage: PipelineStage, a: Action, inputs) -> Tensor | None:
    x, target = inputs
    out = stage.forward(a, x, target)
    return None if stage.is_last else out  # the last stage's output is its loss


def _backward(stage: PipelineStage, a: Action, grad: Tensor | None) -> Tensor | None:
    return stage.backward(a, grad)  # the input gradient, None on the first stage


def _weight_gradient(stage: PipelineStage, a: Action, _) -> None:
    stage.backward(a, None)


def _update(stage: PipelineStage, a: Action, _) -> None:
    stage.update(a)


def _predict(stage: PipelineStage, a: Action, _) -> None:
    stage.predict(a)


#: The tensor work of each compute action: ``(stage, action, inputs) -> output or None``.
_COMPUTE = {F: _forward, B: _backward, I: _backward, W: _weight_gradient, UPDATE: _update, PREDICT: _predict}
#: How each posted action is posted (a table on the class: bound methods in an
#: instance dict would keep every executor alive in a reference cycle).
_POST = {
    SEND_F: DeviceExecutor._post_send,
    SEND_B: DeviceExecutor._post_send,
    RECV_F: DeviceExecutor._post_recv,
    RECV_B: DeviceExecutor._post_recv,
    REDUCE_GRAD: DeviceExecutor._post_collective,
    AVERAGE: DeviceExecutor._post_collective,
}


def stage_actions(schedule: Schedule) -> dict[tuple[int, int], list[Action]]:
    out: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for prog in schedule.programs:
        for a in prog:
            if a.op not in P2P_OPS and a.op is not REDUCE_GRAD and a.op is not AVERAGE:
                out[(a.replica, a.stage)].append(a)
    return out


#: Actions the simulator executes but these executors do not (yet): an
#: OVERLAP_F_B's forward waits for its backward's inputs too, which
#: :meth:`DeviceExecutor.compute` would take as the forward's own input, and
#: FSDP's actions need sharded stages.
UNSUPPORTED_OPS = FSDP_OPS | {OVERLAP_F_B, ALLREDUCE}


def compiled(schedule: Schedule, recv_lookahead: int = 1) -> list[list]:
    check_executable(schedule.strategy, "real-tensor executors")
    for dev, prog in enumerate(schedule.programs):
        for a in prog:
            if a.op in UNSUPPORTED_OPS:
                raise ScheduleError(
                    f"{a.op.value} (device {dev}) is not run by the real-tensor executors; "
                    f"pipesim simulate runs this schedule"
                )
    return compile_plan(schedule, plan(schedule, recv_lookahead=recv_lookahead))


def prepare_stages(schedule: Schedule, stages: dict[tuple[int, int], PipelineStage], optim: OptimizerConfig) -> None:
    acts = stage_actions(schedule)
    for key, s in stages.items():
        if s.num_stages != schedule.num_stages:
            raise ValueError(f"stage {key} was built for {s.num_stages} stages, the schedule has {schedule.num_stages}")
        s.prepare(acts.get(key, []), optim)


def merge(outputs: list[RunOutput]) -> RunOutput:
    out = RunOutput()
    for o in outputs:
        out.losses.update(o.losses)
        out.weights.update(o.weights)
        out.versions_used.update(o.versions_used)
        out.records.extend(o.records)
        out.peak_memory.update(o.peak_memory)
        out.held_activations.update(o.held_activations)
        out.unscheduled_predictions += o.unscheduled_predictions
    out.losses = dict(sorted(out.losses.items()))
    out.weights = dict(sorted(out.weights.items()))
    out.versions_used = dict(sorted(out.versions_used.items()))
    return out


# ---------------------------------------------------------------- the emulator


def execution_events(entries: list[list], timeline) -> list[list[tuple[float, int, int]]]:
    """Per device, in program order, ``(simulated time, part, entry)`` events:
    part 0 posts entry j's communication when the previous compute action
    ends (the walk reaches it then), part 1 runs its compute action when the
    simulator started it."""
    starts: dict[int, list[float]] = defaultdict(list)
    ends: dict[int, list[float]] = defaultdict(list)
    for s in timeline.by_stream()["compute"]:
        starts[s.device].append(s.start)
        ends[s.device].append(s.end)
    out = []
    for dev, prog in enumerate(entries):
        st, en = sorted(starts[dev]), sorted(ends[dev])
        n_compute = sum(1 for e in prog if e[1] is not None)
        if len(st) != n_compute:
            raise ValueError(f"device {dev}: the timeline has {len(st)} compute spans, the schedule {n_compute}")
        events, k = [], 0
        for j, (_, a, _, _) in enumerate(prog):
            events.append((en[k - 1] if k else 0.0, 0, j))
            if a is not None:
                events.append((st[k], 1, j))
                k += 1
        out.append(events)
    return out


def emulate(
    schedule: Schedule,
    stages: dict[tuple[int, int], PipelineStage],
    data,
    optim: OptimizerConfig,
    timeline,
    *,
    recv_lookahead: int = 1,
    timed: bool = False,
    progress=None,
    centres: dict[int, Tensor] | None = None,
    threads: int | None = EXECUTOR_THREADS,
    annotate: bool = False,
    held: bool = False,
) -> RunOutput:
    """Run every device's program in one process, in ``timeline``'s order.

    ``stages`` holds a :class:`PipelineStage` for every (replica, stage) of
    the schedule (they may share one device: the single-device mode).
    ``timeline`` is a :class:`~pipesim.sim.engine.results.SimResult` of the same
    schedule; with ``timed`` every action is timed on the stages' device.
    ``threads`` is the intra-op thread count to compute with: the default
    is the distributed workers', which makes the result bit-identical to
    theirs (:mod:`pipesim.validate.numerics`); ``None`` keeps torch's setting.
    With ``annotate`` every action runs inside a ``record_function`` of its
    :func:`profiler_label`, for a torch.profiler session around the call.
    With ``held`` each device's held activations are measured
    (:class:`~pipesim.validate.stage.HeldActivations`;
    ``RunOutput.held_activations``).
    """
    with intra_op_threads(threads):
        return _emulate(
            schedule,
            stages,
            data,
            optim,
            timeline,
            recv_lookahead=recv_lookahead,
            timed=timed,
            progress=progress,
            centres=centres,
            annotate=annotate,
            held=held,
        )


def _emulate(
    schedule, stages, data, optim, timeline, *, recv_lookahead, timed, progress, centres, annotate=False, held=False
) -> RunOutput:
    missing = sorted(set(schedule.placement()) - set(stages))
    if missing:
        raise ValueError(f"no PipelineStage for (replica, stage) {missing[0]}")
    prepare_stages(schedule, stages, optim)
    entries = compiled(schedule, recv_lookahead)
    comm = LocalComm(schedule, initial_centres(schedule, stages) if centres is None else centres)
    device = next(iter(stages.values())).device
    clock = Clock(device) if timed else None
    comm.clock = clock
    placement = schedule.placement()
    executors = [
        DeviceExecutor(
            d,
            entries[d],
            {k: s for k, s in stages.items() if placement[k] == d},
            data,
            schedule,
            comm,
            clock=clock,
            annotate=annotate,
            held=held,
        )
        for d in range(schedule.num_devices)
    ]
    # Walk the devices in simulated-time order. Zero-cost actions (updates on
    # an ideal machine) tie with what follows them, so at each step the
    # earliest event whose inputs are ready runs; program order within a
    # device always holds.
    events = execution_events(entries, timeline)
    pos = [0] * len(executors)
    total = sum(map(len, events))
    for done in range(1, total + 1):
        best = None
        for d, ex in enumerate(executors):
            if pos[d] == len(events[d]):
                continue
            t, part, j = events[d][pos[d]]
            if part and not ex.ready(j):
                continue
            if best is None or (t, part, d) < best[0]:
                best = ((t, part, d), d, j, part)
        if best is None:
            stuck = [
                str(ex.entries[events[d][pos[d]][2]][1]) for d, ex in enumerate(executors) if pos[d] < len(events[d])
            ]
            raise RuntimeSemanticsError(f"emulation cannot proceed: {', '.join(stuck)} wait for data never produced")
        _, d, j, part = best
        executors[d].step_entry(j, "compute" if part else "posts")
        pos[d] += 1
        if progress is not None and part:
            progress(done, total)
    for ex in executors:
        ex.park()
    out = merge([ex.output() for ex in executors])
    if clock is not None:
        if clock.cuda:
            torch.cuda.synchronize(device)
        clock.resolve_records(out.records)
    return out


def iteration_losses(losses: dict[tuple[int, int], float], m: int) -> list[float]:
    """One mean loss per iteration (over its micro-batches and replicas)."""
    per: dict[int, list[float]] = defaultdict(list)
    for (_, mb), v in losses.items():
        per[mb // m].append(v)
    return [sum(v) / len(v) for _, v in sorted(per.items())]

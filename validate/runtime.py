"""The distributed runtime: one process per device, each walking its part of the IR.

Each worker builds the same model from the same seed, keeps the stages the
schedule places on its device, and runs :class:`~pipesim.validate.executor.DeviceExecutor`
over its compiled entries with :class:`DistComm`, which maps the IR's
communication onto torch.distributed:

* ``SEND_*`` → ``isend`` posted right after the producing pass,
  ``RECV_*`` → ``irecv`` into a preallocated buffer, posted
  ``recv_lookahead`` compute actions ahead of its consumer, which waits on
  it. Sends never block the walk, receives are posted before they are
  needed, and the validator has checked that the IR cannot deadlock under
  exactly that model; gloo's send completing only once its receive is
  posted therefore cannot stall a worker. Every transfer carries a tag
  unique to it (gloo matches on it); NCCL ignores tags and matches in
  order per pair of ranks, so for NCCL :func:`check_pair_order` proves the
  lowering posts both ends in the same order first.
* A cut that carries several tensors (a model from elsewhere, whose stages
  are :class:`~pipesim.validate.boundary.TupleStage`; its
  :func:`boundary_specs` entry lists them) is still one transfer: the
  tensors packed into one uint8 buffer, each at an offset aligned to its
  dtype (:func:`pack`), unpacked by the receiver. Forward carries every
  tensor; backward only the gradients carried back (flagged in the spec),
  and the receiver rebuilds a tuple aligned with the producer's outputs,
  None elsewhere. A one-tensor cut (every catalog model) travels as before.
* ``REDUCE_GRAD``/``AVERAGE`` across devices → every replica's flat tensor
  gathered on every device, posted when the IR posts it and finished by the
  action that waits for it; the reduction itself is
  :func:`~pipesim.validate.executor.apply_collective`, in replica order, so
  the result is bit-identical to the emulator's whatever order a backend
  would reduce in. NCCL gathers with ``all_gather`` on a group per stage;
  gloo with tagged ``isend``/``irecv`` to and from each peer, because gloo's
  CPU ``all_gather`` runs at a fraction of its point-to-point bandwidth (a
  2-rank exchange of 16 MiB took 45 ms against 8 ms one way), and with two
  replicas the exchange moves exactly what a ring all-reduce moves, which
  is what the simulator charges.

Timing: every action is stamped on the device's clock (perf_counter_ns,
CUDA events on GPU). Ranks on one host share the monotonic clock, so their
stamps are already aligned; ranks on other hosts are aligned to rank 0 by a
ping-pong that keeps the round trip with the least delay (NTP's estimate).
Records are gathered to rank 0 and returned.

Profiler traces (``pipesim validate --profiler-trace``)
--------------------------------------------------------
With :attr:`Job.profiler_trace` naming a folder, each worker walks its
program (every iteration of the run, from the barrier that starts it until
its last transfer has completed; not the warm-up, the clock alignment or the
gathering) under ``torch.profiler.profile``, CPU activity plus CUDA activity
on a GPU, ``profile_memory`` off (:data:`PROFILE_MEMORY`, see the cost
below), and writes the Kineto Chrome trace, gzipped, as
``<folder>/rank<R>.json.gz`` (R: the worker's rank, which is pipesim's
device; single-device mode writes one ``rank0.json.gz`` holding every
device). Every action the walker executes
runs inside ``torch.profiler.record_function(label)``; the labels are the
trace's ``user_annotation`` events (``gpu_user_annotation`` too on a GPU).
Their grammar::

    label      = torch-part [" " pipesim-part] | pipesim-part
    torch-part = "PP:" STAGE TORCH-OP [MICROBATCH]
    pipesim-part = "pipesim:" ["r" REPLICA "."] STAGE OP [MICROBATCH] ["@v" VERSION] ["+p" DISTANCE]
    TORCH-OP   = "F" | "I" | "B" | "W" | "SEND_F" | "RECV_F" | "SEND_B" | "RECV_B" | "REDUCE_GRAD"
    OP         = TORCH-OP | "UPDATE" | "PREDICT" | "AVERAGE"

(torch's UNSHARD, RESHARD and OVERLAP_F_B are not executed by this runtime)

i.e. the regular expression
``^(?:PP:(?P<torch>\\d+[A-Z_]+\\d*)(?: pipesim:(?P<full>\\S+))?|pipesim:(?P<own>\\S+))$``.

* An op torch.distributed.pipelining has (its ``_action_regex``; pipesim
  spells these ops as torch does) gets the torch part: exactly the label
  torch's own runtime writes, ``PP:`` + ``str(_Action)``, e.g. ``PP:1F3``,
  ``PP:0SEND_B2``, ``PP:0REDUCE_GRAD``; ``_Action.from_str`` reads what
  follows ``PP:``.
* The pipesim part follows it, after one space, exactly when the action's
  pipesim spelling (:func:`~pipesim.sim.ir.core.format_action`) says more
  than torch's: a replica other than 0, a weight version or a prediction
  distance, e.g. ``PP:0F3 pipesim:0F3@v1``, ``PP:1B5 pipesim:r1.1B5@v0``,
  ``PP:0F9 pipesim:0F9@v2+p1``. Where it is present it is the whole
  action (:func:`~pipesim.sim.ir.core.parse_action` reads it); where it is
  absent the torch part is (replica 0, no version).
* pipesim's own ops have the pipesim part alone: ``pipesim:0UPDATE@v1``,
  ``pipesim:1PREDICT@v2+p1``, ``pipesim:r1.0AVERAGE``.
* Micro-batch ids are pipesim's, global across iterations (iteration t owns
  t·m … t·m+m−1), as ``pipesim schedule --format torch-csv`` writes them;
  torch's runtime numbers each step's from 0. Each compute action therefore
  appears exactly once in a trace.
* A compute action's event (F, I, B, W, UPDATE, PREDICT) contains the span
  pipesim times for it and little more: what it waits for (a receive, a
  cross-device collective, whose reduction runs then) was awaited before
  it, outside any label, whereas torch's runtime puts such waits inside its
  ``PP:`` events. A posted action's event (SEND_*, RECV_*, REDUCE_GRAD,
  AVERAGE) is the posting alone (``isend``, ``irecv``, the exchange's posts;
  in single-device mode a collective runs when its last replica posts it,
  inside that post's event); the transfer itself runs on after it.
* Events that match neither form are torch's own (``gloo:send``,
  ``gloo:recv``, ``gloo:barrier``).

Metadata: ``distributedInfo`` as torch writes it when the default process
group exists (``backend``, ``rank``, ``world_size``, ``pg_count``,
``pg_config``); single-device mode, which has none, writes ``{"backend":
"single", "rank": 0, "world_size": 1}``. ``pipesimInfo``: ``devices`` (the
pipesim devices the trace holds), ``clock_offset_ns`` (what this rank adds
to its own stamps to put them on rank 0's clock; 0 on one host) and, on
Linux, ``minor_faults`` (the walking thread's minor page faults during the
walk; see the heap reserve below). Kineto's timestamps (``ts``, µs) are on
its own clock, not that of pipesim's records; each compute event contains
its record's span, which is how the two line up.

What profiling costs. pipesim's timings, and so the reconciliation, are
still its own stamps (:class:`~pipesim.validate.executor.Clock`), taken
inside each label's span: entering and leaving a label (about 7 µs) falls
between timed spans. What the profiler adds to each operator a pass runs is
timed. Measured on the project's 2-core machine beside other work, on the
job of ``pipesim validate --strategy 1f1b --stages 2 --model mlp --backend
gloo`` (6 to 8 runs of each kind, alternating; per action, the median over
runs of the run's median), against runs with the same heap reserve (below)
and no profiler: F +2 to +8% (an mlp F runs 38 operators), B +3 to +10%
(92 operators), UPDATE +3 to +9%, i.e. about 1 µs an operator. With
``profile_memory`` passes took +5 to +9% and the trace grew by a quarter,
so it stays off. Outside the timed walk: the heap reserve (about 0.3 s a
rank) and writing the trace (about 0.3 s a rank; 190 KB for that run of 4
iterations).

Heap reserve. The profiler's records are small allocations that live until
the trace is written; malloc carves them out of the blocks freed tensors
leave, so the next pass's tensors grow the heap into fresh pages. Profiled
so, rank 0 of that run took 8,900 to 13,000 minor page faults in its walk
against 1,300 to 2,000 unprofiled, and its B ran 51% slower (1.63 to 2.47
ms). A CPU rank whose malloc keeps freed memory
(:mod:`pipesim.validate.allocator`) therefore makes
:data:`PROFILER_HEAP_RESERVE_BYTES` (256 MiB) at the top of its heap
resident before it starts the profiler and frees it again; its walk then
takes 60 to 100 faults (1F1B and GPipe on gpt-small, AvgPipe, PipeDream on
vgg-small too). ``minor_faults`` in the thousands says the reserve ran out
(a larger or longer run) and those passes' times include faulting.

The reserve also spares the walk the faults an unprofiled walk takes as its
heap grows, so against an unprofiled run a profiled one can be faster, not
slower: on that machine, busy, the reserve alone made passes 10 to 22%
faster (iteration 55 to 30 ms), and profiled runs were 5 to 20% faster than
unprofiled ones; in another set of runs they were 2 to 6% slower. Compare
profiled runs with profiled runs.
"""

from __future__ import annotations

import json
import math
import os
import queue
import socket
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipesim.sim.ir.core import (
    AVERAGE,
    COLLECTIVE_OPS,
    SEND_B,
    SEND_F,
    SEND_OPS,
    Schedule,
    ScheduleError,
    boundary_stage,
    transfer_stages,
)
from pipesim.sim.ir.dataflow import Arrival, CollectiveDone
from pipesim.sim.strategies import schedule_option
from pipesim.validate.executor import (
    Clock,
    DeviceExecutor,
    LocalComm,
    Record,
    RunOutput,
    apply_collective,
    collective_input,
    compiled,
    initial_centres,
    merge,
    prepare_stages,
    stage_replicas,
    write_back,
)
from pipesim.validate.numerics import EXECUTOR_THREADS
from pipesim.validate.stage import OptimizerConfig, PipelineStage, RuntimeSemanticsError

#: collectives exchanged point to point use tags from here up
COLLECTIVE_TAG_BASE = 1 << 30


def transfer_tag(token: Arrival, num_stages: int) -> int:
    """A tag unique to one transfer of one run, the same at both ends."""
    send, stage, mb = token
    return (mb * num_stages + stage) * 2 + (0 if send is SEND_F else 1)


def transfer_peers(schedule: Schedule, entries: list[list]) -> dict[int, dict[tuple, int]]:
    """Per device, the other end of each of its transfers."""
    where = schedule.placement()
    out: dict[int, dict[tuple, int]] = defaultdict(dict)
    for dev, prog in enumerate(entries):
        for posts, *_ in prog:
            for x, tok in posts:
                if type(tok) is Arrival:
                    src, dst = (where[(schedule.replica_of(s, x.microbatch), s)] for s in transfer_stages(x))
                    out[dev][tok] = dst if dev == src else src
    return out


def check_pair_order(entries: list[list], peers: dict[int, dict[tuple, int]]) -> None:
    """NCCL matches point-to-point messages in posting order per pair of ranks:
    the sends from a to b must be posted in the order b posts its receives."""
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    for dev, prog in enumerate(entries):
        for posts, *_ in prog:
            for x, tok in posts:
                if type(tok) is not Arrival:
                    continue
                peer = peers[dev][tok]
                if x.op in SEND_OPS:
                    sends[(dev, peer)].append((tok, x))
                else:
                    recvs[(peer, dev)].append((tok, x))
    for pair, ss in sorted(sends.items()):
        rs = recvs.get(pair, [])
        for (ts, xs), (tr, xr) in zip(ss, rs):
            if ts != tr:
                raise ScheduleError(
                    f"NCCL needs device {pair[0]}'s sends to device {pair[1]} in the order that device "
                    f"receives them: {xs} is sent where {xr} is received"
                )


def boundary_specs(stage_modules, data) -> list[tuple[tuple[torch.Size, torch.dtype, bool], ...]]:
    """Per stage, what its output's transfer carries for one micro-batch:
    ``(shape, dtype, carries_gradient)`` of every tensor of the boundary (one
    entry for a one-tensor boundary, one per tensor of a tuple; see
    :func:`~pipesim.validate.models.boundary_tensors`). A tensor carries a
    gradient back when it is floating point and the graph reaches it
    (:class:`~pipesim.validate.boundary.TupleStage`'s rule); a one-tensor
    boundary's float output always does, as ``PipelineStage`` assumes."""
    from pipesim.validate.boundary import carries_gradient, detach_boundary
    from pipesim.validate.models import boundary_tensors, call_layer

    x = data.batch(0)[0]
    specs = []
    with torch.enable_grad():
        for mod in stage_modules:
            x = call_layer(mod, x)
            ts = boundary_tensors(x)
            alone = len(ts) == 1
            specs.append(tuple((t.shape, t.dtype, carries_gradient(t, alone)) for t in ts))
            x = detach_boundary(x)
    return specs


def _aligned(offset: int, dtype: torch.dtype) -> int:
    """``offset`` rounded up to a multiple of ``dtype``'s size."""
    size = dtype.itemsize
    return (offset + size - 1) // size * size


def pack_layout(shapes_dtypes) -> tuple[list[int], int]:
    """Byte offset of each tensor in a packed transfer, each aligned to its
    dtype's size, and the total bytes."""
    offsets, end = [], 0
    for shape, dtype in shapes_dtypes:
        end = _aligned(end, dtype)
        offsets.append(end)
        end += math.prod(shape) * dtype.itemsize
    return offsets, end


def unpack_boundary(buf: torch.Tensor, spec, *, forward: bool) -> tuple:
    """The tuple a packed transfer of a several-tensor boundary carried
    (``spec``: its :func:`boundary_specs` entry). Forward: every tensor, each
    that carries a gradient marked ``requires_grad``. Backward: a tuple
    aligned with the boundary, the carried gradients where the flag is set
    and None elsewhere."""
    if forward:
        ts = unpack(buf, [(sh, dt) for sh, dt, _ in spec])
        return tuple(t.requires_grad_() if g else t for t, (_, _, g) in zip(ts, spec))
    got = iter(unpack(buf, [(sh, dt) for sh, dt, g in spec if g]))
    return tuple(next(got) if g else None for _, _, g in spec)


def pack(tensors) -> torch.Tensor:
    """The tensors' bytes in one uint8 buffer, laid out by :func:`pack_layout`."""
    offsets, total = pack_layout([(t.shape, t.dtype) for t in tensors])
    buf = torch.empty(total, dtype=torch.uint8, device=tensors[0].device if tensors else None)
    for t, o in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        buf[o : o + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buf


def unpack(buf: torch.Tensor, shapes_dtypes) -> list[torch.Tensor]:
    """Views of ``buf`` as the tensors :func:`pack` packed."""
    offsets, _ = pack_layout(shapes_dtypes)
    out = []
    for (shape, dtype), o in zip(shapes_dtypes, offsets):
        n = math.prod(shape) * dtype.itemsize
        out.append(buf[o : o + n].view(dtype).view(shape))
    return out


class DistComm:
    """The IR's communication on torch.distributed (see the module doc)."""

    def __init__(
        self,
        schedule: Schedule,
        device: int,
        stages: dict[tuple[int, int], PipelineStage],
        peers: dict[tuple, int],
        specs,
        groups: dict[int, object],
        members: dict[int, list[int]],
        clock: Clock | None,
        torch_device: torch.device,
        centres: dict | None = None,
    ):
        self.schedule = schedule
        self.device = device
        self.stages = stages
        self.peers = peers
        self.specs = specs
        self.groups = groups
        self.clock = clock
        self.torch_device = torch_device
        self.replicas = stage_replicas(schedule)
        self.alpha = float(schedule_option(schedule, "alpha"))
        self.centres = initial_centres(schedule, stages) if centres is None else centres
        self.local = LocalComm(schedule, self.centres)
        self.local.clock = clock
        self.sends: list[tuple] = []  # (work, tensor, record)
        self.recvs: dict[tuple, tuple] = {}  # token -> (work, buffer, record, boundary spec)
        self.gathers: dict[tuple, tuple] = {}  # token -> (work, outs, action, stage, record)
        self.records: list[Record] = []
        self.members = members  # stage -> devices of its collectives (stage_groups)
        self.p2p = {SEND_F: None, SEND_B: None}
        self.reaper = None
        self.receive_buffers: dict[tuple, torch.Tensor] = {}  # see _receive_buffer
        self.failure: BaseException | None = None

    def _tag(self, token):
        return transfer_tag(token, self.schedule.num_stages)

    def _collective_tag(self, token: CollectiveDone) -> int:
        """Tags above every transfer's: (op, stage, round) of a collective."""
        op, stage, rnd = token
        return COLLECTIVE_TAG_BASE + (rnd * self.schedule.num_stages + stage) * 2 + (op is AVERAGE)

    @staticmethod
    def _wait(work) -> None:
        # gloo's point-to-point works cannot be polled (is_completed stays
        # False until wait), so a waiting rank sleeps; launch(keep_cores_awake=)
        # keeps its core from idling meanwhile
        work.wait()

    def _stamp(self, record):
        if record is not None:
            record.end = self.clock.now()

    def send(self, token, action, tensor, record=None):
        if isinstance(tensor, tuple) and len(tensor) == 1:
            tensor = tensor[0].contiguous()  # a one-tensor boundary travels as it is (see recv)
        elif isinstance(tensor, tuple):
            # several tensors cross this cut: one packed buffer, one transfer (forward:
            # every tensor; backward: the gradients that are carried, in order)
            tensor = pack([t for t in tensor if t is not None])
        else:
            tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=self.peers[token], tag=self._tag(token), group=self.p2p[token.send])
        if self.reaper is not None:
            self.reap.put((work, tensor, record))
        else:
            self.sends.append((work, tensor, record))

    def recv(self, token, action, record=None):
        spec = self.specs[boundary_stage(action)]
        if len(spec) == 1:  # one tensor crosses the cut: received as it is
            shape, dtype, _ = spec[0]
            buf = torch.empty(shape, dtype=dtype, device=self.torch_device)
        else:  # a tuple, packed (see send): its bytes, unpacked when taken
            carried = spec if token.send is SEND_F else [e for e in spec if e[2]]
            buf = torch.empty(
                pack_layout([(sh, dt) for sh, dt, _ in carried])[1], dtype=torch.uint8, device=self.torch_device
            )
        work = dist.irecv(buf, src=self.peers[token], tag=self._tag(token), group=self.p2p[token.send])
        self.recvs[token] = (work, buf, record, spec)

    def _reaper_loop(self):
        """Waits for sends in the order they were posted, stamps their end
        and lets their buffers go. gloo's works cannot be polled
        (``is_completed`` stays False until ``wait``), so without this a
        run would keep every sent tensor until it ends."""
        while True:
            item = self.reap.get()
            if item is None:
                return
            work, _, record = item
            try:
                work.wait()
            except BaseException as e:  # surfaced when the walker closes
                self.failure = self.failure or e
                return
            self._stamp(record)

    def start_reaper(self):
        self.reap = queue.SimpleQueue()
        self.reaper = threading.Thread(target=self._reaper_loop, name="pipesim-reaper", daemon=True)
        self.reaper.start()

    def _stop_reaper(self):
        if self.reaper is not None:
            self.reap.put(None)
            self.reaper.join()
            self.reaper = None
        if self.failure is not None:
            raise self.failure

    def take(self, token):
        try:
            work, buf, record, spec = self.recvs.pop(token)
        except KeyError:
            raise RuntimeSemanticsError(f"data of {token} awaited without a posted receive") from None
        self._wait(work)
        self._stamp(record)
        if len(spec) == 1:
            return buf
        return unpack_boundary(buf, spec, forward=token.send is SEND_F)

    def collective(self, token, action, stage, record=None):
        group = self.groups.get(action.stage)
        if group is None:  # every replica of this stage lives here
            self.local.collective(token, action, stage, record)
            return
        mine = collective_input(action, stage)
        members = self.members[action.stage]
        outs = [mine if d == self.device else self._receive_buffer(action, d, mine) for d in members]
        if dist.get_backend() == "nccl":
            outs = [torch.empty_like(mine) for _ in members]
            works = [dist.all_gather(outs, mine, group=group, async_op=True)]
        else:
            tag = self._collective_tag(token)
            # each direction on its own connection (see p2p), so the exchange is full duplex
            up, down = self.p2p[SEND_F], self.p2p[SEND_B]
            me = self.device
            works = [dist.isend(mine, dst=d, tag=tag, group=up if d > me else down) for d in members if d != me]
            works += [
                dist.irecv(outs[i], src=d, tag=tag, group=up if me > d else down)
                for i, d in enumerate(members)
                if d != me
            ]
        self.gathers[token] = (works, outs, action, stage, record)

    def _receive_buffer(self, action, peer: int, like: torch.Tensor) -> torch.Tensor:
        """Where ``peer``'s buffer of this stage's collective arrives: the same
        tensor every time (a fresh 4 MiB buffer per all-reduce cost its pages'
        first-touch faults on every iteration, inside the transfer)."""
        key = (action.op, action.stage, action.replica, peer)
        buf = self.receive_buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self.receive_buffers[key] = torch.empty_like(like)
        if any(b is buf for _, outs, *_ in self.gathers.values() for b in outs):
            return torch.empty_like(like)  # the last one's is still in flight
        return buf

    def finish(self, token):
        got = self.gathers.pop(token, None)
        if got is None:
            self.local.finish(token)
            return
        works, outs, action, stage, record = got
        for w in works:
            self._wait(w)
        self._stamp(record)
        # group ranks follow device order; the reduction follows replica order
        reps = self.replicas[action.stage]
        where = self.schedule.placement()
        by_device = sorted(reps, key=lambda r: where[(r, action.stage)])
        flats = [None] * len(reps)
        for i, r in enumerate(by_device):
            flats[reps.index(r)] = outs[i]
        own = reps.index(stage.replica)
        results = apply_collective(action, flats, self.centres.get(action.stage), self.alpha, into=flats[own])
        write_back(action, stage, results[own])

    def poll(self):
        """NCCL: stamp the sends that completed (gloo's go through the reaper)."""
        if self.sends:
            still = []
            for s in self.sends:
                if s[0].is_completed():
                    self._stamp(s[2])
                else:
                    still.append(s)
            self.sends = still

    def close(self):
        self._stop_reaper()
        for token in list(self.gathers):
            self.finish(token)
        for work, _, record in self.sends:
            work.wait()
            self._stamp(record)
        self.sends = []
        if self.recvs:
            raise RuntimeSemanticsError(f"receives never consumed: {sorted(map(str, self.recvs))[:3]}")


def stage_groups(schedule: Schedule) -> dict[int, list[int]]:
    """stage -> devices its collectives span, when they span several.

    Each such device must hold exactly one replica of the stage (width x
    depth, data parallelism, disjoint AvgPipe); all replicas on one device
    (shared AvgPipe) need no group.
    """
    where = schedule.placement()
    replicas = stage_replicas(schedule)
    has_coll = {a.stage for prog in schedule.programs for a in prog if a.op in COLLECTIVE_OPS}
    out = {}
    for stage in sorted(has_coll):
        devs = [where[(r, stage)] for r in replicas[stage]]
        if len(set(devs)) == 1:
            continue
        if len(set(devs)) != len(devs):
            raise ScheduleError(
                f"stage {stage}: replicas on devices {devs}; the runtime needs them all on one device or one per device"
            )
        out[stage] = sorted(devs)
    return out


# ---------------------------------------------------------------- the job


@dataclass(frozen=True)
class Job:
    """Everything a worker needs to rebuild its part of the run (picklable)."""

    schedule: Schedule
    model: str
    starts: tuple[int, ...]
    microbatch_size: int
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    width: int | None = None
    depth: int | None = None
    seed: int = 0
    synthetic: bool = False
    recv_lookahead: int = 1
    timed: bool = True
    profiler_trace: str | None = None  # a folder: each rank writes rank<R>.json.gz there (module doc)
    #: measure each device's held activations (RunOutput.held_activations; see
    #: pipesim.validate.stage.HeldActivations)
    held_activations: bool = True
    #: return every stage's final weights (RunOutput.weights), for checks of
    #: bit-identity. Rank 0 gathers them pickled, padded to the largest rank's:
    #: a 425 MB GPT-2 under AvgPipe took 3.6 GB more at the end for it, so a
    #: run that only times leaves them out.
    return_weights: bool = True


#: Whether profiler traces record memory (``profile_memory``; module doc).
PROFILE_MEMORY = False
#: What a CPU rank faults in at the top of its heap before a profiled walk (module doc).
PROFILER_HEAP_RESERVE_BYTES = 256 << 20


def _reserve_heap(nbytes: int) -> None:
    """Make ``nbytes`` at the top of the heap resident and free them again.

    With malloc keeping freed memory (:mod:`pipesim.validate.allocator`),
    they stay resident and serve the allocations that would have grown the
    heap: the profiler's records, and the tensors whose freed blocks those
    records were carved from, no longer fault fresh pages in mid-pass. The
    reserve is taken in pieces under the allocator's threshold, so they come
    from the heap (one block that large would be mapped apart and returned).
    """
    from pipesim.validate.allocator import MMAP_THRESHOLD_BYTES

    piece = MMAP_THRESHOLD_BYTES // 2
    blocks = [torch.ones(piece, dtype=torch.uint8) for _ in range(-(-nbytes // piece))]  # every page touched
    del blocks


def _thread_minor_faults() -> int | None:
    """Minor page faults of the calling thread so far (Linux), else None."""
    import resource

    try:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    except (AttributeError, OSError):
        return None


def profiler_trace_path(folder: str, rank: int) -> str:
    """Where rank ``rank`` writes its profiler trace."""
    return os.path.join(folder, f"rank{rank}.json.gz")


@contextmanager
def profiled(folder: str | None, rank: int, device: torch.device, info: dict):
    """Run the block under ``torch.profiler.profile`` and write its Kineto
    trace to :func:`profiler_trace_path` (nothing when ``folder`` is None;
    nothing either when the block raises). ``info`` becomes the trace's
    ``pipesimInfo``."""
    if folder is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    from pipesim.validate.allocator import is_kept

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    elif is_kept():
        _reserve_heap(PROFILER_HEAP_RESERVE_BYTES)
    prof = profile(activities=activities, profile_memory=PROFILE_MEMORY)
    prof.start()
    faults = _thread_minor_faults()
    try:
        if not dist.is_initialized():  # torch adds it only with a default process group
            prof.add_metadata_json("distributedInfo", json.dumps({"backend": "single", "rank": 0, "world_size": 1}))
        yield
    except BaseException:
        prof.stop()
        raise
    if faults is not None:
        info = {**info, "minor_faults": _thread_minor_faults() - faults}
    prof.add_metadata_json("pipesimInfo", json.dumps(info))
    prof.stop()
    os.makedirs(folder, exist_ok=True)
    final = profiler_trace_path(folder, rank)
    part = os.path.join(folder, f".rank{rank}.part.json.gz")  # torch gzips a path ending .gz
    prof.export_chrome_trace(part)
    os.replace(part, final)


def build_stages(job: Job, keys, device: torch.device):
    """The model's stage modules and a PipelineStage for every (replica, stage) in ``keys``."""
    from pipesim.validate.boundary import stage_class_for
    from pipesim.validate.models import split
    from pipesim.validate.usermodels import resolve_model

    model = resolve_model(
        job.model,
        width=job.width,
        depth=job.depth,
        seed=job.seed,
        microbatch_size=job.microbatch_size,
        memory_check=False,
    )
    modules = split(model, list(job.starts))
    stage_class = stage_class_for(model)  # TupleStage where a cut may carry several tensors
    if len(modules) != job.schedule.num_stages:
        raise ValueError(f"{len(job.starts)} stage starts for a {job.schedule.num_stages}-stage schedule")
    import copy

    stages = {}
    for rep, k in sorted(keys):
        stages[(rep, k)] = stage_class(
            copy.deepcopy(modules[k]), k, job.schedule.num_stages, device, replica=rep, loss_fn=model.loss_fn
        )
    data = model.data(job.microbatch_size, seed=job.seed, synthetic=job.synthetic)
    return model, modules, stages, data


def local_stages(job: Job, keys, device: torch.device):
    """This rank's stages, its data and every stage's boundary specs
    (:func:`boundary_specs`), with nothing else of the model kept.

    :func:`build_stages` builds the whole model to cut it; once the local
    stages are copied out and the boundaries measured, the rest (the whole
    model, 425 MB for a 4-block GPT-2) is freed, and the run reuses its memory.
    """
    _, modules, stages, data = build_stages(job, keys, device)
    return stages, data, boundary_specs(modules, data)


def _yield_to_communication() -> None:
    """Lower this (compute) thread's priority below the threads that move data.

    Each CPU rank has one core (``launch(pin_cores=True)``), shared by its
    compute thread, gloo's I/O thread and the reaper. At equal priority data
    that had arrived waited for the computing thread's time slice to end
    (transfers of 128 KiB took 1.5-3 ms instead of 0.2). Threads started
    earlier keep their priority; only the calling thread is demoted.
    """
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)
        except OSError:
            pass


def warm_up(stages: dict[tuple[int, int], PipelineStage], data, specs, device: torch.device) -> None:
    """An untimed pass through every local stage (see :meth:`PipelineStage.warm_up`)."""
    x0, y0 = data.batch(0)
    for (_, k), st in sorted(stages.items()):
        if k == 0:
            x = x0
        elif len(specs[k - 1]) == 1:
            shape, dtype, _ = specs[k - 1][0]
            x = torch.zeros(shape, dtype=dtype)
        else:
            x = tuple(torch.zeros(shape, dtype=dtype).requires_grad_(g) for shape, dtype, g in specs[k - 1])
        st.warm_up(x, y0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock_offset(rank: int, world: int) -> int:
    """ns to add to this rank's stamps to put them on rank 0's clock."""
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if all(h == hosts[0] for h in hosts):
        return 0  # one host: CLOCK_MONOTONIC is shared by every process
    best = (None, 0)
    buf = torch.zeros(1, dtype=torch.int64)
    for peer in range(1, world):
        for _ in range(8):
            if rank == peer:
                t1 = time.perf_counter_ns()
                dist.send(buf, 0)
                dist.recv(buf, 0)
                t3 = time.perf_counter_ns()
                rtt = t3 - t1
                if best[0] is None or rtt < best[0]:
                    best = (rtt, int(buf.item()) - (t1 + t3) // 2)
            elif rank == 0:
                dist.recv(buf, peer)
                buf.fill_(time.perf_counter_ns())
                dist.send(buf, peer)
    return best[1]  # rank 0's own offset stays 0


def seed_passes(seed: int, rank: int) -> None:
    """Seed the generator the passes draw from (dropout's masks) on this
    rank. A rank walks its program in one fixed order, so every invocation
    draws the same masks and reports the same losses. The emulator, which
    walks every device's passes in one process, draws them in another order
    than the ranks do (what dropout does to bit-identity: the guide)."""
    torch.manual_seed(seed * 65_537 + rank)


def run_job(ctx, job: Job) -> RunOutput | None:
    """One job on this rank: build its stages, then :func:`execute`."""
    where = job.schedule.placement()
    keys = [k for k, d in where.items() if d == ctx.rank]
    seed_passes(job.seed, ctx.rank)
    stages, data, specs = local_stages(job, keys, ctx.device)
    return execute(
        ctx,
        job.schedule,
        stages,
        data,
        specs,
        job.optimizer,
        recv_lookahead=job.recv_lookahead,
        timed=job.timed,
        profiler_trace=job.profiler_trace,
        held=job.held_activations,
        return_weights=job.return_weights,
    )


def execute(
    ctx,
    schedule: Schedule,
    stages: dict[tuple[int, int], PipelineStage],
    data,
    specs,
    optimizer: OptimizerConfig,
    *,
    recv_lookahead: int = 1,
    timed: bool = True,
    centres: dict | None = None,
    profiler_trace: str | None = None,
    held: bool = False,
    return_weights: bool = True,
) -> RunOutput | None:
    """This rank's part of ``schedule``: align clocks, walk, gather to rank 0.

    ``stages`` are this rank's; ``specs`` what every stage's output carries (:func:`boundary_specs`).
    With ``profiler_trace`` (a folder) the walk runs under torch.profiler and
    writes this rank's trace there (see the module doc). With ``held`` the
    rank measures its held activations (``RunOutput.held_activations``).
    Without ``return_weights`` the output carries no weights.
    """
    dev = ctx.rank
    device = ctx.device
    prepare_stages(schedule, stages, optimizer)
    entries = compiled(schedule, recv_lookahead)
    peers = transfer_peers(schedule, entries)
    if ctx.backend == "nccl":
        check_pair_order(entries, peers)
    members = stage_groups(schedule)
    groups = {}
    for stage, devs in members.items():  # every rank creates every group, in order
        g = dist.new_group(devs)
        if dev in devs:
            groups[stage] = g
    warm_up(stages, data, specs, device)
    offset = _clock_offset(ctx.rank, ctx.world_size)
    clock = Clock(device) if timed else None
    comm = DistComm(schedule, dev, stages, peers[dev], specs, groups, members, clock, device, centres)
    # activations and gradients travel on process groups of their own: a pair
    # of ranks then has one connection per direction of the pipeline, so a
    # gradient sent back never queues behind an activation arriving (gloo
    # serialises a connection's traffic; a send waited up to 4 ms for it)
    everyone = list(range(ctx.world_size))
    comm.p2p = {SEND_F: dist.new_group(everyone), SEND_B: dist.new_group(everyone)}
    if ctx.backend == "gloo":
        # The reaper needs the GIL to stamp a send; by default a thread
        # waiting for it gets it only after the holder has run 5 ms. (Posting
        # from a thread of its own was tried and dropped: handing sends over
        # delayed them by up to 6 ms behind the walker.)
        sys.setswitchinterval(1e-4)
        comm.start_reaper()
        _yield_to_communication()  # NCCL posts are asynchronous kernel launches already
    ex = DeviceExecutor(
        dev,
        entries[dev],
        stages,
        data,
        schedule,
        comm,
        clock=clock,
        peers=peers[dev],
        annotate=profiler_trace is not None,
        held=held,
    )
    with profiled(profiler_trace, ctx.rank, device, {"devices": [dev], "clock_offset_ns": offset}):
        dist.barrier()
        ex.run()
        comm.close()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    out = ex.output(weights=return_weights)
    if clock is not None:
        clock.resolve_records(out.records, offset)
    if device.type == "cuda":
        out.peak_memory = {dev: torch.cuda.max_memory_allocated(device)}
    out.weights = {k: {n: t.cpu() for n, t in w.items()} for k, w in out.weights.items()}
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(out, gathered, dst=0)
    dist.barrier()
    return merge(gathered) if ctx.rank == 0 else None


def worker(ctx, jobs: list[Job]) -> list[RunOutput] | None:
    """Body of one rank: the jobs in order, in one process group."""
    outs = [run_job(ctx, job) for job in jobs]
    return outs if ctx.rank == 0 else None


def launch_settings(backend: str) -> dict:
    """How timed runs place their workers (every measurement uses the same):
    on CPUs, a core per rank, kept awake (see :func:`pipesim.validate.launch.launch`)."""
    cpu = backend == "gloo"
    return {"pin_cores": cpu, "keep_cores_awake": cpu}


def run_many(
    jobs: list[Job], *, backend: str = "gloo", timeout_s: float = 300.0, threads: int = EXECUTOR_THREADS
) -> list[RunOutput]:
    """Run jobs of the same device count one after another in one set of worker
    processes (start-up is the expensive part of a short run)."""
    from pipesim.sim.ir.checks import validate
    from pipesim.validate.launch import launch

    if not jobs:
        return []
    n = jobs[0].schedule.num_devices
    for job in jobs:
        if job.schedule.num_devices != n:
            raise ValueError(f"jobs of one launch need the same device count ({n} and {job.schedule.num_devices})")
        validate(job.schedule, deadlock=True)  # a deadlocking schedule is named here, not hung on
        stage_groups(job.schedule)
    results = launch(
        worker, n, args=(list(jobs),), backend=backend, timeout_s=timeout_s, threads=threads, **launch_settings(backend)
    )
    return results[0]


def run_distributed(
    job: Job, *, backend: str = "gloo", timeout_s: float = 300.0, threads: int = EXECUTOR_THREADS
) -> RunOutput:
    """Run ``job`` with one process per device of its schedule; every rank's output, merged."""
    return run_many([job], backend=backend, timeout_s=timeout_s, threads=threads)[0]

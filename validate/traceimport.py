"""A pipeline-parallel run's torch.profiler traces as a measured pipesim timeline.

:func:`import_run` reads one Kineto trace per rank
(:mod:`pipesim.validate.kineto`), finds the pipeline's actions in them, times
each one and returns an :class:`ImportedRun` whose ``result`` is the
simulator's own :class:`~pipesim.sim.engine.results.SimResult`: measured
spans in seconds from the first compute action, each a pipesim IR
:class:`~pipesim.sim.ir.core.Action` of ``result.schedule``, so a measured
run goes through the same accounting, trace writer and plots as a
simulation.

Where the actions come from
---------------------------
* **torch's runtime** (``_PipelineScheduleRuntime``: ScheduleInterleaved1F1B,
  ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble,
  ScheduleDualPipeV, a loaded CSV) wraps every action in
  ``record_function("PP:" + str(action))``; the label is parsed by torch's
  own ``_Action.from_str``. Sends, receives, REDUCE_GRAD, UNSHARD and
  RESHARD are labelled too.
* **pipesim's runtime** (``pipesim validate --profiler-trace``, grammar in
  :mod:`pipesim.validate.runtime`) labels an op torch's grammar has the
  same way (``PP:1F3``), followed by `` pipesim:`` and the whole action
  where pipesim's spelling says more (``PP:0F3 pipesim:0F3@v1``), and its
  own ops (updates, averaging, prediction) as ``pipesim:`` +
  :func:`~pipesim.sim.ir.core.format_action`; the pipesim part is read
  with :func:`~pipesim.sim.ir.core.parse_action`. Its micro-batch ids are
  global and its labels carry the updates, so the schedule is taken as the
  labels give it (a pass with no version reads the updates its stage has
  made so far, a backward its forward's version), its pass ranges already
  exclude the waits for their inputs, and the clock offsets it recorded
  (``pipesimInfo.clock_offset_ns``) replace the estimated ones. A trace of
  its single-device mode, which holds several devices the labels do not
  place, is refused.
* **ScheduleGPipe** labels ``Forward i`` / ``Backward i``. Those ranges also
  hold the pass's receive and the posting of its send; the stage is taken
  to be the rank (one pipeline over the whole world). GPipe computes the
  loss outside its ``Forward`` label, so the last stage's loss is not
  counted as compute.
* **Schedule1F1B** (torch 2.13) labels nothing, so with ``schedule="1f1b"``
  (or ``"gpipe"``) the compute is matched against that schedule's own per-rank
  order (:func:`pipesim.sim.strategies.build_schedule`, which runs the
  passes in torch's order: S - s forwards, then one backward and one
  forward; torch's own ``pipeline_order`` for 1F1B is not used, as it
  numbers the last rank's forwards from 1). A backward is a run of the
  autograd engine's ``evaluate_function`` operators, a forward a run of
  other operators; runs are cut at communication operators, the
  bookkeeping operators between passes (allocations, copies, ``item``,
  the optimizer's) are ignored, and between two backwards the schedule's
  number of forwards is taken as the longest runs there.
* **a user's own loop**, given a ``mapping``: a regular expression that
  matches a whole label, with named groups ``stage``, ``op`` (F, B, I, W,
  the SEND/RECV ops, or forward/backward/fwd/bwd) and ``microbatch``;
  with a mapping, only the labels it matches are read.

Where the runtime labels no send or receive (GPipe, 1F1B, a mapping
without them), a pass that consumes another stage's output gets the last
receive posted after the previous pass began computing and before it did,
and a pass whose output travels the first send posted after it began
computing and before the next pass did; they are placed right before and
right after that pass in the device's program. An ``OVERLAP_F_B`` range is
cut into its forward and its backward where its first autograd operator
starts (else half way).

Steps are the ``ProfilerStep#N`` ranges where the trace has them, else a
new step begins where a label seen in the current one comes back; a step
that does not hold every action the rank runs (the profiler started or
stopped inside it) is left out, with a warning. torch numbers micro-batches
from 0 in every step, so step t's micro-batch i becomes pipesim's global id
``t*m + i``; the steps become the schedule's iterations, with pipesim's
flush semantics (:mod:`pipesim.sim.interchange`: passes of iteration t read
version t, an ``UPDATE`` after the stage's last backward). The update's
time is the optimizer's own ``Optimizer.step#...`` range after the step's
last pass (split evenly between the stages of a rank when one optimizer
steps several), and is not timed where the trace has none. torch's
``REDUCE_GRAD`` (which pipesim's flush IR folds into the update) is kept as
a span on the ``collective`` stream, though the schedule has no such
action.

How an action is timed
----------------------
* **CUDA traces**: an action's time is that of the GPU kernels its CPU range
  launched: a kernel's ``correlation`` id names the ``cuda_runtime`` launch
  (the same id the ``ac2g`` flow arrows carry), and a launch belongs to the
  action whose range holds it, whichever thread made it (the backward's
  kernels are launched from the autograd thread). A compute action spans
  its first kernel's start to its last kernel's end, on whatever streams;
  NCCL kernels are communication. An action that launched nothing keeps its
  CPU range (counted in the warnings).
* **CPU traces** (gloo): an action's time is its CPU range, less the wait
  for a receive at its start: torch's runtime waits for a pass's receive
  inside that pass's range (GPipe posts and waits inside it too), and
  gloo's ``gloo:recv`` range ends when that wait returns, so the pass's
  compute starts when the last receive that ended inside its range did.
  Python's own overhead inside a range counts as compute.

Transfers
---------
A receive is matched with the send of the same data (the same boundary,
direction and global micro-batch: the actions name it exactly). The
transfer cannot start before both ends are posted and ends when the
receive completes; the time before that, from the receive's post, is the
receive's wait. Both spans of the pair (``send`` and ``recv`` streams)
cover the transfer, as in a simulation, with a shared ``flow`` id.

The ranks' clocks are put on rank 0's from the matched pairs: data cannot
arrive before it was sent, so for ranks a and b, with x = clock(b) -
clock(a), every a->b pair gives x <= recv_end(b) - send_post(a) and every
b->a pair x >= send_post(b) - recv_end(a). Where 0 lies within the bounds the
clocks are taken to agree (one host, or NTP-synchronised hosts); else x is
the middle of the bounds (or the one bound there is). Ranks are chained
along the pipeline's links from rank 0.

On gloo, an operation is posted when its ``c10d::send`` / ``c10d::recv_``
operator starts; gloo's own ``gloo:send`` range ends when its ``wait()`` is
called (torch waits for sends late, often at the end of the step), so only
a send's post is used, and a ``gloo:recv`` range ends when the consumer's
wait returned, which is later than the data's arrival when the data came
before the consumer asked for it. So on CPU traces a transfer runs from the
later of the two posts to when it was consumed (an upper bound of the wire
time), and a receive's wait, from its post to the send's, is time it was
posted early, not time anyone was blocked (that is idle time of the
consumer's compute, and, where a send or a receive held the thread, the
run's ``blocking`` ranges). On CUDA the NCCL kernels give both ends as the
GPU saw them.

Spans other than compute are kept inside the compute window (an FSDP
no-op before the first pass must not stretch the makespan). The imported
schedule is checked by :func:`~pipesim.sim.ir.checks.validate` (a failure
is a warning: the trace is what ran), with its deadlock dry run up to
:data:`DEADLOCK_CHECK_MAX` actions and its structure up to
:data:`STRUCTURE_CHECK_MAX` (they hold the whole run's dataflow at once).

A trace with no pipeline actions (a data-parallel job) imports too:
``found_pipeline`` is False, ``result`` is None, and ``per_rank`` gives each
rank's compute and communication time (GPU kernels, else top-level CPU
operators; NCCL kernels and the c10d/gloo/nccl ranges are communication)
over its profiled steps.
"""

from __future__ import annotations

import bisect
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipesim.sim.engine.metrics import round_sig
from pipesim.sim.engine.results import MemoryTrack, SimResult, Span
from pipesim.sim.errors import InputError
from pipesim.sim.ir.core import (
    COLLECTIVE_OPS,
    COMPUTE_OPS,
    FSDP_OPS,
    OVERLAP_F_B,
    PASS_OPS,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    UPDATE,
    Action,
    B,
    F,
    I,
    Op,
    Schedule,
    ScheduleError,
    W,
    format_action,
    parse_action,
)
from pipesim.validate.kineto import COMM_PREFIXES, RankTrace, TraceError, plan_workers, read_run
from pipesim.validate.reconcile import _quantile

__all__ = [
    "IMPORTED_VERSION",
    "ImportedRun",
    "RankStats",
    "TraceImportError",
    "import_run",
    "imported_document",
    "dumps_imported",
    "load_imported",
]

#: The format of ``imported.json`` (:func:`imported_document`).
IMPORTED_VERSION = 1
#: The schedules whose unlabelled compute ``schedule=`` can match (one stage per rank).
MATCHABLE_SCHEDULES = ("gpipe", "1f1b")

_US = 1e-6


class TraceImportError(InputError):
    """The traces cannot be read as a pipeline's run (one line, naming a file)."""


@dataclass
class RankStats:
    """One rank's time over its profiled steps (seconds).

    ``span_s`` runs from its first to its last compute action (for a trace
    with no pipeline, over its ``ProfilerStep`` ranges, else its whole
    recorded window); ``compute_s`` is its busy compute time, ``idle_s``
    the rest of the span; ``communication_s`` the time it had a transfer or
    a collective under way (their union), ``wait_s`` the time it had a
    receive posted whose data had not yet been sent (their union).
    """

    rank: int
    compute_s: float
    communication_s: float
    wait_s: float
    idle_s: float
    span_s: float
    actions: int = 0

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "compute_s": round_sig(self.compute_s),
            "communication_s": round_sig(self.communication_s),
            "wait_s": round_sig(self.wait_s),
            "idle_s": round_sig(self.idle_s),
            "span_s": round_sig(self.span_s),
            "actions": self.actions,
        }


@dataclass
class ImportedRun:
    """A run read from its traces (see the module doc).

    ``result`` is the measured timeline (None when no pipeline was found);
    ``steps`` the profiled iterations kept; ``stage_times`` per (stage, op)
    the count, mean, p50 and p90 of the passes' durations (s);
    ``boundaries`` per boundary and direction the transfers' and the
    receives' waits (s); ``clock_offsets_s`` each rank's clock minus rank
    0's; ``source`` where the actions came from (``torch-runtime``,
    ``torch-gpipe``, ``pipesim``, ``mapping``, ``schedule:1f1b`` ...,
    ``none``); ``device`` ``cuda`` or ``cpu``.
    """

    result: SimResult | None
    per_rank: list[RankStats]
    found_pipeline: bool
    steps: int
    warnings: list[str] = field(default_factory=list)
    source: str = "none"
    microbatches: int | None = None
    stage_times: list[dict] = field(default_factory=list)
    boundaries: list[dict] = field(default_factory=list)
    clock_offsets_s: list[float] = field(default_factory=list)
    files: list[dict] = field(default_factory=list)
    device: str = "cpu"
    #: (device, action, start_s, end_s): the CPU ranges, 50 µs or longer, in
    #: which a rank's thread posted or waited on a send or a receive (gloo's
    #: send blocks until its receiver is ready): where a rank was held up
    #: by communication rather than idle
    blocking: list[tuple[int, str, float, float]] = field(default_factory=list)


# ----------------------------------------------------------------------------- labels


@dataclass(slots=True)
class _Found:
    """One action found on one rank (times in µs on that rank's clock)."""

    op: Op
    stage: int
    mb: int | None
    start: float  # the label's range (or the matched run)
    end: float
    replica: int = 0
    version: int | None = None
    distance: int = 0
    subs: tuple | None = None  # an OVERLAP_F_B's (forward, backward) (op, stage, mb)
    step: int = 0
    t0: float = 0.0  # the measured interval: compute, or a transfer end's post .. completion
    t1: float = 0.0
    gmb: int | None = None  # the global micro-batch id
    base: int = 0  # what turns the label's micro-batch ids into global ones
    tie: int = 0  # execution order among actions placed at one label: receive -1, pass 0, send 1
    cpu: tuple[float, float] | None = None  # a send's or receive's CPU range (posting it, blocked in it)
    flow: int | None = None  # a matched transfer's flow id (t0, t1 are then the transfer's, as on both ends)
    peer: int | None = None  # and the rank at its other end

    def key(self) -> tuple:
        return (self.op, self.replica, self.stage, self.mb, self.subs, self.version)


_OP_WORDS = {
    "forward": F,
    "fwd": F,
    "backward": B,
    "bwd": B,
    "backward_input": I,
    "backward_weight": W,
    **{op.value.lower(): op for op in Op},
}
_GPIPE_LABEL = re.compile(r"(Forward|Backward) (\d+)")
_STEP_LABEL = "ProfilerStep#"
_OPTIMIZER_LABEL = "Optimizer.step"
_MAPPING_GROUPS = ("stage", "op", "microbatch")


def _compile_mapping(mapping) -> re.Pattern | None:
    if mapping is None:
        return None
    try:
        regex = re.compile(mapping) if isinstance(mapping, str) else mapping
    except re.error as e:
        raise TraceImportError(f"mapping regex {mapping!r} does not compile: {e}") from None
    missing = [g for g in _MAPPING_GROUPS if g not in regex.groupindex]
    if missing:
        raise TraceImportError(
            f"mapping regex {regex.pattern!r} lacks the named group(s) {', '.join(missing)}: it needs "
            "(?P<stage>...), (?P<op>...) and (?P<microbatch>...)"
        )
    return regex


class _LabelReader:
    """Turns a label into an action (see the module doc), once per distinct label."""

    def __init__(self, regex: re.Pattern | None) -> None:
        self.regex = regex
        self.cache: dict[str, tuple | None] = {}
        self._torch_action = None
        self.kinds: set[str] = set()

    def read(self, name: str, rank: int, path: Path):
        hit = self.cache.get(name, False)
        if hit is not False:
            return hit
        got = self._parse(name, rank, path)
        self.cache[name] = got
        return got

    def _parse(self, name: str, rank: int, path: Path):
        if self.regex is not None:
            m = self.regex.fullmatch(name)
            if not m:
                return None
            op = _OP_WORDS.get(m["op"].lower()) if m["op"] else None
            if op is None:
                raise TraceImportError(
                    f"{path}: the mapping matched {name!r}, whose op {m['op']!r} is not one of "
                    f"{', '.join(o.value for o in Op)} or forward/backward"
                )
            try:
                stage, mb = int(m["stage"]), int(m["microbatch"])
            except (TypeError, ValueError):
                raise TraceImportError(
                    f"{path}: the mapping matched {name!r}, whose stage and microbatch must be whole numbers"
                ) from None
            self.kinds.add("mapping")
            return ("mapping", op, stage, mb, 0, None, 0, None)
        if name.startswith("PP:"):
            return self._torch(name, path)
        if name.startswith("pipesim:"):
            try:
                a = parse_action(name[len("pipesim:") :])
            except ScheduleError:
                return None
            self.kinds.add("pipesim")
            return ("pipesim", a.op, a.stage, a.microbatch, a.replica, a.version, a.distance, None)
        m = _GPIPE_LABEL.fullmatch(name)
        if m:
            self.kinds.add("torch-gpipe")
            return ("torch-gpipe", F if m[1] == "Forward" else B, -1, int(m[2]), 0, None, 0, None)  # stage: the rank
        return None

    def _torch(self, name: str, path: Path):
        text, _, full = name[len("PP:") :].partition(" pipesim:")
        if full:  # pipesim's runtime: the torch part, then the whole action (versions, replica)
            try:
                a = parse_action(full)
            except ScheduleError:
                return None
            if self._torch_parse(text) is None:
                return None
            self.kinds.add("pipesim")
            return ("pipesim", a.op, a.stage, a.microbatch, a.replica, a.version, a.distance, None)
        got = self._torch_parse(text)
        if got is not None:
            self.kinds.add("torch-runtime")
        return got

    def _torch_parse(self, text: str):
        """What torch's ``_Action.from_str`` reads in ``text`` (pipesim's
        parser where torch has no pipelining)."""
        if self._torch_action is None:
            try:
                from torch.distributed.pipelining.schedules import _Action
            except ImportError:  # a torch without pipelining: its grammar is pipesim's leading part
                _Action = None
            self._torch_action = _Action or False
        if self._torch_action:
            try:
                a = self._torch_action.from_str(text)
            except (RuntimeError, ValueError):
                return None
            if a is None:
                return None
            op = Op(a.computation_type.value)
            subs = None
            if a.sub_actions:
                subs = tuple((Op(s.computation_type.value), s.stage_index, s.microbatch_index) for s in a.sub_actions)
                if len(subs) != 2:
                    return None  # an overlapped action is a forward and a backward
                stage = subs[0][1]
            else:
                stage = a.stage_index
            return ("torch-runtime", op, stage, a.microbatch_index, 0, None, 0, subs)
        try:
            a = parse_action(text)
        except ScheduleError:
            return None
        return ("torch-runtime", a.op, a.stage, a.microbatch, 0, None, 0, None)


def _labelled(trace: RankTrace, reader: _LabelReader) -> list[_Found]:
    """The actions a rank's labels name, in time order."""
    table = trace.table
    if "user_annotation" not in table.cats:
        return []
    annotation = table.cats.index("user_annotation")
    # each distinct label read once, by its index in the table's names (a
    # run's tens of thousands of labels have a few hundred distinct names)
    actions: list = []
    for name in table.names:
        got = reader.read(name, trace.rank, trace.path)
        if got is not None and got[2] < 0:  # a single-stage schedule's label: the stage is the rank
            got = got[:2] + (trace.rank,) + got[3:]
        actions.append(got)
    out = []
    for i, (n, c) in enumerate(zip(table.name, table.cat)):
        got = actions[n] if c == annotation else None
        if got is not None:
            _, op, stage, mb, replica, version, distance, subs = got
            ts = table.ts[i]
            out.append(_Found(op, stage, mb, ts, ts + table.dur[i], replica, version, distance, subs))
    return out


# ----------------------------------------------------------------------------- steps


def _segment_steps(trace: RankTrace, found: list[_Found], warnings: list[str]) -> list[list[_Found]]:
    """The rank's complete steps, each its actions in time order (see the module doc)."""
    steps: list[list[_Found]] = []
    windows = sorted(trace.table.ranges(_STEP_LABEL))
    if windows:
        starts = [w[0] for w in windows]
        per: dict[int, list[_Found]] = defaultdict(list)
        outside = 0
        for a in found:
            i = bisect.bisect_right(starts, a.start) - 1
            if i >= 0 and a.start <= windows[i][1]:
                per[i].append(a)
            else:
                outside += 1
        if not outside and all(len({x.key() for x in v}) == len(v) for v in per.values()):
            steps = [per[i] for i in sorted(per)]
    if not steps:
        current: list[_Found] = []
        seen: set = set()
        for a in found:
            k = a.key()
            if k in seen:
                steps.append(current)
                current, seen = [], set()
            current.append(a)
            seen.add(k)
        if current:
            steps.append(current)
    full = set().union(*({a.key() for a in s} for s in steps)) if steps else set()
    complete = [s for s in steps if len(s) == len(full) and {a.key() for a in s} == full]
    dropped = len(steps) - len(complete)
    if dropped:
        warnings.append(
            f"{trace.path.name}: {dropped} step(s) left out: the profiler started or stopped inside them "
            f"(they lack some of the rank's {len(full)} actions)"
        )
    return complete


def _align_steps(traces, per_rank: list[list[list[_Found]]], warnings: list[str]) -> list[list[list[_Found]]]:
    """The same steps on every rank: as found when the counts agree, else
    the steps of the rank with fewest, each matched on the others with the
    step whose window overlaps it most (steps are in time order, so the
    candidates are found by bisection)."""
    counts = [len(s) for s in per_rank]
    if len(set(counts)) == 1:
        return per_rank
    ref = min(range(len(per_rank)), key=lambda r: counts[r])
    windows = [[(min(a.start for a in st), max(a.end for a in st)) for st in steps] for steps in per_rank]
    starts = [[w[0] for w in ws] for ws in windows]

    def best(r: int, w: tuple[float, float]) -> int | None:
        i = bisect.bisect_left(starts[r], w[0])
        cands = [j for j in (i - 2, i - 1, i, i + 1) if 0 <= j < len(windows[r])]
        overlap = [(min(w[1], windows[r][j][1]) - max(w[0], windows[r][j][0]), j) for j in cands]
        got = max(overlap, default=None)
        return got[1] if got is not None and got[0] > 0 else None

    out: list[list[list[_Found]]] = [[] for _ in per_rank]
    for w in windows[ref]:
        picks = [best(r, w) for r in range(len(per_rank))]
        if all(p is not None for p in picks):
            for r, p in enumerate(picks):
                out[r].append(per_rank[r][p])
    warnings.append(
        f"the ranks recorded different numbers of complete steps ({', '.join(map(str, counts))}); "
        f"kept the {len(out[ref])} that every rank has"
    )
    return out


# ----------------------------------------------------------------------------- timing


class _RankTimes:
    """What times an action on one rank: its point-to-point operations and
    receive completions (CPU), the kernels each launch made (GPU).

    A point-to-point operation is posted when its ``c10d::send`` /
    ``c10d::recv_`` operator starts (gloo's own ``gloo:send`` range begins
    only once the operation is under way, after the data may have left) and
    a receive completes when the ``gloo:recv`` range inside it ends (its
    ``wait()`` returned); without such operators, the ranges themselves.
    """

    def __init__(self, trace: RankTrace, *, trim: bool = True) -> None:
        self.trace = trace
        self.gpu = trace.has_gpu
        self.trim = trim  # whether a compute range holds its receive's wait (torch's runtimes)
        asyncs: dict[str, list[tuple[float, float]]] = {"send": [], "recv": []}
        ops: dict[str, list[tuple[float, float]]] = {"send": [], "recv": []}
        for ev in trace.table.select(("gloo:", "nccl:", "c10d::")):
            kind = _p2p_kind(ev.name)
            if kind is None:
                continue
            if ev.cat == "user_annotation" and ev.name.startswith(("gloo:", "nccl:")):
                asyncs[kind].append((ev.ts, ev.end))
            elif ev.cat == "cpu_op" and ev.name.startswith("c10d::"):
                ops[kind].append((ev.ts, ev.end))
        self.recv_ends = sorted(e for _, e in asyncs["recv"])
        # (post, completion, cpu end) of every send and receive, in post order
        self.p2p: dict[str, list[tuple[float, float, float]]] = {}
        for kind in ("send", "recv"):
            pool = sorted(asyncs[kind])
            starts = [x[0] for x in pool]
            used = set()
            rows = []
            for s, e in sorted(ops[kind]):
                i = bisect.bisect_left(starts, s)
                if i < len(pool) and pool[i][0] <= e and i not in used:
                    used.add(i)
                    rows.append((s, pool[i][1], e))
                else:
                    rows.append((s, e, e))
            rows += [(s, e, e) for i, (s, e) in enumerate(pool) if i not in used]
            self.p2p[kind] = sorted(rows)
        if self.gpu:
            self._index_kernels()

    def _index_kernels(self) -> None:
        k, launches = self.trace.kernels, self.trace.launches
        launched = dict(zip(launches.correlation, launches.ts))
        rows = []
        for i in range(len(k)):
            at = launched.get(k.correlation[i])
            if at is None:
                continue
            name = k.names[k.name[i]]
            rows.append((at, k.ts[i], k.ts[i] + k.dur[i], "nccl" in name.lower()))
        rows.sort()
        self.launch_at = [r[0] for r in rows]
        self.kernel_rows = rows

    def kernels_in(self, start: float, end: float, comm: bool) -> tuple[float, float] | None:
        """First start and last end of the kernels launched in [start, end]."""
        lo = bisect.bisect_left(self.launch_at, start)
        hi = bisect.bisect_right(self.launch_at, end)
        first, last = math.inf, -math.inf
        for _, ks, ke, is_comm in self.kernel_rows[lo:hi]:
            if is_comm == comm:
                first = min(first, ks)
                last = max(last, ke)
        return (first, last) if first <= last else None

    def compute(self, start: float, end: float) -> tuple[float, float, bool]:
        """(start, end, from kernels) of a compute range (see the module doc)."""
        if self.gpu:
            got = self.kernels_in(start, end, comm=False)
            if got is not None:
                return got[0], got[1], True
            return start, end, False
        if not self.trim:
            return start, end, True
        lo = bisect.bisect_right(self.recv_ends, start)
        hi = bisect.bisect_right(self.recv_ends, end)
        t0 = max([start] + self.recv_ends[lo:hi])
        return min(t0, end), end, True


def _p2p_kind(name: str) -> str | None:
    low = name.lower()
    if "recv" in low:
        return "recv"
    if "send" in low:
        return "send"
    return None


def _time_actions(times: _RankTimes, actions: list[_Found]) -> int:
    """Set every action's measured interval; the number timed from its CPU
    range on a GPU trace (it launched no kernel)."""
    untimed = 0
    for a in actions:
        if a.op in P2P:
            a.t0, a.t1 = _comm_interval(times, a)
            continue
        if a.op in COLLECTIVE_OPS or a.op in FSDP_OPS:
            got = times.kernels_in(a.start, a.end, comm=True) if times.gpu else None
            a.t0, a.t1 = got if got else (a.start, a.end)
            continue
        a.t0, a.t1, ok = times.compute(a.start, a.end)
        untimed += not ok
    return untimed


P2P = frozenset({SEND_F, SEND_B, RECV_F, RECV_B})


def _comm_interval(times: _RankTimes, a: _Found) -> tuple[float, float]:
    """A labelled send's or receive's (post, completion)."""
    kind = "recv" if a.op in (RECV_F, RECV_B) else "send"
    if times.gpu:
        got = times.kernels_in(a.start, a.end, comm=True)
        if got is not None:
            return got
    pool = times.p2p[kind]
    lo = bisect.bisect_left(pool, (a.start, -math.inf, -math.inf))
    hi = bisect.bisect_right(pool, (a.end, math.inf, math.inf))
    if hi > lo:
        post = pool[lo][0]
        return post, (max(x[1] for x in pool[lo:hi]) if kind == "recv" else post)
    return a.start, (a.end if kind == "recv" else a.start)


def _attach_p2p(times: _RankTimes, passes: list[_Found], stage_count: int) -> list[_Found]:
    """Sends and receives of a schedule that labels none (GPipe, 1F1B), as
    actions: a pass that consumes a receive gets the last one posted after
    the previous pass began computing and before it did; a pass whose output
    travels gets the first send posted after it began computing and before
    the next pass did (see the module doc). On GPU traces the NCCL kernels
    the posting operator launched are the transfer's."""
    extra: list[_Found] = []
    last = stage_count - 1
    recvs, sends = times.p2p["recv"], times.p2p["send"]
    recv_posts, send_posts = [r[0] for r in recvs], [x[0] for x in sends]
    for i, p in enumerate(passes):
        prev_start = passes[i - 1].t0 if i else -math.inf
        next_start = passes[i + 1].t0 if i + 1 < len(passes) else math.inf
        consumes = (p.op is F and p.stage > 0) or (p.op in (B, I) and p.stage < last)
        produces = (p.op is F and p.stage < last) or (p.op in (B, I) and p.stage > 0)
        if consumes:
            j = bisect.bisect_right(recv_posts, p.t0) - 1  # the last posted by then
            if j >= 0 and recv_posts[j] > prev_start:
                post, done, cpu_end = recvs[j]
                r = _Found(RECV_F if p.op is F else RECV_B, p.stage, p.mb, p.start, p.start, step=p.step, tie=-1)
                r.t0, r.t1 = _p2p_times(times, post, done, cpu_end)
                r.cpu = (post, cpu_end)
                extra.append(r)
        if produces:
            j = bisect.bisect_right(send_posts, p.t0)  # the first posted after it began
            if j < len(sends) and send_posts[j] <= next_start:
                post, _done, cpu_end = sends[j]
                x = _Found(SEND_F if p.op is F else SEND_B, p.stage, p.mb, p.start, p.start, step=p.step, tie=1)
                x.t0, x.t1 = _p2p_times(times, post, post, cpu_end)
                x.cpu = (post, cpu_end)
                extra.append(x)
    return extra


def _p2p_times(times: _RankTimes, post: float, done: float, cpu_end: float) -> tuple[float, float]:
    if times.gpu:
        got = times.kernels_in(post, cpu_end, comm=True)
        if got is not None:
            return got
    return post, done


# ----------------------------------------------------------------------------- unlabelled


#: Operators between passes that are not a pass's compute (allocation,
#: copies, reading a scalar, the input's split into micro-batches).
_BOOKKEEPING = frozenset(
    {
        "aten::empty",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::zeros",
        "aten::zero_",
        "aten::ones_like",
        "aten::item",
        "aten::_local_scalar_dense",
        "aten::detach",
        "aten::detach_",
        "detach_",
        "aten::to",
        "aten::_to_copy",
        "aten::copy_",
        "aten::lift_fresh",
        "aten::randn",
        "aten::rand",
        "aten::normal_",
        "aten::tensor_split",
        "aten::split",
        "aten::chunk",
        "aten::slice",
        "aten::cat",
        "aten::view",
        "aten::div_",
        "aten::set_",
        "aten::resize_",
    }
)


def _is_backward_op(name: str) -> bool:
    return name.startswith("autograd::") or name.endswith("Backward0") or name.endswith("Backward1")


def _match_schedule(traces: list[RankTrace], name: str, m: int | None, warnings: list[str]) -> list[list[_Found]]:
    """The passes of a schedule whose runtime labels none, matched against
    its per-rank order (see the module doc); per rank, in time order."""
    from pipesim.sim.strategies import ScheduleSpec, build_schedule

    if name not in MATCHABLE_SCHEDULES:
        raise TraceImportError(
            f"schedule {name!r}: only {', '.join(MATCHABLE_SCHEDULES)} (one stage per rank) can be matched "
            "against a trace without labels"
        )
    if m is None:
        raise TraceImportError(f"{traces[0].path}: the trace labels no actions: give --microbatches with --schedule")
    world = len(traces)
    try:
        sched = build_schedule(ScheduleSpec(name, stages=world, microbatches=m))
    except InputError as e:
        raise TraceImportError(f"{traces[0].path}: schedule {name} on {world} ranks, m={m}: {e}") from None
    out = []
    for trace, prog in zip(traces, sched.programs, strict=True):
        order = [a for a in prog if a.op in PASS_OPS]
        out.append(_match_rank(trace, order, name, m))
    return out


def _match_rank(trace: RankTrace, order: list[Action], name: str, m: int) -> list[_Found]:
    """One rank's passes: backwards are runs of autograd operators, and the
    forwards between two backwards are the longest runs of other operators
    there, as many as the schedule says."""
    skip = trace.table.ranges(_OPTIMIZER_LABEL) + trace.table.ranges("Optimizer.zero_grad")
    steps = sorted(trace.table.ranges(_STEP_LABEL))
    items = []  # (start, end, kind): "B", "F" or "|" (a cut)
    for nm, ts, dur, _tid in trace.ops.rows():
        if nm in _BOOKKEEPING or _inside(ts, skip) or (steps and not _inside(ts, steps)):
            continue
        items.append((ts, ts + dur, "B" if _is_backward_op(nm) else "F"))
    for ev in trace.table.select(COMM_PREFIXES):
        items.append((ev.ts, ev.ts, "|"))
    for s, e in steps:  # a step's edges cut too
        items += [(s, s, "|"), (e, e, "|")]
    items.sort(key=lambda x: (x[0], x[2] != "|"))
    runs: list[list] = []  # [kind, start, end, busy]
    current = None
    for s, e, kind in items:
        if kind == "|":
            current = None
            continue
        if current is not None and current[0] == kind:
            current[2] = max(current[2], e)
            current[3] += e - s
        else:
            current = [kind, s, e, e - s]
            runs.append(current)
    backwards = [r for r in runs if r[0] == "B"]
    per_step = sum(1 for a in order if a.op is not F)
    if not per_step or len(backwards) % per_step:
        raise TraceImportError(
            f"{trace.path}: cannot match rank {trace.rank}'s compute to {name}'s order: found {len(backwards)} "
            f"backward runs, not a multiple of the {per_step} its order has per step"
        )
    k = len(backwards) // per_step
    expected = order * k
    found: list[_Found] = []
    bi = 0
    cursor = -math.inf
    pending_f: list[tuple[Action, int]] = []  # forwards still to place, with their step

    forwards = [r for r in runs if r[0] == "F"]
    forward_starts = [r[1] for r in forwards]

    def take_forwards(until: float, want: list[tuple[Action, int]]) -> None:
        lo = bisect.bisect_right(forward_starts, cursor)
        hi = bisect.bisect_left(forward_starts, until)
        cands = forwards[lo:hi]
        if len(cands) < len(want):
            raise TraceImportError(
                f"{trace.path}: cannot match rank {trace.rank}'s compute to {name}'s order: "
                f"{len(want)} forward(s) expected before {'the end' if until == math.inf else 'a backward'} "
                f"at {until:.0f} us, found {len(cands)}"
            )
        chosen = sorted(sorted(cands, key=lambda r: -r[3])[: len(want)], key=lambda r: r[1])
        for (a, t), r in zip(want, chosen, strict=True):
            found.append(_Found(F, a.stage, a.microbatch, r[1], r[2], step=t))

    for pos, a in enumerate(expected):
        t = pos // len(order)
        if a.op is F:
            pending_f.append((a, t))
            continue
        run = backwards[bi]
        bi += 1
        take_forwards(run[1], pending_f)
        pending_f = []
        found.append(_Found(B, a.stage, a.microbatch, run[1], run[2], step=t))
        cursor = run[2]
    if pending_f:
        take_forwards(math.inf, pending_f)
    for f in found:
        f.t0, f.t1 = f.start, f.end
    found.sort(key=lambda f: f.start)
    return found


def _inside(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(s <= t <= e for s, e in windows)


# ----------------------------------------------------------------------------- the run


def import_run(
    paths: Sequence,
    *,
    schedule: str | None = None,
    microbatches: int | None = None,
    mapping: str | re.Pattern | None = None,
    progress: Callable[[int], None] | None = None,
    traces: list[RankTrace] | None = None,
    workers: int | None = None,
) -> ImportedRun:
    """Import a run from its traces, one per rank (see the module doc).

    ``schedule`` (``gpipe`` or ``1f1b``) with ``microbatches`` matches a
    trace that labels no action against that schedule's order;
    ``microbatches`` otherwise checks the m the trace shows. ``mapping`` is
    the regular expression of a user's own labels. ``progress`` receives
    byte counts as the files are read (:func:`~pipesim.validate.kineto.read_run`);
    ``traces`` skips the reading (traces already read); ``workers`` is
    :func:`~pipesim.validate.kineto.read_run`'s. Bad input raises a
    one-line :class:`~pipesim.sim.errors.InputError` naming the file.
    """
    from pipesim.sim._gc import gc_paused

    with gc_paused():  # bulk construction of events, actions and spans (see pipesim.sim._gc)
        return _import_run(paths, schedule, microbatches, mapping, progress, traces, workers)


def _prefetch_torch() -> None:
    """Import torch's pipelining schedules (for ``_Action.from_str``) on a
    thread: while child processes read the traces this process is idle, and
    importing torch takes seconds."""
    import threading

    def load() -> None:
        try:
            import torch.distributed.pipelining.schedules  # noqa: F401
        except Exception:  # noqa: BLE001, S110 -- imported again, and reported, where it is needed
            pass

    threading.Thread(target=load, name="pipesim-torch-import", daemon=True).start()


def _import_run(paths, schedule, microbatches, mapping, progress, traces, workers) -> ImportedRun:
    regex = _compile_mapping(mapping)
    if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)):
        raise TraceImportError(f"microbatches must be a whole number, got {microbatches!r}")
    if microbatches is not None and microbatches < 1:
        raise TraceImportError(f"microbatches must be >= 1, got {microbatches}")
    if traces is None:
        if "torch" not in sys.modules and plan_workers(paths, workers) > 1:
            _prefetch_torch()
        traces = read_run(paths, progress, workers=workers)
    _check_devices(traces)
    warnings: list[str] = []
    files = [{"file": t.path.name, "rank": t.rank, "json_bytes": t.json_bytes, "events": t.events_read} for t in traces]
    device = "cuda" if any(t.has_gpu for t in traces) else "cpu"
    reader = _LabelReader(regex)
    found = [_labelled(t, reader) for t in traces]
    source = "none"
    if any(found):
        empty = [t for t, f in zip(traces, found, strict=True) if not f]
        if empty:
            others = [t.rank for t, f in zip(traces, found, strict=True) if f]
            raise TraceImportError(
                f"{empty[0].path}: no pipeline actions on rank {empty[0].rank}, though rank(s) "
                f"{', '.join(map(str, others[:6]))} have them"
            )
        if schedule is not None:
            warnings.append(f"the traces label their actions: --schedule {schedule} was not needed and is ignored")
        kinds = sorted(reader.kinds)
        source = "pipesim" if "pipesim" in kinds else kinds[0] if len(kinds) == 1 else "+".join(kinds)
        steps = [_segment_steps(t, f, warnings) for t, f in zip(traces, found, strict=True)]
    elif regex is not None:
        raise TraceImportError(f"{traces[0].path}: no label matches the mapping regex {regex.pattern!r}")
    elif schedule is not None:
        matched = _match_schedule(traces, schedule, microbatches, warnings)
        source = f"schedule:{schedule}"
        steps = []
        for ranks_passes in matched:
            per: dict[int, list[_Found]] = defaultdict(list)
            for a in ranks_passes:
                per[a.step].append(a)
            steps.append([per[t] for t in sorted(per)])
    else:
        return _no_pipeline(traces, warnings, files, device)
    del found  # the steps hold what is kept of it (the run's actions are its largest objects)
    steps = _align_steps(traces, steps, warnings)
    if not steps[0]:
        raise TraceImportError(f"{traces[0].path}: no complete step: every step lacks some of the rank's actions")
    return _pipeline(traces, steps, microbatches, warnings, files, device, source)


def _pipeline(traces, steps, microbatches, warnings, files, device, source) -> ImportedRun:
    """Time the actions found, build the schedule and the measured result."""
    k = len(steps[0])
    # pipesim's runtime awaits a pass's inputs before the pass's label opens
    times = [_RankTimes(t, trim=source != "pipesim") for t in traces]
    m_step, m, restart, iterations = _microbatches(traces, steps, microbatches, source)
    stage_count = _stage_count(steps)
    actions: list[list[_Found]] = []
    untimed = 0
    for r, (trace, rank_steps) in enumerate(zip(traces, steps, strict=True)):
        acts = []
        for t, step in enumerate(rank_steps):
            for a in step:
                a.step = t
                a.base = t * m_step if restart else 0
                a.gmb = None if a.mb is None else a.mb + a.base
                acts.append(a)
        if not source.startswith("schedule:"):
            untimed += _time_actions(times[r], acts)
        if not any(a.op in P2P for a in acts):
            passes = [a for a in acts if a.op in PASS_OPS]
            extra = _attach_p2p(times[r], passes, stage_count)
            for e in extra:
                e.base = e.step * m_step if restart else 0
                e.gmb = None if e.mb is None else e.mb + e.base
            acts += extra
        # execution order: where each label starts on the CPU; a send or a
        # receive found inside or around a pass's range (GPipe, 1F1B) goes
        # right after or right before that pass
        acts.sort(key=lambda a: (a.start, a.tie))
        actions.append(acts)
    steps.clear()  # ``actions`` holds them now: let each rank's go once its spans are made (_result)
    if untimed:
        warnings.append(f"{untimed} action(s) launched no GPU kernel: timed by their CPU range")
    _check_placement(traces, actions)
    updates = _optimizer_updates(traces, times, actions, k)
    del times
    offsets, pairs = _clock_offsets(actions, warnings)
    recorded = _recorded_offsets(traces)
    if recorded is not None:
        offsets = recorded
    boundaries, waits = _transfers(pairs, offsets)
    del pairs  # the transfers' times are on their actions now (and the schedule's parse holds much at once)
    schedule = _schedule(traces, actions, m, iterations, source, warnings)
    result, blocking = _result(traces, schedule, actions, updates, offsets, source, device)
    per_rank = _pipeline_stats(result, waits, len(traces))
    iterations = schedule.num_iterations
    return ImportedRun(
        result=result,
        per_rank=per_rank,
        found_pipeline=True,
        steps=iterations,
        warnings=warnings,
        source=source,
        microbatches=m,
        stage_times=stage_times(result),
        boundaries=boundaries,
        clock_offsets_s=[round_sig(o * _US) for o in offsets],
        files=files,
        device=device,
        blocking=blocking,
    )


#: The shortest CPU range of a send or receive that :attr:`ImportedRun.blocking` lists (µs).
BLOCKING_MIN_US = 50.0


def _stage_count(steps) -> int:
    return 1 + max(a.stage for rank_steps in steps for step in rank_steps for a in step)


def _microbatches(traces, steps, given: int | None, source: str) -> tuple[int, int, bool, int]:
    """(ids per step, m, whether ids restart every step, iterations).

    torch numbers every step's micro-batches from 0; pipesim's runtime
    numbers them across iterations, so there a step's ids go on from the
    previous step's and its updates tell how many iterations it held."""
    ids = [a.mb for rank_steps in steps for a in rank_steps[0] if a.op in PASS_OPS and a.mb is not None]
    if not ids:
        raise TraceImportError(f"{traces[0].path}: the actions found hold no forward or backward pass")
    m_step = max(ids) + 1
    k = len(steps[0])
    restart = source != "pipesim"
    if source == "pipesim" and k > 1:
        later = [a.mb for a in steps[0][1] if a.op in PASS_OPS and a.mb is not None]
        restart = bool(later) and min(later) < m_step
    every = [a.mb for rank_steps in steps for st in rank_steps for a in st if a.op in PASS_OPS and a.mb is not None]
    total = k * m_step if restart else max(every) + 1
    if given is not None:
        if (m_step if restart else total) % given:
            raise TraceImportError(
                f"{traces[0].path}: the trace's steps run micro-batches 0..{m_step - 1}, which is not whole "
                f"iterations of --microbatches {given}"
            )
        return m_step, given, restart, total // given
    m = m_step
    if source == "pipesim":  # the updates per stage tell the iterations
        ups: dict[tuple, int] = defaultdict(int)
        for st in steps[0]:
            for a in st:
                if a.op is UPDATE:
                    ups[(a.replica, a.stage)] += 1
        n = max(ups.values(), default=0)
        if n and total % n == 0:
            m = total // n
    return m_step, m, restart, max(1, total // m)


def _check_placement(traces, actions) -> None:
    where: dict[tuple[int, int], int] = {}
    for r, acts in enumerate(actions):
        for a in acts:
            if a.op in PASS_OPS:
                prev = where.setdefault((a.replica, a.stage), r)
                if prev != r:
                    raise TraceImportError(
                        f"{traces[r].path}: stage {a.stage} runs on ranks {prev} and {r}: the traces hold several "
                        "pipelines (data parallelism across pipelines); import the ranks of one pipeline"
                    )


def _optimizer_updates(traces, times, actions, k: int) -> dict[int, list[tuple[int, int, float, float]]]:
    """Per rank: (step, stage, t0, t1) of each stage's optimizer step, from
    the ``Optimizer.step#...`` ranges after the step's last pass (and
    before the next step's first action)."""
    out: dict[int, list] = defaultdict(list)
    for r, (trace, acts) in enumerate(zip(traces, actions, strict=True)):
        if any(a.op is UPDATE for a in acts):
            continue  # pipesim labels its own updates
        opt = sorted(trace.table.ranges(_OPTIMIZER_LABEL))
        if not opt:
            continue
        opt_starts = [s for s, _ in opt]
        per_step: dict[int, list[_Found]] = defaultdict(list)
        for a in acts:
            per_step[a.step].append(a)
        for t in range(k):
            step = per_step.get(t, [])
            pass_ends = [a.t1 for a in step if a.op in PASS_OPS]
            if not pass_ends:
                continue
            last = max(pass_ends)
            nxt = per_step.get(t + 1)
            until = min(a.start for a in nxt) if nxt else math.inf
            lo = bisect.bisect_left(opt_starts, last)
            hi = bisect.bisect_left(opt_starts, until)
            ranges = opt[lo:hi]
            stages: list[int] = []
            for a in step:  # the stages in the order their last backward ran
                if a.op in (B, W):
                    if a.stage in stages:
                        stages.remove(a.stage)
                    stages.append(a.stage)
            if not ranges or not stages:
                continue
            if len(ranges) == len(stages):
                spans = [times[r].compute(s, e)[:2] for s, e in ranges]
            else:
                s0, e0 = times[r].compute(ranges[0][0], ranges[-1][1])[:2]
                width = (e0 - s0) / len(stages)
                spans = [(s0 + i * width, s0 + (i + 1) * width) for i in range(len(stages))]
            for stage, (s, e) in zip(stages, spans, strict=True):
                out[r].append((t, stage, s, e))
    return out


def _clock_offsets(actions, warnings) -> tuple[list[float], dict]:
    """Each rank's clock minus rank 0's (µs), from the matched pairs (see the
    module doc); and the pairs: send key -> (send, recv, send rank, recv rank)."""
    recvs = {}
    for r, acts in enumerate(actions):
        for a in acts:
            if a.op is RECV_F:
                recvs[(SEND_F, a.replica, a.stage - 1, a.stage, a.gmb)] = (a, r)
            elif a.op is RECV_B:
                recvs[(SEND_B, a.replica, a.stage + 1, a.stage, a.gmb)] = (a, r)
    pairs = {}
    for rs, acts in enumerate(actions):
        for s in acts:
            if s.op is SEND_F or s.op is SEND_B:
                key = (s.op, s.replica, s.stage, s.stage + (1 if s.op is SEND_F else -1), s.gmb)
                got = recvs.pop(key, None)
                if got is not None and got[1] != rs:
                    pairs[key] = (s, got[0], rs, got[1])
    del recvs
    n = len(actions)
    upper: dict[tuple[int, int], float] = {}  # (a, b) -> bound on clock(b) - clock(a)
    for s, rcv, a, b in pairs.values():
        bound = rcv.t1 - s.t0
        upper[(a, b)] = min(upper.get((a, b), math.inf), bound)
    offsets: list[float | None] = [None] * n
    offsets[0] = 0.0
    frontier = [0]
    while frontier:
        a = frontier.pop()
        for b in range(n):
            if offsets[b] is not None:
                continue
            hi = upper.get((a, b), math.inf)  # x = clock(b) - clock(a) <= hi
            lo = -upper.get((b, a), math.inf)  # x >= -(recv_end(a) - send_post(b))
            if hi == math.inf and lo == -math.inf:
                continue
            if lo <= 0.0 <= hi:
                x = 0.0
            elif lo > hi:
                x = (lo + hi) / 2
                warnings.append(
                    f"the clocks of ranks {a} and {b} disagree with causality by {(lo - hi) * _US * 1e3:.3f} ms "
                    "(a transfer that ends before it starts): offset set half way"
                )
            elif hi == math.inf:
                x = lo
            elif lo == -math.inf:
                x = hi
            else:
                x = (lo + hi) / 2
            offsets[b] = offsets[a] + x
            frontier.append(b)
    if any(o is None for o in offsets):
        lone = [r for r, o in enumerate(offsets) if o is None]
        warnings.append(f"rank(s) {', '.join(map(str, lone))} share no transfer with the others: clocks taken as equal")
    return [o or 0.0 for o in offsets], pairs


def _recorded_offsets(traces) -> list[float] | None:
    """Each rank's clock minus rank 0's (µs) as pipesim's runtime recorded it
    (``pipesimInfo.clock_offset_ns``: what a rank adds to its stamps to put
    them on rank 0's clock), when every trace has it."""
    got = []
    for t in traces:
        info = t.metadata.get("pipesimInfo")
        off = info.get("clock_offset_ns") if isinstance(info, dict) else None
        if not isinstance(off, (int, float)):
            return None
        got.append(-off / 1e3)
    return [g - got[0] for g in got]


def _check_devices(traces) -> None:
    """pipesim's single-device mode writes every device into one trace,
    whose devices its labels cannot tell apart."""
    for t in traces:
        info = t.metadata.get("pipesimInfo")
        devices = info.get("devices") if isinstance(info, dict) else None
        if isinstance(devices, list) and len(devices) > 1:
            raise TraceImportError(
                f"{t.path}: holds pipesim devices {', '.join(map(str, devices[:8]))} of a single-device run, whose "
                "actions the trace does not place; import the traces of a run on one rank per device"
            )


def _schedule(traces, actions, m: int, iterations: int, source: str, warnings) -> Schedule:
    """The found actions as a pipesim schedule, in each rank's execution order."""
    from pipesim.sim.interchange import schedule_from_csv
    from pipesim.sim.ir.checks import validate

    if source == "pipesim":
        from pipesim.sim.interchange import schedule_from_runs

        runs = [[Action(a.op, a.stage, a.gmb, a.version, a.distance, a.replica) for a in acts] for acts in actions]
        schedule = schedule_from_runs(runs, microbatches=m, iterations=iterations)
    else:
        rows = []
        for acts in actions:
            cells = []
            for a in acts:
                if a.op is REDUCE_GRAD:
                    continue  # pipesim's flush IR folds it into the update
                if a.op is OVERLAP_F_B and a.subs:
                    (fo, fs, fm), (bo, bs, bm) = a.subs
                    f = format_action(Action(fo, fs, None if fm is None else fm + a.base))
                    b = format_action(Action(bo, bs, None if bm is None else bm + a.base))
                    cells.append(f"({f};{b}){OVERLAP_F_B.value}")
                    continue
                cells.append(format_action(Action(a.op, a.stage, a.gmb)))
            rows.append(",".join(cells))
        text = "\n".join(rows) + "\n"
        try:
            schedule = schedule_from_csv(text, microbatches=m, iterations=iterations, strategy="imported", check=False)
        except ScheduleError as e:
            raise TraceImportError(f"{traces[0].path}: the actions found do not form a schedule: {e}") from None
    actions_count = sum(map(len, schedule.programs))
    if actions_count <= STRUCTURE_CHECK_MAX:
        try:
            # the checks hold the whole run's dataflow at once: past a size
            # only the structure is checked, past another nothing (the run did execute)
            validate(schedule, deadlock=actions_count <= DEADLOCK_CHECK_MAX)
        except ScheduleError as e:
            warnings.append(f"the actions found do not pass pipesim's schedule checks: {e}")
    return schedule


#: The most actions whose imported schedule gets pipesim's deadlock dry run
#: (:func:`~pipesim.sim.ir.checks.validate`), and the most whose structure is
#: checked: on 144k actions (8 ranks of 100 MB) the dry run peaked at 42 MB
#: of Python heap and the structure check at 27 MB, a third of the import's.
DEADLOCK_CHECK_MAX = 20_000
STRUCTURE_CHECK_MAX = 60_000


def _stream_of(op: Op) -> str:
    if op in (SEND_F, SEND_B):
        return "send"
    if op in (RECV_F, RECV_B):
        return "recv"
    if op in COMPUTE_OPS:
        return "compute"
    return "collective"


class _Program:
    """The schedule's actions of one device, walked in step with the actions
    found there (the schedule was built from them, in that order, with the
    updates the flush semantics add between them), so that a found action's
    schedule action (versions included) costs no index of the whole run."""

    def __init__(self, prog: tuple[Action, ...]) -> None:
        self.prog = prog
        self.pos = 0
        self.index: dict[tuple, Action] | None = None
        self.updates: dict[tuple, Action] | None = None

    def take(self, op: Op, stage: int, mb: int | None, replica: int = 0, version: int | None = None):
        prog, i = self.prog, self.pos
        while i < len(prog):
            a = prog[i]
            if a.op is op and a.stage == stage and a.microbatch == mb and a.replica == replica:
                if version is None or a.version == version:
                    self.pos = i + 1
                    return a
            if a.op is not UPDATE:
                break  # out of step: look it up
            i += 1
        if self.index is None:
            self.index = {}
            for a in prog:
                self.index.setdefault(
                    (a.op, a.stage, a.microbatch, a.replica, a.version if a.op is UPDATE else None), a
                )
        return self.index.get((op, stage, mb, replica, version if op is UPDATE else None))

    def update(self, stage: int, version: int, replica: int = 0):
        """The update of ``stage`` producing ``version`` (found apart from the walk)."""
        if self.updates is None:
            self.updates = {(a.stage, a.version, a.replica): a for a in self.prog if a.op is UPDATE}
        return self.updates.get((stage, version, replica))


def _result(traces, schedule: Schedule, actions, updates, offsets, source, device):
    """The measured SimResult, and the blocking ranges. ``actions`` is
    emptied as its spans are made, so that the found actions and the spans
    are not all held at once."""

    # the compute window, on the common clock: where the spans start from, and what bounds the others
    lo, hi = math.inf, -math.inf
    for dev, acts in enumerate(actions):
        off = offsets[dev]
        for a in acts:
            if a.op in COMPUTE_OPS or (a.op is OVERLAP_F_B and a.subs):
                lo, hi = min(lo, a.t0 - off), max(hi, a.t1 - off)
    for dev, ups in updates.items():
        for _, _, s, e in ups:
            lo, hi = min(lo, s - offsets[dev]), max(hi, e - offsets[dev])
    if lo > hi:
        raise TraceImportError(f"{traces[0].path}: no compute action of the run could be timed")
    t0, t1 = lo, hi
    spans: list[Span] = []

    def add(dev: int, stream: str, act: Action, s: float, e: float, peer=None, flow=None) -> None:
        e = max(s, e)
        if stream != "compute":  # kept inside the compute window: an FSDP no-op before the first pass
            s, e = min(max(s, t0), t1), min(max(e, t0), t1)  # must not stretch the makespan
        spans.append(Span(dev, stream, act, (s - t0) * _US, (e - t0) * _US, peer, flow))

    blocking = []
    for dev, acts in enumerate(actions):
        off = offsets[dev]
        walk = _Program(schedule.programs[dev])
        for a in acts:
            if a.op is OVERLAP_F_B and a.subs:
                walk.take(OVERLAP_F_B, a.stage, None, a.replica)
                for act, s, e in _overlap_parts(traces[dev], a, walk):
                    add(dev, "compute", act, s - off, e - off)
                continue
            if a.op is REDUCE_GRAD and source != "pipesim":
                act = Action(REDUCE_GRAD, a.stage, replica=a.replica)  # folded into the update in pipesim's IR
            else:
                act = walk.take(a.op, a.stage, a.gmb, a.replica, a.version if a.op is UPDATE else None)
            if act is None:
                continue
            add(dev, _stream_of(a.op), act, a.t0 - off, a.t1 - off, a.peer, a.flow)
            cpu = a.cpu or ((a.start, a.end) if a.op in P2P else None)  # labelled: its label's range
            if cpu is not None and cpu[1] - cpu[0] >= BLOCKING_MIN_US:
                b0, b1 = (min(max(x - off, t0), t1) for x in cpu)
                if b1 > b0:
                    name = format_action(Action(a.op, a.stage, a.gmb, replica=a.replica))
                    blocking.append((dev, name, round_sig((b0 - t0) * _US), round_sig((b1 - t0) * _US)))
        for t, stage, s, e in updates.get(dev, ()):
            act = walk.update(stage, t + 1)
            if act is not None:
                add(dev, "compute", act, s - off, e - off)
        actions[dev] = []
    spans.sort(key=lambda sp: (sp.start, sp.device, sp.stream, sp.end))
    blocking.sort()
    meta = {
        "source": source,
        "measured_on": device,
        "files": [t.path.name for t in traces],
        "backend": traces[0].run.backend,
    }
    return _measured(schedule, spans, _memory(traces, t0, offsets, len(schedule.programs)), meta), blocking


def _measured(schedule: Schedule, spans: list, memory: list, meta: dict) -> SimResult:
    """A measured timeline as a SimResult, with the weight versions its
    schedule implies where pipesim can plan them (none otherwise)."""
    from pipesim.sim.engine.trackers import version_plan

    try:
        versions, held, _ = version_plan(schedule)
    except (ScheduleError, KeyError, ValueError):
        versions, held = [], {}
    return SimResult(
        schedule=schedule,
        spans=spans,
        memory=memory,
        versions=versions,
        max_versions_held=held,
        link_bytes={},
        microbatch_size=1,
        meta=meta,
    )


def _overlap_parts(trace: RankTrace, a: _Found, walk: _Program) -> list[tuple[Action, float, float]]:
    """An OVERLAP_F_B range as its forward then its backward: cut where its
    first autograd operator starts (on any thread), else half way."""
    ops = trace.ops.starting_between(a.t0, a.t1)
    cut = next((ts for nm, ts in ops if _is_backward_op(nm)), (a.t0 + a.t1) / 2)
    out = []
    (fo, fs, fm), (bo, bs, bm) = a.subs
    for (op, st, mb), (s, e) in (((fo, fs, fm), (a.t0, cut)), ((bo, bs, bm), (cut, a.t1))):
        act = walk.take(op, st, None if mb is None else mb + a.base)
        if act is not None:
            out.append((act, s, e))
    return out


def _memory(traces, t0: float, offsets, n: int) -> list[MemoryTrack]:
    """Each device's peak from the ``[memory]`` samples (CUDA where there are any)."""
    tracks = []
    for dev in range(n):
        mem = traces[dev].memory if dev < len(traces) else {}
        cuda = {k: v for k, v in mem.items() if k[0] == 1}
        pool = cuda or mem
        peak, at = max(pool.values(), default=(0, t0 + offsets[dev] if dev < len(offsets) else t0))
        off = offsets[dev] if dev < len(offsets) else 0.0
        tracks.append(_peak_track(dev, peak, (at - off - t0) * _US if pool else 0.0))
    return tracks


def _peak_track(device: int, peak_bytes: int, peak_time_s: float) -> MemoryTrack:
    """A device's memory as a trace tells it: one measured peak, at its
    time (an empty track where nothing was sampled: ``peak_bytes`` 0)."""
    return MemoryTrack(
        device=device,
        capacity_bytes=float("inf"),
        times=[peak_time_s] if peak_bytes else [],
        totals=[peak_bytes] if peak_bytes else [],
        peak_bytes=peak_bytes,
        peak_time=peak_time_s,
        peak_breakdown={"measured": peak_bytes} if peak_bytes else {},
    )


# ----------------------------------------------------------------------------- accounting


def _dist(values: list[float]) -> dict:
    """count, mean, p50, p90 (linear interpolation between order statistics)."""
    if not values:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0}
    return {
        "count": len(values),
        "mean": round_sig(sum(values) / len(values)),
        "p50": round_sig(_quantile(values, 0.5)),
        "p90": round_sig(_quantile(values, 0.9)),
    }


def stage_times(result: SimResult) -> list[dict]:
    """Per (stage, op) of the compute spans: count, mean, p50, p90 of their durations (s)."""
    acc: dict[tuple[int, str], list[float]] = defaultdict(list)
    for s in result.by_stream()["compute"]:
        acc[(s.action.stage, s.action.op.value)].append(s.end - s.start)
    return [{"stage": st, "op": op, **_dist(v)} for (st, op), v in sorted(acc.items())]


def _transfers(pairs, offsets) -> tuple[list[dict], dict[int, float]]:
    """Time every matched pair on the common clock (each end's ``flow``:
    id, peer, start, end); per boundary (sending stage -> receiving stage, F
    or B) the transfers' durations and the receives' waits (s); per rank the
    time it had a receive posted whose data was not yet sent (their union, s)."""
    acc: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
    waits: dict[int, list] = defaultdict(list)
    # flow ids in the order the sends were found (rank by rank, in time): the same every run
    for n, (key, (s, rcv, rs, rr)) in enumerate(pairs.items()):
        op, _replica, a, b, _mb = key
        post_r, end_r = rcv.t0 - offsets[rr], rcv.t1 - offsets[rr]
        start = min(max(s.t0 - offsets[rs], post_r), end_r)
        # both ends span the transfer, each on its own rank's clock
        s.t0, s.t1, s.flow, s.peer = start + offsets[rs], end_r + offsets[rs], n, rr
        rcv.t0, rcv.t1, rcv.flow, rcv.peer = start + offsets[rr], rcv.t1, n, rs
        transfer, wait = acc[(a, b, "F" if op is SEND_F else "B", rs, rr)]
        transfer.append((end_r - start) * _US)
        wait.append((start - post_r) * _US)
        waits[rr].append((post_r * _US, start * _US))
    out = []
    for (a, b, direction, rs, rr), (transfer, wait) in sorted(acc.items()):
        out.append(
            {
                "from_stage": a,
                "to_stage": b,
                "direction": direction,
                "from_rank": rs,
                "to_rank": rr,
                "transfer_s": _dist(transfer),
                "wait_s": _dist(wait),
            }
        )
    return out, {r: _union(w) for r, w in waits.items()}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _pipeline_stats(result: SimResult, waits: dict[int, float], n: int) -> list[RankStats]:
    by_dev: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for s in result.spans:
        by_dev[s.device][s.stream].append(s)
    out = []
    for dev in range(n):
        streams = by_dev.get(dev, {})
        compute = streams.get("compute", [])
        busy = sum(s.end - s.start for s in compute)
        span = (max(s.end for s in compute) - min(s.start for s in compute)) if compute else 0.0
        comm = _union([(s.start, s.end) for k in ("send", "recv", "collective") for s in streams.get(k, [])])
        out.append(
            RankStats(
                rank=dev,
                compute_s=busy,
                communication_s=comm,
                wait_s=waits.get(dev, 0.0),
                idle_s=max(0.0, span - busy),
                span_s=span,
                actions=len(compute),
            )
        )
    return out


def _no_pipeline(traces: list[RankTrace], warnings: list[str], files, device) -> ImportedRun:
    """Per-rank compute and communication time of a trace without pipeline actions."""
    per_rank = []
    steps = 0
    for t in traces:
        windows = sorted(t.table.ranges(_STEP_LABEL))
        steps = max(steps, len(windows))
        if not windows:
            windows = [(t.start_us, t.end_us)]

        if t.has_gpu:
            k = t.kernels
            compute, comm = [], []
            for i in range(len(k)):
                s, e = k.ts[i], k.ts[i] + k.dur[i]
                if _inside(s, windows):
                    (comm if "nccl" in k.names[k.name[i]].lower() else compute).append((s, e))
        else:
            compute = [(ts, ts + d) for nm, ts, d, _ in t.ops.rows() if _inside(ts, windows)]
            comm = [(ev.ts, ev.end) for ev in t.table.select(COMM_PREFIXES) if _inside(ev.ts, windows)]
        span = sum(b - a for a, b in windows)
        busy = _union(compute)
        per_rank.append(
            RankStats(
                rank=t.rank,
                compute_s=busy * _US,
                communication_s=_union(comm) * _US,
                wait_s=0.0,
                idle_s=max(0.0, span - busy) * _US,
                span_s=span * _US,
                actions=0,
            )
        )
    warnings.append(
        "no pipeline actions found (no PP:/pipesim: labels, no Forward i/Backward i): only per-rank compute and "
        "communication time; torch's Schedule1F1B labels nothing: give --schedule 1f1b --microbatches M, and a "
        "loop of your own --mapping"
    )
    return ImportedRun(
        result=None,
        per_rank=per_rank,
        found_pipeline=False,
        steps=steps,
        warnings=warnings,
        source="none",
        files=files,
        device=device,
    )


# ----------------------------------------------------------------------------- imported.json


def imported_document(run: ImportedRun) -> dict:
    """``imported.json``: everything :func:`load_imported` needs to re-create
    the run without the traces. Spans are rows ``[device, stream, action,
    start_s, end_s, peer, flow]``; the schedule is pipesim's CSV (header
    included: :func:`~pipesim.sim.ir.core.to_csv`), from which the spans'
    actions (versions included) are parsed back. Span times are written
    exactly (Python's shortest round-tripping repr), so the re-created
    result accounts to the same figures to the last digit."""
    from pipesim.sim.ir.core import to_csv

    doc = {
        "imported_version": IMPORTED_VERSION,
        "found_pipeline": run.found_pipeline,
        "source": run.source,
        "device": run.device,
        "steps": run.steps,
        "microbatches": run.microbatches,
        "files": run.files,
        "warnings": list(run.warnings),
        "clock_offsets_s": run.clock_offsets_s,
        "per_rank": [r.to_json() for r in run.per_rank],
        "stage_times": run.stage_times,
        "boundaries": run.boundaries,
        "blocking": [list(b) for b in run.blocking],
    }
    res = run.result
    if res is not None:
        doc["schedule_csv"] = to_csv(res.schedule)
        doc["spans"] = [
            [s.device, s.stream, format_action(s.action), s.start, s.end, s.peer, s.flow] for s in res.spans
        ]
        doc["memory"] = [
            {"device": m.device, "peak_bytes": int(m.peak_bytes), "peak_time_s": m.peak_time} for m in res.memory
        ]
        doc["meta"] = {k: res.meta[k] for k in sorted(res.meta)}
    return doc


def dumps_imported(run: ImportedRun) -> str:
    """``imported.json``'s text: sorted keys, one span per line, so the same run
    gives the same bytes."""
    doc = imported_document(run)
    spans = doc.pop("spans", None)
    text = json.dumps(doc, indent=1, sort_keys=True)
    if spans is None:
        return text + "\n"
    rows = ",\n".join("  " + json.dumps(row, separators=(",", ":")) for row in spans)
    return text[:-2] + ',\n "spans": [\n' + rows + "\n ]\n}\n"


def load_imported(path) -> ImportedRun:
    """Re-create an :class:`ImportedRun` from ``imported.json``."""
    from pipesim.sim.interchange import schedule_from_csv

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TraceImportError(f"{path}: cannot read imported.json: {e}") from None
    if not isinstance(doc, dict) or doc.get("imported_version") != IMPORTED_VERSION:
        raise TraceImportError(f"{path}: not an imported.json of version {IMPORTED_VERSION}")
    result = None
    if doc.get("found_pipeline") and "schedule_csv" in doc:
        schedule = schedule_from_csv(doc["schedule_csv"], check=False)
        spans = [
            Span(dev, stream, parse_action(act), start, end, peer, flow)
            for dev, stream, act, start, end, peer, flow in doc.get("spans", [])
        ]
        memory = [_peak_track(m["device"], m["peak_bytes"], m["peak_time_s"]) for m in doc.get("memory", [])]
        result = _measured(schedule, spans, memory, dict(doc.get("meta", {})))
    return ImportedRun(
        result=result,
        per_rank=[RankStats(**r) for r in doc.get("per_rank", [])],
        found_pipeline=bool(doc.get("found_pipeline")),
        steps=int(doc.get("steps", 0)),
        warnings=list(doc.get("warnings", [])),
        source=doc.get("source", "none"),
        microbatches=doc.get("microbatches"),
        stage_times=doc.get("stage_times", []),
        boundaries=doc.get("boundaries", []),
        clock_offsets_s=doc.get("clock_offsets_s", []),
        files=doc.get("files", []),
        device=doc.get("device", "cpu"),
        blocking=[tuple(b) for b in doc.get("blocking", [])],
    )


# re-exported for callers that catch the reader's errors by this module's name
__all__ += ["TraceError"]

"""Read torch.profiler (Kineto) traces one event at a time.

A Kineto trace is one Chrome-trace JSON object per rank (``.json``, or
``.json.gz``: gzip is recognised by its magic bytes, not the name), often
hundreds of megabytes, almost all of it in the ``traceEvents`` array. This
reader never holds the document: it reads a window of text (1 MiB), decodes
one event at a time with the standard library's own JSON scanner
(``json.JSONDecoder.scan_once``, the C function behind ``json.loads``),
keeps what the importer (:mod:`pipesim.validate.traceimport`) needs and drops
the rest, so memory follows the events kept, not the file. No new
dependency: the C scanner alone reads pretty-printed Kineto JSON at 60-100
MB/s on one core of the project's 2-core machine, and the whole read at
about 57 MB per CPU-second; :func:`read_run` reads large sets with one
process per core (``pipesim bench trace`` measures it). Decoding a run of
whole events with one ``json.loads`` was tried and is slower: the many
dicts alive at once cost more than the calls they save. The cyclic garbage
collector is paused while reading (every event is a new dict).

What is kept (everything else, Python stacks, flow arrows between forward
and backward, metadata, nested operators, is dropped as it is read):

* :attr:`RankTrace.table` (:class:`EventTable`; :attr:`RankTrace.events`
  gives them as :class:`TraceEvent` s): every
  ``user_annotation`` and ``gpu_user_annotation`` range (the
  ``record_function`` labels: ``PP:0F1``, ``Forward 3``,
  ``ProfilerStep#2``, ``Optimizer.step#SGD.step``, and the process groups'
  own ``gloo:send`` / ``nccl:recv`` ranges, which on gloo run from posting
  to the ``wait()`` that completed them), and every communication operator
  (``c10d::*``, ``record_param_comms``, ``nccl:*``, ``gloo:*``), the
  ``args`` of ``record_param_comms`` only (what moved, between whom);
* :attr:`RankTrace.ops`: CPU operators not nested in another operator of
  their thread (a forward's ``aten::linear``, a backward's
  ``autograd::engine::evaluate_function: ...``), nor in a pipeline action's
  label (:data:`ACTION_LABEL_PREFIXES`, whose range is the action's time),
  in columns: what tells compute from idle where no label does;
* :attr:`RankTrace.kernels` and :attr:`RankTrace.launches`: GPU kernels,
  copies and sets (stream, correlation id) and the CUDA runtime calls that
  launched them (thread, correlation id). An action's GPU time is that of
  the kernels its CPU range launched; kernels carry the launch's
  ``correlation`` in their ``args``, the same id the ``ac2g`` flow arrows
  carry, which are kept only to recover the id of a kernel that lacks it;
* :attr:`RankTrace.memory`: the peak of the ``[memory]`` samples' ``Total
  Allocated`` per device, and when it was reached.

Everything is kept in columns, :mod:`array` s of numbers and indices into
lists of the distinct names, rather than objects (about 30 bytes an event
instead of 200), so a GPU trace's hundreds of thousands of kernels, or a
100 MB CPU trace's tens of thousands of labels, fit in a few megabytes.

Ranks and runs (:func:`read_run`): a trace's rank is its
``distributedInfo.rank`` (what torch.profiler records once the process
group exists), else a ``rank<N>`` in its file name; a set of traces is one
run when they agree on the world size, the backend and the process groups
(``distributedInfo.pg_config``: names, sizes and members), and when their
recorded windows, on the wall clock (``baseTimeNanoseconds`` plus the
events' microseconds), are no more than :data:`RUN_WINDOW_SLACK_S` apart:
the ranks of one run profile the same steps, so their windows overlap, give
or take the hosts' clock skew. Each check that fails is a one-line
:class:`TraceError` naming the file at fault.
"""

from __future__ import annotations

import bisect
import gzip
import heapq
import io
import json
import os
import re
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipesim.sim.errors import InputError

__all__ = [
    "EventTable",
    "KernelTable",
    "json_size",
    "plan_workers",
    "LaunchTable",
    "OpTable",
    "RankTrace",
    "RunIdentity",
    "TraceError",
    "TraceEvent",
    "read_rank_trace",
    "read_run",
]

#: Characters of text decoded per read: big enough that the per-read cost
#: vanishes, small enough that the window is a rounding error in memory.
CHUNK_CHARS = 1 << 20
#: The largest single event the reader will grow its window for; a JSON
#: error that persists over this much text is an error, not a window edge.
MAX_EVENT_CHARS = 16 << 20
#: How far apart (seconds, on the wall clock) the recorded windows of two
#: ranks of one run may be: they overlap when the hosts' clocks agree, and
#: NTP keeps hosts within milliseconds; a re-run is minutes away.
RUN_WINDOW_SLACK_S = 10.0

Progress = Callable[[int], None]

#: Labels of pipeline actions (torch's and pipesim's runtimes, torch's
#: GPipe): the CPU operators inside one are not kept, as the label gives the
#: action's time (an overlapped pair's are kept: where its backward starts).
ACTION_LABEL_PREFIXES = ("PP:", "pipesim:", "Forward ", "Backward ")
#: Names of the CPU-side communication operators and ranges.
COMM_PREFIXES = ("c10d::", "nccl:", "gloo:", "record_param_comms", "ProcessGroup")
_RANK_IN_NAME = re.compile(r"rank[_\-.]?(\d+)", re.IGNORECASE)
_WS = re.compile(r"[ \t\n\r]*")


class TraceError(InputError):
    """A trace file that cannot be read as one rank of one run (one line, naming the file)."""


@dataclass(slots=True)
class TraceEvent:
    """One kept event: a label range, a communication operator, a step.

    ``ts`` and ``dur`` are microseconds on the trace's own clock (as in the
    file); ``args`` is kept only for ``record_param_comms``, whose
    arguments say what moved (collective name, sizes, peers), and is
    ``None`` otherwise.
    """

    name: str
    cat: str
    ts: float
    dur: float
    pid: int | str
    tid: int | str
    args: dict | None = None

    @property
    def end(self) -> float:
        return self.ts + self.dur


class _Names:
    """Interned names: an index per distinct string (a trace has few)."""

    __slots__ = ("names", "_index")

    def __init__(self) -> None:
        self.names: list[str] = []
        self._index: dict[str, int] = {}

    def index(self, name: str) -> int:
        i = self._index.get(name)
        if i is None:
            i = self._index[name] = len(self.names)
            self.names.append(name)
        return i


@dataclass
class EventTable:
    """The kept events, as columns (see :class:`TraceEvent` for the fields):
    ``names[name[i]]``, ``cats[cat[i]]``, ``ts[i]``, ``dur[i]``,
    ``pids[pid[i]]``, ``tids[tid[i]]``, and ``args[i]`` where kept. About 30
    bytes an event instead of an object's 200: a rank's trace keeps tens of
    thousands, and a run's ranks are held at once. Iterating yields
    :class:`TraceEvent` s, in time order (start, then the longer first)."""

    names: list[str] = field(default_factory=list)
    cats: list[str] = field(default_factory=list)
    pids: list = field(default_factory=list)
    tids: list = field(default_factory=list)
    name: array = field(default_factory=lambda: array("i"))
    cat: array = field(default_factory=lambda: array("b"))
    ts: array = field(default_factory=lambda: array("d"))
    dur: array = field(default_factory=lambda: array("d"))
    pid: array = field(default_factory=lambda: array("i"))
    tid: array = field(default_factory=lambda: array("i"))
    args: dict[int, dict] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ts)

    def __iter__(self):
        return self.select()

    def select(self, prefix: str | tuple[str, ...] | None = None, cat: str | None = None):
        """The events whose name starts with ``prefix`` and whose category is
        ``cat`` (either left out: any), as :class:`TraceEvent` s; only those
        are built."""
        names = set(i for i, n in enumerate(self.names) if prefix is None or n.startswith(prefix))
        cats = set(i for i, c in enumerate(self.cats) if cat is None or c == cat)
        if not names or not cats:
            return
        nm, ct, ts, dur, pid, tid = self.name, self.cat, self.ts, self.dur, self.pid, self.tid
        every = len(names) == len(self.names) and len(cats) == len(self.cats)
        for i in range(len(ts)):
            if every or (nm[i] in names and ct[i] in cats):
                yield TraceEvent(
                    self.names[nm[i]],
                    self.cats[ct[i]],
                    ts[i],
                    dur[i],
                    self.pids[pid[i]],
                    self.tids[tid[i]],
                    self.args.get(i),
                )

    def ranges(self, prefix: str, cat: str = "user_annotation") -> list[tuple[float, float]]:
        """(start, end) of the events ``select(prefix, cat)`` gives."""
        return [(ev.ts, ev.ts + ev.dur) for ev in self.select(prefix, cat)]


@dataclass
class OpTable:
    """Top-level CPU operators (not nested in another operator of their
    thread), as columns: ``names[name[i]]``, ``ts[i]``, ``dur[i]`` (µs),
    ``tids[tid[i]]``. Sorted by thread, then start, once read."""

    names: list[str] = field(default_factory=list)
    tids: list[int | str] = field(default_factory=list)
    name: array = field(default_factory=lambda: array("i"))
    ts: array = field(default_factory=lambda: array("d"))
    dur: array = field(default_factory=lambda: array("d"))
    tid: array = field(default_factory=lambda: array("i"))
    _runs: list[tuple[int, int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.ts)

    def rows(self) -> Iterable[tuple[str, float, float, int | str]]:
        """(name, start µs, duration µs, thread) of every operator."""
        names, tids = self.names, self.tids
        for n, t, d, th in zip(self.name, self.ts, self.dur, self.tid):
            yield names[n], t, d, tids[th]

    def starting_between(self, t0: float, t1: float) -> Iterator[tuple[str, float]]:
        """(name, start µs) of the operators that start in ``[t0, t1]``,
        earliest first, every thread's: a binary search in each thread's
        run of the sorted columns, so asking once per action of a long
        trace does not scan the trace once per action."""
        return heapq.merge(*(self._starting(lo, hi, t0, t1) for lo, hi in self._thread_runs()), key=lambda r: r[1])

    def _starting(self, lo: int, hi: int, t0: float, t1: float) -> Iterator[tuple[str, float]]:
        ts, name, names = self.ts, self.name, self.names
        for i in range(bisect.bisect_left(ts, t0, lo, hi), hi):
            if ts[i] > t1:
                return
            yield names[name[i]], ts[i]

    def _thread_runs(self) -> list[tuple[int, int]]:
        """[lo, hi) of each thread's operators in the columns (sorted by
        thread, then start), found on the first call: the columns are final
        once the trace is read."""
        if self._runs is None:
            runs, lo = [], 0
            for i in range(1, len(self.tid) + 1):
                if i == len(self.tid) or self.tid[i] != self.tid[lo]:
                    runs.append((lo, i))
                    lo = i
            self._runs = runs
        return self._runs


@dataclass
class KernelTable:
    """GPU kernels, memory copies and sets, as columns (µs on the trace's
    clock, which Kineto has already put on the CPU's): ``names[name[i]]``,
    ``ts``, ``dur``, ``stream`` (the CUDA stream, -1 unknown), ``device``
    and ``correlation`` (-1 where the kernel had none)."""

    names: list[str] = field(default_factory=list)
    name: array = field(default_factory=lambda: array("i"))
    ts: array = field(default_factory=lambda: array("d"))
    dur: array = field(default_factory=lambda: array("d"))
    stream: array = field(default_factory=lambda: array("q"))
    device: array = field(default_factory=lambda: array("q"))
    correlation: array = field(default_factory=lambda: array("q"))

    def __len__(self) -> int:
        return len(self.ts)


@dataclass
class LaunchTable:
    """CUDA runtime and driver calls that put work on a GPU (kernel
    launches, asynchronous copies and sets, graph launches), as columns:
    ``correlation``, ``ts`` (µs) and ``tids[tid[i]]``."""

    tids: list[int | str] = field(default_factory=list)
    correlation: array = field(default_factory=lambda: array("q"))
    ts: array = field(default_factory=lambda: array("d"))
    tid: array = field(default_factory=lambda: array("i"))

    def __len__(self) -> int:
        return len(self.ts)


@dataclass(frozen=True)
class RunIdentity:
    """What the ranks of one run share: world size, backend and process
    groups (from ``distributedInfo``; ``None`` where the trace has none)."""

    world_size: int | None
    backend: str | None
    process_groups: tuple | None

    def differs(self, other: RunIdentity) -> str | None:
        """Why ``other`` is another run, or None."""
        if self.world_size is not None and other.world_size is not None and self.world_size != other.world_size:
            return f"world size {other.world_size}, not {self.world_size}"
        if self.backend and other.backend and self.backend != other.backend:
            return f"backend {other.backend}, not {self.backend}"
        if self.process_groups is not None and other.process_groups is not None:
            if self.process_groups != other.process_groups:
                return "its process groups (distributedInfo.pg_config) differ"
        return None


@dataclass
class RankTrace:
    """The kept content of one rank's trace (see the module doc)."""

    path: Path
    rank: int
    world_size: int | None
    run: RunIdentity
    host: str | None
    #: wall-clock nanoseconds of the trace clock's zero (``baseTimeNanoseconds``; 0 if absent)
    base_time_ns: int
    #: first and last microsecond any event covers, on the trace's clock
    start_us: float
    end_us: float
    table: EventTable
    ops: OpTable
    kernels: KernelTable
    launches: LaunchTable
    #: (device type, device id) -> (peak Total Allocated bytes, µs when reached);
    #: device type as Kineto writes it: 0 CPU, 1 CUDA
    memory: dict[tuple[int, int], tuple[int, float]]
    #: the top-level keys other than traceEvents (distributedInfo, deviceProperties, ...)
    metadata: dict
    #: characters of JSON read (its bytes, for ASCII JSON as Kineto writes it), and events decoded
    json_bytes: int = 0
    events_read: int = 0

    @property
    def events(self) -> list[TraceEvent]:
        """The kept events (:attr:`table`) as objects, built on each access."""
        return list(self.table)

    @property
    def has_gpu(self) -> bool:
        return len(self.kernels) > 0

    def window_ns(self) -> tuple[float, float]:
        """The recorded window on the wall clock (ns)."""
        return self.base_time_ns + self.start_us * 1e3, self.base_time_ns + self.end_us * 1e3


# --------------------------------------------------------------------------- reading


class _Window:
    """A sliding window of decoded text over a (possibly gzipped) file."""

    __slots__ = ("text", "raw", "buf", "pos", "eof", "consumed", "progress", "_reported", "path")

    def __init__(self, path: Path, progress: Progress | None) -> None:
        self.path = path
        try:
            self.raw = open(path, "rb")  # noqa: SIM115 -- closed by close()
        except OSError as e:
            raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
        magic = self.raw.read(2)
        self.raw.seek(0)
        binary = gzip.GzipFile(fileobj=self.raw, mode="rb") if magic == b"\x1f\x8b" else self.raw
        self.text = io.TextIOWrapper(binary, encoding="utf-8", newline="")
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.consumed = 0  # characters dropped from the front of the window
        self.progress = progress
        self._reported = 0

    def close(self) -> None:
        self.raw.close()

    def fill(self) -> bool:
        """Append the next chunk; False at the end of the file."""
        if self.eof:
            return False
        try:
            chunk = self.text.read(CHUNK_CHARS)
        except (EOFError, zlib.error) as e:
            raise TraceError(f"{self.path}: truncated or corrupt gzip data ({e})") from None
        except gzip.BadGzipFile as e:
            raise TraceError(f"{self.path}: not a gzip file, though it starts like one ({e})") from None
        except UnicodeDecodeError:
            raise TraceError(f"{self.path}: not JSON text (not UTF-8)") from None
        except OSError as e:
            raise TraceError(f"{self.path}: cannot read: {e.strerror or e}") from None
        if self.progress is not None:
            done = self.raw.tell()
            if done > self._reported:
                self.progress(done - self._reported)
                self._reported = done
        if not chunk:
            self.eof = True
            return False
        if self.pos:
            self.consumed += self.pos
            self.buf = self.buf[self.pos :] + chunk
            self.pos = 0
        else:
            self.buf += chunk
        return True

    def skip_ws(self) -> str:
        """Skip white space; the next character, '' at the end of the file."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return ""

    def offset(self) -> int:
        return self.consumed + self.pos


def _scanner():
    return json.JSONDecoder().scan_once


def _value(win: _Window, scan, what: str):
    """Decode one JSON value at the window's position, growing the window
    while the value runs past its end."""
    while True:
        if win.skip_ws() == "":
            raise TraceError(f"{win.path}: truncated: the file ends where {what} should be")
        try:
            obj, end = scan(win.buf, win.pos)
        except StopIteration as e:
            # no value where one must start: garbage, or text cut by the window's edge
            at = e.value if isinstance(e.value, int) else win.pos
            if win.eof or len(win.buf) - at > 64:
                raise TraceError(f"{win.path}: not valid JSON at character {win.consumed + at} (in {what})") from None
        except json.JSONDecodeError as e:
            if win.eof or len(win.buf) - win.pos > MAX_EVENT_CHARS:
                near_end = win.eof and e.pos >= len(win.buf) - 2
                kind = "truncated" if near_end or "Unterminated" in e.msg else "not valid JSON"
                raise TraceError(
                    f"{win.path}: {kind} at character {win.consumed + e.pos} (in {what}: {e.msg})"
                ) from None
        else:
            if end < len(win.buf) or win.eof:  # a number at the window's edge may go on in the next chunk
                win.pos = end
                return obj
        if not win.fill():
            raise TraceError(f"{win.path}: truncated: the file ends inside {what}")


def _expect(win: _Window, chars: str, what: str) -> str:
    c = win.skip_ws()
    if c == "":
        raise TraceError(f"{win.path}: truncated: the file ends inside {what}")
    if c not in chars:
        raise TraceError(
            f"{win.path}: not valid JSON at character {win.offset()}: expected {' or '.join(map(repr, chars))} "
            f"in {what}, found {c!r}"
        )
    win.pos += 1
    return c


class _Collector:
    """Keeps what the importer needs of each decoded event (see the module doc).

    :attr:`add` is built as a closure over local tables (cell variables are
    read faster than attributes): it runs once per event, a million times
    for a 250 MB trace, and its cost is the reader's second largest after
    the decoding itself.
    """

    def __init__(self) -> None:
        self.table = EventTable()
        self.event_names = _Names()
        self.event_cats = _Names()
        self.event_pids = _Names()
        self.event_tids = _Names()
        self.op_names = _Names()
        self.op_tids = _Names()
        self.ops = OpTable()
        self.kernel_names = _Names()
        self.kernels = KernelTable()
        self.launch_tids = _Names()
        self.launches = LaunchTable()
        self.memory: dict[tuple[int, int], tuple[int, float]] = {}
        self.flows: dict[tuple, int] = {}  # ac2g arrow heads: (pid, tid, ts) -> id
        self.bounds = [float("inf"), float("-inf")]
        self.counter = [0]
        self.add = self._make_add()

    @property
    def count(self) -> int:
        return self.counter[0]

    @property
    def start(self) -> float:
        return self.bounds[0]

    @property
    def end(self) -> float:
        return self.bounds[1]

    def _make_add(self):
        table = self.table
        ev_name, ev_cat, ev_ts, ev_dur = table.name.append, table.cat.append, table.ts.append, table.dur.append
        ev_pid, ev_tid, ev_args = table.pid.append, table.tid.append, table.args
        name_index, cat_index = self.event_names.index, self.event_cats.index
        pid_index, tid_index = self.event_pids.index, self.event_tids.index

        def keep(name: str, cat: str, ts: float, dur: float, pid, tid, args) -> None:
            if args is not None:
                ev_args[len(table.ts)] = args
            ev_name(name_index(name))
            ev_cat(cat_index(cat))
            ev_ts(ts)
            ev_dur(dur)
            ev_pid(pid_index(pid))
            ev_tid(tid_index(tid))

        ops = self.ops
        op_name, op_ts, op_dur, op_tid = ops.name.append, ops.ts.append, ops.dur.append, ops.tid.append
        op_name_index, op_tid_index = self.op_names.index, self.op_tids.index
        kernels, kernel_name_index = self.kernels, self.kernel_names.index
        launches, launch_tid_index = self.launches, self.launch_tids.index
        memory, flows = self.memory, self.flows
        bounds, counter = self.bounds, self.counter
        top: dict[object, tuple[float, float]] = {}  # per thread: the last top-level operator kept
        top_get = top.get
        # per thread: the range of the last action label (an operator inside
        # one is that action's, whose time the label gives: not kept)
        labelled: dict[object, tuple[float, float]] = {}
        labelled_get = labelled.get
        action_labels = ACTION_LABEL_PREFIXES
        comm = COMM_PREFIXES
        gpu_cats, runtime_cats = _GPU_CATS, _RUNTIME_CATS
        # the numbers of a decoded event are already float or int; float() on
        # them is a no-op that still costs a call, so convert only what is not
        number = float

        def add(e) -> None:
            counter[0] += 1
            ph = e.get("ph")
            if ph == "X":
                if e.get("cat") == "Operator":  # older Kineto's name for cpu_op
                    e["cat"] = "cpu_op"
                ts = e.get("ts")
                dur = e.get("dur")
                if type(ts) is not number:
                    if ts is None:
                        return
                    ts = number(ts)
                if type(dur) is not number:
                    dur = number(dur or 0.0)
                end = ts + dur
                if ts < bounds[0]:
                    bounds[0] = ts
                if end > bounds[1]:
                    bounds[1] = end
                cat = e.get("cat")
                if cat == "cpu_op":
                    name = e.get("name") or ""
                    tid = e.get("tid")
                    if name.startswith(comm):
                        args = e.get("args") if name == "record_param_comms" else None
                        keep(name, cat, ts, dur, e.get("pid"), tid, args)
                        return
                    last = top_get(tid)
                    if last is not None and last[0] <= ts and end <= last[1]:
                        return  # nested in the last operator kept on its thread
                    last = labelled_get(tid)
                    if last is not None and last[0] <= ts and end <= last[1]:
                        return  # inside an action's label
                    top[tid] = (ts, end)
                    op_name(op_name_index(name))
                    op_ts(ts)
                    op_dur(dur)
                    op_tid(op_tid_index(tid))
                elif cat == "user_annotation" or cat == "gpu_user_annotation":
                    name = e.get("name") or ""
                    tid = e.get("tid")
                    keep(name, cat, ts, dur, e.get("pid"), tid, None)
                    if cat == "user_annotation" and name.startswith(action_labels) and "OVERLAP_F_B" not in name:
                        labelled[tid] = (ts, end)
                elif cat in gpu_cats:
                    args = e.get("args") or {}
                    kernels.name.append(kernel_name_index(e.get("name") or ""))
                    kernels.ts.append(ts)
                    kernels.dur.append(dur)
                    stream = args.get("stream", e.get("tid"))
                    kernels.stream.append(stream if type(stream) is int else -1)
                    device = args.get("device", e.get("pid"))
                    kernels.device.append(device if type(device) is int else -1)
                    corr = args.get("correlation")
                    kernels.correlation.append(corr if type(corr) is int else -1)
                elif cat in runtime_cats:
                    name = e.get("name") or ""
                    if "aunch" in name or "emcpy" in name or "emset" in name:
                        corr = (e.get("args") or {}).get("correlation")
                        if type(corr) is int:
                            launches.correlation.append(corr)
                            launches.ts.append(ts)
                            launches.tid.append(launch_tid_index(e.get("tid")))
            elif ph == "i" or ph == "I":
                if e.get("name") == "[memory]":
                    args = e.get("args") or {}
                    total = args.get("Total Allocated")
                    if isinstance(total, (int, float)):
                        key = (int(args.get("Device Type", -1)), int(args.get("Device Id", -1)))
                        peak = memory.get(key)
                        if peak is None or total > peak[0]:
                            memory[key] = (int(total), number(e.get("ts") or 0.0))
            elif ph == "f" and e.get("cat") == "ac2g":
                fid = e.get("id")
                if type(fid) is int:
                    flows[(e.get("pid"), e.get("tid"), number(e.get("ts") or 0.0))] = fid

        return add

    def finish(self) -> None:
        """Names into the tables; operators sorted, nested ones that came
        out of order dropped; kernels without a correlation id given the
        id of the ac2g arrow that points at them."""
        self.ops.names, self.ops.tids = self.op_names.names, self.op_tids.names
        self.kernels.names = self.kernel_names.names
        self.launches.tids = self.launch_tids.names
        self._sort_ops()
        k = self.kernels
        if self.flows and -1 in k.correlation:
            for i, c in enumerate(k.correlation):
                if c == -1:
                    fid = self.flows.get((k.device[i], k.stream[i], k.ts[i]))
                    if fid is not None:
                        k.correlation[i] = fid
        self.flows.clear()
        t = self.table
        t.names, t.cats, t.pids, t.tids = (
            self.event_names.names,
            self.event_cats.names,
            self.event_pids.names,
            self.event_tids.names,
        )
        order = sorted(range(len(t.ts)), key=lambda i: (t.ts[i], -t.dur[i]))
        if order != list(range(len(t.ts))):
            for col in ("name", "cat", "ts", "dur", "pid", "tid"):
                old = getattr(t, col)
                setattr(t, col, array(old.typecode, (old[i] for i in order)))
            where = {old: new for new, old in enumerate(order)}
            t.args = {where[i]: a for i, a in t.args.items()}

    def _sort_ops(self) -> None:
        ops = self.ops
        order = sorted(range(len(ops.ts)), key=lambda i: (ops.tid[i], ops.ts[i], -ops.dur[i]))
        keep = []
        last_tid, last_end = None, float("-inf")
        for i in order:
            end = ops.ts[i] + ops.dur[i]
            if ops.tid[i] == last_tid and end <= last_end:
                continue  # nested in the previous kept operator of its thread
            keep.append(i)
            last_tid, last_end = ops.tid[i], end
        if keep == list(range(len(ops.ts))):
            return
        for col in ("name", "ts", "dur", "tid"):
            old = getattr(ops, col)
            setattr(ops, col, array(old.typecode, (old[i] for i in keep)))


_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"})
_RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime", "Driver", "runtime", "driver"})


def read_rank_trace(path, progress: Progress | None = None) -> RankTrace:
    """Read one rank's trace, streaming (see the module doc).

    ``progress`` is called with the number of bytes of the file, as stored
    (compressed or not), read since its previous call. A file that is not
    a Kineto trace, not JSON, truncated, or whose rank cannot be told raises
    a one-line :class:`TraceError` naming it.
    """
    from pipesim.sim._gc import gc_paused

    with gc_paused():  # every decoded event is a dict: the collector would rescan the kept ones again and again
        return _read_rank_trace(Path(path), progress)


def _read_rank_trace(path: Path, progress: Progress | None) -> RankTrace:
    win = _Window(path, progress)
    scan = _scanner()
    col = _Collector()
    meta: dict = {}
    found = False
    try:
        c = win.skip_ws()
        if c != "{":
            what = "empty" if c == "" else f"not a JSON object (it starts with {c!r})"
            raise TraceError(f"{path}: {what}; a Kineto trace is one JSON object with a traceEvents array")
        win.pos += 1
        if win.skip_ws() == "}":
            win.pos += 1
        else:
            while True:
                key = _value(win, scan, "the trace's top-level keys")
                if not isinstance(key, str):
                    raise TraceError(f"{path}: not valid JSON at character {win.offset()}: a key must be a string")
                _expect(win, ":", f"the value of {key!r}")
                if key == "traceEvents":
                    found = True
                    _read_events(win, scan, col)
                else:
                    meta[key] = _value(win, scan, f"the value of {key!r}")
                if _expect(win, ",}", "the trace's top-level object") == "}":
                    break
        if win.skip_ws() != "":
            raise TraceError(f"{path}: not valid JSON: text after the trace's object at character {win.offset()}")
    finally:
        win.close()
    if not found:
        raise TraceError(f"{path}: no traceEvents array: not a Chrome/Kineto trace")
    col.finish()
    info = meta.get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    rank = _rank_of(path, info)
    world = info.get("world_size")
    world = world if isinstance(world, int) and world > 0 else None
    if world is not None and rank >= world:
        raise TraceError(f"{path}: rank {rank} of a world of {world}")
    base = meta.get("baseTimeNanoseconds")
    return RankTrace(
        path=path,
        rank=rank,
        world_size=world,
        run=RunIdentity(world, info.get("backend"), _process_groups(info.get("pg_config"))),
        host=meta.get("host_name") if isinstance(meta.get("host_name"), str) else None,
        base_time_ns=int(base) if isinstance(base, (int, float)) else 0,
        start_us=col.start if col.count and col.start != float("inf") else 0.0,
        end_us=col.end if col.count and col.end != float("-inf") else 0.0,
        table=col.table,
        ops=col.ops,
        kernels=col.kernels,
        launches=col.launches,
        memory=col.memory,
        metadata=meta,
        json_bytes=win.consumed + len(win.buf),
        events_read=col.count,
    )


def _read_events(win: _Window, scan, col: _Collector) -> None:
    """The traceEvents array, one event at a time (the hot loop: the window
    and the position live in locals, and the window object is consulted
    only at its edge)."""
    what = "traceEvents"
    if win.skip_ws() != "[":
        raise TraceError(f"{win.path}: traceEvents is not an array")
    win.pos += 1
    if win.skip_ws() == "]":
        win.pos += 1
        return
    sep = _SEPARATOR.match
    add = col.add
    buf, pos = win.buf, win.pos
    n = len(buf)
    while True:
        try:
            obj, pos = scan(buf, pos)
        except (StopIteration, json.JSONDecodeError):
            win.pos = pos
            obj = _value(win, scan, what)  # the window's edge, or a real error: the slow path tells
            buf, pos = win.buf, win.pos
            n = len(buf)
        try:
            add(obj)
        except (ValueError, TypeError, AttributeError) as e:
            win.pos = pos
            raise TraceError(f"{win.path}: a malformed event near character {win.offset()}: {e}") from None
        m = sep(buf, pos)
        if m.lastindex:  # a comma: the next event (the scan finds the window's edge itself)
            pos = m.end()
            continue
        pos = m.end()
        if pos < n and buf[pos] == "]":
            win.pos = pos + 1
            return
        win.pos = pos
        if _expect(win, ",]", what) == "]":
            return
        win.skip_ws()
        buf, pos = win.buf, win.pos
        n = len(buf)


#: White space, a comma if there is one, white space.
_SEPARATOR = re.compile(r"[ \t\n\r]*(,)?[ \t\n\r]*")


def _rank_of(path: Path, info: dict) -> int:
    rank = info.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
        return rank
    found = _RANK_IN_NAME.findall(path.name)
    if len(found) == 1:
        return int(found[0])
    raise TraceError(
        f"{path}: cannot tell its rank: the trace has no distributedInfo.rank and its name "
        f"{'has several' if found else 'has no'} 'rank<N>'; rename it, e.g. rank0.json.gz"
    )


def _process_groups(config) -> tuple | None:
    """distributedInfo.pg_config, reduced to what every rank of a run
    records alike (names, sizes, members; not descriptions)."""
    if not isinstance(config, list):
        return None
    groups = []
    for pg in config:
        if isinstance(pg, dict):
            ranks = pg.get("ranks")
            groups.append(
                (str(pg.get("pg_name")), pg.get("pg_size"), tuple(ranks) if isinstance(ranks, list) else None)
            )
    return tuple(sorted(groups, key=repr))


def read_run(paths: Sequence, progress: Progress | None = None, *, workers: int | None = None) -> list[RankTrace]:
    """Read every rank's trace of one run; the traces by rank.

    Checks, each a one-line :class:`TraceError` naming a file: every file
    reads (:func:`read_rank_trace`); no rank appears twice; the files are
    one run (:class:`RunIdentity` and recorded windows no more than
    :data:`RUN_WINDOW_SLACK_S` apart; the odd file out is the one that
    differs from the majority); and no rank is missing, from the world size
    the traces record, else from the highest rank found.

    Decoding JSON is the whole cost and one file is one core's work, so a
    large set (:data:`PARALLEL_MIN_BYTES` or more) is read by ``workers``
    processes at once (default: one per usable core, at most one per file);
    ``workers=1`` reads in this process. ``progress`` receives byte counts
    as in :func:`read_rank_trace`, summed over the files.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise TraceError("no trace files given")
    traces = _read_all(paths, progress, workers)
    by_rank: dict[int, RankTrace] = {}
    for t in traces:
        other = by_rank.get(t.rank)
        if other is not None:
            raise TraceError(f"{t.path}: rank {t.rank} again ({other.path} is rank {t.rank} too)")
        by_rank[t.rank] = t
    _check_one_run(traces)
    worlds = {t.world_size for t in traces if t.world_size is not None}
    world = worlds.pop() if worlds else max(by_rank) + 1
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        named = ", ".join(f"{t.path.name} (rank {t.rank})" for t in sorted(traces, key=lambda t: t.rank)[:4])
        more = ", ..." if len(traces) > 4 else ""
        raise TraceError(
            f"{traces[0].path.parent}: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))} "
            f"of {world} missing: got {named}{more}"
        )
    return [by_rank[r] for r in range(world)]


#: Total bytes from which :func:`read_run` reads files in parallel processes
#: (below it, starting them costs more than it saves).
PARALLEL_MIN_BYTES = 64 << 20


def _read_all(paths: list[Path], progress: Progress | None, workers: int | None) -> list[RankTrace]:
    """Every file's trace, in the order given: in this process, or in
    ``workers`` child processes, each reading its share of the files (the
    largest first, each to the least loaded child).

    A child is a fresh interpreter running this module
    (``python -m pipesim.validate.kineto``), not a ``multiprocessing``
    worker: those re-import the caller's main script, which breaks on a
    script without a ``__main__`` guard or read from stdin, and forking a
    process that holds threads (torch's, tqdm's) is unsafe. A child prints
    its byte counts on stdout and leaves each trace, pickled, in a temporary
    file; an error in it is raised here as it was raised there.
    """
    sizes = _sizes(paths)
    workers = plan_workers(paths, workers, sizes)
    if workers == 1:
        return [read_rank_trace(p, progress) for p in paths]
    import queue
    import tempfile
    import threading

    shares: list[list[int]] = [[] for _ in range(workers)]
    load = [0] * workers
    for i in sorted(range(len(paths)), key=lambda i: -sizes[i]):
        w = load.index(min(load))
        shares[w].append(i)
        load[w] += sizes[i]
    news: queue.Queue = queue.Queue()  # ("bytes", n) | ("done", i, trace) | ("error", exc)
    procs: list = []
    lock = threading.Lock()
    out: list[RankTrace | None] = [None] * len(paths)
    with tempfile.TemporaryDirectory(prefix="pipesim-kineto-") as tmp:

        def child(share: list[int]) -> None:
            try:
                _read_in_child([paths[i] for i in share], share, tmp, news, procs, lock)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
                news.put(("error", e))

        threads = [threading.Thread(target=child, args=(share,), daemon=True) for share in shares if share]
        for t in threads:
            t.start()
        try:
            left = len(paths)
            while left:
                item = news.get()
                if item[0] == "bytes":
                    if progress is not None:
                        progress(item[1])
                elif item[0] == "done":
                    out[item[1]] = item[2]
                    left -= 1
                else:
                    raise item[1]
        finally:
            with lock:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
            for t in threads:
                t.join()
    return out  # type: ignore[return-value]


def _sizes(paths: Sequence[Path]) -> list[int]:
    """Each file's JSON size: its size, or a gzip file's uncompressed size
    from its trailer (modulo 4 GiB, as gzip records it)."""
    return [json_size(p) for p in paths]


def json_size(path) -> int:
    """Bytes of JSON in ``path``: its size, or for a gzip file the
    uncompressed size its trailer records (modulo 4 GiB)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
            size = f.seek(0, os.SEEK_END)
            if magic != b"\x1f\x8b" or size < 18:
                return size
            f.seek(-4, os.SEEK_END)
            return max(size, int.from_bytes(f.read(4), "little"))
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None


def plan_workers(paths: Sequence, workers: int | None = None, sizes: list[int] | None = None) -> int:
    """How many processes :func:`read_run` reads ``paths`` with: ``workers``
    if given (at most one per file), else one per usable core for a set of
    :data:`PARALLEL_MIN_BYTES` of JSON or more (:func:`json_size`), else 1."""
    if not paths:
        return 1
    if workers is None:
        sizes = _sizes(paths) if sizes is None else sizes
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = min(cores, len(paths)) if sum(sizes) >= PARALLEL_MIN_BYTES else 1
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise TraceError(f"workers must be a whole number >= 1, got {workers!r}")
    return min(workers, len(paths))


def _read_in_child(paths: list[Path], indices: list[int], tmp: str, news, procs: list, lock) -> None:
    """Read ``paths`` in a child interpreter (see :func:`_read_all`); each
    trace goes to ``news`` as ``("done", index, trace)`` once read."""
    import pickle
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pipesim.validate.kineto", tmp]
    cmd += [f"{i}={p}" for i, p in zip(indices, paths, strict=True)]
    with lock:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
    errors: list[str] = []
    reader = threading_reader(proc.stderr, errors)
    for line in proc.stdout:
        kind, _, value = line.strip().partition(" ")
        if kind == "bytes":
            news.put(("bytes", int(value)))
        elif kind == "done":
            with open(os.path.join(tmp, f"{value}.pkl"), "rb") as f:
                news.put(("done", int(value), pickle.load(f)))
    code = proc.wait()
    reader.join()
    if code == _CHILD_INPUT_ERROR:
        with open(os.path.join(tmp, "error.pkl"), "rb") as f:
            raise pickle.load(f)
    if code != 0:
        tail = "".join(errors)[-2000:]
        raise RuntimeError(f"reading {', '.join(map(str, paths))} in a child process failed (exit {code}):\n{tail}")


def threading_reader(stream, into: list):
    """A thread that collects ``stream``'s text into ``into`` (so a child
    never blocks on a full stderr pipe)."""
    import threading

    t = threading.Thread(target=lambda: into.extend(stream), daemon=True)
    t.start()
    return t


#: A child's exit code for bad input (its TraceError is in the result file).
_CHILD_INPUT_ERROR = 3


def _child_main(argv: list[str]) -> int:
    """``python -m pipesim.validate.kineto TMP INDEX=PATH ...``: read each
    trace, printing ``bytes N`` lines as it goes and ``done INDEX`` once the
    trace is pickled into ``TMP/INDEX.pkl``; an input error is pickled into
    ``TMP/error.pkl`` (exit 3)."""
    import pickle
    import sys

    tmp, *jobs = argv
    pending = [0]

    def counted(n: int) -> None:
        pending[0] += n
        if pending[0] >= 1 << 20:
            sys.stdout.write(f"bytes {pending[0]}\n")
            sys.stdout.flush()
            pending[0] = 0

    for job in jobs:
        index, _, path = job.partition("=")
        try:
            trace = read_rank_trace(path, counted)
        except InputError as e:
            with open(os.path.join(tmp, "error.pkl"), "wb") as f:
                pickle.dump(e, f, protocol=pickle.HIGHEST_PROTOCOL)
            return _CHILD_INPUT_ERROR
        with open(os.path.join(tmp, f"{index}.pkl"), "wb") as f:
            pickle.dump(trace, f, protocol=pickle.HIGHEST_PROTOCOL)
        if pending[0]:
            sys.stdout.write(f"bytes {pending[0]}\n")
            pending[0] = 0
        sys.stdout.write(f"done {index}\n")
        sys.stdout.flush()
    return 0


def _check_one_run(traces: list[RankTrace]) -> None:
    """The traces' identities and windows agree (see :func:`read_run`)."""
    # the identity most traces share is the run's (ties: the first file's)
    tally: dict[RunIdentity, int] = {}
    for t in traces:
        tally[t.run] = tally.get(t.run, 0) + 1
    best = max(tally.values())
    run = next(t.run for t in traces if tally[t.run] == best)
    ref = next(t for t in traces if t.run == run)
    for t in traces:
        why = run.differs(t.run)
        if why:
            raise TraceError(f"{t.path}: from another run than {ref.path.name}: {why}")
    timed = [t for t in traces if t.base_time_ns]
    if len(timed) < 2:
        return
    slack = RUN_WINDOW_SLACK_S * 1e9

    def apart(a: tuple[float, float], b: tuple[float, float]) -> float:
        return max(a[0] - b[1], b[0] - a[1], 0.0)

    # the window within the slack of most others is the run's; a trace whose
    # window is further from it was recorded at another time
    anchor = max(timed, key=lambda t: sum(apart(t.window_ns(), u.window_ns()) <= slack for u in timed))
    for t in timed:
        gap = apart(anchor.window_ns(), t.window_ns())
        if gap > slack:
            raise TraceError(
                f"{t.path}: from another run than {anchor.path.name}: recorded {gap / 1e9:.0f} s apart "
                f"(the ranks of one run record the same steps)"
            )


if __name__ == "__main__":
    import sys

    # through the module's own name, so that what the child pickles is
    # pipesim.validate.kineto.RankTrace, not __main__.RankTrace
    from pipesim.validate.kineto import _child_main as main

    sys.exit(main(sys.argv[1:]))

"""Write one output file in a forked child while this process goes on.

A large run's trace.json is its slowest output: about a microsecond of
formatting per span, 0.8 s for the 389k spans of 1F1B with p = 64 and
m = 1,024, as long as the summary and timeline.html together. It needs
nothing they need and they need nothing from it, so on a machine with a
second core it is written by a child forked after the simulation (the
result is shared copy-on-write, nothing is pickled) while the parent
summarises and draws the timeline; the command's outputs then cost the
longer of the two instead of their sum.

A writer may also start before all it needs exists: the trace needs the
spans first (formatting them is most of its work) and the memory tracks only
at the end, so ``pipesim simulate`` forks it as soon as the engine has run
(``deferred``: :meth:`Background.start` from the simulator's ``on_spans``)
and hands the memory tracks over once they are tracked
(:meth:`Background.hand_over`), taking the tracking off the child's path.

The file is byte-identical either way (the same function writes it). The
child reports a failure as its traceback, which the parent raises as
:class:`BackgroundWriteError`; when the parent fails first, the child is
killed and reaped, so no process outlives the command. Where forking is not
worth it or not safe (a small run, one usable core, a platform other than
Linux) the function simply runs in this process, in the same place of the
command.

Python 3.12 warns (a DeprecationWarning, hidden by default) when a process
with threads forks, and numpy's BLAS threads make every such process have
some. The danger is a lock held by another thread at the fork, which the
child then waits on for ever. The child here runs only Python code that
takes no lock those threads hold (it formats text and writes one file, with
no BLAS call and no logging), and leaves with ``os._exit``.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import tempfile
import traceback
from collections.abc import Callable

#: Below this many spans a trace writes in well under 0.1 s: not worth a fork.
FORK_SPANS = 50_000


class BackgroundWriteError(RuntimeError):
    """The forked writer failed; the message carries the child's traceback."""


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worth_forking(spans: int) -> bool:
    """Fork only for a big trace, on Linux (fork is its native start method;
    macOS frameworks may not survive it), with a second core to run on."""
    return spans > FORK_SPANS and sys.platform.startswith("linux") and usable_cores() >= 2


class Background:
    """Context manager: ``fn(*args)`` in a forked child if ``fork``, else
    in this process. Leaving the block waits for the child and raises
    :class:`BackgroundWriteError` if it failed.

    By default ``fn`` starts as the block is entered. With ``deferred`` it
    starts at :meth:`start`, called inside the block once ``args`` are ready,
    and takes one more argument, ``receive``: a callable returning the object
    the parent passes to :meth:`hand_over` later (blocking until then), so
    the child can begin before that object exists. Without a fork, ``fn``
    runs at :meth:`hand_over`.

    ``fn`` must only write files: the child leaves through ``os._exit``
    without flushing the standard streams it inherited (the parent's
    buffered output would otherwise appear twice) and without running
    ``atexit`` handlers.
    """

    def __init__(self, fn: Callable[..., object], *args, fork: bool, what: str, deferred: bool = False) -> None:
        self.fn = fn
        self.args = args
        self.fork = fork
        self.what = what
        self.deferred = deferred
        self.started = False
        self.pid: int | None = None
        self.read_fd: int | None = None
        #: deferred and forked: the file the handed-over object is written to
        #: (opened before the fork, so the child shares it) and the pipe
        #: that says it is there and how long it is
        self.handoff_file = None
        self.ready_fd: int | None = None

    def __enter__(self) -> Background:
        if not self.deferred:
            self.start()
        return self

    def start(self) -> None:
        """Start ``fn``: fork the child, or (not forking) run it now, unless
        it waits for :meth:`hand_over`."""
        if self.started:
            raise RuntimeError(f"the writer of {self.what} is already started")
        self.started = True
        if not self.fork:
            if not self.deferred:
                self.fn(*self.args)
            return
        args = self.args
        if self.deferred:
            self.handoff_file = tempfile.TemporaryFile()
            ready_read, self.ready_fd = os.pipe()
            args = (*args, _receiver(self.handoff_file.fileno(), ready_read))
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: write, report, leave
            os.close(read_fd)
            if self.ready_fd is not None:  # the parent's end: the child must see EOF when the parent closes it
                os.close(self.ready_fd)
            _child(self.fn, args, write_fd)
        os.close(write_fd)
        if self.deferred:
            os.close(ready_read)
        self.pid, self.read_fd = pid, read_fd

    def hand_over(self, obj) -> None:
        """Give a deferred ``fn`` the object its ``receive`` returns (starting
        it first if :meth:`start` was not called)."""
        if not self.started:
            self.start()
        if not self.fork:
            self.fn(*self.args, lambda: obj)
            return
        data = memoryview(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        written = 0
        while written < len(data):
            written += os.pwrite(self.handoff_file.fileno(), data[written:], written)
        os.write(self.ready_fd, struct.pack("<Q", len(data)))  # 8 bytes: never blocks
        self._close_handoff()

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close_handoff()  # a child still waiting for the object reads EOF and fails
        if self.pid is None:
            if exc_type is None and not self.started and self.deferred:
                raise RuntimeError(f"the writer of {self.what} was never started")
            return
        if exc_type is not None:  # the parent failed: the child's file no longer matters
            _kill(self.pid)
        report = _read_all(self.read_fd)
        os.close(self.read_fd)
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        if exc_type is not None:
            return
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            reason = report or (f"killed by signal {-code}" if code < 0 else f"exit status {code}")
            raise BackgroundWriteError(f"writing {self.what} in a child process failed:\n{reason}")

    def _close_handoff(self) -> None:
        if self.ready_fd is not None:
            os.close(self.ready_fd)
            self.ready_fd = None
        if self.handoff_file is not None:
            self.handoff_file.close()
            self.handoff_file = None


def _receiver(file_fd: int, ready_fd: int) -> Callable[[], object]:
    """The child's ``receive``: wait for the parent's word that the object
    is in the shared file, then read and unpickle it."""

    def receive():
        header = _read_all_bytes(ready_fd, 8)
        if len(header) != 8:
            raise BackgroundWriteError("the parent ended before handing its data over")
        (size,) = struct.unpack("<Q", header)
        data = bytearray()
        while len(data) < size and (chunk := os.pread(file_fd, size - len(data), len(data))):
            data += chunk
        return pickle.loads(data)

    return receive


def _read_all_bytes(fd: int, n: int) -> bytes:
    """Up to ``n`` bytes from ``fd``, fewer only at end of file."""
    chunks, got = [], 0
    while got < n and (chunk := os.read(fd, n - got)):
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _child(fn, args, write_fd: int) -> None:
    """Run in the forked child; never returns."""
    code = 0
    try:
        fn(*args)
    except BaseException:
        code = 1
        try:
            os.write(write_fd, traceback.format_exc().encode("utf-8", "replace"))
        except OSError:
            pass
    finally:
        os._exit(code)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_all(fd: int) -> str:
    """Everything the child wrote to the pipe (its traceback, or nothing),
    until it closes its end by exiting."""
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


class TraceWriter:
    """trace.json of the one result a command simulates, started as soon as
    its spans exist (pass :meth:`start` as the simulator's ``on_spans``):
    for a big run (:func:`worth_forking`) in a forked child, which formats
    the spans while this process tracks the memory, then summarises and
    draws the timeline; the memory tracks, the trace's last part, follow
    through :meth:`hand_over` once tracked (a deferred :class:`Background`).
    A small run's trace is written in this process, at :meth:`hand_over`.
    ``announce(spans)`` is called as the writer starts."""

    def __init__(self, path, *, announce: Callable[[int], None] | None = None) -> None:
        self.path = path
        self.announce = announce
        self.job: Background | None = None

    def start(self, result) -> None:
        from pipesim.experiments.trace import write_trace_once_tracked

        if self.announce is not None:
            self.announce(len(result.spans))
        self.job = Background(
            write_trace_once_tracked,
            result,
            self.path,
            fork=worth_forking(len(result.spans)),
            what=str(self.path),
            deferred=True,
        )
        self.job.start()

    def hand_over(self, result) -> None:
        """The result is tracked: give the writer its memory tracks (starting
        it first if the simulator did not)."""
        if self.job is None:
            self.start(result)
        self.job.hand_over(result.memory)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self.job is not None:
            self.job.__exit__(*exc)

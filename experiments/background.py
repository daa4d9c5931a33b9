"""Write one output file in a forked child while this process goes on.

A large run's trace.json is its slowest output: about a microsecond of
formatting per span, 0.8 s for the 389k spans of 1F1B with p = 64 and
m = 1,024, as long as the summary and timeline.html together. It needs
nothing they need and they need nothing from it, so on a machine with a
second core it is written by a child forked after the simulation (the
result is shared copy-on-write, nothing is pickled) while the parent
summarises and draws the timeline; the command's outputs then cost the
longer of the two instead of their sum.

The file is byte-identical either way (the same function writes it). The
child reports a failure as its traceback, which the parent raises as
:class:`BackgroundWriteError`; when the parent fails first, the child is
killed and reaped, so no process outlives the command. Where forking is not
worth it or not safe (a small run, one usable core, a platform other than
Linux) the function simply runs in this process, in the same place of the
command.
"""

from __future__ import annotations

import os
import signal
import sys
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
    right away in this process. Leaving the block waits for the child and
    raises :class:`BackgroundWriteError` if it failed.

    ``fn`` must only write files: the child leaves through ``os._exit``
    without flushing the standard streams it inherited (the parent's
    buffered output would otherwise appear twice) and without running
    ``atexit`` handlers.
    """

    def __init__(self, fn: Callable[..., object], *args, fork: bool, what: str) -> None:
        self.fn = fn
        self.args = args
        self.fork = fork
        self.what = what
        self.pid: int | None = None
        self.read_fd: int | None = None

    def __enter__(self) -> Background:
        if not self.fork:
            self.fn(*self.args)
            return self
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: write, report, leave
            os.close(read_fd)
            _child(self.fn, self.args, write_fd)
        os.close(write_fd)
        self.pid, self.read_fd = pid, read_fd
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.pid is None:
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

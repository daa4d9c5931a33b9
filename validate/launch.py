"""Run a function on ``world_size`` local worker processes, one per rank.

:func:`launch` is the only way the validation harness starts processes, so the
project rule "every multi-process run has a timeout and leaves no processes
behind" is enforced here once.

Design
------
* **Start method.** Workers are started with ``spawn`` (``torch.multiprocessing``):
  forking a process that has touched CUDA, or holds OpenMP/gloo threads, is
  unsafe. Spawn imports ``fn`` by name in each child, so ``fn`` must be a
  picklable top-level function; :func:`launch` checks that before it starts
  anything. Each child imports torch (about 1-2 s), which is the bulk of the
  per-launch overhead; nothing else heavy is imported on the way.

* **Rendezvous.** Every launch gets a fresh ``tempfile.mkdtemp()`` directory
  holding a ``torch.distributed.FileStore``. Unlike a ``TCPStore`` or
  ``MASTER_PORT`` there is no port to collide with concurrent launches (tests
  running in parallel, two users on one box), and no rank hosts the store, so
  a rank that finishes early does not pull the store from under the others.
  The directory, which also holds the result files, is removed afterwards.

* **Start-up data travels through a file too.** ``fn``'s ``args`` (a whole
  schedule, data sets) are pickled once into ``args.pkl`` in that directory,
  and each child is spawned with only its small :class:`_WorkerSpec` and a
  reference to ``fn`` (about 1.5 KB with CPython's own preparation data,
  within even the smallest pipe buffer Linux hands out, one 4 KiB page).
  The reason is in CPython's ``popen_spawn_posix.Popen._launch``: the
  parent writes the pickled process object into a pipe *while still holding
  the child's read end itself*, so when that payload exceeds the pipe buffer
  (64 KiB) and the child dies before reading it all (killed during its torch
  import, say), ``Process.start()`` blocks forever and no deadline can fire.
  A payload that fits the buffer is written at once whatever the child does;
  a child that dies while loading its args is a dead rank like any other.

* **Results and failures travel through files** in that directory. A worker
  ``torch.save``s its return value (atomically: temp name, then rename) or,
  if ``fn`` raises, a small pickle with the exception type, message,
  traceback text and the wall-clock time of the failure, *before* it tears
  down its process group. Files cannot deadlock the way a pipe or queue
  does when a large result meets a parent that is not reading yet, and
  writing them before teardown means the parent learns about a failure even
  when ``destroy_process_group`` then blocks on a peer stuck in a collective.

* **Failure propagation.** The parent waits on the process sentinels and
  polls the directory every few tens of milliseconds. The first failure it
  sees (an error file, or a process that exited without writing anything:
  killed, ``os._exit``, segfault) makes it terminate every other rank at
  once; waiting for the others' process-group timeouts would take minutes
  and they cannot finish anyway. It raises :class:`WorkerError` for the root
  cause: a rank that died silently (seen exiting with neither a result nor
  an error) is preferred over ranks that raised, and among raising ranks
  the earliest failure wins. A dead peer makes the others raise an error
  that only says the peer went away (:data:`_LOST_PEER`), often before the
  dead process can be reaped, so such an error waits up to a second for a
  silent death to explain it. Any other error is blamed at once: a rank
  that dies after it (NCCL's watchdog aborts the survivors of a failed
  collective) is its consequence. Within one poll the order of an error
  and a death cannot be told apart, and the death is blamed.

* **Timeouts.** The whole launch has a deadline, ``timeout_s`` from the start
  of spawning (so it includes start-up: the workers' torch import and loading
  their args; starting a process never blocks, see above); when it passes,
  every rank gets SIGTERM, then SIGKILL after a short grace, and
  :class:`LaunchTimeout` names the ranks that had not returned. Every process
  group is also created with a timeout (``pg_timeout_s``, default
  ``timeout_s``), so a hung collective raises inside the worker, with a
  traceback that says where, when that timeout is the shorter one.

* **No orphans.** All cleanup sits in ``finally`` blocks, so an exception or
  a KeyboardInterrupt in the parent still terminates and reaps every worker.
  If the parent itself is killed (SIGKILL leaves no ``finally``), workers
  die with it: on Linux through ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, which
  the kernel delivers even while a worker is blocked inside C++; elsewhere
  a daemon thread watches the parent's multiprocessing sentinel.

Workers leave through ``os._exit`` once atexit handlers have run and stdio is
flushed: interpreter teardown with torch loaded costs ~0.4 s of CPU per
process, a third of a small launch. Worker code that needs module-level
finalizers at exit (coverage measurement, for one) does not get them.

gloo ranks talk over loopback (``GLOO_SOCKET_IFNAME=lo`` on Linux unless the
variable is already set): every rank is on this host, and in containers the
hostname often resolves to an address the ranks cannot bind or reach.

NCCL: rank ``r`` uses ``cuda:{devices[r]}`` (default ``r % device_count``), is
pinned to it with ``torch.cuda.set_device`` and passes ``device_id`` to
``init_process_group`` so that communicators are created eagerly and bound to
the right GPU. Return values that contain CUDA tensors come back on the CPU:
the parent loads results with ``map_location="cpu"`` so it never initialises
CUDA itself.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as _wait_sentinels
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from pipesim.sim.errors import InputError, RunError
from pipesim.validate.allocator import keep_freed_memory

__all__ = ["BACKENDS", "LaunchContext", "LaunchError", "LaunchTimeout", "MAX_TIMEOUT_S", "WorkerError", "launch"]

BACKENDS = ("gloo", "nccl")

#: How often the parent looks for error/result files while waiting.
_POLL_S = 0.02
#: SIGTERM -> SIGKILL grace when stopping workers.
_TERM_GRACE_S = 2.0
#: How long ranks that returned may take to tear down before being killed.
_EXIT_GRACE_S = 10.0
#: How long an error that only says a peer went away waits for that peer's
#: silent death to show: a dead peer makes the others raise at once
#: ("Connection closed by peer"), while the dead process itself is reaped
#: only once its memory is torn down, which took longer than one poll on a
#: 16-core machine with CUDA loaded.
_DEATH_GRACE_S = 1.0
#: How long a process whose sentinel fired (it is exiting) may take to be
#: reaped, for its exit code; past it the code is reported unknown.
_REAP_S = 1.0
#: What an error says when it is only the symptom of a peer that went away:
#: gloo's closed or reset connection, NCCL's remote error, a store's broken
#: pipe. Only such errors wait for a silent death to explain them; any other
#: error is its own cause, and a rank that dies after it (NCCL's watchdog
#: aborts the survivors of a failed collective) is its consequence.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "remote process exited", "Broken pipe")


#: The longest timeout a launch takes: beyond it ``timedelta`` and the
#: process groups' timers overflow, and nobody waits that long (11.6 days).
MAX_TIMEOUT_S = 1e6


class LaunchError(InputError):
    """A launch this machine cannot do or arguments out of range (one line)."""


class WorkerError(RunError):
    """A worker raised or died; the first line of ``str()`` says which and why.

    ``traceback`` is the worker's formatted traceback text ("" when it died
    without raising); ``exitcode`` is the process exit code where known
    (negative: killed by that signal). ``others`` lists one-line summaries of
    ranks that also failed before they were stopped, usually as a
    consequence of the first failure.
    """

    def __init__(
        self,
        rank: int,
        summary: str,
        traceback: str = "",
        *,
        exc_type: str | None = None,
        exitcode: int | None = None,
        others: Sequence[str] = (),
    ) -> None:
        self.rank = rank
        self.summary = summary
        self.traceback = traceback
        self.exc_type = exc_type
        self.exitcode = exitcode
        self.others = tuple(others)
        text = summary
        if traceback:
            text += "\n" + traceback.rstrip("\n")
        if self.others:
            text += "\nother ranks that failed before they were stopped:\n" + "\n".join("  " + o for o in self.others)
        super().__init__(text)

    @property
    def hint(self) -> str:
        """What to try, from how the rank failed."""
        if self.exitcode is not None and self.exitcode < 0:
            return (
                "a worker was killed from outside (by a signal): if nobody stopped it, the machine may have "
                "run out of memory (see `dmesg`); try a smaller model or micro-batch"
            )
        if not self.traceback:
            return "the worker died without a Python traceback; its stderr, if any, is above"
        return f"the traceback above is rank {self.rank}'s own: fix what it names and run again"

    def __reduce__(self):  # keep picklable despite the custom signature
        return (
            _rebuild_worker_error,
            (self.rank, self.summary, self.traceback, self.exc_type, self.exitcode, self.others),
        )


def _rebuild_worker_error(rank, summary, tb, exc_type, exitcode, others):
    return WorkerError(rank, summary, tb, exc_type=exc_type, exitcode=exitcode, others=others)


class LaunchTimeout(RunError, TimeoutError):
    """Not every rank returned within ``timeout_s``; ``ranks`` are the ones that had not."""

    def __init__(self, ranks: Sequence[int], timeout_s: float) -> None:
        self.ranks = tuple(ranks)
        self.timeout_s = timeout_s
        super().__init__(
            f"launch timed out after {timeout_s:g} s; ranks still running: {list(self.ranks)} (all workers were killed)"
        )

    @property
    def hint(self) -> str:
        return (
            f"give the run more than {self.timeout_s:g} s (--timeout), run fewer iterations, "
            "or look for a rank blocked in a collective (the process-group timeout names it)"
        )

    def __reduce__(self):
        return (LaunchTimeout, (self.ranks, self.timeout_s))


@dataclass(frozen=True)
class LaunchContext:
    """What a worker needs to know about its place in the run."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout: timedelta

    def new_group(self, ranks: Sequence[int]):
        """A process group over ``ranks`` with the launch's timeout and backend.

        torch requires *every* rank of the world to call ``new_group`` for
        *every* group, in the same order, including ranks that are not
        members; create all groups up front, identically on every rank.
        """
        return dist.new_group(ranks=sorted(ranks), timeout=self.timeout, backend=self.backend)


@dataclass(frozen=True)
class _WorkerSpec:
    rank: int
    world_size: int
    backend: str
    store_path: str
    result_path: str
    error_path: str
    pg_timeout_s: float
    threads: int
    cuda_index: int | None
    parent_pid: int
    args_path: str
    core: int | None = None


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
    threads: int = 1,
    devices: Sequence[int] | None = None,
    pg_timeout_s: float | None = None,
    pin_cores: bool = False,
    keep_cores_awake: bool = False,
) -> list:
    """Run ``fn(ctx, *args)`` on ranks ``0 .. world_size-1``; their return values by rank.

    Raises :class:`WorkerError` as soon as any rank fails (the others are
    killed, not waited for) and :class:`LaunchTimeout` when the ranks have
    not all returned within ``timeout_s``. Argument errors raise
    ``ValueError``/``TypeError`` before any process is started. ``threads``
    is each worker's torch intra-op thread count: the default of one keeps
    ``world_size`` CPU workers from oversubscribing the cores.
    ``pg_timeout_s`` (default ``timeout_s``) bounds every collective; set it
    below ``timeout_s`` to have a hung collective raise, with its traceback,
    inside the worker. ``devices`` maps ranks to CUDA indices (NCCL only).
    ``pin_cores`` binds rank r (all its threads, the backend's included) to
    the r-th core this process may use (:func:`core_assignment`;
    round-robin when there are more ranks than cores): timed CPU runs then
    measure each rank on a core of its own, or, oversubscribed, on a core
    shared with known ranks, which the simulator models, instead of
    wherever the OS scheduler moves it. ``keep_cores_awake`` (with ``pin_cores``) runs a spinning
    process at the lowest priority on each rank's core, which yields the core
    to the rank at once but keeps it from idling while the rank waits for a
    message: a virtual CPU that halts comes back slower (on the CI machine a
    transformer layer ran 15% slower after a 2 ms wait, 4% with the spinner),
    which would charge a pipeline's bubbles to the compute after them.
    Return values travel through ``torch.save``/``torch.load`` and arrive
    with tensors on the CPU.
    """
    _check_args(fn, world_size, args, backend, timeout_s, threads, devices, pg_timeout_s)
    pg_timeout = float(timeout_s if pg_timeout_s is None else pg_timeout_s)
    cuda_index = _cuda_indices(backend, world_size, devices)

    tmpdir = tempfile.mkdtemp(prefix="pipesim-launch-")
    procs: list = []
    heaters: list = []
    try:
        args_path = os.path.join(tmpdir, "args.pkl")
        _write_args(args_path, args)
        if pin_cores and keep_cores_awake:
            heaters = _start_heaters(sorted(set(core_assignment(world_size) or ())))
        mp = torch_mp.get_context("spawn")
        start = time.monotonic()
        deadline = start + float(timeout_s)
        specs = [
            _WorkerSpec(
                rank=r,
                world_size=world_size,
                backend=backend,
                store_path=os.path.join(tmpdir, "store"),
                result_path=os.path.join(tmpdir, f"rank{r}.result"),
                error_path=os.path.join(tmpdir, f"rank{r}.error"),
                pg_timeout_s=pg_timeout,
                threads=threads,
                cuda_index=cuda_index[r],
                parent_pid=os.getpid(),
                args_path=args_path,
                core=_core_for(r, world_size) if pin_cores else None,
            )
            for r in range(world_size)
        ]
        for spec in specs:
            if time.monotonic() >= deadline:
                raise LaunchTimeout(range(world_size), timeout_s)
            # only the spec and fn's reference go through spawn's pipe (see "Start-up data")
            p = mp.Process(target=_worker, args=(spec, fn), name=f"pipesim-rank{spec.rank}")
            p.start()
            procs.append(p)
        try:
            _wait_for_results(procs, specs, deadline, timeout_s)
        except WorkerError as e:
            raise _with_exit_code(e, procs) from None
        _wait_for_exit(procs, deadline)
        return [torch.load(s.result_path, map_location="cpu", weights_only=False) for s in specs]
    finally:
        _stop_all(procs)
        _stop_heaters(heaters)
        shutil.rmtree(tmpdir, ignore_errors=True)


def _with_exit_code(err: WorkerError, procs) -> WorkerError:
    """``err``, or for a silent death not yet reaped (its exit code unknown)
    the same error with the code it has after a further grace: the exit
    code says whether it was killed, and by what."""
    if err.exitcode is not None or err.traceback or not 0 <= err.rank < len(procs):
        return err
    procs[err.rank].join(_TERM_GRACE_S)
    code = procs[err.rank].exitcode
    if code is None:
        return err
    return WorkerError(err.rank, _death_summary(err.rank, code), exitcode=code, others=err.others)


def _write_args(path: str, args: Sequence[Any]) -> None:
    """Pickle ``args`` once for every rank to load (see "Start-up data" above)."""
    try:
        payload = pickle.dumps(tuple(args), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise TypeError(f"launch: args must be picklable to reach spawned workers: {e}") from e
    with open(path, "wb") as f:
        f.write(payload)


def _load_args(path: str) -> tuple:
    with open(path, "rb") as f:
        return pickle.load(f)


def _check_args(fn, world_size, args, backend, timeout_s, threads, devices, pg_timeout_s) -> None:
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable, got {fn!r}")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        raise TypeError(
            f"launch: {fn!r} is defined in an interactive session; spawned workers import fn "
            "by name, so define it in a module (or a script file)"
        )
    try:
        pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 -- PicklingError, AttributeError ("local object"), TypeError
        raise TypeError(
            f"launch: fn must be a picklable top-level function (spawned workers import it by "
            f"name); lambdas and nested functions are not: {fn!r}: {e}"
        ) from None
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"launch: args must be a tuple or list, got {type(args).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise LaunchError(f"launch: world_size must be an integer >= 1, got {world_size!r}")
    if backend not in BACKENDS:
        raise LaunchError(f"launch: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    for name, v in (("timeout_s", timeout_s), ("pg_timeout_s", pg_timeout_s)):
        if v is None and name == "pg_timeout_s":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= MAX_TIMEOUT_S):
            raise LaunchError(f"launch: {name} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {v!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise LaunchError(f"launch: threads must be an integer >= 1, got {threads!r}")
    if devices is not None and backend != "nccl":
        raise LaunchError("launch: devices selects GPUs and applies only to backend='nccl'")


def _cuda_indices(backend: str, world_size: int, devices: Sequence[int] | None) -> list[int | None]:
    if backend != "nccl":
        return [None] * world_size
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise LaunchError("launch: nccl needs CUDA devices, and this machine has none visible; use backend='gloo'")
    if devices is None:
        if world_size > count:
            raise LaunchError(
                f"launch: nccl needs one CUDA device per rank: world_size {world_size} > {count} visible device(s)"
            )
        return [r % count for r in range(world_size)]
    devs = list(devices)
    if len(devs) != world_size:
        raise LaunchError(f"launch: devices has {len(devs)} entries for world_size {world_size}")
    if any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < count for d in devs):
        raise LaunchError(f"launch: devices must be CUDA indices in 0..{count - 1}, got {devs}")
    if len(set(devs)) != len(devs):
        raise LaunchError(f"launch: nccl cannot put two ranks on one GPU, got devices {devs}")
    return devs


def _wait_for_results(procs, specs, deadline: float, timeout_s: float) -> None:
    """Block until every rank has written a result; raise on the first failure or the deadline."""
    pending = set(range(len(procs)))
    while pending:
        now = time.monotonic()
        if now >= deadline:
            raise LaunchTimeout(sorted(pending), timeout_s)
        _wait_sentinels([procs[r].sentinel for r in pending], timeout=min(_POLL_S, deadline - now))
        pending -= {r for r in pending if os.path.exists(specs[r].result_path)}
        died = _silent_deaths(procs, specs, pending, deadline)
        errors = [e for e in (_read_error(s) for s in specs) if e is not None]
        if errors and not died and all(_lost_peer(e) for e in errors if e["type"] != "unknown"):
            died = _await_silent_death(
                procs,
                specs,
                pending - {e["rank"] for e in errors},
                min(deadline, time.monotonic() + _DEATH_GRACE_S),
                deadline,
            )
            errors = [e for e in (_read_error(s) for s in specs) if e is not None]  # and those raised meanwhile
        if died or errors:
            raise _root_cause(died, errors)


def _lost_peer(error: dict) -> bool:
    """Whether a rank's error only says that a peer went away (see :data:`_LOST_PEER`)."""
    return any(symptom in str(error["message"]) for symptom in _LOST_PEER)


def _exited(procs, ranks) -> list[int]:
    """The ranks whose process is exiting or has exited. Its sentinel fires
    when it closes its files, before it can be reaped; but a child it forked
    (a fork-started data loader) keeps the sentinel open after it is gone,
    so a reaped process counts too."""
    ready = set(_wait_sentinels([procs[r].sentinel for r in ranks], timeout=0)) if ranks else set()
    return [r for r in sorted(ranks) if procs[r].sentinel in ready or not procs[r].is_alive()]


def _silent_deaths(procs, specs, ranks, deadline: float) -> list[tuple[int, int | None]]:
    """``(rank, exit code)`` of the ranks that are exiting leaving neither a
    result nor an error (files written before a process exits, so looked at
    after it is seen exiting). They are given :data:`_REAP_S` together, and
    no more than to ``deadline``, to be reaped for their exit codes: None
    for one that is not."""
    died = [
        r for r in _exited(procs, ranks) if not any(map(os.path.exists, (specs[r].result_path, specs[r].error_path)))
    ]
    until = min(deadline, time.monotonic() + _REAP_S)
    for r in died:
        procs[r].join(max(0.0, until - time.monotonic()))
    return [(r, procs[r].exitcode) for r in died]


def _await_silent_death(procs, specs, ranks, until: float, deadline: float) -> list[tuple[int, int | None]]:
    """Wait until ``until`` for one of ``ranks`` to die silently, and return
    the ones that did. Looks every poll, not only when a sentinel fires (see
    :func:`_exited`)."""
    waiting = sorted(ranks)
    while waiting and (now := time.monotonic()) < until:
        _wait_sentinels([procs[r].sentinel for r in waiting], timeout=min(_POLL_S, until - now))
        ended = _exited(procs, waiting)
        died = _silent_deaths(procs, specs, ended, deadline)
        if died:
            return died
        waiting = [r for r in waiting if r not in ended]
    return []


def _read_error(spec: _WorkerSpec) -> dict | None:
    try:
        with open(spec.error_path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 -- half-visible or corrupt file: still a failure of that rank
        return {
            "rank": spec.rank,
            "type": "unknown",
            "message": f"unreadable error report ({e})",
            "traceback": "",
            "time": math.inf,
        }


def _root_cause(died: list[tuple[int, int | None]], errors: list[dict]) -> WorkerError:
    summaries = [(_death_summary(r, code), r) for r, code in died]
    summaries += [(_error_summary(e), e["rank"]) for e in sorted(errors, key=lambda e: (e["time"], e["rank"]))]
    if died:
        rank, code = died[0]
        first = WorkerError(rank, summaries[0][0], exitcode=code, others=[s for s, _ in summaries[1:]])
    else:
        e = min(errors, key=lambda e: (e["time"], e["rank"]))
        first = WorkerError(
            e["rank"],
            _error_summary(e),
            e["traceback"],
            exc_type=e["type"],
            others=[s for s, r in summaries if r != e["rank"]],
        )
    return first


def _error_summary(e: dict) -> str:
    msg = str(e["message"]).strip().splitlines()
    return f"rank {e['rank']} failed: {e['type']}: {msg[0] if msg else ''}".rstrip(": ")


def _death_summary(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        try:
            how = f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    elif code is None:
        how = f"still being torn down at least {_REAP_S:g} s after it began to exit, exit code unknown"
    else:
        how = f"exit code {code}"
    return f"rank {rank} failed: worker died without raising ({how}); its stderr, if any, is above"


def _wait_for_exit(procs, deadline: float) -> None:
    """Give ranks that returned a moment to tear down cleanly; warn about the ones that do not."""
    until = min(deadline, time.monotonic() + _EXIT_GRACE_S)
    for p in procs:
        p.join(max(0.0, until - time.monotonic()))
    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
    if stuck:
        warnings.warn(f"launch: ranks {stuck} returned but did not exit; killing them", RuntimeWarning, stacklevel=3)
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None)]
    if bad:
        warnings.warn(f"launch: ranks returned results but exited with codes {bad}", RuntimeWarning, stacklevel=3)


def _stop_all(procs) -> None:
    """SIGTERM every live worker, SIGKILL the ones that outlive the grace, reap all."""
    try:
        for p in procs:
            if p.is_alive():
                p.terminate()
        until = time.monotonic() + _TERM_GRACE_S
        for p in procs:
            p.join(max(0.0, until - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5.0)
            if p.exitcode is not None:
                p.close()


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------


_HEATER = (
    "import os, ctypes\n"
    "try:\n"
    "    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "except OSError:\n"
    "    pass\n"
    "try:\n"
    "    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # runs only when nothing else can\n"
    "except (AttributeError, OSError):\n"
    "    os.nice(19)\n"
    "while True:\n"
    "    pass\n"
)


def _start_heaters(cores) -> list:
    """One lowest-priority spinning process per core (see ``keep_cores_awake``)."""
    import subprocess

    out = []
    for core in cores:
        if core is None:
            continue
        p = subprocess.Popen(
            [sys.executable, "-c", _HEATER],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.sched_setaffinity(p.pid, {core})
        out.append(p)
    return out


def _stop_heaters(heaters) -> None:
    for p in heaters:
        p.kill()
    for p in heaters:
        p.wait()


#: A thread that sleeps 2 ms, wakes beside a busy one on its core and
#: spins: how long it keeps the core before the scheduler switches (a gap
#: of more than 50 us in its clock), median of 30 wake-ups, in seconds.
_WAKE_SLICE_PROBE = (
    "import os, statistics, time\n"
    "os.sched_setaffinity(0, {int(os.environ['PIPESIM_PROBE_CORE'])})\n"
    "runs = []\n"
    "for _ in range(30):\n"
    "    time.sleep(0.002)\n"
    "    t0 = last = time.perf_counter()\n"
    "    while True:\n"
    "        now = time.perf_counter()\n"
    "        if now - last > 50e-6 or now - t0 > 0.05:\n"
    "            break\n"
    "        last = now\n"
    "    runs.append(last - t0)\n"
    "print(statistics.median(runs))\n"
)
_BUSY = "while True:\n    pass\n"


def measure_wake_slice(core: int, timeout_s: float = 30.0) -> float:
    """Seconds a thread woken on ``core`` while another computes there runs
    before the two share it: the simulator's ``HostCpu.wake_slice_s``
    (see :class:`pipesim.sim.engine.core._Core`). Linux gives a woken thread the
    core at once and switches at a scheduler tick after its slice: 1.9–5.9 ms
    on this project's machine (4 ms ticks)."""
    import subprocess

    busy = subprocess.Popen(
        [sys.executable, "-c", _BUSY], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        os.sched_setaffinity(busy.pid, {core})
        out = subprocess.run(
            [sys.executable, "-c", _WAKE_SLICE_PROBE],
            capture_output=True,
            text=True,
            check=True,
            timeout=timeout_s,
            env={**os.environ, "PIPESIM_PROBE_CORE": str(core)},
        )
    finally:
        busy.kill()
        busy.wait()
    return float(out.stdout.split()[-1])


def core_assignment(world_size: int) -> list[int] | None:
    """The core each rank is pinned to (``pin_cores``): rank r on the r-th
    core this process may use, round-robin when there are more ranks than
    cores (so ranks that share a core are known, and the simulator's
    ``Hardware.cpu`` can give the same ranks the same core). None where
    affinity cannot be set."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return [cores[r % len(cores)] for r in range(world_size)]


def _core_for(rank: int, world_size: int) -> int | None:
    cores = core_assignment(world_size)
    return None if cores is None else cores[rank]


def _worker(spec: _WorkerSpec, fn: Callable[..., Any]) -> None:
    _die_with_parent(spec.parent_pid)
    keep_freed_memory()  # as the profiler measured: no page faults for reused memory
    failed = False
    try:
        if spec.core is not None:  # before any thread exists: they inherit it
            os.sched_setaffinity(0, {spec.core})
        torch.set_num_threads(spec.threads)
        args = _load_args(spec.args_path)
        if spec.backend == "nccl":
            device = torch.device("cuda", spec.cuda_index)
            torch.cuda.set_device(device)
            extra: dict[str, Any] = {"device_id": device}
        else:
            device = torch.device("cpu")
            extra = {}
            if (
                sys.platform.startswith("linux")
                and "GLOO_SOCKET_IFNAME" not in os.environ
                and os.path.exists("/sys/class/net/lo")
            ):
                # every rank is on this host: loopback always works, whereas the
                # hostname's address may be unroutable in containers
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        timeout = timedelta(seconds=spec.pg_timeout_s)
        store = dist.FileStore(spec.store_path, spec.world_size)
        dist.init_process_group(
            spec.backend, rank=spec.rank, world_size=spec.world_size, store=store, timeout=timeout, **extra
        )
        ctx = LaunchContext(spec.rank, spec.world_size, spec.backend, device, timeout)
        result = fn(ctx, *args)
        tmp = spec.result_path + ".tmp"
        torch.save(result, tmp)
        os.replace(tmp, spec.result_path)
    except BaseException as e:  # noqa: BLE001 -- KeyboardInterrupt and SystemExit from fn are failures too
        failed = True
        _write_error(spec, e, time.time())
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110
                pass
    _fast_exit(1 if failed else 0)


def _fast_exit(code: int) -> None:
    """Leave without interpreter teardown, which takes ~0.4 s of CPU once torch is loaded.

    atexit handlers still run (multiprocessing's among them: it reaps the
    worker's own child processes), and stdio is flushed; what is skipped is
    module teardown and the final garbage collection. The result or error
    file is already on disk and the process group destroyed.
    """
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110
                pass
        os._exit(code)


def _write_error(spec: _WorkerSpec, e: BaseException, when: float) -> None:
    cls = type(e)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    report = {
        "rank": spec.rank,
        "type": name,
        "message": str(e),
        "traceback": "".join(traceback.format_exception(e)),
        "time": when,
    }
    tmp = spec.error_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(report, f)
    os.replace(tmp, spec.error_path)


def _die_with_parent(parent_pid: int) -> None:
    """Make sure this worker cannot outlive the launching process."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    if armed:
        return
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        _wait_sentinels([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="pipesim-parent-watch", daemon=True).start()

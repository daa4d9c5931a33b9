"""``pipesim sweep``: a grid of configurations through the simulator, in parallel.

A sweep answers "which schedule, depth and micro-batch count should I run on
this model and machine" by simulating every point of a grid and keeping each
one's key figures (throughput, iteration time, bubble, peak memory, OOM,
staleness) beside its configuration: ``sweep.json``, ``sweep.csv`` and
``sweep.html`` (throughput against peak memory, see :func:`sweep_figure`).

**The grid** is one tuple of values per axis. An axis is any
:class:`~pipesim.sim.strategies.ScheduleSpec` field (strategy, stages,
microbatches, iterations, width, chunks, alpha, ..., and whatever field the
spec gains later) or a run setting (model, hardware, microbatch_size,
recompute). Values
are read by the field's type annotation, so a new field can be swept the day
it exists: ``--set NAME=V [V ...]`` on the command line (commas make a tuple:
``--set replicas=15,1 3,1``) or ``{"NAME": [values]}`` in a JSON grid file. A
field some strategies list in ``Strategy.options`` is a strategy option: it
varies only the points of the strategies that take it (as ``pipesim
compare`` passes each strategy only its options); a field no strategy lists
(stages, optimizer) applies to every point.

**Bad input and rejected points.** An unknown axis, a value of the wrong type,
an unknown strategy, model or hardware is a :class:`GridError` (one line,
exit 2) before anything runs. A point the strategy or the simulator rejects
(m < p where a schedule needs m >= p, a model that does not split, more
stages than the machine has devices) is recorded as skipped with the reason.

**Execution.** Points are dealt in chunks (:func:`chunked`) to local
processes (``--workers N``, default every usable core: this process and N - 1
workers, :func:`run_local`) or to Ray tasks (``--ray auto|ADDRESS``). Each
result carries its point's index and is stored at that index, so the output
is in grid order and byte-identical whatever the worker count or executor:
the simulator is deterministic and no timing or worker id enters a result.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import math
import os
import sys
import time
import types
import typing
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

from pipesim.experiments.cliargs import bench_main, first_line, list_choices, positive
from pipesim.sim.errors import InputError, RunError
from pipesim.sim.strategies import ScheduleSpec, check_field, get_strategy, strategies, strategy_names
from pipesim.sim.workloads.profile import check_microbatch_size

SWEEP_VERSION = 1

#: Axes that are not ScheduleSpec fields: what the schedule runs on, and
#: whether every backward recomputes its stage's forward (``simulate``'s
#: ``recompute``; off unless the grid sweeps it).
RUN_AXES: dict[str, object] = {"model": str, "hardware": str, "microbatch_size": int | None, "recompute": bool}

#: Axes a sweep has when neither a grid file nor a flag gives them. Asynchronous
#: schedules are compared over 4 iterations, in steady state (as ``pipesim compare``).
DEFAULT_GRID: dict[str, tuple] = {
    "stages": (2, 4, 8),
    "microbatches": (4, 8, 16, 32),
    "iterations": (4,),
    "model": ("uniform",),
    "hardware": ("ideal",),
}

#: The figures kept from each simulation's summary.json (its names).
KEY_FIGURES = (
    "throughput_samples_per_s",
    "iteration_time_s",
    "bubble_fraction",
    "peak_memory_bytes_max",
    "out_of_memory",
    "devices_count",
)
#: Besides the key figures: the largest staleness over the stages.
RESULT_COLUMNS = ("status", *KEY_FIGURES, "staleness_max", "reason")

#: Chunks dealt to each worker, at least: enough that the last ones to finish
#: are small (chunks go out largest first), so no worker idles long at the end.
CHUNKS_PER_WORKER = 32
#: Points per chunk, at most: a chunk is the unit an interrupted sweep waits
#: for, and Ray's or the pool's per-task cost (about a millisecond) is
#: negligible against 32 simulations.
MAX_CHUNK_POINTS = 32
#: Chunks queued on each worker process beyond the one it computes, so that
#: it never waits for this process (computing a chunk of its own) to hand it one.
QUEUED_PER_WORKER = 1
#: Points above which a sweep shows its progress bar when stderr is not a
#: terminal (a log); on a terminal it appears once the sweep has taken a second.
PROGRESS_POINTS = 500


class GridError(InputError):
    """A sweep grid that cannot run: an unknown axis or name, a value of the wrong type, an empty axis."""


class RayMissingError(InputError):
    """``--ray`` without Ray installed."""


class SweepWorkerError(RunError):
    """A local sweep worker process died (killed, out of memory)."""

    hint = "run with fewer --workers, or --workers 1 to see the failure in this process"


# ---------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------


def axis_types() -> dict[str, object]:
    """Every axis a grid may have and the type its values take, in the order
    of columns and of enumeration: ScheduleSpec's fields, then the run axes."""
    hints = typing.get_type_hints(ScheduleSpec)
    return {**{f.name: hints[f.name] for f in fields(ScheduleSpec)}, **RUN_AXES}


def option_axes() -> frozenset[str]:
    """The spec fields that are strategy options: those some strategy takes
    (``Strategy.options``). Every other field applies to every strategy."""
    return frozenset(itertools.chain.from_iterable(s.options for s in strategies()))


def _members(hint) -> tuple:
    """The alternatives of a union type (``int | None``), else ``(hint,)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _item_types(hint, count: int) -> list | None:
    """The item types of ``count`` items of a sequence type (``tuple[int, ...]``,
    ``tuple[int, int]``, ``list[int]``), or None if ``hint`` is not one or
    takes another number of items."""
    origin = typing.get_origin(hint) or hint
    if not (isinstance(origin, type) and issubclass(origin, (tuple, list, Sequence))) or origin is str:
        return None
    args = typing.get_args(hint)
    if not args or (len(args) == 2 and args[1] is Ellipsis):
        return [args[0] if args else object] * count
    return list(args) if len(args) == count else None


def parse_value(text: str, hint, axis: str):
    """A command-line value of an axis whose values have type ``hint``:
    ``4``, ``0.5``, ``true``, ``shared``, ``none`` (where None is allowed),
    and ``15,1`` for a tuple."""
    errors = []
    for member in _members(hint):
        try:
            return _parse_as(text, member)
        except ValueError as e:
            errors.append(str(e))
    raise GridError(f"{axis}: cannot read {text!r} as {' or '.join(errors)}")


def _parse_as(text: str, hint):
    if hint is type(None):
        if text.lower() in ("none", "null"):
            return None
        raise ValueError("none")
    items = text.split(",")
    item_types = _item_types(hint, len(items))
    if item_types is not None:
        return tuple(_parse_as(t.strip(), h) for t, h in zip(items, item_types, strict=True))
    if _item_types(hint, 1) is not None:
        raise ValueError(f"a tuple of {len(typing.get_args(hint))} items")
    if hint is bool:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ValueError("true or false")
    if hint is float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError("a finite number")
        return value
    if hint in (int, str):
        try:
            return hint(text)
        except ValueError:
            raise ValueError("a whole number") from None
    if hint is object:
        return text
    raise ValueError(f"a value of type {hint}")


def check_value(value, hint, axis: str):
    """``value`` (from a grid file's JSON or a library caller) checked against
    its axis's type ``hint``; sequences become tuples, so points stay
    hashable and a tuple field gets a tuple."""
    for member in _members(hint):
        ok, checked = _check_as(value, member)
        if ok:
            return checked
    raise GridError(f"sweep axis {axis}: value {json.dumps(value, default=repr)} is not of type {_type_name(hint)}")


def _check_as(value, hint) -> tuple[bool, object]:
    if hint is type(None):
        return value is None, value
    if isinstance(value, (list, tuple)):
        item_types = _item_types(hint, len(value))
        if item_types is None:
            return False, None
        checked = [_check_as(v, h) for v, h in zip(value, item_types, strict=True)]
        return all(ok for ok, _ in checked), tuple(v for _, v in checked)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return math.isfinite(value), float(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    return hint is object or (isinstance(hint, type) and isinstance(value, hint)), value


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint)


def parse_set(tokens: Sequence[str]) -> tuple[str, tuple]:
    """``["NAME=V1", "V2", ...]`` (one ``--set``) as ``(NAME, values)``."""
    name, sep, first = tokens[0].partition("=")
    if not sep or not name:
        raise GridError(f"--set {' '.join(tokens)}: expected NAME=VALUE [VALUE ...]")
    hint = _axis_type(name)
    texts = [first, *tokens[1:]] if first else list(tokens[1:])
    if not texts:
        raise GridError(f"--set {name}=: give at least one value")
    return name, tuple(parse_value(t, hint, name) for t in texts)


def _axis_type(name: str):
    types_ = axis_types()
    if name not in types_:
        raise GridError(f"unknown sweep axis {name!r}; axes: {', '.join(types_)}")
    return types_[name]


def load_grid_file(path: str | Path) -> dict[str, list]:
    """A JSON grid file: ``{"axis": [value, ...], ...}``, each value typed as
    the axis's field (a list for a tuple field: ``"replicas": [[15, 1]]``;
    :func:`make_grid` checks them)."""
    from pipesim.sim.files import parse_json, read_text

    data = parse_json(read_text(str(path), "grid", GridError), f"grid file {path}", GridError)
    if not isinstance(data, dict):
        raise GridError(f"grid file {path}: expected an object mapping axes to lists of values")
    for name, values in data.items():
        if not isinstance(values, list):
            raise GridError(f"grid file {path}: {name} must be a list of values, got {json.dumps(values)}")
    return data


def make_grid(*layers: dict[str, Sequence]) -> dict[str, tuple]:
    """The grid of :data:`DEFAULT_GRID` overlaid with ``layers`` (a grid
    file's axes, then the command line's), in axis order, each axis's values
    once; every axis, value type and name checked before any simulation."""
    merged: dict[str, Sequence] = {"strategy": tuple(strategy_names()), **DEFAULT_GRID}
    for layer in layers:
        merged.update(layer)
    for name in merged:
        _axis_type(name)  # unknown axes named before anything else
    grid = {}
    for name, hint in axis_types().items():
        if name in merged:
            values = merged[name]
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                raise GridError(f"sweep axis {name}: expected a sequence of values, got {values!r}")
            if not values:
                raise GridError(f"sweep axis {name} has no values")
            grid[name] = tuple(dict.fromkeys(check_value(v, hint, name) for v in values))
            _check_range(name, grid[name])
    for name in grid["strategy"]:
        get_strategy(name)  # a one-line StrategyError naming the choices
    _check_models(grid["model"])
    hardware_table(grid["hardware"])
    _check_options_apply(grid)
    return grid


def _check_range(axis: str, values: tuple) -> None:
    """Values no point could run (a size < 1, an unknown placement), named
    before any simulation as a flag's would be, not skipped point by point;
    what only some strategies refuse (2BW's m >= p) is still a skip."""
    for value in values:
        try:
            if axis == "microbatch_size":
                if value is not None:
                    check_microbatch_size(value)
            elif axis in ScheduleSpec.__dataclass_fields__ and axis != "strategy":
                check_field(axis, value)
        except InputError as e:
            raise GridError(f"sweep axis {axis}: {e}") from None


def _check_models(names: Iterable[str]) -> None:
    """Every catalog model, computed or measured (PipeDream's profiles)."""
    from pipesim.sim.workloads.catalog import measured_model_names, model_names

    known = model_names() + measured_model_names()
    for name in names:
        if name not in known:
            raise GridError(f"unknown model {name!r}; known: {', '.join(known)}")


def _check_options_apply(grid: dict[str, tuple]) -> None:
    """A strategy option swept for none of the swept strategies is a mistake
    (a typo in the strategy list), not a request to be ignored."""
    chosen = [get_strategy(n) for n in grid["strategy"]]
    options = option_axes()
    for name in (a for a in grid if a in options):
        if not any(name in s.options for s in chosen):
            takers = [s.name for s in strategies() if name in s.options]
            raise GridError(f"option {name} applies to none of the swept strategies; it applies to {', '.join(takers)}")


def hardware_table(names: Iterable[str]) -> dict:
    """Each hardware name (preset or file) resolved once, here, so that a
    worker on another machine (Ray) needs no file of this one."""
    from pipesim.sim.api import resolve_hardware

    return {name: resolve_hardware(name) for name in names}


def expand(grid: dict[str, tuple]) -> list[dict]:
    """Every point of ``grid``, in grid order: strategies outermost, each with
    the product of the axes that apply to it (its own options, every other
    axis)."""
    options = option_axes()
    points = []
    for name in grid["strategy"]:
        taken = get_strategy(name).options
        axes = [a for a in grid if a != "strategy" and (a not in options or a in taken)]
        for values in itertools.product(*(grid[a] for a in axes)):
            points.append({"strategy": name, **dict(zip(axes, values, strict=True))})
    return points


# ---------------------------------------------------------------------------
# Evaluating points
# ---------------------------------------------------------------------------


def evaluate_point(config: dict, hardware: dict) -> dict:
    """One point's row: its configuration, then its key figures, or
    ``status: skipped`` and the reason the strategy or simulator gave."""
    from pipesim.sim._gc import gc_paused
    from pipesim.sim.api import simulate
    from pipesim.sim.engine.metrics import summarize

    spec_fields = {k: v for k, v in config.items() if k not in RUN_AXES}
    try:
        with gc_paused():  # as every simulation: see pipesim.sim._gc
            summary = summarize(
                simulate(
                    ScheduleSpec(**spec_fields),
                    config["model"],
                    hardware[config["hardware"]],
                    microbatch_size=config.get("microbatch_size"),
                    recompute=config.get("recompute", False),
                )
            )
    except InputError as e:
        return {**config, "status": "skipped", "reason": first_line(e)}
    return {
        **config,
        "status": "ok",
        **{k: summary[k] for k in KEY_FIGURES},
        "staleness_max": max((s["staleness_max"] for s in summary["stages_info"]), default=0),
    }


def evaluate_chunk(chunk: list[tuple[int, dict]], hardware: dict) -> list[tuple[int, dict]]:
    """``(index, row)`` of each ``(index, config)``: the unit of work every
    executor ships. (No collection of the cycles simulations leave: they are
    small, 1,000 simulations with the collector off peak at 37 MiB, and a full
    collection in a process holding Ray costs 50 ms.)"""
    return [(i, evaluate_point(config, hardware)) for i, config in chunk]


def estimated_work(config: dict) -> int:
    """What a point's simulation time grows with (its stage passes and
    collective steps, as the strategy counts them); 1 if unknown."""
    from pipesim.sim.engine.size import estimate_work

    spec_fields = {k: v for k, v in config.items() if k not in RUN_AXES}
    try:
        return estimate_work(ScheduleSpec(**spec_fields)) or 1
    except (InputError, TypeError, ArithmeticError):
        return 1


def chunked(points: Sequence[dict], workers: int) -> list[list[tuple[int, dict]]]:
    """``(index, config)`` chunks, the most expensive first: at least
    :data:`CHUNKS_PER_WORKER` per worker and at most :data:`MAX_CHUNK_POINTS`
    points each, so the chunks still running at the end are cheap ones and
    no worker waits long for another."""
    order = sorted(range(len(points)), key=lambda i: (-estimated_work(points[i]), i))
    size = _chunk_size(len(points), workers)
    return [[(i, points[i]) for i in order[k : k + size]] for k in range(0, len(order), size)]


def local_workers(points: int, workers: int | None) -> int:
    """The local processes a sweep of ``points`` runs on when asked for
    ``workers`` (None: every usable core): no more than it has chunks, since
    a process with no chunk only costs its start."""
    workers = workers or usable_cores()
    return max(1, min(workers, -(-points // _chunk_size(points, workers))))


def _chunk_size(points: int, workers: int) -> int:
    """Points per chunk (:func:`chunked`)."""
    return max(1, min(MAX_CHUNK_POINTS, points // (workers * CHUNKS_PER_WORKER)))


def usable_cores() -> int:
    """Cores this process may run on (its affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------
# Executors: each runs chunks and reports rows as they come
# ---------------------------------------------------------------------------

Advance = Callable[[int], None]


def run_in_process(chunks: list, hardware: dict, advance: Advance) -> Iterator[tuple[int, dict]]:
    """Chunks one after another in this process (``--workers 1``: no start-up cost)."""
    for chunk in chunks:
        rows = evaluate_chunk(chunk, hardware)
        advance(len(rows))
        yield from rows


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which cancels what has not started
    and waits for the chunks under way (each small)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _pool_context():
    """forkserver where there is one: workers fork from a server that has
    imported the simulator once (no import per worker, unlike spawn, and no
    fork of a parent that may run threads)."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():  # pragma: no cover - not POSIX
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["pipesim.sim.api", "pipesim.sim.engine.metrics", __name__])
    return ctx


def run_local(chunks: list, hardware: dict, advance: Advance, workers: int) -> Iterator[tuple[int, dict]]:
    """Chunks on this process and ``workers - 1`` worker processes, rows in
    completion order.

    The workers take chunks from the expensive end of ``chunks`` (most
    expensive first), this process from the cheap end, handing the workers
    their next chunk between two of its own: so it computes while they start
    (a third of a second, which one worker fewer would otherwise idle) and
    comes back often enough that a worker always has a chunk queued.
    """
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    todo = deque(chunks)
    running: set = set()
    with ProcessPoolExecutor(workers - 1, mp_context=_pool_context(), initializer=_ignore_sigint) as pool:
        try:
            while todo or running:
                while todo and len(running) < (1 + QUEUED_PER_WORKER) * (workers - 1):
                    running.add(pool.submit(evaluate_chunk, todo.popleft(), hardware))
                if todo:
                    rows = evaluate_chunk(todo.pop(), hardware)
                    advance(len(rows))
                    yield from rows
                else:
                    wait(running, return_when=FIRST_COMPLETED)
                for future in [f for f in running if f.done()]:
                    running.discard(future)
                    rows = future.result()
                    advance(len(rows))
                    yield from rows
        except BrokenProcessPool as e:
            raise SweepWorkerError(f"a sweep worker process died: {e}") from None
        finally:
            for future in running:
                future.cancel()


def import_ray():
    """Ray, or a one-line :class:`RayMissingError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayMissingError("--ray needs Ray: pip install 'pipesim[ray]' (or pip install 'ray>=2.60')") from None
    return ray


#: Seconds to wait for a Ray address to accept a connection before giving up
#: (Ray itself retries an unreachable cluster for minutes).
RAY_CONNECT_TIMEOUT_S = 5.0


def check_ray_address(address: str) -> tuple[str, int] | None:
    """``auto`` or ``local`` (None), or the (host, port) of ``HOST:PORT`` or
    ``ray://HOST:PORT``; a one-line :class:`GridError` for anything else."""
    if address in ("auto", "local"):  # local: always a new instance on this machine (Ray's own spelling)
        return None
    rest = address[len("ray://") :] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise GridError(f"--ray takes auto, local, HOST:PORT or ray://HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _reachable(address: str) -> None:
    """Refuse, after at most :data:`RAY_CONNECT_TIMEOUT_S`, an address where
    nothing accepts a connection: the one given, or for ``auto`` the one
    RAY_ADDRESS names (Ray would otherwise retry it for minutes)."""
    import socket

    if address == "auto" and os.environ.get("RAY_ADDRESS", "") not in ("", "auto", "local"):
        named = os.environ["RAY_ADDRESS"]
        try:
            check_ray_address(named)
        except GridError:
            raise GridError(f"RAY_ADDRESS takes HOST:PORT or ray://HOST:PORT for --ray auto, got {named!r}") from None
        return _reachable(named)
    where = check_ray_address(address)
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        waited = f" after {RAY_CONNECT_TIMEOUT_S:g} s" if isinstance(e, TimeoutError) else ""
        raise GridError(f"cannot reach Ray at {address}: {e.strerror or 'no answer'}{waited}") from None


@contextmanager
def ray_session(address: str):
    """Ray connected: as it already is in this process, else to ``address``
    (``auto``: the cluster RAY_ADDRESS names or one running on this machine,
    else a new local instance on this machine's cores), shut down on the way
    out only if connected here. Yields the CPUs the cluster has and whether
    the session is this call's own (so :func:`run_ray` knows whether its
    shutdown will stop what is left running)."""
    ray = import_ray()
    connect = not ray.is_initialized()
    if connect:
        import logging

        _reachable(address)
        try:
            ray.init(
                address=None if address == "auto" else address,
                include_dashboard=False,
                logging_level=logging.ERROR,
                log_to_driver=False,
            )
        except (ConnectionError, ValueError) as e:
            raise GridError(f"cannot connect to Ray at {address}: {first_line(e)}") from None
    try:
        yield max(1, int(ray.cluster_resources().get("CPU", 1))), connect
    finally:
        if connect:
            ray.shutdown()


def run_ray(chunks: list, hardware: dict, advance: Advance, own_session: bool = False) -> Iterator[tuple[int, dict]]:
    """Chunks as Ray tasks of a connected Ray (:func:`ray_session`), rows in
    completion order; the hardware table is put in the object store once.
    Tasks left when it stops are cancelled, except after Ctrl-C in a session
    of its own (``own_session``), whose shutdown stops them (see below)."""
    ray = import_ray()
    task = ray.remote(evaluate_chunk)
    shared = ray.put(hardware)
    pending = [task.remote(chunk, shared) for chunk in chunks]
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rows = ray.get(done[0])
            advance(len(rows))
            yield from rows
    except KeyboardInterrupt:
        # Ray (2.x) can abort the process when tasks are cancelled right after
        # Ctrl-C interrupted a wait; in a session of our own its shutdown
        # stops them instead (and the interrupt gets out). A caller's Ray
        # outlives us: its tasks are still cancelled.
        if own_session:
            pending = []
        raise
    finally:
        for ref in pending:
            ray.cancel(ref)


@contextmanager
def points_bar(total: int, enabled: bool = True):
    """A progress bar over points on stderr; yields ``advance(n)``. On a
    terminal it shows once the sweep has taken a second; in a log only for
    sweeps of :data:`PROGRESS_POINTS` or more, redrawn every 10 s."""
    tty = sys.stderr.isatty()
    if not enabled or (not tty and total < PROGRESS_POINTS):
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(
        total=total,
        desc="sweep",
        unit="point",
        file=sys.stderr,
        delay=1.0 if tty else 0.0,
        mininterval=0.1 if tty else 10.0,
        leave=not tty,
    ) as bar:
        yield bar.update


# ---------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------


def run_sweep(
    grid: dict[str, tuple], *, workers: int | None = None, ray: str | None = None, progress: bool = True
) -> dict:
    """Simulate every point of ``grid`` (from :func:`make_grid`) and return the
    ``sweep.json`` document: the grid and one row per point, in grid order.

    ``workers`` local processes, this one included (default: every usable
    core; 1 runs in this process alone), or Ray tasks with ``ray`` (``"auto"`` or an address; a Ray
    already initialised in this process is used as it is).
    """
    points = expand(grid)
    hardware = hardware_table(grid["hardware"])
    rows: list[dict | None] = [None] * len(points)
    with points_bar(len(points), progress) as advance:
        if ray is not None:
            with ray_session(ray) as (cpus, own):
                for i, row in run_ray(chunked(points, cpus), hardware, advance, own_session=own):
                    rows[i] = row
        else:
            chunks = chunked(points, workers or usable_cores())
            workers = local_workers(len(points), workers)  # as many as there are chunks, at most
            run = (
                run_in_process(chunks, hardware, advance)
                if workers == 1
                else run_local(chunks, hardware, advance, workers)
            )
            for i, row in run:
                rows[i] = row
    return {
        "sweep_version": SWEEP_VERSION,
        "axes": grid,
        "columns": columns(grid),
        "points": rows,
        "simulated": sum(r["status"] == "ok" for r in rows),
        "skipped": sum(r["status"] != "ok" for r in rows),
    }


# ---------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------


def to_json(doc: dict) -> str:
    """Canonical JSON text of a sweep (tuples as lists, sorted keys)."""
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def columns(grid: dict[str, tuple]) -> list[str]:
    """A sweep's columns, in CSV order: the grid's axes, then the results."""
    return [*grid, *RESULT_COLUMNS]


def _cell(value) -> str:
    """A CSV cell: tuples as the command line writes them (``15,1``), JSON's
    spelling of true, false and empty for None."""
    if isinstance(value, (tuple, list)):
        return ",".join(map(_cell, value))
    if isinstance(value, bool) or value is None:
        return json.dumps(value) if value is not None else ""
    return str(value)


def to_csv(doc: dict) -> str:
    """The sweep as CSV, one row per point in grid order; an option a
    strategy does not take is left empty."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    cols = doc["columns"]
    writer.writerow(cols)
    for row in doc["points"]:
        writer.writerow([_cell(row.get(c)) for c in cols])
    return buf.getvalue()


def label(row: dict, axes: Iterable[str]) -> str:
    """A point's configuration for a hover text or the console: every axis
    but the panel's, a value swept as ``none`` spelled so (not left empty
    as in the CSV)."""
    return ", ".join(
        f"{a}={'none' if row[a] is None else _cell(row[a])}"
        for a in axes
        if a in row and a not in ("model", "hardware")
    )


def pareto_front(rows: Sequence[dict]) -> list[dict]:
    """The points no other point beats on both throughput and peak memory,
    by memory: the fastest configuration for each memory budget."""
    front: list[dict] = []
    for row in sorted(rows, key=lambda r: (r["peak_memory_bytes_max"], -r["throughput_samples_per_s"])):
        if not front or row["throughput_samples_per_s"] > front[-1]["throughput_samples_per_s"]:
            front.append(row)
    return front


def sweep_figure(doc: dict):
    """Throughput against peak memory per device (worst device), one panel per
    model and hardware, one colour per strategy, out-of-memory points as
    crosses, and the frontier of the points that fit.

    Why this plot: a sweep's question is "the fastest configuration that fits
    in memory", and these are the two figures that trade off (deeper
    pipelines and more micro-batches in flight buy throughput with
    activation memory). Throughput compares only within one model on one
    machine, hence one panel each; both axes are logarithmic because a grid
    spans orders of magnitude. The full configuration is in each point's hover.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from pipesim.experiments.figures import STRATEGY_COLORS

    panels = list(itertools.product(doc["axes"]["model"], doc["axes"]["hardware"]))
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig = make_subplots(
        rows=nrows,
        cols=cols,
        subplot_titles=[f"{m} on {h}" for m, h in panels],
        horizontal_spacing=0.08,
        vertical_spacing=0.12 if nrows > 1 else 0.1,
    )
    names = strategy_names()
    shown: set[str] = set()
    for k, (model, hw) in enumerate(panels):
        r, c = divmod(k, cols)
        ok = [
            p
            for p in doc["points"]
            if p["status"] == "ok"
            and p["model"] == model
            and p["hardware"] == hw
            and p["throughput_samples_per_s"] is not None
        ]
        for name in doc["axes"]["strategy"]:
            color = STRATEGY_COLORS[names.index(name) % len(STRATEGY_COLORS)]
            for oom in (False, True):
                pts = [p for p in ok if p["strategy"] == name and p["out_of_memory"] == oom]
                if not pts:
                    continue
                fig.add_trace(
                    go.Scattergl(
                        x=[p["peak_memory_bytes_max"] / 2**30 for p in pts],
                        y=[p["throughput_samples_per_s"] for p in pts],
                        mode="markers",
                        name=name,
                        legendgroup=name,
                        showlegend=name not in shown,
                        marker={
                            "color": color,
                            "size": 10 if oom else 8,
                            "symbol": "x" if oom else "circle",
                            "opacity": 0.8,
                            "line": {"width": 0 if oom else 0.5, "color": "white"},
                        },
                        text=[label(p, doc["axes"]) for p in pts],
                        hovertemplate="%{text}<br>peak memory %{x:.3g} GiB<br>%{y:.4g} samples/s"
                        + ("<br><b>out of memory</b>" if oom else "")
                        + "<extra></extra>",
                    ),
                    row=r + 1,
                    col=c + 1,
                )
                shown.add(name)
        front = pareto_front([p for p in ok if not p["out_of_memory"]])
        if front:
            fig.add_trace(
                go.Scatter(
                    x=[p["peak_memory_bytes_max"] / 2**30 for p in front],
                    y=[p["throughput_samples_per_s"] for p in front],
                    mode="lines",
                    line={"color": "#444", "width": 1, "dash": "dot", "shape": "hv"},
                    name="fastest that fits (frontier)",
                    legendgroup="front",
                    showlegend="front" not in shown,
                    hoverinfo="skip",
                ),
                row=r + 1,
                col=c + 1,
            )
            shown.add("front")
        fig.update_xaxes(type="log", title_text="peak memory, worst device (GiB)", row=r + 1, col=c + 1)
        fig.update_yaxes(type="log", title_text="throughput (samples/s)", row=r + 1, col=c + 1)
    if any(p.get("out_of_memory") for p in doc["points"]):  # one legend entry says what a cross means
        fig.add_trace(
            go.Scattergl(
                x=[None],
                y=[None],
                mode="markers",
                name="× out of memory",
                marker={"symbol": "x", "color": "#888", "size": 10},
                hoverinfo="skip",
            )
        )
    fig.update_layout(
        title={
            "text": f"Sweep: {doc['simulated']} configurations simulated, {doc['skipped']} skipped "
            "(rejected by their strategy; listed in sweep.json)"
        },
        template="plotly_white",
        width=520 * cols + 260,
        height=460 * nrows + 80,
    )
    return fig


def write_outputs(doc: dict, out: Path, *, png: bool = True) -> list[str]:
    """``sweep.json``, ``sweep.csv``, ``sweep.html`` (self-contained) and
    ``sweep.png`` when a browser can draw it; the names written."""
    from pipesim.experiments.export import write_png

    (out / "sweep.json").write_text(to_json(doc), encoding="utf-8")
    (out / "sweep.csv").write_text(to_csv(doc), encoding="utf-8")
    fig = sweep_figure(doc)
    fig.write_html(
        out / "sweep.html", include_plotlyjs=True, full_html=True, div_id="pipesim-sweep", config={"displaylogo": False}
    )
    written = ["sweep.json", "sweep.csv", "sweep.html"]
    if png and write_png(fig, out / "sweep.png", width=fig.layout.width, height=fig.layout.height):
        written.append("sweep.png")
    return written


def best_points(doc: dict) -> list[dict]:
    """The fastest point that fits in memory for each model and hardware, in grid order."""
    best: dict[tuple, dict] = {}
    for p in doc["points"]:
        if p["status"] == "ok" and not p["out_of_memory"] and p["throughput_samples_per_s"] is not None:
            key = (p["model"], p["hardware"])
            if key not in best or p["throughput_samples_per_s"] > best[key]["throughput_samples_per_s"]:
                best[key] = p
    return [best[key] for key in itertools.product(doc["axes"]["model"], doc["axes"]["hardware"]) if key in best]


def skip_reasons(doc: dict) -> dict[str, int]:
    """How many points each distinct reason skipped, most frequent first."""
    counts: dict[str, int] = {}
    for p in doc["points"]:
        if p["status"] != "ok":
            counts[p["reason"]] = counts.get(p["reason"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------
# Command line (the sub-parser and its run() live in pipesim.experiments.cli.sweep)
# ---------------------------------------------------------------------------

#: Axes with a flag of their own: flag -> (axis, argparse type, metavar, help).
AXIS_FLAGS = {
    "--strategy": ("strategy", str, "S", "strategies (default: all)"),
    "--stages": ("stages", positive, "P", "pipeline depths in devices per replica (default: 2 4 8)"),
    "--microbatches": ("microbatches", positive, "M", "micro-batches per iteration (default: 4 8 16 32)"),
    "--iterations": ("iterations", positive, "K", "iterations (default: 4, steady state for asynchronous schedules)"),
    "--width": ("width", positive, "W", "parallel pipelines, for the strategies that take it (default: theirs)"),
    "--model": ("model", str, "NAME", "catalog models, computed or measured (pipedream-*) (default: uniform)"),
    "--hardware": ("hardware", str, "HW", "presets, preset-xN or JSON files (default: ideal)"),
}


def _model_names() -> list[str]:
    from pipesim.sim.workloads.catalog import measured_model_names, model_names

    return model_names() + measured_model_names()


def _preset_names() -> list[str]:
    from pipesim.sim.hardware.machines import preset_names

    return preset_names()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pipesim sweep`` (catalogs looked up only for --help)."""
    listed = {"--strategy": strategy_names, "--model": _model_names, "--hardware": _preset_names}
    for flag, (axis, kind, metavar, text) in AXIS_FLAGS.items():
        action = p.add_argument(
            flag, dest=f"axis_{axis}", nargs="+", type=kind, default=None, metavar=metavar, help=text
        )
        if flag in listed:
            list_choices(action, listed[flag])
    p.add_argument(
        "--set",
        dest="set_axes",
        nargs="+",
        action="append",
        default=None,
        metavar=("NAME=V", "V"),
        help="sweep any ScheduleSpec field, microbatch_size or recompute: --set NAME=V [V ...], repeatable; "
        "commas make a tuple (--set replicas=15,1 3,1)",
    )
    p.add_argument(
        "--grid",
        default=None,
        metavar="FILE.json",
        help='JSON grid file {"axis": [values], ...}; flags override its axes',
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--workers",
        type=positive,
        default=None,
        metavar="N",
        help=f"processes that simulate, this one included (default: the usable cores, here {usable_cores()})",
    )
    g.add_argument(
        "--ray",
        default=None,
        metavar="auto|ADDRESS",
        help="run as Ray tasks: auto (RAY_ADDRESS, a cluster on this machine, else a new local one) "
        "or a cluster address (needs pip install 'pipesim[ray]')",
    )
    p.add_argument("--out", default="out/sweep", help="output folder")


def grid_from_args(args: argparse.Namespace) -> dict[str, tuple]:
    """The grid the command line asks for: defaults, the grid file, the flags."""
    flags: dict[str, tuple] = {}
    for axis, *_ in AXIS_FLAGS.values():
        values = getattr(args, f"axis_{axis}")
        if values is not None:
            flags[axis] = tuple(values)
    for tokens in args.set_axes or ():
        name, values = parse_set(tokens)
        if name in flags:
            raise GridError(f"sweep axis {name} is given twice")
        flags[name] = values
    file_grid = load_grid_file(args.grid) if args.grid else {}
    return make_grid(file_grid, flags)


# ---------------------------------------------------------------------------
# Benchmark: ``pipesim bench sweep``
# ---------------------------------------------------------------------------

#: 5 strategies x 8 depths x 25 micro-batch counts = 1,000 small simulations
#: (uniform model, ideal hardware, one iteration), 1-70 ms each.
BENCH_GRID = {
    "strategy": ("gpipe", "1f1b", "pipedream", "spectrain", "data-parallel"),
    "stages": (2, 4, 6, 8, 10, 12, 14, 16),
    "microbatches": tuple(range(2, 51, 2)),
    "iterations": (1,),
}
QUICK_GRID = {**BENCH_GRID, "stages": (2, 4, 8, 16), "microbatches": (2, 4, 8, 16, 32)}


def bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a 100-point sweep instead of 1,000")
    parser.add_argument("--no-ray", action="store_true", help="time local workers only")
    parser.add_argument(
        "--repeats",
        type=positive,
        default=1,
        help="runs of each setting (local ones interleaved); the best is reported",
    )


def _timed(grid: dict, **how) -> tuple[float, str]:
    start = time.perf_counter()
    doc = run_sweep(grid, progress=False, **how)
    return time.perf_counter() - start, to_json(doc)


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def parallel_ceiling(n: int = 3_000_000) -> float:
    """What 2 processes gain over 1 on pure Python arithmetic right now, pool
    start excluded: 2.0 on two idle cores, less on a shared machine. The
    sweep's own speedup is to be read against it."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2, mp_context=_pool_context()) as pool:
        list(pool.map(_spin, [1, 1]))  # both workers started
        start = time.perf_counter()
        _spin(n), _spin(n)
        one = time.perf_counter() - start
        start = time.perf_counter()
        list(pool.map(_spin, [n, n]))
        return one / (time.perf_counter() - start)


def bench_run(args: argparse.Namespace) -> dict:
    """Times of the same sweep on 1 and 2 local workers and on Ray with 1 and 2 CPUs."""
    grid = make_grid(QUICK_GRID if args.quick else BENCH_GRID)
    points = len(expand(grid))
    runs: dict[tuple[str, int], dict] = {}
    outputs: set[str] = set()
    ceilings = []
    for r in range(args.repeats):
        ceilings.append(round(parallel_ceiling(), 3))
        for n in (1, 2):
            print(f"[local, {n} worker(s), run {r + 1}] {points:,} points ...", file=sys.stderr, flush=True)
            seconds, text = _timed(grid, workers=n)
            runs.setdefault(("local", n), {"executor": "local", "workers": n, "times": []})["times"].append(seconds)
            outputs.add(text)
    for n in () if args.no_ray else (1, 2):
        print(
            f"[ray, {n} CPU(s)] starting Ray, then {args.repeats} x {points:,} points ...", file=sys.stderr, flush=True
        )
        times, started = _ray_times(grid, n, args.repeats)
        runs[("ray", n)] = {"executor": "ray", "workers": n, "times": [t for t, _ in times], "start_s": started}
        outputs.update(text for _, text in times)
    rows = list(runs.values())
    for row in rows:
        row["times"] = [round(t, 3) for t in row["times"]]
        row["seconds"] = min(row["times"])
        row["speedup_vs_1"] = round(runs[(row["executor"], 1)]["seconds"] / row["seconds"], 3)
        row["speedup_vs_local_1"] = round(runs[("local", 1)]["seconds"] / row["seconds"], 3)
    return {
        "points": points,
        "grid": {k: list(v) for k, v in grid.items()},
        "runs": rows,
        "cores": usable_cores(),
        "parallel_ceiling": ceilings,
        "identical_outputs": len(outputs) == 1,
        "target_speedup_2_workers": 1.7,
    }


def _ray_times(grid: dict, cpus: int, repeats: int) -> tuple[list, float]:
    """Timed sweeps on a fresh local Ray with ``cpus`` CPUs, after starting it
    and a small warm-up sweep (its workers started, pipesim imported):
    the times, and what the start and the warm-up took."""
    ray = import_ray()
    import logging

    start = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    try:
        run_sweep(
            make_grid(
                {
                    "strategy": ("1f1b",),
                    "stages": (2,),
                    "microbatches": tuple(range(1, 2 * cpus + 1)),
                    "iterations": (1,),
                }
            ),
            ray="auto",
            progress=False,
        )
        started = time.perf_counter() - start
        return [_timed(grid, ray="auto") for _ in range(repeats)], round(started, 3)
    finally:
        ray.shutdown()


def bench_render(report: dict) -> str:
    lines = [
        (
            f"sweep of {report['points']:,} simulations on {report['cores']} usable cores "
            f"(target: >= {report['target_speedup_2_workers']}x with 2 workers)"
        ),
        f"{'executor':<8} {'workers':>7} {'best s':>7} {'points/s':>9} {'speedup':>8} {'vs local 1':>10}  all runs (s)",
    ]
    for r in report["runs"]:
        lines.append(
            f"{r['executor']:<8} {r['workers']:>7} {r['seconds']:>7.2f} {report['points'] / r['seconds']:>9.0f} "
            f"{r['speedup_vs_1']:>7.2f}x {r['speedup_vs_local_1']:>9.2f}x  " + " ".join(f"{t:.2f}" for t in r["times"])
        )
    for r in report["runs"]:
        if "start_s" in r:
            lines.append(f"ray with {r['workers']} CPU(s): start and warm-up {r['start_s']:.2f} s (not in the times)")
    lines.append(
        "this machine's own 2-process speedup on pure Python, measured beside the local runs: "
        + ", ".join(f"{c:.2f}x" for c in report["parallel_ceiling"])
        + " (2.00x on two idle cores)"
    )
    lines.append("outputs identical across all runs: " + ("yes" if report["identical_outputs"] else "NO"))
    return "\n".join(lines)


def bench(argv: list[str] | None = None, prog: str = "pipesim bench sweep") -> int:
    return bench_main(
        argv,
        prog=prog,
        description="Time a 1,000-point sweep on 1 and 2 local workers and on Ray.",
        add_arguments=bench_arguments,
        run=bench_run,
        render=bench_render,
    )

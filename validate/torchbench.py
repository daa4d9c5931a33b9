"""pipesim's distributed runtime against torch.distributed.pipelining, on one machine, in one run.

What is compared
----------------
Training throughput (samples per second) of GPipe and 1F1B executed by

* **pipesim**: :func:`pipesim.validate.runtime.run_many` walking the IR that
  :func:`pipesim.sim.strategies.build_schedule` builds for the strategy, and
* **torch**: ``torch.distributed.pipelining``'s ``ScheduleGPipe`` /
  ``Schedule1F1B`` over one ``PipelineStage`` per rank, with
  ``torch.optim.SGD`` stepping after every ``schedule.step``.

Why it is a fair comparison
---------------------------
Both sides run

* the **same model and weights**: every rank builds the catalog model
  (:func:`~pipesim.validate.models.build_model`) from the same seed and
  keeps its stage of the same partition (:func:`~pipesim.validate.models.split`
  at ``starts``);
* the **same data in the same order**: micro-batch ``i`` of iteration ``t``
  is ``source.batch(t*m + i)`` on both sides (torch's first rank gets the
  ``torch.cat`` of the iteration's m micro-batches, which its schedule
  splits back into exactly those micro-batches), and both read it inside
  the timed loop;
* the **same pass order**: pipesim's ``gpipe`` and ``1f1b`` programs run
  each stage's forwards and backwards in the order torch's ``ScheduleGPipe``
  and ``Schedule1F1B`` do (all forwards then all backwards; ``S - s``
  warm-up forwards on stage s, then one backward and one forward);
* the **same optimisation**: SGD, lr 0.05, momentum 0.9, gradients
  accumulated over the m micro-batches and divided by m (torch's
  ``scale_grads``; pipesim's ``OptimizerConfig.scale_grads``), one update
  per iteration. The first iteration's losses therefore agree to float
  tolerance (they are reported, and the test checks them): both sides did
  the same work;
* the **same process layout**: :func:`~pipesim.validate.launch.launch`
  with the settings ``run_many`` uses for gloo: one spawned process per
  stage, gloo over loopback, one intra-op thread, each rank pinned to a core
  of its own with a lowest-priority spinner keeping that core awake;
* the **same measurement**: warm-up iterations first (untimed; torch's
  first one also infers its stages' metadata), then ``iterations`` timed
  iterations. Throughput is timed samples over the span from the moment
  the warm-up is over to the moment the last rank finished its last
  optimizer step. For torch the
  ranks meet in a barrier after the warm-up and every rank stamps
  ``perf_counter_ns`` after it and after its last optimizer step; the span
  is latest end minus earliest start. pipesim has no barrier between its
  iterations, so the span comes from its action records, on the same
  clock: from the latest end of any compute action of the warm-up
  iterations to the latest end of any compute action (the last UPDATE).
  (pipesim's records are stamped while it runs, a small cost that only
  pipesim pays.)

What differs is the runtime, which is the point: pipesim posts each
receive one compute action ahead of the action that consumes it
(``recv_lookahead``), leaves sends to complete on a reaper thread while
it computes, runs compute at a lower thread priority than communication, and moves
activations and gradients on process groups of their own; torch's
schedules post a receive right before the pass that needs it (1F1B fuses
it with the previous pass's send into one ``batch_isend_irecv``) and post
from the compute thread, on the world group.

The machine is noisy, so each side runs ``repeats`` times, alternating
(pipesim, torch, pipesim, torch, ...); the report gives the best and the
median of each side and the ratio pipesim/torch of the bests, and the
median of the per-repeat ratios (each from a pipesim run and the torch run
right after it). The CPU other processes took during each launch is
measured (:class:`CpuMeter`) and reported next to the figures.

CLI: ``pipesim bench torch [--model mlp] [--microbatch-size 64]
[--microbatches 8] [--iterations 6] [--repeats 3]``.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipesim.sim.errors import InputError
from pipesim.sim.strategies import get_strategy, strategies
from pipesim.validate.numerics import EXECUTOR_THREADS

__all__ = [
    "DEFAULT_STARTS",
    "CpuMeter",
    "TorchJob",
    "compare_with_torch",
    "default_starts",
    "format_report",
    "machine",
    "pipesim_throughput",
    "torch_worker",
]

#: The strategies compared: those whose per-rank order torch runs with one
#: stage per rank (interleaving needs several per rank, so it is left out).
SCHEDULES = tuple(s.name for s in strategies() if s.torch_equivalent in ("ScheduleGPipe", "Schedule1F1B"))
LR = 0.05
MOMENTUM = 0.9

#: Balanced partitions of the catalog models at their default sizes (by
#: measured forward+backward time on one CPU thread): (model, stages) -> starts.
DEFAULT_STARTS: dict[tuple[str, int], tuple[int, ...]] = {
    ("mlp", 2): (0, 3),  # fc0 fc1 fc2 | fc3 head (the runtime tests' split)
    ("gpt-small", 2): (0, 3),  # embed block0 block1 | block2 block3 head
    ("vgg-small", 2): (0, 2),  # conv0 conv1+pool | conv2 conv3+pool fc head
}


def default_starts(model: str, stages: int, num_layers: int, *, default_size: bool = True) -> tuple[int, ...]:
    """The partition used when none is given: :data:`DEFAULT_STARTS` for a
    catalog model at its default size, else layers split evenly by count."""
    if default_size and (model, stages) in DEFAULT_STARTS:
        return DEFAULT_STARTS[(model, stages)]
    if stages > num_layers:
        raise InputError(f"{stages} stages for a model of {num_layers} layers")
    return tuple(round(k * num_layers / stages) for k in range(stages))


# ------------------------------------------------------------------ torch side


@dataclass(frozen=True)
class TorchJob:
    """One torch.distributed.pipelining run (picklable, for the workers)."""

    schedule: str  # "gpipe" | "1f1b"
    model: str
    starts: tuple[int, ...]
    microbatches: int
    microbatch_size: int
    iterations: int
    warmup_iterations: int
    width: int | None = None
    depth: int | None = None
    seed: int = 0
    lr: float = LR
    momentum: float = MOMENTUM


def _torch_run(ctx, job: TorchJob) -> dict:
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining import PipelineStage

    from pipesim.validate.models import build_model, split

    rank, world = ctx.rank, ctx.world_size
    model = build_model(job.model, width=job.width, depth=job.depth, seed=job.seed)
    modules = split(model, list(job.starts))
    if len(modules) != world:
        raise ValueError(f"{len(modules)} stages for {world} ranks")
    data = model.data(job.microbatch_size, seed=job.seed)
    # example tensors of one micro-batch, so the stages need no metadata
    # inference; activations require grad (that is how the static stages learn
    # that gradients travel back), the model's input does not
    x = data.batch(0)[0]
    examples = [x]
    with torch.no_grad():
        for mod in modules:
            x = mod(x)
            examples.append(torch.zeros_like(x).requires_grad_(x.is_floating_point()))
    module = modules[rank].to(ctx.device)
    stage = PipelineStage(module, rank, world, ctx.device, input_args=examples[rank], output_args=examples[rank + 1])
    kind = getattr(pipelining, get_strategy(job.schedule).torch_equivalent)
    sched = kind(stage, n_microbatches=job.microbatches, loss_fn=model.loss_fn, scale_grads=True)
    # foreach: the multi-tensor update pipesim's stages use as well
    opt = torch.optim.SGD(module.parameters(), lr=job.lr, momentum=job.momentum, foreach=True)
    m = job.microbatches
    first, last = rank == 0, rank == world - 1
    losses: list[list[float]] = []

    def iteration(t: int) -> None:
        args, kw = (), {}
        if first or last:
            batches = [data.batch(t * m + i) for i in range(m)]
            if first:
                args = (torch.cat([b[0] for b in batches]).to(ctx.device),)
            if last:
                kw = {"target": torch.cat([b[1] for b in batches]).to(ctx.device), "losses": []}
        opt.zero_grad(set_to_none=True)
        sched.step(*args, return_outputs=False, **kw)
        opt.step()
        if last:
            losses.append([float(v.detach()) for v in kw["losses"]])

    for t in range(job.warmup_iterations):
        iteration(t)
    dist.barrier()
    t0 = time.perf_counter_ns()
    for t in range(job.warmup_iterations, job.warmup_iterations + job.iterations):
        iteration(t)
    t1 = time.perf_counter_ns()
    dist.barrier()
    return {"rank": rank, "start_ns": t0, "end_ns": t1, "losses": losses if last else None}


def torch_worker(ctx, jobs: list[TorchJob]) -> list[dict]:
    """Body of one rank: the torch jobs in order (launch's ``fn``)."""
    return [_torch_run(ctx, job) for job in jobs]


def _torch_result(per_rank: list[dict], job: TorchJob) -> dict:
    start = min(r["start_ns"] for r in per_rank)
    end = max(r["end_ns"] for r in per_rank)
    losses = per_rank[-1]["losses"]
    timed = job.iterations * job.microbatches * job.microbatch_size
    seconds = (end - start) / 1e9
    return {
        "samples_per_s": timed / seconds,
        "seconds": seconds,
        "timed_samples": timed,
        "trained_samples": sum(len(v) for v in losses) * job.microbatch_size,
        "iteration_losses": [sum(v) / len(v) for v in losses],
        "first_iteration_losses": losses[0],
    }


# ---------------------------------------------------------------- pipesim side


def pipesim_throughput(
    out, *, microbatches: int, microbatch_size: int, iterations: int, warmup_iterations: int
) -> dict:
    """Timed throughput of a flush schedule's run from its records.

    The timed span starts at the latest end of any compute action of the
    warm-up iterations (a pass of a micro-batch < warmup*m, or an UPDATE
    producing a version <= warmup) and ends at the latest end of any compute
    action: every device's last action is its UPDATE, after the transfers
    it depended on (a send's record is stamped when the walker next looks,
    possibly at the end of the run, so it would overstate the span).
    """
    from pipesim.sim.ir.core import UPDATE

    m = microbatches
    cut = warmup_iterations * m
    warm_end = None
    end = None
    for r in out.records:
        if r.end is None or r.stream != "compute":
            continue
        end = r.end if end is None else max(end, r.end)
        a = r.action
        warm = (a.microbatch is not None and a.microbatch < cut) or (
            a.op is UPDATE and a.version is not None and a.version <= warmup_iterations
        )
        if warm:
            warm_end = r.end if warm_end is None else max(warm_end, r.end)
    if end is None:
        raise ValueError("the run has no timed records (was the job timed?)")
    if warm_end is None:  # no warm-up: from the first record on
        warm_end = min(r.start for r in out.records)
    timed = iterations * m * microbatch_size
    seconds = (end - warm_end) / 1e9
    per: dict[int, list[float]] = {}
    for (_, mb), v in sorted(out.losses.items()):
        per.setdefault(mb // m, []).append(v)
    its = [per[k] for k in sorted(per)]
    return {
        "samples_per_s": timed / seconds,
        "seconds": seconds,
        "timed_samples": timed,
        "trained_samples": len(out.losses) * microbatch_size,
        "iteration_losses": [sum(v) / len(v) for v in its],
        "first_iteration_losses": its[0] if its else [],
    }


# ------------------------------------------------------------------ comparison


def machine() -> dict:
    """What the figures were measured on."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


class CpuMeter:
    """CPU time other processes took while a block ran, in cores on average.

    Busy time of the whole machine (``/proc/stat``: user, nice, system, irq,
    softirq, steal) minus what this process and its reaped children (the
    ranks, and the spinners that keep their cores awake, which soak up any
    idle time) used. The spinners yield to anyone, so other work shows up
    here instead of vanishing into idle. ``None`` where /proc/stat is missing.
    """

    def __enter__(self):
        self._start = self._sample()
        return self

    def __exit__(self, *exc):
        end = self._sample()
        self.cores = None
        if self._start is not None and end is not None:
            (b0, o0, w0), (b1, o1, w1) = self._start, end
            if w1 > w0:
                self.cores = max(0.0, ((b1 - b0) - (o1 - o0)) / (w1 - w0))
        return False

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()[1:]
            tick = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, AttributeError):
            return None
        v = [int(x) for x in fields]
        busy = (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / tick
        t = os.times()
        return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def _summary(values: list[float]) -> dict:
    return {"runs": values, "best": max(values), "median": statistics.median(values)}


def _log(msg: str) -> None:
    print(f"[torchbench] {msg}", file=sys.stderr, flush=True)


def compare_with_torch(
    model: str = "mlp",
    stages: int = 2,
    microbatches: int = 8,
    microbatch_size: int = 64,
    iterations: int = 6,
    warmup_iterations: int = 2,
    schedules: Sequence[str] = SCHEDULES,
    width: int | None = None,
    depth: int | None = None,
    seed: int = 0,
    timeout_s: float = 300.0,
    *,
    starts: Sequence[int] | None = None,
    repeats: int = 3,
    progress: bool = False,
) -> dict:
    """Throughput of pipesim's runtime and torch.distributed.pipelining on the same job.

    Returns ``{"config", "machine", "schedules": {name: {"pipesim", "torch",
    "ratio_best", "ratio_median", "first_loss", "max_first_iteration_loss_diff"}}}``. ``pipesim``/``torch`` hold ``samples_per_s`` (``runs``,
    ``best``, ``median``), the samples each side timed and trained, and the
    first repeat's per-iteration mean losses and first-iteration
    per-micro-batch losses; ``ratio_best`` is pipesim's best over torch's
    best, ``ratio_median`` the median of the per-repeat ratios.
    ``machine["other_processes_cores"]`` gives, per launch, the CPU other
    processes took meanwhile (:class:`CpuMeter`): figures from launches
    where it is well above 0 were measured on a contended machine.
    """
    from pipesim.validate.models import build_model, split

    schedules = tuple(schedules)
    _check_comparison(schedules, stages, microbatches, microbatch_size, iterations, repeats, warmup_iterations)
    real = build_model(model, width=width, depth=depth, seed=seed)
    if starts is None:
        starts = default_starts(model, stages, real.num_layers, default_size=width is None and depth is None)
    starts = tuple(int(s) for s in starts)
    if len(starts) != stages:
        raise InputError(f"{len(starts)} stage starts for {stages} stages")
    split(real, list(starts))  # a ModelError naming a bad start, here rather than in every worker
    pjobs, tjobs = _jobs(
        schedules, model, starts, microbatches, microbatch_size, iterations, warmup_iterations, width, depth, seed
    )
    cpu_launch = {
        "backend": "gloo",
        "timeout_s": timeout_s,
        "threads": EXECUTOR_THREADS,
        "pin_cores": True,
        "keep_cores_awake": True,
    }  # what run_many passes for gloo
    pipesim_runs, torch_runs, foreign = _alternate(pjobs, tjobs, schedules, cpu_launch, repeats, progress)
    return {
        "config": {
            "model": model,
            "description": real.description,
            "stages": stages,
            "starts": list(starts),
            "microbatches": microbatches,
            "microbatch_size": microbatch_size,
            "iterations": iterations,
            "warmup_iterations": warmup_iterations,
            "repeats": repeats,
            "width": width,
            "depth": depth,
            "seed": seed,
            "optimizer": {"kind": "sgd", "lr": LR, "momentum": MOMENTUM},
            "launch": {k: v for k, v in cpu_launch.items() if k != "timeout_s"},
        },
        "machine": {**machine(), "other_processes_cores": foreign},
        "schedules": {
            s: _side_by_side([run[j] for run in pipesim_runs], [run[j] for run in torch_runs])
            for j, s in enumerate(schedules)
        },
    }


def _check_comparison(schedules, stages, microbatches, microbatch_size, iterations, repeats, warmup_iterations) -> None:
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        raise InputError(f"schedules must be among {', '.join(SCHEDULES)}, got {list(schedules)}")
    for name, v in (
        ("stages", stages),
        ("microbatches", microbatches),
        ("microbatch_size", microbatch_size),
        ("iterations", iterations),
        ("repeats", repeats),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be a positive integer, got {v!r}")
    if isinstance(warmup_iterations, bool) or not isinstance(warmup_iterations, int) or warmup_iterations < 0:
        raise InputError(f"warmup_iterations must be an integer >= 0, got {warmup_iterations!r}")
    if stages < 2:
        raise InputError("a pipeline comparison needs at least 2 stages")
    needs_m_ge_p = [s for s in schedules if get_strategy(s).torch_equivalent == "Schedule1F1B"]
    if needs_m_ge_p and microbatches < stages:  # torch's class refuses fewer (pipesim's does not)
        raise InputError(f"torch's Schedule1F1B needs microbatches >= stages ({microbatches} < {stages})")


def _jobs(
    schedules, model, starts, microbatches, microbatch_size, iterations, warmup_iterations, width, depth, seed
) -> tuple[list, list]:
    """The same work for both sides: pipesim's jobs and torch's."""
    from pipesim.sim.strategies import ScheduleSpec, build_schedule
    from pipesim.validate.runtime import Job
    from pipesim.validate.stage import OptimizerConfig

    total = warmup_iterations + iterations
    optim = OptimizerConfig(kind="sgd", lr=LR, momentum=MOMENTUM, scale_grads=True)
    pjobs = [
        Job(
            schedule=build_schedule(
                ScheduleSpec(strategy=s, stages=len(starts), microbatches=microbatches, iterations=total)
            ),
            model=model,
            starts=starts,
            microbatch_size=microbatch_size,
            optimizer=optim,
            width=width,
            depth=depth,
            seed=seed,
        )
        for s in schedules
    ]
    tjobs = [
        TorchJob(
            schedule=s,
            model=model,
            starts=starts,
            microbatches=microbatches,
            microbatch_size=microbatch_size,
            iterations=iterations,
            warmup_iterations=warmup_iterations,
            width=width,
            depth=depth,
            seed=seed,
        )
        for s in schedules
    ]
    return pjobs, tjobs


def _alternate(pjobs, tjobs, schedules, cpu_launch: dict, repeats: int, progress: bool):
    """``repeats`` rounds of one pipesim launch then one torch launch (so
    drift on a shared machine hits both sides alike): per round, each
    schedule's throughput record, and the CPU other processes took."""
    from pipesim.validate.launch import launch
    from pipesim.validate.runtime import run_many

    first = tjobs[0]
    pipesim_runs: list[list[dict]] = []
    torch_runs: list[list[dict]] = []
    foreign: dict[str, list[float | None]] = {"pipesim": [], "torch": []}
    for rep in range(repeats):
        if progress:
            _log(f"repeat {rep + 1}/{repeats}: pipesim ({', '.join(schedules)})")
        with CpuMeter() as meter:
            outs = run_many(pjobs, backend="gloo", timeout_s=cpu_launch["timeout_s"], threads=EXECUTOR_THREADS)
        foreign["pipesim"].append(meter.cores)
        pipesim_runs.append(
            [
                pipesim_throughput(
                    o,
                    microbatches=first.microbatches,
                    microbatch_size=first.microbatch_size,
                    iterations=first.iterations,
                    warmup_iterations=first.warmup_iterations,
                )
                for o in outs
            ]
        )
        if progress:
            _log(
                "  pipesim: "
                + ", ".join(f"{s} {r['samples_per_s']:,.0f} samples/s" for s, r in zip(schedules, pipesim_runs[-1]))
            )
            _log(f"repeat {rep + 1}/{repeats}: torch ({', '.join(schedules)})")
        with CpuMeter() as meter:
            per_rank = launch(torch_worker, len(first.starts), args=(tjobs,), **cpu_launch)
        foreign["torch"].append(meter.cores)
        torch_runs.append([_torch_result([r[j] for r in per_rank], job) for j, job in enumerate(tjobs)])
        if progress:
            _log(
                "  torch:   "
                + ", ".join(f"{s} {r['samples_per_s']:,.0f} samples/s" for s, r in zip(schedules, torch_runs[-1]))
            )
            busy = [c for c in (foreign["pipesim"][-1], foreign["torch"][-1]) if c is not None]
            if busy and max(busy) > 0.1:
                _log(f"  other processes used {max(busy):.2f} cores during this repeat: expect noise")
    return pipesim_runs, torch_runs, foreign


def _side_by_side(ps: list[dict], ts: list[dict]) -> dict:
    """One schedule's pipesim and torch records over the repeats, and their ratios."""
    p_thr = [r["samples_per_s"] for r in ps]
    t_thr = [r["samples_per_s"] for r in ts]
    p0, t0 = ps[0], ts[0]
    diffs = [abs(a - b) for a, b in zip(p0["first_iteration_losses"], t0["first_iteration_losses"])]
    keep = ("timed_samples", "trained_samples", "iteration_losses", "first_iteration_losses")
    return {
        "pipesim": {"samples_per_s": _summary(p_thr), **{k: p0[k] for k in keep}},
        "torch": {"samples_per_s": _summary(t_thr), **{k: t0[k] for k in keep}},
        "ratio_best": max(p_thr) / max(t_thr),
        "ratio_median": statistics.median(a / b for a, b in zip(p_thr, t_thr)),
        "first_loss": {"pipesim": p0["iteration_losses"][0], "torch": t0["iteration_losses"][0]},
        "max_first_iteration_loss_diff": max(diffs) if diffs else math.nan,
    }


# ------------------------------------------------------------------ report


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def format_report(result: dict) -> str:
    c, mach = result["config"], result["machine"]
    lines = [
        f"pipesim runtime vs torch.distributed.pipelining  ({c['description']})",
        (
            f"  stages {c['stages']} (starts {tuple(c['starts'])}), m={c['microbatches']} x {c['microbatch_size']} "
            f"samples, {c['warmup_iterations']} warm-up + {c['iterations']} timed iterations, "
            f"{c['repeats']} repeat(s) alternating; gloo, 1 thread/rank, pinned cores"
        ),
        (
            f"  machine: {mach['cpu']}, {mach['usable_cores']} usable of {mach['cores']} cores; "
            f"torch {mach['torch']}, python {mach['python']}"
        ),
        (
            "  CPU taken by other processes during each launch (cores): pipesim "
            + " ".join(_fmt(v) for v in mach["other_processes_cores"]["pipesim"])
            + "; torch "
            + " ".join(_fmt(v) for v in mach["other_processes_cores"]["torch"])
        ),
        "",
        f"  {'schedule':<9} {'side':<8} {'best/s':>10} {'median/s':>10}   runs (samples/s)",
    ]
    for s, r in result["schedules"].items():
        for side in ("pipesim", "torch"):
            st = r[side]["samples_per_s"]
            runs = " ".join(f"{v:,.0f}" for v in st["runs"])
            lines.append(
                f"  {s if side == 'pipesim' else '':<9} {side:<8} {st['best']:>10,.0f} {st['median']:>10,.0f}   {runs}"
            )
        lines.append(
            f"  {'':<9} {'ratio':<8} {r['ratio_best']:>10.3f} {r['ratio_median']:>10.3f}   "
            "pipesim/torch (of bests; median of per-repeat ratios)"
        )
        lines.append(
            f"  {'':<9} first-iteration mean loss: pipesim {r['first_loss']['pipesim']:.6f}, "
            f"torch {r['first_loss']['torch']:.6f} (max per-micro-batch diff "
            f"{r['max_first_iteration_loss_diff']:.1e}); last: pipesim "
            f"{r['pipesim']['iteration_losses'][-1]:.6f}, torch {r['torch']['iteration_losses'][-1]:.6f}"
        )
    return "\n".join(lines)

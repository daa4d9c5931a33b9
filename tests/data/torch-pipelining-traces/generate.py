"""Write torch.profiler (Kineto) traces of torch.distributed.pipelining runs.

Each run is torch's own pipelining on CPU processes over gloo, a few Linear
layers per stage, profiled with ``torch.profiler`` (CPU activity,
``record_shapes=False``), one gzipped Chrome-trace JSON per rank:
``<out>/<schedule>/rank<r>.json.gz``. ``pipesim trace import`` reads them, and
``tests/test_trace_import.py`` checks what it finds against the schedule.

Why these choices:

* a profiler schedule with one warm-up step, so the recorded steps are
  ``ProfilerStep#N`` ranges as in a real training loop, and torch's first
  ``step()``, which also infers the stages' shapes (messages no later step
  sends), is not recorded;
* an SGD step after every ``step()``, so the trace has the optimizer's own
  ``Optimizer.step#SGD.step`` range that an update's time is read from;
* the gzip header has no file name and no time stamp, so the same trace
  always compresses to the same bytes.

Run from the repository root (about 10 s per schedule on 2 cores)::

    python3 tests/data/torch-pipelining-traces/generate.py            # every schedule
    python3 tests/data/torch-pipelining-traces/generate.py --schedule 1f1b --out /tmp/traces

Worker processes are started by :func:`pipesim.validate.launch.launch` (a
deadline, no process left behind).
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: schedule folder -> (torch class, ranks, stages per rank, micro-batches)
SCHEDULES: dict[str, tuple[str, int, int, int]] = {
    "gpipe": ("ScheduleGPipe", 2, 1, 4),
    "1f1b": ("Schedule1F1B", 2, 1, 4),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, 2, 4),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", 2, 2, 4),
}


@dataclass(frozen=True)
class TraceJob:
    """One profiled pipelining run (picklable, for the workers)."""

    schedule: str  # a key of SCHEDULES
    out_dir: str
    ranks: int
    stages_per_rank: int
    microbatches: int
    steps: int = 2
    width: int = 512
    microbatch_size: int = 32
    seed: int = 0


def _stage_module(width: int):
    from torch import nn

    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def trace_worker(ctx, job: TraceJob) -> str:
    """One rank: build its stages, run one warm-up step and ``job.steps``
    recorded steps under the profiler and write ``rank<r>.json.gz``; returns
    the path written."""
    import torch
    from torch.distributed import pipelining
    from torch.profiler import ProfilerActivity, profile, schedule

    rank, world = ctx.rank, ctx.world_size
    per = job.stages_per_rank
    n_stages = world * per
    torch.manual_seed(job.seed)
    # stage k lives on rank k % world (torch's interleaved placement); single
    # schedules have one stage per rank, stage = rank
    mine = [k for k in range(n_stages) if k % world == rank]
    stages, params = [], []
    for k in mine:
        module = _stage_module(job.width)
        params += list(module.parameters())
        x = torch.zeros(job.microbatch_size, job.width).requires_grad_(k > 0)
        y = torch.zeros(job.microbatch_size, job.width).requires_grad_(True)
        stages.append(pipelining.PipelineStage(module, k, n_stages, ctx.device, input_args=x, output_args=y))
    kind = getattr(pipelining, SCHEDULES[job.schedule][0])

    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target)

    sched = kind(stages if per > 1 else stages[0], n_microbatches=job.microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(params, lr=0.01)
    first, last = 0 in mine, n_stages - 1 in mine
    gen = torch.Generator().manual_seed(job.seed)
    batch = job.microbatches * job.microbatch_size

    def step() -> None:
        x = torch.randn(batch, job.width, generator=gen)
        target = torch.randn(batch, job.width, generator=gen)
        opt.zero_grad()
        args = (x,) if first else ()
        kwargs = {"target": target} if last else {}
        sched.step(*args, **kwargs)
        opt.step()

    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=False,
        schedule=schedule(wait=0, warmup=1, active=job.steps, repeat=1),
    ) as prof:
        for _ in range(1 + job.steps):  # the warm-up step, then the recorded ones
            step()
            prof.step()
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f".rank{rank}.json"
    prof.export_chrome_trace(str(raw))
    path = out / f"rank{rank}.json.gz"
    with open(raw, "rb") as src, open(path, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
        gz.write(src.read())
    raw.unlink()
    return str(path)


def generate(
    schedule: str,
    out_dir: str | os.PathLike,
    *,
    ranks: int | None = None,
    microbatches: int | None = None,
    steps: int = 2,
    width: int = 512,
    microbatch_size: int = 32,
    timeout_s: float = 180.0,
) -> list[Path]:
    """Profile one schedule's run; the traces written, by rank.

    ``out_dir`` receives ``rank<r>.json.gz`` for every rank; ``ranks`` and
    ``microbatches`` default to :data:`SCHEDULES`'s."""
    from pipesim.validate.launch import launch

    cls, default_ranks, per, default_m = SCHEDULES[schedule]
    job = TraceJob(
        schedule=schedule,
        out_dir=str(out_dir),
        ranks=ranks or default_ranks,
        stages_per_rank=per,
        microbatches=microbatches or default_m,
        steps=steps,
        width=width,
        microbatch_size=microbatch_size,
    )
    paths = launch(trace_worker, job.ranks, args=(job,), backend="gloo", timeout_s=timeout_s)
    return [Path(p) for p in paths]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    ap.add_argument("--out", default=str(HERE), help="folder that receives one sub-folder per schedule")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps")
    ap.add_argument("--width", type=int, default=512, help="features of every Linear layer")
    ap.add_argument("--microbatch-size", type=int, default=32, help="rows per micro-batch")
    args = ap.parse_args(argv)
    for name in args.schedule:
        paths = generate(
            name, Path(args.out) / name, steps=args.steps, width=args.width, microbatch_size=args.microbatch_size
        )
        total = sum(p.stat().st_size for p in paths)
        print(f"{name}: {len(paths)} ranks, {total / 1024:.0f} KiB in {Path(args.out) / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

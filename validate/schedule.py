"""A schedule object with ``.step()``, for people used to torch.distributed.pipelining.

torch's pattern is a stage wrapping a module and a schedule object whose
``step()`` trains one mini-batch. Here a step runs the pipesim schedule once,
all its iterations (an asynchronous schedule has no flush inside a run, so
its iterations are one unit), and returns one mean loss per iteration::

    stage = PipelineStage(module, rank, world, loss_fn=loss)      # one per local stage
    sched = PipelineSchedule(build_schedule(spec), [stage], OptimizerConfig(lr=0.05))
    losses = sched.step(data)        # data.batch(i) -> (inputs, targets)

Inside an initialised process group whose size is the schedule's device
count, each rank passes the stages it hosts and the step runs distributed
(the losses come back on rank 0; other ranks get ``None``). Without one, all
stages are passed and the step runs in this process, in simulated-time
order (:func:`~pipesim.validate.executor.emulate`).

Consecutive steps continue training: each step reads the next
micro-batches of ``data`` and its weight versions continue from the last
step's (the IR's versions are shifted by the updates already applied).
Gradient scaling is explicit in :class:`~pipesim.validate.stage.OptimizerConfig`.

Steps compute with ``threads`` intra-op threads (default: the distributed
workers' count), so a local step, a distributed step and the emulator give
the same bits (:mod:`pipesim.validate.numerics`); ``threads=None`` keeps
torch's own setting, faster on a many-core CPU but no longer bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from pipesim.sim.ir import UPDATE, Schedule, shift_versions
from .executor import RunOutput, emulate, initial_centres, iteration_losses
from .numerics import EXECUTOR_THREADS, intra_op_threads
from .stage import OptimizerConfig


@dataclass(frozen=True)
class _Context:
    rank: int
    world_size: int
    backend: str
    device: torch.device


class _Offset:
    """The data source seen from a later step: indices continue where the last step stopped."""

    def __init__(self, data, offset: int):
        self.data, self.offset = data, offset

    def batch(self, index):
        return self.data.batch(index + self.offset)


class PipelineSchedule:
    """Run ``schedule`` on ``stages`` with :meth:`step` (see the module doc)."""

    def __init__(self, schedule: Schedule, stages, optimizer: OptimizerConfig = OptimizerConfig(), *,
                 recv_lookahead: int = 1, timed: bool = False, threads: int | None = EXECUTOR_THREADS):
        self.schedule = schedule
        self.stages = {s.key: s for s in stages}
        if not self.stages:
            raise ValueError("PipelineSchedule needs at least one stage")
        self.optimizer = optimizer
        self.recv_lookahead = recv_lookahead
        self.timed = timed
        self.threads = threads
        self.steps = 0
        self.output: RunOutput | None = None
        self.updates_per_step = sum(1 for a in schedule.programs[schedule.placement()[next(iter(self.stages))]]
                                    if a.op is UPDATE and (a.replica, a.stage) == next(iter(self.stages)))
        self._centres = None
        self._timeline = None

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def step(self, data) -> list[float] | None:
        """Run the schedule once; one mean loss per iteration (None on ranks other than 0)."""
        sched = shift_versions(self.schedule, self.steps * self.updates_per_step)
        src = _Offset(data, self.steps * sched.total_microbatches)
        if self._centres is None:
            self._centres = initial_centres(sched, self.stages)
        with intra_op_threads(self.threads):
            out = self._step_distributed(sched, src) if self._distributed() else self._step_local(sched, src)
        self.steps += 1
        self.output = out
        return None if out is None else iteration_losses(out.losses, sched.num_microbatches)

    def _step_local(self, sched: Schedule, data) -> RunOutput:
        from pipesim.sim.engine import simulate
        from pipesim.sim.hardware import load_hardware
        from pipesim.sim.partition import stage_costs_uniform

        if self._timeline is None:  # the order depends on the structure only, not on version numbers
            self._timeline = simulate(self.schedule, stage_costs_uniform(sched.num_stages), load_hardware("ideal"))
        timeline = self._timeline
        return emulate(sched, self.stages, data, self.optimizer, timeline, recv_lookahead=self.recv_lookahead,
                       timed=self.timed, centres=self._centres, threads=None)  # set by step()

    def _step_distributed(self, sched: Schedule, data) -> RunOutput | None:
        from .runtime import execute

        world = dist.get_world_size()
        if world != sched.num_devices:
            raise ValueError(f"the process group has {world} ranks; the schedule needs {sched.num_devices}")
        device = next(iter(self.stages.values())).device
        ctx = _Context(dist.get_rank(), world, dist.get_backend(), device)
        specs = self._infer_specs(sched, data)
        return execute(ctx, sched, self.stages, data, specs, self.optimizer, recv_lookahead=self.recv_lookahead,
                       timed=self.timed, centres=self._centres)

    def _infer_specs(self, sched: Schedule, data) -> list:
        """Every stage's output (shape, dtype), found by running replica 0's
        stages in order, each on the rank that holds it, on the first batch."""
        where = sched.placement()
        specs = []
        for k in range(sched.num_stages):
            owner = where[(0, k)]
            box = [None]
            if dist.get_rank() == owner:
                st = self.stages[(0, k)]
                inp = data.batch(0)[0] if k == 0 else torch.zeros(specs[-1][0], dtype=specs[-1][1])
                with torch.no_grad():
                    out = st.module(inp.to(st.device))
                box = [(tuple(out.shape), out.dtype)]
            dist.broadcast_object_list(box, src=owner)
            specs.append((torch.Size(box[0][0]), box[0][1]))
        return specs

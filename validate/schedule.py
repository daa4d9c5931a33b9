"""A schedule object with ``.step()``, for people used to torch.distributed.pipelining.

torch's pattern is a stage wrapping a module and a schedule object whose
``step()`` trains one mini-batch. Here a step runs the next ``K`` iterations
of the pipesim schedule (the K it was built with) and returns one mean loss
per iteration::

    stage = PipelineStage(module, rank, world, loss_fn=loss)      # one per local stage
    sched = PipelineSchedule(build_schedule(spec), [stage], OptimizerConfig(lr=0.05))
    for _ in range(steps):
        losses = sched.step(data)    # data.batch(i) -> (inputs, targets)
    sched.flush()                    # drain the pipeline (asynchronous schedules)

Consecutive steps **continue one pipeline**: an asynchronous schedule
(PipeDream, SpecTrain, 2BW) is not drained between calls, so its micro-batches
stay in flight and its weight versions run on, and K calls of ``step()``
followed by :meth:`~PipelineSchedule.flush` give the same bits as one run K
times as long (:mod:`pipesim.validate.stream` says how the stream is cut).
The pipeline drains only on ``flush()`` or, with ``steps=N``, at the end
of the N-th step; the next step then starts a new fill, on the next
micro-batches of ``data`` and the versions reached. Between steps each
stage holds its latest weights (:meth:`PipelineStage.state_dict`), which is
what a user evaluating mid-run sees. Flush schedules end every step with an
update of every stage, so for them ``flush()`` has nothing to do.

Inside an initialised process group whose size is the schedule's device
count, each rank passes the stages it hosts and the step runs distributed
(the losses come back on rank 0; other ranks get ``None``). Without one, all
stages are passed and the step runs in this process, in simulated-time
order (:func:`~pipesim.validate.executor.emulate`).

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

from pipesim.sim.ir.core import AVERAGE, Schedule
from pipesim.validate.executor import RunOutput, emulate, initial_centres, iteration_losses
from pipesim.validate.numerics import EXECUTOR_THREADS, intra_op_threads
from pipesim.validate.stage import OptimizerConfig
from pipesim.validate.stream import Part, Stream, StreamError, moved, moved_on, stream_builder, updates


@dataclass(frozen=True)
class _Context:
    rank: int
    world_size: int
    backend: str
    device: torch.device


def _timeline(schedule: Schedule):
    """The simulated order of a schedule's actions (it depends on the
    structure only, so an ideal machine and uniform stages serve)."""
    from pipesim.sim.engine.core import simulate
    from pipesim.sim.hardware.machines import load_hardware
    from pipesim.sim.partition.split import stage_costs_uniform

    return simulate(schedule, stage_costs_uniform(schedule.num_stages), load_hardware("ideal"))


class PipelineSchedule:
    """Run ``schedule`` on ``stages`` with :meth:`step` (see the module doc).

    ``steps``: how many steps the pipeline runs before it drains on its own
    (then its stream is built once, exactly that long); ``None``: until
    :meth:`flush`. ``specs``: what every stage's output carries, as
    :func:`~pipesim.validate.runtime.boundary_specs` gives it, for a
    distributed run; ``None``: inferred on the first step (one tensor a cut).
    """

    def __init__(
        self,
        schedule: Schedule,
        stages,
        optimizer: OptimizerConfig = OptimizerConfig(),
        *,
        steps: int | None = None,
        recv_lookahead: int = 1,
        timed: bool = False,
        threads: int | None = EXECUTOR_THREADS,
        specs: list | None = None,
    ):
        self.schedule = schedule
        self.stages = {s.key: s for s in stages}
        if not self.stages:
            raise ValueError("PipelineSchedule needs at least one stage")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be a positive integer or None, got {steps!r}")
        self.optimizer = optimizer
        self.recv_lookahead = recv_lookahead
        self.timed = timed
        self.threads = threads
        self.total_steps = steps
        self.steps = 0  # step() calls so far
        self.output: RunOutput | None = None
        self._build = stream_builder(schedule)
        self._stream: Stream | None = None
        self._in_stream = 0  # steps run of the current stream
        self._first_id = 0  # micro-batch ids and versions the finished streams used
        self._versions: dict = {}
        self._centres = None
        self._specs = specs
        self._data = None

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def step(self, data) -> list[float] | None:
        """Run the next part of the pipeline; one mean loss per iteration it
        started (None on ranks other than 0)."""
        if self._stream is None:
            self._stream = Stream(
                self._build, self.schedule.total_microbatches, self.recv_lookahead, _timeline, steps=self.total_steps
            )
            if self._centres is None:  # EASGD's centres start at the initial weights
                self._centres = initial_centres(self._stream.layout.lowered, self.stages)
        stream, s = self._stream, self._in_stream
        stream.ensure(s)
        last = stream.fixed and s == stream.horizon - 1
        self._announce(stream.reads(s, s + stream.reach))
        self._data = data  # the drain takes no data; a distributed run warms its stages up on it
        out = self._run(stream.part(s), data)
        self._in_stream += 1
        self.steps += 1
        if last:
            self._end_stream()
        return None if out is None else iteration_losses(out.losses, self.schedule.num_microbatches)

    def flush(self) -> None:
        """Drain the pipeline: run the backwards and updates of the
        micro-batches still in flight, so every stage holds the weights a run
        of the steps so far ends with. The next step starts a new fill."""
        if self._stream is None or not self._in_stream:
            return
        part = self._stream.drain(self._in_stream)
        drained = _actions(part)
        for key, stage in self.stages.items():
            stage.withdraw([moved(a, self._first_id, self._versions) for a in drained.get(key, [])])
        self._announce(drained)
        self._run(part, self._data)
        self._end_stream()

    # ------------------------------------------------------------ internals

    def _end_stream(self) -> None:
        """The next stream continues the ids and versions where this one ends."""
        done = self._stream.build(self._in_stream)
        self._first_id += done.total_microbatches
        for key, n in updates(done).items():
            self._versions[key] = self._versions.get(key, 0) + n
        self._stream, self._in_stream = None, 0

    def _announce(self, actions: dict) -> None:
        """Tell this process's stages the reads of the parts to come (before
        a part overwrites a version they still need)."""
        for key, acts in actions.items():
            stage = self.stages.get(key)
            if stage is not None:
                stage.prepare(
                    [moved(a, self._first_id, self._versions) for a in acts] if self._first_id else acts, self.optimizer
                )

    def _run(self, part: Part, data) -> RunOutput | None:
        sched = moved_on(part.schedule, self._first_id, self._versions)
        averaged = {a.stage for prog in sched.programs for a in prog if a.op is AVERAGE and a.key[:2] in self.stages}
        if averaged - set(self._centres):
            raise StreamError(
                f"{sched.strategy}: a step averages stages {sorted(averaged)} that the first "
                f"{self._stream.horizon} steps did not (pass steps= to build the whole run at once)"
            )
        with intra_op_threads(self.threads):
            if self._distributed():
                out = self._run_distributed(sched, data)
            else:
                out = emulate(
                    sched,
                    self.stages,
                    data,
                    self.optimizer,
                    part,
                    timed=self.timed,
                    centres=self._centres,
                    threads=None,
                )  # set above
        for stage in self.stages.values():
            stage.losses.clear()  # reported once, by the part that made them
        if out is not None:
            self.output = out
        return out

    def _run_distributed(self, sched: Schedule, data) -> RunOutput | None:
        from pipesim.validate.runtime import execute

        world = dist.get_world_size()
        if world != sched.num_devices:
            raise ValueError(f"the process group has {world} ranks; the schedule needs {sched.num_devices}")
        device = next(iter(self.stages.values())).device
        ctx = _Context(dist.get_rank(), world, dist.get_backend(), device)
        if self._specs is None:
            self._specs = self._infer_specs(sched, data)
        return execute(
            ctx,
            sched,
            self.stages,
            data,
            self._specs,
            self.optimizer,
            recv_lookahead=self.recv_lookahead,
            timed=self.timed,
            centres=self._centres,
        )

    def _infer_specs(self, sched: Schedule, data) -> list:
        """Every stage's output as :func:`~pipesim.validate.runtime.boundary_specs`
        gives it (one ``(shape, dtype, carries_gradient)``: these stages pass one
        tensor), found by running replica 0's stages in order, each on the rank
        that holds it, on the first batch."""
        where = sched.placement()
        specs = []
        for k in range(sched.num_stages):
            owner = where[(0, k)]
            box = [None]
            if dist.get_rank() == owner:
                st = self.stages[(0, k)]
                inp = data.batch(0)[0] if k == 0 else torch.zeros(specs[-1][0][0], dtype=specs[-1][0][1])
                with torch.no_grad():
                    out = st.module(inp.to(st.device))
                box = [(tuple(out.shape), out.dtype)]
            dist.broadcast_object_list(box, src=owner)
            specs.append(((torch.Size(box[0][0]), box[0][1], box[0][1].is_floating_point),))
        return specs


def _actions(part: Part) -> dict:
    """Per (replica, stage), the compute actions of a part."""
    out: dict = {}
    for prog in part.schedule.programs:
        for a in prog:
            out.setdefault((a.replica, a.stage), []).append(a)
    return out

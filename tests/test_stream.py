"""``PipelineSchedule.step()`` continues one pipeline across calls.

K calls of ``step()`` and a ``flush()`` must give exactly what one run K
times as long gives: the same weights, losses and weight versions, bit for
bit. Bit-identity is the right assertion (``pipesim.validate.numerics``):
every stage runs the same operations on the same shapes in the same order
either way, so any difference is a pairing, ordering or counting bug. A
pipeline drained at every call (what ``step()`` once did) differs at the
first drain for PipeDream, SpecTrain and 2BW.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from toy import SeededData, tanh_layers

from pipesim.sim.strategies import ScheduleSpec, build_schedule, get_strategy, strategies
from pipesim.validate.executor import emulate, iteration_losses
from pipesim.validate.schedule import PipelineSchedule, _timeline
from pipesim.validate.stage import OptimizerConfig, PipelineStage
from pipesim.validate.stream import StreamError, moved_on, updates

#: numerics tests: CI runs them again with lesser ATen and MKL kernels (.ci/run)
pytestmark = pytest.mark.numerics

D, CLASSES, BATCH = 8, 3, 4
OPT = OptimizerConfig(lr=0.1, momentum=0.9)


def layers(n=4):
    return tanh_layers(n, D, CLASSES, seed=3, weight_scale=0.5)


def Data():  # noqa: N802 (a data source, as the tests construct it)
    return SeededData(BATCH, D, CLASSES, first_seed=50)


def stages_for(sched):
    base = layers()
    per = len(base) // sched.num_stages
    return {
        (rep, k): PipelineStage(
            nn.Sequential(*copy.deepcopy(base[k * per : (k + 1) * per])),
            k,
            sched.num_stages,
            replica=rep,
            loss_fn=nn.CrossEntropyLoss(),
        )
        for rep, k in sched.placement()
    }


def spec(name, iterations, **kw):
    options = {"pipedream-vanilla": {"stashing": False}}.get(name, {})
    strategy = "pipedream" if name == "pipedream-vanilla" else name
    defaults = {
        "interleaved-1f1b": {"stages": 2, "chunks": 2},
        "avgpipe": {"stages": 2, "tau": 2},
        "data-parallel": {"stages": 2},
    }.get(strategy, {"stages": 4})
    return ScheduleSpec(strategy=strategy, iterations=iterations, **(defaults | options | kw))


def long_run(spec_):
    sched = build_schedule(spec_)
    stages = stages_for(sched)
    out = emulate(sched, stages, Data(), OPT, _timeline(sched))
    return stages, out


def assert_same_state(got_stages, got_versions, want_stages, want_out):
    assert got_versions == want_out.versions_used
    for key, stage in want_stages.items():
        assert got_stages[key].pool.version == stage.pool.version, key
        for a, b in zip(got_stages[key].weights(), stage.weights()):
            assert torch.equal(a, b), key


NAMES = [s.name for s in strategies() if s.executable] + ["pipedream-vanilla"]  # the emulator runs them


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("m", [1, 4])
def test_k_steps_and_a_flush_equal_one_run_k_times_as_long(name, m):
    if (
        m < 4
        and get_strategy(spec(name, 1, microbatches=4).strategy).needs_m_ge_p
        or (name == "data-parallel" and m % 2)
    ):
        pytest.skip("m < p (or not a multiple of the devices) is not defined for this strategy")
    K = 3
    want_stages, want = long_run(spec(name, K, microbatches=m))
    sched = build_schedule(spec(name, 1, microbatches=m))
    for total in (None, K):  # drained by flush(), or by the last of `steps=K`
        stages = stages_for(sched)
        runner = PipelineSchedule(sched, stages.values(), OPT, steps=total)
        losses = [runner.step(Data()) for _ in range(K)]
        runner.flush()
        # one mean loss per iteration, from the micro-batches that iteration started
        assert [x for step in losses for x in step] == iteration_losses(want.losses, sched.num_microbatches)
        versions = {key: list(s.versions_used) for key, s in sorted(stages.items())}
        assert_same_state(stages, versions, want_stages, want)


def test_draining_at_every_call_would_differ():
    """The assertion above has teeth: PipeDream drained after each step
    (``steps=1`` each time) trains differently from one continued pipeline."""
    K = 3
    want_stages, _ = long_run(spec("pipedream", K, microbatches=2))
    sched = build_schedule(spec("pipedream", 1, microbatches=2))
    stages = stages_for(sched)
    runner = PipelineSchedule(sched, stages.values(), OPT, steps=1)
    for _ in range(K):
        runner.step(Data())
    assert all(s.pool.version == want_stages[k].pool.version for k, s in stages.items())
    assert any(not torch.equal(a, b) for k, s in stages.items() for a, b in zip(s.weights(), want_stages[k].weights()))


def test_a_flush_then_more_steps_start_a_new_fill_where_the_last_one_ended():
    sched = build_schedule(spec("spectrain", 1, microbatches=2))
    stages = stages_for(sched)
    runner = PipelineSchedule(sched, stages.values(), OPT)
    for _ in range(2):
        runner.step(Data())
    runner.flush()
    runner.flush()  # nothing in flight: nothing to do
    for _ in range(3):
        runner.step(Data())
    runner.flush()
    # the same as two runs, the second on the next micro-batches and versions
    first = build_schedule(spec("spectrain", 2, microbatches=2))
    second = moved_on(build_schedule(spec("spectrain", 3, microbatches=2)), first.total_microbatches, updates(first))
    want = stages_for(first)
    emulate(first, want, Data(), OPT, _timeline(first))
    emulate(second, want, Data(), OPT, _timeline(build_schedule(spec("spectrain", 3, microbatches=2))))
    for key, s in stages.items():
        assert s.pool.version == want[key].pool.version == 10
        assert all(torch.equal(a, b) for a, b in zip(s.weights(), want[key].weights()))


def test_stages_hold_only_the_versions_their_strategy_needs():
    """A stage keeps no more weight buffers than its strategy declares, also
    when steps announce reads ahead (SpecTrain once kept one per update)."""
    for name in ("spectrain", "pipedream", "pipedream-vanilla", "pipedream-2bw"):
        sched = build_schedule(spec(name, 1, microbatches=4))
        stages = stages_for(sched)
        runner = PipelineSchedule(sched, stages.values(), OPT)
        for _ in range(4):
            runner.step(Data())
        runner.flush()
        strategy = get_strategy(sched.strategy)
        for (_, k), s in stages.items():
            assert s.pool.buffers <= strategy.weight_versions(sched.options, k, sched.num_stages), (name, k)


def test_an_edited_asynchronous_schedule_cannot_be_continued():
    sched = build_schedule(spec("pipedream", 1, microbatches=2))
    edited = sched.with_programs([sched.programs[0][:-1]] + list(sched.programs[1:]))  # its last update dropped
    with pytest.raises(StreamError, match="does not build this schedule"):
        PipelineSchedule(edited, stages_for(sched).values(), OPT)


def _stream_worker(ctx, strategy, steps):
    from pipesim.validate.runtime import build_stages

    job = _job(strategy, 1)
    keys = [k for k, d in job.schedule.placement().items() if d == ctx.rank]
    _, _, stages, data = build_stages(job, keys, ctx.device)
    runner = PipelineSchedule(job.schedule, stages.values(), job.optimizer)
    losses = [runner.step(data) for _ in range(steps)]
    runner.flush()
    return losses, {k: s.state_dict() for k, s in stages.items()}


def _job(strategy, iterations):
    from pipesim.validate.runtime import Job

    sched = build_schedule(ScheduleSpec(strategy=strategy, stages=2, microbatches=2, iterations=iterations))
    return Job(
        schedule=sched,
        model="mlp",
        starts=(0, 3),
        microbatch_size=8,
        width=32,
        depth=4,
        optimizer=OptimizerConfig(lr=0.05, momentum=0.9),
    )


@pytest.mark.multiprocess
def test_distributed_steps_continue_the_pipeline_bit_for_bit():
    from pipesim.validate.launch import launch
    from pipesim.validate.runtime import build_stages

    got = launch(_stream_worker, 2, args=("spectrain", 3), timeout_s=120)
    job = _job("spectrain", 3)
    _, _, stages, data = build_stages(job, job.schedule.placement(), torch.device("cpu"))
    want = emulate(job.schedule, stages, data, job.optimizer, _timeline(job.schedule))
    losses, weights = got[0][0], {**got[0][1], **got[1][1]}
    assert [x for step in losses for x in step] == iteration_losses(want.losses, 2)
    assert got[1][0] == [None] * 3
    for key, state in want.weights.items():
        for name, t in state.items():
            assert torch.equal(weights[key][name], t), (key, name)

"""The distributed runtime against the emulator: same IR, same numbers.

Bit-identical final weights, losses and weight versions on CPU for every
strategy (2 devices), and a few 3- and 4-device schedules, and
``PipelineSchedule.step()`` twice against one run twice as long. Jobs of one
device count share one launch, because starting workers is what costs.

Why exact equality is the right assertion here, on any CPU: both sides run
the same operations on the same shapes in the same order, reduce across
replicas in pipesim's own replica order, and compute with the same intra-op
thread count on the same machine (the argument in full, point by point, is
:mod:`pipesim.validate.numerics`). A difference in the last bit therefore
means one of those points broke, which is a bug, not rounding. CI runs this
module again with lesser ATen and MKL kernels (``.ci/run``), so a result
that depends on the kernels fails everywhere, not only on the machine whose
kernels happen to expose it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipesim.sim.engine.core import simulate
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.ir.checks import validate
from pipesim.sim.ir.core import Op, ScheduleError
from pipesim.sim.ir.dataflow import Arrival
from pipesim.sim.partition.split import stage_costs_uniform
from pipesim.sim.strategies import ScheduleSpec, build_schedule, get_strategy, strategy_names
from pipesim.validate.executor import compiled, emulate, iteration_losses
from pipesim.validate.numerics import EXECUTOR_THREADS
from pipesim.validate.runtime import (
    Job,
    build_stages,
    check_pair_order,
    run_many,
    transfer_peers,
    transfer_tag,
)
from pipesim.validate.stage import OptimizerConfig, PipelineStage

#: numerics tests: CI runs them again with lesser ATen and MKL kernels (.ci/run)
pytestmark = pytest.mark.numerics

STARTS = {1: (0,), 2: (0, 3), 3: (0, 2, 4), 4: (0, 1, 3, 4)}

TWO_DEVICES = [
    ("gpipe", {}),
    ("1f1b", {}),
    ("zb-h1", {}),
    ("interleaved-1f1b", {"chunks": 2}),
    ("pipedream", {}),
    ("pipedream", {"stashing": False}),
    ("pipedream-2bw", {}),
    ("spectrain", {}),
    ("avgpipe", {"width": 2}),
    ("data-parallel", {}),
]
MORE_DEVICES = [
    ("1f1b", 3, {}),
    ("spectrain", 3, {}),
    ("pipedream-2bw", 2, {"width": 2}),
    ("avgpipe", 2, {"width": 2, "placement": "disjoint"}),
    # PipeDream's hybrid: the first stage replicated on 3 devices, the second on one ("3-1")
    ("1f1b", 2, {"replicas": (3, 1)}),
    ("pipedream", 2, {"replicas": (3, 1)}),
    ("pipedream-2bw", 2, {"replicas": (3, 1)}),
]


def job_for(strategy, stages, kw, m=None):
    m = m or (6 if "replicas" in kw else 4)  # a multiple of every stage's replicas
    sched = build_schedule(ScheduleSpec(strategy=strategy, stages=stages, microbatches=m, iterations=2, **kw))
    return Job(
        schedule=sched,
        model="mlp",
        starts=STARTS[sched.num_stages],
        microbatch_size=8,
        width=32,
        depth=4,
        optimizer=OptimizerConfig(lr=0.05, momentum=0.9),
    )


def reference(job):
    sched = job.schedule
    timeline = simulate(sched, stage_costs_uniform(sched.num_stages), load_hardware("ideal"))
    _, _, stages, data = build_stages(job, sched.placement(), torch.device("cpu"))
    return emulate(sched, stages, data, job.optimizer, timeline)


def assert_same(got, want):
    assert got.losses == want.losses
    assert got.versions_used == want.versions_used
    assert got.weights.keys() == want.weights.keys()
    for key in want.weights:
        for name, t in want.weights[key].items():
            assert torch.equal(got.weights[key][name], t), (key, name)


def test_all_strategies_are_covered():
    assert {s for s, _ in TWO_DEVICES} == {s for s in strategy_names() if get_strategy(s).executable}


@pytest.mark.multiprocess
def test_two_device_strategies_match_the_emulator_bit_for_bit():
    jobs = [job_for(s, 2 if s != "interleaved-1f1b" else 2, kw) for s, kw in TWO_DEVICES]
    timing_only = dataclasses.replace(jobs[0], return_weights=False)  # what `pipesim validate` runs
    *outs, timed = run_many([*jobs, timing_only], timeout_s=240)
    assert timed.weights == {}
    assert timed.losses == outs[0].losses and timed.versions_used == outs[0].versions_used
    for (strategy, kw), job, out in zip(TWO_DEVICES, jobs, outs):
        assert_same(out, reference(job))
        compute = [r for r in out.records if r.stream == "compute"]
        n_compute = sum(1 for p in job.schedule.programs for a in p if a.op.name not in ("REDUCE_GRAD", "AVERAGE"))
        assert len(compute) == n_compute, strategy
        assert all(r.end >= r.start for r in out.records if r.end is not None)
        # communication is timed too, and every transfer completed
        sends = [r for r in out.records if r.stream == "send"]
        assert all(r.end is not None for r in sends)


@pytest.mark.multiprocess
@pytest.mark.parametrize("devices", [3, 4])
def test_larger_pipelines_match_the_emulator(devices):
    jobs = [job for job in (job_for(s, st, kw) for s, st, kw in MORE_DEVICES) if job.schedule.num_devices == devices]
    assert jobs
    for job, out in zip(jobs, run_many(jobs, timeout_s=240)):
        assert_same(out, reference(job))


def test_transfer_tags_are_unique_and_symmetric():
    for strategy, kw in TWO_DEVICES:
        sched = build_schedule(ScheduleSpec(strategy=strategy, stages=2, microbatches=4, iterations=3, **kw))
        entries = compiled(sched)
        tokens = {tok for prog in entries for posts, *_ in prog for _, tok in posts if isinstance(tok, Arrival)}
        tags = {transfer_tag(t, sched.num_stages) for t in tokens}
        assert len(tags) == len(tokens)


def test_nccl_pair_order_holds_for_every_strategy_and_is_checked():
    for strategy, kw in TWO_DEVICES:
        sched = build_schedule(ScheduleSpec(strategy=strategy, stages=2, microbatches=4, iterations=2, **kw))
        entries = compiled(sched)
        check_pair_order(entries, transfer_peers(sched, entries))
    # swap two receives on device 1: the sends from device 0 no longer match
    sched = build_schedule(ScheduleSpec(strategy="gpipe", stages=2, microbatches=4))
    entries = compiled(sched)
    recv_slots = [j for j, (posts, *_) in enumerate(entries[1]) if any(x.op is Op.RECV_F for x, _ in posts)]
    a, b = recv_slots[0], recv_slots[1]
    ea, eb = entries[1][a], entries[1][b]
    entries[1][a] = (eb[0], *ea[1:])
    entries[1][b] = (ea[0], *eb[1:])
    with pytest.raises(ScheduleError, match="NCCL"):
        check_pair_order(entries, transfer_peers(sched, entries))


def test_a_deadlocking_schedule_is_refused_before_any_process_starts():
    sched = build_schedule(ScheduleSpec(strategy="gpipe", stages=2, microbatches=2))
    progs = [list(p) for p in sched.programs]
    progs[1] = [a for a in progs[1] if a.op is not Op.FORWARD or a.microbatch != 1] + [
        a for a in progs[1] if a.op is Op.FORWARD and a.microbatch == 1
    ]
    bad = sched.with_programs(progs)
    with pytest.raises(ScheduleError):
        validate(bad, deadlock=True)
    job = Job(schedule=bad, model="mlp", starts=(0, 3), microbatch_size=4, width=8, depth=4)
    with pytest.raises(ScheduleError):
        run_many([job], timeout_s=30)


def _stages_for(job, keys, device="cpu"):
    return build_stages(job, keys, torch.device(device))


def test_schedule_step_twice_equals_one_run_twice_as_long():
    from pipesim.validate.schedule import PipelineSchedule

    for strategy in ("1f1b", "data-parallel"):
        short = job_for(strategy, 2, {}, m=4)
        sched2 = build_schedule(ScheduleSpec(strategy=strategy, stages=2, microbatches=4, iterations=4))
        long = Job(
            schedule=sched2,
            model="mlp",
            starts=short.starts,
            microbatch_size=8,
            width=32,
            depth=4,
            optimizer=short.optimizer,
        )
        _, _, stages, data = _stages_for(short, short.schedule.placement())
        runner = PipelineSchedule(short.schedule, stages.values(), short.optimizer)
        first, second = runner.step(data), runner.step(data)
        want = reference(long)
        got = runner.output
        assert first + second == iteration_losses(want.losses, sched2.num_microbatches)
        for key, w in want.weights.items():
            for name, t in w.items():
                assert torch.equal(got.weights[key][name], t), (strategy, key, name)


def _torch_style_worker(ctx, job):
    from pipesim.validate.schedule import PipelineSchedule

    keys = [k for k, d in job.schedule.placement().items() if d == ctx.rank]
    _, _, stages, data = build_stages(job, keys, ctx.device)
    runner = PipelineSchedule(job.schedule, stages.values(), job.optimizer)
    return runner.step(data), runner.step(data)


@pytest.mark.multiprocess
def test_schedule_step_runs_distributed_inside_a_process_group():
    from pipesim.validate.launch import launch
    from pipesim.validate.schedule import PipelineSchedule

    job = job_for("pipedream-2bw", 2, {}, m=4)
    got = launch(_torch_style_worker, 2, args=(job,), timeout_s=120)
    assert got[1] == (None, None)
    _, _, stages, data = build_stages(job, job.schedule.placement(), torch.device("cpu"))
    runner = PipelineSchedule(job.schedule, stages.values(), job.optimizer)
    want = (runner.step(data), runner.step(data))
    assert got[0] == want


def test_every_executor_computes_with_the_workers_thread_count(monkeypatch):
    """Point 4 of the bit-identity argument: a GEMM's result depends on the
    intra-op thread count, so the emulator and ``step()`` must compute with
    the count the distributed workers use, whatever the caller has set, and
    give the caller's setting back afterwards."""
    from pipesim.validate.schedule import PipelineSchedule

    seen = []
    forward = PipelineStage.forward

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(PipelineStage, "forward", spy)
    job = job_for("1f1b", 2, {}, m=2)
    before = torch.get_num_threads()
    torch.set_num_threads(EXECUTOR_THREADS + 1)
    try:
        reference(job)
        _, _, stages, data = _stages_for(job, job.schedule.placement())
        PipelineSchedule(job.schedule, stages.values(), job.optimizer).step(data)
        assert torch.get_num_threads() == EXECUTOR_THREADS + 1
        _, _, stages, data = _stages_for(job, job.schedule.placement())
        free = PipelineSchedule(job.schedule, stages.values(), job.optimizer, threads=None)
        n = len(seen)
        free.step(data)
    finally:
        torch.set_num_threads(before)
    assert seen[:n] == [EXECUTOR_THREADS] * n and n > 0
    assert set(seen[n:]) == {EXECUTOR_THREADS + 1}


@pytest.mark.parametrize("model", ["mlp", "gpt-small"])
def test_split_backward_gives_the_full_backwards_gradients(model):
    """I then W (the zero-bubble split, each module's weight gradient from
    the gradient of its output that I kept) give the same input gradient and
    weight gradients as one B, on a stage in the middle of a pipeline."""
    import copy

    from torch import nn

    from pipesim.sim.ir.core import Action, B, F, I, W
    from pipesim.validate.models import build_model
    from pipesim.validate.stage import PipelineStage

    m = build_model(model, seed=3)
    body = nn.Sequential(*copy.deepcopy(m.layers[1:-1]))
    x0, _ = m.data(4).batch(0)
    with torch.no_grad():
        h = m.layers[0](x0)
    stages = [PipelineStage(copy.deepcopy(body), 1, 3) for _ in range(2)]
    stages[1].split_backward = True
    g = torch.randn_like(body(h))
    dx = []
    for st, ops in zip(stages, ((B,), (I, W))):
        st.pool.expect(0, 1 + len(ops))
        out = st.forward(Action(F, 1, 0, 0), h)
        assert out.shape == g.shape
        got = [st.backward(Action(op, 1, 0, 0), g) for op in ops]
        dx.append(got[0])
        assert got[1:] == [None] * (len(ops) - 1) and st.accumulated == 1 and not st.inflight
    assert stages[1].inflight == {} and torch.equal(dx[0], dx[1])
    for a, b in zip(stages[0].grads, stages[1].grads):
        assert torch.equal(a, b)  # the same products on the same gradients

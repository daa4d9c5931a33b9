"""DDP's gradient buckets and the compute a collective slows, held to
analytic cases: what a bucketed all-reduce exposes after the backward, how
buckets are cut, and what overlapped compute pays."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.sim.api import simulate
from pipesim.sim.engine.core import bucketed_exposure, gradient_buckets
from pipesim.sim.hardware import load_hardware
from pipesim.sim.strategies import ScheduleSpec
from pipesim.sim.workloads.profile import LayerCost, Profile
from pipesim.sim.workloads.stages import stage_cost

MIB = 1 << 20
DGX1 = load_hardware("dgx1-v100")


def machine(bucket_bytes: int = 25 * MIB, usage: float = 0.0):
    """dgx1-v100 with the given bucket cap and processor usage on NVLink."""
    spec = dataclasses.replace(DGX1.collectives, bucket_bytes=bucket_bytes, processor_usage=(("nvlink", usage),))
    return dataclasses.replace(DGX1, collectives=spec)


def profile(layers: int, grad_mib: int, backward_s: float) -> Profile:
    return Profile("p", tuple(LayerCost(f"l{i}", 1e-3, backward_s, grad_mib * MIB, 0, 0) for i in range(layers)))


def data_parallel(hw, prof: Profile, devices: int = 8):
    result = simulate(ScheduleSpec("data-parallel", devices, devices), hardware=hw, profile=prof)
    dev0 = [s for s in result.spans if s.device == 0]
    backward = next(s for s in dev0 if s.stream == "compute" and s.action.op.name == "BACKWARD")
    update = next(s for s in dev0 if s.stream == "compute" and s.action.op.name == "UPDATE")
    reduce = next(s for s in dev0 if s.stream == "collective")
    return backward, reduce, update


def test_buckets_fill_from_the_last_layer() -> None:
    cost = stage_cost(profile(4, 10, 1e-3), 0, 3)  # four 10 MiB layers, equal backward shares
    # 1 MiB first cap: the last layer alone; then 25 MiB: the next three (30 MiB)
    assert gradient_buckets(cost, MIB, 25 * MIB) == [(0.25, 10 * MIB), (1.0, 30 * MIB)]
    assert gradient_buckets(cost, MIB, 15 * MIB) == [(0.25, 10 * MIB), (0.75, 20 * MIB), (1.0, 10 * MIB)]


@given(st.lists(st.integers(0, 64 * MIB), min_size=1, max_size=12), st.integers(1, 64 * MIB))
def test_buckets_hold_every_gradient_once_in_backward_order(sizes, cap) -> None:
    prof = Profile("p", tuple(LayerCost(f"l{i}", 1e-3, 2e-3, n, 0, 0) for i, n in enumerate(sizes)))
    cost = stage_cost(prof, 0, len(sizes) - 1)
    buckets = gradient_buckets(cost, MIB, cap)
    assert sum(n for _, n in buckets) == sum(sizes)
    shares = [s for s, _ in buckets]
    assert shares == sorted(shares)
    if sum(sizes):
        # the last bucket is ready when the backward has reached the first layer with gradients
        # (layers before it have none to wait for); shares are equal here, one per layer
        first = next(i for i, n in enumerate(sizes) if n)
        assert shares[-1] == pytest.approx((len(sizes) - first) / len(sizes))
    assert all(n >= cap for _, n in buckets[1:-1])  # only the first and the last may be short


def test_exposure_in_closed_form() -> None:
    # three buckets ready at 25%, 50%, 100% of a 10 ms backward, 1 ms each
    buckets = [(0.25, 1), (0.5, 1), (1.0, 1)]
    assert bucketed_exposure(buckets, 10e-3, lambda n: 1e-3) == pytest.approx(1e-3)  # only the last shows
    # all-reduces longer than the backward: they queue, and the rest shows
    assert bucketed_exposure(buckets, 10e-3, lambda n: 6e-3) == pytest.approx(2.5e-3 + 18e-3 - 10e-3)


def test_a_long_backward_exposes_only_the_last_bucket() -> None:
    """Eight 30 MiB layers, 10 ms of backward each: every bucket but the
    last (the first layer's) all-reduces while the backward runs; the update
    waits for the last bucket's all-reduce alone."""
    hw = machine()
    backward, reduce, update = data_parallel(hw, profile(8, 30, 10e-3))
    last = hw.allreduce_estimate(range(8), 30 * MIB).seconds
    assert reduce.start == pytest.approx(backward.start + 10e-3)  # the first bucket: the last layer's
    assert reduce.end == pytest.approx(backward.end + last, rel=1e-9)
    assert update.start == pytest.approx(reduce.end)
    # unbucketed, the whole 240 MiB waits for the backward's end
    _, whole, _ = data_parallel(machine(bucket_bytes=0), profile(8, 30, 10e-3))
    assert whole.start == pytest.approx(backward.end)
    assert whole.end - whole.start == pytest.approx(hw.allreduce_estimate(range(8), 240 * MIB).seconds)


def test_overlapped_compute_pays_the_processor_usage() -> None:
    """The backward under the buckets' all-reduces runs 1 / (1 - u) as long
    while they run: the extra time, u / (1 - u) x the overlap, lands on the
    device's next pass (its update)."""
    prof = profile(8, 30, 10e-3)
    free_b, free_r, free_u = data_parallel(machine(usage=0.0), prof)
    slow_b, slow_r, slow_u = data_parallel(machine(usage=0.2), prof)
    assert (slow_b.start, slow_b.end) == (free_b.start, free_b.end)
    # one bucket a layer: seven all-reduce under the backward, the first layer's after it
    busy = DGX1.allreduce_estimate(range(8), 30 * MIB).seconds * 7
    assert busy < free_b.end - free_r.start
    extra = (slow_u.end - slow_u.start) - (free_u.end - free_u.start)
    assert extra == pytest.approx(0.2 / 0.8 * busy, rel=1e-6)


def test_a_stage_all_reduces_one_window_after_another(monkeypatch) -> None:
    """2BW's next window can end its gradients while the last window's
    all-reduce still runs (2 GiB a layer): the stage's communication stream
    runs them one after the other, never at once, and the ring that skips
    its steps (no other traffic on its links) ends where the step-by-step
    ring does."""
    from pipesim.sim.api import simulate_schedule
    from pipesim.sim.engine import core as engine
    from pipesim.sim.strategies import build_schedule

    prof = Profile("p", tuple(LayerCost(f"l{i}", 1e-3, 2e-3, 2048 * MIB, MIB, MIB) for i in range(4)))
    schedule = build_schedule(ScheduleSpec("pipedream-2bw", 4, 4, iterations=4, width=2))
    fast = simulate_schedule(schedule, prof, DGX1, starts=range(4))
    for dev in range(schedule.num_devices):
        spans = sorted((s.start, s.end) for s in fast.spans if s.device == dev and s.stream == "collective")
        assert len(spans) == 4
        assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))
    monkeypatch.setattr(engine._Run, "ring_alone", lambda self, *args, **kw: False)
    slow = simulate_schedule(schedule, prof, DGX1, starts=range(4))
    assert fast.makespan == slow.makespan


def test_replicas_sharing_a_device_bucket_their_gradients() -> None:
    """Four replicas of one stage on two devices, each device running both
    its backwards before both REDUCE_GRADs: every REDUCE_GRAD pairs with its
    own replica's backward, so the buckets start under the later backward
    (its last layer's 10 ms in) instead of waiting for its end."""
    from pipesim.sim.engine.core import simulate as run_engine
    from pipesim.sim.ir.core import REDUCE_GRAD, UPDATE, Action, B, F, Schedule

    cost = stage_cost(profile(8, 30, 10e-3), 0, 7)

    def program(reps):
        passes = [
            x for r in reps for x in (Action(F, 0, r, version=0, replica=r), Action(B, 0, r, version=0, replica=r))
        ]
        reduces = [Action(REDUCE_GRAD, 0, replica=r) for r in reps]
        return (*passes, *reduces, *(Action(UPDATE, 0, version=1, replica=r) for r in reps))

    schedule = Schedule("shared", 1, 4, (program([0, 2]), program([1, 3])), replicas=4)
    result = run_engine(schedule, [cost], machine())
    later = max(
        (s for s in result.spans if s.device == 0 and s.stream == "compute" and s.action.op is B), key=lambda s: s.start
    )
    reduce = next(s for s in result.spans if s.device == 0 and s.stream == "collective")
    assert reduce.start == pytest.approx(later.start + 10e-3)
    assert reduce.end < later.end + DGX1.allreduce_estimate(range(2), 240 * MIB).seconds

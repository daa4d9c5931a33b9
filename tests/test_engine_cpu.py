"""The engine on CPU cores (``Hardware.cpu``): shared cores and the CPU time
transfers take, each against a case worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.sim.engine.core import simulate as run_engine
from pipesim.sim.hardware.machines import CpuCost, Hardware, HardwareError, HostCpu, load_hardware
from pipesim.sim.ir.core import F
from pipesim.sim.strategies import ScheduleSpec, build_schedule
from pipesim.sim.workloads.stages import StageCost

F_S, B_S = 0.010, 0.020  # every stage's forward and backward


def _costs(stages: int, nbytes: int = 1_000_000) -> list[StageCost]:
    return [StageCost(k, k, F_S, B_S, B_S / 2, B_S / 2, 0, nbytes, 0) for k in range(stages)]


def _host(n: int, cores, *, send=CpuCost(), recv=CpuCost(), latency=0.0, bandwidth=float("inf")) -> Hardware:
    base = {
        "name": "host",
        "device": {"name": "core", "flops": 1e12, "mem_bandwidth": "inf", "memory_bytes": 1e12},
        "num_devices": n,
        "devices_per_node": n,
        "intra_node": {
            "kind": "switch" if latency or bandwidth != float("inf") else "ideal",
            "bandwidth": "inf" if bandwidth == float("inf") else bandwidth,
            "latency": latency,
        },
    }
    return replace(Hardware.from_json(base), cpu=HostCpu(tuple(cores), send, recv))


def _passes(result, dev):
    return sorted((s for s in result.spans if s.stream == "compute" and s.device == dev), key=lambda s: s.start)


def test_without_transfer_costs_own_cores_change_nothing():
    """One core per device and free transfers: the same timeline as a GPU."""
    s = build_schedule(ScheduleSpec("1f1b", 4, 8))
    cpu_hw = _host(4, [0, 1, 2, 3])
    cpu = run_engine(s, _costs(4), cpu_hw)
    gpu = run_engine(s, _costs(4), replace(cpu_hw, cpu=None))

    def passes(result):
        return sorted((x.device, x.start, x.end, str(x.action)) for x in result.spans if x.stream == "compute")

    assert passes(cpu) == passes(gpu)


@given(fixed=st.floats(1e-6, 5e-3), per_mb=st.floats(0.0, 5e-3))
@settings(max_examples=30, deadline=None)
def test_a_send_delays_the_senders_next_pass_by_exactly_its_cost(fixed, per_mb):
    """GPipe, 2 stages, 2 micro-batches, free links: stage 0 sends micro-batch
    0's activation as its forward ends, so its second forward starts exactly
    the send's CPU time later (the core was idle; nothing else differs)."""
    nbytes = 1_000_000
    send = CpuCost(fixed, 1e6 / per_mb if per_mb else float("inf"))
    s = build_schedule(ScheduleSpec("gpipe", 2, 2))
    plain = run_engine(s, _costs(2, nbytes), _host(2, [0, 1]))
    taxed = run_engine(s, _costs(2, nbytes), _host(2, [0, 1], send=send))
    f0, f1 = _passes(taxed, 0)[:2]
    assert (f0.action.op, f1.action.op) == (F, F)
    assert f1.start - f0.end == pytest.approx(send.seconds(nbytes), rel=1e-12, abs=1e-15)
    assert _passes(plain, 0)[1].start == pytest.approx(f0.end)
    assert f1.end - f1.start == pytest.approx(F_S)  # the pass itself is not stretched


def test_a_receive_during_a_pass_stretches_it_by_exactly_its_cost():
    """Stage 1 is running micro-batch 0's forward when micro-batch 1's
    activation arrives (a link of 3 ms, the last 2 of which are the
    receiver's copy; stage 0's second forward ends 10 ms after its first):
    the copy preempts the pass, which ends ``recv`` seconds late; the
    arrivals themselves are not delayed (the link time contains the copy)."""
    recv = CpuCost(0.002, float("inf"))
    s = build_schedule(ScheduleSpec("gpipe", 2, 2))
    hw = _host(2, [0, 1], recv=recv, latency=0.003)
    result = run_engine(s, _costs(2), hw)
    first = _passes(result, 1)[0]
    assert first.action.op is F and first.action.microbatch == 0
    assert first.start == pytest.approx(F_S + 0.003)  # the first copy found the core idle
    assert first.end - first.start == pytest.approx(F_S + recv.fixed_s)
    arrivals = sorted(x.end for x in result.spans if x.stream == "recv" and x.device == 1)
    assert arrivals == pytest.approx([F_S + 0.003, 2 * F_S + 0.003])  # the second inside the pass


@given(k=st.sampled_from([2, 4, 6]), c=st.sampled_from([1, 2, 3]), m=st.integers(1, 6))
@settings(max_examples=25, deadline=None)
def test_k_ranks_on_c_cores_stretch_a_compute_bound_run_by_k_over_c(k, c, m):
    """Data parallelism (no pipeline dependencies, free collectives) is
    compute-bound: k devices on c < k cores, round-robin, take k / c times as
    long as on k cores, when c divides k."""
    if c >= k or k % c:
        return
    s = build_schedule(ScheduleSpec("data-parallel", k, k * m))
    own = run_engine(s, _costs(1), _host(k, range(k)))
    shared = run_engine(s, _costs(1), _host(k, [d % c for d in range(k)]))
    assert shared.makespan == pytest.approx(own.makespan * k / c)


def _core_ends(arrivals, blocks=(), wake_slice=0.0):
    """(start, end) of passes ``(arrival, work)`` on one shared core, with
    transfer work ``(at, seconds)`` blocking it."""
    import simpy

    from pipesim.sim.engine.core import _Core

    env = simpy.Environment()
    core = _Core(env, wake_slice)
    ends = {}

    def job(i, at, work):
        yield env.timeout(at)
        start = yield from core.run(work)
        ends[i] = (start, env.now)

    def block(at, seconds):
        yield env.timeout(at)
        core.block(seconds)

    for i, (at, work) in enumerate(arrivals):
        env.process(job(i, at, work))
    for at, seconds in blocks:
        env.process(block(at, seconds))
    env.run()
    return [ends[i] for i in range(len(arrivals))]


def _flat(pairs):
    return [x for pair in pairs for x in pair]


def test_passes_on_one_core_share_it_at_equal_rates():
    """Processor sharing, worked by hand: a pass of 10 ms alone, then joined
    at 5 ms by another of 10 ms: the first has 5 ms left at half speed (ends
    at 15), the second then runs alone for its last 5 ms (ends at 20)."""
    assert _flat(_core_ends([(0, 0.010), (0.005, 0.010)])) == pytest.approx(
        _flat([(0, 0.015), (0.005, 0.020)]), abs=1e-15
    )
    # started together, both end at twice their work; three share by thirds
    assert [e for _, e in _core_ends([(0, 0.010), (0, 0.010)])] == pytest.approx([0.020, 0.020])
    assert [e for _, e in _core_ends([(0, 0.003), (0, 0.010), (0, 0.010)])] == pytest.approx([0.009, 0.023, 0.023])


def test_a_pass_that_starts_beside_another_runs_alone_for_its_wake_slice():
    """Slice 1.5 ms. 10 ms at 0, joined at 5 ms by 1 ms: the newcomer runs
    alone (5 to 6), the first is pushed back by it (ends at 11). Joined by
    3 ms instead: alone 5 to 6.5, then both share; the newcomer's last 1.5 ms
    take 3 (ends at 9.5), the first has 3.5 ms left then (ends at 13)."""
    assert _flat(_core_ends([(0, 0.010), (0.005, 0.001)], wake_slice=0.0015)) == pytest.approx(
        _flat([(0, 0.011), (0.005, 0.006)]), abs=1e-15
    )
    assert _flat(_core_ends([(0, 0.010), (0.005, 0.003)], wake_slice=0.0015)) == pytest.approx(
        _flat([(0, 0.013), (0.005, 0.0095)]), abs=1e-15
    )
    # a transfer's work during the slice pushes the slice back by its length
    assert _flat(_core_ends([(0, 0.010), (0.005, 0.001)], [(0.0055, 0.002)], wake_slice=0.0015)) == pytest.approx(
        _flat([(0, 0.013), (0.005, 0.008)]), abs=1e-15
    )


def test_transfer_work_stalls_every_pass_on_the_core():
    """2 ms of transfer work at 4 ms stretches both shared passes by 2 ms;
    on an idle core it delays the next pass's start until it is done."""
    assert [e for _, e in _core_ends([(0, 0.010), (0, 0.010)], [(0.004, 0.002)])] == pytest.approx([0.022, 0.022])
    assert _flat(_core_ends([(0.001, 0.010)], [(0, 0.002)])) == pytest.approx(_flat([(0.002, 0.012)]))
    # a block arriving in a block queues behind it
    assert _flat(_core_ends([(0.001, 0.010)], [(0, 0.002), (0.001, 0.002)])) == pytest.approx(_flat([(0.004, 0.014)]))


@given(
    works=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 20)), min_size=1, max_size=6),
    wake_slice=st.sampled_from([0.0, 0.0015, 0.004]),
)
@settings(max_examples=60, deadline=None)
def test_a_shared_core_is_never_idle_while_work_is_left(works, wake_slice):
    """Work is conserved: the last pass ends when the core has done all the
    work that arrived, counting idle gaps before arrivals (a busy period's
    end is its start plus the work that arrived within it)."""
    arrivals = sorted((a * 1e-3, w * 1e-3) for a, w in works)
    ends = _core_ends(arrivals, wake_slice=wake_slice)
    free = 0.0
    for at, work in arrivals:
        free = max(free, at) + work
    assert max(e for _, e in ends) == pytest.approx(free, abs=1e-12)
    assert all(e - s >= w - 1e-12 for (s, e), (_, w) in zip(ends, arrivals))  # never faster than alone


def test_cpu_section_round_trips_and_is_checked():
    hw = _host(2, [0, 0], send=CpuCost(1e-5, 2e9), recv=CpuCost(2e-5, 3e9))
    again = Hardware.from_json(hw.to_json())
    assert again.cpu == hw.cpu and again.cpu.shared
    with pytest.raises(HardwareError, match="cores for 2 devices"):
        replace(
            again, num_devices=None, devices_per_node=None, intra_node=load_hardware("ideal").intra_node
        ).check_devices(3)
    for bad in (
        {"cores": []},
        {"cores": [0, -1]},
        {"cores": [0, 1], "send": {"fixed_s": -1}},
        {"cores": [0, 1], "recv": {"bytes_per_s": 0}},
        {"cores": [0, 1], "speed": 1},
    ):
        with pytest.raises(HardwareError):
            Hardware.from_json({**hw.to_json(), "cpu": bad})
    with pytest.raises(HardwareError, match="each of the 4 devices"):
        Hardware.from_json({**load_hardware("pcie-4gpu").to_json(), "cpu": {"cores": [0, 1]}})


def test_each_memory_bound_kernel_runs_at_its_own_bandwidth():
    """An UPDATE costs 5 |W| (SGD) at the device's update bandwidth, a
    PREDICT 3 |W| at its predict bandwidth; a device without them prices
    both at mem_bandwidth."""
    from pipesim.sim.engine.core import CostModel
    from pipesim.sim.ir.core import PREDICT, UPDATE, Action

    plain = load_hardware("pcie-4gpu").device
    device = replace(plain, update_bandwidth=2e9, predict_bandwidth=3e9, average_bandwidth=4e9)
    cost = StageCost(0, 0, 1.0, 2.0, 1.0, 1.0, 6_000_000, 0, 0)
    own = CostModel.for_device([cost], device)
    assert own.compute(Action(UPDATE, 0, version=1)) == pytest.approx(5 * 6e6 / 2e9)
    assert own.compute(Action(PREDICT, 0, version=0, distance=1)) == pytest.approx(3 * 6e6 / 3e9)
    assert own.averaging(0, 2) == pytest.approx(6 * 6e6 / 4e9)
    shared = CostModel.for_device([cost], plain)
    assert shared.compute(Action(UPDATE, 0, version=1)) == pytest.approx(5 * 6e6 / plain.mem_bandwidth)
    again = Hardware.from_json(
        {
            **load_hardware("pcie-4gpu").to_json(),
            "device": {**load_hardware("pcie-4gpu").to_json()["device"], "predict_bandwidth": 3e9},
        }
    )
    assert again.device.predict_bandwidth == 3e9 and again.device.kernel_bandwidth("update") == plain.mem_bandwidth
    assert Hardware.from_json(again.to_json()) == again
    with pytest.raises(HardwareError, match="average_bandwidth"):
        replace(plain, average_bandwidth=0.5)


def test_an_all_reduce_on_cores_costs_its_copies_and_additions():
    """Data parallelism on 2 cores, free links: each core sends its whole
    gradient buffer to the other and receives the other's (the gloo
    runtime's exchange), then adds and halves: 3 + 2 buffers of traffic at
    the update bandwidth. The all-reduce lasts exactly that CPU work."""
    weights = 8_000_000
    send, recv = CpuCost(1e-4, 4e9), CpuCost(2e-4, 8e9)
    hw = _host(2, [0, 1], send=send, recv=recv)
    hw = replace(hw, device=replace(hw.device, update_bandwidth=1e10))
    cost = [StageCost(0, 0, F_S, B_S, B_S / 2, B_S / 2, weights, 0, 0)]
    result = run_engine(build_schedule(ScheduleSpec("data-parallel", 2, 2)), cost, hw)
    spans = [x for x in result.spans if x.stream == "collective"]
    assert len(spans) == 2
    expect = send.seconds(weights) + recv.seconds(weights) + 5 * weights / 1e10
    assert all(x.end - x.start == pytest.approx(expect, rel=1e-9) for x in spans)
    plain = run_engine(build_schedule(ScheduleSpec("data-parallel", 2, 2)), cost, replace(hw, cpu=None))
    assert all(x.end == x.start for x in plain.spans if x.stream == "collective")  # free links, no cores

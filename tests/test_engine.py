"""The SimPy engine and its trackers, checked against the semantics note."""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.sim.api import simulate
from pipesim.sim.engine.core import simulate as run_engine
from pipesim.sim.engine.metrics import dumps, summarize
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.interchange import schedule_from_csv
from pipesim.sim.ir.checks import validate
from pipesim.sim.ir.core import PASS_OPS, B, F, I, Schedule, ScheduleError, W, parse_action, to_csv
from pipesim.sim.partition.split import stage_costs_uniform
from pipesim.sim.strategies import ScheduleSpec, build_schedule
from pipesim.sim.workloads.stages import StageCost

FAST = settings(max_examples=25, deadline=None)
sizes = st.tuples(st.integers(1, 6), st.integers(1, 10))


def run(strategy: str, p: int, m: int, **kw):
    return simulate(ScheduleSpec(strategy, p, m, **kw), "uniform", "ideal")


@FAST
@given(sizes, st.sampled_from(["gpipe", "1f1b"]))
def test_flush_bubble_is_exact(pm, strategy) -> None:
    p, m = pm
    s = summarize(run(strategy, p, m))
    expected = (p - 1) / (m + p - 1)
    assert s["bubble_fraction"] == pytest.approx(expected, abs=1e-9)
    # and the makespan is (m + p - 1) (F + B) with F = 1 ms, B = 2 ms
    assert s["makespan_s"] == pytest.approx((m + p - 1) * 3e-3)


@FAST
@given(sizes)
def test_1f1b_and_gpipe_activation_memory(pm) -> None:
    p, m = pm
    for strategy, bound in (("1f1b", lambda k: min(p - k, m)), ("gpipe", lambda k: m)):
        result = run(strategy, p, m)
        for k, mem in enumerate(result.memory):
            held = mem.peak_breakdown["activations"] / result.stage_costs[k].stash_bytes
            assert held == bound(k), (strategy, k)


@FAST
@given(st.integers(1, 5), st.integers(1, 4))
def test_pipedream_versions_and_staleness(p, k_iter) -> None:
    m = 2 * p  # enough micro-batches to reach steady state
    s = summarize(run("pipedream", p, m, iterations=k_iter))
    for info in s["stages_info"]:
        k = info["stage"]
        assert info["staleness_max"] == p - k - 1
        assert info["weight_versions"] == p - k
    vanilla = run("pipedream", p, m, stashing=False)
    assert all(v.backward_version >= v.forward_version for v in vanilla.versions)
    if p > 1:
        assert any(v.backward_version != v.forward_version for v in vanilla.versions)
        assert summarize(vanilla)["stages_info"][0]["weight_versions"] == 1


@FAST
@given(st.integers(1, 5), st.integers(0, 3), st.integers(2, 4))
def test_2bw_double_buffer_and_staleness_one(p, extra, k_iter) -> None:
    m = p + extra
    result = run("pipedream-2bw", p, m, iterations=k_iter)
    s = summarize(result)
    for info in s["stages_info"]:
        assert info["weight_versions"] <= 2
        assert info["staleness_max"] == 1
    # the first window is applied on the version it read, the rest one late
    for v in result.versions:
        assert v.staleness == (0 if v.microbatch < m else 1)


@FAST
@given(sizes, st.sampled_from(["gpipe", "1f1b", "zb-h1", "data-parallel"]))
def test_flush_schedules_have_no_staleness(pm, strategy) -> None:
    p, m = pm
    if strategy == "data-parallel":
        m = p * m
    s = summarize(run(strategy, p, m, iterations=2))
    assert all(i["staleness_max"] == 0 and i["weight_versions"] == 1 for i in s["stages_info"])


def test_spectrain_distances_reach_summary() -> None:
    result = run("spectrain", 4, 8, iterations=2)
    s = summarize(result)
    assert [i["prediction_distance_fwd"] for i in s["stages_info"]] == [3, 2, 2, 1]
    assert [i["prediction_distance_bwd"] for i in s["stages_info"]] == [0, 0, 1, 1]
    # In steady state the forward at stage k reads version i - (N-k-1), so
    # with s_fwd = k//2 + N-k-1 the effective version is i + k//2: the
    # stages of one micro-batch disagree by at most N//2 - ... = 1 here.
    eff = defaultdict(dict)
    for v in result.versions:
        eff[v.microbatch][v.stage] = v.forward_version + v.forward_distance
    for mb in range(8, 16):
        assert [eff[mb][k] - mb for k in range(4)] == [0, 0, 1, 1]


ALL = [
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "zb-h1",
    "pipedream",
    "pipedream-2bw",
    "spectrain",
    "avgpipe",
    "data-parallel",
]


def _spec_for(strategy: str, p: int, m: int) -> ScheduleSpec:
    if strategy == "data-parallel":
        return ScheduleSpec(strategy, p, p * m)
    if strategy in ("pipedream-2bw", "interleaved-1f1b"):
        m = max(m, p) if strategy == "pipedream-2bw" else p * max(1, m // p)
    return ScheduleSpec(strategy, p, m, iterations=2)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(ALL), st.integers(1, 4), st.integers(1, 6), st.sampled_from(["ideal", "pcie-4gpu"]))
def test_execution_respects_streams_and_dependencies(strategy, p, m, hardware) -> None:
    spec = _spec_for(strategy, p, m)
    result = simulate(spec, "uniform" if hardware == "ideal" else "vgg16-cifar", hardware)
    spans = result.spans
    by_dev = defaultdict(list)
    for s in spans:
        if s.stream == "compute":
            by_dev[s.device].append(s)
    for dev, items in by_dev.items():
        items.sort(key=lambda s: (s.start, s.end))
        for a, b in zip(items, items[1:]):
            assert a.end <= b.start + 1e-12, f"device {dev} overlaps {a.action} and {b.action}"
    ends = {
        (s.action.op, s.action.replica, s.action.stage, s.action.microbatch): s
        for s in spans
        if s.stream == "compute" and s.action.op in PASS_OPS
    }
    split = {(k[1], k[2]) for k in ends if k[0] is I}
    last = result.schedule.num_stages - 1
    for (op, rep, stage, mb), s in ends.items():
        needs = []
        if op is F and stage > 0:
            needs.append((F, rep, stage - 1, mb))
        if op in (B, I):
            needs.append((F, rep, stage, mb))
            if stage < last:
                needs.append((I if (rep, stage + 1) in split else B, rep, stage + 1, mb))
        if op is W:
            needs.append((I, rep, stage, mb))
        for need in needs:
            assert ends[need].end <= s.start + 1e-12, f"{s.action} started before {ends[need].action} ended"


@FAST
@given(st.sampled_from(ALL), st.integers(1, 4), st.integers(1, 5))
def test_summary_is_byte_identical(strategy, p, m) -> None:
    spec = _spec_for(strategy, p, m)
    a = dumps(summarize(simulate(spec, "bert-large", "dgx1-v100")))
    b = dumps(summarize(simulate(spec, "bert-large", "dgx1-v100")))
    assert a == b


@FAST
@given(st.sampled_from(ALL), st.integers(1, 4), st.integers(1, 5))
def test_strategies_round_trip_through_csv(strategy, p, m) -> None:
    schedule = build_schedule(_spec_for(strategy, p, m))
    back = schedule_from_csv(
        to_csv(schedule),
        strategy=schedule.strategy,
        microbatches=schedule.num_microbatches,
        iterations=schedule.num_iterations,
    )
    assert back == schedule


def test_torch_csv_schedule_simulates_like_ours() -> None:
    ours = build_schedule(ScheduleSpec("1f1b", 4, 8))
    imported = schedule_from_csv(to_csv(ours, torch_only=True))
    costs = stage_costs_uniform(4)
    hw = load_hardware("ideal")
    a, b = run_engine(ours, costs, hw), run_engine(imported, costs, hw)
    assert a.makespan == b.makespan
    assert summarize(a)["bubble_fraction"] == summarize(b)["bubble_fraction"]


def test_shared_link_serialises_transfers() -> None:
    # Two independent pipelines (width 2) on pcie-4gpu: every transfer crosses
    # the one host bridge, so link time adds up and nothing moves faster
    # than the bridge's bandwidth allows.
    result = simulate(ScheduleSpec("gpipe", 2, 4, width=2), "vgg16-cifar", "pcie-4gpu")
    transfers = sorted((s.start, s.end) for s in result.spans if s.stream == "send" and s.nbytes)
    assert transfers
    for (s0, e0), (s1, e1) in zip(transfers, transfers[1:]):
        assert s1 >= e0 - 1e-12, "two transfers used the shared PCIe bridge at once"
    p2p = sum(s.nbytes for s in result.spans if s.stream == "send")
    # plus each stage's gradient all-reduce: a 2-device ring is 2 steps in
    # which both devices send half the gradients
    ring = sum(2 * 2 * -(-c.param_bytes // 2) for c in result.stage_costs)
    assert result.link_bytes == {"node0.pcie-bridge": p2p + ring}


def test_allreduce_costs_time_on_real_links_and_none_on_ideal() -> None:
    ideal = simulate(ScheduleSpec("data-parallel", 4, 4), "uniform", "ideal")
    pcie = simulate(ScheduleSpec("data-parallel", 4, 4), "vgg16", "pcie-4gpu")
    coll = [s for s in pcie.spans if s.stream == "collective"]
    assert len(coll) == 4 and all(s.duration > 0 for s in coll)
    grad_bytes = pcie.stage_costs[0].param_bytes
    bw = load_hardware("pcie-4gpu").route(0, 1)[0].bandwidth
    # ring all-reduce: 2(n-1) steps of 1/n of the buffer per device, four
    # devices sharing one bridge: at least 2(n-1)/n * bytes * n / bandwidth
    assert coll[0].duration >= 2 * 3 * grad_bytes / bw * 0.999
    assert all(s.duration == 0 for s in ideal.spans if s.stream == "collective")


def test_engine_reports_deadlock_without_hanging() -> None:
    rows = ["0F0@v0 0B0@v0 0F1@v0 0B1@v0 0UPDATE@v1", "1F1@v0 1B1@v0 1F0@v0 1B0@v0 1UPDATE@v1"]
    s = Schedule("t", 2, 2, [[parse_action(x) for x in r.split()] for r in rows])
    with pytest.raises(ScheduleError, match="deadlock"):
        run_engine(s, stage_costs_uniform(2), load_hardware("ideal"))
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(s)


def test_stage_costs_must_match() -> None:
    s = build_schedule(ScheduleSpec("1f1b", 2, 2))
    with pytest.raises(ScheduleError, match="2 stages but 3 stage costs"):
        run_engine(s, stage_costs_uniform(3), load_hardware("ideal"))


def test_bubble_fraction_is_exact_fraction_for_interleaved() -> None:
    p, v, m = 4, 2, 8
    s = summarize(run("interleaved-1f1b", p, m, chunks=v))
    # Megatron: bubble time (p-1) chunk-times against v*m chunk-times of work
    assert Fraction(s["bubble_fraction"]).limit_denominator(1000) == Fraction(p - 1, v * m + p - 1)


def test_engine_costs_kernels_by_the_bytes_they_move() -> None:
    # sim may not import kernels, so this test holds the two byte counts together.
    from pipesim.kernels import bytes_moved
    from pipesim.sim.engine.core import CostModel
    from pipesim.sim.ir.core import PREDICT

    costs = stage_costs_uniform(1, param_bytes=4 * 1000)
    for optimizer, kernel in (("sgd", "predict_sgd"), ("adam", "predict_adam")):
        model = CostModel(tuple(costs), mem_bandwidth=1.0, optimizer=optimizer)
        assert model.traffic(PREDICT) * 4 * 1000 == bytes_moved(kernel, 1000, "float32")
    model = CostModel(tuple(costs), mem_bandwidth=1.0)
    for n in (1, 2, 4):
        assert model.averaging(0, n) == bytes_moved("elastic_average", 1000, "float32", replicas=n)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b", "zb-h1", "pipedream", "avgpipe", "data-parallel"]),
    st.integers(2, 4),
    st.integers(1, 4),
    st.data(),
)
def test_dry_run_and_engine_agree_on_deadlock(strategy, p, m, data) -> None:
    """Swap two compute actions on one device (keeping each device's own
    F-before-B order legal or not): the validator's zero-time dry run and the
    SimPy engine must reach the same verdict, and a deadlock is never a hang."""
    spec = _spec_for(strategy, p, m)
    schedule = build_schedule(spec)
    dev = data.draw(st.integers(0, schedule.num_devices - 1))
    prog = list(schedule.programs[dev])
    i, j = sorted(data.draw(st.lists(st.integers(0, len(prog) - 1), min_size=2, max_size=2, unique=True)))
    prog[i], prog[j] = prog[j], prog[i]
    mutated = schedule.with_programs([prog if d == dev else q for d, q in enumerate(schedule.programs)])
    try:
        validate(mutated, deadlock=False)
    except ScheduleError:
        return  # structurally broken: both executors refuse before running
    verdicts = []
    for check in (
        lambda: validate(mutated),
        lambda: run_engine(mutated, stage_costs_uniform(mutated.num_stages), load_hardware("ideal"), check=False),
    ):
        try:
            check()
            verdicts.append("ok")
        except ScheduleError as e:
            assert "deadlock" in str(e) and "waits for" in str(e)
            verdicts.append("deadlock")
    assert verdicts[0] == verdicts[1], verdicts


@settings(max_examples=20, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b", "zb-h1", "pipedream", "avgpipe"]),
    st.integers(2, 4),
    st.integers(1, 4),
    st.sampled_from(["pcie-4gpu", "dgx1-v100"]),
)
def test_consumers_wait_for_their_data_to_arrive(strategy, p, m, hardware) -> None:
    # On real links a pass may only start once the transfer carrying its
    # input has ended (a pass token must never stand in for its transfer).
    result = simulate(_spec_for(strategy, p, m), "vgg16-cifar", hardware)
    start = {
        (s.action.op, s.action.replica, s.action.stage, s.action.microbatch): s.start
        for s in result.spans
        if s.stream == "compute"
    }
    split = {(k[1], k[2]) for k in start if k[0] is I}
    recvs = [s for s in result.spans if s.stream == "recv"]
    assert recvs and any(s.duration > 0 for s in recvs)
    for s in recvs:
        a = s.action
        op = F if a.op.value == "RECV_F" else (I if (a.replica, a.stage) in split else B)
        assert start[(op, a.replica, a.stage, a.microbatch)] >= s.end - 1e-12, f"{a} arrived after its consumer began"


def test_critical_path_with_transfers_is_exact() -> None:
    # GPipe, 2 stages, 1 micro-batch on pcie-4gpu: nothing overlaps, so the
    # makespan is the critical path F0 -> send -> F1 -> B1 -> send -> B0 -> update.
    hw = load_hardware("pcie-4gpu")
    result = simulate(ScheduleSpec("gpipe", 2, 1), "vgg16-cifar", hw)
    c0, c1 = result.stage_costs
    act = c0.activation_bytes
    update0 = 5 * c0.param_bytes / hw.device.mem_bandwidth  # SGD: read W, g, v; write W, v
    expected = (
        c0.forward_s
        + hw.transfer_time(0, 1, act)
        + c1.forward_s
        + c1.backward_s
        + hw.transfer_time(1, 0, act)
        + c0.backward_s
        + update0
    )
    assert result.makespan == pytest.approx(expected, rel=1e-12)
    assert hw.transfer_time(0, 1, act) > 0


def test_out_of_memory_is_reported_and_breakdown_sums_to_peak() -> None:
    gpipe = summarize(simulate(ScheduleSpec("gpipe", 2, 64), "gpt-13b", "dgx-h100"))
    onef1b = summarize(simulate(ScheduleSpec("1f1b", 2, 64), "gpt-13b", "dgx-h100"))
    assert gpipe["out_of_memory"] and all(d["out_of_memory"] for d in gpipe["devices"])
    for s in (gpipe, onef1b):
        for d in s["devices"]:
            assert sum(d["memory_breakdown"].values()) == d["peak_memory_bytes"]
    # GPipe stashes all 64 micro-batches, 1F1B at most p - k = 2 on stage 0
    stash0 = onef1b["stages_info"][0]["stash_bytes"]
    assert gpipe["devices"][0]["memory_breakdown"]["activations"] == 64 * stash0
    assert onef1b["devices"][0]["memory_breakdown"]["activations"] == 2 * stash0


# -- stage replication ------------------------------------------------------


@given(r=st.integers(1, 4), rounds=st.integers(2, 6), strategy=st.sampled_from(["1f1b", "gpipe", "pipedream"]))
@settings(max_examples=40, deadline=None)
def test_replicated_stage_against_the_analytic_case(r, rounds, strategy):
    """ "r-1" on uniform layers: stage 0 holds r layers (F = r, B = 2r per
    micro-batch) on r replicas, stage 1 one layer (F = 1, B = 2) on one
    device, so both stages process a micro-batch every 3 time units. M
    micro-batches then take 3M for stage 1 plus the first micro-batch's
    forward and the last one's backward on stage 0 (3r): makespan 3M + 3r,
    every device idle r/(M + r) of it. Without the replicas stage 0 alone
    needs 3r per micro-batch: replication is what balances the split."""
    m = r * rounds
    costs = [
        StageCost(0, r - 1, 1.0 * r, 2.0 * r, 1.0 * r, 1.0 * r, 0, 0, 0),
        StageCost(r, r, 1.0, 2.0, 1.0, 1.0, 0, 0, 0),
    ]
    s = build_schedule(ScheduleSpec(strategy, 2, m, replicas=(r, 1)))
    assert s.num_devices == r + 1 and s.replicas == (r, 1)
    result = run_engine(s, costs, load_hardware("ideal"))
    assert result.makespan == pytest.approx(3 * m + 3 * r)
    summary = summarize(result)
    assert summary["bubble_fraction"] == pytest.approx(r / (m + r))
    assert summary["throughput_samples_per_s"] == pytest.approx(m / (3 * m + 3 * r))
    # unreplicated, stage 0 alone works 3r per micro-batch, one after another
    straight = run_engine(build_schedule(ScheduleSpec(strategy, 2, m)), costs, load_hardware("ideal"))
    assert straight.makespan >= 3 * r * m


def test_replicas_fan_in_over_a_shared_bus_queues():
    """Three stage-0 replicas send to the one stage-1 device over pcie-4gpu's
    single host bridge: their transfers cannot overlap, so each micro-batch's
    activation crossing waits for the ones before it (contention the
    ideal machine does not have)."""
    s = build_schedule(ScheduleSpec("gpipe", 2, 6, replicas=(3, 1)))
    costs = [
        StageCost(0, 0, 0.001, 0.002, 0.001, 0.001, 0, 2**24, 0),
        StageCost(1, 1, 0.001, 0.002, 0.001, 0.001, 0, 0, 0),
    ]
    result = run_engine(s, costs, load_hardware("pcie-4gpu"))
    sends = sorted((sp.start, sp.end) for sp in result.spans if sp.stream == "send" and sp.action.op.value == "SEND_F")
    assert len(sends) == 6
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(sends, sends[1:]))  # one at a time on the bridge
    free = run_engine(s, costs, load_hardware("ideal"))
    assert result.makespan > free.makespan


def test_runs_are_kept_until_exit_only_inside_the_block():
    """A one-shot process keeps the run's objects instead of freeing them
    (pipesim.sim._gc); a library caller, a sweep or compare must not
    accumulate them."""
    from pipesim.sim import _gc
    from pipesim.sim.api import simulate
    from pipesim.sim.strategies import ScheduleSpec

    before = len(_gc._kept)
    simulate(ScheduleSpec("1f1b", 2, 4))
    assert len(_gc._kept) == before
    try:
        with _gc.kept_until_exit():
            simulate(ScheduleSpec("1f1b", 2, 4))
            with _gc.kept_until_exit(False):
                simulate(ScheduleSpec("1f1b", 2, 4))
        assert len(_gc._kept) == before + 1
        simulate(ScheduleSpec("1f1b", 2, 4))
        assert len(_gc._kept) == before + 1
    finally:
        del _gc._kept[before:]

"""The partitioner against brute force over every contiguous split."""

from __future__ import annotations

import itertools
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.partition.split import partition, stage_costs_uniform
from pipesim.sim.workloads.catalog import model_profile
from pipesim.sim.workloads.profile import LayerCost, Profile, WorkloadError
from pipesim.sim.workloads.stages import StageCost, split_at, stage_cost

REL = 1e-9


def make_profile(times, params=None, stash=None, optimizer="sgd"):
    n = len(times)
    params = params or [0] * n
    stash = stash or [0] * n
    return Profile(
        "hand",
        tuple(LayerCost(f"l{i}", t / 3, 2 * t / 3, params[i], 100 + i, stash[i]) for i, t in enumerate(times)),
        optimizer=optimizer,
    )


def all_splits(n, s):
    """Every list of stage starts splitting n layers into s non-empty stages."""
    for cuts in itertools.combinations(range(1, n), s - 1):
        yield [0, *cuts]


def stage_times(profile, starts):
    return [st_.time_s for st_ in split_at(profile, starts)]


def fits(profile, starts, limit, inflight):
    return all(
        sc.memory_bytes(inflight(k), profile.optimizer_state_multiplier) <= limit
        for k, sc in enumerate(split_at(profile, starts))
    )


def starts_of(stages):
    return [sc.first_layer for sc in stages]


def check_shape(profile, stages, s):
    assert len(stages) == s
    assert stages[0].first_layer == 0 and stages[-1].last_layer == len(profile.layers) - 1
    for a, b in itertools.pairwise(stages):
        assert b.first_layer == a.last_layer + 1
    assert all(sc.first_layer <= sc.last_layer for sc in stages)


times_st = st.lists(
    st.one_of(st.integers(0, 20).map(float), st.floats(0.0, 5.0, allow_nan=False)), min_size=1, max_size=8
)


@settings(max_examples=200, deadline=None)
@given(times=times_st, data=st.data())
def test_bottleneck_is_optimal(times, data):
    prof = make_profile(times)
    s = data.draw(st.integers(1, len(times)))
    stages = partition(prof, s)
    check_shape(prof, stages, s)
    got = max(sc.time_s for sc in stages)
    best = min(max(stage_times(prof, sp)) for sp in all_splits(len(times), s))
    assert got <= best * (1 + REL) + 1e-12
    # secondary objective: the smallest sum of squares among optimal splits
    optimal = [sp for sp in all_splits(len(times), s) if max(stage_times(prof, sp)) <= best * (1 + REL) + 1e-12]
    best_sq = min(sum(t * t for t in stage_times(prof, sp)) for sp in optimal)
    assert sum(sc.time_s**2 for sc in stages) <= best_sq * (1 + 1e-6) + 1e-12


@settings(max_examples=200, deadline=None)
@given(
    times=st.lists(st.integers(0, 10).map(float), min_size=1, max_size=7),
    data=st.data(),
    opt=st.sampled_from(["sgd", "adam"]),
)
def test_memory_limit_respected_when_feasible(times, data, opt):
    n = len(times)
    params = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    stash = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    prof = make_profile(times, params, stash, opt)
    s = data.draw(st.integers(1, n))
    limit = data.draw(st.integers(0, 60))
    mode = data.draw(st.sampled_from(["default", "one", "gpipe"]))
    inflight = {"default": lambda k: s - k, "one": lambda k: 1, "gpipe": lambda k: 4}[mode]
    stages = partition(prof, s, memory_limit_bytes=limit, inflight=None if mode == "default" else inflight)
    check_shape(prof, stages, s)
    feasible = [sp for sp in all_splits(n, s) if fits(prof, sp, limit, inflight)]
    got = max(sc.time_s for sc in stages)
    if feasible:
        assert fits(prof, starts_of(stages), limit, inflight)
        best = min(max(stage_times(prof, sp)) for sp in feasible)
        assert got <= best * (1 + REL) + 1e-12
    else:  # nothing fits: the time-balanced split, for the engine to report OOM
        assert starts_of(stages) == starts_of(partition(prof, s))


def test_hand_made_balance():
    prof = make_profile([4, 1, 1, 1, 1, 4])
    assert starts_of(partition(prof, 3)) == [0, 1, 5]
    assert [sc.time_s for sc in partition(prof, 3)] == pytest.approx([4, 4, 4])
    prof = make_profile([1, 2, 3, 4, 5, 6, 7, 8, 9])
    stages = partition(prof, 3)
    assert max(sc.time_s for sc in stages) == pytest.approx(17)  # 1..5 | 6,7 | 8,9 -> 15, 13, 17
    assert starts_of(stages) == [0, 5, 7]


def test_ties_prefer_more_layers_later_and_are_deterministic():
    prof = make_profile([1.0] * 5)
    assert starts_of(partition(prof, 2)) == [0, 2]  # 2 | 3, not 3 | 2
    assert starts_of(partition(prof, 3)) == [0, 1, 3]  # 1 | 2 | 2
    a = partition(model_profile("vgg16", load_hardware("pcie-4gpu").device), 4)
    b = partition(model_profile("vgg16", load_hardware("pcie-4gpu").device), 4)
    assert a == b


def test_secondary_objective_balances_non_bottleneck_stages():
    # The bottleneck is layer 0 (10) whatever the split; among the rest,
    # 3+3 | 3+3 beats 3 | 3+3+3 by sum of squares.
    prof = make_profile([10, 3, 3, 3, 3])
    assert starts_of(partition(prof, 3)) == [0, 1, 3]


def test_memory_moves_the_split():
    # time-balanced is [0, 2]: stage 0 = layers 0-1 (params 10 each).
    prof = make_profile([1, 1, 1, 1], params=[10, 10, 0, 0])
    assert starts_of(partition(prof, 2)) == [0, 2]
    # sgd: weights x3; stage 0 at [0, 2] needs 60 > 40, so split after layer 0
    stages = partition(prof, 2, memory_limit_bytes=40)
    assert starts_of(stages) == [0, 1]
    assert all(sc.memory_bytes(1, 1) <= 40 for sc in stages)
    # nothing fits (layer 0 alone needs 30): time-balanced anyway
    assert starts_of(partition(prof, 2, memory_limit_bytes=20)) == [0, 2]
    assert starts_of(partition(prof, 2, memory_limit_bytes=math.inf)) == [0, 2]


def test_default_inflight_is_1f1b():
    # stash 10 per layer; stage 0 holds N - 0 = 2 micro-batches by default
    prof = make_profile([1, 1, 1, 1], stash=[10, 10, 10, 10])
    assert starts_of(partition(prof, 2, memory_limit_bytes=40)) == [0, 2]  # 20*2 = 40 fits
    assert starts_of(partition(prof, 2, memory_limit_bytes=39)) == [0, 1]  # 10*2 | 30*1
    assert starts_of(partition(prof, 2, memory_limit_bytes=39, inflight=lambda k: 1)) == [0, 2]
    with pytest.raises(WorkloadError, match="inflight"):
        partition(prof, 2, memory_limit_bytes=39, inflight=lambda k: -1)


def test_stage_sums():
    prof = model_profile("resnet50", load_hardware("dgx1-v100").device)
    stages = partition(prof, 5)
    assert math.fsum(sc.forward_s for sc in stages) == pytest.approx(prof.forward_s, rel=1e-12)
    assert sum(sc.param_bytes for sc in stages) == prof.param_bytes
    assert sum(sc.stash_bytes for sc in stages) == sum(la.stash_bytes for la in prof.layers)
    for sc in stages:
        assert sc.backward_input_s + sc.backward_weight_s == pytest.approx(sc.backward_s, rel=1e-12)
        assert sc.activation_bytes == prof.layers[sc.last_layer].activation_bytes
    assert stages[-1].activation_bytes == 0


def test_bad_stage_counts():
    prof = model_profile("vgg16", load_hardware("ideal").device)
    with pytest.raises(WorkloadError) as e:
        partition(prof, 20)
    assert str(e.value) == "cannot split 16 layers into 20 stages"
    with pytest.raises(WorkloadError, match="into 0 stages"):
        partition(prof, 0)
    with pytest.raises(WorkloadError, match="memory limit"):
        partition(prof, 2, memory_limit_bytes=-1)
    assert len(partition(prof, 16)) == 16


def test_split_at_and_stage_cost():
    prof = make_profile([3, 3, 3])
    assert [sc.num_layers for sc in split_at(prof, [0, 2])] == [2, 1]
    for bad in ([], [1], [0, 0], [0, 3], [0, 2, 1]):
        with pytest.raises(WorkloadError):
            split_at(prof, bad)
    with pytest.raises(WorkloadError):
        stage_cost(prof, 2, 1)


def test_stage_costs_uniform():
    stages = stage_costs_uniform(4)
    assert len(stages) == 4
    for k, sc in enumerate(stages):
        assert isinstance(sc, StageCost)
        assert (sc.first_layer, sc.last_layer) == (k, k)
        assert (sc.forward_s, sc.backward_s, sc.backward_input_s, sc.backward_weight_s) == (1e-3, 2e-3, 1e-3, 1e-3)
        assert sc.activation_bytes == 0
    assert stage_costs_uniform(2, 2e-3, 5e-3)[1].backward_input_s == 2.5e-3
    # the uniform model partitioned one layer per stage gives the same stages
    prof = model_profile("uniform", load_hardware("ideal").device, layers=4)
    assert partition(prof, 4) == stages
    assert [sc.forward_s for sc in partition(model_profile("uniform", load_hardware("ideal").device), 8)] == [8e-3] * 8
    with pytest.raises(WorkloadError):
        stage_costs_uniform(0)


def test_large_profiles_are_fast():
    dev = load_hardware("dgx-h100").device
    prof = model_profile("gpt-8.3b", dev)  # 74 layers
    t = time.perf_counter()
    stages = partition(prof, 32, memory_limit_bytes=dev.memory_bytes)
    assert time.perf_counter() - t < 2.0
    check_shape(prof, stages, 32)


# --- sizes --------------------------------------------------------------------


def test_one_layer_per_stage_needs_no_tables():
    # the uniform model on 100000 stages: the only split, without the dynamic
    # program's 100001 x 100001 tables (80 GB)
    n = 100_000
    prof = model_profile("uniform", load_hardware("ideal").device, layers=n)
    stages = partition(prof, n, memory_limit_bytes=1.0)  # nothing fits: still the only split
    assert starts_of(stages) == list(range(n))
    assert partition(prof, 1)[0].num_layers == n


@pytest.mark.parametrize("n", [1, 2, 5])
def test_trivial_splits_equal_the_dynamic_program(n):
    times = [1.0 + i % 3 for i in range(n)]
    prof = make_profile(times, params=[10] * n, stash=[5] * n)
    for k in {1, n}:
        got = starts_of(partition(prof, k, memory_limit_bytes=1e9))
        best = min(all_splits(n, k), key=lambda s: max(stage_times(prof, s)))
        assert got == best


@pytest.mark.parametrize(
    ("layers", "stages"),
    [(2049, 2), (1024, 200)],  # over MAX_DP_LAYERS; over MAX_DP_CELLS (200 x 1025^2)
)
def test_dynamic_program_size_is_bounded(layers, stages):
    from pipesim.sim.partition.split import MAX_DP_CELLS, MAX_DP_LAYERS

    assert layers > MAX_DP_LAYERS or stages * (layers + 1) ** 2 > MAX_DP_CELLS
    prof = make_profile([1.0] * layers)
    with pytest.raises(WorkloadError) as e:
        partition(prof, stages)
    msg = str(e.value)
    assert f"cannot split {layers} layers into {stages} stages exactly" in msg and "\n" not in msg
    assert "2048 layers" in msg and "134,217,728 cells" in msg
    # just inside both limits it splits
    assert len(partition(make_profile([1.0] * 512), 64)) == 64


# ---------------------------------------------------------------------------
# Communication-aware: the split a simulation runs on a machine with links
# ---------------------------------------------------------------------------

MACHINES = ("pcie-4gpu", "pipedream-cluster-a-x2", "dgx-h100")
MiB = 2**20


def _oom(result) -> bool:
    return any(t.out_of_memory for t in result.memory)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_default_split_is_never_slower_in_the_simulator_than_any_other(data):
    """Every split of a small random model simulated: the one a simulation
    picks by itself is the fastest of those that fit in memory (and fits
    whenever one does). Activations up to 200 MiB make transfers matter; a
    compute-only split is up to twice as slow on such models."""
    from dataclasses import replace

    from pipesim.sim.api import simulate_schedule
    from pipesim.sim.strategies import ScheduleSpec, build_schedule

    n = data.draw(st.integers(2, 6), label="layers")
    p = data.draw(st.integers(2, min(4, n)), label="stages")
    layers = tuple(
        LayerCost(
            f"l{i}",
            data.draw(st.floats(1e-3, 1e-2)),
            data.draw(st.floats(2e-3, 2e-2)),
            data.draw(st.integers(0, 50)) * MiB,
            data.draw(st.sampled_from([0, 8, 64, 200])) * MiB,
            data.draw(st.integers(0, 100)) * MiB,
        )
        for i in range(n)
    )
    prof = Profile("random", layers)
    hw = load_hardware(data.draw(st.sampled_from(MACHINES), label="hardware"))
    need = 3 * sum(la.param_bytes for la in layers) + 2 * sum(la.stash_bytes for la in layers)
    limit = max(1, int(need * data.draw(st.floats(0.2, 1.5), label="memory")))
    hw = replace(hw, device=replace(hw.device, memory_bytes=limit))
    strategy = data.draw(st.sampled_from(["1f1b", "pipedream", "gpipe", "pipedream-2bw"]), label="strategy")
    schedule = build_schedule(ScheduleSpec(strategy, p, 8, iterations=2))
    chosen = simulate_schedule(schedule, prof, hw)
    fitting = [r for r in (simulate_schedule(schedule, prof, hw, starts=sp) for sp in all_splits(n, p)) if not _oom(r)]
    if fitting:
        assert not _oom(chosen)
        assert chosen.makespan <= min(r.makespan for r in fitting) * (1 + REL)


def test_vgg16_on_a_pcie_bus_cuts_where_the_activations_are_small():
    """The issue's case: PipeDream on the 4-GPU PCIe box. A compute-only split
    ships VGG-16's 205 MB second-layer output over the shared bridge; the
    communication-aware one does not, and is much faster."""
    from pipesim.sim.api import simulate_schedule
    from pipesim.sim.engine.metrics import summarize
    from pipesim.sim.strategies import ScheduleSpec, build_schedule

    hw = load_hardware("pcie-4gpu")
    prof = model_profile("vgg16", hw.device)
    schedule = build_schedule(ScheduleSpec("pipedream", 4, 8, iterations=4))
    compute_only = partition(prof, 4, memory_limit_bytes=hw.device.memory_bytes)
    aware = simulate_schedule(schedule, prof, hw)
    cut_bytes = [c.activation_bytes for c in aware.stage_costs[:-1]]
    assert max(cut_bytes) < max(c.activation_bytes for c in compute_only[:-1])
    slow = simulate_schedule(schedule, prof, hw, starts=starts_of(compute_only))
    assert summarize(aware)["throughput_samples_per_s"] > 1.15 * summarize(slow)["throughput_samples_per_s"]


def test_ideal_machine_keeps_the_compute_only_split():
    from pipesim.sim.api import split_for
    from pipesim.sim.strategies import ScheduleSpec, build_schedule

    prof = make_profile([4, 1, 1, 1, 1, 4])
    schedule = build_schedule(ScheduleSpec("1f1b", 3, 8))
    assert starts_of(split_for(schedule, prof, load_hardware("ideal"))) == starts_of(partition(prof, 3))


def test_shared_links_are_summed():
    """Two boundaries on one PCIe bridge, each activation and its gradient:
    the bridge carries four transfers per micro-batch, and with nothing to
    compute it is the bottleneck. Counting each boundary apart gives half."""
    from pipesim.sim.partition.layout import layout_of
    from pipesim.sim.partition.search import CostSetting
    from pipesim.sim.strategies import ScheduleSpec, build_schedule

    hw = load_hardware("pcie-4gpu")
    nbytes = 120 * MiB
    prof = Profile("flat", tuple(LayerCost(f"l{i}", 1e-6, 2e-6, 0, nbytes, 0) for i in range(3)))
    layout = layout_of(build_schedule(ScheduleSpec("pipedream", 3, 8, iterations=4)))
    est = CostSetting.of(prof, hw).estimate(split_at(prof, [0, 1, 2]), layout)
    assert est.bottleneck == "node0.pcie-bridge"
    assert est.period_s == pytest.approx(4 * hw.transfer_time(0, 1, nbytes), rel=1e-9)


@pytest.mark.parametrize("name", ["pipedream-cluster-a-x4", "p3.16xlarge-x2"])
@pytest.mark.parametrize("devices", [(0, 1), (0, 1, 2, 3), (2, 3, 4, 5, 6), (0, 1, 4, 5), tuple(range(15))])
def test_ring_model_is_the_hardwares(name, devices):
    """The planner's ring is the hardware's, on the cube mesh (where the ring
    order is searched) as on uniform links."""
    from pipesim.sim.partition.cost import LinkModel

    hw = load_hardware(name)
    nbytes = 60 * len(devices) * MiB  # a multiple of n: no rounding of the chunk
    assert LinkModel(hw).ring(devices).seconds(nbytes) == pytest.approx(
        hw.ring_allreduce_time(devices, nbytes), rel=1e-12
    )


def test_communication_aware_needs_hardware_and_layout():
    prof = make_profile([1, 2, 3])
    with pytest.raises(WorkloadError, match="both hardware and layout"):
        partition(prof, 2, hardware=load_hardware("pcie-4gpu"))

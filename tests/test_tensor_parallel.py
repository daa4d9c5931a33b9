"""Tensor parallelism (Megatron-style): closed form against the engine, structure, refusal by executors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesim.sim.api import simulate, simulate_schedule
from pipesim.sim.engine.metrics import summarize
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.ir.core import ALLREDUCE, REDUCE_GRAD, UPDATE, B, F, parse_action
from pipesim.sim.strategies import ScheduleSpec, StrategyError, build_schedule, get_strategy
from pipesim.sim.workloads.catalog import uniform_profile
from pipesim.sim.workloads.profile import Profile

ACT = 1 << 20  # bytes of each layer's hidden state in the closed-form test


def _profile(layers: int) -> Profile:
    p = uniform_profile(layers)
    return replace(p, layers=tuple(replace(c, activation_bytes=ACT) for c in p.layers))


@pytest.mark.parametrize("hw,d", [("dgx1-v100", 2), ("dgx1-v100", 4), ("p3.16xlarge", 8), ("p3.16xlarge-x2", 16)])
def test_closed_form_on_uniform_layers(hw, d):
    """time = m * (F + B) / d + 4 * layers * allreduce(activation) per micro-batch, and the update."""
    layers, m = 6, 3
    sched = build_schedule(ScheduleSpec("tensor-parallel", d, m))
    res = simulate_schedule(sched, _profile(layers), hw)
    hwm = load_hardware(hw)
    ar = hwm.ring_allreduce_time(list(range(d)), ACT)
    compute = layers * (1e-3 + 2e-3) / d
    update = 5 * (-(-layers * (1 << 20) // d)) / hwm.device.mem_bandwidth
    expected = m * (compute + 4 * layers * ar) + update
    assert res.makespan == pytest.approx(expected, rel=1e-9)


def test_structure():
    s = build_schedule(ScheduleSpec("tensor-parallel", 4, 2, iterations=2))
    assert s.num_devices == 4 and s.num_stages == 1 and s.replicas == (4,)
    assert s.options["tensor_parallel"] == 4
    for r, prog in enumerate(s.programs):
        ops = [a.op for a in prog]
        assert REDUCE_GRAD not in ops  # sharded weights: nothing to reduce
        assert ops.count(F) == ops.count(B) == 4 and ops.count(ALLREDUCE) == 8 and ops.count(UPDATE) == 2
        # every device runs every micro-batch, on its own shard id
        assert sorted(a.microbatch // 4 for a in prog if a.op is F) == [0, 1, 2, 3]
        assert all(a.microbatch % 4 == r for a in prog if a.op is F)
    assert parse_action("r2.0ALLREDUCE") == s.programs[2][1]


def test_throughput_counts_each_microbatch_once():
    one = summarize(simulate(ScheduleSpec("tensor-parallel", 1, 4), "uniform", "ideal"))
    four = summarize(simulate(ScheduleSpec("tensor-parallel", 4, 4), "uniform", "ideal"))
    assert one["throughput_samples_per_s"] == pytest.approx(four["throughput_samples_per_s"])
    # and the summary says so: m micro-batches, whose samples over the makespan are the throughput
    for s in (one, four):
        assert s["microbatches"] == 4
        samples = s["microbatches"] * s["iterations"] * s["microbatch_size"]
        assert s["throughput_samples_per_s"] == pytest.approx(samples / s["makespan_s"], rel=1e-6)


def test_steady_throughput_counts_each_microbatch_once():
    """The planner's steady state counts a sharded micro-batch once, as the metrics do."""
    from pipesim.sim.planning.plan import steady_throughput

    one = steady_throughput(simulate(ScheduleSpec("tensor-parallel", 1, 4, iterations=3), "uniform", "ideal"))
    four = steady_throughput(simulate(ScheduleSpec("tensor-parallel", 4, 4, iterations=3), "uniform", "ideal"))
    assert one == pytest.approx(four)


def test_across_servers_is_slower_than_within():
    prof = _profile(4)
    within = simulate_schedule(build_schedule(ScheduleSpec("tensor-parallel", 8, 2)), prof, "p3.16xlarge-x2")
    across = simulate_schedule(build_schedule(ScheduleSpec("tensor-parallel", 16, 2)), prof, "p3.16xlarge-x2")
    assert across.makespan > within.makespan / 2


def test_facts_and_real_model_run():
    st = get_strategy("tensor-parallel")
    assert not st.executable and st.device_costs is not None
    res = simulate(ScheduleSpec("tensor-parallel", 8, 2), "2bw-gpt-355m", "p3.16xlarge", microbatch_size=2)
    assert res.makespan > 0 and not any(t.out_of_memory for t in res.memory)


def test_executors_refuse():
    from pipesim.sim.strategies._common import check_executable

    with pytest.raises(StrategyError, match="cannot run tensor-parallel"):
        check_executable("tensor-parallel", "emulator")
    check_executable("gpipe", "emulator")  # runs


@pytest.mark.parametrize("d", [2, 8])
def test_fixed_part_of_a_pass_is_not_split(d):
    """Every device launches every kernel of its shard, and pays the profile's
    per-pass overhead: only the rest of a pass shrinks with d. Closed form on
    uniform layers with 0.2 ms of launches forward, 0.5 ms backward (0.25 of
    it in each half), and 0.1 / 0.3 ms of per-pass overhead."""
    from pipesim.sim.workloads.stages import split_at

    layers = 4
    base = _profile(layers)
    prof = replace(
        base,
        overhead_forward_s=1e-4,
        overhead_backward_s=3e-4,
        layers=tuple(replace(c, fixed_forward_s=2e-4, fixed_backward_s=5e-4) for c in base.layers),
    )
    opts = build_schedule(ScheduleSpec("tensor-parallel", d, 1)).options
    (c,) = get_strategy("tensor-parallel").device_costs(prof, split_at(prof, [0]), opts)
    fixed_f, fixed_b = layers * 2e-4 + 1e-4, layers * 5e-4 + 3e-4
    assert c.forward_s == pytest.approx((layers * 1e-3 - layers * 2e-4) / d + fixed_f)
    assert c.backward_s == pytest.approx((layers * 2e-3 - layers * 5e-4) / d + fixed_b)
    # the split halves: each pays the per-pass overhead, the launches split as the backward does
    half_fixed = layers * 2.5e-4 + 3e-4
    assert c.backward_input_s == pytest.approx((layers * 1e-3 + 3e-4 - half_fixed) / d + half_fixed)
    assert c.backward_weight_s == pytest.approx((layers * 1e-3 + 3e-4 - half_fixed) / d + half_fixed)
    # nothing fixed: exactly the old division
    (plain,) = get_strategy("tensor-parallel").device_costs(base, split_at(base, [0]), opts)
    assert (plain.forward_s, plain.backward_s) == (layers * 1e-3 / d, layers * 2e-3 / d)


def test_a_shard_prices_its_gemms_at_the_shards_shapes():
    """On a device with the GEMM shape model a tensor-parallel rank runs its
    GEMMs at their shard's shapes (QKV and h -> 4h split by columns, the
    projections by rows, attention by heads): eight ranks of GPT-2.2B at
    b = 1 each take more than an eighth of one GPU's time, since 1/8 of a
    GEMM fills fewer of the V100's waves; the engine runs that shard."""
    from pipesim.sim.workloads.catalog import Gemm, model_profile

    g = Gemm(512, 3 * 2304, 2304)
    assert g.shard(8) == Gemm(512, 864, 2304)
    assert Gemm(512, 2304, 9216, tp="k").shard(8).k == 1152
    assert Gemm(512, 512, 72, batch=32, scale="batch", weights=False, tp="batch").shard(8).batch == 4
    hw = load_hardware("p3.16xlarge")
    whole = model_profile("2bw-gpt-2.2b", hw.device, 1)
    shard = model_profile("2bw-gpt-2.2b", hw.device, 1, tensor_parallel=8)
    assert shard.tensor_parallel == 8 and whole.tensor_parallel == 1
    t_whole = sum(la.forward_s + la.backward_s for la in whole.layers)
    t_shard = sum(la.forward_s + la.backward_s for la in shard.layers)
    assert t_whole / 8 < t_shard < t_whole / 2
    assert [la.activation_bytes for la in shard.layers] == [la.activation_bytes for la in whole.layers]
    # simulate() hands the tensor-parallel schedule the shard, and the engine runs it as it is
    result = simulate(ScheduleSpec("tensor-parallel", 8, 1), "2bw-gpt-2.2b", hw, microbatch_size=1)
    forward = next(s for s in result.spans if s.stream == "compute" and s.action.op is F)
    assert forward.end - forward.start == pytest.approx(sum(la.forward_s for la in shard.layers), rel=1e-9)
    # a roofline device has no shapes to price: the whole model, divided by the strategy
    pcie = load_hardware("pcie-4gpu")
    assert model_profile("bert-large", pcie.device, 1, tensor_parallel=4).tensor_parallel == 1


def test_a_shard_of_another_degree_is_refused():
    from pipesim.sim.workloads.catalog import model_profile

    hw = load_hardware("p3.16xlarge")
    shard = model_profile("2bw-gpt-355m", hw.device, 1, tensor_parallel=4)
    with pytest.raises(StrategyError, match="4-way"):
        simulate(ScheduleSpec("tensor-parallel", 8, 1), hardware=hw, profile=shard)
    again = Profile.from_json(shard.to_json())
    assert again == shard and shard.to_json()["tensor_parallel"] == 4


def test_a_shard_is_refused_by_every_other_strategy():
    from pipesim.sim.workloads.catalog import model_profile
    from pipesim.sim.workloads.profile import WorkloadError

    shard = model_profile("2bw-gpt-355m", load_hardware("p3.16xlarge").device, 1, tensor_parallel=4)
    with pytest.raises(WorkloadError, match="only the tensor-parallel strategy"):
        simulate(ScheduleSpec("1f1b", 4, 4), hardware="p3.16xlarge", profile=shard)


def test_a_shard_keeps_megatrons_unsplit_parts_whole():
    """Korthikanti et al. 2022 (4.2.1): of a transformer layer's 34 bytes per
    element of s b h, the layer norms' inputs, the dropout masks after
    attention and MLP and the inputs of QKV and the first MLP product (10)
    stay whole on every tensor-parallel rank, the other 24 are split; the
    layer's input and output are whole too, so the traffic besides the GEMMs
    shrinks less than d-fold."""
    from pipesim.sim.workloads.catalog import architecture, model_profile

    hw = load_hardware("p3.16xlarge")
    block = next(la for la in architecture("2bw-gpt-2.2b") if la.name == "block0")
    s, h = 512, 2304
    assert block.stash_elems == 17 * s * h and block.replicated_stash_elems == 5 * s * h
    moved, stash = block.rank_elems(8)
    assert stash == pytest.approx((10 + 24 / 8) * s * h / 2)
    assert moved == pytest.approx(2 * s * h + stash)
    assert block.rank_elems(1) == (block.in_elems + block.out_elems + block.stash_elems, block.stash_elems)
    # the forward's work besides its GEMMs moves those elements at the memory bandwidth
    from pipesim.sim.hardware.gemm import gemm_seconds
    from pipesim.sim.workloads.catalog import gemm_launches, shaped_passes

    for shards in (1, 8):
        gemms = sum(
            times * sum(gemm_seconds(hw.device, *shape) for shape in shapes)
            for part, times, shapes in gemm_launches(block, 4, shards)
            if part == "forward"
        )
        rest = shaped_passes(block, hw.device, 4, shards)[0] - gemms
        expected = hw.device.dtype_bytes * 4 * block.rank_elems(shards)[0] / hw.device.mem_bandwidth
        assert rest == pytest.approx(expected, rel=1e-9)
    for b in (1, 4):
        whole = model_profile("2bw-gpt-2.2b", hw.device, b)
        shard = model_profile("2bw-gpt-2.2b", hw.device, b, tensor_parallel=8)
        (w,) = [la for la in whole.layers if la.name == "block0"]
        (r,) = [la for la in shard.layers if la.name == "block0"]
        assert w.stash_bytes == round(2 * b * 17 * s * h)
        assert r.stash_bytes == round(2 * b * (5 + 12 / 8) * s * h)  # 13/34 of the whole, not 1/8

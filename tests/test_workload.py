"""Profiles (validation, JSON) and the model catalog (sizes, FLOPs, times)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.sim.hardware.machines import DeviceSpec, load_hardware
from pipesim.sim.workloads.catalog import (
    PARAM_BYTES,
    architecture,
    model_names,
    model_parameters,
    model_profile,
    uniform_profile,
)
from pipesim.sim.workloads.profile import LayerCost, Profile, WorkloadError
from pipesim.sim.workloads.readers import load_profile, save_profile

#: Compute-only device: with infinite memory bandwidth every time is FLOPs / 1e15.
FLOPS_ONLY = DeviceSpec("flops-only", flops=1e15, mem_bandwidth=math.inf, memory_bytes=math.inf, dtype_bytes=2)


def layer(name="l", f=1.0, b=2.0, p=10, a=5, s=7, bi=None):
    return LayerCost(name, f, b, p, a, s, bi)


# ---------------------------------------------------------------------------
# LayerCost / Profile
# ---------------------------------------------------------------------------


def test_default_backward_split():
    assert layer(p=10, b=2.0).backward_input == 1.0
    assert layer(p=10, b=2.0).backward_weight == 1.0
    assert layer(p=0, b=2.0).backward_input == 2.0  # no weights, no weight gradient
    assert layer(p=0, b=2.0).backward_weight == 0.0
    assert layer(b=2.0, bi=0.5).backward_weight == 1.5


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(f=-1.0), "forward_s must be"),
        (dict(b=math.inf), "backward_s must be"),
        (dict(b=math.nan), "backward_s must be"),
        (dict(p=-1), "param_bytes must be"),
        (dict(a=1.5), "activation_bytes must be"),
        (dict(s=True), "stash_bytes must be"),
        (dict(b=1.0, bi=1.5), "backward_input_s must be between"),
        (dict(name=""), "name must be"),
    ],
)
def test_layer_validation(kwargs, fragment):
    with pytest.raises(WorkloadError, match=fragment):
        layer(**kwargs)


def test_profile_validation_and_optimizer_state():
    assert Profile("m", (layer(),)).optimizer_state_multiplier == 1
    assert Profile("m", (layer(),), optimizer="adam").optimizer_state_multiplier == 2
    with pytest.raises(WorkloadError, match="optimizer must be one of"):
        Profile("m", (layer(),), optimizer="lamb")
    with pytest.raises(WorkloadError, match="has no layers"):
        Profile("m", ())
    with pytest.raises(WorkloadError, match="microbatch_size"):
        Profile("m", (layer(),), microbatch_size=0)
    assert issubclass(WorkloadError, ValueError)


layer_st = st.builds(
    LayerCost,
    name=st.text(min_size=1, max_size=8),
    forward_s=st.floats(0, 10, allow_nan=False),
    backward_s=st.floats(0, 10, allow_nan=False),
    param_bytes=st.integers(0, 2**40),
    activation_bytes=st.integers(0, 2**40),
    stash_bytes=st.integers(0, 2**40),
    backward_input_s=st.none(),
)


@settings(max_examples=50, deadline=None)
@given(
    layers=st.lists(layer_st, min_size=1, max_size=6),
    mb=st.integers(1, 512),
    opt=st.sampled_from(["sgd", "adam"]),
    split=st.lists(st.floats(0, 1), min_size=6, max_size=6),
)
def test_profile_json_round_trip(layers, mb, opt, split):
    layers = [
        LayerCost(
            la.name,
            la.forward_s,
            la.backward_s,
            la.param_bytes,
            la.activation_bytes,
            la.stash_bytes,
            None if k % 2 else la.backward_s * split[k],
        )
        for k, la in enumerate(layers)
    ]
    prof = Profile("p", tuple(layers), microbatch_size=mb, optimizer=opt, notes="x")
    assert Profile.from_json(json.loads(json.dumps(prof.to_json()))) == prof


def test_save_and_load_catalog_profile(tmp_path):
    prof = model_profile("gnmt", load_hardware("dgx1-v100").device)
    path = tmp_path / "gnmt.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    assert load_profile(str(path)) == prof


GOOD_LAYER = {
    "name": "l0",
    "forward_s": 0.001,
    "backward_s": 0.002,
    "param_bytes": 4,
    "activation_bytes": 8,
    "stash_bytes": 16,
}


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("{", "malformed JSON at line 1"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"layers": [GOOD_LAYER]}), "missing field 'name'"),
        (json.dumps({"name": "m"}), "missing field 'layers'"),
        (json.dumps({"name": "m", "layers": {}}), "'layers' must be a list"),
        (json.dumps({"name": "m", "layers": []}), "has no layers"),
        (
            json.dumps({"name": "m", "layers": [{k: v for k, v in GOOD_LAYER.items() if k != "stash_bytes"}]}),
            "layer 0 (l0): missing field 'stash_bytes'",
        ),
        (
            json.dumps({"name": "m", "layers": [GOOD_LAYER, {**GOOD_LAYER, "name": "l1", "forward_s": -2}]}),
            "layer 1 (l1): forward_s must be a finite number >= 0",
        ),
        (json.dumps({"name": "m", "layers": [{**GOOD_LAYER, "param_bytes": "big"}]}), "param_bytes must be an integer"),
        (json.dumps({"name": "m", "layers": [{**GOOD_LAYER, "forward_ms": 1}]}), "unknown field 'forward_ms'"),
        (json.dumps({"name": "m", "layers": [GOOD_LAYER], "optimizer": "rmsprop"}), "optimizer must be one of"),
        (json.dumps({"name": "m", "layers": [GOOD_LAYER], "microbatch_size": 0}), "microbatch_size must be"),
        (
            (
                '{"name": "m", "layers": [{"name": "l", "forward_s": NaN, "backward_s": 1, "param_bytes": 1,'
                ' "activation_bytes": 1, "stash_bytes": 1}]}'
            ),
            "forward_s must be",
        ),
    ],
)
def test_malformed_profile_files(tmp_path, content, fragment):
    path = tmp_path / "prof.json"
    path.write_text(content)
    with pytest.raises(WorkloadError) as e:
        load_profile(path)
    msg = str(e.value)
    assert fragment in msg, msg
    assert str(path) in msg and "\n" not in msg


def test_missing_profile_file(tmp_path):
    with pytest.raises(WorkloadError, match="not found"):
        load_profile(tmp_path / "nope.json")


def test_whole_float_sizes_are_accepted(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"name": "m", "layers": [{**GOOD_LAYER, "param_bytes": 1.6e7}]}))
    assert load_profile(path).layers[0].param_bytes == 16_000_000


# ---------------------------------------------------------------------------
# Catalog
# ---------------------------------------------------------------------------


def test_catalog_names():
    names = model_names()
    assert {"vgg16", "resnet50", "gnmt", "bert-large", "gpt-1.3b", "gpt-13b", "uniform"} <= set(names)
    with pytest.raises(WorkloadError) as e:
        model_profile("alexnet", FLOPS_ONLY)
    assert "vgg16" in str(e.value) and "gpt-1.3b" in str(e.value)


@pytest.mark.parametrize(
    "name, params, rel",
    [
        ("vgg16", 138_357_544, 1e-6),  # torchvision
        ("vgg16-cifar", 14_719_818, 1e-6),
        ("resnet50", 25_557_032, 1e-6),  # torchvision
        ("gnmt", 160e6, 0.05),  # MLPerf GNMT
        ("bert-large", 340e6, 0.05),
        ("gpt-1.3b", 1.3e9, 0.05),
        ("gpt-8.3b", 8.3e9, 0.02),  # Megatron-LM
        ("gpt-13b", 13e9, 0.05),
    ],
)
def test_parameter_counts(name, params, rel):
    assert model_parameters(name) == pytest.approx(params, rel=rel)
    prof = model_profile(name, FLOPS_ONLY)
    tied = sum(la.tied_params for la in architecture(name))
    assert prof.param_bytes == PARAM_BYTES * (model_parameters(name) + tied)


@pytest.mark.parametrize(
    "name, gflops",
    [
        ("vgg16", 2 * 15.47),  # 15.47 GMACs per 224x224 image
        ("resnet50", 2 * 4.09),  # 4.09 GMACs
        ("vgg16-cifar", 2 * 0.313),
    ],
)
def test_cnn_forward_flops(name, gflops):
    prof = model_profile(name, FLOPS_ONLY, microbatch_size=1)
    assert prof.forward_s * FLOPS_ONLY.flops == pytest.approx(gflops * 1e9, rel=0.02)


def test_transformer_flops_follow_megatron_formula():
    # Narayanan et al. SC'21 count 96 b s l h^2 (1 + s/(6h) + V/(16 l h)) for forward, backward
    # and recomputation: 4 forwards of the blocks but 3 of the logits (2 b s h V each).
    b, s, l, h, v = 4, 2048, 24, 2048, 50257
    expect = 24 * b * s * l * h * h * (1 + s / (6 * h)) + 2 * b * s * h * v
    prof = model_profile("gpt-1.3b", FLOPS_ONLY)
    assert prof.microbatch_size == b
    assert prof.forward_s * FLOPS_ONLY.flops == pytest.approx(expect, rel=1e-9)
    # backward = 2 x forward, except the embedding which needs no input gradient
    assert prof.backward_s == pytest.approx(2 * prof.forward_s, rel=1e-9)


@pytest.mark.parametrize("shapes", [False, True], ids=["roofline", "gemm-shapes"])
@pytest.mark.parametrize("name", [n for n in model_names() if n != "uniform"])
def test_catalog_profile_invariants(name, shapes):
    import dataclasses

    dev = load_hardware("dgx-h100").device
    if not shapes:  # the same device without its GEMM shape model: the roofline at its sustained FLOP/s
        dev = dataclasses.replace(
            dev,
            peak_flops=None,
            sms=None,
            gemm_max_efficiency=None,
            gemm_k_overhead=0.0,
            gemm_fixed_s=0.0,
            gemm_table=None,
        )
    assert dev.shape_model == shapes
    prof = model_profile(name, dev)
    assert prof.name == name and prof.num_layers >= 10
    for la in prof.layers:
        assert la.forward_s > 0 and la.backward_s >= la.forward_s * 0.99
        assert la.backward_input + la.backward_weight == pytest.approx(la.backward_s)
        assert la.backward_weight >= 0
    assert prof.layers[0].backward_input == 0.0  # data needs no gradient
    assert prof.layers[-1].activation_bytes == 0  # the loss
    assert all(la.activation_bytes > 0 for la in prof.layers[:-1])
    total_b = prof.backward_s
    # by FLOPs the backward is twice the forward (less the first layer's input
    # gradient); by shapes each gradient GEMM runs at its own efficiency (an
    # LSTM's weight gradient is one GEMM over all time steps, its forward one
    # per step), so the ratio moves, within bounds
    lo, hi = (1.4, 2.3) if shapes else (1.8, 2.05)
    assert lo * prof.forward_s <= total_b <= hi * prof.forward_s


def test_times_scale_with_device_and_microbatch():
    slow = DeviceSpec("slow", flops=1e13, mem_bandwidth=math.inf, memory_bytes=math.inf, dtype_bytes=2)
    a = model_profile("bert-large", FLOPS_ONLY, 8)
    b = model_profile("bert-large", slow, 8)
    c = model_profile("bert-large", FLOPS_ONLY, 16)
    for la, lb, lc in zip(a.layers, b.layers, c.layers):
        assert lb.forward_s == pytest.approx(100 * la.forward_s)
        assert lc.backward_s == pytest.approx(2 * la.backward_s)
        assert lc.stash_bytes == pytest.approx(2 * la.stash_bytes, abs=1)
        assert lc.activation_bytes == 2 * la.activation_bytes
        assert lc.param_bytes == la.param_bytes


def test_activation_and_stash_sizes():
    h100 = load_hardware("dgx-h100").device
    prof = model_profile("gpt-1.3b", h100)  # micro-batch 4, sequence 2048, hidden 2048, bf16
    block = prof.layers[1]
    assert block.activation_bytes == 4 * 2048 * 2048 * 2
    assert block.stash_bytes == 4 * 2048 * 2048 * 34  # Korthikanti et al., no attention scores
    bert = model_profile("bert-large", h100, 1).layers[1]
    assert bert.stash_bytes == 512 * 1024 * (34 + 5 * 16 * 512 / 1024)
    # fp32 device: activations double
    pcie = load_hardware("pcie-4gpu").device
    assert model_profile("gpt-1.3b", pcie).layers[1].activation_bytes == 2 * block.activation_bytes


def test_memory_bound_layers_are_not_free():
    # with finite memory bandwidth an embedding lookup (0 FLOPs) still takes time
    dev = load_hardware("dgx1-v100").device
    emb = model_profile("gpt-1.3b", dev).layers[0]
    assert emb.forward_s > 0
    assert emb.forward_s == pytest.approx(2 * 4 * (2048 + 2048 * 2048 + 0.5 * 2048 * 2048) / dev.mem_bandwidth)
    # vgg16's first convolution on the 2018 GPU is memory-bound: bytes / bandwidth
    pcie = load_hardware("pcie-4gpu").device
    conv1 = model_profile("vgg16", pcie, 32).layers[0]
    elems = 3 * 224**2 + 64 * 224**2 + 3 * 224**2
    assert conv1.forward_s == pytest.approx(4 * 32 * (elems + 1792 / 32) / pcie.mem_bandwidth)


def test_uniform_model():
    for dev in (FLOPS_ONLY, load_hardware("pcie-4gpu").device):
        prof = model_profile("uniform", dev)
        assert prof.num_layers == 64
        for la in prof.layers:
            assert (la.forward_s, la.backward_s, la.backward_input, la.backward_weight) == (1e-3, 2e-3, 1e-3, 1e-3)
            assert la.activation_bytes == 0 and la.param_bytes == 2**20 and la.stash_bytes == 2**20
    assert model_profile("uniform", FLOPS_ONLY, layers=4).num_layers == 4
    assert model_profile("uniform", FLOPS_ONLY, 8).microbatch_size == 8
    assert uniform_profile(3, forward_s=2e-3).layers[2].forward_s == 2e-3
    assert model_parameters("uniform", layers=4) == 4 * 2**18


def test_layer_and_sequence_overrides():
    assert model_profile("gpt-1.3b", FLOPS_ONLY, layers=4).num_layers == 6  # embed + 4 blocks + head
    short = model_profile("bert-large", FLOPS_ONLY, seq_len=128)
    assert short.layers[1].activation_bytes == 8 * 128 * 1024 * 2
    assert model_profile("gnmt", FLOPS_ONLY, seq_len=25).forward_s < model_profile("gnmt", FLOPS_ONLY).forward_s
    with pytest.raises(WorkloadError, match="fixed depth"):
        model_profile("vgg16", FLOPS_ONLY, layers=8)
    with pytest.raises(WorkloadError, match="no sequence length"):
        model_profile("resnet50", FLOPS_ONLY, seq_len=8)
    with pytest.raises(WorkloadError, match="microbatch_size must be a positive"):
        model_profile("vgg16", FLOPS_ONLY, 0)
    with pytest.raises(WorkloadError, match="layers must be a positive"):
        model_profile("uniform", FLOPS_ONLY, layers=0)
    assert model_profile("gpt-1.3b", FLOPS_ONLY, optimizer="sgd").optimizer == "sgd"
    assert model_profile("gpt-1.3b", FLOPS_ONLY).optimizer == "adam"
    assert model_profile("vgg16", FLOPS_ONLY).optimizer == "sgd"


def test_profile_pass_overhead_is_charged_once_per_stage_pass():
    from pipesim.sim.workloads.stages import split_at

    layers = tuple(LayerCost(f"l{i}", 1e-3, 2e-3, 100, 10, 10) for i in range(4))
    base = Profile("p", layers)
    prof = Profile("p", layers, overhead_forward_s=1e-4, overhead_backward_s=3e-4)
    a, b = split_at(base, [0, 2]), split_at(prof, [0, 2])
    for x, y in zip(a, b):
        assert y.forward_s == pytest.approx(x.forward_s + 1e-4)
        assert y.backward_s == pytest.approx(x.backward_s + 3e-4)
        assert y.backward_input_s == pytest.approx(x.backward_input_s + 3e-4)
    again = Profile.from_json(json.loads(json.dumps(prof.to_json())))
    assert again == prof
    assert "overhead" not in base.to_json()
    with pytest.raises(WorkloadError, match="overhead"):
        Profile.from_json({**prof.to_json(), "overhead": {"forward_s": -1}})
    with pytest.raises(WorkloadError, match="overhead"):
        Profile.from_json({**prof.to_json(), "overhead": {"launch_s": 1}})


# ---------------------------------------------------------------------------
# Hostile numbers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("param_bytes", 2**70, "param_bytes must be an integer >= 0 and <= 2**53"),  # was an OverflowError
        ("param_bytes", 1e300, "param_bytes must be an integer >= 0 and <= 2**53"),  # was an overflow warning
        ("stash_bytes", 2**53 + 1, "stash_bytes must be an integer >= 0 and <= 2**53"),
        ("activation_bytes", True, "activation_bytes must be an integer"),
        ("activation_bytes", "8", "activation_bytes must be an integer"),
        ("forward_s", 1e300, "forward_s must be a finite number >= 0 and <= 1e+09"),
        ("backward_s", 10**30, "backward_s must be a finite number >= 0 and <= 1e+09"),
        ("forward_s", False, "forward_s must be a finite number"),
        ("forward_s", "0.1", "forward_s must be a finite number"),
    ],
)
def test_numbers_out_of_range_are_refused_at_load(tmp_path, field, value, fragment):
    path = tmp_path / "prof.json"
    path.write_text(json.dumps({"name": "m", "layers": [{**GOOD_LAYER, field: value}]}))
    with pytest.raises(WorkloadError) as e:
        load_profile(path)
    msg = str(e.value)
    assert fragment in msg and str(path) in msg and "\n" not in msg, msg


def test_profile_level_numbers_are_checked():
    big = layer(p=2**52, s=2**52)
    Profile("ok", (big, big))  # 2**53 in all: the limit
    with pytest.raises(WorkloadError, match=r"param_bytes add up to \d+, more than 2\*\*53"):
        Profile("m", (big, big, layer(p=1, s=0)))
    with pytest.raises(WorkloadError, match="microbatch_size must be an integer >= 1 and <= 2"):
        Profile("m", (layer(),), microbatch_size=2**31 + 1)
    with pytest.raises(WorkloadError, match="optimizer must be one of"):
        Profile("m", (layer(),), optimizer=["sgd"])  # unhashable: was a TypeError
    with pytest.raises(WorkloadError, match="overhead_forward_s must be a finite number"):
        Profile("m", (layer(),), overhead_forward_s=math.inf)
    with pytest.raises(WorkloadError, match="an integer of 3322 bits"):
        layer(p=10**1000)  # too long even to print


def test_integer_beyond_pythons_digit_limit_is_a_workload_error(tmp_path):
    path = tmp_path / "prof.json"
    path.write_text('{"name": "m", "layers": [{"name": "l", "forward_s": ' + "9" * 5000 + "}]}")
    with pytest.raises(WorkloadError, match="unreadable JSON"):
        load_profile(path)


def test_memory_the_tracker_cannot_count_is_refused_by_name():
    from pipesim.sim.api import simulate
    from pipesim.sim.strategies import ScheduleSpec

    half = layer(p=2**40, a=0, s=2**52)
    prof = Profile("huge-stash", (half, half))  # 2**52 of stash per stage: legal
    # 1F1B keeps at most p micro-batches in flight: counted exactly
    ok = simulate(ScheduleSpec("1f1b", 2, 2048), profile=prof)
    assert max(t.peak_bytes for t in ok.memory) == 2 * 2**52 + 3 * 2**40
    # GPipe keeps all 2048 of them: 2**63 bytes would wrap int64 to a negative peak
    with pytest.raises(WorkloadError, match="memory accounting overflows on device 0"):
        simulate(ScheduleSpec("gpipe", 2, 2048), profile=prof)


# ---------------------------------------------------------------------------
# Kernel launches: a fixed part per pass (DeviceSpec.kernel_overhead_s)
# ---------------------------------------------------------------------------

#: FLOPS_ONLY with 5 us per kernel launch.
LAUNCHING = DeviceSpec(
    "launching", flops=1e15, mem_bandwidth=math.inf, memory_bytes=math.inf, dtype_bytes=2, kernel_overhead_s=5e-6
)


@pytest.mark.parametrize("b", [1, 2, 3, 8, 32])
def test_layer_time_is_launches_plus_b_times_per_sample(b):
    """A transformer block on a compute-bound device: time(b) = kernels x
    overhead + b x per-sample time, forward (15 kernels) and backward (43:
    19 for the input gradient, 24 for the weight gradient), in closed form."""
    from pipesim.sim.workloads.catalog import TRANSFORMER_KERNELS

    s, h = 512, 1024
    per_sample_fwd = (24 * s * h * h + 4 * s * s * h) / LAUNCHING.flops
    t = LAUNCHING.kernel_overhead_s
    k_f, k_bi, k_bw = TRANSFORMER_KERNELS
    assert TRANSFORMER_KERNELS == (15, 19, 24)
    block = model_profile("2bw-gpt-355m", LAUNCHING, b).layers[1]
    assert block.forward_s == pytest.approx(k_f * t + b * per_sample_fwd, rel=1e-12)
    assert block.backward_s == pytest.approx((k_bi + k_bw) * t + 2 * b * per_sample_fwd, rel=1e-12)
    # the input gradient: its own launches and the products' input-gradient FLOPs (24sh^2 + 8s^2h)
    assert block.backward_input == pytest.approx(
        k_bi * t + b * (24 * s * h * h + 8 * s * s * h) / LAUNCHING.flops, rel=1e-12
    )
    assert (block.fixed_forward_s, block.fixed_backward_s) == pytest.approx((k_f * t, (k_bi + k_bw) * t))
    # without launches it is the roofline alone, exactly as before
    plain = model_profile("2bw-gpt-355m", FLOPS_ONLY, b).layers[1]
    assert plain.forward_s == b * model_profile("2bw-gpt-355m", FLOPS_ONLY, 1).layers[1].forward_s
    assert (plain.fixed_forward_s, plain.fixed_backward_s) == (0.0, 0.0)


def test_launches_make_small_microbatches_dearer_per_sample_only():
    """Per-sample time falls with b toward the roofline's, never below it;
    the first layer (no input gradient) pays no input-gradient launches."""
    per_sample = [model_profile("2bw-gpt-2.2b", LAUNCHING, b) for b in (1, 2, 4, 8, 16)]
    times = [(p.forward_s + p.backward_s) / p.microbatch_size for p in per_sample]
    assert times == sorted(times, reverse=True)
    roofline = model_profile("2bw-gpt-2.2b", FLOPS_ONLY, 1)
    assert times[-1] > roofline.forward_s + roofline.backward_s
    embed = per_sample[0].layers[0]
    assert embed.backward_input == 0.0 and embed.fixed_backward_s == pytest.approx(16 * 5e-6)


def test_measured_profiles_never_pay_launches():
    """PipeDream's profiles are measured times (launches included): a device
    with kernel_overhead_s leaves them exactly as they are."""
    assert model_profile("pipedream-vgg16", LAUNCHING) == model_profile("pipedream-vgg16", FLOPS_ONLY)
    assert model_profile("uniform", LAUNCHING) == model_profile("uniform", FLOPS_ONLY)


def test_fixed_parts_round_trip_and_are_checked(tmp_path):
    prof = model_profile("2bw-gpt-355m", LAUNCHING, 2, layers=2)
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    assert "fixed_forward_s" not in json.dumps(model_profile("2bw-gpt-355m", FLOPS_ONLY, layers=2).to_json())
    with pytest.raises(WorkloadError, match="fixed_forward_s must be between 0 and forward_s"):
        LayerCost("l", 1.0, 2.0, 1, 1, 1, fixed_forward_s=1.5)
    with pytest.raises(WorkloadError, match="fixed_backward_s must be between"):
        LayerCost("l", 1.0, 2.0, 1, 1, 1, fixed_backward_s=-1.0)

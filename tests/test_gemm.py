"""GEMM time from its shape (sim/hardware/gemm.py), the devices that carry the
model (DeviceSpec, the presets) and the catalog layers priced by it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.sim.hardware import gemm
from pipesim.sim.hardware.machines import DeviceSpec, Hardware, HardwareError, load_hardware, preset_names
from pipesim.sim.workloads.catalog import TWO_BW_SIZES, architecture, layer_cost, model_names, model_profile

H100 = load_hardware("dgx-h100").device
V100 = load_hardware("p3.16xlarge").device
A100 = load_hardware("dgx-a100").device

#: a device with the shape model, no table, no memory bound, no launches
SHAPED = DeviceSpec(
    "shaped",
    flops=1e12,
    mem_bandwidth=math.inf,
    memory_bytes=math.inf,
    dtype_bytes=2,
    peak_flops=100e12,
    sms=80,
    gemm_max_efficiency=0.5,
)

shape_models = st.fixed_dictionaries(
    {
        "sms": st.integers(1, 160),
        "max_efficiency": st.floats(0.05, 1.0),
        "tile": st.sampled_from([(128, 128), (64, 128), (128, 256), (256, 128), (16, 16)]),
        "k_overhead": st.sampled_from([0.0, 64.0, 118.0, 500.0]),
    }
)
dims = st.integers(1, 5000)


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(model=shape_models, k=dims, extra=st.integers(2, 40))
def test_wave_quantisation(model, k, extra):
    """sms + 1 tiles run in two waves, as long as 2 x sms tiles; sms tiles in
    one, half that; past a full wave K is never split."""
    tm, tn = model["tile"]
    kw = dict(peak_flops=1e14, fixed_s=0.0, **model)
    sms = model["sms"]
    one_more = gemm.model_seconds(tm * (sms + 1), tn, k, **kw)
    assert one_more == gemm.model_seconds(tm * 2 * sms, tn, k, **kw)
    assert one_more == pytest.approx(2 * gemm.model_seconds(tm * sms, tn, k, **kw), rel=1e-12)
    # the same over N and over the batch
    assert one_more == gemm.model_seconds(tm, tn * 2 * sms, k, **kw) == gemm.model_seconds(tm, tn, k, 2 * sms, **kw)
    assert gemm.split_k(tm * (sms + 1), tn, k, sms=sms, tile=model["tile"]) == 1
    # a wave and a bit more: waves / ceil(waves) of the full-wave efficiency
    t = sms * extra + 1
    full = gemm.efficiency(tm * sms * extra, tn, k, **model)
    assert gemm.efficiency(tm * t, tn, k, **model) == pytest.approx(full * t / (sms * (extra + 1)), rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(model=shape_models, m=dims, n=dims, k=dims, batch=st.integers(1, 64))
def test_efficiency_is_at_most_the_best_shapes(model, m, n, k, batch):
    eff = gemm.efficiency(m, n, k, batch, **model)
    best = model["max_efficiency"] * k / (k + model["k_overhead"])
    assert 0 < eff <= model["max_efficiency"] * (1 + 1e-12)
    if gemm.split_k(m, n, k, batch, sms=model["sms"], tile=model["tile"], k_overhead=model["k_overhead"]) == 1:
        assert eff <= best * (1 + 1e-12)
    # time and efficiency are one formula
    t = gemm.model_seconds(m, n, k, batch, peak_flops=1e14, **model)
    assert t == pytest.approx(2 * m * n * k * batch / (1e14 * eff), rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(model=shape_models, m=dims, n=dims, k=dims, batch=st.integers(1, 16), axis=st.integers(0, 3), grow=dims)
def test_a_bigger_gemm_never_takes_less_time(model, m, n, k, batch, axis, grow):
    shape = [m, n, k, batch]
    bigger = list(shape)
    bigger[axis] += grow
    kw = dict(peak_flops=1e14, fixed_s=1e-6, **model)
    assert gemm.model_seconds(*bigger, **kw) >= gemm.model_seconds(*shape, **kw)


@settings(max_examples=100, deadline=None)
@given(model=shape_models, j=st.integers(1, 20), kt=st.integers(1, 40))
def test_whole_waves_of_whole_tiles_reach_the_best_efficiency(model, j, kt):
    tm, tn = model["tile"]
    k = 32 * kt
    eff = gemm.efficiency(tm * model["sms"] * j, tn, k, **model)
    assert eff == pytest.approx(model["max_efficiency"] * k / (k + model["k_overhead"]), rel=1e-12)


def test_efficiency_rises_with_m_and_saturates():
    """N = K = 4096 on the V100 preset's model, M from one tile row to 2**17:
    the efficiency never falls and ends at the best shapes' (the model's
    max), while one tile row reaches under 85% of that."""
    kw = dict(sms=V100.sms, max_efficiency=V100.gemm_max_efficiency, tile=V100.gemm_tile)
    effs = [gemm.efficiency(2**e, 4096, 4096, **kw) for e in range(7, 18)]
    assert effs == sorted(effs)
    assert effs[-1] == pytest.approx(V100.gemm_max_efficiency, rel=2e-3)
    assert effs[0] < 0.85 * effs[-1]
    # tile quantisation: a dimension one past a tile pads a whole tile
    assert gemm.efficiency(129, 4096, 4096, **kw) == pytest.approx(
        gemm.efficiency(256, 4096, 4096, **kw) * 129 / 256, rel=1e-12
    )


def test_split_k_fills_the_device_below_one_wave():
    # one tile on 80 SMs: split into 80 slices when splitting is free
    assert gemm.split_k(100, 100, 8000, sms=80) == 80
    # every slice pays the fixed work per unit again, which bounds the gain
    kw = dict(peak_flops=1e14, sms=80, max_efficiency=1.0)
    assert gemm.split_k(100, 100, 64, sms=80, k_overhead=500) == 64
    assert gemm.model_seconds(100, 100, 64, k_overhead=500, **kw) == pytest.approx(
        80 * 2 * 128 * 128 * (1 + 500) / 1e14, rel=1e-12
    )
    # never more slices than K has elements, never past one wave
    assert gemm.split_k(100, 100, 3, sms=80) == 3
    assert gemm.split_k(128 * 41, 128, 4096, sms=80) == 1


def test_bad_shapes_are_refused():
    with pytest.raises(gemm.GemmError, match="GEMM m must be a positive integer"):
        gemm.model_seconds(0, 1, 1, peak_flops=1e12, sms=1, max_efficiency=1.0)
    with pytest.raises(gemm.GemmError, match="GEMM batch"):
        gemm.gemm_seconds(SHAPED, 1, 1, 1, 1.5)
    with pytest.raises(gemm.GemmError, match="no GEMM shape model"):
        gemm.gemm_seconds(load_hardware("pcie-4gpu").device, 8, 8, 8)


# ---------------------------------------------------------------------------
# A device's GEMM: the memory bound, the measured table
# ---------------------------------------------------------------------------


def test_a_device_gemm_is_the_model_or_its_operands_traffic():
    m, n, k = 4096, 4096, 4096
    assert gemm.gemm_seconds(SHAPED, m, n, k) == gemm.model_seconds(
        m, n, k, peak_flops=100e12, sms=80, max_efficiency=0.5
    )
    slow = dataclasses.replace(SHAPED, mem_bandwidth=1e9)  # a GEMV-like shape is memory-bound
    assert gemm.gemm_seconds(slow, 1, 4096, 4096) == pytest.approx((4096 + 4096 * 4096 + 4096) * 2 / 1e9)
    fixed = dataclasses.replace(SHAPED, gemm_fixed_s=3e-6)
    assert gemm.gemm_seconds(fixed, m, n, k) == pytest.approx(gemm.gemm_seconds(SHAPED, m, n, k) + 3e-6)


def test_the_table_path_reproduces_the_tables_points():
    table = gemm.load_table("gemm-h100-bf16")
    data = json.loads(
        (gemm._measurements() / "gemm-h100-bf16.json").read_text(encoding="utf-8")  # the file as committed
    )
    assert len(data["points"]) == 375 == len(list(table.points()))
    for b, m, n, k, rate in data["points"]:
        assert gemm.gemm_seconds(H100, m, n, k, b) == pytest.approx(2 * b * m * n * k / rate, rel=1e-12)
    # two points the calibration notes quote (docs: gpu-cost-calibration.md section 2a)
    assert table.rate(1, 1024, 2048, 2048) == pytest.approx(524.288e12, rel=1e-12)
    assert table.rate(1, 4096, 4096, 4096) == pytest.approx(783.3e12, rel=1e-4)


@settings(max_examples=200, deadline=None)
@given(b=st.integers(1, 4), m=st.integers(256, 4096), n=st.integers(256, 4096), k=st.integers(256, 4096))
def test_between_measured_shapes_the_rate_stays_between_its_neighbours(b, m, n, k):
    table = gemm.load_table("gemm-h100-bf16")
    corners = []
    for v, ax in zip((b, m, n, k), table.axes):
        lo = max(a for a in ax if a <= v)
        hi = min(a for a in ax if a >= v)
        corners.append({lo, hi})
    rates = [table.rate(*c) for c in itertools.product(*corners)]
    assert min(rates) * (1 - 1e-12) <= table.rate(b, m, n, k) <= max(rates) * (1 + 1e-12)


def test_interpolation_is_linear_in_log_space():
    table = gemm.load_table("gemm-h100-bf16")
    lo, hi = table.rate(1, 1024, 2048, 2048), table.rate(1, 2048, 2048, 2048)
    m = 1448  # about the geometric mean of 1024 and 2048
    w = (math.log(m) - math.log(1024)) / (math.log(2048) - math.log(1024))
    assert table.rate(1, m, 2048, 2048) == pytest.approx(lo ** (1 - w) * hi**w, rel=1e-12)


def test_outside_the_table_the_model_carries_the_nearest_measured_shape():
    near = gemm.gemm_seconds(H100, 4096, 4096, 4096, 4)

    def model(b):
        return gemm._device_model(H100, b, 4096, 4096, 4096)

    # eight products: the table's four, scaled by the model's ratio
    assert gemm.gemm_seconds(H100, 4096, 4096, 4096, 8) == pytest.approx(near * model(8) / model(4), rel=1e-12)
    # M past the table: about proportional (whole waves either way)
    assert gemm.gemm_seconds(H100, 8192, 4096, 4096, 4) == pytest.approx(2 * near, rel=0.02)
    # continuous at the edge: K = 255 just outside, K = 256 the measured shape
    assert gemm.gemm_seconds(H100, 1024, 1024, 255) == pytest.approx(gemm.gemm_seconds(H100, 1024, 1024, 256), rel=0.01)
    # a head dimension of 64: dearer per FLOP than the nearest measured K (the fixed work per tile)
    k64 = gemm.gemm_seconds(H100, 512, 512, 64, 64)
    k256 = gemm.gemm_seconds(H100, 512, 512, 256, 64)
    assert k256 / 4 < k64 < k256


def test_a_table_must_be_a_full_grid(monkeypatch, tmp_path):
    (tmp_path / "gemm-bad.json").write_text(
        json.dumps({"columns": ["b", "m", "n", "k", "flops_per_s"], "points": [[1, 256, 256, 256, 1e12]] * 2})
    )
    (tmp_path / "gemm-hole.json").write_text(
        json.dumps(
            {
                "columns": ["b", "m", "n", "k", "flops_per_s"],
                "points": [[1, 256, 256, 256, 1e12], [1, 512, 512, 256, 1e12]],
            }
        )
    )
    monkeypatch.setattr(gemm, "_measurements", lambda: tmp_path)
    gemm.load_table.cache_clear()
    try:
        assert gemm.table_names() == ["gemm-bad", "gemm-hole"]
        with pytest.raises(gemm.GemmError, match="listed twice"):
            gemm.load_table("gemm-bad")
        with pytest.raises(gemm.GemmError, match="full grid"):
            gemm.load_table("gemm-hole")
        with pytest.raises(gemm.GemmError, match="unknown GEMM table"):
            gemm.load_table("gemm-h100-bf16")
    finally:
        gemm.load_table.cache_clear()


# ---------------------------------------------------------------------------
# The presets' constants, each from its source
# ---------------------------------------------------------------------------


def test_h100_constants_are_the_fit_to_xlas_table():
    """gemm_max_efficiency, gemm_k_overhead and gemm_fixed_s of the H100
    presets are the least-squares fit of the model to XLA's table, rounded."""
    points = list(gemm.load_table("gemm-h100-bf16").points())
    eff, k0, fixed, rms = gemm.fit_model(points, peak_flops=H100.peak_flops, sms=H100.sms, tile=H100.gemm_tile)
    assert (round(eff, 3), k0, round(fixed, 8)) == (
        H100.gemm_max_efficiency,
        H100.gemm_k_overhead,
        H100.gemm_fixed_s,
    )
    assert rms < 0.09
    # the fit reaches the table's best shapes' rate within a few per cent
    best = max(r for *_, r in points)
    model = max(2 * b * m * n * k / gemm._device_model(H100, b, m, n, k) for b, m, n, k, _ in points)
    assert model == pytest.approx(best, rel=0.05)
    for name in ("dgx-h100-x2", "dgx-h100-x4"):
        assert load_hardware(name).device == H100


def test_a100_constant_reproduces_the_measured_best_matmul():
    """271.2 TFLOP/s measured at M x N x K = 1024 x 10240 x 5120 in bf16
    (stas00/ml-engineering's maximum achievable matmul FLOPS table)."""
    t = gemm.gemm_seconds(A100, 1024, 10240, 5120)
    assert 2 * 1024 * 10240 * 5120 / t == pytest.approx(271.2e12, rel=1e-3)
    assert (A100.peak_flops, A100.sms) == (312e12, 108)


def test_v100_presets_share_one_gemm_model():
    dgx1 = load_hardware("dgx1-v100").device
    fields = [f for f in DeviceSpec.GEMM_FIELDS]
    for name in ("p3.16xlarge-x8", "dgx1-v100", "dgx1-v100-x4"):
        dev = load_hardware(name).device
        assert [getattr(dev, f) for f in fields] == [getattr(V100, f) for f in fields]
    assert (V100.peak_flops, V100.sms) == (125e12, 80) and dgx1.kernel_overhead_s == 0.0
    # the fp32 presets keep the sustained roofline (no tensor-core GEMM model for fp32)
    for name in ("pipedream-cluster-a", "pipedream-cluster-b", "pcie-4gpu", "spectrain-4gpu", "ideal"):
        assert not load_hardware(name).device.shape_model


# ---------------------------------------------------------------------------
# The hardware file
# ---------------------------------------------------------------------------

_DEV = {"flops": 1e12, "mem_bandwidth": 1e11, "memory_bytes": 1e9, "dtype_bytes": 2}
_MODEL = {"peak_flops": 1e14, "sms": 80, "gemm_max_efficiency": 0.5}


def _file(tmp_path, **fields):
    d = {"name": "x", "num_devices": 2, "device": {**_DEV, **fields}, "intra_node": {"kind": "bus", "bandwidth": 1e9}}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.parametrize("name", preset_names())
def test_presets_round_trip(name):
    hw = load_hardware(name)
    again = Hardware.from_json(json.loads(json.dumps(hw.to_json())))
    assert again.device == hw.device and again.to_json() == hw.to_json()
    keys = set(hw.to_json()["device"])
    if hw.device.shape_model:
        assert {"peak_flops", "sms", "gemm_max_efficiency", "gemm_tile"} <= keys
    else:  # a preset without the model writes exactly the fields it always did
        assert not keys & set(DeviceSpec.GEMM_FIELDS)


def test_model_fields_are_read_and_written(tmp_path):
    path = _file(tmp_path, **_MODEL, gemm_tile=[64, 256], gemm_k_overhead=32, gemm_fixed_s=2e-6)
    dev = load_hardware(path).device
    assert (dev.peak_flops, dev.sms, dev.gemm_max_efficiency, dev.gemm_tile) == (1e14, 80, 0.5, (64, 256))
    assert (dev.gemm_k_overhead, dev.gemm_fixed_s, dev.gemm_table) == (32, 2e-6, None)
    out = load_hardware(path).to_json()["device"]
    assert out["gemm_tile"] == [64, 256] and out["gemm_k_overhead"] == 32 and "gemm_table" not in out
    minimal = load_hardware(_file(tmp_path, **_MODEL)).to_json()["device"]
    assert minimal["gemm_tile"] == [128, 128] and "gemm_k_overhead" not in minimal and "gemm_fixed_s" not in minimal


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({**_MODEL, "peak_flops": "inf"}, "peak_flops must be a positive finite number"),
        ({**_MODEL, "peak_flops": 0}, "peak_flops must be a positive finite number"),
        ({**_MODEL, "sms": 0}, "sms must be an integer between 1"),
        ({**_MODEL, "sms": 80.0}, "device.sms must be an integer"),
        ({**_MODEL, "sms": True}, "device.sms must be an integer"),
        ({**_MODEL, "gemm_max_efficiency": 1.5}, r"gemm_max_efficiency must be a number in \(0, 1\]"),
        ({**_MODEL, "gemm_max_efficiency": 0}, r"gemm_max_efficiency must be a number in \(0, 1\]"),
        ({**_MODEL, "gemm_max_efficiency": "high"}, "device.gemm_max_efficiency must be a number"),
        ({**_MODEL, "gemm_tile": [128]}, "gemm_tile must be two integers"),
        ({**_MODEL, "gemm_tile": [128, 0]}, "gemm_tile must be two integers"),
        ({**_MODEL, "gemm_tile": [128, 1.5]}, "gemm_tile must be two integers"),
        ({**_MODEL, "gemm_tile": "128x128"}, "gemm_tile must be a list of two integers"),
        ({**_MODEL, "gemm_k_overhead": -1}, "gemm_k_overhead must be a number >= 0"),
        ({**_MODEL, "gemm_fixed_s": "inf"}, "gemm_fixed_s must be a finite number >= 0"),
        ({**_MODEL, "gemm_table": "gemm-nowhere"}, "gemm_table must name a GEMM table"),
        ({**_MODEL, "gemm_table": 3}, "gemm_table must be the name of a GEMM table"),
        ({"peak_flops": 1e14, "sms": 80}, "gemm_max_efficiency is missing"),
        ({"sms": 80, "gemm_max_efficiency": 0.5}, "peak_flops is missing"),
        ({"gemm_table": "gemm-h100-bf16"}, "gemm_table needs the GEMM shape model"),
        ({"gemm_tile": [64, 64]}, "gemm_tile needs the GEMM shape model"),
    ],
)
def test_bad_model_fields_are_refused_in_one_line(tmp_path, fields, fragment):
    with pytest.raises(HardwareError, match=fragment) as err:
        load_hardware(_file(tmp_path, **fields))
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------
# The catalog's GEMMs
# ---------------------------------------------------------------------------


def _gpt_and_bert():
    return [n for n in model_names() if "gpt" in n or "bert" in n]


@pytest.mark.parametrize("name", _gpt_and_bert())
def test_transformer_gemms_count_megatrons_flops(name):
    """Each block's GEMMs add up to Megatron's 24sh^2 + 4s^2h per sample, the
    GPT logits to 2shV; no GEMM is counted twice or left out."""
    layers = architecture(name)
    blocks = [la for la in layers if la.name.startswith("block")]
    s = layers[0].in_elems
    h = blocks[0].in_elems // s
    for la in blocks:
        assert math.fsum(g.flops for g in la.gemms) == 24 * s * h * h + 4 * s * s * h == la.gemm_flops + la.other_flops
        assert len(la.gemms) == 6 and sum(not g.weights for g in la.gemms) == 2
    if "gpt" in name:
        head = layers[-1]
        (logits,) = head.gemms
        assert logits.flops == 2 * s * h * logits.n and logits.n in (50257, 51200)


@pytest.mark.parametrize("name", [n for n in model_names() if n != "uniform"])
def test_every_layers_gemms_account_for_its_flops(name):
    """GEMM FLOPs are the layer's counted FLOPs, but for GNMT's additive
    attention scores (3tsh of its 5tsh, elementwise work)."""
    for la in architecture(name):
        total = la.gemm_flops + la.other_flops
        got = math.fsum(g.flops for g in la.gemms)
        if la.name == "dec.lstm0+attn":
            t, h = 50, 1024
            assert got == pytest.approx(total - 3 * t * t * h, rel=1e-12)
        elif total:
            assert got == pytest.approx(total, rel=1e-12), la.name
        else:
            assert not la.gemms


@pytest.mark.parametrize("b", [1, 3, 8])
def test_backward_gemms_have_the_gradients_shapes(b, monkeypatch):
    """Record every GEMM a layer prices: the forward's at b times the rows
    (or products), the input gradients' (M, K, N) and (K, N, M) FLOPs equal
    to the forward's plus attention's again, the weight gradients' to the
    forward products with weights."""
    from pipesim.sim.workloads import catalog

    seen = []

    def record(device, m, n, k, batch=1):
        seen.append((m, n, k, batch))
        return 1.0

    monkeypatch.setattr(catalog, "gemm_seconds", record)
    block = architecture("2bw-gpt-355m")[1]
    s, h = 512, 1024
    fwd, grad_in, grad_w = catalog.shaped_passes(block, SHAPED, b)
    # each product's forward, then its two gradients
    assert len(seen) == 3 * 6
    forward = seen[0::3]
    grads = [x for i, x in enumerate(seen) if i % 3]
    assert forward[0] == (b * s, 3 * h, h, 1) and forward[1] == (s, s, 64, 16 * b)  # QKV; scores per head
    assert math.fsum(2 * m * n * k * c for m, n, k, c in forward) == b * (24 * s * h * h + 4 * s * s * h)
    assert math.fsum(2 * m * n * k * c for m, n, k, c in grads) == 2 * b * (24 * s * h * h + 4 * s * s * h)
    assert seen[1] == (b * s, h, 3 * h, 1)  # QKV's data gradient (M, K, N)
    # the weight gradients sum over every row: K = b x s
    assert (h, 3 * h, b * s, 1) in seen and (4 * h, h, b * s, 1) in seen
    # at 1 s per GEMM (bandwidth unbounded): 6 forward, 4 + 2 x 2 input-gradient, 4 weight-gradient
    assert (fwd, grad_in, grad_w) == (6.0, 8.0, 4.0)


def test_a_layer_is_its_gemms_plus_its_traffic():
    dev = dataclasses.replace(H100, kernel_overhead_s=0.0)
    block = architecture("2bw-gpt-1.3b")[1]
    b = 2
    cost = layer_cost(block, dev, b)
    gemms = math.fsum(gemm.gemm_seconds(dev, *g.shape(b)) * g.steps for g in block.gemms)
    traffic = dev.dtype_bytes * b * (block.in_elems + block.out_elems + block.stash_elems) / dev.mem_bandwidth
    assert cost.forward_s == pytest.approx(gemms + traffic, rel=1e-12)
    grad_in = grad_w = 0.0
    for g in block.gemms:
        m, n, k, c = g.shape(b)
        grad_in += gemm.gemm_seconds(dev, m, k, n, c)
        if g.weights:
            grad_w += gemm.gemm_seconds(dev, k, n, m * c)
        else:
            grad_in += gemm.gemm_seconds(dev, k, n, m, c)
    # the non-GEMM backward (twice the forward's traffic) is part of the input gradient
    assert cost.backward_input == pytest.approx(grad_in + 2 * traffic, rel=1e-12)
    assert cost.backward_weight == pytest.approx(grad_w, rel=1e-9)


@pytest.mark.parametrize("hardware", ["p3.16xlarge", "dgx1-v100", "dgx-a100", "dgx-h100"])
@pytest.mark.parametrize("model", ["2bw-gpt-355m", "bert-large", "resnet50"])
def test_a_microbatch_of_one_costs_more_per_sample_than_32(hardware, model):
    """On every preset with the shape model, launches or none (dgx1-v100 and
    dgx-a100 charge none): the GEMMs of one sample fill fewer waves."""
    dev = load_hardware(hardware).device

    def per_sample(device, b):
        p = model_profile(model, device, b)
        return (p.forward_s + p.backward_s) / b

    assert per_sample(dev, 1) > 1.05 * per_sample(dev, 32)
    # the same device priced by the roofline, without launches: a smaller penalty, if any
    plain = dataclasses.replace(
        dev,
        kernel_overhead_s=0.0,
        peak_flops=None,
        sms=None,
        gemm_max_efficiency=None,
        gemm_k_overhead=0.0,
        gemm_fixed_s=0.0,
        gemm_table=None,
    )
    assert per_sample(plain, 1) / per_sample(plain, 32) < per_sample(dev, 1) / per_sample(dev, 32)


def test_2bw_sizes_divide_into_heads():
    for _, _, d, heads in TWO_BW_SIZES:
        assert d % heads == 0

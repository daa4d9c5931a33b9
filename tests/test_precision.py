"""Mixed precision: each copy of the weights at its own width (``Precision``).

What a gradient all-reduce moves (engine spans and the planner's closed
forms), what memory holds (weights, stashed versions, gradients, the master
copy and optimizer state), the profile file's ``"precision"`` object and the
catalog's choice per device.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipesim.experiments.cli import main
from pipesim.sim.api import simulate_schedule
from pipesim.sim.hardware.machines import DeviceSpec, load_hardware, preset_names
from pipesim.sim.ir.core import AVERAGE, REDUCE_GRAD
from pipesim.sim.partition import cost as cost_model
from pipesim.sim.partition.layout import layout_of
from pipesim.sim.partition.search import CostSetting, Tables, memory_terms, stage_terms
from pipesim.sim.partition.split import partition
from pipesim.sim.planning.grid import GridRequest, Shape, _Grid
from pipesim.sim.strategies import ScheduleSpec, build_schedule
from pipesim.sim.strategies.tensor_parallel import device_costs
from pipesim.sim.workloads.catalog import catalog_precision, model_profile
from pipesim.sim.workloads.profile import (
    FP32,
    MIXED_16BIT,
    PRECISION_WIDTHS,
    LayerCost,
    Precision,
    Profile,
    WorkloadError,
)
from pipesim.sim.workloads.readers import load_profile, save_profile
from pipesim.sim.workloads.stages import split_at, stage_cost

PCIE = load_hardware("pcie-4gpu")  # fp32, four devices behind one bridge: every collective has bytes to move

widths = st.sampled_from(PRECISION_WIDTHS)
precisions = st.builds(Precision, widths, widths, widths)
#: 16-bit gradients beside the same weights and master: only what REDUCE_GRAD moves differs from fp32
GRAD16 = Precision(weight_bytes=4, gradient_bytes=2, master_bytes=4)


def layers(params: list[int], activation: int = 0, stash: int = 0) -> tuple[LayerCost, ...]:
    return tuple(LayerCost(f"l{i}", 1e-3, 2e-3, p, activation, stash) for i, p in enumerate(params))


def profile(params: list[int], precision: Precision = FP32, optimizer: str = "sgd", **sizes) -> Profile:
    return Profile("p", layers(params, **sizes), optimizer=optimizer, precision=precision)


def collectives(result, op) -> dict:
    """(device, action, k) -> bytes of the k-th collective span of ``op`` with that action on that device."""
    out, seen = {}, defaultdict(int)
    for s in sorted(result.spans, key=lambda s: (s.device, s.start, s.end)):
        if s.stream == "collective" and s.action.op is op:
            key = (s.device, s.action)
            out[(*key, seen[key])] = s.nbytes
            seen[key] += 1
    return out


# ---------------------------------------------------------------------------
# Precision and the profile file
# ---------------------------------------------------------------------------


@given(pr=precisions, params=st.lists(st.integers(0, 2**30), min_size=1, max_size=6))
def test_copies_scale_from_the_master_width(pr, params):
    """Each copy is param_bytes (counted at master_bytes per parameter) at its own width."""
    params = [p * pr.master_bytes for p in params]  # whole parameters
    prof = profile(params, pr)
    c = stage_cost(prof, 0, len(params) - 1)
    n = sum(params) // pr.master_bytes  # parameters
    assert (c.param_bytes, c.weight_bytes, c.gradient_bytes) == (
        n * pr.master_bytes,
        n * pr.weight_bytes,
        n * pr.gradient_bytes,
    )
    assert c.master_copy_bytes == (n * pr.master_bytes if pr.weight_bytes != pr.master_bytes else 0)


def test_mixed_precision_holds_zeros_count():
    """Mixed-precision Adam: 2 + 2 + 4 + 4 + 4 = 16 bytes a parameter, momentum
    SGD 12, as fp32 holds at 4 + 4 + 8 and 4 + 4 + 4 (ZeRO, section 3.1)."""
    n = 1000
    for pr in (MIXED_16BIT, FP32):
        c = stage_cost(profile([4 * n], pr), 0, 0)
        assert c.resident_bytes(2) == 16 * n and c.resident_bytes(1) == 12 * n
        assert c.memory_bytes(0, 2) == 16 * n
    mixed = stage_cost(profile([4 * n], MIXED_16BIT), 0, 0)
    assert (mixed.weight_bytes, mixed.gradient_bytes, mixed.master_copy_bytes) == (2 * n, 2 * n, 4 * n)


def test_a_stage_built_by_hand_is_one_precision():
    c = split_at(profile([40, 80]), [0])[0]
    bare = replace(c, weight_bytes=None, gradient_bytes=None)
    assert bare.weight_bytes == bare.gradient_bytes == bare.param_bytes == 120 and bare.master_copy_bytes == 0


@settings(max_examples=60)
@given(
    pr=st.none() | precisions,
    params=st.lists(st.integers(0, 2**20), min_size=1, max_size=5),
    optimizer=st.sampled_from(["sgd", "adam"]),
)
def test_profile_json_round_trip(tmp_path_factory, pr, params, optimizer):
    """A profile written and read back is the same profile; without a
    precision the file has no "precision" and reads as one width throughout."""
    master = pr.master_bytes if pr is not None else 4
    prof = Profile(
        "m", layers([p * master for p in params], activation=3, stash=5), optimizer=optimizer, precision=pr or FP32
    )
    d = prof.to_json()
    assert ("precision" in d) == (pr is not None and pr != FP32)
    assert Profile.from_json(json.loads(json.dumps(d))) == prof
    path = tmp_path_factory.mktemp("p") / "prof.json"
    save_profile(prof, path)
    assert load_profile(path) == prof
    if "precision" in d:
        assert d["precision"] == {
            "weight_bytes": pr.weight_bytes,
            "gradient_bytes": pr.gradient_bytes,
            "master_bytes": pr.master_bytes,
        }
        without = {k: v for k, v in d.items() if k != "precision"}
        assert Profile.from_json(without).precision == FP32


def test_a_file_without_precision_is_unchanged():
    d = {
        "name": "m",
        "layers": [
            {"name": "l", "forward_s": 1, "backward_s": 2, "param_bytes": 7, "activation_bytes": 0, "stash_bytes": 0}
        ],
    }
    prof = Profile.from_json(d)
    assert prof.precision == FP32 and "precision" not in prof.to_json()
    c = stage_cost(prof, 0, 0)  # 7 bytes: no whole 4-byte parameters needed at one width
    assert c.weight_bytes == c.gradient_bytes == c.param_bytes == 7 and c.master_copy_bytes == 0


GOOD = {"weight_bytes": 2, "gradient_bytes": 2, "master_bytes": 4}


@pytest.mark.parametrize(
    "precision, fragment",
    [
        ({**GOOD, "gradient_bytes": 3}, "precision.gradient_bytes must be 1, 2, 4 or 8"),
        ({**GOOD, "weight_bytes": 0}, "precision.weight_bytes must be 1, 2, 4 or 8"),
        ({**GOOD, "master_bytes": 16}, "precision.master_bytes must be 1, 2, 4 or 8"),
        ({**GOOD, "master_bytes": 4.0}, "precision.master_bytes must be 1, 2, 4 or 8"),
        ({**GOOD, "weight_bytes": True}, "precision.weight_bytes must be 1, 2, 4 or 8"),
        ({**GOOD, "gradient_bytes": "2"}, "precision.gradient_bytes must be 1, 2, 4 or 8"),
        ({**GOOD, "gradient_bytes": None}, "precision.gradient_bytes must be 1, 2, 4 or 8"),
        ({**GOOD, "gradient_bytes": 2**80}, "precision.gradient_bytes must be 1, 2, 4 or 8"),
        ({"weight_bytes": 2, "gradient_bytes": 2}, "precision: missing field 'master_bytes'"),
        ({**GOOD, "optimizer_bytes": 4}, "precision: unknown field 'optimizer_bytes'"),
        ([2, 2, 4], "'precision' must be an object"),
        ("mixed", "'precision' must be an object"),
    ],
)
def test_bad_precision_is_one_line_naming_the_field(tmp_path, capsys, precision, fragment):
    d = {
        "name": "m",
        "precision": precision,
        "layers": [
            {"name": "l", "forward_s": 1, "backward_s": 2, "param_bytes": 8, "activation_bytes": 0, "stash_bytes": 0}
        ],
    }
    with pytest.raises(WorkloadError, match=fragment.replace("(", r"\(").replace(".", r"\.")) as e:
        Profile.from_json(d)
    assert "\n" not in str(e.value)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    code = main(["simulate", "--strategy", "1f1b", "--stages", "1", "--profile", str(path), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err and str(path) in err, err


def test_precision_built_in_python_is_checked_too():
    with pytest.raises(WorkloadError, match=r"precision\.master_bytes must be"):
        Precision(2, 2, 3)
    with pytest.raises(WorkloadError, match="precision must be a Precision"):
        Profile("p", layers([4]), precision=(2, 2, 4))


def test_mixed_widths_need_whole_parameters():
    """param_bytes counts master_bytes per parameter once the widths differ."""
    with pytest.raises(WorkloadError, match=r"layer 'l1': param_bytes 6 is not a whole number of 4-byte parameters"):
        profile([8, 6], MIXED_16BIT)
    assert profile([8, 6], Precision(2, 2, 2)).precision.uniform  # one width: any byte count


def test_precision_totals_stay_in_bounds():
    big = [2**52, 2**52]  # 2**53 at the master's 1 byte: 2**56 of 8-byte weights
    with pytest.raises(WorkloadError, match="weight bytes at this precision add up to"):
        profile(big, Precision(8, 1, 1))


# ---------------------------------------------------------------------------
# The engine: what each all-reduce moves
# ---------------------------------------------------------------------------

REDUCING = [
    (ScheduleSpec("data-parallel", 4, 8), [0]),
    (ScheduleSpec("1f1b", 2, 4, width=2), [0, 2]),
    (ScheduleSpec("gpipe", 2, 4, width=2), [0, 2]),
    (ScheduleSpec("pipedream-2bw", 2, 4, iterations=2, width=2), [0, 2]),
    (ScheduleSpec("pipedream", 2, 6, replicas=(3, 1)), [0, 3]),
    (ScheduleSpec("zb-h1", 2, 4, width=2), [0, 2]),
]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(REDUCING),
    params=st.lists(st.integers(1, 2**22), min_size=4, max_size=4),
    half=st.sampled_from([GRAD16, MIXED_16BIT]),
)
def test_16bit_gradients_halve_every_gradient_allreduce(case, params, half):
    spec, starts = case
    params = [4 * p for p in params]
    schedule = build_schedule(spec)
    full = simulate_schedule(schedule, profile(params, FP32, activation=4096), PCIE, starts=starts)
    mixed = simulate_schedule(schedule, profile(params, half, activation=4096), PCIE, starts=starts)
    a, b = collectives(full, REDUCE_GRAD), collectives(mixed, REDUCE_GRAD)
    assert a and a.keys() == b.keys()
    for key, nbytes in b.items():
        stage = mixed.stage_costs[key[1].stage]
        assert nbytes == stage.gradient_bytes == stage.param_bytes // 2 > 0
        assert a[key] == 2 * nbytes == full.stage_costs[key[1].stage].gradient_bytes
    assert sum(b.values()) * 2 == sum(a.values())


def test_averaging_moves_the_master_weights():
    """AvgPipe's AVERAGE all-reduces the weights the optimizers update, at the master's width."""
    spec = ScheduleSpec("avgpipe", 2, 4, iterations=2, placement="disjoint")
    schedule = build_schedule(spec)
    params = [4000, 8000, 4000, 12000]
    full = simulate_schedule(schedule, profile(params, FP32), PCIE, starts=[0, 2])
    mixed = simulate_schedule(schedule, profile(params, MIXED_16BIT), PCIE, starts=[0, 2])
    a, b = collectives(full, AVERAGE), collectives(mixed, AVERAGE)
    assert a and a == b
    assert all(n == mixed.stage_costs[act.stage].param_bytes for (_, act, _), n in b.items())


@pytest.mark.parametrize("pr", [FP32, MIXED_16BIT, GRAD16])
def test_averaging_centre_is_at_the_masters_width(pr):
    """AvgPipe's centre is a copy of the master weights, on replica 0's
    devices; there the planner's memory is the engine's (it charges the
    centre to every replica, an upper bound elsewhere)."""
    params = [4000, 8000, 4000, 12000]
    prof = profile(params, pr)
    schedule = build_schedule(ScheduleSpec("avgpipe", 2, 4, iterations=2, placement="disjoint"))
    result = simulate_schedule(schedule, prof, PCIE, starts=[0, 2])
    est = CostSetting.of(prof, PCIE).estimate(split_at(prof, [0, 2]), layout_of(schedule))
    placement = schedule.placement()
    for k, c in enumerate(result.stage_costs):
        dev = placement[(0, k)]
        assert result.memory[dev].peak_breakdown["averaging"] == c.param_bytes
        assert est.memory_bytes[dev] == result.memory[dev].peak_bytes


def test_link_bytes_count_the_16bit_gradients():
    """Two replicas on one bridge: each REDUCE_GRAD's two ring steps carry half the gradients per device."""
    params = [4000, 8000, 4000, 12000]
    spec = ScheduleSpec("data-parallel", 2, 4)
    schedule = build_schedule(spec)
    for pr in (FP32, MIXED_16BIT):
        r = simulate_schedule(schedule, profile(params, pr), PCIE, starts=[0])
        reduces = len(collectives(r, REDUCE_GRAD)) // 2  # one span per device
        assert sum(r.link_bytes.values()) == reduces * 2 * 2 * (r.stage_costs[0].gradient_bytes // 2)


# ---------------------------------------------------------------------------
# Memory: engine and planner
# ---------------------------------------------------------------------------

MEMORY = [
    (ScheduleSpec("1f1b", 4, 8), [0, 1, 2, 3]),
    (ScheduleSpec("pipedream", 4, 8, iterations=2), [0, 1, 2, 3]),
    (ScheduleSpec("pipedream-2bw", 4, 8, iterations=3), [0, 1, 2, 3]),
    (ScheduleSpec("spectrain", 4, 8, iterations=2), [0, 1, 2, 3]),
    (ScheduleSpec("gpipe", 2, 4, width=2), [0, 2]),
    (ScheduleSpec("pipedream", 2, 6, replicas=(3, 1)), [0, 3]),
]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(MEMORY),
    pr=st.sampled_from([FP32, MIXED_16BIT, GRAD16]),
    params=st.lists(st.integers(1, 2**20), min_size=4, max_size=4),
    optimizer=st.sampled_from(["sgd", "adam"]),
)
def test_planner_memory_is_the_engines(case, pr, params, optimizer):
    """Without activations a device holds weights, their versions, gradients,
    master copy, optimizer state and buffers only: the planner's closed form
    (and its vectorised form) holds exactly what the engine's tracker peaks at."""
    spec, starts = case
    prof = profile([4 * p for p in params], pr, optimizer)
    schedule = build_schedule(replace(spec, optimizer=optimizer))
    result = simulate_schedule(schedule, prof, PCIE, starts=starts)
    layout = layout_of(schedule)
    est = CostSetting.of(prof, PCIE).estimate(split_at(prof, starts), layout)
    assert list(est.memory_bytes) == [t.peak_bytes for t in result.memory]
    tables = Tables(prof)
    bounds = [*starts, len(params)]
    for k in range(layout.stages):
        vector = memory_terms(
            tables,
            inflight=layout.inflight[k],
            versions=layout.versions[k],
            buffers=layout.buffers[k],
            optimizer_multiplier=prof.optimizer_state_multiplier,
        )[bounds[k], bounds[k + 1]]
        c = stage_cost(prof, bounds[k], bounds[k + 1] - 1)
        closed = cost_model.stage_memory(
            c, layout.inflight[k], layout.versions[k], layout.buffers[k], prof.optimizer_state_multiplier, 0
        )
        assert vector == closed


def test_stashed_versions_hold_the_passes_weights():
    """PipeDream's stashed versions and SpecTrain's predicted weights are the
    16-bit copy the passes read; the master and optimizer state stay one copy.
    Stage 0 of PipeDream holds p = 4 versions: 3 extra ones of w bytes."""
    n = 1 << 16
    prof = profile([4 * n] * 4, MIXED_16BIT)
    fp32 = profile([4 * n] * 4, FP32)
    for spec, extra in ((ScheduleSpec("pipedream", 4, 8, iterations=2), 3), (ScheduleSpec("spectrain", 4, 8), 1)):
        schedule = build_schedule(spec)
        mixed = simulate_schedule(schedule, prof, PCIE, starts=[0, 1, 2, 3]).memory[0]
        full = simulate_schedule(schedule, fp32, PCIE, starts=[0, 1, 2, 3]).memory[0]
        resident = 12 * n  # momentum SGD: 2 + 2 + 4 + 4, as 4 + 4 + 4
        assert mixed.peak_bytes == resident + extra * 2 * n
        assert full.peak_bytes == resident + extra * 4 * n
        bd = mixed.peak_breakdown
        assert bd["gradients"] == 2 * n and bd["optimizer"] == 8 * n  # the master copy and the momentum
        assert bd["weights"] + bd.get("prediction", 0) == (1 + extra) * 2 * n


def test_compute_only_split_counts_the_smaller_copies():
    """Weights and gradients at 1 byte beside an 8-byte master: a stage holds
    2.25 bytes per master byte with SGD, not 3, so the faster split fits."""
    prof = Profile(
        "p",
        (LayerCost("a", 2.0, 0.0, 0, 0, 0), LayerCost("b", 1.0, 0.0, 800, 0, 0), LayerCost("c", 1.0, 0.0, 800, 0, 0)),
        precision=Precision(weight_bytes=1, gradient_bytes=1, master_bytes=8),
    )
    assert split_at(prof, [0, 1])[1].memory_bytes(1) == 3600  # (200 + 200 + 1600 + 1600)
    assert [c.first_layer for c in partition(prof, 2, memory_limit_bytes=4000)] == [0, 1]
    assert [c.first_layer for c in partition(prof, 2, memory_limit_bytes=3599)] == [0, 2]


@settings(max_examples=150, deadline=None)
@given(
    pr=precisions,
    params=st.lists(st.integers(0, 6), min_size=2, max_size=6),
    times=st.data(),
    optimizer=st.sampled_from(["sgd", "adam"]),
)
def test_compute_only_split_counts_each_copy(pr, params, times, optimizer):
    """The compute-only partitioner's memory test is StageCost's at every
    precision: the fastest split where every stage fits, if any does."""
    n = len(params)
    prof = Profile(
        "p",
        tuple(
            LayerCost(f"l{i}", times.draw(st.integers(0, 9).map(float)), 1.0, p * pr.master_bytes * 8, 0, 1)
            for i, p in enumerate(params)
        ),
        optimizer=optimizer,
        precision=pr,
    )
    s = times.draw(st.integers(1, n))
    limit = times.draw(st.integers(0, 800))
    mult = prof.optimizer_state_multiplier

    def fit(starts):
        return all(c.memory_bytes(s - k, mult) <= limit for k, c in enumerate(split_at(prof, starts)))

    splits = [(0, *c) for c in itertools.combinations(range(1, n), s - 1)]
    feasible = [sp for sp in splits if fit(sp)]
    got = partition(prof, s, memory_limit_bytes=limit)
    if feasible:
        assert fit(tuple(c.first_layer for c in got))
        best = min(max(c.time_s for c in split_at(prof, sp)) for sp in feasible)
        assert max(c.time_s for c in got) <= best * (1 + 1e-9)


def test_tensor_parallel_shards_every_copy():
    prof = profile([4 * 3000, 4 * 5000], MIXED_16BIT)
    (c,) = device_costs(prof, split_at(prof, [0]), {"tensor_parallel": 4})
    assert (c.param_bytes, c.weight_bytes, c.gradient_bytes, c.master_copy_bytes) == (8000, 4000, 4000, 8000)


# ---------------------------------------------------------------------------
# The planner's closed forms: the same gradient bytes
# ---------------------------------------------------------------------------


@pytest.fixture
def ring_bytes(monkeypatch):
    """Every byte count a ring all-reduce of the planner is priced at."""
    seen: list[float] = []
    real = cost_model.Ring.seconds

    def seconds(self, nbytes):
        seen.append(nbytes)
        return real(self, nbytes)

    monkeypatch.setattr(cost_model.Ring, "seconds", seconds)
    return seen


def tables_valid(params) -> np.ndarray:
    return Tables(profile(params)).valid


def priced_at_gradients(seen: list, costs) -> int:
    """Check that the planner priced each stage's all-reduce at its gradient
    bytes (whole, and split into buckets that add up to it where it
    overlaps the backward in buckets) and nothing larger; the bytes priced in all."""
    assert seen and all(c.gradient_bytes in seen for c in costs)
    assert max(seen) <= max(c.gradient_bytes for c in costs)
    return sum(seen)


@pytest.mark.parametrize("spec", [ScheduleSpec("1f1b", 2, 4, width=2), ScheduleSpec("pipedream-2bw", 2, 4, width=2)])
def test_estimate_reduces_the_engines_gradient_bytes(ring_bytes, spec):
    params = [4000, 8000, 4000, 12000]
    layout = layout_of(build_schedule(spec))
    priced = {}
    for pr in (FP32, GRAD16, MIXED_16BIT):
        prof = profile(params, pr)
        costs = split_at(prof, [0, 2])
        ring_bytes.clear()
        CostSetting.of(prof, PCIE).estimate(costs, layout)
        priced[pr] = priced_at_gradients(ring_bytes, costs)
    assert priced[FP32] == 2 * priced[GRAD16] == 2 * priced[MIXED_16BIT] > 0


def test_grid_planner_reduces_the_engines_gradient_bytes(ring_bytes):
    params = [4000, 8000, 4000, 12000]
    priced = {}
    for strategy in ("pipedream-2bw", "1f1b"):
        for pr in (FP32, MIXED_16BIT):
            prof = profile(params, pr)
            req = GridRequest(
                strategy, lambda b, prof=prof: prof, PCIE, 4, 8, microbatch_sizes=(1,), recompute=(False,), confirm=0
            )
            costs = split_at(prof, [0, 2])
            ring_bytes.clear()
            _Grid(req, math.inf).score(Shape(2, 2, 1, 4, False), costs)
            priced[pr] = priced_at_gradients(ring_bytes, costs)
        assert priced[FP32] == 2 * priced[MIXED_16BIT] > 0


@pytest.mark.parametrize("spec", [ScheduleSpec("1f1b", 2, 4, width=2), ScheduleSpec("pipedream-2bw", 2, 4, width=2)])
def test_search_tables_reduce_the_engines_gradient_bytes(spec):
    """The vectorised stage terms price each layer range's all-reduce at its
    gradient bytes: for every layer range, 16-bit gradients of P bytes of
    weights cost what fp32 gradients of P / 2 bytes do, less than fp32
    gradients of P."""
    params = [4000, 8000, 4000, 12000]
    links = cost_model.LinkModel(PCIE)
    traits = {"passes": 4, "steps": 1, "microbatches": 4, "optimizer": "sgd"}
    hidden = bool(layout_of(build_schedule(spec)).hidden_reduce[0])

    def reduce_part(prof):  # a stage on two devices less the same stage on one: its all-reduce
        tables = Tables(prof)
        two = stage_terms(tables, (0, 1), links, hidden=hidden, **traits)
        one = stage_terms(tables, (0,), links, hidden=hidden, **traits)
        out = np.zeros_like(two)
        out[tables.valid] = two[tables.valid] - one[tables.valid]  # inf below the diagonal
        return out

    halved = reduce_part(profile(params, GRAD16))
    assert np.array_equal(halved, reduce_part(profile(params, MIXED_16BIT)))
    # the same ring bytes; the one-device terms subtracted differ in their optimizer step
    assert halved == pytest.approx(reduce_part(profile([p // 2 for p in params], FP32)), rel=1e-9, abs=0)
    full = reduce_part(profile(params, FP32))
    assert halved.max() > 0 and (full[tables_valid(params)] > halved[tables_valid(params)]).all()


# ---------------------------------------------------------------------------
# The catalog
# ---------------------------------------------------------------------------


def test_catalog_precision_follows_the_device():
    for name in preset_names():
        dev = load_hardware(name).device
        assert catalog_precision(dev) == (MIXED_16BIT if dev.dtype_bytes == 2 else FP32), name


@pytest.mark.parametrize("dtype", [1, 4, 8])
def test_a_non_16bit_device_keeps_one_precision(dtype):
    dev = DeviceSpec("d", flops=1e14, mem_bandwidth=1e12, memory_bytes=2**34, dtype_bytes=dtype)
    prof = model_profile("bert-large", dev, layers=2)
    assert prof.precision == FP32 and "precision" not in prof.to_json()
    for c in split_at(prof, range(prof.num_layers)):
        assert c.weight_bytes == c.gradient_bytes == c.param_bytes and c.master_copy_bytes == 0


def test_an_fp32_device_profile_is_unchanged():
    """pcie-4gpu is fp32: its catalog profile is a profile of one precision,
    and every stage, memory figure and all-reduce is what it was."""
    dev = PCIE.device
    assert dev.dtype_bytes == 4
    prof = model_profile("gpt-1.3b", dev, layers=4)
    assert prof.precision == FP32 and "precision" not in prof.to_json()
    assert Profile.from_json(prof.to_json()) == prof
    spec = ScheduleSpec("1f1b", 2, 4, width=2)
    result = simulate_schedule(build_schedule(spec), prof, PCIE, starts=[0, 3])
    for (_, act, _), nbytes in collectives(result, REDUCE_GRAD).items():
        assert nbytes == result.stage_costs[act.stage].param_bytes
    for c in result.stage_costs:
        assert c.memory_bytes(1, 2) == c.param_bytes * 4 + c.stash_bytes


def test_a_mixed_device_profile_reduces_16bit_gradients():
    hw = load_hardware("dgx1-v100")
    prof = model_profile("gpt-1.3b", hw.device, layers=4)
    assert prof.precision == MIXED_16BIT and prof.to_json()["precision"] == {
        "weight_bytes": 2,
        "gradient_bytes": 2,
        "master_bytes": 4,
    }
    fp32 = replace(prof, precision=FP32)
    for a, b in zip(split_at(prof, [0, 3]), split_at(fp32, [0, 3]), strict=True):
        assert a.gradient_bytes * 2 == b.gradient_bytes == a.param_bytes
        assert a.memory_bytes(3, 2) == b.memory_bytes(3, 2)  # 16 bytes a parameter either way

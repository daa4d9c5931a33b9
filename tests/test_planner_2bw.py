"""The width x depth planner (PipeDream-2BW's; also 1F1B and GPipe) and
AvgPipe's tuner: memory, choice, recomputation, and their command line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipesim.experiments.cli import main
from pipesim.sim.api import simulate, simulate_schedule
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.planning.grid import GridRequest, Shape, _Grid, plan_grid, shape_spec, shapes
from pipesim.sim.planning.plan import PLAN_KEYS, PlanError, plan_file, steady_throughput
from pipesim.sim.planning.tuner import TuneRequest, tune
from pipesim.sim.strategies import ScheduleSpec, build_schedule, get_strategy, strategies
from pipesim.sim.workloads.profile import LayerCost, Profile

MIB = 1 << 20
IDEAL = load_hardware("ideal")
PCIE = load_hardware("pcie-4gpu")


def model(layers: int = 4, f: float = 1e-3, weights: int = 8 * MIB, sent: int = MIB, stash: int = 16 * MIB):
    """Identical layers costed per sample; ``profile_for(b)`` scales time and activations with b."""

    def profile_for(b: int) -> Profile:
        return Profile(
            "toy",
            tuple(LayerCost(f"l{i}", f * b, 2 * f * b, weights, sent * b, stash * b) for i in range(layers)),
            microbatch_size=b,
        )

    return profile_for


def with_memory(hw, limit: float):
    return replace(hw, device=replace(hw.device, memory_bytes=limit))


def test_planners_are_facts_of_the_strategies() -> None:
    assert get_strategy("pipedream-2bw").planner == "width-depth"
    assert get_strategy("avgpipe").planner == "tuner"
    assert {s.name for s in strategies() if "width-depth" in s.planners} == {"gpipe", "1f1b", "pipedream-2bw"}
    assert get_strategy("spectrain").planner is None


@pytest.mark.parametrize("strategy", ["1f1b", "pipedream-2bw"])
def test_closed_form_is_the_papers_on_a_uniform_model(strategy) -> None:
    """Free links, 4 stages of F = 1 ms, B = 2 ms: 2BW takes m periods per
    update, a flushed 1F1B m + d - 1; the engine agrees in steady state."""
    req = GridRequest(strategy, model(), IDEAL, 4, 16, microbatch_sizes=(1,), recompute=(False,), confirm=0)
    grid = _Grid(req, float("inf"))
    shape = Shape(1, 4, 1, 16, False)
    cand = grid.candidate(shape)
    periods = 16 if strategy == "pipedream-2bw" else 16 + 3
    assert cand.analytic_samples_per_s == pytest.approx(16 / (periods * 3e-3))
    confirmed = grid.confirm(cand)
    assert confirmed.simulated_samples_per_s == pytest.approx(cand.analytic_samples_per_s, rel=1e-6)
    rc = grid.candidate(replace(shape, recompute=True))  # every backward re-runs the forward: 4 ms a pass
    assert rc.analytic_samples_per_s == pytest.approx(16 / (periods * 4e-3))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    strategy=st.sampled_from(["gpipe", "1f1b", "pipedream-2bw"]),
    limit_mib=st.integers(60, 400),
    batch=st.sampled_from([8, 16]),
)
def test_choice_fits_and_is_the_fastest_confirmed(strategy, limit_mib, batch) -> None:
    rec = plan_grid(
        GridRequest(
            strategy,
            model(),
            with_memory(PCIE, limit_mib * MIB),
            4,
            batch,
            microbatch_sizes=(1, 2, 4),
            confirm=3,
            iterations=3,
        )
    ).to_json()
    cands, best = rec["candidates"], rec["candidates"][rec["chosen"]]
    fitting = [c for c in cands if not c["out_of_memory"]]
    if not fitting:
        assert best["out_of_memory"]
        return
    assert not best["out_of_memory"] and best["peak_memory_bytes"] <= limit_mib * MIB
    confirmed = [c for c in fitting if c["simulated_samples_per_s"] is not None]
    assert best["simulated_samples_per_s"] == max(c["simulated_samples_per_s"] for c in confirmed)
    p = best["params"]
    assert p["width"] * p["depth"] == 4 and p["width"] * p["microbatch_size"] * p["microbatches"] == batch
    assert set(rec) <= PLAN_KEYS and plan_file(rec).width == p["width"]  # simulate --plan reads it back
    assert (rec["width"], rec["microbatch_size"], rec["recompute"]) == (
        p["width"],
        p["microbatch_size"],
        p["recompute"],
    )


def test_confirmations_go_to_every_shape_before_a_shapes_near_ties() -> None:
    """Micro-batch sizes of one (width, depth, recompute) shape score alike;
    the engine confirms the best of each shape first, so a shape the closed
    form ranks just behind another's near-ties is still simulated."""
    rec = plan_grid(
        GridRequest(
            "pipedream-2bw",
            model(),
            PCIE,
            4,
            16,
            microbatch_sizes=(1, 2, 4),
            recompute=(False,),
            confirm=3,
            iterations=3,
        )
    ).to_json()
    fitting = [c for c in rec["candidates"] if not c["out_of_memory"]]
    shapes = {(c["params"]["width"], c["params"]["depth"]) for c in fitting}
    confirmed = [c for c in fitting if c["simulated_samples_per_s"] is not None]
    assert len(shapes) >= 3 and len(confirmed) == 3
    assert len({(c["params"]["width"], c["params"]["depth"]) for c in confirmed}) == 3


def _largest_fitting_b(strategy: str, recompute: bool, limit: float) -> int:
    rec = plan_grid(
        GridRequest(
            strategy,
            model(layers=8),
            with_memory(PCIE, limit),
            4,
            64,
            microbatch_sizes=(1, 2, 4, 8, 16),
            recompute=(recompute,),
            confirm=2,
        )
    ).to_json()
    fits = [c["params"]["microbatch_size"] for c in rec["candidates"] if not c["out_of_memory"]]
    return max(fits, default=0)


def test_recomputation_lets_a_larger_microbatch_fit() -> None:
    limit = 300 * MIB  # weights about 100 MiB per stage; whole stashes of 16 MiB x b per layer do not fit
    plain, rc = _largest_fitting_b("pipedream-2bw", False, limit), _largest_fitting_b("pipedream-2bw", True, limit)
    assert 0 < plain < rc


def _largest_m(strategy: str, limit: float, options: dict) -> int:
    req = GridRequest(
        strategy,
        model(),
        with_memory(PCIE, limit),
        4,
        64,
        microbatch_sizes=(1,),
        recompute=(False,),
        confirm=0,
        options=options,
    )
    grid = _Grid(req, limit)
    return max((m for m in range(1, 65) if not grid.candidate(Shape(1, 4, 1, m, False)).out_of_memory), default=0)


def test_gpipe_fits_fewer_microbatches_than_1f1b() -> None:
    """GPipe stashes all m micro-batches of a flush, 1F1B at most d - k:
    with a fixed micro-batch and one flush per update, the largest batch
    that fits is smaller for GPipe."""
    limit = 250 * MIB
    gpipe, one_f_one_b = _largest_m("gpipe", limit, {"flushes": 1}), _largest_m("1f1b", limit, {})
    assert 0 < gpipe < one_f_one_b
    # and the engine holds GPipe's m stashes: one more micro-batch, one more stash per stage
    peaks = [
        max(
            t.peak_bytes
            for t in simulate(ScheduleSpec("gpipe", 4, m), profile=model()(1), hardware=IDEAL, recv_lookahead=1).memory
        )
        for m in (4, 5)
    ]
    assert peaks[1] - peaks[0] == 16 * MIB  # a stage (one layer here) holds one more stash


def test_the_grid_splits_a_gpipe_batch_that_does_not_fit_into_the_fewest_flushes() -> None:
    """Left to choose, the planner runs a GPipe batch too big for one flush
    as the fewest flushes that fit (gradient accumulation), each flush
    holding what one flush of the largest fitting m held; the closed form
    charges each flush its fill and drain, and the engine's run of the
    chosen schedule holds the same stashes."""
    limit = 250 * MIB
    one = _largest_m("gpipe", limit, {"flushes": 1})
    req = GridRequest(
        "gpipe", model(), with_memory(PCIE, limit), 4, 64, microbatch_sizes=(1,), recompute=(False,), confirm=0
    )
    grid = _Grid(req, limit)
    m = 4 * one + 1  # needs five flushes: four hold one + 1 each would not fit
    cand = grid.candidate(Shape(1, 4, 1, m, False))
    assert not cand.out_of_memory
    assert cand.params["flushes"] == 5
    fitted = grid.candidate(Shape(1, 4, 1, one, False))
    assert "flushes" not in fitted.params
    # the same micro-batch period: (one + 3) periods an update with one fill
    # and drain, m + 5 x 3 with five (the rate is of the request's batch)
    period = req.batch_size / fitted.analytic_samples_per_s / (one + 3)
    assert req.batch_size / cand.analytic_samples_per_s == pytest.approx(period * (m + 5 * 3), rel=0.02)
    spec = shape_spec("gpipe", cand.params, 1, {})
    assert spec.flushes == 5
    hw = with_memory(PCIE, limit)
    run = simulate(spec, profile=model()(1), hardware=hw, recv_lookahead=1)
    largest_flush = simulate(ScheduleSpec("gpipe", 4, -(-m // 5)), profile=model()(1), hardware=hw, recv_lookahead=1)
    assert [t.peak_bytes for t in run.memory] == [t.peak_bytes for t in largest_flush.memory]
    assert not any(t.out_of_memory for t in run.memory)


def test_tuner_picks_the_best_of_a_brute_force_grid() -> None:
    hw = with_memory(PCIE, 150 * MIB)  # the fastest, 3 pipelines of 8, needs about 161 MiB
    profile_for = model()
    rec = tune(TuneRequest("avgpipe", profile_for, hw, 4, 8, pipelines=(1, 2, 3), microbatches=(2, 4, 8))).to_json()
    brute = {}
    for n in (1, 2, 3):
        for m in (2, 4, 8):
            r = simulate(ScheduleSpec("avgpipe", 4, m, iterations=3, width=n), profile=profile_for(8 // m), hardware=hw)
            brute[(n, m)] = (not any(t.out_of_memory for t in r.memory), steady_throughput(r))
    assert any(not fits for fits, _ in brute.values()) and any(fits for fits, _ in brute.values())
    best = max(brute, key=lambda k: brute[k])
    p = rec["candidates"][rec["chosen"]]["params"]
    assert (p["pipelines"], p["microbatches"]) == best
    assert rec["predicted_samples_per_s"] == pytest.approx(brute[best][1])
    assert len(rec["candidates"]) == 9
    assert set(rec) <= PLAN_KEYS and plan_file(rec).width == p["pipelines"]  # simulate --plan reads it back


def test_plan_runs_with_simulate_plan(tmp_path, capsys) -> None:
    out = tmp_path / "plan"
    assert (
        main(
            [
                "plan",
                "--strategy",
                "pipedream-2bw",
                "--model",
                "bert-large",
                "--hardware",
                "dgx1-v100",
                "--batch-size",
                "32",
                "--recompute",
                "--confirm",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    rec = json.loads((out / "plan.json").read_text())
    assert (out / "pareto.html").exists() and "chosen: " in text and rec["recompute"] is True
    pf = plan_file(rec)
    spec = pf.spec()
    assert spec.width == rec["width"] and spec.replicas is None and spec.stages == len(rec["stages"])
    assert (
        main(["simulate", "--plan", str(out / "plan.json"), "--summary-only", "--json", "--out", str(tmp_path / "sim")])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["meta"]["recompute"] is True and summary["microbatch_size"] == rec["microbatch_size"]
    assert summary["plan"]["steady_samples_per_s"] == pytest.approx(rec["predicted_samples_per_s"], rel=1e-9)


def test_a_gpipe_plan_in_flushes_runs_with_simulate_plan(tmp_path, capsys) -> None:
    """GPT-1.3B's batch of 64 does not fit GPipe's one flush on 8 V100s at
    b = 1 without recomputation: the plan runs it in flushes, records them
    in its options, and ``simulate --plan`` runs that schedule; --flushes
    fixes them for every candidate."""
    base = ["plan", "--strategy", "gpipe", "--planner", "width-depth", "--model", "gpt-1.3b"]
    base += ["--hardware", "dgx1-v100", "--batch-size", "64", "--microbatch-size", "1", "--confirm", "1"]
    out = tmp_path / "plan"
    assert main([*base, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rec = json.loads((out / "plan.json").read_text())
    chosen = rec["candidates"][rec["chosen"]]["params"]
    assert chosen["flushes"] > 1 and rec["options"] == {"flushes": chosen["flushes"]}
    assert f"chosen: {rec['config']} in {chosen['flushes']} flushes, " in printed
    assert plan_file(rec).spec().flushes == chosen["flushes"]
    assert (
        main(["simulate", "--plan", str(out / "plan.json"), "--summary-only", "--json", "--out", str(tmp_path / "s")])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["plan"]["steady_samples_per_s"] == pytest.approx(rec["predicted_samples_per_s"], rel=1e-9)
    fixed = tmp_path / "fixed"
    assert main([*base, "--flushes", "4", "--confirm", "0", "--out", str(fixed)]) == 0
    rec = json.loads((fixed / "plan.json").read_text())
    assert {c["params"].get("flushes") for c in rec["candidates"]} == {4} and rec["options"]["flushes"] == 4


def test_same_inputs_same_plan() -> None:
    req = GridRequest("1f1b", model(), PCIE, 4, 8, microbatch_sizes=(1, 2), confirm=2)
    a, b = plan_grid(req).to_json(), plan_grid(req).to_json()
    a.pop("planner_seconds"), b.pop("planner_seconds")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--strategy", "pipedream", "--batch-size", "8"], "--batch-size is for the width-depth"),
        (["--strategy", "pipedream", "--planner", "tuner"], "pipedream is planned by replicas, not tuner"),
        (["--strategy", "pipedream-2bw", "--batch-size", "3"], "no width x depth configuration"),
        (["--strategy", "pipedream-2bw", "--microbatches", "4"], "--microbatches is not an option"),
        (["--strategy", "avgpipe", "--confirm", "2"], "leave out --confirm"),
        (["--strategy", "pipedream-2bw", "--batch-size", "0"], "must be >= 1"),
    ],
)
def test_bad_input_is_one_line(argv, message, tmp_path, capsys) -> None:
    code = main(["plan", "--model", "uniform", "--hardware", "pcie-4gpu", *argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_library_errors() -> None:
    with pytest.raises(PlanError, match="not planned by width x depth"):
        plan_grid(GridRequest("pipedream", model(), PCIE, 4, 8))
    with pytest.raises(PlanError, match="option 'width' is not a plan option of avgpipe .the tuner chooses"):
        tune(TuneRequest("avgpipe", model(), PCIE, 4, 8, options={"width": 2}))
    # an option the strategy lacks is named with those it takes, by every planner alike
    with pytest.raises(PlanError, match="gpipe has no option 'alpha' to plan with .it takes: flushes."):
        plan_grid(GridRequest("gpipe", model(), PCIE, 4, 8, options={"alpha": 0.5}))
    with pytest.raises(PlanError, match="avgpipe has no option 'stashing' to plan with .it takes: .*placement"):
        tune(TuneRequest("avgpipe", model(), PCIE, 4, 8, options={"stashing": False}))


def test_the_tuner_plans_avgpipes_disjoint_placement(tmp_path, capsys) -> None:
    """``plan --placement disjoint`` gives each of the N pipelines its own
    GPUs (depth GPUs / N), and the plan keeps the option for simulate --plan;
    a strategy without the option refuses it in one line."""
    out = tmp_path / "plan"
    assert (
        main(
            [
                "plan",
                "--strategy",
                "avgpipe",
                "--model",
                "bert-large",
                "--hardware",
                "pcie-4gpu",
                "--batch-size",
                "8",
                "--placement",
                "disjoint",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    rec = json.loads((out / "plan.json").read_text())
    assert rec["options"]["placement"] == "disjoint" and len(rec["stages"]) * rec["width"] == 4
    assert (f"in each of {rec['width']} pipelines" if rec["width"] > 1 else "in its one pipeline") in text
    assert (
        main(["simulate", "--plan", str(out / "plan.json"), "--summary-only", "--json", "--out", str(tmp_path / "sim")])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["devices_count"] == 4
    assert summary["plan"]["steady_samples_per_s"] == pytest.approx(rec["predicted_samples_per_s"], rel=1e-9)
    assert main(["plan", "--strategy", "pipedream", "--placement", "disjoint", "--out", str(tmp_path / "x")]) == 2
    assert "pipedream has no option 'placement' to plan with" in capsys.readouterr().err


TWO_SERVERS = load_hardware("p3.16xlarge-x8")


def test_stage_grouping_is_offered_only_across_servers() -> None:
    one = GridRequest("pipedream-2bw", model(8), load_hardware("p3.16xlarge"), 8, 64, microbatch_sizes=(1,))
    two = GridRequest("pipedream-2bw", model(8), TWO_SERVERS, 16, 64, microbatch_sizes=(1,))
    assert {s.grouping for s in shapes(one, 8)} == {"pipelines"}
    found = {(s.width, s.depth, s.grouping) for s in shapes(two, 8)}
    assert (8, 2, "stages") in found and (8, 2, "pipelines") in found
    assert (1, 16, "stages") not in found and (16, 1, "stages") not in found  # nothing to regroup


def test_stage_grouping_places_a_stages_replicas_on_one_server() -> None:
    """8 x 2 on two servers: grouped by stage, stage k's 8 replicas fill
    server k, so its all-reduce runs over NVLink and all 8 activations of a
    boundary queue on the one NIC; side by side, the reverse."""
    req = GridRequest("pipedream-2bw", model(8), TWO_SERVERS, 16, 64, microbatch_sizes=(1,), confirm=0)
    grid = _Grid(req, float("inf"))
    by_stage, side_by_side = Shape(8, 2, 1, 8, False, "stages"), Shape(8, 2, 1, 8, False)
    assert [by_stage.device(r, 1) for r in range(8)] == list(range(8, 16))
    assert [side_by_side.device(r, 1) for r in range(8)] == list(range(1, 16, 2))
    nbytes = 4 * MIB
    one = TWO_SERVERS.transfer_time(0, 8, nbytes)
    assert grid.shared_transfer(by_stage, 0, 1, nbytes) == pytest.approx(8 * one)
    assert grid.shared_transfer(side_by_side, 0, 1, nbytes) == pytest.approx(TWO_SERVERS.transfer_time(0, 1, nbytes))


@pytest.mark.parametrize(
    ("weights", "sent", "grouping"),
    [(256 * MIB, 64 * 1024, "stages"), (64 * 1024, 64 * MIB, "pipelines")],
)
def test_the_grouping_keeps_the_heavier_traffic_inside_a_server(weights, sent, grouping) -> None:
    """8 x 2 on two servers. Heavy gradients and light activations: each
    stage's all-reduce inside a server wins; light gradients and heavy
    activations: each pipeline inside one wins."""
    req = GridRequest("1f1b", model(8, weights=weights, sent=sent), TWO_SERVERS, 16, 128, microbatch_sizes=(1,))
    grid = _Grid(req, float("inf"))
    rate = {g: grid.candidate(Shape(8, 2, 1, 16, False, g)).analytic_samples_per_s for g in ("stages", "pipelines")}
    assert max(rate, key=rate.get) == grouping


def test_a_plan_grouped_by_stage_runs_as_planned_from_its_file() -> None:
    req = GridRequest(
        "1f1b", model(8, weights=256 * MIB, sent=64 * 1024), TWO_SERVERS, 16, 128, microbatch_sizes=(1,), confirm=4
    )
    plan = plan_grid(req)
    best = plan.candidates[plan.chosen]
    assert best.params["grouping"] == "stages" and best.config.endswith("by stage")
    doc = json.loads(json.dumps(plan.to_json()))
    spec = plan_file(doc).spec()
    w, d = best.params["width"], best.params["depth"]
    assert "width" not in doc and spec.replicas == (w,) * d
    assert spec.microbatches == best.params["microbatches"] * w
    result = simulate_schedule(build_schedule(spec), req.profile_for(1), TWO_SERVERS, starts=list(best.starts))
    assert steady_throughput(result) == pytest.approx(best.simulated_samples_per_s, rel=1e-9)

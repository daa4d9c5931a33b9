"""The PipeDream and SpecTrain reproductions: rows in results.json's shape,
predictions that never read a published value, and the same bytes twice.
PipeDream runs on a cheap subset (one model, one cluster) to stay fast."""

from __future__ import annotations

import json

import pytest
from test_reproduce_runner import check_results_shape

from pipesim.experiments.reproduce import pipedream, runner, spectrain
from pipesim.experiments.reproduce.base import with_published
from pipesim.sim.api import resolve_hardware


@pytest.fixture
def small_pipedream(monkeypatch):
    monkeypatch.setattr(pipedream, "MODELS", (("pipedream-alexnet", 256),))
    monkeypatch.setattr(pipedream, "CLUSTERS", (("pipedream-cluster-b-x2", "Cluster-B 2x8"),))


def _nonsense(table: dict) -> dict:
    return {k: -123.0 for k in table}


def test_pipedream_predictions_do_not_read_published_values(small_pipedream, monkeypatch) -> None:
    seen = []
    rows, claims = pipedream.predict(lambda d, t, w: seen.append(d))
    assert seen[-1] == 1 and all(r.published is None for r in rows)
    monkeypatch.setattr(pipedream, "PUBLISHED", _nonsense(pipedream.PUBLISHED))
    monkeypatch.setattr(pipedream, "PUBLISHED_CLAIMS", _nonsense(pipedream.PUBLISHED_CLAIMS))
    monkeypatch.setattr(pipedream, "PUBLISHED_CONFIGS", {k: ("1-2-3", 6) for k in pipedream.PUBLISHED_CONFIGS})
    assert pipedream.predict() == (rows, claims)
    (row,) = rows
    assert row.technique == "pipedream" and row.metric == "speedup_vs_dp" and row.figure == "table1"
    assert row.gpus == 16 and row.global_batch == 256 * 16 and sum(row.config["replicas"]) == 16
    assert row.predicted > 1.0
    # the real table fills it in, keyed by model and cluster
    filled, _ = with_published(
        rows, claims, pipedream.PAPER.published_rows, pipedream.PAPER.published_claims, key=pipedream.PAPER.key
    )
    assert filled[0].published == 2.04


def test_pipedream_notes_price_the_configuration_the_paper_ran(small_pipedream, monkeypatch) -> None:
    rows, claims = pipedream.predict()
    (row,) = rows  # AlexNet on Cluster-B, where the paper ran 15-1
    theirs = pipedream.held_to_paper(row)
    assert theirs > 1.0
    assert f"| 15-1 | {theirs:.2f}x |" in pipedream.notes(rows, claims)
    # pure data parallelism held ("16") is the baseline itself
    monkeypatch.setitem(pipedream.PUBLISHED_CONFIGS, "pipedream-alexnet", ("16", 16))
    assert pipedream.held_to_paper(row) == pytest.approx(1.0, rel=1e-6)
    # a configuration that leaves GPUs idle is priced against data parallelism on all of them
    monkeypatch.setitem(pipedream.PUBLISHED_CONFIGS, "pipedream-alexnet", ("15", 15))
    fewer = pipedream.held_to_paper(row)
    assert 0.5 < fewer < 0.999
    assert f"| 15 on 15 of 16 GPUs | {fewer:.2f}x |" in pipedream.notes(rows, claims)
    monkeypatch.delitem(pipedream.PUBLISHED_CONFIGS, "pipedream-alexnet")
    assert pipedream.held_to_paper(row) is None and "| — | — |" in pipedream.notes(rows, claims)


def test_pipedream_results_json_shape_and_determinism(small_pipedream, tmp_path) -> None:
    paper = pipedream.PAPER
    texts = []
    for _ in range(2):
        rows, claims = pipedream.predict()
        rows, claims = with_published(rows, claims, paper.published_rows, paper.published_claims, key=paper.key)
        texts.append(runner.results_json(rows, claims))
    assert texts[0] == texts[1]
    check_results_shape(json.loads(texts[0]))


def test_spectrain_predicts_without_published_values_and_writes_its_files(tmp_path, monkeypatch) -> None:
    rows, claims = spectrain.predict()
    speed = [r for r in rows if r.metric == "speedup_vs_dp"]
    assert {r.technique for r in speed} == {"spectrain", "pipedream"}
    assert {r.model for r in speed} == set(spectrain.MODELS)
    assert {c.id for c in claims} == set(spectrain.PUBLISHED_CLAIMS)
    assert all(r.published is None and r.predicted > 0 for r in speed)
    assert all(r.published is None for r in rows)
    monkeypatch.setattr(spectrain, "PUBLISHED_CLAIMS", _nonsense(spectrain.PUBLISHED_CLAIMS))
    monkeypatch.setattr(spectrain, "PUBLISHED_ROWS", _nonsense(spectrain.PUBLISHED_ROWS))
    monkeypatch.setattr(
        spectrain,
        "PUBLISHED_ACCURACY",
        {k: {**v, "accuracy": _nonsense(v["accuracy"])} for k, v in spectrain.PUBLISHED_ACCURACY.items()},
    )
    assert spectrain.predict() == (rows, claims)
    monkeypatch.undo()
    out = runner.run_paper(spectrain.PAPER, tmp_path)
    doc = json.loads((tmp_path / "spectrain" / "results.json").read_text())
    check_results_shape(doc)
    assert {c["published"] for c in doc["claims"]} == {8.91, 2.18}
    first = (tmp_path / "spectrain" / "results.json").read_bytes()
    runner.run_paper(spectrain.PAPER, tmp_path)
    assert (tmp_path / "spectrain" / "results.json").read_bytes() == first
    assert (tmp_path / "spectrain" / "speedup.html").exists() and "Runtime" in out.report
    assert (tmp_path / "spectrain" / "accuracy.html").exists()


def test_spectrain_fc_profile_follows_its_dimensions() -> None:
    device = resolve_hardware(spectrain.HARDWARE).device
    p = spectrain.fc_profile(device, batch=2, inputs=3, hidden=5, layers=2, outputs=7)
    assert [layer.param_bytes for layer in p.layers] == [(3 * 5 + 5) * 4, (5 * 5 + 5) * 4, (5 * 7 + 7) * 4]
    assert [layer.activation_bytes for layer in p.layers] == [2 * 5 * 4, 2 * 5 * 4, 2 * 7 * 4]
    assert all(layer.backward_s == 2 * layer.forward_s > 0 for layer in p.layers)
    assert p.microbatch_size == 2


def test_spectrain_accuracy_rows_are_pipesim_converge_gaps_beside_the_papers() -> None:
    """Each accuracy row is a committed converge result's gap to data
    parallelism (points, at the file's reference lr, 4 stages), labelled as
    measured with the command that regenerates it; the published gaps are
    the papers' tables; a gap has no ratio error, only a difference."""
    rows = spectrain.accuracy_rows()
    assert {(r.figure, r.model) for r in rows} == {
        ("accuracy", "lstm"),
        ("accuracy", "mlp"),
        ("2bw-mnli", "gpt-small"),
        ("2bw-mnli", "lstm"),
        ("2bw-mnli", "mlp"),
    }
    assert all(r.metric == "accuracy_gap_pts" and r.gpus == 4 and r.global_batch == 32 for r in rows)
    # recomputed here straight from the file: lstm, 4 stages, reference lr 0.3
    doc = json.loads(spectrain.files("pipesim.experiments").joinpath("results", "converge-lstm.json").read_text())
    ref = doc["summary"]["4"]["reference_lr"]
    acc = {s: v[f"{ref:g}"]["mean"] for s, v in doc["summary"]["4"]["accuracy"].items()}
    got = {r.technique: r.predicted for r in rows if r.figure == "accuracy" and r.model == "lstm"}
    assert got == pytest.approx(
        {s: 100 * (acc[s] - acc["data-parallel"]) for s in ("pipedream-nostash", "pipedream", "spectrain")}
    )
    # the README's table: SpecTrain 48.7 against 57.6; the papers' order holds on the lstm
    assert got["spectrain"] == pytest.approx(48.7 - 57.6, abs=0.1)
    assert got["spectrain"] > got["pipedream"] > got["pipedream-nostash"]
    for r in rows:
        assert "measured by pipesim converge" in r.note and "`pipesim converge --model" in r.note
    filled, _ = with_published(rows, [], spectrain.PUBLISHED_ROWS, {})
    pub = {(r.figure, r.model, r.technique): r.published for r in filled}
    assert pub[("accuracy", "lstm", "spectrain")] == pytest.approx(81.24 - 81.74)
    assert pub[("accuracy", "mlp", "pipedream-nostash")] == pytest.approx(88.31 - 91.10)
    assert pub[("2bw-mnli", "gpt-small", "pipedream-2bw")] == pytest.approx(0.05)
    for r in filled:
        assert r.ratio_error is None and r.difference == pytest.approx(r.predicted - r.published)
        assert r.to_json()["ratio_error"] is None


@pytest.mark.parametrize("results", sorted({f for _, f, *_ in spectrain.ACCURACY_RESULTS}))
def test_the_regenerating_command_is_the_runs_of_the_file(results) -> None:
    """The command a row names parses and plans exactly the runs the
    committed file holds (checked before anything trains)."""
    from pipesim.experiments.cli import build_parser
    from pipesim.experiments.converge import ConvergeConfig, runs_of

    doc = spectrain.load_results(results)
    args = build_parser().parse_args(spectrain.converge_command(doc).split()[1:])
    cfg = ConvergeConfig(
        model=args.model,
        stages=tuple(args.stages),
        strategies=tuple(args.strategies),
        lrs=tuple(args.lr),
        seeds=tuple(args.seeds),
        updates=args.updates,
        update_batch=args.update_batch,
        eval_every=args.eval_every,
        momentum=args.momentum,
        model_width=args.model_width,
        model_depth=args.model_depth,
    )
    planned = {(r.strategy, r.stages, r.lr, r.seed) for r in runs_of(cfg)}
    assert planned == {(r["strategy"], r["stages"], r["lr"], r["seed"]) for r in doc["runs"]}

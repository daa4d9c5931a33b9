"""The PipeDream and SpecTrain reproductions: rows in results.json's shape,
predictions that never read a published value, and the same bytes twice.
PipeDream runs on a cheap subset (one model, one cluster) to stay fast."""

from __future__ import annotations

import json

import pytest
from pipesim.experiments.reproduce import pipedream, runner, spectrain
from pipesim.experiments.reproduce.base import with_published
from pipesim.sim.api import resolve_hardware

from test_reproduce_runner import check_results_shape


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
    monkeypatch.setattr(pipedream, "PUBLISHED_CONFIGS", {k: "1-2-3" for k in pipedream.PUBLISHED_CONFIGS})
    assert pipedream.predict() == (rows, claims)
    (row,) = rows
    assert row.technique == "pipedream" and row.metric == "speedup_vs_dp" and row.figure == "table1"
    assert row.gpus == 16 and row.global_batch == 256 * 16 and sum(row.config["replicas"]) == 16
    assert row.predicted > 1.0
    # the real table fills it in, keyed by model and cluster
    filled, _ = with_published(rows, claims, pipedream.PAPER.published_rows, pipedream.PAPER.published_claims,
                               key=pipedream.PAPER.key)
    assert filled[0].published == 2.04


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
    assert {r.technique for r in rows} == {"spectrain", "pipedream"}
    assert {r.model for r in rows} == set(spectrain.MODELS)
    assert {c.id for c in claims} == set(spectrain.PUBLISHED_CLAIMS)
    assert all(r.published is None and r.predicted > 0 for r in rows)
    monkeypatch.setattr(spectrain, "PUBLISHED_CLAIMS", _nonsense(spectrain.PUBLISHED_CLAIMS))
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


def test_spectrain_fc_profile_follows_its_dimensions() -> None:
    device = resolve_hardware(spectrain.HARDWARE).device
    p = spectrain.fc_profile(device, batch=2, inputs=3, hidden=5, layers=2, outputs=7)
    assert [layer.param_bytes for layer in p.layers] == [(3 * 5 + 5) * 4, (5 * 5 + 5) * 4, (5 * 7 + 7) * 4]
    assert [layer.activation_bytes for layer in p.layers] == [2 * 5 * 4, 2 * 5 * 4, 2 * 7 * 4]
    assert all(layer.backward_s == 2 * layer.forward_s > 0 for layer in p.layers)
    assert p.microbatch_size == 2

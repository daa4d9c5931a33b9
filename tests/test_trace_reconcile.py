"""``pipesim trace reconcile`` and ``pipesim trace whatif`` on real
torch.distributed.pipelining runs (tests/data/torch-pipelining-traces): the
run simulated on its own measured costs, and other schedules priced with
them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipesim.experiments.cli import main
from pipesim.experiments.tracereconcile import reconcile_dir, whatif_dir

DATA = Path(__file__).parent / "data" / "torch-pipelining-traces"
#: set -> import arguments, and the bound its reconciliation is held to
SETS = {
    "gpipe": ([], 0.10),
    "1f1b": (["--schedule", "1f1b", "--microbatches", "4"], 0.10),
    "zero-bubble": ([], 0.10),
    "interleaved-1f1b": ([], 0.10),
}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("imported")
    for name, (extra, _) in SETS.items():
        assert main(["trace", "import", str(DATA / name), "--out", str(root / name), *extra]) == 0
    return root


@pytest.mark.parametrize("name", list(SETS))
def test_a_run_simulated_on_its_own_costs_takes_its_own_time(imported, name) -> None:
    report = reconcile_dir(imported / name)
    assert abs(report["iteration_time_error"]) <= SETS[name][1], report["iteration_time_error"]
    assert (imported / name / "overlay.html").exists() and (imported / name / "costs.json").exists()
    written = json.loads((imported / name / "report.json").read_text())
    assert written["iteration_time_error"] == report["iteration_time_error"]
    assert 0 < written["bubble_fraction_predicted"] < 1


def test_whatif_prices_other_schedules_on_the_measured_costs(imported, tmp_path, capsys) -> None:
    out = tmp_path / "w"
    code = main(
        [
            "trace",
            "whatif",
            str(imported / "gpipe"),
            "--strategies",
            "gpipe,1f1b",
            "zb-h1",
            "--microbatches",
            "4,8",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    doc = json.loads((out / "whatif.json").read_text())
    rows = {(r["strategy"], r["microbatches"]): r for r in doc["what_if"]}
    assert set(rows) == {(s, m) for s in ("gpipe", "1f1b", "zb-h1") for m in (4, 8)}
    # GPipe stashes every micro-batch, 1F1B at most the pipeline's depth (2 stages)
    assert rows[("gpipe", 8)]["peak_stash"] == 8 and rows[("1f1b", 8)]["peak_stash"] == 2
    # more micro-batches, a smaller bubble
    assert rows[("1f1b", 8)]["bubble_fraction"] < rows[("1f1b", 4)]["bubble_fraction"]
    # the measured run itself: GPipe at 4 micro-batches on its own costs is within the reconciliation's error
    measured = doc["measured"]
    assert measured["microbatches"] == 4 and measured["samples_per_s"] > 0
    assert rows[("gpipe", 4)]["samples_per_s"] == pytest.approx(measured["samples_per_s"], rel=0.15)
    assert (out / "whatif.html").exists() and "zb-h1" in capsys.readouterr().out


def test_whatif_of_more_stages_splits_the_measured_ones(imported) -> None:
    rows, _ = whatif_dir(imported / "gpipe", ["1f1b"], [8], devices=4, out=imported / "gpipe-4")
    assert rows[0].stages == 4 and "split into 2 equal parts" in rows[0].note


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["trace", "reconcile", "nowhere"], "no imported.json"),
        (["trace", "whatif", "nowhere"], "no imported.json"),
    ],
)
def test_bad_input_is_one_line(argv, says, tmp_path, capsys) -> None:
    argv = [a if a != "nowhere" else str(tmp_path / "nowhere") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_whatif_names_an_unknown_strategy(imported, capsys) -> None:
    assert main(["trace", "whatif", str(imported / "gpipe"), "--strategies", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "nosuch" in err and len(err.strip().splitlines()) == 1, err


def test_a_public_trace_without_a_pipeline_imports(tmp_path, capsys) -> None:
    """facebookresearch/param's 8-rank DLRM trace (CUDA, data parallel):
    per-rank compute and communication, and a warning, not a failure."""
    import tarfile

    from pipesim.validate.traceimport import import_run

    with tarfile.open(Path(__file__).parent / "data" / "param-dlrm-kineto" / "dlrm_kineto.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    paths = sorted((tmp_path / "dlrm_kineto").glob("*.json"))
    run = import_run(paths)
    assert len(paths) == 8 and not run.found_pipeline and run.result is None and run.device == "cuda"
    assert sorted(r.rank for r in run.per_rank) == list(range(8))
    assert all(r.compute_s > 0 and r.communication_s > 0 and r.span_s >= r.compute_s for r in run.per_rank)
    assert any("no pipeline actions" in w for w in run.warnings)
    assert main(["trace", "import", str(tmp_path / "dlrm_kineto"), "--out", str(tmp_path / "o")]) == 0
    assert "no pipeline actions found" in capsys.readouterr().out

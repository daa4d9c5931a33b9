"""``pipesim reproduce``: the runner on a tiny fake paper (results.json's shape
and bytes, report.md, figures, ``all`` over the modules a build has), and the
sub-command's one-line errors."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from pipesim.experiments.cli import main
from pipesim.experiments.reproduce import runner
from pipesim.experiments.reproduce.base import Claim, Paper, Row

ROW_KEYS = {
    "paper",
    "figure",
    "model",
    "hardware",
    "gpus",
    "global_batch",
    "technique",
    "metric",
    "predicted",
    "published",
    "config",
}
CLAIM_KEYS = {"id", "text", "predicted", "published"}
TECHNIQUES = {
    "inter-layer",
    "tensor",
    "gpipe",
    "pipedream-flush",
    "pipedream-2bw",
    "pipedream",
    "data-parallel",
    "spectrain",
    "pipedream-nostash",
}
METRICS = {"throughput_seq_s", "memory_gb", "max_params_b", "speedup_vs_dp", "accuracy_gap_pts"}
CONFIG_KEYS = {"w", "d", "b", "recompute", "replicas"}


def check_results_shape(doc: dict) -> None:
    """results.json as the issue specifies it."""
    assert set(doc) == {"rows", "claims"}
    for r in doc["rows"]:
        assert ROW_KEYS <= set(r), r
        assert r["technique"] in TECHNIQUES and r["metric"] in METRICS
        assert r["predicted"] is None or isinstance(r["predicted"], float | int)
        assert r["published"] is None or isinstance(r["published"], float | int)
        assert r["config"] is None or set(r["config"]) == CONFIG_KEYS
    for c in doc["claims"]:
        assert CLAIM_KEYS <= set(c), c


def fake_predict(progress):
    progress(0, 2, "first")
    rows = [
        Row(
            "fake",
            "1",
            "m",
            "ideal",
            2,
            8,
            "pipedream",
            "speedup_vs_dp",
            1.0 / 3.0,
            config={"w": 1, "d": 2, "b": 4, "recompute": False, "replicas": [1, 1]},
            note="a gap's cause",
        ),
        Row("fake", "1", "m", "ideal", 2, 8, "data-parallel", "speedup_vs_dp", 1.0, config=None),
    ]
    progress(1, 2, "second")
    return rows, [Claim("c", "fake is 2x faster", 2.0)]


def fake_figures(rows, claims, out: Path) -> list[Path]:
    path = out / "fig.html"
    path.write_text("<html></html>")
    return [path]


FAKE = Paper(
    name="fake",
    title="A fake paper",
    predict=fake_predict,
    published_rows={("1", "m", 8, "pipedream", "speedup_vs_dp"): 1.0},
    published_claims={"c": 2.1},
    figures=fake_figures,
    steps=2,
    notes=lambda rows, claims: "Some notes.",
)


def test_the_runner_writes_results_report_and_figures(tmp_path) -> None:
    seen = []
    out = runner.run_paper(FAKE, tmp_path, progress=lambda d, t, w: seen.append((d, t, w)))
    folder = tmp_path / "fake"
    assert {p.name for p in out.written} == {"results.json", "report.md", "fig.html"}
    assert all(p.exists() for p in out.written)
    doc = json.loads((folder / "results.json").read_text())
    check_results_shape(doc)
    assert [r["published"] for r in doc["rows"]] == [1.0, None]  # filled in after prediction, by row_key
    assert doc["rows"][0]["predicted"] == 0.333333  # 6 significant figures
    assert doc["claims"][0]["published"] == 2.1
    report = (folder / "report.md").read_text()
    assert "A fake paper" in report and "Some notes." in report and "Runtime:" in report
    assert "a gap's cause" in report  # -67%: over 20%, so its note is printed
    assert "| [cause 1](#cause-1) |" in report and report.count("a gap's cause") == 1
    assert "Runtime" not in (folder / "results.json").read_text()
    assert seen[0] == (0, 2 + runner.WRITING_STEPS, "first")


def test_a_cause_many_rows_share_is_printed_once_and_each_row_links_to_it() -> None:
    """Two rows outside the tolerance with one note and a claim with
    another cite causes 1 and 2, a row within it cites none; the section
    prints each cause once, in the order first cited, with its anchor."""
    rows = [
        Row("f", "1", "m", "ideal", 2, 8, t, "speedup_vs_dp", v, config=None, note="shared", published=1.0)
        for t, v in (("gpipe", 2.0), ("1f1b", 1.05), ("pipedream", 0.5))
    ]
    claims = [Claim("c", "a claim", 3.0, note="its own", published=1.0)]
    causes = runner.Causes()
    table = runner.comparison_table(rows, causes=causes).splitlines()[2:]
    assert [line.rsplit("|", 2)[1].strip() for line in table] == ["[cause 1](#cause-1)", "", "[cause 1](#cause-1)"]
    assert "| [cause 2](#cause-2) |" in runner.claims_table(claims, causes=causes)
    assert causes.section() == '<a id="cause-1"></a>**Cause 1.** shared\n\n<a id="cause-2"></a>**Cause 2.** its own'
    assert runner.Causes().section() == ""


def test_results_json_is_byte_identical_run_to_run(tmp_path) -> None:
    runner.run_paper(FAKE, tmp_path / "a")
    runner.run_paper(FAKE, tmp_path / "b")
    assert (tmp_path / "a/fake/results.json").read_bytes() == (tmp_path / "b/fake/results.json").read_bytes()


@pytest.fixture
def fake_module(monkeypatch):
    """A build with the fake paper's module and one missing module."""
    module = types.ModuleType(f"{runner.PACKAGE}.fakepaper")
    module.PAPER = FAKE
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(runner, "PAPERS", {"fake": "fakepaper", "gone": "no_such_paper_module"})


def test_all_runs_the_papers_this_build_has(fake_module, tmp_path) -> None:
    printed = []
    outcomes = runner.run("all", tmp_path, echo=printed.append, bar=False)
    assert [o.paper.name for o in outcomes] == ["fake"]
    assert (tmp_path / "fake" / "report.md").exists()
    assert any("A fake paper" in p for p in printed)
    with pytest.raises(runner.PaperError, match="gone: its reproduction .* is not in this build"):
        runner.load_paper("gone")


def test_a_missing_paper_module_is_one_line_exit_2(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(runner.PAPERS, "2bw", "no_such_paper_module")
    assert main(["reproduce", "2bw", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "2bw" in err and "not in this build" in err
    assert not (tmp_path / "2bw").exists()


def test_bad_paper_name_and_bad_out_dir_are_one_line_exit_2(tmp_path, capsys) -> None:
    assert main(["reproduce", "gpipe", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gpipe" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["reproduce", "spectrain", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot write to output folder" in err


def test_progress_ends_only_after_the_figures_and_the_report(tmp_path) -> None:
    """The bar counts the predictions, then the figures, then the report
    (whose notes may simulate more), and reaches its total only at the end."""
    seen: list[tuple[int, int, str]] = []

    def figures(rows, claims, out):
        seen.append((-1, -1, "figures ran"))
        return fake_figures(rows, claims, out)

    def notes(rows, claims):
        seen.append((-1, -1, "notes ran"))
        return "Some notes."

    paper = Paper(**{**FAKE.__dict__, "figures": figures, "notes": notes})
    runner.run_paper(paper, tmp_path, lambda done, total, what: seen.append((done, total, what)))
    total = FAKE.steps + runner.WRITING_STEPS
    assert [s for s in seen if s[0] >= 0] == [
        (0, total, "first"),
        (1, total, "second"),
        (2, total, "figures"),
        (3, total, "report"),
        (total, total, "done"),
    ]
    order = [what for *_, what in seen]
    assert order.index("figures") < order.index("figures ran") < order.index("report")
    assert order.index("report") < order.index("notes ran") < order.index("done")

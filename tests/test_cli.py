"""The pipesim command line: outputs, determinism and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipesim.experiments.bench import BENCHES
from pipesim.experiments.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_simulate_writes_summary_trace_and_timeline(tmp_path, capsys) -> None:
    code, out, err = run(
        capsys,
        "simulate",
        "--strategy",
        "spectrain",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--model",
        "vgg16",
        "--hardware",
        "pcie-4gpu",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    assert "spectrain" in out and "s_fwd" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "strategy",
        "stages",
        "microbatches",
        "makespan_s",
        "throughput_samples_per_s",
        "bubble_fraction",
        "devices",
        "stages_info",
        "link_bytes",
    ):
        assert key in summary
    for dev in summary["devices"]:
        assert {"id", "bubble_fraction", "peak_memory_bytes", "memory_breakdown", "out_of_memory"} <= dev.keys()
    assert [s["prediction_distance_fwd"] for s in summary["stages_info"]] == [3, 2, 2, 1]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])
    assert "<html" in (tmp_path / "timeline.html").read_text()[:2000].lower()


def test_same_inputs_give_byte_identical_outputs(tmp_path, capsys) -> None:
    args = [
        "simulate",
        "--strategy",
        "pipedream-2bw",
        "--stages",
        "4",
        "--microbatches",
        "4",
        "--iterations",
        "3",
        "--model",
        "gnmt",
        "--hardware",
        "dgx1-v100",
    ]
    assert run(capsys, *args, "--out", str(tmp_path / "a"))[0] == 0
    assert run(capsys, *args, "--out", str(tmp_path / "b"))[0] == 0
    for name in ("summary.json", "trace.json", "timeline.html"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.mark.parametrize(
    "argv,message",
    [
        (["simulate", "--strategy", "nope"], "unknown strategy 'nope'"),
        (["simulate", "--strategy", "1f1b", "--stages", "0"], "must be >= 1"),
        (["simulate", "--strategy", "1f1b", "--microbatches", "-3"], "must be >= 1"),
        (["simulate", "--strategy", "1f1b", "--model", "nope"], "unknown model"),
        (["simulate", "--strategy", "1f1b", "--hardware", "nope"], "unknown hardware"),
        (["simulate", "--strategy", "1f1b", "--stages", "40", "--model", "vgg16"], "cannot split"),
        (["simulate", "--strategy", "pipedream-2bw", "--stages", "4", "--microbatches", "2"], "m=2 < p=4"),
        (["simulate", "--strategy", "1f1b", "--profile", "/nonexistent/profile.json"], "not found"),
        (["simulate", "--schedule", "/nonexistent/schedule.csv"], "schedule file /nonexistent/schedule.csv not found"),
        (["simulate", "--strategy", "1f1b", "--stages", "8", "--hardware", "pcie-4gpu"], "has 4 devices"),
        (["simulate", "--strategy", "pipedream", "--width", "2"], "width"),
        # a flag for an option the strategy ignores is refused even at the option's default
        (["simulate", "--strategy", "1f1b", "--chunks", "2"], "--chunks does not apply to 1f1b"),
        (["schedule", "--strategy", "gpipe", "--no-stashing"], "--no-stashing does not apply to gpipe"),
        (["simulate"], "--strategy"),
        (["compare", "--strategies", "gpipe,,1f1b"], "unknown strategy ''"),
        (["compare", "--strategies", "1f1b,nope"], "unknown strategy 'nope'"),
        (
            ["simulate", "--schedule", "x.csv", "--no-stashing", "--tau", "2"],
            "--no-stashing, --tau configure a strategy",
        ),
        (["simulate", "--schedule", "x.csv", "--strategy", "1f1b"], "--strategy configure a strategy"),
        (["frobnicate"], "invalid choice"),
        # a value list that starts negative is the option's bad value, not an unknown flag
        (
            ["simulate", "--strategy", "1f1b", "--stages", "2", "--replicas", "-1,2"],
            "argument --replicas: expected replicas per stage like 15,1, got '-1,2'",
        ),
        (["simulate", "--strategy", "1f1b", "--stages", "-2"], "argument --stages: must be >= 1, got -2"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path) -> None:
    code, out, err = run(capsys, *argv, *(["--out", str(tmp_path)] if argv[0] in ("simulate", "compare") else []))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert message in lines[0]
    assert "Traceback" not in err


def test_malformed_profile_and_schedule(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run(capsys, "simulate", "--strategy", "1f1b", "--profile", str(bad), "--out", str(tmp_path))
    assert code == 2 and len(err.strip().splitlines()) == 1
    deadlock = tmp_path / "dl.csv"
    deadlock.write_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    code, _, err = run(capsys, "simulate", "--schedule", str(deadlock), "--out", str(tmp_path))
    assert code == 2 and "deadlock" in err and "waits for" in err
    # a pipesim header's optimizer is named as the header's, not blamed on the model's profile
    code, csv_text, _ = run(
        capsys, "schedule", "--strategy", "1f1b", "--stages", "2", "--microbatches", "4", "--format", "csv"
    )
    assert code == 0
    for old, new, message in (
        ('"strategy":"1f1b"', '"strategy":5', "header's strategy must be a name"),
        ('"optimizer":"sgd"', '"optimizer":"adamw"', "header's optimizer must be one of"),
        ('"optimizer":"sgd"', '"optimizer":["adam"]', "header's optimizer must be one of"),
    ):
        assert old in csv_text
        edited = tmp_path / "edited.csv"
        edited.write_text(csv_text.replace(old, new))
        code, _, err = run(capsys, "simulate", "--schedule", str(edited), "--out", str(tmp_path / "e"))
        assert code == 2 and message in err and "profile" not in err and err.count("\n") == 1, err


def test_torch_csv_out_and_back_in(tmp_path, capsys) -> None:
    code, out, _ = run(
        capsys, "schedule", "--strategy", "1f1b", "--stages", "3", "--microbatches", "4", "--format", "torch-csv"
    )
    assert code == 0
    assert out.splitlines()[2] == "2F0,2B0,2F1,2B1,2F2,2B2,2F3,2B3"
    csv_file = tmp_path / "s.csv"
    csv_file.write_text(out)
    code, _, err = run(capsys, "simulate", "--schedule", str(csv_file), "--out", str(tmp_path / "o"), "--summary-only")
    assert code == 0, err
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["bubble_fraction"] == pytest.approx(2 / 6)


def test_interleaved_devices_flag(capsys) -> None:
    code, out, _ = run(
        capsys,
        "schedule",
        "--strategy",
        "interleaved-1f1b",
        "--stages",
        "8",
        "--devices",
        "4",
        "--microbatches",
        "4",
        "--format",
        "text",
    )
    assert code == 0
    assert len(out.splitlines()) == 4 and "4F0" in out.splitlines()[0]


def test_compare_runs_a_subset(tmp_path, capsys) -> None:
    code, out, err = run(
        capsys,
        "compare",
        "--strategies",
        "gpipe,1f1b,pipedream",
        "--width",
        "2",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    comparison = json.loads((tmp_path / "comparison.json").read_text())
    assert comparison["order"] == ["gpipe", "1f1b", "pipedream"]
    assert sorted(comparison["strategies"]) == sorted(comparison["order"])
    # --width went to the strategies that take it and not to pipedream
    assert comparison["strategies"]["gpipe"]["replicas"] == 2
    assert comparison["strategies"]["pipedream"]["replicas"] == 1
    assert (tmp_path / "1f1b" / "timeline.html").exists()
    assert comparison["strategies"]["pipedream"]["iterations"] == 4  # steady state by default
    html = (tmp_path / "comparison.html").read_text()
    assert "pipesim-comparison" in html and "max staleness" in html


def test_compare_runs_one_uniform_model_for_every_strategy(tmp_path, capsys) -> None:
    """uniform is one layer per model stage when simulated alone; compared,
    every strategy runs the same model: as many layers as interleaving's
    p*v model stages (before, interleaving ran twice the layers the others
    did and read 0.58x of gpipe)."""
    code, _, err = run(
        capsys,
        "compare",
        "--strategies",
        "gpipe,interleaved-1f1b,data-parallel,pipedream",
        "--model",
        "uniform",
        "--hardware",
        "ideal",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    doc = json.loads((tmp_path / "comparison.json").read_text())["strategies"]
    model_ms = {name: round(sum(st["forward_s"] for st in s["stages_info"]) * 1e3, 9) for name, s in doc.items()}
    assert set(model_ms.values()) == {8.0}, model_ms  # 8 layers of F = 1 ms, whoever splits them
    # the bubbles are then the textbook's: (p-1)/(m+p-1) for GPipe, (p-1)/(v*m+p-1) interleaved
    assert doc["gpipe"]["bubble_fraction"] == pytest.approx(3 / 11, abs=1e-6)
    assert doc["interleaved-1f1b"]["bubble_fraction"] == pytest.approx(3 / 19, abs=1e-6)
    assert doc["interleaved-1f1b"]["throughput_samples_per_s"] > doc["gpipe"]["throughput_samples_per_s"]


def test_compare_counts_the_uniform_layers_of_schedules_it_did_not_keep(tmp_path, capsys, monkeypatch) -> None:
    """With memory for no schedule to be kept beside the others, every
    strategy still runs the one model (the layers came from the kept ones
    only, and interleaving's 8 stages met a 4-layer model)."""
    from pipesim.sim.engine import size

    monkeypatch.setattr(size, "available_memory_bytes", lambda: size.BYTES_PER_PASS * 300)
    code, _, err = run(
        capsys,
        "compare",
        "--strategies",
        "1f1b,interleaved-1f1b",
        "--model",
        "uniform",
        "--hardware",
        "ideal",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    doc = json.loads((tmp_path / "comparison.json").read_text())["strategies"]
    assert {round(sum(st["forward_s"] for st in s["stages_info"]) * 1e3, 9) for s in doc.values()} == {8.0}


def test_compare_builds_each_schedule_once(tmp_path, capsys, monkeypatch) -> None:
    """The schedule built to check the machine's devices is the one simulated."""
    from pipesim.sim import strategies

    built = []
    real = strategies.build_schedule
    monkeypatch.setattr(strategies, "build_schedule", lambda spec: built.append(spec.strategy) or real(spec))
    code, _, err = run(
        capsys, "compare", "--strategies", "gpipe,1f1b", "--stages", "2", "--microbatches", "4", "--out", str(tmp_path)
    )
    assert code == 0, err
    assert built == ["gpipe", "1f1b"]
    # with no memory to keep them beside each other, each is built again for its run
    from pipesim.sim.engine import size

    built.clear()
    monkeypatch.setattr(size, "available_memory_bytes", lambda: size.BYTES_PER_PASS * 40)  # each fits, not two
    code, _, err = run(
        capsys,
        "compare",
        "--strategies",
        "gpipe,1f1b",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--out",
        str(tmp_path / "again"),
    )
    assert code == 0, err
    assert built == ["gpipe", "1f1b", "gpipe", "1f1b"]


@pytest.mark.slow
def test_console_script_entry_point(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pipesim.experiments.cli", "simulate", "--strategy", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


@pytest.mark.slow
def test_closed_pipe_is_not_an_error() -> None:
    # `pipesim schedule ... | head`: the reader leaves early
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipesim.experiments.cli",
            "schedule",
            "--strategy",
            "1f1b",
            "--stages",
            "32",
            "--microbatches",
            "512",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and err == b""


def test_bench_dispatches_to_each_layers_benchmark_with_json(capsys) -> None:
    code, out, err = run(capsys, "bench", "sim", "--quick", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["raw_simpy_timeouts_per_s"] > 0 and report["target"] == {}
    assert {r["strategy"] for r in report["cases"]} >= {"1f1b", "pipedream"}
    assert all(r["compute_actions"] > 0 and r["actions_per_s"] > 0 for r in report["cases"])
    code, out, err = run(capsys, "bench", "sim", "--quick")
    assert code == 0 and out.startswith("SimPy raw timeouts/s:") and "actions/s" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["bench", "nope"], "invalid choice"),
        (["bench", "comm", "--world-size", "1"], "must be >= 2"),
        (["bench", "kernels", "--repeat", "0"], "must be >= 1"),
    ],
)
def test_bench_arguments_are_checked_in_one_line(argv, message, capsys) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_help_shows_choices_and_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # help wraps lines at the terminal width
    assert "(choices: gpipe, 1f1b, interleaved-1f1b" in out
    assert "--alpha ALPHA" in out and "(default: 0.25)" in out
    assert "(default: 4, or as many as --replicas names)" in out  # --stages
    assert "pcie-4gpu" in out and "vgg16" in out  # hardware presets and catalog models


# --- hostile input: sizes, progress, imported iterations, output folders -----


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


def test_too_large_a_run_is_refused_before_anything_is_built(tmp_path, capsys, monkeypatch) -> None:
    from pipesim.sim import strategies
    from pipesim.sim.engine import size

    monkeypatch.setattr(size, "available_memory_bytes", lambda: 68 * size.BYTES_PER_PASS)  # 64 passes, 4 devices
    with monkeypatch.context() as m:

        def no_build(spec):
            raise AssertionError("built a schedule the size check should have refused")

        m.setattr(strategies, "build_schedule", no_build)
        for command in ("simulate", "schedule"):
            argv = [command, "--strategy", "1f1b", "--stages", "4", "--microbatches", "17"]  # 68 passes > 64
            code, out, err = run(capsys, *argv, *(["--out", str(tmp_path)] if command == "simulate" else []))
            line = _one_error_line(err)
            assert code == 2 and out == ""
            assert "68 stage passes" in line and "at most 64 passes on its 4 devices" in line, line
    code, _, err = run(
        capsys,
        "simulate",
        "--strategy",
        "1f1b",
        "--stages",
        "4",
        "--microbatches",
        "16",
        "--summary-only",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err  # exactly at the limit


def test_huge_sizes_fail_in_one_line_without_allocating(tmp_path, capsys) -> None:
    # 10**12 micro-batches would need petabytes of memory
    code, _, err = run(capsys, "simulate", "--strategy", "1f1b", "--microbatches", str(10**12), "--out", str(tmp_path))
    assert code == 2 and "stage passes" in _one_error_line(err)
    # 3000 layers: the exact partitioner's (layers+1)^2 tables are refused, not allocated
    layer = {"forward_s": 1e-3, "backward_s": 2e-3, "param_bytes": 4, "activation_bytes": 4, "stash_bytes": 4}
    prof = tmp_path / "deep.json"
    prof.write_text(json.dumps({"name": "deep", "layers": [{"name": f"l{i}", **layer} for i in range(3000)]}))
    code, _, err = run(
        capsys, "simulate", "--strategy", "1f1b", "--stages", "2", "--profile", str(prof), "--out", str(tmp_path)
    )
    line = _one_error_line(err)
    assert code == 2 and "cannot split 3000 layers into 2 stages exactly" in line and "2048 layers" in line


def test_progress_bar_goes_to_stderr_only_for_long_runs(tmp_path, capsys, monkeypatch) -> None:
    import pipesim.experiments.progress as progress

    args = ["simulate", "--strategy", "zb-h1", "--stages", "4", "--microbatches", "8", "--json", "--out", str(tmp_path)]
    code, quiet, err = run(capsys, *args)
    assert code == 0 and err == ""  # stderr is not a terminal and the run is short
    monkeypatch.setattr(progress, "PROGRESS_PASSES", 1)  # every run counts as long now
    code, out, err = run(capsys, *args)
    assert code == 0
    assert out == quiet  # the JSON on stdout is untouched
    for phase in ("building the schedule", "simulating", "summarizing", "writing trace.json", "writing timeline.html"):
        assert phase in err, err
    assert "%|" in err


def test_progress_bar_on_a_terminal_waits_a_second(tmp_path, capsys, monkeypatch) -> None:
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    fake = Terminal()
    monkeypatch.setattr(sys, "stderr", fake)
    code = main(
        [
            "simulate",
            "--strategy",
            "1f1b",
            "--stages",
            "2",
            "--microbatches",
            "4",
            "--summary-only",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    assert fake.getvalue() == ""  # a run shorter than the bar's one-second delay draws nothing


def test_imported_csv_takes_iterations(tmp_path, capsys) -> None:
    spec = ["--stages", "2", "--microbatches", "2", "--iterations", "2"]
    code, csv_text, _ = run(capsys, "schedule", "--strategy", "1f1b", *spec, "--format", "csv")
    assert code == 0
    path = tmp_path / "two.csv"
    path.write_text(csv_text)
    code, built, _ = run(capsys, "simulate", "--strategy", "1f1b", *spec, "--json", "--out", str(tmp_path / "b"))
    # given on the command line, or read off the pipesim CSV's header: the same run as the strategy's
    for flags in (spec[2:], []):
        code, imported, err = run(
            capsys, "simulate", "--schedule", str(path), *flags, "--json", "--out", str(tmp_path / "a")
        )
        assert code == 0, err  # was: "micro-batch 2 out of range 0..1"
        assert imported == built
    # a torch CSV records nothing: --iterations says how many the rows hold
    code, torch_csv, _ = run(capsys, "schedule", "--strategy", "1f1b", *spec, "--format", "torch-csv")
    path.write_text(torch_csv)
    code, imported, err = run(
        capsys, "simulate", "--schedule", str(path), *spec[2:], "--json", "--out", str(tmp_path / "c")
    )
    a, b = json.loads(imported), json.loads(built)
    assert code == 0 and a["iterations"] == 2 and a["microbatches"] == 2 and a["strategy"] == "imported"
    for key in ("strategy", "options"):
        a.pop(key), b.pop(key)
    assert a == b


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--strategy", "1f1b"],
        ["compare", "--strategies", "1f1b"],
        ["figure", "bubbles"],
        ["profile", "--model", "mlp"],
        ["validate", "--strategy", "1f1b"],
    ],
)
def test_unwritable_output_folder_fails_before_any_work(argv, tmp_path, capsys, monkeypatch) -> None:
    from pipesim.experiments import figures
    from pipesim.validate import harness

    def no_work(*args, **kwargs):
        raise AssertionError("started work with an output folder that cannot be written")

    for module, name in (
        (harness, "run_validation"),
        (harness, "profile"),
        (harness, "model_of"),
        (figures, "bubble_figure"),
    ):
        monkeypatch.setattr(module, name, no_work)
    blocker = tmp_path / "file"
    blocker.write_text("a regular file")
    code, out, err = run(capsys, *argv, "--out", str(blocker / "out"))
    assert code == 2 and out == ""
    line = _one_error_line(err)
    assert f"cannot write to output folder {blocker / 'out'}" in line, line


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_benchmark_answers_help(name, capsys) -> None:
    # each benchmark's module and parser load (a moved module would fail here, not in a user's hands)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert f"pipesim bench {name}" in capsys.readouterr().out


def test_compare_with_a_profile_runs_on_the_machine_its_help_names(tmp_path) -> None:
    profile = tmp_path / "p.json"
    layer = {
        "forward_s": 0.001,
        "backward_s": 0.002,
        "param_bytes": 1 << 20,
        "activation_bytes": 1 << 16,
        "stash_bytes": 1 << 16,
    }
    profile.write_text(json.dumps({"name": "p", "layers": [{"name": f"l{i}", **layer} for i in range(2)]}))
    out = tmp_path / "out"
    assert (
        main(["compare", "--profile", str(profile), "--stages", "2", "--strategies", "gpipe", "--out", str(out)]) == 0
    )
    assert json.loads((out / "gpipe" / "summary.json").read_text())["meta"]["hardware"] == "pcie-4gpu"

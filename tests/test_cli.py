"""The pipesim command line: outputs, determinism and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipesim.experiments.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_simulate_writes_summary_trace_and_timeline(tmp_path, capsys) -> None:
    code, out, err = run(capsys, "simulate", "--strategy", "spectrain", "--stages", "4", "--microbatches", "8",
                         "--model", "vgg16", "--hardware", "pcie-4gpu", "--out", str(tmp_path))
    assert code == 0, err
    assert "spectrain" in out and "s_fwd" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("strategy", "stages", "microbatches", "makespan_s", "throughput_samples_per_s", "bubble_fraction",
                "devices", "stages_info", "link_bytes"):
        assert key in summary
    for dev in summary["devices"]:
        assert {"id", "bubble_fraction", "peak_memory_bytes", "memory_breakdown", "out_of_memory"} <= dev.keys()
    assert [s["prediction_distance_fwd"] for s in summary["stages_info"]] == [3, 2, 2, 1]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])
    assert "<html" in (tmp_path / "timeline.html").read_text()[:2000].lower()


def test_same_inputs_give_byte_identical_outputs(tmp_path, capsys) -> None:
    args = ["simulate", "--strategy", "pipedream-2bw", "--stages", "4", "--microbatches", "4", "--iterations", "3",
            "--model", "gnmt", "--hardware", "dgx1-v100"]
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
        (["simulate", "--schedule", "/nonexistent/schedule.csv"], "cannot read schedule file"),
        (["simulate", "--strategy", "1f1b", "--stages", "8", "--hardware", "pcie-4gpu"], "has 4 devices"),
        (["simulate", "--strategy", "pipedream", "--width", "2"], "width"),
        (["simulate"], "--strategy"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path) -> None:
    code, out, err = run(capsys, *argv, *(["--out", str(tmp_path)] if argv[0] == "simulate" else []))
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


def test_torch_csv_out_and_back_in(tmp_path, capsys) -> None:
    code, out, _ = run(capsys, "schedule", "--strategy", "1f1b", "--stages", "3", "--microbatches", "4",
                       "--format", "torch-csv")
    assert code == 0
    assert out.splitlines()[2] == "2F0,2B0,2F1,2B1,2F2,2B2,2F3,2B3"
    csv_file = tmp_path / "s.csv"
    csv_file.write_text(out)
    code, _, err = run(capsys, "simulate", "--schedule", str(csv_file), "--out", str(tmp_path / "o"),
                       "--summary-only")
    assert code == 0, err
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["bubble_fraction"] == pytest.approx(2 / 6)


def test_interleaved_devices_flag(capsys) -> None:
    code, out, _ = run(capsys, "schedule", "--strategy", "interleaved-1f1b", "--stages", "8", "--devices", "4",
                       "--microbatches", "4", "--format", "text")
    assert code == 0
    assert len(out.splitlines()) == 4 and "4F0" in out.splitlines()[0]


def test_compare_runs_a_subset(tmp_path, capsys) -> None:
    code, out, err = run(capsys, "compare", "--strategies", "gpipe,1f1b,pipedream", "--width", "2",
                         "--stages", "2", "--microbatches", "4", "--out", str(tmp_path))
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


@pytest.mark.slow
def test_console_script_entry_point(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipesim.experiments.cli", "simulate", "--strategy", "nope"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


@pytest.mark.slow
def test_closed_pipe_is_not_an_error() -> None:
    # `pipesim schedule ... | head`: the reader leaves early
    proc = subprocess.Popen([sys.executable, "-m", "pipesim.experiments.cli", "schedule", "--strategy", "1f1b",
                             "--stages", "32", "--microbatches", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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


@pytest.mark.parametrize("argv,message", [
    (["bench", "nope"], "invalid choice"),
    (["bench", "comm", "--world-size", "1"], "must be >= 2"),
    (["bench", "kernels", "--repeat", "0"], "must be >= 1"),
])
def test_bench_arguments_are_checked_in_one_line(argv, message, capsys) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_help_shows_choices_and_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # help wraps lines at the terminal width
    assert "(choices: gpipe, 1f1b, interleaved-1f1b" in out
    assert "--alpha ALPHA" in out and "(default: 0.25)" in out
    assert "(default: 4)" in out  # --stages
    assert "pcie-4gpu" in out and "vgg16" in out  # hardware presets and catalog models

"""Reconciliation, the validation harness and its command line.

Most of this runs in one process (single-device mode, hand-made timelines);
one test runs the full gloo path through the CLI.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import pytest

from pipesim.experiments.cli import main
from pipesim.sim.api import simulate
from pipesim.sim.engine.results import MemoryTrack, Span
from pipesim.sim.ir.core import PASS_OPS
from pipesim.sim.strategies import ScheduleSpec
from pipesim.sim.workloads.readers import load_profile
from pipesim.validate import executor, harness
from pipesim.validate.harness import (
    ValidateConfig,
    ValidateError,
    build,
    check_machine,
    run_validation,
    summed_memory,
)
from pipesim.validate.reconcile import (
    DURATION_THRESHOLD,
    compare,
    compare_actions,
    compare_versions,
    iteration_ends,
    iteration_time,
)

REQUIRED = (
    "iteration_time_measured_s",
    "iteration_time_predicted_s",
    "iteration_time_error",
    "bubble_fraction_measured",
    "bubble_fraction_predicted",
    "action_errors",
    "losses",
    "weight_versions",
    "flagged_actions",
)


def predicted(strategy="gpipe", iterations=3, m=4):
    return simulate(
        ScheduleSpec(strategy=strategy, stages=2, microbatches=m, iterations=iterations), "uniform", "ideal"
    )


def stretched(result, factor=1.0, slow=None):
    """A fake measurement: every span scaled, and optionally one action slowed."""
    spans, shift = [], 0.0
    for s in sorted(result.spans, key=lambda s: s.start):
        d = s.duration * factor
        if slow is not None and (s.device, str(s.action)) == slow:
            d *= 3
        spans.append(Span(s.device, s.stream, s.action, s.start * factor + shift, s.start * factor + shift + d))
        if slow is not None and (s.device, str(s.action)) == slow:
            shift += d - s.duration * factor
    return replace(result, spans=spans, memory=[], versions=[])


def steady_actions(result):
    """The compute actions each device runs from its first pass of the second
    iteration on (all of them for a one-iteration run)."""
    m = result.schedule.num_microbatches
    if result.schedule.num_iterations == 1:
        return result.by_stream()["compute"]
    out = []
    for dev in range(result.schedule.num_devices):
        spans = sorted((s for s in result.by_stream()["compute"] if s.device == dev), key=lambda s: s.start)
        first = next(i for i, s in enumerate(spans) if s.action.op in PASS_OPS and s.action.microbatch >= m)
        out += spans[first:]
    return out


def test_iteration_time_of_a_flush_schedule_is_its_period():
    res = predicted("gpipe", iterations=3)
    ends = iteration_ends(res)
    assert len(ends) == 3 and ends == sorted(ends)
    # uniform stages, F=1 ms, B=2 ms, free updates: one GPipe iteration is (m+p-1)(F+B)
    assert iteration_time(res) == pytest.approx((4 + 2 - 1) * 3e-3)
    assert iteration_time(stretched(res, 2.0)) == pytest.approx(2 * iteration_time(res))


def test_action_errors_find_the_slow_action():
    res = predicted("1f1b")
    meas = stretched(res, slow=(1, "1B6@v1"))  # in the steady state: the second iteration
    summary, flagged = compare_actions(res, meas)
    assert summary["compared"] == len(steady_actions(res))
    assert flagged and flagged[0]["action"] == "1B6@v1" and flagged[0]["device"] == 1
    assert flagged[0]["duration_error"] == pytest.approx(-2 / 3)
    assert summary["duration_error"]["max"] == pytest.approx(2 / 3)
    same, none = compare_actions(res, stretched(res))
    assert none == [] and same["duration_error"]["max"] == 0
    assert 2 / 3 > DURATION_THRESHOLD


def test_action_errors_leave_out_the_warm_up_iteration():
    """A first forward 5 ms slower (allocator and cache warm-up) delays
    every later action by 5 ms; counted from the end of the first iteration,
    as the iteration time is, the steady state shows no error at all."""
    res = predicted("gpipe", iterations=3)
    warm = [
        Span(s.device, s.stream, s.action, s.start + (5e-3 if s.start > 0 else 0.0), s.end + 5e-3) for s in res.spans
    ]
    meas = replace(res, spans=warm, memory=[], versions=[])
    summary, flagged = compare_actions(res, meas)
    assert summary["compared"] == len(steady_actions(res)) < len(res.by_stream()["compute"])
    assert summary["start_error_s"]["max"] == pytest.approx(0, abs=1e-12) and flagged == []


def test_compare_report_signs_and_versions():
    res = predicted("pipedream", iterations=2)
    meas = stretched(res, 1.25)
    used = {}
    for pv in res.versions:
        used.setdefault((pv.replica, pv.stage), []).extend(
            [
                ("F", pv.microbatch, pv.forward_version, pv.forward_distance),
                ("B", pv.microbatch, pv.backward_version, pv.backward_distance),
            ]
        )
    report = compare(res, meas, losses=[1.0, 0.5], versions_used=used)
    for key in REQUIRED:
        assert key in report
    assert report["iteration_time_error"] == pytest.approx(1 / 1.25 - 1)
    assert report["weight_versions"]["match"]
    key = next(iter(used))
    used[key][1] = (used[key][1][0], used[key][1][1], used[key][1][2] + 1, 0)
    bad = compare_versions(res, used)
    assert not bad["match"] and bad["mismatches"] == 1


def test_machine_checks_are_one_line_errors(monkeypatch):
    # a 2-core machine without a GPU, as CI's, whatever this one is
    monkeypatch.setattr(harness.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(harness.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with pytest.raises(ValidateError, match="needs 2 GPUs"):
        check_machine(ValidateConfig("1f1b", backend="nccl"), build(ValidateConfig("1f1b")))
    cfg = ValidateConfig("pipedream-2bw", replicas=4)
    with pytest.raises(ValidateError, match="worker processes"):
        check_machine(cfg, build(cfg))
    with pytest.raises(ValidateError, match="unknown backend"):
        check_machine(ValidateConfig("1f1b", backend="mpi"), build(ValidateConfig("1f1b")))


def test_single_device_validation_end_to_end():
    cfg = ValidateConfig(
        "spectrain",
        stages=2,
        microbatches=4,
        iterations=3,
        model="mlp",
        backend="single",
        microbatch_size=8,
        model_width=32,
        profile_repeats=3,
    )
    v = run_validation(cfg)
    r = v.report
    for key in REQUIRED:
        assert key in r
    assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
    assert r["weight_versions"]["match"] and r["weight_versions"]["passes_compared"] == 2 * 2 * 12
    assert r["action_errors"]["compared"] == len(steady_actions(v.measured))
    assert r["iteration_time_error"] == pytest.approx(
        (r["iteration_time_predicted_s"] - r["iteration_time_measured_s"]) / r["iteration_time_measured_s"], rel=1e-6
    )
    # the prediction again at the run's pass speed: the measured passes' time over their layers' in the profile
    starts = [*r["partition_starts"], v.profile.num_layers]
    layers = [v.profile.layers[a:b] for a, b in zip(starts, starts[1:])]
    passes = [s for s in steady_actions(v.measured) if s.action.op in PASS_OPS]
    times = {"F": lambda la: la.forward_s, "B": lambda la: la.backward_s}
    layer_s = sum(times[s.action.op.value](la) for s in passes for la in layers[s.action.stage])
    assert r["pass_time_ratio"] == pytest.approx(sum(s.duration for s in passes) / layer_s, rel=1e-6)
    # laid end to end, an iteration at the run's speed is longer by about its layers' time times
    # (ratio - 1): about, as the iteration ends fall between devices' actions, not at the steady passes'
    longer = r["iteration_time_predicted_at_run_speed_s"] - r["iteration_time_predicted_s"]
    expected = (r["pass_time_ratio"] - 1) * layer_s / (cfg.iterations - 1)
    assert 0.5 * abs(expected) - 2e-6 <= abs(longer) <= 1.5 * abs(expected) + 2e-6
    assert longer * expected >= 0 or abs(expected) < 2e-6
    assert r["iteration_time_error_at_run_speed"] == pytest.approx(
        (r["iteration_time_predicted_at_run_speed_s"] - r["iteration_time_measured_s"])
        / r["iteration_time_measured_s"],
        rel=1e-6,
    )
    # single-device mode predicts the actions laid end to end, in the order they ran
    pred = v.predicted.by_stream()["compute"]
    assert all(a.end == pytest.approx(b.start) for a, b in zip(pred, pred[1:]))
    # ... and its memory is every simulated device's on the one device
    assert len(v.predicted.memory) == 1 and v.predicted.memory[0].peak_bytes > 0
    assert r["mode"].startswith("single-device")


def test_single_device_memory_is_the_peak_of_the_summed_tracks():
    """Device 0 holds 10 B over [0, 2), device 1 5 B from 1 and 7 B from 3:
    one device holding both peaks at 15 B at t = 1, neither device 0's
    10 B nor the sum of the peaks, 17 B."""
    a = MemoryTrack(0, 100.0, times=[0.0, 2.0], totals=[10, 0], peak_bytes=10)
    b = MemoryTrack(1, 100.0, times=[1.0, 3.0], totals=[5, 7], peak_bytes=7)
    one = summed_memory([a, b])
    assert one.times == [0.0, 1.0, 2.0, 3.0] and one.totals == [10, 15, 5, 7]
    assert (one.peak_bytes, one.peak_time, one.device, one.capacity_bytes) == (15, 1.0, 0, 100.0)
    assert summed_memory([a]).totals == [10, 0]


def test_single_device_memory_holds_a_transfer_once():
    """Device 0 sends 5 B over [1, 2) (its send buffer), device 1 receives
    them from 1 until its consumer starts at 3: one device holds the tensor
    once, 15 B at the peak, not the simulator's 20."""
    a = MemoryTrack(0, 100.0, times=[0.0, 1.0, 2.0], totals=[10, 15, 10], peak_bytes=15)
    b = MemoryTrack(1, 100.0, times=[1.0, 3.0], totals=[5, 0], peak_bytes=5)
    assert summed_memory([a, b]).peak_bytes == 20
    one = summed_memory([a, b], [(1.0, 2.0, 5)])
    assert one.times == [0.0, 1.0, 2.0, 3.0] and one.totals == [10, 15, 15, 10]
    assert one.peak_bytes == 15
    # and 3 B more over [0.5, 1), consumed at 1.5: one transfer starts as the
    # other ends, and each is taken out over its own interval only
    a = MemoryTrack(0, 100.0, times=[0.0, 0.5, 1.0, 2.0], totals=[10, 13, 15, 10], peak_bytes=15)
    b = MemoryTrack(1, 100.0, times=[0.5, 1.0, 1.5, 3.0], totals=[3, 8, 5, 0], peak_bytes=8)
    two = summed_memory([a, b], [(1.0, 2.0, 5), (0.5, 1.0, 3)])
    assert two.times == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0] and two.totals == [10, 13, 18, 15, 15, 10]


class _DeferredStamp:
    """A timestamp known only once the run is over, as a CUDA event's is."""

    def __init__(self, ns: int):
        self.ns = ns


class _DeferredClock(executor.Clock):
    """The CPU clock with CUDA's contract: ``now`` returns an object, and only
    ``resolve`` turns it into host nanoseconds."""

    def now(self):
        return _DeferredStamp(super().now())

    def resolve(self, stamp):
        return stamp.ns if isinstance(stamp, _DeferredStamp) else super().resolve(stamp)


def test_single_device_validation_resolves_deferred_timestamps(monkeypatch):
    """On a GPU every stamp is an event resolved after the run: the emulator
    must resolve them before the records are reconciled (it once handed the
    events themselves to the reconciliation, which failed on the first GPU)."""
    monkeypatch.setattr(executor, "Clock", _DeferredClock)
    cfg = ValidateConfig(
        "1f1b",
        stages=2,
        microbatches=4,
        iterations=2,
        model="mlp",
        backend="single",
        microbatch_size=8,
        model_width=32,
        profile_repeats=3,
    )
    v = run_validation(cfg)
    assert v.report["action_errors"]["compared"] > 0
    assert all(isinstance(s.start, float) and isinstance(s.end, float) for s in v.measured.spans)


def test_cli_profile_then_simulate_with_it(tmp_path, capsys):
    code = main(
        [
            "profile",
            "--model",
            "mlp",
            "--model-width",
            "32",
            "--microbatch-size",
            "8",
            "--backend",
            "single",
            "--repeats",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    prof = load_profile(tmp_path / "profile.json")
    assert prof.num_layers == 5 and prof.overhead_forward_s > 0
    assert all(la.forward_s > 0 and la.backward_s > 0 for la in prof.layers)
    code = main(
        [
            "simulate",
            "--strategy",
            "1f1b",
            "--stages",
            "2",
            "--profile",
            str(tmp_path / "profile.json"),
            "--hardware",
            str(tmp_path / "hardware.json"),
            "--out",
            str(tmp_path / "sim"),
            "--summary-only",
        ]
    )
    assert code == 0, capsys.readouterr().err
    # validate with that profile at another micro-batch size, or with none there: one line, before any measuring
    for profile, size, width, message in (
        (
            tmp_path / "profile.json",
            "16",
            "32",
            "was measured at micro-batch size 8, this run uses 16: pass --microbatch-size 8",
        ),
        (tmp_path / "none.json", "8", "32", "not found"),
        # a profile of another model size: its layers are not this model's
        (tmp_path / "profile.json", "8", "64", "measured on another model size"),
    ):
        code = main(
            [
                "validate",
                "--strategy",
                "1f1b",
                "--stages",
                "2",
                "--model",
                "mlp",
                "--model-width",
                width,
                "--microbatch-size",
                size,
                "--backend",
                "single",
                "--profile",
                str(profile),
                "--hardware",
                str(tmp_path / "hardware.json"),
                "--out",
                str(tmp_path / "v"),
            ]
        )
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    # a profile measured in one backend's runtime is not another's (its per-pass overhead is the runtime's)
    code = main(
        [
            "validate",
            "--strategy",
            "1f1b",
            "--stages",
            "2",
            "--model",
            "mlp",
            "--model-width",
            "32",
            "--microbatch-size",
            "8",
            "--backend",
            "gloo",
            "--profile",
            str(tmp_path / "profile.json"),
            "--hardware",
            str(tmp_path / "hardware.json"),
            "--out",
            str(tmp_path / "v"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "was measured with --backend single" in err and len(err.strip().splitlines()) == 1, err
    # the profile (written for SGD) is priced with the optimizer the run uses
    from pipesim.validate import harness
    from pipesim.validate.stage import OptimizerConfig

    cfg = ValidateConfig(
        "1f1b",
        stages=2,
        microbatches=4,
        model="mlp",
        backend="single",
        microbatch_size=8,
        model_width=32,
        optimizer=OptimizerConfig(kind="adam"),
        profile_path=str(tmp_path / "profile.json"),
        hardware_path=str(tmp_path / "hardware.json"),
    )
    schedule = harness.build(cfg)
    prof, _ = harness._measurements(
        cfg, schedule, harness.torch_device("single"), harness.model_of(cfg), lambda msg: None
    )
    assert prof.optimizer == "adam" and load_profile(tmp_path / "profile.json").optimizer == "sgd"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["validate", "--strategy", "1f1b", "--model", "resnet"], "unknown model"),
        (["validate", "--strategy", "nope"], "unknown strategy"),
        (["validate", "--strategy", "1f1b", "--backend", "nccl"], "GPUs"),
        (["validate", "--strategy", "1f1b", "--stages", "9", "--backend", "single"], "stages"),
        # a micro-batch whose activations alone exceed memory: refused before its batch is built
        (
            ["validate", "--strategy", "1f1b", "--microbatch-size", "100000000", "--backend", "single"],
            "use a smaller --microbatch-size",
        ),
        (["profile", "--microbatch-size", "100000000", "--backend", "single"], "use a smaller --microbatch-size"),
    ],
)
def test_cli_validate_bad_input_exits_2_with_one_line(argv, message, capsys, tmp_path):
    code = main([*argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.multiprocess
def test_cli_validate_gloo_writes_report_overlay_and_trace(tmp_path, capsys):
    code = main(
        [
            "validate",
            "--strategy",
            "1f1b",
            "--stages",
            "2",
            "--microbatches",
            "4",
            "--model",
            "mlp",
            "--model-width",
            "32",
            "--microbatch-size",
            "8",
            "--iterations",
            "2",
            "--backend",
            "gloo",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads((tmp_path / "report.json").read_text())
    for key in REQUIRED:
        assert key in report
    assert report["backend"] == "gloo" and report["devices"] == 2
    assert report["weight_versions"]["match"]
    # the second of 2 iterations: F and B of 4 micro-batches and an update on each of 2 stages
    assert report["action_errors"]["compared"] == 2 * (2 * 4 + 1)
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert {"measured device 0", "simulated device 1"} <= names
    html = (tmp_path / "overlay.html").read_text()
    assert "d0 measured" in html and "d1 simulated" in html
    assert "iteration time" in out.out


def test_bench_validate_runs_every_executable_strategy():
    """`pipesim bench validate` without --strategies runs what real tensors
    can run, and nothing the runtime refuses (a refusal lost every row)."""
    from pipesim.experiments.bench.validate import default_strategies
    from pipesim.sim.strategies import get_strategy, strategy_names

    chosen = default_strategies()
    assert "tensor-parallel" not in chosen and {"gpipe", "1f1b", "spectrain", "avgpipe"} <= set(chosen)
    assert set(chosen) == {n for n in strategy_names() if get_strategy(n).executable}


def test_bench_validate_deepens_the_model_for_interleaved_stages():
    """4 stages of interleaved 1F1B are 8 virtual stages: the bench's model gets a layer for each."""
    from pipesim.experiments.bench.validate import _depth_for
    from pipesim.validate.models import build_model

    for name in ("mlp", "gpt-small"):
        default = build_model(name)
        assert _depth_for(name, 2) == default.config["depth"]  # already enough layers
        deep = _depth_for(name, 8)
        assert build_model(name, depth=deep).num_layers == 8


def test_bench_validate_prints_every_configuration_in_one_table():
    from pipesim.experiments.bench.validate import render

    def row(strategy, error):
        return {
            "strategy": strategy,
            "errors": [error],
            "error": error,
            "error_without_cpu_model": None,
            "start_error_p90": 0.04,
            "measured_s": 0.1,
            "predicted_s": 0.1 * (1 + error),
            "bubble_measured": 0.2,
            "bubble_predicted": 0.2,
        }

    def config(model, stages, rows):
        return {
            "model": model,
            "model_depth": 4,
            "stages": stages,
            "microbatch_size": 32,
            "microbatches": 8,
            "iterations": 4,
            "backend": "gloo",
            "link_latency_s": 3e-5,
            "link_bandwidth_Bps": 4e9,
            "update_bandwidth_Bps": 2e10,
            "rows": rows,
        }

    res = {
        "configs": [
            config("mlp", 2, [row("gpipe", -0.02), row("1f1b", -0.2)]),
            config("gpt-small", 4, [row("gpipe", 0.01), row("1f1b", -0.03)]),
        ],
        "median_abs_error": 0.025,
        "seconds": 60,
    }
    text = render(res)
    table = [line for line in text.splitlines() if line.startswith(("mlp  ", "gpt-small  "))]
    assert len(table) == 4 and "-20.0%" in table[1]
    assert "mlp, 2 stages: median |error| 11.0% (target 5%), worst 1f1b -20.0%, 1 of 2 within 15%" in text
    assert "gpt-small, 4 stages: median |error| 2.0%" in text
    assert "all: median |error| 2.5% (target 5%), worst 1f1b -20.0%, 3 of 4 within 15%" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategies", "tensor-parallel"], "cannot run tensor-parallel"),
        (
            ["--strategies", "interleaved-1f1b", "--model-depth", "1", "--repeats", "1"],
            "interleaved-1f1b: 4 stages need at least that many layers",
        ),
    ],
)
def test_bench_validate_refuses_before_measuring(argv, message, capsys, monkeypatch):
    """What `pipesim validate` refuses at once, its benchmark refuses before
    profiling the model too (it measured for seconds, then said so)."""
    from pipesim.validate import harness

    monkeypatch.setattr(harness, "profile", lambda *a, **k: pytest.fail("profiled before refusing"))
    code = main(["bench", "validate", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_bench_validate_takes_models_from_elsewhere_whole():
    """A model from elsewhere is one --model (its query holds commas); catalog names stay a list."""
    from pipesim.experiments.bench.validate import _models

    assert _models("mlp,gpt-small") == ["mlp", "gpt-small"]
    hf = "hf:resnet?depths=2,2,2,2&layer_type=basic"
    assert _models(hf) == [hf]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown model"):
        _models("mlp,resnet")


def test_bench_validate_reports_the_run_to_run_spread_and_what_moved():
    """--fresh repeats are separate measurements: the row says how far its
    error moved and whether the prediction or the measurement moved it, and
    a model from elsewhere is held to its own targets (10%, 20%)."""
    from pipesim.experiments.bench.validate import TARGETS, _failed_row, _row, render

    def report(measured, predicted, at_speed=None):
        at_speed = measured if at_speed is None else at_speed
        return {
            "iteration_time_error": (predicted - measured) / measured,
            "iteration_time_measured_s": measured,
            "iteration_time_predicted_s": predicted,
            "iteration_time_error_at_run_speed": (at_speed - measured) / measured,
            "pass_time_ratio": at_speed / predicted,
            "action_errors": {"start_error_fraction_of_makespan": {"p90": 0.03}},
            "bubble_fraction_measured": 0.1,
            "bubble_fraction_predicted": 0.1,
        }

    steady = _row("1f1b", [report(1.0, 1.0), report(1.0, 1.03, 1.01), report(1.0, 0.99)])
    assert steady["spread_at_run_speed"] == pytest.approx(0.01)
    assert steady["spread"] == pytest.approx(0.04) and steady["measured_spread"] == 0
    assert steady["predicted_spread"] == pytest.approx(0.04)
    jumpy = _row("gpipe", [report(1.0, 1.0), report(1.2, 1.0), report(1.0, 1.0)])
    assert jumpy["predicted_spread"] == 0 and jumpy["measured_spread"] == pytest.approx(0.2)
    model = "hf:gpt2?n_layer=4&seq_len=64"
    config = {
        "model": model,
        "model_depth": None,
        "stages": 2,
        "microbatch_size": 8,
        "microbatches": 8,
        "iterations": 8,
        "backend": "gloo",
        "fresh": True,
        "target_median": TARGETS["elsewhere"][0],
        "target_each": TARGETS["elsewhere"][1],
        "link_latency_s": 1e-4,
        "link_bandwidth_Bps": 4e9,
        "update_bandwidth_Bps": 1e10,
        "rows": [steady, jumpy, _failed_row("avgpipe", "rank 1 failed: worker died without raising (SIGKILL)")],
    }
    text = render({"configs": [config], "median_abs_error": 0.0, "seconds": 1})
    assert "avgpipe            failed: rank 1 failed: worker died" in text
    assert "2 of 3 within 20% (avgpipe failed)" in text
    assert f"#1 = {model}, 2 stages" in text and "measured afresh every run" in text
    assert "(target 10%)" in text and "within 20%" in text
    assert (
        "widest spread 16.7 points (gpipe: prediction moved 0.0%, measurement 20.0%), 1 of 2 within 5 points; "
        "at the run's pass speed, widest 1.0 points (1f1b), 2 of 2 within 5" in text
    )
    # each strategy's runs, at the run's pass speed too, and how fast its passes ran
    assert "  1f1b               +0.0% +3.0% -1.0% (4.0)" in text
    assert "| +0.0% +1.0% +0.0% (1.0)" in text and "| x1.000 x0.981 x1.010" in text

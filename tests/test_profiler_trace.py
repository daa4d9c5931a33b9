"""``pipesim validate --profiler-trace``: a Kineto trace per rank, every action
labelled in the grammar :mod:`pipesim.validate.runtime` documents."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter

import pytest
from torch.distributed.pipelining.schedules import _Action

from pipesim.experiments.cli import main
from pipesim.sim.ir.core import COMPUTE_OPS, TORCH_OPS, Action, parse_action
from pipesim.sim.strategies import ScheduleSpec, build_schedule, get_strategy, strategy_names, strategy_options
from pipesim.validate.executor import compiled, profiler_label
from pipesim.validate.harness import ValidateConfig, build

#: The label grammar, as the runtime's module doc states it.
LABEL = re.compile(r"^(?:PP:(?P<torch>\d+[A-Z_]+\d*)(?: pipesim:(?P<full>\S+))?|pipesim:(?P<own>\S+))$")

SMALL = ["--microbatches", "4", "--model", "mlp", "--model-width", "32", "--microbatch-size", "8", "--iterations", "2"]


def parse_label(label: str) -> Action | None:
    """The action a label names; None for an event that is not one of pipesim's
    (torch's own annotations, e.g. ``gloo:send``)."""
    m = LABEL.match(label)
    if m is None:
        return None
    if m["own"]:
        a = parse_action(m["own"])
        assert a.op not in TORCH_OPS, label
        return a
    torch_action = _Action.from_str(m["torch"])  # torch's own parser reads the PP part
    assert str(torch_action) == m["torch"], label
    if m["full"]:
        a = parse_action(m["full"])
        assert (a.replica, a.version, a.distance) != (0, None, 0), f"{label}: the pipesim part says nothing more"
    else:
        a = parse_action(m["torch"])
    assert (torch_action.stage_index, torch_action.computation_type.value, torch_action.microbatch_index) == (
        a.stage,
        a.op.value,
        a.microbatch,
    ), label
    return a


def read_trace(path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def labelled(trace: dict) -> list[Action]:
    """The actions of a trace's user annotations, in trace order."""
    events = sorted(
        (e for e in trace["traceEvents"] if e.get("cat") == "user_annotation" and e.get("ph") == "X"),
        key=lambda e: e["ts"],
    )
    return [a for a in (parse_label(e["name"]) for e in events) if a is not None]


@pytest.mark.parametrize("strategy", [n for n in strategy_names() if get_strategy(n).executable])
def test_every_executed_action_has_a_label_that_reads_back(strategy):
    """Every action the walker executes, for every strategy validate runs
    (width 2, so replicas are named): its label parses back to the action."""
    width = 2 if "width" in strategy_options(strategy) else 1
    schedule = build_schedule(ScheduleSpec(strategy=strategy, stages=2, microbatches=4, iterations=2, width=width))
    seen = 0
    for prog in compiled(schedule):
        for posts, a, _, _ in prog:
            for x in [p for p, _ in posts] + ([a] if a is not None else []):
                label = profiler_label(x)
                assert LABEL.match(label), label
                assert parse_label(label) == x, label
                seen += 1
    assert seen


@pytest.mark.multiprocess
def test_gloo_run_writes_a_labelled_kineto_trace_per_rank(tmp_path, capsys):
    code = main(
        ["validate", "--strategy", "1f1b", "--stages", "2", *SMALL, "--backend", "gloo", "--profiler-trace"]
        + ["--out", str(tmp_path)]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    folder = tmp_path / "profiler"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["profiler_trace"] == str(folder)
    assert str(folder) in out.out and "rank0.json.gz, rank1.json.gz" in out.out
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.json.gz", "rank1.json.gz"]
    schedule = build(ValidateConfig(strategy="1f1b", stages=2, microbatches=4, iterations=2))
    m = schedule.num_microbatches
    for rank in range(2):
        trace = read_trace(folder / f"rank{rank}.json.gz")
        assert trace["schemaVersion"] == 1 and isinstance(trace["traceEvents"], list)
        info = trace["distributedInfo"]
        assert (info["rank"], info["world_size"], info["backend"]) == (rank, 2, "gloo")
        assert trace["pipesimInfo"]["devices"] == [rank]
        actions = labelled(trace)
        computed = [a for a in actions if a.op in COMPUTE_OPS]
        expected = [a for a in schedule.programs[rank] if a.op in COMPUTE_OPS]
        # every compute action once, in program order (so once per step)
        assert computed == expected
        steps = Counter(a.microbatch // m if a.microbatch is not None else a.version - 1 for a in computed)
        assert steps == Counter({0: 2 * m + 1, 1: 2 * m + 1})
        # the transfers are labelled too, as torch names them
        sends = [a for a in actions if a.op.value.startswith(("SEND", "RECV"))]
        assert len(sends) == 2 * m * schedule.num_iterations


def test_single_device_mode_traces_every_device_in_one_file(tmp_path, capsys):
    """--backend single: one trace, rank0.json.gz, with the distributedInfo
    torch would write for a world of one; pipesim's spelling where torch's
    cannot say it (SpecTrain's prediction distance)."""
    code = main(
        ["validate", "--strategy", "spectrain", "--stages", "2", *SMALL, "--backend", "single", "--profiler-trace"]
        + ["--out", str(tmp_path)]
    )
    assert code == 0, capsys.readouterr().err
    trace = read_trace(tmp_path / "profiler" / "rank0.json.gz")
    assert trace["distributedInfo"] == {"backend": "single", "rank": 0, "world_size": 1}
    schedule = build(ValidateConfig(strategy="spectrain", stages=2, microbatches=4, iterations=2))
    computed = Counter(a for a in labelled(trace) if a.op in COMPUTE_OPS)
    assert computed == Counter(a for prog in schedule.programs for a in prog if a.op in COMPUTE_OPS)
    assert any(a.distance for a in computed)


def test_without_the_option_nothing_is_profiled(tmp_path, capsys):
    code = main(
        ["validate", "--strategy", "1f1b", "--stages", "2", *SMALL, "--backend", "single"] + ["--out", str(tmp_path)]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert not (tmp_path / "profiler").exists()
    assert "profiler_trace" not in json.loads((tmp_path / "report.json").read_text())
    assert "profiler" not in out.out

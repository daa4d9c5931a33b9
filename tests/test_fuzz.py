"""Hostile input at every entry point: random configurations, argument lists,
files and corrupted schedules.

Every outcome is classified as a success or a clean rejection: an
:class:`~pipesim.sim.errors.InputError` with a one-line message (at the
command line: exit code 2 and one ``error:`` line, raised as an InputError or
an argument-parser error). Anything else fails the test: another exception, a
hang (sizes stay small; hypothesis has a deadline and pytest a timeout), or an
impossible figure (a negative or non-finite time, a bubble fraction outside
[0, 1], memory that does not add up, a makespan of 0 with work to do, a
summary that is not byte-identical when the same input runs again).

The default run draws ``conftest.FUZZ_EXAMPLES`` examples in all (a few
seconds); ``pytest tests/test_fuzz.py --fuzz-examples 20000`` runs a longer
campaign.
"""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipesim.experiments import cli
from pipesim.experiments.cliargs import EXIT_USAGE
from pipesim.sim import api
from pipesim.sim.engine import size
from pipesim.sim.engine.core import simulate as run_engine
from pipesim.sim.engine.metrics import dumps, summarize
from pipesim.sim.errors import InputError
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.ir.checks import validate
from pipesim.sim.ir.core import to_csv
from pipesim.sim.ir.lowering import lower
from pipesim.sim.partition.split import stage_costs_uniform
from pipesim.sim.strategies import ScheduleSpec, build_schedule, strategy_names, strategy_options
from pipesim.sim.workloads.catalog import model_profile
from pipesim.sim.workloads.readers import load_profile

pytestmark = pytest.mark.timeout(240)


def _settings(max_examples: int):
    return settings(
        max_examples=max_examples,
        deadline=10_000,  # ms; generous on a shared 2-core machine, but a hang is caught
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    )


# --- classification -------------------------------------------------------------


def attempt(fn):
    """``fn()``'s result, or None when it rejects its input cleanly."""
    try:
        return fn()
    except InputError as e:
        assert_one_line(str(e))
        return None


def assert_one_line(msg: str) -> None:
    assert msg.strip(), "an empty error message"
    assert "\n" not in msg.strip(), f"a message of several lines: {msg!r}"


def check_summary(s: dict) -> None:
    """No figure in ``summary.json`` is impossible."""
    makespan = s["makespan_s"]
    for key in ("makespan_s", "iteration_time_s", "throughput_samples_per_s"):
        assert math.isfinite(s[key]) and s[key] >= 0, (key, s[key])
    assert 0.0 <= s["bubble_fraction"] <= 1.0, s["bubble_fraction"]
    work = any(st_["forward_s"] > 0 or st_["backward_s"] > 0 for st_ in s["stages_info"])
    if work and s["compute_actions"]:
        assert makespan > 0, "a makespan of 0 with work to do"
    for dev in s["devices"]:
        assert 0.0 <= dev["bubble_fraction"] <= 1.0, dev
        assert 0.0 <= dev["busy_s"] <= makespan * (1 + 1e-9) + 1e-12, (dev["busy_s"], makespan)
        assert math.isfinite(dev["peak_memory_time_s"])
        parts = dev["memory_breakdown"]
        assert all(isinstance(v, int) and v >= 0 for v in parts.values()), parts
        assert sum(parts.values()) == dev["peak_memory_bytes"] >= 0, dev
    for st_ in s["stages_info"]:
        assert st_["weight_versions"] >= 1
        assert 0 <= st_["staleness_mean"] <= st_["staleness_max"], st_
    assert all(v >= 0 for v in s["link_bytes"].values())
    assert s["peak_memory_bytes_max"] == max(d["peak_memory_bytes"] for d in s["devices"])


def check_result(result, again) -> None:
    """Possible figures, and the same document when the same input runs again."""
    summary = summarize(result)
    check_summary(summary)
    assert dumps(summarize(again)) == dumps(summary), "the same input gave a different summary"


# --- library configurations --------------------------------------------------------

#: Values of the wrong type or out of range for most arguments (each use must be refused by name or work).
WEIRD = st.sampled_from([0, -1, True, False, None, "2", 2.0, 1.5, math.nan, math.inf, 10**30, [], (1,), "", "x"])

#: Plausible values of each strategy option (a strategy gets only the ones it takes).
OPTION_VALUES = {
    "width": st.integers(1, 2),
    "chunks": st.integers(1, 2),
    "stashing": st.booleans(),
    "alpha": st.floats(0.01, 1.0),
    "tau": st.integers(1, 3),
    "advance": st.integers(0, 3),
    "placement": st.sampled_from(["shared", "disjoint"]),
    "flushes": st.integers(1, 3),  # more than m is rejected
    "replicas": st.lists(st.integers(1, 3), min_size=1, max_size=4).map(tuple),  # a wrong length is rejected
}
#: Hardware with room for every plausible spec, and some without.
HARDWARE = ["ideal", "dgx-h100-x2", "dgx1-v100-x4", "pcie-4gpu"]
MODELS = ["uniform", "vgg16", "gnmt", "gpt-1.3b"]


@st.composite
def _configuration(draw):
    """Arguments of ``api.simulate``: a plausible spec and machine, then up to
    two arguments (spec field, option or keyword) replaced by hostile values."""
    name = draw(st.sampled_from(strategy_names()))
    fields = {
        "strategy": name,
        "stages": draw(st.integers(1, 4)),
        "microbatches": draw(st.integers(1, 6)),
        "iterations": draw(st.integers(1, 2)),
        "optimizer": draw(st.sampled_from(["sgd", "adam"])),
    }
    for option in strategy_options(name):
        if draw(st.booleans()):
            fields[option] = draw(OPTION_VALUES[option])
    kwargs = {
        "model": draw(st.sampled_from(MODELS)),
        "hardware": draw(st.sampled_from(HARDWARE)),
        "microbatch_size": draw(st.one_of(st.none(), st.integers(1, 64))),
        "recv_lookahead": draw(st.integers(0, 3)),
    }
    targets = ["strategy", "stages", "microbatches", "iterations", "optimizer", *OPTION_VALUES, *kwargs]
    for target in draw(st.lists(st.sampled_from(targets), max_size=2, unique=True)):
        # small, or absurd enough for the size limit on any machine: nothing in between runs for minutes
        value = draw(st.one_of(WEIRD, st.integers(-2, 12), st.sampled_from([10**15, 2**63, "bogus", "pcie-4gpu-x2"])))
        (kwargs if target in kwargs else fields)[target] = value
    return ScheduleSpec(**fields), kwargs


def test_random_library_configurations(fuzz_examples):
    @_settings(fuzz_examples(0.3))
    @given(_configuration())
    def run(config):
        spec, kwargs = config
        result = attempt(lambda: api.simulate(spec, **kwargs))
        if result is not None:
            check_result(result, api.simulate(spec, **kwargs))

    run()


# --- the command line -----------------------------------------------------------------

#: Hostile and plausible values per flag, for the flags added to a plausible command line.
_FLAGS = {
    "--strategy": [*strategy_names(), "nope", ""],
    "--stages": ["1", "2", "3", "0", "-1", "x", "2.5", "1" + "0" * 15],
    "--microbatches": ["1", "2", "4", "8", "0", "x", "1" + "0" * 15],
    "--iterations": ["1", "2", "0", "x", "1" + "0" * 15],
    "--width": ["1", "2", "0", "1" + "0" * 15],
    "--chunks": ["1", "2", "3", "0", "1" + "0" * 15],
    "--alpha": ["0.5", "1", "0", "2", "nan", "inf", "-1", "x"],
    "--tau": ["1", "2", "0"],
    "--advance": ["0", "1", "3", "-1"],
    "--placement": ["shared", "disjoint", "ring"],
    "--recv-lookahead": ["0", "1", "4", "-1", "x"],
    "--microbatch-size": ["1", "8", "0", "1" + "0" * 20],
    "--model": ["uniform", "vgg16", "gnmt", "nope"],
    "--hardware": ["ideal", "pcie-4gpu", "dgx-h100", "dgx1-v100-x4", "nope", "pcie-4gpu-x2"],
    "--format": ["torch-csv", "csv", "text", "xml"],
    "--devices": ["1", "2", "4", "0"],
}
_SWITCHES = ["--no-stashing", "--json", "--summary-only", "--lowered", "--list", "--bogus"]
_OPTION_FLAGS = {
    "width": ["1", "2"],
    "chunks": ["1", "2"],
    "alpha": ["0.5", "1"],
    "tau": ["1", "2"],
    "advance": ["0", "2"],
    "placement": ["shared", "disjoint"],
}


@pytest.fixture(scope="module")
def input_files(tmp_path_factory):
    """Files for --profile and --schedule: valid ones, corrupt ones, missing ones."""
    d = tmp_path_factory.mktemp("fuzz-inputs")
    (d / "good.json").write_text(
        json.dumps(model_profile("uniform", load_hardware("ideal").device, layers=3).to_json())
    )
    (d / "bad.json").write_text('{"name": "p", "layers": [{"name": "l", "forward_s": 1e300}]}')
    sched = build_schedule(ScheduleSpec("1f1b", 2, 2, iterations=2))
    (d / "good.csv").write_text(to_csv(sched))
    (d / "torch.csv").write_text(to_csv(sched, torch_only=True))
    (d / "bad.csv").write_text("0F0,0F0,0B0\n1F0,1X9\n")
    return {
        "--profile": [str(d / n) for n in ("good.json", "bad.json", "missing.json")],
        "--schedule": [str(d / n) for n in ("good.csv", "torch.csv", "bad.csv", "missing.csv")],
    }


@st.composite
def _command_line(draw, input_files):
    """A plausible ``simulate`` or ``schedule`` command line, then up to two
    flags with hostile or plausible values and up to two switches added."""
    command = draw(st.sampled_from(["simulate", "schedule"]))
    name = draw(st.sampled_from(strategy_names()))
    argv = [
        command,
        "--strategy",
        name,
        "--stages",
        str(draw(st.integers(1, 3))),
        "--microbatches",
        str(draw(st.integers(1, 6))),
    ]
    for option in strategy_options(name):
        if option in _OPTION_FLAGS and draw(st.booleans()):
            argv += [f"--{option}", draw(st.sampled_from(_OPTION_FLAGS[option]))]
    if command == "simulate":
        argv += ["--model", draw(st.sampled_from(MODELS)), "--hardware", draw(st.sampled_from(HARDWARE))]
    flags = {**_FLAGS, **input_files}
    for flag in draw(st.lists(st.sampled_from(sorted(flags)), max_size=2, unique=True)):
        argv += [flag, draw(st.sampled_from(flags[flag]))]
    argv += draw(st.lists(st.sampled_from(_SWITCHES), max_size=2, unique=True))
    return argv


def test_random_command_lines(fuzz_examples, input_files, tmp_path, capsys):
    # main() answers bad input with exit code 2 and lets every other
    # exception through with its traceback, so a crash fails the test here
    out = tmp_path / "out"

    def invoke(argv):
        code = cli.main(argv)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    @_settings(fuzz_examples(0.3))
    @given(_command_line(input_files))
    def run(argv):
        if argv[0] == "simulate":
            argv = [*argv, "--out", str(out)]
        code, stdout, stderr = invoke(argv)
        assert "Traceback" not in stderr, stderr
        if code == EXIT_USAGE:
            lines = stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), (argv, stderr)
            return
        assert code == 0, (argv, code, stderr)
        if argv[0] == "schedule":
            assert stdout.strip(), argv
            return
        summary = (out / "summary.json").read_bytes()
        check_summary(json.loads(summary))
        code, again, _ = invoke(argv)
        assert code == 0 and (out / "summary.json").read_bytes() == summary, argv
        if "--json" in argv:
            assert stdout.encode() == summary and again == stdout, argv

    run()


# --- profile and hardware files ------------------------------------------------------------

#: What a mutation writes in place of a value.
HOSTILE = st.sampled_from(
    [
        -1,
        0,
        1,
        0.5,
        1e-300,
        1e300,
        -1e300,
        2**53,
        2**53 + 1,
        2**63,
        2**70,
        10**400,
        math.inf,
        -math.inf,
        math.nan,
        True,
        False,
        None,
        "",
        "x",
        "inf",
        "1e3",
        [],
        {},
        [0, 1, 1],
    ]
)

_PROFILE = {
    "name": "p",
    "microbatch_size": 4,
    "optimizer": "adam",
    "notes": "n",
    "overhead": {"forward_s": 1e-5, "backward_s": 2e-5},
    "layers": [
        {
            "name": f"l{i}",
            "forward_s": 1e-3 * (i + 1),
            "backward_s": 2e-3 * (i + 1),
            "backward_input_s": 1e-3,
            "param_bytes": 2**20 * (i + 1),
            "activation_bytes": 2**16,
            "stash_bytes": 2**18,
        }
        for i in range(3)
    ],
}


def _paths(doc, prefix=()):
    """Every (path to a value) in a JSON document."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out += _paths(value, (*prefix, key))
    return out


@st.composite
def _mutated(draw, doc):
    """``doc`` with one to three values replaced, deleted, or joined by an unknown key."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        if not paths:
            break
        *parent_path, key = draw(st.sampled_from(paths))
        parent = doc
        for k in parent_path:
            parent = parent[k]
        how = draw(st.sampled_from(["replace", "replace", "delete", "unknown"]))
        value = copy.deepcopy(draw(HOSTILE))  # sampled_from hands out one shared [] or {}
        if how == "replace":
            parent[key] = value
        elif how == "delete":
            del parent[key]
        elif isinstance(parent, dict):
            parent["bogus_field"] = value
    return doc


def test_mutated_profile_and_hardware_files(fuzz_examples, tmp_path):
    hardware_docs = [load_hardware(n).to_json() for n in ("pcie-4gpu", "dgx1-v100", "dgx-h100-x2", "ideal")]
    # a measured CPU host: shared cores and their wake slice, transfer CPU costs, per-kernel bandwidths
    host = load_hardware("pcie-4gpu").to_json()
    hardware_docs.append(
        {
            **host,
            "device": {
                **host["device"],
                "update_bandwidth": 2e10,
                "predict_bandwidth": 3e10,
                "average_bandwidth": 1e10,
            },
            "cpu": {
                "cores": [0, 1, 0, 1],
                "send": {"fixed_s": 3e-5, "bytes_per_s": 3.5e9},
                "recv": {"fixed_s": 3e-5, "bytes_per_s": 6.7e9},
                "wake_slice_s": 0.002,
            },
        }
    )
    path = tmp_path / "input.json"

    @_settings(fuzz_examples(0.2))
    @given(
        which=st.sampled_from(["profile", "hardware"]),
        data=st.data(),
        strategy=st.sampled_from(["1f1b", "zb-h1", "spectrain", "avgpipe"]),
    )
    def run(which, data, strategy):
        doc = data.draw(_mutated(_PROFILE if which == "profile" else data.draw(st.sampled_from(hardware_docs))))
        path.write_text(json.dumps(doc))
        spec = ScheduleSpec(strategy, 2, 4)
        if which == "profile":
            prof = attempt(lambda: load_profile(path))
            hw = data.draw(st.sampled_from(["ideal", "pcie-4gpu"]))
            if prof is None:
                return

            def go():
                return api.simulate(spec, hardware=hw, profile=prof)
        else:
            hw = attempt(lambda: load_hardware(str(path)))
            model = data.draw(st.sampled_from(["uniform", "gpt-1.3b"]))
            if hw is None:
                return

            def go():
                return api.simulate(spec, model, hw)

        result = attempt(go)
        if result is not None:
            check_result(result, go())

    run()


# --- corrupted schedules -----------------------------------------------------------------


@st.composite
def _corrupted(draw):
    """A small valid schedule (lowered or not) with actions dropped, duplicated,
    swapped or moved to another device."""
    strategy = draw(st.sampled_from(strategy_names()))
    p, m = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    sched = attempt(lambda: build_schedule(ScheduleSpec(strategy, p, m, iterations=draw(st.integers(1, 2)))))
    if sched is None:
        return None
    if draw(st.booleans()):
        sched = lower(sched)
    progs = [list(prog) for prog in sched.programs]
    for _ in range(draw(st.integers(0, 3))):  # none: the validator and engine must accept it
        dev = draw(st.integers(0, len(progs) - 1))
        prog = progs[dev]
        if not prog:
            continue
        i = draw(st.integers(0, len(prog) - 1))
        how = draw(st.sampled_from(["drop", "duplicate", "swap", "move"]))
        if how == "drop":
            del prog[i]
        elif how == "duplicate":
            prog.insert(draw(st.integers(0, len(prog))), prog[i])
        elif how == "swap":
            j = draw(st.integers(0, len(prog) - 1))
            prog[i], prog[j] = prog[j], prog[i]
        else:
            other = progs[draw(st.integers(0, len(progs) - 1))]
            other.insert(draw(st.integers(0, len(other))), prog.pop(i))
    return sched.with_programs(progs)


def test_corrupted_schedules(fuzz_examples):
    ideal = load_hardware("ideal")

    @_settings(fuzz_examples(0.2))
    @given(_corrupted())
    def run(bad):
        if bad is None:
            return
        checked = _validates(bad)

        def go():
            return run_engine(bad, stage_costs_uniform(bad.num_stages), ideal)

        result = attempt(go)
        # the validator's zero-time dry run and the engine agree on what can run
        assert checked == (result is not None), (checked, [[str(a) for a in p] for p in bad.programs])
        if result is not None:
            check_result(result, go())

    run()


def _validates(schedule) -> bool:
    """Whether ``validate`` accepts ``schedule`` (it returns None either way)."""
    try:
        validate(schedule)
    except InputError as e:
        assert_one_line(str(e))
        return False
    return True


# --- explicit cases of the issue ----------------------------------------------------------


@pytest.mark.parametrize("value", ["1", None, 1.0, True, -1])
def test_recv_lookahead_is_checked_at_both_entry_points(value):
    from pipesim.sim.ir.core import ScheduleError

    spec = ScheduleSpec("1f1b", 2, 4)
    with pytest.raises(ScheduleError, match="recv_lookahead must be an integer >= 0"):
        api.simulate(spec, recv_lookahead=value)  # was a TypeError deep in the lowering
    sched = build_schedule(spec)
    with pytest.raises(ScheduleError, match="recv_lookahead must be an integer >= 0"):
        run_engine(sched, stage_costs_uniform(2), load_hardware("ideal"), recv_lookahead=value)


@pytest.mark.parametrize("value", ["print", 3, [len]])
def test_on_spans_is_checked_at_every_entry_point(value):
    spec = ScheduleSpec("1f1b", 2, 4)
    with pytest.raises(InputError, match="on_spans must be a callable"):
        api.simulate(spec, on_spans=value)  # not a TypeError once the run is over
    sched = build_schedule(spec)
    with pytest.raises(InputError, match="on_spans must be a callable"):
        run_engine(sched, stage_costs_uniform(2), load_hardware("ideal"), on_spans=value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"microbatch_size": 0}, "microbatch_size must be an integer >= 1"),
        ({"microbatch_size": "8"}, "microbatch_size must be an integer >= 1"),
        ({"optimizer": "lamb"}, "optimizer must be one of"),
        ({"optimizer": ["sgd"]}, "optimizer must be one of"),
        ({"check": "yes"}, "check (validate the schedule first) must be True or False"),
        ({"stage_costs": "fast"}, "stage_costs must be a sequence"),
        ({"hardware": "ideal"}, "hardware must be a pipesim.sim.hardware.machines.Hardware"),
        ({"schedule": None}, "schedule must be a pipesim.sim.ir.core.Schedule"),
    ],
)
def test_engine_arguments_are_checked_up_front(kwargs, fragment):
    args = {
        "schedule": build_schedule(ScheduleSpec("1f1b", 2, 4)),
        "stage_costs": stage_costs_uniform(2),
        "hardware": load_hardware("ideal"),
    }
    for key in ("schedule", "stage_costs", "hardware"):
        if key in kwargs:
            args[key] = kwargs.pop(key)
    with pytest.raises(InputError) as e:
        run_engine(args.pop("schedule"), args.pop("stage_costs"), args.pop("hardware"), **kwargs)
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: api.simulate("1f1b"), "spec must be a ScheduleSpec"),
        (lambda: api.simulate(ScheduleSpec("1f1b", 2, 4), model=3), "model must be a catalog model name"),
        (lambda: api.simulate(ScheduleSpec("1f1b", 2, 4), profile={}), "profile must be a"),
        (
            lambda: api.simulate(ScheduleSpec("1f1b", 2, 4), "gpt-1.3b", microbatch_size=2**31 + 1),
            "microbatch_size must be an integer >= 1 and <= 2**31",
        ),
    ],
)
def test_library_arguments_are_checked_up_front(call, fragment):
    with pytest.raises(InputError) as e:
        call()
    assert fragment in str(e.value)


def test_size_limit_comes_from_available_memory(monkeypatch):
    if os.path.exists("/proc/meminfo"):
        assert 2**20 < size.available_memory_bytes() < 2**60  # MemAvailable, in bytes
    spec = ScheduleSpec("interleaved-1f1b", 2, 4, iterations=3, width=2, chunks=3)
    assert size.estimate_passes(spec) == 2 * 3 * 4 * 3 * 2  # stages x chunks x m x iterations x replicas
    assert size.estimate_passes(ScheduleSpec("data-parallel", 4, 8, iterations=2)) == 16
    assert size.estimate_passes(ScheduleSpec("1f1b", "2", 4)) is None
    assert size.estimate_devices(spec) == 4  # 2 stages x width 2
    monkeypatch.setattr(size, "available_memory_bytes", lambda: 147 * size.BYTES_PER_PASS)
    with pytest.raises(size.SizeError, match="144 stage passes") as e:  # 144 passes and 4 devices: 148
        api.simulate(spec)
    assert "at most 143 passes on its 4 devices" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setattr(size, "available_memory_bytes", lambda: 148 * size.BYTES_PER_PASS)
    assert api.simulate(spec).schedule.num_devices == 4
    # few passes on an enormous replica count: refused by its devices, before anything is built
    wide = ScheduleSpec("gpipe", 2, 1, replicas=(10**12, 1))
    assert size.estimate_devices(wide) == 10**12 + 1
    with pytest.raises(size.SizeError, match="with 1,000,000,000,001 devices would need"):
        size.check_size(wide)
    # as many devices as passes, too many for memory: refused by the devices, no negative budget
    with pytest.raises(size.SizeError, match="with 1,000,000,000 devices would need"):
        size.check_size(ScheduleSpec("1f1b", 10**9, 1))
    # counting a huge spec's collectives lists nothing (a sweep counts every point's work first)
    assert size.estimate_work(ScheduleSpec("pipedream", 10**12, 1)) == 10**12

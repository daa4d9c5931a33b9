"""``pipesim sweep``: the grid, skipped points, identical results on any executor, one-line errors."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import pytest

from pipesim.experiments import sweep
from pipesim.experiments.cli import main
from pipesim.sim.errors import InputError
from pipesim.sim.strategies import ScheduleSpec

#: A small grid with a point its strategy rejects (2BW needs m >= p) and
#: options that only some strategies take.
SMALL = {
    "strategy": ("gpipe", "pipedream-2bw", "interleaved-1f1b", "avgpipe"),
    "stages": (2, 4),
    "microbatches": (2, 4),
    "iterations": (2,),
    "width": (1, 2),
    "chunks": (2,),
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_values_are_read_by_the_field_type() -> None:
    assert sweep.parse_set(["chunks=2", "4"]) == ("chunks", (2, 4))
    assert sweep.parse_set(["alpha=0.5"]) == ("alpha", (0.5,))
    assert sweep.parse_set(["stashing=false", "true"]) == ("stashing", (False, True))
    assert sweep.parse_set(["placement=disjoint"]) == ("placement", ("disjoint",))
    assert sweep.parse_set(["microbatch_size=", "16", "none"]) == ("microbatch_size", (16, None))
    replicas = tuple[int, ...] | None
    assert sweep.parse_value("15,1", replicas, "replicas") == (15, 1)
    assert sweep.parse_value("4", replicas, "replicas") == (4,)
    assert sweep.parse_value("none", replicas, "replicas") is None
    assert sweep.check_value([15, 1], replicas, "replicas") == (15, 1)
    assert sweep.check_value(None, replicas, "replicas") is None
    assert sweep.check_value(1, float, "alpha") == 1.0
    for bad in (["x"], 1.5, "15,1", [True]):
        with pytest.raises(sweep.GridError, match="sweep axis replicas: value"):
            sweep.check_value(bad, replicas, "replicas")
    with pytest.raises(sweep.GridError, match="cannot read '15,x'"):
        sweep.parse_value("15,x", replicas, "replicas")
    with pytest.raises(sweep.GridError, match="as a finite number"):
        sweep.parse_value("nan", float, "alpha")


def test_library_grids_are_checked_like_the_command_line() -> None:
    assert sweep.make_grid({"stages": [4, 2, 4], "alpha": (1,)})["stages"] == (4, 2)
    assert sweep.make_grid({"alpha": (1,)})["alpha"] == (1.0,)
    for grid, message in (
        ({"stages": "4"}, "expected a sequence"),
        ({"stages": (4.5,)}, "not of type int"),
        ({"nope": (1,)}, "unknown sweep axis"),
        ({"strategy": ("nope",)}, "unknown strategy"),
    ):
        with pytest.raises(InputError, match=message):
            sweep.make_grid(grid)


def test_options_vary_only_the_strategies_that_take_them() -> None:
    points = sweep.expand(
        sweep.make_grid(
            {
                **SMALL,
                "strategy": ("gpipe", "interleaved-1f1b", "spectrain"),
                "stages": (2,),
                "microbatches": (4,),
                "chunks": (2, 3),
            }
        )
    )
    count = {name: sum(p["strategy"] == name for p in points) for name in ("gpipe", "interleaved-1f1b", "spectrain")}
    assert count == {"gpipe": 2, "interleaved-1f1b": 4, "spectrain": 1}
    assert all("width" not in p and "chunks" not in p for p in points if p["strategy"] == "spectrain")


@dataclass(frozen=True)
class _SpecWithReplicas(ScheduleSpec):
    """ScheduleSpec as it will be once it has a per-stage ``replicas`` field."""

    replicas: tuple[int, ...] | None = None


def test_a_new_spec_field_is_swept_with_no_change(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(sweep, "ScheduleSpec", _SpecWithReplicas)  # in this process: --workers 1
    grid_file = tmp_path / "grid.json"
    grid_file.write_text(json.dumps({"strategy": ["1f1b"], "stages": [2], "replicas": [[15, 1], [3, 1], None]}))
    code, _, err = run(
        capsys,
        "sweep",
        "--grid",
        str(grid_file),
        "--microbatches",
        "2",
        "--workers",
        "1",
        "--out",
        str(tmp_path / "file"),
    )
    assert code == 0, err
    doc = json.loads((tmp_path / "file" / "sweep.json").read_text())
    assert [p["replicas"] for p in doc["points"]] == [[15, 1], [3, 1], None]
    code, _, err = run(
        capsys,
        "sweep",
        "--strategy",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--set",
        "replicas=15,1",
        "3,1",
        "none",
        "--workers",
        "1",
        "--out",
        str(tmp_path / "flags"),
    )
    assert code == 0, err
    for name in ("sweep.json", "sweep.csv"):
        assert (tmp_path / "flags" / name).read_bytes() == (tmp_path / "file" / name).read_bytes()
    lines = (tmp_path / "flags" / "sweep.csv").read_text().splitlines()
    assert lines[0].startswith("strategy,stages,microbatches,iterations,replicas,model,hardware,status")
    assert [line.split(",")[4:6] for line in lines[1:]] == [['"15', '1"'], ['"3', '1"'], ["", "uniform"]]


def test_rejected_points_are_skipped_with_the_reason() -> None:
    doc = sweep.run_sweep(
        sweep.make_grid({"strategy": ("pipedream-2bw",), "stages": (4,), "microbatches": (2, 4), "iterations": (3,)}),
        workers=1,
        progress=False,
    )
    skipped, ran = doc["points"]
    assert skipped["status"] == "skipped" and "m=2 < p=4" in skipped["reason"]
    assert ran["status"] == "ok" and ran["staleness_max"] == 1 and ran["devices_count"] == 4
    assert (doc["simulated"], doc["skipped"]) == (1, 1)


def _outputs(doc: dict) -> tuple[str, str]:
    return sweep.to_json(doc), sweep.to_csv(doc)


@pytest.mark.multiprocess
def test_one_two_and_three_workers_give_identical_outputs() -> None:
    grid = sweep.make_grid(SMALL)
    one = sweep.run_sweep(grid, workers=1, progress=False)
    for workers in (2, 3):
        assert _outputs(sweep.run_sweep(grid, workers=workers, progress=False)) == _outputs(one)
    assert [(p["strategy"], p["stages"], p["microbatches"]) for p in one["points"]] == [
        (p["strategy"], p["stages"], p["microbatches"]) for p in sweep.expand(grid)
    ]
    assert one["skipped"] and one["simulated"]


@pytest.mark.multiprocess
def test_ray_gives_the_local_results() -> None:
    ray = pytest.importorskip("ray")
    grid = sweep.make_grid(SMALL)
    local = sweep.run_sweep(grid, workers=1, progress=False)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        on_ray = sweep.run_sweep(grid, ray="auto", progress=False)
        assert ray.is_initialized()  # a Ray the caller started is left running
    finally:
        ray.shutdown()
    assert _outputs(on_ray) == _outputs(local)


def test_cli_writes_table_csv_and_figure(tmp_path, capsys) -> None:
    code, out, err = run(
        capsys,
        "sweep",
        "--strategy",
        "gpipe",
        "1f1b",
        "--model",
        "bert-large",
        "vgg16",
        "--hardware",
        "pcie-4gpu",
        "--stages",
        "4",
        "--microbatches",
        "4",
        "64",
        "--iterations",
        "1",
        "--workers",
        "1",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    assert "8 points: 8 simulated, 0 skipped, 3 out of memory" in out
    assert "fastest configuration that fits in memory" in out and "bert-large" in out
    rows = (tmp_path / "sweep.csv").read_text().splitlines()
    assert len(rows) == 9 and rows[1].startswith("gpipe,4,4,1,bert-large,pcie-4gpu,ok,")
    # plotly escapes non-ASCII text unless orjson is installed
    html = (tmp_path / "sweep.html").read_text().replace("\\u00d7", "×")
    assert "pipesim-sweep" in html and "× out of memory" in html and "fastest that fits" in html


def test_a_value_swept_as_none_is_spelled_none_in_the_console_and_empty_in_the_csv() -> None:
    doc = {
        "columns": ["strategy", "microbatch_size", "recompute"],
        "points": [
            {"strategy": "1f1b", "microbatch_size": None, "recompute": False},
            {"strategy": "1f1b", "microbatch_size": 2, "recompute": True},
        ],
    }
    axes = ["strategy", "microbatch_size", "recompute", "width"]  # width: not taken by these points
    assert [sweep.label(p, axes) for p in doc["points"]] == [
        "strategy=1f1b, microbatch_size=none, recompute=false",
        "strategy=1f1b, microbatch_size=2, recompute=true",
    ]
    assert sweep.to_csv(doc).splitlines()[1:] == ["1f1b,,false", "1f1b,2,true"]


def test_ray_missing_is_one_line(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    code, _, err = run(capsys, "sweep", "--ray", "auto", "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "pip install 'pipesim[ray]'" in err


@pytest.mark.parametrize("address", ["nonsense", "", "host:notaport", "host:70000", "ray://:10001"])
def test_a_malformed_ray_address_is_one_line(address, tmp_path, capsys) -> None:
    code, _, err = run(capsys, "sweep", "--ray", address, "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "--ray takes auto, local, HOST:PORT or ray://HOST:PORT" in err, err
    assert sweep.check_ray_address("ray://head:10001") == ("head", 10001)
    assert sweep.check_ray_address("[::1]:6379") == ("::1", 6379)
    assert sweep.check_ray_address("auto") is None and sweep.check_ray_address("local") is None


def test_an_unreachable_ray_address_is_refused_in_bounded_time(tmp_path, capsys) -> None:
    """Ray retries an address nobody answers on for minutes; pipesim asks
    the port first (port 1 on this machine refuses at once)."""
    pytest.importorskip("ray")
    code, _, err = run(capsys, "sweep", "--ray", "127.0.0.1:1", "--stages", "2", "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "cannot reach Ray at 127.0.0.1:1" in err, err


def test_ray_auto_checks_the_address_ray_address_names(tmp_path, capsys, monkeypatch) -> None:
    """--ray auto connects where RAY_ADDRESS says: a dead one is refused at
    once, as a dead --ray address is (Ray itself retried it for minutes)."""
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    code, _, err = run(capsys, "sweep", "--ray", "auto", "--stages", "2", "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "cannot reach Ray at 127.0.0.1:1" in err, err
    monkeypatch.setenv("RAY_ADDRESS", "nonsense")
    code, _, err = run(capsys, "sweep", "--ray", "auto", "--stages", "2", "--out", str(tmp_path))
    assert code == 2 and "RAY_ADDRESS takes HOST:PORT" in err, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--set", "chunks=x"], "chunks: cannot read 'x' as a whole number"),
        (["--set", "nope=1"], "unknown sweep axis 'nope'"),
        (["--set", "chunks"], "expected NAME=VALUE"),
        (["--set", "stashing=maybe"], "as true or false"),
        (["--strategy", "nope"], "unknown strategy 'nope'"),
        (["--model", "nope"], "unknown model 'nope'"),
        (["--hardware", "nope"], "unknown hardware 'nope'"),
        (["--stages", "0"], "must be >= 1"),
        (["--strategy", "gpipe", "--set", "chunks=2"], "chunks applies to none of the swept strategies"),
        (["--stages", "2", "--set", "stages=4"], "sweep axis stages is given twice"),
        # values no point could run are refused as a flag's would be, not skipped point by point
        (["--set", "microbatch_size=-1"], "sweep axis microbatch_size: microbatch_size must be an integer >= 1"),
        (["--set", "replicas=0,1"], "sweep axis replicas: replicas must give each stage a count >= 1"),
        (["--set", "placement=nope"], "sweep axis placement: placement must be one of shared, disjoint"),
        (["--set", "alpha=0"], "sweep axis alpha: alpha must be a number in (0, 1]"),
        (["--grid", "/nonexistent/grid.json"], "grid file /nonexistent/grid.json not found"),
        (["--workers", "2", "--ray", "auto"], "not allowed with"),
        (["--workers", "0"], "must be >= 1"),
    ],
)
def test_bad_grid_is_one_line_and_exit_2(argv, message, capsys, tmp_path) -> None:
    code, _, err = run(capsys, "sweep", *argv, "--out", str(tmp_path))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", "malformed JSON"),
        ("[1, 2]", "expected an object"),
        ('{"stages": 4}', "stages must be a list of values"),
        ('{"stages": ["4"]}', 'sweep axis stages: value "4" is not of type int'),
        ('{"alpha": [0.5, "x"]}', 'sweep axis alpha: value "x" is not of type float'),
        ('{"stages": []}', "sweep axis stages has no values"),
        ('{"frobs": [1]}', "unknown sweep axis 'frobs'"),
        ('{"stages": [4, -2]}', "sweep axis stages: stages must be >= 1, got -2"),
        # json would keep the last silently; an axis given twice is an error, as on the command line
        ('{"stages": [2], "microbatches": [4], "stages": [4]}', "the key 'stages' appears twice in one object"),
    ],
)
def test_bad_grid_file_is_one_line_and_exit_2(content, message, capsys, tmp_path) -> None:
    grid = tmp_path / "grid.json"
    grid.write_text(content)
    code, _, err = run(capsys, "sweep", "--grid", str(grid), "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_sweep_runs_pipedreams_measured_profiles() -> None:
    """The catalog's measured models (PipeDream's graph.txt profiles) sweep
    like the computed ones, each point costed from the profile."""
    grid = sweep.make_grid(
        {
            "strategy": ("1f1b",),
            "stages": (2, 4),
            "microbatches": (4,),
            "iterations": (1,),
            "model": ("pipedream-alexnet",),
            "hardware": ("pipedream-cluster-a",),
        }
    )
    doc = sweep.run_sweep(grid, workers=1, progress=False)
    assert [p["status"] for p in doc["points"]] == ["ok", "ok"]
    assert all(p["throughput_samples_per_s"] > 0 for p in doc["points"])


def test_a_reader_that_stops_early_loses_no_file(tmp_path) -> None:
    """``pipesim sweep ... | head -1``: the files are written before the
    first line is printed, so a pipe that closes after it loses none."""
    import subprocess

    cmd = (
        f"{sys.executable} -m pipesim.experiments.cli sweep --strategy 1f1b 1f1b --stages 2 --microbatches 4 "
        f"--iterations 1 --workers 1 --out {tmp_path / 'o'} | head -c 1"
    )
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in (tmp_path / "o").iterdir()} >= {"sweep.json", "sweep.csv", "sweep.html"}


def test_recomputation_is_a_sweep_axis() -> None:
    """``--set recompute=false true``: every backward re-runs its forward, so
    the stash shrinks to the layers' inputs and the passes take longer."""
    grid = sweep.make_grid(
        {
            "strategy": ("1f1b",),
            "stages": (4,),
            "microbatches": (8,),
            "iterations": (2,),
            "model": ("bert-large",),
            "hardware": ("pcie-4gpu",),
            "recompute": (False, True),
        }
    )
    assert "recompute" in sweep.columns(grid)
    plain, recomputed = sweep.run_sweep(grid, workers=1, progress=False)["points"]
    assert (plain["recompute"], recomputed["recompute"]) == (False, True)
    assert recomputed["peak_memory_bytes_max"] < plain["peak_memory_bytes_max"]
    assert recomputed["throughput_samples_per_s"] < plain["throughput_samples_per_s"]


def test_a_swept_optimizer_is_the_one_the_run_prices_and_records() -> None:
    """``optimizer=adam`` on an SGD model prices Adam's two moments (more
    memory); a model that trains with Adam records adam, not the spec's
    default, beside Adam's memory."""
    from pipesim.sim.api import simulate
    from pipesim.sim.engine.metrics import summarize

    grid = sweep.make_grid(
        {
            "strategy": ("1f1b",),
            "stages": (2,),
            "microbatches": (4,),
            "iterations": (1,),
            "model": ("vgg16",),
            "hardware": ("pcie-4gpu",),
            "optimizer": ("sgd", "adam"),
        }
    )
    sgd, adam = sweep.run_sweep(grid, workers=1, progress=False)["points"]
    assert adam["peak_memory_bytes_max"] > sgd["peak_memory_bytes_max"]
    summary = summarize(simulate(ScheduleSpec("1f1b", 2, 4), "bert-large", "pcie-4gpu"))
    assert summary["options"]["optimizer"] == summary["meta"]["optimizer"] == "adam"


def test_the_console_says_how_many_workers_ran(tmp_path, capsys) -> None:
    """A sweep starts no more processes than it has chunks of points, and says
    so when fewer than asked; its files are those of any other count."""
    assert sweep.local_workers(12, 50) == 12 and sweep.local_workers(12, 2) == 2 and sweep.local_workers(1, 8) == 1
    code, out, err = run(
        capsys,
        "sweep",
        "--strategy",
        "gpipe",
        "1f1b",
        "--stages",
        "2",
        "4",
        "--microbatches",
        "4",
        "8",
        "16",
        "--workers",
        "50",
        "--out",
        str(tmp_path / "many"),
    )
    assert code == 0, err
    assert "on 12 local worker(s) of the 50 asked for" in out
    code, _, err = run(
        capsys,
        "sweep",
        "--strategy",
        "gpipe",
        "1f1b",
        "--stages",
        "2",
        "4",
        "--microbatches",
        "4",
        "8",
        "16",
        "--workers",
        "1",
        "--out",
        str(tmp_path / "one"),
    )
    assert code == 0, err
    assert (tmp_path / "many" / "sweep.json").read_bytes() == (tmp_path / "one" / "sweep.json").read_bytes()

"""``pipesim trace import``: torch.profiler (Kineto) traces of pipeline runs.

The committed traces (tests/data/torch-pipelining-traces, written by its
generate.py from torch.distributed.pipelining itself) are imported and held
to the schedule they ran and to a bubble fraction computed here, straight
from the JSON, without the importer's code; bad input must fail in one line
naming the file; a user's own labels, a trace with no pipeline and a CUDA
trace are synthesized here.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.experiments.cli import main
from pipesim.sim.errors import InputError
from pipesim.sim.ir.core import PASS_OPS, UPDATE, B, F, I, W
from pipesim.validate.kineto import read_rank_trace, read_run
from pipesim.validate.traceimport import import_run, load_imported

DATA = Path(__file__).parent / "data" / "torch-pipelining-traces"
#: set -> (import keywords, ranks, stages, passes per (stage, micro-batch))
SETS = {
    "gpipe": ({}, 2, 2, "FB"),
    "1f1b": ({"schedule": "1f1b", "microbatches": 4}, 2, 2, "FB"),
    "interleaved-1f1b": ({}, 2, 4, "FB"),
    "zero-bubble": ({}, 2, 4, "FIW"),
}
M, STEPS = 4, 5
OP = {"F": F, "B": B, "I": I, "W": W}


def files(name: str) -> list[Path]:
    return sorted((DATA / name).glob("rank*.json.gz"))


@pytest.fixture(scope="module")
def imported():
    return {name: import_run(files(name), **kw) for name, (kw, *_rest) in SETS.items()}


# ---------------------------------------------------------------- committed sets


@pytest.mark.parametrize("name", list(SETS))
def test_every_action_of_the_schedule_is_found_exactly_once(imported, name) -> None:
    _, ranks, stages, ops = SETS[name]
    run = imported[name]
    assert run.found_pipeline and run.steps == STEPS and run.microbatches == M
    res = run.result
    assert res.schedule.num_devices == ranks and res.schedule.num_stages == stages
    passes = Counter((s.action.op, s.action.stage, s.action.microbatch) for s in res.spans if s.action.op in PASS_OPS)
    want = {(OP[o], k, mb) for k in range(stages) for mb in range(M * STEPS) for o in ops}
    assert set(passes) == want and set(passes.values()) == {1}
    # every compute action of the imported schedule has exactly one span, on its device
    spans = Counter((s.device, s.action) for s in res.by_stream()["compute"])
    scheduled = {(d, a) for d, prog in enumerate(res.schedule.programs) for a in prog if a.op in PASS_OPS | {UPDATE}}
    assert set(spans) == scheduled and set(spans.values()) == {1}
    assert not [w for w in run.warnings if "checks" in w], run.warnings  # the order passes pipesim's validator
    assert run.clock_offsets_s == [0.0] * ranks  # one host: the pairs agree with one clock


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_single_stage_schedules_run_in_pipesims_order(imported, name) -> None:
    from pipesim.sim.strategies import ScheduleSpec, build_schedule

    res = imported[name].result
    ref = build_schedule(ScheduleSpec(name, stages=SETS[name][1], microbatches=M, iterations=STEPS))
    for got, want in zip(res.schedule.programs, ref.programs, strict=True):
        assert [a for a in got if a.op in PASS_OPS] == [a for a in want if a.op in PASS_OPS]


def _raw_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


_LABEL = re.compile(r"PP:\d+[FBIW]\d+|(Forward|Backward) \d+")


def _labelled_busy(events: list[dict]) -> list[tuple[float, float]]:
    """A labelled pass runs from its label's start, or from the end of the
    last receive that ended inside it (torch waits for it there), to its end."""
    recv_ends = [e["ts"] + e["dur"] for e in events if e["name"] == "gloo:recv"]
    out = []
    for e in events:
        if e.get("cat") == "user_annotation" and _LABEL.fullmatch(e["name"]):
            s, t = e["ts"], e["ts"] + e["dur"]
            out.append((max([s] + [r for r in recv_ends if s < r <= t]), t))
    return out


_FORWARD_OPS = {"aten::linear", "aten::relu", "aten::mse_loss"}  # generate.py's model and loss


def _unlabelled_busy(events: list[dict]) -> list[tuple[float, float]]:
    """1F1B labels nothing: a pass is a run of the model's forward operators,
    or of autograd's, between communication operators."""
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]
    skip = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("Optimizer.")]
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"]))
    top, end = [], -1.0
    for e in ops:
        if e["ts"] + e["dur"] <= end:
            continue
        top.append(e)
        end = e["ts"] + e["dur"]
    out, kind = [], None
    for e in top:
        s, t = e["ts"], e["ts"] + e["dur"]
        if not any(a <= s <= b for a, b in steps) or any(a <= s <= b for a, b in skip):
            continue
        k = "B" if e["name"].startswith("autograd::") else "F" if e["name"] in _FORWARD_OPS else None
        if e["name"].startswith("c10d::"):
            kind = None
        if k is None:
            continue
        if k == kind:
            out[-1] = (out[-1][0], t)
        else:
            out.append((s, t))
        kind = k
    return out


@pytest.mark.parametrize("name", list(SETS))
def test_bubble_fraction_agrees_with_one_computed_from_the_raw_json(imported, name) -> None:
    busy_per_rank = []
    for path in files(name):
        events = _raw_events(path)
        busy = _unlabelled_busy(events) if name == "1f1b" else _labelled_busy(events)
        busy += [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("Optimizer.step#")]
        busy_per_rank.append(busy)
    lo = min(s for busy in busy_per_rank for s, _ in busy)
    hi = max(t for busy in busy_per_rank for _, t in busy)
    want = sum(1 - sum(t - s for s, t in busy) / (hi - lo) for busy in busy_per_rank) / len(busy_per_rank)
    from pipesim.sim.engine.metrics import summarize

    got = summarize(imported[name].result)["bubble_fraction"]
    assert abs(got - want) < 0.01, (got, want)


def test_per_stage_and_boundary_figures(imported) -> None:
    run = imported["interleaved-1f1b"]
    ops = {(s["stage"], s["op"]) for s in run.stage_times}
    assert {(k, o) for k in range(4) for o in ("F", "B", "UPDATE")} == ops
    assert all(s["count"] and 0 < s["p50"] <= s["p90"] for s in run.stage_times if s["op"] != "UPDATE")
    bounds = {(b["from_stage"], b["to_stage"], b["direction"]) for b in run.boundaries}
    assert bounds == {(k, k + 1, "F") for k in range(3)} | {(k + 1, k, "B") for k in range(3)}
    assert all(b["transfer_s"]["count"] == M * STEPS and b["wait_s"]["p50"] >= 0 for b in run.boundaries)
    for r in run.per_rank:
        assert 0 < r.compute_s <= r.span_s and r.communication_s > 0 and r.idle_s >= 0


# ---------------------------------------------------------------- outputs


def test_cli_writes_every_output_and_imported_json_round_trips(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code = main(["trace", "import", str(DATA / "zero-bubble"), "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    for f in ("summary.json", "timeline.html", "trace.json", "imported.json", "report.txt"):
        assert (out / f).stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["compute_actions"] == 2 * STEPS * (3 * 2 * M + 2) and 0 < summary["bubble_fraction"] < 1
    assert "largest bubble: device" in text and text.count("\n") < 60
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    first = (out / "imported.json").read_bytes()
    again = load_imported(out / "imported.json")
    from pipesim.sim.engine.metrics import summarize

    assert summarize(again.result) == summary
    assert again.result.schedule == import_run(files("zero-bubble")).result.schedule
    main(["trace", "import", str(DATA / "zero-bubble"), "--out", str(out)])
    capsys.readouterr()
    assert (out / "imported.json").read_bytes() == first  # the same run, the same bytes


def test_unlabelled_trace_needs_the_schedule_and_its_microbatches(tmp_path, capsys) -> None:
    code = main(["trace", "import", str(DATA / "1f1b"), "--schedule", "1f1b", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--microbatches" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- bad input


def _copy(src: Path, dst: Path) -> Path:
    shutil.copy(src, dst)
    return dst


def _write_json(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc, indent=2))
    return path


def _bad_inputs(tmp: Path) -> dict:
    g0, g1 = files("gpipe")
    text = gzip.open(g0, "rt").read()
    cut = tmp / "cut" / "rank0.json"
    cut.parent.mkdir()
    cut.write_text(text[: len(text) // 2])
    cutgz = tmp / "cutgz" / "rank0.json.gz"
    cutgz.parent.mkdir()
    cutgz.write_bytes(g0.read_bytes()[:5000])
    junk = tmp / "junk" / "rank0.json"
    junk.parent.mkdir()
    junk.write_text("not json at all\n")
    twice = tmp / "twice"
    twice.mkdir()
    later = tmp / "later"
    later.mkdir()
    doc = json.loads(gzip.open(g1, "rt").read())
    doc["baseTimeNanoseconds"] += 3600 * 10**9  # recorded an hour after rank 0
    nolabels = tmp / "nolabels"
    nolabels.mkdir()
    half = json.loads(text)
    half["traceEvents"] = [e for e in half["traceEvents"] if not re.fullmatch(r"(Forward|Backward) \d+", e["name"])]
    return {
        "truncated": ([cut, g1], "rank0.json", "truncated"),
        "truncated gzip": ([cutgz, g1], "rank0.json.gz", "gzip"),
        "not JSON": ([junk, g1], "rank0.json", "not a JSON object"),
        "rank missing": ([g0], "gpipe", "rank 1 of 2 missing"),
        "rank twice": ([g0, g1, _copy(g0, twice / "again-rank0.json.gz")], "again-rank0.json.gz", "rank 0 again"),
        "two runs (world size)": ([g0, files("1f1b")[1]], "rank1.json.gz", "another run"),
        "two runs (time)": ([g0, _write_json(later / "rank1.json", doc)], "rank1.json", "apart"),
        "no labels on one rank": ([_write_json(nolabels / "rank0.json", half), g1], "rank0.json", "no pipeline"),
    }


def test_bad_inputs_raise_one_line_naming_the_file(tmp_path) -> None:
    for case, (paths, named, says) in _bad_inputs(tmp_path).items():
        with pytest.raises(InputError) as err:
            import_run(paths)
        msg = str(err.value)
        assert named in msg and says in msg and "\n" not in msg, (case, msg)


def test_mapping_errors_are_one_line(tmp_path) -> None:
    with pytest.raises(InputError, match="named group") as err:
        import_run(files("gpipe"), mapping=r"fwd_(\d+)")
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="rank0.json.gz: no label matches") as err:
        import_run(files("gpipe"), mapping=r"mine_(?P<stage>\d+)(?P<op>F)(?P<microbatch>\d+)")


def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys) -> None:
    paths, named, says = _bad_inputs(tmp_path)["truncated"]
    code = main(["trace", "import", *map(str, paths), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and named in err and says in err, err
    code = main(["trace", "import", str(tmp_path / "nowhere.json"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "nowhere.json" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- synthesized traces


def _trace(rank: int, world: int, events: list[dict], **extra) -> dict:
    info = {"backend": "gloo", "rank": rank, "world_size": world, "pg_count": 1}
    info["pg_config"] = [{"pg_name": "0", "pg_size": world, "ranks": list(range(world))}]
    return {"distributedInfo": info, "baseTimeNanoseconds": 1_700_000_000 * 10**9, "traceEvents": events, **extra}


def _x(name: str, ts: float, dur: float, cat: str = "user_annotation", tid: int = 1, **args) -> dict:
    ev = {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}
    if args:
        ev["args"] = args
    return ev


def test_a_users_own_labels_through_a_mapping(tmp_path) -> None:
    # GPipe over 2 ranks, m = 2, labelled "fwd mb<i> s<k>" / "bwd ...", 1 ms a pass; no transfers recorded
    events = {0: [], 1: []}
    order = {0: ["fwd", "fwd", None, None, "bwd", "bwd"], 1: [None, "fwd", "fwd", "bwd", "bwd", None]}
    for rank, slots in order.items():
        seen = Counter()
        for t, kind in enumerate(slots):
            if kind:
                mb = seen[kind]
                seen[kind] += 1
                events[rank].append(_x(f"{kind} mb{mb} s{rank}", 1000.0 * t, 900.0))
    paths = [_write_json(tmp_path / f"run-rank{r}.json", {"traceEvents": events[r]}) for r in (0, 1)]
    run = import_run(paths, mapping=r"(?P<op>fwd|bwd) mb(?P<microbatch>\d+) s(?P<stage>\d+)")
    assert run.found_pipeline and run.source == "mapping" and run.microbatches == 2
    res = run.result
    assert [str(a) for a in res.schedule.programs[1] if a.op in PASS_OPS] == ["1F0@v0", "1F1@v0", "1B0@v0", "1B1@v0"]
    from pipesim.sim.engine.metrics import summarize

    s = summarize(res)
    assert s["compute_actions"] == 8 and s["bubble_fraction"] == pytest.approx(1 - 3.6 / 5.9)


def test_pipesims_own_labels_and_recorded_clock_offsets(tmp_path) -> None:
    """pipesim's runtime: ``PP:<torch> pipesim:<full>`` and ``pipesim:<own>``
    labels, ids global across iterations, a recorded clock offset. The
    import gives back the simulated timeline the labels were written from."""
    from pipesim.sim.api import simulate
    from pipesim.sim.ir.core import TORCH_OPS, format_action
    from pipesim.sim.strategies import ScheduleSpec

    sim = simulate(ScheduleSpec("1f1b", stages=2, microbatches=2, iterations=2))
    skew_us = 5000.0  # rank 1's clock runs 5 ms behind rank 0's
    events = {0: [], 1: []}
    for sp in sim.by_stream()["compute"]:
        a, shift = sp.action, -skew_us if sp.device else 0.0
        t0, t1 = 1e4 + sp.start * 1e6 + shift, 1e4 + sp.end * 1e6 + shift
        full, short = format_action(a), format_action(a, torch_only=True)
        label = f"PP:{short} pipesim:{full}" if a.op in TORCH_OPS else f"pipesim:{full}"
        if a.op is UPDATE:  # the uniform model's update takes no time: 1 µs, just before the next pass
            t0, t1 = t0 - 2, t0 - 1.2
        events[sp.device].append(_x(label, t0, (t1 - t0) * 0.8))
        for q in sim.schedule.programs[sp.device]:  # the transfers this pass sends, posted as it ends
            if q.op.value.startswith("SEND") and (q.stage, q.microbatch) == (a.stage, a.microbatch):
                if (q.op.value == "SEND_F") == (a.op is F):
                    post = t0 + (t1 - t0) * 0.8 + 10
                    events[sp.device] += [_x(f"PP:{format_action(q)}", post, 20.0)]
                    events[sp.device] += [_x("c10d::send", post + 2, 10.0, cat="cpu_op")]
    for sp in sim.by_stream()["recv"]:  # posted 100 µs before the data arrives, waited for until then
        shift = -skew_us if sp.device else 0.0
        at = 1e4 + sp.end * 1e6 + shift
        events[sp.device] += [
            _x(f"PP:{format_action(sp.action)}", at - 100, 20.0),
            _x("c10d::recv_", at - 98, 10.0, cat="cpu_op"),
            _x("gloo:recv", at - 95, 95.0),
        ]
    paths = []
    for r in (0, 1):
        doc = _trace(r, 2, events[r], pipesimInfo={"devices": [r], "clock_offset_ns": int(skew_us * 1e3) * r})
        paths.append(_write_json(tmp_path / f"rank{r}.json", doc))
    run = import_run(paths)
    assert run.source == "pipesim" and run.microbatches == 2 and run.steps == 2
    assert run.clock_offsets_s == [0.0, -0.005]
    res = run.result
    for got, want in zip(res.schedule.programs, sim.schedule.programs, strict=True):
        assert [a for a in got if a.op in PASS_OPS | {UPDATE}] == [a for a in want if a.op in PASS_OPS | {UPDATE}]
    want = {(s.device, s.action): s.start for s in sim.by_stream()["compute"] if s.action.op is not UPDATE}
    got = {(s.device, s.action): s.start for s in res.by_stream()["compute"] if s.action.op is not UPDATE}
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 1e-9 for k in want)  # rank 1's labels put back on rank 0's clock


def test_a_trace_without_a_pipeline_imports_with_per_rank_times(tmp_path, capsys) -> None:
    # data parallelism on 2 ranks: forward/backward operators, a gradient all-reduce, two steps
    paths = []
    for rank in range(2):
        evs = []
        for step in range(2):
            t = 10_000.0 * step
            evs += [
                _x(f"ProfilerStep#{step}", t, 9000.0),
                _x("aten::linear", t + 100, 2000.0, cat="cpu_op"),
                _x("aten::addmm", t + 200, 1500.0, cat="cpu_op"),  # nested: not counted twice
                _x("autograd::engine::evaluate_function: AddmmBackward0", t + 2500, 3000.0, cat="cpu_op"),
                _x("c10d::allreduce_", t + 6000, 100.0, cat="cpu_op"),
                _x("gloo:all_reduce", t + 6050, 1950.0),
            ]
        paths.append(_write_json(tmp_path / f"dp_rank{rank}.json", _trace(rank, 2, evs)))
    run = import_run(paths)
    assert not run.found_pipeline and run.result is None and run.steps == 2
    assert any("no pipeline actions" in w for w in run.warnings)
    for r in run.per_rank:
        assert r.compute_s == pytest.approx(0.010) and r.communication_s == pytest.approx(0.004)
        assert r.span_s == pytest.approx(0.018) and r.idle_s == pytest.approx(0.008)
    code = main(["trace", "import", *map(str, paths), "--out", str(tmp_path / "out")])
    assert code == 0 and "no pipeline actions found" in capsys.readouterr().out
    assert (tmp_path / "out" / "imported.json").exists() and not (tmp_path / "out" / "summary.json").exists()


def test_cuda_actions_take_their_kernels_times(tmp_path) -> None:
    """A CUDA trace: a pass's time is its kernels' (launched inside its
    range, matched by correlation id), a transfer's the NCCL kernels'."""
    corr = iter(range(1, 1000))
    per_rank = {0: [], 1: []}

    def launch(rank: int, name: str, at: float, k0: float, k1: float, tid: int = 1) -> None:
        c = next(corr)
        per_rank[rank].append(_x("cudaLaunchKernel", at, 5.0, cat="cuda_runtime", tid=tid, correlation=c))
        per_rank[rank].append(_x(name, k0, k1 - k0, cat="kernel", tid=7, correlation=c, stream=7, device=0))

    # rank 0: F0, send; rank 1: receive, F0, B0 (the last stage), send back; rank 0: receive, B0
    per_rank[0].append(_x("PP:0F0", 0.0, 100.0))
    launch(0, "gemm", 10.0, 200.0, 700.0)
    per_rank[0].append(_x("PP:0SEND_F0", 110.0, 20.0))
    launch(0, "ncclDevKernel_SendRecv", 115.0, 700.0, 900.0)
    per_rank[1].append(_x("PP:1RECV_F0", 0.0, 20.0))
    launch(1, "ncclDevKernel_SendRecv", 5.0, 100.0, 900.0)
    per_rank[1].append(_x("PP:1F0", 30.0, 100.0))
    launch(1, "gemm", 40.0, 900.0, 1400.0)
    per_rank[1].append(_x("PP:1B0", 140.0, 100.0))
    launch(1, "gemm_backward", 150.0, 1400.0, 2400.0, tid=2)  # from the autograd thread
    per_rank[1].append(_x("PP:1SEND_B0", 250.0, 20.0))
    launch(1, "ncclDevKernel_SendRecv", 255.0, 2400.0, 2500.0)
    per_rank[0].append(_x("PP:0RECV_B0", 140.0, 20.0))
    launch(0, "ncclDevKernel_SendRecv", 145.0, 950.0, 2500.0)
    per_rank[0].append(_x("PP:0B0", 170.0, 100.0))
    launch(0, "gemm_backward", 180.0, 2500.0, 3500.0)
    for at, total in ((50.0, 3 << 20), (190.0, 7 << 20), (300.0, 5 << 20)):  # the allocator's samples
        args = {"Device Type": 1, "Device Id": 0, "Total Allocated": total, "Bytes": 1}
        per_rank[0].append({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": at, "args": args})
    paths = [_write_json(tmp_path / f"rank{r}.json", _trace(r, 2, per_rank[r])) for r in (0, 1)]
    run = import_run(paths)
    assert run.device == "cuda" and run.found_pipeline
    got = {(s.device, str(s.action), s.stream): (round(s.start * 1e6), round(s.end * 1e6)) for s in run.result.spans}
    assert got[(0, "0F0@v0", "compute")] == (0, 500)
    assert got[(1, "1F0@v0", "compute")] == (700, 1200)
    assert got[(1, "1B0@v0", "compute")] == (1200, 2200)
    assert got[(0, "0B0@v0", "compute")] == (2300, 3300)
    # the activation: both ends posted at 100 (rank 1's kernel) .. done at 900, no wait
    assert got[(0, "0SEND_F0", "send")] == got[(1, "1RECV_F0", "recv")] == (500, 700)
    back = next(b for b in run.boundaries if b["direction"] == "B")
    assert back["wait_s"]["mean"] == pytest.approx(1450e-6)  # rank 0 posted at 950, rank 1 sent at 2400
    from pipesim.sim.engine.metrics import summarize

    devices = summarize(run.result)["devices"]
    assert [d["peak_memory_bytes"] for d in devices] == [7 << 20, 0]


def test_the_reader_streams_every_layout(tmp_path) -> None:
    """Kineto's pretty layout and a compact one read alike, event by event;
    a number cut at the window's edge is not misread."""
    from pipesim.validate import kineto

    evs = [_x(f"PP:0F{i}", 1000.0 * i, 900.0) for i in range(2000)] + [_x("aten::mm", 5.0, 1.0, cat="cpu_op")]
    doc = _trace(0, 1, evs)
    compact = _write_json(tmp_path / "rank0.json", doc)
    compact.write_text(json.dumps(doc, separators=(",", ":")))
    pretty = tmp_path / "pretty" / "rank0.json.gz"
    pretty.parent.mkdir()
    with gzip.open(pretty, "wt") as f:
        json.dump(doc, f, indent=4)
    old = kineto.CHUNK_CHARS
    kineto.CHUNK_CHARS = 777  # many window edges, inside strings and numbers
    try:
        a, b = read_rank_trace(compact), read_rank_trace(pretty)
    finally:
        kineto.CHUNK_CHARS = old
    for t in (a, b):
        assert t.rank == 0 and t.world_size == 1 and t.events_read == 2001
        assert [e.name for e in t.events if e.name.startswith("PP:")] == [f"PP:0F{i}" for i in range(2000)]
        assert t.events[-1].ts == 1999000.0 and len(t.ops) == 1
    seen = []
    read_run([pretty], progress=seen.append)
    assert sum(seen) == pretty.stat().st_size


def test_reading_in_child_processes_gives_the_same_traces(tmp_path) -> None:
    one, two = read_run(files("gpipe"), workers=1), read_run(files("gpipe"), workers=2)
    assert [t.events for t in one] == [t.events for t in two]
    assert [list(t.ops.ts) for t in one] == [list(t.ops.ts) for t in two]
    paths, named, says = _bad_inputs(tmp_path)["truncated"]
    with pytest.raises(InputError, match=says) as err:  # raised in the child, raised here as it was
        read_run(paths, workers=2)
    assert named in str(err.value)


def test_rank_from_the_file_name_or_an_error(tmp_path) -> None:
    plain = {"traceEvents": [_x("x", 0.0, 1.0)]}
    assert read_rank_trace(_write_json(tmp_path / "trace_rank3.json", plain)).rank == 3
    with pytest.raises(InputError, match=r"trace\.json: cannot tell its rank"):
        read_rank_trace(_write_json(tmp_path / "trace.json", plain))


def test_bench_trace_runs_small(capsys) -> None:
    code = main(["bench", "trace", "--ranks", "2", "--size-mb", "0.2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["json_mb_per_s"] > 0 and report["compute_actions"] > 0
    assert report["python_heap_peak_bytes"] > 0 and report["largest_file_bytes"] > 0


# ---------------------------------------------------------------- live


def _generator():
    spec = importlib.util.spec_from_file_location("generate", DATA / "generate.py")
    if str(DATA) not in sys.path:
        sys.path.insert(0, str(DATA))  # the spawned ranks import the worker from it by name
    module = importlib.util.module_from_spec(spec)
    sys.modules["generate"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.multiprocess
def test_fresh_traces_of_a_live_run_import(tmp_path) -> None:
    gen = _generator()
    paths = gen.generate("1f1b", tmp_path, ranks=2, steps=2, timeout_s=120)
    assert [p.name for p in paths] == ["rank0.json.gz", "rank1.json.gz"]
    assert read_run(paths)[1].world_size == 2
    run = import_run(paths, schedule="1f1b", microbatches=4)
    compute = run.result.by_stream()["compute"]
    passes = Counter((s.action.op, s.action.stage, s.action.microbatch) for s in compute if s.action.op in PASS_OPS)
    assert set(passes) == {(o, k, mb) for o in (F, B) for k in (0, 1) for mb in range(8)}
    assert set(passes.values()) == {1} and run.steps == 2


@settings(max_examples=50, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 2), st.floats(0, 100), st.sampled_from(["aten::mm", "MmBackward0"])), max_size=40
    ),
    window=st.tuples(st.floats(0, 100), st.floats(0, 50)),
)
def test_operators_starting_in_a_window_earliest_first_over_threads(ops, window):
    """``OpTable.starting_between`` (binary searches in each thread's run)
    gives what a scan of every operator would, in start order."""
    from array import array

    from pipesim.validate.kineto import OpTable

    ops = sorted(ops)  # by thread, then start: as a read trace holds them
    names = ["aten::mm", "MmBackward0"]
    table = OpTable(
        names=names,
        tids=[0, 1, 2],
        name=array("i", [names.index(n) for _, _, n in ops]),
        ts=array("d", [t for _, t, _ in ops]),
        dur=array("d", [1.0] * len(ops)),
        tid=array("i", [th for th, _, _ in ops]),
    )
    t0, t1 = window[0], window[0] + window[1]
    got = list(table.starting_between(t0, t1))
    want = sorted(((n, t) for _, t, n in ops if t0 <= t <= t1), key=lambda r: r[1])
    assert [t for _, t in got] == [t for _, t in want]
    assert sorted(got) == sorted(want)

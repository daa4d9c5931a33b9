"""Interchange with torch.distributed.pipelining (torch 2.13), checked against torch's own schedules.

torch's schedule classes plan their orders from the stage layout alone, so
they are built here from stand-in stages, without processes: what they write
with ``_dump_csv`` is what a user would hand to ``pipesim simulate``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.experiments.cli import main
from pipesim.sim.api import model_for, simulate_schedule
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.interchange import schedule_from_csv
from pipesim.sim.ir.checks import validate
from pipesim.sim.ir.core import (
    OVERLAP_F_B,
    PASS_OPS,
    RESHARD,
    SEND_B,
    UNSHARD,
    UPDATE,
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    parse_cell,
    program_cells,
    to_csv,
)
from pipesim.sim.ir.dataflow import Gathered, compile_plan, split_stages
from pipesim.sim.ir.lowering import group, lower
from pipesim.sim.strategies import ScheduleSpec, build_schedule

S = pytest.importorskip("torch.distributed.pipelining.schedules")

IDEAL = load_hardware("ideal")
MS = 1e-3


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def torch_multi(name: str, p: int, m: int, v: int = 2):
    """torch's multi-stage schedule ``name`` on p ranks (rank 0's view)."""
    ids = (0, 2 * p - 1) if name == "DualPipeV" else tuple(c * p for c in range(v))
    stages = [
        SimpleNamespace(num_stages=len(ids) * p, group_size=p, group_rank=0, stage_index=i, submod=None) for i in ids
    ]
    return S.get_schedule_class(name)(stages, m)


def torch_csv(sched, tmp_path, fmt: str = "compute_comms") -> str:
    """What torch's ``_dump_csv`` writes for ``sched``."""
    path = tmp_path / f"{fmt}.csv"
    sched._dump_csv(str(path), format=fmt)
    return path.read_text()


def torch_single_csv(cls_name: str, p: int, m: int) -> str:
    """A single-stage schedule's order written the way ``_dump_csv`` writes rows
    (single-stage classes have no ``_dump_csv`` of their own)."""
    order = getattr(S, cls_name)(SimpleNamespace(num_stages=p), m).pipeline_order
    buf = io.StringIO()
    writer = csv.writer(buf)
    for rank in order:
        writer.writerow(order[rank])
    return buf.getvalue()


def simulate_uniform(schedule: Schedule, recv_lookahead: int = 1):
    """Every stage F = 1 ms, B = 2 ms (I = W = 1 ms), nothing sent, ideal machine."""
    return simulate_schedule(
        schedule, model_for(schedule, "uniform", IDEAL, None), IDEAL, recv_lookahead=recv_lookahead
    )


def torch_accepts(text: str, stage_to_rank, num_stages: int) -> bool:
    """Whether torch's own dry run (``_simulate_comms_compute``) gets through a comm CSV."""
    order = {rank: [S._Action.from_str(c) for c in row.split(",") if c] for rank, row in enumerate(text.splitlines())}
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints the schedule when stuck
            S._simulate_comms_compute(order, stage_to_rank, num_stages)
    except (ValueError, IndexError):  # "not progressing" (or torch failing to print it)
        return False
    return True


def mk(rows: list[str], p: int, m: int, **kw) -> Schedule:
    """A schedule from rows of space-separated cells."""
    return Schedule("t", p, m, [[a for c in r.split() for a in parse_cell(c)] for r in rows], **kw)


# --------------------------------------------------------------------------
# 1. UNSHARD / RESHARD
# --------------------------------------------------------------------------


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12), (3, 2, 6)])
def test_torch_comm_csv_with_fsdp_actions_simulates_like_pipesim(tmp_path, p, v, m):
    sched = torch_multi("Interleaved1F1B", p, m, v)
    text = torch_csv(sched, tmp_path)
    assert "UNSHARD" in text and "RESHARD" in text and "REDUCE_GRAD" in text  # what torch really writes
    imported = schedule_from_csv(text, strategy="interleaved-1f1b")
    ours = build_schedule(ScheduleSpec("interleaved-1f1b", p, m, chunks=v))
    # same per-rank compute order and flush semantics, torch's communication and FSDP actions kept
    assert (
        imported.compute_only().with_programs(
            [a for a in prog if a.op not in (UNSHARD, RESHARD)] for prog in imported.compute_only().programs
        )
        == ours
    )
    assert sum(a.op is UNSHARD for prog in imported.programs for a in prog) == p * v
    got, want = simulate_uniform(imported), simulate_uniform(ours)
    assert got.makespan == pytest.approx(want.makespan, abs=1e-12)
    # FSDP actions are instant without sharding and show on the collective stream
    shards = [s for s in got.spans if s.action.op in (UNSHARD, RESHARD)]
    assert len(shards) == 2 * p * v and all(s.stream == "collective" and s.start == s.end for s in shards)


def test_fsdp_actions_round_trip_and_export_as_torch_spells_them():
    s = mk(["0UNSHARD 0F0@v0 0B0@v0 0UPDATE@v1 0RESHARD"], 1, 1)
    validate(s)
    assert schedule_from_csv(to_csv(s), strategy="t") == s
    assert to_csv(s, torch_only=True) == "0UNSHARD,0F0,0B0,0RESHARD\n"
    assert S._Action.from_str("0UNSHARD").computation_type is S.UNSHARD


def test_unshard_is_waited_for_by_the_next_pass_of_its_stage_only():
    s = mk(["0UNSHARD 0F0@v0 0F1@v0 0B0@v0 0B1@v0 0UPDATE@v1 0RESHARD 0UNSHARD 0F2@v1 0B2@v1 0UPDATE@v2"], 1, 3)
    validate(s)
    entries = compile_plan(s, group(s))[0]
    gated = {str(a): [t for t in waits if isinstance(t, Gathered)] for _, a, waits, _ in entries if a is not None}
    assert gated["0F0@v0"] == [Gathered(0, 0, 0)] and gated["0F2@v1"] == [Gathered(0, 0, 1)]
    assert not any(gated[k] for k in gated if k not in ("0F0@v0", "0F2@v1"))


@pytest.mark.parametrize(
    "rows,message",
    [
        (["0F0@v0 0UNSHARD 0B0@v0 0UPDATE@v1 0RESHARD"], "computes on stage 0's sharded parameters"),
        (["0UNSHARD 0UNSHARD 0F0@v0 0B0@v0 0UPDATE@v1"], "already unsharded"),
        (["0RESHARD 0F0@v0 0B0@v0 0UPDATE@v1"], "not unsharded"),
        (["0UNSHARD 0F0@v0 0RESHARD 0B0@v0 0UPDATE@v1"], "sharded parameters"),
        (["0UNSHARD 0F0@v0 0B0@v0 0UPDATE@v1 0RESHARD", "0UNSHARD"], "0UNSHARD on device 1: .*runs on device 0"),
    ],
)
def test_fsdp_action_errors_are_named(rows, message):
    with pytest.raises(ScheduleError, match=message):
        validate(mk(rows, 1, 1))


# --------------------------------------------------------------------------
# 2. flush semantics of imported schedules: one definition, every flush strategy
# --------------------------------------------------------------------------

FLUSH_CASES = [
    ("gpipe", 3, 4, {}),
    ("1f1b", 4, 6, {}),
    ("1f1b", 3, 2, {}),
    ("interleaved-1f1b", 2, 4, {"chunks": 2}),
    ("interleaved-1f1b", 3, 6, {"chunks": 3}),
    ("zb-h1", 4, 5, {}),
    ("data-parallel", 1, 5, {}),
]


@pytest.mark.parametrize("strategy,p,m,kw", FLUSH_CASES)
@pytest.mark.parametrize("iterations", [1, 3])
def test_flush_strategy_round_trips_through_torch_csv(strategy, p, m, kw, iterations):
    s = build_schedule(ScheduleSpec(strategy, p, m, iterations=iterations, **kw))
    text = to_csv(s, torch_only=True)
    assert "@v" not in text and "UPDATE" not in text
    back = schedule_from_csv(text, microbatches=s.num_microbatches, iterations=iterations, strategy=strategy)
    assert back == s  # versions, updates and their places included
    updates = [a for prog in back.programs for a in prog if a.op is UPDATE]
    assert sorted(a.version for a in updates) == sorted(t + 1 for t in range(iterations) for _ in range(s.num_stages))
    assert {a.version for prog in back.programs for a in prog if a.op in PASS_OPS} == set(range(iterations))
    # with communication (receives posted right before use, as torch wants) the compute order is kept too
    low = lower(s, recv_lookahead=0)
    back_low = schedule_from_csv(
        to_csv(low, torch_only=True), microbatches=s.num_microbatches, iterations=iterations, strategy=strategy
    )
    assert back_low.compute_only() == s


@pytest.mark.parametrize(
    "strategy,kw",
    [("1f1b", {"width": 2}), ("data-parallel", {"width": 2}), ("interleaved-1f1b", {"width": 2, "chunks": 2})],
)
def test_replicas_round_trip_through_pipesim_csv_only(strategy, kw):
    # torch's CSV has one row per rank of one pipeline: no replicas, so no REDUCE_GRAD between them
    s = build_schedule(ScheduleSpec(strategy, 2, 4, iterations=2, **kw))
    back = schedule_from_csv(to_csv(s), microbatches=s.num_microbatches, iterations=2, strategy=strategy)
    assert back == s
    with pytest.raises(ScheduleError, match="holds one pipeline and this schedule has replicas"):
        to_csv(s, torch_only=True)


def test_overlapping_iterations_are_not_a_flush_schedule():
    # micro-batch 2 (iteration 1) starts before micro-batch 1 (iteration 0) ran on device 0
    text = "0F0,0F2,0F1,0B0,0B1,0F3,0B2,0B3\n"
    with pytest.raises(ScheduleError, match=r"iteration 0\) runs after .*iteration 1"):
        schedule_from_csv(text, microbatches=2, iterations=2)


# --------------------------------------------------------------------------
# 3. OVERLAP_F_B and DualPipeV
# --------------------------------------------------------------------------


def test_overlap_spelling_round_trips_through_both_csvs():
    cell = "(0F7;7B3)OVERLAP_F_B"
    marker, f, b = parse_cell(cell)
    assert marker.op is OVERLAP_F_B and f == Action(F, 0, 7) and b == Action(B, 7, 3)
    assert program_cells((marker, f, b), torch_only=True) == [cell]
    versioned = program_cells((marker, f._replace(version=2), b._replace(version=1, replica=0)))
    assert versioned == ["(0F7@v2;7B3@v1)OVERLAP_F_B"] and list(parse_cell(versioned[0]))[1].version == 2
    # torch reads pipesim's cell back as its compound action
    t = S._Action.from_str(cell)
    assert t.computation_type is S.OVERLAP_F_B and [str(x) for x in t.sub_actions] == ["0F7", "7B3"]
    for bad in ("(0F7)OVERLAP_F_B", "(0F7;7B3)OVERLAP", "0OVERLAP_F_B", "(0F7;7B3;1F1)OVERLAP_F_B"):
        with pytest.raises(ScheduleError):
            parse_cell(bad)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 16), (5, 10)])
@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_dualpipev_makespan_is_exact(tmp_path, p, m, fmt):
    text = torch_csv(torch_multi("DualPipeV", p, m), tmp_path, fmt)
    s = schedule_from_csv(text, strategy="dualpipev")
    # stages mix B and I/W per micro-batch, as torch's DualPipeV does
    assert any(mbs is not None for mbs in split_stages(s).values())
    # out and back in, in pipesim's spelling and in torch's (flush semantics derived again)
    assert schedule_from_csv(to_csv(s), strategy="dualpipev") == s
    assert schedule_from_csv(to_csv(s, torch_only=True), strategy="dualpipev") == s
    assert to_csv(s, torch_only=True).count("OVERLAP_F_B") == text.count("OVERLAP_F_B")
    # DualPipe's bubble (DeepSeek-V3 report) on 2p half-stages: (p-1)(T_F&B + T_B - 3 T_W), where an
    # overlapped pair runs its F and B back to back (T_F&B = T_F + T_B): with F=1, B=2, W=1 ms,
    # makespan = 2m(T_F + T_B) + 2(p-1)
    result = simulate_uniform(s)
    assert result.makespan == pytest.approx((6 * m + 2 * (p - 1)) * MS, abs=1e-12)


def test_dualpipev_timeline_by_hand(tmp_path):
    """p = 2, m = 4 on the uniform model, worked out by hand: a pair starts once
    both its halves have their inputs, runs F then B, and its results leave
    when it ends."""
    s = schedule_from_csv(torch_csv(torch_multi("DualPipeV", 2, 4), tmp_path, "compute_only"))
    starts = {
        (sp.device, str(sp.action).split("@")[0]): round(sp.start / MS, 9)
        for sp in simulate_uniform(s, recv_lookahead=0).spans
        if sp.stream == "compute"
    }
    want = {
        0: "0F0 0 0F1 1 0F2 2 3F0 3 3I0 4 3W0 5 3F1 6 0F3 7 3B1 8 3F2 11 0B0 12 3B2 14 3F3 17 0B1 18 3B3 20 "
        "0I2 22 0W2 23 0I3 24 0W3 25",
        1: "1F0 1 2F0 2 1F1 3 2F1 4 1F2 5 2B0 6 2F2 8 1B0 9 1F3 11 2B1 12 2F3 14 1B1 15 2B2 17 1B2 19 "
        "2I3 22 1I3 23 2W3 24 1W3 25",
    }
    for dev, row in want.items():
        items = row.split()
        for name, t in zip(items[::2], items[1::2], strict=True):
            assert starts.pop((dev, name)) == float(t), (dev, name)
    assert not [k for k in starts if not k[1].endswith("UPDATE")]


def test_lowering_posts_nothing_inside_a_pair_and_sends_follow_each_microbatch(tmp_path):
    s = schedule_from_csv(torch_csv(torch_multi("DualPipeV", 2, 4), tmp_path, "compute_only"))
    for lookahead in (0, 1, 2):
        low = lower(s, recv_lookahead=lookahead)
        validate(low)
        for prog in low.programs:
            for pos, a in enumerate(prog):
                if a.op is OVERLAP_F_B:
                    assert prog[pos + 1].op is F and prog[pos + 2].op is B
        rank0 = [str(a).split("@")[0] for a in low.programs[0]]
        # stage 3 splits micro-batch 0 (I then W) and runs micro-batch 1 fully in a pair:
        # each SEND_B follows the pass that made that micro-batch's input gradient
        assert rank0[rank0.index("3I0") + 1] == "3SEND_B0"
        pair = rank0.index("3B1")
        assert rank0[pair - 2] == "0OVERLAP_F_B" and "3SEND_B1" in rank0[pair + 1 : pair + 3]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.booleans(), min_size=4, max_size=4), st.lists(st.booleans(), min_size=4, max_size=4))
def test_backward_kind_is_chosen_per_microbatch(split0, split1):
    # 2 stages on 2 devices, GPipe order; micro-batch i of stage k uses I then W where splitK[i]
    progs = []
    for k, split in enumerate((split0, split1)):
        prog = [Action(F, k, i, 0) for i in range(4)]
        for i in range(4):
            prog += [Action(I, k, i, 0), Action(W, k, i, 0)] if split[i] else [Action(B, k, i, 0)]
        progs.append(prog + [Action(UPDATE, k, version=1)])
    s = Schedule("mixed", 2, 4, progs)
    validate(s)
    low = lower(s, recv_lookahead=0)
    validate(low)
    rank1 = low.programs[1]
    for pos, a in enumerate(rank1):
        if a.op is SEND_B:
            assert rank1[pos - 1].op is (I if split1[a.microbatch] else B)
    assert simulate_uniform(s).makespan > 0


@pytest.mark.parametrize(
    "rows,message",
    [
        (["0F0@v0 (0F1@v0;0B0@v0)OVERLAP_F_B 0B1@v0 0UPDATE@v1"], None),
        (["(0F0@v0;0B0@v0)OVERLAP_F_B 0UPDATE@v1"], "0B0@v0's forward 0F0 must run before the pair"),
        (["0F0@v0 (0B0@v0;0F0@v0)OVERLAP_F_B 0UPDATE@v1"], "followed by a forward and a full backward"),
        (["0F0@v0 0I0@v0 0B0@v0 0W0@v0 0UPDATE@v1"], "already ran 0I0"),
        (["0F0@v0 0F1@v0 0I0@v0 0W0@v0 0B1@v0 0W1@v0 0UPDATE@v1"], "runs before 0I1"),
    ],
)
def test_overlap_and_mixed_backward_errors_are_named(rows, message):
    s = mk(rows, 1, 2)
    if message is None:
        validate(s)
        return
    with pytest.raises(ScheduleError, match=message):
        validate(s)


def test_deadlock_through_a_pair_names_the_pair():
    # the pair's backward needs 1B0, which device 1 runs only after 1F1, which needs the pair's forward
    rows = ["0F0@v0 (0F1@v0;0B0@v0)OVERLAP_F_B 0B1@v0 0UPDATE@v1", "1F0@v0 1F1@v0 1B0@v0 1B1@v0 1UPDATE@v1"]
    for s in (mk(rows, 2, 2), lower(mk(rows, 2, 2))):
        with pytest.raises(ScheduleError, match=r"\(0F1@v0;0B0@v0\)OVERLAP_F_B \(device 0\) waits for"):
            validate(s)
    with pytest.raises(ScheduleError, match=r"deadlocked: .*\(0F1@v0;0B0@v0\)OVERLAP_F_B"):
        simulate_schedule(mk(rows, 2, 2), model_for(mk(rows, 2, 2), "uniform", IDEAL, None), IDEAL)


def test_real_tensor_executors_refuse_what_they_do_not_run(tmp_path):
    from pipesim.validate.executor import compiled

    s = schedule_from_csv(torch_csv(torch_multi("DualPipeV", 2, 4), tmp_path))
    with pytest.raises(ScheduleError, match="OVERLAP_F_B|UNSHARD"):
        compiled(s)


# --------------------------------------------------------------------------
# 4. torch 2.13's Schedule1F1B numbering
# --------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(4, 8), (1, 3), (2, 5)])
def test_torch_1f1b_last_rank_numbering_gets_its_own_message(capsys, p, m):
    text = torch_single_csv("Schedule1F1B", p, m)
    assert f"{p - 1}F{m}" in text  # torch really writes F1..Fm on its last rank
    for kwargs in ({}, {"microbatches": m}):
        with pytest.raises(ScheduleError) as e:
            schedule_from_csv(text, **kwargs)
        msg = str(e.value)
        assert msg.startswith(f"forward of micro-batch 0 missing on stage {p - 1}")
        assert "Schedule1F1B" in msg and f"--stages {p} --microbatches {m} --format torch-csv" in msg
        assert "\n" not in msg
    # what it says to do works: pipesim writes the same order with the true ids
    assert (
        main(["schedule", "--strategy", "1f1b", "--stages", str(p), "--microbatches", str(m), "--format", "torch-csv"])
        == 0
    )
    fixed = capsys.readouterr().out
    renumbered = [row.split(",") for row in text.splitlines()]
    renumbered[-1] = [
        f"{p - 1}F{int(c[len(str(p - 1)) + 1 :]) - 1}" if c.startswith(f"{p - 1}F") else c for c in renumbered[-1]
    ]
    assert [[c for c in row if c and "REDUCE" not in c] for row in renumbered] == [
        row.split(",") for row in fixed.splitlines()
    ]
    assert schedule_from_csv(fixed, strategy="1f1b") == build_schedule(ScheduleSpec("1f1b", p, m))


@pytest.mark.parametrize(
    "text,message",
    [
        # the last stage's backwards are off by one too: not torch's pattern
        ("0F0,0F1,0B0,0F2,0B1,0B2\n1F1,1B1,1F2,1B2,1F3,1B3\n", "^0F3 is missing"),
        # the first stage is off, not the last
        ("0F1,0F2,0B0,0F3,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n", "^0B0@v0 on device 0 runs before 0F0$"),
    ],
)
def test_other_broken_orders_keep_the_generic_messages(text, message):
    with pytest.raises(ScheduleError, match=message):
        schedule_from_csv(text)


def test_cli_says_what_is_wrong_with_torch_1f1b(tmp_path, capsys):
    path = tmp_path / "torch1f1b.csv"
    path.write_text(torch_single_csv("Schedule1F1B", 4, 8))
    code = main(["simulate", "--schedule", str(path), "--out", str(tmp_path / "o"), "--summary-only"])
    err = capsys.readouterr().err
    assert code == 2 and "forward of micro-batch 0 missing on stage 3" in err and err.count("\n") == 1


# --------------------------------------------------------------------------
# 5. lowered torch CSVs that torch's own dry run accepts
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy,p,m,kw",
    [
        ("gpipe", 2, 2, {}),
        ("gpipe", 4, 8, {}),
        ("1f1b", 3, 5, {}),
        ("1f1b", 4, 8, {}),
        ("1f1b", 8, 16, {}),
        ("interleaved-1f1b", 2, 4, {"chunks": 2}),
        ("interleaved-1f1b", 4, 8, {"chunks": 2}),
        ("interleaved-1f1b", 4, 12, {"chunks": 3}),
        ("gpipe", 3, 4, {"iterations": 2}),
    ],
)
def test_torch_dry_run_accepts_lowered_torch_csv(capsys, strategy, p, m, kw):
    s = build_schedule(ScheduleSpec(strategy, p, m, **kw))
    argv = [
        "schedule",
        "--strategy",
        strategy,
        "--stages",
        str(p),
        "--microbatches",
        str(m),
        "--lowered",
        "--format",
        "torch-csv",
    ] + [x for k, v in kw.items() for x in (f"--{k}", str(v))]
    assert main(argv) == 0
    text = capsys.readouterr().out
    home = s.placement()
    assert torch_accepts(text, lambda stage: home[(0, stage)], s.num_stages)
    # receives posted a compute action early are what torch's dry run cannot take (it blocks on them)
    early = to_csv(lower(s, recv_lookahead=1), torch_only=True)
    assert not torch_accepts(early, lambda stage: home[(0, stage)], s.num_stages)


def test_schedule_recv_lookahead_option(capsys):
    base = ["schedule", "--strategy", "1f1b", "--stages", "2", "--microbatches", "2", "--lowered"]
    assert main([*base, "--format", "torch-csv", "--recv-lookahead", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1SEND_B1"
    assert main([*base, "--format", "torch-csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1"
    assert main(["schedule", "--strategy", "1f1b", "--recv-lookahead", "1"]) == 2
    assert "applies to --lowered" in capsys.readouterr().err


# --------------------------------------------------------------------------
# 6. the dry-run path stays light
# --------------------------------------------------------------------------


def test_simulating_a_schedule_csv_imports_neither_torch_nor_plotly(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text(
        to_csv(lower(build_schedule(ScheduleSpec("interleaved-1f1b", 2, 4)), recv_lookahead=0), torch_only=True)
    )
    code = (
        "import sys; from pipesim.experiments.cli import main; "
        f"assert main(['simulate', '--schedule', {str(path)!r}, '--summary-only', '--out', {str(tmp_path)!r}]) == 0; "
        "print(sorted(m for m in ('torch', 'plotly') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"
    assert json.loads((tmp_path / "summary.json").read_text())["compute_actions"] > 0


def test_torch_dry_run_benchmark_reports_both_sides(capsys):
    from pipesim.experiments.torchdry import main as bench

    assert bench(["--sizes", "2,2,4", "--repeat", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert (row["ranks"], row["stages_per_rank"], row["microbatches"]) == (2, 2, 4)
    for key in ("torch_dry_run_s", "torch_end_to_end_s", "pipesim_cli_s", "pipesim_inprocess_s"):
        assert row[key] > 0
    assert row["torch_end_to_end_s"] > row["torch_dry_run_s"]  # a fresh interpreter imports torch first
    assert row["ratio_cli"] == pytest.approx(row["torch_dry_run_s"] / row["pipesim_cli_s"], rel=0.01)
    assert row["ratio_end_to_end"] == pytest.approx(row["torch_end_to_end_s"] / row["pipesim_cli_s"], rel=0.01)


def test_pipesim_csv_keeps_what_its_rows_cannot_say():
    """The header carries the strategy, m, the iterations and the options, so
    AvgPipe's averaging rate survives a round trip (the executors average
    with it) and an imported schedule is the strategy's own."""
    s = build_schedule(ScheduleSpec("avgpipe", 2, 3, iterations=2, alpha=0.5, tau=2))
    back = schedule_from_csv(to_csv(s))
    assert back == s and back.strategy == "avgpipe" and back.options == s.options
    assert (back.num_microbatches, back.num_iterations) == (6, 2)  # the iteration's 3 per pipeline, 2 pipelines
    assert back.options["alpha"] == 0.5
    # arguments still take precedence over the header
    assert schedule_from_csv(to_csv(s), strategy="mine").strategy == "mine"
    with pytest.raises(ScheduleError, match="malformed pipesim header"):
        schedule_from_csv("# pipesim {not json\n" + to_csv(s).split("\n", 1)[1])


def test_a_csv_saved_with_a_byte_order_mark_imports_as_without() -> None:
    """Excel and Windows editors start a UTF-8 file with a byte-order mark."""
    from pipesim.sim.interchange import load_schedule_csv

    s = build_schedule(ScheduleSpec("1f1b", 2, 4))
    text = to_csv(s)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        plain, marked = Path(d) / "plain.csv", Path(d) / "marked.csv"
        plain.write_text(text, encoding="utf-8")
        marked.write_text(text, encoding="utf-8-sig")
        assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
        assert load_schedule_csv(marked) == load_schedule_csv(plain) == s


def test_torch_csv_of_an_asynchronous_strategy_says_what_it_loses(capsys) -> None:
    assert main(["schedule", "--strategy", "pipedream", "--format", "torch-csv"]) == 0
    err = capsys.readouterr().err
    assert "read back from it is a flushed schedule; --format csv keeps them" in err
    assert main(["schedule", "--strategy", "1f1b", "--format", "torch-csv"]) == 0
    assert capsys.readouterr().err == ""
    # a schedule torch's CSV cannot hold is refused in one line, without the note
    argv = ["schedule", "--strategy", "pipedream-2bw", "--stages", "1", "--microbatches", "1", "--width", "2"]
    assert main([*argv, "--format", "torch-csv"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "holds one pipeline" in err


@pytest.mark.parametrize(
    ("spec", "hardware"),
    [
        (dict(strategy="avgpipe", stages=4, microbatches=8, iterations=3, advance=2), "pcie-4gpu"),
        (
            dict(strategy="avgpipe", stages=4, microbatches=8, iterations=4, width=2, placement="disjoint", tau=2),
            "dgx-h100",
        ),
        (dict(strategy="1f1b", stages=4, microbatches=8), "dgx1-v100"),
    ],
)
def test_a_lowered_csv_read_back_runs_as_its_compute_order_does(spec, hardware):
    """The sends and receives a lowered CSV carries are the ones the run
    adds to the compute order itself: they must not shrink the budget of
    splits a small run confirms, or the two run on different splits (6%
    apart for the first case before)."""
    from pipesim.sim.api import model_for, resolve_hardware, simulate_schedule
    from pipesim.sim.interchange import schedule_from_csv
    from pipesim.sim.ir.core import to_csv
    from pipesim.sim.ir.lowering import lower
    from pipesim.sim.strategies import ScheduleSpec, build_schedule

    hw = resolve_hardware(hardware)
    built = build_schedule(ScheduleSpec(**spec))
    read = schedule_from_csv(to_csv(lower(built)))
    direct, again = (simulate_schedule(s, model_for(s, "vgg16", hw, None), hw) for s in (built, read))
    assert again.makespan == direct.makespan
    assert again.stage_costs == direct.stage_costs


def test_a_csv_read_with_too_few_micro_batches_says_what_m_counts():
    """--microbatches on an import counts every micro-batch of an iteration
    (over all replicas): given per pipeline, the ids overflow, and the error
    says so and what the header records instead of "out of range"."""
    from pipesim.sim.interchange import schedule_from_csv
    from pipesim.sim.ir.core import ScheduleError, to_csv
    from pipesim.sim.strategies import ScheduleSpec, build_schedule

    text = to_csv(build_schedule(ScheduleSpec("1f1b", 2, 4, width=2)))
    with pytest.raises(
        ScheduleError,
        match=r"micro-batches 0\.\.7, more than m=4 x 1 iteration\(s\) hold: an "
        r"imported schedule's m counts every micro-batch of an iteration, over "
        r"all its replicas \(its header says 8\)",
    ):
        schedule_from_csv(text, microbatches=4)
    assert schedule_from_csv(text).num_microbatches == 8


@pytest.mark.parametrize(
    ("name", "lookahead"), [("gpipe", 0), ("1f1b", 0), ("interleaved-1f1b", 0), ("zb-h1", 0), ("1f1b", 1), ("zb-h1", 1)]
)
def test_a_lowered_torch_csv_of_several_iterations_reads_back_as_lowered(name, lookahead):
    """torch's CSV has no updates: read back, each goes right after its
    stage's last backward and the sends that follow, before any receive
    (which serves a later pass and, at --recv-lookahead 0, sits right
    before it). So the lowered schedule comes back action for action.
    Before, an update went after a following receive: interleaving's mid-
    drain updates and every iteration's last one moved a slot. Receives
    posted ahead (a lookahead of 1) keep the update after them, as then."""
    from pipesim.sim.interchange import schedule_from_csv
    from pipesim.sim.ir.core import to_csv
    from pipesim.sim.ir.lowering import lower
    from pipesim.sim.strategies import ScheduleSpec, build_schedule

    lowered = lower(build_schedule(ScheduleSpec(name, 2, 4, iterations=2)), recv_lookahead=lookahead)
    read = schedule_from_csv(to_csv(lowered, torch_only=True), iterations=2)
    assert read.programs == lowered.programs


def test_receives_ahead_is_read_off_the_order():
    from pipesim.sim.interchange import receives_ahead
    from pipesim.sim.ir.core import parse_cell

    def prog(cells):
        return [a for c in cells.split() for a in parse_cell(c)]

    assert not receives_ahead(prog("1RECV_F0 1F0 1RECV_F1 1F1 1RECV_B0 1B0"))  # each right before its pass
    assert receives_ahead(prog("1RECV_F0 1F0 1RECV_F1 1RECV_B0 1F1 1B0"))  # RECV_B0 waits across 1F1
    # a DualPipeV unit consumes both its receives: not ahead
    assert not receives_ahead(prog("1RECV_F2 1RECV_B0 (1F2;1B0)OVERLAP_F_B 1RECV_F3 1F3"))

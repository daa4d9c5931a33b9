"""The schedule IR: spelling, CSV interchange, validation, deadlock detection, lowering."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.sim.interchange import schedule_from_csv
from pipesim.sim.ir.checks import validate
from pipesim.sim.ir.core import (
    P2P_OPS,
    Action,
    F,
    Op,
    Schedule,
    ScheduleError,
    format_action,
    parse_action,
    parse_csv,
    to_csv,
)
from pipesim.sim.ir.lowering import lower


def mk(rows: list[str], p: int, m: int, **kw) -> Schedule:
    return Schedule("t", p, m, [[parse_action(x) for x in r.split()] for r in rows], **kw)


GOOD = ["0F0@v0 0F1@v0 0B0@v0 0B1@v0 0UPDATE@v1", "1F0@v0 1B0@v0 1F1@v0 1B1@v0 1UPDATE@v1"]


actions = st.builds(
    Action,
    # an OVERLAP_F_B marker has no spelling of its own: see the compound tests
    op=st.sampled_from([op for op in Op if op is not Op.OVERLAP_F_B]),
    stage=st.integers(0, 99),
    microbatch=st.integers(0, 999),
    version=st.none() | st.integers(0, 50),
    distance=st.integers(0, 9),
    replica=st.integers(0, 7),
)


@given(actions)
def test_action_spelling_round_trips(a: Action) -> None:
    from pipesim.sim.ir.core import MICROBATCH_OPS, PREDICT

    if a.op not in MICROBATCH_OPS and a.op is not PREDICT:
        a = a._replace(microbatch=None)
    assert parse_action(format_action(a)) == a


def test_torch_spelling_is_read_as_torch_writes_it() -> None:
    assert parse_action("2B0") == Action(Op.BACKWARD, 2, 0)
    assert parse_action("0SEND_F1") == Action(Op.SEND_F, 0, 1)
    assert parse_action("1RECV_B12") == Action(Op.RECV_B, 1, 12)
    assert parse_action("3REDUCE_GRAD") == Action(Op.REDUCE_GRAD, 3)
    assert format_action(parse_action("r1.2F7@v3+p2"), torch_only=True) == "2F7"
    for bad in ("F1", "0X1", "0F", "0UPDATE3", ""):
        with pytest.raises(ScheduleError):
            parse_action(bad)


def test_torch_parser_reads_pipesim_csv() -> None:
    from torch.distributed.pipelining.schedules import _Action

    s = lower(mk(GOOD, 2, 2))
    for row, prog in zip(to_csv(s, torch_only=True).splitlines(), s.programs, strict=True):
        torch_actions = [_Action.from_str(c) for c in row.split(",")]
        ours = [a for a in prog if a.op.value in {"F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}]
        assert [(t.stage_index, t.computation_type.value, t.microbatch_index) for t in torch_actions] == [
            (a.stage, a.op.value, a.microbatch) for a in ours
        ]


def test_csv_round_trip_keeps_everything() -> None:
    s = lower(mk(GOOD, 2, 2))
    back = schedule_from_csv(to_csv(s), strategy="t")
    assert back == s


def test_torch_csv_import_adds_flush_semantics() -> None:
    text = "0F0,0F1,,0B0,0B1,0REDUCE_GRAD\n,1F0,1B0,1F1,1B1,1REDUCE_GRAD\n"
    s = schedule_from_csv(text)
    assert s.num_stages == 2 and s.num_microbatches == 2
    assert [str(a) for a in s.programs[1]] == ["1F0@v0", "1B0@v0", "1F1@v0", "1B1@v0", "1UPDATE@v1"]


def test_empty_csv_rejected() -> None:
    with pytest.raises(ScheduleError, match="no actions"):
        parse_csv("\n\n")


# -- validator -------------------------------------------------------------


def test_valid_schedule_passes() -> None:
    validate(mk(GOOD, 2, 2))
    validate(lower(mk(GOOD, 2, 2)))


@pytest.mark.parametrize(
    "rows,p,m,message",
    [
        (["0F0@v0 0UPDATE@v1"], 1, 1, "0B0 is missing"),
        (["0B0@v0 0F0@v0 0UPDATE@v1"], 1, 1, "runs before 0F0"),
        (["0F0@v0 0F0@v0 0B0@v0 0UPDATE@v1"], 1, 1, "appears twice"),
        (["0F0@v0 0B0@v0"], 1, 1, "never applied"),
        (["0F0@v1 0B0@v0 0UPDATE@v1"], 1, 1, "reads version 1"),
        (["0F0@v0 0B0@v0 0UPDATE@v2"], 1, 1, "next update produces version 1"),
        (["0F0@v0 0F1@v0 0B0@v0 0B1@v0 0UPDATE@v1"], 1, 1, "micro-batch 1 out of range"),
        (["0F0@v0+p2 0B0@v0 0UPDATE@v1"], 1, 1, "no PREDICT"),
        (["0F0@v0 1B0@v0 0B0@v0 0UPDATE@v1", "1F0@v0 1UPDATE@v1"], 2, 1, "stage 1 has actions on devices"),
        (["0F0 0B0@v0 0UPDATE@v1"], 1, 1, "names no weight version"),
        (["0F0@v0 0I0@v0 0W0@v0 0UPDATE@v1", "1F0@v0 1B0@v0 1UPDATE@v1"], 2, 1, None),
    ],
)
def test_validator_rejects_broken_schedules(rows, p, m, message) -> None:
    s = mk(rows, p, m)
    if message is None:
        validate(s)
        return
    with pytest.raises(ScheduleError, match=message):
        validate(s)


def test_torch_1f1b_last_rank_numbering_is_rejected() -> None:
    # torch 2.13's Schedule1F1B numbers the last rank's forwards from 1.
    text = "0F0,0F1,0B0,0F2,0B1,0B2\n1F1,1B0,1F2,1B1,1F3,1B2\n"
    for kwargs in ({"microbatches": 3}, {}):
        with pytest.raises(ScheduleError, match="forward of micro-batch 0 missing on stage 1.*Schedule1F1B"):
            schedule_from_csv(text, **kwargs)


LOWERED = ["0F0@v0 0SEND_F0 0RECV_B0 0B0@v0 0UPDATE@v1", "1RECV_F0 1F0@v0 1B0@v0 1SEND_B0 1UPDATE@v1"]


@pytest.mark.parametrize(
    "edit,message",
    [
        ((0, "0SEND_F0", ""), "1RECV_F0 on device 1 has no matching send"),
        ((1, "1SEND_B0", ""), "0RECV_B0 on device 0 has no matching send"),
        ((1, "1RECV_F0", ""), "0SEND_F0 on device 0 has no matching receive"),
        ((0, "0F0@v0 0SEND_F0", "0SEND_F0 0F0@v0"), "0SEND_F0 is not after 0F0 on device 0"),
        ((1, "1RECV_F0 1F0@v0", "1F0@v0 1RECV_F0"), "1F0 on device 1 needs data from device 0 but no 1RECV_F0"),
        ((0, "0RECV_B0 0B0@v0", "0B0@v0 0RECV_B0"), "0B0 on device 0 needs data from device 1 but no 0RECV_B0"),
        (((0, "0SEND_F0", ""), (1, "1RECV_F0", "")), "1F0 on device 1 needs data from device 0 but no 1RECV_F0"),
    ],
)
def test_transfer_errors_are_named(edit, message) -> None:
    validate(mk(LOWERED, 2, 1))
    rows = list(LOWERED)
    for dev, old, new in edit if isinstance(edit[0], tuple) else [edit]:
        rows[dev] = rows[dev].replace(old, new)
    with pytest.raises(ScheduleError, match=message):
        validate(mk(rows, 2, 1))


def test_deadlock_is_named() -> None:
    # Device 0 wants micro-batch 0's gradient first, device 1 does micro-batch 1 first.
    rows = ["0F0@v0 0B0@v0 0F1@v0 0B1@v0 0UPDATE@v1", "1F1@v0 1B1@v0 1F0@v0 1B0@v0 1UPDATE@v1"]
    for s in (mk(rows, 2, 2), lower(mk(rows, 2, 2))):
        with pytest.raises(ScheduleError) as e:
            validate(s)
        text = str(e.value)
        assert "deadlock" in text
        assert "0B0@v0 (device 0) waits for" in text and "1F1@v0 (device 1) waits for" in text


def test_collective_deadlock_is_named() -> None:
    # Both replicas of stage 0 share one device; replica 0 updates (waiting
    # for the all-reduce) before replica 1 has joined it.
    # (micro-batch i runs on replica i % 2)
    ok = ["0F0@v0 0B0@v0 0REDUCE_GRAD r1.0F1@v0 r1.0B1@v0 r1.0REDUCE_GRAD 0UPDATE@v1 r1.0UPDATE@v1"]
    validate(mk(ok, 1, 2, replicas=2))
    stuck = ["0F0@v0 0B0@v0 0REDUCE_GRAD 0UPDATE@v1 r1.0F1@v0 r1.0B1@v0 r1.0REDUCE_GRAD r1.0UPDATE@v1"]
    with pytest.raises(ScheduleError, match=r"0UPDATE@v1 \(device 0\) waits for REDUCE_GRAD of stage 0"):
        validate(mk(stuck, 1, 2, replicas=2))
    missing = ["0F0@v0 0B0@v0 0REDUCE_GRAD 0UPDATE@v1", "r1.0F1@v0 r1.0B1@v0 r1.0UPDATE@v1"]
    with pytest.raises(ScheduleError, match="REDUCE_GRAD 1 times but replica 1 0 times"):
        validate(mk(missing, 1, 2, replicas=2))
    misrouted = ["0F0@v0 0B0@v0 0REDUCE_GRAD r1.0F0@v0 r1.0B0@v0 r1.0REDUCE_GRAD 0UPDATE@v1 r1.0UPDATE@v1"]
    with pytest.raises(ScheduleError, match="runs on its replica 0 \\(round robin over 2\\), not replica 1"):
        validate(mk(misrouted, 1, 1, replicas=2))


# -- lowering --------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 6), lookahead=st.integers(0, 3))
def test_lowering_pairs_every_cross_device_dependency(p: int, m: int, lookahead: int) -> None:
    progs = []
    for k in range(p):  # GPipe order, one stage per device
        progs.append(
            [Action(F, k, i, 0) for i in range(m)]
            + [parse_action(f"{k}B{i}@v0") for i in reversed(range(m))]
            + [parse_action(f"{k}UPDATE@v1")]
        )
    s = Schedule("gpipe", p, m, progs)
    low = lower(s, recv_lookahead=lookahead)
    validate(low)
    comm = [a for prog in low.programs for a in prog if a.op in P2P_OPS]
    assert len(comm) == 2 * 2 * (p - 1) * m  # send+recv, forward+backward, per boundary and mb
    assert low.compute_only() == s

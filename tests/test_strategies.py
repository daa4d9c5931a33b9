"""Schedule generators: torch-order equality, structure, versions, staleness, bubbles, errors.

Everything here is static: versions are read off the IR (program order of
each device), bubbles come from a zero-communication list-scheduling model
written below. The engine computes the same facts dynamically.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipesim.sim.ir.core import (
    AVERAGE,
    P2P_OPS,
    PASS_OPS,
    PREDICT,
    REDUCE_GRAD,
    UPDATE,
    Action,
    B,
    F,
    I,
    W,
    format_action,
)
from pipesim.sim.ir.dataflow import PassDone, producer_of, split_stages
from pipesim.sim.strategies import (
    ScheduleSpec,
    StrategyError,
    build_schedule,
    get_strategy,
    strategies,
    strategy_names,
    strategy_options,
)
from pipesim.sim.strategies._common import warmup

try:  # the validator is written concurrently; use it once it exists
    from pipesim.sim.ir.checks import validate
except ImportError:  # pragma: no cover
    validate = None

try:
    from pipesim.sim.ir.lowering import lower
except ImportError:  # pragma: no cover
    lower = None

FLUSH = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
REPLICATED = ("gpipe", "1f1b", "pipedream", "pipedream-2bw")  # take per-stage replicas
WIDE = FLUSH + ("pipedream-2bw",)
ALL = FLUSH + ("pipedream", "pipedream-2bw", "spectrain", "avgpipe", "data-parallel")


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def build(strategy, p, m, **kw):
    s = build_schedule(ScheduleSpec(strategy, p, m, **kw))
    if validate is not None:
        validate(s)
    return s


def torch_spelling(prog, ops=PASS_OPS):
    return [format_action(a, torch_only=True) for a in prog if a.op in ops]


def static_versions(s):
    """Versions read off the IR, per (replica, stage, micro-batch).

    Returns ``(reads, update_at, held)``: ``reads[(op, replica, stage, mb)] =
    (version, distance)``; ``update_at[(replica, stage, mb)]`` = version
    current when the UPDATE consuming that micro-batch's gradient ran (the
    version it replaces); ``held[(replica, stage)]`` = most versions alive at
    once (the current one plus every older one some later pass still reads).
    """
    reads, update_at, held = {}, {}, defaultdict(int)
    for prog in s.programs:
        last_read = {}
        for pos, a in enumerate(prog):
            if a.op in PASS_OPS:
                last_read[(a.replica, a.stage, a.version)] = pos
        current = defaultdict(int)
        pending = defaultdict(list)
        closed = {}  # what a REDUCE_GRAD closed for the next UPDATE (later gradients wait for the one after)
        for pos, a in enumerate(prog):
            rs = (a.replica, a.stage)
            if a.op in PASS_OPS:
                reads[(a.op, *rs, a.microbatch)] = (a.version, a.distance)
                if a.op in (B, W):
                    pending[rs].append(a.microbatch)
            elif a.op is REDUCE_GRAD:
                closed[rs] = pending.pop(rs, [])
            elif a.op is UPDATE:
                for mb in closed.pop(rs) if rs in closed else pending.pop(rs, []):
                    update_at[(*rs, mb)] = current[rs]
                current[rs] = a.version
            alive = {current[rs]} | {v for v in range(current[rs]) if last_read.get((*rs, v), -1) >= pos}
            held[rs] = max(held[rs], len(alive))
    return reads, update_at, dict(held)


def staleness(s):
    reads, update_at, _ = static_versions(s)
    return {key: update_at[key] - reads[(F, *key)][0] for key in update_at}


def makespan(s, T):
    """Zero-communication list scheduling: each action starts when its device is
    free and the passes it consumes are done. ``T`` maps op -> duration."""
    split = split_stages(s)
    end, pc, free = {}, [0] * s.num_devices, [0.0] * s.num_devices
    progress = True
    while progress:
        progress = False
        for d, prog in enumerate(s.programs):
            while pc[d] < len(prog):
                a = prog[pc[d]]
                prod = producer_of(a, s.replicas, split) if a.op in PASS_OPS else None
                deps = () if prod is None else (prod,)
                if any(x not in end for x in deps):
                    break
                start = max([free[d]] + [end[x] for x in deps])
                free[d] = start + T.get(a.op, 0.0)
                end[PassDone(a.op, a.replica, a.stage, a.microbatch)] = free[d]
                pc[d] += 1
                progress = True
    assert all(pc[d] == len(p) for d, p in enumerate(s.programs)), "timing model deadlocked"
    return max(free)


def outstanding(prog, stage, done_ops=(B,)):
    """Most micro-batches of ``stage`` between their F and their backward."""
    n = peak = 0
    for a in prog:
        if a.stage != stage:
            continue
        if a.op is F:
            n += 1
        elif a.op in done_ops:
            n -= 1
        peak = max(peak, n)
    return peak


def expect_error(spec):
    p, m, w = spec.stages, spec.microbatches, spec.width
    if spec.strategy == "pipedream" and spec.replicas:
        return any(m * spec.iterations % r for r in spec.replicas)
    if spec.strategy == "pipedream-2bw":
        reps = spec.replicas or (1,) * p
        per_window = m if spec.replicas else m  # per pipeline with width, in all with replicas
        return any(per_window // (r if spec.replicas else 1) < warmup(reps, k) + 1 for k, r in enumerate(reps))
    if spec.strategy == "data-parallel":
        return m % (p * w) != 0
    if spec.strategy == "interleaved-1f1b":
        return m % max(1, m // p) != 0
    return False


# --------------------------------------------------------------------------
# torch 2.13's orders
# --------------------------------------------------------------------------


def torch_schedule(name):
    """A torch schedule class (tests may import torch; pipesim.sim never does)."""
    return getattr(pytest.importorskip("torch.distributed.pipelining.schedules"), name)


def torch_order(cls, p, m, v=None):
    """Per-rank compute orders of a torch schedule, built without processes: the
    schedules only read num_stages (and group_size/group_rank for multi-stage)."""
    if v is None:
        sched = cls(SimpleNamespace(num_stages=p), m)
    else:
        stages = [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=c * p) for c in range(v)]
        sched = cls(stages, m)
    return {
        rank: [str(a) for a in acts if a is not None and "REDUCE_GRAD" not in str(a)]
        for rank, acts in sched.pipeline_order.items()
    }


@pytest.mark.parametrize("p,m", [(1, 1), (1, 3), (2, 1), (2, 2), (3, 7), (4, 4), (4, 6), (4, 9), (5, 3)])
def test_gpipe_equals_torch(p, m):
    s = build("gpipe", p, m)
    want = torch_order(torch_schedule("ScheduleGPipe"), p, m)
    assert [torch_spelling(prog) for prog in s.programs] == [want[r] for r in range(p)]


@pytest.mark.parametrize("p,m,flushes", [(2, 4, 2), (3, 9, 3), (4, 8, 4), (4, 8, 8)])
def test_gpipe_flushes_are_consecutive_torch_steps(p, m, flushes):
    """An iteration of ``flushes`` GPipe flushes runs on every rank what
    ``flushes`` calls of torch's ScheduleGPipe ``step()`` over m / flushes
    micro-batches each run (gradient accumulation), the ids of step c
    shifted by c m / flushes; one update after the last."""
    q = m // flushes
    one = torch_order(torch_schedule("ScheduleGPipe"), p, q)

    def shifted(action: str, by: int) -> str:
        head = action.rstrip("0123456789")
        return f"{head}{int(action[len(head) :]) + by}"

    s = build("gpipe", p, m, flushes=flushes)
    for r in range(p):
        want = [shifted(a, c * q) for c in range(flushes) for a in one[r]]
        assert torch_spelling(s.programs[r]) == want, r
        assert sum(a.op is UPDATE for a in s.programs[r]) == 1
    assert s.options["flushes"] == flushes


def test_gpipe_flushes_hold_a_flush_and_uneven_ones_differ_by_one():
    from pipesim.sim.partition.layout import layout_of

    s = build("gpipe", 3, 7, flushes=3)  # flushes of 3, 2 and 2
    assert layout_of(s).inflight == (3, 3, 3)
    order = [(a.op, a.microbatch) for a in s.programs[0] if a.op in (F, B)]
    assert order[:6] == [(F, 0), (F, 1), (F, 2), (B, 0), (B, 1), (B, 2)] and order[6:8] == [(F, 3), (F, 4)]
    with pytest.raises(StrategyError, match="flushes=8 is more than the 7 micro-batches"):
        build("gpipe", 3, 7, flushes=8)
    with pytest.raises(StrategyError, match="option flushes=2 does not apply to 1f1b"):
        build("1f1b", 3, 7, flushes=2)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=4).map(tuple),
    st.integers(1, 13),
    st.integers(1, 5),
    st.integers(1, 2),
)
def test_gpipe_flushes_are_the_same_ids_on_every_stage(reps, m, flushes, iterations):
    """A flush is a range of consecutive micro-batch ids of the iteration,
    the same on every stage whatever its replica count: each replica runs,
    flush after flush, every forward of its ids in the flush, then every
    backward. Split by each replica's own count instead, stages with
    different replica counts wait for each other across flushes (a
    deadlock the engine reports)."""
    flushes = min(flushes, m)
    s = build_schedule(ScheduleSpec("gpipe", len(reps), m, iterations=iterations, replicas=reps, flushes=flushes))
    sizes = [m // flushes + (f < m % flushes) for f in range(flushes)]
    bounds = [sum(sizes[:f]) for f in range(flushes + 1)]
    for prog in s.programs:
        for t in range(iterations):
            passes = [a for a in prog if a.op in (F, B) and a.version == t]
            runs = []  # (op, flush) in program order, one entry per run of equal ones
            for a in passes:
                flush = max(f for f in range(flushes) if bounds[f] <= a.microbatch - t * m)
                if not runs or runs[-1] != (a.op, flush):
                    runs.append((a.op, flush))
            flushes_seen = [f for op, f in runs if op is F]
            assert flushes_seen == sorted(set(flushes_seen)), runs  # one forward run per flush, in order
            assert runs == [(op, f) for f in flushes_seen for op in (F, B)], runs


def _fix_torch_1f1b_last_rank(order, p):
    # torch numbers the last rank's forwards F1..Fm; the true ids are F0..F(m-1).
    fixed = []
    for a in order:
        if a.startswith(f"{p - 1}F"):
            a = f"{p - 1}F{int(a[len(str(p - 1)) + 1 :]) - 1}"
        fixed.append(a)
    return fixed


@pytest.mark.parametrize("p,m", [(1, 1), (1, 4), (2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 6), (4, 10), (5, 8)])
def test_1f1b_equals_torch(p, m):
    s = build("1f1b", p, m)
    want = torch_order(torch_schedule("Schedule1F1B"), p, m)
    want[p - 1] = _fix_torch_1f1b_last_rank(want[p - 1], p)
    assert [torch_spelling(prog) for prog in s.programs] == [want[r] for r in range(p)]
    # the last rank really does run F0..F(m-1) and torch really is off by one
    assert torch_order(torch_schedule("Schedule1F1B"), p, m)[p - 1][0] == f"{p - 1}F1"


@pytest.mark.parametrize(
    "p,v,m",
    [
        (2, 2, 2),
        (2, 2, 4),
        (2, 3, 4),
        (4, 2, 4),
        (4, 2, 8),
        (4, 2, 10),
        (4, 2, 3),
        (4, 2, 6),
        (3, 2, 8),
        (4, 3, 12),
        (4, 1, 4),
        (2, 2, 1),
    ],
)
def test_interleaved_equals_torch(p, v, m):
    s = build("interleaved-1f1b", p, m, chunks=v)
    assert s.num_stages == p * v
    want = torch_order(torch_schedule("ScheduleInterleaved1F1B"), p, m, v)
    assert [torch_spelling(prog) for prog in s.programs] == [want[r] for r in range(p)]
    # stage c*p + r lives on rank r
    assert all(dev == stage % p for (_, stage), dev in s.placement().items())


@pytest.mark.parametrize("p,v,m", [(2, 3, 5), (4, 2, 9), (3, 2, 7)])
def test_interleaved_rejects_what_torch_rejects(p, v, m):
    with pytest.raises(StrategyError, match="multiple of"):
        build_schedule(ScheduleSpec("interleaved-1f1b", p, m, chunks=v))
    with pytest.raises(ValueError):
        torch_order(torch_schedule("ScheduleInterleaved1F1B"), p, m, v)


# --------------------------------------------------------------------------
# structure and versions for every strategy (property-based)
# --------------------------------------------------------------------------


@st.composite
def specs(draw):
    strategy = draw(st.sampled_from(ALL))
    kw = {}
    p = draw(st.integers(1, 4))
    m = draw(st.integers(1, 6))
    if strategy in WIDE or strategy == "data-parallel":
        kw["width"] = draw(st.integers(1, 3))
    if strategy == "avgpipe":
        kw.update(
            width=draw(st.integers(1, 3)),
            advance=draw(st.integers(0, 4)),
            tau=draw(st.integers(1, 3)),
            placement=draw(st.sampled_from(["shared", "disjoint"])),
        )
    if strategy == "interleaved-1f1b":
        kw["chunks"] = draw(st.integers(1, 3))
    if strategy == "pipedream":
        kw["stashing"] = draw(st.booleans())
    if strategy in REPLICATED and draw(st.booleans()):  # PipeDream-style per-stage replicas
        kw.pop("width", None)
        kw["replicas"] = tuple(draw(st.lists(st.integers(1, 3), min_size=p, max_size=p)))
        m = draw(st.integers(1, 12))
    return ScheduleSpec(strategy, p, m, iterations=draw(st.integers(1, 3)), **kw)


def check_structure(s):
    """Every micro-batch runs every stage once forward and once backward (B,
    or I then W), on the replica it is routed to (round robin), forward first."""
    count = Counter()
    where = {}
    for dev, prog in enumerate(s.programs):
        for pos, a in enumerate(prog):
            if a.op in PASS_OPS:
                count[(a.op, a.replica, a.stage, a.microbatch)] += 1
                where[(a.op, a.replica, a.stage, a.microbatch)] = (dev, pos)
            assert a.op not in P2P_OPS, "strategies produce compute-only programs"
    split = {(r, k) for (op, r, k, _) in count if op is I}
    for k in range(s.num_stages):
        for mb in range(s.total_microbatches):
            r = mb % s.replicas[k]
            bwd = (I, W) if (r, k) in split else (B,)
            for op in (F, *bwd):
                assert count[(op, r, k, mb)] == 1, (op, r, k, mb)
            fdev, fpos = where[(F, r, k, mb)]
            bdev, bpos = where[(bwd[0], r, k, mb)]
            assert fdev == bdev and fpos < bpos
            if len(bwd) == 2:
                wdev, wpos = where[(W, r, k, mb)]
                assert wdev == bdev and bpos < wpos
    assert len(count) == sum(1 for prog in s.programs for a in prog if a.op in PASS_OPS)


def check_versions(s, spec):
    """Versions read, staleness and versions held, against each strategy's
    rule. A replica of a replicated stage runs its share of the micro-batches
    in order: its l-th is micro-batch l*r + replica, and PipeDream's rules
    apply to that stream with the replica's warm-up."""
    reads, update_at, held = static_versions(s)
    p, m, total = s.num_stages, s.num_microbatches, s.total_microbatches
    reps = s.replicas
    assert set(update_at) == {(i % reps[k], k, i) for k in range(p) for i in range(total)}, "every gradient is applied"
    stale = staleness(s)
    name = spec.strategy
    for (op, r, k, i), (v, dist) in reads.items():
        local, w = i // reps[k], warmup(reps, k)
        if name in FLUSH + ("avgpipe", "data-parallel"):
            assert (v, dist) == (i // m, 0)
        elif name == "pipedream":
            fv = max(local - w, 0)
            if op is F or spec.stashing:
                assert (v, dist) == (fv, 0)
            else:
                assert (v, dist) == (local, 0)
        elif name == "pipedream-2bw":
            assert (v, dist) == (max(i // m - 1, 0), 0)
        elif name == "spectrain":
            assert v == max(i - (p - k - 1), 0) if op is F else v == i
            assert dist == (k // 2 + p - k - 1 if op is F else k // 2)
    for (r, k, i), st_ in stale.items():
        local, w = i // reps[k], warmup(reps, k)
        if name in FLUSH + ("avgpipe", "data-parallel"):
            assert st_ == 0
            assert update_at[(r, k, i)] == i // m
        elif name in ("pipedream", "spectrain"):
            assert update_at[(r, k, i)] == local
            assert st_ == min(local, w)
        elif name == "pipedream-2bw":
            assert st_ == (0 if i < m else 1)
    declared = get_strategy(name).weight_versions
    for (r, k), h in held.items():
        # the strategy's declared steady-state count bounds what the IR holds,
        # and is reached once the pipeline has been full for a while and a
        # second iteration has begun (2BW reads the last iteration's version)
        assert h <= declared(s.options, k, p)
        if total >= 2 * sum(reps) and s.num_iterations >= 2:
            expect = declared(s.options, k, p)
            if name == "pipedream-2bw" and reps[k] > 1 and (warmup(reps, k) == 0 or s.num_iterations < 3):
                # a replicated stage defers its update to the first forward of
                # the window after next (or the end): without warm-up that
                # comes after the old version's last read, so it holds the
                # closed gradient instead of a second version
                expect = 1
            assert h == expect, (name, k)
        if name in FLUSH + ("avgpipe", "data-parallel", "spectrain"):
            assert h == 1
        elif name == "pipedream":
            if spec.stashing:
                assert h <= warmup(reps, k) + 1
            else:
                assert h == 1
        elif name == "pipedream-2bw":
            assert h <= 2


@given(specs())
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_strategy_structure_and_versions(spec):
    if expect_error(spec):
        with pytest.raises(StrategyError):
            build_schedule(spec)
        return
    s = build_schedule(spec)
    if validate is not None:
        validate(s)
        if lower is not None:
            validate(lower(s))
    assert s.strategy == spec.strategy
    assert s.num_iterations == spec.iterations
    # the size the strategy announces before building is the size it builds
    assert get_strategy(spec.strategy).stage_passes(spec) == sum(1 for p in s.programs for a in p if a.op is F)
    check_structure(s)
    check_versions(s, spec)
    # UPDATE versions run 1, 2, 3, ... per (replica, stage); a REDUCE_GRAD before each
    # UPDATE whenever gradients are all-reduced across replicas, right before it
    # except in 2BW, which defers the update (test_2bw_defers_the_update)
    for prog in s.programs:
        produced = defaultdict(int)
        last = {}  # (replica, stage) -> its last REDUCE_GRAD or UPDATE
        for pos, a in enumerate(prog):
            rs = (a.replica, a.stage)
            if a.op is REDUCE_GRAD:
                assert last.get(rs) is not REDUCE_GRAD, "two REDUCE_GRADs without an UPDATE between"
                last[rs] = REDUCE_GRAD
            if a.op is UPDATE:
                produced[rs] += 1
                assert a.version == produced[rs]
                reduced = last.get(rs) is REDUCE_GRAD
                last[rs] = UPDATE
                assert reduced == (s.replicas[a.stage] > 1 and spec.strategy != "avgpipe")
                if reduced and spec.strategy != "pipedream-2bw":
                    assert prog[pos - 1].op is REDUCE_GRAD
                    assert (prog[pos - 1].stage, prog[pos - 1].replica) == (a.stage, a.replica)


# --------------------------------------------------------------------------
# per-strategy facts
# --------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (3, 3), (1, 5), (5, 7)])
def test_1f1b_outstanding_and_gpipe_stash(p, m):
    one = build("1f1b", p, m, iterations=2)
    gp = build("gpipe", p, m, iterations=2)
    for k in range(p):
        assert outstanding(one.programs[k], k) == min(p - k, m)
        assert outstanding(gp.programs[k], k) == m


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 7), (5, 10)])
def test_flush_bubbles(p, m):
    T = {F: 1.0, B: 2.0}
    for name in ("gpipe", "1f1b"):
        s = build(name, p, m)
        span = makespan(s, T)
        assert span == pytest.approx((m + p - 1) * 3.0)
        assert 1 - m * 3.0 / span == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 2, 4), (3, 3, 6), (4, 4, 8)])
def test_interleaved_bubble(p, v, m):
    s = build("interleaved-1f1b", p, m, chunks=v)
    T = {F: 1.0 / v, B: 2.0 / v}  # a chunk is 1/v of a device's layers
    ideal = m * 3.0
    assert makespan(s, T) == pytest.approx(ideal + (p - 1) * 3.0 / v)  # bubble (p-1)/(v m) of ideal


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 4), (4, 13), (6, 12)])
@pytest.mark.parametrize("tf,ti,tw", [(1, 1, 1), (2, 2, 1), (1, 1.5, 0.5)])
def test_zb_h1_bubble_and_memory(p, m, tf, ti, tw):
    s = build("zb-h1", p, m)
    span = makespan(s, {F: tf, I: ti, W: tw})
    assert span == pytest.approx(m * (tf + ti + tw) + (p - 1) * (tf + ti - tw))
    one = build("1f1b", p, m)
    assert span < makespan(one, {F: tf, B: ti + tw}) or p == 1
    for k in range(p):
        assert outstanding(s.programs[k], k, done_ops=(W,)) <= min(p, m)  # 1F1B's peak
        assert outstanding(s.programs[k], k, done_ops=(I,)) == min(p - k, m)  # F..I as 1F1B
        pending = peak = 0
        for a in s.programs[k]:
            pending += (a.op is I) - (a.op is W)
            peak = max(peak, pending)
        assert peak == min(k + 1, m)  # the I just done plus at most k deferred W's


def test_pipedream_staleness_and_versions():
    p, m, K = 4, 4, 3
    s = build("pipedream", p, m, iterations=K)
    stale = staleness(s)
    _, _, held = static_versions(s)
    for k in range(p):
        steady = [stale[(0, k, i)] for i in range(p, m * K)]
        assert set(steady) == {p - k - 1}
        assert held[(0, k)] == p - k
        # every backward is followed at once by that stage's update
        prog = s.programs[k]
        for pos, a in enumerate(prog):
            if a.op is B:
                assert prog[pos + 1] == Action(UPDATE, k, version=a.microbatch + 1)


def test_pipedream_vanilla_is_inconsistent():
    p, m = 4, 8
    reads, _, held = static_versions(build("pipedream", p, m, stashing=False))
    for k in range(p - 1):
        assert any(reads[(F, 0, k, i)] != reads[(B, 0, k, i)] for i in range(m))
        assert held[(0, k)] == 1
    assert all(reads[(F, 0, p - 1, i)] == reads[(B, 0, p - 1, i)] for i in range(m))


def test_2bw_versions_and_width():
    p, m, K, w = 3, 4, 4, 2
    s = build("pipedream-2bw", p, m, iterations=K, width=w)
    assert s.num_devices == w * p and s.num_replicas == w
    assert s.placement() == {(r, k): r * p + k for r in range(w) for k in range(p)}
    stale = staleness(s)
    _, _, held = static_versions(s)
    # ids are global over the replicas: an iteration is m*w micro-batches, i on replica i % w
    assert s.num_microbatches == m * w
    assert all(stale[(i % w, k, i)] == (0 if i < m * w else 1) for k in range(p) for i in range(m * w * K))
    assert max(held.values()) == 2
    assert sum(a.op is UPDATE for a in s.programs[0]) == K


def test_spectrain_distances_n4():
    s = build("spectrain", 4, 8, iterations=2)
    assert s.options["s_fwd"] == [3, 2, 2, 1]
    assert s.options["s_bwd"] == [0, 0, 1, 1]
    for k in range(4):
        fd = {a.distance for a in s.programs[k] if a.op is F}
        bd = {a.distance for a in s.programs[k] if a.op is B}
        assert fd == {[3, 2, 2, 1][k]} and bd == {[0, 0, 1, 1][k]}
        preds = [a for a in s.programs[k] if a.op is PREDICT]
        assert all(a.distance > 0 for a in preds)
        # no PREDICT repeats the (version, distance) already materialised
        last = None
        for a in s.programs[k]:
            if a.op is UPDATE:
                last = None
            elif a.op is PREDICT:
                assert (a.version, a.distance) != last
                last = (a.version, a.distance)
    # the last stage's forward and backward share one prediction per version
    last_stage = s.programs[3]
    assert sum(a.op is PREDICT for a in last_stage) == sum(a.op is UPDATE for a in last_stage)


def test_avgpipe_shared_merges_replicas():
    p, m, n_p, K, tau = 3, 4, 2, 4, 2
    s = build("avgpipe", p, m, width=n_p, iterations=K, tau=tau)
    assert s.num_devices == p and s.num_replicas == n_p
    assert s.placement() == {(r, k): k for r in range(n_p) for k in range(p)}
    for k, prog in enumerate(s.programs):
        avgs = Counter(a.replica for a in prog if a.op is AVERAGE)
        assert avgs == {r: K // tau for r in range(n_p)}
        for pos, a in enumerate(prog):
            if a.op is AVERAGE:
                assert prog[pos - 1] == Action(UPDATE, k, version=prog[pos - 1].version, replica=a.replica)
        # AFP: advance=1 forwards ahead of the 1F1B warm-up over the merged stream
        assert outstanding(_slots(prog), k) == min(p - k + 1, n_p * m)
    # the replicas fill each other's bubbles: like one 1F1B over n_p*m micro-batches
    one = build("avgpipe", p, m, width=n_p, advance=0)
    assert makespan(one, {F: 1.0, B: 2.0}) == pytest.approx((n_p * m + p - 1) * 3.0)
    assert makespan(one, {F: 1.0, B: 2.0}) < n_p * makespan(build("1f1b", p, m), {F: 1.0, B: 2.0})


def _slots(prog):
    # count forwards/backwards of every replica together (the merged stream)
    return [a._replace(replica=0) for a in prog if a.op in (F, B)]


def test_avgpipe_advance_extremes_and_disjoint():
    p, m, n_p = 4, 3, 2
    zero = build("avgpipe", p, m, width=n_p, advance=0)
    for k, prog in enumerate(zero.programs):
        assert outstanding(_slots(prog), k) == min(p - k, n_p * m)
    allf = build("avgpipe", p, m, width=n_p, advance=n_p * m)
    for prog in allf.programs:
        ops = [a.op for a in prog if a.op in (F, B)]
        assert ops == [F] * (n_p * m) + [B] * (n_p * m)  # GPipe-like
    dis = build("avgpipe", p, m, width=n_p, placement="disjoint", iterations=2)
    assert dis.num_devices == n_p * p
    assert dis.placement() == {(r, k): r * p + k for r in range(n_p) for k in range(p)}
    assert build_schedule(ScheduleSpec("avgpipe", 2, 2)).num_replicas == 2  # default N_p


def test_data_parallel_layout():
    s = build("data-parallel", 4, 8, iterations=2)
    # the iteration's 8 micro-batches, 2 per device: ids 1 and 5 on device 1
    assert (s.num_devices, s.num_stages, s.num_replicas, s.num_microbatches) == (4, 1, 4, 8)
    assert [format_action(a) for a in s.programs[1][:6]] == [
        "r1.0F1@v0",
        "r1.0B1@v0",
        "r1.0F5@v0",
        "r1.0B5@v0",
        "r1.0REDUCE_GRAD",
        "r1.0UPDATE@v1",
    ]
    assert build("data-parallel", 2, 8, width=2).num_devices == 4
    single = build("data-parallel", 1, 3)
    assert not any(a.op is REDUCE_GRAD for a in single.programs[0])


def test_width_places_replicas_and_reduces():
    p, m, w = 3, 4, 2
    for name in FLUSH:
        s = build(name, p, m, width=w, iterations=2)
        assert s.num_devices == w * p and s.num_replicas == w
        for r in range(w):
            for d in range(p):
                prog = s.programs[r * p + d]
                assert {a.replica for a in prog} == {r}
                # the plain pipeline's order on the replica's own micro-batches: its l-th is l*w + r
                plain = build(name, p, m, iterations=2).programs[d]
                assert [a._replace(replica=0) for a in prog if a.op is not REDUCE_GRAD] == [
                    a if a.microbatch is None else a._replace(microbatch=a.microbatch * w + r) for a in plain
                ]


def test_flush_update_right_after_last_backward():
    s = build("zb-h1", 4, 6, iterations=2)
    for k, prog in enumerate(s.programs):
        for t in range(2):
            last = max(pos for pos, a in enumerate(prog) if a.op in (B, W) and a.microbatch // 6 == t)
            assert prog[last + 1] == Action(UPDATE, k, version=t + 1)
    assert strategy_names() == list(ALL[:4]) + [
        "pipedream",
        "pipedream-2bw",
        "spectrain",
        "avgpipe",
        "data-parallel",
        "tensor-parallel",
    ]


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,match",
    [
        (ScheduleSpec("nope", 2, 2), "unknown strategy"),
        (ScheduleSpec("gpipe", 0, 2), "stages must be >= 1"),
        (ScheduleSpec("1f1b", 2, 0), "microbatches must be >= 1"),
        (ScheduleSpec("1f1b", 2, 2, iterations=0), "iterations must be >= 1"),
        (ScheduleSpec("gpipe", 2, 2, width=0), "width must be >= 1"),
        (ScheduleSpec("interleaved-1f1b", 2, 2, chunks=0), "chunks must be >= 1"),
        (ScheduleSpec("pipedream-2bw", 4, 3), "m=3 < p=4"),
        (ScheduleSpec("data-parallel", 4, 6), "multiple of 4"),
        (ScheduleSpec("pipedream", 2, 2, width=2), "width > 1"),
        (ScheduleSpec("spectrain", 2, 2, width=3), "width > 1"),
        (ScheduleSpec("gpipe", 2, 2, stashing=False), "does not apply"),
        (ScheduleSpec("1f1b", 2, 2, chunks=3), "does not apply"),
        (ScheduleSpec("avgpipe", 2, 2, placement="ring"), "placement"),
        (ScheduleSpec("avgpipe", 2, 2, alpha=0.0), "alpha"),
        (ScheduleSpec("avgpipe", 2, 2, advance=-1), "advance"),
        (ScheduleSpec("avgpipe", 2, 2, tau=0), "tau"),
        (ScheduleSpec("gpipe", 2, 2, optimizer="lamb"), "optimizer"),
        (ScheduleSpec("gpipe", 2.5, 2), "integer"),
        (ScheduleSpec("avgpipe", 2, 2, alpha="x"), "alpha"),
        (ScheduleSpec("pipedream", 2, 2, stashing="no"), "stashing"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(StrategyError, match=match) as info:
        build_schedule(spec)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


NON_DEFAULT = {
    "width": 2,
    "chunks": 3,
    "stashing": False,
    "alpha": 0.5,
    "tau": 2,
    "advance": 2,
    "placement": "disjoint",
}


@pytest.mark.parametrize("name", ALL)
def test_strategy_options_lists_what_is_accepted(name):
    """Every listed option is accepted with a non-default value; every other one is refused."""
    used = strategy_options(name)
    for option, value in NON_DEFAULT.items():
        spec = ScheduleSpec(name, 2, 8, **{option: value})
        if option in used:
            build(name, 2, 8, **{option: value})
        else:
            with pytest.raises(StrategyError, match="does not"):
                build_schedule(spec)
    with pytest.raises(StrategyError, match="unknown strategy"):
        strategy_options("nope")


# --------------------------------------------------------------------------
# what callers ask the strategies (facts declared in each module)
# --------------------------------------------------------------------------


def test_asynchronous_strategies_update_within_an_iteration():
    """``asynchronous`` means weights change between micro-batches of one
    iteration: a pass of iteration 1 or later reads a version other than its
    iteration number on some stage. Flush schedules never do."""
    for strat in strategies():
        s = build_schedule(ScheduleSpec(strat.name, 4, 8, iterations=2))
        m = s.num_microbatches
        reads = [a for prog in s.programs for a in prog if a.op in PASS_OPS]
        off_iteration = any(a.version != a.microbatch // m or a.distance for a in reads)
        assert off_iteration == strat.asynchronous, strat.name


def test_needs_m_ge_p_is_what_the_strategy_defines():
    """Strategies that declare ``needs_m_ge_p`` are the ones whose schedules
    are defined (or match the analytic forms) only from m >= p; every other
    strategy builds and validates with fewer micro-batches than stages."""
    for strat in strategies():
        if strat.needs_m_ge_p:
            continue
        s = build_schedule(ScheduleSpec(strat.name, 4, 4 if strat.name == "data-parallel" else 2))
        validate(s)
    assert {s.name for s in strategies() if s.needs_m_ge_p} == {"interleaved-1f1b", "pipedream-2bw", "zb-h1"}


def test_option_defaults_and_default_width_come_from_the_strategy():
    for strat in strategies():
        spec = ScheduleSpec(strat.name, 2, 4)
        assert spec.width == strat.default_width
        defaults = strat.option_defaults()
        assert set(defaults) == set(strat.options)
        assert all(getattr(spec, name) == value for name, value in defaults.items())
    assert get_strategy("avgpipe").default_width == 2


def test_unknown_strategy_names_the_choices():
    for name in ("nope", None, ["1f1b"]):  # not even a name: still a one-line StrategyError
        with pytest.raises(StrategyError, match="choose one of gpipe, 1f1b"):
            build_schedule(ScheduleSpec(name, 2, 2))


@pytest.mark.parametrize(
    "kw",
    [
        dict(strategy="avgpipe", stages=2, microbatches=2),
        dict(strategy="1f1b", stages=2, microbatches=4, replicas=(2, 1)),
        dict(strategy="pipedream-2bw", stages=2, microbatches=4, width=2),
        dict(strategy="pipedream", stages=2, microbatches=3, replicas=(3, 1)),
    ],
)
def test_a_schedule_rebuilds_from_the_spec_read_off_it(kw):
    """spec_of inverts the build: widths count m per pipeline, per-stage replicas m in all."""
    from pipesim.sim.strategies import spec_of

    sched = build_schedule(ScheduleSpec(**kw))
    assert build_schedule(spec_of(sched)) == sched

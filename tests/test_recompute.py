"""Activation recomputation: the backward re-runs the stage's forward, and a
micro-batch keeps only its layers' inputs until then, rematerialising one
layer at a time (analytic values on uniform models, one layer per stage
first, where per-layer and per-stage checkpointing coincide, then several;
the engine's trackers and the planner's cost model agree)."""

import pytest

from pipesim.sim.api import simulate, simulate_schedule
from pipesim.sim.errors import InputError
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.ir.core import B as OpB
from pipesim.sim.partition.cost import held_activations
from pipesim.sim.partition.layout import layout_of
from pipesim.sim.partition.search import CostSetting, Tables, memory_terms
from pipesim.sim.strategies import ScheduleSpec, build_schedule
from pipesim.sim.workloads.profile import LayerCost, Profile
from pipesim.sim.workloads.stages import recomputed, split_at, stage_cost

F, B = 1e-3, 2e-3
A, S, W = 1 << 18, 1 << 20, 1 << 20  # sent per micro-batch, stashed per micro-batch, weights


def uniform(p: int) -> Profile:
    return Profile("u", tuple(LayerCost(f"l{i}", F, B, W, A, S) for i in range(p)))


def run(strategy: str, p: int, m: int, recompute: bool, iterations: int = 2):
    return simulate_schedule(
        build_schedule(ScheduleSpec(strategy, p, m, iterations=iterations)), uniform(p), "ideal", recompute=recompute
    )


@pytest.mark.parametrize("p,m", [(4, 8), (3, 5), (2, 2)])
def test_one_f_one_b_time_and_memory(p, m):
    plain, rc = run("1f1b", p, m, False), run("1f1b", p, m, True)
    # every pass F + B becomes F + (F + B): makespan (m + p - 1)(2F + B) per iteration
    assert plain.makespan == pytest.approx(2 * (m + p - 1) * (F + B))
    assert rc.makespan == pytest.approx(2 * (m + p - 1) * (2 * F + B))
    for k in range(p):
        inflight = min(p - k, m)
        assert plain.memory[k].peak_breakdown["activations"] == inflight * S
        # the inputs of the others in flight (stage 0's input is the data: 0), one full stash
        assert rc.memory[k].peak_breakdown["activations"] == (inflight - 1) * (A if k else 0) + S
        assert rc.memory[k].peak_bytes < plain.memory[k].peak_bytes or inflight == 1


def test_gpipe_keeps_every_input():
    p, m = 3, 6
    plain, rc = run("gpipe", p, m, False), run("gpipe", p, m, True)
    assert rc.makespan / plain.makespan == pytest.approx((2 * F + B) / (F + B))
    for k in range(p):
        assert plain.memory[k].peak_breakdown["activations"] == m * S
        assert rc.memory[k].peak_breakdown["activations"] == (m - 1) * (A if k else 0) + S


def test_split_backward_recomputes_before_the_input_gradient():
    costs = recomputed(split_at(uniform(2), [0, 1]))
    c = costs[1]
    assert c.backward_input_s == pytest.approx(B / 2 + F) and c.backward_weight_s == pytest.approx(B / 2)
    assert c.backward_s == pytest.approx(B + F) and c.held_bytes == A and c.full_stash_bytes == S
    assert recomputed(costs) == costs  # idempotent


def test_summary_records_it_and_bad_values_are_refused():
    rc = simulate(ScheduleSpec("1f1b", 2, 4), "uniform", recompute=True)
    assert rc.meta["recompute"] is True
    assert "recompute" not in simulate(ScheduleSpec("1f1b", 2, 4), "uniform").meta
    with pytest.raises(InputError, match="recompute must be True or False"):
        simulate(ScheduleSpec("1f1b", 2, 4), "uniform", recompute="no")


@pytest.mark.parametrize("strategy", ["1f1b", "gpipe", "pipedream-2bw"])
def test_cost_model_memory_matches_the_engine(strategy):
    """Both memory checks (the full model's stage_memory and the search's
    memory_terms) count what the engine's tracker holds at its peak."""
    p, m = 4, 8
    prof = uniform(p)
    hw = load_hardware("ideal")
    for recompute in (False, True):
        schedule = build_schedule(ScheduleSpec(strategy, p, m, iterations=2))
        result = simulate_schedule(schedule, prof, hw, recompute=recompute, starts=range(p))
        tables = Tables(prof, recompute)
        layout = layout_of(schedule)
        est = CostSetting.of(prof, hw).estimate(tables.split(tuple(range(p))), layout)
        for k in range(p):
            engine_acts = result.memory[k].peak_breakdown["activations"]
            terms = memory_terms(
                tables, inflight=layout.inflight[k], versions=layout.versions[k], buffers=0, optimizer_multiplier=1
            )
            weights = W * (layout.versions[k] + 2)
            boundary = 2 * (A if k else 0) + 2 * (A if k + 1 < p else 0)
            assert terms[k, k + 1] == est.memory_bytes[k] == weights + engine_acts + boundary, (strategy, k)


def test_held_activations_hook():
    assert held_activations(S, 3) == 3 * S
    assert held_activations(S, 3, A) == 2 * A + S
    assert held_activations(S, 0, A) == 0
    assert held_activations(A // 2, 2, A) == 2 * A  # a stash smaller than its input: the input counts


# ---------------------------------------------------------------- per-layer checkpoints


def layered(p: int, per_stage: int) -> Profile:
    return Profile("u", tuple(LayerCost(f"l{i}", F, B, W, A, S) for i in range(p * per_stage)))


@pytest.mark.parametrize("strategy,p,m,layers", [("1f1b", 4, 8, 3), ("gpipe", 3, 6, 4), ("1f1b", 2, 2, 1)])
def test_checkpoints_are_per_layer(strategy, p, m, layers):
    """A stage of L uniform layers keeps every layer's input between the
    passes (L inputs; stage 0's first input is the data: L - 1) and, in its
    backward, one layer's full stash over the inputs below it: (L - 1)
    inputs + S (stage 0: L - 2). With m in flight (GPipe: all of them) the
    stage peaks at (m - 1) checkpoints + that, far above per-stage
    checkpointing's (m - 1) inputs + L stashes when L A is large."""
    sched = build_schedule(ScheduleSpec(strategy, p, m, iterations=2))
    rc = simulate_schedule(sched, layered(p, layers), "ideal", recompute=True, starts=range(0, p * layers, layers))
    for k in range(p):
        inputs = layers * A if k else (layers - 1) * A
        peak = (layers - 1) * A + S if k else max(layers - 2, 0) * A + S
        inflight = m if strategy == "gpipe" else min(p - k, m)
        assert rc.memory[k].peak_breakdown["activations"] == (inflight - 1) * inputs + peak, k


def test_layer_tables_match_the_stage_costs():
    """The search's per-range checkpoints and backward peaks (numpy tables)
    are the stage costs' own, on layers of every size."""
    sizes = [(7, 100), (0, 30), (50, 5), (3, 300), (20, 20), (0, 0), (90, 10)]  # (activation, stash)
    prof = Profile("mixed", tuple(LayerCost(f"l{i}", F, B, W, a, s) for i, (a, s) in enumerate(sizes)))
    t = Tables(prof, recompute=True)
    for i in range(len(sizes)):
        for j in range(i + 1, len(sizes) + 1):
            c = recomputed([stage_cost(prof, i, j - 1)])[0]
            assert (t.checkpoints[i, j], t.peak[i, j]) == (c.held_bytes, c.full_stash_bytes), (i, j)
            for inflight in (0, 1, 3):
                assert t.held(inflight)[i, j] == held_activations(
                    c.stash_bytes, inflight, c.held_bytes, c.full_stash_bytes
                )


def test_multi_layer_memory_checks_match_the_engine():
    p, m, layers = 4, 8, 3
    prof, hw = layered(p, layers), load_hardware("ideal")
    starts = tuple(range(0, p * layers, layers))
    for strategy in ("1f1b", "gpipe", "pipedream-2bw"):
        schedule = build_schedule(ScheduleSpec(strategy, p, m, iterations=2))
        result = simulate_schedule(schedule, prof, hw, recompute=True, starts=starts)
        tables, layout = Tables(prof, True), layout_of(schedule)
        est = CostSetting.of(prof, hw).estimate(tables.split(starts), layout)
        for k in range(p):
            terms = memory_terms(
                tables, inflight=layout.inflight[k], versions=layout.versions[k], buffers=0, optimizer_multiplier=1
            )
            weights = layers * W * (layout.versions[k] + 2)
            boundary = 2 * (A if k else 0) + 2 * (A if k + 1 < p else 0)  # buffers; free links hold none
            engine = weights + result.memory[k].peak_breakdown["activations"] + boundary
            assert terms[starts[k], starts[k] + layers] == est.memory_bytes[k] == engine, (strategy, k)


# ---------------------------------------------------------------- layers outside the checkpoints


def test_a_layer_outside_the_checkpoints_keeps_its_stash_and_runs_once():
    """A last layer with ``recomputed=False`` (Megatron's LM head): between
    the passes the stage keeps the other layers' inputs plus that layer's
    whole stash, and the backward re-runs only the checkpointed forwards."""
    head = LayerCost("head", 3 * F, 2 * B, W, A, 5 * S, recomputed=False)
    prof = Profile("u", (*(LayerCost(f"l{i}", F, B, W, A, S) for i in range(3)), head))
    c = recomputed([stage_cost(prof, 1, 3)])[0]
    assert c.rerun_forward_s == pytest.approx(2 * F)  # l1 and l2, not the head
    assert c.backward_s == pytest.approx(4 * B + 2 * F)  # the head's backward is 2 B
    assert c.held_bytes == 2 * A + 5 * S
    # the head's backward runs first, holding all of it: two inputs below, its stash
    assert c.full_stash_bytes == 2 * A + 5 * S
    m, p = 4, 2
    result = simulate_schedule(
        build_schedule(ScheduleSpec("gpipe", p, m)), prof, "ideal", recompute=True, starts=(0, 1)
    )
    assert result.memory[1].peak_breakdown["activations"] == m * (2 * A + 5 * S)
    # each stage-1 backward runs l1 and l2's forward again, not the head's
    backwards = [sp.end - sp.start for sp in result.spans if sp.stream == "compute" and sp.action.op is OpB]
    assert sorted(backwards) == pytest.approx([B + F] * m + [4 * B + 2 * F] * m)  # stage 0: l0 again


def test_tables_match_the_stage_costs_with_layers_outside_the_checkpoints():
    sizes = [(7, 100, True), (0, 30, False), (50, 5, True), (3, 300, False), (20, 20, True), (90, 10, False)]
    prof = Profile(
        "mixed",
        tuple(LayerCost(f"l{i}", F * (i + 1), B, W, a, s, recomputed=r) for i, (a, s, r) in enumerate(sizes)),
    )
    t = Tables(prof, recompute=True)
    for i in range(len(sizes)):
        for j in range(i + 1, len(sizes) + 1):
            c = recomputed([stage_cost(prof, i, j - 1)])[0]
            assert (t.checkpoints[i, j], t.peak[i, j]) == (c.held_bytes, c.full_stash_bytes), (i, j)
            assert t.time[i, j] == pytest.approx(c.forward_s + c.backward_s), (i, j)


def test_profile_files_carry_the_flag():
    la = LayerCost("head", F, B, W, A, S, recomputed=False)
    assert la.to_json()["recomputed"] is False and "recomputed" not in LayerCost("x", F, B, W, A, S).to_json()
    back = Profile.from_json(Profile("p", (la,)).to_json())
    assert back.layers[0].recomputed is False
    with pytest.raises(InputError, match="recomputed must be true or false"):
        Profile.from_json({"name": "p", "layers": [la.to_json() | {"recomputed": "no"}]})


def test_the_catalogs_loss_keeps_an_fp32_softmax_outside_the_checkpoints():
    """A GPT's LM head stashes the final layer norm's input and output at the
    device's width and the loss's softmax in fp32 (4 s V bytes a sample,
    Megatron's cross-entropy on logits.float()), whatever the device; the
    embedding and the head stay out of the checkpoints, the blocks do not."""
    from pipesim.sim.workloads.catalog import model_profile

    s, d, vocab, b = 512, 2304, 50257, 2
    for device, width in (("p3.16xlarge", 2), ("pcie-4gpu", 4)):
        prof = model_profile("2bw-gpt-2.2b", load_hardware(device).device, b)
        head, embed = prof.layers[-1], prof.layers[0]
        assert head.stash_bytes == b * (width * 2 * s * d + 4 * s * vocab), device
        assert not head.recomputed and not embed.recomputed
        assert all(la.recomputed for la in prof.layers[1:-1])
    shard = model_profile("2bw-gpt-2.2b", load_hardware("p3.16xlarge").device, b, tensor_parallel=8)
    assert shard.layers[-1].stash_bytes == b * (2 * 2 * s * d + 4 * s * vocab) / 8  # vocabulary-parallel

"""What zero bubble's I leaves held for W (``w_held_bytes``): measured by
the profiler from the tensors, carried by profiles and stages, held by the
simulator from the end of I to the end of W."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipesim.sim.engine.core import simulate
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.partition.split import stage_costs_uniform
from pipesim.sim.strategies import ScheduleSpec, build_schedule
from pipesim.sim.workloads.profile import LayerCost, Profile, WorkloadError
from pipesim.sim.workloads.stages import split_at

STASH, HELD = 1000, 300

FACTORY = """
import torch
import torch.nn.functional as F
from torch import nn

def make(microbatch_size):
    layers = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    return layers, torch.randn(microbatch_size, 16), torch.randint(0, 8, (microbatch_size,)), F.cross_entropy
"""


def _activation_peaks(strategy: str, held: int) -> list[int]:
    sched = build_schedule(ScheduleSpec(strategy, 2, 1))
    costs = [replace(c, w_held_bytes=held) for c in stage_costs_uniform(2, stash_bytes=STASH)]
    result = simulate(sched, costs, load_hardware("ideal"))
    return [m.peak_breakdown["activations"] for m in result.memory]


def test_a_split_backward_holds_what_i_leaves_for_w_until_w_ends():
    """One micro-batch: F, I, W on each stage; between I and W the stage holds its stash and what I left."""
    assert _activation_peaks("zb-h1", 0) == [STASH, STASH]
    assert _activation_peaks("zb-h1", HELD) == [STASH + HELD, STASH + HELD]


def test_an_unsplit_backward_holds_nothing_more():
    assert _activation_peaks("1f1b", HELD) == _activation_peaks("1f1b", 0) == [STASH, STASH]


def test_profiles_carry_it_through_their_files_and_stages():
    layers = tuple(LayerCost(f"l{i}", 1e-3, 2e-3, 64, 128, STASH, w_held_bytes=HELD + i) for i in range(3))
    prof = Profile("p", layers, microbatch_size=4)
    again = Profile.from_json(json.loads(json.dumps(prof.to_json())))
    assert [la.w_held_bytes for la in again.layers] == [HELD, HELD + 1, HELD + 2]
    assert [c.w_held_bytes for c in split_at(again, [0, 1])] == [HELD, 2 * HELD + 3]
    plain = LayerCost("x", 1e-3, 2e-3, 64, 128, STASH)
    assert "w_held_bytes" not in plain.to_json()  # absent means 0: files without it read as before
    with pytest.raises(WorkloadError, match="w_held_bytes"):
        LayerCost("x", 1e-3, 2e-3, 64, 128, STASH, w_held_bytes=-1)


def test_the_profiler_counts_the_output_gradients_a_linear_layer_keeps_for_w(tmp_path):
    """A linear layer's W multiplies its input (stashed) with its output's
    gradient, which I computes and leaves held: b x outputs x 4 bytes."""
    pytest.importorskip("torch")
    from pipesim.validate.profiler import ProfileSettings, profile_layers
    from pipesim.validate.usermodels import resolve_model

    (tmp_path / "two_linears.py").write_text(FACTORY)
    b = 4
    model = resolve_model(f"{tmp_path / 'two_linears.py'}:make", microbatch_size=b)
    prof, _ = profile_layers(model, settings=ProfileSettings(b, warmup=1, repeats=1))
    assert [la.w_held_bytes for la in prof.layers] == [b * 32 * 4, b * 8 * 4]
    assert prof.layers[0].stash_bytes == b * 16 * 4  # its input, for W

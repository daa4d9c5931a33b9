"""Repeated layers (a transformer's blocks) are timed once: which layers
repeat which (``repeated_layers``), and a profile whose repeats carry their
first's times, bytes measured for each layer all the same."""

from __future__ import annotations

import hashlib
import importlib.util

import pytest
import torch

from pipesim.validate.models import RealModel, layer_stats, repeated_layers
from pipesim.validate.profiler import ProfileSettings, profile_layers, time_layers
from pipesim.validate.usermodels import resolve_model

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[models]')",
)

GPT2 = "hf:gpt2?n_layer=4&n_embd=64&n_head=2&vocab_size=97&seq_len=16"


def _same_as(spec: str, b: int = 2) -> tuple[RealModel, list[int]]:
    model = resolve_model(spec, microbatch_size=b)
    return model, repeated_layers(model, layer_stats(model, b))


@needs_transformers
def test_a_transformers_blocks_repeat_the_first_and_the_ends_stand_alone():
    model, same_as = _same_as(GPT2)
    assert model.layer_names == ["embed", "block0", "block1", "block2", "block3", "head"]
    # block1..3 differ from block0 only in attn.layer_idx, the KV cache's index
    assert same_as == [0, 1, 1, 1, 1, 5]


@needs_transformers
def test_a_resnet_stages_first_block_which_changes_shapes_is_timed():
    model, same_as = _same_as("hf:resnet?depths=3,2&hidden_sizes=32,64&embedding_size=32&image_size=32")
    names = dict(zip(model.layer_names, same_as, strict=True))
    first = model.layer_names.index
    assert names["stage0.block1"] == names["stage0.block2"] == first("stage0.block0")  # 32 -> 32 channels
    assert names["stage1.block0"] == first("stage1.block0")  # 32 -> 64 channels, strided
    assert names["stage1.block1"] == first("stage1.block1")  # its input is stage1.block0's output, not 32 channels


_TOY = """
import torch
from torch import nn


class Toy(nn.Module):
    def __init__(self, p=0.0, width=16, place=0):
        super().__init__()
        self.linear, self.drop = nn.Linear(16, width), nn.Dropout(p)
        self.layer_idx = place  # its place in the model, not a difference in what it computes

    def forward(self, x):
        return self.drop(self.linear(x))


def make(b):
    torch.manual_seed(0)
    layers = LAYERS
    return layers, torch.randn(b, 16), torch.randint(0, 16, (b,)), nn.functional.cross_entropy
"""


def _toy(tmp_path, layers: str) -> RealModel:
    path = tmp_path / f"toy_{hashlib.sha1(layers.encode()).hexdigest()[:12]}.py"  # a module name per model
    path.write_text(_TOY.replace("LAYERS", layers))
    return resolve_model(f"{path}:make", microbatch_size=4)


def _toy_same_as(tmp_path, layers: str) -> list[int]:
    model = _toy(tmp_path, layers)
    return repeated_layers(model, layer_stats(model, 4))


def test_a_layer_repeats_only_what_computes_alike_on_alike_shapes(tmp_path):
    assert _toy_same_as(tmp_path, "[Toy(place=i) for i in range(5)]") == [0, 1, 1, 1, 4]
    # a dropout rate is a difference
    mixed = "[Toy(), Toy(), Toy(p=0.1), Toy(p=0.1), Toy()]"
    assert _toy_same_as(tmp_path, mixed) == [0, 1, 2, 2, 4]
    # so is a width, and what follows a change of width is timed too
    widths = "[Toy(), Toy(), Toy(width=8), nn.Linear(8, 16), Toy()]"
    assert _toy_same_as(tmp_path, widths) == [0, 1, 2, 3, 4]


def test_repeats_take_their_firsts_times_and_the_chain_runs_without_them(tmp_path):
    model = _toy(tmp_path, "[Toy(place=i) for i in range(6)]")
    same_as = repeated_layers(model, layer_stats(model, 4))
    assert same_as == [0, 1, 1, 1, 1, 5]
    t = time_layers(model, torch.device("cpu"), ProfileSettings(4, warmup=1, repeats=2), same_as=same_as)
    for values in (t.forward, t.backward, t.backward_input, t.update, t.optimizer_state_bytes, t.w_held_bytes):
        assert len(values) == 6 and values[2] == values[3] == values[4] == values[1]
    assert t.forward[1] != t.forward[0]  # timed apart


@needs_transformers
def test_a_profile_says_which_layers_it_timed_and_every_layer_times_them_all():
    model = resolve_model(GPT2, microbatch_size=2)
    settings = ProfileSettings(2, warmup=1, repeats=1)
    prof, _ = profile_layers(model, settings=settings)
    blocks = prof.layers[1:5]
    assert len({(la.forward_s, la.backward_s, la.backward_input_s) for la in blocks}) == 1
    assert "3 of 6 layers timed" in prof.notes and "block1-block3 take block0's times" in prof.notes
    # bytes are every layer's own: the embedding's and the head's differ from the blocks'
    assert prof.layers[0].param_bytes != blocks[0].param_bytes != prof.layers[5].param_bytes
    every, _ = profile_layers(resolve_model(GPT2, microbatch_size=2), settings=settings, every_layer=True)
    assert "every layer timed" in every.notes
    assert len({(la.forward_s, la.backward_s) for la in every.layers[1:5]}) == 4

"""`pipesim bench profile`: the wall time of `pipesim profile --model`, and its determinism check."""

from __future__ import annotations

import copy

import pytest

from pipesim.experiments.bench.profile import differences, untimed
from pipesim.experiments.cli import main

TINY = "hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=128&seq_len=16"


def _profile(forward_s=0.01, stash=4096):
    return {
        "name": "x-measured",
        "overhead": {"forward_s": 1e-5, "backward_s": 2e-5},
        "layers": [
            {"name": "embed", "forward_s": forward_s, "backward_s": 0.02, "param_bytes": 512, "stash_bytes": stash},
            {"name": "head", "forward_s": 0.03, "backward_s": 0.04, "param_bytes": 256, "stash_bytes": 128},
        ],
    }


def test_profiles_differing_only_in_their_times_are_the_same():
    a, b = _profile(forward_s=0.01), _profile(forward_s=0.5)
    assert differences(untimed(a), untimed(b)) == []
    assert "forward_s" not in untimed(a)["layers"][0] and "overhead" not in untimed(a)


def test_a_byte_count_that_moves_is_a_difference_named_by_its_path():
    a, b = _profile(stash=4096), _profile(stash=4100)
    assert differences(untimed(a), untimed(b)) == ["layers[0].stash_bytes: 4096 != 4100"]
    c = copy.deepcopy(a)
    c["layers"].pop()
    assert differences(untimed(a), untimed(c))  # a layer more or less is a difference


def test_bench_profile_times_the_command_and_finds_it_deterministic(capsys):
    code = main(["bench", "profile", "--model", TINY, "--repeats", "2", "--microbatch-size", "2"])
    out = capsys.readouterr().out
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith(TINY))
    assert row.split()[1] == "4" and row.rstrip().endswith("yes")  # embed, 2 blocks, head


@pytest.mark.parametrize("model", ["nosuch_module_xyz:make", "hf:gpt2?n_layers=2"])
def test_bench_profile_passes_a_refusal_on_in_one_line(model, capsys):
    code = main(["bench", "profile", "--model", model, "--repeats", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 2 and err[-1].startswith("error: ") and model.split("?")[0] in err[-1], err

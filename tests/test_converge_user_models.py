"""``pipesim converge --model M`` for models from elsewhere: ``hf:``, a factory.

What a wrong implementation gets wrong: the data a model trains on (the
character corpus for a causal language model, the factory's own samples,
random samples only with ``--synthetic``), that training on them lowers the
held-out loss, that the emulator and the distributed runtime give the same
bits for a model with dropout, and that every bad input is one line and exit 2.
Configurations are tiny: a 2-block GPT-2 of width 32, a few updates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipesim.experiments.cli import main
from pipesim.validate import data as data_mod
from pipesim.validate.convergence import Run, Setup, run_data, train

GPT2 = "hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=128&seq_len=16"

needs_transformers = pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None, reason="needs the models extra (transformers)"
)

#: A factory with its own data: y = the class of the largest of 4 features
#: (learnable, so the held-out loss falls), 256 training and 64 held-out samples.
FACTORY = """
import torch
from torch import nn

from pipesim.validate import data

CALLS = []


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def _samples(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, x.argmax(1)


def make(b):
    layers = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return layers, torch.zeros(b, 4), torch.zeros(b, dtype=torch.long), loss_fn, data.tensors(
        train=_samples(256, 1), heldout=_samples(64, 2)
    )


def without_data(b):
    return make(b)[:4]


def bad_data(b):
    return (*make(b)[:4], 42)
"""


@pytest.fixture
def factory(tmp_path) -> Path:
    path = tmp_path / "conv_factory.py"
    path.write_text(FACTORY, encoding="utf-8")
    return path


def args(model: str, out: Path, *extra: str) -> list[str]:
    return [
        "converge",
        "--model",
        model,
        "--stages",
        "2",
        "--strategies",
        "1f1b",
        "--lr",
        "0.05",
        "--seeds",
        "0",
        "--updates",
        "8",
        "--update-batch",
        "8",
        "--eval-every",
        "4",
        "--jobs",
        "1",
        "--out",
        str(out),
        *extra,
    ]


@needs_transformers
def test_a_causal_language_model_trains_on_the_character_corpus(monkeypatch):
    read = []
    batch = data_mod.CharCorpus.batch

    def spy(self, index):
        read.append((self.split, self.seq_len, self.microbatch_size, index))
        return batch(self, index)

    monkeypatch.setattr(data_mod.CharCorpus, "batch", spy)
    setup = Setup(model=GPT2, updates=16, update_batch=8, eval_every=8, optimizer="adam", warmup_steps=0)
    record = train(Run(setup, "1f1b", 2, 0.003, 0))
    # every training micro-batch came from the corpus's training split, at the model's seq_len
    assert read and {(s, n) for s, n, _, _ in read} == {("train", 16)}
    samples = {i * b + j for _, _, b, i in read for j in range(b)}
    assert samples == set(range(16 * 8))
    losses = [p["heldout_loss"] for p in record["curve"]]
    assert losses[-1] < losses[0] - 0.3 and not record["diverged"]
    assert all(0 <= p["heldout_accuracy"] <= 1 for p in record["curve"])
    assert "char_corpus" in run_data(setup).description


def test_the_factorys_own_data_are_what_it_trains_and_evaluates_on(factory, monkeypatch):
    read = []
    batch, held = data_mod.TensorSamples.batch, data_mod.TensorSamples.heldout_set
    monkeypatch.setattr(data_mod.TensorSamples, "batch", lambda self, i: read.append(i) or batch(self, i))
    evaluated = []
    monkeypatch.setattr(data_mod.TensorSamples, "heldout_set", lambda self: evaluated.append(1) or held(self))
    setup = Setup(model=f"{factory}:make", updates=40, update_batch=8, eval_every=20)
    record = train(Run(setup, "1f1b", 2, 0.1, 0))
    assert sorted(set(read)) == list(range(40 * 2))  # 2 micro-batches of 4 per update
    assert evaluated
    curve = record["curve"]
    assert curve[-1]["heldout_loss"] < 0.8 * curve[0]["heldout_loss"]
    assert curve[-1]["heldout_accuracy"] > curve[0]["heldout_accuracy"]
    # the held-out figures are of the factory's 64 held-out samples: the accuracy is a multiple of 1/64
    assert all(math.isclose(p["heldout_accuracy"] * 64, round(p["heldout_accuracy"] * 64)) for p in curve)


def test_the_tensors_stream_is_addressed_by_sample():
    x = torch.arange(10.0).reshape(10, 1)
    data = data_mod.tensors(train=(x, torch.arange(10)), heldout=(x[:3], torch.arange(3)))
    four = [data(4, 7, "train").batch(i)[1] for i in range(5)]
    two = [data(2, 7, "train").batch(i)[1] for i in range(10)]
    assert torch.equal(torch.cat(four), torch.cat(two))
    # every epoch visits every sample once; another seed, another order
    assert sorted(torch.cat(four)[:10].tolist()) == list(range(10))
    assert not torch.equal(torch.cat(four), torch.cat([data(4, 8, "train").batch(i)[1] for i in range(5)]))
    assert data(1, 0, "heldout").heldout_set()[1].tolist() == [0, 1, 2]


def test_without_data_synthetic_trains_random_samples_and_says_it_is_a_loss_curve(factory, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(args(f"{factory}:without_data", out, "--synthetic")) == 0
    printed = capsys.readouterr().out
    assert "loss curve only" in printed and "held-out loss" in printed
    doc = json.loads((out / "curves.json").read_text())
    st = doc["settings"]
    assert st["synthetic"] is True and st["compared_on"] == "heldout_loss" and "synthetic" in st["data"]
    (run,) = doc["runs"]
    assert run["final_heldout_accuracy"] is None and all(p["heldout_accuracy"] is None for p in run["curve"])
    assert math.isfinite(run["final_heldout_loss"])
    assert "heldout_loss" in doc["summary"]["2"] and "accuracy" not in doc["summary"]["2"]


def test_synthetic_samples_are_addressed_by_sample_and_keep_the_examples_masks():
    from pipesim.validate.usermodels import ExampleSamples

    ids = torch.randint(3, 9, (4, 5))
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[:, -1] = True
    src = ExampleSamples(4, (ids, mask), torch.randn(4, 2), seed=1, split="train")
    (a_ids, a_mask), a_y = src.batch(1)
    (b_ids, b_mask), b_y = ExampleSamples(2, (ids, mask), torch.randn(4, 2), seed=1, split="train").batch(3)
    assert torch.equal(a_ids[2:], b_ids) and torch.equal(a_y[2:], b_y)
    assert a_ids.min() >= 3 and a_ids.max() <= 8 and torch.equal(a_mask, mask)


@needs_transformers
@pytest.mark.multiprocess
def test_the_distributed_runtime_trains_the_same_bits_with_dropout():
    from pipesim.validate.convergence import train_distributed

    run = Run(Setup(model=GPT2, updates=8, update_batch=8, eval_every=4), "pipedream-2bw", 2, 0.01, 1)
    assert train_distributed(run, timeout_s=180) == train(run)


@needs_transformers
def test_dropout_masks_depend_on_the_seed_stage_and_micro_batch_only():
    """GPT-2 keeps dropout 0.1: two runs of one seed agree bit for bit
    whatever the process's RNG held; another seed's masks differ."""
    setup = Setup(model=GPT2, updates=4, update_batch=8, eval_every=4)
    torch.manual_seed(123)
    a = train(Run(setup, "1f1b", 2, 0.05, 0))
    torch.manual_seed(456)
    assert train(Run(setup, "1f1b", 2, 0.05, 0)) == a


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and "%|" not in err
    return err


@pytest.mark.parametrize(
    ("model", "extra", "fragment"),
    [
        ("{factory}:without_data", (), "the factory gives no data (no fifth item)"),
        ("{factory}:bad_data", (), "fifth item (its data) must be None or callable"),
        ("mlp", ("--synthetic",), "mlp comes with its data; --synthetic is for models that come with none"),
        ("{factory}:nothing", (), "has no nothing"),
        ("{factory}:make", ("--model-depth", "4"), "--model-depth sizes catalog models only"),
    ],
)
def test_bad_factory_input_is_one_line_and_exit_2(factory, tmp_path, capsys, model, extra, fragment):
    assert main(args(model.format(factory=factory), tmp_path / "out", *extra)) == 2
    err = _one_line(capsys)
    assert fragment in err, err
    if "no fifth item" in fragment:  # both remedies named
        assert "--synthetic" in err and "fifth item" in err


@needs_transformers
@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        (
            "hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=64&seq_len=16",
            "character corpus of 103 characters and this vocabulary has 64 tokens: set vocab_size to 103 or more",
        ),
        (
            "hf:resnet?depths=1,1&hidden_sizes=8,16&embedding_size=8&layer_type=basic&image_size=16",
            "has 2 labels: set num_labels=10",
        ),
        (
            "hf:bert?num_hidden_layers=2&hidden_size=32&num_attention_heads=2&intermediate_size=64",
            "add --synthetic for a loss curve on random samples",
        ),
        ("hf:gpt2?n_layers=2", "n_layers is not a field of GPT2Config"),
    ],
)
def test_bad_hf_input_is_one_line_and_exit_2(tmp_path, capsys, model, fragment):
    assert main(args(model, tmp_path / "out")) == 2
    assert fragment in _one_line(capsys)


@needs_transformers
def test_too_few_layers_for_the_stages_names_the_models_remedy(tmp_path, capsys):
    argv = args(GPT2, tmp_path / "out")
    argv[argv.index("--stages") + 1] = "8"
    assert main(argv) == 2
    assert "8 stages need at least as many layers; the model has 4 (choose a model with more layers)" in _one_line(
        capsys
    )

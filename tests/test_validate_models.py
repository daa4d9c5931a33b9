"""Real models and data of the validation harness: determinism, shapes, splitting, learning, byte counts."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import pytest
import torch

from pipesim.sim.errors import InputError
from pipesim.validate import data
from pipesim.validate.models import (
    LayerStats,
    RealModel,
    build_model,
    layer_stats,
    model_names,
    split,
)
from pipesim.validate.numerics import intra_op_threads

ALL_MODELS = ["gpt-small", "lstm", "mlp", "vgg-small"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Intra-op threads buy nothing on these small tensors, and on a loaded machine they spin."""
    with intra_op_threads(1):
        yield


@pytest.fixture(scope="module", params=ALL_MODELS)
def model(request) -> RealModel:
    return build_model(request.param)


# ------------------------------------------------------------------ data


@pytest.mark.parametrize(
    "make",
    [
        lambda: data.digits(16, seed=3),
        lambda: data.digits(16, seed=3, image=True),
        lambda: data.char_corpus(8, 20, seed=3),
        lambda: data.synthetic(
            8, data.TensorSpec((5,), torch.float32), data.TensorSpec((), torch.int64, high=4), seed=3
        ),
    ],
    ids=["digits", "digits-image", "corpus", "synthetic"],
)
def test_batches_are_a_pure_function_of_seed_and_index(make):
    a, b = make(), make()
    forward = [a.batch(i) for i in range(6)]
    # A second source (another rank) asking in another order, with repeats.
    for i in [5, 0, 3, 3, 1, 4, 2]:
        x, y = b.batch(i)
        assert torch.equal(x, forward[i][0]) and torch.equal(y, forward[i][1])
    assert not torch.equal(forward[0][0], forward[1][0])
    # The global RNGs neither feed nor are fed by a batch.
    torch.manual_seed(123)
    x, _ = make().batch(2)
    assert torch.equal(x, forward[2][0])
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(123).get_state())


def test_seed_changes_the_stream():
    assert not torch.equal(data.digits(16, seed=0).batch(0)[0], data.digits(16, seed=1).batch(0)[0])
    assert not torch.equal(data.char_corpus(4, 16, seed=0).batch(0)[0], data.char_corpus(4, 16, seed=1).batch(0)[0])


def test_digits_shapes_dtypes_and_standardisation():
    flat, img = data.digits(24, seed=5), data.digits(24, seed=5, image=True)
    x, y = flat.batch(7)
    xi, yi = img.batch(7)
    assert x.shape == (24, 64) and x.dtype == torch.float32
    assert xi.shape == (24, 1, 8, 8) and torch.equal(xi.reshape(24, 64), x) and torch.equal(yi, y)
    assert y.shape == (24,) and y.dtype == torch.int64
    assert 0 <= int(y.min()) and int(y.max()) < flat.num_classes == 10
    everything, _ = data._digits_arrays()
    assert everything.shape == (1797, 64)
    mean, std = everything.mean(0), everything.std(0, unbiased=False)
    assert mean.abs().max() < 1e-5
    varying = std > 0
    assert varying.sum() > 55  # a few corner pixels are always blank
    assert torch.allclose(std[varying], torch.ones(int(varying.sum())), atol=1e-4)


def _row_counts(x: torch.Tensor) -> collections.Counter:
    return collections.Counter(bytes(r.numpy().tobytes()) for r in x)


def test_digits_walk_whole_epochs_across_straddling_batches():
    b = 1000  # batch 1 straddles the end of epoch 0 (1797 examples)
    src = data.digits(b, seed=2)
    x = torch.cat([src.batch(i)[0] for i in range(4)])  # positions 0..3999: epochs 0, 1 and part of 2
    everything, _ = data._digits_arrays()
    n = everything.shape[0]
    assert _row_counts(x[:n]) == _row_counts(everything)
    assert _row_counts(x[n : 2 * n]) == _row_counts(everything)
    # A new permutation each epoch, not the same order again.
    assert not torch.equal(x[:n], x[n : 2 * n])


def test_heldout_split_is_disjoint_from_training_and_fixed():
    everything, labels = data._digits_arrays()
    train = data.digits(100, seed=3, split="train")
    held_x, held_y = data.digits(1, seed=9, split="heldout").heldout_set()
    assert train.num_examples + len(held_x) == len(everything) == 1797
    seen = _row_counts(torch.cat([train.batch(i)[0] for i in range(15)]))  # 1500 samples: a whole epoch
    assert set(seen) == set(_row_counts(everything[torch.from_numpy(data._digits_split_rows("train").copy())]))
    assert not set(seen) & set(_row_counts(held_x))
    # every class is held out in proportion, and the split does not follow the seed
    assert collections.Counter(held_y.tolist()) == {
        c: round(n * 0.2) for c, n in collections.Counter(labels.tolist()).items()
    }
    assert torch.equal(data.digits(1, seed=0, image=True).heldout_set()[0].reshape(-1, 64), held_x)

    corpus = data.char_corpus(64, 24, seed=1, split="train")
    text = data.corpus_text()
    tail = text[len(text) - round(len(text) * data.CORPUS_HELDOUT_SHARE) :]
    hx, hy = corpus.heldout_set()
    assert hx.shape[1] == 24 and torch.equal(hx[:, 1:], hy[:, :-1])
    assert all(corpus.decode(x) + corpus.decode(y[-1:]) in tail for x, y in zip(hx, hy))
    head = text[: len(text) - len(tail)]
    for i in range(4):
        x, y = corpus.batch(i)
        assert all(corpus.decode(r) + corpus.decode(t[-1:]) in head for r, t in zip(x, y))


@pytest.mark.parametrize(
    "make",
    [lambda b: data.digits(b, seed=4, split="train"), lambda b: data.char_corpus(b, 16, seed=4, split="train")],
    ids=["digits", "corpus"],
)
def test_streams_are_addressed_by_sample(make):
    """One micro-batch of 12 holds the samples of three of 4: runs that cut
    the stream differently (a pipeline's m micro-batches against PipeDream's
    one) train on the same samples in the same order."""
    big, small = make(12), make(4)
    for i in range(3):
        x, y = big.batch(i)
        parts = [small.batch(3 * i + j) for j in range(3)]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))


def test_deep_mlp_trains_with_he_initialisation():
    """torch's default initialisation shrinks a ReLU stack's activations about
    3x per layer; at depth 8 the mlp then barely trained."""
    m = build_model("mlp", width=64, depth=8)
    scales = []
    x = m.data(256, split="train").batch(0)[0]
    with torch.no_grad():
        for layer in m.layers[:-1]:
            x = layer(x)
            scales.append(float(x.pow(2).mean()))
    assert 0.3 < scales[-1] / scales[0] < 3  # no vanishing through 8 layers
    net, src = m.sequential(), m.data(32, split="train")
    opt = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)
    for i in range(120):
        x, y = src.batch(i)
        opt.zero_grad()
        m.loss_fn(net(x), y).backward()
        opt.step()
    hx, hy = m.heldout()
    with torch.no_grad():
        assert (net(hx).argmax(-1) == hy).float().mean() > 0.85


def test_corpus_targets_are_next_characters_of_the_real_text():
    src = data.char_corpus(6, 40, seed=1)
    x, y = src.batch(11)
    assert x.shape == y.shape == (6, 40) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    text = data.corpus_text()
    assert len(text) > 400_000
    assert src.vocab_size == len(set(text)) == len(src.vocab)
    assert 0 <= int(x.min()) and int(x.max()) < src.vocab_size
    for row_x, row_y in zip(x, y):
        window = src.decode(row_x) + src.decode(row_y[-1:])
        assert window in text
    assert torch.equal(src.encode(src.decode(x[0])), x[0])


def test_synthetic_like_keeps_shapes_and_dtypes_only(model):
    real, fake = model.data(8), model.data(8, synthetic=True)
    (xr, yr), (xf, yf) = real.batch(0), fake.batch(0)
    assert xf.shape == xr.shape and xf.dtype == xr.dtype
    assert yf.shape == yr.shape and yf.dtype == yr.dtype
    assert not torch.equal(xf, xr)
    assert 0 <= int(yf.min()) and int(yf.max()) < real.target_spec.high
    if not xr.dtype.is_floating_point:
        assert 0 <= int(xf.min()) and int(xf.max()) < real.input_spec.high
    assert torch.equal(fake.batch(3)[0], model.data(8, synthetic=True).batch(3)[0])
    model.loss_fn(model.sequential()(xf), yf)  # the model accepts it


@pytest.mark.parametrize(
    "call",
    [
        lambda: data.digits(0),
        lambda: data.digits(True),
        lambda: data.digits(4, seed=-1),
        lambda: data.digits(4).batch(-1),
        lambda: data.char_corpus(0, 8),
        lambda: data.char_corpus(4, 0),
        lambda: data.char_corpus(4, 10**7),
        lambda: data.digits(4, split="test"),
        lambda: data.char_corpus(4, 8, split=None),
        lambda: data.TensorSpec((3,), torch.int64),  # integers need a bound
        lambda: data.synthetic(0, data.TensorSpec((3,), torch.float32), data.TensorSpec((), torch.float32)),
    ],
)
def test_bad_data_arguments_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


# ---------------------------------------------------------------- models


def _params(m: RealModel) -> list[torch.Tensor]:
    return [p for layer in m.layers for p in layer.parameters()]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_init_is_a_function_of_the_seed_only(name):
    torch.manual_seed(1)
    a = build_model(name, seed=7)
    after_build = torch.rand(3)
    torch.manual_seed(999)  # a different global state must not matter
    b = build_model(name, seed=7)
    c = build_model(name, seed=8)
    pa, pb, pc = _params(a), _params(b), _params(c)
    assert len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert any(not torch.equal(x, y) for x, y in zip(pa, pc))
    # ... and building leaves the caller's RNG stream where it was.
    torch.manual_seed(1)
    assert torch.equal(torch.rand(3), after_build)


def test_catalog_and_configuration():
    assert model_names() == ALL_MODELS
    mlp = build_model("mlp", width=32, depth=3)
    assert mlp.num_layers == 4 and mlp.config["width"] == 32 and mlp.config["depth"] == 3
    assert isinstance(mlp.layers[1][0], torch.nn.Linear) and mlp.layers[1][0].out_features == 32
    gpt = build_model("gpt-small", width=32, depth=2, heads=2, seq_len=16)
    assert gpt.num_layers == 4 and gpt.config["seq_len"] == 16
    assert gpt.data(2).batch(0)[0].shape == (2, 16)
    vgg = build_model("vgg-small", width=8, depth=6)
    assert vgg.num_layers == 8
    assert sum(isinstance(m, torch.nn.Conv2d) for layer in vgg.layers for m in layer.modules()) == 6
    assert len(mlp.layer_names) == mlp.num_layers and mlp.description.startswith("mlp")
    for m in (mlp, gpt, vgg):  # determinism rules: no dropout, no batch norm
        kinds = {type(sub) for layer in m.layers for sub in layer.modules()}
        assert not kinds & {torch.nn.Dropout, torch.nn.BatchNorm1d, torch.nn.BatchNorm2d}
        assert not [b for layer in m.layers for b in layer.buffers()]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"name": "foo"}, "choose from: gpt-small, lstm, mlp, vgg-small"),
        ({"name": "mlp", "width": 0}, "width"),
        ({"name": "mlp", "depth": -1}, "depth"),
        ({"name": "mlp", "width": 2.5}, "width"),
        ({"name": "mlp", "heads": 4}, "heads"),
        ({"name": "gpt-small", "width": 30, "heads": 4}, "divisible"),
        ({"name": "gpt-small", "seq_len": 10**7}, "seq_len"),
        ({"name": "vgg-small", "seed": -1}, "seed"),
    ],
)
def test_bad_model_arguments_are_one_line_input_errors(kwargs, fragment):
    # ModelError for the model's own options, DataError for what its data cannot give
    kwargs = dict(kwargs)
    with pytest.raises(InputError, match=fragment) as e:
        build_model(kwargs.pop("name"), **kwargs)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_every_layer_maps_one_tensor_and_loss_is_finite(model):
    x, y = model.data(4).batch(0)
    for layer in model.layers:
        x = layer(x)
        assert isinstance(x, torch.Tensor)
    loss = model.loss_fn(x, y)
    assert loss.ndim == 0 and math.isfinite(loss.item())
    # Untrained classifier over C classes: loss close to log(C).
    assert abs(loss.item() - math.log(x.shape[-1])) < 0.5


def test_gpt_attention_is_causal():
    m = build_model("gpt-small", width=32, depth=2, heads=2, seq_len=16)
    net = m.sequential()
    x, _ = m.data(2).batch(0)
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % m.config["vocab_size"]
    with torch.no_grad():
        a, b = net(x), net(x2)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@dataclass
class _Stage:  # stands in for pipesim.sim.workloads.stages.StageCost
    first_layer: int
    last_layer: int


def _run_stages(stages, x, y, loss_fn):
    """Forward and backward stage by stage, cutting the graph at each boundary as a pipeline does."""
    outs, ins = [], []
    for stage in stages:
        inp = x.detach().requires_grad_(x.dtype.is_floating_point and bool(ins))
        ins.append(inp)
        x = stage(inp)
        outs.append(x)
    loss = loss_fn(outs[-1], y)
    loss.backward()
    for k in range(len(stages) - 2, -1, -1):
        outs[k].backward(ins[k + 1].grad)
    return outs[-1], loss


def test_split_stages_compute_exactly_the_whole_model(model):
    n = model.num_layers
    x, y = model.data(4).batch(1)
    whole = model.sequential()
    model.sequential().zero_grad(set_to_none=True)
    ref_out = whole(x)
    model.loss_fn(ref_out, y).backward()
    ref_grads = [p.grad.clone() for p in _params(model)]
    model.sequential().zero_grad(set_to_none=True)

    for spec in ([0, 1, n - 1], [_Stage(0, 0), _Stage(1, n - 2), _Stage(n - 1, n - 1)]):
        stages = split(model, spec)
        assert len(stages) == 3 and [len(s) for s in stages] == [1, n - 2, 1]
        assert stages[1][0] is model.layers[1]  # stages share the model's parameters
        out, _ = _run_stages(stages, x, y, model.loss_fn)
        assert torch.equal(out, ref_out.detach())
        grads = [p.grad for p in _params(model)]
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
        model.sequential().zero_grad(set_to_none=True)
    assert len(split(model, [0])) == 1 and len(split(model, list(range(n)))) == n


def test_split_accepts_partitioner_stage_costs():
    from pipesim.sim.workloads.stages import StageCost

    m = build_model("mlp", width=16, depth=3)
    costs = [StageCost(0, 1, 1.0, 2.0, 1.0, 1.0, 0, 0, 0), StageCost(2, 3, 1.0, 2.0, 1.0, 1.0, 0, 0, 0)]
    stages = split(m, costs)
    assert [list(s) for s in stages] == [m.layers[:2], m.layers[2:]]


@pytest.mark.parametrize(
    "spec",
    [
        [],
        [1, 2],
        [0, 2, 2],
        [0, 3, 1],
        [0, 5],
        [0, True],
        [0.0, 2],
        "ab",
        [_Stage(0, 1)],
        [_Stage(0, 1), _Stage(3, 4)],
        [_Stage(1, 4)],
        [_Stage(0, 2), _Stage(3, 2), _Stage(3, 4)],
    ],
)
def test_split_rejects_bad_stage_lists(spec):
    m = build_model("mlp", width=16, depth=4)  # 5 layers
    with pytest.raises(ValueError):
        split(m, spec)


@pytest.mark.parametrize(
    "name, kwargs, lr, factor",
    [
        ("mlp", {}, 0.05, 0.7),
        ("vgg-small", {}, 0.05, 0.8),
        ("gpt-small", {"width": 64, "depth": 2}, 0.1, 0.8),  # the default learns too, 5x slower
        ("lstm", {"width": 32, "depth": 2}, 0.3, 0.8),
    ],
)
def test_models_learn_their_real_data(name, kwargs, lr, factor):
    m = build_model(name, **kwargs)
    net = m.sequential()
    src = m.data(32)
    held_out = [src.batch(10_000 + i) for i in range(3)]

    def eval_loss() -> float:
        with torch.no_grad():
            return sum(m.loss_fn(net(x), y).item() for x, y in held_out) / len(held_out)

    before = eval_loss()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    for i in range(40):
        x, y = src.batch(i)
        opt.zero_grad()
        m.loss_fn(net(x), y).backward()
        opt.step()
    after = eval_loss()
    assert math.isfinite(after) and after < factor * before, (before, after)


# ----------------------------------------------------------- layer stats


def test_layer_stats_match_the_tensors(model):
    b = 4
    stats = layer_stats(model, b)
    assert len(stats) == model.num_layers and all(isinstance(s, LayerStats) for s in stats)
    assert [s.name for s in stats] == model.layer_names
    x, _ = model.data(b).batch(0)
    with torch.no_grad():
        for s, layer in zip(stats, model.layers):
            x = layer(x)
            assert s.param_bytes == sum(p.numel() * 4 for p in layer.parameters())
            assert s.activation_bytes == x.numel() * x.element_size() == x.nbytes
            assert s.output_shape == tuple(x.shape) and s.output_dtype == x.dtype
            nonlinear = any(
                isinstance(m, (torch.nn.ReLU, torch.nn.LayerNorm, torch.nn.Conv2d, torch.nn.Linear))
                for m in layer.modules()
            )
            if nonlinear:
                assert s.stash_bytes > 0
            # saved tensors, not parameters: far below the layer's weights for big layers
            assert s.stash_bytes < s.param_bytes + 64 * s.activation_bytes + 4096
    # layer_stats runs on a copy: the model's gradients stay untouched
    assert all(p.grad is None for p in _params(model))


def test_layer_stats_stash_counts_saved_inputs_once():
    b, w = 8, 32
    m = build_model("mlp", width=w, depth=3)
    stats = layer_stats(m, b)
    # fc0 saves its data input (b x 64); fc1, fc2 and the head save their
    # input (b x w), which is also the ReLU result saved by the layer before
    # and is counted once, with the consumer. The head's stash also holds
    # what the loss saves: cross-entropy's log-softmax (b x 10), the targets
    # (int64) and nll_loss's total weight (one float).
    loss_saves = b * 10 * 4 + b * 8 + 4
    assert [s.stash_bytes for s in stats] == [b * 64 * 4, b * w * 4, b * w * 4, b * w * 4 + loss_saves]
    assert [s.activation_bytes for s in stats] == [b * w * 4] * 3 + [b * 10 * 4]

    gpt = build_model("gpt-small", width=32, depth=1, heads=2, seq_len=16)
    embed, block, head = layer_stats(gpt, b)
    act = b * 16 * 32 * 4
    # token ids and positions (int64) for the embedding
    assert embed.stash_bytes == b * 16 * 8 + 16 * 8
    # a transformer block keeps many activations' worth (about 17 without
    # attention scores; Korthikanti et al.'s 34 bytes at fp16)
    assert 10 * act <= block.stash_bytes <= 40 * act
    assert head.stash_bytes >= act  # at least its input

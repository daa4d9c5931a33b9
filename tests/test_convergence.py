"""``pipesim converge``: fair runs, held-out evaluation, divergence, outputs.

Runs are tiny (a 16-wide mlp, a few updates): what is checked is what a
wrong harness would get wrong, not accuracy. The fairness rules: every
strategy trains on exactly the same samples, B per update; a synchronous
pipeline and data parallelism are then the same mini-batch SGD, so their
curves agree to rounding.
"""

from __future__ import annotations

import json

import pytest

from pipesim.experiments.cli import main
from pipesim.validate import data as data_mod
from pipesim.validate.convergence import (
    ConvergeError,
    Run,
    Setup,
    plan,
    stability_threshold,
    stage_starts,
    train,
    update_rule,
)

SETUP = Setup(model="mlp", updates=8, update_batch=8, eval_every=4, model_width=16, model_depth=3)
ALL = [
    "data-parallel",
    "gpipe",
    "1f1b",
    "zb-h1",
    "pipedream-2bw",
    "pipedream",
    "pipedream-nostash",
    "spectrain",
    "avgpipe",
]


@pytest.fixture
def samples_read(monkeypatch):
    """Every training sample position a run's data source hands out."""
    seen: set[int] = set()
    batch = data_mod.Digits.batch

    def spy(self, index):
        if self.split == "train":
            seen.update(range(index * self.microbatch_size, (index + 1) * self.microbatch_size))
        return batch(self, index)

    monkeypatch.setattr(data_mod.Digits, "batch", spy)
    return seen


@pytest.mark.parametrize("strategy", ALL)
def test_every_strategy_trains_on_the_same_samples(strategy, samples_read):
    record = train(Run(SETUP, strategy, 2, 0.05, 0))
    assert samples_read == set(range(SETUP.updates * SETUP.update_batch))
    assert [pt["samples"] for pt in record["curve"]] == [0, 32, 64]
    assert record["updates"] == SETUP.updates and not record["diverged"]


def test_a_run_never_trains_on_what_it_evaluates(monkeypatch):
    """Every image a run trains on comes from the training split, every
    evaluation is of the whole held-out split, and no image is in both."""
    import pipesim.validate.convergence as conv

    trained, evaluated = set(), []
    batch, evaluate = data_mod.Digits.batch, conv.evaluate

    def spy_batch(self, index):
        x, y = batch(self, index)
        assert self.split == "train"
        trained.update(bytes(r.numpy()) for r in x.reshape(len(x), -1))
        return x, y

    def spy_evaluate(parts, inputs, targets, loss_fn):
        evaluated.append(inputs)
        return evaluate(parts, inputs, targets, loss_fn)

    monkeypatch.setattr(data_mod.Digits, "batch", spy_batch)
    monkeypatch.setattr(conv, "evaluate", spy_evaluate)
    train(Run(SETUP, "spectrain", 2, 0.05, 0))
    held = data_mod.digits(1, split="heldout").heldout_set()[0]
    assert len(evaluated) == 3 and all(x.shape[0] == len(held) == 359 for x in evaluated)
    assert trained and not trained & {bytes(r.numpy()) for r in held.reshape(len(held), -1)}


def test_synchronous_pipelines_and_data_parallelism_are_the_same_sgd():
    curves = {s: train(Run(SETUP, s, 2, 0.05, 0))["curve"] for s in ("data-parallel", "1f1b", "gpipe")}
    for s in ("1f1b", "gpipe"):
        for a, b in zip(curves[s], curves["data-parallel"]):
            assert a["heldout_loss"] == pytest.approx(b["heldout_loss"], rel=1e-5)
    # ... and an asynchronous pipeline is not
    async_curve = train(Run(SETUP, "pipedream", 2, 0.05, 0))["curve"]
    assert async_curve[-1]["heldout_loss"] != pytest.approx(curves["1f1b"][-1]["heldout_loss"], rel=1e-5)


def test_micro_batch_sizes_follow_the_update_batch():
    sizes = {s: plan(Run(Setup(update_batch=32), s, 4, 0.05, 0)).microbatch_size for s in ALL}
    assert sizes == {
        "data-parallel": 8,
        "gpipe": 8,
        "1f1b": 8,
        "zb-h1": 8,
        "pipedream-2bw": 8,
        "pipedream": 32,
        "pipedream-nostash": 32,
        "spectrain": 32,
        "avgpipe": 4,
    }
    with pytest.raises(ConvergeError, match="does not split"):
        plan(Run(Setup(update_batch=30), "1f1b", 4, 0.05, 0))


@pytest.mark.parametrize("stages", [4, 8])
def test_every_strategy_makes_exactly_the_same_updates(stages):
    """PipeDream and SpecTrain update p times per iteration (m = p): a step
    that rounded eval_every up to a multiple of p once gave them 320 updates
    where the flushed schedules made 300, evaluated at other sample counts."""
    setup = Setup(updates=400, eval_every=40)
    for s in ALL:
        p = plan(Run(setup, s, stages, 0.05, 0))
        assert (p.updates, p.updates_per_step, p.steps) == (400, 40, 10), s
    with pytest.raises(ConvergeError, match="eval-every 30 is not a multiple"):
        plan(Run(Setup(updates=300, eval_every=30), "pipedream", 4, 0.05, 0))
    with pytest.raises(ConvergeError, match="updates 300 is not a multiple of --eval-every 40"):
        plan(Run(Setup(updates=300, eval_every=40), "1f1b", 4, 0.05, 0))


def test_stage_starts_deal_layers_evenly():
    assert stage_starts(9, 4) == [0, 2, 4, 6]
    assert stage_starts(9, 8) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert stage_starts(8, 8) == list(range(8))
    with pytest.raises(ConvergeError, match="model-depth"):
        stage_starts(4, 8)


def test_a_run_that_blows_up_is_marked_and_stops():
    record = train(
        Run(
            Setup(model="mlp", updates=40, update_batch=8, eval_every=4, model_width=16, model_depth=3),
            "pipedream",
            2,
            50.0,
            0,
        )
    )
    assert record["diverged"]
    assert len(record["curve"]) < 11
    json.dumps(record, allow_nan=False)  # non-finite losses are null


def test_update_rules_read_off_the_ir_and_their_stability():
    assert update_rule("1f1b", 4) == [(0, 0)] * 4
    assert update_rule("pipedream-2bw", 4) == [(1, 0)] * 4
    assert update_rule("pipedream", 4) == [(3, 0), (2, 0), (1, 0), (0, 0)]
    assert update_rule("spectrain", 4) == [(3, 3), (2, 2), (1, 2), (0, 1)]
    # heavy ball on a quadratic: 2(1 + mu) in time, 1 - mu one update late
    assert stability_threshold(0, 0, 0.9) == pytest.approx(3.8, rel=1e-9)
    assert stability_threshold(1, 0, 0.9) == pytest.approx(0.1, rel=1e-9)
    assert stability_threshold(1, 0, 0.0) == pytest.approx(1.0, rel=1e-9)
    # predicting ahead without delay costs stability; predicting the delay away buys some back
    assert stability_threshold(0, 3) < stability_threshold(0, 0)
    assert stability_threshold(3, 0) < stability_threshold(3, 3) < stability_threshold(0, 0)


ARGS = [
    "converge",
    "--stages",
    "2",
    "--strategies",
    "1f1b",
    "pipedream-nostash",
    "--lr",
    "0.05",
    "0.1",
    "--seeds",
    "0",
    "--updates",
    "8",
    "--update-batch",
    "8",
    "--eval-every",
    "4",
    "--model-width",
    "16",
    "--model-depth",
    "3",
    "--jobs",
    "1",
]


def test_converge_writes_curves_and_figures_deterministically(tmp_path, capsys):
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert main(ARGS + ["--out", str(out)]) == 0
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == ["curves.json", "final_accuracy.html", "learning_curves.html", "stability.html"]
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    doc = json.loads((outs[0] / "curves.json").read_text())
    assert len(doc["runs"]) == 4
    run = doc["runs"][0]
    assert {
        "model",
        "strategy",
        "stages",
        "lr",
        "seed",
        "updates",
        "final_heldout_accuracy",
        "final_heldout_loss",
        "diverged",
        "curve",
    } <= set(run)
    assert set(run["curve"][0]) == {"samples", "heldout_accuracy", "heldout_loss", "train_loss"}
    assert {r["strategy"] for r in doc["runs"]} == {"1f1b", "pipedream-nostash"}
    assert doc["summary"]["2"]["accuracy"]["1f1b"]["0.05"]["seeds"] == 1
    assert doc["published"]["spectrain-lstm-imdb"]["accuracy"]["spectrain"] == 81.24
    assert doc["summary"]["2"]["reference_strategy"] == "1f1b"
    assert "pipedream-nostash" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--stages", "8"], "model-depth"),
        (["--strategies", "nope"], "unknown strategy"),
        (["--strategies", "tensor-parallel"], "cannot run tensor-parallel"),
        (["--update-batch", "7"], "does not split"),
        (["--lr", "0"], "lr"),
        (["--model", "resnet"], "unknown model"),
        (["--seeds", "0", "0"], "repeats"),
        (["--momentum", "1.5"], "momentum"),
        (["--eval-every", "3"], "not a multiple"),
        (["--updates", "6"], "not a multiple"),
    ],
)
def test_bad_converge_arguments_are_one_line_errors(tmp_path, capsys, extra, fragment):
    assert main(ARGS + extra + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err and "%|" not in err  # before any progress bar


@pytest.mark.multiprocess
def test_the_distributed_runtime_trains_the_same_bits(tmp_path):
    from pipesim.validate.convergence import train_distributed

    for strategy in ("spectrain", "pipedream-2bw"):
        run = Run(SETUP, strategy, 2, 0.05, 1)
        assert train_distributed(run, timeout_s=120) == train(run)


def test_layer_curvature_is_each_blocks_top_hessian_eigenvalue():
    """Power iteration against the explicit Hessian of each layer's block on a tiny mlp."""
    import torch

    from pipesim.validate.convergence import layer_curvature
    from pipesim.validate.models import build_model

    setup = Setup(model="mlp", update_batch=8, model_width=6, model_depth=2)
    got = layer_curvature(setup, lr=0.05, updates=3, samples=16, iterations=200)
    model = build_model("mlp", width=6, depth=2, seed=0)
    net = model.sequential()
    src = model.data(8, seed=0, split="train")
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for i in range(3):
        x, y = src.batch(i)
        opt.zero_grad()
        model.loss_fn(net(x), y).backward()
        opt.step()
    x, y = model.data(16, seed=0, split="train").batch(2)
    assert len(got) == len(model.layers)
    for layer, lam in zip(model.layers, got):
        params = list(layer.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params])

        def loss(w, layer=layer, params=params):
            chunks, i = {}, 0
            for name, p in layer.named_parameters():
                chunks[name] = w[i : i + p.numel()].reshape(p.shape)
                i += p.numel()
            h = x
            for other in model.layers:
                h = torch.func.functional_call(other, chunks, (h,)) if other is layer else other(h)
            return model.loss_fn(h, y)

        eig = torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss, flat))
        top = eig[eig.abs().argmax()].item()
        assert lam == pytest.approx(top, rel=1e-3), (lam, top)


@pytest.mark.multiprocess
def test_runs_in_a_pool_give_the_serial_records_and_leave_no_process():
    """--jobs 2 trains the runs in a pool of spawned workers, longest first:
    the records are the serial run's, in the configuration's order, and no
    worker outlives the call."""
    import multiprocessing

    from pipesim.experiments.converge import ConvergeConfig, train_all

    cfg = ConvergeConfig(
        model="mlp",
        stages=(2,),
        strategies=("data-parallel", "1f1b", "pipedream"),
        lrs=(0.01,),
        seeds=(0,),
        updates=4,
        eval_every=2,
        model_width=16,
        model_depth=3,
        jobs=2,
    )
    pooled = train_all(cfg)
    assert [r["strategy"] for r in pooled] == ["data-parallel", "1f1b", "pipedream"]
    assert pooled == train_all(ConvergeConfig(**{**cfg.__dict__, "jobs": 1}))
    assert multiprocessing.active_children() == []


def test_the_console_table_lists_strategies_in_the_order_given():
    from pipesim.experiments.converge import table

    cell = {"0.1": {"mean": 0.9, "min": 0.9, "max": 0.9, "diverged": 0, "seeds": 1}}
    doc = {
        "settings": {"layouts": [{"strategy": "spectrain"}, {"strategy": "1f1b"}, {"strategy": "avgpipe"}]},
        "summary": {
            "2": {
                "reference_lr": 0.1,
                "reference_strategy": "1f1b",
                "accuracy": {"1f1b": cell, "avgpipe": cell, "spectrain": cell},
            }
        },
    }
    assert [row[2] for row in table(doc)] == ["spectrain", "1f1b", "avgpipe"]


def test_the_console_table_shows_the_others_when_the_reference_always_diverged():
    """Data parallelism diverging at every lr must not hide how the pipelines
    fared: they are listed at the smallest lr run."""
    from pipesim.experiments.converge import table

    gone = {"mean": 0.1, "min": 0.1, "max": 0.1, "diverged": 1, "seeds": 1}
    fine = {"mean": 0.8, "min": 0.8, "max": 0.8, "diverged": 0, "seeds": 1}
    doc = {
        "settings": {"layouts": [{"strategy": "data-parallel"}, {"strategy": "1f1b"}]},
        "summary": {
            "2": {
                "reference_lr": None,
                "reference_strategy": "data-parallel",
                "accuracy": {"data-parallel": {"0.1": gone, "0.05": gone}, "1f1b": {"0.1": gone, "0.05": fine}},
            }
        },
    }
    rows = table(doc)
    assert rows[0][2] == "data-parallel diverged at every learning rate"
    assert [(row[1], row[2], row[3]) for row in rows[1:]] == [
        ("0.05", "data-parallel", "10.0"),
        ("0.05", "1f1b", "80.0"),
    ]
    assert "(1/1 diverged)" in rows[1][4]

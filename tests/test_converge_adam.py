"""``pipesim converge --optimizer adam --warmup-steps N``: the warm-up schedule,
Adam against torch.optim.Adam, the schedule applied alike in every strategy,
and the command's records and one-line errors.

Runs are tiny (a 16-wide mlp, a few updates), as in tests/test_convergence.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from pipesim.experiments.cli import main
from pipesim.validate import stage as stage_mod
from pipesim.validate.convergence import Run, Setup, _Trainer, plan, train
from pipesim.validate.models import build_model
from pipesim.validate.stage import OptimizerConfig, OptimizerError, PipelineStage

SETUP = Setup(
    model="mlp",
    updates=8,
    update_batch=8,
    eval_every=4,
    model_width=16,
    model_depth=3,
    optimizer="adam",
    warmup_steps=4,
)
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


# ---------------------------------------------------------------- the schedule


def test_warmup_is_linear_from_zero_then_constant():
    opt = OptimizerConfig(kind="adam", lr=1e-3, warmup_steps=10)
    assert opt.lr_at(0) == 0.0
    assert opt.lr_at(5) == pytest.approx(5e-4, rel=1e-15)
    assert opt.lr_at(9) == pytest.approx(9e-4, rel=1e-15)
    assert opt.lr_at(10) == 1e-3 and opt.lr_at(11) == 1e-3 and opt.lr_at(10_000) == 1e-3
    assert [opt.lr_at(u) for u in range(11)] == sorted(opt.lr_at(u) for u in range(11))
    # without a warm-up the rate is lr itself, the same float as before the schedule existed
    assert all(OptimizerConfig(lr=0.05).lr_at(u) == 0.05 for u in (0, 1, 7))
    # a prediction s updates ahead uses the mean of those updates' rates
    assert opt.lr_ahead(8, 3) == pytest.approx((8e-4 + 9e-4 + 1e-3) / 3, rel=1e-15)
    assert opt.lr_ahead(10, 3) == 1e-3 and opt.lr_ahead(3, 1) == opt.lr_at(3)
    for bad in (-1, 1.5, True):
        with pytest.raises(OptimizerError, match="warm-up"):
            OptimizerConfig(warmup_steps=bad)


# ------------------------------------------------- against torch's optimizer


def _pipeline_weights(run: Run) -> torch.Tensor:
    trainer = _Trainer(run)
    for _ in range(trainer.plan.steps):
        trainer.step()
    trainer.runner.flush()
    return torch.cat(
        [t.flatten() for k in range(trainer.num_stages) for t in trainer.stages[(0, k)].weights()]
    ).detach()


def _reference(setup: Setup, lr: float, seed: int, *, lag: int = 0) -> torch.Tensor:
    """torch.optim on the unsplit model, torch's own LambdaLR for the warm-up;
    ``lag=1`` takes each update's gradient on the weights before the last
    update (2BW's rule, W(t+1) = W(t) − step(∇f(W(t−1))))."""
    width, depth = setup.size()
    model = build_model(setup.model, width=width, depth=depth, seed=seed)
    net = model.sequential()
    at = copy.deepcopy(net)  # where the gradient is taken
    src = model.data(setup.update_batch, seed=seed, split="train")
    if setup.optimizer == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=lr, betas=setup.betas, eps=setup.eps)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=setup.momentum)
    n = setup.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min(1.0, u / n) if n else 1.0)
    for u in range(setup.updates):
        x, y = src.batch(u)
        if not lag:
            at = net
        at.zero_grad()
        model.loss_fn(at(x), y).backward()
        before = copy.deepcopy(net)
        for p, q in zip(net.parameters(), at.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        sched.step()
        if lag:
            at = before
    return torch.cat([p.detach().flatten() for p in net.parameters()])


#: Adam's step is lr·m̂/(√v̂ + ε), at most about lr per coordinate, and the two
#: sides' gradients differ only in the order float32 sums are taken (the
#: pipeline adds micro-batch gradients, the reference backpropagates one batch
#: mean): relative differences of order B·eps32 in m̂ and v̂, which move a
#: weight by about lr·B·eps32 per update. Allowing 10⁻⁴·lr·U absolute (with
#: U = 8, 8e-6 at lr 0.01) is far above that and far below what a wrong rule
#: does: an update at the wrong rate (no warm-up) moves weights by about lr.
def _tolerance(setup: Setup, lr: float) -> float:
    return 1e-4 * lr * setup.updates


@pytest.mark.parametrize("strategy", ["1f1b", "gpipe", "data-parallel"])
def test_adam_with_warmup_under_a_flush_schedule_is_torch_adam(strategy):
    run = Run(SETUP, strategy, 2, 0.01, 0)
    got, want = _pipeline_weights(run), _reference(SETUP, 0.01, 0)
    tol = _tolerance(SETUP, 0.01)
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    # the warm-up is what makes them agree: without it the weights end elsewhere
    no_warmup = _reference(Setup(**{**SETUP.__dict__, "warmup_steps": 0}), 0.01, 0)
    assert (no_warmup - want).abs().max() > 100 * tol


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_2bw_with_warmup_is_torch_one_update_late(optimizer):
    """2BW's double buffer under the schedule: every window's gradient is
    taken one version late and applied at that update's warmed-up rate."""
    setup = Setup(**{**SETUP.__dict__, "optimizer": optimizer})
    lr = 0.01 if optimizer == "adam" else 0.05
    got = _pipeline_weights(Run(setup, "pipedream-2bw", 2, lr, 0))
    want = _reference(setup, lr, 0, lag=1)
    torch.testing.assert_close(got, want, rtol=0, atol=_tolerance(setup, 0.01))  # SGD's error is smaller still
    assert (got - _reference(setup, lr, 0)).abs().max() > 1e-4  # and it is not the synchronous rule


@pytest.mark.parametrize("strategy", ALL)
def test_every_strategy_warms_up_by_its_update_count(strategy, monkeypatch):
    """Every stage of every strategy (replicas, stashes, double buffers,
    predictions, averaging) makes its t-th Adam update at lr_at(t − 1)."""
    calls = []
    coefficients = stage_mod.adam_coefficients

    def spy(step, lr, betas, eps, distance):
        if distance == 1.0:  # an update, not a prediction
            calls.append((step, lr))
        return coefficients(step, lr, betas, eps, distance)

    monkeypatch.setattr(stage_mod, "adam_coefficients", spy)
    run = Run(SETUP, strategy, 2, 0.01, 0)
    record = train(run)
    opt = SETUP.optimizer_config(0.01)
    per_stage = [(t, opt.lr_at(t - 1)) for t in range(1, plan(run).updates + 1)]
    stages = len(calls) // len(per_stage)
    assert stages >= 2 and sorted(calls) == sorted(per_stage * stages)
    assert record["optimizer"] == "adam" and record["warmup_steps"] == 4 and not record["diverged"]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_spectrains_prediction_uses_the_warmed_up_rates(kind):
    """Ŵ = W − (lr(t) + … + lr(t+s−1))·v after t updates: the rates of the
    updates it predicts, not the final lr."""
    torch.manual_seed(0)
    st = PipelineStage(torch.nn.Linear(3, 2), 0, 2)
    opt = OptimizerConfig(kind=kind, lr=0.1, warmup_steps=8)
    st.optim = opt
    w = st.weights()
    st.steps = 5
    if kind == "sgd":
        st.state["momentum"] = [torch.randn_like(t) for t in w]
    else:
        st.state["exp_avg"] = [torch.randn_like(t) for t in w]
        st.state["exp_avg_sq"] = [torch.rand_like(t) for t in w]
    st._predict_into_scratch(0, 3)
    rates = opt.lr_at(5) + opt.lr_at(6) + opt.lr_at(7)
    if kind == "sgd":
        want = [a - rates * v for a, v in zip(w, st.state["momentum"])]
    else:
        b1, b2 = opt.betas
        c = (1 - b2**5) ** 0.5 / (1 - b1**5)
        want = [
            a - rates * c * m / (v.sqrt() + opt.eps * (1 - b2**5) ** 0.5)
            for a, m, v in zip(w, st.state["exp_avg"], st.state["exp_avg_sq"])
        ]
    for got, ref in zip(st.scratch, want):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.multiprocess
def test_the_distributed_runtime_trains_the_same_bits_under_adam_and_warmup():
    """SpecTrain: the warmed-up rates in its updates and in its predictions
    (one strategy: every strategy's updates are the same stage code on both)."""
    from pipesim.validate.convergence import train_distributed

    run = Run(SETUP, "spectrain", 2, 0.01, 1)
    assert train_distributed(run, timeout_s=120) == train(run)


# ---------------------------------------------------------------- the command

ARGS = [
    "converge",
    "--stages",
    "2",
    "--strategies",
    "1f1b",
    "pipedream-2bw",
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


def test_converge_records_the_optimizer_and_warmup(tmp_path, capsys):
    assert main(ARGS + ["--optimizer", "adam", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "curves.json").read_text())
    st = doc["settings"]
    # Adam's defaults: its learning rates, a tenth of the run warming up, torch's betas and eps
    assert (st["optimizer"], st["warmup_steps"], st["adam_betas"], st["adam_eps"]) == ("adam", 0, [0.9, 0.999], 1e-8)
    assert sorted({r["lr"] for r in doc["runs"]}) == [0.0005, 0.001, 0.002]
    assert {(r["optimizer"], r["warmup_steps"]) for r in doc["runs"]} == {("adam", 0)}
    assert doc["quadratic_stability"]["2"]["1f1b"][0]["max_lr_h"] is None  # SGD's analysis
    assert "Adam" in (tmp_path / "learning_curves.html").read_text()
    capsys.readouterr()
    out = tmp_path / "w"
    assert main(ARGS + ["--optimizer", "adam", "--lr", "0.01", "--warmup-steps", "4", "--out", str(out)]) == 0
    st = json.loads((out / "curves.json").read_text())["settings"]
    assert st["warmup_steps"] == 4 and "lr * min(1, u / 4)" in st["lr_schedule"]
    # SGD as before: no warm-up, no Adam settings
    out = tmp_path / "s"
    assert main(ARGS + ["--lr", "0.05", "--out", str(out)]) == 0
    st = json.loads((out / "curves.json").read_text())["settings"]
    assert (st["optimizer"], st["warmup_steps"], st["lr_schedule"]) == ("sgd", 0, "constant")
    assert "adam_betas" not in st


def test_adams_default_warmup_is_a_tenth_of_the_updates():
    from pipesim.experiments.converge import ConvergeConfig

    assert ConvergeConfig(optimizer="adam", updates=300).warmup_steps == 30
    assert ConvergeConfig(optimizer="adam").lrs == (0.0005, 0.001, 0.002)
    assert ConvergeConfig().warmup_steps == 0 and ConvergeConfig().lrs == (0.01, 0.02, 0.05)
    assert ConvergeConfig(optimizer="adam", warmup_steps=0, lrs=(0.003,)).warmup_steps == 0


def test_the_command_line_names_the_optimizers_the_stages_run():
    from pipesim.experiments.converge import OPTIMIZERS

    assert OPTIMIZERS == stage_mod.OPTIMIZERS


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--warmup-steps", "-1"], "must be >= 0, got -1"),
        (["--optimizer", "foo"], "invalid choice: 'foo'"),
        (["--warmup-steps", "9"], "longer than --updates 8"),
        (["--optimizer", "adam", "--adam-betas", "1", "0.999"], "betas must be in [0, 1)"),
        (["--optimizer", "adam", "--adam-eps", "0"], "adam-eps"),
    ],
)
def test_bad_optimizer_arguments_are_one_line_errors(tmp_path, capsys, extra, fragment):
    assert main(ARGS + extra + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err and "%|" not in err  # before any progress bar

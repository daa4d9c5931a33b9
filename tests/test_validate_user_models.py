"""``pipesim validate --model hf:...|module:factory``: models beyond the catalog
run under pipesim's runtime, whose cuts may carry a tuple of tensors.

The emulator against the unsplit model (losses and one SGD step), the gloo
runtime against the emulator bit for bit (one packed transfer per tuple), the
CLI end to end on gloo and on ``--backend single``. Tests of ``hf:`` models
skip, saying why, when transformers is not installed."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from pipesim.experiments.cli import main
from pipesim.sim.engine.core import simulate
from pipesim.sim.hardware.machines import load_hardware
from pipesim.sim.partition.split import stage_costs_uniform
from pipesim.sim.strategies import ScheduleSpec, build_schedule
from pipesim.validate.boundary import TupleStage
from pipesim.validate.executor import emulate, iteration_losses
from pipesim.validate.models import split
from pipesim.validate.runtime import Job, boundary_specs, build_stages, pack, run_many, unpack_boundary
from pipesim.validate.stage import OptimizerConfig
from pipesim.validate.usermodels import resolve_model

#: numerics tests: CI runs them again with lesser ATen and MKL kernels (.ci/run)
pytestmark = pytest.mark.numerics

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "how-to" / "bring-your-own-model.md"

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[models]')",
)

#: dropout off: the pipeline and the unsplit model draw no random masks
GPT2 = "hf:gpt2?n_layer=2&n_embd=64&n_head=2&vocab_size=97&seq_len=16&resid_pdrop=0&embd_pdrop=0&attn_pdrop=0"
#: every cut carries (hidden, cos, sin)
LLAMA = (
    "hf:llama?num_hidden_layers=2&hidden_size=64&num_attention_heads=4&num_key_value_heads=2"
    "&intermediate_size=128&vocab_size=97&seq_len=16"
)
LR = 0.1


def job_for(spec: str, strategy: str = "1f1b", m: int = 4, iterations: int = 1, **opt) -> Job:
    sched = build_schedule(ScheduleSpec(strategy=strategy, stages=2, microbatches=m, iterations=iterations))
    return Job(
        schedule=sched,
        model=spec,
        starts=(0, 2),
        microbatch_size=3,
        seed=1,
        optimizer=OptimizerConfig(**({"lr": LR, "momentum": 0.0} | opt)),
    )


def emulated(job: Job):
    sched = job.schedule
    timeline = simulate(sched, stage_costs_uniform(sched.num_stages), load_hardware("ideal"))
    _, modules, stages, data = build_stages(job, sched.placement(), torch.device("cpu"))
    return emulate(sched, stages, data, job.optimizer, timeline), modules, stages, data


def assert_same(got, want):
    assert got.losses == want.losses
    assert got.versions_used == want.versions_used
    assert got.weights.keys() == want.weights.keys()
    for key in want.weights:
        for name, t in want.weights[key].items():
            assert torch.equal(got.weights[key][name], t), (key, name)


@needs_transformers
@pytest.mark.parametrize("spec", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_emulated_1f1b_trains_like_the_unsplit_model(spec):
    job = job_for(spec)
    out, modules, stages, data = emulated(job)
    assert all(isinstance(s, TupleStage) for s in stages.values())
    specs = boundary_specs(modules, data)
    if "llama" in spec:  # hidden carries a gradient back, the rotary tables do not
        assert [g for _, _, g in specs[0]] == [True, False, False]
    else:
        assert len(specs[0]) == 1
    # the unsplit model: the same micro-batches, one SGD step on their mean loss
    ref = resolve_model(spec, seed=1, microbatch_size=3)
    net = ref.sequential()
    m = job.schedule.num_microbatches
    total = 0
    for i in range(m):
        x, y = data.batch(i)
        loss = ref.loss_fn(net(*x) if isinstance(x, tuple) else net(x), y)
        assert out.losses[(0, i)] == pytest.approx(loss.item(), rel=1e-6, abs=1e-6)
        total = total + loss
    (total / m).backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= LR * p.grad
    for k, mod in enumerate(split(ref, list(job.starts))):
        want = mod.state_dict()
        assert out.weights[(0, k)].keys() == want.keys()
        for name, t in want.items():
            torch.testing.assert_close(out.weights[(0, k)][name], t, rtol=1e-5, atol=1e-6)


def test_packing_keeps_every_tensor_and_its_alignment():
    hidden = torch.randn(2, 3, 5)
    mask = torch.tensor([[True, False, True]])
    table = torch.randn(1, 3, dtype=torch.float64)
    spec = [(t.shape, t.dtype, g) for t, g in ((hidden, True), (mask, False), (table, False))]
    got = unpack_boundary(pack((hidden, mask, table)), spec, forward=True)
    assert [torch.equal(a, b) for a, b in zip(got, (hidden, mask, table))] == [True] * 3
    assert got[2].data_ptr() % 8 == 0 and got[0].requires_grad and not got[2].requires_grad
    # backward: the carried gradients only, None where none is carried
    grads = unpack_boundary(pack([hidden]), spec, forward=False)
    assert torch.equal(grads[0], hidden) and grads[1:] == (None, None)


@needs_transformers
@pytest.mark.multiprocess
def test_gloo_runs_tuple_boundaries_bit_for_bit_like_the_emulator():
    jobs = [job_for(LLAMA, s, iterations=2, momentum=0.9) for s in ("1f1b", "zb-h1")]
    for job, out in zip(jobs, run_many(jobs, timeout_s=240)):
        assert_same(out, emulated(job)[0])
        assert all(
            r.nbytes == 3 * 16 * 64 * 4 + 2 * 16 * 16 * 4
            for r in out.records
            if r.stream == "send" and r.action.op.name == "SEND_F"
        )


@needs_transformers
@pytest.mark.multiprocess
def test_pipesim_validate_hf_gpt2_on_gloo(tmp_path):
    args = ["--strategy", "1f1b", "--stages", "2", "--microbatches", "4", "--iterations", "2"]
    args += ["--microbatch-size", "3", "--model", GPT2, "--out", str(tmp_path)]
    assert main(["validate", *args, "--backend", "gloo"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert isinstance(report["iteration_time_error"], float)
    # the same run in the emulator: the same losses, bit for bit (as the report rounds them)
    sched = build_schedule(ScheduleSpec(strategy="1f1b", stages=2, microbatches=4, iterations=2))
    job = Job(
        schedule=sched,
        model=GPT2,
        starts=tuple(report["partition_starts"]),
        microbatch_size=3,
        optimizer=OptimizerConfig(lr=0.05, momentum=0.9),
    )
    want = iteration_losses(emulated(job)[0].losses, 4)
    assert report["losses"] == [float(f"{v:.12g}") for v in want]


def guide_factory(tmp_path: Path) -> Path:
    """The factory in docs/how-to/bring-your-own-model.md, as a file."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.S)
    path = tmp_path / "my_model.py"
    path.write_text(next(b for b in blocks if "def make(" in b))
    return path


def test_the_guides_factory_runs_under_backend_single(tmp_path):
    path = guide_factory(tmp_path)
    args = ["--strategy", "1f1b", "--stages", "2", "--microbatches", "2", "--iterations", "2"]
    args += ["--microbatch-size", "2", "--model", f"{path}:make", "--backend", "single", "--out", str(tmp_path / "o")]
    assert main(["validate", *args]) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert len(report["losses"]) == 2 and all(v == v for v in report["losses"])


@needs_transformers
def test_a_model_with_dropout_reports_the_same_losses_every_invocation(tmp_path):
    """The passes' generator is seeded (per rank; here one process), so
    dropout draws the same masks and two invocations agree on the losses."""
    dropout = GPT2.replace("&resid_pdrop=0&embd_pdrop=0&attn_pdrop=0", "")
    assert dropout != GPT2
    losses = []
    for run in ("a", "b"):
        args = ["--strategy", "1f1b", "--stages", "2", "--microbatches", "2", "--iterations", "2"]
        args += ["--microbatch-size", "2", "--model", dropout, "--backend", "single", "--out", str(tmp_path / run)]
        assert main(["validate", *args]) == 0
        losses.append(json.loads((tmp_path / run / "report.json").read_text())["losses"])
    assert losses[0] == losses[1]


@needs_transformers
@pytest.mark.multiprocess
def test_batchnorm_stays_bit_identical_and_dropout_does_not():
    """What the guide says of bit-identity: BatchNorm's statistics are each
    micro-batch's own, so the runtime matches the emulator bit for bit;
    dropout draws its masks from each process's generator, so it does not."""
    resnet = "hf:resnet?depths=1,1&hidden_sizes=8,16&embedding_size=8&layer_type=basic&image_size=32"
    dropout = GPT2.replace("&resid_pdrop=0&embd_pdrop=0&attn_pdrop=0", "")
    jobs = [job_for(spec, iterations=2) for spec in (resnet, dropout)]
    batchnorm_run, dropout_run = run_many(jobs, timeout_s=240)
    assert_same(batchnorm_run, emulated(jobs[0])[0])
    assert dropout_run.losses != emulated(jobs[1])[0].losses

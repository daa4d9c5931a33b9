"""Models beyond the catalog (``--model hf:...``, ``torchvision:...``, a factory):
resolving, splitting into layers with several tensors across a cut, the
profile's byte counts, and every bad input as one line with exit code 2.

Tests of ``hf:`` models skip, saying why, when the ``models`` extra
(transformers) is not installed."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from pipesim.experiments.cli import main
from pipesim.sim.ir.core import Action, B, F, I, W
from pipesim.validate.boundary import TupleStage
from pipesim.validate.models import ModelError, build_model, layer_stats, split
from pipesim.validate.profiler import ProfileSettings, profile_layers
from pipesim.validate.stage import OptimizerConfig, PipelineStage
from pipesim.validate.usermodels import resolve_model

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "how-to" / "bring-your-own-model.md"

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[models]')",
)

#: Small configurations of each model type the splitter knows (seconds to build).
TINY = {
    "gpt2": "n_layer=2&n_embd=64&n_head=2&vocab_size=97&seq_len=16",
    "bert": "num_hidden_layers=2&hidden_size=64&num_attention_heads=2&intermediate_size=128&vocab_size=97&seq_len=16",
    "llama": "num_hidden_layers=2&hidden_size=64&num_attention_heads=4&num_key_value_heads=2&intermediate_size=128"
    "&vocab_size=97&seq_len=16",
    "resnet": "depths=1,2&hidden_sizes=32,64&embedding_size=16&image_size=32",
    "vit": "num_hidden_layers=2&hidden_size=64&num_attention_heads=2&intermediate_size=128&image_size=32&patch_size=8",
}


def one_line_error(capsys, *argv: str) -> str:
    """Run the CLI, expect exit 2 and one line on stderr; return it."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def write_factory(tmp_path: Path, body: str, name: str = "factory_mod.py") -> Path:
    path = tmp_path / name
    path.write_text("import torch\nfrom torch import nn\n\n" + body)
    return path


def guide_factory(tmp_path: Path) -> Path:
    """The factory in docs/how-to/bring-your-own-model.md, as a file."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.S)
    code = next(b for b in blocks if "def make(" in b)
    path = tmp_path / "my_model.py"
    path.write_text(code)
    return path


# ------------------------------------------------------------ several tensors across a cut


PAIR_MODEL = """
class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 16)

    def forward(self, ids, mask):
        return self.tok(ids), mask


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h, mask):
        return h + torch.tanh(self.fc(h)) * mask.unsqueeze(-1), mask


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(16, 5)

    def forward(self, h, mask):
        return self.out((h * mask.unsqueeze(-1)).sum(1))


def loss(out, y):
    return nn.functional.cross_entropy(out, y)


def make(b):
    ids = torch.randint(0, 50, (b, 7))
    mask = (torch.arange(7) < 5).float().expand(b, 7).contiguous()  # float: no gradient all the same
    return nn.Sequential(Embed(), Block(), Block(), Head()), (ids, mask), torch.randint(0, 5, (b,)), loss
"""


def run_pipeline(model, starts, b: int, stage_class=TupleStage, split_backward: bool = False):
    """Every stage of ``split(model, starts)`` as a stage object, one micro-batch
    forward and back (B, or I then W); returns each stage's accumulated gradients
    and the loss."""
    modules = [copy.deepcopy(m) for m in split(model, starts)]
    n = len(modules)
    stages = [stage_class(m, k, n, loss_fn=model.loss_fn) for k, m in enumerate(modules)]
    for st in stages:
        st.optim = OptimizerConfig()
        st.pool.expect(0, 10)
        st.split_backward = split_backward
    x, y = model.data(b).batch(0)
    for st in stages:
        x = st.forward(Action(F, st.stage_index, 0, 0), x, y if st.is_last else None)
    loss = x
    g = None
    for st in reversed(stages):
        if split_backward:
            g_in = st.backward(Action(I, st.stage_index, 0, 0), g)
            st.backward(Action(W, st.stage_index, 0, 0), None)
            g = g_in
        else:
            g = st.backward(Action(B, st.stage_index, 0, 0), g)
    return [[t.clone() for t in st.grads] for st in stages], loss


def whole_model_grads(model, starts, b: int):
    """The same gradients by autograd on the whole chain, grouped by stage."""
    net = copy.deepcopy(model.sequential())
    x, y = model.data(b).batch(0)
    loss = model.loss_fn(net(*x) if isinstance(x, tuple) else net(x), y)
    params = list(net.parameters())
    grads = torch.autograd.grad(loss, params)
    bounds = [*starts, len(net)]
    out, i = [], 0
    for a, z in zip(bounds, bounds[1:]):
        count = sum(1 for layer in list(net)[a:z] for _ in layer.parameters())
        out.append(list(grads[i : i + count]))
        i += count
    return out, loss


@pytest.mark.parametrize("split_backward", [False, True])
def test_a_pair_of_tensors_crosses_every_cut_and_the_gradients_are_the_whole_models(tmp_path, split_backward):
    path = write_factory(tmp_path, PAIR_MODEL)
    model = resolve_model(f"{path}:make", microbatch_size=4, seed=3)
    assert model.layer_names == ["embed0", "block1", "block2", "head3"]
    stats = layer_stats(model, 4)
    hidden, mask = 4 * 7 * 16 * 4, 4 * 7 * 4
    # every tensor that crosses a cut counts; the mask carries no gradient back
    assert [s.activation_bytes for s in stats] == [hidden + mask] * 3 + [4 * 5 * 4]
    assert stats[0].outputs == (((4, 7, 16), torch.float32, True), ((4, 7), torch.float32, False))
    for starts in ([0, 1, 2, 3], [0, 2], [0, 3]):
        got, loss = run_pipeline(model, starts, 4, split_backward=split_backward)
        want, want_loss = whole_model_grads(model, starts, 4)
        assert torch.equal(loss, want_loss.detach())
        for g_stage, w_stage in zip(got, want):
            assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(g_stage, w_stage))


def test_tuple_stage_is_pipeline_stage_on_one_tensor_boundaries():
    mlp = build_model("mlp", width=32, depth=3)
    for split_backward in (False, True):
        a, loss_a = run_pipeline(mlp, [0, 2], 8, PipelineStage, split_backward)
        b, loss_b = run_pipeline(mlp, [0, 2], 8, TupleStage, split_backward)
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


@needs_transformers
def test_hf_llama_sends_hidden_cos_and_sin_and_matches_transformers():
    spec = f"hf:llama?{TINY['llama']}"
    model = resolve_model(spec, seed=1)
    assert model.layer_names == ["embed", "layer0", "layer1", "head"]
    b = 3
    stats = layer_stats(model, b)
    hidden, table = b * 16 * 64 * 4, 1 * 16 * 16 * 4  # rotary cos and sin: (1, seq, head_dim)
    assert [s.activation_bytes for s in stats[:3]] == [hidden + 2 * table] * 3
    assert [o[2] for o in stats[0].outputs] == [True, False, False]
    got, loss = run_pipeline(model, [0, 2], b)
    want, want_loss = whole_model_grads(model, [0, 2], b)
    assert torch.allclose(loss, want_loss.detach())
    for g_stage, w_stage in zip(got, want):
        assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(g_stage, w_stage))


@needs_transformers
@pytest.mark.parametrize("model_type", sorted(TINY))
def test_hf_layers_compute_what_transformers_computes(model_type):
    import transformers

    from pipesim.validate.usermodels import HF_SPLITS

    spec = f"hf:{model_type}?{TINY[model_type]}"
    model = resolve_model(spec, seed=5)
    assert model.origin == "hf" and model.num_layers == 4 or model_type == "resnet"
    assert model.layer_names[0] in ("embed", "embedder") and model.layer_names[-1] == "head"
    fields = {k: v for k, v in (kv.split("=") for kv in TINY[model_type].split("&"))}
    fields.pop("seq_len", None)
    if model_type == "resnet":
        fields.pop("image_size")
    typed = {k: [int(x) for x in v.split(",")] if "," in v else int(v) for k, v in fields.items()}
    split_ = HF_SPLITS[model_type]
    config = transformers.AutoConfig.for_model(model_type, **typed)
    extra = {"attn_implementation": "sdpa"} if split_.family == "text" else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        whole = getattr(transformers, split_.auto).from_config(config, **extra)
    x, _ = model.data(2).batch(0)
    with torch.no_grad():
        assert torch.equal(model.sequential().eval()(x), whole.eval()(x).logits)


@needs_transformers
def test_hf_gpt2_splits_as_the_ecosystem_does_and_is_deterministic():
    spec = f"hf:gpt2?{TINY['gpt2']}"
    a, b = resolve_model(spec, seed=2), resolve_model(spec, seed=2)
    assert a.layer_names == ["embed", "block0", "block1", "head"]
    embed, head = a.layers[0], a.layers[-1]
    assert {type(m).__name__ for m in embed.modules()} >= {"Embedding", "Dropout"}
    assert {type(m).__name__ for m in head.modules()} >= {"LayerNorm", "Linear"}
    # untied: the head keeps its own copy of the token embedding
    assert head.parts[1].weight is not embed.tokens.weight
    assert torch.equal(head.parts[1].weight, embed.tokens.weight)
    assert all(torch.equal(p, q) for p, q in zip(a.sequential().parameters(), b.sequential().parameters()))
    assert a.config["overrides"] == {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 97}


# ------------------------------------------------------------ the profile's numbers


LINEAR_MODEL = """
def make(b):
    torch.manual_seed(0)
    layers = [nn.Linear(64, 32), nn.Linear(32, 10)]
    return layers, torch.randn(b, 64), torch.randint(0, 10, (b,)), nn.functional.cross_entropy
"""


@pytest.mark.parametrize("optimizer, copies", [("sgd", 1), ("adam", 2)])
def test_a_linear_layers_bytes_are_the_hand_computed_ones(tmp_path, optimizer, copies):
    b = 8
    path = write_factory(tmp_path, LINEAR_MODEL)
    model = resolve_model(f"{path}:make", microbatch_size=b)
    prof, extra = profile_layers(
        model, settings=ProfileSettings(b, warmup=1, repeats=1), optimizer=OptimizerConfig(kind=optimizer)
    )
    first, second = prof.layers
    params = (64 * 32 + 32) * 4
    assert first.param_bytes == params
    assert first.activation_bytes == b * 32 * 4  # the output it sends on
    assert first.stash_bytes == b * 64 * 4  # Linear keeps its input for the weight gradient
    assert second.param_bytes == (32 * 10 + 10) * 4 and second.activation_bytes == b * 10 * 4
    assert [m.optimizer_state_bytes for m in extra] == [copies * params, copies * second.param_bytes]
    assert prof.optimizer == optimizer and prof.microbatch_size == b
    for la in prof.layers:
        assert 0 <= la.backward_input_s <= la.backward_s and la.forward_s > 0


def test_profile_cli_writes_what_plan_simulate_and_compare_read(tmp_path, capsys):
    out = tmp_path / "prof"
    factory = guide_factory(tmp_path)
    code = main(["profile", "--model", f"{factory}:make", "--microbatch-size", "4", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "(2 tensors)" in printed and "sgd state" in printed
    data = json.loads((out / "profile.json").read_text())
    assert [la["name"] for la in data["layers"]] == ["embed0", "block1", "block2", "block3", "block4", "head5"]
    hidden, mask = 4 * 64 * 128 * 4, 4 * 64  # (hidden states, bool padding mask)
    assert [la["activation_bytes"] for la in data["layers"][:-1]] == [hidden + mask] * 5
    assert "layers only" in data["notes"] and "micro-batch 4" in data["notes"]
    profile = str(out / "profile.json")
    for argv in (
        ["simulate", "--strategy", "1f1b", "--stages", "3", "--profile", profile, "--hardware", "dgx1-v100"],
        ["compare", "--strategies", "gpipe,zb-h1", "--stages", "2", "--profile", profile],
        ["plan", "--strategy", "1f1b", "--profile", profile, "--hardware", "dgx1-v100", "--gpus", "4"],
    ):
        code = main([*argv, "--out", str(tmp_path / argv[0])])
        err = capsys.readouterr().err
        assert code == 0, (argv, err)


def test_profiles_of_one_model_differ_only_in_their_times(tmp_path):
    path = write_factory(tmp_path, LINEAR_MODEL)

    def measured():
        model = resolve_model(f"{path}:make", microbatch_size=4)
        prof, extra = profile_layers(model, settings=ProfileSettings(4, warmup=1, repeats=1))
        d = prof.to_json()
        for la in d["layers"]:
            for k in ("forward_s", "backward_s", "backward_input_s"):
                la.pop(k)
        d.pop("overhead")
        return d, [(m.name, m.optimizer_state_bytes, m.outputs) for m in extra]

    assert measured() == measured()


# ------------------------------------------------------------ bad input: one line, exit 2


@needs_transformers
@pytest.mark.parametrize(
    "model, message",
    [
        ("hf:nosuchmodel", "hf:nosuchmodel: transformers 5"),
        ("hf:gpt2?n_layerz=4", "hf:gpt2?n_layerz=4: n_layerz is not a field of GPT2Config"),
        ("hf:gpt2?n_layer=four", "n_layer=four is not an integer"),
        ("hf:gpt2?n_layer", "'n_layer' is not field=value"),
        ("hf:gpt2?seq_len=5000", "seq_len=5000 is longer than the model's 1024 positions"),
        ("hf:t5", "hf:t5: pipesim cannot cut a T5 model into pipeline layers"),
        ("hf:missing/config.json", "cannot read missing/config.json"),
    ],
)
def test_bad_hf_models_are_one_line(capsys, tmp_path, model, message):
    line = one_line_error(capsys, "profile", "--model", model, "--out", str(tmp_path))
    assert message in line, line


@needs_transformers
def test_a_model_too_big_is_refused_before_it_is_built(capsys, tmp_path, monkeypatch):
    from pipesim.sim.engine import size

    monkeypatch.setattr(size, "available_memory_bytes", lambda: 23 * 2**30)
    line = one_line_error(capsys, "profile", "--model", "hf:llama", "--out", str(tmp_path))
    assert line.startswith("error: hf:llama") and "6,738,415,616 parameters" in line, line
    assert "25.1 GiB in fp32" in line and "23.0 GiB available" in line, line


@needs_transformers
def test_a_config_file_and_its_overrides(tmp_path):
    import transformers

    config = transformers.AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    config.save_pretrained(tmp_path)
    model = resolve_model(f"hf:{tmp_path / 'config.json'}?n_layer=3&seq_len=8")
    assert model.num_layers == 5 and model.config["seq_len"] == 8
    assert model.data(2).batch(0)[0].shape == (2, 8)


def test_without_transformers_the_extra_is_named(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    line = one_line_error(capsys, "profile", "--model", "hf:gpt2", "--out", str(tmp_path))
    assert "pip install -e '.[models]'" in line, line


def test_torchvision_that_does_not_import_is_one_line(capsys, tmp_path, monkeypatch):
    fake = tmp_path / "fake" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(fake.parent))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    line = one_line_error(capsys, "profile", "--model", "torchvision:resnet50", "--out", str(tmp_path / "o"))
    assert "torchvision:resnet50: the installed torchvision does not import against torch" in line, line
    assert "operator torchvision::nms does not exist" in line and torch.__version__ in line, line
    monkeypatch.setitem(sys.modules, "torchvision", None)
    line = one_line_error(capsys, "profile", "--model", "torchvision:resnet50", "--out", str(tmp_path / "o"))
    assert "torchvision is not installed" in line, line


def test_a_working_torchvision_model_is_cut_and_checked(tmp_path, monkeypatch):
    # a stand-in torchvision whose get_model builds a small VGG-like and a net whose forward is not its children's
    pkg = tmp_path / "tv" / "torchvision"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import torch\nfrom torch import nn\n__version__ = 'stand-in'\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, num_classes=10):\n"
        "        super().__init__()\n"
        "        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))\n"
        "        self.classifier = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, num_classes))\n"
        "    def forward(self, x):\n"
        "        return self.classifier(torch.flatten(self.features(x), 1))\n"
        "class Odd(Net):\n"
        "    def forward(self, x):\n"
        "        return super().forward(x) * 2\n"
        "class models:\n"
        "    @staticmethod\n"
        "    def get_model(name, weights=None, **kw):\n"
        "        return {'net': Net, 'odd': Odd}[name](**kw)\n"
    )
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    model = resolve_model("torchvision:net?num_classes=3&image_size=8")
    assert model.layer_names == [
        "features.0",
        "features.1",
        "features.2",
        "flatten",
        "classifier.0",
        "classifier.1",
        "classifier.2",
    ]
    assert model.data(2).batch(0)[0].shape == (2, 3, 8, 8)
    with pytest.raises(
        ModelError, match=r"torchvision:odd\?image_size=8: its forward is not the chain of its children"
    ):
        resolve_model("torchvision:odd?image_size=8")


@pytest.mark.parametrize(
    "body, message",
    [
        ("def make(b):\n    raise ValueError('no data here')\n", "the factory raised ValueError: no data here"),
        ("def make(b):\n    return nn.Linear(2, 2), torch.zeros(b, 2)\n", "the factory returned a 2-tuple"),
        (
            "def make(b):\n    return nn.LSTM(2, 2), torch.zeros(b, 2), torch.zeros(b), None\n",
            "the factory returned one LSTM, which pipesim cannot cut into layers",
        ),
        (
            "def make(b):\n    return [nn.Linear(2, 2)], torch.zeros(b + 1, 2), torch.zeros(b), nn.MSELoss()\n",
            "its first dimension must be the micro-batch size, 4",
        ),
        (
            "def make(b):\n    return [nn.Linear(3, 2)], torch.zeros(b, 2), torch.zeros(b, 2), nn.MSELoss()\n",
            "layer 0 (linear0) failed on (4, 2) torch.float32: RuntimeError",
        ),
        (
            "def make(b):\n    return [nn.Linear(2, 2)], torch.zeros(b, 2), torch.zeros(b, 2), lambda o, t: o - t\n",
            "its loss_fn returned shape (4, 2), not a scalar tensor",
        ),
        ("make = 3\n", "make is a int, not a callable"),
        ("", "has no make"),
    ],
)
def test_bad_factories_are_one_line(capsys, tmp_path, body, message):
    path = write_factory(tmp_path, body)
    line = one_line_error(
        capsys, "profile", "--model", f"{path}:make", "--microbatch-size", "4", "--out", str(tmp_path / "o")
    )
    assert line.startswith(f"error: {path}:make: ") and message in line, line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "no_such_module_x:make"], "cannot import no_such_module_x: ModuleNotFoundError"),
        (["--model", "missing/file.py:make"], "no such file missing/file.py"),
        (["--model", "nosuch"], "unknown model 'nosuch'"),
        (["--model", "hf:gpt2", "--model-depth", "3"], "--model-depth sizes catalog models only"),
        (["--model", "hf:gpt2", "--backend", "gloo"], "--backend is for measuring this machine's links"),
        (["--model", "mlp", "--dtype", "bf16"], "mlp is built in fp32 only"),
    ],
)
def test_bad_model_options_are_one_line(capsys, tmp_path, argv, message):
    line = one_line_error(capsys, "profile", *argv, "--out", str(tmp_path))
    assert message in line, line


def test_a_model_with_fewer_layers_than_stages_is_refused(tmp_path):
    path = write_factory(tmp_path, LINEAR_MODEL)
    model = resolve_model(f"{path}:make", microbatch_size=2)
    with pytest.raises(ModelError, match=rf"stage start 2 is past the last layer \(1\) of {re.escape(str(path))}"):
        split(model, [0, 1, 2])


def test_both_profilers_measure_the_same_bytes_and_validates_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    """``pipesim validate`` profiles the model it runs next, so its profiler
    times copies and leaves the weights and their gradients as they were;
    ``pipesim profile`` builds its steps from the model's own layers. Both
    measure the same bytes and the same way of pricing a pass's overhead."""
    import torch

    from pipesim.validate import profiler
    from pipesim.validate.profiler import profile_model

    settings = ProfileSettings(4, warmup=1, repeats=1)
    model = resolve_model(f"{write_factory(tmp_path, LINEAR_MODEL)}:make", microbatch_size=4)
    empty_stage_repeats = []
    real_time_stage = profiler.time_stage

    def counting(stage, *args, settings, **kw):
        if len(stage) == 0:
            empty_stage_repeats.append((settings.warmup, settings.repeats))
        return real_time_stage(stage, *args, settings=settings, **kw)

    monkeypatch.setattr(profiler, "time_stage", counting)
    before = [p.detach().clone() for layer in model.layers for p in layer.parameters()]
    copied = profile_model(model, settings=settings)
    after = [p for layer in model.layers for p in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(p.grad is None for p in after)
    trained, _ = profile_layers(model, settings=settings)
    assert [la.param_bytes for la in copied.layers] == [la.param_bytes for la in trained.layers]
    assert [la.activation_bytes for la in copied.layers] == [la.activation_bytes for la in trained.layers]
    assert [la.stash_bytes for la in copied.layers] == [la.stash_bytes for la in trained.layers]
    # the pass overhead: an empty stage timed at least OVERHEAD_REPEATS times by both, whatever the layers' repeats
    assert empty_stage_repeats == [(3, profiler.OVERHEAD_REPEATS)] * 2

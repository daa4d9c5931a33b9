"""The catalog's GPT-2 (``gpt2-124m``) against a measured Hugging Face GPT-2
profile (``pipesim bench catalog``): same parameters, bytes accounted for
tensor by tensor, the same winning strategy on the machine it was measured on.

The measured profile and the machine's hardware file are
``tests/data/gpt2-profile/`` (its README says how they were made); nothing
here profiles a model."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from pipesim.experiments.bench import catalog as bench
from pipesim.experiments.cli import main
from pipesim.sim.hardware import load_hardware
from pipesim.sim.workloads.catalog import GPT2_SMALL, architecture, model_parameters, model_profile
from pipesim.sim.workloads.profile import WorkloadError
from pipesim.sim.workloads.readers import load_profile

DATA = Path(__file__).parent / "data" / "gpt2-profile"
PROFILE = DATA / "profile.json"
HARDWARE = DATA / "hardware.json"
#: ``pipesim bench catalog ... --measure-flops --json``'s report of the same files
RECORDED = DATA / "catalog-cpu.json"
#: the profile's shape: hf:gpt2?n_layer=4&seq_len=128, micro-batch 8
BLOCKS, SEQ, MB = 4, 128, 8
VOCAB, POSITIONS, D, HEADS, LAYERS = GPT2_SMALL


def _catalog(device_of: str = "pcie-4gpu"):
    return model_profile("gpt2-124m", load_hardware(device_of).device, MB, layers=BLOCKS, seq_len=SEQ, optimizer="sgd")


def _args(**given) -> Namespace:
    args = dict(
        profile=str(PROFILE),
        catalog="gpt2-124m",
        hardware=str(HARDWARE),
        layers=None,
        seq_len=SEQ,
        stages=None,
        microbatches=8,
        strategies=None,
        measure_flops=False,
        flops=None,
        threads=1,
        repeats=1,
        tolerance=bench.TOLERANCE,
    )
    args.update(given)
    return Namespace(**args)


def test_gpt2_124m_has_gpt2_small_parameters() -> None:
    # OpenAI's GPT-2 small, counted with the output layer tied to the token embedding
    assert (VOCAB, POSITIONS, D, HEADS, LAYERS) == (50257, 1024, 768, 12, 12)
    assert model_parameters("gpt2-124m") == 124_439_808
    arch = architecture("gpt2-124m")
    assert len(arch) == LAYERS + 2
    # the pipeline's copy of the tied embedding is the head's, counted in its
    # profile but not in the model's parameters
    assert arch[-1].tied_params == VOCAB * D
    assert sum(la.params for la in arch) == 124_439_808 + VOCAB * D


def test_gpt2_124m_takes_layers_and_seq_len_and_keeps_its_position_table() -> None:
    dev = load_hardware("pcie-4gpu").device
    short = model_profile("gpt2-124m", dev, 8, layers=4, seq_len=128)
    assert short.num_layers == 6
    full = model_profile("gpt2-124m", dev, 8)
    # wpe keeps its 1024 rows at any sequence: the embedding's weights do not shrink
    assert short.layers[0].param_bytes == full.layers[0].param_bytes == 4 * (VOCAB + POSITIONS) * D
    assert short.layers[1].activation_bytes * 8 == full.layers[1].activation_bytes
    with pytest.raises(WorkloadError, match="1024 positions"):
        model_profile("gpt2-124m", dev, 8, seq_len=2048)


def test_catalog_weights_and_cuts_match_the_measured_profile_exactly() -> None:
    measured, catalog = load_profile(PROFILE), _catalog()
    assert [la.param_bytes for la in catalog.layers] == [la.param_bytes for la in measured.layers]
    # what a cut after the embedding or a block carries: b x s x d fp32
    assert [la.activation_bytes for la in catalog.layers[:-1]] == [la.activation_bytes for la in measured.layers[:-1]]
    # the measured model counts the copy of the tied embedding as HF's tie is undone: two copies
    assert sum(la.param_bytes for la in measured.layers) // 4 == model_parameters("gpt2-124m", layers=4) + VOCAB * D


def test_stash_differences_are_the_tensors_autograd_saves_on_this_cpu() -> None:
    """Each measured stash is the catalog's plus what ``saved_tensors_hooks``
    found beside it (docs/how-to/bring-your-own-model.md, "Measured against
    the catalog"), to the byte."""
    measured, catalog = load_profile(PROFILE), _catalog()
    f32 = 4
    bsd = MB * SEQ * D  # one b x s x d tensor, in elements
    ln_stats = MB * SEQ * f32  # a LayerNorm's mean or rstd: one fp32 per token
    # embedding: a CPU dropout keeps its mask as an fp32 noise tensor (the
    # catalog: a 1-byte mask at 2-byte activations, half an element), and the
    # lookup keeps the token ids and the position ids (int64)
    m, c = measured.layers[0].stash_bytes, catalog.layers[0].stash_bytes
    assert c == bsd * f32 // 2
    assert m == bsd * f32 + MB * SEQ * 8 + SEQ * 8
    # a block: Korthikanti's 17 b.s.d elements, then
    #  + 12 b.s.d: gelu_new is 8 separate operations on the 4d-wide hidden
    #    layer, which keep 3 more 4d-wide tensors than one GELU's input
    #  + 1 b.s.d: two residual-dropout masks in fp32, not 2 bytes an element
    #  + 3 a.s.s per sample: the attention's scores, dropout mask and dropped
    #    scores (SDPA's math path: CPU attention with dropout keeps them;
    #    the catalog's GPT assumes FlashAttention, which does not)
    #  + the two LayerNorms' mean and rstd
    for m_la, c_la in zip(measured.layers[1:-1], catalog.layers[1:-1]):
        assert c_la.stash_bytes == 17 * bsd * f32
        gelu_new, masks, scores = 12 * bsd * f32, bsd * f32, 3 * HEADS * SEQ * SEQ * MB * f32
        assert m_la.stash_bytes == c_la.stash_bytes + gelu_new + masks + scores + 4 * ln_stats
    # head: both keep ln_f's input and output; the catalog keeps the logits for
    # the loss in the stash, the measured head sends them on as its output
    m_head, c_head = measured.layers[-1], catalog.layers[-1]
    logits = MB * SEQ * VOCAB * f32
    assert m_head.activation_bytes == logits and c_head.activation_bytes == 0
    assert c_head.stash_bytes == 2 * bsd * f32 + logits
    assert m_head.stash_bytes == 2 * bsd * f32 + 2 * ln_stats


def test_gemm_shapes_are_the_catalog_layers_flops() -> None:
    arch = architecture("gpt2-124m", seq_len=SEQ, layers=BLOCKS)
    for la, (fwd, bwd) in zip(arch, bench.gemm_shapes(arch, MB)):
        flops = lambda shapes: sum(2.0 * b * m * n * k for b, m, n, k in shapes)  # noqa: E731
        assert flops(fwd) == pytest.approx(MB * (la.gemm_flops + la.other_flops))
        assert flops(bwd) == pytest.approx(2 * flops(fwd))  # every layer with products takes input gradients


def test_measure_gemms_times_every_product() -> None:
    arch = architecture("gpt2-124m", seq_len=1, layers=1)
    got = bench.measure_gemms(arch, 1, threads=1, repeats=1)
    assert len(got["layers"]) == 3 and got["layers"][0] == {"forward_s": 0.0, "backward_s": 0.0}
    assert all(la["forward_s"] > 0 and la["backward_s"] > 0 for la in got["layers"][1:])
    assert got["flops_per_s"] == pytest.approx(got["flops"] / got["seconds"])


def test_both_sides_pick_the_same_winner_on_the_measured_machine() -> None:
    recorded = json.loads(RECORDED.read_text())
    assert recorded["rate"]["source"].startswith("measured")
    report = bench.run(_args(flops=recorded["rate"]["flops_per_s"]))
    assert [s["stages"] for s in report["stages"]] == [2]  # the file describes 2 devices
    (two,) = report["stages"]
    ran = [r for r in two["strategies"] if r["skipped"] is None]
    assert {"gpipe", "1f1b", "zb-h1", "data-parallel"} <= {r["strategy"] for r in ran}
    for r in ran:
        m, c = r["measured"]["throughput_samples_per_s"], r["catalog"]["throughput_samples_per_s"]
        assert r["ratio"] == pytest.approx(c / m)
    assert two["measured_winners"] and two["catalog_winners"]
    assert two["agree"], (two["measured_winners"], two["catalog_winners"])
    assert all(row["param_bytes"]["ratio"] == 1.0 for row in report["layers"])
    text = bench.render(report)
    assert "agree" in text and "DISAGREE" not in text and "block3" in text


def test_bench_catalog_from_the_command_line(capsys) -> None:
    code = main(
        ["bench", "catalog", "--profile", str(PROFILE), "--catalog", "gpt2-124m", "--seq-len", "128"]
        + ["--hardware", "pcie-4gpu", "--stages", "2", "--strategies", "gpipe,1f1b", "--json"]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    assert report["hardware"] == "pcie-4gpu" and report["blocks"] == 4
    assert [r["strategy"] for r in report["stages"][0]["strategies"]] == ["gpipe", "1f1b"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--hardware", "dgx1-v100", "--measure-flops"], "prices GEMMs by their shapes"),
        (["--hardware", "pcie-4gpu", "--layers", "2"], "has 4 layers; the profile has 6"),
        (["--hardware", "pcie-4gpu", "--stages", "2,x"], "comma-separated integers"),
    ],
)
def test_bench_catalog_refuses_in_one_line(extra, message, capsys) -> None:
    code = main(["bench", "catalog", "--profile", str(PROFILE), "--catalog", "gpt2-124m", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_tensor_parallel_gap_is_the_measured_heads_logits(tmp_path) -> None:
    """Tensor parallelism all-reduces each layer's larger of input and output:
    the measured head outputs the logits, the catalog's head nothing. With
    the measured head's output left out, its ratio is the other strategies'."""
    rate = json.loads(RECORDED.read_text())["rate"]["flops_per_s"]
    doc = json.loads(PROFILE.read_text())
    doc["layers"][-1]["activation_bytes"] = 0
    (tmp_path / "profile.json").write_text(json.dumps(doc))

    def ratios(path) -> dict[str, float]:
        (two,) = bench.run(_args(profile=str(path), flops=rate, strategies="1f1b,tensor-parallel"))["stages"]
        return {r["strategy"]: r["ratio"] for r in two["strategies"]}

    as_measured, without_logits = ratios(PROFILE), ratios(tmp_path / "profile.json")
    assert as_measured["tensor-parallel"] > 1.2 * as_measured["1f1b"]
    assert without_logits["tensor-parallel"] == pytest.approx(without_logits["1f1b"], rel=0.05)

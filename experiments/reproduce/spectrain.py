"""SpecTrain (Chen, Yang, Cheng, arXiv 1809.02839, 2018): pipelined model
parallelism with weight prediction against data parallelism and PipeDream on
a 4-GPU platform.

For each kind of model the paper trains, three runs on ``spectrain-4gpu``
(4 GPUs behind one PCIe bridge, an assumption stated in the preset and the
README): SpecTrain as a straight 4-stage pipeline, PipeDream (weight
stashing, the same 1F1B order) as the same pipeline, data parallelism on the
4 GPUs at the same per-GPU micro-batch (a mini-batch of 4 micro-batches,
all-reduced once), and inter-layer model parallelism without pipelining
(GPipe with one micro-batch in flight). Rows: SpecTrain's and PipeDream's
speedup over data parallelism; claims: SpecTrain's largest speedup over data
parallelism and over the best model-parallel method.

The models (assumptions, since the text we could search, the abstract and
summaries, gives no dimensions):

* **a large fully connected network**: not in the catalog; built here from
  its dimensions (:func:`fc_profile`): MNIST-sized input (784), 8 hidden
  layers of 4096 units (the width of VGG's fully connected layers), 10
  outputs, ReLU, fp32, SGD with momentum, micro-batch 128; a layer's time is
  max(FLOPs / the device's sustained FLOP/s, bytes / its memory bandwidth),
  backward twice forward, as the catalog prices layers.
* **a residual LSTM**: the catalog's ``gnmt`` (GNMT-8: 4+4 LSTM layers of
  1024 with residual connections, sequence 50, micro-batch 64), the closest
  residual LSTM the catalog has.
* **VGG-16**: the catalog's ``vgg16-cifar`` (32 x 32 inputs, micro-batch
  128), assuming the paper trained its image models on CIFAR-10.

**Accuracy** (figure ``accuracy``, and ``2bw-mnli`` for PipeDream-2BW's one
published accuracy): nothing is trained here. The rows read what
``pipesim converge`` measured, the results committed in
``experiments/results/`` (:data:`ACCURACY_RESULTS`; each row's note and the
report give the command that regenerates its file), and put each
strategy's accuracy as a gap to data parallelism, in points
(``accuracy_gap_pts``), beside the paper's gap. pipesim's models and data
are not the papers' (a character LSTM and a digits MLP for the paper's
residual LSTM on IMDb and VGG-16 on CIFAR-10, a small character transformer
for 2BW's BERT on MNLI; 400 updates, not whole trainings), so what compares
is the sign, the size and the order of the gaps, not the accuracies. Each
gap is read at the file's reference learning rate (the largest at which
data parallelism converged in every seed, one for every strategy: README
"Convergence"); the report adds every learning rate.

Published (``PUBLISHED_CLAIMS``, ``PUBLISHED_ROWS``; kept out of
:func:`predict`): the abstract's "up to 8.91x speedup compared to data
parallelism on a 4-GPU platform" and the other version of the abstract's
"up to 2.18x speedup compared to the state-of-the-art model parallelism
method" (issue section 4). No per-model speedup is published in what we
could read, so the speedup rows carry none. The accuracy rows' published
gaps are the papers' accuracy tables (:data:`pipesim.experiments.converge.PUBLISHED`:
SpecTrain's top-1 % for the residual LSTM and VGG-16, data parallelism,
PipeDream without and with stashing, SpecTrain; 2BW's MNLI for 2BW and its
synchronous baseline) as gaps to the synchronous run.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

from pipesim.experiments.converge import PUBLISHED as PUBLISHED_ACCURACY
from pipesim.experiments.reproduce.base import (
    Claim,
    Paper,
    Progress,
    Row,
    bars_beside_published,
    no_progress,
    write_figure,
)
from pipesim.sim.api import resolve_hardware, simulate
from pipesim.sim.hardware.machines import DeviceSpec
from pipesim.sim.planning.plan import steady_throughput
from pipesim.sim.strategies import ScheduleSpec
from pipesim.sim.workloads.catalog import model_profile
from pipesim.sim.workloads.profile import LayerCost, Profile

NAME = "spectrain"
FIGURE = "speedup"
HARDWARE = "spectrain-4gpu"
GPUS = 4
#: micro-batches per iteration of a pipeline run, and iterations (a stream of
#: 32: steady state is measured without the first and last 8)
MICROBATCHES, ITERATIONS = 8, 4
#: The large fully connected network (assumed, see the module doc).
FC_INPUT, FC_HIDDEN, FC_LAYERS, FC_OUTPUT, FC_BATCH = 784, 4096, 8, 10, 128
FC_NAME = "spectrain-fc"
#: (row model name, how to build it)
MODELS = (FC_NAME, "gnmt", "vgg16-cifar")

PUBLISHED_CLAIMS = {"spectrain-vs-dp": 8.91, "spectrain-vs-mp": 2.18}

# ---------------------------------------------------------------------------
# Accuracy: pipesim converge's measurements beside the papers' tables
# ---------------------------------------------------------------------------

ACCURACY_FIGURE, TWO_BW_FIGURE = "accuracy", "2bw-mnli"
ACCURACY_METRIC = "accuracy_gap_pts"
#: The depth the rows are read at: SpecTrain's 4 GPUs, one stage each.
ACCURACY_STAGES = 4
#: pipesim converge's committed results read by the accuracy rows: (figure,
#: file in experiments/results/, the papers' setting it stands beside
#: (a key of converge.PUBLISHED), its synchronous baseline, the strategies
#: compared with it).
SPECTRAIN_STRATEGIES = ("pipedream-nostash", "pipedream", "spectrain")
ACCURACY_RESULTS = (
    (ACCURACY_FIGURE, "converge-lstm.json", "spectrain-lstm-imdb", "data-parallel", SPECTRAIN_STRATEGIES),
    (ACCURACY_FIGURE, "converge-mlp.json", "spectrain-vgg16-cifar10", "data-parallel", SPECTRAIN_STRATEGIES),
    (TWO_BW_FIGURE, "converge-gpt-small-probe.json", "pipedream-2bw-bert-mnli", "1f1b", ("pipedream-2bw",)),
    (TWO_BW_FIGURE, "converge-lstm.json", "pipedream-2bw-bert-mnli", "data-parallel", ("pipedream-2bw",)),
    (TWO_BW_FIGURE, "converge-mlp.json", "pipedream-2bw-bert-mnli", "data-parallel", ("pipedream-2bw",)),
)
#: a strategy's label in the report, as the papers name it
LABELS = {
    "data-parallel": "data parallelism",
    "1f1b": "1F1B (synchronous)",
    "pipedream-nostash": "vanilla (no stashing)",
    "pipedream": "PipeDream (stashing)",
    "spectrain": "SpecTrain",
    "pipedream-2bw": "PipeDream-2BW",
}


def _gap_key(figure: str, model: str, technique: str) -> tuple:
    return (figure, model, 32, technique, ACCURACY_METRIC)


def _published_gaps() -> dict[tuple, float]:
    """The papers' accuracy tables as gaps (points) to their synchronous run,
    keyed as the accuracy rows are (:func:`base.row_key`)."""
    out = {}
    for figure, results, setting, baseline, strategies in ACCURACY_RESULTS:
        acc = PUBLISHED_ACCURACY[setting]["accuracy"]
        base = acc["data-parallel"] if "data-parallel" in acc else acc["1f1b"]
        model = results_model(results)
        for technique in strategies:
            out[_gap_key(figure, model, technique)] = round(acc[technique] - base, 2)
    return out


def results_model(results: str) -> str:
    """The model a results file trained, from its name ("converge-lstm.json" -> "lstm")."""
    stem = results.removeprefix("converge-").removesuffix(".json")
    return stem.removesuffix("-probe").removesuffix("-momentum0")


def load_results(results: str) -> dict:
    """A committed ``pipesim converge`` results file (curves.json without its curves)."""
    return json.loads(files("pipesim.experiments").joinpath("results", results).read_text(encoding="utf-8"))


def converge_command(doc: dict) -> str:
    """The ``pipesim converge`` command line that regenerates ``doc`` (its
    curves.json, of which the committed file keeps all but the curves)."""
    st, runs = doc["settings"], doc["runs"]
    strategies = list(dict.fromkeys(lay["strategy"] for lay in st["layouts"]))
    lrs = sorted({r["lr"] for r in runs})
    seeds = sorted({r["seed"] for r in runs})
    stages = sorted({r["stages"] for r in runs})
    return (
        f"pipesim converge --model {st['model']} --stages {' '.join(map(str, stages))} "
        f"--strategies {' '.join(strategies)} --lr {' '.join(f'{x:g}' for x in lrs)} "
        f"--seeds {' '.join(map(str, seeds))} --updates {st['updates']} --update-batch {st['update_batch']} "
        f"--eval-every {st['eval_every']} --momentum {st['momentum']:g} --model-width {st['model_width']} "
        f"--model-depth {st['model_depth']}"
    )


def _mean(doc: dict, stages: int, strategy: str, lr: str) -> float | None:
    got = doc["summary"][str(stages)]["accuracy"].get(strategy, {}).get(lr)
    return None if got is None else got["mean"]


def accuracy_rows() -> list[Row]:
    """Every accuracy row: per results file, each strategy's mean final
    held-out accuracy over seeds minus its synchronous baseline's, in
    points, at :data:`ACCURACY_STAGES` and the file's reference learning
    rate (``published`` None)."""
    rows = []
    for figure, results, _setting, baseline, strategies in ACCURACY_RESULTS:
        doc = load_results(results)
        model = results_model(results)
        summary = doc["summary"][str(ACCURACY_STAGES)]
        lr = f"{summary['reference_lr']:g}"
        base = _mean(doc, ACCURACY_STAGES, baseline, lr)
        layout = {lay["strategy"]: lay for lay in doc["settings"]["layouts"] if lay["stages"] == ACCURACY_STAGES}
        for technique in strategies:
            got = _mean(doc, ACCURACY_STAGES, technique, lr)
            div = summary["accuracy"][technique][lr]
            note = (
                f"measured by pipesim converge ({results}: {doc['settings']['model']}, "
                f"{ACCURACY_STAGES} stages, lr {lr}, the file's reference; {div['seeds']} seeds, "
                f"{div['diverged']} diverged) against {LABELS[baseline]}; regenerate with "
                f"`{converge_command(doc)}`; a different model and data than the paper's: compare signs and "
                f"orderings, not sizes"
            )
            rows.append(
                Row(
                    paper=NAME,
                    figure=figure,
                    model=model,
                    hardware=doc["settings"]["backend"],
                    gpus=ACCURACY_STAGES,
                    global_batch=doc["settings"]["update_batch"],
                    technique=technique,
                    metric=ACCURACY_METRIC,
                    predicted=None if got is None or base is None else 100 * (got - base),
                    config={
                        "w": 1,
                        "d": ACCURACY_STAGES,
                        "b": layout[technique]["microbatch_size"],
                        "recompute": False,
                        "replicas": [1] * ACCURACY_STAGES,
                    },
                    note=note,
                )
            )
    return rows


PUBLISHED_ROWS: dict[tuple, float] = _published_gaps()

FP32 = 4


def fc_profile(
    device: DeviceSpec,
    batch: int = FC_BATCH,
    inputs: int = FC_INPUT,
    hidden: int = FC_HIDDEN,
    layers: int = FC_LAYERS,
    outputs: int = FC_OUTPUT,
) -> Profile:
    """A fully connected network ``inputs -> layers x hidden -> outputs`` at
    micro-batch ``batch``, fp32, on ``device``."""
    dims = [inputs] + [hidden] * layers + [outputs]
    out = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        params = (a * b + b) * FP32
        flops = 2 * batch * a * b
        moved = params + batch * (a + b) * FP32
        fwd = max(flops / device.flops, moved / device.mem_bandwidth)
        out.append(
            LayerCost(
                name=f"fc{i}",
                forward_s=fwd,
                backward_s=2 * fwd,
                param_bytes=params,
                activation_bytes=batch * b * FP32,
                stash_bytes=batch * b * FP32,
            )
        )
    return Profile(
        name=FC_NAME,
        layers=tuple(out),
        microbatch_size=batch,
        optimizer="sgd",
        notes=f"fully connected {inputs}-{layers}x{hidden}-{outputs}, fp32, micro-batch {batch} "
        f"(SpecTrain's 'large fully connected network'; dimensions assumed)",
    )


def profile_of(model: str, device: DeviceSpec) -> Profile:
    return fc_profile(device) if model == FC_NAME else model_profile(model, device)


def _throughput(spec: ScheduleSpec, profile: Profile, hw) -> float:
    return steady_throughput(simulate(spec, profile=profile, hardware=hw))


#: what each model runs: (label, spec)
def runs() -> list[tuple[str, ScheduleSpec]]:
    return [
        ("spectrain", ScheduleSpec("spectrain", GPUS, MICROBATCHES, iterations=ITERATIONS)),
        ("pipedream", ScheduleSpec("pipedream", GPUS, MICROBATCHES, iterations=ITERATIONS)),
        ("inter-layer", ScheduleSpec("gpipe", GPUS, 1, iterations=ITERATIONS)),
        ("data-parallel", ScheduleSpec("data-parallel", GPUS, GPUS, iterations=ITERATIONS)),
    ]


def steps() -> int:
    return len(MODELS) * len(runs())


def predict(progress: Progress = no_progress) -> tuple[list[Row], list[Claim]]:
    hw = resolve_hardware(HARDWARE)
    rows: list[Row] = []
    vs_dp, vs_mp = [], []
    done = 0
    for model in MODELS:
        profile = profile_of(model, hw.device)
        b = profile.microbatch_size
        speed = {}
        for label, spec in runs():
            progress(done, steps(), f"{model}: {label}")
            speed[label] = _throughput(spec, profile, hw)
            done += 1
        dp = speed["data-parallel"]
        best_mp = max(speed["pipedream"], speed["inter-layer"])
        for technique in ("spectrain", "pipedream"):
            rows.append(
                Row(
                    paper=NAME,
                    figure=FIGURE,
                    model=model,
                    hardware=HARDWARE,
                    gpus=GPUS,
                    global_batch=b,
                    technique=technique,
                    metric="speedup_vs_dp",
                    predicted=speed[technique] / dp,
                    config={"w": 1, "d": GPUS, "b": b, "recompute": False, "replicas": [1] * GPUS},
                    note=NOTE_ROW,
                )
            )
        vs_dp.append(speed["spectrain"] / dp)
        vs_mp.append(speed["spectrain"] / best_mp)
    rows += accuracy_rows()
    progress(done, steps(), "done")
    claims = [
        Claim(
            id="spectrain-vs-dp",
            text="SpecTrain up to 8.91x faster than data parallelism on a 4-GPU platform "
            "(the largest of the models' predicted speedups)",
            predicted=max(vs_dp),
            note=NOTE_DP,
        ),
        Claim(
            id="spectrain-vs-mp",
            text="SpecTrain up to 2.18x faster than the best model-parallel method of its "
            "time (predicted: over the faster of PipeDream and unpipelined inter-layer model parallelism)",
            predicted=max(vs_mp),
            note=NOTE_MP,
        ),
    ]
    return rows, claims


NOTE_ROW = "no per-model value published in the text we could read"
NOTE_DP = (
    "the speedup over data parallelism is set by the model's weights against its compute on a shared PCIe "
    "bridge: the fully connected network's 483 MB of fp32 gradients take 0.24 s to all-reduce by NCCL's model "
    "per 0.019 s of compute, so DDP's buckets hide almost none of it (data parallelism 2016 samples/s, 1976 without them); the "
    "dimensions of the paper's networks and its platform's interconnect are assumptions here (module doc); "
    "the largest fully connected network decides the maximum"
)
NOTE_MP = (
    "SpecTrain and PipeDream run the same 1F1B order, so pipesim predicts SpecTrain no faster than PipeDream "
    "(slower where its weight prediction, a memory-bound pass over a stage's weights before each pass, is "
    "large against the compute: the fully connected network); the paper's gain over the model-parallel "
    "method of its time is measured against a baseline pipesim does not model, and the accuracy side "
    "(staleness) is the convergence work's (pipesim converge)"
)


def notes(rows: list[Row], claims: list[Claim]) -> str:
    return "\n".join(
        [
            "Platform `spectrain-4gpu`: 4 x GTX 1080 Ti (fp32) behind one PCIe 3.0 bridge, an assumption (the catalog "
            "reference, spectrain-4gpu). Models, assumed: a fully connected network 784-8x4096-10 "
            "(`spectrain-fc`, built in `pipesim.experiments.reproduce.spectrain` from its dimensions, micro-batch 128), "
            "the catalog's `gnmt` as the residual LSTM (4+4 LSTM layers of 1024, residual, micro-batch 64) and "
            "`vgg16-cifar` as VGG-16 (micro-batch 128). Every pipeline is a straight 4-stage pipeline split by the "
            "simulator's partitioner; data parallelism runs the same micro-batch per GPU and all-reduces its "
            "gradients once per mini-batch of 4, in DDP's buckets while the backward runs.",
            "",
            "",
            accuracy_notes(rows),
        ]
    )


def _order(gaps: dict[str, float | None]) -> str:
    """The strategies from the smallest loss to the largest, with their gaps
    (ties, to 0.1 point, joined by "=")."""
    known = sorted(((v, k) for k, v in gaps.items() if v is not None), key=lambda x: -x[0])
    out = ""
    for i, (v, k) in enumerate(known):
        if i:
            out += " = " if round(v, 1) == round(known[i - 1][0], 1) else " > "
        out += f"{LABELS[k]} " + f"{v:+.2f}".rstrip("0").rstrip(".")
    return out


def accuracy_notes(rows: list[Row]) -> str:
    """The report's accuracy section: the papers' table and pipesim's gaps
    beside it (every learning rate, both depths), the orderings, and the
    commands that regenerate the measurements."""
    out = [
        "### Accuracy under staleness (measured by `pipesim converge`, not trained here)",
        "",
        "Gaps in points to the synchronous run (data parallelism; 2BW's paper: its synchronous baseline). "
        "pipesim's models and data differ from the papers' (character LSTM and digits MLP against the "
        "paper's residual LSTM on IMDb and VGG-16 on CIFAR-10; a small character transformer against 2BW's "
        "BERT on MNLI) and train 400 updates, not whole trainings: compare the gaps' signs and the "
        "strategies' order, not the accuracies. The rows above are read at each file's reference learning "
        "rate (the largest at which data parallelism converged in every seed, one rate for every strategy). "
        "2BW's MNLI pair (87.77, 87.82) is read as `pipesim.experiments.converge.PUBLISHED` assigns it "
        "(2BW 87.82); sources disagree on which is which, a gap of 0.05 points either way.",
        "",
    ]
    acc_rows = [r for r in rows if r.metric == ACCURACY_METRIC]
    done = set()
    for figure, results, setting, baseline, strategies in ACCURACY_RESULTS:
        mine = {r.technique: r for r in acc_rows if r.figure == figure and r.model == results_model(results)}
        paper = {t: r.published for t, r in mine.items()}
        measured = {t: r.predicted for t, r in mine.items()}
        src = PUBLISHED_ACCURACY[setting]
        what = "order" if len(strategies) > 1 else "gap"
        out += [
            f"**{figure}: pipesim `{results_model(results)}` ({results}) beside {src['model']} on "
            f"{src['data']}**: published {what} {_order(paper) or '(not filled in)'}; "
            f"pipesim's at the reference lr {_order(measured)}.",
            "",
        ]
        if results in done:
            continue
        done.add(results)
        doc = load_results(results)
        shown = [s for s in LABELS if s != baseline and s in doc["summary"][str(ACCURACY_STAGES)]["accuracy"]]
        out += ["| stages | lr | " + " | ".join(LABELS[s] for s in shown) + " |", "|---|---|" + "---|" * len(shown)]
        for stages in sorted(doc["summary"], key=int):
            summary = doc["summary"][stages]
            for lr in sorted(summary["accuracy"][baseline], key=float):
                base = _mean(doc, int(stages), baseline, lr)
                cells = []
                for s in shown:
                    got, info = _mean(doc, int(stages), s, lr), summary["accuracy"][s][lr]
                    cell = "—" if got is None or base is None else f"{100 * (got - base):+.1f}"
                    cells.append(cell + (f" ×{info['diverged']}" if info["diverged"] else ""))
                ref = " (ref.)" if float(lr) == summary["reference_lr"] else ""
                out.append(f"| {stages} | {lr}{ref} | " + " | ".join(cells) + " |")
        out += [
            "",
            f"(×k: k seeds diverged.) Regenerate: `{converge_command(doc)} --out DIR` "
            f"(the committed file is DIR/curves.json without the curves).",
            "",
        ]
    return "\n".join(out)


def figures(rows: list[Row], claims: list[Claim], out_dir: Path) -> list[Path]:
    speed = [r for r in rows if r.metric == "speedup_vs_dp"]
    fig = bars_beside_published(
        speed,
        "SpecTrain on 4 GPUs: speedup over data parallelism",
        "speedup over data parallelism (x)",
        group=lambda r: r.model,
    )
    written = write_figure(fig, out_dir, "speedup")
    gaps = [r for r in rows if r.metric == ACCURACY_METRIC]
    if gaps:
        fig = bars_beside_published(
            gaps,
            "Accuracy gap to the synchronous run (points): pipesim converge "
            "(its models) beside the papers' tables (theirs)",
            "points",
            group=lambda r: f"{r.figure}: {r.model}",
        )
        written += write_figure(fig, out_dir, "accuracy")
    return written


PAPER = Paper(
    name=NAME,
    title="SpecTrain (arXiv 1809.02839): speedup over data parallelism and PipeDream on 4 GPUs",
    predict=predict,
    published_rows=PUBLISHED_ROWS,
    published_claims=PUBLISHED_CLAIMS,
    figures=figures,
    steps=steps(),
    notes=notes,
    sources=(
        "Chen, Yang, Cheng, Efficient and Robust Parallel DNN Training through Model Parallelism on "
        "Multi-GPU Platform, arXiv 1809.02839 (abstracts of its versions: 8.91x over data "
        "parallelism, 2.18x over the state-of-the-art model parallelism method)",
    ),
)

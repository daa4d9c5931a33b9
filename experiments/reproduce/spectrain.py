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

The staleness and accuracy side of SpecTrain (weight prediction against
stashing) is the convergence work's (``pipesim converge``, README
"Convergence"); nothing is trained here.

Published (``PUBLISHED_CLAIMS``; kept out of :func:`predict`): the abstract's
"up to 8.91x speedup compared to data parallelism on a 4-GPU platform" and
the other version of the abstract's "up to 2.18x speedup compared to the
state-of-the-art model parallelism method" (issue section 4). No per-model
value is published in what we could read, so the rows carry none.
"""

from __future__ import annotations

from pathlib import Path

from pipesim.sim.api import resolve_hardware, simulate
from pipesim.sim.hardware import DeviceSpec
from pipesim.sim.models import model_profile
from pipesim.sim.planning.plan import steady_throughput
from pipesim.sim.strategies import ScheduleSpec
from pipesim.sim.workload import LayerCost, Profile

from .base import Claim, Paper, Progress, Row, bars_beside_published, no_progress, write_figure

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

PUBLISHED_ROWS: dict[tuple, float] = {}
PUBLISHED_CLAIMS = {"spectrain-vs-dp": 8.91, "spectrain-vs-mp": 2.18}

FP32 = 4


def fc_profile(device: DeviceSpec, batch: int = FC_BATCH, inputs: int = FC_INPUT, hidden: int = FC_HIDDEN,
               layers: int = FC_LAYERS, outputs: int = FC_OUTPUT) -> Profile:
    """A fully connected network ``inputs -> layers x hidden -> outputs`` at
    micro-batch ``batch``, fp32, on ``device``."""
    dims = [inputs] + [hidden] * layers + [outputs]
    out = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        params = (a * b + b) * FP32
        flops = 2 * batch * a * b
        moved = params + batch * (a + b) * FP32
        fwd = max(flops / device.flops, moved / device.mem_bandwidth)
        out.append(LayerCost(name=f"fc{i}", forward_s=fwd, backward_s=2 * fwd, param_bytes=params,
                             activation_bytes=batch * b * FP32, stash_bytes=batch * b * FP32))
    return Profile(name=FC_NAME, layers=tuple(out), microbatch_size=batch, optimizer="sgd",
                   notes=f"fully connected {inputs}-{layers}x{hidden}-{outputs}, fp32, micro-batch {batch} "
                         f"(SpecTrain's 'large fully connected network'; dimensions assumed)")


def profile_of(model: str, device: DeviceSpec) -> Profile:
    return fc_profile(device) if model == FC_NAME else model_profile(model, device)


def _throughput(spec: ScheduleSpec, profile: Profile, hw) -> float:
    return steady_throughput(simulate(spec, profile=profile, hardware=hw))


#: what each model runs: (label, spec)
def runs() -> list[tuple[str, ScheduleSpec]]:
    return [("spectrain", ScheduleSpec("spectrain", GPUS, MICROBATCHES, iterations=ITERATIONS)),
            ("pipedream", ScheduleSpec("pipedream", GPUS, MICROBATCHES, iterations=ITERATIONS)),
            ("inter-layer", ScheduleSpec("gpipe", GPUS, 1, iterations=ITERATIONS)),
            ("data-parallel", ScheduleSpec("data-parallel", GPUS, GPUS, iterations=ITERATIONS))]


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
            rows.append(Row(paper=NAME, figure=FIGURE, model=model, hardware=HARDWARE, gpus=GPUS, global_batch=b,
                            technique=technique, metric="speedup_vs_dp", predicted=speed[technique] / dp,
                            config={"w": 1, "d": GPUS, "b": b, "recompute": False, "replicas": [1] * GPUS},
                            note=NOTE_ROW))
        vs_dp.append(speed["spectrain"] / dp)
        vs_mp.append(speed["spectrain"] / best_mp)
    progress(done, steps(), "done")
    claims = [
        Claim(id="spectrain-vs-dp", text="SpecTrain up to 8.91x faster than data parallelism on a 4-GPU platform "
              "(the largest of the models' predicted speedups)", predicted=max(vs_dp), note=NOTE_DP),
        Claim(id="spectrain-vs-mp", text="SpecTrain up to 2.18x faster than the best model-parallel method of its "
              "time (predicted: over the faster of PipeDream and unpipelined inter-layer model parallelism)",
              predicted=max(vs_mp), note=NOTE_MP),
    ]
    return rows, claims


NOTE_ROW = "no per-model value published in the text we could read"
NOTE_DP = ("the speedup over data parallelism is set by the model's weights against its compute on a shared PCIe "
           "bridge, and the dimensions of the paper's networks and its platform's interconnect are assumptions "
           "here (module doc); the largest fully connected network decides the maximum")
NOTE_MP = ("SpecTrain and PipeDream run the same 1F1B order, so pipesim predicts SpecTrain no faster than PipeDream "
           "(slower where its weight prediction, a memory-bound pass over a stage's weights before each pass, is "
           "large against the compute: the fully connected network); the paper's gain over the model-parallel "
           "method of its time is measured against a baseline pipesim does not model, and the accuracy side "
           "(staleness) is the convergence work's (pipesim converge)")


def notes(rows: list[Row], claims: list[Claim]) -> str:
    return "\n".join([
        "Platform `spectrain-4gpu`: 4 x GTX 1080 Ti (fp32) behind one PCIe 3.0 bridge, an assumption (the README's "
        "\"Papers' machines and workloads\"). Models, assumed: a fully connected network 784-8x4096-10 "
        "(`spectrain-fc`, built in `pipesim.experiments.reproduce.spectrain` from its dimensions, micro-batch 128), "
        "the catalog's `gnmt` as the residual LSTM (4+4 LSTM layers of 1024, residual, micro-batch 64) and "
        "`vgg16-cifar` as VGG-16 (micro-batch 128). Every pipeline is a straight 4-stage pipeline split by the "
        "simulator's partitioner; data parallelism runs the same micro-batch per GPU and all-reduces once per "
        "mini-batch of 4.",
        "",
        "Staleness and accuracy (weight prediction against stashing and against no stashing) are measured by "
        "`pipesim converge` (README \"Convergence\"); they are not run here.",
    ])


def figures(rows: list[Row], claims: list[Claim], out_dir: Path) -> list[Path]:
    fig = bars_beside_published(rows, "SpecTrain on 4 GPUs: speedup over data parallelism",
                                "speedup over data parallelism (x)", group=lambda r: r.model)
    return write_figure(fig, out_dir, "speedup")


PAPER = Paper(name=NAME, title="SpecTrain (arXiv 1809.02839): speedup over data parallelism and PipeDream on 4 GPUs",
              predict=predict, published_rows=PUBLISHED_ROWS, published_claims=PUBLISHED_CLAIMS, figures=figures,
              steps=steps(), notes=notes,
              sources=("Chen, Yang, Cheng, Efficient and Robust Parallel DNN Training through Model Parallelism on "
                       "Multi-GPU Platform, arXiv 1809.02839 (abstracts of its versions: 8.91x over data "
                       "parallelism, 2.18x over the state-of-the-art model parallelism method)",))

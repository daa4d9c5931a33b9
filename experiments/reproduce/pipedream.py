"""PipeDream (Narayanan et al., SOSP'19), Table 1: PipeDream's speedup over
data parallelism at the same GPU count, in epoch time (the throughput ratio).

For each model and cluster the replicas planner (``pipesim plan --strategy
pipedream``, :func:`pipesim.sim.planning.plan.plan`) chooses the
configuration, simulates it with the engine in steady state, and simulates
data parallelism on the same 16 GPUs; the row is the ratio. The models are
PipeDream's own published profiles (``pipedream-*``, measured, fp32, SGD),
rescaled to the per-GPU batch of the paper's runs (VGG-16 64, AlexNet 256,
ResNet-50 128, GNMT-16 64): one micro-batch is one GPU's batch, in the
pipeline and in data parallelism alike. Clusters: ``pipedream-cluster-a-x4``
(4 servers x 4 V100 on PCIe, 10 Gbps) and ``pipedream-cluster-b-x2``
(2 x 8 V100 with NVLink, 25 Gbps).

Published values (``PUBLISHED``; kept out of :func:`predict`):

* VGG-16 5.28x (A), 2.98x (B), configuration 15-1 in both; AlexNet 4.92x
  (A), 2.04x (B), 15-1: the issue's section 4, from the paper's Table 1.
* ResNet-50: the optimizer chose pure data parallelism ("16") on both
  clusters, 1x: Table 1, as summarised in a reading note of the paper found
  with the search tool (a GitHub knowledge-base note on DOI
  10.1145/3341301.3359646, "PipeDream optimizer chooses pure data
  parallelism, about 1x").
* GNMT-16: null. The same note gives "up to ~3.14x on Cluster-B" (the
  paper's Cluster-B row for GNMT-16 is one server of 8 GPUs, not 2 x 8)
  and "about 2.92x time-to-accuracy" on 16 GPUs of Cluster-A, which is not
  epoch time; no source we could read gives the 4 x 4 or 2 x 8 epoch-time
  figure, so the rows carry no published value (the configuration the paper
  ran, "straight" on 14 GPUs, is in ``PUBLISHED_CONFIGS`` for the report).
"""

from __future__ import annotations

from pathlib import Path

from pipesim.experiments.reproduce.base import (
    Claim,
    Paper,
    Progress,
    Row,
    bars_beside_published,
    no_progress,
    write_figure,
)
from pipesim.sim.api import resolve_hardware
from pipesim.sim.planning.plan import PlanRequest, data_parallel_throughput, notation, plan
from pipesim.sim.workloads.catalog import model_profile

NAME = "pipedream"
FIGURE = "table1"
GPUS = 16
#: (catalog model, per-GPU batch of the paper's runs)
MODELS = (("pipedream-vgg16", 64), ("pipedream-alexnet", 256), ("pipedream-resnet50", 128), ("pipedream-gnmt16", 64))
#: (preset, the paper's name for it)
CLUSTERS = (("pipedream-cluster-a-x4", "Cluster-A 4x4"), ("pipedream-cluster-b-x2", "Cluster-B 2x8"))

#: Published speedups over data parallelism, keyed by :func:`key` (model,
#: hardware, technique, metric). Never read by :func:`predict`.
PUBLISHED: dict[tuple, float] = {
    ("pipedream-vgg16", "pipedream-cluster-a-x4", "pipedream", "speedup_vs_dp"): 5.28,
    ("pipedream-vgg16", "pipedream-cluster-b-x2", "pipedream", "speedup_vs_dp"): 2.98,
    ("pipedream-alexnet", "pipedream-cluster-a-x4", "pipedream", "speedup_vs_dp"): 4.92,
    ("pipedream-alexnet", "pipedream-cluster-b-x2", "pipedream", "speedup_vs_dp"): 2.04,
    ("pipedream-resnet50", "pipedream-cluster-a-x4", "pipedream", "speedup_vs_dp"): 1.0,
    ("pipedream-resnet50", "pipedream-cluster-b-x2", "pipedream", "speedup_vs_dp"): 1.0,
}
#: The configuration the paper ran (for the report; not a prediction): its
#: notation and the GPUs it used of the 16. GNMT-16's "straight" pipeline ran
#: 14 stages on 14 GPUs: the stage map its driver launched
#: (``models/gnmt_large/gpus=16/mp_conf.json`` in msr-fiddle/pipedream,
#: commit 7db6a1c) has 14 stages, and its runtime's world size is the map's.
PUBLISHED_CONFIGS = {
    "pipedream-vgg16": ("15-1", 16),
    "pipedream-alexnet": ("15-1", 16),
    "pipedream-resnet50": ("16", 16),
    "pipedream-gnmt16": ("straight", 14),
}
#: "up to 5.3x faster than commonly used intra-batch parallelism" (abstract).
PUBLISHED_CLAIMS = {"pipedream-up-to": 5.3}

#: Why a row's gap is what it is (the report prints it for gaps over 20%).
#: Written after seeing the results; the causes are the planner page's (docs/concepts/planning.md,
#: side by side with PipeDream's optimizer), and they hold for every row.
NOTE_DP = (
    "the gap is in the baseline: pipesim's data parallelism all-reduces the fp32 gradients (PipeDream's profiles "
    "are fp32) by NCCL's model in DDP's buckets while the backward runs, through one 10 or 25 Gbps NIC per "
    "server shared by its GPUs, at 0.54 of line rate (NCCL's socket transport as measured at 25 Gbps: busbw "
    "1.7 GB/s of 3.125, NVIDIA/nccl-tests#83); for VGG-16 that is 1.04 GB through each NIC per iteration, "
    "1.54 s (Cluster-A) and 0.62 s (Cluster-B) of all-reduce beside 0.34 s of compute, 0.22 s of it hidden by "
    "the buckets, so data parallelism runs at 20% and 45% of the 16 GPUs' compute (18% and 35% with one "
    "all-reduce after the backward, 35% and 73% at line rate); AlexNet's at 12% and 27%. With pipesim's own "
    "pipeline rate the published speedups mean data parallelism at 15% (VGG-16) and 5% (AlexNet) on Cluster-A, "
    "below pipesim's, and at 20% (VGG-16) and 34% (AlexNet) on Cluster-B, where pipesim's AlexNet baseline "
    "(27%) is the slower; a slower baseline inflates every speedup over it, as PipeDream's own model of data "
    "parallelism does (the planner page, side by side with PipeDream's optimizer)"
)
NOTE_PIPE = (
    "pipesim's best configuration itself is slow here (AlexNet on Cluster-A: 12-2-1-1 at 27% of the 16 GPUs' "
    "compute): a stage of one replica takes the activations of the many replicas before it through its "
    "server's one NIC, and a replicated stage steps in lock-step with its slowest replica, which PipeDream's "
    "optimizer does not charge (it ignores activation transfers)"
)
#: below this share of the GPUs' compute a configuration's own speed is named as a cause
SLOW_PIPELINE = 0.6
NOTE_CONFIG = (
    "where pipesim's configuration differs from the paper's, pipesim charges the activations each cut sends "
    "over the server's one NIC and makes a replicated stage wait for its slowest replica, which PipeDream's "
    "optimizer does not (it ignores activation transfers); VGG-16 takes the paper's 15-1 on both clusters "
    "(3.90x and 1.99x against the published 5.28x and 2.98x), so there the gap is the baseline's alone; for "
    "AlexNet on Cluster-B the paper's 15-1, held, runs 1.57x (published 2.04x) and pipesim's free 13-3 2.58x"
)


def key(row: Row) -> tuple:
    """How a published value is found: Table 1 has two rows per model, one per cluster."""
    return (row.model, row.hardware, row.technique, row.metric)


def steps() -> int:
    return len(MODELS) * len(CLUSTERS)


def predict(progress: Progress = no_progress) -> tuple[list[Row], list[Claim]]:
    """Table 1's rows and the abstract's claim, from the planner and the engine alone."""
    rows: list[Row] = []
    done = 0
    for model, batch in MODELS:
        for preset, cluster in CLUSTERS:
            progress(done, steps(), f"{model} on {cluster}")
            hw = resolve_hardware(preset)
            profile = model_profile(model, hw.device, batch)
            p = plan(PlanRequest("pipedream", profile, hw, GPUS, model=model))
            replicas = list(p.best.replicas)
            chosen = notation(replicas)
            one_gpu = batch / sum(layer.forward_s + layer.backward_s for layer in profile.layers)
            dp_eff = (p.data_parallel_samples_per_s or 0.0) / (GPUS * one_gpu)
            eff = p.predicted_samples_per_s / (GPUS * one_gpu)
            rows.append(
                Row(
                    paper=NAME,
                    figure=FIGURE,
                    model=model,
                    hardware=preset,
                    gpus=GPUS,
                    global_batch=batch * GPUS,
                    technique="pipedream",
                    metric="speedup_vs_dp",
                    predicted=p.speedup_vs_dp,
                    config={"w": None, "d": len(replicas), "b": batch, "recompute": False, "replicas": replicas},
                    note=f"pipesim chose {chosen}, at {eff:.0%} of 16 GPUs' compute, data parallelism at "
                    f"{dp_eff:.0%}; " + (NOTE_PIPE + "; " if eff < SLOW_PIPELINE else "") + NOTE_DP,
                )
            )
            done += 1
    progress(done, steps(), "done")
    best = max((r.predicted for r in rows if r.predicted is not None), default=None)
    claims = [
        Claim(
            id="pipedream-up-to",
            text="PipeDream up to 5.3x faster than intra-batch (data) parallelism "
            "(abstract; the largest Table 1 row predicted)",
            predicted=best,
            note=NOTE_DP,
        )
    ]
    return rows, claims


def held_to_paper(row: Row) -> float | None:
    """The speedup over data parallelism on all the row's GPUs that pipesim
    predicts for the configuration the paper ran (its cuts planned, as
    ``pipesim plan --replicas`` or ``--straight --gpus N`` does), on the row's
    model and cluster; None where the paper names none. A published fact
    used as an input, so it lives in the report, never in :func:`predict`."""
    if row.model not in PUBLISHED_CONFIGS:
        return None
    config, used = PUBLISHED_CONFIGS[row.model]
    hw = resolve_hardware(row.hardware)
    profile = model_profile(row.model, hw.device, row.global_batch // row.gpus)

    how = {"straight": True} if config == "straight" else {"replicas": tuple(map(int, config.split("-")))}
    theirs = plan(PlanRequest("pipedream", profile, hw, used, model=row.model, **how))
    if used == row.gpus:
        return theirs.speedup_vs_dp
    all_gpus = PlanRequest("pipedream", profile, hw, row.gpus, model=row.model)
    return theirs.predicted_samples_per_s / data_parallel_throughput(all_gpus)


def _paper_config(row: Row) -> str:
    """The paper's configuration in the report's words: its notation, and
    the GPUs it used where it left some idle."""
    if row.model not in PUBLISHED_CONFIGS:
        return "—"
    config, used = PUBLISHED_CONFIGS[row.model]
    return config if used == row.gpus else f"{config} on {used} of {row.gpus} GPUs"


def notes(rows: list[Row], claims: list[Claim]) -> str:
    """The configurations chosen against those the paper ran, what the
    paper's would give in pipesim, and the causes of the gaps."""
    out = [
        'Configurations (PipeDream\'s notation: replicas per stage; "16" pure data parallelism), and the '
        "speedup pipesim predicts for each (the paper's with its cuts planned, `pipesim plan --replicas`):",
        "",
        "| model | cluster | pipesim chose | speedup | the paper ran | its speedup in pipesim |",
        "|---|---|---|---|---|---|",
    ]
    names = dict(CLUSTERS)
    for r in rows:
        theirs = held_to_paper(r)
        out.append(
            f"| {r.model} | {names.get(r.hardware, r.hardware)} | {notation(r.config['replicas'])} | "
            f"{r.predicted:.2f}x | {_paper_config(r)} | "
            f"{'—' if theirs is None else f'{theirs:.2f}x'} |"
        )
    out += [
        "",
        "Per-GPU batch as in the paper's runs (VGG-16 64, AlexNet 256, ResNet-50 128, GNMT-16 64): "
        "PipeDream's measured profiles rescaled linearly from their profiled batch (`--microbatch-size`). "
        "GNMT-16 has no published epoch-time speedup for these two clusters in the sources we could read "
        "(the paper's Cluster-B row is one 8-GPU server), so its rows are predictions only.",
        "",
        "Gaps over 20%: "
        + NOTE_DP[0].upper()
        + NOTE_DP[1:]
        + ". "
        + NOTE_CONFIG[0].upper()
        + NOTE_CONFIG[1:]
        + ". The planner page (docs/concepts/planning.md, side by side with PipeDream's optimizer) "
        "measures both effects.",
    ]
    return "\n".join(out)


def figures(rows: list[Row], claims: list[Claim], out_dir: Path) -> list[Path]:
    names = dict(CLUSTERS)
    fig = bars_beside_published(
        rows,
        "PipeDream Table 1: speedup over data parallelism (16 GPUs, epoch time)",
        "speedup over data parallelism (x)",
        group=lambda r: f"{r.model.removeprefix('pipedream-')}, {names[r.hardware]}",
    )
    return write_figure(fig, out_dir, "table1")


PAPER = Paper(
    name=NAME,
    title="PipeDream (SOSP'19), Table 1: speedup over data parallelism",
    predict=predict,
    published_rows=PUBLISHED,
    published_claims=PUBLISHED_CLAIMS,
    figures=figures,
    steps=steps(),
    key=key,
    notes=notes,
    sources=(
        "Narayanan et al., PipeDream: Generalized Pipeline Parallelism for DNN Training, SOSP 2019, "
        "Table 1 (VGG-16, AlexNet: the issue's section 4; ResNet-50: a reading note of the paper)",
    ),
)

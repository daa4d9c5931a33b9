"""Benchmark: how long ``pipesim profile --model M`` takes, and that it is deterministic.

``pipesim bench profile`` runs ``pipesim profile --model M --microbatch-size
B`` as a user does, in a fresh interpreter (imports, building the model,
the memory check, measuring every layer, writing the profile), for each
``--model`` (by default ResNet-50 and GPT-2 from ``transformers``, the
issue's pair), ``--repeats`` times, and prints the wall time of each
against the target (60 s on the project's 2-core machine).

Two profiles of one model must agree in everything but their timings: the
layers, their names, every byte count, the notes. Each later repeat's
profile is compared with the first one's, field by field, with the
measured times left out, and any difference is printed (a profile that
depends on something else than the model, its settings and the machine).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipesim.experiments.bench import console_command
from pipesim.experiments.cliargs import bench_main, positive, run_command
from pipesim.sim.errors import InputError

#: The issue's models: ResNet-50 and GPT-2 (12 blocks, 128 tokens), built from their configurations.
DEFAULT_MODELS = ("hf:resnet", "hf:gpt2")
#: Seconds a profile of one of them may take on 2 CPU cores.
TARGET_S = 60.0
#: The fields of a profile that are measured times, left out when two profiles are compared.
TIMED_FIELDS = frozenset({"forward_s", "backward_s", "backward_input_s", "overhead"})


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def untimed(profile: dict) -> dict:
    """``profile`` (a profile file's JSON) without its measured times."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in TIMED_FIELDS}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(profile)


def differences(first: dict, other: dict, path: str = "") -> list[str]:
    """Where two untimed profiles differ, as ``path: a != b`` lines."""
    if isinstance(first, dict) and isinstance(other, dict):
        out = []
        for key in sorted(set(first) | set(other)):
            out += differences(first.get(key), other.get(key), f"{path}.{key}" if path else key)
        return out
    if isinstance(first, list) and isinstance(other, list) and len(first) == len(other):
        return [d for i, (a, b) in enumerate(zip(first, other, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if first == other else [f"{path}: {first!r} != {other!r}"]


def profile_once(model: str, microbatch_size: int, out: Path) -> float:
    """Seconds ``pipesim profile`` takes for ``model``, writing to ``out``."""
    cmd = [
        *console_command(),
        "profile",
        "--model",
        model,
        "--microbatch-size",
        str(microbatch_size),
        "--out",
        str(out),
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if done.returncode == 2:  # refused: its one line, as pipesim profile said it
        raise InputError(done.stderr.strip().splitlines()[-1].removeprefix("error: "))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stderr.strip()}")
    return seconds


def run(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipesim-bench-profile-") as tmp:
        for i, model in enumerate(args.model or DEFAULT_MODELS):
            times, profiles = [], []
            for r in range(args.repeats):
                _say(f"[{model}] pipesim profile, run {r + 1}/{args.repeats} ...")
                out = Path(tmp) / f"m{i}r{r}"
                times.append(profile_once(model, args.microbatch_size, out))
                profiles.append(untimed(json.loads((out / "profile.json").read_text())))
            diffs = sorted({d for p in profiles[1:] for d in differences(profiles[0], p)})
            rows.append(
                {
                    "model": model,
                    "layers": len(profiles[0]["layers"]),
                    "seconds": [round(t, 1) for t in times],
                    "median_s": round(statistics.median(times), 1),
                    "differences": diffs,
                }
            )
    return {"microbatch_size": args.microbatch_size, "target_s": TARGET_S, "cpus": os.cpu_count(), "rows": rows}


def render(res: dict) -> str:
    lines = [
        f"pipesim profile --model M --microbatch-size {res['microbatch_size']}, each in a fresh interpreter, "
        f"{res['cpus']} CPUs; target {res['target_s']:.0f} s"
    ]
    w = max([len("model")] + [len(r["model"]) for r in res["rows"]])
    lines.append(f"{'model':{w}} {'layers':>6} {'median s':>9}  {'runs s':20} {'target':7} deterministic")
    for r in res["rows"]:
        same = "yes" if not r["differences"] else f"NO ({len(r['differences'])} fields)"
        if len(r["seconds"]) < 2:
            same = "(one run)"
        met = "met" if r["median_s"] <= res["target_s"] else "missed"
        runs = " ".join(f"{t:.1f}" for t in r["seconds"])
        lines.append(f"{r['model']:{w}} {r['layers']:>6} {r['median_s']:9.1f}  {runs:20} {met:7} {same}")
        lines += [f"    {d}" for d in r["differences"][:10]]
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument(
        "--model",
        action="append",
        default=None,
        help=f"a model `pipesim profile --model` takes; repeat it (default: {', '.join(DEFAULT_MODELS)})",
    )
    p.add_argument("--microbatch-size", type=positive, default=8, help="samples per micro-batch")
    p.add_argument("--repeats", type=positive, default=2, help="profiles of each model (two or more check determinism)")


def main(argv=None, prog: str = "python -m pipesim.experiments.bench.profile") -> int:
    return bench_main(
        argv, prog=prog, description=__doc__.splitlines()[0], add_arguments=add_arguments, run=run, render=render
    )


if __name__ == "__main__":
    raise SystemExit(run_command(main))

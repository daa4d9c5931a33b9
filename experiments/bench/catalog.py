"""Set a measured profile against the catalog's analytic model of the same shape: which strategy wins on each, and why their figures differ.

``pipesim bench catalog --profile P --catalog NAME --hardware H`` costs the
catalog model ``NAME`` at the measured profile's shape (as many blocks as
the profile has layers between its first and last, ``--seq-len``, the
profile's micro-batch and optimizer) on ``H``'s device, and simulates every
strategy ``pipesim compare`` runs, at every ``--stages`` count, with each of
the two profiles on the same machine (:func:`pipesim.sim.api.simulate_schedule`,
the split each run would get from ``pipesim simulate``). It reports:

* per stage count and strategy, the simulated throughput from each side and
  their ratio (catalog / measured), which strategy wins on each side and
  whether the two agree;
* per layer, the measured and the analytic forward and backward time and
  bytes (weights, the activations a cut carries, the stash), each with its
  ratio; a ratio off 1 by more than ``--tolerance`` (25%) is flagged.

What a comparison means depends on ``H``. The measured profile's times are
always those of the machine it was measured on; the catalog's are computed
for ``H``'s device. On a hardware file of that same machine (``pipesim
profile --backend gloo`` writes one) both sides run on the same device and
links, so the ratios test the catalog's cost model; but those files carry a
placeholder compute rate (1 TFLOP/s: a measured profile never reads it), so
``--measure-flops`` first measures the rate the catalog divides its FLOPs by
on this CPU: ``torch.matmul`` of exactly the catalog model's matrix products
(forward and backward shapes at this micro-batch, :class:`~pipesim.sim.workloads.catalog.Gemm`),
at the profile's intra-op threads, their FLOPs over their time; and the
per-layer table then shows those products' measured time beside each
layer's, which is how much of the layer is matrix products. On a GPU preset
(``pcie-4gpu``) the catalog is priced for that GPU while the profile keeps
its CPU times, on the same links: the throughputs differ by the devices'
speeds, and what the comparison tests is whether the ranking of the
strategies survives it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import replace

from pipesim.experiments.cliargs import UsageError, bench_main, int_list, positive, run_command

#: Relative difference above which a figure is flagged (the issue's 25%).
TOLERANCE = 0.25
#: Throughputs within this fraction of a side's best count as winning too
#: (GPipe and 1F1B tie exactly on many machines; the engine's figures are
#: rounded, so a difference this small is no ranking).
TIE = 0.01
#: Iterations per run: ``pipesim compare``'s, so asynchronous schedules are
#: compared in steady state.
ITERATIONS = 4


def add_arguments(ap) -> None:
    ap.add_argument("--profile", required=True, help="the measured profile (pipesim profile's profile.json)")
    ap.add_argument("--catalog", required=True, help="the catalog model of the same architecture (gpt2-124m)")
    ap.add_argument(
        "--hardware",
        required=True,
        help="preset or hardware file both sides run on (the measured machine's hardware.json, or a preset)",
    )
    ap.add_argument(
        "--layers",
        type=positive,
        default=None,
        help="the catalog model's blocks (default: as many as make its layer count the profile's)",
    )
    ap.add_argument("--seq-len", type=positive, default=None, help="the catalog model's sequence (default: its own)")
    ap.add_argument(
        "--stages",
        type=int_list,
        default=None,
        help="comma-separated stage counts (default: 2 up to the machine's devices and the profile's layers)",
    )
    ap.add_argument("--microbatches", type=positive, default=8, help="micro-batches per iteration")
    ap.add_argument("--strategies", default=None, help="comma-separated (default: every strategy compare runs)")
    ap.add_argument(
        "--measure-flops",
        action="store_true",
        help="price the catalog at this CPU's measured GEMM rate (torch.matmul of the catalog model's own "
        "products) instead of the device's flops; for a hardware file of the machine the profile was measured on",
    )
    ap.add_argument(
        "--flops",
        type=float,
        default=None,
        help="price the catalog at this many FLOP/s instead of the device's flops (a rate --measure-flops "
        "reported earlier)",
    )
    ap.add_argument("--threads", type=positive, default=1, help="intra-op threads for --measure-flops (default: 1)")
    ap.add_argument("--repeats", type=positive, default=3, help="timed calls per GEMM shape (default: 3)")
    ap.add_argument(
        "--tolerance", type=float, default=TOLERANCE, help=f"flag ratios off 1 by more than this (default: {TOLERANCE})"
    )


def main(argv: Sequence[str] | None = None, prog: str = "python -m pipesim.experiments.bench.catalog") -> int:
    return bench_main(
        None if argv is None else list(argv),
        prog=prog,
        description=__doc__.split("\n")[0],
        add_arguments=add_arguments,
        run=run,
        render=render,
    )


# ---------------------------------------------------------------- the two profiles


def catalog_depth(name: str, profile_layers: int) -> int:
    """Blocks that give catalog model ``name`` ``profile_layers`` layers
    (its layers other than blocks, an embedding and a head, stay)."""
    from pipesim.sim.workloads.catalog import architecture

    fixed = len(architecture(name, layers=1)) - 1
    if profile_layers - fixed < 1:
        raise UsageError(f"the profile has {profile_layers} layers; {name} needs at least {fixed + 1}")
    return profile_layers - fixed


def gemm_shapes(arch, microbatch_size: int) -> list[tuple[list[tuple[int, int, int, int]], list]]:
    """Per layer of ``arch``: the (batch, m, n, k) of every product its
    forward runs, then of every product its backward runs (each launched as
    often as it repeats), as :func:`pipesim.sim.workloads.catalog.shaped_passes`
    prices them (:func:`~pipesim.sim.workloads.catalog.gemm_launches`)."""
    from pipesim.sim.workloads.catalog import gemm_launches

    out = []
    for la in arch:
        fwd, bwd = [], []
        for part, times, shapes in gemm_launches(la, microbatch_size):
            (fwd if part == "forward" else bwd).extend((b, m, n, k) for m, n, k, b in shapes * times)
        out.append((fwd, bwd))
    return out


def measure_gemms(arch, microbatch_size: int, threads: int, repeats: int) -> dict:
    """This CPU's fp32 ``torch.matmul`` time of every product of ``arch``
    (:func:`gemm_shapes`), each distinct shape timed once: per layer the
    forward and backward seconds, and the rate they add up to."""
    import torch

    from pipesim.validate.gemmprofile import time_matmul
    from pipesim.validate.numerics import intra_op_threads

    shapes = gemm_shapes(arch, microbatch_size)
    distinct = sorted({s for fwd, bwd in shapes for s in (*fwd, *bwd)})
    seconds = {}
    with intra_op_threads(threads):
        for i, (b, m, n, k) in enumerate(distinct, 1):
            print(f"[gemm {i}/{len(distinct)}] b {b}, m {m}, n {n}, k {k} ...", file=sys.stderr, flush=True)
            seconds[(b, m, n, k)] = time_matmul(torch.device("cpu"), torch.float32, b, m, n, k, 1, repeats)
    layers = [
        {"forward_s": math.fsum(seconds[s] for s in fwd), "backward_s": math.fsum(seconds[s] for s in bwd)}
        for fwd, bwd in shapes
    ]
    flops = math.fsum(2.0 * b * m * n * k for fwd, bwd in shapes for (b, m, n, k) in (*fwd, *bwd))
    total = math.fsum(la["forward_s"] + la["backward_s"] for la in layers)
    return {
        "threads": threads,
        "repeats": repeats,
        "shapes": len(distinct),
        "flops": flops,
        "seconds": total,
        "flops_per_s": flops / total,
        "layers": layers,
    }


# ---------------------------------------------------------------- the comparison


def run(args) -> dict:
    from pipesim.sim.api import resolve_hardware
    from pipesim.sim.workloads.catalog import architecture, model_profile
    from pipesim.sim.workloads.profile import at_microbatch_size
    from pipesim.sim.workloads.readers import load_profile

    measured = at_microbatch_size(load_profile(args.profile), None)
    mb = measured.microbatch_size
    layers = args.layers if args.layers is not None else catalog_depth(args.catalog, len(measured.layers))
    arch = architecture(args.catalog, seq_len=args.seq_len, layers=layers)
    if len(arch) != len(measured.layers):
        raise UsageError(
            f"{args.catalog} with {layers} blocks has {len(arch)} layers; the profile has {len(measured.layers)}"
        )
    hw = resolve_hardware(args.hardware)
    rate = {"flops_per_s": hw.device.flops, "source": f"the device's flops ({hw.name})"}
    gemms = None
    if args.measure_flops or args.flops is not None:
        flag = "--measure-flops" if args.measure_flops else "--flops"
        if args.measure_flops and args.flops is not None:
            raise UsageError("--measure-flops and --flops both set the catalog's rate: give one")
        if hw.device.shape_model:
            raise UsageError(f"{flag}: {hw.name} prices GEMMs by their shapes, not at its flops")
    if args.flops is not None:
        hw = replace(hw, device=replace(hw.device, flops=args.flops))  # the device checks the number
        rate = {"flops_per_s": args.flops, "source": "given (--flops)"}
    if args.measure_flops:
        gemms = measure_gemms(arch, mb, args.threads, args.repeats)
        hw = replace(hw, device=replace(hw.device, flops=gemms["flops_per_s"]))
        rate = {
            "flops_per_s": gemms["flops_per_s"],
            "source": f"measured: torch.matmul of the catalog model's {gemms['shapes']} product shapes, "
            f"fp32, {args.threads} thread(s)",
        }

    def catalog(shards: int = 1):
        return model_profile(
            args.catalog,
            hw.device,
            mb,
            layers=layers,
            seq_len=args.seq_len,
            optimizer=measured.optimizer,
            tensor_parallel=shards,  # model_profile shards only where the device has the GEMM shape model
        )

    analytic = catalog()
    report = {
        "profile": args.profile,
        "profile_name": measured.name,
        "catalog": args.catalog,
        "catalog_notes": analytic.notes,
        "blocks": layers,
        "seq_len": args.seq_len,
        "hardware": hw.name,
        "microbatch_size": mb,
        "microbatches": args.microbatches,
        "iterations": ITERATIONS,
        "optimizer": measured.optimizer,
        "rate": rate,
        "tolerance": args.tolerance,
        "tie": TIE,
        "layers": layer_rows(measured, analytic, gemms, args.tolerance),
        "stages": [],
    }
    for p in stage_counts(args.stages, hw, len(measured.layers)):
        report["stages"].append(compare_at(p, args, hw, measured, catalog))
    return report


def stage_counts(chosen: Sequence[int] | None, hw, layers: int) -> list[int]:
    """The stage counts to compare at: ``chosen`` (``--stages``) once each,
    else 2 up to the machine's devices and the profile's layers."""
    if chosen is not None:
        return list(dict.fromkeys(chosen))
    top = min(hw.num_devices or layers, layers)
    return list(range(2, top + 1)) or [1]


def _ratio(catalog: float, measured: float) -> float | None:
    return None if not measured else catalog / measured


def _off(ratio: float | None, tolerance: float) -> bool:
    return ratio is not None and abs(ratio - 1) > tolerance


def layer_rows(measured, analytic, gemms: dict | None, tolerance: float) -> list[dict]:
    """Per layer: each figure of the two profiles, their ratio, and the
    figures off by more than ``tolerance``."""
    rows = []
    for i, (m, c) in enumerate(zip(measured.layers, analytic.layers)):
        row = {"measured_name": m.name, "catalog_name": c.name, "flagged": []}
        for field in ("forward_s", "backward_s", "backward_input", "param_bytes", "activation_bytes", "stash_bytes"):
            mv, cv = getattr(m, field), getattr(c, field)
            key = "backward_input_s" if field == "backward_input" else field
            row[key] = {"measured": mv, "catalog": cv, "ratio": _ratio(cv, mv)}
            if _off(row[key]["ratio"], tolerance):
                row["flagged"].append(key)
        if gemms is not None:
            g = gemms["layers"][i]
            row["gemm_forward_s"], row["gemm_backward_s"] = g["forward_s"], g["backward_s"]
        rows.append(row)
    return rows


def compare_at(p: int, args, hw, measured, catalog) -> dict:
    """Every strategy at ``p`` stages, simulated with each profile."""
    from pipesim.experiments.cli.compare import _compared
    from pipesim.sim.api import simulate_schedule
    from pipesim.sim.engine.metrics import summarize
    from pipesim.sim.engine.size import check_size
    from pipesim.sim.errors import InputError
    from pipesim.sim.strategies import ScheduleSpec, build_schedule

    rows = []
    for name in _compared(args.strategies):
        row = {"strategy": name, "skipped": None}
        rows.append(row)
        print(f"[{p} stages] {name} ...", file=sys.stderr, flush=True)
        try:
            spec = ScheduleSpec(strategy=name, stages=p, microbatches=args.microbatches, iterations=ITERATIONS)
            check_size(spec)
            schedule = build_schedule(spec)
            hw.check_devices(schedule.num_devices)
            shards = int(schedule.options.get("tensor_parallel", 1))
            for side, profile in (("measured", measured), ("catalog", catalog(shards))):
                s = summarize(simulate_schedule(schedule, profile, hw))
                row[side] = {
                    "throughput_samples_per_s": s["throughput_samples_per_s"],
                    "iteration_time_s": s["iteration_time_s"],
                    "devices": s["devices_count"],
                    "out_of_memory": s["out_of_memory"],
                }
        except InputError as e:  # this strategy cannot run this size here: said, and left out
            row["skipped"] = str(e).strip().splitlines()[0]
            row.pop("measured", None)
            continue
        row["ratio"] = _ratio(row["catalog"]["throughput_samples_per_s"], row["measured"]["throughput_samples_per_s"])
        row["flagged"] = _off(row["ratio"], args.tolerance)
    ran = [r for r in rows if r["skipped"] is None]
    out = {"stages": p, "strategies": rows}
    for side in ("measured", "catalog"):
        fits = [r for r in ran if not r[side]["out_of_memory"]]
        best = max((r[side]["throughput_samples_per_s"] for r in fits), default=None)
        out[f"{side}_winners"] = (
            [] if not best else [r["strategy"] for r in fits if r[side]["throughput_samples_per_s"] >= best * (1 - TIE)]
        )
    out["agree"] = bool(set(out["measured_winners"]) & set(out["catalog_winners"]))
    return out


# ---------------------------------------------------------------- tables


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def render(report: dict) -> str:
    from pipesim.experiments.cli.common import rate, table

    tol = report["tolerance"]
    lines = [
        f"{report['profile_name']} (measured) against {report['catalog']} ({report['blocks']} blocks"
        + (f", sequence {report['seq_len']}" if report["seq_len"] else "")
        + f") on {report['hardware']}, micro-batch {report['microbatch_size']}, {report['optimizer']}",
        f"catalog priced at {report['rate']['flops_per_s'] / 1e9:.1f} GFLOP/s: {report['rate']['source']}",
        "",
    ]
    for block in report["stages"]:
        rows = []
        for r in block["strategies"]:
            if r["skipped"] is not None:
                continue
            m, c = r["measured"], r["catalog"]
            mark = (" OOM" if m["out_of_memory"] else "", " OOM" if c["out_of_memory"] else "")
            rows.append(
                [
                    r["strategy"],
                    str(m["devices"]),
                    rate(m["throughput_samples_per_s"]) + mark[0],
                    rate(c["throughput_samples_per_s"]) + mark[1],
                    _x(r["ratio"]) + (" *" if r["flagged"] else ""),
                ]
            )
        lines.append(f"{block['stages']} stages, {report['microbatches']} micro-batches x {report['iterations']}:")
        lines.append(table(rows, ["strategy", "devices", "measured samples/s", "catalog samples/s", "ratio"], limit=64))
        lines += [f"not run: {r['strategy']}: {r['skipped']}" for r in block["strategies"] if r["skipped"]]
        lines.append(
            f"winner: measured {', '.join(block['measured_winners']) or 'none'}; "
            f"catalog {', '.join(block['catalog_winners']) or 'none'} "
            f"({'agree' if block['agree'] else 'DISAGREE'}; within {TIE:.0%} of the best counts as winning)"
        )
        lines.append("")
    has_gemms = any("gemm_forward_s" in r for r in report["layers"])
    rows = []
    for r in report["layers"]:
        flagged = set(r["flagged"])

        def cell(key, fmt, r=r, flagged=flagged):
            v = r[key]
            return [fmt(v["measured"]), fmt(v["catalog"]), _x(v["ratio"]) + (" *" if key in flagged else "")]

        row = [r["measured_name"]]
        row += cell("forward_s", _ms) + cell("backward_s", _ms)
        if has_gemms:
            row += [_ms(r["gemm_forward_s"]), _ms(r["gemm_backward_s"])]
        row += cell("param_bytes", _mib) + cell("activation_bytes", _mib) + cell("stash_bytes", _mib)
        rows.append(row)
    header = ["layer", "F ms", "cat.", "x", "B ms", "cat.", "x"]
    if has_gemms:
        header += ["GEMM F", "GEMM B"]
    header += ["params MiB", "cat.", "x", "output MiB", "cat.", "x", "stash MiB", "cat.", "x"]
    lines.append("per layer, one micro-batch (measured, catalog, catalog / measured):")
    lines.append(table(rows, header, limit=256))
    notes = f"* off by more than {tol:.0%}"
    if has_gemms:
        notes += "; GEMM F, GEMM B: this CPU's torch.matmul time of the layer's products, forward and backward"
    lines.append(notes)
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(run_command(main))

"""``pipesim profile``: measure a real model and this machine's links,
writing the profile and hardware JSON that ``simulate`` takes."""

from __future__ import annotations

import argparse

from pipesim.experiments.cli.common import fmt_bytes, model_args, output_dir, progress, table
from pipesim.experiments.cliargs import positive


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure a real model and this machine's links for the simulator")
    model_args(p)
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl", "single"),
        default="gloo",
        help="what to measure links on (single: no links)",
    )
    p.add_argument("--devices", type=positive, default=2, help="devices the hardware JSON describes")
    p.add_argument(
        "--repeats", type=positive, default=15, help="timed repetitions per layer or GEMM shape (their mean is taken)"
    )
    p.add_argument("--out", default="out/profile", help="output folder")
    gemm = p.add_argument_group("GEMM table (instead of a model)")
    gemm.add_argument(
        "--gemm-table",
        action="store_true",
        help="measure this machine's GEMM throughput by shape (torch.matmul over a full grid of shapes) "
        "and write gemm-table.json, which a hardware file's device names as its gemm_table",
    )
    gemm.add_argument(
        "--gemm-sizes",
        type=int_list,
        default=None,
        help="m, n and k values, comma-separated (default: 256-4096 on a GPU, as XLA's table; 64-1024 on a CPU)",
    )
    gemm.add_argument(
        "--gemm-batches",
        type=int_list,
        default=None,
        help="b values, comma-separated (default: 1,2,4 on a GPU; 1,2 on a CPU)",
    )
    gemm.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="the operands' type")
    p.set_defaults(func=run)


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def run(args) -> int:
    import json

    if args.gemm_table:
        return run_gemm_table(args)

    from pipesim.sim.workloads.readers import save_profile
    from pipesim.validate.harness import ValidateConfig, check_fits, hardware_for, model_of, profile, torch_device

    out = output_dir(args.out)
    cfg = ValidateConfig(
        strategy="gpipe",
        model=args.model,
        backend=args.backend,
        microbatch_size=args.microbatch_size,
        model_width=args.model_width,
        model_depth=args.model_depth,
        seed=args.seed,
        profile_repeats=args.repeats,
    )
    device = torch_device(args.backend)
    model = model_of(cfg)
    check_fits(cfg, model)
    progress(f"measuring {args.backend} point-to-point links and the optimizer's bandwidth ...")
    hw = hardware_for(cfg, device, args.devices, model=model)
    progress(f"profiling {args.model} layers on {device} (micro-batch {args.microbatch_size}) ...")
    prof = profile(cfg, device, model=model, hardware=hw)
    save_profile(prof, out / "profile.json")
    (out / "hardware.json").write_text(json.dumps(hw.to_json(), indent=1) + "\n")
    rows = [
        [
            la.name,
            f"{la.forward_s * 1e3:.3f}",
            f"{la.backward_s * 1e3:.3f}",
            fmt_bytes(la.param_bytes),
            fmt_bytes(la.activation_bytes),
            fmt_bytes(la.stash_bytes),
        ]
        for la in prof.layers
    ]
    print(table(rows, ["layer", "F ms", "B ms", "params", "output", "stash"], limit=64))
    print(
        f"per-pass overhead: forward {prof.overhead_forward_s * 1e6:.1f} us, backward "
        f"{prof.overhead_backward_s * 1e6:.1f} us; optimizer bandwidth {hw.device.mem_bandwidth / 1e9:.2f} GB/s"
    )
    written = "profile.json and hardware.json"
    if hw.intra_node.kind != "ideal":
        from pipesim.validate.commprofile import measure_allreduce
        from pipesim.validate.harness import ring_allreduce_prediction

        print(
            f"{args.backend} link: latency {hw.intra_node.latency * 1e6:.1f} us, "
            f"bandwidth {hw.intra_node.bandwidth / 1e9:.3f} GB/s"
        )
        progress(f"measuring all-reduce over {args.devices} {args.backend} ranks ...")
        coll = measure_allreduce(args.backend, args.devices)
        (out / "collectives.json").write_text(json.dumps(coll.to_json(), indent=1) + "\n")
        written = "profile.json, hardware.json and collectives.json"
        rows = [
            [fmt_bytes(n), f"{t * 1e3:.3f}", f"{ring_allreduce_prediction(hw, args.devices, n) * 1e3:.3f}"]
            for n, t in zip(coll.sizes, coll.allreduce_s)
        ]
        print(table(rows, ["all-reduce size", "measured ms", "ring model ms"], limit=64))
    print(f"wrote {written} to {out} (pipesim simulate --profile {out}/profile.json --hardware {out}/hardware.json)")
    return 0


def run_gemm_table(args) -> int:
    """``--gemm-table``: time the grid of GEMM shapes on the backend's device."""
    import json
    import sys

    from tqdm import tqdm

    from pipesim.sim.hardware.gemm import load_table
    from pipesim.validate.gemmprofile import measure_table
    from pipesim.validate.harness import torch_device

    out = output_dir(args.out)
    device = torch_device(args.backend)
    with tqdm(total=None, file=sys.stderr, delay=1.0, leave=False, desc="GEMM shapes") as bar:

        def step(done: int, total: int) -> None:
            bar.total = total
            bar.update(1)

        data = measure_table(
            device, args.dtype, args.gemm_batches, args.gemm_sizes, repeats=args.repeats, on_point=step
        )
    path = out / "gemm-table.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    table_ = load_table(str(path))  # what the simulator will read, checked as it reads it
    rates = [p[4] for p in data["points"]]
    print(
        f"{len(rates)} shapes on {data['device']} ({args.dtype}): {min(rates) / 1e9:.1f} to "
        f"{max(rates) / 1e9:.1f} GFLOP/s; b {list(table_.axes[0])}, m n k {list(table_.axes[1])}"
    )
    print(f"wrote {path} (name it as the device's gemm_table in a hardware file)")
    return 0

"""``pipesim profile``: measure a real model and this machine's links,
writing the profile and hardware JSON that ``simulate`` takes."""

from __future__ import annotations

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
    p.add_argument("--repeats", type=positive, default=15, help="timed repetitions per layer (median)")
    p.add_argument("--out", default="out/profile", help="output folder")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

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

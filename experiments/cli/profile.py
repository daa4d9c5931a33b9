"""``pipesim profile``: measure a real model and this machine's links,
writing the profile and hardware JSON that ``simulate`` takes.

A catalog model (``mlp``, ``gpt-small``, ``vgg-small``, ``lstm``) without
``--device`` is measured as ``pipesim validate`` measures it: layers on the
backend's device, plus links, kernel bandwidths and collectives. With
``--device``, and for every other model (``hf:``, ``torchvision:``, a
factory: :mod:`pipesim.validate.usermodels`), only the layers are measured
(:func:`pipesim.validate.profiler.profile_layers`) and only
``profile.json`` is written."""

from __future__ import annotations

from pipesim.experiments.cli.common import fmt_bytes, model_args, output_dir, progress, table
from pipesim.experiments.cliargs import UsageError, int_list, positive

#: Timed steps and warm-up steps: a catalog model's, and a layers-only run's of any other model.
CATALOG_REPEATS, CATALOG_WARMUP = 15, 3
MODEL_REPEATS, MODEL_WARMUP = 3, 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure a real model and this machine's links for the simulator")
    model_args(p)
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl", "single"),
        default=None,
        help="what to measure links on (single: no links) (default: gloo; not with a layers-only profile)",
    )
    p.add_argument("--devices", type=positive, default=None, help="devices the hardware JSON describes (default: 2)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="measure the model's layers alone on this device and write profile.json only (the default for "
        "models that are not catalog names, on cpu)",
    )
    p.add_argument(
        "--optimizer",
        choices=("sgd", "adam"),
        default="sgd",
        help="the optimizer the profile is for: its updates run while timing, its state is measured, "
        "and the profile's optimizer field names it",
    )
    p.add_argument(
        "--threads",
        type=positive,
        default=None,
        help="intra-op threads of a layers-only profile on a CPU (default: 1, as each runtime worker computes)",
    )
    p.add_argument(
        "--repeats",
        type=positive,
        default=None,
        help=f"timed repetitions per layer or GEMM shape (their mean is taken) (default: {CATALOG_REPEATS}; "
        f"{MODEL_REPEATS} for models that are not catalog names, whose steps take seconds)",
    )
    p.add_argument(
        "--every-layer",
        action="store_true",
        help="time every layer of a layers-only profile (default: a layer that repeats the one before it, "
        "as a transformer's blocks do, takes that one's times)",
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
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="the GEMM operands' type, or a layers-only profile's weights, gradients, optimizer state "
        "and activations (pure low precision, no fp32 master copy)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    from dataclasses import replace

    if args.gemm_table:
        if args.repeats is None:
            args.repeats = CATALOG_REPEATS
        return run_gemm_table(args)

    from pipesim.validate.usermodels import is_catalog

    out = output_dir(args.out)
    if args.device is not None or not is_catalog(args.model):
        return run_layers(args, out)
    if args.dtype != "fp32":
        raise UsageError(f"--dtype {args.dtype}: {args.model} is built in fp32 only (pass --device for layers only)")

    from pipesim.sim.workloads.readers import save_profile
    from pipesim.validate.harness import ValidateConfig, check_fits, hardware_for, model_of, profile, torch_device
    from pipesim.validate.stage import OptimizerConfig

    args.backend = args.backend or "gloo"
    args.devices = args.devices or 2
    if args.threads is not None:
        raise UsageError("--threads applies to a layers-only profile (--device); the backend's workers use one")
    cfg = ValidateConfig(
        strategy="gpipe",
        model=args.model,
        backend=args.backend,
        microbatch_size=args.microbatch_size,
        model_width=args.model_width,
        model_depth=args.model_depth,
        seed=args.seed,
        optimizer=OptimizerConfig(kind=args.optimizer),
        profile_repeats=args.repeats or CATALOG_REPEATS,
    )
    device = torch_device(args.backend)
    model = model_of(cfg)
    check_fits(cfg, model)
    progress(f"measuring {args.backend} point-to-point links and the optimizer's bandwidth ...")
    hw = hardware_for(cfg, device, args.devices, model=model)
    progress(f"profiling {args.model} layers on {device} (micro-batch {args.microbatch_size}) ...")
    prof = profile(cfg, device, model=model, hardware=hw)
    if args.optimizer != prof.optimizer:
        prof = replace(prof, optimizer=args.optimizer)
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


def run_layers(args, out) -> int:
    """A layers-only profile (the module doc): ``profile.json`` alone."""
    import sys
    import time

    import torch
    from tqdm import tqdm

    from pipesim.sim.workloads.readers import save_profile
    from pipesim.validate.numerics import EXECUTOR_THREADS, intra_op_threads
    from pipesim.validate.profiler import ProfileSettings, device_name, profile_layers
    from pipesim.validate.stage import OptimizerConfig
    from pipesim.validate.usermodels import check_activations, is_catalog, resolve_model

    for flag, value in (("--backend", args.backend), ("--devices", args.devices)):
        if value is not None:
            raise UsageError(
                f"{flag} is for measuring this machine's links, which a layers-only profile (--device, or a "
                f"model that is not a catalog name) does not do: leave it out"
            )
    device = torch.device(args.device or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this machine has no CUDA device (use --device cpu)")
    if device.type == "cuda":
        device = torch.device("cuda", 0)
    if args.threads is not None and device.type != "cpu":
        raise UsageError("--threads sets a CPU's intra-op threads; leave it out with --device cuda")
    catalog = is_catalog(args.model)
    repeats = args.repeats or (CATALOG_REPEATS if catalog else MODEL_REPEATS)
    warmup = CATALOG_WARMUP if catalog else MODEL_WARMUP
    b = args.microbatch_size
    started = time.perf_counter()
    model = resolve_model(
        args.model,
        width=args.model_width,
        depth=args.model_depth,
        seed=args.seed,
        microbatch_size=b,
        dtype=args.dtype,
        device=device,
        optimizer=args.optimizer,
    )
    threads = (args.threads or EXECUTOR_THREADS) if device.type == "cpu" else None
    with intra_op_threads(threads):
        check_activations(model, b, device=device)
        where = f"{device} ({device_name(device)}" + (f", {threads} thread(s))" if threads else ")")
        progress(f"profiling {len(model.layers)} layers of {args.model} on {where}, micro-batch {b}, {args.dtype} ...")
        with tqdm(total=None, file=sys.stderr, delay=1.0, leave=False, desc="training steps") as bar:

            def step(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            prof, extra = profile_layers(
                model,
                device=device,
                settings=ProfileSettings(microbatch_size=b, warmup=warmup, repeats=repeats),
                optimizer=OptimizerConfig(kind=args.optimizer),
                dtype=args.dtype,
                progress=step,
                every_layer=args.every_layer or None,
            )
    elapsed = time.perf_counter() - started
    save_profile(prof, out / "profile.json")
    rows = [
        [
            la.name,
            f"{la.forward_s * 1e3:.3f}",
            f"{la.backward_s * 1e3:.3f}",
            f"{la.backward_input_s * 1e3:.3f}",
            f"{m.weight_s * 1e3:.3f}",
            fmt_bytes(la.param_bytes),
            fmt_bytes(la.activation_bytes) + (f" ({len(m.outputs)} tensors)" if len(m.outputs) > 1 else ""),
            fmt_bytes(la.stash_bytes),
            fmt_bytes(m.optimizer_state_bytes),
        ]
        for la, m in zip(prof.layers, extra)
    ]
    header = ["layer", "F ms", "B ms", "I ms", "W ms", "params", "output", "stash", f"{args.optimizer} state"]
    print(table(rows, header, limit=64))
    print(
        f"{model.num_params():,} parameters; per-pass overhead: forward {prof.overhead_forward_s * 1e6:.1f} us, "
        f"backward {prof.overhead_backward_s * 1e6:.1f} us; {elapsed:.1f} s in all"
    )
    print(
        f"wrote profile.json to {out} (layers only, no links: pipesim simulate --profile {out}/profile.json "
        "--hardware PRESET_OR_FILE)"
    )
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

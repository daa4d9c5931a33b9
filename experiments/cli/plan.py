"""``pipesim plan``: run a strategy's planner (PipeDream's splits and
per-stage replicas, PipeDream-2BW's width and depth, AvgPipe's tuner),
confirm the best with the engine, print the plan and write plan.json and
pareto.html."""

from __future__ import annotations

import shlex
import sys
from contextlib import contextmanager

from pipesim.experiments.cli.common import (
    COMPARE_HARDWARE,
    COMPARE_MODEL,
    STRATEGY_FLAGS,
    catalog_models,
    fmt_bytes,
    hardware_presets,
    output_dir,
    plan_profile,
    recorded_path,
)
from pipesim.experiments.cliargs import UsageError, list_choices, nonnegative, positive, replica_counts


def _plannable() -> list[str]:
    from pipesim.sim.planning.plan import plannable

    return plannable()


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="choose the fastest configuration (stages, splits, replicas) for a strategy",
        description="Run the strategy's planner (PipeDream's splits and per-stage replicas; PipeDream-2BW's width, "
        "depth, micro-batch size and recomputation; AvgPipe's tuner), confirm the best with the engine, "
        "print the plan and write plan.json and pareto.html.",
    )
    list_choices(
        p.add_argument(
            "--strategy",
            default="pipedream",
            help="a strategy some planner serves (planned by its first planner unless --planner says otherwise: "
            "pipedream, gpipe, 1f1b replicas; pipedream-2bw width-depth; avgpipe tuner)",
        ),
        _plannable,
    )
    p.add_argument(
        "--planner",
        choices=("replicas", "width-depth", "tuner"),
        default=None,
        help="replicas: splits and per-stage replicas (PipeDream); width-depth: width, depth, micro-batch "
        "size and recomputation for --batch-size (PipeDream-2BW; also gpipe, 1f1b); tuner: "
        "pipelines and micro-batches by simulation (AvgPipe) (default: the strategy's)",
    )
    p.add_argument(
        "--batch-size",
        type=positive,
        default=None,
        help="width-depth: global batch B per update (m = B / (width x micro-batch size)); tuner: "
        "samples per pipeline per iteration (default: 4 micro-batches of the model's size per GPU)",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="activation recomputation: replicas and tuner plan with it; width-depth searches it anyway "
        "and with this flag only configurations that recompute",
    )
    g = p.add_mutually_exclusive_group()
    list_choices(
        g.add_argument("--model", default=None, help=f"catalog model (default: {COMPARE_MODEL})"), catalog_models
    )
    g.add_argument("--profile", default=None, help="per-layer cost profile (JSON or PipeDream's graph.txt)")
    list_choices(
        p.add_argument("--hardware", default=COMPARE_HARDWARE, help="preset, preset-xN or a JSON file"),
        hardware_presets,
    )
    p.add_argument("--gpus", type=positive, default=None, help="devices to plan for (default: all the hardware has)")
    p.add_argument(
        "--microbatches", type=positive, default=None, help="micro-batches per iteration (default: one per device)"
    )
    p.add_argument(
        "--iterations",
        type=positive,
        default=None,
        help="iterations of each confirming simulation (steady state is measured on all but the "
        "first and the last) (default: 3)",
    )
    p.add_argument(
        "--microbatch-size",
        type=positive,
        default=None,
        help="samples per micro-batch (default: the model's; width-depth and tuner: every power of two "
        "that divides the batch, or only this one)",
    )
    p.add_argument("--no-stashing", action="store_true", help="pipedream without weight stashing (vanilla)")
    from pipesim.sim.strategies import OPTION_DEFAULTS, PLACEMENTS

    for name in _PLAN_OPTION_FLAGS:
        kind, text = STRATEGY_FLAGS[name]
        p.add_argument(
            f"--{name}",
            type=kind,
            default=None,
            choices=PLACEMENTS if name == "placement" else None,
            help=f"{text} (default: {_PLAN_OPTION_DEFAULTS.get(name, OPTION_DEFAULTS[name])})",
        )
    held = p.add_mutually_exclusive_group()
    held.add_argument(
        "--replicas",
        type=replica_counts,
        default=None,
        help="replicas planner: hold the search to this configuration, replicas per stage in "
        "PipeDream's notation (15,1 for 15-1), summing to the GPUs; only the cuts are searched",
    )
    held.add_argument(
        "--straight",
        action="store_true",
        help="replicas planner: hold the search to a straight pipeline, one stage on each of the "
        "--gpus devices (what PipeDream's optimizer returns under --straight_pipeline; its paper "
        "ran GNMT-16 as 14 such stages: --gpus 14)",
    )
    p.add_argument(
        "--confirm",
        type=nonnegative,
        default=None,
        help="candidates confirmed with the engine, besides data parallelism, the straight pipeline and the "
        "sweep's new replica counts (0: the cost model alone) (default: 8; width-depth: 6, no landmarks)",
    )
    p.add_argument(
        "--refine",
        type=nonnegative,
        default=None,
        help="replicas planner: other splits of the chosen pipeline confirmed once it is chosen (0: none) (default: 6)",
    )
    p.add_argument(
        "--recv-lookahead",
        type=nonnegative,
        default=1,
        help="post receives this many compute actions early (0 = right before use)",
    )
    p.add_argument("--json", action="store_true", help="print plan.json instead of the summary")
    p.add_argument("--out", default="out/plan", help="output folder (plan.json, pareto.html)")
    p.set_defaults(func=run)


def run(args) -> int:
    from pipesim.experiments.plans import render_plan, write_plan
    from pipesim.sim.api import resolve_hardware
    from pipesim.sim.planning.plan import dumps

    hw = resolve_hardware(args.hardware)
    gpus = args.gpus or (sum(args.replicas) if args.replicas else hw.num_devices)
    if gpus is None:
        raise UsageError(f"pipesim plan: {hw.name} has no fixed device count; give --gpus N")
    planner = _planner(args)
    out = output_dir(args.out)
    from pipesim.sim.planning.plan import ITERATIONS

    m = args.microbatches or gpus
    with _plan_progress(gpus * m * (args.iterations or ITERATIONS)) as say:
        record = _PLANNERS[planner](args, hw, gpus, say).to_json()
    written = write_plan(record, out)
    if args.json:
        sys.stdout.write(dumps(record))
    else:
        print(render_plan(record))
        print(
            f"wrote {', '.join(p.name for p in written)} to {out} "
            f"(pipesim simulate --plan {shlex.quote(str(out / 'plan.json'))})"
        )
    if record["out_of_memory"]:  # the files show every candidate; the answer is that none will do
        from pipesim.sim.planning.plan import PlanError

        limit = record["memory_limit_bytes"]
        raise PlanError(
            f"no configuration of {args.strategy} the planner found fits in memory: the fastest, "
            f"{record['config']}, needs {fmt_bytes(record['peak_memory_bytes'])} per device"
            + ("" if limit is None else f" of {fmt_bytes(limit)}")
            + f" ({out}/plan.json and pareto.html list every candidate)"
        )
    return 0


def _planner(args) -> str:
    """The planner the strategy uses (``Strategy.planners``; ``--planner``
    picks another it allows), and the flags that planner takes checked."""
    from pipesim.sim.planning.plan import PlanError, plannable
    from pipesim.sim.strategies import get_strategy

    strategy = get_strategy(args.strategy)
    if not strategy.planners:
        raise PlanError(
            f"{args.strategy} takes no per-stage replicas and has no planner, so there is nothing to "
            f"plan; plannable: {', '.join(plannable())}"
        )
    planner = args.planner or strategy.planner
    if planner not in strategy.planners:
        raise PlanError(f"{args.strategy} is planned by {' or '.join(strategy.planners)}, not {planner}")
    if args.refine is not None and (args.replicas is not None or args.straight or args.confirm == 0):
        held = "--replicas" if args.replicas is not None else "--straight" if args.straight else "--confirm 0"
        raise UsageError(
            f"pipesim plan: --refine does nothing with {held} (a held search confirms its own splits; "
            "--confirm 0 simulates nothing)"
        )
    if planner == "replicas" and args.batch_size is not None:
        raise UsageError(
            "pipesim plan: --batch-size is for the width-depth and tuner planners; the replicas planner "
            "takes --microbatches (per iteration) and --microbatch-size"
        )
    why = {
        "--microbatches": "it chooses the micro-batches from --batch-size",
        "--no-stashing": "weight stashing is PipeDream's, planned by the replicas planner",
        "--replicas": "its stages are never replicated one by one",
        "--straight": "its stages are never replicated one by one",
        "--refine": "its splits are balanced, not searched",
    }
    given = [
        flag
        for flag, on in (
            ("--microbatches", args.microbatches is not None),
            ("--no-stashing", args.no_stashing),
            ("--replicas", args.replicas is not None),
            ("--straight", args.straight),
            ("--refine", args.refine is not None),
        )
        if on
    ]
    if planner != "replicas" and given:
        flag = given[0]
        raise UsageError(f"pipesim plan: {flag} is not an option of the {planner} planner ({why[flag]})")
    return planner


#: Strategy options ``pipesim plan`` passes to a planner (AvgPipe's; a
#: strategy that does not take one refuses it in one line).
_PLAN_OPTION_FLAGS = ("alpha", "tau", "advance", "placement", "flushes")
#: What a plan option is when the command line leaves it out, where that is
#: not the spec's default.
_PLAN_OPTION_DEFAULTS = {"flushes": "the fewest that fit, chosen by the planner"}


def _plan_options(args) -> dict:
    """The strategy options the plan command line gives."""
    options = {name: getattr(args, name) for name in _PLAN_OPTION_FLAGS if getattr(args, name) is not None}
    return options | ({"stashing": False} if args.no_stashing else {})


def _plan_replicas(args, hw, gpus: int, say):
    """PipeDream's planner: splits and per-stage replicas."""
    from pipesim.sim.planning.plan import PlanRequest, plan

    profile = plan_profile(args, hw, gpus)
    options = _plan_options(args)
    given = {k: getattr(args, k) for k in ("iterations", "confirm", "refine") if getattr(args, k) is not None}
    return plan(
        PlanRequest(
            args.strategy,
            profile,
            hw,
            gpus,
            microbatches=args.microbatches,
            options=options,
            recv_lookahead=args.recv_lookahead,
            model=args.model,
            profile_path=recorded_path(args.profile),
            recompute=args.recompute,
            replicas=args.replicas,
            straight=args.straight,
            **given,
        ),
        progress=say,
    )


def _profile_for(args, hw, gpus: int):
    """(the model at micro-batch size b, the sizes the planner may try: None
    for any, a measured profile's own, or --microbatch-size), and the
    batch size: --batch-size, else 4 micro-batches of the model's size per GPU."""
    from dataclasses import replace

    from pipesim.sim.workloads.catalog import model_profile

    default = plan_profile(args, hw, gpus)
    batch = args.batch_size or 4 * gpus * default.microbatch_size
    if args.profile:  # one size: the profile's, or --microbatch-size's (at_microbatch_size)
        return (lambda b: replace(default, microbatch_size=b)), (default.microbatch_size,), batch
    model = args.model or "uniform"
    layers = gpus if model == "uniform" else None
    sizes = None if args.microbatch_size is None else (args.microbatch_size,)
    return (lambda b: model_profile(model, hw.device, b, layers=layers)), sizes, batch


def _plan_width_depth(args, hw, gpus: int, say):
    """PipeDream-2BW's planner: width, depth, micro-batch size, recomputation."""
    from pipesim.sim.planning.grid import GridRequest, plan_grid

    profile_for, sizes, batch = _profile_for(args, hw, gpus)
    given = {k: getattr(args, k) for k in ("iterations", "confirm") if getattr(args, k) is not None}
    return plan_grid(
        GridRequest(
            args.strategy,
            profile_for,
            hw,
            gpus,
            batch,
            microbatch_sizes=sizes,
            recompute=(True,) if args.recompute else (False, True),
            options=_plan_options(args),
            recv_lookahead=args.recv_lookahead,
            model=args.model,
            profile_path=recorded_path(args.profile),
            **given,
        ),
        progress=say,
    )


def _plan_tuner(args, hw, gpus: int, say):
    """AvgPipe's tuner: pipelines and micro-batches, by simulation."""
    from pipesim.sim.planning.tuner import TuneRequest, tune

    if args.confirm is not None:
        raise UsageError("pipesim plan: the tuner simulates every candidate; leave out --confirm")
    profile_for, sizes, batch = _profile_for(args, hw, gpus)
    microbatches = (
        None if sizes is None else tuple(m for m in range(1, batch + 1) if batch % m == 0 and batch // m in sizes)
    )
    given = {"iterations": args.iterations} if args.iterations is not None else {}
    return tune(
        TuneRequest(
            args.strategy,
            profile_for,
            hw,
            gpus,
            batch,
            microbatches=microbatches or None,
            options=_plan_options(args),
            recv_lookahead=args.recv_lookahead,
            recompute=args.recompute,
            model=args.model,
            profile_path=recorded_path(args.profile),
            **given,
        ),
        progress=say,
    )


#: What each planner (``Strategy.planners``) runs.
_PLANNERS = {"replicas": _plan_replicas, "width-depth": _plan_width_depth, "tuner": _plan_tuner}


@contextmanager
def _plan_progress(passes: int):
    """A progress line on stderr for a terminal (after a second): what the
    planner is doing. Elsewhere (a log, a pipe) nothing for the usual plan
    of a second or two, but one line per step when its confirmation runs
    are long (``passes``, a straight pipeline's stage passes, past
    :data:`~pipesim.experiments.progress.PROGRESS_PASSES`, as for a simulation)."""
    if not sys.stderr.isatty():
        from pipesim.experiments.progress import PROGRESS_PASSES

        yield None if passes < PROGRESS_PASSES else (lambda msg: print(f"planning: {msg}", file=sys.stderr, flush=True))
        return
    from tqdm import tqdm

    bar = tqdm(total=None, file=sys.stderr, delay=1.0, leave=False, bar_format="planning: {desc} {elapsed}")
    try:
        yield lambda msg: (bar.set_description_str(msg, refresh=False), bar.update(0))
    finally:
        bar.close()

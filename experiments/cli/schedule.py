"""``pipesim schedule``: print a strategy's per-device order (text, torch CSV
or pipesim CSV), or list the strategies."""

from __future__ import annotations

import sys

from pipesim.experiments.cli.common import add_schedule_args, schedule_spec
from pipesim.experiments.cliargs import UsageError, nonnegative, positive


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("schedule", help="print a strategy's per-device order")
    add_schedule_args(p, strategy_required=False)
    p.add_argument("--devices", type=positive, default=None, help="devices (interleaved: stages/devices chunks)")
    p.add_argument("--format", choices=("torch-csv", "csv", "text"), default="text")
    p.add_argument("--lowered", action="store_true", help="include the sends and receives")
    p.add_argument(
        "--recv-lookahead",
        type=nonnegative,
        default=None,
        help="with --lowered: post receives this many compute actions early "
        "(default: 0 for torch-csv, which torch's dry run requires; else 1)",
    )
    p.add_argument("--list", action="store_true", help="list strategy names")
    p.set_defaults(func=run)


def run(args) -> int:
    from pipesim.sim.engine.size import check_size
    from pipesim.sim.ir.core import program_cells, to_csv
    from pipesim.sim.strategies import build_schedule, get_strategy, strategies

    if args.list:
        width = max(len(s.name) for s in strategies())
        print("\n".join(f"{s.name:<{width}}  {s.summary}" for s in strategies()))
        return 0
    if not args.strategy:
        raise UsageError("pipesim schedule: give --strategy NAME (or --list)")
    if args.devices is not None and "chunks" in get_strategy(args.strategy).options:
        # --stages counts model stages here: they are dealt over the devices in chunks
        if args.stages % args.devices:
            raise UsageError(f"pipesim schedule: {args.stages} stages do not split evenly over {args.devices} devices")
        args.chunks, args.stages = args.stages // args.devices, args.devices
    if args.recv_lookahead is not None and not args.lowered:
        raise UsageError("pipesim schedule: --recv-lookahead applies to --lowered schedules")
    spec = schedule_spec(args)
    check_size(spec)
    schedule = build_schedule(spec)
    if args.devices is not None and schedule.num_devices != args.devices:
        raise UsageError(
            f"pipesim schedule: {args.strategy} with {args.stages} stages uses "
            f"{schedule.num_devices} devices, not {args.devices}"
        )
    if args.lowered:
        from pipesim.sim.ir.lowering import lower

        # torch's dry run (_simulate_comms_compute) blocks a rank on a posted
        # receive, so it accepts receives only right before their consumer
        lookahead = args.recv_lookahead
        if lookahead is None:
            lookahead = 0 if args.format == "torch-csv" else 1
        schedule = lower(schedule, recv_lookahead=lookahead)
    if args.format == "torch-csv":
        text = to_csv(schedule, torch_only=True)  # refused (one line) before any note
        if get_strategy(args.strategy).asynchronous:  # said, not refused: torch's order of passes is still right
            print(
                f"note: torch's CSV has no updates or weight versions, so {args.strategy} read back from it "
                "is a flushed schedule; --format csv keeps them",
                file=sys.stderr,
            )
        sys.stdout.write(text)
    elif args.format == "csv":
        sys.stdout.write(to_csv(schedule))
    else:
        for dev, prog in enumerate(schedule.programs):
            print(f"device {dev}: " + " ".join(program_cells(prog)))
    return 0

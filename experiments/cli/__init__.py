"""The ``pipesim`` command line.

Sub-commands, one module each (its options and its body together: ``add_parser``
and ``run``), in the order ``pipesim --help`` lists them:

* :mod:`~pipesim.experiments.cli.simulate`: one strategy (or an imported
  schedule CSV, or a plan) on a model and a machine; prints a table, writes
  summary.json, trace.json, timeline.html;
* :mod:`~pipesim.experiments.cli.compare`: several strategies on the same
  model and machine (the default job: ``pipesim compare`` with no arguments);
* :mod:`~pipesim.experiments.cli.plan`: the fastest configuration (stages,
  splits, replicas) a strategy's planner finds; plan.json, pareto.html;
* :mod:`~pipesim.experiments.cli.schedule`: print a strategy's per-device
  order (torch CSV or pipesim CSV);
* :mod:`~pipesim.experiments.cli.profile`: measure a real model and this
  machine's links, writing the profile and hardware JSON that ``simulate`` takes;
* :mod:`~pipesim.experiments.cli.validate`: profile, simulate, run for real
  (gloo, NCCL or one device) and reconcile: report.json, overlay.html, trace.json;
* :mod:`~pipesim.experiments.cli.trace`: import a run's torch.profiler
  traces (``pipesim trace import``) and account for them as for a
  simulation: summary.json, timeline.html, trace.json, imported.json;
* :mod:`~pipesim.experiments.cli.sweep`: a grid of configurations (strategy x
  stages x micro-batches x hardware x model x options) on local workers or
  Ray; sweep.json, sweep.csv, sweep.html (:mod:`pipesim.experiments.sweep`);
* :mod:`~pipesim.experiments.cli.bench`: every benchmark, by the layer it
  measures (:mod:`pipesim.experiments.bench`);
* :mod:`~pipesim.experiments.cli.converge`: train every strategy on the same
  samples and compare held-out accuracy under staleness
  (:mod:`pipesim.experiments.converge`);
* :mod:`~pipesim.experiments.cli.reproduce`: predict the papers' published
  figures and compare (:mod:`pipesim.experiments.reproduce`);
* :mod:`~pipesim.experiments.cli.figure`: paper-style figures (``bubbles``).

The options several of them share (schedule, machine, real model), the output
folder's check, one simulation with its files and the printed tables live in
:mod:`~pipesim.experiments.cli.common`. This module builds the parser and
dispatches.

Exit codes tell the truth (:mod:`pipesim.sim.errors`):

* **2**, one line on stderr: bad input. Every library check raises an
  :class:`~pipesim.sim.errors.InputError` with a one-line message, and the
  argument parser is told to behave the same way.
* **1**, with the failing rank's traceback and a hint: a run that failed
  (:class:`~pipesim.sim.errors.RunError`: a worker raised or died, a launch
  or a collective timed out).
* **1**, with the full traceback: anything else, which is a bug in pipesim
  and is never disguised as bad input.
* **130**: interrupted (Ctrl-C); every worker is stopped first.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

from pipesim.experiments.cli import (
    bench,
    common,
    compare,
    converge,
    figure,
    plan,
    profile,
    reproduce,
    schedule,
    simulate,
    sweep,
    trace,
    validate,
)
from pipesim.experiments.cli.common import COMPARE_HARDWARE, COMPARE_MODEL, DEFAULT_STAGES
from pipesim.experiments.cliargs import Parser, run_command
from pipesim.experiments.export import close_renderer

#: The sub-command modules, in the order ``pipesim --help`` lists them.
SUBCOMMANDS = (simulate, compare, plan, schedule, profile, validate, trace, sweep, bench, converge, reproduce, figure)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pipesim", description="Simulate, validate and plot pipeline-parallel training schedules.")
    parser.add_argument("--version", action=_Version, help="print pipesim's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    return parser


class _Version(argparse.Action):
    """``--version``, looking the version up only when asked (importlib.metadata
    costs every other command 10 ms of start-up)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {_version()}")
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipesim")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: _dispatch(argv))


def _dispatch(argv: list[str] | None) -> int:
    """Parse ``argv`` and run the sub-command it names."""
    args = build_parser().parse_args(argv)
    args.stages_given = getattr(args, "stages", None) is not None
    if args.command in ("simulate", "compare") and args.recv_lookahead is None and not getattr(args, "plan", None):
        args.recv_lookahead = 1  # a plan's own is read with it (pipesim.experiments.cli.simulate._plan_arguments)
    if getattr(args, "stages", 0) is None:  # a schedule's depth: what --replicas says, else 4
        args.stages = len(args.replicas) if getattr(args, "replicas", None) else DEFAULT_STAGES
    if args.command in ("compare", "plan") and getattr(args, "model", None) is None and not args.profile:
        args.model = COMPARE_MODEL  # the default model, unless a profile replaces it
        if args.hardware is None:
            args.hardware = COMPARE_HARDWARE
    if args.command == "compare" and args.hardware is None:
        args.hardware = COMPARE_HARDWARE  # the machine its help names, a profile's run included
    from pipesim.sim._gc import gc_paused

    with gc_paused():  # bulk construction of actions and spans: see pipesim.sim._gc
        return args.func(args)


def console_main() -> None:
    """The ``pipesim`` console script: :func:`main`, then exit at once.

    A large simulation leaves about a million small objects; freeing them one
    by one took 0.16 s of a 2 s run (131k compute actions) only for the
    process to end right after. So the result and the run's temporaries stay
    referenced (:func:`pipesim.sim._gc.kept_until_exit`), the cyclic
    collector stays off for this one-shot process (else its first pass after
    the run would scan every one of those objects), and once the streams are
    flushed the process exits without tearing down its heap. Every output
    file is closed by then, and the PNG export child
    (:mod:`pipesim.experiments.export`) has ended with its browser.
    """
    common.ONE_SHOT = True  # read where the run is simulated (common.simulate_one)
    gc.disable()
    code = main()
    close_renderer()  # the PNG export child and its browser end with the command, not after it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

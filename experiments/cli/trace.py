"""``pipesim trace import``: read a pipeline-parallel run's torch.profiler
traces (one Kineto JSON per rank) and account for the measured timeline as
for a simulation: prints a one-screen report and writes summary.json,
timeline.html, trace.json, imported.json and report.txt
(:mod:`pipesim.experiments.traceimport`, :mod:`pipesim.validate.traceimport`).
``pipesim trace reconcile`` and ``pipesim trace whatif`` simulate the
imported run on its own measured costs
(:mod:`pipesim.experiments.tracereconcile`)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

from pipesim.experiments.cli.common import output_dir
from pipesim.experiments.cliargs import Parser, UsageError, positive

#: Bytes of trace from which a progress bar shows when stderr is not a terminal (a log).
PROGRESS_BYTES = 256 << 20
#: What a folder given as PATH contributes: its trace files.
TRACE_SUFFIXES = (".json", ".json.gz")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("trace", help="import torch.profiler traces of a pipeline-parallel run")
    sub = p.add_subparsers(dest="trace_command", required=True, parser_class=Parser)
    imp = sub.add_parser(
        "import",
        help="import one Kineto trace per rank: report, summary.json, timeline.html, trace.json, imported.json",
        description="Read one torch.profiler (Kineto) trace per rank of a pipeline-parallel run and account for "
        "the measured timeline as for a simulation.",
    )
    imp.add_argument("paths", nargs="+", metavar="PATH", help="trace files (.json, .json.gz), or folders holding them")
    imp.add_argument("--out", default="out/trace", help="output folder")
    imp.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b"),
        default=None,
        help="match a trace whose runtime labels no action (torch's Schedule1F1B) against this schedule's order",
    )
    imp.add_argument(
        "--microbatches", type=positive, default=None, help="micro-batches per step (required with --schedule)"
    )
    imp.add_argument(
        "--mapping",
        default=None,
        help="regular expression matching a whole label of your own loop, with named groups stage, op "
        "(F, B, I, W, ..., or forward/backward, fwd/bwd) and microbatch, e.g. "
        "'(?P<op>fwd|bwd)_s(?P<stage>\\d+)_mb(?P<microbatch>\\d+)'",
    )
    imp.add_argument("--workers", type=positive, default=None, help="processes reading the files (default: per core)")
    imp.add_argument("--json", action="store_true", help="print summary.json instead of the report")
    imp.set_defaults(func=run)

    rec = sub.add_parser(
        "reconcile",
        help="simulate an imported run on its own measured costs: report.json, overlay.html, costs.json",
        description="Simulate the schedule `pipesim trace import` read, with each stage's measured pass times and "
        "each boundary's measured transfer time, and compare the simulation with the run.",
    )
    rec.add_argument("folder", metavar="DIR", help="what `pipesim trace import` wrote (its imported.json)")
    rec.add_argument("--out", default=None, help="output folder (default: DIR)")
    rec.set_defaults(func=run_reconcile)

    wi = sub.add_parser(
        "whatif",
        help="other schedules and micro-batch counts on an imported run's own costs: whatif.json, whatif.html",
        description="Predict, with an imported run's own measured costs, the throughput, bubble and peak stash "
        "of other strategies and micro-batch counts, drawn beside the measured run.",
    )
    wi.add_argument("folder", metavar="DIR", help="what `pipesim trace import` wrote (its imported.json)")
    wi.add_argument(
        "--strategies",
        nargs="+",
        type=_names,
        default=[["1f1b", "interleaved-1f1b", "zb-h1", "pipedream-2bw"]],
        help="strategies to price, space- or comma-separated",
    )
    wi.add_argument(
        "--microbatches",
        nargs="+",
        type=_counts,
        default=None,
        help="micro-batches per step to try (default: the run's m, 2m and 4m)",
    )
    wi.add_argument("--devices", type=positive, default=None, help="devices of the pipeline (default: the run's)")
    wi.add_argument("--out", default=None, help="output folder (default: DIR)")
    wi.set_defaults(func=run_whatif)


def _names(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def _counts(text: str) -> list[int]:
    return [positive(t) for t in text.split(",") if t]


def _flat(lists) -> list:
    return list(dict.fromkeys(x for part in lists for x in part))


def trace_paths(given: list[str]) -> list[Path]:
    """The trace files PATHs name: files as given, folders' trace files sorted."""
    out: list[Path] = []
    for text in given:
        p = Path(text)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(TRACE_SUFFIXES))
            if not found:
                raise UsageError(f"{p}: the folder holds no trace file ({' or '.join(TRACE_SUFFIXES)})")
            out += found
        elif p.exists():
            out.append(p)
        else:
            raise UsageError(f"{p}: no such file or folder")
    return out


@contextmanager
def _bytes_bar(total: int):
    """A progress bar over the bytes read (stderr), or none: on a terminal
    after a second; in a log only for big sets."""
    tty = sys.stderr.isatty()
    if not tty and total < PROGRESS_BYTES:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="reading traces",
        file=sys.stderr,
        delay=1.0 if tty else 0.0,
        mininterval=0.2 if tty else 5.0,
        leave=not tty,
    )
    try:
        yield bar.update
    finally:
        bar.close()


def run(args) -> int:
    from pipesim.experiments.traceimport import write_outputs
    from pipesim.validate.traceimport import import_run

    if args.schedule and args.microbatches is None:
        raise UsageError("pipesim trace import: --schedule needs --microbatches (the micro-batches of one step)")
    if args.schedule and args.mapping:
        raise UsageError("pipesim trace import: --schedule and --mapping both say where the actions are; choose one")
    out = output_dir(args.out)
    paths = trace_paths(args.paths)
    started = time.perf_counter()
    total = sum(p.stat().st_size for p in paths)
    with _bytes_bar(total) as progress:
        run_ = import_run(
            paths,
            schedule=args.schedule,
            microbatches=args.microbatches,
            mapping=args.mapping,
            progress=progress,
            workers=args.workers,
        )
    written = write_outputs(run_, out)
    if args.json and run_.result is not None:
        sys.stdout.write((out / "summary.json").read_text(encoding="utf-8"))  # as write_outputs wrote it
    else:
        print((out / "report.txt").read_text(encoding="utf-8").rstrip("\n"))
        print(f"wrote {', '.join(written)} to {out} in {time.perf_counter() - started:.2f} s")
    return 0


def run_reconcile(args) -> int:
    from pipesim.experiments.tracereconcile import format_reconcile, reconcile_dir

    out = args.out or args.folder
    report = reconcile_dir(args.folder, out)
    print(format_reconcile(report))
    print(f"wrote report.json, costs.json, overlay.html to {out}")
    return 0


def run_whatif(args) -> int:
    from pipesim.experiments.tracereconcile import format_whatif, whatif_dir

    out = args.out or args.folder
    rows, measured = whatif_dir(
        args.folder,
        _flat(args.strategies),
        None if args.microbatches is None else _flat(args.microbatches),
        devices=args.devices,
        out=out,
    )
    print(format_whatif(rows, measured))
    print(f"wrote whatif.json, whatif.html to {out}")
    return 0

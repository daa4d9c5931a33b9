"""``pipesim trace reconcile`` and ``pipesim trace whatif``: a measured run
(what ``pipesim trace import`` wrote) simulated on its own costs.

Both read ``imported.json`` (:func:`pipesim.validate.traceimport.load_imported`)
and calibrate the engine from the run itself
(:mod:`pipesim.sim.planning.whatif`): each stage's mean forward, backward (or
input and weight gradients) and update, each boundary's mean transfer with
the waits taken out.

* :func:`reconcile_dir` simulates the run's own schedule on those costs and
  writes ``report.json`` (the keys ``pipesim validate`` writes for the
  timing: ``iteration_time_error`` and the rest, from
  :func:`pipesim.validate.reconcile.compare`), ``overlay.html`` (measured
  above simulated, per device) and ``costs.json`` (the calibration).
* :func:`whatif_dir` prices other strategies and micro-batch counts with the
  same costs and writes ``whatif.json``, ``whatif.html`` (and ``.png``)
  beside the measured run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pipesim.experiments.overlay import write_overlay_html
from pipesim.experiments.whatif import format_whatif, write_whatif
from pipesim.sim.engine.metrics import bubble_fractions, dumps
from pipesim.sim.planning.whatif import WhatIf, measured_costs, reconcile, what_if
from pipesim.validate.reconcile import compare, iteration_time
from pipesim.validate.traceimport import ImportedRun, TraceImportError, load_imported

IMPORTED = "imported.json"


def imported_run(folder: str | Path) -> ImportedRun:
    """The run ``pipesim trace import`` wrote to ``folder``; a one-line
    error when there is none, or when it found no pipeline to simulate."""
    path = Path(folder) / IMPORTED
    if not path.is_file():
        raise TraceImportError(
            f"{folder}: no {IMPORTED} here (write one with `pipesim trace import ... --out {folder}`)"
        )
    run = load_imported(path)
    if not run.found_pipeline or run.result is None:
        raise TraceImportError(f"{path}: the imported run has no pipeline actions, so there is no schedule to simulate")
    return run


def reconcile_dir(folder: str | Path, out: str | Path | None = None) -> dict:
    """Simulate the imported run on its own measured costs; write
    ``report.json``, ``overlay.html`` and ``costs.json`` to ``out``
    (default ``folder``) and return the report."""
    run = imported_run(folder)
    out = Path(out or folder)
    out.mkdir(parents=True, exist_ok=True)
    measured = run.result
    costs = measured_costs(measured)
    predicted = reconcile(measured, costs)
    report = {
        "source": run.source,
        "stages": measured.schedule.num_stages,
        "devices": measured.schedule.num_devices,
        "microbatches": run.microbatches,
        "steps": run.steps,
        "calibration": "each stage's mean pass times and each boundary's mean transfer, read off this run",
        "assumptions": list(costs.assumptions),
    } | compare(predicted, measured, losses=[], versions_used={})
    report.pop("weight_versions", None)  # a trace holds no weights
    report.pop("losses", None)
    (out / "report.json").write_text(dumps(report))
    (out / "costs.json").write_text(json.dumps(costs.to_json(), indent=1, sort_keys=True) + "\n")
    write_overlay_html(measured, predicted, out / "overlay.html", flagged=report.get("flagged_actions"))
    return report


def format_reconcile(report: dict) -> str:
    """The one-screen summary of a reconciliation."""
    err = report.get("iteration_time_error")
    lines = [
        f"{report['source']}: {report['devices']} devices, {report['stages']} stages, "
        f"{report['microbatches']} micro-batches x {report['steps']} step(s)",
        f"iteration  measured {report['iteration_time_measured_s'] * 1e3:.3f} ms, simulated on its own costs "
        f"{report['iteration_time_predicted_s'] * 1e3:.3f} ms" + ("" if err is None else f" ({err:+.1%})"),
        f"bubble     measured {report['bubble_fraction_measured']:.3f}, simulated {report['bubble_fraction_predicted']:.3f}",
    ]
    for a in report.get("assumptions", []):
        lines.append(f"assumed: {a}")
    worst = report.get("flagged_actions") or []
    if worst:
        lines.append("actions furthest from their simulated place (worst first):")
        for f in worst[:5]:
            lines.append("  " + ", ".join(f"{k} {v}" for k, v in f.items() if k != "reasons"))
    return "\n".join(lines)


def measured_point(run: ImportedRun) -> dict:
    """The run itself, in the terms of a what-if row."""
    result = run.result
    t = iteration_time(result)
    samples = run.microbatches * result.schedule.num_replicas * result.microbatch_size
    bubbles = bubble_fractions(result)
    return {
        "strategy": run.source,
        "microbatches": run.microbatches,
        "iteration_s": t,
        "samples_per_s": samples / t if t > 0 else None,
        "bubble_fraction": sum(bubbles) / len(bubbles) if bubbles else None,
        "peak_stash": None,
    }


def whatif_dir(
    folder: str | Path,
    strategies: Sequence[str],
    microbatches: Sequence[int] | None,
    *,
    devices: int | None = None,
    out: str | Path | None = None,
) -> tuple[list[WhatIf], dict]:
    """Price ``strategies`` x ``microbatches`` (default: the run's m, 2m
    and 4m) with the imported run's costs on its devices (or ``devices``);
    write ``whatif.json`` and ``whatif.html`` to ``out`` (default ``folder``)."""
    run = imported_run(folder)
    if microbatches is None:
        microbatches = [run.microbatches * k for k in (1, 2, 4)]
    out = Path(out or folder)
    costs = measured_costs(run.result)
    rows = what_if(costs, strategies, microbatches, devices or run.result.schedule.num_devices)
    point = measured_point(run)
    title = (
        f"What if: {run.source} measured on {run.result.schedule.num_devices} devices "
        f"({run.microbatches} micro-batches), other schedules on its own costs"
    )
    write_whatif(rows, point, title, out)
    return rows, point


__all__ = ["format_reconcile", "format_whatif", "imported_run", "reconcile_dir", "whatif_dir"]

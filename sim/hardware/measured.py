"""Public measurements of collectives, to hold the collective model against.

``measurements/nccl-tests.json`` holds all-reduce times that NCCL's own
benchmark (nccl-tests' ``all_reduce_perf``) measured on GPU systems nobody
here ran, each curve with its source and the preset and devices that stand
for its system in pipesim (``preset`` is None where pipesim has no preset of
that system yet). ``pipesim bench comm --against nccl-tests`` sets the
engine's all-reduce against every point.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass

from pipesim.sim.errors import InputError
from pipesim.sim.files import parse_json


@dataclass(frozen=True)
class CollectivePoint:
    """One message size of a measured curve."""

    nbytes: int
    seconds: float
    #: as nccl-tests prints it: (bytes / seconds) * 2(n-1)/n, in GB/s (1e9 bytes/s)
    busbw_GBps: float


@dataclass(frozen=True)
class CollectiveCurve:
    """All-reduce times of one system at several message sizes."""

    name: str
    system: str
    gpus: int
    preset: str | None
    devices: tuple[int, ...]
    source: str
    points: tuple[CollectivePoint, ...]


def bus_bandwidth(nbytes: float, seconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce, in bytes/s: what each link
    carries, comparable across rank counts (algorithm bandwidth times 2(n-1)/n)."""
    return nbytes / seconds * 2 * (ranks - 1) / ranks


def nccl_tests_curves() -> list[CollectiveCurve]:
    """Every committed nccl-tests all-reduce curve, in file order."""
    path = importlib.resources.files("pipesim.sim.hardware").joinpath("measurements", "nccl-tests.json")
    data = parse_json(path.read_text(encoding="utf-8"), "nccl-tests.json", InputError)
    return [
        CollectiveCurve(
            name=c["name"],
            system=c["system"],
            gpus=c["gpus"],
            preset=c["preset"],
            devices=tuple(c["devices"]),
            source=c["source"],
            points=tuple(CollectivePoint(p["bytes"], p["seconds"], p["busbw_GBps"]) for p in c["points"]),
        )
        for c in data["curves"]
    ]

"""What an execution of a schedule produces: timed spans, memory and versions.

The SimPy engine fills these from simulated time; the validation runtime fills
the same types from measured time, so the trace writer, the plots and the
reconciliation code never care which executor produced them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from operator import attrgetter

from pipesim.sim.ir.core import Action, Schedule

#: Streams of a device. Compute actions run on "compute"; sends and receives
#: on their own streams so they overlap with compute as on a GPU; all-reduce
#: and elastic averaging on "collective".
STREAMS = ("compute", "send", "recv", "collective")

#: Memory categories, in the order reports list them.
MEMORY_CATEGORIES = (
    "weights",  # parameters x weight versions held
    "gradients",
    "optimizer",  # SGD momentum 1x, Adam 2x the weights
    "activations",  # stashed for the backward of in-flight micro-batches
    "comm_buffers",  # posted receives and in-flight sends
    "prediction",  # SpecTrain's predicted-weights buffer
    "averaging",  # AvgPipe's centre variable
)


@dataclass(slots=True)
class Span:
    """One action executed on one stream of one device, in seconds.

    Treat spans as immutable. (Not ``frozen``: a frozen dataclass costs six
    times as much to build, and the engine builds one per action.)

    ``flow`` pairs a send with its receive (same id on both spans) so trace
    viewers can draw an arrow; ``peer`` is the other device of a transfer.
    ``version`` is the weight version a pass read (``None`` otherwise).
    """

    device: int
    stream: str
    action: Action
    start: float
    end: float
    peer: int | None = None
    flow: int | None = None
    nbytes: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class PassVersions:
    """Weight versions seen by one micro-batch on one stage.

    ``update_version`` is the version current when the update consuming the
    micro-batch's gradient was applied (``None`` if none was). Effective
    versions add the prediction distance. Treat as immutable (not frozen
    for the same reason as :class:`Span`).
    """

    replica: int
    stage: int
    microbatch: int
    forward_version: int
    backward_version: int
    forward_distance: int = 0
    backward_distance: int = 0
    update_version: int | None = None

    @property
    def staleness(self) -> int | None:
        if self.update_version is None:
            return None
        return self.update_version - self.forward_version


@dataclass
class MemoryTrack:
    """Memory of one device over time.

    ``times`` and ``totals`` are step-function samples (bytes held from that
    time on); ``peak_breakdown`` is the per-category split at the peak.
    """

    device: int
    capacity_bytes: float
    times: list[float] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)
    peak_bytes: int = 0
    peak_time: float = 0.0
    peak_breakdown: dict[str, int] = field(default_factory=dict)

    @property
    def out_of_memory(self) -> bool:
        return self.peak_bytes > self.capacity_bytes


@dataclass
class SimResult:
    """Everything one execution of a schedule produced."""

    schedule: Schedule
    spans: list[Span]
    memory: list[MemoryTrack]
    versions: list[PassVersions]
    #: most weight versions of (replica, stage) held at once
    max_versions_held: dict[tuple[int, int], int]
    #: bytes moved per link name
    link_bytes: dict[str, int]
    #: samples per micro-batch, for throughput
    microbatch_size: int = 1
    #: free-form provenance: model, hardware, engine parameters
    meta: dict[str, object] = field(default_factory=dict)
    #: the StageCost of each model stage the execution was costed with
    stage_costs: tuple = ()

    def by_stream(self) -> dict[str, list[Span]]:
        """Spans split by stream, in their original order (computed once:
        trackers, metrics and plots all want the compute spans alone)."""
        cached = self.__dict__.get("_by_stream")
        if cached is None or cached[0] != len(self.spans):
            split: dict[str, list[Span]] = defaultdict(list, {name: [] for name in STREAMS})
            for s in self.spans:  # not setdefault, which would build a list per span to discard
                split[s.stream].append(s)
            cached = self._by_stream = (len(self.spans), dict(split))
        return cached[1]

    def span_bounds(self) -> tuple[float, float] | None:
        """(first start, last end) over every span, None without spans.
        Computed once per span list: each bound is a pass over every span
        (50 ms for both on 389k spans), and the run's choice, the memory
        tracker, the summary and the timeline all ask."""
        spans = self.spans
        cached = self.__dict__.get("_bounds")
        if cached is None or cached[0] is not spans or cached[1] != len(spans):
            bounds = (min(map(attrgetter("start"), spans)), max(map(attrgetter("end"), spans))) if spans else None
            cached = self._bounds = (spans, len(spans), bounds)
        return cached[2]

    @property
    def makespan(self) -> float:
        bounds = self.span_bounds()
        if bounds is None:
            return 0.0
        return bounds[1] - bounds[0]

"""The discrete-event engine and the accounting of what a run produced.

Layer 5 of :mod:`pipesim.sim`: it may import :mod:`~pipesim.sim.ir`,
:mod:`~pipesim.sim.strategies`, :mod:`~pipesim.sim.hardware` and
:mod:`~pipesim.sim.workloads`, never :mod:`~pipesim.sim.partition`,
:mod:`~pipesim.sim.api` or :mod:`~pipesim.sim.planning`.

* :mod:`.core`: the SimPy model of devices, links, CPU cores and collectives running a
  lowered schedule into timed spans;
* :mod:`.results`: the spans and the result every executor returns;
* :mod:`.trackers`: memory, weight versions and staleness derived from spans;
* :mod:`.metrics`: bubbles, throughput and the summary;
* :mod:`.size`: how big a run will be, refused before it is built when it would not fit.
"""

from pipesim.sim.engine.core import (  # the package's public names, where users import them
    CostModel,
    check_on_spans,
    check_run_options,
    compiled,
    prepared_run,
    simulate,
)

__all__ = [
    "check_on_spans",
    "check_run_options",
    "compiled",
    "CostModel",
    "prepared_run",
    "simulate",
]

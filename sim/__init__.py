"""Simulate pipeline-parallel training schedules without hardware.

Pure Python on simpy and numpy (never torch), in layers:

* :mod:`~pipesim.sim.ir`: the schedule IR every executor runs;
  :mod:`~pipesim.sim.checks` validates it, :mod:`~pipesim.sim.lowering` adds
  communication, :mod:`~pipesim.sim.interchange` reads and writes torch's CSV;
* :mod:`~pipesim.sim.strategies`: one small module per schedule, generating the IR;
* :mod:`~pipesim.sim.workload`, :mod:`~pipesim.sim.models`,
  :mod:`~pipesim.sim.partition`, :mod:`~pipesim.sim.hardware`: what runs, split
  how, on what;
* :mod:`~pipesim.sim.planning`: the cost model, the communication-aware
  partitioner's search and the planner (which configuration to run);
* :mod:`~pipesim.sim.engine` (SimPy), :mod:`~pipesim.sim.trackers`,
  :mod:`~pipesim.sim.metrics`, :mod:`~pipesim.sim.trace`: execution and what it
  produced; :mod:`~pipesim.sim.api` ties them together.
"""

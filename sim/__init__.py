"""Simulate pipeline-parallel training schedules without hardware.

Pure Python on simpy and numpy (never torch), in layers. A module may import
its own layer and the layers listed before it, never a later one
(``tests/test_architecture.py`` holds the tree to this, and to having no
import circle):

0. foundations: :mod:`~pipesim.sim.errors` (the exceptions every check
   raises), :mod:`~pipesim.sim.files` (reading input files),
   :mod:`~pipesim.sim.limits` (the bounds input numbers are held to),
   :mod:`~pipesim.sim._gc` (garbage-collector control for big runs);
1. :mod:`~pipesim.sim.ir`: the schedule IR every executor runs, with its
   lowering, dataflow and validation passes;
2. :mod:`~pipesim.sim.strategies`: one small module per schedule, generating the IR;
3. :mod:`~pipesim.sim.hardware`: machines, links and presets;
4. :mod:`~pipesim.sim.workloads`: layer profiles, the model catalog, stage costs;
5. :mod:`~pipesim.sim.engine`: the SimPy engine, and the accounting of memory,
   versions, staleness and bubbles from its spans;
6. :mod:`~pipesim.sim.partition`: splitting a model into stages (the cost model
   and the communication-aware search);
7. :mod:`~pipesim.sim.api` (one run: spec, model and hardware to a result) and
   :mod:`~pipesim.sim.interchange` (torch's schedule CSV in and out);
8. :mod:`~pipesim.sim.planning`: which configuration to run, confirmed by simulation.

Writers (Chrome trace, timeline), the command line and the benchmarks live in
:mod:`pipesim.experiments`.
"""

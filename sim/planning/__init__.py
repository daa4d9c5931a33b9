"""Planning: which configuration to run, and how fast it will be.

Layer 8 of :mod:`pipesim.sim`, the top: it may import every other layer,
:mod:`pipesim.sim.api` included, since it confirms its candidates by
simulating them.

* :mod:`.plan`: the planner (the search of :mod:`pipesim.sim.partition.search`,
  then the best candidates confirmed by the engine), its record
  (:class:`~.plan.Plan`, ``plan.json``) and PipeDream's notation;
* :mod:`.grid`: width × depth planning (PipeDream-2BW's planner);
* :mod:`.tuner`: AvgPipe's tuner (the number of parallel pipelines and of
  micro-batches, by simulation);
* :mod:`.whatif`: a measured run's own costs, its reconciliation with them,
  and other schedules priced with them.
"""

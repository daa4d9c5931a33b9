"""Planning: which configuration to run, and how fast it will be.

* :mod:`.layout`: what a schedule asks of each model stage (placement,
  passes, stash, steps, weight versions), read off a built schedule or
  computed for one not built yet;
* :mod:`.cost`: the analytic cost model (compute, transfers over the links
  they cross, shared links shared, all-reduces over their topology, memory);
* :mod:`.search`: the communication-aware partitioner (fixed stages) and the
  planner's search over splits and per-stage replicas;
* :mod:`.plan`: the planner (search, then the best candidates confirmed by
  the engine), its record (:class:`~.plan.Plan`, ``plan.json``) and
  PipeDream's notation.
"""

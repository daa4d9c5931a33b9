"""AvgPipe (Chen, Xu, Qian, Zhou, PPoPP'23) -- pipesim's INTERPRETATION.

The paper's full text was not available; this module encodes the reading in
docs/concepts/strategies.md, not a verified reproduction:

* ``N_p = width`` pipelines (default 2), each a full replica of the
  partitioned model with its own weights and version counter. Each replica
  is a flush schedule: every pass of iteration t reads that replica's version
  t and the replica's stage k applies ``UPDATE@v(t+1)`` after its last
  backward of the iteration. There is no gradient all-reduce.
* Elastic averaging (EASGD) replaces the all-reduce: after every ``tau``-th
  iteration each replica's stage posts an ``AVERAGE`` (a collective over the
  N_p replicas of the stage, x_r <- x_r - alpha (x_r - centre)) right after
  its UPDATE; that replica's next pass on the stage waits for it. It
  averages the master weights (``StageCost.param_bytes``, fp32 in mixed
  precision), which the replicas' optimizers update, and keeps the centre
  at that width, since averaging the passes' 16-bit copies would round away
  what the master keeps.
* Advance forward propagation (AFP): the 1F1B warm-up is lengthened by
  ``advance`` forwards (0 = plain 1F1B, >= the iteration's micro-batch count
  = GPipe-like all forwards first), so sends overlap compute while
  activation memory stays bounded (stage k holds <= p-k+advance).
* Placement ``"shared"`` (default): replica r's stage k runs on device k, so
  the replicas fill each other's bubbles. On each device the N_p*m
  micro-batches of an iteration form ONE 1F1B/AFP stream in which slot j
  belongs to replica ``j % N_p``, micro-batch ``t*m + j // N_p``; the slot
  sequence is the same on every stage, so the merged stream is deadlock-free.
  ``"disjoint"``: replica r occupies devices ``r*p .. r*p+p-1`` and each runs
  a plain 1F1B/AFP of its own replica.
"""

from __future__ import annotations

from pipesim.sim.ir.core import Action, Schedule, routed
from pipesim.sim.strategies._common import (
    ScheduleSpec,
    Strategy,
    check_spec,
    flush_iteration,
    one_f_one_b,
    ring_steps,
    schedule_of,
)

NAME = "avgpipe"


def shared_order(stage: int, p: int, m: int, n_p: int, advance: int, t: int) -> list[Action]:
    """Iteration t of device ``stage`` hosting every replica's ``stage``: slot
    j of the iteration's n_p*m micro-batches is id t*n_p*m + j, on replica
    j % n_p (the round-robin rule)."""
    first = t * n_p * m
    return [Action(op, stage, first + j, replica=j % n_p) for op, j in one_f_one_b(n_p * m, p - stage - 1 + advance)]


def disjoint_order(stage: int, p: int, m: int, n_p: int, replica: int, advance: int, t: int) -> list[Action]:
    """Iteration t of replica ``replica``'s stage on its own device: its m
    micro-batches of the iteration, in order."""
    ids = routed(t * n_p * m, n_p * m, n_p, replica)
    return [Action(op, stage, ids[i], replica=replica) for op, i in one_f_one_b(m, p - stage - 1 + advance)]


def build(spec: ScheduleSpec) -> Schedule:
    check_spec(spec, uses=STRATEGY.options)
    p, m, n_p = spec.stages, spec.microbatches, spec.width
    if spec.placement == "shared":
        orders = [lambda t, k=k: shared_order(k, p, m, n_p, spec.advance, t) for k in range(p)]
    else:
        orders = [
            lambda t, k=k, r=r: disjoint_order(k, p, m, n_p, r, spec.advance, t) for r in range(n_p) for k in range(p)
        ]
    programs = []
    for order in orders:
        prog: list[Action] = []
        for t in range(spec.iterations):
            prog.extend(flush_iteration(order(t), t, reduce=False, average=(t + 1) % spec.tau == 0))
        programs.append(tuple(prog))
    return schedule_of(
        spec,
        programs,
        num_microbatches=n_p * m,
        replicas=n_p,
        options={
            "pipelines": n_p,
            "alpha": spec.alpha,
            "tau": spec.tau,
            "advance": spec.advance,
            "placement": spec.placement,
            "interpretation": "pipesim's reading of AvgPipe (full text unavailable); see docs/semantics.md",
        },
    )


def ring_transfers(spec: ScheduleSpec) -> int:
    """Averaging every ``tau`` iterations over the replicas' devices: none
    when they share one device per stage."""
    if spec.placement != "disjoint" or not isinstance(spec.tau, int) or spec.tau < 1:
        return 0
    return spec.iterations // spec.tau * spec.stages * ring_steps(spec.width)


STRATEGY = Strategy(
    name=NAME,
    build=build,
    options=("width", "alpha", "tau", "advance", "placement"),
    default_width=2,
    ring_transfers=ring_transfers,
    summary="N_p pipelines with elastic averaging every tau iterations and advance forward propagation",
    planners=("tuner",),
)

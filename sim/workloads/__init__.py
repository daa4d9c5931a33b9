"""What runs: layer profiles, the model catalog and profile files.

Layer 4 of :mod:`pipesim.sim`: it may import the foundations,
:mod:`~pipesim.sim.ir` and :mod:`~pipesim.sim.hardware` (the catalog prices
architectures on a device).

* :mod:`.profile`: :class:`~.profile.LayerCost` and :class:`~.profile.Profile`,
  the per-layer costs a simulation runs on, the widths of the weights'
  copies (:class:`~.profile.Precision`), and their JSON form;
* :mod:`.stages`: a contiguous run of layers as one pipeline stage
  (:class:`~.stages.StageCost`) and activation recomputation;
* :mod:`.catalog`: analytic models (VGG-16, ResNet-50, GNMT, BERT, GPT sizes)
  priced on a device, and the measured ones by name;
* :mod:`.pipedream_graph`: PipeDream's published ``graph.txt`` profiles
  (``profiles/pipedream/``);
* :mod:`.readers`: profile files in and out, either format.
"""

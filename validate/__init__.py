"""Run pipesim schedules on real devices and reconcile them with the simulator.

* :mod:`~pipesim.validate.models`, :mod:`~pipesim.validate.data`: small real
  models (mlp, gpt-small, vgg-small) as flat layer lists, and bundled data;
* :mod:`~pipesim.validate.usermodels`: any model in (``hf:`` transformers
  models built offline, ``torchvision:``, a user's ``module:factory``), split
  into layers whose boundaries may carry several tensors
  (:mod:`~pipesim.validate.boundary`: the stage that passes them);
* :mod:`~pipesim.validate.stage`: :class:`PipelineStage`, one stage of one
  replica with its weight versions, predictions, gradients and optimizer;
* :mod:`~pipesim.validate.executor`: the walker shared by every executor, and
  :func:`emulate`, the single-process reference;
* :mod:`~pipesim.validate.runtime` (with :mod:`~pipesim.validate.launch`): one
  process per device over torch.distributed;
* :mod:`~pipesim.validate.profiler`, :mod:`~pipesim.validate.commprofile`:
  measure the model and the machine for the simulator;
* :mod:`~pipesim.validate.reconcile`, :mod:`~pipesim.validate.harness`:
  compare measured with simulated timelines (``pipesim validate``);
* :mod:`~pipesim.validate.kineto`, :mod:`~pipesim.validate.traceimport`:
  read torch.profiler traces of a pipeline-parallel run into a measured
  timeline (``pipesim trace import``).

Submodules are imported on use; this package itself imports nothing heavy.
"""

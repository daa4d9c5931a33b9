"""Figures and the ``pipesim`` command line (:mod:`pipesim.experiments.cli`)."""

"""pipesim's exceptions: one family, two kinds of failure.

Everything pipesim raises on purpose derives from :class:`PipesimError`, and
falls into one of two kinds that a front end must treat differently:

* :class:`InputError` -- the caller asked for something pipesim cannot do:
  an unknown name, a size out of range, a malformed or deadlocking schedule,
  a missing file, a run this machine cannot host. The message is one line
  that says what is wrong; the ``pipesim`` command prints it and exits 2.
  It is a ``ValueError`` too, so library callers that catch ``ValueError``
  keep working.
* :class:`RunError` -- the input was fine but running it failed: a worker
  raised or died, a launch or a collective timed out. The ``pipesim``
  command exits 1 and prints the failing rank's traceback and what to try.

Any other exception is a bug in pipesim and must surface with its full
traceback, never disguised as bad input. Each layer subclasses these for its
own errors (:class:`~pipesim.sim.ir.core.ScheduleError`,
``pipesim.validate.launch.WorkerError``, ...), so one ``except InputError``
at the top catches all bad input and nothing else.
"""

from __future__ import annotations


class PipesimError(Exception):
    """Base of every exception pipesim raises on purpose."""


class InputError(PipesimError, ValueError):
    """Bad input: an unknown name, a size out of range, a malformed file or schedule."""


class RunError(PipesimError, RuntimeError):
    """A run of valid input failed (a worker raised or died, a timeout).

    ``hint`` is one sentence a user can act on (what to try next).
    """

    hint: str = ""

"""Argument parsing shared by every pipesim command line.

The ``pipesim`` command and the benchmarks (``pipesim bench ...``, also run
as ``python -m pipesim.<layer>.bench``) live in every layer, so the parser
they share lives in the lowest one. It behaves as pipesim's exit codes
promise (:mod:`pipesim.sim.errors`): a bad argument is a :class:`UsageError`,
an :class:`~pipesim.sim.errors.InputError` that the front end prints as one
line with exit code 2, never argparse's usage dump; and every option's help
shows its choices and its default, so ``--help`` answers "what can I pass and
what happens if I don't".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable

from pipesim.sim.errors import InputError, RunError


class UsageError(InputError):
    """Bad command-line input: reported in one line with exit code 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its choices and its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        choices = action.choices
        listed = getattr(action, "listed_choices", None)
        if listed is not None:  # looked up only when help is shown (see list_choices)
            choices = listed()
        if choices is not None and not isinstance(action, argparse._SubParsersAction):
            text += f" (choices: {', '.join(map(str, choices))})"
        default = action.default
        if (
            default is None
            or default is False
            or default is argparse.SUPPRESS
            or "%(default)" in text
            or "default:" in text
        ):
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises :class:`UsageError` instead of exiting."""

    #: What argparse takes for a negative number, a value and not a flag:
    #: its own -1 and -.5, and lists of numbers that start negative
    #: (``--replicas -1,2``), so the option's check names the bad value
    #: instead of argparse saying the option got no argument.
    NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\.?\d[\d.]*(,[-\d.]*)+$")

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = self.NEGATIVE  # argparse's private hook, same since 3.2

    def error(self, message: str):  # one line, exit 2, no usage dump
        raise UsageError(f"{self.prog}: {message}")


def list_choices(action: argparse.Action, names: Callable[[], list[str]]) -> argparse.Action:
    """Show ``names()`` as the choices in ``action``'s help, without enforcing
    them: the library checks the value itself with a better message (and a
    file path may be allowed too), and ``names`` is only called when help is
    printed, so a catalog that imports torch costs nothing otherwise."""
    action.listed_choices = names
    return action


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low``, with a one-line complaint."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


positive, nonnegative = int_at_least(1), int_at_least(0)


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated whole numbers, each >= 1."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def replica_counts(text: str) -> tuple[int, ...]:
    """An argparse type: replicas per stage in PipeDream's notation, ``15,1``
    (or ``15-1``), each a whole number >= 1."""
    try:
        counts = tuple(int(part) for part in text.replace("-", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected replicas per stage like 15,1, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"every stage needs at least one replica, got {text!r}")
    return counts


def seconds(text: str) -> float:
    """An argparse type: a timeout in seconds, finite and in (0, 1e6]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= 1e6:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, 1e6], got {text}")
    return value


def bench_main(
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], object],
    render: Callable[[object], str],
) -> int:
    """The body of every benchmark's command line: parse, run, print.

    ``run(args)`` measures and returns a JSON-able report; ``--json`` prints
    it as JSON, otherwise ``render(report)`` prints it as tables. Progress
    goes to stderr, so the JSON on stdout stays clean.
    """
    parser = Parser(prog=prog, description=description)
    add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    args = parser.parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=1, sort_keys=True) if args.json else render(report))
    return 0


EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def run_command(body: Callable[[], int]) -> int:
    """Run a command's ``body`` under pipesim's exit-code policy; its exit code.

    * bad input (:class:`~pipesim.sim.errors.InputError`): one line on
      stderr, exit 2;
    * a failed run (:class:`~pipesim.sim.errors.RunError`): what failed, the
      failing rank's traceback and a hint, exit 1;
    * Ctrl-C: exit 130 (whatever started workers has stopped them on the
      way out: their launcher cleans up in ``finally``);
    * a reader that went away (``pipesim schedule ... | head``): exit 0;
    * anything else is a bug: it propagates with its full traceback (exit 1).
    """
    try:
        return body()
    except BrokenPipeError:
        # point stdout at nothing so the interpreter's final flush stays quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except InputError as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except RunError as e:
        report_run_error(e)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type if it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def report_run_error(e: RunError) -> None:
    """A failed run on stderr: what failed, the rest of its message (the
    failing rank's traceback), and what to try."""
    print(f"error: {first_line(e)}", file=sys.stderr)
    rest = str(e).strip().split("\n", 1)
    if len(rest) > 1:
        print(rest[1], file=sys.stderr)
    if e.hint:
        print(f"hint: {e.hint}", file=sys.stderr)

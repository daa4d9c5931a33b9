"""MkDocs hook: the command-line reference, generated from pipesim's own parsers.

``docs/reference/cli.md`` holds the marker ``<!-- cli-reference -->``; at
build time it is replaced by every subcommand's usage, description and
options, read off :func:`pipesim.experiments.cli.build_parser`, so the page
cannot drift from the code. ``pipesim bench`` lists its benchmarks from the
same registry the command dispatches on.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os

MARKER = "<!-- cli-reference -->"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    return ", ".join(f"`{flag}`" for flag in action.option_strings)


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """One row per option, its text exactly as ``--help`` prints it (choices and default included)."""
    formatter = parser._get_formatter()
    rows = ["| option | what it does |", "|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        text = formatter._expand_help(action) if action.help is not None else ""
        rows.append(f"| {_flags(action)} | {_cell(text)} |")
    return rows


def _usage(parser: argparse.ArgumentParser) -> str:
    return parser.format_usage().strip().removeprefix("usage: ")


def _bench_help(name: str) -> str:
    """``pipesim bench NAME --help`` as the terminal prints it (each benchmark builds its own parser)."""
    from pipesim.experiments.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(["bench", name, "--help"])
    return out.getvalue().strip()


def _benchmarks(benches: dict) -> list[str]:
    lines = ["| benchmark | what it measures |", "|---|---|"]
    lines += [f"| [`{key}`](#pipesim-bench-{key}) | {_cell(bench.summary)} |" for key, bench in benches.items()]
    lines.append("")
    for key in benches:
        lines += [f"### pipesim bench {key} {{#pipesim-bench-{key}}}", "", f"```text\n{_bench_help(key)}\n```", ""]
    return lines


#: The width help is wrapped to, whatever the builder's terminal: the page is the same on every machine.
COLUMNS = "100"


def reference() -> str:
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS  # argparse wraps usage and help to it
    try:
        return _reference()
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def _reference() -> str:
    from pipesim.experiments.bench import BENCHES
    from pipesim.experiments.cli import build_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    lines = [f"```text\n{_usage(top)}\n```", ""]
    for name, parser in sub.choices.items():
        lines += [f"## pipesim {name}", "", helps.get(name) or "", "", f"```text\n{_usage(parser)}\n```", ""]
        if parser.description:
            lines += [parser.description.strip(), ""]
        lines += _options(parser) + [""]
        if name == "bench":
            lines += _benchmarks(BENCHES)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs' hook signature)
    if MARKER in markdown:
        return markdown.replace(MARKER, reference())
    return markdown

"""MkDocs hook: the command-line reference, generated from pipesim's own parsers.

``docs/reference/cli.md`` holds the marker ``<!-- cli-reference -->``; at
build time it is replaced by every subcommand's usage, description and
options, read off :func:`pipesim.experiments.cli.build_parser`, so the page
cannot drift from the code. ``pipesim bench`` lists its benchmarks from the
same registry the command dispatches on.
"""

from __future__ import annotations

import argparse

MARKER = "<!-- cli-reference -->"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    return ", ".join(f"`{flag}`" for flag in action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._StoreTrueAction):
        return ""
    return f"`{action.default}`"


def _options(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| option | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        help_text = (action.help or "") % {"default": action.default, "prog": parser.prog} if action.help else ""
        if action.choices and not isinstance(action.choices, dict):
            shown = ", ".join(f"`{c}`" for c in action.choices)
            help_text = f"{help_text} (one of {shown})" if help_text else f"one of {shown}"
        rows.append(f"| {_flags(action)} | {_default(action)} | {_cell(help_text)} |")
    return rows


def _usage(parser: argparse.ArgumentParser) -> str:
    return parser.format_usage().strip().removeprefix("usage: ")


def reference() -> str:
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
            lines += ["Benchmarks (`pipesim bench NAME --help` lists each one's options):", "",
                      "| benchmark | what it measures |", "|---|---|"]
            lines += [f"| `{key}` | {_cell(bench.summary)} |" for key, bench in BENCHES.items()]
            lines.append("")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs' hook signature)
    if MARKER in markdown:
        return markdown.replace(MARKER, reference())
    return markdown

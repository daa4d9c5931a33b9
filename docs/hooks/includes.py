"""MkDocs hook: pages that show a file from the repository's root.

``CHANGELOG.md`` and ``CONTRIBUTING.md`` live at the root, where GitHub and a
clone show them; the site shows the same text. A page holding
``<!-- include: NAME -->`` gets the file's content in its place, its links
into ``docs/`` made relative to the site (``docs/how-to/x.md`` becomes
``how-to/x.md``) so that ``mkdocs build --strict`` checks them like any
other link.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = re.compile(r"<!-- include: (?P<name>[\w.-]+) -->")


def _included(match: re.Match) -> str:
    text = (ROOT / match.group("name")).read_text(encoding="utf-8")
    return text.replace("](docs/", "](")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs' hook signature)
    return INCLUDE.sub(_included, markdown)

"""MkDocs hook: lay out pipesim's source the way it is imported, for mkdocstrings.

The four top-level folders (``sim/``, ``kernels/``, ``validate/``,
``experiments/``) install as ``pipesim.sim`` and so on (pyproject's
``package-dir``), a mapping mkdocstrings' loader cannot follow. Before the
build this hook links them under ``build/api-src/pipesim/``, the path
``mkdocs.yml`` gives mkdocstrings, so the API reference reads the working
tree's docstrings, whatever is installed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "build" / "api-src" / "pipesim"


def link_sources() -> None:
    SOURCE.mkdir(parents=True, exist_ok=True)
    for folder in ("sim", "kernels", "validate", "experiments"):
        link = SOURCE / folder
        if link.is_symlink() and Path(os.readlink(link)) == ROOT / folder:
            continue
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.exists():
            shutil.rmtree(link)  # a copy where a link belongs (build/ is the build's own)
        link.symlink_to(ROOT / folder, target_is_directory=True)


# At import, when MkDocs loads its hooks while reading mkdocs.yml: earlier than
# any hook event, and mkdocstrings (a plugin, whose events run before the
# hooks') takes its source paths as they are when its own on_config runs.
link_sources()

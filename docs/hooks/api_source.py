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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "build" / "api-src" / "pipesim"


def link_sources() -> None:
    SOURCE.mkdir(parents=True, exist_ok=True)
    for folder in ("sim", "kernels", "validate", "experiments"):
        link = SOURCE / folder
        if link.is_symlink() or link.exists():
            if link.is_symlink() and Path(os.readlink(link)) == ROOT / folder:
                continue
            link.unlink()
        link.symlink_to(ROOT / folder, target_is_directory=True)


link_sources()

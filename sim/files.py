"""Reading the files users hand pipesim: one way to turn I/O and JSON
failures into a one-line :class:`~pipesim.sim.errors.InputError` that names
the file and the problem (a profile, a hardware description, a schedule CSV
each raise their own subclass)."""

from __future__ import annotations

import json
from typing import Any

from pipesim.sim.errors import InputError


def read_text(path, what: str, error: type[InputError]) -> str:
    """The text of ``path``; ``error`` saying "<what> file <path> not found" or why it cannot be read.
    A leading byte-order mark (Excel and Windows editors write one) is not text."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except FileNotFoundError:
        raise error(f"{what} file {path} not found") from None
    except OSError as e:
        raise error(f"cannot read {what} file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise error(f"{what} file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


class _DuplicateKey(ValueError):
    """A key given twice in one JSON object (json keeps the last silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_json(text: str, source: str, error: type[InputError]) -> Any:
    """``text`` parsed as JSON; ``error`` naming ``source`` and where it is
    malformed, or the key an object gives twice (which one counted would
    otherwise be json's choice: the last)."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise error(f"{source}: the key {e.args[0]!r} appears twice in one object") from None
    except json.JSONDecodeError as e:
        raise error(f"{source}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except ValueError as e:  # an integer literal beyond Python's digit limit
        raise error(f"{source}: unreadable JSON: {e}") from None

"""The bounds every input file's numbers are held to, and how a bad value is shown.

Profiles (pipesim's JSON and PipeDream's graph.txt) and hardware files are
read by different modules but answer to the same limits: durations and byte counts that keep every sum
the engine and the partitioner form finite and exact in float64.
"""

from __future__ import annotations

from typing import Any

#: Largest byte count of one field, and of a profile's total param_bytes or
#: stash_bytes: 2**53 (8 PiB). Whole numbers up to 2**53 are exact in
#: float64, which JSON sizes such as 1.6e7 arrive as and the partitioner sums
#: in; and a device holds a stage's weights, gradients and optimizer state
#: (at most 4x a total each) plus a few versions and buffers, so its memory
#: stays below the memory tracker's int64 limit of 2**63 unless a schedule
#: keeps about a thousand such totals alive at once, which the tracker
#: refuses by name.
MAX_BYTES = 2**53
#: Longest time of one layer pass or per-pass overhead: 1e9 s (32 years).
#: Sums over the 10**12 actions no simulation reaches stay below 1e21 s,
#: finite and far from float64's range.
MAX_SECONDS = 1e9


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def shown(v: Any) -> str:
    """``repr(v)`` for a message; a huge integer by its size (its digits may
    not even be printable: Python refuses str() beyond 4300 digits)."""
    if isinstance(v, int) and v.bit_length() > 64:
        return f"an integer of {v.bit_length()} bits"
    return repr(v)


def seconds_problem(name: str, v: Any) -> str | None:
    """Why ``v`` is not a valid duration (see MAX_SECONDS), or None."""
    if not is_number(v) or not (0 <= v <= MAX_SECONDS):
        return f"{name} must be a finite number >= 0 and <= {MAX_SECONDS:g} (seconds), got {shown(v)}"
    return None


def bytes_problem(name: str, v: Any) -> str | None:
    """Why ``v`` is not a valid byte count (see MAX_BYTES), or None."""
    if not isinstance(v, int) or isinstance(v, bool) or not (0 <= v <= MAX_BYTES):
        return f"{name} must be an integer >= 0 and <= 2**53 (bytes), got {shown(v)}"
    return None

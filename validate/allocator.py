"""Keep freed memory in the process, so tensors allocated again cost no page faults.

On CPU torch takes tensor memory from the C library's ``malloc``. glibc
serves large requests (above 128 KiB to 32 MiB, adapting) with fresh
``mmap`` pages and hands them back at ``free``; it also trims the top of its
heap once 128 KiB or more is free there. A pipeline stage frees a
micro-batch's activations at its backward and allocates the next
micro-batch's at its forward, so with either behaviour every forward writes
to pages the kernel must first fault in and zero. That cost grows with how
much the stage frees and allocates between passes, i.e. with the
micro-batches it holds: gpt-small's last stage (b = 32, one thread) ran its
forward in 11.1 ms with nothing else in flight and 13.6–16.6 ms with 1–24
micro-batches held, taking 2,000–4,700 minor faults per forward; with
freed memory kept it ran in 11.0–11.7 ms at every count, with none.

The profile times passes with one micro-batch in flight, so it never sees
those faults; the runs do, and more the more a schedule holds (GPipe holds
all m). Rather than model the kernel's page-fault path, the processes that
measure and run schedules keep what they free, as PyTorch's caching
allocator does on a GPU: glibc is told never to trim its heap and to map
apart only blocks of :data:`MMAP_THRESHOLD_BYTES` (32 MiB) or more, a
fixed threshold instead of its adapting one. Every smaller block comes
from the heap and goes back to it, and the resident set stays at the run's
peak, which is what a training process reaches anyway.

Blocks of 32 MiB and more (a GPT-2 head's logits, 103 MB at b = 8 and 64
tokens; its 154 MB weight gradient) are mapped fresh and faulted in at
every allocation, in the profile as in the run, whatever the schedule holds:
the profiled pass pays what the run's pass pays. Kept in the heap instead,
they fragment it: smaller blocks are carved out of a freed large one, the
next large block no longer fits and the heap grows. AvgPipe's last-stage
worker on a 4-block GPT-2 grew by 1.1 GB an iteration, to 12.8 GB after 8;
with the threshold it stays at 3.9 GB.

``PIPESIM_KEEP_FREED_MEMORY=0`` leaves malloc as it is (to measure the
difference). Other C libraries are left alone; :func:`keep_freed_memory`
says what it did.
"""

from __future__ import annotations

import ctypes
import os

#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

#: Blocks at least this large are mapped apart and unmapped when freed: 32
#: MiB, the ceiling of glibc's adapting threshold on 64-bit systems
#: (DEFAULT_MMAP_THRESHOLD_MAX), so they are mapped as glibc maps them anyway
#: once it has adapted; every smaller block stays in the heap.
MMAP_THRESHOLD_BYTES = 32 << 20
#: Heap growth asked of the kernel at once (fewer brk calls while a run ramps up).
_TOP_PAD_BYTES = 64 << 20
#: The largest threshold mallopt takes (an int): in effect, never trim.
_NEVER_TRIM = 2**31 - 1

#: What :func:`keep_freed_memory` returns when it took effect.
KEPT = "kept (glibc: blocks under 32 MiB from the heap, never trimmed)"

_state: str | None = None


def keep_freed_memory() -> str:
    """Make this process's malloc keep freed memory; idempotent.

    Returns what holds now, for reports: :data:`KEPT`, or why malloc was
    left alone."""
    global _state
    if _state is None:
        _state = _configure()
    return _state


def is_kept() -> bool:
    """Whether this process's malloc keeps freed memory (blocks under the threshold)."""
    return keep_freed_memory() == KEPT


def _configure() -> str:
    if os.environ.get("PIPESIM_KEEP_FREED_MEMORY", "1") == "0":
        return "system default (PIPESIM_KEEP_FREED_MEMORY=0)"
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return "system default (not glibc)"
    ok = (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
        and mallopt(_M_TOP_PAD, _TOP_PAD_BYTES) == 1
    )
    return KEPT if ok else "system default (mallopt refused)"


def _glibc_mallopt():
    """glibc's ``mallopt``, or None on another C library."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded, the C library's among them
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it
        return None
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt

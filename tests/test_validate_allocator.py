"""Freed memory kept by the processes that measure and run schedules (validate/allocator.py)."""

import os
import subprocess
import sys

import pytest

#: Allocate, touch and free a 64 MiB tensor ten times; print the minor page
#: faults of the last nine (the first one may grow the heap).
_CHILD = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from pipesim.validate.allocator import keep_freed_memory
    print(keep_freed_memory())
else:
    print("-")
torch.ones(1).add_(1)
def cycle():
    t = torch.empty(16 << 20)
    t.fill_(1.0)
    del t
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(9):
    cycle()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, env=None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], check=True, capture_output=True, text=True,
                         env={**os.environ, **(env or {})}).stdout.split("\n")
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and minor-fault counts")
def test_kept_memory_is_not_faulted_in_again():
    state, kept = _faults("keep")
    if not state.startswith("kept"):
        pytest.skip(f"malloc left alone here: {state}")
    _, plain = _faults("plain")
    # a 64 MiB block comes from mmap and goes back at free: 16k fresh pages each time
    assert plain > 9 * 8000, plain
    assert kept < 9 * 100, kept


def test_opt_out_leaves_malloc_alone():
    state, faults = _faults("keep", {"PIPESIM_KEEP_FREED_MEMORY": "0"})
    assert state.startswith("system default")
    if sys.platform.startswith("linux"):
        assert faults > 9 * 8000, faults


@pytest.mark.multiprocess
def test_workers_keep_freed_memory():
    """The launcher's workers keep freed memory, as the profiler's process does."""
    from pipesim.validate.launch import launch

    states = launch(_worker_state, world_size=2, backend="gloo", timeout_s=60)
    from pipesim.validate.allocator import keep_freed_memory

    assert states == [keep_freed_memory()] * 2


def _worker_state(ctx):
    from pipesim.validate.allocator import keep_freed_memory

    return keep_freed_memory()

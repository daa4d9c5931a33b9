"""Freed memory kept by the processes that measure and run schedules (validate/allocator.py)."""

import os
import subprocess
import sys

import pytest

#: A stage's pattern: activations of 2 MiB held by the micro-batch in
#: flight, their count varying (8 to 64) from one round to the next, all freed
#: at the end of each round. Prints the minor page faults of 12 rounds after
#: 4 of warm-up. (One big block allocated and freed in a loop is no test:
#: glibc's adaptive thresholds keep that one.)
_CHILD = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from pipesim.validate.allocator import keep_freed_memory
    print(keep_freed_memory())
else:
    print("-")
torch.ones(1).add_(1)
def round_(k):
    held = [torch.empty(512 << 10) for _ in range(k)]
    for t in held:
        t.fill_(1.0)
    del held
for k in (8, 16, 32, 64):
    round_(k)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(12):
    round_((8, 64, 16, 32)[i % 4])
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, env=None) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    ).stdout.split("\n")
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and minor-fault counts")
def test_kept_memory_is_not_faulted_in_again():
    state, kept = _faults("keep")
    if not state.startswith("kept"):
        pytest.skip(f"malloc left alone here: {state}")
    _, plain = _faults("plain")
    # glibc hands the freed top of its heap back and faults it in again: ~113k pages here
    assert plain > 20_000, plain
    assert kept < 1_000, kept


def test_opt_out_leaves_malloc_alone():
    state, faults = _faults("keep", {"PIPESIM_KEEP_FREED_MEMORY": "0"})
    assert state.startswith("system default")
    if sys.platform.startswith("linux"):
        assert faults > 20_000, faults


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


#: RSS growth, in MiB, left by a block of ``argv[2]`` MiB allocated, touched
#: and freed: kept blocks stay resident, blocks mapped apart go back.
_BLOCK_CHILD = """
import sys, torch
if sys.argv[1] == "keep":
    from pipesim.validate.allocator import keep_freed_memory
    keep_freed_memory()
def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) >> 10
torch.ones(1).add_(1)
before = rss()
block = torch.ones((int(sys.argv[2]) << 20) // 4)
del block
print(rss() - before)
"""


def _left_resident_mib(mode: str, mib: int) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _BLOCK_CHILD, mode, str(mib)], check=True, capture_output=True, text=True
    )
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc")
def test_blocks_under_the_threshold_stay_and_larger_ones_go_back():
    from pipesim.validate.allocator import MMAP_THRESHOLD_BYTES, is_kept

    if not is_kept():
        pytest.skip("malloc left alone here")
    below, above = MMAP_THRESHOLD_BYTES // 2 >> 20, 2 * MMAP_THRESHOLD_BYTES >> 20
    # glibc on its own maps a first large block apart and returns it
    assert _left_resident_mib("plain", below) < below // 4
    # kept: the heap holds it for the next allocation
    assert _left_resident_mib("keep", below) > below * 3 // 4
    # a block of the threshold's size or more is mapped apart even so: kept in
    # the heap, such blocks fragmented it (allocator.py's AvgPipe)
    assert _left_resident_mib("keep", above) < above // 4

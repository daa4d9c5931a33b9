"""The forked writer of big outputs (pipesim.experiments.background)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pipesim.experiments import background
from pipesim.experiments.background import Background, BackgroundWriteError
from pipesim.experiments.cli import main

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _write(path, text: str) -> None:
    path.write_text(text)


def _fail() -> None:
    raise ValueError("the child's own message")


def _reaped(pid: int) -> bool:
    """Whether ``pid`` is gone: no longer a child of ours to wait for."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@pytest.mark.parametrize("fork", [True, False])
def test_file_written_either_way(tmp_path, fork) -> None:
    with Background(_write, tmp_path / "f.txt", "x" * 100_000, fork=fork, what="f.txt") as job:
        pid = job.pid
        assert (pid is not None) == fork
    assert (tmp_path / "f.txt").read_text() == "x" * 100_000
    if fork:
        assert _reaped(pid)


def test_child_failure_raises_with_its_traceback() -> None:
    with pytest.raises(BackgroundWriteError) as err:
        with Background(_fail, fork=True, what="nothing.json") as job:
            pid = job.pid
    text = str(err.value)
    assert "nothing.json" in text and "ValueError: the child's own message" in text and "_fail" in text
    assert _reaped(pid)


def test_child_killed_by_a_signal_is_named() -> None:
    with pytest.raises(BackgroundWriteError, match="killed by signal 9"):
        with Background(time.sleep, 30, fork=True, what="slow.json") as job:
            os.kill(job.pid, signal.SIGKILL)


def test_parent_failure_kills_and_reaps_the_child() -> None:
    start = time.monotonic()
    with pytest.raises(KeyError):  # the parent's own error, not the child's
        with Background(time.sleep, 30, fork=True, what="slow.json") as job:
            pid = job.pid
            raise KeyError("parent")
    assert time.monotonic() - start < 10  # killed, not waited for
    assert _reaped(pid)


def _write_received(path, head: str, receive) -> None:
    path.write_text(head + "".join(receive()))


@pytest.mark.parametrize("fork", [True, False])
def test_deferred_writer_gets_what_is_handed_over_later(tmp_path, fork) -> None:
    """A deferred writer starts before its last input exists and receives it
    (larger than a pipe holds: the handover must not block the parent)."""
    late = ["y" * 1000] * 2000
    with Background(_write_received, tmp_path / "f.txt", "x", fork=fork, what="f.txt", deferred=True) as job:
        assert job.pid is None  # not started by the block
        job.start()
        assert (job.pid is not None) == fork
        start = time.monotonic()
        job.hand_over(late)
        assert time.monotonic() - start < 5
    assert (tmp_path / "f.txt").read_text() == "x" + "y" * 2_000_000


def test_deferred_writer_never_handed_anything_fails_not_hangs(tmp_path) -> None:
    with pytest.raises(BackgroundWriteError, match="before handing its data over"):
        with Background(_write_received, tmp_path / "f.txt", "x", fork=True, what="f.txt", deferred=True) as job:
            job.start()
            pid = job.pid
    assert _reaped(pid) and not (tmp_path / "f.txt").exists()


def test_parent_failure_before_the_handover_kills_the_waiting_child(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(KeyError):
        with Background(_write_received, tmp_path / "f.txt", "x", fork=True, what="f.txt", deferred=True) as job:
            job.start()
            pid = job.pid
            raise KeyError("parent")
    assert time.monotonic() - start < 10 and _reaped(pid)


@pytest.mark.parametrize(
    ("model", "hardware", "tracked_first"), [("uniform", "ideal", False), ("vgg16", "pcie-4gpu", True)]
)
def test_cli_outputs_identical_with_the_trace_forked(
    tmp_path, monkeypatch, capsys, model, hardware, tracked_first
) -> None:
    """`pipesim simulate` with the trace written by a forked child (the
    threshold lowered so that a small run forks) writes byte for byte what it
    writes with everything in one process. With one run (``ideal``: one
    split) the child is forked before the memory is tracked and receives it
    later; where several splits are run and one chosen, after."""
    argv = [
        "simulate",
        "--strategy",
        "1f1b",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--model",
        model,
        "--hardware",
        hardware,
    ]
    monkeypatch.setattr(background, "worth_forking", lambda spans: False)
    assert main([*argv, "--out", str(tmp_path / "inline")]) == 0
    forked, tracked = [], []
    real = Background.start

    def spy(self):
        tracked.append(bool(self.args[0].memory))
        real(self)
        forked.append(self.pid is not None)

    monkeypatch.setattr(background, "worth_forking", lambda spans: True)
    monkeypatch.setattr(Background, "start", spy)
    assert main([*argv, "--out", str(tmp_path / "forked")]) == 0
    capsys.readouterr()
    assert forked == [True] and tracked == [tracked_first]
    names = sorted(p.name for p in (tmp_path / "inline").iterdir())
    assert {"summary.json", "trace.json", "timeline.html"} <= set(names)
    assert names == sorted(p.name for p in (tmp_path / "forked").iterdir())
    for name in ("summary.json", "trace.json", "timeline.html"):
        assert (tmp_path / "forked" / name).read_bytes() == (tmp_path / "inline" / name).read_bytes(), name


def test_bench_outputs_write_what_the_command_writes(tmp_path, monkeypatch, capsys) -> None:
    """`pipesim bench sim`'s in-process writer (trace forked as the spans
    exist, timeline beside it) writes the command's trace and timeline."""
    from pipesim.experiments.bench import _Outputs
    from pipesim.sim.api import simulate
    from pipesim.sim.strategies import ScheduleSpec

    monkeypatch.setattr(background, "worth_forking", lambda spans: True)
    assert (
        main(["simulate", "--strategy", "1f1b", "--stages", "4", "--microbatches", "8", "--out", str(tmp_path / "cli")])
        == 0
    )
    capsys.readouterr()
    with _Outputs(tmp_path / "bench") as writer:
        result = simulate(ScheduleSpec("1f1b", 4, 8), on_spans=writer.start)
        assert writer.trace.job.pid is not None  # forked before the memory was tracked
        writer.finish(result)
    for name in ("trace.json", "timeline.html"):
        assert (tmp_path / "bench" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name


def test_a_run_failing_after_its_spans_leaves_no_child(tmp_path, monkeypatch, capsys) -> None:
    """The trace child is forked as soon as the spans exist; when the
    tracking after it refuses the run (memory int64 cannot count), the
    command exits 2 with one line and the waiting child is killed and
    reaped."""
    from pipesim.sim.workloads.profile import LayerCost, Profile
    from pipesim.sim.workloads.readers import save_profile

    half = LayerCost("l", 1.0, 2.0, 2**40, 0, 2**52, None)
    save_profile(Profile("huge-stash", (half, half)), tmp_path / "huge.json")
    children = []
    real = Background.start

    def spy(self):
        real(self)
        children.append(self.pid)

    monkeypatch.setattr(background, "worth_forking", lambda spans: True)
    monkeypatch.setattr(Background, "start", spy)
    code = main(
        [
            "simulate",
            "--strategy",
            "gpipe",
            "--stages",
            "2",
            "--microbatches",
            "2048",
            "--profile",
            str(tmp_path / "huge.json"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "memory accounting overflows" in err
    assert len(children) == 1 and children[0] is not None and _reaped(children[0])

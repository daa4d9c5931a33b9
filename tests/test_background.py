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


def test_cli_outputs_identical_with_the_trace_forked(tmp_path, monkeypatch, capsys) -> None:
    """`pipesim simulate` with the trace written by a forked child (the
    threshold lowered so that a small run forks) writes byte for byte what it
    writes with everything in one process."""
    argv = ["simulate", "--strategy", "1f1b", "--stages", "4", "--microbatches", "8", "--hardware", "pcie-4gpu"]
    monkeypatch.setattr(background, "worth_forking", lambda spans: False)
    assert main([*argv, "--out", str(tmp_path / "inline")]) == 0
    forked = []
    real = Background.__enter__

    def spy(self):
        out = real(self)
        forked.append(self.pid is not None)
        return out

    monkeypatch.setattr(background, "worth_forking", lambda spans: True)
    monkeypatch.setattr(Background, "__enter__", spy)
    assert main([*argv, "--out", str(tmp_path / "forked")]) == 0
    capsys.readouterr()
    assert forked == [True]
    names = sorted(p.name for p in (tmp_path / "inline").iterdir())
    assert {"summary.json", "trace.json", "timeline.html"} <= set(names)
    assert names == sorted(p.name for p in (tmp_path / "forked").iterdir())
    for name in ("summary.json", "trace.json", "timeline.html"):
        assert (tmp_path / "forked" / name).read_bytes() == (tmp_path / "inline" / name).read_bytes(), name

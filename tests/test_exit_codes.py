"""Exit codes tell the truth, checked through the console script's entry point
(``console_main``, run as ``python -m pipesim.experiments.cli`` by this very
interpreter, so the install under test is the one the tests import).

* bad input: one line on stderr, exit 2;
* a run that fails (a launch timeout, a worker killed): exit 1 with what
  failed and a hint, never mistaken for bad input;
* a bug (any exception that is not pipesim's own, even a ``ValueError``):
  exit 1 with the full traceback;
* Ctrl-C: exit 130, and no worker process is left behind.

The validation runs reuse a hand-written profile and the ``ideal`` hardware
preset, so no profiling happens: only the workers start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipesim.sim.workloads.profile import LayerCost, Profile
from pipesim.sim.workloads.readers import save_profile
from pipesim.validate.models import build_model, layer_param_bytes

#: The console script's entry point (console_main) in this interpreter: the
#: same install the tests import, whatever else is on PATH.
PIPESIM = [sys.executable, "-m", "pipesim.experiments.cli"]


def pipesim(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*PIPESIM, *argv], capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    model = build_model("mlp")  # a hand-written profile of this model: its layers' weights are the model's
    weights = [layer_param_bytes(layer) for layer in model.layers]
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    save_profile(
        Profile(
            "mlp",
            tuple(LayerCost(f"l{i}", 1e-3, 2e-3, w, 4096, 4096) for i, w in enumerate(weights)),
            microbatch_size=8,
        ),
        path,
    )
    return path


def validate_args(profile: Path, out: Path, *extra: str) -> list[str]:
    return [
        "validate",
        "--strategy",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--model",
        "mlp",
        "--microbatch-size",
        "8",
        "--profile",
        str(profile),
        "--hardware",
        "ideal",
        "--out",
        str(out),
        *extra,
    ]


def test_version_and_bad_input_through_the_console_script(tmp_path):
    got = pipesim("--version")
    assert got.returncode == 0 and got.stdout.startswith("pipesim ")
    for argv in (
        ["simulate", "--strategy", "nope"],
        ["simulate", "--strategy", "1f1b", "--profile", "/no/such.json"],
        ["validate", "--strategy", "1f1b", "--model", "no-such-model"],
        ["bench", "nope"],
    ):
        got = pipesim(*argv, "--out", str(tmp_path)) if argv[0] != "bench" else pipesim(*argv)
        assert got.returncode == 2, (argv, got.stderr)
        assert len(got.stderr.strip().splitlines()) == 1 and got.stderr.startswith("error:"), got.stderr


def test_a_bug_is_exit_1_with_its_traceback_never_bad_input(tmp_path):
    """A ValueError that pipesim did not raise on purpose (here: from inside
    the metrics) is a bug: it must not be reported as one line of bad input."""
    code = (
        "import sys, pipesim.sim.engine.metrics as m\n"
        "def broken(*a, **k):\n"
        "    raise ValueError('internal inconsistency')\n"
        "m.summarize = broken\n"
        "from pipesim.experiments.cli import console_main\n"
        f"sys.argv = ['pipesim', 'simulate', '--strategy', '1f1b', '--out', {str(tmp_path)!r}]\n"
        "console_main()\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 1
    assert "Traceback (most recent call last)" in got.stderr and "internal inconsistency" in got.stderr
    assert not got.stderr.startswith("error:")


@pytest.mark.multiprocess
def test_a_launch_timeout_is_a_failed_run(tmp_path, profile):
    got = pipesim(*validate_args(profile, tmp_path, "--timeout", "0.5", "--iterations", "50"))
    assert got.returncode == 1, got.stderr
    assert "error: launch timed out after 0.5 s" in got.stderr
    assert "hint: give the run more than 0.5 s" in got.stderr


def _workers(pid: int) -> list[int]:
    """Worker processes (spawned by multiprocessing) among ``pid``'s children."""
    out = []
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for child in map(int, children):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
        except OSError:
            pass
    return out


def _wait_for_workers(proc: subprocess.Popen, n: int, seconds: float = 60.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = _workers(proc.pid)
        if len(found) >= n:
            return found
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    pytest.fail(f"no {n} workers appeared")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie has stopped; only its exit status is left


def _assert_gone(pids: list[int], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(map(_gone, pids)):
        time.sleep(0.05)
    assert all(map(_gone, pids)), [p for p in pids if not _gone(p)]


def _start(argv: list[str]) -> subprocess.Popen:
    """The console script in a session of its own (a process group to signal)."""
    return subprocess.Popen(
        [*PIPESIM, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _finish(proc: subprocess.Popen) -> str:
    """Wait for ``proc``; if it hangs, kill its whole group and fail."""
    try:
        return proc.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("pipesim hung")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds workers through /proc")
@pytest.mark.multiprocess
def test_a_killed_worker_and_ctrl_c(tmp_path, profile):
    # a worker killed from outside, as soon as it exists (during start-up):
    # exit 1 naming the rank and the signal, within the run's own timeout
    proc = _start(validate_args(profile, tmp_path / "kill", "--iterations", "400", "--timeout", "50"))
    workers = _wait_for_workers(proc, 2)
    os.kill(workers[-1], signal.SIGKILL)
    err = _finish(proc)
    assert proc.returncode == 1, err
    assert "killed by signal SIGKILL" in err and "hint:" in err
    _assert_gone(workers)

    # Ctrl-C in a terminal interrupts the whole foreground process group
    proc = _start(validate_args(profile, tmp_path / "int", "--iterations", "400"))
    workers = _wait_for_workers(proc, 2)
    os.killpg(proc.pid, signal.SIGINT)
    err = _finish(proc)
    assert proc.returncode == 130, err
    assert err.rstrip().endswith("interrupted")
    _assert_gone(workers)

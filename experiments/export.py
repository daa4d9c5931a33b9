"""Static image export of plotly figures, when the machine can do it.

PNG export needs kaleido (a dependency of pipesim) and a Chrome/Chromium that
kaleido can drive, which comes from the system, so :func:`write_png` checks
for both and returns ``False`` instead of raising when either is missing. It never
downloads a browser (kaleido's ``get_chrome`` is not called).

The export runs in a child Python process, so a browser that hangs or
crashes (sandboxing in containers, missing libraries) costs at most
``timeout`` seconds (once: after a child that hung or died without an
answer, no further figure is tried) and never takes the caller down. Starting a
headless browser costs about two seconds, rendering a figure in a running one
a tenth of that, so the child is started once per process and keeps its
browser (kaleido's sync server) for every figure the command writes: a
``pipesim compare`` of ten strategies writes eleven PNGs for one start. It
reads one job per line on its stdin and answers ``ok`` or ``error`` per job;
it ends with its stdin, at the caller's exit or death, and a child that
overruns a job's time limit is killed with every process below it (the
browser driver starts the browser in sessions of its own, so they are found
through ``/proc``). Its answers go to a private copy of its stdout, so nothing
else it prints can be mistaken for one.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Executable names looked up on PATH, in order.
BROWSER_NAMES = (
    "chromium",
    "chromium-browser",
    "google-chrome",
    "google-chrome-stable",
    "chrome",
)

_CHILD = r"""
import json
import os
import sys
import warnings

# answers go to a private copy of stdout; whatever kaleido, its browser driver
# or anything else prints goes to stderr, so it cannot split an answer
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

import kaleido
import plotly.io as pio

warnings.simplefilter("ignore")  # kaleido warns that a running server ignores per-call options
kaleido.start_sync_server(silence_warnings=True)
for line in sys.stdin:
    job = json.loads(line)
    try:
        fig = pio.from_json(open(job["spec"], encoding="utf-8").read(), skip_invalid=True)
        fig.write_image(job["out"], format="png", width=job["width"], height=job["height"], scale=job["scale"])
        print("done", job["id"], "ok", file=answers, flush=True)
    except Exception as e:  # one figure failing is that figure's "False", not the next one's
        print("done", job["id"], "error", type(e).__name__, file=answers, flush=True)
kaleido.stop_sync_server(silence_warnings=True)
"""


def kaleido_available() -> bool:
    """kaleido can be imported (without importing it here)."""
    try:
        return importlib.util.find_spec("kaleido") is not None
    except (ImportError, ValueError):
        return False


def find_browser() -> str | None:
    """Path of a Chrome/Chromium kaleido could drive, or ``None``.

    Looks at ``BROWSER_PATH`` (choreographer's override), the usual names on
    PATH, then kaleido's own detection (choreographer's ``find_browser``,
    which includes a browser kaleido downloaded earlier) without downloading.
    """
    env = os.environ.get("BROWSER_PATH")
    if env and os.path.isfile(env) and os.access(env, os.X_OK):
        return env
    for name in BROWSER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    if not kaleido_available():
        return None
    try:
        from choreographer.browsers.chromium import Chromium  # kaleido >= 1.0's driver
    except Exception:  # noqa: BLE001 - any import problem means "not found"
        return None
    finder = getattr(Chromium, "find_browser", None)
    if finder is None:
        return None
    for call in (lambda: finder(skip_local=False), lambda: finder()):
        try:
            found = call()
        except TypeError:
            continue
        except Exception:  # noqa: BLE001 - best effort detection
            return None
        return str(found) if found else None
    return None


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: read from /proc; elsewhere none).

    The browser driver starts the browser in sessions of its own, so killing
    the export child's process group does not reach it; its pids are collected
    while the child is still their ancestor."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_group(proc: subprocess.Popen, tree: list[int] | None = None) -> None:
    """End the export child, its session and ``tree`` (its descendants, see :func:`_descendants`)."""
    for target in (proc.pid, *(tree or ())):
        for kill in (os.killpg, os.kill) if hasattr(os, "killpg") else (os.kill,):
            try:
                kill(target, 9)
            except (ProcessLookupError, PermissionError, OSError):
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


def png_supported() -> bool:
    """kaleido is importable, a browser for it is present, and PNGs are not
    switched off with ``PIPESIM_PNG=0`` (the test suite does, for speed)."""
    if os.environ.get("PIPESIM_PNG", "1") == "0":
        return False
    return kaleido_available() and find_browser() is not None


def png_skipped_reason() -> str:
    """Why :func:`png_supported` is false, in a few words, for a "skipped" line."""
    if os.environ.get("PIPESIM_PNG", "1") == "0":
        return "PIPESIM_PNG=0"
    if not kaleido_available():
        return "needs kaleido"
    return "needs Chrome/Chromium for kaleido" if find_browser() is None else "the export failed or timed out"


class _Renderer:
    """The export child of this process (see the module doc), started on first use."""

    proc: subprocess.Popen | None = None
    owner: int | None = None  # the pid that started it: a forked child starts its own
    jobs = 0  # jobs sent, so each answer names the job it answers
    pending = b""  # what the child wrote that is not yet a whole line
    failed: int | None = None  # the pid whose child timed out or died unanswered: no PNGs there

    @classmethod
    def running(cls) -> subprocess.Popen | None:
        if cls.failed == os.getpid():  # one that hung or died unanswered is not tried again
            return None
        if cls.proc is not None and cls.owner == os.getpid() and cls.proc.poll() is None:
            return cls.proc
        if cls.owner == os.getpid():
            cls.close()
        try:
            # Own session, so a hung browser it started can be ended with it.
            cls.proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            cls.proc = None
            return None
        cls.owner, cls.pending = os.getpid(), b""
        return cls.proc

    @classmethod
    def render(cls, job: dict, timeout: float) -> bool:
        """Send ``job`` and wait for its answer (``done ID ok``; anything else the
        child or its libraries print is passed over); a child that overruns
        ``timeout`` or dies is ended."""
        proc = cls.running()
        if proc is None:
            return False
        cls.jobs += 1
        job = {**job, "id": cls.jobs}
        try:
            proc.stdin.write(json.dumps(job).encode() + b"\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            cls.close(wait=0)
            return False
        deadline = time.monotonic() + timeout
        answer = f"done {job['id']} ".encode()
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                *lines, cls.pending = cls.pending.split(b"\n")
                for line in lines:
                    if line.startswith(answer):
                        return line[len(answer) :].split()[:1] == [b"ok"]
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    break  # timed out
                chunk = os.read(fd, 65536)  # unbuffered: select sees everything not yet read
                if not chunk:
                    break  # died
                cls.pending += chunk
        cls.close(wait=0)  # nothing it says later can be trusted
        cls.failed = os.getpid()
        return False

    @classmethod
    def close(cls, wait: float = 10.0) -> None:
        """End the child: it finishes with its stdin; one that does not within
        ``wait`` seconds is killed with everything it started."""
        proc, cls.proc = cls.proc, None
        if proc is None or cls.owner != os.getpid():
            return
        tree = _descendants(proc.pid)  # before they outlive their parent and are lost to init
        try:
            proc.stdin.close()
            proc.wait(timeout=wait)
        except (OSError, subprocess.TimeoutExpired):
            pass
        _kill_group(proc, tree)  # whatever has not ended by now


atexit.register(_Renderer.close)


def close_renderer() -> None:
    """End this process's export child now (the next PNG starts a new one,
    even after one that failed)."""
    _Renderer.close()
    _Renderer.failed = None


def write_png(
    fig, path: str | Path, *, width: int = 1400, height: int | None = None, scale: float = 2.0, timeout: float = 180.0
) -> bool:
    """Write ``fig`` as a PNG at ``path``; ``True`` on success.

    Returns ``False`` (and writes nothing) when kaleido or a browser is
    missing, or when the export fails or exceeds ``timeout`` seconds.
    ``height`` defaults to the figure's own layout height (or 600).
    """
    if not png_supported():
        return False
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if height is None:
        height = int(getattr(fig.layout, "height", None) or 600)
    with tempfile.TemporaryDirectory(prefix="pipesim-png-") as tmp:
        spec = Path(tmp) / "fig.json"
        out = Path(tmp) / "fig.png"
        spec.write_text(fig.to_json(), encoding="utf-8")
        job = {"spec": str(spec), "out": str(out), "width": int(width), "height": int(height), "scale": scale}
        if not _Renderer.render(job, timeout) or not out.is_file() or out.stat().st_size == 0:
            return False
        shutil.copyfile(out, path)
    return True

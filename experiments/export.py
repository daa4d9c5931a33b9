"""Static image export of plotly figures, when the machine can do it.

PNG export needs kaleido and a Chrome/Chromium that kaleido can drive. Neither
is a hard dependency of pipesim (``pip install pipesim[png]`` adds kaleido;
the browser comes from the system), so :func:`write_png` checks for both and
returns ``False`` instead of raising when either is missing. It never
downloads a browser (kaleido's ``get_chrome`` is not called).

The export runs in a child Python process with a time limit, so a browser
that hangs or crashes (sandboxing in containers, missing libraries) costs at
most ``timeout`` seconds and never takes the caller down.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
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
import sys
import plotly.io as pio
fig = pio.from_json(open(sys.argv[1], encoding="utf-8").read(), skip_invalid=True)
fig.write_image(sys.argv[2], format="png", width=int(sys.argv[3]), height=int(sys.argv[4]), scale=float(sys.argv[5]))
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


def _kill_group(proc: subprocess.Popen) -> None:
    """End the export child and whatever it started (its own session)."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, 9)
        else:  # pragma: no cover - Windows
            proc.kill()
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
        cmd = [sys.executable, "-c", _CHILD, str(spec), str(out), str(int(width)), str(int(height)), str(scale)]
        try:
            # Own session, so a hung browser it started can be ended with it.
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            return False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return False
        if rc != 0 or not out.is_file() or out.stat().st_size == 0:
            return False
        shutil.copyfile(out, path)
    return True

"""Choice between the foreach path, the fused C loops on CPU and the fused Triton path.

``auto`` (the default) takes Triton for CUDA tensors when ``triton`` imports,
the native C loops (:mod:`pipesim.kernels.native`) for CPU tensors when they
compile and load, and the foreach path otherwise, so CPU-only installs never
import Triton. The choice depends only on the machine (compiler, Triton
install), so every process on one machine makes the same one: the emulator
and a multi-process runtime compute the same bits. The switch exists to
compare the paths (the benchmark does), to pin the reference path when
debugging numerics, and to run the Triton kernels on CPU under Triton's
interpreter (``TRITON_INTERPRET=1``) in CI without a GPU.

The process-wide default can be set with :func:`set_backend`, the
:func:`use_backend` context manager or the ``PIPESIM_KERNELS_BACKEND``
environment variable; every kernel also takes ``backend=`` per call.
"""

from __future__ import annotations

import contextlib
import os

import torch

from pipesim.kernels.native import native_available, native_unavailable_reason

BACKENDS = ("auto", "foreach", "native", "triton")

_backend = os.environ.get("PIPESIM_KERNELS_BACKEND", "auto")
if _backend not in BACKENDS:  # a typo in the environment must not silently mean "auto"
    raise ValueError(f"PIPESIM_KERNELS_BACKEND={_backend!r}; expected one of {BACKENDS}")

_triton_ok: bool | None = None


def triton_available() -> bool:
    """True when ``import triton`` works; tried once, failures of any kind mean no."""
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton
            import triton.language  # noqa: F401

            _triton_ok = True
        except Exception:  # ImportError, or a broken install raising anything else
            _triton_ok = False
    return _triton_ok


def triton_interpreting() -> bool:
    """Triton's CPU interpreter is on: Triton kernels may then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def set_backend(name: str) -> None:
    """Set the process-wide default: ``"auto"``, ``"foreach"``, ``"native"`` or ``"triton"``."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


@contextlib.contextmanager
def use_backend(name: str):
    """Temporarily change the default backend (tests, benchmarks)."""
    old = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def resolve(backend: str | None, device: torch.device) -> str:
    """Map a requested backend and a device to the path that will run."""
    name = _backend if backend is None else backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    triton_device = device.type == "cuda" or triton_interpreting()
    if name == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "foreach"
        return "native" if device.type == "cpu" and native_available() else "foreach"
    if name == "native":
        if device.type != "cpu":
            raise RuntimeError(f"backend='native' needs CPU tensors (got {device})")
        if not native_available():
            raise RuntimeError(
                f"backend='native' requested but the C kernels are unavailable: {native_unavailable_reason()}"
            )
    if name == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' requested but triton is not importable")
        if not triton_device:
            raise RuntimeError(f"backend='triton' needs CUDA tensors (got {device}) or TRITON_INTERPRET=1")
    return name

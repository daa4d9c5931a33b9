"""Fused CPU loops in C (``native.c``), compiled on first use and loaded with ctypes.

Why: on CPU the foreach path pays a parallel region per torch op and, for
16-bit weights, extra passes converting tiles to float32 scratch and back;
Adam, bf16 and the double buffer stay at 35–70% of copy bandwidth. One loop
that reads each operand once, computes in float in L1-sized blocks and
writes each result once is memory-bound like a copy. Alternatives rejected:
``torch.utils.cpp_extension`` compiles against torch's headers (~1 minute
per build), and ``torch.compile`` takes 10+ s per kernel signature and
recompiles for every new list shape. The C file needs no torch header, so
the system compiler (``$CC``, else ``cc``) builds it in about a second, and
nothing new is installed.

Compile cache: the shared object goes to ``$PIPESIM_KERNELS_CACHE`` (default
``$XDG_CACHE_HOME/pipesim``, else ``~/.cache/pipesim``) under a name hashed
from the C source, the compiler's ``--version``, the flags and the CPU's
feature flags: ``-march=native`` code from a newer CPU would crash an older
one sharing the home directory. Each build goes to a temporary file that is
renamed into place, so processes compiling at once all load a whole file.

If no compiler works, :func:`native_available` is False and
:func:`native_unavailable_reason` says why; ``auto`` then uses foreach.

Threads: ``torch.get_num_threads()`` POSIX threads split the concatenated
element range by offsets (not OpenMP: a second OpenMP runtime beside
torch's spins and oversubscribes the cores); totals below
:data:`PARALLEL_MIN_NUMEL` run on the calling thread. The kernels are
elementwise, so any split gives the same bits.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("native.c")
FLAGS = (
    "-O3",
    "-march=native",
    "-fPIC",
    "-shared",
    "-pthread",
    # no implicit FMA (native.c uses fmaf where it wants one); sqrtf
    # without errno handling so it vectorises (results are the same)
    "-ffp-contract=off",
    "-fno-math-errno",
    # block copies stay vector loops, not memcpy calls: with memcpy per
    # 2 KiB block (and float32 copied in too) the kernel ran 2.6x slower
    # here (AMD EPYC)
    "-fno-tree-loop-distribute-patterns",
)

#: Totals (elements) below this run on the calling thread: starting threads
#: costs more than it saves.
PARALLEL_MIN_NUMEL = 1 << 18


def _last_level_cache_bytes() -> int:
    """Size of the largest CPU cache the OS reports (32 MiB when it does not say)."""
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if size > 0:
            return int(size)
    return 32 << 20


#: Calls whose operands span more bytes than this write fresh outputs with
#: non-temporal stores: the data cannot stay in cache anyway, and skipping
#: the read-for-ownership of each output line saves a quarter of the traffic
#: of an out-of-place kernel (the plain copy it is measured against does the
#: same). Smaller calls keep their outputs in cache for whoever reads next.
STREAM_MIN_BYTES = _last_level_cache_bytes()

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_AXPY, _ADAM, _ELASTIC = 0, 1, 2


class _Job(ctypes.Structure):
    _fields_ = [
        ("ntensors", ctypes.c_int64),
        ("numel", ctypes.c_void_p),
        ("start", ctypes.c_void_p),
        ("ptr", ctypes.c_void_p),
        ("dtype", ctypes.c_void_p),
        ("nlists", ctypes.c_int32),
        ("kernel", ctypes.c_int32),
        ("s0", ctypes.c_float),
        ("s1", ctypes.c_float),
        ("stream", ctypes.c_int32),
    ]


class NativeUnavailable(RuntimeError):
    """The C kernels could not be compiled or loaded here."""


# ------------------------------------------------------------------ build and load


def cache_dir() -> Path:
    env = os.environ.get("PIPESIM_KERNELS_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pipesim"


def _compiler() -> list[str]:
    """``$CC`` split like a shell would (it may be ``ccache gcc``), else ``cc``."""
    return shlex.split(os.environ.get("CC") or "cc")


def _cpu_flags() -> str:
    """The CPU's feature list (x86 ``flags``, Arm ``Features``), what -march=native depends on."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler_version(cc: list[str]) -> str:
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"C compiler {shlex.join(cc)!r} does not run: {e}") from None
    if out.returncode:
        raise NativeUnavailable(f"{shlex.join(cc)} --version failed (exit {out.returncode})")
    return out.stdout


def build_key(source: bytes, compiler_version: str, cpu_flags: str) -> str:
    """Cache key of one build: anything that changes the machine code changes it."""
    h = hashlib.sha256()
    for part in (
        source,
        compiler_version.encode(),
        cpu_flags.encode(),
        " ".join(FLAGS).encode(),
        platform.machine().encode(),
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:24]


def _compile(cc: list[str], dest: Path) -> None:
    """Build into a temporary file next to ``dest``, then rename: concurrent builders are safe."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        out = subprocess.run([*cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300)
        if out.returncode:
            last = (out.stderr.strip().splitlines() or ["no message"])[-1]
            raise NativeUnavailable(f"compiling {SOURCE.name} failed: {last}")
        os.replace(tmp, dest)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"compiling {SOURCE.name} failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path() -> Path:
    """Where this machine's build lives in the cache (compiled or not)."""
    cc = _compiler()
    key = build_key(SOURCE.read_bytes(), _compiler_version(cc), _cpu_flags())
    return cache_dir() / f"native-{key}.so"


def _load() -> ctypes.CDLL:
    path = library_path()
    if not path.exists():
        _compile(_compiler(), path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(f"loading {path} failed: {e}") from None
    lib.pipesim_run.argtypes = [ctypes.POINTER(_Job), ctypes.c_int64, ctypes.c_int32]
    lib.pipesim_run.restype = ctypes.c_int
    return lib


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None


def _library() -> ctypes.CDLL:
    """The loaded library, built on the first call; raises NativeUnavailable."""
    global _lib, _reason
    with _lock:
        if _lib is None and _reason is None:
            try:
                _lib = _load()
            except NativeUnavailable as e:
                _reason = str(e).splitlines()[0]
    if _lib is None:
        raise NativeUnavailable(_reason)
    return _lib


def native_available() -> bool:
    """True when the C kernels compile and load on this machine (tried once per process)."""
    try:
        _library()
    except NativeUnavailable:
        return False
    return True


def native_unavailable_reason() -> str | None:
    """One line on why the C kernels are unavailable; None when they are available."""
    return None if native_available() else _reason


# ------------------------------------------------------------------ kernels


def supports(lists: list[list[Tensor]]) -> bool:
    """CPU, contiguous, float32/bfloat16/float16 operands (state may be float32 beside 16-bit)."""
    return all(t.device.type == "cpu" and t.dtype in _DTYPE_CODE and t.is_contiguous() for lst in lists for t in lst)


def _threads(total: int) -> int:
    return 1 if total < PARALLEL_MIN_NUMEL else max(1, torch.get_num_threads())


def launch(kernel: int, lists: list[list[Tensor]], s0: float, s1: float = 0.0, threads: int | None = None) -> None:
    """Run one kernel over aligned lists (``threads`` overrides the thread count)."""
    first = lists[0]
    numels = [t.numel() for t in first]
    total = sum(numels)
    if total == 0:
        return
    n = len(first)
    starts, acc = [], 0
    for k in numels:
        starts.append(acc)
        acc += k
    numel_arr = (ctypes.c_int64 * n)(*numels)
    start_arr = (ctypes.c_int64 * n)(*starts)
    ptr_arr = (ctypes.c_void_p * (n * len(lists)))(*[t.data_ptr() for lst in lists for t in lst])
    dtype_arr = (ctypes.c_int32 * len(lists))(*[_DTYPE_CODE[lst[0].dtype] for lst in lists])
    nbytes = total * sum(lst[0].element_size() for lst in lists)
    job = _Job(
        n,
        ctypes.addressof(numel_arr),
        ctypes.addressof(start_arr),
        ctypes.addressof(ptr_arr),
        ctypes.addressof(dtype_arr),
        len(lists),
        kernel,
        s0,
        s1,
        nbytes >= STREAM_MIN_BYTES,
    )
    nthreads = _threads(total) if threads is None else threads
    if _library().pipesim_run(ctypes.byref(job), total, nthreads) != 0:
        raise RuntimeError(f"native kernel {kernel} refused its arguments")


def axpy(out: list[Tensor], x: list[Tensor], y: list[Tensor], alpha: float) -> None:
    """out = x + alpha * y, computed as fmaf in float and rounded once. ``out`` may be ``x``."""
    launch(_AXPY, [out, x, y], alpha)


def adam_apply(out: list[Tensor], w: list[Tensor], m: list[Tensor], v: list[Tensor], c: float, eps: float) -> None:
    """out = w - c * m / (sqrt(v) + eps), in float, rounded once. ``out`` may be ``w``."""
    launch(_ADAM, [out, w, m, v], c, eps)


def elastic(replicas: list[list[Tensor]], center: list[Tensor], alpha: float) -> None:
    """EASGD step in place; every d_r = x_r - c uses the values from before the call."""
    launch(_ELASTIC, [center, *replicas], alpha)

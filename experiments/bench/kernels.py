"""Kernel benchmark: ``pipesim bench kernels`` (or ``python -m pipesim.experiments.bench.kernels``).

For a model-sized parameter list (about 100 tensors shaped like a
transformer's; 10M parameters on CPU, 100M on GPU) each kernel is timed
against two yardsticks measured in the same run:

* a plain ``dst.copy_(src)`` of a flat buffer moving the same number of bytes
  (the memory-bandwidth limit): ``gbps`` is :func:`bytes_moved` divided by the
  kernel's time, ``copy_gbps`` the copy's bytes divided by its time;
* the per-tensor Python loop a user would write (plain torch ops per tensor,
  allocating results): ``loop_speedup`` = loop time / kernel time.

Kernel and copy runs alternate and the best of ``--repeat`` runs is kept, so
slow drift and interference on a shared machine hit both alike. The foreach
path is measured everywhere, beside the fused path of the device (Triton on
CUDA, the native C loops on CPU) where it is available; fused rows report
``foreach_speedup``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from pipesim.experiments.cliargs import UsageError, bench_main, positive, run_command
from pipesim.kernels import (
    DoubleBuffer,
    WeightStash,
    bytes_moved,
    elastic_average,
    predict_adam,
    predict_sgd,
    predict_sgd_,
    triton_available,
)
from pipesim.kernels._checks import DEFAULT_LAUNCH, check_launch_shape
from pipesim.kernels.native import native_available
from pipesim.kernels.prediction import empty_like_all

TARGET_PCT_COPY = 80.0
TARGET_LOOP_CPU = 3.0
TARGET_TRITON = 1.2
# Kernels with a fused Triton and native implementation; the stash snapshot is a plain copy everywhere.
FUSED_KERNELS = ("predict_sgd", "predict_adam", "elastic_average", "double_buffer", "predict_sgd_")
#: Every kernel the benchmark times (the names of :func:`_cases`).
KERNELS = ("predict_sgd", "predict_adam", "elastic_average", "weight_stash", "double_buffer", "predict_sgd_")
#: Weight dtypes it times them in.
DTYPES = ("float32", "bfloat16", "float16")


def model_shapes(numel: int, n_tensors: int = 100) -> list[tuple[int, ...]]:
    """~``n_tensors`` transformer-like shapes summing to about ``numel``.

    Per layer: qkv, output, two MLP matrices, their biases and two norms
    (12 tensors); an embedding table takes up the remainder.
    """
    layers = max(1, (n_tensors - 3) // 12)
    d = max(8, int(math.sqrt(numel / (13 * layers))) // 8 * 8)
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    used = sum(math.prod(s) for s in shapes) + 2 * d
    shapes += [(max(1, (numel - used) // d), d), (d,), (d,)]
    return shapes


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_all(fns, device, repeat: int) -> list[float]:
    """Best-of-``repeat`` seconds of each function, runs interleaved."""
    inner = 10 if device.type == "cuda" else 1
    start = time.perf_counter()
    rounds = 0
    while rounds < 2 or (rounds < 20 and time.perf_counter() - start < 0.5):  # warm caches, pages
        for f in fns:
            f()
        rounds += 1
    best = [math.inf] * len(fns)
    for _ in range(repeat):
        for k, f in enumerate(fns):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            _sync(device)
            best[k] = min(best[k], (time.perf_counter() - t0) / inner)
    return best


def _cases(params, sdt, lr=0.01, s=3.0, alpha=0.1):
    """(kernel name, state dtype for costing, setup) triples; setup -> (kernel_fn, loop_fn)."""
    dev = params[0].device
    wdt = params[0].dtype

    def rand_like(dtype, positive=False):
        out = [torch.randn(p.shape, device=dev, dtype=torch.float32) for p in params]
        if positive:
            out = [t.abs_() for t in out]
        return [t.to(dtype) for t in out]

    def sgd(backend):
        v = rand_like(sdt)
        out = empty_like_all(params)

        def kern():
            return predict_sgd(params, v, lr, s, out=out, backend=backend)

        def loop():
            return [(w - s * lr * b).to(wdt) for w, b in zip(params, v)]

        return kern, loop

    def adam(backend):
        m, v = rand_like(sdt), rand_like(sdt, positive=True)
        out = empty_like_all(params)
        step, betas, eps = 10, (0.9, 0.999), 1e-8

        def kern():
            return predict_adam(params, m, v, step, lr, betas, eps, s, out=out, backend=backend)

        bc1, bc2 = 1 - betas[0] ** step, 1 - betas[1] ** step

        def loop():
            return [(w - s * lr * (a / bc1) / ((b / bc2).sqrt() + eps)).to(wdt) for w, a, b in zip(params, m, v)]

        return kern, loop

    def easgd(backend):
        reps = [[p.clone() for p in params] for _ in range(2)]
        center = [p.to(sdt) for p in params]

        def kern():
            return elastic_average(reps, center, alpha, backend=backend)

        def loop():
            for i, c in enumerate(center):
                d = [alpha * (rep[i] - c) for rep in reps]
                for rep, di in zip(reps, d):
                    rep[i].sub_(di)
                c.add_(sum(d))

        return kern, loop

    def stash(backend):
        st = WeightStash(params, capacity=2)

        def kern():  # a version with a reader in flight is snapshotted, then freed
            v = st.acquire()
            st.advance()
            st.release(v)

        def loop():
            return [p.detach().clone() for p in params]

        return kern, loop

    def double(backend):
        db = DoubleBuffer([p.clone() for p in params])
        g = rand_like(wdt)

        def kern():
            return db.update_sgd(g, lr, backend=backend)

        def loop():
            return [w - lr * gi for w, gi in zip(db.current, g)]

        return kern, loop

    def sgd_inplace(backend):
        v = rand_like(sdt)
        w = [p.clone() for p in params]
        backup = torch.empty(sum(p.numel() for p in params), dtype=wdt, device=dev)

        def kern():
            predict_sgd_(w, v, lr, s, backup=backup, backend=backend).restore()

        def loop():
            saved = [p.clone() for p in w]
            for p, b in zip(w, v):
                p.sub_((s * lr * b).to(wdt))
            for p, o in zip(w, saved):
                p.copy_(o)

        return kern, loop

    return [
        ("predict_sgd", sdt, sgd),
        ("predict_adam", sdt, adam),
        ("elastic_average", sdt, easgd),
        ("weight_stash", wdt, stash),
        ("double_buffer", wdt, double),
        ("predict_sgd_", sdt, sgd_inplace),
    ]


def _warm_up(dev, numel: int, seconds: float) -> None:
    """Touch memory and spin up threads before measuring: on a fresh process (and
    more so in a VM, where the host backs guest memory lazily) the first seconds
    run several times slower, which would land on whichever row comes first."""
    if seconds <= 0:
        return
    a = torch.randn(4 * numel, device=dev)
    b = torch.empty_like(a)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        b.copy_(a)
        torch.add(a, b, alpha=0.5, out=b)
    _sync(dev)


def run(
    device: str = "cpu",
    numel: int | None = None,
    n_tensors: int = 100,
    dtypes=("float32", "bfloat16"),
    repeat: int = 15,
    kernels=None,
    warmup_s: float = 2.0,
    launches=None,
) -> list[dict]:
    """Rows of every kernel, dtype and backend; ``launches``, a sequence of
    (block, warps), times the Triton path at each of those launch shapes
    instead of its default."""
    dev = torch.device(device)
    if numel is None:
        numel = 10_000_000 if dev.type == "cpu" else 100_000_000
    backends = ["foreach"]
    if dev.type == "cuda" and triton_available():
        backends.append("triton")
    if dev.type == "cpu" and native_available():
        backends.append("native")
    if launches and "triton" not in backends:
        raise UsageError("--triton-launch needs a CUDA device and Triton")
    torch.manual_seed(0)
    rows = []
    _warm_up(dev, numel, warmup_s)
    for dt_name in dtypes:
        wdt = getattr(torch, dt_name)
        sdt = torch.float32  # "bf16 weights with fp32 state"
        params = [torch.randn(s, device=dev).to(wdt) for s in model_shapes(numel, n_tensors)]
        total = sum(p.numel() for p in params)
        for name, cost_sdt, setup in _cases(params, sdt):
            if kernels and name not in kernels:
                continue
            nbytes = bytes_moved(name, total, wdt, state_dtype=cost_sdt)
            if name == "predict_sgd_":  # timed as predict + restore (a copy back)
                nbytes += bytes_moved("copy", total, wdt)
            src = torch.empty(nbytes // 8, dtype=torch.float32, device=dev).uniform_()
            dst = torch.empty_like(src)
            kerns, loop = [], None
            variants = _variants(backends if name in FUSED_KERNELS else ["foreach"], launches)
            for backend, shape in variants:
                kern, loop_fn = setup(backend)
                kerns.append(kern if shape is None else _launched(kern, shape))
                loop = loop or loop_fn
            times = _time_all([*kerns, lambda d=dst, s=src: d.copy_(s), loop], dev, repeat)
            t_copy, loop_t = times[-2], times[-1]
            t_foreach = times[0]
            for (backend, shape), t in zip(variants, times):
                row = {
                    "kernel": name,
                    "device": dev.type,
                    "dtype": dt_name,
                    "state_dtype": str(cost_sdt).replace("torch.", ""),
                    "numel": total,
                    "tensors": len(params),
                    "backend": backend,
                    "bytes": nbytes,
                    "ms": round(t * 1e3, 3),
                    "gbps": round(nbytes / t / 1e9, 2),
                    "copy_gbps": round(2 * src.numel() * 4 / t_copy / 1e9, 2),
                    "loop_ms": round(loop_t * 1e3, 3),
                    "loop_speedup": round(loop_t / t, 2),
                }
                row["pct_copy"] = round(100 * row["gbps"] / row["copy_gbps"], 1)
                if backend != "foreach":
                    row["foreach_speedup"] = round(t_foreach / t, 2)
                if backend == "triton":
                    row["launch"] = _launch_label(shape)
                rows.append(row)
    return rows


def _variants(backends: list[str], launches) -> list[tuple[str, tuple[int, int] | None]]:
    """(backend, launch shape or None for the default) to time: foreach first,
    then each backend, Triton once per launch shape asked for and at the
    default one (:func:`with_default_shape`)."""
    out = []
    for backend in backends:
        shapes = list(with_default_shape(launches)) if backend == "triton" and launches else [None]
        out += [(backend, shape) for shape in shapes]
    return out


def _launched(kern, shape: tuple[int, int]):
    """``kern`` with the Triton kernels launched at ``shape`` (block, warps)."""
    from pipesim.kernels import triton_kernels

    def run():
        with triton_kernels.launch_shape(*shape):
            kern()

    return run


def with_default_shape(launches) -> tuple[tuple[int, int], ...]:
    """The launch shapes asked for, the default one added last when missing:
    the targets are judged at the default shape, so a sweep always times it."""
    shapes = tuple(launches)
    return shapes if DEFAULT_LAUNCH in shapes else (*shapes, DEFAULT_LAUNCH)


def _launch_label(shape: tuple[int, int] | None) -> str:
    block, warps = DEFAULT_LAUNCH if shape is None else shape
    return f"{block}x{warps}"


def launch_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """An argparse type: comma-separated ``BLOCKxWARPS`` launch shapes."""
    shapes = []
    for item in (t.strip() for t in text.split(",")):
        block, sep, warps = item.partition("x")
        try:
            shape = (int(block), int(warps))
            if not sep:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected BLOCKxWARPS, e.g. 4096x8, got {item!r}") from None
        try:
            check_launch_shape(*shape)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        shapes.append(shape)
    return tuple(shapes)


def format_table(rows: list[dict]) -> str:
    cols = ["kernel", "backend", "dtype", "numel", "ms", "gbps", "copy_gbps", "pct_copy", "loop_ms", "loop_speedup"]
    if any("launch" in r for r in rows):
        cols.insert(2, "launch")
    if any("foreach_speedup" in r for r in rows):
        cols.append("foreach_speedup")
    data = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(d[i]) for d in data)) for i, c in enumerate(cols)]

    def line(vals):
        return "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))

    out = [line(cols), line(["-" * w for w in widths])] + [line(d) for d in data]
    return "\n".join(out)


def check_targets(rows: list[dict]) -> list[str]:
    """Human-readable misses of the issue's targets (empty when all are met)."""
    miss = []
    default = _launch_label(None) if any("launch" in r for r in rows) else None
    for r in rows:
        if r.get("launch", default) != default:  # a sweep's other shapes: measurements, not the product
            continue
        tag = f"{r['kernel']} {r['dtype']} {r['backend']}"
        if r["pct_copy"] < TARGET_PCT_COPY:
            miss.append(f"{tag}: {r['pct_copy']}% of copy bandwidth (target {TARGET_PCT_COPY:.0f}%)")
        if r["device"] == "cpu" and r["loop_speedup"] < TARGET_LOOP_CPU:
            miss.append(f"{tag}: {r['loop_speedup']}x over the loop (target {TARGET_LOOP_CPU}x)")
        if r["backend"] == "triton" and r["foreach_speedup"] < TARGET_TRITON:
            miss.append(f"{tag}: {r['foreach_speedup']}x over foreach (target {TARGET_TRITON}x)")
    return miss


def _names(allowed: tuple[str, ...], what: str):
    """An argparse type: a comma-separated subset of ``allowed``."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(bad) or repr(text)}; choose from {', '.join(allowed)}"
            )
        return names

    return parse


def _device(text: str) -> str:
    """An argparse type: cpu, or cuda when this machine has a GPU torch can use."""
    if text == "cpu" or (text == "cuda" and torch.cuda.is_available()):
        return text
    if text == "cuda":
        raise argparse.ArgumentTypeError("cuda: torch sees no GPU on this machine")
    raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")


def add_arguments(ap) -> None:
    ap.add_argument(
        "--device",
        type=_device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device to time on (cpu or cuda)",
    )
    ap.add_argument("--numel", type=positive, default=None, help="parameters (default: 10M CPU, 100M GPU)")
    ap.add_argument("--tensors", type=positive, default=100, help="tensors the parameters are split into")
    ap.add_argument(
        "--dtypes",
        type=_names(DTYPES, "dtype"),
        default=("float32", "bfloat16"),
        help=f"comma-separated weight dtypes, of {', '.join(DTYPES)}",
    )
    ap.add_argument("--repeat", type=positive, default=15, help="timed runs per kernel (the best is kept)")
    ap.add_argument(
        "--kernels",
        type=_names(KERNELS, "kernel"),
        default=None,
        help=f"comma-separated subset of {', '.join(KERNELS)} (default: all)",
    )
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up before measuring")
    ap.add_argument(
        "--triton-launch",
        type=launch_shapes,
        default=None,
        help="time the Triton kernels at these comma-separated BLOCKxWARPS launch shapes instead of "
        "the default (CUDA only), e.g. 1024x4,2048x8,4096x8,8192x16",
    )


def run_bench(args) -> dict:
    rows = run(
        args.device,
        args.numel,
        args.tensors,
        args.dtypes,
        args.repeat,
        args.kernels,
        args.warmup,
        launches=args.triton_launch,
    )
    return {"threads": torch.get_num_threads(), "repeat": args.repeat, "rows": rows, "misses": check_targets(rows)}


def render(report: dict) -> str:
    miss = report["misses"]
    return "\n".join(
        [
            f"threads={report['threads']}; best of {report['repeat']}; "
            "gbps = minimum bytes / time; copy = flat copy_ of the same bytes",
            format_table(report["rows"]),
            "\ntargets: " + ("all met" if not miss else "missed:\n  " + "\n  ".join(miss)),
        ]
    )


def main(argv=None, prog: str = "python -m pipesim.experiments.bench.kernels") -> int:
    return bench_main(
        argv, prog=prog, description=__doc__.split("\n")[0], add_arguments=add_arguments, run=run_bench, render=render
    )


if __name__ == "__main__":
    raise SystemExit(run_command(main))

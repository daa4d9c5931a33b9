"""The native backend (C loops loaded with ctypes): exact results, threads, cache, fallback.

The tolerance tests of test_kernels.py run on this backend too (its
``kernel_backend`` fixture); the tests here are stricter. The C kernels
compute in float32 with a documented order of operations, so a float32
emulation in torch gives the same bits: each torch op below is one IEEE
operation (rounded once), the explicit fused multiply-adds are emulated in
float64 (the product of two floats is exact there) and rounded to float32,
and so is the square root (C's sqrtf is correctly rounded, torch.sqrt on
CPU may not be).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pipesim.kernels as K
from pipesim.kernels import foreach, native
from pipesim.kernels.prediction import impl_for

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.skipif(
        not native.native_available(), reason=f"native kernels unavailable: {native.native_unavailable_reason()}"
    ),
]

# (weight dtype, state dtype)
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.float16, torch.float16),
]
# Block edges (512), tiny, scalar and empty tensors.
SHAPES = [(3, 5), (511,), (512,), (513,), (), (0,), (1,), (1000, 7), (5, 0), (2,)]

F = torch.float32


def rand(shapes, dtype, gen, *, positive=False, scale=1.0):
    out = []
    for s in shapes:
        t = torch.randn(s, generator=gen) * scale
        out.append((t.abs() if positive else t).to(dtype))
    return out


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F)


def fma(a, b, c):
    """a*b + c rounded once to float32 (a*b is exact in float64)."""
    return (a.double() * b.double() + c.double()).to(F)


def want_axpy(x, y, alpha):
    return fma(f32(alpha), y.to(F), x.to(F)).to(x.dtype)


def sqrt(v):
    """Correctly rounded float32 square root (torch.sqrt may go through MKL, within 1 ulp)."""
    return torch.sqrt(v.double()).to(F)


def want_adam(w, m, v, c, eps):
    return (w.to(F) - (f32(c) * m.to(F)) / (sqrt(v.to(F)) + f32(eps))).to(w.dtype)


def want_elastic(xs, c, alpha):
    cf = c.to(F)
    total = torch.zeros_like(cf)
    new = []
    for x in xs:
        d = x.to(F) - cf
        total = total + d
        new.append(fma(f32(-alpha), d, x.to(F)).to(x.dtype))
    return new, fma(f32(alpha), total, cf).to(c.dtype)


def same_bits(a, b):
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("wdt,sdt", DTYPES)
def test_axpy_is_one_fma_rounded_once(wdt, sdt):
    g = torch.Generator().manual_seed(1)
    x, y = rand(SHAPES, wdt, g), rand(SHAPES, sdt, g, scale=3.0)
    out = [torch.full(s, float("nan"), dtype=wdt) for s in SHAPES]
    native.axpy(out, x, y, -0.0371)
    assert all(same_bits(o, want_axpy(a, b, -0.0371)) for o, a, b in zip(out, x, y))
    expect = [want_axpy(a, b, 0.5) for a, b in zip(x, y)]
    native.axpy(x, x, y, 0.5)  # in place: out is x
    assert all(same_bits(a, e) for a, e in zip(x, expect))


@pytest.mark.parametrize("wdt,sdt", DTYPES)
def test_adam_apply_is_torch_float32_op_by_op(wdt, sdt):
    g = torch.Generator().manual_seed(2)
    w, m = rand(SHAPES, wdt, g), rand(SHAPES, sdt, g, scale=0.1)
    v = rand(SHAPES, sdt, g, positive=True, scale=0.01)
    v[0][0, 0] = 0.0  # the denominator is eps alone
    out = [torch.empty(s, dtype=wdt) for s in SHAPES]
    native.adam_apply(out, w, m, v, 0.0123, 1e-8)
    assert all(same_bits(o, want_adam(*t, 0.0123, 1e-8)) for o, *t in zip(out, w, m, v))
    expect = [want_adam(*t, 0.5, 1e-3) for t in zip(w, m, v)]
    native.adam_apply(w, w, m, v, 0.5, 1e-3)  # in place: out is w
    assert all(same_bits(a, e) for a, e in zip(w, expect))


@pytest.mark.parametrize("wdt,cdt", DTYPES)
@pytest.mark.parametrize("n", [1, 3])
def test_elastic_uses_values_from_before_the_call(wdt, cdt, n):
    g = torch.Generator().manual_seed(3)
    reps = [rand(SHAPES, wdt, g) for _ in range(n)]
    center = rand(SHAPES, cdt, g)
    expect = [want_elastic([r[i] for r in reps], center[i], 0.2) for i in range(len(SHAPES))]
    native.elastic(reps, center, 0.2)
    for i, (xs, c) in enumerate(expect):
        assert same_bits(center[i], c), f"center[{i}]"
        assert all(same_bits(r[i], x) for r, x in zip(reps, xs)), f"replicas[.][{i}]"


def test_bf16_rounding_ties_to_even_and_keeps_nan():
    # 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even (1);
    # 1 + 3*2^-8 halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
    x = [torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 3e38], dtype=torch.bfloat16)]
    y = [torch.tensor([2.0**-8, 3 * 2.0**-8, 2.0**-8 + 2.0**-20, float("nan"), float("-inf"), 3e38])]
    out = [torch.empty(6, dtype=torch.bfloat16)]
    native.axpy(out, x, y, 1.0)
    got = out[0].float()
    assert got[:3].tolist() == [1.0, 1 + 2**-6, 1 + 2**-7]
    assert got[3].isnan() and got[4].item() == float("-inf") and got[5].item() == float("inf")


@pytest.mark.parametrize("stream", [False, True])
def test_threads_and_streaming_do_not_change_bits(monkeypatch, stream):
    """Any split of the element range, and non-temporal stores (forced on here for
    misaligned views too), give the bits of the single-threaded plain-store run."""
    g = torch.Generator().manual_seed(4)
    sizes = [70_001, 3, 0, 40_000, 129, 64_000]
    for wdt in (torch.float32, torch.bfloat16):
        flat = torch.randn(sum(sizes) + 1, generator=g).to(wdt)[1:]  # views off 64-byte alignment
        x = list(flat.split(sizes))
        y = rand([(n,) for n in sizes], F, g)
        m = rand([(n,) for n in sizes], F, g)
        monkeypatch.setattr(native, "STREAM_MIN_BYTES", 1 << 62)
        ref_axpy = [torch.empty_like(t) for t in x]
        native.launch(0, [ref_axpy, x, y], 0.25, threads=1)
        ref_adam = [torch.empty_like(t) for t in x]
        native.launch(1, [ref_adam, x, y, [t.abs() for t in m]], 0.1, 1e-8, threads=1)
        monkeypatch.setattr(native, "STREAM_MIN_BYTES", 0 if stream else 1 << 62)
        for threads in (2, 3, 7):
            out = torch.empty(sum(sizes) + 3, dtype=wdt)[3:].split(sizes)
            native.launch(0, [list(out), x, y], 0.25, threads=threads)
            assert all(same_bits(a, b) for a, b in zip(out, ref_axpy)), f"axpy {wdt} {threads} threads"
            native.launch(1, [list(out), x, y, [t.abs() for t in m]], 0.1, 1e-8, threads=threads)
            assert all(same_bits(a, b) for a, b in zip(out, ref_adam)), f"adam {wdt} {threads} threads"


def test_unsupported_groups_fall_back_to_foreach():
    a = torch.randn(4, 6)
    assert impl_for([[a], [a], [a]], "native") is native
    assert impl_for([[a.t()], [a], [a]], "native") is foreach  # non-contiguous
    d = a.double()
    assert impl_for([[d], [d], [d]], "native") is foreach  # float64
    w = [torch.randn(6, 4).t(), torch.randn(5)]
    v = [torch.randn(4, 6), torch.randn(5)]
    got = K.predict_sgd(w, v, 0.1, 2, backend="native")  # the whole group goes to foreach
    assert all(same_bits(a_, b_) for a_, b_ in zip(got, K.predict_sgd(w, v, 0.1, 2, backend="foreach")))


def test_raw_pointer_writes_bump_version_counters():
    w, v = [torch.randn(8)], [torch.randn(8)]
    out = [torch.empty(8)]
    before = out[0]._version
    K.predict_sgd(w, v, 0.1, 1, out=out, backend="native")
    assert out[0]._version > before
    db = K.DoubleBuffer([torch.randn(8)])
    shadow = db.shadow[0]
    before = shadow._version
    db.update_sgd([torch.randn(8)], 0.1, backend="native")
    assert shadow._version > before


def test_build_key_follows_source_compiler_and_cpu():
    src = native.SOURCE.read_bytes()
    key = native.build_key(src, "gcc 12", "avx2 fma")
    assert key == native.build_key(src, "gcc 12", "avx2 fma")
    assert key != native.build_key(src + b"\n", "gcc 12", "avx2 fma")
    assert key != native.build_key(src, "gcc 13", "avx2 fma")
    assert key != native.build_key(src, "gcc 12", "avx2 fma avx512f")


def _python(code: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_concurrent_builds_all_load(tmp_path):
    """Two processes compiling into one empty cache at once both load a whole library."""
    code = """
        import torch
        from pipesim.kernels import native
        assert native.native_available(), native.native_unavailable_reason()
        out = [torch.empty(3)]
        native.axpy(out, [torch.ones(3)], [torch.ones(3)], 2.0)
        assert out[0].tolist() == [3.0] * 3
        print(native.library_path())
    """
    procs = [_python(code, {"PIPESIM_KERNELS_CACHE": str(tmp_path)}) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(paths.pop())]  # no temporary left


def test_missing_compiler_falls_back(tmp_path):
    code = """
        import torch
        import pipesim.kernels as K
        from pipesim.kernels import native
        from pipesim.kernels.backend import resolve
        assert not native.native_available()
        print(native.native_unavailable_reason())
        assert resolve("auto", torch.device("cpu")) == "foreach"
        assert K.predict_sgd([torch.ones(2)], [torch.ones(2)], 0.5, 1)[0].tolist() == [0.5, 0.5]
        try:
            K.predict_sgd([torch.ones(2)], [torch.ones(2)], 0.5, 1, backend="native")
        except RuntimeError as e:
            print(e)
        else:
            raise SystemExit("backend='native' did not raise")
    """
    p = _python(code, {"PIPESIM_KERNELS_CACHE": str(tmp_path), "CC": "/nonexistent/cc"})
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    reason, error = out.strip().splitlines()
    assert "/nonexistent/cc" in reason
    assert "unavailable" in error and "/nonexistent/cc" in error
    assert os.listdir(tmp_path) == []

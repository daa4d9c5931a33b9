"""The fused Triton path: on CUDA when present, else under Triton's CPU interpreter.

CUDA tests skip cleanly without a GPU. The interpreter test runs the same
Triton kernels on CPU tensors (``TRITON_INTERPRET=1``, in a subprocess since
the variable is read when the kernels are decorated) wherever ``triton``
imports, so the kernel code is exercised in CI without a GPU. Tolerances are
those of ``test_kernels.check`` (see its docstring); the interpreter
truncates float32 to bfloat16 instead of rounding to nearest, an error below
one bf16 ulp, which that bound already allows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from test_kernels import DTYPES, check, make, ref_adam, ref_elastic, ref_sgd

import pipesim.kernels as K
from pipesim.kernels.backend import resolve, triton_available

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

SHAPES = [(3, 5), (4097,), (), (0,), (1000, 33), (7,)]  # block edges, empty and scalar tensors


def _compare_all(device, backend):
    g = torch.Generator().manual_seed(0)
    for wdt, sdt in DTYPES:
        if wdt == torch.float64:
            continue  # float64 stays on the foreach path by design
        for layout in ("separate", "flat"):
            w = [t.to(device) for t in make(SHAPES, wdt, layout, g)]
            if layout == "flat":  # keep the views back to back on the device
                flat = torch.cat([t.reshape(-1) for t in w])
                w = [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in w]), w)]
            v = [t.to(device) for t in make(SHAPES, sdt, "separate", g)]
            m = [t.to(device) * 0.1 for t in make(SHAPES, sdt, "separate", g)]
            sq = [t.to(device) for t in make(SHAPES, sdt, "separate", g, positive=True, scale=0.01)]

            got = K.predict_sgd(w, v, 0.1, 3, backend=backend)
            for i, (a, r, wi, vi) in enumerate(zip(got, ref_sgd(w, v, 0.1, 3), w, v)):
                check(
                    a.cpu(),
                    r.cpu(),
                    (wi.double().abs() + 0.3 * vi.double().abs()).cpu(),
                    wdt,
                    2,
                    f"sgd {wdt} {layout} [{i}]",
                )

            got = K.predict_adam(w, m, sq, 9, 0.01, (0.9, 0.999), 1e-8, 2, backend=backend)
            ref, upd = ref_adam(w, m, sq, 9, 0.01, (0.9, 0.999), 1e-8, 2)
            for i, (a, r, wi, u) in enumerate(zip(got, ref, w, upd)):
                check(a.cpu(), r.cpu(), (wi.double().abs() + u.abs()).cpu(), wdt, 4, f"adam {wdt} {layout} [{i}]")

            reps = [[t.clone() for t in w], [t.to(device) for t in make(SHAPES, wdt, "separate", g)]]
            center = [t.to(device) for t in make(SHAPES, sdt, "separate", g)]
            want_r, want_c = ref_elastic(reps, center, 0.2)
            scale = [
                (reps[0][i].double().abs() + reps[1][i].double().abs() + center[i].double().abs()).cpu()
                for i in range(len(SHAPES))
            ]
            K.elastic_average(reps, center, 0.2, backend=backend)
            for rep, want in zip(reps, want_r):
                for i, (a, b) in enumerate(zip(rep, want)):
                    check(a.cpu(), b.cpu(), scale[i], wdt, 4, f"elastic {wdt} {layout} replica [{i}]")
            for i, (a, b) in enumerate(zip(center, want_c)):
                check(a.cpu(), b.cpu(), scale[i], sdt, 4, f"elastic {wdt} {layout} centre [{i}]")

            orig = [t.clone() for t in w]
            K.predict_sgd_(w, v, 0.1, 3, backend=backend).restore()
            assert all(torch.equal(a, b) for a, b in zip(w, orig))


def _run_under_interpreter(code: str) -> None:
    """Run ``code`` in a fresh interpreter with ``TRITON_INTERPRET=1`` (read
    when the kernels are decorated, so it must be set before the import);
    the code prints ``ok`` last."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@needs_cuda
@needs_triton
def test_triton_is_chosen_automatically_on_cuda():
    assert resolve("auto", torch.device("cuda")) == "triton"
    assert resolve("foreach", torch.device("cuda")) == "foreach"


@needs_cuda
@pytest.mark.parametrize("backend", ["foreach", "triton"])
def test_cuda_matches_reference(backend):
    if backend == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    _compare_all("cuda", backend)


@needs_cuda
@needs_triton
def test_triton_writes_bump_version_counters():
    w = torch.randn(10, device="cuda", requires_grad=True)
    x = torch.randn(10, device="cuda", requires_grad=True)
    loss = (w * x).sum()  # saves w and x for backward
    with torch.no_grad():
        K.elastic_average([[w.detach()]], [x.detach()], 0.1, backend="triton")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@needs_triton
def test_triton_kernels_under_interpreter():
    """Runs the Triton kernels on CPU tensors through Triton's interpreter."""
    code = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, %r)
        from test_kernels_cuda import _compare_all
        _compare_all("cpu", "triton")
        print("ok")
    """
        % os.path.dirname(__file__)
    )
    _run_under_interpreter(code)


@needs_triton
def test_triton_launch_shapes_give_the_same_bits_under_interpreter():
    """Every element is computed alone, so any launch shape gives the same
    bits; the default shape is restored after the ``with``, even on error."""
    code = textwrap.dedent("""
        import torch
        import pipesim.kernels as K
        from pipesim.kernels import triton_kernels as tk
        g = torch.Generator().manual_seed(1)
        w = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (300, 4097, 5)]
        v = [torch.randn(n, generator=g) for n in (300, 4097, 5)]
        ref = K.predict_sgd(w, v, 0.1, 3, backend="triton")
        for block, warps in ((128, 1), (256, 4), (8192, 8)):
            with tk.launch_shape(block, warps):
                assert (tk.BLOCK, tk.NUM_WARPS) == (block, warps)
                got = K.predict_sgd(w, v, 0.1, 3, backend="triton")
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (block, warps)
        try:
            with tk.launch_shape(512, 2):
                raise KeyError("inside")
        except KeyError:
            pass
        assert (tk.BLOCK, tk.NUM_WARPS) == (4096, 8)
        try:
            tk.launch_shape(1000, 4).__enter__()
        except ValueError as e:
            assert "block must be a power of two" in str(e)
        else:
            raise AssertionError("a block of 1000 was accepted")
        print("ok")
    """)
    _run_under_interpreter(code)


@needs_triton
def test_triton_kernels_compile_for_hopper_with_vector_loads():
    """Compiles (no GPU needed: Triton ships ptxas) for sm_90 and checks that a full
    block with aligned pointers uses 128-bit loads and stores; without the alignment
    and block-offset hints these kernels would issue 32-bit accesses only."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:  # a Triton without this compile API
        pytest.skip(f"Triton compile API unavailable: {exc}")
    import triton.language as tl

    from pipesim.kernels import triton_kernels as tk

    sig = {
        "W": "*i64",
        "M": "*i64",
        "V": "*i64",
        "O": "*i64",
        "NUMELS": "*i64",
        "BLK_T": "*i32",
        "BLK_OFF": "*i64",
        "neg_c": "fp32",
        "eps": "fp32",
        "W_TY": "constexpr",
        "M_TY": "constexpr",
        "V_TY": "constexpr",
        "O_TY": "constexpr",
        "ALIGNED": "constexpr",
        "BLOCK": "constexpr",
    }
    # fp32 throughout, and bf16 weights with fp32 state (whose 2-byte elements
    # must still move 16 bytes per access: 8 to a vector)
    for weights in (tl.float32, tl.bfloat16):
        consts = {
            "W_TY": weights,
            "M_TY": tl.float32,
            "V_TY": tl.float32,
            "O_TY": weights,
            "ALIGNED": True,
            "BLOCK": tk.BLOCK,
        }
        try:
            kernel = triton.compile(
                ASTSource(fn=tk._adam_kernel, signature=sig, constexprs=consts),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": tk.NUM_WARPS},
            )
        except Exception as exc:  # e.g. no ptxas in this install
            if "ptxas" in str(exc).lower():
                pytest.skip(f"cannot compile for CUDA here: {exc}")
            raise
        ptx = kernel.asm["ptx"]
        assert re.search(r"ld\.global(\.[\w:]+)*\.v4", ptx), f"no 128-bit loads ({weights})"
        assert re.search(r"st\.global(\.[\w:]+)*\.v4", ptx), f"no 128-bit stores ({weights})"
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx  # IEEE, not the fast approximations

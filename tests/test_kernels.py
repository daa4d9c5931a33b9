"""Kernels layer: numerics against a plain per-tensor reference, validation, in-place restore.

Tolerances. The reference is computed per tensor in float64 from the same
inputs, so it is the exact result up to ~1e-16 relative. Let eps be the
machine epsilon of the dtype (one ulp at 1.0) and ``scale`` the elementwise
magnitude of the terms being combined (e.g. |W| + |s·lr·v|):

* float32 / float64: every op rounds once to within eps/2 of its result,
  so a k-op kernel is within (k/2)·eps·scale. We allow 2·eps·scale for SGD
  (mul+add, possibly fused), 4·eps·scale for Adam (sqrt, add, div, mul, add)
  and for elastic averaging (mean, difference, scaled sum).
* 16-bit weights (fp32 or 16-bit state): the kernels compute in float32 and
  round once, so the result is the float32 value rounded to the 16-bit
  grid: within half a 16-bit ulp of the float32 value, which is itself within
  the float32 bound above. Near a rounding tie the float32 error can push
  the result to the other neighbour, hence 1 ulp of the result
  (eps16·|ref|) plus the float32 bound. Double rounding (e.g. rounding the
  update to bf16 first) can exceed this; ``test_bf16_rounds_once`` pins
  a case where it does.
* An absolute floor of one subnormal spacing covers results in the
  subnormal range, where the relative bounds do not hold.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipesim.kernels as K
from pipesim.experiments.bench.kernels import _variants as bench_variants
from pipesim.experiments.bench.kernels import check_targets, launch_shapes, model_shapes, with_default_shape
from pipesim.experiments.bench.kernels import main as bench_main
from pipesim.experiments.bench.kernels import run as bench_run
from pipesim.experiments.cliargs import run_command
from pipesim.kernels import foreach
from pipesim.kernels._checks import DEFAULT_LAUNCH
from pipesim.kernels.native import native_available, native_unavailable_reason

#: numerics tests: CI runs them again with lesser ATen and MKL kernels (.ci/run)
pytestmark = pytest.mark.numerics

# The backend fixture is set once per test, the same for every example.
SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)

# (weight dtype, state dtype)
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
    (torch.float64, torch.float64),
]

shape_st = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
big_shape_st = st.sampled_from([(300,), (17, 40), (1025,)])
shapes_st = st.lists(st.one_of(shape_st, shape_st, big_shape_st), min_size=1, max_size=5)
layout_st = st.sampled_from(["separate", "flat", "transposed"])
# Tiles far smaller than the default exercise packing and chunking on small inputs.
tile_st = st.sampled_from([16, 64, foreach.TILE_NUMEL])


@pytest.fixture(params=["foreach", "native"])
def kernel_backend(request):
    """Run a test on each CPU backend (unsupported groups fall back to foreach)."""
    if request.param == "native" and not native_available():
        pytest.skip(f"native kernels unavailable: {native_unavailable_reason()}")
    with K.use_backend(request.param):
        yield request.param


class tile_size:
    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.old, foreach.TILE_NUMEL = foreach.TILE_NUMEL, self.n

    def __exit__(self, *exc):
        foreach.TILE_NUMEL = self.old


def make(shapes, dtype, layout, gen, *, positive=False, scale=1.0):
    """Random tensors of ``shapes``: separate, back to back in one buffer, or non-contiguous."""

    def values(shape):
        t = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
        return (t.abs() if positive else t).to(dtype)

    if layout == "flat":
        numels = [math.prod(s) for s in shapes]
        flat = values((sum(numels),))
        return [p.view(s) for p, s in zip(flat.split(numels), shapes)]
    if layout == "transposed":
        return [values(s[::-1]).t() if len(s) == 2 else values(s) for s in shapes]
    return [values(s) for s in shapes]


def bits(t):
    """Raw bytes: bit-exact comparison that also holds for NaN, -0.0 and subnormals."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def check(got, ref, scale, dtype, k, what=""):
    """|got - ref| within the bounds described in the module docstring."""
    fi = torch.finfo(dtype)
    overflow = ref.to(dtype).isinf()  # the correctly rounded result is +-inf: demand exactly that
    assert torch.equal(got[overflow], ref.to(dtype)[overflow]), f"{what}: overflow differs"
    got, ref, scale = got[~overflow], ref[~overflow], (scale * torch.ones_like(ref))[~overflow]
    err = (got.double() - ref).abs()
    tol = k * fi.eps * scale
    if dtype in (torch.bfloat16, torch.float16):
        tol = fi.eps * ref.abs() + k * torch.finfo(torch.float32).eps * scale
    tol = tol + fi.smallest_normal * fi.eps
    bad = err > tol
    assert not bad.any(), (
        f"{what}: max error {err.max().item():.3g} over tolerance "
        f"(got {got[bad][:3].tolist()}, ref {ref[bad][:3].tolist()})"
    )


# ------------------------------------------------------------------ references


def ref_sgd(ws, vs, lr, s):
    return [w.double() - s * lr * v.double() for w, v in zip(ws, vs)]


def ref_adam(ws, ms, vs, step, lr, betas, eps, s):
    bc1, bc2 = 1 - betas[0] ** step, 1 - betas[1] ** step
    upd = [s * lr * (m.double() / bc1) / ((v.double() / bc2).sqrt() + eps) for m, v in zip(ms, vs)]
    return [w.double() - u for w, u in zip(ws, upd)], upd


def ref_elastic(reps, center, alpha):
    ds = [[alpha * (x.double() - c.double()) for x, c in zip(rep, center)] for rep in reps]
    new_reps = [[x.double() - d for x, d in zip(rep, dr)] for rep, dr in zip(reps, ds)]
    new_c = [c.double() + sum(dr[i] for dr in ds) for i, c in enumerate(center)]
    return new_reps, new_c


@pytest.mark.usefixtures("kernel_backend")
# ------------------------------------------------------------------ predict_sgd

@SETTINGS
@given(
    shapes=shapes_st,
    dts=st.sampled_from(DTYPES),
    layout=layout_st,
    tile=tile_st,
    seed=st.integers(0, 2**31),
    lr=st.sampled_from([1e-3, 0.1, 1.0]),
    distance=st.integers(0, 8),
    use_out=st.booleans(),
)
def test_predict_sgd_matches_reference(shapes, dts, layout, tile, seed, lr, distance, use_out):
    wdt, sdt = dts
    g = torch.Generator().manual_seed(seed)
    w = make(shapes, wdt, layout, g)
    v = make(shapes, sdt, "separate", g)
    before = [t.clone() for t in w]
    out = [torch.full(s, float("nan"), dtype=wdt) for s in shapes] if use_out else None
    with tile_size(tile):
        got = K.predict_sgd(w, v, lr, distance, out=out)
    if use_out:
        assert all(a is b for a, b in zip(got, out))
    for i, (a, r, wi, vi) in enumerate(zip(got, ref_sgd(w, v, lr, distance), w, v)):
        assert a.dtype == wdt and a.shape == wi.shape
        scale = wi.double().abs() + distance * lr * vi.double().abs()
        check(a, r, scale, wdt, 2, f"params[{i}]")
    assert all(torch.equal(a, b) for a, b in zip(w, before)), "params were modified"


@pytest.mark.usefixtures("kernel_backend")
@SETTINGS
@given(shapes=shapes_st, dts=st.sampled_from(DTYPES), layout=layout_st, seed=st.integers(0, 2**31))
def test_distance_zero_is_identity(shapes, dts, layout, seed):
    wdt, sdt = dts
    g = torch.Generator().manual_seed(seed)
    w = make(shapes, wdt, layout, g)
    v = make(shapes, sdt, "separate", g, scale=1e30 if sdt != torch.float16 else 1e4)
    m = make(shapes, sdt, "separate", g)
    sq = make(shapes, sdt, "separate", g, positive=True)
    for got in (
        K.predict_sgd(w, v, 0.1, 0),
        K.predict_adam(w, m, sq, 5, 0.1, (0.9, 0.999), 1e-8, 0),
        K.predict_adam(w, m, sq, 0, 0.1, (0.9, 0.999), 1e-8, 3),
    ):  # step 0: no moments yet
        assert all(torch.equal(a, b) for a, b in zip(got, w))


@pytest.mark.usefixtures("kernel_backend")
def test_bf16_rounds_once():
    # W = 1 - s*lr*v with s*lr*v = 2^-9 + 2^-18: exact 1 - 2^-9 - 2^-18 lies below the
    # midpoint 1 - 2^-9 of the bf16 neighbours 1 - 2^-8 and 1, so it rounds to 1 - 2^-8.
    # Rounding the update to bf16 first (2^-9) lands on the midpoint and ties to 1.0.
    w = [torch.ones(4, dtype=torch.bfloat16)]
    v = [torch.full((4,), 2.0**-9 + 2.0**-18)]
    assert K.predict_sgd(w, v, 1.0, 1)[0].tolist() == [1 - 2**-8] * 4
    db = K.DoubleBuffer([w[0].clone()])
    db.update_sgd(v, 1.0)
    assert db.current[0].tolist() == [1 - 2**-8] * 4


@pytest.mark.usefixtures("kernel_backend")
def test_predict_sgd_equals_torch_sgd_step():
    """An SGD step with momentum 1, no dampening and a zero gradient keeps v and does
    W - lr*v: exactly the distance-1 prediction, computed by torch.optim itself."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 8)).square().sum().backward()
        opt.step()
    params = list(model.parameters())
    bufs = [opt.state[p]["momentum_buffer"] for p in params]
    predicted = K.predict_sgd(params, bufs, 0.05, 1)
    # Within each other's rounding (the module docstring's bound for SGD, scaled by
    # |W| + lr|v|): torch's step and the kernel may each fuse W - lr*v or not, by
    # ATEN_CPU_CAPABILITY and backend.
    scale = [p.detach().double().abs() + 0.05 * b.double().abs() for p, b in zip(params, bufs)]
    for g in opt.param_groups:
        g["momentum"], g["dampening"] = 1.0, 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for i, (a, p, sc) in enumerate(zip(predicted, params, scale)):
        check(a, p.detach().double(), sc, torch.float32, 2, f"params[{i}]")


@pytest.mark.usefixtures("kernel_backend")
# ------------------------------------------------------------------ predict_adam

@SETTINGS
@given(
    shapes=shapes_st,
    dts=st.sampled_from(DTYPES),
    layout=layout_st,
    tile=tile_st,
    seed=st.integers(0, 2**31),
    step=st.integers(1, 10_000),
    distance=st.integers(0, 8),
    lr=st.sampled_from([1e-4, 1e-2, 1.0]),
    eps=st.sampled_from([1e-8, 1e-3]),
)
def test_predict_adam_matches_reference(shapes, dts, layout, tile, seed, step, distance, lr, eps):
    wdt, sdt = dts
    g = torch.Generator().manual_seed(seed)
    w = make(shapes, wdt, layout, g)
    m = make(shapes, sdt, "separate", g, scale=0.1)
    v = make(shapes, sdt, "separate", g, positive=True, scale=0.01)
    if v[0].numel():
        v[0][(0,) * v[0].dim()] = 0.0  # sqrt(0): the denominator is eps alone
    betas = (0.9, 0.999)
    with tile_size(tile):
        got = K.predict_adam(w, m, v, step, lr, betas, eps, distance)
    ref, upd = ref_adam(w, m, v, step, lr, betas, eps, distance)
    for i, (a, r, wi, u) in enumerate(zip(got, ref, w, upd)):
        check(a, r, wi.double().abs() + u.abs(), wdt, 4, f"params[{i}]")


@pytest.mark.usefixtures("kernel_backend")
def test_predict_adam_reads_torch_adam_state():
    torch.manual_seed(1)
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        model = torch.nn.Linear(6, 4)
        opt = cls(model.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-6)
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(3, 6)).square().sum().backward()
            opt.step()
        params = list(model.parameters())
        st_ = [opt.state[p] for p in params]
        step = int(st_[0]["step"])
        got = K.Predictor(model, opt).predict(2)
        ref, _ = ref_adam(
            params, [s["exp_avg"] for s in st_], [s["exp_avg_sq"] for s in st_], step, 1e-2, (0.8, 0.99), 1e-6, 2
        )
        for (name, a), r, p in zip(got.items(), ref, params):
            check(a, r, p.double().abs() + (r - p.double()).abs(), torch.float32, 4, name)


@pytest.mark.usefixtures("kernel_backend")
# ------------------------------------------------------------------ elastic averaging

@SETTINGS
@given(
    shapes=shapes_st,
    dts=st.sampled_from(DTYPES),
    layout=layout_st,
    tile=tile_st,
    seed=st.integers(0, 2**31),
    n=st.integers(1, 4),
    alpha=st.sampled_from([0.0, 0.05, 0.2, 0.5]),
)
def test_elastic_average_matches_reference(shapes, dts, layout, tile, seed, n, alpha):
    wdt, cdt = dts
    g = torch.Generator().manual_seed(seed)
    reps = [make(shapes, wdt, layout, g) for _ in range(n)]
    center = make(shapes, cdt, "separate", g)
    want_reps, want_c = ref_elastic(reps, center, alpha)
    scale = [sum(r[i].double().abs() for r in reps) + center[i].double().abs() for i in range(len(shapes))]
    with tile_size(tile):
        K.elastic_average(reps, center, alpha)
    for r, (rep, want) in enumerate(zip(reps, want_reps)):
        for i, (a, b) in enumerate(zip(rep, want)):
            check(a, b, scale[i], wdt, 4, f"replicas[{r}][{i}]")
    for i, (a, b) in enumerate(zip(center, want_c)):
        check(a, b, scale[i], cdt, 4, f"center[{i}]")


def test_elastic_average_conserves_total_and_contracts():
    g = torch.Generator().manual_seed(3)
    reps = [[torch.randn(50, generator=g, dtype=torch.float64)] for _ in range(3)]
    center = [torch.randn(50, generator=g, dtype=torch.float64)]
    total = sum(r[0] for r in reps) + center[0]
    spread = max((r[0] - center[0]).abs().max() for r in reps)
    K.elastic_average(reps, center, 0.1)
    torch.testing.assert_close(sum(r[0] for r in reps) + center[0], total, rtol=0, atol=1e-12)
    assert max((r[0] - center[0]).abs().max() for r in reps) < spread


@pytest.mark.usefixtures("kernel_backend")
# ------------------------------------------------------------------ in place with exact restore

@SETTINGS
@given(
    shapes=shapes_st,
    dts=st.sampled_from(DTYPES),
    layout=layout_st,
    tile=tile_st,
    seed=st.integers(0, 2**31),
    save=st.sampled_from(["copy", "residual"]),
    kind=st.sampled_from(["sgd", "adam"]),
    distance=st.integers(0, 6),
)
def test_inplace_prediction_restores_bit_exactly(shapes, dts, layout, tile, seed, save, kind, distance):
    wdt, sdt = dts
    g = torch.Generator().manual_seed(seed)
    w = make(shapes, wdt, layout, g)
    if w[0].numel():
        w[0][(0,) * w[0].dim()] = 1e-30 if wdt != torch.float16 else 1e-7  # weight << update: an exception
    s1 = make(shapes, sdt, "separate", g, scale=0.5)
    s2 = make(shapes, sdt, "separate", g, positive=True)
    original = [t.clone() for t in w]
    with tile_size(tile):
        if kind == "sgd":
            want = K.predict_sgd(w, s1, 0.1, distance)
            h = K.predict_sgd_(w, s1, 0.1, distance, save=save)
            scale = [wi.double().abs() + distance * 0.1 * si.double().abs() for wi, si in zip(original, s1)]
        else:
            want = K.predict_adam(w, s1, s2, 7, 0.01, (0.9, 0.999), 1e-8, distance)
            h = K.predict_adam_(w, s1, s2, 7, 0.01, (0.9, 0.999), 1e-8, distance, save=save)
            scale = [wi.double().abs() + (a.double() - wi.double()).abs() for wi, a in zip(original, want)]
        for i, (a, b) in enumerate(zip(w, want)):  # same prediction as the out-of-place form
            check(a, b.double(), scale[i], wdt, 4, f"params[{i}]")
        h.restore()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(w, original))


@pytest.mark.usefixtures("kernel_backend")
def test_residual_mode_is_smaller_and_handles_hard_cases():
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(10_000, generator=g)]
    w[0][:10] = torch.tensor([1e-30, -1e-30, 0.0, -0.0, 1e-45, 3e38, -3e38, 1e-7, 2.0, float("inf")])
    v = [torch.randn(10_000, generator=g)]
    original = w[0].clone()
    h = K.predict_sgd_(w, v, 0.5, 3, save="residual")
    assert h.nbytes < 10_000 * 4 / 3
    h.restore()
    assert torch.equal(w[0].view(torch.int32), original.view(torch.int32))
    h = K.predict_sgd_(w, v, 0.5, 3, save="copy")
    assert h.nbytes == 10_000 * 4
    h.restore()
    assert torch.equal(w[0].view(torch.int32), original.view(torch.int32))


def test_inplace_guards_and_context_manager():
    w = [torch.randn(5)]
    v = [torch.randn(5)]
    orig = w[0].clone()
    with K.predict_sgd_(w, v, 0.1, 2) as h:
        assert not torch.equal(w[0], orig)
    assert h.restored and torch.equal(w[0], orig)
    with pytest.raises(RuntimeError, match="already restored"):
        h.restore()
    h = K.predict_sgd_(w, v, 0.1, 2)
    with torch.no_grad():
        w[0].add_(1.0)  # e.g. an optimizer step before the restore
    with pytest.raises(RuntimeError, match=r"params\[0\] was modified"):
        h.restore()
    h = K.predict_sgd_(w, v, 0.1, 2, save="residual")
    v[0].mul_(2)
    with pytest.raises(RuntimeError, match="optimizer state changed"):
        h.restore()
    backup = torch.empty(5)
    w2 = [torch.randn(5)]
    orig2 = w2[0].clone()
    K.predict_sgd_(w2, v, 0.1, 2, backup=backup).restore()
    assert torch.equal(w2[0], orig2) and torch.equal(backup, orig2)
    with pytest.raises(ValueError, match="backup"):
        K.predict_sgd_(w2, v, 0.1, 2, backup=torch.empty(4))
    with pytest.raises(ValueError, match="save"):
        K.predict_sgd_(w2, v, 0.1, 2, save="nothing")


@pytest.mark.usefixtures("kernel_backend")
def test_inplace_prediction_with_autograd_leaf_params():
    """Module parameters require grad: the in-place form must work on them, and a
    forward+backward between predict_ and restore sees the predicted weights."""
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    lin(torch.randn(4, 3)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in lin.parameters()]
    pred = K.Predictor(lin, opt)
    want = {k: t.clone() for k, t in pred.predict(2).items()}
    with pred.predict_(2, save="residual"):
        torch.testing.assert_close(lin.weight.detach(), want["weight"], rtol=0, atol=1e-6)
        lin(torch.randn(4, 3)).sum().backward()
    for p, b in zip(lin.parameters(), before):
        assert torch.equal(p.detach(), b)


@pytest.mark.usefixtures("kernel_backend")
def test_writes_through_flat_views_reach_autograd():
    """Two tensors sharing one storage but not a version counter (as after ``set_``):
    the flat fast path writes both through one view, and autograd must still learn
    that ``b`` changed, or the backward below would silently use the new values."""
    storage = torch.randn(20).untyped_storage()
    a = torch.empty(0).set_(storage, 0, (10,))
    b = torch.empty(0).set_(storage, 10, (10,))
    x = torch.randn(10, requires_grad=True)
    loss = (x * b).sum()
    with tile_size(4):
        K.elastic_average([[a, b]], list(torch.zeros(20).split(10)), 0.1)  # all flat
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ------------------------------------------------------------------ validation


def test_validation_names_the_offending_index():
    w = [torch.zeros(2), torch.zeros(4, 6), torch.zeros(3)]
    ok = [torch.zeros(2), torch.zeros(4, 6), torch.zeros(3)]
    with pytest.raises(ValueError, match=r"momentum_buffers\[1\] has shape \(4, 5\), params\[1\] has \(4, 6\)"):
        K.predict_sgd(w, [ok[0], torch.zeros(4, 5), ok[2]], 0.1, 1)
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[2\] has dtype torch.float64, params\[2\] has torch.float32"):
        K.predict_adam(w, ok, [ok[0], ok[1], torch.zeros(3, dtype=torch.float64)], 1, 0.1, (0.9, 0.99), 1e-8, 1)
    with pytest.raises(ValueError, match=r"momentum_buffers\[0\] is on meta, params\[0\] is on cpu"):
        K.predict_sgd(w, [torch.zeros(2, device="meta"), ok[1], ok[2]], 0.1, 1)
    with pytest.raises(ValueError, match=r"momentum_buffers has 2 tensors, params has 3"):
        K.predict_sgd(w, ok[:2], 0.1, 1)
    with pytest.raises(ValueError, match="distance must be >= 0"):
        K.predict_sgd(w, ok, 0.1, -1)
    with pytest.raises(ValueError, match="distance must be >= 0"):
        K.predict_adam(w, ok, ok, 1, 0.1, (0.9, 0.99), 1e-8, float("nan"))
    with pytest.raises(ValueError, match=r"out\[2\] has dtype torch.bfloat16"):
        K.predict_sgd(w, ok, 0.1, 1, out=[ok[0], ok[1], torch.zeros(3, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match=r"out\[1\] is the same memory as params\[1\]"):
        K.predict_sgd(w, ok, 0.1, 1, out=[torch.zeros(2), w[1], torch.zeros(3)])
    with pytest.raises(ValueError, match=r"params\[0\] has dtype torch.int64"):
        K.predict_sgd([torch.zeros(2, dtype=torch.long)], [torch.zeros(2, dtype=torch.long)], 0.1, 1)
    with pytest.raises(ValueError, match=r"betas\[0\] must be in \[0, 1\)"):
        K.predict_adam(w, ok, ok, 1, 0.1, (1.0, 0.99), 1e-8, 1)
    with pytest.raises(ValueError, match="step must be >= 0"):
        K.predict_adam(w, ok, ok, -1, 0.1, (0.9, 0.99), 1e-8, 1)
    # fp32 state next to bf16 weights is allowed, bf16 state next to fp32 weights is not
    K.predict_sgd([torch.zeros(2, dtype=torch.bfloat16)], [torch.zeros(2)], 0.1, 1)
    with pytest.raises(ValueError, match=r"momentum_buffers\[0\] has dtype torch.bfloat16"):
        K.predict_sgd([torch.zeros(2)], [torch.zeros(2, dtype=torch.bfloat16)], 0.1, 1)


def test_elastic_validation():
    c = [torch.zeros(3), torch.zeros(2, 2)]
    with pytest.raises(ValueError, match="replicas is empty"):
        K.elastic_average([], c, 0.1)
    with pytest.raises(ValueError, match=r"replicas\[1\]\[1\] has shape \(2, 3\), replicas\[0\]\[1\] has \(2, 2\)"):
        K.elastic_average([[torch.zeros(3), torch.zeros(2, 2)], [torch.zeros(3), torch.zeros(2, 3)]], c, 0.1)
    with pytest.raises(ValueError, match=r"center\[0\] has dtype torch.float64"):
        K.elastic_average([[torch.zeros(3), torch.zeros(2, 2)]], [torch.zeros(3, dtype=torch.float64), c[1]], 0.1)
    with pytest.raises(ValueError, match=r"replicas\[1\] has 1 tensors, replicas\[0\] has 2"):
        K.elastic_average([[torch.zeros(3), torch.zeros(2, 2)], [torch.zeros(3)]], c, 0.1)
    r0 = [torch.zeros(3), torch.zeros(2, 2)]
    with pytest.raises(ValueError, match=r"replicas\[1\]\[0\] is the same memory as replicas\[0\]\[0\]"):
        K.elastic_average([r0, [r0[0], torch.zeros(2, 2)]], c, 0.1)
    with pytest.raises(ValueError, match=r"replicas\[0\]\[1\] is the same memory as center\[1\]"):
        K.elastic_average([[torch.zeros(3), c[1]]], c, 0.1)


# ------------------------------------------------------------------ backend switch


def test_backend_switch():
    assert K.get_backend() in K.BACKENDS
    with pytest.raises(ValueError, match="backend must be one of"):
        K.set_backend("cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        K.predict_sgd([torch.zeros(2)], [torch.zeros(2)], 0.1, 1, backend="fast")
    from pipesim.kernels.backend import resolve

    assert resolve("auto", torch.device("cpu")) == ("native" if native_available() else "foreach")
    with pytest.raises(RuntimeError, match="native.*CPU"):
        resolve("native", torch.device("cuda"))
    with K.use_backend("foreach"):
        assert K.get_backend() == "foreach"
    import os

    if not os.environ.get("TRITON_INTERPRET"):
        with pytest.raises(RuntimeError, match="triton"):
            K.predict_sgd([torch.zeros(2)], [torch.zeros(2)], 0.1, 1, backend="triton")


def test_cpu_import_does_not_import_triton():
    import subprocess
    import sys

    code = (
        "import sys, torch, pipesim.kernels as K\n"
        "K.predict_sgd([torch.ones(3)], [torch.ones(3)], .1, 1)\n"
        "print('triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------ module helpers


def test_predictor_groups_steps_and_missing_state():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.01}],
        lr=0.5,
        momentum=0.9,
    )
    model(torch.randn(2, 4)).sum().backward()
    model[1].bias.grad = None  # no momentum buffer for this one: predicted as itself
    opt.step()
    pred = K.Predictor(model, opt)
    got = pred.predict(3)
    assert list(got) == [n for n, _ in model.named_parameters()]
    lrs = {"0.weight": 0.1, "0.bias": 0.1, "1.weight": 0.01}
    for name, p in model.named_parameters():
        buf = opt.state[p].get("momentum_buffer")
        want = p.detach() if buf is None else p.detach() - 3 * lrs[name] * buf
        torch.testing.assert_close(got[name], want)
    again = pred.predict(1)
    assert again["0.weight"].data_ptr() == got["0.weight"].data_ptr()  # buffers reused
    out = torch.func.functional_call(model, pred.predict(0), (torch.ones(1, 4),))
    torch.testing.assert_close(out, model(torch.ones(1, 4)))
    with pytest.raises(ValueError, match="not managed by the optimizer"):
        K.Predictor(torch.nn.Linear(2, 2), opt)


def test_elastic_average_modules():
    torch.manual_seed(4)
    reps = [torch.nn.Linear(3, 3) for _ in range(2)]
    center = torch.nn.Linear(3, 3)
    want_reps, want_c = ref_elastic([list(r.parameters()) for r in reps], list(center.parameters()), 0.25)
    K.elastic_average_modules(reps, center, 0.25)
    for r, w in zip(reps, want_reps):
        for a, b in zip(r.parameters(), w):
            torch.testing.assert_close(a.detach().double(), b)
    for a, b in zip(center.parameters(), want_c):
        torch.testing.assert_close(a.detach().double(), b)


# ------------------------------------------------------------------ costing and benchmark


def test_bytes_moved():
    n = 1000
    assert K.bytes_moved("predict_sgd", n) == 3 * 4 * n
    assert K.bytes_moved("predict_adam", n, torch.bfloat16, state_dtype=torch.float32) == n * (2 * 2 + 2 * 4)
    assert K.bytes_moved("elastic_average", n, "float32", replicas=3) == n * (2 * 4 + 2 * 3 * 4)
    assert K.bytes_moved("copy", n, torch.float16) == 4 * n
    with pytest.raises(ValueError, match="unknown kernel"):
        K.bytes_moved("adamw", n)


def test_model_shapes_are_model_sized():
    shapes = model_shapes(10_000_000)
    assert 90 <= len(shapes) <= 110
    assert abs(sum(math.prod(s) for s in shapes) - 10_000_000) < 50_000


def test_bench_smoke():
    rows = bench_run("cpu", numel=20_000, n_tensors=30, dtypes=("float32",), repeat=1, warmup_s=0)
    assert {r["kernel"] for r in rows} >= {
        "predict_sgd",
        "predict_adam",
        "elastic_average",
        "weight_stash",
        "double_buffer",
    }
    if native_available():  # the fused CPU path gets rows of its own, against foreach
        native = {r["kernel"]: r for r in rows if r["backend"] == "native"}
        assert set(native) == {"predict_sgd", "predict_adam", "elastic_average", "double_buffer", "predict_sgd_"}
        assert all(r["foreach_speedup"] > 0 for r in native.values())
    for r in rows:
        assert {"kernel", "device", "dtype", "numel", "gbps", "copy_gbps", "loop_speedup"} <= set(r)
        assert r["ms"] > 0 and r["gbps"] >= 0 and r["copy_gbps"] >= 0  # rounded: tiny sizes on a busy machine read 0.0
    json.dumps(rows)


def test_bench_times_triton_once_per_launch_shape_asked_for():
    assert bench_variants(["foreach", "triton"], ((1024, 4), (8192, 16))) == [
        ("foreach", None),
        ("triton", (1024, 4)),
        ("triton", (8192, 16)),
        ("triton", DEFAULT_LAUNCH),
    ]
    assert bench_variants(["triton"], (DEFAULT_LAUNCH, (1024, 4))) == [
        ("triton", DEFAULT_LAUNCH),
        ("triton", (1024, 4)),
    ]
    assert bench_variants(["foreach", "triton"], None) == [("foreach", None), ("triton", None)]
    assert bench_variants(["foreach", "native"], ((1024, 4),)) == [("foreach", None), ("native", None)]


def test_bench_launch_sweep_always_times_the_default_shape():
    """The targets are judged at the default shape only: a sweep that left it
    out would report every target met without judging one."""
    assert with_default_shape(((1024, 4),)) == ((1024, 4), DEFAULT_LAUNCH)
    assert with_default_shape((DEFAULT_LAUNCH, (1024, 4))) == (DEFAULT_LAUNCH, (1024, 4))
    slow = {
        "kernel": "predict_sgd",
        "dtype": "bfloat16",
        "backend": "triton",
        "device": "cuda",
        "pct_copy": 40.0,
        "loop_speedup": 9.0,
        "foreach_speedup": 1.0,
    }
    rows = [{**slow, "launch": "1024x4"}, {**slow, "launch": "%dx%d" % DEFAULT_LAUNCH}]
    assert check_targets(rows[:1]) == [] and len(check_targets(rows)) == 2


@pytest.mark.parametrize(
    "text,message",
    [
        ("1024", "expected BLOCKxWARPS"),
        ("1000x4", "block must be a power of two"),
        ("4096x64", "warps must be a power of two"),
        ("64x4", "block must be"),
        ("axb", "expected BLOCKxWARPS"),
    ],
)
def test_bench_launch_shapes_refuse_what_triton_cannot_launch(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        launch_shapes(text)
    assert launch_shapes("128x1, 65536x32") == ((128, 1), (65536, 32))


def test_bench_triton_launch_on_cpu_is_one_line_exit_2(capsys):
    assert run_command(lambda: bench_main(["--device", "cpu", "--triton-launch", "1024x4"])) == 2
    err = capsys.readouterr().err
    assert "--triton-launch needs a CUDA device and Triton" in err and len(err.strip().splitlines()) == 1

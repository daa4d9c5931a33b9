"""Weight prediction: SpecTrain (momentum SGD) and XPipe/PipeOptim (Adam).

A pipeline stage that predicts runs a forward or backward on Ŵ, the weights
it expects to exist ``distance`` updates from now, instead of the stale W it
holds. Two forms:

* **Out of place** (:func:`predict_sgd`, :func:`predict_adam`): Ŵ is written
  to separate tensors and W is never touched. This is the right form whenever
  autograd is involved: W may have been saved by a pending backward, and
  writing it would corrupt (or, thanks to version counters, abort) that
  backward. Costs one extra copy of the weights; pass ``out=`` to reuse it
  from step to step.
* **In place with exact restore** (:func:`predict_sgd_`,
  :func:`predict_adam_`): Ŵ overwrites W and a handle puts W back bit for
  bit. For callers that must run the module itself on Ŵ and cannot hold a
  second full copy on the device. Undoing the update arithmetically is not an
  option: W - s·lr·v + s·lr·v differs from W in the last bits, and the error
  would accumulate over thousands of steps. So the handle keeps what it needs:
  ``save="copy"`` a copy of W (fastest; pass ``backup=`` to put it in host
  memory), ``save="residual"`` one byte per element (the bit-pattern
  difference to the recomputed value, see
  :func:`pipesim.kernels.foreach.residual_predict`), a quarter of an fp32
  copy. Restore only between passes that do not save W for autograd across
  the restore (e.g. predict_, forward+backward, restore) and before the
  optimizer changes the state.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipesim.kernels import foreach, native
from pipesim.kernels._checks import (
    as_tensor_list,
    check_aligned,
    check_distance,
    check_no_alias,
    check_reference,
    group_indices,
    take,
)
from pipesim.kernels.backend import resolve


def impl_for(lists: list[list[Tensor]], backend: str | None):
    """The module that runs one group: Triton or the C loops where chosen and able, else foreach."""
    name = resolve(backend, lists[0][0].device)
    if name == "triton":
        from pipesim.kernels import triton_kernels

        if triton_kernels.supports(lists):
            return triton_kernels
    elif name == "native" and native.supports(lists):
        return native
    return foreach


def empty_like_all(tensors: list[Tensor]) -> list[Tensor]:
    """Contiguous tensors shaped like ``tensors``, one allocation per device and dtype.

    Back-to-back views let later kernels treat the result as one flat buffer.
    """
    out: list[Tensor | None] = [None] * len(tensors)
    for idx in group_indices(tensors):
        numels = [tensors[i].numel() for i in idx]
        t0 = tensors[idx[0]]
        flat = torch.empty(sum(numels), dtype=t0.dtype, device=t0.device)
        for i, piece in zip(idx, flat.split(numels)):
            out[i] = piece.view(tensors[i].shape)
    return out  # type: ignore[return-value]


def _prepare_out(params: list[Tensor], out) -> list[Tensor]:
    if out is None:
        return empty_like_all(params)
    out = as_tensor_list("out", out)
    check_aligned("params", params, "out", out, state=False)
    check_no_alias("params", params, "out", out)
    return out


def _copy_groups(out: list[Tensor], params: list[Tensor]) -> None:
    for idx in group_indices(params):
        foreach.copy(take(out, idx), take(params, idx))


def _bump(tensors: list[Tensor]) -> None:
    """Tell autograd the tensors changed: writes through flat views or raw pointers
    do not reach every tensor's version counter on their own."""
    if tensors:
        torch.autograd.graph.increment_version(tensors)


# ----------------------------------------------------------------- SGD (SpecTrain)


def _sgd_inputs(params, momentum_buffers, distance):
    params = as_tensor_list("params", params)
    bufs = as_tensor_list("momentum_buffers", momentum_buffers)
    check_reference("params", params)
    check_aligned("params", params, "momentum_buffers", bufs, state=True)
    return params, bufs, check_distance(distance)


def predict_sgd(
    params, momentum_buffers, lr: float, distance: float, out=None, *, backend: str | None = None
) -> list[Tensor]:
    """SpecTrain's Ŵ = W - distance·lr·v, v the ``momentum_buffer`` torch.optim.SGD keeps.

    Returns Ŵ (``out`` when given, else freshly allocated) and never writes
    ``params``. Distance 0 returns an exact copy. 16-bit weights with float32
    buffers are computed in float32 and rounded once.
    """
    params, bufs, d = _sgd_inputs(params, momentum_buffers, distance)
    out = _prepare_out(params, out)
    with torch.no_grad():
        if d == 0.0 or lr == 0.0:
            _copy_groups(out, params)
            return out
        alpha = -d * float(lr)
        for idx in group_indices(params, bufs):
            lists = [take(out, idx), take(params, idx), take(bufs, idx)]
            impl_for(lists, backend).axpy(lists[0], lists[1], lists[2], alpha)
        _bump(out)
    return out


def predict_sgd_(
    params,
    momentum_buffers,
    lr: float,
    distance: float,
    *,
    save: str = "copy",
    backup: Tensor | None = None,
    backend: str | None = None,
) -> InplacePrediction:
    """In-place SpecTrain prediction; ``.restore()`` (or leaving the ``with``) undoes it exactly.

    ``save="copy"`` keeps a copy of W (in ``backup``, a flat tensor of at least
    as many elements, on any device, when given); ``save="residual"`` keeps one
    byte per element. Prefer :func:`predict_sgd` unless the weights themselves
    must hold Ŵ.
    """
    params, bufs, d = _sgd_inputs(params, momentum_buffers, distance)
    c = d * float(lr)

    def delta(dst, v):
        foreach._delta_sgd(dst, v, c)

    def apply(w, v, backend_):
        impl_for([w, w, v], backend_).axpy(w, w, v, -c)

    return InplacePrediction._make(params, [bufs], c == 0.0, save, backup, backend, delta, apply)


# --------------------------------------------------------------- Adam (XPipe, PipeOptim)


def _adam_inputs(params, exp_avgs, exp_avg_sqs, step, betas, distance):
    params = as_tensor_list("params", params)
    m = as_tensor_list("exp_avgs", exp_avgs)
    v = as_tensor_list("exp_avg_sqs", exp_avg_sqs)
    check_reference("params", params)
    check_aligned("params", params, "exp_avgs", m, state=True)
    check_aligned("params", params, "exp_avg_sqs", v, state=True)
    d = check_distance(distance)
    step = int(step.item() if isinstance(step, Tensor) else step)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    beta1, beta2 = (float(b) for b in betas)
    for name, b in (("betas[0]", beta1), ("betas[1]", beta2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b}")
    return params, m, v, d, step, beta1, beta2


def adam_coefficients(step: int, lr: float, betas, eps: float, distance: float) -> tuple[float, float]:
    """(c, eps') with m̂/(√v̂+ε) = (√bc2/bc1)·m/(√v + ε√bc2): the bias corrections
    folded into two scalars, which saves two passes over the moments."""
    bc1 = 1.0 - betas[0] ** step
    bc2 = 1.0 - betas[1] ** step
    root = math.sqrt(bc2)
    return distance * float(lr) * root / bc1, float(eps) * root


def predict_adam(
    params,
    exp_avgs,
    exp_avg_sqs,
    step,
    lr: float,
    betas,
    eps: float,
    distance: float,
    out=None,
    *,
    backend: str | None = None,
) -> list[Tensor]:
    """XPipe/PipeOptim's Ŵ = W - distance·lr·m̂/(√v̂ + ε), bias-corrected at ``step``.

    Reads ``exp_avg``/``exp_avg_sq`` as torch.optim.Adam and AdamW keep them
    (AdamW's decoupled weight decay is not predicted, as in the papers; with
    ``amsgrad`` pass ``max_exp_avg_sq``). ``step`` is the optimizer's step
    count; at step 0 there are no moments yet and Ŵ = W. Never writes
    ``params``.
    """
    params, m, v, d, step, b1, b2 = _adam_inputs(params, exp_avgs, exp_avg_sqs, step, betas, distance)
    out = _prepare_out(params, out)
    with torch.no_grad():
        if d == 0.0 or step == 0 or lr == 0.0:
            _copy_groups(out, params)
            return out
        c, eps2 = adam_coefficients(step, lr, (b1, b2), eps, d)
        for idx in group_indices(params, m, v):
            lists = [take(out, idx), take(params, idx), take(m, idx), take(v, idx)]
            impl_for(lists, backend).adam_apply(*lists, c, eps2)
        _bump(out)
    return out


def predict_adam_(
    params,
    exp_avgs,
    exp_avg_sqs,
    step,
    lr: float,
    betas,
    eps: float,
    distance: float,
    *,
    save: str = "copy",
    backup: Tensor | None = None,
    backend: str | None = None,
) -> InplacePrediction:
    """In-place form of :func:`predict_adam`; see :func:`predict_sgd_` for ``save``."""
    params, m, v, d, step, b1, b2 = _adam_inputs(params, exp_avgs, exp_avg_sqs, step, betas, distance)
    identity = d == 0.0 or step == 0 or lr == 0.0
    c, eps2 = (0.0, 0.0) if identity else adam_coefficients(step, lr, (b1, b2), eps, d)

    def delta(dst, m_, v_):
        foreach._delta_adam(dst, m_, v_, c, eps2)

    def apply(w, m_, v_, backend_):
        impl_for([w, m_, v_, w], backend_).adam_apply(w, w, m_, v_, c, eps2)

    return InplacePrediction._make(params, [m, v], identity, save, backup, backend, delta, apply)


# ------------------------------------------------------------------------ the handle


class InplacePrediction:
    """Undo record of an in-place prediction. Use ``restore()`` or ``with``.

    Restore refuses (``RuntimeError``) when the weights were written after the
    prediction (restoring would erase that write) or, in residual mode, when
    the optimizer state changed (the recomputation would differ).
    """

    def __init__(self):
        self.params: list[Tensor] = []
        self.save = "copy"
        self.restored = False
        self._parts: list = []
        self._versions: list[int] = []
        self._state: list[Tensor] = []
        self._state_versions: list[int] = []
        self._held: list[Tensor] = []

    @classmethod
    def _make(cls, params, state, identity, save, backup, backend, delta, apply):
        if save not in ("copy", "residual"):
            raise ValueError(f"save must be 'copy' or 'residual', got {save!r}")
        self = cls()
        self.params, self.save = params, save
        flat_state = [t for lst in state for t in lst]
        total = sum(p.numel() for p in params)
        if backup is not None:
            if save != "copy":
                raise ValueError("backup= is only used with save='copy'")
            if backup.dim() != 1 or backup.numel() < total:
                raise ValueError(
                    f"backup must be a 1-D tensor of at least {total} elements, got shape {tuple(backup.shape)}"
                )
            for i, p in enumerate(params):  # checked before anything is overwritten
                if p.dtype != backup.dtype:
                    raise ValueError(f"backup has dtype {backup.dtype}, params[{i}] has {p.dtype}")
        with torch.no_grad():
            if not identity:
                offset = 0
                for idx in group_indices(params, *state):
                    w = take(params, idx)
                    st = [take(lst, idx) for lst in state]
                    numels = [t.numel() for t in w]
                    n = sum(numels)
                    if save == "copy":
                        if backup is not None:
                            flat = backup[offset : offset + n]
                        else:
                            flat = torch.empty(n, dtype=w[0].dtype, device=w[0].device)
                        offset += n
                        saved = [p.view(t.shape) for p, t in zip(flat.split(numels), w)]
                        foreach.copy(saved, w)
                        apply(w, *st, backend)
                        self._parts.append(("copy", w, saved))
                        self._held.append(flat)
                    else:
                        k = torch.empty(n, dtype=torch.int8, device=w[0].device)
                        ks = [p.view(t.shape) for p, t in zip(k.split(numels), w)]
                        exc = foreach.residual_predict(w, ks, st, delta)
                        self._parts.append(("residual", w, ks, st, exc))
                        self._held.append(k)
                        for _, idx_, vals in exc:
                            self._held.append(vals)
                            self._held.extend(idx_ or ())
                _bump(params)
        self._versions = [p._version for p in params]
        if save == "residual":
            self._state = flat_state
            self._state_versions = [t._version for t in flat_state]
        self._delta = delta
        return self

    @property
    def nbytes(self) -> int:
        """Memory this handle keeps alive to make the restore exact."""
        return sum(t.numel() * t.element_size() for t in self._held)

    def restore(self) -> None:
        if self.restored:
            raise RuntimeError("this prediction was already restored")
        for i, (p, ver) in enumerate(zip(self.params, self._versions)):
            if p._version != ver:
                raise RuntimeError(
                    f"params[{i}] was modified after the in-place prediction; restoring would erase that change"
                )
        for i, (t, ver) in enumerate(zip(self._state, self._state_versions)):
            if t._version != ver:
                raise RuntimeError(
                    "optimizer state changed since the in-place prediction; the residual restore needs it unchanged"
                )
        with torch.no_grad():
            for part in self._parts:
                if part[0] == "copy":
                    foreach.copy(part[1], part[2])
                else:
                    _, w, ks, st, exc = part
                    foreach.residual_restore(w, ks, st, self._delta, exc)
            if self._parts:
                _bump(self.params)
        self.restored = True
        self._parts = []
        self._held = []

    def __enter__(self) -> InplacePrediction:
        return self

    def __exit__(self, *exc) -> None:
        if not self.restored:
            self.restore()

"""The kernels applied to an ``nn.Module`` and a ``torch.optim`` optimizer.

The kernels take aligned tensor lists and scalar hyperparameters; a model
has parameter groups with their own lr/betas, parameters without state yet
(before their first step, or SGD without momentum), and Adam steps that may
differ per parameter. These helpers do that bookkeeping, so a runtime writes

    predictor = Predictor(model, optimizer)
    weights = predictor.predict(distance)          # {name: Ŵ}, buffers reused
    out = torch.func.functional_call(model, weights, inputs)

A parameter without optimizer state is predicted as itself: nothing has been
accumulated that could move it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pipesim.kernels import foreach
from pipesim.kernels.averaging import elastic_average
from pipesim.kernels.prediction import (
    InplacePrediction,
    empty_like_all,
    predict_adam,
    predict_adam_,
    predict_sgd,
    predict_sgd_,
)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """``"sgd"`` (momentum buffers) or ``"adam"`` (Adam, AdamW and friends: two moments)."""
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    defaults = optimizer.defaults
    if "betas" in defaults and "eps" in defaults:
        return "adam"
    if "momentum" in defaults:
        return "sgd"
    raise ValueError(f"no prediction rule for {type(optimizer).__name__}; supported: SGD with momentum, Adam, AdamW")


def _params_of(params_or_module) -> tuple[list[str] | None, list[Tensor]]:
    if isinstance(params_or_module, nn.Module):
        named = list(params_or_module.named_parameters())
        return [n for n, _ in named], [p for _, p in named]
    return None, list(params_or_module)


def _scalar(x) -> float:
    return float(x.item() if isinstance(x, Tensor) else x)


class Predictor:
    """Predicted weights of a module (or parameter list) from its optimizer's state.

    :meth:`predict` writes into buffers allocated on the first call and reused
    after, so the returned tensors are overwritten by the next call: keep
    them only as long as the pass that reads them (ask for ``out=`` to
    manage buffers yourself).
    """

    def __init__(self, params_or_module, optimizer: torch.optim.Optimizer, *, backend: str | None = None):
        self.names, self.params = _params_of(params_or_module)
        self.optimizer = optimizer
        self.kind = optimizer_kind(optimizer)
        self.backend = backend
        self._out: list[Tensor] | None = None
        index = {id(p): i for i, p in enumerate(self.params)}
        self._groups = []  # (param_group, indices into self.params)
        covered = set()
        for g in optimizer.param_groups:
            idx = [index[id(p)] for p in g["params"] if id(p) in index]
            covered.update(idx)
            if idx:
                self._groups.append((g, idx))
        missing = [i for i in range(len(self.params)) if i not in covered]
        if missing:
            what = self.names[missing[0]] if self.names else f"params[{missing[0]}]"
            raise ValueError(f"{what} is not managed by the optimizer")

    def _batches(self):
        """(kind-specific call arguments, indices) per group and, for Adam, per step."""
        state = self.optimizer.state
        for g, idx in self._groups:
            lr = _scalar(g["lr"])
            if self.kind == "sgd":
                have = [i for i in idx if state.get(self.params[i], {}).get("momentum_buffer") is not None]
                if have:
                    bufs = [state[self.params[i]]["momentum_buffer"] for i in have]
                    yield ("sgd", bufs, lr), have
                continue
            by_step: dict[int, list[int]] = {}
            for i in idx:
                st = state.get(self.params[i], {})
                if "exp_avg" in st:
                    by_step.setdefault(int(_scalar(st["step"])), []).append(i)
            sq = "max_exp_avg_sq" if g.get("amsgrad") else "exp_avg_sq"
            for step, have in by_step.items():
                m = [state[self.params[i]]["exp_avg"] for i in have]
                v = [state[self.params[i]][sq] for i in have]
                yield ("adam", m, v, step, lr, g["betas"], g["eps"]), have

    def predict(self, distance: float, out: Sequence[Tensor] | None = None):
        """Ŵ for every parameter: a ``{name: tensor}`` dict for a module, else a list."""
        if out is None:
            if self._out is None:
                self._out = empty_like_all(self.params)
            out = self._out
        out = list(out)
        done = [False] * len(self.params)
        with torch.no_grad():
            for args, idx in self._batches():
                w = [self.params[i] for i in idx]
                o = [out[i] for i in idx]
                if args[0] == "sgd":
                    predict_sgd(w, args[1], args[2], distance, out=o, backend=self.backend)
                else:
                    _, m, v, step, lr, betas, eps = args
                    predict_adam(w, m, v, step, lr, betas, eps, distance, out=o, backend=self.backend)
                for i in idx:
                    done[i] = True
            rest = [i for i, d in enumerate(done) if not d]
            if rest:
                foreach.copy([out[i] for i in rest], [self.params[i] for i in rest])
        return dict(zip(self.names, out)) if self.names is not None else out

    def predict_(self, distance: float, *, save: str = "copy") -> PredictionGroup:
        """Overwrite the parameters with Ŵ; the handle restores them exactly."""
        handles = []
        try:
            for args, idx in self._batches():
                w = [self.params[i] for i in idx]
                if args[0] == "sgd":
                    handles.append(predict_sgd_(w, args[1], args[2], distance, save=save, backend=self.backend))
                else:
                    _, m, v, step, lr, betas, eps = args
                    handles.append(
                        predict_adam_(w, m, v, step, lr, betas, eps, distance, save=save, backend=self.backend)
                    )
        except BaseException:
            PredictionGroup(handles).restore()
            raise
        return PredictionGroup(handles)


class PredictionGroup:
    """Several :class:`InplacePrediction` handles restored together (one per group)."""

    def __init__(self, handles: list[InplacePrediction]):
        self.handles = handles
        self.restored = False

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.handles)

    def restore(self) -> None:
        for h in reversed(self.handles):
            if not h.restored:
                h.restore()
        self.restored = True

    def __enter__(self) -> PredictionGroup:
        return self

    def __exit__(self, *exc) -> None:
        if not self.restored:
            self.restore()


def predict_module(
    module: nn.Module, optimizer: torch.optim.Optimizer, distance: float, *, backend: str | None = None
) -> dict[str, Tensor]:
    """One-shot :meth:`Predictor.predict` (fresh buffers; build a Predictor to reuse them)."""
    return Predictor(module, optimizer, backend=backend).predict(distance)


def elastic_average_modules(replicas: Sequence[nn.Module], center, alpha: float, *, backend: str | None = None) -> None:
    """:func:`elastic_average` over modules' parameters (``center``: a module or tensor list)."""
    reps = [list(r.parameters()) for r in replicas]
    c = list(center.parameters()) if isinstance(center, nn.Module) else list(center)
    elastic_average(reps, c, alpha, backend=backend)

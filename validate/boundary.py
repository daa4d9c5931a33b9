"""Stages whose boundaries carry several tensors.

:class:`~pipesim.validate.stage.PipelineStage` sends one tensor across each
cut: its forward takes one input and returns one output, its backward one
gradient each way. Models from elsewhere (:mod:`pipesim.validate.usermodels`)
may pass a tuple from layer to layer (the hidden states with the rotary cos
and sin of a Hugging Face decoder, or with an attention mask; see
:mod:`pipesim.validate.models`). :class:`TupleStage` is a ``PipelineStage``
whose passes take and return such boundaries, with the same weight
versions, gradient accumulation, optimizer and split backward (I, W):

* **forward** takes a tensor or a tuple (the previous stage's output, or
  the data's input on stage 0) and calls its module with the tuple's
  tensors as positional arguments. A floating-point input that carries a
  gradient (below) becomes a leaf that requires one. It returns what the
  module returns, every tensor detached, and each marked
  ``requires_grad`` exactly when it carries a gradient back: a tensor the
  autograd graph reaches from the stage's weights or inputs (the hidden
  states) does, a constant (rotary tables made from buffers, a mask, token
  ids) does not.
* **backward** takes the gradient of each output that carries one (a tuple
  aligned with the outputs, ``None`` where none is carried; one tensor for a
  one-tensor boundary) and returns the input gradients the same way: a
  tensor for a one-tensor input, a tuple aligned with the inputs otherwise,
  ``None`` on stage 0. A carried input that the stage did not use gets
  zeros, so a sender always receives a tensor of the shape it sent.

On one-tensor boundaries it computes exactly what ``PipelineStage`` does,
bit for bit (a float input always carries a gradient there, as
``PipelineStage`` assumes). The profiler runs every model that is not a
catalog model in it (:func:`stage_class_for`).
So do the emulator and the distributed runtime
(:func:`pipesim.validate.runtime.build_stages`), which sends a tuple as one
packed transfer (:class:`~pipesim.validate.runtime.DistComm`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipesim.sim.ir.core import I, W
from pipesim.validate.models import boundary_tensors, call_layer
from pipesim.validate.stage import PipelineStage, _InFlight

__all__ = ["TupleStage", "carries_gradient", "detach_boundary", "stage_class_for"]


def carries_gradient(t: Tensor, alone: bool) -> bool:
    """Whether the boundary tensor ``t`` carries a gradient back across its
    cut: a floating-point tensor marked ``requires_grad``, or any
    floating-point tensor that is its boundary's only one (``alone``,
    PipelineStage's rule)."""
    return t.is_floating_point() and (alone or t.requires_grad)


def detach_boundary(value: Any) -> Any:
    """``value`` (a tensor or a tuple) detached, each floating-point tensor
    marked ``requires_grad`` when the original required one: what a stage
    hands the next one."""

    def one(t: Tensor) -> Tensor:
        d = t.detach()
        return d.requires_grad_() if t.requires_grad and t.is_floating_point() else d

    return tuple(one(t) for t in value) if isinstance(value, tuple) else one(value)


class TupleStage(PipelineStage):
    """A :class:`PipelineStage` whose boundaries may be tuples of tensors (module doc)."""

    def _inputs(self, x: Any) -> Any:
        """The stage's input as its module receives it: leaves where a gradient is carried."""
        if self.is_first:
            return x
        alone = not isinstance(x, tuple)

        def leaf(t: Tensor) -> Tensor:
            return t.detach().requires_grad_() if carries_gradient(t, alone) else t

        return tuple(leaf(t) for t in x) if isinstance(x, tuple) else leaf(x)

    def _call(self, x: Any) -> Any:
        return call_layer(self.module, x)

    def _handoff(self, out: Any) -> Any:
        return detach_boundary(out)

    # ------------------------------------------------------------ backward

    def _carried_inputs(self, rec: _InFlight) -> list[Tensor]:
        return [t for t in boundary_tensors(rec.x) if isinstance(t, Tensor) and t.requires_grad]

    def _seeds(self, rec: _InFlight, grad_out: Any) -> tuple[list[Tensor], list[Tensor | None]]:
        """The outputs to differentiate and their gradients."""
        if self.is_last:
            return [rec.out], [None]
        outs = boundary_tensors(rec.out)
        grads = boundary_tensors(grad_out) if grad_out is not None else (None,) * len(outs)
        if len(grads) != len(outs):
            raise ValueError(f"stage {self.stage_index}: {len(grads)} gradients for {len(outs)} outputs")
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _input_grads(self, rec: _InFlight, got: tuple) -> Any:
        """The input gradients to send back, shaped like the input (module doc)."""
        if self.is_first:
            return None
        got = iter(got)
        grads = []
        for t in boundary_tensors(rec.x):
            if isinstance(t, Tensor) and t.requires_grad:
                g = next(got)
                grads.append(torch.zeros_like(t) if g is None else g)
            else:
                grads.append(None)
        if not isinstance(rec.x, tuple):
            return grads[0]
        return tuple(grads)

    def _gradients(self, a, rec: _InFlight, grad_out: Any) -> tuple:
        outs, seeds = self._seeds(rec, grad_out)
        xs = self._carried_inputs(rec) if a.op is not W else []
        inputs = xs + (rec.leaves if a.op is not I else [])
        with torch.enable_grad():
            if inputs and outs:
                got = torch.autograd.grad(outs, inputs, grad_outputs=seeds, retain_graph=a.op is I, allow_unused=True)
            else:
                got = (None,) * len(inputs)
        dx = self._input_grads(rec, got[: len(xs)]) if a.op is not W else None
        return dx, got[len(xs) :]

    def _split_pass(self, a, rec: _InFlight, grad_out: Any) -> Any:
        if a.op is not I:
            return super()._split_pass(a, rec, grad_out)  # W reads only what I left
        outs, seeds = self._seeds(rec, grad_out)
        xs = self._carried_inputs(rec)
        inputs = xs + [out for _, out in rec.captured]
        with torch.enable_grad():
            if inputs and outs:
                got = torch.autograd.grad(outs, inputs, grad_outputs=seeds, retain_graph=True, allow_unused=True)
            else:
                got = (None,) * len(inputs)
        rec.captured_grads = got[len(xs) :]
        return self._backward_done(a, self._input_grads(rec, got[: len(xs)]))

    def warm_up(self, x: Any, target: Tensor | None = None) -> None:
        x = tuple(t.to(self.device) for t in x) if isinstance(x, tuple) else x.to(self.device)
        first, self.is_first = self.is_first, False  # an untimed pass: every float input a leaf
        try:
            x = self._inputs(x)
        finally:
            self.is_first = first
        with torch.enable_grad():
            leaves = self._bind(self.pool.get(self.pool.version))
            out = call_layer(self.module, x)
            if self.is_last:
                out = self.loss_fn(out, target.to(self.device))
                outs, seeds = [out], [None]
            else:
                outs = [o for o in boundary_tensors(out) if o.requires_grad]
                seeds = [torch.ones_like(o) for o in outs]
            inputs = [t for t in boundary_tensors(x) if isinstance(t, Tensor) and t.requires_grad] + leaves
            if outs:
                torch.autograd.grad(outs, inputs, grad_outputs=seeds, allow_unused=True)


def stage_class_for(model) -> type[PipelineStage]:
    """The stage ``model``'s layers run in, in the profiler and the runtime
    alike: ``PipelineStage`` for the catalog's one-tensor boundaries,
    :class:`TupleStage` (the same passes on tuples) for models from
    elsewhere (a :class:`~pipesim.validate.models.RealModel`)."""
    return PipelineStage if model.origin == "catalog" else TupleStage

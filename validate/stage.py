"""A pipeline stage that executes the IR's passes with real tensors.

:class:`PipelineStage` plays the role of torch.distributed.pipelining's
``PipelineStage``: it wraps the ``nn.Module`` of one model stage (of one
replica) on one device. Unlike torch's, it also owns what pipesim's
strategies make explicit in the schedule:

* **weight versions** in a :class:`~pipesim.kernels.VersionPool`. Every pass
  of the IR names the version it reads, so the stage announces each
  version's readers as soon as the version exists; the optimizer then
  writes in place when nobody will read the old version again (flush
  schedules, vanilla asynchronous pipelining) and into a second buffer
  otherwise (PipeDream's stash, PipeDream-2BW's double buffer). A version
  never moves while it has readers, which is what lets a forward's autograd
  graph stay valid until its backward.
* **predicted weights** (SpecTrain, PipeOptim) in one scratch buffer,
  written by ``PREDICT`` through :func:`pipesim.kernels.predict_sgd` /
  :func:`~pipesim.kernels.predict_adam`.
* **gradient accumulation and the optimizer step**, functional so the next
  version can be written out of place. Gradient scaling is explicit
  (:attr:`OptimizerConfig.scale_grads`).

How a pass reads "its" weights: every pass binds *aliases* of a buffer
(``tensor.data``, a fresh autograd version counter on the same storage) as
the module's parameters. A forward's graph therefore reads whatever that
storage holds when its backward runs, and the stage makes sure it holds the
backward's version: unchanged storage for stashing and 2BW; the live buffer,
updated in place, for vanilla PipeDream (the backward reads the current
weights, as the IR says); the prediction buffer refilled with the
backward's (version, distance) for SpecTrain. Activations saved by the
forward are not recomputed, exactly as in those systems' implementations.

Held activations (:class:`HeldActivations`): with a counter attached
(:attr:`PipelineStage.held`), every forward runs under
``torch.autograd.graph.saved_tensors_hooks`` that count the storages autograd
saves for the backward, once per storage (views of one storage are one),
the stage's weights left out (they are the weights' memory, not the
activations'). Each saved tensor is packed into a small object whose
finalizer gives its storage back to the count when autograd frees it (the
end of the backward, or the graph dropped), so the count is what the graphs
really keep, not what the schedule says they should. The counter adds the
boundary tensors a stage keeps for a pending backward (a micro-batch's
input and output, the output gradient and the gradients of its modules'
outputs held from I to W) where autograd does not save them already.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from pipesim.kernels import VersionPool, adam_coefficients, foreach, predict_adam, predict_sgd
from pipesim.sim.errors import InputError
from pipesim.sim.ir.core import PASS_OPS, PREDICT, UPDATE, Action, B, F, I, W

OPTIMIZERS = ("sgd", "adam")

#: What a forward runs under when held activations are not measured.
_NO_HOOKS = contextlib.nullcontext()


class OptimizerError(InputError):
    """An optimizer setting out of range (one line)."""


class RuntimeSemanticsError(RuntimeError):
    """The runtime cannot execute an action as the schedule states it."""


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer every stage runs, and how gradients are scaled.

    ``scale_grads`` divides the accumulated gradient of an update by the
    number of micro-batches it accumulates (m for flush schedules and 2BW,
    1 for PipeDream), so the learning rate means the same for every
    strategy; torch.distributed.pipelining's ``scale_grads`` does the same.
    Gradients all-reduced across replicas are always averaged.

    ``warmup_steps`` N warms the learning rate up linearly: a stage's update
    u (counted from 0) uses :meth:`lr_at` ``(u) = lr·min(1, u/N)``, so update
    0 applies nothing (it only feeds the optimizer's state), update N/2
    half the rate and update N on the full one (Megatron-LM's and Hugging
    Face's linear warm-up). N = 0: ``lr`` throughout, the same bits as
    without the field.
    """

    kind: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    scale_grads: bool = True
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise OptimizerError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.kind!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise OptimizerError(f"lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise OptimizerError(f"momentum must be in [0, 1), got {self.momentum}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise OptimizerError(f"warm-up steps must be a whole number >= 0, got {self.warmup_steps!r}")

    def lr_at(self, update: int) -> float:
        """The learning rate of update ``update`` (counted from 0): ``lr``
        once the warm-up is over, ``lr·update/warmup_steps`` before."""
        if update >= self.warmup_steps:
            return self.lr
        return self.lr * max(update, 0) / self.warmup_steps

    def lr_ahead(self, done: int, distance: int) -> float:
        """The learning rate a prediction ``distance`` updates ahead uses after
        ``done`` updates: the mean of the next ``distance`` updates' rates,
        so that distance·lr_ahead is the sum of the rates those updates
        apply (SpecTrain's Ŵ = W − s·lr·v with the schedule's lr). ``lr``
        once the warm-up is over, bit for bit."""
        if done >= self.warmup_steps or distance < 1 or distance != int(distance):
            return self.lr_at(done)
        n = int(distance)
        return math.fsum(self.lr_at(done + j) for j in range(n)) / n


def _reads_stored(a: Action) -> bool:
    """Whether ``a`` reads a stored version: a pass does unless it computes
    on predicted weights, which the PREDICT that made them read instead."""
    return (a.op in PASS_OPS and not a.distance) or a.op is PREDICT


class _Saved:
    """A tensor autograd saved, packed by :class:`HeldActivations`: while it
    lives, its storage counts; freeing it (autograd drops what it saved)
    gives the storage back."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: Tensor, key: int, owner: HeldActivations):
        self.tensor = tensor
        self.key = key
        self.owner = owner

    def __del__(self):
        self.owner._drop(self.key)


def _storage(t: Tensor) -> tuple[int, int]:
    """(key, bytes) of ``t``'s storage: views of one storage share the key."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class HeldActivations:
    """Bytes one device holds for its pending backwards, measured from the
    tensors themselves (module doc), and their peak.

    :meth:`hooks` wraps a forward; :meth:`sample` (after each compute action,
    where the level can have risen: after a forward, and after an input
    gradient that keeps gradients for its W) adds the boundary tensors the
    device's stages keep in flight and records the peak. ``live`` is what
    autograd's saved tensors hold now, each storage once."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage key -> [saved tensors alive, bytes]
        self._skip: frozenset = frozenset()  # ids of the forward's weight leaves

    def hooks(self, leaves: list[Tensor]):
        """The ``saved_tensors_hooks`` of a forward whose weights are ``leaves``."""
        self._skip = frozenset(map(id, leaves))
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: Tensor):
        base = t._base if t._base is not None else t
        if id(base) in self._skip:
            return t  # a weight, or a view of one: weights are counted as weights
        key, nbytes = _storage(t)
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, nbytes]
            self.live += nbytes
        else:
            ref[0] += 1
        # detached: a node that saves its own output (ReLU, softmax) would
        # otherwise keep itself alive through its output's grad_fn, a cycle
        # with a C++ node that Python's collector cannot break (a graph kept
        # by retain_graph, zero bubble's I and W, would never be freed);
        # autograd rebuilds the unpacked tensor's history from its own record
        return _Saved(t.detach(), key, self)

    def _drop(self, key: int) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if not ref[0]:
            del self._refs[key]
            self.live -= ref[1]

    def level(self, stages) -> int:
        """What the device holds now: the saved storages, and every in-flight
        boundary tensor of ``stages`` whose storage autograd did not save."""
        seen: set[int] = set()
        extra = 0
        refs = self._refs
        for st in stages:
            for rec in st.inflight.values():
                for t in rec.kept():
                    key, nbytes = _storage(t)
                    if key not in refs and key not in seen:
                        seen.add(key)
                        extra += nbytes
        return self.live + extra

    def sample(self, stages) -> int:
        """Record the level now (see :meth:`level`); returns it."""
        now = self.level(stages)
        if now > self.peak:
            self.peak = now
        return now


def _unpack(packed):
    return packed.tensor if type(packed) is _Saved else packed


def _tensors(value) -> list[Tensor]:
    """The tensors of a boundary value (a tensor, a tuple with Nones, or None)."""
    if value is None:
        return []
    if isinstance(value, Tensor):
        return [value]
    return [t for t in value if isinstance(t, Tensor)]


@dataclass
class _InFlight:
    """A micro-batch between its forward and its last backward pass."""

    x: Tensor  # the stage input (a leaf that requires grad when it is a float activation)
    out: Tensor  # the stage output, or the loss on the last stage
    leaves: list[Tensor]  # weight aliases the graph was built on
    buffer: list[Tensor]  # the storage those aliases share
    version: int
    distance: int
    grad_out: Tensor | None = None  # kept between I and W when no outputs were captured
    #: (owner index, gradient edge of its output) of every module with
    #: parameters, in forward order, when the stage splits its backward (see
    #: PipelineStage.split_backward); an edge holds none of the output's storage
    captured: list | None = None
    #: their gradients, from I, for W
    captured_grads: tuple | None = None

    def kept(self) -> list[Tensor]:
        """Every tensor this record keeps for the backward still to come."""
        out = _tensors(self.x) + _tensors(self.out) + _tensors(self.grad_out)
        if self.captured_grads is not None:
            out += [g for g in self.captured_grads if g is not None]
        return out


def _bind_targets(module: nn.Module) -> tuple[list[str], list[tuple[nn.Module, str]], list[Tensor]]:
    names, slots, params = [], [], []
    for name, p in module.named_parameters():
        owner_name, _, attr = name.rpartition(".")
        names.append(name)
        slots.append((module.get_submodule(owner_name) if owner_name else module, attr))
        params.append(p)
    return names, slots, params


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages`` (of replica ``replica``), wrapping ``module``.

    The module's parameters become version 0 (copied, so the caller's module
    is left as it was). ``loss_fn`` is applied on the last stage.
    """

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str = "cpu",
        *,
        replica: int = 0,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    ):
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} outside 0..{num_stages - 1}")
        self.device = torch.device(device)
        self.module = module.to(self.device)
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.replica = replica
        self.loss_fn = loss_fn
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        if self.is_last and loss_fn is None:
            raise ValueError("the last stage needs a loss_fn")
        self.names, self._slots, params = _bind_targets(self.module)
        # the modules that own parameters, and which leaves each owns (see split_backward)
        self._owners: list[nn.Module] = []
        self._owned: list[list[int]] = []
        for i, (owner, _) in enumerate(self._slots):
            k = next((j for j, o in enumerate(self._owners) if o is owner), None)
            if k is None:
                self._owners.append(owner)
                self._owned.append([])
                k = len(self._owners) - 1
            self._owned[k].append(i)
        self._hooks: list | None = None
        self._capture: list | None = None  # outputs of the forward running now, when splitting
        self.split_backward = False
        with torch.no_grad():
            weights = [p.detach().clone() for p in params]
        self.pool = VersionPool(weights)
        # gradients live in one flat buffer when they can, so a collective
        # ships and reduces them in place, without gathering and scattering
        self.grad_flat, self.grads = _gradient_buffer(weights, self.device)
        self.accumulated = 0  # micro-batches in self.grads since the last update
        # (grad_flat, grads, accumulated) a REDUCE_GRAD closed for the next
        # UPDATE; backwards meanwhile accumulate into a second buffer, made
        # the first time one is needed and kept for the next time
        self.closed: tuple | None = None
        self._spare: tuple | None = None
        self.optim: OptimizerConfig | None = None
        self.state: dict[str, list[Tensor]] = {}
        self.steps = 0
        self.scratch: list[Tensor] | None = None
        self.scratch_key: tuple[int, int] | None = None
        self.inflight: dict[int, _InFlight] = {}
        self.reads: Counter = Counter()  # version -> announced reads not yet made
        self.pending: set[Action] = set()  # the actions behind ``reads``
        # outputs made here whose consumer runs in a later part of a stream
        # (a DeviceExecutor parks them at the end of its walk and takes them back)
        self.parked: dict[tuple, Tensor] = {}
        self.losses: dict[int, Tensor] = {}  # micro-batch -> loss (last stage)
        self.versions_used: list[tuple[str, int, int, int]] = []  # (op, mb, version, distance)
        self.unscheduled_predictions = 0
        #: the device's held-activation counter, when the run measures them
        #: (:class:`HeldActivations`; the executor attaches it)
        self.held: HeldActivations | None = None

    # ------------------------------------------------------------ set-up

    @property
    def key(self) -> tuple[int, int]:
        return (self.replica, self.stage_index)

    @property
    def num_params(self) -> int:
        return len(self.grads)

    def prepare(self, actions: list[Action], optim: OptimizerConfig) -> None:
        """Read this stage's actions: who reads which version, and the optimizer.

        May be called again as a stream goes on (``PipelineSchedule.step``
        announces the reads of the parts to come before it runs one): an
        action is counted once however often it is told, until it has read,
        and reads of a version that exists already are announced to it at
        once (later versions get theirs when they are made)."""
        self.optim = optim
        if any(a.op is I or a.op is W for a in actions):
            self.split_backward = True
        new: Counter = Counter()
        for a in actions:
            if _reads_stored(a) and a not in self.pending:
                self.pending.add(a)
                new[a.version] += 1
        self.reads.update(new)
        for version, n in sorted(new.items()):
            if version <= self.pool.version:
                if version not in self.pool.held:
                    raise RuntimeSemanticsError(
                        f"stage {self.stage_index}: {n} reads of version {version} announced after it was "
                        f"overwritten (held: {self.pool.held})"
                    )
                self.pool.expect(version, n)

    def withdraw(self, keep) -> None:
        """Forget the announced reads of every action not in ``keep``: a
        stream drained early (``PipelineSchedule.flush``) never runs the
        parts whose reads were announced ahead, and a version they held
        would otherwise never be written in place or freed."""
        for a in sorted(self.pending - set(keep)):
            self.pending.discard(a)
            self.reads[a.version] -= 1
            if a.version <= self.pool.version:
                self.pool.release(a.version)

    def _announce(self, version: int) -> None:
        n = self.reads.get(version, 0)
        if n:
            self.pool.expect(version, n)

    def weights(self, version: int | None = None) -> list[Tensor]:
        """The tensors of a held version (default: current)."""
        return self.pool.get(self.pool.version if version is None else version)

    def state_dict(self) -> dict[str, Tensor]:
        """Current weights by parameter name (copies)."""
        return {n: t.detach().clone() for n, t in zip(self.names, self.weights())}

    # ------------------------------------------------------------ passes

    def _bind(self, buffer: list[Tensor]) -> list[Tensor]:
        leaves = [t.data.requires_grad_() for t in buffer]
        for (owner, attr), leaf in zip(self._slots, leaves):
            owner._parameters[attr] = leaf
        return leaves

    def _read(self, a: Action) -> list[Tensor]:
        """The buffer pass ``a`` computes on, with its (version, distance) in it."""
        if a.distance == 0:
            try:
                return self.pool.get(a.version)
            except KeyError:
                raise RuntimeSemanticsError(f"{a}: version {a.version} is not held (held: {self.pool.held})") from None
        if self.scratch_key != (a.version, a.distance):
            self.unscheduled_predictions += 1
            self._predict_into_scratch(a.version, a.distance)
        return self.scratch

    def _done_reading(self, a: Action) -> None:
        if _reads_stored(a):
            self.reads[a.version] -= 1
            self.pending.discard(a)
            self.pool.release(a.version)

    def _inputs(self, x: Tensor) -> Tensor:
        """The stage's input as its module receives it: a leaf that requires
        a gradient where one is sent back (every stage but the first)."""
        if x.is_floating_point() and not self.is_first:
            return x.detach().requires_grad_()
        return x

    def _call(self, x: Tensor) -> Tensor:
        return self.module(x)

    def _handoff(self, out: Tensor) -> Tensor:
        """What the next stage receives: the output, detached."""
        return out.detach()

    def forward(self, a: Action, x: Tensor, target: Tensor | None = None) -> Tensor:
        """Run F; returns the output to send on (detached), or the loss on the last stage.
        (:class:`~pipesim.validate.boundary.TupleStage` passes tuples through
        :meth:`_inputs`, :meth:`_call` and :meth:`_handoff`.)"""
        buffer = self._read(a)
        x = self._inputs(x)
        captured = self._start_capture() if self.split_backward else None
        try:
            with torch.enable_grad():
                leaves = self._bind(buffer)
                with self.held.hooks(leaves) if self.held is not None else _NO_HOOKS:
                    out = self._call(x)
                    if self.is_last:
                        out = self.loss_fn(out, target)
        finally:
            self._capture = None
        self._done_reading(a)
        if captured is not None:
            # W needs each output's place in the graph, not its values: an
            # edge keeps no storage, so an output autograd does not save
            # itself (logits before the loss) is freed now instead of at W
            captured = [(k, get_gradient_edge(t)) for k, t in captured]
        self.inflight[a.microbatch] = _InFlight(x, out, leaves, buffer, a.version, a.distance, captured=captured)
        self.versions_used.append(("F", a.microbatch, a.version, a.distance))
        if self.is_last:
            self.losses[a.microbatch] = out.detach()
            return out.detach()
        return self._handoff(out)

    def _graph_reads(self, a: Action, rec: _InFlight) -> None:
        """Make the storage the forward's graph points at hold ``a``'s weights."""
        if a.distance == 0 and rec.distance == 0:
            want = self._read(a)
            if want is rec.buffer or all(w.data_ptr() == r.data_ptr() for w, r in zip(want, rec.buffer)):
                return
            raise RuntimeSemanticsError(
                f"{a}: its forward computed on version {rec.version}, whose buffer no longer holds "
                f"version {a.version}; the schedule needs this version stashed or read in place"
            )
        if rec.buffer is not self.scratch:
            raise RuntimeSemanticsError(
                f"{a}: backward with prediction distance {a.distance} after a forward on stored "
                f"version {rec.version}: not executable without recomputing the forward"
            )
        if self.scratch_key != (a.version, a.distance):
            self._predict_into_scratch(a.version, a.distance)

    def backward(self, a: Action, grad_out: Tensor | None) -> Tensor | None:
        """Run B (input and weight gradients), I (input only) or W (weights only).

        Returns the input gradient to send back (None on stage 0 and for W).
        """
        rec = self.inflight[a.microbatch]
        self._graph_reads(a, rec)
        if rec.captured is not None and a.op is not B:
            return self._split_pass(a, rec, grad_out)
        if a.op is W:
            grad_out = rec.grad_out
        dx, weight_grads = self._gradients(a, rec, grad_out)
        if a.op is not I:
            self._accumulate(weight_grads)
            del self.inflight[a.microbatch]
        else:
            rec.grad_out = grad_out
        return self._backward_done(a, dx)

    def _gradients(self, a: Action, rec: _InFlight, grad_out: Tensor | None) -> tuple:
        """(input gradient or None, weight gradients) of ``a``'s pass over
        ``rec``'s graph: B both, I the input's only, W the weights' only."""
        with torch.enable_grad():
            want_x = a.op is not W and rec.x.requires_grad
            want_w = a.op is not I
            inputs = ([rec.x] if want_x else []) + (rec.leaves if want_w else [])
            if inputs:
                got = torch.autograd.grad(
                    rec.out, inputs, grad_outputs=grad_out, retain_graph=a.op is I, allow_unused=True
                )
            else:
                got = ()
        return (got[0] if want_x else None), (got[1:] if want_x else got)

    def _backward_done(self, a: Action, dx: Tensor | None) -> Tensor | None:
        self._done_reading(a)
        self.versions_used.append((a.op.value, a.microbatch, a.version, a.distance))
        return dx

    def _accumulate(self, weight_grads) -> None:
        """Add one micro-batch's weight gradients (None: unused) to the buffer."""
        if self.closed is not None and self.grads is self.closed[1]:
            self._second_gradient_buffer()
        with torch.no_grad():
            for acc, g in zip(self.grads, weight_grads):
                if g is not None:
                    acc.add_(g)
        self.accumulated += 1

    # ------------------------------------------------- split backward (I, W)

    def _start_capture(self) -> list:
        """Record the output of every module that owns parameters during the
        forward about to run (hooks installed the first time)."""
        if self._hooks is None:
            self._hooks = [m.register_forward_hook(self._make_hook(k)) for k, m in enumerate(self._owners)]
        self._capture = []
        return self._capture

    def _make_hook(self, k: int):
        def hook(_module, _inputs, output):
            if self._capture is not None and isinstance(output, Tensor) and output.requires_grad:
                self._capture.append((k, output))

        return hook

    def _split_pass(self, a: Action, rec: _InFlight, grad_out: Tensor | None) -> Tensor | None:
        """I or W of a micro-batch whose forward captured its modules' outputs.

        I runs the backward once for the input's gradient and the gradient
        of each captured output; W turns each of those into its module's
        weight gradients, a walk through that module's own operations only
        (a linear layer's weight gradient is one product). So I and W split
        one backward's work, as zero-bubble schedules assume, instead of W
        walking the whole backward again from the stage's output."""
        if a.op is I:
            want_x = rec.x.requires_grad
            inputs = ([rec.x] if want_x else []) + [edge for _, edge in rec.captured]
            with torch.enable_grad():
                got = (
                    torch.autograd.grad(rec.out, inputs, grad_outputs=grad_out, retain_graph=True, allow_unused=True)
                    if inputs
                    else ()
                )
            rec.captured_grads = got[1:] if want_x else got
            return self._backward_done(a, got[0] if want_x else None)
        sums: list[Tensor | None] = [None] * len(rec.leaves)
        with torch.enable_grad():
            for (k, edge), g in zip(rec.captured, rec.captured_grads):
                if g is None:
                    continue
                owned = self._owned[k]
                grads = torch.autograd.grad(
                    [edge], [rec.leaves[i] for i in owned], grad_outputs=[g], retain_graph=True, allow_unused=True
                )
                for i, gi in zip(owned, grads):
                    if gi is not None:
                        sums[i] = gi if sums[i] is None else sums[i] + gi
        self._accumulate(sums)
        del self.inflight[a.microbatch]
        return self._backward_done(a, None)

    def warm_up(self, x: Tensor, target: Tensor | None = None) -> None:
        """One forward and backward that change nothing: the first pass of a
        process pays for lazy initialisation (autograd's engine, allocator
        pools, kernel selection), which a timed run should not mistake for
        the schedule's cost."""
        x = x.to(self.device)
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        with torch.enable_grad():
            leaves = self._bind(self.pool.get(self.pool.version))
            out = self.module(x)
            if self.is_last:
                out = self.loss_fn(out, target.to(self.device))
            inputs = ([x] if x.requires_grad else []) + leaves
            torch.autograd.grad(
                out, inputs, grad_outputs=None if self.is_last else torch.ones_like(out), allow_unused=True
            )

    # ------------------------------------------------------------ weights

    def _predict_into_scratch(self, version: int, distance: int) -> None:
        if version != self.pool.version:
            raise RuntimeSemanticsError(
                f"stage {self.stage_index}: prediction from version {version}, but the current "
                f"version is {self.pool.version} (predictions start from the live weights)"
            )
        src = self.pool.get(version)
        if self.scratch is None:
            self.scratch = [torch.empty_like(t) for t in src]
        opt = self.optim
        lr = opt.lr_ahead(self.steps, distance)  # the rates of the updates predicted, warm-up included
        if opt.kind == "sgd" and "momentum" in self.state:
            predict_sgd(src, self.state["momentum"], lr, distance, out=self.scratch)
        elif opt.kind == "adam" and self.steps:
            predict_adam(
                src,
                self.state["exp_avg"],
                self.state["exp_avg_sq"],
                self.steps,
                lr,
                opt.betas,
                opt.eps,
                distance,
                out=self.scratch,
            )
        else:  # no optimizer state yet: nothing moves the weights
            foreach.copy(self.scratch, src)
        self.scratch_key = (version, distance)

    def predict(self, a: Action) -> None:
        """PREDICT: the scratch buffer gets the weights ``a.distance`` updates ahead."""
        self._predict_into_scratch(a.version, a.distance)
        self._done_reading(a)

    def close_gradients(self) -> None:
        """REDUCE_GRAD: the gradients accumulated so far are the ones it
        reduces and the next UPDATE applies; backwards before that UPDATE
        accumulate into a second buffer (see :mod:`pipesim.sim.ir.core`)."""
        if self.closed is not None:
            raise RuntimeSemanticsError(
                f"stage {self.stage_index} replica {self.replica}: REDUCE_GRAD before the "
                "UPDATE of the gradients the previous one closed"
            )
        self.closed = (self.grad_flat, self.grads, self.accumulated)
        self.accumulated = 0

    def _second_gradient_buffer(self) -> None:
        if self._spare is None:
            self._spare = _gradient_buffer(self.grads, self.device)
        self.grad_flat, self.grads = self._spare
        self._spare = None

    def update(self, a: Action) -> None:
        """UPDATE: apply the accumulated gradient (what the last REDUCE_GRAD
        closed, if one did), producing version ``a.version``."""
        if a.version != self.pool.version + 1:
            raise RuntimeSemanticsError(f"{a}: produces version {a.version} but the current one is {self.pool.version}")
        opt = self.optim
        closed = self.closed
        grads, accumulated = (closed[1], closed[2]) if closed is not None else (self.grads, self.accumulated)
        with torch.no_grad():
            if opt.scale_grads and accumulated > 1:
                torch._foreach_div_(grads, float(accumulated))
            self.steps += 1
            if opt.kind == "sgd":
                self._sgd(grads)
            else:
                self._adam(grads)
        self.pool.update(self._write)
        self._announce(self.pool.version)
        with torch.no_grad():
            torch._foreach_zero_(grads)
        if closed is None:
            self.accumulated = 0
        else:
            self.closed = None
            if grads is not self.grads:  # backwards ran meanwhile: the applied buffer is the spare now
                self._spare = (closed[0], grads)
        if self.scratch_key is not None:
            self.scratch_key = None  # predictions were relative to the old weights

    def _sgd(self, grads: list[Tensor]) -> None:
        opt = self.optim
        if opt.momentum:
            if "momentum" not in self.state:
                self.state["momentum"] = [g.clone() for g in grads]
            else:
                buf = self.state["momentum"]
                torch._foreach_mul_(buf, opt.momentum)
                torch._foreach_add_(buf, grads)
            step = self.state["momentum"]
        else:
            step = grads
        self._pending = (step, -opt.lr_at(self.steps - 1))  # self.steps counts this update

    def _adam(self, grads: list[Tensor]) -> None:
        opt = self.optim
        b1, b2 = opt.betas
        if "exp_avg" not in self.state:
            self.state["exp_avg"] = [torch.zeros_like(g) for g in grads]
            self.state["exp_avg_sq"] = [torch.zeros_like(g) for g in grads]
        m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
        torch._foreach_lerp_(m, grads, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
        lr = opt.lr_at(self.steps - 1)  # self.steps counts this update
        self._pending = ("adam",) + adam_coefficients(self.steps, lr, opt.betas, opt.eps, 1.0)

    def _write(self, dst: list[Tensor], src: list[Tensor]) -> None:
        pending = self._pending
        if pending[0] == "adam":
            _, c, eps = pending
            foreach.adam_apply(dst, src, self.state["exp_avg"], self.state["exp_avg_sq"], c, eps)
        else:
            step, alpha = pending
            foreach.axpy(dst, src, step, alpha)


def _gradient_buffer(like: list[Tensor], device) -> tuple[Tensor | None, list[Tensor]]:
    """Zeroed gradients shaped like ``like``: views of one flat buffer when
    the dtypes agree (a collective then ships and reduces them in place,
    without gathering and scattering), else separate tensors."""
    if like and all(w.dtype == like[0].dtype for w in like):
        flat_ = torch.zeros(sum(w.numel() for w in like), dtype=like[0].dtype, device=device)
        grads, i = [], 0
        for w in like:
            grads.append(flat_[i : i + w.numel()].view_as(w))
            i += w.numel()
        return flat_, grads
    return None, [torch.zeros_like(w) for w in like]


#: Action types a stage executes itself (collectives and transfers are the executor's).
STAGE_OPS = frozenset({F, B, I, W, UPDATE, PREDICT})

"""Per-layer cost profiles: what one micro-batch costs on each layer.

A :class:`Profile` is the only description of a model the simulator needs:
per layer, the forward and backward time of one micro-batch, the parameter
bytes, the bytes sent to the next layer and the bytes kept for the backward.
Profiles come from the built-in catalog (:mod:`pipesim.sim.workloads.catalog`, computed
from each architecture's FLOPs and sizes on a device) or from a JSON file a
user measured (``--profile FILE``), so a real model can be simulated without
pipesim knowing its architecture. ``--profile`` also reads PipeDream's
``graph.txt`` profiles (:mod:`pipesim.sim.workloads.pipedream_graph`).

JSON form (times in seconds, sizes in bytes, per micro-batch)::

    {
      "name": "my-model",
      "microbatch_size": 8,
      "optimizer": "adam",
      "notes": "measured on one A100, bf16",
      "layers": [
        {"name": "embed", "forward_s": 0.0004, "backward_s": 0.0008,
         "param_bytes": 205852672, "activation_bytes": 16777216,
         "stash_bytes": 0},
        {"name": "block0", "forward_s": 0.0021, "backward_s": 0.0042,
         "backward_input_s": 0.0023, "param_bytes": 100663296,
         "activation_bytes": 16777216, "stash_bytes": 285212672}
      ]
    }

``backward_input_s`` is optional (see :attr:`LayerCost.backward_input`).
An optional ``"precision"`` says how many bytes per parameter each copy of
the weights takes (:class:`Precision`; each 1, 2, 4 or 8), for mixed
precision::

    "precision": {"weight_bytes": 2, "gradient_bytes": 2, "master_bytes": 4}

``weight_bytes``: the weights the passes read (and a stashed version of
them); ``gradient_bytes``: the gradients, which a replicated stage
all-reduces; ``master_bytes``: the master weights the optimizer updates and
each of its state buffers. A layer's ``param_bytes`` counts its weights at
``master_bytes`` per parameter (a whole number of them), and the other
copies are scaled from it. Without ``"precision"`` every copy has the width
``param_bytes`` was counted at (one precision throughout, as in fp32
training: :data:`FP32`), and any byte count is accepted.
Numbers are checked where they enter (a file, or building a
:class:`LayerCost` / :class:`Profile`): times are finite seconds in
``[0, MAX_SECONDS]``, sizes whole bytes in ``[0, MAX_BYTES]`` (a profile's
total weights and total stash too), ``microbatch_size`` an integer in
``[1, MAX_MICROBATCH_SIZE]``; booleans and strings are not numbers. The
bounds are far beyond any real model and are what keeps every sum the
simulator forms finite and inside int64 (see each constant).
An optional ``"overhead": {"forward_s": ..., "backward_s": ...}`` is a fixed
cost per *stage* pass (a runtime's dispatch and autograd bookkeeping, kernel
launches) that per-layer timings cannot carry: timing each layer alone would
charge it once per layer. ``pipesim profile`` measures it; every stage pays it
once per forward and once per backward pass (each half of a split backward
pays it too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from pipesim.sim.errors import InputError
from pipesim.sim.limits import MAX_BYTES, bytes_problem, is_number, seconds_problem, shown

#: Optimizer state kept per weight byte: SGD with momentum keeps one
#: momentum buffer, Adam two moments.
OPTIMIZER_STATE_MULTIPLIER = {"sgd": 1, "adam": 2}

#: Most samples per micro-batch: 2**31. Catalog costs scale with it, and a
#: bounded product keeps FLOP and byte counts convertible to float.
MAX_MICROBATCH_SIZE = 2**31


class WorkloadError(InputError):
    """A profile, catalog name or partition request is invalid."""


#: The widths a :class:`Precision` field may take, in bytes per parameter.
PRECISION_WIDTHS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each copy of a model's weights.

    ``weight_bytes``: the weights the forward and backward passes read, and
    every older version a schedule keeps for a later pass (a stash);
    ``gradient_bytes``: the gradients the backward makes, which a replicated
    stage's REDUCE_GRAD all-reduces; ``master_bytes``: the master weights the
    optimizer updates and each of its state buffers (momentum, Adam's two
    moments).

    A layer's ``param_bytes`` counts its weights at ``master_bytes`` each;
    :meth:`weights` and :meth:`gradients` scale it to the other widths. Where
    the passes read weights of another width than the master's, a separate
    master copy is kept (:meth:`master_copy`); otherwise the passes read the
    master itself. Mixed-precision Adam (:data:`MIXED_16BIT`) holds 2 + 2 + 4
    + 4 + 4 = 16 bytes per parameter, momentum SGD 12 (Rajbhandari et al.
    2020, "ZeRO", section 3.1): what one precision throughout holds at 4
    bytes, so only what crosses a link and what a stash holds change.
    """

    weight_bytes: int = 4
    gradient_bytes: int = 4
    master_bytes: int = 4

    def __post_init__(self) -> None:
        for name in _PRECISION_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v not in PRECISION_WIDTHS:
                raise WorkloadError(f"precision.{name} must be 1, 2, 4 or 8 (bytes per parameter), got {shown(v)}")

    @property
    def uniform(self) -> bool:
        """Every copy at one width: the sizes are ``param_bytes`` whatever it was counted at."""
        return self.weight_bytes == self.gradient_bytes == self.master_bytes

    def weights(self, param_bytes: int) -> int:
        """Bytes of the passes' weights of ``param_bytes`` counted at the master's width."""
        return param_bytes * self.weight_bytes // self.master_bytes

    def gradients(self, param_bytes: int) -> int:
        """Bytes of the gradients of ``param_bytes`` counted at the master's width."""
        return param_bytes * self.gradient_bytes // self.master_bytes

    @property
    def separate_master(self) -> bool:
        """Whether a master copy is kept beside the passes' weights (their widths differ)."""
        return self.weight_bytes != self.master_bytes

    def master_copy(self, param_bytes: int) -> int:
        """Bytes of a master copy kept beside the passes' weights: ``param_bytes``
        when the two widths differ, 0 when the passes read the master itself."""
        return param_bytes if self.separate_master else 0

    def ratios(self) -> tuple[float, float, float]:
        """The passes' weights, the gradients and the separate master copy
        per byte of ``param_bytes``, for sums over layer ranges (powers of
        two, so the products are exact)."""
        return (
            self.weight_bytes / self.master_bytes,
            self.gradient_bytes / self.master_bytes,
            1.0 if self.separate_master else 0.0,
        )

    def to_json(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _PRECISION_FIELDS}

    @classmethod
    def from_json(cls, d: Any) -> Precision:
        """Validate and build; :class:`WorkloadError` naming the field on bad input."""
        if not isinstance(d, dict):
            raise WorkloadError(f"'precision' must be an object with {', '.join(_PRECISION_FIELDS)}")
        extra = sorted(set(d) - set(_PRECISION_FIELDS))
        if extra:
            raise WorkloadError(f"precision: unknown field {extra[0]!r} (known: {', '.join(_PRECISION_FIELDS)})")
        missing = [k for k in _PRECISION_FIELDS if k not in d]
        if missing:
            raise WorkloadError(f"precision: missing field {missing[0]!r}")
        return cls(**d)


_PRECISION_FIELDS = ("weight_bytes", "gradient_bytes", "master_bytes")

#: One precision throughout (every copy at the width ``param_bytes`` counts):
#: a profile's default, and fp32 training.
FP32 = Precision()
#: Mixed precision as Megatron-LM and apex's AMP (O2) train: 16-bit (fp16
#: or bf16) weights for the passes and 16-bit gradients, fp32 master weights
#: and optimizer state.
MIXED_16BIT = Precision(weight_bytes=2, gradient_bytes=2, master_bytes=4)


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer for one micro-batch.

    ``backward_s`` is the full backward (input and weight gradients).
    ``backward_input_s`` splits it for zero-bubble schedules; when it is None
    the split defaults to half and half for a layer with parameters (the
    input-gradient and weight-gradient GEMMs of a linear or convolutional
    layer cost the same FLOPs) and all-input for a layer without parameters
    (it has no weight gradient).

    ``w_held_bytes``: what a split backward's input-gradient pass (I) leaves
    held for the weight-gradient pass (W) beyond the stash, which W still
    reads: the gradients of the layer's outputs that W multiplies with its
    inputs (a linear layer of n outputs: n values a sample). Held from the
    end of I to the end of W; 0 where it is not measured (the catalog's
    analytic layers), as an unsplit backward holds nothing extra.

    ``fixed_forward_s`` / ``fixed_backward_s`` say how much of ``forward_s`` /
    ``backward_s`` is fixed per pass whatever the layer's work (kernel
    launches: :attr:`DeviceSpec.kernel_overhead_s` times the kernels the
    layer launches, :mod:`pipesim.sim.workloads.catalog`). They are already inside the
    two times; they only tell a strategy that splits a layer's work over
    devices (tensor parallelism) which part every device still pays in full.

    ``recomputed``: what activation recomputation does with the layer. True
    (the default): it is checkpointed, keeping only its input between the
    passes and running its forward again before its backward. False: it
    keeps its whole stash and runs once, as the layers outside Megatron-LM's
    checkpointed transformer blocks do (the embedding and the LM head with
    its loss, whose saved softmax is the largest stash of a GPT's last
    stage).
    """

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int
    activation_bytes: int
    stash_bytes: int
    backward_input_s: float | None = None
    fixed_forward_s: float = 0.0
    fixed_backward_s: float = 0.0
    w_held_bytes: int = 0
    recomputed: bool = True

    def __post_init__(self) -> None:
        problem = _layer_problem(self)
        if problem:
            raise WorkloadError(f"layer {self.name!r}: {problem}")

    @property
    def backward_input(self) -> float:
        """Input-gradient time, with the default split applied."""
        if self.backward_input_s is not None:
            return self.backward_input_s
        return self.backward_s / 2 if self.param_bytes else self.backward_s

    @property
    def backward_weight(self) -> float:
        """Weight-gradient time: the rest of the backward."""
        return self.backward_s - self.backward_input

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
        }
        if self.backward_input_s is not None:
            d["backward_input_s"] = self.backward_input_s
        if self.fixed_forward_s or self.fixed_backward_s:
            d.update(fixed_forward_s=self.fixed_forward_s, fixed_backward_s=self.fixed_backward_s)
        d.update(
            param_bytes=self.param_bytes,
            activation_bytes=self.activation_bytes,
            stash_bytes=self.stash_bytes,
        )
        if self.w_held_bytes:
            d["w_held_bytes"] = self.w_held_bytes
        if not self.recomputed:
            d["recomputed"] = False
        return d


def check_microbatch_size(v: Any, where: str = "") -> int:
    """``v`` as samples per micro-batch; :class:`WorkloadError` unless an integer in [1, MAX_MICROBATCH_SIZE]."""
    if isinstance(v, bool) or not isinstance(v, int) or not (1 <= v <= MAX_MICROBATCH_SIZE):
        raise WorkloadError(f"{where}microbatch_size must be an integer >= 1 and <= 2**31, got {shown(v)}")
    return v


def _layer_problem(layer: LayerCost) -> str | None:
    if not isinstance(layer.name, str) or not layer.name:
        return "name must be a non-empty string"
    for attr in ("forward_s", "backward_s"):
        problem = seconds_problem(attr, getattr(layer, attr))
        if problem:
            return problem
    for attr in ("param_bytes", "activation_bytes", "stash_bytes", "w_held_bytes"):
        problem = bytes_problem(attr, getattr(layer, attr))
        if problem:
            return problem
    bi = layer.backward_input_s
    if bi is not None and (not is_number(bi) or not (0 <= bi <= layer.backward_s)):
        return f"backward_input_s must be between 0 and backward_s ({layer.backward_s}), got {bi!r}"
    for fixed, total in (("fixed_forward_s", "forward_s"), ("fixed_backward_s", "backward_s")):
        v, most = getattr(layer, fixed), getattr(layer, total)
        if not is_number(v) or not (0 <= v <= most):
            return f"{fixed} must be between 0 and {total} ({most}), got {shown(v)}"
    if not isinstance(layer.recomputed, bool):
        return f"recomputed must be true or false, got {shown(layer.recomputed)}"
    return None


@dataclass(frozen=True)
class Profile:
    """A model as a sequence of layer costs, plus what the costs assume.

    ``microbatch_size`` is the samples per micro-batch the costs were taken
    at (for throughput; costs are not rescaled). ``optimizer`` decides the
    optimizer state held per weight (:data:`OPTIMIZER_STATE_MULTIPLIER`).
    ``precision``: the width of each copy of the weights (:class:`Precision`;
    by default one width throughout). ``tensor_parallel``: the layers are
    one device's shard of d-way tensor parallelism (times, weights and
    stashes per shard; activations whole, as the all-reduce leaves them on
    every rank), as a catalog model on a device with the GEMM shape model
    prices its sharded GEMMs; 1 (the default) is the whole model, which
    tensor parallelism divides itself.
    """

    name: str
    layers: tuple[LayerCost, ...]
    microbatch_size: int = 1
    optimizer: str = "sgd"
    notes: str = ""
    #: fixed seconds per stage pass, on top of its layers (see the module doc)
    overhead_forward_s: float = 0.0
    overhead_backward_s: float = 0.0
    precision: Precision = FP32
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        tp = self.tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 2**20:
            raise WorkloadError(f"profile {self.name!r}: tensor_parallel must be an integer >= 1, got {tp!r}")
        for name in ("overhead_forward_s", "overhead_backward_s"):
            problem = seconds_problem(name, getattr(self, name))
            if problem:
                raise WorkloadError(f"profile {self.name!r}: {problem}")
        if not isinstance(self.name, str) or not self.name:
            raise WorkloadError("a profile needs a non-empty name")
        if not self.layers:
            raise WorkloadError(f"profile {self.name!r} has no layers")
        for layer in self.layers:
            if not isinstance(layer, LayerCost):
                raise WorkloadError(f"profile {self.name!r}: layers must be LayerCost, got {type(layer).__name__}")
        check_microbatch_size(self.microbatch_size, f"profile {self.name!r}: ")
        if not isinstance(self.optimizer, str) or self.optimizer not in OPTIMIZER_STATE_MULTIPLIER:
            raise WorkloadError(
                f"profile {self.name!r}: optimizer must be one of {', '.join(OPTIMIZER_STATE_MULTIPLIER)}, "
                f"got {self.optimizer!r}"
            )
        for attr in ("param_bytes", "stash_bytes"):  # a stage may hold every layer
            total = sum(getattr(layer, attr) for layer in self.layers)
            if total > MAX_BYTES:
                raise WorkloadError(
                    f"profile {self.name!r}: the layers' {attr} add up to {total}, more than 2**53 bytes"
                )
        self._check_precision()

    def _check_precision(self) -> None:
        pr = self.precision
        if not isinstance(pr, Precision):
            raise WorkloadError(f"profile {self.name!r}: precision must be a Precision, got {type(pr).__name__}")
        if pr.uniform:
            return
        for layer in self.layers:
            if layer.param_bytes % pr.master_bytes:
                raise WorkloadError(
                    f"profile {self.name!r}: layer {layer.name!r}: param_bytes {layer.param_bytes} is not a whole "
                    f"number of {pr.master_bytes}-byte parameters (precision.master_bytes)"
                )
        for what, size in (("weight", pr.weights), ("gradient", pr.gradients)):
            total = size(self.param_bytes)
            if total > MAX_BYTES:
                raise WorkloadError(
                    f"profile {self.name!r}: the layers' {what} bytes at this precision add up to {total}, "
                    "more than 2**53 bytes"
                )

    @property
    def optimizer_state_multiplier(self) -> int:
        return OPTIMIZER_STATE_MULTIPLIER[self.optimizer]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def forward_s(self) -> float:
        return math.fsum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return math.fsum(layer.backward_s for layer in self.layers)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "microbatch_size": self.microbatch_size,
            "optimizer": self.optimizer,
        }
        if self.notes:
            d["notes"] = self.notes
        if self.overhead_forward_s or self.overhead_backward_s:
            d["overhead"] = {"forward_s": self.overhead_forward_s, "backward_s": self.overhead_backward_s}
        if self.precision != FP32:
            d["precision"] = self.precision.to_json()
        if self.tensor_parallel != 1:
            d["tensor_parallel"] = self.tensor_parallel
        d["layers"] = [layer.to_json() for layer in self.layers]
        return d

    @classmethod
    def from_json(cls, d: Any) -> Profile:
        """Validate and build; :class:`WorkloadError` with a one-line reason on bad input."""
        if not isinstance(d, dict):
            raise WorkloadError("a profile must be a JSON object")
        extra = sorted(set(d) - _PROFILE_KEYS)
        if extra:
            raise WorkloadError(f"unknown field {extra[0]!r} (known: {', '.join(sorted(_PROFILE_KEYS))})")
        if "name" not in d:
            raise WorkloadError("missing field 'name'")
        if "layers" not in d:
            raise WorkloadError("missing field 'layers'")
        if not isinstance(d["layers"], list):
            raise WorkloadError("'layers' must be a list")
        layers = []
        for i, ld in enumerate(d["layers"]):
            where = f"layer {i}"
            if not isinstance(ld, dict):
                raise WorkloadError(f"{where} must be a JSON object")
            if isinstance(ld.get("name"), str) and ld["name"]:
                where = f"layer {i} ({ld['name']})"
            extra = sorted(set(ld) - _LAYER_KEYS)
            if extra:
                raise WorkloadError(f"{where}: unknown field {extra[0]!r} (known: {', '.join(sorted(_LAYER_KEYS))})")
            missing = [k for k in _LAYER_REQUIRED if k not in ld]
            if missing:
                raise WorkloadError(f"{where}: missing field {missing[0]!r}")
            values = dict(ld)
            # Sizes written as 1.6e7 are fine as long as they are whole numbers.
            for k in ("param_bytes", "activation_bytes", "stash_bytes", "w_held_bytes"):
                v = values.get(k)
                if isinstance(v, float) and v.is_integer():
                    values[k] = int(v)
            try:
                layers.append(LayerCost(**values))
            except WorkloadError as e:
                raise WorkloadError(f"{where}: {str(e).split(': ', 1)[-1]}") from None
        notes = d.get("notes", "")
        if not isinstance(notes, str):
            raise WorkloadError("'notes' must be a string")
        overhead = d.get("overhead", {})
        if not isinstance(overhead, dict) or set(overhead) - {"forward_s", "backward_s"}:
            raise WorkloadError("'overhead' must be an object with forward_s and/or backward_s")
        for k, v in overhead.items():
            problem = seconds_problem(f"overhead.{k}", v)
            if problem:
                raise WorkloadError(problem)
        precision = Precision.from_json(d["precision"]) if "precision" in d else FP32
        return cls(
            name=d["name"],
            layers=tuple(layers),
            microbatch_size=d.get("microbatch_size", 1),
            optimizer=d.get("optimizer", "sgd"),
            notes=notes,
            overhead_forward_s=float(overhead.get("forward_s", 0.0)),
            overhead_backward_s=float(overhead.get("backward_s", 0.0)),
            precision=precision,
            tensor_parallel=d.get("tensor_parallel", 1),
        )


_PROFILE_KEYS = {"name", "layers", "microbatch_size", "optimizer", "notes", "overhead", "precision", "tensor_parallel"}
_LAYER_REQUIRED = ("name", "forward_s", "backward_s", "param_bytes", "activation_bytes", "stash_bytes")
_LAYER_KEYS = set(_LAYER_REQUIRED) | {
    "backward_input_s",
    "fixed_forward_s",
    "fixed_backward_s",
    "w_held_bytes",
    "recomputed",
}


def rescaled(profile: Profile, microbatch_size: int) -> Profile:
    """``profile`` with times and activation bytes scaled by ``microbatch_size / profile.microbatch_size``.

    An approximation, and the notes say so: activations grow exactly with the
    batch, but GPU kernels do not time linearly in it (a small batch uses the
    GPU less well, so its time per sample is longer than this predicts).
    Weights do not scale.
    """
    check_microbatch_size(microbatch_size)
    r = microbatch_size / profile.microbatch_size
    layers = tuple(
        _times_scaled(
            la,
            r,
            activation_bytes=round(la.activation_bytes * r),
            stash_bytes=round(la.stash_bytes * r),
            w_held_bytes=round(la.w_held_bytes * r),
        )
        for la in profile.layers
    )
    note = (
        f"rescaled linearly from the profiled batch of {profile.microbatch_size} to {microbatch_size}: "
        "an approximation (kernel times are not linear in the batch size)"
    )
    return replace(profile, layers=layers, microbatch_size=microbatch_size, notes=f"{profile.notes}; {note}")


def at_layer_speed(profile: Profile, ratio: float) -> Profile:
    """``profile`` with every layer's passes ``ratio`` times as long (bytes
    and the per-pass overheads as they are): the same layers on a machine
    running ``1 / ratio`` as fast. ``pipesim validate`` re-prices its
    prediction so, at the speed its run's passes measured, to tell how much
    of an error is the profile's speed and how much the schedule's. The
    per-pass overheads stay: a run's pass spans hold little of them (most
    is the runtime's bookkeeping between passes), so the run cannot say
    how fast they went."""
    if not (math.isfinite(ratio) and ratio > 0):
        raise WorkloadError(f"a layer-time ratio must be positive and finite, not {ratio}")
    layers = tuple(
        _times_scaled(
            la, ratio, fixed_forward_s=la.fixed_forward_s * ratio, fixed_backward_s=la.fixed_backward_s * ratio
        )
        for la in profile.layers
    )
    return replace(profile, layers=layers)


def _times_scaled(layer: LayerCost, r: float, **changes) -> LayerCost:
    """``layer`` with its forward and backward (and the backward's split)
    ``r`` times as long, and ``changes``."""
    return replace(
        layer,
        forward_s=layer.forward_s * r,
        backward_s=layer.backward_s * r,
        backward_input_s=None if layer.backward_input_s is None else layer.backward_input_s * r,
        **changes,
    )


def at_microbatch_size(profile: Profile, microbatch_size: int | None) -> Profile:
    """``profile`` run at ``microbatch_size`` samples per micro-batch (None:
    as it is). A profile that knows its batch (any but 1: a JSON profile's
    ``microbatch_size``, the images of a PipeDream graph's input node) is
    :func:`rescaled` to it, as the catalog's measured models are, so the
    same graph.txt gives the same run by ``--profile`` and by ``--model``.
    A profile of batch 1 (unstated, or a graph whose batch cannot be read)
    is taken to have been measured at ``microbatch_size``: that only sets
    the samples each micro-batch counts."""
    if microbatch_size is None or microbatch_size == profile.microbatch_size:
        return profile
    check_microbatch_size(microbatch_size)
    if profile.microbatch_size == 1:
        return replace(profile, microbatch_size=microbatch_size)
    return rescaled(profile, microbatch_size)

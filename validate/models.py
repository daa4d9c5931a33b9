"""Small real models for checking the simulator against measured runs.

A :class:`RealModel` is a *flat* list of layers, because that is the unit the
simulator's partitioner works in: a profile has one entry per layer and a
stage is a contiguous range of them. Every catalog layer maps one tensor to
one tensor, so stage ``k`` is the chain ``layers[first:last + 1]`` and a
pipeline runtime only ever sends one activation (and one gradient) across a
stage boundary. Residual connections therefore live *inside* a layer (a whole
transformer block is one layer), never across layers.

**Boundaries of several tensors.** Models from elsewhere
(:mod:`pipesim.validate.usermodels`: ``hf:``, ``torchvision:``, a factory)
may pass more than one tensor from layer to layer, as Hugging Face's
decoders pass the hidden states with the rotary cos and sin. A layer then
returns a tuple of tensors, and the next layer is called with them as
positional arguments, ``layer(*boundary)``; a layer that returns one tensor
is called ``layer(x)`` as before (:class:`LayerChain`, :func:`call_layer`).
The boundary after a layer is every tensor it returns, and its
``activation_bytes`` counts every one of them (:func:`boundary_tensors`).
A tensor that crosses a cut carries a gradient back exactly when it
requires one where it was made (the rotary tables do not).

The models are deliberately boring so that measured behaviour depends on the
schedule, not on the model:

* no dropout and no BatchNorm, so a layer's output depends only on its
  parameters and input (no RNG state to replay, no running statistics that
  change with how micro-batches are grouped);
* parameters come from the ``seed`` alone (built inside a forked RNG), so
  every rank of a distributed run can build the full model and keep its own
  stage, and a single-process reference run starts from the same weights;
* sizes are picked so that one micro-batch of 32-64 samples costs roughly
  0.5-5 ms of forward per (non-trivial) layer on one CPU thread: long enough
  that per-op overhead does not dominate, short enough for quick tests.

:func:`layer_stats` measures the per-layer byte counts the simulator's
profile JSON needs (``param_bytes``, ``activation_bytes``, ``stash_bytes``)
with one real forward + backward, so memory predictions can be compared with
what autograd actually keeps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipesim.sim.errors import InputError
from pipesim.validate import data as _data

__all__ = [
    "LayerChain",
    "LayerStats",
    "ModelError",
    "RealModel",
    "boundary_tensors",
    "build_model",
    "call_layer",
    "cross_entropy",
    "layer_stats",
    "model_names",
    "split",
]


class ModelError(InputError):
    """A model name or size the catalog cannot build."""


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every prediction: samples, and positions for sequences."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def boundary_tensors(value: Any) -> tuple[torch.Tensor, ...]:
    """The tensors a layer's output sends across a cut after it: the tensor
    itself, or every tensor of a tuple, in order."""
    return tuple(value) if isinstance(value, tuple) else (value,)


def call_layer(layer: nn.Module, x: Any) -> Any:
    """Call ``layer`` on the boundary ``x``: one tensor as it is, a tuple as
    positional arguments."""
    return layer(*x) if isinstance(x, tuple) else layer(x)


class LayerChain(nn.Sequential):
    """An ``nn.Sequential`` whose layers may pass tuples: each layer is called
    on the previous one's output as :func:`call_layer` does. On layers that
    map one tensor to one tensor it computes exactly what ``nn.Sequential``
    does. Called with several arguments (or one tuple), the first layer gets
    them all."""

    def forward(self, *inputs: Any) -> Any:
        x = inputs[0] if len(inputs) == 1 else inputs
        for layer in self:
            x = call_layer(layer, x)
        return x


@dataclass
class RealModel:
    """A model as the pipeline sees it: layers in order plus its data and loss.

    The layers are the model: :func:`split` hands out ``nn.Sequential``
    views of them that share parameters, so training a stage trains the model.
    """

    name: str
    layers: list[nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    config: dict[str, Any]
    layer_names: list[str]
    # (microbatch_size, seed, split) -> the real source. A picklable partial,
    # not a lambda, so a RealModel can be sent to worker processes.
    source_fn: Callable[[int, int, str], _data.MicroBatchSource] = field(repr=False)
    description: str = ""
    #: where the model comes from: "catalog" (this module), "hf", "torchvision"
    #: or "factory" (:mod:`pipesim.validate.usermodels`)
    origin: str = "catalog"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def sequential(self) -> nn.Sequential:
        """The whole model as one module (shares parameters with ``layers``),
        a :class:`LayerChain`."""
        return LayerChain(*self.layers)

    def num_params(self) -> int:
        return sum(p.numel() for layer in self.layers for p in layer.parameters())

    def data(
        self, microbatch_size: int, *, seed: int = 0, synthetic: bool = False, split: str = "all"
    ) -> _data.MicroBatchSource:
        """The model's training stream over ``split`` (:data:`~pipesim.validate.data.SPLITS`);
        ``synthetic`` keeps shapes and dtypes, drops the values."""
        source = self.source_fn(microbatch_size, seed, split)
        return _data.synthetic_like(source) if synthetic else source

    def heldout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed held-out set (inputs, targets), disjoint from ``data(split="train")``."""
        return self.source_fn(1, 0, "heldout").heldout_set()


# ------------------------------------------------------------------ mlp


def _linear_relu(n_in: int, n_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(n_in, n_out), nn.ReLU())


def _build_mlp(width: int, depth: int) -> tuple[list[nn.Module], list[str], dict[str, Any]]:
    """He (Kaiming) initialisation: torch's default for ``nn.Linear`` scales
    weights by 1/sqrt(3) of what keeps a ReLU stack's activations at unit
    variance, so they shrink by about 3x per layer and an 8-layer mlp barely
    trained (data parallelism peaked at 72% on digits). He-normal weights
    (fan in, ReLU gain) keep every layer's scale; biases start at zero, and
    the head at a tenth of its He scale, so the untrained loss stays near
    log(10) whatever the depth."""
    layers = [_linear_relu(64 if i == 0 else width, width) for i in range(depth)]
    layers.append(nn.Linear(width, 10))
    for i, layer in enumerate(layers):
        linear = layer if isinstance(layer, nn.Linear) else layer[0]
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        if i == depth:
            linear.weight.data.mul_(0.1)
        nn.init.zeros_(linear.bias)
    names = [f"fc{i}" for i in range(depth)] + ["head"]
    return layers, names, {}


# ------------------------------------------------------------ gpt-small


class TokenEmbedding(nn.Module):
    """Token + learned position embedding: the first layer takes token ids."""

    def __init__(self, vocab_size: int, seq_len: int, width: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(seq_len, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        L = idx.shape[-1]
        if L > self.pos.num_embeddings:
            raise ValueError(f"sequence of {L} tokens is longer than the model's seq_len {self.pos.num_embeddings}")
        return self.tok(idx) + self.pos(torch.arange(L, device=idx.device))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm GPT block; both residuals stay inside so the layer is one tensor in, one out."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, L, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, L, h, d // h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, L, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class LMHead(nn.Module):
    def __init__(self, width: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.linear = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.ln(x))


def _gpt_init(layers: list[nn.Module], depth: int) -> None:
    """GPT-2's initialisation: N(0, 0.02), zero biases, residual outputs scaled by 1/sqrt(2*depth).

    PyTorch's default (Kaiming-uniform) works too but learns noticeably
    slower with plain SGD, and the tests want visible progress in few steps.
    """
    for layer in layers:
        for name, module in layer.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = 0.02 / math.sqrt(2 * depth) if name in ("proj", "out") else 0.02
                nn.init.normal_(module.weight, 0.0, std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)


def _build_gpt(
    width: int, depth: int, *, heads: int = 4, seq_len: int = 32
) -> tuple[list[nn.Module], list[str], dict[str, Any]]:
    heads = _check_size("heads", heads)
    seq_len = _check_size("seq_len", seq_len)
    if width % heads:
        raise ModelError(f"gpt-small width {width} is not divisible by heads {heads}")
    probe = _data.char_corpus(1, seq_len)  # validates seq_len against the corpus
    vocab = probe.vocab_size
    layers: list[nn.Module] = [TokenEmbedding(vocab, seq_len, width)]
    layers += [TransformerBlock(width, heads) for _ in range(depth)]
    layers.append(LMHead(width, vocab))
    _gpt_init(layers, depth)
    names = ["embed"] + [f"block{i}" for i in range(depth)] + ["head"]
    return layers, names, {"heads": heads, "seq_len": seq_len, "vocab_size": vocab}


# ----------------------------------------------------------------- lstm


class CharEmbedding(nn.Module):
    """Token embedding only: a recurrent model needs no positions."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx)


class ResidualLSTM(nn.Module):
    """``x + LSTM(LayerNorm(x))``: a residual LSTM layer (the model class of
    SpecTrain's PyTorch port), one tensor in and one out like every layer here.
    The state starts at zero for every window, so a micro-batch's output
    depends on its own tokens only."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.lstm = nn.LSTM(width, width, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(self.ln(x))
        return x + y


def _build_lstm(width: int, depth: int, *, seq_len: int = 32) -> tuple[list[nn.Module], list[str], dict[str, Any]]:
    seq_len = _check_size("seq_len", seq_len)
    vocab = _data.char_corpus(1, seq_len).vocab_size  # validates seq_len against the corpus
    layers: list[nn.Module] = [CharEmbedding(vocab, width)]
    layers += [ResidualLSTM(width) for _ in range(depth)]
    layers.append(LMHead(width, vocab))
    for layer in (layers[0], layers[-1]):
        for module in layer.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)  # as gpt-small's: a small, even start
    names = ["embed"] + [f"lstm{i}" for i in range(depth)] + ["head"]
    return layers, names, {"seq_len": seq_len, "vocab_size": vocab}


# ------------------------------------------------------------ vgg-small


def _build_vgg(width: int, depth: int) -> tuple[list[nn.Module], list[str], dict[str, Any]]:
    """Conv3x3+ReLU layers; every second one also max-pools and the next doubles channels.

    The 8x8 input allows three poolings (8 -> 4 -> 2 -> 1); deeper stacks
    keep the 1x1 map and the channel count after that.
    """
    layers: list[nn.Module] = []
    names: list[str] = []
    channels, size, pools = 1, 8, 0
    for i in range(depth):
        out = width * 2**pools
        unit: list[nn.Module] = [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU()]
        pool = i % 2 == 1 and size > 1
        if pool:
            unit.append(nn.MaxPool2d(2))
            size //= 2
            pools += 1
        layers.append(nn.Sequential(*unit))
        names.append(f"conv{i}" + ("+pool" if pool else ""))
        channels = out
    hidden = 4 * width
    layers.append(nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, hidden), nn.ReLU()))
    layers.append(nn.Linear(hidden, 10))
    names += ["fc", "head"]
    return layers, names, {"hidden": hidden, "final_map": [channels, size, size]}


# -------------------------------------------------------------- catalog


def _digits_source(
    image: bool, config: dict, microbatch_size: int, seed: int, split: str = "all"
) -> _data.MicroBatchSource:
    return _data.digits(microbatch_size, seed=seed, image=image, split=split)


def _corpus_source(config: dict, microbatch_size: int, seed: int, split: str = "all") -> _data.MicroBatchSource:
    return _data.char_corpus(microbatch_size, config["seq_len"], seed=seed, split=split)


@dataclass(frozen=True)
class _Spec:
    builder: Callable[..., tuple[list[nn.Module], list[str], dict[str, Any]]]
    width: int
    depth: int
    options: tuple[str, ...]  # extra keyword arguments the builder accepts
    summary: str
    # (config, microbatch_size, seed, split) -> the model's data source
    source: Callable[..., _data.MicroBatchSource] = functools.partial(_digits_source, False)


_CATALOG: dict[str, _Spec] = {
    "mlp": _Spec(_build_mlp, 512, 4, (), "digits (64 px) -> depth x Linear(width)+ReLU -> Linear(10), He init"),
    "gpt-small": _Spec(
        _build_gpt,
        128,
        4,
        ("heads", "seq_len"),
        "char LM on pydoc topics: embed -> depth x pre-LN block -> LN + Linear(vocab)",
        _corpus_source,
    ),
    "lstm": _Spec(
        _build_lstm,
        128,
        4,
        ("seq_len",),
        "char LM on pydoc topics: embed -> depth x residual LSTM (x + LSTM(LN x)) -> LN + Linear(vocab)",
        _corpus_source,
    ),
    "vgg-small": _Spec(
        _build_vgg,
        64,
        4,
        (),
        "digits (1x8x8) -> depth x Conv3x3+ReLU(+pool) -> Linear+ReLU -> Linear(10)",
        functools.partial(_digits_source, True),
    ),
}


def model_names() -> list[str]:
    return sorted(_CATALOG)


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(f"{name} must be a positive integer, got {value!r}")
    return value


def build_model(
    name: str, *, width: int | None = None, depth: int | None = None, seed: int = 0, **kw: Any
) -> RealModel:
    """Build a catalog model; the same arguments give bit-identical parameters in any process."""
    spec = _CATALOG.get(name)
    if spec is None:
        raise ModelError(f"unknown model {name!r} (choose from: {', '.join(model_names())})")
    unknown = sorted(set(kw) - set(spec.options))
    if unknown:
        allowed = ", ".join(("width", "depth", "seed") + spec.options)
        raise ModelError(f"{name} does not take {', '.join(unknown)} (options: {allowed})")
    width = _check_size("width", spec.width if width is None else width)
    depth = _check_size("depth", spec.depth if depth is None else depth)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ModelError(f"seed must be a non-negative integer, got {seed!r}")
    # fork_rng: the global RNG supplies the default initialisers, so seed it
    # here and restore the caller's state afterwards (their stream must not
    # depend on whether they built a model).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers, names, extra = spec.builder(width, depth, **kw)  # ModelError/DataError name bad options
    config = {"width": width, "depth": depth, "seed": seed, **extra}
    model = RealModel(name, layers, cross_entropy, config, names, functools.partial(spec.source, config))
    model.description = f"{name}: {spec.summary}; {config}; {model.num_params():,} parameters"
    return model


# ---------------------------------------------------------------- stats


@dataclass(frozen=True)
class LayerStats:
    """Byte counts of one layer for one micro-batch, as the profile JSON wants them.

    ``stash_bytes`` follows the simulator's convention (see
    ``pipesim.sim.workloads.catalog``): a layer's stash is its input plus its internal
    intermediates, and a tensor the layer saves that *is* its output (a
    final ReLU keeps its result) is counted with the next layer, which saves
    the same storage as its input. That way summing layers over a stage
    counts each saved storage once. The price is at stage boundaries: a
    stage whose last layer saves its own output (mlp, vgg-small: the final
    ReLU) really holds that tensor too, and the sum leaves it out; the
    receiving stage's copy is counted. What the loss saves for its backward
    (cross-entropy's log-softmax, the size of the logits) is held by the
    last stage, and counted in the last layer's ``stash_bytes``.
    """

    index: int
    name: str
    param_bytes: int
    activation_bytes: int
    stash_bytes: int
    output_shape: tuple[int, ...]  # of the first tensor the layer returns
    output_dtype: torch.dtype
    #: (shape, dtype, requires_grad) of every tensor the layer returns, in
    #: order: what a cut after it carries (one entry for a catalog layer)
    outputs: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...] = ()


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


def layer_param_bytes(layer: torch.nn.Module) -> int:
    """Bytes of ``layer``'s weights: a profile's ``param_bytes``."""
    return sum(p.nbytes for p in layer.parameters())


def _describe(x: Any) -> str:
    return ", ".join(
        f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in boundary_tensors(x)
    )


def _user_code(model: RealModel, what: str, on: Any, fn: Callable, *args: Any) -> Any:
    """``fn(*args)``; for a model from elsewhere (``origin`` not the catalog),
    an exception it raises is bad input: one line naming the model, ``what``
    failed and ``on`` what (the catalog's own code failing is a bug, and
    keeps its traceback)."""
    if model.origin == "catalog":
        return fn(*args)
    try:
        return fn(*args)
    except Exception as e:
        lines = str(e).strip().splitlines()
        reason = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
        raise ModelError(f"{model.name}: {what} failed on {_describe(on)}: {reason}") from None


def to_device(x: Any, device: torch.device) -> Any:
    """A boundary (a tensor or a tuple of tensors) on ``device``."""
    return tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)


#: Attributes that name a layer's place in the model rather than what it
#: computes (Hugging Face's ``layer_idx`` indexes the KV cache): two layers
#: that differ only in them compute alike.
_PLACE_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})


def _signature(layer: nn.Module) -> tuple:
    """What a layer computes, as far as its cost goes: its modules' types
    and printed configuration, its parameters' and buffers' shapes, types
    and whether they train, and its modules' plain attributes (a sliding
    window, a dropout rate) but for :data:`_PLACE_ATTRIBUTES`."""
    plain = []
    for name, sub in layer.named_modules():
        for key, value in sorted(vars(sub).items()):
            if key.startswith("_") or key in _PLACE_ATTRIBUTES:
                continue
            if value is None or isinstance(value, (bool, int, float, str, tuple)):
                plain.append((name, key, repr(value)))
    tensors = [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in layer.named_parameters()]
    tensors += [(n, tuple(t.shape), t.dtype) for n, t in layer.named_buffers()]
    return type(layer), repr(layer), tuple(tensors), tuple(plain)


def repeated_layers(model: RealModel, stats: Sequence[LayerStats]) -> list[int]:
    """Per layer, the layer whose costs it has: itself, or the first of the
    run of identical layers it repeats (a transformer's blocks, a ResNet
    stage's blocks after the first).

    A layer repeats the one before it when the two compute alike
    (:func:`_signature`) on inputs of the same shapes and give outputs of
    the same shapes, so the layers of a run are interchangeable: a chain
    that keeps only the first of each run is a valid model with the same
    boundaries. Costs that depend on the values (a mixture of experts'
    routing) are not told apart. The first and the last layer are never
    repeats."""
    n = len(model.layers)
    first = list(range(n))
    signatures = [_signature(layer) for layer in model.layers]
    # the first layer's input is the batch, whose shapes stats do not hold,
    # and the last computes the loss too: both stand for themselves
    for i in range(2, n - 1):
        same_inputs = stats[i - 1].outputs == stats[i - 2].outputs
        if signatures[i] == signatures[i - 1] and same_inputs and stats[i].outputs == stats[i - 1].outputs:
            first[i] = first[i - 1]
    return first


def layer_stats(
    model: RealModel,
    microbatch_size: int,
    *,
    device: str | torch.device = "cpu",
    copy_layers: bool = True,
    backward: bool = True,
) -> list[LayerStats]:
    """Measure each layer's bytes with one forward + backward of a real micro-batch.

    Runs on a copy of the layers so the model's ``.grad`` fields and device
    placement are untouched (``copy_layers=False`` runs on the layers
    themselves, already on ``device``: for a model too big to copy, whose
    ``.grad`` fields stay untouched all the same).

    ``backward=False`` leaves out the backward (the counts come from the
    forward alone; it only proves the graph runs), for callers that run one
    next anyway.

    A layer that returns a tuple (see the module doc) sends all of it:
    its ``activation_bytes`` is the sum of every tensor's bytes, and each
    of them, saved again by the next layer, is counted with that one.
    """
    device = torch.device(device)
    layers = [copy.deepcopy(layer).to(device) for layer in model.layers] if copy_layers else list(model.layers)
    inputs, targets = model.data(microbatch_size).batch(0)
    x, targets = to_device(inputs, device), targets.to(device)
    params = [p for layer in layers for p in layer.parameters()]
    param_keys = {_storage_key(p) for p in params}

    stats: list[LayerStats] = []
    for i, layer in enumerate(layers):
        saved: dict[tuple[str, int], int] = {}

        def pack(t: torch.Tensor, saved: dict[tuple[str, int], int] = saved) -> torch.Tensor:
            key = _storage_key(t)
            if key not in param_keys and key[1] != 0:
                saved[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _user_code(model, f"layer {i} ({model.layer_names[i]})", x, call_layer, layer, x)
        sent = boundary_tensors(out)
        if not sent or not all(isinstance(t, torch.Tensor) for t in sent):
            kinds = ", ".join(sorted({type(t).__name__ for t in sent})) or "an empty tuple"
            raise ModelError(
                f"{model.name}: layer {i} ({model.layer_names[i]}) returned {kinds}; a layer must return "
                "a tensor or a tuple of tensors"
            )
        for t in sent:
            saved.pop(_storage_key(t), None)  # counted by the next layer
        stats.append(
            LayerStats(
                index=i,
                name=model.layer_names[i],
                param_bytes=layer_param_bytes(layer),
                activation_bytes=sum(t.nbytes for t in sent),
                stash_bytes=sum(saved.values()),
                output_shape=tuple(sent[0].shape),
                output_dtype=sent[0].dtype,
                outputs=tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in sent),
            )
        )
        x = out
    # the loss runs in the last stage's forward, and what it saves for the
    # backward (cross-entropy keeps its log-softmax, as large as the logits)
    # is held there with the last layer's stash
    last = dict(saved) if stats else {}  # the last layer's, its outputs left out
    counting = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if stats else contextlib.nullcontext()
    with counting:  # into the last layer's ``saved``
        loss = _user_code(model, "its loss_fn", x, model.loss_fn, x, targets)
    if stats and saved.keys() - last.keys():
        extra = sum(n for key, n in saved.items() if key not in last)
        stats[-1] = dataclasses.replace(stats[-1], stash_bytes=stats[-1].stash_bytes + extra)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise ModelError(f"{model.name}: its loss_fn returned {got}, not a scalar tensor")
    if backward:
        # autograd.grad rather than backward(): a real backward pass through
        # every saved tensor, without accumulating into anyone's .grad.
        torch.autograd.grad(loss, [p for p in params if p.requires_grad], allow_unused=True)
    return stats


# ---------------------------------------------------------------- split


def split(model: RealModel, stages: Sequence[int] | Sequence[Any]) -> list[nn.Sequential]:
    """Cut the layers into contiguous stages (sharing parameters with the model),
    each a :class:`LayerChain` (an ``nn.Sequential`` that passes tuples on).

    ``stages`` is either the start layer of each stage (``[0, 3, 5]``) or the
    partitioner's output (objects with ``first_layer``/``last_layer``, e.g.
    ``pipesim.sim.workloads.stages.StageCost``), which must cover every layer once,
    in order.
    """
    n = model.num_layers
    items = list(stages)
    if not items:
        raise ModelError("split needs at least one stage")
    if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
        starts = items
        if starts[0] != 0:
            raise ModelError(f"the first stage must start at layer 0, got {starts[0]}")
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise ModelError(f"stage starts must be strictly increasing, got {starts}")
        if starts[-1] >= n:
            raise ModelError(f"stage start {starts[-1]} is past the last layer ({n - 1}) of {model.name}")
        bounds = list(zip(starts, [*starts[1:], n]))
    elif all(hasattr(s, "first_layer") and hasattr(s, "last_layer") for s in items):
        bounds = []
        expected = 0
        for s in items:
            first, last = s.first_layer, s.last_layer
            if first != expected or last < first:
                raise ModelError(
                    f"stages must be contiguous and non-empty from layer 0: expected a stage starting at "
                    f"{expected}, got layers {first}..{last}"
                )
            bounds.append((first, last + 1))
            expected = last + 1
        if expected != n:
            raise ModelError(f"stages cover layers 0..{expected - 1}, but {model.name} has {n} layers")
    else:
        raise ModelError(
            "split takes a list of stage start indices or of objects with first_layer/last_layer "
            f"(such as StageCost), got {items!r}"
        )
    return [LayerChain(*model.layers[a:b]) for a, b in bounds]

"""Any PyTorch model as a :class:`~pipesim.validate.models.RealModel`: ``--model`` beyond the catalog.

:func:`resolve_model` reads one ``--model`` string:

``mlp``, ``gpt-small``, ``vgg-small``, ``lstm``
    the catalog (:func:`pipesim.validate.models.build_model`), unchanged;
``hf:MODEL_TYPE[?field=value&...]`` or ``hf:path/to/config.json[?...]``
    a Hugging Face ``transformers`` model built offline with random weights
    from its configuration class's defaults
    (``transformers.AutoConfig.for_model``; a file's fields instead), the
    query's fields overriding them (each value parsed as the type of the
    field's default; a name that is no field of the configuration is an
    error). Two more keys size the input, not the model: ``seq_len`` (text
    models, default :data:`DEFAULT_SEQ_LEN`, at most the configuration's
    maximum positions) and ``image_size`` (ResNet; ViT's is its
    configuration's field). Nothing is downloaded (``HF_HUB_OFFLINE``);
``torchvision:NAME[?arg=value&...]``
    ``torchvision.models.get_model(NAME, weights=None, ...)``, where a
    torchvision built for the installed torch imports;
``package.module:factory`` or ``path/to/file.py:factory``
    a Python callable, ``factory(microbatch_size: int)``, returning
    ``(layers, example_inputs, example_targets, loss_fn)`` (see
    :func:`from_factory`).

Every model is built under ``torch.manual_seed(seed)`` inside a forked RNG,
so the same string and seed give the same weights in any process, and the
caller's RNG is untouched.

**Layers, the way the ecosystem splits them** (:data:`HF_SPLITS`):

======================  ===========================================================
``hf:gpt2``             wte + wpe + dropout, each ``GPT2Block``, ln_f + lm_head
``hf:bert``             embeddings, each ``BertLayer``, pooler + dropout + classifier
                        (``BertForSequenceClassification``)
``hf:llama`` (also      embed_tokens and the rotary tables, each decoder layer, norm
``mistral``, ``qwen2``) + lm_head; every cut carries (hidden, cos, sin)
``hf:resnet``           embedder, each bottleneck (or basic) block, pooler + classifier
``hf:vit``              embeddings, each ``ViTLayer``, layernorm + classifier on [CLS]
``torchvision:``        the top-level children, ``nn.Sequential`` ones opened, a
                        flatten before the first linear layer; refused unless the
                        chain computes what the model's forward does
a factory               an ``nn.Sequential``'s children, or the list it returns
======================  ===========================================================

Attention runs through ``scaled_dot_product_attention`` with no mask tensor
(causal for the decoders), as ``transformers`` itself runs it when no
sequence is padded, so no mask crosses a cut. Tied input and output
embeddings (GPT-2's) are untied after building: the head gets its own copy,
equal at the start, as the last stage of a Megatron-LM pipeline starts from
the first stage's. Each end then trains its own (pipesim's runtime has no
embedding all-reduce), and each end's ``param_bytes`` counts it. Dropout
keeps the configuration's rates.

**Memory first.** A model too big for the device is refused before it is
built (:func:`check_memory`): the parameters are counted on the ``meta``
device (``hf:``, ``torchvision:``, and a factory that runs there) and
profiling holds :data:`PROFILE_COPIES` plus the optimizer's copies of them.

Bad input is one line (:class:`~pipesim.validate.models.ModelError`) naming
the model and the reason.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import numpy as np
import torch
from torch import nn

from pipesim.validate import data as _data
from pipesim.validate.models import (
    ModelError,
    RealModel,
    build_model,
    cross_entropy,
    model_names,
)

__all__ = [
    "DEFAULT_IMAGE_SIZE",
    "DEFAULT_SEQ_LEN",
    "DTYPES",
    "HF_SPLITS",
    "NoTrainingData",
    "TrainingData",
    "check_memory",
    "from_factory",
    "is_catalog",
    "resolve_model",
    "training_source",
]

#: Tokens per sample of a text model unless ``seq_len`` says otherwise.
DEFAULT_SEQ_LEN = 128
#: Pixels per side of an image model whose configuration does not say.
DEFAULT_IMAGE_SIZE = 224
#: ``--dtype`` names.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Copies of the weights profiling holds besides the optimizer's state: the
#: stage's version buffer, the gradients, and the weight gradients a backward
#: returns before they are accumulated (see :func:`check_memory`).
PROFILE_COPIES = 3
#: The optimizer's state in copies of the weights.
OPTIMIZER_COPIES = {"sgd": 1, "adam": 2}
#: What the memory check leaves free for activations, the allocator and Python.
MEMORY_MARGIN = 0.10

INSTALL_HINT = "pip install -e '.[models]'"


def is_catalog(spec: str) -> bool:
    """Whether ``spec`` names one of the catalog's real models."""
    return spec in model_names()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


# ---------------------------------------------------------------- resolving


def resolve_model(
    spec: str,
    *,
    width: int | None = None,
    depth: int | None = None,
    seed: int = 0,
    microbatch_size: int = 1,
    dtype: str = "fp32",
    device: str | torch.device = "cpu",
    optimizer: str = "sgd",
    memory_check: bool = True,
) -> RealModel:
    """The model ``spec`` names (module doc), on the CPU, in ``dtype``.

    ``microbatch_size`` is what a factory is called with (its example batch
    is the data). With ``memory_check``, a model whose profiling would not
    fit on ``device`` with ``optimizer`` is refused before it is built.
    """
    if not isinstance(spec, str) or not spec:
        raise ModelError(f"a model must be a non-empty string, got {spec!r}")
    if dtype not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ModelError(f"seed must be a non-negative integer, got {seed!r}")
    if is_catalog(spec):
        if dtype != "fp32":
            raise ModelError(f"{spec} is built in fp32 only (--dtype {dtype} is for hf:, torchvision: and factories)")
        return build_model(spec, width=width, depth=depth, seed=seed)
    if width is not None or depth is not None:
        flag = "--model-width" if width is not None else "--model-depth"
        raise ModelError(
            f"{spec}: {flag} sizes catalog models only; size this one with its own fields "
            "(hf:gpt2?n_layer=4&n_embd=256, or the factory's code)"
        )
    kind, sep, rest = spec.partition(":")
    if kind == "hf" and sep:
        return _hf_model(spec, rest, seed, dtype, device, optimizer, memory_check)
    if kind == "torchvision" and sep:
        return _torchvision_model(spec, rest, seed, dtype, device, optimizer, memory_check)
    if ":" in spec:
        return from_factory(
            spec, microbatch_size, seed=seed, dtype=dtype, device=device, optimizer=optimizer, memory_check=memory_check
        )
    raise ModelError(
        f"unknown model {spec!r} (choose from: {', '.join(model_names())}; or hf:MODEL_TYPE, "
        "torchvision:NAME, module:factory, path/to/file.py:factory)"
    )


def _real_model(spec, layers, loss_fn, config, names, source, origin: str, dtype: str) -> RealModel:
    """The :class:`RealModel` of a model from elsewhere, in ``dtype``."""
    model = RealModel(spec, layers, loss_fn, config, names, source, origin=origin)
    _to_dtype(model, dtype)
    return model


def _to_dtype(model: RealModel, dtype: str) -> RealModel:
    if dtype != "fp32":
        for layer in model.layers:
            layer.to(DTYPES[dtype])
    return model


# ---------------------------------------------------------------- memory


def check_memory(
    spec: str,
    num_params: int,
    *,
    dtype: str = "fp32",
    device: str | torch.device = "cpu",
    optimizer: str = "sgd",
    what: str = "",
) -> None:
    """Refuse a model whose profiling would not fit, before it is built.

    Building holds the fp32 weights on the host (they are cast to ``dtype``
    afterwards). Profiling trains every layer as a stage: the weights in the
    stage's buffer, their gradients, the weight gradients a backward returns
    before they are added in (:data:`PROFILE_COPIES`), and the optimizer's
    state (:data:`OPTIMIZER_COPIES`), all at ``dtype``'s width; the model's
    own parameters are released as each stage takes them over. Each side
    keeps :data:`MEMORY_MARGIN` free for the activations and the allocator
    (checked apart once the model exists, :func:`check_activations`)."""
    from pipesim.sim.engine.size import available_memory_bytes

    device = torch.device(device)
    width = DTYPES[dtype].itemsize
    copies = PROFILE_COPIES + OPTIMIZER_COPIES.get(optimizer, 2)
    weights = num_params * width
    host_need = num_params * 4
    profile_need = copies * weights
    host = available_memory_bytes()
    label = f"{spec}{f' ({what})' if what else ''}"
    if device.type == "cuda":
        if host is not None and host_need > host * (1 - MEMORY_MARGIN):
            raise ModelError(
                f"{label}: {num_params:,} parameters need {_gib(host_need)} of host memory in fp32 to be built "
                f"and this machine has {_gib(host)} available"
            )
        free = torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else None
        where, available = str(device), free
        host_need = 0
    else:
        where, available = "this machine", host
    need = max(host_need, profile_need)
    if available is not None and need > available * (1 - MEMORY_MARGIN):
        raise ModelError(
            f"{label}: {num_params:,} parameters are {_gib(weights)} in {dtype}, and profiling with {optimizer} "
            f"holds {copies}x that ({_gib(profile_need)}: weights, gradients, optimizer state); {where} has "
            f"{_gib(available)} available: make it smaller (fewer layers, a smaller hidden size) or use a "
            "bigger device"
        )


def check_activations(model: RealModel, microbatch_size: int, *, device: str | torch.device = "cpu") -> None:
    """Refuse a micro-batch whose activations alone would not fit: one
    sample's outputs and stashes (measured on a micro-batch of one) times
    the micro-batch size, as ``pipesim validate`` checks its models. A
    factory's example batch is its micro-batch already, measured whole."""
    from pipesim.sim.engine.size import available_memory_bytes
    from pipesim.validate.models import layer_stats

    device = torch.device(device)
    fixed = model.origin == "factory"
    stats = layer_stats(model, microbatch_size if fixed else 1, copy_layers=False, backward=False)
    per = sum(s.activation_bytes + s.stash_bytes for s in stats)
    need = per if fixed else per * microbatch_size
    if device.type == "cuda" and torch.cuda.is_available():
        available = torch.cuda.mem_get_info(device)[0]
    else:
        available = available_memory_bytes()
    if available is not None and need > available:
        raise ModelError(
            f"{model.name}: a micro-batch of {microbatch_size} needs at least {_gib(need)} for its activations "
            f"and {device} has {_gib(available)} available: use a smaller --microbatch-size"
        )


def _meta_params(build: Callable[[], Any]) -> int | None:
    """Parameters of what ``build`` makes on the ``meta`` device (nothing
    allocated); None when it cannot run there."""
    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            made = build()
    except Exception:
        return None
    modules = made if isinstance(made, (list, tuple)) else [made]
    seen, n = set(), 0
    for m in modules:
        if isinstance(m, nn.Module):
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
    return n


# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class RandomSamples:
    """Synthetic samples addressed by sample, as pipesim's real sources are
    (:mod:`pipesim.validate.data`): sample ``p`` of a split is drawn from
    ``numpy.random.default_rng([tag, split, seed, p])``, so micro-batch
    ``i`` of size ``b`` holds samples ``i*b .. i*b+b-1`` whatever ``b`` is.
    Floats are standard normal, integers uniform in ``[0, high)``. The
    held-out set is :data:`HELDOUT` samples of its own split."""

    microbatch_size: int
    input_spec: _data.TensorSpec
    target_spec: _data.TensorSpec
    seed: int = 0
    split: str = "all"

    HELDOUT = 64
    _TAG = 26

    def _sample(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self._TAG, _data.SPLITS.index(self.split), self.seed, p])
        return _draw(rng, self.input_spec), _draw(rng, self.target_spec)

    def _samples(self, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(self._sample(p) for p in range(first, first + n)))
        return torch.stack(xs), torch.stack(ys)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise _data.DataError(f"index must be a non-negative integer, got {index!r}")
        return self._samples(index * self.microbatch_size, self.microbatch_size)

    def heldout_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        return RandomSamples(1, self.input_spec, self.target_spec, 0, "heldout")._samples(0, self.HELDOUT)


def _draw(rng: np.random.Generator, spec: _data.TensorSpec) -> torch.Tensor:
    if spec.dtype.is_floating_point:
        return torch.from_numpy(rng.standard_normal(spec.shape, dtype=np.float32)).to(spec.dtype)
    return torch.from_numpy(np.asarray(rng.integers(0, spec.high, size=spec.shape, dtype=np.int64))).to(spec.dtype)


def _random_source(
    inputs: _data.TensorSpec, targets: _data.TensorSpec, microbatch_size: int, seed: int, split: str = "all"
) -> RandomSamples:
    return RandomSamples(microbatch_size, inputs, targets, seed, _data._check_split(split))


class _ExampleShapes:
    """The specs of a factory's example batch (``inputs``, ``targets``),
    for the sources built on it."""

    inputs: Any
    targets: torch.Tensor

    @property
    def input_spec(self) -> _data.TensorSpec:
        if isinstance(self.inputs, tuple):
            raise _data.DataError("a factory's inputs of several tensors have no single input_spec (--synthetic)")
        return _data._spec(self.inputs)

    @property
    def target_spec(self) -> _data.TensorSpec:
        return _data._spec(self.targets)


@dataclass(frozen=True)
class ExampleBatch(_ExampleShapes):
    """A factory's example micro-batch, as every micro-batch of the stream
    (timing needs shapes, not values). Its held-out set is the same batch."""

    microbatch_size: int
    inputs: Any
    targets: torch.Tensor

    def batch(self, index: int) -> tuple[Any, torch.Tensor]:
        return self.inputs, self.targets

    def heldout_set(self) -> tuple[Any, torch.Tensor]:
        return self.inputs, self.targets


@dataclass(frozen=True)
class FactorySources:
    """A factory model's ``source_fn``: its example batch as every
    micro-batch (what profiling and ``pipesim validate`` stream), and beside
    it the factory's own ``data`` (its fifth item, None when it gave none),
    which :func:`training_source` hands to ``pipesim converge``."""

    inputs: Any
    targets: torch.Tensor
    data: Callable | None = None

    def __call__(self, microbatch_size: int, seed: int, split: str = "all") -> ExampleBatch:
        return ExampleBatch(microbatch_size, self.inputs, self.targets)


@dataclass(frozen=True)
class ExampleSamples(_ExampleShapes):
    """Random samples shaped like a factory's example batch, addressed by
    sample as :class:`RandomSamples` are: every tensor of sample ``p``
    (inputs and targets) is drawn from
    ``numpy.random.default_rng([tag, split, seed, p])``. Floating-point
    tensors are standard normal; integer ones uniform between the example's
    smallest and largest value of that tensor (token ids, labels); boolean
    ones (masks) are copied from the example's sample ``p mod b``, since a
    random mask can hide a whole sequence. The held-out set is
    :attr:`HELDOUT` samples of its own split."""

    microbatch_size: int
    inputs: Any
    targets: torch.Tensor
    seed: int = 0
    split: str = "all"

    HELDOUT = 64
    _TAG = 27

    def _one(self, rng: np.random.Generator, t: torch.Tensor, p: int) -> torch.Tensor:
        if t.dtype == torch.bool:
            return t[p % t.shape[0]].clone()
        if t.is_floating_point():
            return torch.from_numpy(rng.standard_normal(tuple(t.shape[1:]), dtype=np.float32)).to(t.dtype)
        lo, hi = (int(t.min()), int(t.max()) + 1) if t.numel() else (0, 1)
        return torch.from_numpy(np.asarray(rng.integers(lo, hi, size=tuple(t.shape[1:]), dtype=np.int64))).to(t.dtype)

    def _samples(self, first: int, n: int) -> tuple[Any, torch.Tensor]:
        several = isinstance(self.inputs, tuple)
        ins = self.inputs if several else (self.inputs,)
        rows = []
        for p in range(first, first + n):
            rng = np.random.default_rng([self._TAG, _data.SPLITS.index(self.split), self.seed, p])
            rows.append([self._one(rng, t, p) for t in (*ins, self.targets)])
        cols = [torch.stack(c) for c in zip(*rows)]
        inputs = tuple(cols[:-1]) if several else cols[0]
        return inputs, cols[-1]

    def batch(self, index: int) -> tuple[Any, torch.Tensor]:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise _data.DataError(f"index must be a non-negative integer, got {index!r}")
        return self._samples(index * self.microbatch_size, self.microbatch_size)

    def heldout_set(self) -> tuple[Any, torch.Tensor]:
        return ExampleSamples(1, self.inputs, self.targets, 0, "heldout")._samples(0, self.HELDOUT)


def _example_samples(inputs: Any, targets: torch.Tensor, microbatch_size: int, seed: int, split: str = "all"):
    return ExampleSamples(microbatch_size, inputs, targets, seed, _data._check_split(split))


# ---------------------------------------------------------------- training data


class NoTrainingData(ModelError):
    """A model ``pipesim converge`` has no data to train on, or whose data
    do not fit it (one line, naming the remedies)."""


@dataclass(frozen=True)
class TrainingData:
    """What a convergence run trains a model on: ``source_fn`` as
    :attr:`RealModel.source_fn` takes it (``(microbatch_size, seed, split)``
    to a source, the ``"heldout"`` split's with ``heldout_set()``), what it
    is in words, and whether it is random samples (a loss curve only)."""

    source_fn: Callable
    description: str
    synthetic: bool = False


#: The corpus causal language models train on, and the digits image classifiers do.
_TEXT_DATA = "char_corpus (next character over Python's bundled help texts)"
_DIGIT_CLASSES = 10


def _corpus_source(seq_len: int, microbatch_size: int, seed: int, split: str = "all") -> _data.CharCorpus:
    return _data.char_corpus(microbatch_size, seq_len, seed=seed, split=split)


def _digit_images_source(
    side: int, channels: int, microbatch_size: int, seed: int, split: str = "all"
) -> _data.DigitImages:
    return _data.digit_images(microbatch_size, side, channels=channels, seed=seed, split=split)


def _image_classifier_data(spec: str, inputs: _data.TensorSpec, targets: _data.TensorSpec, field: str):
    labels = targets.high
    if len(inputs.shape) != 3 or inputs.shape[1] != inputs.shape[2]:
        raise NoTrainingData(f"{spec}: its input {inputs.shape} is no square image; converge trains on the digits")
    if labels != _DIGIT_CLASSES:
        raise NoTrainingData(
            f"{spec}: converge trains image classifiers on the digits (10 classes) and this one has {labels} "
            f"labels: set {field}=10"
        )
    channels, side, _ = inputs.shape
    return TrainingData(
        functools.partial(_digit_images_source, side, channels),
        f"digits as {channels}x{side}x{side} images (scikit-learn's 8x8 digits, resized, 10 classes)",
    )


def training_source(model: RealModel, *, synthetic: bool = False) -> TrainingData:
    """What ``pipesim converge`` trains ``model`` on (a :class:`NoTrainingData`
    error, one line, where there is nothing):

    * a catalog model: its own data (digits or characters; no ``synthetic``);
    * ``hf:`` causal language models (gpt2, llama, mistral, qwen2): the
      character corpus (:func:`pipesim.validate.data.char_corpus`) at the
      model's ``seq_len``; the vocabulary must cover its characters;
    * image classifiers (``hf:resnet``, ``hf:vit``, ``torchvision:``): the
      digits as the model's images (:func:`pipesim.validate.data.digit_images`),
      which needs 10 labels;
    * a factory: its data (the fifth item it returns), checked on one batch;
    * with ``synthetic``, any model that is not the catalog's: random samples
      of its input's shapes (``hf:``/``torchvision:``, :class:`RandomSamples`;
      a factory's example, :class:`ExampleSamples`), addressed by sample,
      with a held-out split of their own: the curve is a loss curve only.
    """
    spec = model.name
    if model.origin == "catalog":
        if synthetic:
            raise NoTrainingData(f"{spec} comes with its data; --synthetic is for models that come with none")
        kind = type(model.data(1, split="heldout")).__name__
        words = {"Digits": "digits (scikit-learn's 8x8 handwritten digits, 10 classes)", "CharCorpus": _TEXT_DATA}
        return TrainingData(model.source_fn, words.get(kind, kind))
    sources = model.source_fn
    if synthetic:
        if model.origin == "factory":
            fn = functools.partial(_example_samples, sources.inputs, sources.targets)
            what = "the factory's example"
        else:
            fn, what = sources, "the model's inputs and labels"
        return TrainingData(fn, f"synthetic: random samples of {what}' shapes (a loss curve only)", True)
    if model.origin == "factory":
        return _factory_data(spec, sources.data)
    probe = sources(1, 0, "all")
    inputs, targets = probe.input_spec, probe.target_spec
    if model.origin == "torchvision":
        return _image_classifier_data(spec, inputs, targets, "num_classes")
    model_type = model.config.get("model_type")
    split = HF_SPLITS[model_type]
    if split.task == "causal-lm":
        corpus = _data.char_corpus(1, 1)
        if inputs.high < corpus.vocab_size:
            raise NoTrainingData(
                f"{spec}: converge trains causal language models on a character corpus of "
                f"{corpus.vocab_size} characters and this vocabulary has {inputs.high} tokens: set vocab_size to "
                f"{corpus.vocab_size} or more"
            )
        seq_len = inputs.shape[0]
        try:
            _data.char_corpus(1, seq_len, split="heldout").heldout_set(1)
        except _data.DataError as e:
            raise NoTrainingData(f"{spec}: {e}") from None
        return TrainingData(functools.partial(_corpus_source, seq_len), f"{_TEXT_DATA}, {seq_len} characters a sample")
    if split.family == "image":
        return _image_classifier_data(spec, inputs, targets, "num_labels")
    converged = ", ".join(k for k, v in HF_SPLITS.items() if v.task == "causal-lm")
    raise NoTrainingData(
        f"{spec}: converge has no data for {model_type} ({split.auto}); it trains causal language models "
        f"({converged}) on characters and image classifiers (resnet, vit, torchvision:) on digits: add "
        "--synthetic for a loss curve on random samples, or give a factory that returns its data"
    )


def _factory_data(spec: str, data: Callable | None) -> TrainingData:
    """A factory's own data, checked: a training batch and the held-out set come out."""
    if data is None:
        raise NoTrainingData(
            f"{spec}: the factory gives no data (no fifth item): return its data as a fifth item "
            "(pipesim.validate.data.tensors(train, heldout)), or add --synthetic to train on random samples "
            "of its example's shapes (a loss curve only)"
        )
    for split, call in (("train", lambda s: s.batch(0)), ("heldout", lambda s: s.heldout_set())):
        try:
            got = call(data(1, 0, split))
        except AttributeError as e:
            raise NoTrainingData(
                f"{spec}: the factory's data for split {split!r} lacks {e.name or 'a method'} (a source "
                "has batch(index), and for 'heldout' heldout_set())"
            ) from None
        except Exception as e:
            raise NoTrainingData(f"{spec}: the factory's data for split {split!r} raised {_first_line(e)}") from None
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[1], torch.Tensor)):
            raise NoTrainingData(
                f"{spec}: the factory's data for split {split!r} gave a {type(got).__name__}, not (inputs, targets)"
            )
    kind = "tensors" if isinstance(data, _data.TensorData) else getattr(data, "__name__", type(data).__name__)
    return TrainingData(data, f"the factory's data ({kind})")


# ---------------------------------------------------------------- factories


def from_factory(
    spec: str,
    microbatch_size: int,
    *,
    seed: int = 0,
    dtype: str = "fp32",
    device: str | torch.device = "cpu",
    optimizer: str = "sgd",
    memory_check: bool = True,
) -> RealModel:
    """The model a user's factory makes.

    ``spec`` is ``package.module:name`` (imported) or ``path/to/file.py:name``
    (loaded from the file). The factory is called as
    ``factory(microbatch_size)`` and returns a 4-tuple::

        (layers, example_inputs, example_targets, loss_fn)

    * ``layers``: an ``nn.Sequential`` (its children are the layers, named by
      their keys when those are not numbers) or a list of ``nn.Module``, in
      forward order. Layer ``i + 1`` is called on layer ``i``'s output: one
      tensor as ``layer(x)``, a tuple of tensors as ``layer(*x)``.
    * ``example_inputs``: one micro-batch of inputs for layer 0, a tensor or
      a tuple of tensors; the first tensor's leading dimension is
      ``microbatch_size``. This batch is every micro-batch of the data.
    * ``example_targets``: a tensor, what ``loss_fn`` compares the output with.
    * ``loss_fn(output, targets)``: a scalar tensor; ``output`` is what the
      last layer returns.
    * optionally a fifth item, ``data``: the model's data, for ``pipesim
      converge`` (:func:`training_source`), called as ``data(microbatch_size,
      seed, split)`` with ``split`` ``"train"`` or ``"heldout"``; it returns a
      source whose ``batch(index)`` gives ``(inputs, targets)`` of
      micro-batch ``index`` (samples ``index*b .. index*b+b-1`` of the seed's
      stream, a pure function of (seed, index)) and, for ``"heldout"``,
      ``heldout_set()``, the whole held-out set. ``data.tensors(train,
      heldout)`` (:func:`pipesim.validate.data.tensors`) makes one from
      tensors. Profiling and ``pipesim validate`` stream the example batch
      whatever it is.

    The factory runs under ``torch.manual_seed(seed)``; it is first run on
    the ``meta`` device to count the parameters without allocating them
    (a factory that cannot run there is counted once built).
    """
    factory = _load_factory(spec)

    def call():
        return factory(microbatch_size)

    def layers_only():
        made = call()
        return made[0] if isinstance(made, (tuple, list)) and made else made

    counted = _meta_params(layers_only) if memory_check else None
    if counted is not None:
        check_memory(spec, counted, dtype=dtype, device=device, optimizer=optimizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            made = call()
        except Exception as e:
            raise ModelError(f"{spec}: the factory raised {_first_line(e)}") from None
    layers, names, inputs, targets, loss_fn, data = _check_factory_result(spec, made, microbatch_size)
    if memory_check and counted is None:  # counted now that it exists
        check_memory(
            spec,
            sum(p.numel() for m in layers for p in m.parameters()),
            dtype=dtype,
            device=device,
            optimizer=optimizer,
        )
    if dtype != "fp32":
        inputs = tuple(_cast(t, dtype) for t in inputs) if isinstance(inputs, tuple) else _cast(inputs, dtype)
    config = {"source": "factory", "factory": spec, "seed": seed, "dtype": dtype, "microbatch_size": microbatch_size}
    model = _real_model(spec, layers, loss_fn, config, names, FactorySources(inputs, targets, data), "factory", dtype)
    model.description = (
        f"{spec}: a factory's {len(layers)} layers; {model.num_params():,} parameters; data: its example "
        f"batch of {microbatch_size}{' (and its own data, for converge)' if data is not None else ''}"
    )
    return model


def _cast(t: torch.Tensor, dtype: str) -> torch.Tensor:
    return t.to(DTYPES[dtype]) if t.is_floating_point() else t


def _load_factory(spec: str) -> Callable:
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ModelError(f"{spec}: a factory is module.path:function or path/to/file.py:function")
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise ModelError(f"{spec}: no such file {where}")
        module_name = f"_pipesim_factory_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(module_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(module_name, path)
            if loader is None or loader.loader is None:
                raise ModelError(f"{spec}: {where} is not a Python file")
            module = importlib.util.module_from_spec(loader)
            try:
                loader.loader.exec_module(module)
            except Exception as e:
                raise ModelError(f"{spec}: importing {where} raised {_first_line(e)}") from None
            sys.modules[module_name] = module
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise ModelError(f"{spec}: cannot import {where}: {_first_line(e)}") from None
    factory = getattr(module, name, None)
    if factory is None:
        raise ModelError(f"{spec}: {where} has no {name}")
    if not callable(factory):
        raise ModelError(f"{spec}: {name} is a {type(factory).__name__}, not a callable")
    return factory


_FACTORY_SHAPE = "return (layers, example_inputs, example_targets, loss_fn), and optionally its data fifth"


def _check_factory_result(spec: str, made: Any, microbatch_size: int):
    if not isinstance(made, (tuple, list)) or len(made) not in (4, 5):
        got = f"a {len(made)}-tuple" if isinstance(made, (tuple, list)) else f"a {type(made).__name__}"
        raise ModelError(f"{spec}: the factory returned {got}; it must {_FACTORY_SHAPE}")
    model, inputs, targets, loss_fn = made[:4]
    data = made[4] if len(made) == 5 else None
    if data is not None and not callable(data):
        raise ModelError(
            f"{spec}: the factory's fifth item (its data) must be None or callable as "
            f"data(microbatch_size, seed, split), got a {type(data).__name__}"
        )
    if isinstance(model, nn.Sequential):
        layers = list(model)
        keys = list(model._modules)
        names = [
            k if not k.isdigit() else f"{type(m).__name__.lower()}{i}" for i, (k, m) in enumerate(zip(keys, layers))
        ]
    elif isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
        layers = list(model)
        names = [f"{type(m).__name__.lower()}{i}" for i, m in enumerate(layers)]
    elif isinstance(model, nn.Module):
        raise ModelError(
            f"{spec}: the factory returned one {type(model).__name__}, which pipesim cannot cut into layers: "
            "return an nn.Sequential or a list of modules, each called on the previous one's output"
        )
    else:
        raise ModelError(f"{spec}: the factory's layers are a {type(model).__name__}; {_FACTORY_SHAPE}")
    if not layers:
        raise ModelError(f"{spec}: the factory returned no layers")
    sent = inputs if isinstance(inputs, tuple) else (inputs,)
    if not sent or not all(isinstance(t, torch.Tensor) for t in sent):
        raise ModelError(f"{spec}: example_inputs must be a tensor or a tuple of tensors; {_FACTORY_SHAPE}")
    if sent[0].dim() == 0 or sent[0].shape[0] != microbatch_size:
        raise ModelError(
            f"{spec}: example_inputs' first tensor has shape {tuple(sent[0].shape)}; its first dimension must be "
            f"the micro-batch size, {microbatch_size}"
        )
    if not isinstance(targets, torch.Tensor):
        raise ModelError(f"{spec}: example_targets must be a tensor, got a {type(targets).__name__}")
    if not callable(loss_fn):
        raise ModelError(f"{spec}: loss_fn must be callable, got a {type(loss_fn).__name__}")
    return layers, names, inputs, targets, loss_fn, data


# ---------------------------------------------------------------- query strings


def _parse_query(spec: str, query: str) -> dict[str, str]:
    if not query:
        return {}
    pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False)
    out: dict[str, str] = {}
    for part in query.split("&"):
        if part and "=" not in part:
            raise ModelError(f"{spec}: {part!r} is not field=value")
    for k, v in pairs:
        if k in out:
            raise ModelError(f"{spec}: {k} is given twice")
        out[k] = v
    return out


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _typed(spec: str, key: str, text: str, default: Any) -> Any:
    """``text`` as the type of ``default`` (a field's default value)."""

    def bad(kind: str) -> ModelError:
        return ModelError(f"{spec}: {key}={text} is not {kind} (the default is {default!r})")

    if isinstance(default, bool):
        low = text.lower()
        if low in _TRUE | _FALSE:
            return low in _TRUE
        raise bad("true or false")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise bad("an integer") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise bad("a number") from None
    if isinstance(default, str):
        return text
    if isinstance(default, (list, tuple)):
        items = [t for t in text.split(",") if t != ""]
        sample = default[0] if len(default) else None
        try:
            values = [_typed(spec, key, t, sample) if sample is not None else _guess(t) for t in items]
        except ModelError:
            raise bad(f"a comma-separated list of {type(sample).__name__}") from None
        return type(default)(values)
    if isinstance(default, dict):
        try:
            value = json.loads(text)
        except ValueError:
            raise bad("a JSON object") from None
        if not isinstance(value, dict):
            raise bad("a JSON object")
        return value
    return _guess(text)


def _guess(text: str) -> Any:
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# ---------------------------------------------------------------- transformers


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded, ever
    try:
        import transformers
    except ImportError:
        raise ModelError(f"hf: models need the transformers extra: {INSTALL_HINT}") from None
    except Exception as e:
        raise ModelError(f"hf: transformers does not import: {_first_line(e)}") from None
    # its advice on configurations (token ids outside a shrunk vocabulary) is not pipesim's output
    transformers.logging.set_verbosity_error()
    return transformers


class _Embed(nn.Module):
    """Token (+ learned position) embeddings, dropout: ids -> hidden."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None = None, drop: nn.Module | None = None):
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.drop = drop if drop is not None else nn.Identity()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids)
        if self.positions is not None:
            h = h + self.positions(torch.arange(ids.shape[-1], device=ids.device))
        return self.drop(h)


class _Head(nn.Module):
    """Modules applied in order to the hidden states; the constants that
    came along (rotary tables) end here."""

    def __init__(self, *modules: nn.Module):
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self, h: torch.Tensor, *_constants: torch.Tensor) -> torch.Tensor:
        for m in self.parts:
            h = m(h)
        return h


class _Block(nn.Module):
    """One Hugging Face block on the hidden states alone (no mask: none is
    needed when no sequence is padded; attention runs through SDPA)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.block(h)
        return out[0] if isinstance(out, tuple) else out


class _RotaryEmbed(nn.Module):
    """Token embedding and the rotary tables: ids -> (hidden, cos, sin)."""

    def __init__(self, tokens: nn.Module, rotary: nn.Module):
        super().__init__()
        self.tokens = tokens
        self.rotary = rotary

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.tokens(ids)
        positions = torch.arange(ids.shape[-1], device=ids.device).unsqueeze(0)
        cos, sin = self.rotary(h, positions)
        return h, cos, sin


class _RotaryBlock(nn.Module):
    """A decoder layer: (hidden, cos, sin) -> (hidden, cos, sin)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        out = self.block(h, position_embeddings=(cos, sin))
        return (out[0] if isinstance(out, tuple) else out), cos, sin


class _Flatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(x, 1)


def _seq_len(spec: str, cfg, options: dict[str, Any]) -> int:
    limit = next((getattr(cfg, k) for k in ("max_position_embeddings", "n_positions") if getattr(cfg, k, None)), None)
    n = options.get("seq_len", DEFAULT_SEQ_LEN if limit is None else min(DEFAULT_SEQ_LEN, limit))
    if limit is not None and n > limit:
        raise ModelError(f"{spec}: seq_len={n} is longer than the model's {limit} positions")
    return n


def _blocks(spec: str, base: nn.Module) -> nn.ModuleList:
    """The repeated blocks of a Hugging Face base model, wherever its
    version keeps them (``layers``, ``encoder.layer``, ``h``)."""
    for path in ("layers", "encoder.layer", "encoder.layers", "h"):
        try:
            found = base.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(found, nn.ModuleList):
            return found
    raise ModelError(f"{spec}: pipesim cannot find the blocks of {type(base).__name__} in this transformers version")


def _split_gpt2(spec, model, cfg, options):
    t = model.transformer
    blocks = _blocks(spec, t)
    layers = [_Embed(t.wte, t.wpe, t.drop)] + [_Block(b) for b in blocks] + [_Head(t.ln_f, model.lm_head)]
    names = ["embed"] + [f"block{i}" for i in range(len(blocks))] + ["head"]
    return layers, names


def _split_bert(spec, model, cfg, options):
    b = model.bert
    if b.pooler is None:
        raise ModelError(f"{spec}: add_pooling_layer is off; the classification head needs the pooler")
    blocks = _blocks(spec, b)
    layers = [b.embeddings] + [_Block(layer) for layer in blocks]
    layers.append(_Head(b.pooler, model.dropout, model.classifier))
    names = ["embed"] + [f"layer{i}" for i in range(len(blocks))] + ["head"]
    return layers, names


def _split_decoder(spec, model, cfg, options):
    m = model.model
    blocks = _blocks(spec, m)
    layers = [_RotaryEmbed(m.embed_tokens, m.rotary_emb)] + [_RotaryBlock(b) for b in blocks]
    layers.append(_Head(m.norm, model.lm_head))
    names = ["embed"] + [f"layer{i}" for i in range(len(blocks))] + ["head"]
    return layers, names


def _split_resnet(spec, model, cfg, options):
    r = model.resnet
    layers, names = [r.embedder], ["embedder"]
    for s, stage in enumerate(r.encoder.stages):
        for j, block in enumerate(stage.layers):
            layers.append(block)
            names.append(f"stage{s}.block{j}")
    layers.append(_Head(r.pooler, model.classifier))
    names.append("head")
    return layers, names


def _split_vit(spec, model, cfg, options):
    v = model.vit
    blocks = _blocks(spec, v)
    layers = [v.embeddings] + [_Block(layer) for layer in blocks]
    layers.append(_ViTHead(v.layernorm, model.classifier))
    names = ["embed"] + [f"layer{i}" for i in range(len(blocks))] + ["head"]
    return layers, names


@dataclass(frozen=True)
class _HFSplit:
    auto: str  # the transformers Auto class whose model is split
    split: Callable  # (spec, model, config, options) -> (layers, names)
    family: str  # "text" or "image": which input key applies
    task: str  # "causal-lm" (targets: a token per position) or "classification" (a label per sample)


#: The model types pipesim cuts into layers, with the task head it builds.
HF_SPLITS: dict[str, _HFSplit] = {
    "gpt2": _HFSplit("AutoModelForCausalLM", _split_gpt2, "text", "causal-lm"),
    "bert": _HFSplit("AutoModelForSequenceClassification", _split_bert, "text", "classification"),
    "llama": _HFSplit("AutoModelForCausalLM", _split_decoder, "text", "causal-lm"),
    "mistral": _HFSplit("AutoModelForCausalLM", _split_decoder, "text", "causal-lm"),
    "qwen2": _HFSplit("AutoModelForCausalLM", _split_decoder, "text", "causal-lm"),
    "resnet": _HFSplit("AutoModelForImageClassification", _split_resnet, "image", "classification"),
    "vit": _HFSplit("AutoModelForImageClassification", _split_vit, "image", "classification"),
}

#: Query keys that size the input rather than the model (module doc).
_INPUT_KEYS = {"text": ("seq_len",), "image": ("image_size",)}


class _ViTHead(nn.Module):
    """layernorm, then the classifier on the [CLS] token."""

    def __init__(self, norm: nn.Module, classifier: nn.Module):
        super().__init__()
        self.norm = norm
        self.classifier = classifier

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(h)[:, 0, :])


def _is_path(target: str) -> bool:
    """Whether ``hf:TARGET`` names a configuration file (or its folder), not a model type."""
    return target.endswith(".json") or "/" in target or os.sep in target


def _hf_config(spec: str, target: str, query: dict[str, str]):
    """(model type, configuration with the overrides, overrides, input options)."""
    transformers = _transformers()
    if _is_path(target):
        path = Path(target)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ModelError(f"{spec}: cannot read {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise ModelError(f"{spec}: {path} is not JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
            raise ModelError(f"{spec}: {path} has no model_type")
        model_type = data["model_type"]
    else:
        model_type, data = target, None
    try:
        default = transformers.AutoConfig.for_model(model_type)
    except (ValueError, KeyError):
        raise ModelError(
            f"{spec}: transformers {transformers.__version__} has no model type {model_type!r} "
            f"(pipesim splits: {', '.join(HF_SPLITS)})"
        ) from None
    if data is not None:
        try:
            default = type(default).from_dict(data)
        except Exception as e:
            raise ModelError(f"{spec}: the configuration in {target} is refused: {_first_line(e)}") from None
    split = HF_SPLITS.get(model_type)
    if split is None:
        raise ModelError(
            f"{spec}: pipesim cannot cut a {type(default).__name__.removesuffix('Config')} model into pipeline "
            f"layers (it splits {', '.join(HF_SPLITS)}); for another model, write a factory "
            "(docs/how-to/bring-your-own-model.md)"
        )
    inputs = _INPUT_KEYS[split.family]
    overrides, options = {}, {}
    fields = default.to_dict()
    for key, text in query.items():
        if key in inputs and not hasattr(default, key):
            options[key] = _typed(spec, key, text, DEFAULT_SEQ_LEN if key == "seq_len" else DEFAULT_IMAGE_SIZE)
            if options[key] < 1:
                raise ModelError(f"{spec}: {key} must be a positive integer, got {options[key]}")
            continue
        if key not in fields and not hasattr(default, key):
            raise ModelError(
                f"{spec}: {key} is not a field of {type(default).__name__}"
                + (f" (besides its fields: {', '.join(inputs)}, the input's size)" if inputs else "")
            )
        overrides[key] = _typed(spec, key, text, getattr(default, key, fields.get(key)))
    try:
        base = data if data is not None else {}
        config = type(default).from_dict({**base, **overrides}) if data is not None else None
        if config is None:
            config = transformers.AutoConfig.for_model(model_type, **overrides)
    except Exception as e:
        raise ModelError(f"{spec}: the configuration refused the overrides: {_first_line(e)}") from None
    return model_type, config, overrides, options, split


def _hf_model(spec, rest, seed, dtype, device, optimizer, memory_check) -> RealModel:
    target, _, query_text = rest.partition("?")
    if not target:
        raise ModelError(f"{spec}: name a model type (hf:gpt2) or a config.json (hf:path/to/config.json)")
    transformers = _transformers()
    model_type, config, overrides, options, split = _hf_config(spec, target, _parse_query(spec, query_text))
    auto = getattr(transformers, split.auto)

    if split.family == "text":  # the input's size first: nothing is built for a bad one
        n = _seq_len(spec, config, options)
        inputs = _data.TensorSpec((n,), torch.int64, config.vocab_size)
        size = {"seq_len": n}
    else:
        side = options.get("image_size") or getattr(config, "image_size", None) or DEFAULT_IMAGE_SIZE
        channels = getattr(config, "num_channels", 3)
        inputs = _data.TensorSpec((channels, side, side), DTYPES[dtype])
        size = {"image_size": side}
    if split.task == "causal-lm":
        targets = _data.TensorSpec((inputs.shape[0],), torch.int64, config.vocab_size)
    else:
        targets = _data.TensorSpec((), torch.int64, config.num_labels)
    attention = {"attn_implementation": "sdpa"} if split.family == "text" else {}

    def build():
        return auto.from_config(config, **attention)

    if memory_check:
        try:
            with torch.device("meta"):
                meta = build()
            n = sum(p.numel() for p in meta.parameters()) + _tied_numel(meta)  # untied below
        except Exception as e:
            raise ModelError(f"{spec}: transformers cannot build it: {_first_line(e)}") from None
        check_memory(spec, n, dtype=dtype, device=device, optimizer=optimizer, what=f"{model_type}, {split.auto}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            whole = build()
        except Exception as e:
            raise ModelError(f"{spec}: transformers cannot build it: {_first_line(e)}") from None
    whole.train()
    _untie(whole)
    layers, names = split.split(spec, whole, config, options)
    if len(layers) < 2:
        raise ModelError(f"{spec}: {len(layers)} layer(s); nothing to cut")
    cfg = {
        "source": "hf",
        "model_type": model_type,
        "class": type(whole).__name__,
        "overrides": overrides,
        **size,
        "seed": seed,
        "dtype": dtype,
        "transformers": transformers.__version__,
    }
    model = _real_model(
        spec, layers, cross_entropy, cfg, names, functools.partial(_random_source, inputs, targets), "hf", dtype
    )
    shape = ", ".join(f"{k} {v}" for k, v in size.items())
    model.description = (
        f"{spec}: transformers {transformers.__version__} {type(whole).__name__} from "
        f"{'the configuration file' if _is_path(target) else 'its configuration class defaults'}"
        f"{', ' + ', '.join(f'{k}={v}' for k, v in overrides.items()) if overrides else ''}; random weights "
        f"(seed {seed}), {dtype}; {model.num_params():,} parameters; {len(layers)} layers; {shape}; "
        "random data"
    )
    return model


def _tied(whole: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(output, input) embeddings when they share one weight."""
    try:
        out, inp = whole.get_output_embeddings(), whole.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # no embeddings (image models)
        return None
    if out is not None and inp is not None and out.weight is inp.weight:
        return out, inp
    return None


def _tied_numel(whole: nn.Module) -> int:
    tied = _tied(whole)
    return tied[0].weight.numel() if tied else 0


def _untie(whole: nn.Module) -> None:
    """Give a tied output embedding its own copy of the weight, equal at the
    start (as Megatron-LM's last stage starts from the first stage's)."""
    tied = _tied(whole)
    if tied:
        out, inp = tied
        out.weight = nn.Parameter(inp.weight.detach().clone())


# ---------------------------------------------------------------- torchvision


def _torchvision(spec: str):
    try:
        import torchvision
    except ImportError as e:
        if getattr(e, "name", None) == "torchvision":
            raise ModelError(
                f"{spec}: torchvision is not installed; install the build made for torch {torch.__version__} "
                "(PyTorch's wheel index), never another torch, or use hf:resnet / hf:vit"
            ) from None
        raise ModelError(_torchvision_mismatch(spec, e)) from None
    except Exception as e:
        raise ModelError(_torchvision_mismatch(spec, e)) from None
    return torchvision


def _torchvision_mismatch(spec: str, e: BaseException) -> str:
    return (
        f"{spec}: the installed torchvision does not import against torch {torch.__version__} "
        f"({_first_line(e)}): it was built for another torch; install the torchvision build made for "
        f"torch {torch.__version__} (PyTorch's wheel index), or use hf:resnet / hf:vit"
    )


def _open(children: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    out = []
    for name, m in children:
        if isinstance(m, nn.Sequential) and len(m) > 0:
            out += [(f"{name}.{k}", c) for k, c in m.named_children()]
        else:
            out.append((name, m))
    return out


def _torchvision_model(spec, rest, seed, dtype, device, optimizer, memory_check) -> RealModel:
    name, _, query_text = rest.partition("?")
    if not name:
        raise ModelError(f"{spec}: name a model (torchvision:resnet50)")
    torchvision = _torchvision(spec)
    query = _parse_query(spec, query_text)
    side = _typed(spec, "image_size", query.pop("image_size", str(DEFAULT_IMAGE_SIZE)), DEFAULT_IMAGE_SIZE)
    kwargs = {k: _guess(v) for k, v in query.items()}

    def build():
        return torchvision.models.get_model(name, weights=None, **kwargs)

    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in build().parameters())
    except (ValueError, KeyError):
        raise ModelError(f"{spec}: torchvision has no model {name!r} (torchvision.models.list_models())") from None
    except Exception as e:
        raise ModelError(f"{spec}: torchvision cannot build it: {_first_line(e)}") from None
    if memory_check:
        check_memory(spec, n, dtype=dtype, device=device, optimizer=optimizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        whole = build()
    parts, flattened = [], False
    for child_name, m in _open(list(whole.named_children())):
        if not flattened and isinstance(m, nn.Linear):
            parts.append(("flatten", _Flatten()))
            flattened = True
        parts.append((child_name, m))
    layers = [m for _, m in parts]
    names = [n for n, _ in parts]
    classes = next((m.out_features for m in reversed(layers) if isinstance(m, nn.Linear)), None)
    if classes is None or len(layers) < 2:
        raise ModelError(f"{spec}: pipesim cannot cut {type(whole).__name__} into layers (no final linear layer)")
    _check_chain(spec, whole, layers, side)
    whole.train()
    inputs = _data.TensorSpec((3, side, side), DTYPES[dtype])
    targets = _data.TensorSpec((), torch.int64, classes)
    cfg = {"source": "torchvision", "name": name, "kwargs": kwargs, "image_size": side, "seed": seed, "dtype": dtype}
    model = _real_model(
        spec,
        layers,
        cross_entropy,
        cfg,
        names,
        functools.partial(_random_source, inputs, targets),
        "torchvision",
        dtype,
    )
    model.description = (
        f"{spec}: torchvision {torchvision.__version__} {type(whole).__name__}, random weights (seed {seed}), "
        f"{dtype}; {model.num_params():,} parameters; {len(layers)} layers; image_size {side}; random data"
    )
    return model


def _check_chain(spec: str, whole: nn.Module, layers: list[nn.Module], side: int) -> None:
    """Refuse a split whose chain does not compute the model's forward
    (a forward with functional steps between its children)."""
    was = whole.training
    whole.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            x = torch.randn(1, 3, side, side)
            want = whole(x)
            got = x
            for m in layers:
                got = m(got)
    except Exception as e:
        raise ModelError(f"{spec}: its children do not chain: {_first_line(e)}") from None
    finally:
        whole.train(was)
    if not isinstance(want, torch.Tensor) or got.shape != want.shape or not torch.allclose(got, want, atol=1e-4):
        raise ModelError(
            f"{spec}: its forward is not the chain of its children, so pipesim cannot cut it; write a factory "
            "(docs/how-to/bring-your-own-model.md)"
        )

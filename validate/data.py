"""Training data for the validation harness: real, bundled, deterministic.

Every source here is an endless stream of micro-batches addressed by index,
and ``source.batch(index)`` is a pure function of ``(seed, index)``. That is
what a pipeline runtime needs: each rank builds its own source and asks for
whichever micro-batches its schedule touches, in whatever order, and the
first and last stages must still agree on which targets belong to which
inputs, and a rerun must see the same stream. Nothing here keeps an
iterator position, so there is no state to synchronise or checkpoint.

Randomness comes from ``numpy.random.default_rng([seed, ...])`` (a
``SeedSequence`` over the integer words), never from a global RNG, so the
global state of torch or numpy neither affects nor is affected by a batch.

Every stream is addressed by *sample*: micro-batch ``index`` of size ``b``
holds samples ``index*b .. index*b + b - 1`` of one sample stream per
``seed``. Two runs that cut the stream into micro-batches of different
sizes (a pipeline with m micro-batches of B/m samples, PipeDream with one of
B) therefore train on the same samples in the same order.

Splits. A source reads one ``split`` of its data (:data:`SPLITS`): ``"all"``
(the default, what the timing harness has always streamed), ``"train"`` or
``"heldout"``, which are disjoint and fixed (they do not depend on the seed).
:meth:`Digits.heldout_set` / :meth:`CharCorpus.heldout_set` give the whole
held-out split once, in a fixed order, for evaluation.

Sources (nothing is downloaded; both data sets ship with installed packages):

``digits``
    scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes;
    held out: a fixed 20%, stratified by class). The stream walks the split
    in epochs: sample position ``p`` of the stream is example
    ``perm_e[p % n]`` of epoch ``e = p // n``, with a fresh permutation per
    epoch. A micro-batch that straddles an epoch boundary takes its tail from
    the next epoch's permutation, so every epoch visits every example exactly
    once.
``char_corpus``
    Character-level language modelling on the help texts that ship with
    Python (``pydoc_data.topics``, about 465k characters; held out: the last
    10%). Sample ``p`` is a window starting at an offset drawn for it (in
    blocks of :data:`CORPUS_BLOCK` samples per generator, for speed);
    training windows lie wholly before the held-out tail, held-out windows
    wholly inside it. Targets are the inputs shifted by one.
``digit_images``
    The digits made into an image model's input: each 8x8 image resized
    (bilinear) to ``image_size`` x ``image_size`` and repeated over
    ``channels`` channels, the same samples, splits and order as ``digits``
    (:class:`DigitImages`; what ``pipesim converge`` trains Hugging Face and
    torchvision image classifiers on).
``tensors``
    Your own samples, held in memory: a training set and a held-out set of
    tensors (:func:`tensors`, :class:`TensorSamples`), walked in epochs as
    ``digits`` is, a fresh permutation per epoch and seed. What a model
    factory returns as its data for ``pipesim converge``.
``synthetic``
    Random tensors of given per-sample shapes and dtypes, for timing runs
    where the values do not matter but the shapes must. Any source's
    ``input_spec``/``target_spec`` describe it well enough to build one
    (:func:`synthetic_like`).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from pipesim.sim.errors import InputError

__all__ = [
    "SPLITS",
    "CharCorpus",
    "DataError",
    "DigitImages",
    "Digits",
    "MicroBatchSource",
    "Synthetic",
    "TensorData",
    "TensorSamples",
    "TensorSpec",
    "char_corpus",
    "corpus_text",
    "digit_images",
    "digits",
    "synthetic",
    "synthetic_like",
    "tensors",
]


class DataError(InputError):
    """A data source asked for something it cannot give (one line)."""


# Tags keep the streams of different sources apart even for equal seeds.
_DIGITS_TAG = 1
_CORPUS_TAG = 2
_SYNTHETIC_TAG = 3
_SPLIT_TAG = 4
_TENSORS_TAG = 5

#: What a source can read: everything, or one of two fixed, disjoint parts.
SPLITS = ("all", "train", "heldout")
#: Share of each data set held out for evaluation.
DIGITS_HELDOUT_SHARE = 0.2
CORPUS_HELDOUT_SHARE = 0.1
#: Corpus window offsets are drawn this many samples per generator.
CORPUS_BLOCK = 256


def _check_split(split: object) -> str:
    if split not in SPLITS:
        raise DataError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return split


@dataclass(frozen=True)
class TensorSpec:
    """Per-sample shape and dtype of one side of a micro-batch.

    ``high`` is the exclusive upper bound of integer values (class count,
    vocabulary size); synthetic data needs it to produce valid indices.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    high: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 1 for s in self.shape):
            raise DataError(f"TensorSpec shape must be positive, got {self.shape}")
        if self.dtype.is_floating_point:
            return
        if self.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise DataError(f"TensorSpec dtype must be floating or integer, got {self.dtype}")
        if self.high is None or self.high < 1:
            raise DataError(f"integer TensorSpec needs high >= 1, got {self.high}")

    def batch_shape(self, microbatch_size: int) -> tuple[int, ...]:
        return (microbatch_size, *self.shape)


@runtime_checkable
class MicroBatchSource(Protocol):
    """What the harness needs from a data stream."""

    microbatch_size: int

    @property
    def input_spec(self) -> TensorSpec: ...

    @property
    def target_spec(self) -> TensorSpec: ...

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def _check_int(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; True as a batch size is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise DataError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise DataError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _rng(tag: int, seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([tag, seed, index])


# ----------------------------------------------------------------- digits


@functools.cache
def _digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """Load and standardise once per process (about 10 ms, but per batch it adds up)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = d.data.astype(np.float64)
    mean = x.mean(axis=0)
    std = x.std(axis=0)
    # Corner pixels are always 0: StandardScaler's convention (scale 1) keeps
    # them 0 instead of dividing by zero.
    std[std == 0.0] = 1.0
    x = ((x - mean) / std).astype(np.float32)
    inputs = torch.from_numpy(x)
    targets = torch.from_numpy(d.target.astype(np.int64))
    return inputs, targets


@functools.cache
def _digits_split_rows(split: str) -> np.ndarray:
    """Rows of the data set in ``split``: held out, a fixed share of every
    class (drawn once, whatever the run's seed); train, the rest."""
    _, targets = _digits_arrays()
    y = targets.numpy()
    if split == "all":
        rows = np.arange(len(y))
    else:
        rng = _rng(_SPLIT_TAG, 0, 0)
        held = []
        for c in np.unique(y):
            members = np.flatnonzero(y == c)
            held.append(rng.permutation(members)[: round(len(members) * DIGITS_HELDOUT_SHARE)])
        held_rows = np.sort(np.concatenate(held))
        rows = held_rows if split == "heldout" else np.setdiff1d(np.arange(len(y)), held_rows)
    rows.flags.writeable = False
    return rows


@functools.lru_cache(maxsize=16)
def _epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    perm = _rng(_DIGITS_TAG, seed, epoch).permutation(n)
    perm.flags.writeable = False
    return perm


@dataclass(frozen=True)
class Digits:
    """8x8 digit images, standardised per pixel over the whole data set.

    Standardising per pixel (not with one global mean) gives every input
    feature unit scale, which is what lets a plain-SGD MLP learn in a few
    dozen steps.
    """

    microbatch_size: int
    seed: int = 0
    image: bool = False
    split: str = "all"
    num_classes: int = field(default=10, init=False)

    def __post_init__(self) -> None:
        _check_int("microbatch_size", self.microbatch_size, 1)
        _check_int("seed", self.seed, 0)
        _check_split(self.split)

    @property
    def num_examples(self) -> int:
        return len(_digits_split_rows(self.split))

    def _shape(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, 1, 8, 8) if self.image else x

    def heldout_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held-out example once, in data-set order (the same for every seed)."""
        x, y = _digits_arrays()
        idx = torch.from_numpy(_digits_split_rows("heldout").copy())
        return self._shape(x[idx]), y[idx]

    @property
    def input_spec(self) -> TensorSpec:
        return TensorSpec((1, 8, 8) if self.image else (64,), torch.float32)

    @property
    def target_spec(self) -> TensorSpec:
        return TensorSpec((), torch.int64, high=self.num_classes)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = _check_int("index", index, 0)
        x, y = _digits_arrays()
        members = _digits_split_rows(self.split)
        n = len(members)
        b = self.microbatch_size
        positions = index * b + np.arange(b, dtype=np.int64)
        epochs = positions // n
        within = positions % n
        rows = np.empty(b, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            rows[sel] = members[_epoch_permutation(self.seed, int(e), n)[within[sel]]]
        idx = torch.from_numpy(rows)
        return self._shape(x[idx]), y[idx]


def digits(microbatch_size: int, *, seed: int = 0, image: bool = False, split: str = "all") -> Digits:
    """scikit-learn's digits: inputs (b, 64) or, with ``image``, (b, 1, 8, 8)."""
    return Digits(microbatch_size, seed=seed, image=image, split=split)


@dataclass(frozen=True)
class DigitImages:
    """:class:`Digits` as an image model's input: every 8x8 image resized
    (bilinear, ``align_corners=False``) to ``image_size`` pixels a side and
    repeated over ``channels`` channels. Sample ``p`` is the digits' sample
    ``p`` (same split, same epochs, same order), so a run on these images
    reads the samples a run on the digits reads."""

    microbatch_size: int
    image_size: int
    channels: int = 3
    seed: int = 0
    split: str = "all"
    num_classes: int = field(default=10, init=False)

    def __post_init__(self) -> None:
        _check_int("image_size", self.image_size, 1)
        _check_int("channels", self.channels, 1)
        self._digits()  # the rest of the checks

    def _digits(self) -> Digits:
        return Digits(self.microbatch_size, seed=self.seed, image=True, split=self.split)

    def _resized(self, x: torch.Tensor) -> torch.Tensor:
        side = self.image_size
        if side != 8:
            x = torch.nn.functional.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
        return x.expand(-1, self.channels, -1, -1).contiguous()

    @property
    def input_spec(self) -> TensorSpec:
        return TensorSpec((self.channels, self.image_size, self.image_size), torch.float32)

    @property
    def target_spec(self) -> TensorSpec:
        return TensorSpec((), torch.int64, high=self.num_classes)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self._digits().batch(index)
        return self._resized(x), y

    def heldout_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held-out digit once, resized, in data-set order (the same for every seed)."""
        x, y = self._digits().heldout_set()
        return self._resized(x), y


def digit_images(
    microbatch_size: int, image_size: int, *, channels: int = 3, seed: int = 0, split: str = "all"
) -> DigitImages:
    """The digits as (b, channels, image_size, image_size) images."""
    return DigitImages(microbatch_size, image_size, channels, seed=seed, split=split)


# ------------------------------------------------------------ char corpus


@functools.cache
def corpus_text() -> str:
    """The help texts bundled with Python, in sorted-key order (stable across runs)."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


@functools.cache
def _corpus_tokens() -> tuple[str, torch.Tensor]:
    text = corpus_text()
    vocab = "".join(sorted(set(text)))
    lut = {c: i for i, c in enumerate(vocab)}
    ids = np.fromiter((lut[c] for c in text), dtype=np.int64, count=len(text))
    return vocab, torch.from_numpy(ids)


@dataclass(frozen=True)
class CharCorpus:
    """Next-character prediction windows over :func:`corpus_text`.

    Offsets are drawn uniformly per sample rather than walked in epochs:
    with ~465k start positions, overlapping random windows are the usual
    char-LM practice and keep ``batch`` independent of anything but
    ``(seed, index)`` and the micro-batch size.
    """

    microbatch_size: int
    seq_len: int
    seed: int = 0
    split: str = "all"

    def __post_init__(self) -> None:
        _check_int("microbatch_size", self.microbatch_size, 1)
        _check_int("seed", self.seed, 0)
        _check_int("seq_len", self.seq_len, 1)
        _check_split(self.split)
        lo, hi = self._span(self.split)
        if self.seq_len > hi - lo - 1:
            raise DataError(f"seq_len {self.seq_len} is longer than the corpus allows (at most {hi - lo - 1})")

    def _span(self, split: str) -> tuple[int, int]:
        """[first, end) of the tokens windows of ``split`` lie in."""
        n = self.num_tokens
        cut = n - round(n * CORPUS_HELDOUT_SHARE)
        return {"all": (0, n), "train": (0, cut), "heldout": (cut, n)}[split]

    @property
    def vocab(self) -> str:
        return _corpus_tokens()[0]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def num_tokens(self) -> int:
        return _corpus_tokens()[1].numel()

    @property
    def input_spec(self) -> TensorSpec:
        return TensorSpec((self.seq_len,), torch.int64, high=self.vocab_size)

    @property
    def target_spec(self) -> TensorSpec:
        return TensorSpec((self.seq_len,), torch.int64, high=self.vocab_size)

    def encode(self, text: str) -> torch.Tensor:
        lut = {c: i for i, c in enumerate(self.vocab)}
        try:
            return torch.tensor([lut[c] for c in text], dtype=torch.int64)
        except KeyError as e:
            raise DataError(f"character {e.args[0]!r} is not in the corpus vocabulary") from None

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        vocab = self.vocab
        return "".join(vocab[int(i)] for i in torch.as_tensor(ids).reshape(-1))

    def _windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        # window k reads L + 1 tokens: L inputs and the L next characters
        offsets = torch.from_numpy(starts)[:, None] + torch.arange(self.seq_len + 1)
        windows = _corpus_tokens()[1][offsets]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = _check_int("index", index, 0)
        b = self.microbatch_size
        positions = index * b + np.arange(b, dtype=np.int64)
        starts = np.empty(b, dtype=np.int64)
        blocks = positions // CORPUS_BLOCK
        for blk in np.unique(blocks):
            sel = blocks == blk
            starts[sel] = _corpus_block(self.seed, int(blk), *self._span(self.split), self.seq_len)[
                positions[sel] % CORPUS_BLOCK
            ]
        return self._windows(starts)

    def heldout_set(self, max_windows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-overlapping windows of the held-out tail, evenly spaced, at
        most ``max_windows`` of them (the same for every seed)."""
        lo, hi = self._span("heldout")
        L = self.seq_len
        count = min(max_windows, (hi - lo - 1) // L)
        if count < 1:
            raise DataError(f"seq_len {L} is longer than the held-out tail ({hi - lo} tokens)")
        stride = (hi - lo - 1 - L) // max(count - 1, 1)
        return self._windows(lo + stride * np.arange(count, dtype=np.int64))


@functools.lru_cache(maxsize=64)
def _corpus_block(seed: int, block: int, lo: int, hi: int, seq_len: int) -> np.ndarray:
    """Window offsets of samples ``block*CORPUS_BLOCK ..`` of one split's stream."""
    starts = _rng(_CORPUS_TAG, seed, block).integers(lo, hi - seq_len, size=CORPUS_BLOCK)
    starts.flags.writeable = False
    return starts


def char_corpus(microbatch_size: int, seq_len: int, *, seed: int = 0, split: str = "all") -> CharCorpus:
    """Character windows of Python's bundled help texts: (b, seq_len) ids and next-char targets."""
    return CharCorpus(microbatch_size, seq_len, seed=seed, split=split)


# ----------------------------------------------------------------- tensors


def _rows(value: Any, idx: torch.Tensor) -> Any:
    return tuple(t[idx] for t in value) if isinstance(value, tuple) else value[idx]


def _count(name: str, value: Any) -> int:
    ts = value if isinstance(value, tuple) else (value,)
    if not ts or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in ts):
        raise DataError(f"{name} must be a tensor or a tuple of tensors, each with a sample dimension first")
    n = ts[0].shape[0]
    if any(t.shape[0] != n for t in ts):
        raise DataError(f"{name}: every tensor needs the same number of samples, got {[t.shape[0] for t in ts]}")
    return n


@dataclass(frozen=True)
class TensorSamples:
    """One split of :class:`TensorData` as a stream: sample position ``p``
    is example ``perm_e[p % n]`` of epoch ``e = p // n``, with a fresh
    permutation per (seed, epoch), as :class:`Digits` walks its split; the
    held-out split's :meth:`heldout_set` is every held-out sample once."""

    microbatch_size: int
    inputs: Any
    targets: torch.Tensor
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("microbatch_size", self.microbatch_size, 1)
        _check_int("seed", self.seed, 0)

    @property
    def num_examples(self) -> int:
        return int(self.targets.shape[0])

    @property
    def input_spec(self) -> TensorSpec:
        if isinstance(self.inputs, tuple):
            raise DataError("inputs of several tensors have no single input_spec")
        return _spec(self.inputs)

    @property
    def target_spec(self) -> TensorSpec:
        return _spec(self.targets)

    def batch(self, index: int) -> tuple[Any, torch.Tensor]:
        index = _check_int("index", index, 0)
        n, b = self.num_examples, self.microbatch_size
        positions = index * b + np.arange(b, dtype=np.int64)
        epochs, within = positions // n, positions % n
        rows = np.empty(b, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            rows[sel] = _rng(_TENSORS_TAG, self.seed, int(e)).permutation(n)[within[sel]]
        idx = torch.from_numpy(rows)
        return _rows(self.inputs, idx), self.targets[idx]

    def heldout_set(self) -> tuple[Any, torch.Tensor]:
        return self.inputs, self.targets


def _spec(t: torch.Tensor) -> TensorSpec:
    high = None if t.is_floating_point() else int(t.max()) + 1 if t.numel() else 1
    return TensorSpec(tuple(t.shape[1:]), t.dtype, high)


@dataclass(frozen=True)
class TensorData:
    """A data set held in memory, as a model's data: called as
    ``data(microbatch_size, seed, split)`` (what
    :attr:`pipesim.validate.models.RealModel.source_fn` is), it gives the
    stream of ``split``: ``"train"`` (or ``"all"``) walks the training
    tensors, ``"heldout"`` the held-out ones (:class:`TensorSamples`)."""

    train: tuple[Any, torch.Tensor]
    heldout: tuple[Any, torch.Tensor]

    def __post_init__(self) -> None:
        for name in ("train", "heldout"):
            pair = getattr(self, name)
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise DataError(f"{name} must be a pair (inputs, targets)")
            n = _count(f"{name} inputs", pair[0])
            if _count(f"{name} targets", pair[1]) != n or isinstance(pair[1], tuple):
                raise DataError(f"{name} targets must be one tensor with as many samples as the inputs ({n})")
            if n < 1:
                raise DataError(f"{name} has no samples")

    def __call__(self, microbatch_size: int, seed: int = 0, split: str = "train") -> TensorSamples:
        inputs, targets = self.heldout if _check_split(split) == "heldout" else self.train
        return TensorSamples(microbatch_size, inputs, targets, seed)


def tensors(train: tuple[Any, torch.Tensor], heldout: tuple[Any, torch.Tensor]) -> TensorData:
    """Your samples as a model's data: ``train`` and ``heldout`` are each
    ``(inputs, targets)``, inputs a tensor or a tuple of tensors, the sample
    dimension first. A factory returns this as its fifth item."""
    return TensorData(train, heldout)


# --------------------------------------------------------------- synthetic


def _random(rng: np.random.Generator, spec: TensorSpec, b: int) -> torch.Tensor:
    shape = spec.batch_shape(b)
    if spec.dtype.is_floating_point:
        # numpy has no bfloat16: draw in float32 and convert.
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(spec.dtype)
    assert spec.high is not None
    return torch.from_numpy(rng.integers(0, spec.high, size=shape, dtype=np.int64)).to(spec.dtype)


@dataclass(frozen=True)
class Synthetic:
    """Random micro-batches with the shapes and dtypes of a real source.

    Floats are standard normal, integers uniform in ``[0, high)``, so the
    same model code (embedding lookups, cross-entropy targets) runs
    unchanged; only the values are meaningless.
    """

    microbatch_size: int
    input_spec: TensorSpec
    target_spec: TensorSpec
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("microbatch_size", self.microbatch_size, 1)
        _check_int("seed", self.seed, 0)
        for name in ("input_spec", "target_spec"):
            if not isinstance(getattr(self, name), TensorSpec):
                raise DataError(f"{name} must be a TensorSpec, got {getattr(self, name)!r}")

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = _check_int("index", index, 0)
        rng = _rng(_SYNTHETIC_TAG, self.seed, index)
        b = self.microbatch_size
        return _random(rng, self.input_spec, b), _random(rng, self.target_spec, b)


def synthetic(microbatch_size: int, inputs: TensorSpec, targets: TensorSpec, *, seed: int = 0) -> Synthetic:
    """Random micro-batches: ``inputs``/``targets`` give per-sample shape and dtype."""
    return Synthetic(microbatch_size, inputs, targets, seed=seed)


def synthetic_like(source: MicroBatchSource, *, seed: int | None = None) -> Synthetic:
    """A synthetic stream shaped like ``source`` (same micro-batch size, shapes, dtypes)."""
    seed = operator.index(getattr(source, "seed", 0)) if seed is None else seed
    return Synthetic(source.microbatch_size, source.input_spec, source.target_spec, seed=seed)

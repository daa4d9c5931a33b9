"""Built-in model catalog: per-layer profiles computed from real architectures.

Each model is written down layer by layer as per-sample FLOPs, parameter
counts and tensor sizes taken from its published architecture; a
:class:`~pipesim.sim.hardware.machines.DeviceSpec` turns them into times. Nothing
about the models is measured, so the profiles are only as good as the
assumptions stated here once:

Time (per layer and pass: its kernel launches plus its work)
    ``time = kernels * device.kernel_overhead_s + work``. ``kernels`` is what
    the pass launches (each layer's :attr:`ArchLayer.kernels`; a Megatron
    transformer layer launches 15 kernels forward and 43 backward,
    :data:`TRANSFORMER_KERNELS`), and each launch costs a fixed time
    whatever the micro-batch (0 on every preset but ``p3.16xlarge``).

    On a device with the GEMM shape model (``device.peak_flops``, ``sms``,
    ``gemm_max_efficiency``: the V100, A100 and H100 presets) the work is
    ``sum of the layer's GEMM times + bytes moved / device.mem_bandwidth``.
    Each GEMM of :attr:`ArchLayer.gemms`, at the micro-batch's shape (b
    samples are b times the rows: ``M = b * s`` for a transformer's linear
    layers, ``b * Ho * Wo`` for a convolution; b times the products for
    attention's per-head ones), is priced by
    :func:`~pipesim.sim.hardware.gemm.gemm_seconds`: tile and wave
    quantisation over the device's SMs, or the device's measured table. So a
    small micro-batch fills fewer waves and pads more of its tiles, and its
    GEMMs run at a lower fraction of peak: the per-sample time falls with b
    and levels off once the GEMMs fill the device. The bytes term is the
    rest of the layer (elementwise kernels, softmax, normalisation, whose
    traffic is taken as the layer's input, output and stashed
    intermediates), memory-bound, one after the other with the GEMMs.

    Elsewhere (devices without the shape model: the fp32 and CPU presets,
    measured machines; layers without GEMMs) the work is the roofline
    ``max(FLOPs / device.flops, bytes moved / device.mem_bandwidth)``, with
    ``device.flops`` a *sustained* throughput that already prices the
    elementwise work around big GEMMs, the same at every micro-batch size.
    Bytes moved in the forward: the weights (not for embedding lookups,
    which read only the rows they gather) plus the layer's input, output and
    stashed intermediates; the backward moves twice that.
Backward
    A product with weights (M, N, K) has an input gradient (M, K, N), the
    same FLOPs, and a weight gradient (K, N, M), the same FLOPs again,
    one kernel summing over every row, so ``B ~= 2 F`` by FLOPs and the
    zero-bubble split is about half and half (by shapes the two gradients
    run at their own efficiencies, and the non-GEMM backward, twice the
    forward's bytes, is part of the input gradient). Products without
    weights (attention scores, attention-weighted values) have two input
    gradients, (M, K, N) and (K, N, M): 2x their forward, all input
    gradient. The first layer needs no input gradient: its input is data.

Sizes
    Activations and stashes are in the device's precision
    (``device.dtype_bytes``: 4 on the fp32 ``pcie-4gpu``, 2 with mixed
    precision on V100/H100). ``param_bytes`` counts parameters at 4 bytes
    each, the fp32 master weights. On a device with 2-byte activations the
    profile's :class:`~pipesim.sim.workloads.profile.Precision` is mixed
    precision (:func:`catalog_precision`): the passes read 16-bit weights,
    the gradients (what a replicated stage all-reduces) are 16-bit, the
    master weights and the optimizer state fp32: 2 + 2 + 4 + 4 + 4 = 16
    bytes per parameter with Adam, 2 + 2 + 4 + 4 = 12 with momentum SGD
    (ZeRO's count), the same as fp32 training holds (4 + 4 + 8, 4 + 4 + 4)
    on an fp32 device, where every copy is fp32. A layer's stash is its
    input plus its internal intermediates; its output is stashed by the
    next layer as that layer's input.
    Transformer stashes follow Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models"): ``s*b*h*(34 + 5*a*s/h)`` bytes
    per layer at 2 bytes per element. BERT-large keeps the attention scores
    (the ``5as/h`` term, as its 2019-2021 implementations did); the GPT
    models do not (FlashAttention / Megatron's selective recomputation, as
    current GPT training does). A transformer's loss keeps the softmax of
    its logits in fp32 whatever the device precision, ``4 s V`` bytes a
    sample (V the vocabulary): Megatron-LM's vocabulary-parallel
    cross-entropy runs on ``logits.float()`` and saves its softmax for the
    backward (``mpu/cross_entropy.py``, ``ctx.save_for_backward(exp_logits,
    ...)``), and ``torch.autocast`` runs ``cross_entropy`` in fp32 too; the
    16-bit logits are freed once converted. On a GPT's last stage it is the
    largest stash (2BW's GPT-2.2B: 103 MB a sequence, against 40 MB a block).
Recomputation
    Activation recomputation checkpoints the transformer blocks only, as
    Megatron-LM's ``--checkpoint-activations`` wraps them
    (``ParallelTransformer._checkpointed_forward``): the embedding and the
    heads (``ArchLayer.recomputed`` False) keep their stashes, the loss's
    softmax among them, and run their forward once.
Tied embeddings
    A pipeline keeps a copy of tied input/output embeddings on the first and
    the last stage (Megatron does exactly this), so the output layer's
    profile carries the copy. :func:`model_parameters` counts it once, as
    papers do.

Architectures and defaults (``model_names()`` lists them):

* ``vgg16``: VGG-16 on 224x224 ImageNet (Simonyan & Zisserman 2015),
  138.4M parameters, 15.5 GMACs per image; 16 layers (13 conv, with their
  ReLU and pooling, + 3 fully connected). Micro-batch 32, momentum SGD.
* ``vgg16-cifar``: the same convolutions on 32x32 CIFAR-10 with a 512->10
  classifier, the variant SpecTrain's VGG experiments use; 14.7M
  parameters; 14 layers. Micro-batch 128, momentum SGD.
* ``resnet50``: ResNet-50 v1.5 on 224x224 (torchvision), 25.6M parameters,
  4.1 GMACs; 18 layers (stem, 16 bottleneck blocks, pool+classifier).
  Micro-batch 32, momentum SGD.
* ``gnmt`` / ``gnmt-16``: GNMT (Wu et al. 2016) as in PipeDream and the MLPerf
  reference: hidden 1024, vocabulary 32320, 50-token source and target,
  first encoder layer bidirectional, normalised Bahdanau attention on the
  first decoder layer fed to all upper decoder layers; ``gnmt`` has 4+4 LSTM
  layers (GNMT-8, ~160M parameters), ``gnmt-16`` 8+8. Decoder layers pass the
  encoder output (bottom decoder layer) or the attention context (upper
  layers) along with their own output. Micro-batch 64, Adam.
* ``bert-large``: 24 layers, hidden 1024, 16 heads, sequence 512, vocabulary
  30522; 336M parameters; embedding + 24 blocks + pre-training heads.
  Micro-batch 8, Adam.
* ``gpt-1.3b``: 24 layers, hidden 2048, 16 heads, sequence 2048, vocabulary
  50257 (GPT-3 XL size, Megatron's 1.3B configuration); 1.32B parameters.
  Micro-batch 4, Adam.
* ``gpt2-124m``: GPT-2 small (Radford et al. 2019; OpenAI's released
  configuration, github.com/openai/gpt-2 ``hparams.json``, which Hugging
  Face's ``GPT2Config`` defaults repeat): 12 layers, hidden 768, 12 heads,
  vocabulary 50257, 1024 positions (the table keeps its 1024 rows at a
  shorter ``seq_len``; a longer one is refused); 124,439,808 parameters
  with the output layer tied to the token embedding (the head's copy,
  768 x 50257 = 38,597,376 more, is in the profile, not in
  :func:`model_parameters`). GELU, LayerNorm and biases as in the other GPT
  models, so its blocks are theirs at this size. Sequence 1024, micro-batch
  8, Adam.
* ``gpt-8.3b``: Megatron-LM's 8.3B model: 72 layers, hidden 3072, 32 heads,
  sequence 1024, vocabulary 51200. Micro-batch 1, Adam.
* ``gpt-13b``: GPT-3 13B: 40 layers, hidden 5120, 40 heads, sequence 2048,
  vocabulary 50257. Micro-batch 1, Adam.
* ``2bw-gpt-355m``, ``2bw-gpt-1.3b``, ``2bw-gpt-2.2b``, ``2bw-gpt-3.8b`` and
  ``2bw-bert-*`` of the same four sizes: PipeDream-2BW's models (Narayanan
  et al. 2021; sizes from the authors' sweep script: 24 x 1024 x 16 heads,
  24 x 2048 x 16, 32 x 2304 x 32, 32 x 3072 x 32), sequence 512, vocabulary
  50257 (GPT) or 30522 (BERT). Micro-batch 1 (2BW's planner chooses it), Adam.
* ``uniform``: for analytic checks; see :func:`uniform_profile`.

Measured profiles (:func:`measured_model_names`): ``pipedream-vgg16``,
``pipedream-alexnet``, ``pipedream-resnet18``, ``pipedream-resnet50``,
``pipedream-squeezenet``, ``pipedream-gnmt8`` and ``pipedream-gnmt16`` are
the per-layer profiles PipeDream's authors published
(:mod:`pipesim.sim.workloads.pipedream_graph`). They were measured, so they do not
depend on the hardware's device, and take no ``layers`` or ``seq_len``; a
``microbatch_size`` other than the profiled batch rescales their times and
activations linearly, an approximation their notes state.

The GPT models count causal attention at full cost (as Megatron's FLOPs
formula does). Sequence models take ``seq_len``; transformers take
``layers`` (number of blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from pipesim.sim.hardware.gemm import gemm_seconds
from pipesim.sim.hardware.machines import DeviceSpec
from pipesim.sim.workloads import pipedream_graph
from pipesim.sim.workloads.profile import (
    FP32,
    MIXED_16BIT,
    OPTIMIZER_STATE_MULTIPLIER,
    LayerCost,
    Precision,
    Profile,
    WorkloadError,
)

#: Bytes per parameter of every catalog profile's ``param_bytes`` (fp32 master weights).
PARAM_BYTES = 4
#: Bytes of an fp32 element (:attr:`ArchLayer.fp32_stash_elems`).
FP32_BYTES = 4


def catalog_precision(device: DeviceSpec) -> Precision:
    """The precision a catalog model trains at on ``device``: mixed
    precision (16-bit weights and gradients, fp32 master weights and
    optimizer state, as Megatron-LM and apex's AMP keep them) where the
    device computes in 2-byte elements, fp32 throughout otherwise."""
    return MIXED_16BIT if device.dtype_bytes == 2 else FP32


#: The ``uniform`` model's per-layer weights and stash: 1 MiB each, so memory
#: results read as whole MiB while sends stay at zero bytes.
UNIFORM_PARAM_BYTES = 1 << 20
UNIFORM_STASH_BYTES = 1 << 20
UNIFORM_DEFAULT_LAYERS = 64

# ---------------------------------------------------------------------------
# Kernel launches per pass: (forward, backward input gradient, backward
# weight gradient). A device's kernel_overhead_s charges each once.
# ---------------------------------------------------------------------------

#: A Megatron-LM transformer layer, counted from ParallelTransformerLayer in
#: the code PipeDream-2BW's authors ran (msr-fiddle/pipedream,
#: megatron/megatron/model/transformer.py: apex's fused LayerNorm, the fused
#: scale-mask-softmax, TorchScript-fused bias-GeLU and bias-dropout-add, no
#: tensor parallelism). Forward 15: 2 LayerNorms, the QKV GEMM and its bias
#: add (``F.linear`` on a 3-D input), scores (``baddbmm``), softmax,
#: attention dropout, context (``bmm``), the ``permute().contiguous()``
#: copy, 3 GEMMs (projection, h->4h, 4h->h), bias-GeLU and 2
#: bias-dropout-adds. Backward input gradient 19: a data-gradient GEMM for
#: each of the 4 linear layers and 2 for each of the 2 batched products, the
#: backward of the 8 elementwise kernels (2 bias-dropout-adds, GeLU,
#: dropout, softmax, the copy, 2 LayerNorms' input gradients), the q/k/v
#: gradients' concatenation and the 2 residual sums. Backward weight
#: gradient 24: 4 weight-gradient GEMMs, 4 bias reductions, the 2
#: LayerNorms' gamma/beta gradients (2 kernels each) and an accumulation
#: into ``.grad`` for each of the 12 parameter tensors (every micro-batch of
#: an update but the first accumulates).
TRANSFORMER_KERNELS = (15, 19, 24)
#: GPT's input embedding: word and position lookups, the position ids, their
#: sum, dropout, the [b, s] -> [s, b] copy; backward: dropout, the copy, two
#: embedding backwards (sort, segment and sum: about 6 kernels each in
#: PyTorch's CUDA ``embedding_dense_backward``) and 2 accumulations.
GPT_EMBED_KERNELS = (6, 0, 16)
#: GPT's last layer: final LayerNorm, the copy back to [b, s], the logits
#: GEMM and Megatron's vocabulary cross-entropy (max, subtract, 5 target-mask
#: operations, the gather of the targets' logits, exp, sum, log, subtract,
#: the loss mask: 16); backward: the loss (4), the data-gradient GEMM, the
#: copy, LayerNorm's input gradient; the weight-gradient GEMM, LayerNorm's
#: gamma/beta (2) and 3 accumulations.
GPT_HEAD_KERNELS = (19, 7, 6)
#: BERT's embedding: 3 lookups, the position ids, 2 sums, LayerNorm, dropout,
#: the copy; backward: the copy, dropout, LayerNorm (3), 3 embedding
#: backwards (about 6 each) and 5 accumulations.
BERT_EMBED_KERNELS = (9, 0, 28)
#: BERT's pre-training heads: the LM transform (GEMM + bias, GeLU,
#: LayerNorm), the logits (GEMM + bias), pooler (GEMM + bias, tanh), NSP
#: (GEMM + bias), two cross-entropies (2 each), their sum, the copy: 17;
#: backward: the losses (4), 4 data-gradient GEMMs, tanh, LayerNorm, GeLU,
#: the branches' sum (12); 4 weight-gradient GEMMs, 4 bias reductions,
#: LayerNorm's gamma/beta (2), 10 accumulations (20).
BERT_HEADS_KERNELS = (17, 12, 20)
# The CNN and LSTM counts below are estimates from PyTorch's and cuDNN's
# usual decomposition (one kernel per convolution, bias, activation, pooling
# and batch norm; cuDNN's LSTM launches a recurrent GEMM and an elementwise
# kernel per time step), not read from a paper's code: no preset that sets
# kernel_overhead_s runs them in a reproduction.
#: a linear layer with bias, ReLU and dropout (classifier: bias, log-softmax, NLL)
FC_KERNELS = (4, 3, 4)
#: a bottleneck block: 3 convolutions, 3 batch norms, 3 ReLUs, the residual
#: add; backward their inverses and the residual sum, 3 weight-gradient
#: convolutions and 9 accumulations (the projection shortcut adds a
#: convolution and a batch norm each way and 3 accumulations)
BOTTLENECK_KERNELS = (10, 10, 12)
BOTTLENECK_DOWN_KERNELS = (12, 12, 16)
#: an embedding lookup: its backward (about 6 kernels) and 1 accumulation
LOOKUP_KERNELS = (1, 0, 7)


def _conv_kernels(pooled: bool, first: bool) -> tuple[int, int, int]:
    """A VGG convolution with bias and ReLU (and max-pool): forward conv,
    bias, ReLU (pool); backward ReLU (pool) and the data-gradient
    convolution; the weight-gradient convolution, the bias reduction and 2
    accumulations. The first layer needs no input gradient, only the
    elementwise backwards in front of its weight gradient."""
    act = 2 if pooled else 1
    if first:
        return (2 + act, 0, 4 + act)
    return (2 + act, act + 1, 4)


def _lstm_kernels(steps: int, directions: int) -> tuple[int, int, int]:
    """cuDNN's LSTM over ``steps`` time steps, per direction: one GEMM for
    every step's input projection, then per step a recurrent GEMM and an
    elementwise kernel; backward per step the elementwise backward and the
    recurrent data-gradient GEMM plus one input data-gradient GEMM; 2
    weight-gradient GEMMs and 4 accumulations (2 matrices, 2 biases)."""
    return (directions * (1 + 2 * steps), directions * (2 * steps + 1), directions * 6)


@dataclass(frozen=True)
class Gemm:
    """One matrix product of a layer's forward, per sample: ``batch``
    products (m x k) @ (k x n) in one kernel, launched ``steps`` times one
    after another (an LSTM's time steps; 1 otherwise).

    ``scale`` is the dimension a micro-batch of b samples multiplies:
    ``"m"``, the rows (the tokens or output pixels of b samples stacked, as
    linear layers and convolutions run them: M = b x m), or ``"batch"``, the
    independent products (attention's per-head products: b x heads of
    them). ``weights``: B is a weight matrix, so the backward is a data
    gradient (M, K, N) and a weight gradient (K, N, M x batch x steps): one
    kernel summing over every row; otherwise both operands are activations
    (attention's scores and context) and the backward is two data gradients,
    (M, K, N) and (K, N, M)."""

    m: int
    n: int
    k: int
    batch: int = 1
    scale: str = "m"
    steps: int = 1
    weights: bool = True
    #: how Megatron's tensor parallelism splits it over d ranks: ``"n"``
    #: (column-parallel: QKV, h -> 4h, the vocabulary of the logits), ``"k"``
    #: (row-parallel: the output projection, 4h -> h) or ``"batch"`` (the
    #: attention products, by heads)
    tp: str = "n"

    def shard(self, d: int) -> Gemm:
        """One rank's part of this product under d-way tensor parallelism."""
        if d == 1:
            return self
        if self.tp == "k":
            return replace(self, k=-(-self.k // d))
        if self.tp == "batch":
            return replace(self, batch=-(-self.batch // d))
        return replace(self, n=-(-self.n // d))

    @property
    def flops(self) -> float:
        """Forward FLOPs per sample (a multiply-add is 2)."""
        return 2.0 * self.m * self.n * self.k * self.batch * self.steps

    def shape(self, microbatch_size: int) -> tuple[int, int, int, int]:
        """(M, N, K, batch) of one launch at a micro-batch size."""
        if self.scale == "batch":
            return (self.m, self.n, self.k, self.batch * microbatch_size)
        return (self.m * microbatch_size, self.n, self.k, self.batch)


@dataclass(frozen=True)
class ArchLayer:
    """One layer, per sample, independent of any device.

    ``gemm_flops``: forward FLOPs of products with weights. ``other_flops``:
    forward FLOPs of products without weights (attention). Element counts are
    in the device precision; ``stash_elems`` excludes the output (see the
    module doc). ``tied_params`` are parameters that duplicate another
    layer's (the pipeline copy of tied embeddings). ``kernels``: the kernels
    one pass launches, (forward, backward input gradient, backward weight
    gradient), whatever the micro-batch (see :data:`TRANSFORMER_KERNELS`).
    ``gemms``: the layer's matrix products with their shapes, which a device
    with the GEMM shape model prices one by one (see the module doc); their
    FLOPs are the layer's ``gemm_flops + other_flops`` but for work that is
    no GEMM (the additive attention scores of GNMT), which the memory term
    prices. Empty: the layer is priced by the roofline at ``device.flops``.
    ``replicated_stash_elems``: the part of ``stash_elems`` every
    tensor-parallel rank keeps whole (:meth:`rank_elems`).
    ``fp32_stash_elems``: elements stashed in fp32 whatever the device's
    precision (a loss's softmax), beside ``stash_elems``; tensor
    parallelism splits them (the vocabulary-parallel loss).
    ``recomputed``: whether activation recomputation checkpoints the layer
    (:attr:`LayerCost.recomputed <pipesim.sim.workloads.profile.LayerCost.recomputed>`).
    """

    name: str
    gemm_flops: float
    params: int
    in_elems: float
    out_elems: float
    stash_elems: float
    other_flops: float = 0.0
    input_grad: bool = True
    param_traffic: bool = True
    tied_params: int = 0
    kernels: tuple[int, int, int] = (0, 0, 0)
    gemms: tuple[Gemm, ...] = ()
    replicated_stash_elems: float = 0.0
    fp32_stash_elems: float = 0.0
    recomputed: bool = True

    def fp32_rank_bytes(self, shards: int = 1) -> float:
        """Bytes per sample of the fp32 stash on one of ``shards`` ranks."""
        return FP32_BYTES * self.fp32_stash_elems / shards

    def rank_elems(self, shards: int = 1) -> tuple[float, float]:
        """(elements moved by the layer's work other than its GEMMs, elements
        stashed) per sample on one of ``shards`` tensor-parallel ranks.
        Megatron-LM's tensor parallelism splits the GEMMs and what lies
        between a split pair (attention heads, the MLP's inner width), while
        every rank moves the layer's input and output whole, and keeps whole
        the stashed parts Korthikanti et al. 2022 (section 4.2.1) count as
        not parallelised: the layer norms' inputs, the inputs of the QKV and
        first MLP products and the dropout masks after attention and MLP
        (``replicated_stash_elems``)."""
        stash = self.replicated_stash_elems + (self.stash_elems - self.replicated_stash_elems) / shards
        return self.in_elems + self.out_elems + stash, stash


@dataclass(frozen=True)
class _Model:
    name: str
    description: str
    microbatch_size: int
    optimizer: str
    build: Callable[..., list[ArchLayer]]
    seq_len: int | None = None  # default; None: the model takes no seq_len
    blocks: int | None = None  # default block count; None: the model takes no `layers`


# ---------------------------------------------------------------------------
# CNNs
# ---------------------------------------------------------------------------

_VGG16_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def _vgg16(image: int, classifier: tuple[int, ...]) -> list[ArchLayer]:
    layers: list[ArchLayer] = []
    c, h = 3, image
    cfg = list(_VGG16_CFG)
    i = 0
    n = 0
    while i < len(cfg):
        cout = cfg[i]
        assert isinstance(cout, int)
        pooled = i + 1 < len(cfg) and cfg[i + 1] == "M"
        conv_out = cout * h * h
        ho = h // 2 if pooled else h
        n += 1
        layers.append(
            ArchLayer(
                name=f"conv{n}" + ("+pool" if pooled else ""),
                gemm_flops=2.0 * h * h * cout * c * 9,
                params=9 * c * cout + cout,
                in_elems=c * h * h,
                out_elems=cout * ho * ho,
                # the conv's input (for its weight gradient), plus the ReLU
                # output the max-pool backward needs when pooled
                stash_elems=c * h * h + (conv_out if pooled else 0),
                input_grad=bool(layers),
                kernels=_conv_kernels(pooled, first=not layers),
                # implicit GEMM: M = b x H x W output pixels, N = Cout, K = Cin x 3 x 3
                gemms=(Gemm(h * h, cout, c * 9),),
            )
        )
        c, h = cout, ho
        i += 2 if pooled else 1
    width = c * h * h
    for k, nout in enumerate(classifier):
        last = k == len(classifier) - 1
        layers.append(
            ArchLayer(
                name=f"fc{k + 1}",
                gemm_flops=2.0 * width * nout,
                params=width * nout + nout,
                in_elems=width,
                out_elems=0 if last else nout,  # the last layer ends in the loss
                stash_elems=width + (nout if last else nout / 2),  # logits / dropout mask
                kernels=FC_KERNELS,
                gemms=(Gemm(1, nout, width),),
            )
        )
        width = nout
    return layers


def _resnet50() -> list[ArchLayer]:
    layers = [
        ArchLayer(
            name="stem",
            gemm_flops=2.0 * 112 * 112 * 64 * 3 * 49,
            params=49 * 3 * 64 + 2 * 64,
            in_elems=3 * 224 * 224,
            out_elems=64 * 56 * 56,
            # input, conv output (BN input), ReLU output (max-pool input)
            stash_elems=3 * 224 * 224 + 2 * 64 * 112 * 112,
            input_grad=False,
            kernels=(4, 0, 7),  # conv, BN, ReLU, max-pool; their backwards, 3 accumulations
            gemms=(Gemm(112 * 112, 64, 3 * 49),),  # the 7x7 stride-2 convolution
        )
    ]
    cin, h = 64, 56
    for stage, (mid, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for b in range(blocks):
            stride = 2 if (b == 0 and stage > 1) else 1
            ho = h // stride
            out = 4 * mid
            down = b == 0  # channel (and maybe stride) change: projection shortcut
            params = cin * mid + 9 * mid * mid + mid * out + 2 * (mid + mid + out)
            macs = h * h * cin * mid + ho * ho * 9 * mid * mid + ho * ho * mid * out
            stash = cin * h * h + 2 * mid * h * h + 2 * mid * ho * ho + out * ho * ho
            # 1x1 reduce, 3x3 (with the stride, as v1.5 has it), 1x1 expand
            gemms = [Gemm(h * h, mid, cin), Gemm(ho * ho, mid, 9 * mid), Gemm(ho * ho, out, mid)]
            if down:
                params += cin * out + 2 * out
                macs += ho * ho * cin * out
                stash += out * ho * ho
                gemms.append(Gemm(ho * ho, out, cin))  # the 1x1 projection shortcut
            layers.append(
                ArchLayer(
                    name=f"layer{stage}.{b}",
                    gemm_flops=2.0 * macs,
                    params=params,
                    in_elems=cin * h * h,
                    out_elems=out * ho * ho,
                    stash_elems=stash,
                    kernels=BOTTLENECK_DOWN_KERNELS if down else BOTTLENECK_KERNELS,
                    gemms=tuple(gemms),
                )
            )
            cin, h = out, ho
    layers.append(
        ArchLayer(
            name="pool+fc",
            gemm_flops=2.0 * 2048 * 1000,
            params=2048 * 1000 + 1000,
            in_elems=2048 * 7 * 7,
            out_elems=0,
            stash_elems=2048 + 1000,
            kernels=(5, 4, 4),  # average pool, then the classifier (FC_KERNELS's)
            gemms=(Gemm(1, 1000, 2048),),
        )
    )
    return layers


# ---------------------------------------------------------------------------
# GNMT
# ---------------------------------------------------------------------------

_GNMT_HIDDEN = 1024
_GNMT_VOCAB = 32320


def _lstm_params(inp: int, h: int) -> int:
    return 4 * h * (inp + h) + 8 * h  # PyTorch keeps two bias vectors


def _lstm_gemms(steps: int, inp: int, h: int, directions: int = 1) -> tuple[Gemm, ...]:
    """An LSTM layer's GEMMs, per direction, as cuDNN runs them: the input
    projection of every time step at once (M = b x steps, N = 4h, K = inp),
    then each step's recurrent product (M = b, N = 4h, K = h), ``steps``
    launches one after another."""
    return (Gemm(steps, 4 * h, inp), Gemm(1, 4 * h, h, steps=steps)) * directions


def _gnmt(seq_len: int, depth: int) -> list[ArchLayer]:
    """``depth`` LSTM layers in the encoder and as many in the decoder."""
    h, v, s = _GNMT_HIDDEN, _GNMT_VOCAB, seq_len
    t = s  # target length = source length
    layers = [
        ArchLayer("enc.embed", 0.0, v * h, s, s * h, 0.0, input_grad=False, param_traffic=False, kernels=LOOKUP_KERNELS)
    ]
    # Encoder. Per LSTM layer keep the input and, per direction, the four
    # gates and the cell state (5h per token).
    for i in range(depth):
        dirs = 2 if i == 0 else 1
        inp = 2 * h if i == 1 else h
        layers.append(
            ArchLayer(
                name=f"enc.lstm{i}" + ("(bi)" if dirs == 2 else ""),
                gemm_flops=dirs * s * 2.0 * 4 * h * (inp + h),
                params=dirs * _lstm_params(inp, h),
                in_elems=s * inp,
                out_elems=s * h * dirs,
                stash_elems=s * (inp + dirs * 5 * h),
                kernels=_lstm_kernels(s, dirs),
                gemms=_lstm_gemms(s, inp, h, dirs),
            )
        )
    enc_out = s * h
    # The decoder embedding is tied with the encoder's (MLPerf shares them);
    # on another stage it is a copy. It passes the encoder output along.
    layers.append(
        ArchLayer(
            "dec.embed",
            0.0,
            v * h,
            enc_out,
            t * h + enc_out,
            0.0,
            param_traffic=False,
            tied_params=v * h,
            kernels=LOOKUP_KERNELS,
        )
    )
    # Bottom decoder layer with attention over the encoder output.
    attn_params = 2 * h * h + 2 * h
    layers.append(
        ArchLayer(
            name="dec.lstm0+attn",
            gemm_flops=t * 2.0 * 4 * h * 2 * h + 2.0 * s * h * h + 2.0 * t * h * h,
            other_flops=5.0 * t * s * h,  # scores (add, tanh, dot) and context
            params=_lstm_params(h, h) + attn_params,
            in_elems=t * h + enc_out,
            out_elems=2 * t * h,  # output and context
            stash_elems=t * h + enc_out + 5 * t * h + s * h + 2 * t * s + t * h,
            # the LSTM, then attention: 2 GEMMs, add, tanh, score, mask, softmax,
            # context bmm, concatenation, and their backwards; 3 accumulations more
            kernels=tuple(k + a for k, a in zip(_lstm_kernels(t, 1), (10, 10, 5))),
            # the LSTM, the keys' and the query's projections, the context bmm
            # (t x s weights by s x h values); the additive scores are elementwise
            gemms=(*_lstm_gemms(t, h, h), Gemm(s, h, h), Gemm(t, h, h), Gemm(t, h, s, weights=False)),
        )
    )
    for i in range(1, depth):
        last = i == depth - 1
        layers.append(
            ArchLayer(
                name=f"dec.lstm{i}",
                gemm_flops=t * 2.0 * 4 * h * (2 * h + h),
                params=_lstm_params(2 * h, h),
                in_elems=2 * t * h,
                out_elems=t * h if last else 2 * t * h,  # upper layers carry the context
                stash_elems=t * (2 * h + 5 * h),
                kernels=_lstm_kernels(t, 1),
                gemms=_lstm_gemms(t, 2 * h, h),
            )
        )
    layers.append(
        ArchLayer(
            name="classifier",
            gemm_flops=2.0 * t * h * v,
            params=h * v + v,
            in_elems=t * h,
            out_elems=0,
            stash_elems=t * h + t * v,  # input and logits for the softmax loss
            kernels=FC_KERNELS,
            gemms=(Gemm(t, v, h),),
        )
    )
    return layers


# ---------------------------------------------------------------------------
# Transformers
# ---------------------------------------------------------------------------


def _block(name: str, s: int, d: int, heads: int, keep_scores: bool) -> ArchLayer:
    # Korthikanti et al.: bytes per sample at 2 bytes/element; halve for elements.
    # 10 s d of the 34 every tensor-parallel rank keeps whole (their section 4.2.1).
    stash_bytes16 = s * d * 34 + (5 * heads * s * s if keep_scores else 0)
    assert d % heads == 0, (d, heads)
    dh = d // heads
    # Megatron's products ([s, b, h] layout, so M = s x b), in their order
    gemms = (
        Gemm(s, 3 * d, d),  # QKV
        Gemm(s, s, dh, batch=heads, scale="batch", weights=False, tp="batch"),  # scores Q K^T, b x heads
        Gemm(s, dh, s, batch=heads, scale="batch", weights=False, tp="batch"),  # context: probabilities x V
        Gemm(s, d, d, tp="k"),  # output projection
        Gemm(s, 4 * d, d),  # h -> 4h
        Gemm(s, d, 4 * d, tp="k"),  # 4h -> h
    )
    return ArchLayer(
        name=name,
        gemm_flops=24.0 * s * d * d,
        other_flops=4.0 * s * s * d,
        params=12 * d * d + 13 * d,
        in_elems=s * d,
        out_elems=s * d,
        stash_elems=stash_bytes16 / 2,
        kernels=TRANSFORMER_KERNELS,
        gemms=gemms,
        replicated_stash_elems=s * d * 10 / 2,
    )


def _bert(seq_len: int, blocks: int, d: int = 1024, heads: int = 16, vocab: int = 30522) -> list[ArchLayer]:
    s = seq_len
    layers = [
        ArchLayer(
            "embed",
            0.0,
            (vocab + 512 + 2) * d + 2 * d,
            s,
            s * d,
            1.5 * s * d,  # LN input + dropout mask
            input_grad=False,
            param_traffic=False,
            kernels=BERT_EMBED_KERNELS,
            recomputed=False,
        )
    ]
    layers += [_block(f"block{i}", s, d, heads, keep_scores=True) for i in range(blocks)]
    head_params = (d * d + d) + (d * d + d + 2 * d) + (d * vocab + vocab) + (2 * d + 2)
    layers.append(
        ArchLayer(
            name="heads",
            gemm_flops=2.0 * s * d * d + 2.0 * s * d * vocab + 2.0 * d * d,
            params=head_params,
            in_elems=s * d,
            out_elems=0,
            stash_elems=3 * s * d,
            fp32_stash_elems=s * vocab,  # the loss's softmax
            tied_params=d * vocab,
            kernels=BERT_HEADS_KERNELS,
            recomputed=False,
            # the LM transform, the logits, the pooler (the [CLS] token only)
            gemms=(Gemm(s, d, d), Gemm(s, vocab, d), Gemm(1, d, d)),
        )
    )
    return layers


def _gpt(seq_len: int, blocks: int, d: int, heads: int, vocab: int, positions: int | None = None) -> list[ArchLayer]:
    """GPT: token and position embeddings, ``blocks`` blocks, the LM head.
    ``positions``: rows of the position table (default ``seq_len``, one per
    position trained, as Megatron sizes it to the sequence)."""
    s = seq_len
    layers = [
        ArchLayer(
            "embed",
            0.0,
            vocab * d + (s if positions is None else positions) * d,
            s,
            s * d,
            0.5 * s * d,  # dropout mask
            input_grad=False,
            param_traffic=False,
            kernels=GPT_EMBED_KERNELS,
            recomputed=False,
        )
    ]
    layers += [_block(f"block{i}", s, d, heads, keep_scores=False) for i in range(blocks)]
    layers.append(
        ArchLayer(
            name="lm_head",
            gemm_flops=2.0 * s * d * vocab,
            params=2 * d + d * vocab,
            in_elems=s * d,
            out_elems=0,
            stash_elems=2 * s * d,  # the final LN's input and output
            fp32_stash_elems=s * vocab,  # the loss's softmax
            tied_params=d * vocab,
            kernels=GPT_HEAD_KERNELS,
            recomputed=False,
            gemms=(Gemm(s, vocab, d),),  # the logits, against the tied embedding
        )
    )
    return layers


#: GPT-2 small as OpenAI published it (Radford et al. 2019, "Language Models
#: are Unsupervised Multitask Learners"; the released checkpoint's config.json,
#: github.com/openai/gpt-2 ``hparams.json``: n_vocab 50257, n_ctx 1024,
#: n_embd 768, n_head 12, n_layer 12), as Hugging Face's ``GPT2Config``
#: defaults repeat it: (vocabulary, positions, hidden, heads, blocks).
GPT2_SMALL = (50257, 1024, 768, 12, 12)


def _gpt2(seq_len: int, blocks: int) -> list[ArchLayer]:
    """GPT-2 small (:data:`GPT2_SMALL`) at ``seq_len`` tokens: its position
    table keeps all 1024 rows whatever the sequence (``wpe`` is part of the
    checkpoint), and no sequence may be longer."""
    vocab, positions, d, heads, _ = GPT2_SMALL
    if seq_len > positions:
        raise WorkloadError(f"gpt2-124m: seq_len {seq_len} is longer than GPT-2's {positions} positions")
    return _gpt(seq_len, blocks, d, heads, vocab, positions=positions)


#: PipeDream-2BW's transformer sizes, (name, blocks, hidden, heads), from the
#: authors' sweep script (Narayanan et al. 2021): 355M, 1.3B, 2.2B and 3.8B.
TWO_BW_SIZES = (("355m", 24, 1024, 16), ("1.3b", 24, 2048, 16), ("2.2b", 32, 2304, 32), ("3.8b", 32, 3072, 32))


def _two_bw_models() -> list[_Model]:
    """GPT and BERT at 2BW's sizes, sequence 512 as the paper ran them.

    Separate names (``2bw-gpt-1.3b``) rather than new defaults of the
    existing ``gpt-1.3b``, whose sequence 2048 other figures use. The paper
    trained them in fp16 with fp32 master weights and Adam, which is what
    every catalog profile already prices (see the module doc); the
    micro-batch defaults to 1 because 2BW's planner chooses it."""
    out = []
    for size, blocks, d, heads in TWO_BW_SIZES:
        out.append(
            _Model(
                f"2bw-gpt-{size}",
                f"GPT {size.upper()} as in PipeDream-2BW ({blocks} x {d}, {heads} heads)",
                1,
                "adam",
                lambda seq_len, blocks, d=d, heads=heads: _gpt(seq_len, blocks, d, heads, 50257),
                seq_len=512,
                blocks=blocks,
            )
        )
        out.append(
            _Model(
                f"2bw-bert-{size}",
                f"BERT {size.upper()} as in PipeDream-2BW ({blocks} x {d}, {heads} heads)",
                1,
                "adam",
                lambda seq_len, blocks, d=d, heads=heads: _bert(seq_len, blocks, d, heads, 30522),
                seq_len=512,
                blocks=blocks,
            )
        )
    return out


_MODELS: dict[str, _Model] = {
    m.name: m
    for m in (
        _Model("vgg16", "VGG-16, 224x224 ImageNet", 32, "sgd", lambda: _vgg16(224, (4096, 4096, 1000))),
        _Model("vgg16-cifar", "VGG-16, 32x32 CIFAR-10", 128, "sgd", lambda: _vgg16(32, (10,))),
        _Model("resnet50", "ResNet-50 v1.5, 224x224 ImageNet", 32, "sgd", _resnet50),
        _Model(
            "gnmt", "GNMT-8 (4+4 LSTM layers, hidden 1024)", 64, "adam", lambda seq_len: _gnmt(seq_len, 4), seq_len=50
        ),
        _Model(
            "gnmt-16",
            "GNMT-16 (8+8 LSTM layers, hidden 1024)",
            64,
            "adam",
            lambda seq_len: _gnmt(seq_len, 8),
            seq_len=50,
        ),
        _Model(
            "bert-large",
            "BERT-large (24 x 1024, 16 heads)",
            8,
            "adam",
            lambda seq_len, blocks: _bert(seq_len, blocks),
            seq_len=512,
            blocks=24,
        ),
        _Model(
            "gpt-1.3b",
            "GPT 1.3B (24 x 2048, 16 heads)",
            4,
            "adam",
            lambda seq_len, blocks: _gpt(seq_len, blocks, 2048, 16, 50257),
            seq_len=2048,
            blocks=24,
        ),
        _Model(
            "gpt2-124m",
            "GPT-2 small, OpenAI (12 x 768, 12 heads)",
            8,
            "adam",
            _gpt2,
            seq_len=GPT2_SMALL[1],
            blocks=GPT2_SMALL[4],
        ),
        *_two_bw_models(),
        _Model(
            "gpt-8.3b",
            "GPT 8.3B, Megatron-LM (72 x 3072, 32 heads)",
            1,
            "adam",
            lambda seq_len, blocks: _gpt(seq_len, blocks, 3072, 32, 51200),
            seq_len=1024,
            blocks=72,
        ),
        _Model(
            "gpt-13b",
            "GPT-3 13B (40 x 5120, 40 heads)",
            1,
            "adam",
            lambda seq_len, blocks: _gpt(seq_len, blocks, 5120, 40, 50257),
            seq_len=2048,
            blocks=40,
        ),
    )
}


def model_names() -> list[str]:
    """Catalog names computed from an architecture, ``uniform`` included, sorted."""
    return sorted([*_MODELS, "uniform"])


def measured_model_names() -> list[str]:
    """Catalog names of measured profiles (PipeDream's), sorted: no architecture, no device."""
    return pipedream_graph.catalog_names()


def _lookup(name: str) -> _Model:
    try:
        return _MODELS[name]
    except KeyError:
        if name in pipedream_graph.CATALOG:
            raise WorkloadError(f"{name} is a measured profile: it has no architecture description") from None
        raise WorkloadError(
            f"unknown model {name!r}; known: {', '.join(model_names())}; measured: {', '.join(measured_model_names())}"
        ) from None


def architecture(name: str, *, seq_len: int | None = None, layers: int | None = None) -> list[ArchLayer]:
    """The device-independent per-sample layer list of a catalog model."""
    m = _lookup(name)
    kwargs: dict[str, int] = {}
    if m.seq_len is not None:
        kwargs["seq_len"] = _positive("seq_len", seq_len if seq_len is not None else m.seq_len)
    elif seq_len is not None:
        raise WorkloadError(f"{name} has no sequence length; seq_len applies to {_names_with('seq_len')}")
    if m.blocks is not None:
        kwargs["blocks"] = _positive("layers", layers if layers is not None else m.blocks)
    elif layers is not None:
        raise WorkloadError(f"{name} has a fixed depth; layers applies to uniform, {_names_with('blocks')}")
    return m.build(**kwargs)


def _names_with(attr: str) -> str:
    return ", ".join(n for n, m in sorted(_MODELS.items()) if getattr(m, attr) is not None)


def _positive(what: str, v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise WorkloadError(f"{what} must be a positive integer, got {v!r}")
    return v


def model_parameters(name: str, *, layers: int | None = None) -> int:
    """Trainable parameters of the architecture, tied weights counted once."""
    if name == "uniform":
        n = _positive("layers", layers if layers is not None else UNIFORM_DEFAULT_LAYERS)
        return n * UNIFORM_PARAM_BYTES // PARAM_BYTES
    if name in pipedream_graph.CATALOG and layers is None:  # fp32 weights, as the profile counts them
        return pipedream_graph.catalog_profile(name).param_bytes // PARAM_BYTES
    return sum(la.params - la.tied_params for la in architecture(name, layers=layers))


def model_profile(
    name: str,
    device: DeviceSpec,
    microbatch_size: int | None = None,
    *,
    layers: int | None = None,
    seq_len: int | None = None,
    optimizer: str | None = None,
    tensor_parallel: int = 1,
) -> Profile:
    """The profile of catalog model ``name`` on ``device`` (see the module doc).

    ``microbatch_size`` defaults to the model's; ``layers`` sets the number of
    transformer blocks (or of ``uniform`` layers); ``seq_len`` the sequence
    length of GNMT/BERT/GPT; ``optimizer`` overrides the model's default.
    A measured model ignores ``device`` (see the module doc).

    ``tensor_parallel`` d > 1: one rank's shard of d-way tensor parallelism
    (:attr:`Profile.tensor_parallel`), for an architecture model on a device
    with the GEMM shape model: every GEMM at its shard's shape
    (:meth:`Gemm.shard`), its weights divided by d, its other traffic and
    its stash as Megatron-LM shards them (:meth:`ArchLayer.rank_elems`: the
    layer's input and output, and a transformer block's layer-norm, dropout
    and first-product inputs, whole on every rank), its kernel launches
    whole. Elsewhere (measured
    and ``uniform`` models, roofline devices) the whole model comes back and
    tensor parallelism divides its times by d.
    """
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise WorkloadError(f"tensor_parallel must be an integer >= 1, got {tensor_parallel!r}")
    if optimizer is not None and optimizer not in OPTIMIZER_STATE_MULTIPLIER:
        raise WorkloadError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_MULTIPLIER)}, got {optimizer!r}")
    if name in pipedream_graph.CATALOG:
        if layers is not None or seq_len is not None:
            raise WorkloadError(f"{name} is a measured profile: its depth and sequence length are fixed")
        mb = None if microbatch_size is None else _positive("microbatch_size", microbatch_size)
        return pipedream_graph.catalog_profile(name, mb, optimizer)
    if name == "uniform":
        if seq_len is not None:
            raise WorkloadError("uniform has no sequence length")
        return uniform_profile(
            layers if layers is not None else UNIFORM_DEFAULT_LAYERS,
            microbatch_size=_positive("microbatch_size", microbatch_size if microbatch_size is not None else 1),
            optimizer=optimizer or "sgd",
        )
    m = _lookup(name)
    mb = _positive("microbatch_size", microbatch_size if microbatch_size is not None else m.microbatch_size)
    arch = architecture(name, seq_len=seq_len, layers=layers)
    shards = tensor_parallel if device.shape_model else 1
    costs = tuple(layer_cost(la, device, mb, shards) for la in arch)
    if device.shape_model:
        rate = (
            f"with GEMMs by shape ({device.peak_flops / 1e12:g} TFLOP/s peak, {device.sms} SMs, "
            f"{device.gemm_table or f'at most {device.gemm_max_efficiency:g} of peak'})"
        )
    else:
        rate = f"at {device.flops / 1e12:g} TFLOP/s sustained"
    notes = (
        f"{m.description}; {device.name} {rate}, "
        f"{device.dtype_bytes}-byte activations, {PARAM_BYTES}-byte parameters; micro-batch {mb}"
    )
    if m.seq_len is not None:
        notes += f", sequence {seq_len if seq_len is not None else m.seq_len}"
    if shards > 1:
        notes += f"; one rank's shard of {shards}-way tensor parallelism, its GEMMs at their shard's shapes"
    return Profile(
        name=name,
        layers=costs,
        microbatch_size=mb,
        optimizer=optimizer or m.optimizer,
        notes=notes,
        precision=catalog_precision(device),
        tensor_parallel=shards,
    )


def layer_cost(la: ArchLayer, device: DeviceSpec, microbatch_size: int, shards: int = 1) -> LayerCost:
    """Times and sizes of one architecture layer for one micro-batch: each
    pass is its kernel launches (``kernels * device.kernel_overhead_s``,
    the same at every micro-batch size) plus its work: on a device with the
    GEMM shape model, its GEMMs by their shapes and the rest of its traffic at
    the memory bandwidth (:func:`shaped_passes`), else the roofline of its
    FLOPs and bytes (see the module doc). ``shards`` > 1: one rank's part
    under tensor parallelism (the GEMM shape model only; see
    :func:`model_profile`)."""
    mb = microbatch_size
    dt = device.dtype_bytes
    k_f, k_bi, k_bw = la.kernels
    launch = device.kernel_overhead_s
    fixed_f, fixed_bi, fixed_bw = k_f * launch, (k_bi if la.input_grad else 0) * launch, k_bw * launch
    if device.shape_model and la.gemms:
        forward_s, backward_input_s, backward_weight_s = shaped_passes(la, device, mb, shards)
        backward_s = backward_input_s + backward_weight_s
    else:
        forward_s, backward_s, backward_input_s = (t / shards for t in _roofline_passes(la, device, mb))
    return LayerCost(
        name=la.name,
        forward_s=fixed_f + forward_s,
        backward_s=fixed_bi + fixed_bw + backward_s,
        param_bytes=PARAM_BYTES * -(-la.params // shards),
        activation_bytes=round(dt * mb * la.out_elems),
        stash_bytes=round(mb * (dt * la.rank_elems(shards)[1] + la.fp32_rank_bytes(shards))),
        backward_input_s=fixed_bi + backward_input_s,
        fixed_forward_s=fixed_f,
        fixed_backward_s=fixed_bi + fixed_bw,
        recomputed=la.recomputed,
    )


def shaped_passes(
    la: ArchLayer, device: DeviceSpec, microbatch_size: int, shards: int = 1
) -> tuple[float, float, float]:
    """(forward, backward input-gradient, backward weight-gradient) seconds of
    a layer's work on a device with the GEMM shape model, launches aside.

    Each of the layer's GEMMs at the micro-batch's shape
    (:func:`~pipesim.sim.hardware.gemm.gemm_seconds`), times its launches;
    its backward as :class:`Gemm` says (a layer whose input is data computes
    no data gradient of its weight products). The rest of the layer's work
    (elementwise kernels, softmax, normalisation) moves its input, output and
    stashed intermediates at ``device.mem_bandwidth``, twice that in the
    backward, which is part of the input gradient (of the weight gradient
    where the layer has none). ``shards``: one tensor-parallel rank's part,
    each GEMM at its shard's shape and the rest of the traffic as
    :meth:`ArchLayer.rank_elems` counts it."""
    mb = microbatch_size
    passes: dict[str, list[float]] = {"forward": [], "input": [], "weight": []}
    for part, times, shapes in gemm_launches(la, mb, shards):
        passes[part].append(times * sum(gemm_seconds(device, *shape) for shape in shapes))
    forward, grad_in, grad_w = passes.values()
    moved = mb * (device.dtype_bytes * la.rank_elems(shards)[0] + la.fp32_rank_bytes(shards)) / device.mem_bandwidth
    (grad_in if la.input_grad else grad_w).append(2 * moved)
    return math.fsum(forward) + moved, math.fsum(grad_in), math.fsum(grad_w)


#: One launch group of a layer's products: the pass it belongs to
#: ("forward", "input" or "weight" gradient), how often it is launched, and
#: the (m, n, k, batch) of each product in it.
GemmLaunch = tuple[str, int, tuple[tuple[int, int, int, int], ...]]


def gemm_launches(la: ArchLayer, microbatch_size: int, shards: int = 1) -> list[GemmLaunch]:
    """The products a layer launches, product by product (its forward, then
    its gradients), as :class:`Gemm` says: a weight product's input gradient
    is its transpose (none where the layer's input is data) and its weight
    gradient one product over every row; a product of two activations takes
    both gradients, with the input's (with the weights' where the input is
    data). ``shards``: one tensor-parallel rank's part."""
    out: list[GemmLaunch] = []
    for g in (g.shard(shards) for g in la.gemms):
        m, n, k, batch = g.shape(microbatch_size)
        out.append(("forward", g.steps, ((m, n, k, batch),)))
        if g.weights:
            if la.input_grad:
                out.append(("input", g.steps, ((m, k, n, batch),)))
            out.append(("weight", 1, ((k, n, m * batch * g.steps, 1),)))
        else:
            out.append(("input" if la.input_grad else "weight", g.steps, ((m, k, n, batch), (k, n, m, batch))))
    return out


def _roofline_passes(la: ArchLayer, device: DeviceSpec, mb: int) -> tuple[float, float, float]:
    """(forward, backward, backward input-gradient) seconds of a layer's work
    by the roofline at ``device.flops`` and ``device.mem_bandwidth``."""
    dt = device.dtype_bytes
    fwd_flops = mb * (la.gemm_flops + la.other_flops)
    if la.input_grad:
        bwd_input_flops = mb * (la.gemm_flops + 2 * la.other_flops)
    else:
        bwd_input_flops = 0.0
    bwd_flops = bwd_input_flops + mb * la.gemm_flops
    fwd_bytes = dt * ((la.params if la.param_traffic else 0) + mb * (la.in_elems + la.out_elems + la.stash_elems))
    fwd_bytes += mb * la.fp32_rank_bytes()
    forward_s = max(fwd_flops / device.flops, fwd_bytes / device.mem_bandwidth)
    backward_s = max(bwd_flops / device.flops, 2 * fwd_bytes / device.mem_bandwidth)
    if bwd_flops > 0:
        backward_input_s = backward_s * (bwd_input_flops / bwd_flops)
    elif not la.input_grad:
        backward_input_s = 0.0
    else:
        backward_input_s = backward_s if la.params == 0 else backward_s / 2
    return forward_s, backward_s, backward_input_s


def uniform_profile(
    layers: int = UNIFORM_DEFAULT_LAYERS,
    *,
    forward_s: float = 1e-3,
    backward_s: float = 2e-3,
    microbatch_size: int = 1,
    optimizer: str = "sgd",
) -> Profile:
    """Identical layers for analytic checks: F = 1 ms, B = 2 ms (I = W = 1 ms).

    Nothing is sent between layers (0 activation bytes), so communication
    never shows up; each layer has 1 MiB of weights and stashes 1 MiB per
    micro-batch, so memory accounting is visible and easy to read. Times do
    not depend on the device or the micro-batch size. With ``layers`` equal
    to the stage count every stage is exactly one layer, F = 1 ms, B = 2 ms.
    """
    n = _positive("layers", layers)
    layers_ = tuple(
        LayerCost(
            name=f"layer{i}",
            forward_s=forward_s,
            backward_s=backward_s,
            param_bytes=UNIFORM_PARAM_BYTES,
            activation_bytes=0,
            stash_bytes=UNIFORM_STASH_BYTES,
            backward_input_s=backward_s / 2,
        )
        for i in range(n)
    )
    return Profile(
        name="uniform",
        layers=layers_,
        microbatch_size=microbatch_size,
        optimizer=optimizer,
        notes=f"{n} uniform layers, F = {forward_s * 1e3:g} ms, B = {backward_s * 1e3:g} ms, nothing sent",
    )

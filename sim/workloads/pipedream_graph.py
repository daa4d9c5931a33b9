"""PipeDream's per-layer profiles (``graph.txt``) as pipesim profiles.

PipeDream's profiler writes one node per line (shown here on two), then the
edges, each on a line that starts with a tab::

    node4 -- Conv2d(64, 64, ...) -- forward_compute_time=46.201, backward_compute_time=113.330,
        activation_size=1644167168.000, parameter_size=147712.000
        node2 -- node4

Times are milliseconds for the whole profiled batch; ``activation_size`` is
the bytes of the node's output for that batch (a ``[a; b; c]`` list for a
node with several outputs, summed as PipeDream's own parser does);
``parameter_size`` is bytes of fp32 weights. A node line may end in
`` -- stage_id=N`` (PipeDream's partitioned graphs); the stage is ignored.

Turning a graph into a :class:`~pipesim.sim.workloads.profile.Profile` takes three
decisions, each the one PipeDream's own optimizer
(``optimizer/optimizer_graph_hierarchical.py``) makes where it makes one:

Inputs
    Source nodes described ``Input...`` stand for data loading. Their times
    include reading and decoding the batch, which is not model compute, and
    their outputs are data each stage loads for itself, not activations, so
    they are dropped entirely (PipeDream zeroes them before planning).
Order
    pipesim's partitioner splits a *sequence* of layers. A branching graph
    (ResNet's residual adds, GNMT's encoder/decoder and attention) is
    linearised in a topological order, taking among the nodes that are ready
    the one with the smallest node number. The order is deterministic and,
    because PipeDream numbers nodes as it traces the forward pass, follows
    the model's own execution order wherever the graph leaves a choice.
Bytes across a cut
    A stage boundary after position ``i`` carries the output of every node at
    or before ``i`` that has a consumer after ``i``, each output once: a
    residual shortcut or the encoder output GNMT's attention reads crosses
    every cut it spans, on top of the main path's tensor. That byte count is
    the layer's ``activation_bytes``, which is what the partitioner and the
    engine charge for a boundary after it (PipeDream's ``output_activation_size``
    of an antichain: the outputs of its augmented antichain).

What a layer stashes for its backward (``stash_bytes``) is its own output:
every output is kept until the backward that needs it, and charging it to its
producer counts each tensor once however many nodes consume it (charging
inputs would count a residual block's input twice, GNMT's attention context
three times). This is PipeDream's memory rule too (a stage's stashed data is
the sum of its nodes' ``activation_size``), with one refinement: a node whose
output aliases memory already counted stashes nothing. That is a
``__getitem__`` (one element of its producer's tuple output, whose
``activation_size`` already sums every element), a ``View``, and an in-place
operation (``ReLU(inplace)``, ``Add(inplace)``: the output overwrites its
input's buffer). PipeDream counts those again, which on VGG-16 doubles the
activation memory. On a cut, the receiving stage's copy of a boundary tensor
is the engine's communication buffer, not a stash.

The seven profiles PipeDream's authors published ship with pipesim as the
catalog models ``pipedream-*`` (:data:`CATALOG`); their batch sizes are not
in the files and are derived from the tensor sizes (see :data:`CATALOG`).

They are read as published, including two measurement artefacts of the GNMT
files that no rule of this reader can undo (both checked against the
authors' code, msr-fiddle/pipedream at 7db6a1c):

* **Backward time charged to the wrong node.** The profiler
  (``profiler/torchmodules/torchprofiler/profiling.py``) times a module's
  backward from a pre-hook (no ``cuda.synchronize``) to a legacy
  ``register_backward_hook`` that fires on the grad_fn of the module's *last*
  operation. ``Classifier.forward`` ends in a slice
  (``out[..., :self.out_features]``), so its Linear's backward runs after
  the hook and is timed in the next node's window, the LSTM before it:
  in ``gnmt_large`` the last decoder LSTM(2048, 1024) (node92) has a
  backward of 66.2 ms where its six identical siblings have 18.7-19.1, and the
  Classifier 5.4 ms against a forward of 24.8 (a Linear's backward is two
  GEMMs of the forward's size). Likewise the encoder Embedding (node4) has
  25.5 ms where the identical decoder Embedding (node41) has 0.46, and the
  EmuBidirLSTM after it 0.019 ms for a 14.1 ms forward. ``gnmt`` (GNMT-8)
  shows the same pattern (node44 15.9 ms against 5.3; node4 6.9 against
  0.33). Sums are unaffected; which layer is slow is: moved back, the slowest
  layer of GNMT-16 is the Classifier (about 77 ms a batch of 128), not the
  LSTM (about 30).
* **An attention output recorded as a hidden state.** ``RecurrentAttention``
  returns ``(rnn_outputs, (h, c), attn_outputs, scores)``; the file lists the
  flattened sizes and gives ``__getitem__(2)`` (node46 in ``gnmt_large``)
  the third flattened one, ``c`` (524,288 B), where element 2 is
  ``attn_outputs`` (13,107,200 B at batch 128). Every decoder cut carries
  that tensor, so the decoder's boundaries are about 12.6 MB light.
"""

from __future__ import annotations

import heapq
import importlib.resources
import math
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from pipesim.sim.limits import MAX_SECONDS, bytes_problem
from pipesim.sim.workloads.profile import LayerCost, Profile, WorkloadError, rescaled

_NODE_RE = re.compile(
    r"^(?P<id>\S+) -- (?P<desc>.*) -- forward_compute_time=(?P<forward>[^,]*), "
    r"backward_compute_time=(?P<backward>[^,]*), activation_size=(?P<activation>\[[^\]]*\]|[^,\[]*), "
    r"parameter_size=(?P<params>\S*?)(?: -- stage_id=\d+)?$"
)
_EDGE_RE = re.compile(r"^\s+(?P<src>\S+) -- (?P<dst>\S+)$")
_ID_RE = re.compile(r"^node(?P<number>\d{1,18})$")  # a bounded int: no digit-limit ValueError
_NODE_FORM = (
    "'nodeN -- description -- forward_compute_time=MS, backward_compute_time=MS, "
    "activation_size=BYTES, parameter_size=BYTES'"
)

#: Bytes of one 3x224x224 fp32 ImageNet image: an input node of a whole
#: multiple of this is that many images (all five image profiles).
IMAGENET_IMAGE_BYTES = 3 * 224 * 224 * 4


@dataclass(frozen=True)
class GraphNode:
    """One node of a graph.txt, in the file's units (milliseconds, bytes)."""

    id: str
    number: int
    description: str
    forward_ms: float
    backward_ms: float
    output_bytes: int
    param_bytes: int
    line: int

    @property
    def aliases_memory(self) -> bool:
        """Whether the output lives in memory another node's output already counts (see the module doc)."""
        d = self.description
        return d.startswith(("__getitem__", "View")) or "inplace" in d

    @property
    def layer_name(self) -> str:
        """``node12 Conv2d``: the id and the module's class, without its long argument list."""
        kind = self.description.split("(", 1)[0].strip()
        return f"{self.id} {kind}" if kind else self.id


@dataclass(frozen=True)
class Graph:
    """A parsed graph.txt: nodes by id and deduplicated edges ``(src, dst)``."""

    nodes: dict[str, GraphNode]
    edges: tuple[tuple[str, str], ...]


def _shown(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _ms(name: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (0 <= v <= MAX_SECONDS * 1e3):
        raise WorkloadError(
            f"{name} must be a number of milliseconds >= 0 and <= {MAX_SECONDS * 1e3:g}, got {_shown(text)}"
        )
    return v


def _bytes(name: str, text: str) -> int:
    """A byte count written as a float (``77070336.000``), or a ``[a; b]`` list of them summed;
    a fraction of a byte is a malformed profile, not something to round."""
    parts = text[1:-1].split(";") if text.startswith("[") else [text]
    total = 0.0
    for part in parts:
        try:
            v = float(part)
        except ValueError:
            v = math.nan
        if not (0 <= v < math.inf) or v != math.floor(v):
            raise WorkloadError(f"{name} must be a whole number of bytes >= 0, got {_shown(text)}")
        total += v
    n = round(total)
    problem = bytes_problem(name, n)
    if problem:
        raise WorkloadError(problem)
    return n


def _parse_node(line: str, lineno: int) -> GraphNode:
    m = _NODE_RE.match(line)
    if not m:
        raise WorkloadError(f"expected a node {_NODE_FORM} or an edge '<tab>nodeA -- nodeB', got {_shown(line)}")
    ident = _ID_RE.match(m["id"])
    if not ident:
        raise WorkloadError(f"node ids are node<number>, got {_shown(m['id'])}")
    return GraphNode(
        id=m["id"],
        number=int(ident["number"]),
        description=m["desc"].strip(),
        forward_ms=_ms("forward_compute_time", m["forward"]),
        backward_ms=_ms("backward_compute_time", m["backward"]),
        output_bytes=_bytes("activation_size", m["activation"]),
        param_bytes=_bytes("parameter_size", m["params"]),
        line=lineno,
    )


def parse_graph(text: str) -> Graph:
    """Nodes and edges of a graph.txt; :class:`WorkloadError` naming the line at fault."""
    nodes: dict[str, GraphNode] = {}
    edges: dict[tuple[str, str], int] = {}  # edge -> first line, in file order
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if not line:
            continue
        try:
            if line[0].isspace():
                m = _EDGE_RE.match(line)
                if not m:
                    raise WorkloadError(f"expected an edge '<tab>nodeA -- nodeB', got {_shown(line.strip())}")
                edges.setdefault((m["src"], m["dst"]), lineno)
                continue
            node = _parse_node(line, lineno)
            if node.id in nodes:
                raise WorkloadError(f"{node.id} is defined twice (first on line {nodes[node.id].line})")
        except WorkloadError as e:
            raise WorkloadError(f"line {lineno}: {e}") from None
        nodes[node.id] = node
    if not nodes:
        raise WorkloadError("no node lines (expected PipeDream's graph.txt format)")
    for (src, dst), lineno in edges.items():
        for end in (src, dst):
            if end not in nodes:
                raise WorkloadError(f"line {lineno}: the edge names {end}, which no node line defines")
    return Graph(nodes, tuple(edges))


def linear_order(nodes: list[GraphNode], edges: list[tuple[str, str]]) -> list[GraphNode]:
    """``nodes`` in a topological order of ``edges``, ties to the smallest node number.

    Edges must join listed nodes. :class:`WorkloadError` when they form a cycle.
    """
    by_id = {n.id: n for n in nodes}
    consumers: dict[str, list[str]] = {n.id: [] for n in nodes}
    waiting = {n.id: 0 for n in nodes}
    for src, dst in edges:
        consumers[src].append(dst)
        waiting[dst] += 1
    ready = [(n.number, n.id) for n in nodes if waiting[n.id] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, ident = heapq.heappop(ready)
        order.append(by_id[ident])
        for dst in consumers[ident]:
            waiting[dst] -= 1
            if waiting[dst] == 0:
                heapq.heappush(ready, (by_id[dst].number, dst))
    if len(order) < len(nodes):
        cycle = _a_cycle([by_id[i] for i, w in waiting.items() if w], edges)
        path = " -> ".join(n.id for n in [*cycle, cycle[0]])
        raise WorkloadError(f"the edges form a cycle: {path} (node lines {', '.join(str(n.line) for n in cycle)})")
    return order


def _a_cycle(stuck: list[GraphNode], edges: list[tuple[str, str]]) -> list[GraphNode]:
    """A cycle among the nodes a topological sort could not place, in edge
    order from its smallest-numbered node.

    Each of them waits on another of them, so walking back from one,
    always to its smallest-numbered waiting predecessor, must come round.
    """
    by_id = {n.id: n for n in stuck}
    back: dict[str, GraphNode] = {}
    for src, dst in edges:
        if src in by_id and dst in by_id and (dst not in back or by_id[src].number < back[dst].number):
            back[dst] = by_id[src]
    walk = [min(stuck, key=lambda n: n.number)]
    while back[walk[-1].id] not in walk:
        walk.append(back[walk[-1].id])
    cycle = walk[walk.index(back[walk[-1].id]) :][::-1]
    first = cycle.index(min(cycle, key=lambda n: n.number))
    return cycle[first:] + cycle[:first]


def cut_bytes(order: list[GraphNode], edges: list[tuple[str, str]]) -> list[int]:
    """Bytes crossing the cut after each position of ``order``.

    The cut after position ``i`` carries the output of every node at or
    before ``i`` with a consumer after ``i``, each output once; nothing
    follows the last position, so its entry is 0.
    """
    position = {n.id: i for i, n in enumerate(order)}
    last_use = list(range(len(order)))  # a node without consumers crosses no cut
    for src, dst in edges:
        i = position[src]
        last_use[i] = max(last_use[i], position[dst])
    change = [0] * (len(order) + 1)  # a difference array over cut positions
    for i, node in enumerate(order):
        change[i] += node.output_bytes
        change[last_use[i]] -= node.output_bytes
    out, running = [], 0
    for i in range(len(order)):
        running += change[i]
        out.append(running)
    return out


def input_nodes(graph: Graph) -> list[GraphNode]:
    """The data-loading nodes: sources described ``Input...`` (PipeDream's own test)."""
    consumed = {d for _, d in graph.edges}
    return [n for n in graph.nodes.values() if n.description.startswith("Input") and n.id not in consumed]


def graph_layers(graph: Graph) -> tuple[LayerCost, ...]:
    """The graph's layers, inputs dropped, linearised, with cut and stash bytes (see the module doc)."""
    inputs = {n.id for n in input_nodes(graph)}
    nodes = [n for n in graph.nodes.values() if n.id not in inputs]
    if not nodes:
        raise WorkloadError("the graph has only input nodes, no layers")
    edges = [(s, d) for s, d in graph.edges if s not in inputs]
    order = linear_order(nodes, edges)
    return tuple(
        LayerCost(
            name=node.layer_name,
            forward_s=node.forward_ms / 1e3,
            backward_s=node.backward_ms / 1e3,
            param_bytes=node.param_bytes,
            activation_bytes=crossing,
            stash_bytes=0 if node.aliases_memory else node.output_bytes,
        )
        for node, crossing in zip(order, cut_bytes(order, edges))
    )


def inferred_batch(graph: Graph) -> int | None:
    """Images per batch when the one input node holds whole 3x224x224 fp32 images, else None."""
    inputs = input_nodes(graph)
    if len(inputs) != 1:
        return None
    images, rest = divmod(inputs[0].output_bytes, IMAGENET_IMAGE_BYTES)
    return images if images and not rest else None


def graph_profile(
    text: str, name: str, *, microbatch_size: int | None = None, optimizer: str = "sgd", notes: str = ""
) -> Profile:
    """A :class:`Profile` of graph.txt ``text`` (see the module doc).

    ``microbatch_size`` is the batch the file was profiled at; when None it is
    inferred from an ImageNet input node, else taken as 1 (and the notes say
    so): the format does not record it.
    """
    graph = parse_graph(text)
    layers = graph_layers(graph)
    batch, how = microbatch_size, "batch as profiled"
    if batch is None:
        batch, how = inferred_batch(graph), "batch inferred from the input node (3x224x224 fp32 images)"
    if batch is None:
        batch, how = 1, "batch not recorded in the file: 1 assumed (--microbatch-size sets the samples per micro-batch)"
    summary = (
        f"PipeDream graph.txt: {len(graph.nodes)} nodes, {len(layers)} layers after dropping input nodes, "
        f"linearised in topological order (ties to the smaller node number); {how}: {batch}"
    )
    return Profile(
        name=name,
        layers=layers,
        microbatch_size=batch,
        optimizer=optimizer,
        notes=f"{notes}; {summary}" if notes else summary,
    )


def looks_like_graph(path, text: str) -> bool:
    """Whether a profile file is a graph.txt rather than pipesim's JSON.

    By content (a graph starts with a ``node<number>`` line), and by name for
    a ``.txt`` file that is not JSON, so a broken graph.txt is reported as one.
    """
    head = text.lstrip()
    return bool(re.match(r"node\d", head)) or (Path(str(path)).suffix == ".txt" and not head.startswith(("{", "[")))


def graph_file_profile(path, text: str) -> Profile:
    """The profile of a graph.txt read from ``path``, named after the file (its folder for ``graph.txt``)."""
    p = Path(str(path))
    name = p.stem
    if name == "graph":  # PipeDream's layout: profiles/<model>/graph.txt
        name = p.resolve().parent.name or name
    return graph_profile(text, name or "graph")


# ---------------------------------------------------------------------------
# The published profiles as catalog models
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CatalogEntry:
    """A shipped profile: its folder under ``profiles/pipedream``, batch and optimizer.

    ``batch`` comes from tensor sizes in the file: the image models' input
    node is that many 3x224x224 fp32 images; GNMT's LSTM hidden states are
    ``batch x 1024`` fp32 (131072 B -> 32 in gnmt, 524288 B -> 128 in
    gnmt_large), which the attention scores confirm (32 x 47 x 48 and
    128 x 25 x 25 floats).
    """

    folder: str
    batch: int
    optimizer: str
    description: str


#: Catalog name -> shipped profile. Optimizers are what PipeDream trained
#: them with: momentum SGD for the image models, Adam for GNMT.
CATALOG = {
    "pipedream-alexnet": CatalogEntry("alexnet", 256, "sgd", "AlexNet"),
    "pipedream-gnmt16": CatalogEntry("gnmt_large", 128, "adam", "GNMT-16 (8+8 LSTM layers), sequences of 25"),
    "pipedream-gnmt8": CatalogEntry("gnmt", 32, "adam", "GNMT-8 (4+4 LSTM layers), sequences of 48/47"),
    "pipedream-resnet18": CatalogEntry("resnet18", 256, "sgd", "ResNet-18"),
    "pipedream-resnet50": CatalogEntry("resnet50", 128, "sgd", "ResNet-50"),
    "pipedream-squeezenet": CatalogEntry("squeezenet1_0", 256, "sgd", "SqueezeNet 1.0"),
    "pipedream-vgg16": CatalogEntry("vgg16", 128, "sgd", "VGG-16"),
}


def catalog_names() -> list[str]:
    """Names of the shipped PipeDream profiles, sorted."""
    return sorted(CATALOG)


def catalog_file(name: str):
    """The shipped graph.txt of catalog model ``name`` (an importlib resource)."""
    folder = CATALOG[name].folder
    return importlib.resources.files("pipesim.sim.workloads").joinpath("profiles", "pipedream", folder, "graph.txt")


@lru_cache(maxsize=None)
def _as_profiled(name: str) -> Profile:
    entry = CATALOG[name]
    return graph_profile(
        catalog_file(name).read_text(encoding="utf-8"),
        name,
        microbatch_size=entry.batch,
        optimizer=entry.optimizer,
        notes=f"{entry.description}, measured by PipeDream's authors (profiles/pipedream/{entry.folder}/graph.txt, "
        "MIT licence); device not recorded (the paper's clusters used V100s)",
    )


def catalog_profile(name: str, microbatch_size: int | None = None, optimizer: str | None = None) -> Profile:
    """Catalog model ``name`` at ``microbatch_size`` samples (default: as profiled).

    A measured profile does not depend on a device. Another micro-batch size
    rescales every time and activation byte count linearly (see
    :func:`rescaled`).
    """
    profile = _as_profiled(name)
    if optimizer is not None:
        profile = replace(profile, optimizer=optimizer)
    if microbatch_size is not None and microbatch_size != profile.microbatch_size:
        profile = rescaled(profile, microbatch_size)
    return profile

"""PipeDream's graph.txt profiles: parsing, linearisation, cut bytes, the shipped catalog models."""

from __future__ import annotations

import json
import math

import pytest

from pipesim.sim.hardware.machines import DeviceSpec
from pipesim.sim.workloads.catalog import measured_model_names, model_names, model_parameters, model_profile
from pipesim.sim.workloads.pipedream_graph import CATALOG, catalog_file, catalog_profile, input_nodes, parse_graph
from pipesim.sim.workloads.profile import WorkloadError
from pipesim.sim.workloads.readers import load_profile

FAST = DeviceSpec("fast", flops=1e15, mem_bandwidth=math.inf, memory_bytes=math.inf)
SLOW = DeviceSpec("slow", flops=1e12, mem_bandwidth=1e11, memory_bytes=1e9)


def node(number, desc, f, b, act, params=0.0):
    return (
        f"node{number} -- {desc} -- forward_compute_time={f:.3f}, backward_compute_time={b:.3f}, "
        f"activation_size={act}, parameter_size={params:.3f}"
    )


#: A small branching graph, nodes out of order as PipeDream writes them: a
#: conv (node2) feeding a main path (3 -> 5), a shortcut (4) joined by an
#: add (6), a tuple output (7) read by getitems (8 used, 9 unused), and a
#: long skip from node2 to the last node.
BRANCHING = "\n".join(
    [
        node(6, "Add", 0.0, 0.0, "20.000"),
        node(1, "Input", 5.0, 0.0, "1000.000"),
        node(3, "Conv2d(8, 8)", 2.0, 4.0, "30.000", 8),
        node(2, "Conv2d(3, 8)", 1.0, 2.0, "100.000", 40),
        node(5, "ReLU(inplace)", 0.5, 0.25, "30.000"),
        node(4, "Conv2d(3, 8, stride=2)", 1.0, 1.0, "20.000", 4),
        node(7, "LSTM(8, 8)", 3.0, 6.0, "[7.0; 3.0]", 400),
        node(8, "__getitem__(0)", 0.0, 0.0, "7.0"),
        node(9, "__getitem__(1)", 0.0, 0.0, "3.0"),
        node(10, "Loss", 0.125, 0.125, "1.000"),
        *(
            f"\tnode{a} -- node{b}"
            for a, b in [(1, 2), (2, 3), (2, 4), (3, 5), (5, 6), (4, 6), (6, 7), (7, 8), (7, 9), (8, 10), (2, 10)]
        ),
    ]
)


def write(tmp_path, text, name="graph.txt"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_branching_graph_by_hand(tmp_path):
    prof = load_profile(write(tmp_path, BRANCHING))
    # topological, ties to the smaller number: node4 (ready after node2) comes before node5 (after node3)
    assert [la.name for la in prof.layers] == [
        "node2 Conv2d",
        "node3 Conv2d",
        "node4 Conv2d",
        "node5 ReLU",
        "node6 Add",
        "node7 LSTM",
        "node8 __getitem__",
        "node9 __getitem__",
        "node10 Loss",
    ]
    # each cut carries every earlier output still to be read, once: node2's 100 bytes cross every cut
    # up to node10; after node3 its 30 wait for node5; node4's 20 wait for node6; node7's 10 for node9;
    # node8's 7 for node10. Only the last node's output would give 100, 30, 20, 30, 20, 10, 7, 3, 0.
    assert [la.activation_bytes for la in prof.layers] == [100, 130, 150, 150, 120, 110, 117, 107, 0]
    # a layer stashes its own output, except where it aliases one already counted (in-place, getitem)
    assert [la.stash_bytes for la in prof.layers] == [100, 30, 20, 0, 20, 10, 0, 0, 1]
    assert [la.param_bytes for la in prof.layers] == [40, 8, 4, 0, 0, 400, 0, 0, 0]
    # the input node's 5 ms of data loading is not compute
    assert prof.forward_s == pytest.approx((1 + 2 + 1 + 0.5 + 3 + 0.125) / 1e3)
    assert prof.backward_s == pytest.approx((2 + 4 + 1 + 0.25 + 6 + 0.125) / 1e3)
    assert prof.name == tmp_path.name  # graph.txt is named after its folder
    assert prof.microbatch_size == 1 and "not recorded" in prof.notes  # 1000 bytes are no ImageNet batch


def test_file_order_and_stage_ids_do_not_matter(tmp_path):
    lines = BRANCHING.splitlines()
    nodes = [ln for ln in lines if not ln.startswith("\t")]
    edges = [ln for ln in lines if ln.startswith("\t")]
    shuffled = "\n".join([*reversed(nodes[5:]), *edges[::-1], *nodes[:5]])  # edges before some nodes
    staged = "\n".join(ln if ln.startswith("\t") else ln + " -- stage_id=0" for ln in lines)
    a = load_profile(write(tmp_path, BRANCHING, "a.txt"))
    for text in (shuffled, staged, BRANCHING.replace("\n", "\r\n") + "\n\n"):
        assert load_profile(write(tmp_path, text, "a.txt")).layers == a.layers


EXPECTED = {  # sums over non-input nodes: forward ms, backward ms, parameter MB; batch
    # the table in PipeDream's profiles' README (shared/data/pipedream-profiles)
    "pipedream-vgg16": (233.9, 438.6, 553.4, 128),
    "pipedream-alexnet": (44.8, 40.5, 244.4, 256),
    "pipedream-resnet50": (182.5, 260.9, 102.2, 128),
    "pipedream-resnet18": (107.4, 152.3, 46.8, 256),
    "pipedream-squeezenet": (113.2, 172.1, 5.0, 256),
    # that table's GNMT rows leave out the nodes with list activations (see the next test)
    "pipedream-gnmt8": (33.5, 55.9, 775.1, 32),
    "pipedream-gnmt16": (182.6, 337.9, 1110.9, 128),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_profiles_match_their_published_sums(name):
    forward_ms, backward_ms, param_mb, batch = EXPECTED[name]
    prof = catalog_profile(name)
    assert prof.name == name and prof.microbatch_size == batch
    assert round(prof.forward_s * 1e3, 1) == forward_ms
    assert round(prof.backward_s * 1e3, 1) == backward_ms
    assert round(prof.param_bytes / 1e6, 1) == param_mb
    graph = parse_graph(catalog_file(name).read_text(encoding="utf-8"))
    assert prof.num_layers == len(graph.nodes) - len(input_nodes(graph))
    assert prof.layers[-1].activation_bytes == 0  # nothing follows the loss
    assert all(la.activation_bytes > 0 for la in prof.layers[:-1])  # every cut carries something
    assert prof.optimizer == ("adam" if "gnmt" in name else "sgd")
    assert (catalog_file(name).parent.parent / "LICENSE.txt").read_text().startswith("MIT License")


def test_gnmt_batches_and_the_shared_tables_gnmt_rows():
    for name, batch in (("pipedream-gnmt8", 32), ("pipedream-gnmt16", 128)):
        graph = parse_graph(catalog_file(name).read_text(encoding="utf-8"))
        producers = {dst: graph.nodes[src] for src, dst in graph.edges}
        hidden = {
            n.output_bytes
            for n in graph.nodes.values()
            if n.description == "__getitem__(1)" and producers[n.id].description.startswith("LSTM")
        }
        assert hidden == {batch * 1024 * 4}  # h of shape (1, batch, 1024), fp32
    # the shared table's GNMT rows (11.4 ms, 9.5 ms, 464.5 MB; 41.0, 34.4, 464.5) are the sums
    # without the nodes whose activation_size is a list: a parser that skipped those lines
    for name, want in (("pipedream-gnmt8", (11.4, 9.5, 464.5)), ("pipedream-gnmt16", (41.0, 34.4, 464.5))):
        text = catalog_file(name).read_text(encoding="utf-8")
        plain = [ln for ln in text.splitlines() if "[" not in ln and not ln.startswith("\t")]
        nodes = parse_graph("\n".join(plain)).nodes.values()
        got = (
            sum(n.forward_ms for n in nodes),
            sum(n.backward_ms for n in nodes),
            sum(n.param_bytes for n in nodes) / 1e6,
        )
        assert tuple(round(x, 1) for x in got) == want


def test_image_batches_are_inferred_from_the_input_node(tmp_path):
    for name, entry in CATALOG.items():
        from_file = load_profile(catalog_file(name))
        assert from_file.layers == catalog_profile(name).layers
        if "gnmt" not in name:
            assert from_file.microbatch_size == entry.batch and "inferred" in from_file.notes


def test_catalog_models_ignore_the_device_and_rescale_with_a_note():
    assert measured_model_names() == sorted(EXPECTED)
    assert not set(measured_model_names()) & set(model_names())
    base = model_profile("pipedream-vgg16", FAST)
    assert model_profile("pipedream-vgg16", SLOW) == base  # measured: no roofline on the device
    assert model_profile("pipedream-vgg16", SLOW, 128) == base
    quarter = model_profile("pipedream-vgg16", SLOW, 32)
    assert quarter.microbatch_size == 32 and "approximation" in quarter.notes
    for a, q in zip(base.layers, quarter.layers):
        assert q.forward_s == pytest.approx(a.forward_s / 4) and q.backward_s == pytest.approx(a.backward_s / 4)
        assert q.activation_bytes == a.activation_bytes // 4 and q.stash_bytes == a.stash_bytes // 4
        assert q.param_bytes == a.param_bytes
    assert model_profile("pipedream-gnmt8", FAST, optimizer="sgd").optimizer == "sgd"
    assert model_parameters("pipedream-vgg16") == base.param_bytes // 4
    with pytest.raises(WorkloadError, match="measured profile: its depth and sequence length are fixed"):
        model_profile("pipedream-gnmt8", FAST, seq_len=10)
    with pytest.raises(WorkloadError, match="microbatch_size must be a positive"):
        model_profile("pipedream-vgg16", FAST, 0)
    with pytest.raises(WorkloadError, match="activation_bytes must be an integer >= 0 and <= 2"):
        model_profile("pipedream-vgg16", FAST, 2**31)  # 1.6 GB per 128 images, 2**31 images
    with pytest.raises(WorkloadError) as e:
        model_profile("pipedream-vgg19", FAST)
    assert "measured: pipedream-alexnet" in str(e.value)


def test_cli_simulates_catalog_names_and_graph_files(tmp_path, capsys):
    from pipesim.experiments.cli import main

    out = tmp_path / "vgg"
    argv = [
        "simulate",
        "--strategy",
        "1f1b",
        "--model",
        "pipedream-vgg16",
        "--hardware",
        "pcie-4gpu",
        "--stages",
        "4",
        "--out",
        str(out),
        "--summary-only",
    ]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["microbatch_size"] == 128 and summary["meta"]["model"] == "pipedream-vgg16"
    prof = catalog_profile("pipedream-vgg16")
    stages = summary["stages_info"]
    assert sum(s["forward_s"] for s in stages) == pytest.approx(prof.forward_s)
    assert sum(s["param_bytes"] for s in stages) == prof.param_bytes
    assert (
        main(
            [
                "simulate",
                "--strategy",
                "gpipe",
                "--profile",
                str(catalog_file("pipedream-gnmt8")),
                "--hardware",
                "pipedream-cluster-b",
                "--stages",
                "2",
                "--microbatch-size",
                "32",
                "--out",
                str(tmp_path / "gnmt"),
                "--summary-only",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "gnmt" / "summary.json").read_text())["meta"]["model"] == "gnmt"
    capsys.readouterr()


def test_a_graph_file_at_another_batch_runs_as_the_catalog_model_does(tmp_path, capsys):
    """--microbatch-size rescales a profile that knows its batch (AlexNet's
    graph.txt: 256 images), as the catalog's name does: the same file by
    --profile and by --model gives the same run. Before, the file kept its
    256-image times and counted 64 samples: a quarter of the throughput."""
    from pipesim.experiments.cli import main

    rates = []
    for source in (["--profile", str(catalog_file("pipedream-alexnet"))], ["--model", "pipedream-alexnet"]):
        out = tmp_path / source[0].strip("-")
        assert (
            main(
                [
                    "simulate",
                    "--strategy",
                    "pipedream",
                    *source,
                    "--hardware",
                    "pipedream-cluster-a-x4",
                    "--replicas",
                    "14,1,1",
                    "--microbatches",
                    "28",
                    "--iterations",
                    "3",
                    "--microbatch-size",
                    "64",
                    "--out",
                    str(out),
                    "--summary-only",
                ]
            )
            == 0
        )
        summary = json.loads((out / "summary.json").read_text())
        assert summary["microbatch_size"] == 64
        rates.append(summary["throughput_samples_per_s"])
    assert rates[0] == rates[1]
    capsys.readouterr()


def test_a_profile_of_unknown_batch_takes_the_size_it_is_given():
    """Batch 1 (unstated) is taken to be what --microbatch-size says: the
    samples counted change, the times do not."""
    from pipesim.sim.workloads.profile import LayerCost, Profile, at_microbatch_size

    prof = Profile(
        "x", (LayerCost("a", forward_s=1e-3, backward_s=2e-3, param_bytes=8, activation_bytes=4, stash_bytes=4),)
    )
    declared = at_microbatch_size(prof, 16)
    assert declared.microbatch_size == 16 and declared.layers == prof.layers
    known = at_microbatch_size(declared, 32)  # now it knows its batch: rescaled
    assert known.layers[0].forward_s == pytest.approx(2e-3) and known.layers[0].stash_bytes == 8
    assert at_microbatch_size(prof, None) is prof


def test_plan_of_a_graph_file_names_its_model(tmp_path, capsys):
    """``plan --profile`` records the profile's model, not the default
    catalog model it replaces."""
    from pipesim.experiments.cli import main

    assert (
        main(
            [
                "plan",
                "--profile",
                str(catalog_file("pipedream-alexnet")),
                "--hardware",
                "pipedream-cluster-a",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    record = json.loads((tmp_path / "plan.json").read_text())
    assert record["model"] == "alexnet" and record["profile"].endswith("graph.txt")
    capsys.readouterr()


MALFORMED = [
    ("", "no node lines"),
    ("node1 -- Input -- forward_compute_time=1.0", "line 1: expected a node 'nodeN -- description"),
    (node(1, "Conv", 1.0, 1.0, "4.0") + "\nnode2 Conv2d", "line 2: expected a node"),
    (node(1, "Conv", 1.0, 1.0, "4.0").replace("=1.000,", "=fast,", 1), "line 1: forward_compute_time must be"),
    (node(1, "Conv", 1.0, 1.0, "4.0").replace("=1.000,", "=nan,", 1), "line 1: forward_compute_time must be"),
    (
        node(1, "Conv", 1.0, -1.0, "4.0"),
        "line 1: backward_compute_time must be a number of milliseconds >= 0 and <= 1e+12",
    ),
    (node(1, "Conv", 1.0, 1.0, "[4.0; x]"), "line 1: activation_size must be a whole number of bytes"),
    (node(1, "Conv", 1.0, 1.0, "4.0", 1180672.5), "line 1: parameter_size must be a whole number of bytes"),
    (node(1, "Conv", 1.0, 1.0, "4.0", 1e300), "line 1: parameter_size must be"),
    (node(1, "Conv", 1.0, 1.0, "1e17"), "line 1: activation_size must be an integer >= 0 and <= 2**53"),
    (node(1, "Conv", 1.0, 1.0, "4.0").replace("node1", "layer1"), "line 1: node ids are node<number>"),
    (node(1, "A", 1, 1, "4.0") + "\n" + node(1, "B", 1, 1, "4.0"), "line 2: node1 is defined twice (first on line 1)"),
    (node(1, "A", 1, 1, "4.0") + "\n\tnode1 -> node2", "line 2: expected an edge '<tab>nodeA -- nodeB'"),
    (node(1, "A", 1, 1, "4.0") + "\n\n\tnode1 -- node7", "line 3: the edge names node7, which no node line"),
    (
        node(1, "A", 1, 1, "4.0") + "\n" + node(2, "B", 1, 1, "4.0") + "\n\tnode1 -- node2\n\tnode2 -- node1",
        "the edges form a cycle: node1 -> node2 -> node1 (node lines 1, 2)",
    ),
    (
        "\n".join(
            [node(i, "L", 1, 1, "4.0") for i in (1, 2, 7, 8, 9)]
            + [f"\tnode{a} -- node{b}" for a, b in [(1, 2), (9, 2), (7, 8), (8, 9), (9, 7)]]
        ),
        "the edges form a cycle: node7 -> node8 -> node9 -> node7 (node lines 3, 4, 5)",
    ),  # node2 only waits on it
    (node(1, "Input", 1, 0, "4.0"), "only input nodes, no layers"),
]


@pytest.mark.parametrize("text, fragment", MALFORMED, ids=[fragment for _, fragment in MALFORMED])
def test_malformed_graph_files_are_one_line_errors(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(WorkloadError) as e:
        load_profile(path)
    msg = str(e.value)
    assert fragment in msg and msg.startswith(f"profile file {path}: ") and "\n" not in msg, msg


def test_json_profiles_are_still_json(tmp_path):
    good = catalog_profile("pipedream-alexnet")
    path = write(tmp_path, json.dumps(good.to_json()), "alexnet.txt")  # JSON content wins over the name
    assert load_profile(path) == good
    with pytest.raises(WorkloadError, match="malformed JSON at line 1"):
        load_profile(write(tmp_path, "nodes are not JSON", "p.json"))


def test_pipeline_across_cluster_a_servers_sends_cut_bytes_over_ethernet():
    from pipesim.sim.api import simulate
    from pipesim.sim.strategies import ScheduleSpec

    m = 4
    res = simulate(ScheduleSpec("1f1b", 8, m), "pipedream-resnet50", "pipedream-cluster-a-x4")
    boundary = res.stage_costs[3].activation_bytes  # stage 3 (server 0) -> stage 4 (server 1)
    assert boundary == catalog_profile("pipedream-resnet50").layers[res.stage_costs[3].last_layer].activation_bytes
    assert res.link_bytes["node0.eth0.tx"] == m * boundary  # activations out; gradients come back on rx
    assert res.link_bytes["node1.eth0.rx"] == m * boundary

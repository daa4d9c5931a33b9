"""Hardware presets, routes and transfer times against hand calculations."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.sim.hardware.machines import (
    DeviceSpec,
    Hardware,
    HardwareError,
    Interconnect,
    Link,
    NicSpec,
    load_hardware,
    preset_names,
)

REQUIRED = {
    "ideal",
    "pcie-4gpu",
    "dgx1-v100",
    "dgx-h100",
    "dgx1-v100-x4",
    "dgx-h100-x2",
    "dgx-h100-x4",
    "pipedream-cluster-a",
    "pipedream-cluster-b",
}


def test_required_presets_exist_and_load():
    names = preset_names()
    assert REQUIRED <= set(names)
    assert names == sorted(names)
    for name in names:
        hw = load_hardware(name)
        assert hw.name == name
        assert hw.notes, f"{name} must cite its numbers in notes"


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_preset_json_round_trips(name):
    hw = load_hardware(name)
    again = Hardware.from_json(json.loads(json.dumps(hw.to_json())))
    assert again == hw


def test_preset_key_numbers():
    pcie = load_hardware("pcie-4gpu")
    assert pcie.num_devices == 4 and pcie.device.dtype_bytes == 4
    assert 8e12 <= pcie.device.flops <= 10e12
    assert 8 * 2**30 <= pcie.device.memory_bytes <= 12 * 2**30
    v100 = load_hardware("dgx1-v100")
    assert v100.num_devices == 8 and v100.device.dtype_bytes == 2
    assert 3e13 <= v100.device.flops <= 1e14
    h100 = load_hardware("dgx-h100")
    assert h100.num_devices == 8 and h100.device.memory_bytes == 80 * 2**30
    assert 3e14 <= h100.device.flops <= 5e14
    assert load_hardware("dgx1-v100-x4").num_devices == 32
    assert load_hardware("dgx-h100-x2").num_devices == 16
    assert load_hardware("dgx-h100-x4").nodes == 4


def _lat(hw, src, dst):
    """The latency a transfer pays before its bytes: the route's links' own,
    or one NCCL step where the machine has NCCL's model (tests/test_collectives.py
    holds those to tuning.cc); these tests hold the topology and bandwidths."""
    return hw.transfer_line(src, dst)[0]


def _links_only(hw):
    """``hw`` with its collectives as rings over its links (no NCCL model)."""
    return dataclasses.replace(hw, collectives=None)


def test_ideal_is_free_and_unbounded():
    hw = load_hardware("ideal")
    assert hw.num_devices is None
    hw.check_devices(10**6)
    assert hw.route(0, 12345) == ()
    assert hw.transfer_time(0, 12345, 10**12) == 0.0
    assert math.isinf(hw.device.memory_bytes) and math.isinf(hw.device.mem_bandwidth)
    assert hw.ring_allreduce_time(range(16), 10**9) == 0.0


def test_pcie_4gpu_shares_one_host_bridge():
    hw = load_hardware("pcie-4gpu")
    routes = [hw.route(s, d) for s, d in itertools.permutations(range(4), 2)]
    assert all(len(r) == 1 for r in routes)
    bridge = routes[0][0]
    assert all(r[0] is bridge for r in routes), "every transfer must hold the same link object"
    assert bridge.bandwidth == 12e9 and bridge.latency == 1e-5
    # hand calculation: 12 MB over 12 GB/s plus 10 us
    assert hw.transfer_time(0, 3, 12_000_000) == pytest.approx(_lat(hw, 0, 3) + 1e-3, rel=1e-12)
    assert hw.route(2, 2) == () and hw.transfer_time(2, 2, 10**9) == 0.0
    assert hw.transfer_time(0, 1, 0) == 0.0  # nothing to send costs nothing


def test_check_devices_message():
    with pytest.raises(HardwareError) as e:
        load_hardware("pcie-4gpu").check_devices(8)
    assert str(e.value) == "pcie-4gpu has 4 devices; the schedule needs 8"
    load_hardware("pcie-4gpu").check_devices(4)


def test_dgx_h100_switch_ports():
    hw = load_hardware("dgx-h100")
    r01, r02, r23, r10 = hw.route(0, 1), hw.route(0, 2), hw.route(2, 3), hw.route(1, 0)
    assert [lk.name for lk in r01] == ["gpu0.nvswitch.tx", "gpu1.nvswitch.rx"]
    assert r01[0] is r02[0], "two sends from GPU 0 share its egress port"
    assert not {lk.name for lk in r01} & {lk.name for lk in r23}, "disjoint pairs do not contend"
    assert not {lk.name for lk in r01} & {lk.name for lk in r10}, "full duplex: the reverse uses other ports"
    assert hw.route(3, 1)[1] is r01[1], "two receives into GPU 1 share its ingress port"
    assert hw.transfer_time(0, 1, 4e8) == pytest.approx(_lat(hw, 0, 1) + 4e8 / 4e11, rel=1e-12)


DGX1_TOPO = """
X NV1 NV1 NV2 NV2 SYS SYS SYS
NV1 X NV2 NV1 SYS NV2 SYS SYS
NV1 NV2 X NV2 SYS SYS NV1 SYS
NV2 NV1 NV2 X SYS SYS SYS NV1
NV2 SYS SYS SYS X NV1 NV1 NV2
SYS NV2 SYS SYS NV1 X NV2 NV1
SYS SYS NV1 SYS NV1 NV2 X NV2
SYS SYS SYS NV1 NV2 NV1 NV2 X
"""  # nvidia-smi topo -m on a DGX-1 (V100)


def test_dgx1_v100_hybrid_cube_mesh_matches_nvidia_smi():
    hw = load_hardware("dgx1-v100")
    rows = [line.split() for line in DGX1_TOPO.strip().splitlines()]
    host = None
    for a, b in itertools.permutations(range(8), 2):
        route = hw.route(a, b)
        assert len(route) == 1
        cell = rows[a][b]
        if cell == "SYS":
            assert route[0].name == "node0.host"
            host = host or route[0]
            assert route[0] is host, "all non-NVLink traffic shares the host path"
        else:
            lanes = int(cell[2:])
            assert route[0].name == f"gpu{a}->gpu{b}.nvlink"
            assert route[0].bandwidth == lanes * 24e9
    assert hw.route(0, 3)[0] is not hw.route(3, 0)[0]
    # 3 -> 4 has no NVLink: 15 us + bytes over 10 GB/s
    assert hw.transfer_time(3, 4, 1e7) == pytest.approx(_lat(hw, 3, 4) + 1e-3, rel=1e-12)
    assert hw.transfer_time(0, 3, 4.8e7) == pytest.approx(_lat(hw, 0, 3) + 1e-3, rel=1e-12)


def test_multinode_h100_nic_per_gpu():
    hw = load_hardware("dgx-h100-x2")
    assert hw.node_of(7) == 0 and hw.node_of(8) == 1
    r = hw.route(0, 8)
    assert [lk.name for lk in r] == ["node0.ib0.tx", "node1.ib0.rx"]
    assert [lk.name for lk in hw.route(1, 9)] == ["node0.ib1.tx", "node1.ib1.rx"]
    assert hw.route(0, 15)[0] is r[0], "GPU 0's sends to another node share its NIC"
    # 48 MB over NDR (48 GB/s) + 8 us
    assert hw.transfer_time(0, 8, 48e6) == pytest.approx(_lat(hw, 0, 8) + 1e-3, rel=1e-12)
    # intra-node traffic on node 1 uses node 1's own ports
    assert [lk.name for lk in hw.route(8, 9)] == ["gpu8.nvswitch.tx", "gpu9.nvswitch.rx"]


def test_multinode_v100_gpu_pairs_share_a_nic():
    hw = load_hardware("dgx1-v100-x4")
    assert hw.route(0, 8)[0] is hw.route(1, 16)[0]  # GPUs 0 and 1 sit under NIC 0
    assert hw.route(2, 8)[0].name == "node0.ib1.tx"
    assert hw.route(31, 0)[0].name == "node3.ib3.tx"
    assert hw.route(31, 0)[1].name == "node0.ib0.rx"
    assert hw.transfer_time(0, 8, 12e6) == pytest.approx(_lat(hw, 0, 8) + 1e-3, rel=1e-12)
    # intra-node mesh on node 2 mirrors node 0's
    assert hw.route(16, 19)[0].bandwidth == 48e9
    assert hw.route(19, 20)[0].name == "node2.host"


def test_node_suffix_builds_any_count_like_the_files():
    for name, base, n in (("dgx-h100-x4", "dgx-h100", 4), ("dgx1-v100-x4", "dgx1-v100", 4)):
        file_hw = load_hardware(name)
        built = load_hardware(base).with_nodes(n)
        assert built.name == name and built.num_devices == file_hw.num_devices
        for s, d in itertools.product(range(0, 32, 3), range(0, 32, 5)):
            assert built.route(s, d) == file_hw.route(s, d)
    assert load_hardware("dgx-h100-x16").num_devices == 128
    with pytest.raises(HardwareError, match="no NICs"):
        load_hardware("pcie-4gpu-x2")
    # a node count on a preset that already has nodes is refused, not reinterpreted
    with pytest.raises(HardwareError, match=r"dgx1-v100-x4 is already 4 nodes.*dgx1-v100-x8 for 8 nodes"):
        load_hardware("dgx1-v100-x4-x2")
    with pytest.raises(HardwareError, match="p3.16xlarge-x8 is already 8 nodes"):
        load_hardware("p3.16xlarge-x8-x1")


def test_pipedream_cluster_a_four_pcie_servers_on_10_gbps():
    one = load_hardware("pipedream-cluster-a")
    assert (one.num_devices, one.nodes, one.device.dtype_bytes) == (4, 1, 4)  # fp32, as PipeDream trained
    assert one.device.memory_bytes == 16 * 2**30 and 0.6 * 14e12 <= one.device.flops <= 0.8 * 14e12
    bridge = one.route(0, 1)[0]
    assert all(one.route(s, d) == (bridge,) for s, d in itertools.permutations(range(4), 2)), "one shared PCIe"
    hw = load_hardware("pipedream-cluster-a-x4")
    assert (hw.num_devices, hw.nodes, hw.devices_per_node) == (16, 4, 4)
    assert hw.inter_node.bandwidth == 10e9 / 8 == 1.25e9
    # between servers: the sender's NIC, then the receiver's, shared by all four GPUs of a server
    assert [lk.name for lk in hw.route(3, 4)] == ["node0.eth0.tx", "node1.eth0.rx"]
    assert hw.route(0, 12)[0] is hw.route(3, 4)[0] and hw.route(7, 8)[1] is hw.route(0, 8)[1]
    assert [lk.name for lk in hw.route(12, 15)] == ["node3.pcie"]  # inside server 3: its own bus
    assert (
        hw.inter_node.achieved == 1.25e9 * 0.54
    )  # NCCL over TCP: the efficiency measured at 25 GbE, as the preset says
    assert hw.transfer_time(3, 4, 1.25e7) == pytest.approx(_lat(hw, 3, 4) + 1.25e7 / hw.inter_node.achieved, rel=1e-12)


def test_pipedream_cluster_b_nvlink_servers_on_25_gbps():
    hw = load_hardware("pipedream-cluster-b-x2")
    assert (hw.num_devices, hw.nodes, hw.device.dtype_bytes) == (16, 2, 4)
    assert hw.inter_node.bandwidth == 25e9 / 8
    assert [lk.name for lk in hw.route(7, 8)] == ["node0.eth0.tx", "node1.eth0.rx"]
    assert hw.transfer_time(0, 15, 3.125e7) == pytest.approx(
        _lat(hw, 0, 15) + 3.125e7 / hw.inter_node.achieved, rel=1e-12
    )
    # p3.16xlarge's NVLink hybrid cube mesh is the DGX-1's, on each server
    dgx1 = load_hardware("dgx1-v100")
    for a, b in itertools.permutations(range(8), 2):
        want = dgx1.route(a, b)[0]
        for node in (0, 1):
            got = hw.route(8 * node + a, 8 * node + b)[0]
            assert (got.bandwidth, got.latency) == (want.bandwidth, want.latency)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(REQUIRED - {"ideal"})),
    data=st.data(),
    nbytes=st.integers(min_value=1, max_value=10**10),
)
def test_transfer_time_is_latency_plus_bytes_over_bottleneck(name, data, nbytes):
    hw = _links_only(load_hardware(name))  # the route's own latencies (NCCL's: tests/test_collectives.py)
    src = data.draw(st.integers(0, hw.num_devices - 1))
    dst = data.draw(st.integers(0, hw.num_devices - 1))
    route = hw.route(src, dst)
    assert route == hw.route(src, dst)  # deterministic
    if src == dst:
        assert route == () and hw.transfer_time(src, dst, nbytes) == 0.0
        return
    expect = sum(lk.latency for lk in route) + nbytes / min(lk.bandwidth for lk in route)
    assert hw.transfer_time(src, dst, nbytes) == pytest.approx(expect, rel=1e-12)
    # links with one name are one object
    for lk in route:
        assert isinstance(lk, Link)
        assert all(o is lk for s2 in range(hw.num_devices) for o in hw.route(src, s2) if o.name == lk.name)


def test_ring_allreduce_time_counts_sharing():
    pcie = _links_only(load_hardware("pcie-4gpu"))
    nbytes = 4 * 12_000_000
    # 6 steps; each step moves 4 chunks of 12 MB over the one bridge
    assert pcie.ring_allreduce_time(range(4), nbytes) == pytest.approx(6 * 4 * (1e-5 + 1e-3), rel=1e-9)
    h100 = _links_only(load_hardware("dgx-h100"))
    nbytes = 8 * 4e8
    # disjoint ports: a step lasts one transfer
    assert h100.ring_allreduce_time(range(8), nbytes) == pytest.approx(14 * (5e-6 + 1e-3), rel=1e-9)
    assert h100.ring_allreduce_time([3], nbytes) == 0.0


def test_direct_construction_defaults_to_ideal_interconnect():
    dev = DeviceSpec("toy", flops=1e12, mem_bandwidth=1e11, memory_bytes=1e9)
    hw = Hardware("toy", dev, num_devices=4)
    assert hw.route(0, 3) == () and hw.nodes == 1
    bus = Hardware("bus", dev, 4, intra_node=Interconnect("bus", bandwidth=1e9, latency=0.0, label="pci"))
    assert bus.transfer_time(0, 1, 1e9) == pytest.approx(1.0)
    with pytest.raises(HardwareError, match="NIC"):
        Hardware("two", dev, 8, devices_per_node=4)
    two = Hardware("two", dev, 8, devices_per_node=4, inter_node=NicSpec(count=1, bandwidth=1e9, latency=1e-6))
    assert two.route(0, 4)[0] is two.route(3, 7)[0]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{not json", "malformed JSON at line 1"),
        ("[]", "must be a JSON object"),
        ('{"device": {"flops": 1, "mem_bandwidth": 1, "memory_bytes": 1}}', "missing or empty field 'name'"),
        ('{"name": "x"}', "missing field 'device'"),
        ('{"name": "x", "device": {"mem_bandwidth": 1, "memory_bytes": 1}}', "missing field 'flops'"),
        ('{"name": "x", "device": {"flops": -1, "mem_bandwidth": 1, "memory_bytes": 1}}', "flops must be a positive"),
        (
            '{"name": "x", "device": {"flops": "fast", "mem_bandwidth": 1, "memory_bytes": 1}}',
            "device.flops must be a number",
        ),
        ('{"name": "x", "bogus": 1, "device": {}}', "unknown field 'bogus'"),
        (
            (
                '{"name": "x", "num_devices": 4, "device": {"flops": 1, "mem_bandwidth": 1, "memory_bytes": 1},'
                ' "intra_node": {"kind": "bus", "bandwidth": -5}}'
            ),
            "bandwidth must be a positive",
        ),
        (
            (
                '{"name": "x", "num_devices": 4, "device": {"flops": 1, "mem_bandwidth": 1, "memory_bytes": 1},'
                ' "intra_node": {"kind": "torus", "bandwidth": 5}}'
            ),
            "kind must be one of",
        ),
        (
            (
                '{"name": "x", "num_devices": 4, "device": {"flops": 1, "mem_bandwidth": 1, "memory_bytes": 1},'
                ' "intra_node": {"kind": "mesh", "bandwidth": 5, "host_bandwidth": 1, "mesh": [[0, 9, 1]]}}'
            ),
            "mesh entry",
        ),
        (
            (
                '{"name": "x", "num_devices": 6, "devices_per_node": 4,'
                ' "device": {"flops": 1, "mem_bandwidth": 1, "memory_bytes": 1}}'
            ),
            "do not fill nodes",
        ),
        ('{"name": 5, "device": {"flops": 1, "mem_bandwidth": 1, "memory_bytes": 1}}', "name must be a string, got 5"),
        (
            (
                '{"name": "x", "num_devices": 4, "device": {"flops": 1, "mem_bandwidth": 1, "memory_bytes": 1},'
                ' "intra_node": {"kind": "mesh", "bandwidth": 5, "host_bandwidth": 1, "mesh": [[0, 1, 2], [1, 0, 1]]}}'
            ),
            "lists the pair 0, 1 twice",
        ),
    ],
)
def test_malformed_files_give_one_line_errors(tmp_path, text, fragment):
    path = tmp_path / "hw.json"
    path.write_text(text)
    with pytest.raises(HardwareError) as e:
        load_hardware(str(path))
    msg = str(e.value)
    assert fragment in msg and str(path) in msg and "\n" not in msg


def test_unknown_names_and_paths():
    with pytest.raises(HardwareError) as e:
        load_hardware("tpu-pod")
    assert "pcie-4gpu" in str(e.value) and "dgx-h100" in str(e.value)
    with pytest.raises(HardwareError, match="not found"):
        load_hardware("/nonexistent/dir/hw.json")
    assert issubclass(HardwareError, ValueError)


def test_loading_a_custom_file(tmp_path):
    d = load_hardware("pcie-4gpu").to_json()
    d["name"] = "my-box"
    d["intra_node"]["bandwidth"] = "inf"
    path = tmp_path / "box.json"
    path.write_text(json.dumps(d))
    hw = load_hardware(str(path))
    # infinite bandwidth: the latency alone, one NCCL step over PCIe (8.4 + 5.7 us)
    assert hw.name == "my-box" and hw.transfer_time(0, 1, 10**9) == pytest.approx(14.1e-6)


def test_bad_device_index():
    hw = load_hardware("dgx-h100")
    with pytest.raises(HardwareError, match="no device 8"):
        hw.route(0, 8)
    with pytest.raises(HardwareError, match="no device -1"):
        hw.route(-1, 0)


# --- hostile numbers ------------------------------------------------------------

_DEV = {"flops": 1e12, "mem_bandwidth": 1e11, "memory_bytes": 1e9}


def _with(section: str, key: str, value) -> dict:
    d = {"name": "x", "num_devices": 4, "device": dict(_DEV), "intra_node": {"kind": "bus", "bandwidth": 1e9}}
    d[section][key] = value
    return d


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        # infinitely fast devices made every layer free: a makespan of 0
        (json.dumps(_with("device", "flops", "inf")), "flops must be a positive finite number >= 1"),
        (
            '{"name": "x", "device": {"flops": Infinity, "mem_bandwidth": 1, "memory_bytes": 1}}',
            "flops must be a positive finite number >= 1",
        ),
        (json.dumps(_with("device", "flops", 1e-300)), "flops must be a positive finite number >= 1"),
        (json.dumps(_with("device", "mem_bandwidth", 0.5)), "mem_bandwidth must be a positive number >= 1"),
        (json.dumps(_with("device", "memory_bytes", -1)), "memory_bytes must be a positive number"),
        (json.dumps(_with("device", "flops", True)), "device.flops must be a number"),
        (json.dumps(_with("device", "dtype_bytes", 2.0)), "dtype_bytes must be an integer"),
        (json.dumps(_with("intra_node", "bandwidth", 1e-300)), "bandwidth must be a positive number >= 1"),
        (json.dumps(_with("intra_node", "latency", 1e300)), "latency must be a finite number >= 0 and <= 1e+09"),
        (json.dumps(_with("intra_node", "latency", "inf")), "latency must be a finite number"),
        (json.dumps(_with("device", "flops", 10**400)), "got an integer of 1329 bits"),
        (
            '{"name": "x", "device": {"flops": ' + "9" * 5000 + ', "mem_bandwidth": 1, "memory_bytes": 1}}',
            "unreadable JSON",
        ),
    ],
)
def test_numbers_out_of_range_are_refused_at_load(tmp_path, text, fragment):
    path = tmp_path / "hw.json"
    path.write_text(text)
    with pytest.raises(HardwareError) as e:
        load_hardware(str(path))
    msg = str(e.value)
    assert fragment in msg and str(path) in msg and "\n" not in msg, msg


def test_direct_construction_rejects_booleans_and_unbounded_counts():
    with pytest.raises(HardwareError, match="dtype_bytes"):
        DeviceSpec("d", 1e12, 1e11, 1e9, dtype_bytes=True)
    with pytest.raises(HardwareError, match="count must be a positive integer"):
        NicSpec(count=True)
    with pytest.raises(HardwareError, match="flops must be a positive finite"):
        DeviceSpec("d", 10**400, 1e11, 1e9)  # was an OverflowError in math.isinf
    dev = DeviceSpec("d", 1e12, 1e11, 1e9)
    with pytest.raises(HardwareError, match="lanes between 1 and 1024"):
        Hardware("m", dev, 2, intra_node=Interconnect("mesh", bandwidth=1e9, mesh=((0, 1, 10**400),)))
    # unbounded bandwidth, memory and memory bandwidth stay valid (the ideal preset)
    ideal = load_hardware("ideal")
    assert math.isinf(ideal.device.mem_bandwidth) and math.isinf(ideal.device.memory_bytes)


@pytest.mark.parametrize("name", ["p3.16xlarge", "dgx1-v100", "pipedream-cluster-b"])
def test_cube_mesh_ring_uses_only_nvlink(name):
    """NCCL's rings on the hybrid cube mesh: a Hamiltonian cycle of NVLink
    edges exists (one of double links, in fact), so the chosen ring never
    touches the host path and its all-reduce is the analytic ring time of
    its slowest link (as rings over the links alone price it)."""
    hw = _links_only(load_hardware(name))
    order = hw.ring_order(range(8))
    assert sorted(order) == list(range(8))
    routes = [hw.route(order[i], order[(i + 1) % 8]) for i in range(8)]
    assert all(len(r) == 1 and r[0].name.endswith(".nvlink") for r in routes)
    slowest = min(r[0].bandwidth for r in routes)
    assert slowest == 2 * hw.intra_node.bandwidth  # every edge a double link
    nbytes = 8 * 10**8
    analytic = 2 * 7 / 8 * nbytes / slowest + 2 * 7 * hw.intra_node.latency
    assert hw.ring_allreduce_time(range(8), nbytes) == pytest.approx(analytic, rel=1e-12)
    # device order crosses 3->4 and 7->0, two pairs without NVLink sharing the host path
    assert hw.ring_allreduce_time(range(8), nbytes) < hw.transfer_time(3, 4, nbytes / 8) * 14 / 2


def test_mesh_subgroup_ring_avoids_the_host():
    hw = load_hardware("p3.16xlarge")
    assert hw.ring_order((0, 1, 4, 5)) == (0, 1, 5, 4)  # 1->4 and 5->0 have no NVLink
    assert hw.ring_order((5, 4, 1, 0, 1)) == (0, 1, 5, 4)  # a set: duplicates and order given do not matter
    assert hw.ring_order((0, 1, 2, 3)) == (0, 1, 2, 3)  # every ring has a single link: device order


@pytest.mark.parametrize(
    "name", ["ideal", "pcie-4gpu", "dgx-h100", "dgx-h100-x2", "pipedream-cluster-a-x4", "spectrain-4gpu"]
)
def test_uniform_links_keep_device_order(name):
    """Where every order costs the same, the ring is the device order, so
    results on these machines do not move."""
    hw = load_hardware(name)
    n = hw.num_devices or 16
    assert hw.ring_order(range(n)) == tuple(range(n))
    assert hw.ring_order(range(1, n, 2)) == tuple(range(1, n, 2))


def test_multi_node_ring_enters_each_node_once():
    hw = load_hardware("dgx1-v100-x4")
    order = hw.ring_order(range(32))
    nodes = [hw.node_of(d) for d in order]
    assert nodes == sorted(nodes)  # node-local segments, chained in node order
    crossings = [i for i in range(32) if nodes[i] != nodes[(i + 1) % 32]]
    assert len(crossings) == 4
    # inside a node the segment is a path of NVLink edges
    assert all(hw.route(order[i], order[i + 1])[0].name.endswith(".nvlink") for i in range(31) if i not in crossings)


def test_kernel_overhead_is_read_checked_and_written_only_when_set(tmp_path):
    d = _with("device", "kernel_overhead_s", 5e-6)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(d))
    hw = load_hardware(str(path))
    assert hw.device.kernel_overhead_s == 5e-6 and hw.to_json()["device"]["kernel_overhead_s"] == 5e-6
    assert "kernel_overhead_s" not in load_hardware("pcie-4gpu").to_json()["device"]
    for bad in (-1e-6, "inf", True, 1e300):
        path.write_text(json.dumps(_with("device", "kernel_overhead_s", bad)))
        with pytest.raises(HardwareError, match="kernel_overhead_s"):
            load_hardware(str(path))

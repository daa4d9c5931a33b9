"""Published all-reduce measurements (nccl-tests) and the engine set beside them."""

from __future__ import annotations

import json

import pytest

from pipesim.experiments.bench.comm import against_nccl_tests, engine_allreduce_seconds
from pipesim.experiments.cli import main
from pipesim.sim.hardware import load_hardware
from pipesim.sim.hardware.measured import bus_bandwidth, nccl_tests_curves


def test_every_point_agrees_with_its_own_bus_bandwidth() -> None:
    # the time and busbw columns were copied apart: each must imply the other (nccl-tests' formula)
    curves = nccl_tests_curves()
    assert {c.name for c in curves} >= {"v100-x8", "v100-x4", "v100-x2", "a100-x8", "a100-x2"}
    for curve in curves:
        sizes = [p.nbytes for p in curve.points]
        assert sizes == sorted(sizes) and sizes[0] == 2**20 and sizes[-1] == 2**30, curve.name
        for p in curve.points:
            implied = bus_bandwidth(p.nbytes, p.seconds, curve.gpus) / 1e9
            assert implied == pytest.approx(p.busbw_GBps, rel=0.03), (curve.name, p)


def test_bus_bandwidth_is_nccl_tests_formula() -> None:
    # 1 GiB over 8 ranks in 13.97 ms: algbw 76.9 GB/s, busbw x 14/8 = 134.5 GB/s
    assert bus_bandwidth(2**30, 13.97e-3, 8) / 1e9 == pytest.approx(134.5, abs=0.1)
    assert bus_bandwidth(2**30, 1.0, 2) == pytest.approx(2**30)  # two ranks: busbw = algbw


def test_the_engine_time_is_the_ring_the_hardware_prices() -> None:
    hw = load_hardware("dgx1-v100")
    for ranks, nbytes in ((8, 16 * 2**20), (4, 2**20), (2, 2**30)):
        assert engine_allreduce_seconds(hw, ranks, nbytes) == pytest.approx(
            hw.ring_allreduce_time(range(ranks), nbytes), rel=1e-9
        )


def test_the_comparison_covers_every_curve_with_a_preset(capsys) -> None:
    report = against_nccl_tests()
    by_name = {c["name"]: c for c in report["curves"]}
    for curve in nccl_tests_curves():
        points = by_name[curve.name]["points"]
        assert len(points) == (len(curve.points) if curve.preset else 0)
        for p, measured in zip(points, curve.points):
            assert p["measured_s"] == measured.seconds
            assert p["error"] == pytest.approx(p["predicted_s"] / measured.seconds - 1)
    assert main(["bench", "comm", "--against", "nccl-tests", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["curves"][0]["name"] == "v100-x8"


@pytest.mark.parametrize("flags", [["--all-gather"], ["--backend", "gloo"], ["--world-size", "4"], ["--repeats", "3"]])
def test_against_refuses_options_of_a_local_measurement(capsys, flags) -> None:
    # even given at their defaults: they would be ignored, and an ignored flag misleads
    assert main(["bench", "comm", "--against", "nccl-tests", *flags]) == 2
    assert flags[0] in capsys.readouterr().err

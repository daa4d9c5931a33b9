"""``pipesim profile --gemm-table``: this machine's GEMM throughput by shape,
written in the table format the simulator reads, and read back through a
hardware file's ``gemm_table``."""

from __future__ import annotations

import json

import pytest
import torch

from pipesim.experiments.cli import main
from pipesim.sim.hardware import Hardware, HardwareError, load_hardware
from pipesim.sim.hardware.gemm import gemm_seconds, load_table
from pipesim.validate.gemmprofile import measure_table


def test_a_measured_table_is_a_full_grid_the_simulator_reads(tmp_path) -> None:
    data = measure_table(torch.device("cpu"), "fp32", (1, 2), (32, 64), warmup=1, repeats=2)
    assert data["columns"] == ["b", "m", "n", "k", "flops_per_s"] and len(data["points"]) == 2 * 2**3
    assert all(p[4] > 0 for p in data["points"])
    path = tmp_path / "gemm-table.json"
    path.write_text(json.dumps(data))
    table = load_table(str(path))
    assert table.axes == ((1, 2), (32, 64), (32, 64), (32, 64))
    # a device naming the file prices a measured shape at its measured time
    d = load_hardware("dgx-h100").to_json()
    d["device"]["gemm_table"] = str(path)
    device = Hardware.from_json(d).device
    b, m, n, k, rate = data["points"][5]
    assert gemm_seconds(device, m, n, k, b) == pytest.approx(2 * b * m * n * k / rate, rel=1e-12)
    d["device"]["gemm_table"] = str(tmp_path / "missing.json")
    with pytest.raises(HardwareError, match="gemm_table"):
        Hardware.from_json(d)


def test_the_command_writes_the_table(tmp_path, capsys) -> None:
    args = ["profile", "--gemm-table", "--gemm-sizes", "32,64", "--gemm-batches", "1", "--repeats", "2"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "8 shapes" in out and (tmp_path / "gemm-table.json").is_file()
    assert main(["profile", "--gemm-table", "--gemm-sizes", "0,64", "--out", str(tmp_path)]) == 2
    assert "positive" in capsys.readouterr().err

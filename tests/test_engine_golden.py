"""summary.json stays byte-identical across engine speed work.

Speed-ups of the lowering, dataflow, engine and trackers must not change a
single number. Each case below is a ``pipesim simulate`` command line (every
strategy, contended links, replicated stages, width > 1, recomputation) with
the first 16 hex digits of the SHA-256 of the summary.json it wrote at commit
231693f. A mismatch means the simulated semantics changed: if that was
deliberate (a new cost model, a preset edited), regenerate the digest with
``pipesim simulate ... --summary-only --out DIR && sha256sum DIR/summary.json``
and say why in the commit. The four cases with an all-reduce or an
activation on a real link were regenerated when GPU presets took NCCL's
cost model and DDP's buckets (CHANGELOG, Unreleased).
"""

from __future__ import annotations

import hashlib

import pytest

from pipesim.experiments.cli import main

CASES = [
    ("--strategy gpipe --stages 4 --microbatches 8 --hardware pcie-4gpu", "4a9d6bc7430b7490"),
    ("--strategy 1f1b --stages 4 --microbatches 8 --hardware pcie-4gpu", "c9966e0159d25057"),
    ("--strategy interleaved-1f1b --stages 4 --microbatches 8 --hardware pcie-4gpu", "b50e85da1c028e1a"),
    ("--strategy zb-h1 --stages 4 --microbatches 8 --hardware pcie-4gpu", "8ec3f0601467ed3d"),
    ("--strategy pipedream --stages 4 --microbatches 8 --hardware pcie-4gpu", "5512717363f20bee"),
    ("--strategy pipedream-2bw --stages 4 --microbatches 8 --hardware pcie-4gpu", "7e7e5ccf923bace7"),
    ("--strategy spectrain --stages 4 --microbatches 8 --hardware pcie-4gpu", "398a1d846dd2247d"),
    ("--strategy avgpipe --stages 4 --microbatches 8 --hardware pcie-4gpu", "ae78c7672d8d33f4"),
    ("--strategy data-parallel --stages 4 --microbatches 8 --hardware pcie-4gpu", "64b1bcf2b66fb716"),
    ("--strategy 1f1b --stages 4 --microbatches 8 --hardware pipedream-cluster-a-x4 --model gnmt", "7967dba22a520373"),
    ("--strategy 1f1b --replicas 3,1 --microbatches 8 --hardware pcie-4gpu", "2ec024743a45d48f"),
    ("--strategy pipedream-2bw --replicas 2,2 --microbatches 8 --hardware pcie-4gpu", "26d4c2372c3550ed"),
    (
        "--strategy avgpipe --stages 4 --width 2 --microbatches 8 --hardware dgx1-v100 --iterations 2",
        "56667e952b0e62ff",
    ),
    ("--strategy 1f1b --stages 4 --microbatches 8 --recompute --hardware pcie-4gpu", "536fb931b4e8a728"),
]


@pytest.mark.parametrize(("command", "digest"), CASES, ids=[c.split(" --microbatches")[0] for c, _ in CASES])
def test_summary_bytes_unchanged(tmp_path, capsys, command, digest) -> None:
    assert main(["simulate", *command.split(), "--summary-only", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    got = hashlib.sha256((tmp_path / "summary.json").read_bytes()).hexdigest()[:16]
    assert got == digest, f"summary.json of `pipesim simulate {command}` changed"

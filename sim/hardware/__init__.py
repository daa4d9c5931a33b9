"""Machines: devices, links, topologies and the built-in presets.

Layer 3 of :mod:`pipesim.sim`: it imports only the foundations
(:mod:`~pipesim.sim.errors`, :mod:`~pipesim.sim.files`, :mod:`~pipesim.sim.limits`).

* :mod:`.machines`: :class:`Hardware` (devices, interconnects, links and ring orders),
  the hardware file format and :func:`load_hardware`;
* :mod:`.measured`: published measurements of collectives (``measurements/``:
  nccl-tests all-reduce curves, each with its source) to hold the model against;
* :mod:`.collectives`: NCCL's cost model of an all-reduce and a transfer
  (algorithms, protocols, latency per step, channels), with its constants in
  ``constants/nccl-tuning.json`` and DDP's bucket sizes and the collectives'
  processor usage in ``constants/overlap.json``, each with its source;
* :mod:`.gemm`: the time of one GEMM from its shape (tile and wave
  quantisation over a device's SMs), or from a measured table
  (``measurements/gemm-*.json``);
* ``presets/``: the JSON presets (``pcie-4gpu``, ``dgx1-v100``, ``dgx-h100``, the
  papers' clusters), each with its sources.
"""

from pipesim.sim.hardware.machines import (  # the package's public names, where users import them
    RING_SEARCH_MAX,
    CpuCost,
    DeviceSpec,
    Hardware,
    HardwareError,
    HostCpu,
    Interconnect,
    Link,
    NicSpec,
    load_hardware,
    preset_names,
)

__all__ = [
    "CpuCost",
    "DeviceSpec",
    "Hardware",
    "HardwareError",
    "HostCpu",
    "Interconnect",
    "Link",
    "load_hardware",
    "NicSpec",
    "preset_names",
    "RING_SEARCH_MAX",
]

"""Device presets for the planner: memory, peak FLOP/s and link bandwidths, plus byte-size parsing.

Figures are the vendors' dense (no sparsity) peaks; bandwidths are what a ring all-reduce typically
achieves (bus bandwidth), not the marketing aggregate. They only rank layouts against each other.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Dict, Optional

from bmtrain_cli.errors import UserError

GiB = 1 << 30
GB = 10**9


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "gpu" or "cpu"
    memory_bytes: int
    peak_flops: float  # dense bf16/fp16 FLOP/s
    peak_flops_fp32: float
    intra_node_bw: float  # all-reduce bus bandwidth between devices of one node, bytes/s
    inter_node_bw: float  # per-device bandwidth between nodes, bytes/s
    host_bw: float  # host <-> device copies, bytes/s
    host_update_bw: float = 20 * GB  # host memory bandwidth for an offloaded optimizer update
    gpus_per_node: int = 8
    runtime_reserve_bytes: int = int(1.0 * GiB)  # CUDA context, cuBLAS workspace, NCCL buffers

    def with_memory(self, memory_bytes: int) -> Device:
        return replace(
            self, memory_bytes=int(memory_bytes), name=f"{self.name} ({format_bytes(memory_bytes)})"
        )


def _gpu(
    name: str,
    mem_gib: float,
    bf16_tflops: float,
    fp32_tflops: float,
    nvlink_gbs: float,
    ib_gbs: float,
    pcie_gbs: float,
) -> Device:
    return Device(
        name=name,
        kind="gpu",
        memory_bytes=int(mem_gib * GiB),
        peak_flops=bf16_tflops * 1e12,
        peak_flops_fp32=fp32_tflops * 1e12,
        intra_node_bw=nvlink_gbs * GB,
        inter_node_bw=ib_gbs * GB,
        host_bw=pcie_gbs * GB,
    )


PRESETS: Dict[str, Device] = {
    "A100-40GB": _gpu("A100-40GB", 40, 312, 19.5, 230, 25, 24),
    "A100-80GB": _gpu("A100-80GB", 80, 312, 19.5, 230, 25, 24),
    "A800-80GB": _gpu("A800-80GB", 80, 312, 19.5, 150, 25, 24),
    "H100-80GB": _gpu("H100-80GB", 80, 989, 67, 360, 50, 50),
    "H800-80GB": _gpu("H800-80GB", 80, 989, 67, 180, 50, 50),
    "H200": _gpu("H200", 141, 989, 67, 360, 50, 50),
    "V100-32GB": _gpu("V100-32GB", 32, 125, 15.7, 120, 12.5, 12),
    "L40S": _gpu("L40S", 48, 362, 91.6, 25, 12.5, 25),
    "RTX4090": _gpu("RTX4090", 24, 165, 82.6, 20, 12.5, 25),
}
ALIASES = {
    "A100": "A100-80GB",
    "A100-80G": "A100-80GB",
    "A100-40G": "A100-40GB",
    "H100": "H100-80GB",
    "H800": "H800-80GB",
    "H200-141GB": "H200",
    "V100": "V100-32GB",
    "4090": "RTX4090",
}

_UNITS = {
    "B": 1,
    "K": 1 << 10,
    "KB": 10**3,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 10**6,
    "MIB": 1 << 20,
    "G": GiB,
    "GB": GB,
    "GIB": GiB,
    "T": 1 << 40,
    "TB": 10**12,
    "TIB": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920; '80GB' -> 80e9; '40G' -> 40 GiB; bytes need the unit B. A number without a
    unit is refused: `--gpu_memory 80` meant 80 GiB, not 80 bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if m and not m.group(2):
        raise UserError(
            f"memory size {text!r} has no unit: write {m.group(1)}GiB (or {m.group(1)}GB, {m.group(1)}G)"
        )
    if not m or m.group(2).upper() not in _UNITS:
        raise UserError(f"cannot read a memory size from {text!r} (examples: 80GiB, 40GB, 24G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_bytes(n: float) -> str:
    n = float(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def host_memory_bytes() -> int:
    """Physical memory of this machine (MemTotal), or 0 when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_device(memory_bytes: Optional[int] = None) -> Device:
    """This machine's CPU as a training device (memory = physical RAM)."""
    cores = os.cpu_count() or 1
    return Device(
        name="CPU",
        kind="cpu",
        memory_bytes=int(memory_bytes or host_memory_bytes()),
        peak_flops=cores * 50e9,
        peak_flops_fp32=cores * 50e9,
        intra_node_bw=5 * GB,
        inter_node_bw=1 * GB,
        host_bw=10 * GB,
        gpus_per_node=1,
        runtime_reserve_bytes=0,
    )


def get_device(name: Optional[str] = None, memory: Optional[str] = None) -> Device:
    """A preset by name (case-insensitive; 'cpu' is this machine), optionally with another memory size.
    With only a memory size, an A100-class GPU with that much memory."""
    if name is None:
        if memory is None:
            return cpu_device()
        return PRESETS["A100-80GB"].with_memory(parse_bytes(memory))
    key = name.strip()
    if key.lower() == "cpu":
        dev = cpu_device()
    else:
        upper = {k.upper(): k for k in PRESETS}
        alias = {k.upper(): v for k, v in ALIASES.items()}
        canon = upper.get(key.upper()) or alias.get(key.upper())
        if canon is None:
            raise UserError(f"unknown device {name!r}; presets: {', '.join(PRESETS)}, cpu")
        dev = PRESETS[canon]
    return dev.with_memory(parse_bytes(memory)) if memory is not None else dev


def detect_device() -> Device:
    """The device this process trains on: the current GPU (its name and total memory) or the CPU."""
    import paddle

    from bmtrain_cli.machine import gpu_available

    if gpu_available():
        props = paddle.device.cuda.get_device_properties()
        name = str(getattr(props, "name", "GPU"))
        total = int(getattr(props, "total_memory", 0))
        base = (
            PRESETS["H100-80GB"]
            if "H100" in name or "H800" in name or "H200" in name
            else PRESETS["A100-80GB"]
        )
        return replace(base, name=name, memory_bytes=total or base.memory_bytes)
    return cpu_device()

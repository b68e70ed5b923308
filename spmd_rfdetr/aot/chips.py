"""TPU chip figures for the AOT check, and the topology names it accepts.

Published per-chip figures (Google Cloud TPU docs, https://cloud.google.com/tpu/docs/v5e, .../v6e, .../v4, .../v5p,
.../system-architecture-tpu-vm for v3): peak bf16 FLOP/s, HBM capacity and HBM bandwidth per chip.

``compiler_hbm_bytes`` is the HBM libtpu 0.0.21 says a program may use on one device, read off its own out-of-memory
messages (``Used 22.00G of 15.75G hbm``, or ``would exceed memory (size=33822867456)`` for v6e): the published
capacity less what the runtime reserves. That, not the published figure, is what a compile must fit in.

A device is a chip everywhere except v3, whose two TensorCores are separate devices with 16 GiB of HBM each (libtpu has
no megacore config for v3). v4 is built in megacore mode (one device per chip, as a v4 TPU VM runs); libtpu's default
for v4 is one device per core.

``hbm_only_flag`` is the libtpu flag that turns off the compiler's assignment of buffers to on-chip memory (VMEM):
compiled with it, every access is to HBM and the cost analysis's ``bytes accessed`` is all HBM traffic (an upper
bound on what the shipped program, which keeps some buffers on chip, moves through HBM). v3's compiler assigns none
by default (``""``: its count is already all HBM); libtpu 0.0.21 has no such flag for v4 (``None``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Chip:
    """One TPU generation: per-chip figures and the topology names it accepts (``<name>:<dims>``)."""

    name: str  # topology prefix, e.g. "v5e"
    device_kind: str  # what libtpu's devices report
    peak_bf16_flops: float  # FLOP/s per chip
    hbm_bytes: int  # published, per chip
    hbm_bandwidth: float  # bytes/s per chip
    compiler_hbm_bytes: int  # per device, as libtpu reports it available
    ndims: int  # 2: "2x4", 3: "2x2x1"
    topologies: tuple[str, ...]  # the usual slice shapes (listed in error messages)
    devices_per_chip: int = 1
    chip_config_name: str | None = None
    hbm_only_flag: str | None = None  # libtpu flag: no buffer in on-chip memory ("": none needed; module docstring)

    @property
    def device_flops(self) -> float:
        return self.peak_bf16_flops / self.devices_per_chip

    @property
    def device_bandwidth(self) -> float:
        return self.hbm_bandwidth / self.devices_per_chip

    @property
    def device_hbm_bytes(self) -> int:
        return self.hbm_bytes // self.devices_per_chip


_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
_3D = ("1x1x1", "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8")

CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v5e", "TPU v5 lite", 197e12, 16 * GiB, 819e9, int(15.75 * GiB), 2, _2D,
             hbm_only_flag="--xla_vf_vmem_memory_space_assignment=false"),
        Chip("v6e", "TPU v6 lite", 918e12, 32 * GiB, 1640e9, 33822867456, 2, _2D,
             hbm_only_flag="--xla_gf_vmem_memory_space_assignment=false"),
        Chip("v4", "TPU v4", 275e12, 32 * GiB, 1228e9, int(30.75 * GiB), 3, _3D, chip_config_name="megacore"),
        Chip("v5p", "TPU v5", 459e12, 95 * GiB, 2765e9, int(95.74 * GiB), 3, _3D,
             hbm_only_flag="--xla_vf_vmem_memory_space_assignment=false"),
        # v3-8 (Kaggle, Colab) is "v3:2x2": 4 chips, 8 devices
        Chip("v3", "TPU v3", 123e12, 32 * GiB, 900e9, int(15.48 * GiB), 2, ("1x1", "2x2", "4x4", "4x8", "8x8"),
             devices_per_chip=2, hbm_only_flag=""),
    )
}

#: Cloud accelerator-type names (the suffix counts chips for v5e/v6e, TensorCores for v3/v4/v5p).
ALIASES: dict[str, str] = {
    **{f"v5litepod-{n}": f"v5e:{d}" for n, d in ((1, "1x1"), (4, "2x2"), (8, "2x4"), (16, "4x4"), (32, "4x8"))},
    **{f"v6e-{n}": f"v6e:{d}" for n, d in ((1, "1x1"), (4, "2x2"), (8, "2x4"), (16, "4x4"), (32, "4x8"))},
    **{f"v4-{n}": f"v4:{d}" for n, d in ((8, "2x2x1"), (16, "2x2x2"), (32, "2x2x4"), (64, "2x4x4"))},
    **{f"v5p-{n}": f"v5p:{d}" for n, d in ((8, "2x2x1"), (16, "2x2x2"), (32, "2x2x4"), (64, "2x4x4"))},
    **{f"v3-{n}": f"v3:{d}" for n, d in ((8, "2x2"), (32, "4x4"), (64, "4x8"))},
}


class TopologyError(ValueError):
    """An unknown or malformed topology name."""


def valid_names() -> str:
    """Every listed topology name, on one line."""
    return ", ".join(f"{c.name}:{t}" for c in CHIPS.values() for t in c.topologies)


def parse_topology(name: str) -> tuple[Chip, str, tuple[int, ...]]:
    """``"v5e:2x2"`` (or an alias such as ``"v5litepod-4"``) -> (chip, canonical name, dims).

    Any ``<chip>:<dims>`` with the chip's number of dimensions passes here; libtpu decides whether it exists.
    """
    canonical = ALIASES.get(name.strip().lower(), name.strip())
    m = re.fullmatch(r"(v\d+[a-z]*)[:=_](\d+(?:x\d+)+)", canonical)
    chip = CHIPS.get(m.group(1)) if m else None
    dims = tuple(int(d) for d in m.group(2).split("x")) if m else ()
    if chip is not None and chip.ndims == 2 and len(dims) == 3 and dims[2] == 1:
        dims = dims[:2]
    if chip is None or len(dims) != chip.ndims or min(dims) < 1:
        raise TopologyError(f"unknown TPU topology {name!r}; valid names: {valid_names()}")
    return chip, f"{chip.name}:{'x'.join(map(str, dims))}", dims


def topology_kwargs(name: str) -> dict:
    """Keyword arguments for ``jax.experimental.topologies.get_topology_desc(platform="tpu", **kw)``."""
    chip, canonical, dims = parse_topology(name)
    kw: dict = {"topology_name": canonical}
    if chip.chip_config_name:
        kw["chip_config_name"] = chip.chip_config_name
    if min(dims[:2]) < 2:  # libtpu's default host is 2x2x1 chips: a smaller slice must say it is one smaller host
        kw["chips_per_host_bounds"] = (min(dims[0], 2), min(dims[1], 2), 1)
    return kw


def hbm_only_problem(chip: Chip) -> str | None:
    """Why ``--hbm_only`` cannot compile for ``chip`` (libtpu has no switch for its on-chip memory: v4); ``None``: it
    can."""
    if chip.hbm_only_flag is not None:
        return None
    return (f"--hbm_only: libtpu has no switch for {chip.name}'s on-chip memory; it works for "
            + ", ".join(c.name for c in CHIPS.values() if c.hbm_only_flag is not None))


def hbm_only_label(chip: Chip) -> str:
    """What a report records of an ``--hbm_only`` compile for ``chip``: the libtpu flag, or why none was needed."""
    return chip.hbm_only_flag or f"no flag: {chip.name}'s compiler keeps nothing on chip by default"


def hbm_only_env(topology: str) -> dict[str, str]:
    """Environment for a compile child whose program keeps nothing in on-chip memory (``hbm_only_flag``; empty for v3,
    which needs none). Callers check :func:`hbm_only_problem` first."""
    flag = parse_topology(topology)[0].hbm_only_flag
    return {"LIBTPU_INIT_ARGS": f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {flag}".strip()} if flag else {}


def chip_for_device_kind(device_kind: str) -> Chip | None:
    return next((c for c in CHIPS.values() if c.device_kind == device_kind), None)

"""The device mesh: one logical grid over every XLA device, with named axes.

Two axes, outermost first: ``data`` and ``fsdp`` (e.g. 2 x 4 on 8 devices; neighbouring devices share an ``fsdp``
group). The batch is split over both (``BATCH_AXES``); :func:`spmd_rfdetr.parallelize.parallelize` shards the large
parameters (and their gradients, AdamW state and EMA copy) along ``fsdp`` and replicates them along ``data``. With
``fsdp=1`` (the default) this is plain data parallelism. One axis may be ``-1`` ("all devices left").
"""

from __future__ import annotations

import math

import numpy as np
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
#: Mesh axis names, outermost first. The batch dimension is sharded over ``BATCH_AXES``.
AXES: tuple[str, ...] = (DATA_AXIS, FSDP_AXIS)
BATCH_AXES: tuple[str, ...] = (DATA_AXIS, FSDP_AXIS)


def build_mesh(data: int = -1, fsdp: int = 1) -> xs.Mesh:
    """Build the 2-D ``(data, fsdp)`` SPMD mesh over all ``xr.global_runtime_device_count()`` devices.

    Args:
        data: size of the ``data`` axis; ``-1`` means every device left after ``fsdp``.
        fsdp: size of the ``fsdp`` axis (parameters sharded along it); ``-1`` means every device left after ``data``.

    Raises:
        ValueError: if the axis sizes do not multiply to the device count.
    """
    num_devices = xr.global_runtime_device_count()
    sizes = _resolve_axis_sizes({DATA_AXIS: data, FSDP_AXIS: fsdp}, num_devices)
    shape = tuple(sizes[name] for name in AXES)
    return xs.Mesh(np.arange(num_devices), shape, AXES)


def data_axis_size(mesh: xs.Mesh) -> int:
    """Number of devices along the ``data`` axis (the batch size must be a multiple of it)."""
    return int(mesh.shape()[DATA_AXIS])


def fsdp_axis_size(mesh: xs.Mesh) -> int:
    """Number of devices along the ``fsdp`` axis (1 on a mesh without one)."""
    return int(mesh.shape().get(FSDP_AXIS, 1))


def batch_shard_count(mesh: xs.Mesh) -> int:
    """Number of shards the batch dimension is split into (product of ``BATCH_AXES`` sizes)."""
    return math.prod(int(mesh.shape().get(name, 1)) for name in BATCH_AXES)


def _resolve_axis_sizes(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
    """Replace the (at most one) ``-1`` axis by what is left, and check the product equals ``num_devices``."""
    for name, size in sizes.items():
        if size != -1 and size < 1:
            raise ValueError(f"mesh.{name}={size} is invalid: use a positive axis size, or -1 for all devices left.")
    inferred = [name for name, size in sizes.items() if size == -1]
    if len(inferred) > 1:
        raise ValueError(f"Only one mesh axis may be -1, got {', '.join(f'mesh.{n}=-1' for n in inferred)}.")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    given = ", ".join(f"mesh.{name}={size}" for name, size in sizes.items())
    if num_devices % fixed:
        raise ValueError(
            f"{given} does not divide the {num_devices} XLA devices of this runtime. "
            f"Use mesh sizes whose product is {num_devices} (or -1 for all devices)."
        )
    if inferred:
        return {**sizes, inferred[0]: num_devices // fixed}
    if fixed != num_devices:
        raise ValueError(
            f"{given} uses {fixed} of the {num_devices} XLA devices of this runtime, but every device must be in "
            f"the mesh. Set mesh.{DATA_AXIS}=-1 (or {num_devices}), or change the device count "
            "(e.g. CPU_NUM_DEVICES on the CPU)."
        )
    return dict(sizes)

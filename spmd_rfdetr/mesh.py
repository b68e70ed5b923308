"""The device mesh: one logical grid over every XLA device, with named axes.

Today there is one axis, ``data`` (data parallel: the batch is split along it, parameters are replicated). More axes
(e.g. ``fsdp``) are added by extending ``AXES`` and ``build_mesh``'s arguments; ``_resolve_axis_sizes`` already handles
any number of axes, one of which may be ``-1`` ("all devices left").
"""

from __future__ import annotations

import math

import numpy as np
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

DATA_AXIS = "data"
#: Mesh axis names, outermost first. The batch dimension is sharded over ``BATCH_AXES``.
AXES: tuple[str, ...] = (DATA_AXIS,)
BATCH_AXES: tuple[str, ...] = (DATA_AXIS,)


def build_mesh(data: int = -1) -> xs.Mesh:
    """Build the SPMD mesh over all ``xr.global_runtime_device_count()`` devices.

    Args:
        data: size of the ``data`` axis; ``-1`` means every device.

    Raises:
        ValueError: if the axis sizes do not multiply to the device count.
    """
    num_devices = xr.global_runtime_device_count()
    sizes = _resolve_axis_sizes({DATA_AXIS: data}, num_devices)
    shape = tuple(sizes[name] for name in AXES)
    return xs.Mesh(np.arange(num_devices), shape, AXES)


def data_axis_size(mesh: xs.Mesh) -> int:
    """Number of devices along the ``data`` axis (the batch size must be a multiple of it)."""
    return int(mesh.shape()[DATA_AXIS])


def batch_shard_count(mesh: xs.Mesh) -> int:
    """Number of shards the batch dimension is split into (product of ``BATCH_AXES`` sizes)."""
    return math.prod(int(mesh.shape()[name]) for name in BATCH_AXES)


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

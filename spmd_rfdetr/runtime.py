"""Process set-up shared by every verb (``fit``, ``validate``, ``predict``): the PJRT device, SPMD, precision names."""

from __future__ import annotations

import os

from spmd_rfdetr.config import MeshOptions

#: ``trainer.precision`` -> the Fabric precision plugin's name.
PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed"}


def setup_runtime(mesh: MeshOptions) -> None:
    """Choose the PJRT device (before the XLA runtime starts) and switch the process to SPMD."""
    if mesh.cpu_devices is not None and "PJRT_DEVICE" not in os.environ:
        os.environ["PJRT_DEVICE"] = "CPU"
        os.environ["CPU_NUM_DEVICES"] = str(mesh.cpu_devices)
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()

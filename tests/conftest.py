"""Every test in this process runs on a real 4-device XLA SPMD mesh on the CPU.

SPMD is process-global in torch_xla, so it is switched on once, here, before any XLA tensor exists. Tests that need a
different device count or no SPMD run a subprocess.
"""
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()

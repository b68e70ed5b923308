"""The backend a run is for (the XLA device type, or the chip ``aot`` traces for) and what it cannot run there.

Import-light (no torch_xla): ``aot``'s parent process checks a config before any trace child starts.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from spmd_rfdetr.config.options import TrainerOptions

#: Set by the ``aot`` verb for its trace child: the device type its virtual CPU mesh stands in for.
TRACED_FOR_ENV = "SPMD_RFDETR_TRACED_FOR"


def xla_backend() -> str | None:
    """The XLA device type (``CPU``, ``TPU`` ...) the run is for: ``aot``'s trace child says ``TPU``; else the
    runtime's when torch_xla's runtime is already loaded, else ``None``."""
    if os.environ.get(TRACED_FOR_ENV):
        return os.environ[TRACED_FOR_ENV]
    if "torch_xla.runtime" not in sys.modules:
        return None
    # lazy: only once torch_xla.runtime is loaded (checked above): importing it here would start torch_xla
    import torch_xla.runtime as xr

    return str(xr.device_type())


#: TPU generations whose Mosaic compiler refuses the kernels: libtpu 0.0.21 for v3, "Mosaic failed to compile TPU
#: kernel: Unsupported matmul RHS type on target: 'vector<128x128xbf16>'" (``aot --topology v3:2x2``, 2026-12-07).
FUSED_ATTENTION_UNSUPPORTED = (2, 3)


def fused_attention_chip_problem(generation: int) -> str | None:
    """Why ``trainer.fused_attention`` cannot run on TPU ``v<generation>``; ``None``: it compiles there."""
    if generation not in FUSED_ATTENTION_UNSUPPORTED:
        return None
    return (f"trainer.fused_attention=true: the TPU compiler refuses its Pallas kernels on TPU v{generation} (Mosaic has "
            f"no bf16 matrix product there); set trainer.fused_attention=false on this chip (v5e compiles them)")


def fused_attention_problems(t: TrainerOptions) -> list[str]:
    """``trainer.fused_attention`` lowers its kernels with JAX's Pallas (for a TPU, or interpreted on another backend),
    inside the lazily traced step (dynamo's ``openxla`` trace would leave them out)."""
    if not t.fused_attention:
        return []
    if t.compile_backend == "openxla":
        return ["trainer.fused_attention=true runs in the lazily traced step only: set trainer.compile_backend=torch_xla "
                "(or trainer.fused_attention=false)"]
    if importlib.util.find_spec("jax") is None:
        return ["trainer.fused_attention=true lowers its kernel with JAX's Pallas, which is not installed: "
                "pip install -e \".[tpu,aot]\" (or set trainer.fused_attention=false)"]
    if xla_backend() == "TPU" and not os.environ.get(TRACED_FOR_ENV):  # on a chip (`aot` checks its topology)
        # lazy: torch_xla's runtime is loaded (xla_backend said TPU); its TPU metadata names the generation
        from torch_xla._internal import tpu

        try:
            generation = tpu.version()
        except (OSError, KeyError):  # no metadata to read: the compiler will say
            return []
        return [problem] if (problem := fused_attention_chip_problem(generation)) else []
    return []

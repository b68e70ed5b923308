"""Each side in a fresh interpreter (SPMD is process-global in torch_xla): ``run.py --_child ROLE``, JSON back."""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import ROOT, RUN_SCRIPT

#: XLA CPU codegen without LLVM optimisation: compiles ~2x faster, runs slower. For smoke tests (the counters do not
#: depend on it), never for published numbers.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
#: Set from ``--fast-compile`` by the parent before it starts any child.
FAST_COMPILE = False


def on_cpu_host() -> bool:
    """No TPU visible and PJRT_DEVICE unset (or CPU): the children run on virtual XLA CPU devices."""
    pjrt = os.environ.get("PJRT_DEVICE")
    if pjrt is not None:
        return pjrt.upper() == "CPU"
    return not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*")


def child_env(devices: int | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    if FAST_COMPILE:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FAST_COMPILE_FLAGS).strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("XLA_USE_BF16", None)
    if on_cpu_host():
        env["PJRT_DEVICE"] = "CPU"
        if devices is not None:
            env["CPU_NUM_DEVICES"] = str(devices)
    return env


def run_child(role: str, spec: dict[str, Any], devices: int | None, timeout: float | None,
              label: str | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one side in a fresh interpreter (``env``: variables to add to ours); its logs go to our stderr, its
    result comes back as JSON."""
    label = label or role
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(RUN_SCRIPT), "--_child", role, "--_spec", str(spec_path), "--_out", str(out_path)]
        print(f"[bench] {label}: starting ({'CPU_NUM_DEVICES=' + str(devices) if on_cpu_host() else 'all devices'})",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=child_env(devices, env), stdout=sys.stderr, stderr=sys.stderr, timeout=timeout)
        if proc.returncode != 0 or not out_path.exists():
            raise SystemExit(f"[bench] {label} failed with exit code {proc.returncode} (see the log above)")
        result = json.loads(out_path.read_text())
        result["process_wall_s"] = time.perf_counter() - start
        return result


def default_devices(args: argparse.Namespace) -> int | None:
    """Devices for our side: ``--devices``; on a CPU host 1, the device upstream runs on (virtual XLA CPU devices
    share the same cores, so more of them add partitioning and collectives, not compute); on a TPU every chip."""
    if args.devices is not None:
        return args.devices
    return 1 if on_cpu_host() else None

"""Every test in this process runs on a real 4-device XLA SPMD mesh on the CPU.

SPMD is process-global in torch_xla, so it is switched on once, here, before any XLA tensor exists. Tests that need a
different device count or no SPMD run a subprocess.

What the suite checks: sharding specs; parity of our step with upstream rfdetr's own step (eager CPU: loss and gradients
at step 1, then 4 more steps within :func:`support.models.parity_tolerance`; on the same XLA device with the same
capturable AdamW: 1e-5 at steps 1-2); EMA against upstream's ``AveragedModel``; the TPU compiler's verdict on the tiny
step for v5e:2x2 (``test_aot.py``: it compiles, donates the training state, runs no collective inside a loop, holds
a quarter of the batch per chip, does not grow with the batch, has no float64 input; an over-large program exits 2); torch_xla
counters; the solver against SciPy; the CLI in subprocesses (a fit preempted by a real SIGTERM and a SIGKILL inside a
save, resumed twice; 8 devices with FSDP: the same losses; two processes of one gloo group each replaying the step as
alone); the LR schedule against rfdetr's own; every config error; the data formats and overflow policies; replay against
lazy tracing (``test_replay.py``: same losses, 2 Python traces, one compile, a baked Python value caught); openxla
training against eager and against the replay fit (``test_openxla.py``); prefetch counted by loader events
(``test_fabric.py``); bf16 convolutions and matrix products in the README script's compiled step (``test_readme.py``).
``pytest -m tpu`` on a TPU VM runs the seed's Phase 2a smoke checklist, a preempted fit resumed bit for bit on the
chip and the fused attention kernels against the XLA path (``test_fused_attention.py`` runs them in Pallas's
interpreter here, and has libtpu compile them).

How it fits on 2 cores: the suite's subprocesses (CLI fits, the TPU compiler, upstream's step in a child, the benchmark
and README scripts, two gloo hosts) run as background jobs beside the in-process tests (``jobs.py``: both cores stay
busy, one thread per process, up to 17 GB of memory in use); the tests of the training loop (preemption and resume, step
modes, non-finite steps, 8 devices, openxla, multi-scale buckets, the benchmark report, several hosts) train
:data:`support.models.LOOP_MODEL`, RF-DETR Nano with one DINOv2 block and one decoder layer at 64 px
(``model.backbone_blocks``), while parity with upstream, EMA, accumulation, evaluation and interop use the 4-block
:data:`support.models.TINY_MODEL` at 128 px; XLA's CPU code generator runs without LLVM optimisation
(:data:`support.environment.CPU_XLA_FLAGS`: compiles 2-3x faster, steps 1.8x slower); the fits and the fresh-weights
steps are made once per session and read by several tests.
"""
import glob
import os

from support.environment import COMPILATION_CACHE_SIZE, CPU_XLA_FLAGS

if "PJRT_DEVICE" not in os.environ and not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):
    os.environ["PJRT_DEVICE"] = "CPU"  # no TPU here: a 4-device virtual CPU mesh (a TPU VM keeps its chips)
    os.environ.setdefault("CPU_NUM_DEVICES", "4")

if os.environ.get("PJRT_DEVICE") == "CPU" and CPU_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_XLA_FLAGS}".strip()
    os.environ.setdefault("OMP_NUM_THREADS", "1")


_bound_here = "XLA_COMPILATION_CACHE_SIZE" not in os.environ
os.environ.setdefault("XLA_COMPILATION_CACHE_SIZE", str(COMPILATION_CACHE_SIZE))

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()
(torch.zeros(1, device=torch_xla.device()) + 1).cpu()  # the cache is created (reading the bound) at the first compile
assert torch_xla._XLAC._xla_computation_cache_is_initialized()
if _bound_here:
    del os.environ["XLA_COMPILATION_CACHE_SIZE"]

#: The scheduling of the subprocess jobs (``jobs.py``) and the session's fixtures (``support/fixtures.py``); the
#: helpers tests import live in ``support/``.
pytest_plugins = ["jobs", "support.fixtures"]

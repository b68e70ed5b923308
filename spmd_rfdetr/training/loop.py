"""``fit``: config -> mesh + Fabric -> static sharded batches -> rfdetr model -> one compiled step -> log/checkpoint.

This module stays light (no torch_xla, no rfdetr): the runtime must choose its device before they are imported, so
the run itself (:mod:`spmd_rfdetr.training.run`: start-up in :mod:`~spmd_rfdetr.training.setup`, then the loop) is
imported once :func:`~spmd_rfdetr.xla.runtime.setup_runtime` has run.

Long runs:
- Preemption: SIGTERM (what a spot/preemptible TPU VM gets before it goes) finishes the step in flight, saves a full
  checkpoint (:mod:`spmd_rfdetr.training.checkpoint`) and exits 0 with one line: ``stopped by SIGTERM after step N: saved ...``.
- Resume (``trainer.resume``: ``auto``, the newest complete checkpoint in ``output_dir`` or else a fresh start; or a
  path): the data order continues exactly, since the batch of each step is a pure function of ``trainer.seed`` and
  the step (a seeded permutation per epoch, every sample's augmentations seeded from (seed, epoch, index):
  :mod:`spmd_rfdetr.data.batches`), whatever ``num_workers`` is. ``metrics.jsonl`` drops the records the interrupted run wrote
  after its checkpoint, so every step is there once. Tested: a real SIGTERM, a SIGKILL inside a save, two resumes:
  every step is logged once, the steps after each resume equal the uninterrupted run's (<= 1e-6), and the resumed
  step is replayed after its one compile. Later steps are not compared on the CPU mesh: XLA's CPU client itself
  computes a gradient an ulp apart now and then between two identical runs (no resume involved), and the test fit's
  large learning rate amplifies that chaotically (measured 2e-5 by step 40 in one pair, 4e-4 by step 13 in another).
  ``pytest -m tpu`` checks a resumed fit bit for bit on a chip.
- Non-finite steps (:mod:`spmd_rfdetr.training.step` keeps their weights unchanged): ``trainer.on_nonfinite=stop`` stops at the
  next log or checkpoint point naming the steps (exit status 3; the newest checkpoint has finite weights);
  ``skip_step`` goes on and counts them (``nonfinite_steps``). Tested with a real NaN batch at step 5 of a real
  ``fit`` (fault injection: ``SPMD_RFDETR_TEST_NAN_BATCH=5``).
- ``fit``'s own host time per step is measured against the benchmark's in ``benchmarks/README.md``.
"""

from __future__ import annotations

import time
from pathlib import Path

from spmd_rfdetr.config.options import RunConfig
from spmd_rfdetr.training.stops import NonFiniteLoss, Preemption
from spmd_rfdetr.xla.runtime import setup_runtime

__all__ = ["NonFiniteLoss", "fit"]


def fit(cfg: RunConfig) -> Path:
    """Train to ``trainer.max_steps`` (resuming if asked); returns the path of ``last.pth``, or of the checkpoint
    saved when SIGTERM stopped the run early. SIGTERM before the first step is done exits at once (:class:`Preemption`);
    a non-finite loss with ``trainer.on_nonfinite=stop`` raises :class:`NonFiniteLoss`."""
    hint = f"Start it again (--trainer.resume auto continues from the newest checkpoint in {cfg.trainer.output_dir})."
    with Preemption(hint) as preemption:
        started = time.perf_counter()
        setup_runtime(cfg.mesh, cfg.trainer.compile_cache_dir)
        # lazy: the run imports torch_xla, which must start on the device setup_runtime chose
        from spmd_rfdetr.training.run import train

        return train(cfg, preemption, started)

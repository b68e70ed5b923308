"""The run's checkpoint owner: the resume, the save interval and how many are kept, ``best.pth`` and ``last.pth``.

The formats and the atomic writes are :mod:`spmd_rfdetr.training.checkpoint`'s; this says when and what.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from spmd_rfdetr.training import checkpoint
from spmd_rfdetr.training.build import Trainer
from spmd_rfdetr.training.evaluation import FitEvaluation
from spmd_rfdetr.training.setup import Run

log = logging.getLogger(__name__)


class Saver:
    """Saves ``trainer``'s state every ``checkpointing.every_steps`` (and on request), its weights as files."""

    def __init__(self, run: Run, trainer: Trainer) -> None:
        self.run, self.trainer = run, trainer
        self.every, self.keep = run.cfg.checkpointing.every_steps, run.cfg.checkpointing.keep
        self.weights_kind = "ema" if trainer.ema is not None else "raw"  # what the weight files and evaluations hold

    def resume(self) -> tuple[int, dict[str, Any]]:
        """Load the resume point into the trainer (if any): its step and its ``meta``."""
        resume_from = self.run.resume_from
        if not resume_from:
            return 0, {"step": 0}
        meta = checkpoint.load(resume_from, checkpoint.training_state(self.trainer))
        log.info("resumed from %s at step %d", resume_from, meta["step"])
        return meta["step"], meta

    def due(self, step: int) -> bool:
        """Whether ``step`` is a periodic checkpoint step."""
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, evaluation: FitEvaluation | None, **extra: Any) -> Path:
        """The full training state after ``step`` (with the evaluation's counts), keeping the newest ``keep``."""
        kept = evaluation.state() if evaluation is not None else {"best_map": None}
        state = checkpoint.training_state(self.trainer)
        return checkpoint.save(self.run.out, step, state, {**kept, "config": self.run.resolved, **extra}, self.keep)

    def weights(self, name: str, step: int) -> Path:
        """``<output_dir>/<name>``: the evaluated weights with what rfdetr's ``RFDETR.from_checkpoint`` reads."""
        trainer = self.trainer
        meta = {**self.run.weight_file_entries, "step": step, "weights": self.weights_kind}
        if trainer.ema is not None:
            meta["ema"] = {"decay": trainer.ema.decay, "tau": trainer.ema.tau, "updates": step}
        return checkpoint.save_weights(self.run.out / name, trainer.inference_model, meta)

    def best(self, step: int, evaluation: FitEvaluation) -> None:
        """``best.pth`` after an evaluation that improved the mAP."""
        self.weights("best.pth", step)
        log.info("saved %s (%s %.4f)", self.run.out / "best.pth", evaluation.metric, evaluation.best_map)

    def last(self, step: int) -> Path:
        """``last.pth`` at the end of the run."""
        last = self.weights("last.pth", step)
        log.info("saved %s (%s weights)", last, self.weights_kind)
        return last

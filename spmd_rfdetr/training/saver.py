"""The run's checkpoint owner: the resume, the save interval and how many are kept, ``best.pth`` and ``last.pth``.

The formats and the atomic writes are :mod:`spmd_rfdetr.training.checkpoint`'s; this says when and what.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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
        self.counters: Callable[[], dict[str, Any]] = dict
        """The run's host-side counters each checkpoint keeps (:meth:`StepLog.state`), set by the loop."""

    def resume(self) -> tuple[int, dict[str, Any]]:
        """Load the resume point into the trainer (if any): its step and its ``meta``. Checkpoints and weight files of
        later steps (an abandoned branch) are moved aside first (:func:`checkpoint.set_aside_later`)."""
        resume_from = self.run.resume_from
        meta = checkpoint.read_meta(resume_from) if resume_from else {"step": 0}
        checkpoint.set_aside_later(self.run.out, meta["step"])
        if resume_from:
            meta = checkpoint.load(resume_from, checkpoint.training_state(self.trainer))
            log.info("resumed from %s at step %d", resume_from, meta["step"])
        return meta["step"], meta

    def due(self, step: int) -> bool:
        """Whether ``step`` is a checkpoint step: every ``checkpointing.every_steps``, and the last step (so that a
        relaunch of a finished run finds it finished, and a longer run can continue it)."""
        return (self.every > 0 and step % self.every == 0) or step == self.run.cfg.trainer.max_steps

    def save(self, step: int, evaluation: FitEvaluation | None, **extra: Any) -> Path:
        """The full training state after ``step`` (with the evaluation's and the loop's counts), keeping the newest
        ``keep``."""
        kept = evaluation.state() if evaluation is not None else {"best_map": None}
        state = checkpoint.training_state(self.trainer)
        meta = {**kept, **self.counters(), "config": self.run.resolved, **extra}
        return checkpoint.save(self.run.out, step, state, meta, self.keep)

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


def finished(run: Run) -> tuple[Path, str] | None:
    """``last.pth`` and why the run being resumed has nothing left to do (``None``: it has): its checkpoint is at (or
    past) ``trainer.max_steps`` or early stopping ended it, evaluated at that step when ``fit`` evaluates, and
    ``last.pth`` holds that step. Reads ``meta.json`` and the weight file's step only: nothing is built or compiled."""
    if not run.resume_from:
        return None
    meta, last = checkpoint.read_meta(run.resume_from), run.out / "last.pth"
    step, stopped = meta["step"], bool(meta.get("early_stopped"))
    evaluated = run.eval_set is None or stopped or meta.get("evaluated_step") == step
    if (step >= run.cfg.trainer.max_steps or stopped) and evaluated and checkpoint.weight_file_step(last) == step:
        why = f"stopped early at step {step} (early stopping)" if stopped else f"is finished at step {step}"
        return last, f"this run {why}"
    return None

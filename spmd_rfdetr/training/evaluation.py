"""Evaluation inside ``fit``: every N steps and after the last, the best mAP (``best.pth``), early stopping's counts
(Lightning's ``EarlyStopping`` rule, as rfdetr's ``RFDETREarlyStopping``) and ``eval.base_model``'s second pass on the
raw weights by the same compiled program (:func:`borrowed_weights`). The eval program itself is
:mod:`spmd_rfdetr.eval.evaluator`'s."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch_xla

from spmd_rfdetr.config.options import RunConfig, is_keypoint, is_segmentation
from spmd_rfdetr.eval.evaluator import Evaluator, evaluator_for, refresh_parameter_data, save_result
from spmd_rfdetr.xla.fabric import replicate_parameters


@contextlib.contextmanager
def borrowed_weights(module: torch.nn.Module, source: torch.nn.Module) -> Iterator[None]:
    """For the duration, ``module``'s parameters and buffers hold ``source``'s device data, restored after.

    They stay the same tensor objects, and a compiled eval program takes the weights as inputs: :class:`EvalForward`
    over ``module`` then runs its compiled program on ``source``'s weights, without a new trace or compile (measured on
    the 4-device CPU mesh). ``source`` must have the same tensors in the same order, with the same shapes, dtypes and
    shardings: ``fit``'s EMA copy and the model it averages (a deep copy, made after the parameters were sharded).
    """
    spec = torch_xla._XLAC._get_xla_sharding_spec
    ours, theirs = [*module.parameters(), *module.buffers()], [*source.parameters(), *source.buffers()]
    different = len(ours) != len(theirs) or any(
        a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
        or (a.device.type == "xla" and spec(a) != spec(b)) for a, b in zip(ours, theirs))
    if different:
        raise ValueError("borrowed_weights: the two modules' parameters and buffers differ in number, shape, dtype or "
                         "sharding")
    kept = [t.data for t in ours]
    try:
        for a, b in zip(ours, theirs):
            a.data = b.data
        yield
    finally:
        for a, data in zip(ours, kept):
            a.data = data


@dataclass
class FitEvaluation:
    """Evaluation inside ``fit`` every ``every_steps`` steps and after the last one; tracks the best mAP and early
    stopping's counts (Lightning's ``EarlyStopping`` rule in mode max, as rfdetr's ``RFDETREarlyStopping``)."""

    evaluator: Evaluator
    every_steps: int
    output_dir: Path
    save_detections: bool = False
    best_map: float = -math.inf
    improved: bool = False
    history: list[dict[str, float]] = field(default_factory=list)
    patience: int = 0
    """Early stopping: evaluations without an improvement of ``min_delta`` before :attr:`should_stop` (0: never)."""
    min_delta: float = 0.0
    stopping_best: float = -math.inf  # the mAP early stopping compares with (moves only by more than min_delta)
    stale: int = 0  # evaluations in a row without such an improvement
    raw_model: torch.nn.Module | None = None
    """``eval.base_model`` with EMA: the raw weights, evaluated too, by the EMA's program (:func:`borrowed_weights`)."""
    use_ema: bool = False
    """``eval.early_stopping_use_ema``: with :attr:`raw_model`, watch the EMA's mAP alone, not the better of the two."""
    metric: str = "eval/mAP"
    """The mAP ``best.pth`` and early stopping follow (:func:`best_metric`)."""
    evaluated_step: int = 0
    """The step of the latest evaluation (0: none yet): a checkpoint of a step it differs from was saved before its
    evaluation (a SIGTERM at an evaluation step)."""

    @property
    def watched(self) -> str:
        """What early stopping watches, as the records name it."""
        raw = self.metric.replace("eval/", "eval/raw_")
        return self.metric if self.raw_model is None or self.use_ema else f"max({raw}, {self.metric})"

    def due(self, step: int, max_steps: int) -> bool:
        """Whether ``step`` is an evaluation step."""
        return self.every_steps > 0 and (step % self.every_steps == 0 or step == max_steps)

    @property
    def should_stop(self) -> bool:
        """Early stopping's verdict after the latest evaluation (a NaN mAP never counts as an improvement)."""
        return self.patience > 0 and self.stale >= self.patience

    def update(self, record: dict[str, float]) -> None:
        """The best :attr:`metric` (:attr:`improved`) and early stopping's counts after one evaluation's record."""
        self.improved = record[self.metric] > self.best_map
        if self.improved:
            self.best_map = record[self.metric]
        watched, raw = record[self.metric], self.metric.replace("eval/", "eval/raw_")
        if raw in record and not self.use_ema:
            watched = max(record[raw], watched)  # rfdetr's max(regular, ema)
        if watched - self.min_delta > self.stopping_best:  # Lightning's EarlyStopping rule, mode max
            self.stopping_best, self.stale = watched, 0
        else:
            self.stale += 1

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps so a resumed run continues the same counts."""
        return {"best_map": self.best_map, "stopping_best": self.stopping_best, "stale": self.stale,
                "evaluated_step": self.evaluated_step}

    def restore(self, meta: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state` (keys missing in older checkpoints keep their defaults)."""
        for key in ("best_map", "stopping_best", "stale", "evaluated_step"):
            if meta.get(key) is not None:
                setattr(self, key, meta[key])

    def __call__(self, step: int) -> dict[str, float]:
        """Evaluate now; returns the ``eval/*`` record (``eval/raw_*`` too with :attr:`raw_model`) and sets
        :attr:`improved` (save ``best.pth`` when True)."""
        stem = f"step{step:07d}_"
        record: dict[str, float] = {}
        if not self.history:  # the eval program compiles now: say so, the run would look stalled
            print(f"evaluating at step {step} (the first evaluation compiles the eval program: about a minute)",
                  flush=True)
        if self.raw_model is not None:  # first: the refreshes below then follow both passes
            with borrowed_weights(self.evaluator.forward.model, self.raw_model):
                raw = self.evaluator.run()
            save_result(raw, self.output_dir / "eval", detections=self.save_detections, stem=f"{stem}raw_")
            print(f"eval of the raw weights at step {step}:\n{raw.table()}", flush=True)
            record.update(raw.record("eval/raw_"))
        result = self.evaluator.run()
        refresh_parameter_data(self.evaluator.forward.model)  # training continues on the same graph
        if self.raw_model is not None:
            refresh_parameter_data(self.raw_model)
        save_result(result, self.output_dir / "eval", detections=self.save_detections, stem=stem)
        print(f"eval at step {step}:\n{result.table()}", flush=True)
        record = {**result.record(), **record}
        self.update(record)
        record["eval/best_mAP"] = self.best_map
        self.history.append({"step": step, **record})
        self.evaluated_step = step
        return record


def fit_evaluation(cfg: RunConfig, cfgs: Any, model: torch.nn.Module, fabric: Any, dataset: Any,
                   every_steps: int | None = None, raw_model: torch.nn.Module | None = None) -> FitEvaluation | None:
    """The periodic evaluation ``fit`` runs on ``dataset`` (``eval.split``) every ``every_steps`` steps (default
    ``eval.every_steps``; ``None`` if that is 0) of ``model``, and of ``raw_model`` too if given (``eval.base_model``,
    the model ``model`` averages); build it before the first step."""
    every_steps = cfg.eval.every_steps if every_steps is None else every_steps
    if every_steps <= 0:
        return None
    e = cfg.eval
    evaluator = evaluator_for(cfg, cfgs, model, fabric, dataset)
    if raw_model is not None:
        replicate_parameters(raw_model, evaluator.mesh)  # as the evaluated copy's, before the first training step
    return FitEvaluation(evaluator, every_steps, Path(cfg.trainer.output_dir), e.save_detections,
                         patience=e.early_stopping_patience if e.early_stopping else 0,
                         min_delta=e.early_stopping_min_delta, raw_model=raw_model, use_ema=e.early_stopping_use_ema,
                         metric=best_metric(cfg.model.variant))


def best_metric(variant: str) -> str:
    """The mAP ``best.pth`` and early stopping follow, as rfdetr's ``best_model_metric="map"``: the task's AP@50:95
    (OKS keypoint AP for the keypoint model, mask AP for a seg model, else box AP)."""
    return "eval/kp_mAP" if is_keypoint(variant) else "eval/segm_mAP" if is_segmentation(variant) else "eval/mAP"

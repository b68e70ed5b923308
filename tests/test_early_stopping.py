"""Early stopping inside ``fit`` against rfdetr's own callback, and its counts through a real checkpoint (no compile).

The resumed run that carries these counts across real preemptions is conftest's ``preempted_run`` (tests/
test_resume.py reads it).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from spmd_rfdetr.training.evaluation import FitEvaluation

#: (model.ema, eval.base_model, eval.early_stopping_use_ema)
SETTINGS = [(ema, base, use_ema) for ema in (False, True) for base in (False, True) for use_ema in (False, True)]


@pytest.mark.parametrize(("ema", "base_model", "use_ema"), SETTINGS)
def test_early_stopping_watches_what_rfdetrs_callback_watches(ema: bool, base_model: bool, use_ema: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """rfdetr 1.11's ``RFDETREarlyStopping`` (Lightning's ``EarlyStopping`` on ``max(regular, ema)``, or the EMA's
    alone with ``use_ema``), driven by a real Lightning ``Trainer`` over a series of evaluations, and our
    :class:`FitEvaluation` fed the records ``fit`` writes for the same weights agree after every evaluation: the
    count without improvement, the best value counted and the verdict.

    What rfdetr's callback sees (its ``COCOEvalCallback`` and ``trainer.py``): without EMA ``val/mAP_50_95`` alone,
    the raw weights'; with EMA and ``eval_base_model=False`` (its default) only the EMA weights are evaluated and
    ``val/mAP_50_95`` mirrors ``val/ema_mAP_50_95``; with ``eval_base_model=True`` ``val/mAP_50_95`` is the raw
    weights' and ``val/ema_mAP_50_95`` the EMA's. Ours: ``eval/mAP`` is the EMA's with EMA, ``eval/raw_mAP`` is there
    with ``eval.base_model`` and EMA. The mAPs are multiples of 1/128, exact in Lightning's float32 as in our floats.
    """
    from pytorch_lightning import Trainer
    from pytorch_lightning.trainer.states import TrainerFn

    # an aot test earlier in this process leaves libtpu's TPU_* variables set, with which Lightning's TPU probe
    # (torch_xla's tpu.version()) raises instead of answering "no TPU"
    monkeypatch.delenv("TPU_SKIP_MDS_QUERY", raising=False)
    from rfdetr.training.callbacks.best_model import RFDETREarlyStopping

    patience, min_delta = 3, 2**-6
    theirs = RFDETREarlyStopping(patience=patience, min_delta=min_delta, use_ema=use_ema, verbose=False)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[theirs])
    trainer.state.fn = TrainerFn.FITTING
    ours = FitEvaluation(None, 1, Path("."), patience=patience, min_delta=min_delta,  # type: ignore[arg-type]
                         use_ema=use_ema)

    rng = random.Random(0)
    stops = improvements = 0
    for i in range(60):
        raw, averaged = ((i // 2 + rng.randrange(-8, 4)) / 128 for _ in range(2))  # slow gains, ties, setbacks
        if not ema:
            record, logged = {"eval/mAP": raw}, {"val/mAP_50_95": raw}
        elif not base_model:
            record, logged = {"eval/mAP": averaged}, {"val/mAP_50_95": averaged, "val/ema_mAP_50_95": averaged}
        else:
            record, logged = ({"eval/mAP": averaged, "eval/raw_mAP": raw},
                              {"val/mAP_50_95": raw, "val/ema_mAP_50_95": averaged})
        for key in ("val/mAP_50_95", "val/ema_mAP_50_95"):
            trainer.callback_metrics.pop(key, None)
        trainer.callback_metrics.update({key: torch.tensor(value) for key, value in logged.items()})
        trainer.should_stop = False
        theirs.on_validation_end(trainer, None)  # type: ignore[arg-type]
        ours.update(record)
        assert (ours.stale, ours.stopping_best, ours.should_stop) == (
            theirs.wait_count, float(theirs.best_score), trainer.should_stop), (i, record)
        stops += ours.should_stop
        improvements += ours.stale == 0
    assert stops and improvements > 3, (stops, improvements)  # the series exercised both outcomes


def test_early_stopping_counts_survive_a_checkpoint(tmp_path: Path) -> None:
    """The state ``fit`` saves (best mAP, early stopping's best and count) goes through a real training-state
    checkpoint (``meta.json``) and back into a fresh :class:`FitEvaluation` unchanged, before any evaluation (-inf) as
    after some; the step comes back as written."""
    from spmd_rfdetr.training import checkpoint

    state = {"model.w": torch.arange(6.0)}
    for step, records in ((1, []), (2, [0.25, 0.5, 0.5, 0.25])):
        before = FitEvaluation(None, 1, tmp_path, patience=10, min_delta=0.001)  # type: ignore[arg-type]
        for value in records:
            before.update({"eval/mAP": value})
        saved = checkpoint.save(tmp_path, step, state, {**before.state(), "config": {}}, keep=0)
        meta = checkpoint.load(saved, {"model.w": torch.zeros(6)})
        after = FitEvaluation(None, 1, tmp_path, patience=10, min_delta=0.001)  # type: ignore[arg-type]
        after.restore(meta)
        assert meta["step"] == step
        assert (after.best_map, after.stopping_best, after.stale) == (before.best_map, before.stopping_best,
                                                                      before.stale), meta
    assert (after.best_map, after.stale) == (0.5, 2) and math.isinf(FitEvaluation.best_map)


def test_best_and_early_stopping_follow_the_tasks_map_as_rfdetrs_best_model_metric() -> None:
    """rfdetr's ``best_model_metric="map"`` is the task's AP: a seg model's mask AP, the keypoint model's OKS AP."""
    from spmd_rfdetr.training.evaluation import best_metric

    assert [best_metric(v) for v in ("nano", "seg-nano", "keypoint-preview")] == [
        "eval/mAP", "eval/segm_mAP", "eval/kp_mAP"]
    ours = FitEvaluation(None, 1, Path("."), patience=2, metric="eval/kp_mAP")  # type: ignore[arg-type]
    for box, keypoints in ((0.5, 0.1), (0.6, 0.05), (0.7, 0.02)):  # boxes improve, keypoints do not
        ours.update({"eval/mAP": box, "eval/kp_mAP": keypoints})
    assert ours.best_map == 0.1 and not ours.improved and ours.should_stop

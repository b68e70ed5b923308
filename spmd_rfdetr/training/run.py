"""One training run after the runtime started: start-up, then the loop, which asks small owners "is it time?" and
tells them "do it" (:class:`~spmd_rfdetr.training.saver.Saver` the checkpoints, :class:`~spmd_rfdetr.training.steplog.
StepLog` the records and the non-finite stop, :class:`~spmd_rfdetr.training.evaluation.FitEvaluation` evaluation and
early stopping, :class:`~spmd_rfdetr.training.stops.Preemption` SIGTERM)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from spmd_rfdetr.data.batches import HOST_RNG
from spmd_rfdetr.training import setup
from spmd_rfdetr.training.build import build_trainer
from spmd_rfdetr.training.evaluation import FitEvaluation
from spmd_rfdetr.training.metrics import xla_counters
from spmd_rfdetr.training.saver import Saver, finished
from spmd_rfdetr.training.steplog import StepLog
from spmd_rfdetr.training.stops import Preemption
from spmd_rfdetr.xla import hosts

log = logging.getLogger(__name__)


def train(cfg: Any, preemption: Preemption, started: float) -> Path:
    """Train ``cfg`` to ``trainer.max_steps``; returns ``last.pth``, or the checkpoint SIGTERM saved."""
    run = setup.prepare(cfg)
    t = cfg.trainer
    done = finished(run)
    if done is not None:  # a relaunch of a finished run: nothing is built, nothing compiles
        last, why = done
        log.info("%s: %s; nothing left to train (XLA compiled %d graph(s) in this process; %s holds its weights)",
                 run.resume_from, why, xla_counters()["xla_compiles"], last)
        return last
    trainer = build_trainer(run.fabric, run.build_cfgs, cfg.optim, t, ema=cfg.model, mesh=cfg.mesh)
    saver = Saver(run, trainer)
    start, meta = saver.resume()
    steplog = StepLog(run, trainer.step, preemption, start, started, meta)
    saver.counters = steplog.state
    evaluation = setup.evaluation(run, trainer, meta)  # None when off
    if start >= t.max_steps or meta.get("early_stopped"):
        return _finish(run, start, meta, saver, evaluation, steplog)
    data = setup.train_data(run, trainer.step, start)
    log.info(_compile_notice(cfg, start))
    steplog.open(data)
    last_step = t.max_steps
    for step in range(start + 1, t.max_steps + 1):
        steplog.begin()
        stats = trainer.step(next(data))
        preemption.inject(step)
        stop = hosts.any_host(preemption.requested)  # a SIGTERM on one host stops them all at this step
        # a pending stop saves at once: the notice (~30 s on a spot VM) is shorter than an evaluation
        eval_now = not stop and evaluation is not None and evaluation.due(step, t.max_steps)
        if eval_now and trainer.step.check_pending and step < t.max_steps:  # e.g. a resumed run's first step
            data.check_ahead(trainer.step)
        save_now = stop or saver.due(step)
        if not steplog.due(step, evaluates=eval_now, saves=save_now):
            continue
        record = steplog.record(step, stats)
        if eval_now and _evaluate(step, record, evaluation, saver):
            steplog.write(record)  # early stopping: the state above is the run's last checkpoint
            last_step = step
            break
        saved = saver.save(step, evaluation) if save_now else None
        steplog.write(record, wait=eval_now or save_now)
        if stop:
            steplog.close()
            return preemption.stopped(step, saved)
    steplog.close()
    return saver.last(last_step)


def _finish(run: Any, start: int, meta: dict[str, Any], saver: Saver, evaluation: FitEvaluation | None,
            steplog: StepLog) -> Path:
    """A resumed run with no step left (a SIGTERM at its last step, early stopping, or ``trainer.max_steps`` now
    below the checkpoint's step): the final evaluation if the checkpoint was saved before it, then ``last.pth`` with
    the checkpoint's weights and step. No training step is built or compiled."""
    t = run.cfg.trainer
    if start > t.max_steps:
        log.warning("the checkpoint %s is at step %d, past trainer.max_steps=%d: nothing to train; last.pth holds "
                    "step %d's weights", run.resume_from, start, t.max_steps, start)
    if evaluation is not None and not meta.get("early_stopped") and evaluation.evaluated_step != start:
        log.info("step %d was saved before its evaluation (a SIGTERM at the last step): evaluating it now", start)
        record: dict[str, Any] = {}
        _evaluate(start, record, evaluation, saver)
        steplog.amend(start, record)
        saver.save(start, evaluation)  # the checkpoint now says it was evaluated: a relaunch finds the run finished
    steplog.close()
    log.info("%s: nothing left to train after step %d", run.resume_from, start)
    return saver.last(start)


#: What the first compile of the training step takes, by device type: what ``fit`` tells the user before it starts.
COMPILE_TIME = {
    "TPU": "a few minutes on a TPU VM (libtpu took 3-10 min for the recipes' steps on 2 CPU cores: "
           "benchmarks/README.md; a TPU host has more), once: a restarted run loads it from trainer.compile_cache_dir",
    "CPU": "1-4 min for a small RF-DETR on 2 cores (XLA's CPU compiler)",
}


def _compile_notice(cfg: Any, start: int) -> str:
    """One line before step 1: what compiles now and roughly how long it takes (the first line after it is step 1's
    record)."""
    import torch_xla.runtime as xr  # lazy: torch_xla started long before (setup_runtime), as the rest of the run

    device = str(xr.device_type())
    m, d = cfg.model, cfg.data
    what = (f"RF-DETR {m.variant}, {m.resolution or 'default'} px, {d.global_batch_size} images a step over "
            f"{xr.global_runtime_device_count()} {device} device(s), {cfg.trainer.precision}")
    return (f"compiling the training step ({what}) before step {start + 1}: "
            f"{COMPILE_TIME.get(device, 'minutes')}; the step's line follows")


def _evaluate(step: int, record: dict[str, Any], evaluation: FitEvaluation, saver: Saver) -> bool:
    """Evaluate into ``record``; ``best.pth`` if the mAP improved. True: early stopping ends the run here (saved).
    The train loader's prefetch thread reads no sample meanwhile (:data:`~spmd_rfdetr.data.batches.HOST_RNG`)."""
    with HOST_RNG:
        record.update(evaluation(step), evaluated_weights=saver.weights_kind)
    if evaluation.improved:
        saver.best(step, evaluation)
    if not evaluation.should_stop:
        return False
    log.info("early stopping at step %d: %s has not improved by %g for %d evaluations (best %.4f)", step,
             evaluation.watched, evaluation.min_delta, evaluation.stale, evaluation.stopping_best)
    record["early_stopped"] = True
    saver.save(step, evaluation, early_stopped=True)  # a relaunch with --trainer.resume auto ends here too
    return True

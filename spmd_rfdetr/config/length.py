"""The run's length in steps: rfdetr's units (epochs, warm-up epochs, evaluation every N epochs) converted once the
train split's size is known, and the schedules that cannot do what they say refused (or warned about) before
anything compiles."""

from __future__ import annotations

import logging

from spmd_rfdetr.config.options import ConfigError, RunConfig, TrainerOptions

log = logging.getLogger(__name__)

#: A warm-up longer than this share of the run leaves little of the run at (or near) the peak LR: a warning.
WARMUP_SHARE_WARNED = 0.5
#: An evaluation of the eval split costs about this share of a training pass over as many images (a forward only).
EVAL_COST_PER_IMAGE = 1 / 3
#: Evaluations estimated above this share of the run's image passes: a warning with the setting to change.
EVAL_SHARE_WARNED = 0.25


def evaluates_in_fit(cfg: RunConfig) -> bool:
    """Whether ``fit`` evaluates (``eval.every_steps`` > 0 or ``eval.every_epochs`` set)."""
    return cfg.eval.every_steps > 0 or cfg.eval.every_epochs is not None


def steps_per_epoch(cfg: RunConfig, train_images: int) -> int:
    """Optimizer steps per pass over ``train_images`` usable train images, as rfdetr counts an epoch (the last partial
    batch dropped): what ``trainer.epochs`` and ``eval.every_epochs`` are converted with."""
    return train_images // cfg.data.global_batch_size


def eval_every_steps(cfg: RunConfig, train_images: int) -> int:
    """``fit``'s evaluation interval in steps: ``eval.every_steps``, or ``eval.every_epochs`` converted (at least 1)."""
    if cfg.eval.every_epochs is None:
        return cfg.eval.every_steps
    return max(1, round(cfg.eval.every_epochs * steps_per_epoch(cfg, train_images)))


def size_in_steps(cfg: RunConfig, train_images: int) -> None:
    """Convert rfdetr's units to steps (``trainer.max_steps``, ``optim.warmup_steps``) for ``train_images`` usable
    train images; raise :class:`ConfigError` when an epoch has no step, and warn when ``trainer.max_steps`` is
    overridden by ``trainer.epochs``, when the warm-up covers most of the run (or all of it) or a step schedule never
    drops."""
    t, o, d = cfg.trainer, cfg.optim, cfg.data
    per_epoch = steps_per_epoch(cfg, train_images)
    in_epochs = [name for name, value in (("trainer.epochs", t.epochs), ("optim.warmup_epochs", o.warmup_epochs),
                                          ("eval.every_epochs", cfg.eval.every_epochs)) if value is not None]
    if in_epochs and per_epoch == 0:
        raise ConfigError(
            f"{', '.join(in_epochs)} count(s) in epochs, but the {train_images} usable train images of "
            f"{d.dataset_dir} are fewer than one global batch of {d.global_batch_size}: an epoch has no step. Lower "
            "data.per_device_batch_size (or data.global_batch_size), use fewer devices (mesh.data), or count in "
            "steps (trainer.max_steps, optim.warmup_steps, eval.every_steps)")
    if t.epochs is not None:
        if t.max_steps != TrainerOptions.max_steps:  # e.g. --trainer.max_steps on a recipe that counts in epochs
            log.warning("trainer.max_steps=%d is not used: trainer.epochs=%g decides the run's length (add "
                        "--trainer.epochs null to count in steps)", t.max_steps, t.epochs)
        t.max_steps = max(1, round(t.epochs * per_epoch))
        log.info("trainer.epochs=%g: %d steps of %d images over %d train images (%d steps an epoch)", t.epochs,
                 t.max_steps, d.global_batch_size, train_images, per_epoch)
    if o.warmup_epochs is not None:  # rfdetr's warmup unit
        o.warmup_steps = round(o.warmup_epochs * per_epoch)
        log.info("optim.warmup_epochs=%g: %d warmup steps", o.warmup_epochs, o.warmup_steps)
    warmup = f"optim.warmup_steps={o.warmup_steps}" if o.warmup_epochs is None else \
        f"optim.warmup_epochs={o.warmup_epochs:g} ({o.warmup_steps} steps)"
    if o.warmup_steps >= t.max_steps:
        log.warning("%s covers the whole run of %d steps: the LR never reaches optim.lr=%g. Train longer "
                    "(trainer.epochs) or shorten the warm-up", warmup, t.max_steps, o.lr)
    elif o.warmup_steps > WARMUP_SHARE_WARNED * t.max_steps:
        log.warning("%s covers %.0f%% of the run's %d steps: most of the run trains below optim.lr=%g. Train longer "
                    "(trainer.epochs) or shorten the warm-up", warmup, 100 * o.warmup_steps / t.max_steps,
                    t.max_steps, o.lr)
    if o.schedule == "step" and not 0 < o.lr_drop_step < t.max_steps:
        log.warning("optim.schedule=step with optim.lr_drop_step=%d: the LR never drops in this run of %d steps "
                    "(the step schedule is then constant)", o.lr_drop_step, t.max_steps)


def log_eval_share(cfg: RunConfig, train_images: int, eval_images: int) -> None:
    """Say how often ``fit`` evaluates and roughly what share of the run that is; warn when it is large."""
    every = eval_every_steps(cfg, train_images)
    if cfg.eval.every_epochs is not None:
        log.info("eval.every_epochs=%g: an evaluation every %d steps (%d steps per epoch)", cfg.eval.every_epochs,
                 every, steps_per_epoch(cfg, train_images))
    evaluations = cfg.trainer.max_steps // every + (cfg.trainer.max_steps % every != 0)
    passes = evaluations * eval_images * EVAL_COST_PER_IMAGE
    share = passes / (passes + cfg.trainer.max_steps * cfg.data.global_batch_size)
    log.info("evaluation: %d %s images every %d steps and at the end (%d evaluations, about %.0f%% of the run's "
             "device time)", eval_images, cfg.eval.split, every, evaluations, 100 * share)
    if share > EVAL_SHARE_WARNED:
        log.warning("evaluation takes about %.0f%% of this run: evaluate less often (eval.every_epochs or "
                    "eval.every_steps) or on a smaller eval split", 100 * share)

"""One call to train, in rfdetr's words: ``spmd_rfdetr.train(variant="nano", dataset_dir=..., epochs=...)``.

The same path as ``python -m spmd_rfdetr fit``: the arguments become that command's options (rfdetr's names mapped to
ours, :data:`UPSTREAM_NAMES`), parsed and checked by the CLI's own parser, then ``fit`` runs in this process. Options
without an rfdetr name go in ``options`` with the CLI's dotted names (``{"trainer.precision": "bf16"}``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spmd_rfdetr import quiet
from spmd_rfdetr.config.options import ConfigError

#: rfdetr's ``train(...)`` argument -> our option.
UPSTREAM_NAMES = {
    "dataset_dir": "data.dataset_dir",
    "batch_size": "data.per_device_batch_size",  # rfdetr's is per device (per GPU) too
    "lr": "optim.lr",
    "lr_encoder": "optim.lr_encoder",
    "weight_decay": "optim.weight_decay",
    "output_dir": "trainer.output_dir",
    "resolution": "model.resolution",
    "num_classes": "model.num_classes",
    "pretrain_weights": "model.pretrain_weights",
    "use_ema": "model.ema",
    "ema_decay": "model.ema_decay",
    "num_workers": "data.num_workers",
    "warmup_epochs": "optim.warmup_epochs",  # resolved to steps once the train split's size is known, as epochs
    "grad_accum_steps": "optim.accumulate",  # rfdetr's batch_size is per micro-batch: see _per_step_batch
    "seed": "trainer.seed",
    "resume": "trainer.resume",
    "early_stopping": "eval.early_stopping",
    "early_stopping_patience": "eval.early_stopping_patience",
    "early_stopping_min_delta": "eval.early_stopping_min_delta",
    "early_stopping_use_ema": "eval.early_stopping_use_ema",
    "eval_interval": "eval.every_epochs",  # both count in epochs (converted to steps at the start)
    "eval_max_dets": "eval.max_dets",
    "eval_base_model": "eval.base_model",
    "ema_tau": "model.ema_tau",
    "lr_vit_layer_decay": "optim.lr_vit_layer_decay",
    "lr_component_decay": "optim.lr_component_decay",
    "clip_max_norm": "optim.clip_max_norm",
    "lr_scheduler": "optim.schedule",  # by name: cosine, step
    "dataset_file": "data.dataset_format",
    "multi_scale": "data.multi_scale",  # see UPSTREAM_VALUES
    "amp_dtype": "trainer.precision",  # see UPSTREAM_VALUES
    "progress_bar": "trainer.progress_bar",  # see UPSTREAM_VALUES
    "project": "trainer.wandb_project",  # with wandb=True (UPSTREAM_LOGGERS)
    "run": "trainer.wandb_run",
}

#: rfdetr's values of the names above whose values differ from ours: rfdetr's value -> ours (any other is refused).
UPSTREAM_VALUES: dict[str, dict[Any, Any]] = {
    "multi_scale": {"off": False, "per-batch": True, False: False, True: True},  # rfdetr's MultiScale (a str enum)
    "amp_dtype": {"auto": "bf16", "bf16": "bf16", None: "fp32"},  # rfdetr's auto is bf16 on TPU; None: no autocast
    "progress_bar": {None: None, "tqdm": True, "rich": True, True: True, False: False},
}

#: rfdetr's logger switches -> our ``trainer.loggers`` entry and rfdetr's default. Given either, ``trainer.loggers``
#: becomes the loggers they switch on, with rfdetr's defaults for the other (``wandb=True`` alone: tensorboard and
#: wandb); given neither, the config's list stands.
UPSTREAM_LOGGERS = {"tensorboard": ("tensorboard", True), "wandb": ("wandb", False)}

#: rfdetr's ``train(...)`` arguments not taken here -> what to use instead (all named in one ConfigError).
UPSTREAM_REFUSED = {
    "checkpoint_interval": "rfdetr counts it in epochs; full training-state checkpoints here count optimizer steps: "
                           "options={'checkpointing.every_steps': N} (steps per epoch: usable train images // global "
                           "batch, which fit logs with epochs=...; the weights are last.pth, and best.pth by eval mAP)",
    "lr_drop": "rfdetr counts it in epochs: options={'optim.schedule': 'step', 'optim.lr_drop_step': lr_drop x steps "
               "per epoch}",
    "lr_scheduler_kwargs": "options={'optim.lr_drop_step': N} for lr_scheduler='step', "
                           "{'optim.min_lr_factor': f} for 'cosine'",
    "class_names": "the class names are the dataset's categories (COCO annotations, YOLO data.yaml): name them there",
    "eval_batch_size": "rfdetr's is per device: options={'eval.global_batch_size': eval_batch_size x devices}",
    "devices": "one process drives every device of its host as one SPMD mesh: options={'mesh.data': N, "
               "'mesh.fsdp': M}; several hosts: start fit on every VM",
    "num_nodes": "several hosts: start fit on every VM, each drives its own devices (one SPMD mesh over all)",
    "accelerator": "the device is torch_xla's (PJRT_DEVICE; options={'mesh.cpu_devices': N} for a CPU mesh)",
    "strategy": "always SPMD over the mesh: options={'mesh.data': N, 'mesh.fsdp': M}",
    "mlflow": "not a logger here: trainer.loggers takes tensorboard, csv, wandb (tensorboard=True, wandb=True, "
              "options={'trainer.loggers': [...]})",
    "clearml": "not a logger here: trainer.loggers takes tensorboard, csv, wandb (tensorboard=True, wandb=True, "
               "options={'trainer.loggers': [...]})",
    "run_test": "evaluate the test split after fit: python -m spmd_rfdetr validate --eval.split test (or "
                "options={'eval.split': 'test'} to evaluate it during fit)",
    "fp16_eval": "evaluation runs in trainer.precision (amp_dtype: bf16, or None for fp32); TPUs have no fp16",
    "optimizer": "AdamW always (rfdetr's default), with rfdetr's parameter groups: options={'optim.*': ...}",
    "optimizer_kwargs": "options={'optim.weight_decay': ..., 'optim.lr': ...}",
    "drop_path": "not supported: rfdetr's default 0.0 is what trains",
    "aug_config": "not configurable here: rfdetr's default augmentations train",
}


@dataclass
class TrainResult:
    """What :func:`train` made: the weight file and the last record of ``metrics.jsonl`` (eval metrics included when
    the run evaluated at its last step)."""

    weights: Path
    metrics: dict[str, Any] = field(default_factory=dict)


def train(variant: str | None = None, *, config: str | None = None, epochs: float | None = None,
          max_steps: int | None = None, options: dict[str, Any] | None = None, verbose: bool = False,
          **upstream: Any) -> TrainResult:
    """Train RF-DETR ``variant`` on the device mesh of this process, as ``fit`` does; returns a :class:`TrainResult`.

    Args:
        variant: ``nano``, ``small``, ``medium``, ``large``, ``base`` or a ``seg-*`` variant (rfdetr's ``RFDETRNano``
            ...); ``None``: the config's (a recipe's variant stands), else ``nano``.
        config: a YAML recipe (``configs/v5e.yaml`` ...) the other arguments override.
        epochs: passes over the train split (``trainer.epochs``); or
        max_steps: optimizer steps (``trainer.max_steps``, and ``trainer.epochs`` unset); neither: the config's.
        options: any other option by its CLI name, e.g. ``{"eval.every_steps": 100, "mesh.cpu_devices": 4}``.
        verbose: show the XLA, torch and rfdetr warnings left out by default (the CLI's ``--verbose``,
            :mod:`spmd_rfdetr.quiet`).
        **upstream: rfdetr's argument names (:data:`UPSTREAM_NAMES`, :data:`UPSTREAM_LOGGERS`), e.g.
            ``dataset_dir``, ``batch_size``, ``lr``, ``eval_interval``, ``wandb=True, project=..., run=...``; its names
            with no counterpart here (:data:`UPSTREAM_REFUSED`, e.g. ``checkpoint_interval``) raise one ConfigError
            naming what to use instead;
            ``pretrain_weights`` as the CLI's (default ``"auto"``: the variant's published weights, as rfdetr's
            ``RFDETRNano()`` fine-tunes; ``None``: from scratch). ``grad_accum_steps=k`` with ``batch_size=b`` is
            rfdetr's ``b`` images per device per micro-batch, ``k`` micro-batches per optimizer step (our
            ``data.per_device_batch_size = b * k``, ``optim.accumulate = k``; ours normalises the losses by the whole
            step's box count where rfdetr normalises each micro-batch by its own).

    Raises ``ConfigError``/``DataError``/``FileNotFoundError`` with the CLI's messages (before anything compiles).
    """
    quiet.configure(verbose)  # before torch_xla and rfdetr are imported, as the CLI does
    # lazy: quiet.configure runs first: the CLI's imports (torch, later torch_xla and rfdetr) come after it
    from spmd_rfdetr.cli import LOG_FORMAT, run_config

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # the CLI's log lines (a no-op if logging is set up)
    # lazy: after quiet.configure, like the CLI import above (xla.hosts imports torch)
    from spmd_rfdetr.xla.hosts import leave_hosts
    from spmd_rfdetr.training.loop import fit

    cfg = run_config(fit_arguments(variant, config=config, epochs=epochs, max_steps=max_steps, options=options,
                                   **upstream))
    weights = fit(cfg)
    leave_hosts()  # several hosts: leave the gloo group together, as the CLI does (gloo may abort at exit otherwise)
    records = Path(cfg.trainer.output_dir) / "metrics.jsonl"
    lines = records.read_text().splitlines() if records.exists() else []
    return TrainResult(Path(weights), json.loads(lines[-1]) if lines else {})


def fit_arguments(variant: str | None = None, *, config: str | None = None, epochs: float | None = None,
                  max_steps: int | None = None, options: dict[str, Any] | None = None, **upstream: Any) -> list[str]:
    """:func:`train`'s arguments as ``fit``'s command line (``--config`` first: the options after it override it)."""
    problems = [f"rfdetr's {name} is not taken here: {UPSTREAM_REFUSED[name]}" for name in upstream
                if name in UPSTREAM_REFUSED]
    unknown = sorted(set(upstream) - set(UPSTREAM_NAMES) - set(UPSTREAM_LOGGERS) - set(UPSTREAM_REFUSED))
    if unknown:
        problems.append(f"unknown argument(s) {', '.join(unknown)}; rfdetr's names accepted here: "
                        f"{', '.join([*UPSTREAM_NAMES, *UPSTREAM_LOGGERS])}; any other option goes in "
                        "options={'section.field': value}")
    problems += [f"{name}={upstream[name]!r} is not taken here: one of {', '.join(map(repr, table))}"
                 for name, table in UPSTREAM_VALUES.items() if name in upstream and not _known(upstream[name], table)]
    if epochs is not None and max_steps is not None:
        problems.append("give epochs or max_steps, not both")
    if problems:
        raise ConfigError("train(): " + problems[0] if len(problems) == 1 else
                          "train(): several arguments are not taken:\n  - " + "\n  - ".join(problems))
    mapped = {k: UPSTREAM_VALUES[k][v] if k in UPSTREAM_VALUES else v for k, v in _per_step_batch(upstream).items()
              if k in UPSTREAM_NAMES}
    loggers = {"trainer.loggers": [logger for flag, (logger, default) in UPSTREAM_LOGGERS.items()
                                   if upstream.get(flag, default)]} if set(upstream) & set(UPSTREAM_LOGGERS) else {}
    values = {**({"model.variant": variant} if variant is not None else {}),
              **{UPSTREAM_NAMES[k]: v for k, v in mapped.items()}, **loggers, **(options or {})}
    if max_steps is not None:  # counted in steps, also on a recipe that counts in epochs
        values.update({"trainer.max_steps": max_steps, "trainer.epochs": None})
    if epochs is not None:
        values["trainer.epochs"] = epochs
    argv = (["--config", config] if config else []) + [f"--{key}={_cli_value(value)}" for key, value in values.items()]
    return argv


def _per_step_batch(upstream: dict[str, Any]) -> dict[str, Any]:
    """rfdetr's ``batch_size`` counts one micro-batch; ours (``data.per_device_batch_size``) one optimizer step."""
    steps = upstream.get("grad_accum_steps")
    if steps is None or "batch_size" not in upstream:
        return upstream
    return {**upstream, "batch_size": int(upstream["batch_size"]) * int(steps)}


def _known(value: Any, table: dict[Any, Any]) -> bool:
    """Whether ``value`` is one of ``table``'s keys (an unhashable value is not)."""
    try:
        return value in table
    except TypeError:
        return False


def _cli_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, list, dict)) or value is None else str(value)

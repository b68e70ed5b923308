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
        max_steps: optimizer steps (``trainer.max_steps``); neither: the config's.
        options: any other option by its CLI name, e.g. ``{"eval.every_steps": 100, "mesh.cpu_devices": 4}``.
        verbose: show the XLA, torch and rfdetr warnings left out by default (the CLI's ``--verbose``,
            :mod:`spmd_rfdetr.quiet`).
        **upstream: rfdetr's argument names (:data:`UPSTREAM_NAMES`), e.g. ``dataset_dir``, ``batch_size``, ``lr``;
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
    unknown = sorted(set(upstream) - set(UPSTREAM_NAMES))
    if unknown:
        raise ConfigError(f"train(): unknown argument(s) {', '.join(unknown)}; rfdetr's names accepted here: "
                          f"{', '.join(UPSTREAM_NAMES)}; any other option goes in options={{'section.field': value}}")
    if epochs is not None and max_steps is not None:
        raise ConfigError("train(): give epochs or max_steps, not both")
    values = {**({"model.variant": variant} if variant is not None else {}),
              **{UPSTREAM_NAMES[k]: v for k, v in _per_step_batch(upstream).items()}, **(options or {})}
    if max_steps is not None:
        values["trainer.max_steps"] = max_steps
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


def _cli_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, list, dict)) or value is None else str(value)

"""The one build path of a training run: model -> Fabric setup -> criterion -> optimizer -> LR schedule -> step.

``fit``, ``benchmarks/run.py``, the tests and user scripts all build their trainer here, so they train the same
thing the same way (parameters replicated on the mesh, capturable AdamW on rfdetr's parameter groups, device-tensor
learning rates, the step in ``trainer.step_mode``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spmd_rfdetr.config import OptimOptions, TrainerOptions
from spmd_rfdetr.loss import build_criterion
from spmd_rfdetr.model import (
    DeviceLRSchedule,
    UpstreamConfigs,
    build_model,
    build_optimizer,
    build_upstream_criterion,
)
from spmd_rfdetr.step import TrainStep


@dataclass
class Trainer:
    """What :func:`build_trainer` made: the set-up model and optimizer, the criterion, the schedule and the step."""

    model: torch.nn.Module
    criterion: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: DeviceLRSchedule
    step: TrainStep


def build_trainer(
    fabric: Any,
    cfgs: UpstreamConfigs,
    optim: OptimOptions,
    trainer: TrainerOptions,
    *,
    model: torch.nn.Module | None = None,
) -> Trainer:
    """Build (or take ``model``, a CPU module), set it up on ``fabric``'s mesh and wire the compiled step.

    ``trainer.max_steps`` sizes the cosine schedule; ``trainer.matcher`` picks the assignment solver.
    """
    net = build_model(cfgs) if model is None else model
    criterion = build_criterion(build_upstream_criterion(cfgs)[0], solver=trainer.matcher).train()
    optimizer = build_optimizer(net, cfgs, on_device=True)
    net, optimizer = fabric.setup(net, optimizer)
    net.train()
    schedule = DeviceLRSchedule(optimizer, optim, trainer.max_steps)
    step = TrainStep(
        net, criterion, optimizer, clip_max_norm=optim.clip_max_norm, full_graph=trainer.matcher == "device",
        schedule=schedule, mode="openxla" if trainer.compile_backend == "openxla" else trainer.step_mode,
    )
    return Trainer(net, criterion, optimizer, schedule, step)

"""The one build path of a training run: model -> Fabric setup -> parallelize -> LR schedule -> EMA -> step.

``fit``, ``benchmarks/run.py``, the tests and user scripts all build their trainer here, so they train the same
thing the same way (parameters replicated on the mesh, or sharded along its ``fsdp`` axis by
:func:`~spmd_rfdetr.xla.parallelize.parallelize`; capturable AdamW on rfdetr's parameter groups, device-tensor learning
rates, the step in ``trainer.step_mode``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spmd_rfdetr.config.options import MeshOptions, ModelOptions, OptimOptions, TrainerOptions
from spmd_rfdetr.model.keypoint_groups import train_keypoints_on_groups
from spmd_rfdetr.model.loss import build_criterion
from spmd_rfdetr.model.streams import round_streams_to_bf16
from spmd_rfdetr.model.upstream import UpstreamConfigs, build_model, build_upstream_criterion
from spmd_rfdetr.model.xla_safe import use_fused_attention
from spmd_rfdetr.training.ema import DeviceEMA
from spmd_rfdetr.training.optim import DeviceLRSchedule, build_optimizer
from spmd_rfdetr.training.step import TrainStep
from spmd_rfdetr.xla.mesh import batch_shard_count
from spmd_rfdetr.xla.parallelize import parallelize


@dataclass
class Trainer:
    """What :func:`build_trainer` made: the set-up model and optimizer, the criterion, the schedule and the step."""

    model: torch.nn.Module
    criterion: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: DeviceLRSchedule
    step: TrainStep
    ema: DeviceEMA | None = None

    @property
    def inference_model(self) -> torch.nn.Module:
        """The weights to evaluate, export and save as ``last.pth``/``best.pth``: the EMA's when it is on."""
        return self.ema.module if self.ema is not None else unwrap(self.model)


def build_trainer(
    fabric: Any,
    cfgs: UpstreamConfigs,
    optim: OptimOptions,
    trainer: TrainerOptions,
    *,
    model: torch.nn.Module | None = None,
    ema: ModelOptions | None = None,
    mesh: MeshOptions | None = None,
) -> Trainer:
    """Build (or take ``model``, a CPU module), set it up on ``fabric``'s mesh and wire the compiled step.

    ``trainer.max_steps`` sizes the cosine schedule; ``trainer.matcher`` picks the assignment solver; ``ema`` (a
    :class:`ModelOptions` with ``ema`` on) adds the EMA of the weights to the step; ``mesh`` (``fsdp_min_numel``)
    tunes the parameter sharding, whose ``fsdp`` size is that of ``fabric``'s mesh.
    """
    net = build_model(cfgs, training=True) if model is None else model
    if trainer.bf16_streams and trainer.precision == "bf16":
        round_streams_to_bf16(net)  # before the EMA copies the model: its evaluations round as training does
    if trainer.fused_attention:
        use_fused_attention(net)
    if trainer.keypoint_groups is not None:
        train_keypoints_on_groups(net, trainer.keypoint_groups)
    criterion = build_criterion(build_upstream_criterion(cfgs)[0], solver=trainer.matcher,
                                keypoint_groups=trainer.keypoint_groups).train()
    optimizer = build_optimizer(net, cfgs, on_device=True)
    net, optimizer = fabric.setup(net, optimizer)
    parallelize(unwrap(net), fabric.strategy.mesh, mesh, optimizer)  # fsdp > 1: shard params + AdamW state
    net.train()
    schedule = DeviceLRSchedule(optimizer, optim, trainer.max_steps)
    averaged = DeviceEMA(unwrap(net), ema.ema_decay, ema.ema_tau) if ema is not None and ema.ema else None
    step = TrainStep(
        net, criterion, optimizer, clip_max_norm=optim.clip_max_norm, full_graph=trainer.matcher == "device",
        schedule=schedule, ema=averaged, accumulate=optim.accumulate, batch_shards=batch_shard_count(fabric.strategy.mesh),
        mode="openxla" if trainer.compile_backend == "openxla" else trainer.step_mode,
    )
    return Trainer(net, criterion, optimizer, schedule, step, averaged)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside Fabric's wrapper (its ``state_dict`` keys are rfdetr's)."""
    return getattr(model, "module", model)

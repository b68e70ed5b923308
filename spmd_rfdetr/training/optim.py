"""AdamW over rfdetr's parameter groups and the LR schedule, computed on the device.

The parameter groups are rfdetr's ``get_param_dict``; the schedule uses rfdetr's cosine/step formulas after a warm-up of
its own (:func:`lr_factor` says where it differs).
"""

from __future__ import annotations

import math

import torch
from rfdetr.training.param_groups import get_param_dict

from spmd_rfdetr.config.options import OptimOptions
from spmd_rfdetr.model.upstream import UpstreamConfigs


def build_optimizer(net: torch.nn.Module, cfgs: UpstreamConfigs, *, on_device: bool = False) -> torch.optim.AdamW:
    """AdamW over rfdetr's parameter groups (backbone layer decay, decoder component decay, no-decay rules).

    ``on_device``: ``capturable`` AdamW (its step count lives on the device), for use with :class:`DeviceLRSchedule`.
    """
    param_groups = get_param_dict(cfgs.namespace(), net)
    return torch.optim.AdamW(param_groups, lr=cfgs.train.lr, weight_decay=cfgs.train.weight_decay, capturable=on_device)


def lr_factor(step: int, optim: OptimOptions, max_steps: int) -> float:
    """The LR factor of optimizer step ``step`` (from 0): linear warm-up, then cosine to ``min_lr_factor``, a 10x drop
    at ``lr_drop_step``, or constant.

    After warm-up these are the formulas of rfdetr's managed ``LambdaLR``
    (``rfdetr.training.module_model._build_managed_scheduler``). Where it differs from rfdetr (tests/test_schedule.py):
    the warm-up is ``(step + 1) / (warmup + 1)`` (rfdetr: ``step / warmup``, 0 at the first step), the drop step is
    counted in steps (rfdetr: ``lr_drop`` epochs), ``constant`` is ours, and the defaults (:class:`OptimOptions`:
    cosine to 0.05; rfdetr: ``step``, cosine to 0.0).
    """
    if step < optim.warmup_steps:
        return (step + 1) / (optim.warmup_steps + 1)  # never exactly 0, unlike upstream's first warmup step
    if optim.schedule == "cosine":
        progress = (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps)
        return optim.min_lr_factor + (1 - optim.min_lr_factor) * 0.5 * (1 + math.cos(math.pi * progress))
    if optim.schedule == "step" and optim.lr_drop_step and step >= optim.lr_drop_step:
        return 0.1
    return 1.0


def device_lr_factor(step: torch.Tensor, optim: OptimOptions, max_steps: int) -> torch.Tensor:
    """:func:`lr_factor` computed on the device from a float32 step count (no Python value changes per step)."""
    warmup = optim.warmup_steps
    if optim.schedule == "cosine":
        progress = (step - warmup) / max(1, max_steps - warmup)
        after = optim.min_lr_factor + (1 - optim.min_lr_factor) * 0.5 * (1 + torch.cos(math.pi * progress))
    elif optim.schedule == "step" and optim.lr_drop_step:
        after = torch.where(step >= optim.lr_drop_step, 0.1, 1.0)
    else:
        after = torch.ones_like(step)
    if warmup <= 0:
        return after
    return torch.where(step < warmup, (step + 1) / (warmup + 1), after)


class DeviceLRSchedule:
    """:func:`lr_factor` as device-tensor learning rates, stepped inside the compiled training step.

    A Python-float learning rate is baked into the XLA graph: AdamW's ``param.mul_(1 - lr * weight_decay)`` compiled a
    new graph when that factor stopped rounding to 1.0 in float32 (measured: a recompile at step 16 of the CPU recipe's
    warmup), and a replayed program would keep the first step's value for ever. So the step count is a device tensor
    too and the factor is computed from it on the device (:func:`device_lr_factor`): one graph for the whole run, never
    read back.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, optim: OptimOptions, max_steps: int) -> None:
        self.optimizer, self.optim, self.max_steps = optimizer, optim, max_steps
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        device = optimizer.param_groups[0]["params"][0].device
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)  # optimizer steps taken
        factor = lr_factor(0, optim, max_steps)
        for group, base in zip(optimizer.param_groups, self.base_lrs):
            group["lr"] = torch.tensor(base * factor, dtype=torch.float32, device=device)

    def step(self) -> None:
        """Advance one optimizer step (in-place device ops: part of the step's graph, no host value involved)."""
        self.step_count.add_(1)
        factor = device_lr_factor(self.step_count, self.optim, self.max_steps)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"].copy_(factor * base)

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors :meth:`step` updates (part of the training step's state)."""
        return [self.step_count]

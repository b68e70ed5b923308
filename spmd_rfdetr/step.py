"""The training step: forward, rfdetr's set criterion, backward, clipping and AdamW, compiled as one XLA program.

Compiled with ``torch_xla.compile`` (lazy tracing): ``torch.compile(backend="openxla")`` gives wrong parameter
gradients for training under SPMD (see ``shared/repro``). With the device matcher the step is traced with
``full_graph=True``, so any stray host sync (an ``.item()``, a CPU fallback) raises instead of silently cutting the
graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ContextManager

import torch
import torch_xla
from rfdetr.models.criterion import SetCriterion
from rfdetr.utilities.tensors import NestedTensor

from spmd_rfdetr.data import targets_list
from spmd_rfdetr.loss import total_loss


def as_samples(images: torch.Tensor) -> NestedTensor:
    """Fixed-size images need no padding: an all-False bool mask, as rfdetr's NestedTensor expects."""
    mask = torch.zeros(images.shape[0], images.shape[2], images.shape[3], dtype=torch.bool, device=images.device)
    return NestedTensor(images, mask)


def forward_loss(
    model: torch.nn.Module,
    criterion: SetCriterion,
    batch: dict[str, torch.Tensor],
    autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward + criterion: (weighted total loss, rfdetr's loss dict). The loss is computed in fp32."""
    with autocast():
        outputs = model(as_samples(batch["images"]))
    outputs = _to_float(outputs)
    loss_dict = criterion(outputs, targets_list(batch))
    return total_loss(loss_dict, criterion.weight_dict), loss_dict


def _to_float(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.float() if tree.is_floating_point() else tree
    if isinstance(tree, dict):
        return {k: _to_float(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_float(v) for v in tree]
    return tree


class TrainStep:
    """One optimizer step as one compiled program; returns device tensors only (read them at log points)."""

    def __init__(
        self,
        model: torch.nn.Module,
        criterion: SetCriterion,
        optimizer: torch.optim.Optimizer,
        *,
        clip_max_norm: float,
        autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
        full_graph: bool = True,
        schedule: Any = None,
    ) -> None:
        self.model, self.criterion, self.optimizer, self.schedule = model, criterion, optimizer, schedule
        self.clip_max_norm = clip_max_norm
        self.autocast = autocast
        self._compiled = torch_xla.compile(self._step, full_graph=full_graph, name="train_step")

    def _step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        if hasattr(self.criterion.matcher, "unconverged"):
            self.criterion.matcher.unconverged = None
        loss, loss_dict = forward_loss(self.model, self.criterion, batch, self.autocast)
        loss.backward()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.clip_max_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip_max_norm)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
        self.optimizer.step()
        if self.schedule is not None:
            self.schedule.step()  # e.g. DeviceLRSchedule: next step's learning rates, inside this graph
        stats = {"loss": loss.detach(), "grad_norm": grad_norm.detach()}
        stats.update({k: v.detach() for k, v in loss_dict.items() if k in ("loss_ce", "loss_bbox", "loss_giou")})
        unconverged = getattr(self.criterion.matcher, "unconverged", None)
        if unconverged is not None:
            stats["matcher_unconverged"] = unconverged
        self.stat_names = list(stats)
        return torch.stack([v.float() for v in stats.values()])  # one tensor: one transfer at a log point

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run one step; returns the stats vector named by :attr:`stat_names` (still on the device)."""
        return self._compiled(batch)

    def read(self, stats: torch.Tensor) -> dict[str, float]:
        """Bring a step's stats to the host (one device->host transfer; only at log points)."""
        return dict(zip(self.stat_names, stats.cpu().tolist()))

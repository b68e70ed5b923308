"""The static-shape set criterion: rfdetr's SetCriterion with a matcher whose output shapes never change.

Upstream's loss math is already static for padded targets (``valid`` masks in ``loss_labels``/``loss_boxes``,
``num_boxes`` kept as a tensor). What is not static is its HungarianMatcher: it moves every cost matrix to the host and
solves it with SciPy, one variable-length result per image. :class:`StaticShapeMatcher` keeps rfdetr's cost (the same
``_compute_compact_detection_cost_matrix``) and replaces only the solve:

- ``solver="device"``: :func:`spmd_rfdetr.matching.solve_assignment` on the device, inside the step's one graph;
- ``solver="scipy"``: the upstream way, through the host (a reference, and a fallback).

Either way every image gets exactly ``group_detr * max_targets`` (query, target) pairs: real targets at their optimal
query, padding slots parked on distinct leftover queries, where the criterion's ``valid`` mask zeroes them.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from rfdetr.models.criterion import SetCriterion
from rfdetr.models.matcher import HungarianMatcher
from scipy.optimize import linear_sum_assignment

Solver = Literal["device", "scipy"]


def park_padding(query_of_target: torch.Tensor, valid: torch.Tensor, num_queries: int) -> torch.Tensor:
    """Give every padding slot its own query among those no real target took (fixed shapes, no host sync).

    ``query_of_target`` [P, T] (only valid slots meaningful), ``valid`` [P, T] -> [P, T] injective per problem.
    """
    taken = torch.zeros(query_of_target.shape[0], num_queries, dtype=torch.int32, device=query_of_target.device)
    # scatter_add, not scatter: the padding slots all point at query 0, and duplicate-index scatter is unordered
    taken = taken.scatter_add(1, torch.where(valid, query_of_target, 0), valid.to(torch.int32))
    free_first = torch.argsort(taken, dim=1, stable=True)  # free queries in ascending order, then taken ones
    pad_rank = torch.cumsum((~valid).to(torch.int64), dim=1) - 1
    parked = torch.gather(free_first, 1, pad_rank.clamp(min=0))
    return torch.where(valid, query_of_target, parked)


def _scipy_solve(cost: torch.Tensor) -> torch.Tensor:
    """Upstream's host path: SciPy on every [Q, T] problem (padding columns included). Returns [P, T]."""
    cost_host = cost.detach().float().cpu()
    result = torch.empty(cost.shape[0], cost.shape[2], dtype=torch.int64)
    for p, c in enumerate(cost_host):
        rows, cols = linear_sum_assignment(c.numpy())
        result[p, torch.as_tensor(cols)] = torch.as_tensor(rows)
    return result.to(cost.device)


class StaticShapeMatcher(HungarianMatcher):
    """rfdetr's matcher cost + a fixed-shape assignment (see the module docstring)."""

    def __init__(self, *args: Any, solver: Solver = "device", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.solver = solver
        self.unconverged: torch.Tensor | None = None  # problems finished greedily since the last reset (device)

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self, outputs: dict[str, Any], targets: list[dict[str, torch.Tensor]], group_detr: int = 1, **_: Any
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batch, queries = outputs["pred_logits"].shape[:2]
        slots = targets[0]["boxes"].shape[0]
        if any("valid" not in t or t["boxes"].shape[0] != slots for t in targets):
            raise ValueError("StaticShapeMatcher needs targets padded to one length with a 'valid' mask")
        per_group = queries // group_detr
        if slots > per_group:
            raise ValueError(f"max_targets={slots} exceeds the {per_group} queries per group; lower data.max_targets")
        # rfdetr's cost, [Q, B*T] (padding columns already at its sentinel cost) -> [B, Q, T]
        cost = self._compute_compact_detection_cost_matrix(outputs, targets).view(queries, batch, slots)
        cost = cost.permute(1, 0, 2).reshape(batch * group_detr, per_group, slots)  # one problem per image x group
        valid = torch.stack([t["valid"] for t in targets]).repeat_interleave(group_detr, dim=0)
        if self.solver == "scipy":
            query_of_target = _scipy_solve(cost)
        else:
            from spmd_rfdetr.matching import solve_assignment

            query_of_target, converged = solve_assignment(cost, valid)
            missed = (~converged).sum()
            self.unconverged = missed if self.unconverged is None else self.unconverged + missed
            query_of_target = park_padding(query_of_target, valid, per_group)
        offsets = torch.arange(group_detr, device=cost.device).repeat(batch)[:, None] * per_group
        query_index = (query_of_target + offsets).view(batch, group_detr * slots)
        target_index = torch.arange(slots, device=cost.device).repeat(group_detr)
        return [(query_index[i], target_index) for i in range(batch)]


def build_criterion(upstream: SetCriterion, solver: Solver = "device") -> SetCriterion:
    """rfdetr's criterion (same losses, weights, group DETR) with its matcher swapped for :class:`StaticShapeMatcher`."""
    m = upstream.matcher
    upstream.matcher = StaticShapeMatcher(
        cost_class=m.cost_class, cost_bbox=m.cost_bbox, cost_giou=m.cost_giou, focal_alpha=m.focal_alpha, solver=solver
    )
    return upstream


def total_loss(loss_dict: dict[str, torch.Tensor], weight_dict: dict[str, float]) -> torch.Tensor:
    """The weighted sum rfdetr's training step backpropagates."""
    return torch.stack([loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict]).sum()

"""DETR-like assignment problems and SciPy's answer to them: what the tests and ``benchmarks/`` measure the device
solver's exactness (:mod:`spmd_rfdetr.model.matching`) with."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from rfdetr.utilities.box_ops import box_cxcywh_to_xyxy, generalized_box_iou
from scipy.optimize import linear_sum_assignment

from spmd_rfdetr.model.matching import sanitize_cost

# rfdetr's default matcher weights (set_cost_class / set_cost_bbox / set_cost_giou) and focal alpha.
COST_CLASS, COST_BBOX, COST_GIOU, FOCAL_ALPHA = 2.0, 5.0, 2.0, 0.25


def random_boxes(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random cxcywh boxes with sides in [0.02, 0.5]."""
    boxes = torch.rand(*shape, 4, generator=generator)
    return torch.cat([boxes[..., :2], boxes[..., 2:] * 0.48 + 0.02], dim=-1)


def detr_costs(
    num_problems: int,
    num_queries: int,
    max_targets: int,
    generator: torch.Generator,
    *,
    mode: str = "random",
    min_targets: int = 0,
    num_classes: int = 20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DETR matching costs ``[P, Q, T]`` and ``valid [P, T]``, computed like rfdetr's HungarianMatcher.

    ``2 * focal class cost + 5 * L1 + 2 * (-GIoU)`` between predicted and target cxcywh boxes; each problem has
    ``U[min_targets, max_targets]`` valid targets. ``mode``: ``random`` predictions, ``trained`` (every target is
    predicted by a few queries with small noise: many near-ties) or ``untrained`` (all queries predict nearly the
    same box).
    """
    p, q, t = num_problems, num_queries, max_targets
    logits = torch.randn(p, q, num_classes, generator=generator) * 2.0 - 2.0
    target_boxes = random_boxes((p, t), generator)
    pred_boxes = random_boxes((p, q), generator)
    if mode == "trained" and t > 0:
        owner = torch.randint(0, t, (p, q), generator=generator)
        noise = torch.randn(p, q, 4, generator=generator) * 0.02
        pred_boxes = (target_boxes.gather(1, owner[..., None].expand(p, q, 4)) + noise).clamp(0.01, 1.0)
    elif mode == "untrained":
        pred_boxes = 0.97 * pred_boxes[:, :1] + 0.03 * pred_boxes
    labels = torch.randint(0, num_classes, (p, t), generator=generator)
    count = torch.randint(min_targets, t + 1, (p,), generator=generator)
    valid = torch.arange(t)[None, :] < count[:, None]

    target_logits = logits.gather(2, labels[:, None, :].expand(p, q, t))
    prob = target_logits.sigmoid()
    positive = FOCAL_ALPHA * (1 - prob) ** 2 * -F.logsigmoid(target_logits)
    negative = (1 - FOCAL_ALPHA) * prob**2 * -F.logsigmoid(-target_logits)
    cost_l1 = (pred_boxes[:, :, None, :] - target_boxes[:, None, :, :]).abs().sum(-1)
    giou = torch.stack(
        [generalized_box_iou(box_cxcywh_to_xyxy(pred_boxes[k]), box_cxcywh_to_xyxy(target_boxes[k])) for k in range(p)]
    )
    return COST_CLASS * (positive - negative) + COST_BBOX * cost_l1 - COST_GIOU * giou, valid


@dataclass
class Check:
    """Per-problem comparison with SciPy."""

    rel_err: np.ndarray  # |ours - scipy| / |scipy| of the total cost (0 where both are 0)
    injective: np.ndarray  # bool


def compare_with_scipy(cost: torch.Tensor, valid: torch.Tensor, query_of_target: torch.Tensor) -> Check:
    """Totals of our assignment and SciPy's on the sanitized cost, both summed in float64."""
    sanitized = sanitize_cost(cost.float(), valid).double().numpy()
    valid_np, chosen = valid.numpy(), query_of_target.cpu().numpy()
    rel, injective = np.zeros(len(cost)), np.ones(len(cost), dtype=bool)
    for k in range(len(cost)):
        targets = np.flatnonzero(valid_np[k])
        if len(targets) == 0:
            continue
        matrix = sanitized[k][:, targets]  # [Q, T_k]
        rows, cols = linear_sum_assignment(matrix)
        best = matrix[rows, cols].sum()
        queries = chosen[k][targets]
        injective[k] = len(np.unique(queries)) == len(queries) and queries.min() >= 0 and queries.max() < len(matrix)
        ours = matrix[np.clip(queries, 0, len(matrix) - 1), np.arange(len(targets))].sum()
        gap = abs(ours - best)
        rel[k] = 0.0 if gap == 0 else gap / max(abs(best), np.finfo(np.float64).tiny)
    return Check(rel, injective)


# (num_problems, num_queries, max_targets, mode, min_targets): 10,450 problems in all.
SWEEP = [
    (1000, 300, 100, "random", 0),
    (1000, 300, 100, "trained", 0),
    (500, 300, 100, "untrained", 0),
    (1500, 300, 20, "random", 0),
    (500, 300, 20, "trained", 0),
    (2500, 30, 30, "random", 0),
    (2000, 30, 30, "trained", 0),
    (1000, 30, 30, "untrained", 0),
    (300, 30, 30, "random", 25),  # T close to Q
    (100, 300, 300, "random", 250),  # T close to Q, large
    (50, 300, 300, "untrained", 250),
]

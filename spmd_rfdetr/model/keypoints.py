"""rfdetr's keypoint losses and matching costs on static batches, for rfdetr's GroupPose keypoint model.

rfdetr's per-target arithmetic is ``compute_l1_keypoint_loss`` (``rfdetr/models/heads/keypoints.py``): an
area-normalised L1 over the findable keypoints, a findable and a visible BCE over every keypoint slot of the target's
class, and a Gaussian NLL with the predicted precision Cholesky factors. :func:`target_keypoint_losses` is that
arithmetic term by term, without its two host reads (a ``target_classes.max()`` guard and a debug count of
non-finite factors: each a device-to-host sync inside a compiled step), for any leading shape of matched pairs.
A class outside the schema gives that target zero losses (upstream zeroes the whole batch's; the data check refuses
such labels first). :func:`keypoint_losses` weights each pair by ``valid``: upstream's ``loss_keypoints`` refuses
padded targets because a padding pair's findable/visible BCE is not zero (its L1 and NLL vanish with its zero area).

The matcher's keypoint terms (``compute_keypoint_matching_cost``, which finds each class's targets with ``nonzero``
and writes their columns by index) are :func:`keypoint_match_costs`: every query of an image against that image's
target slots, each class's arithmetic computed for every slot and kept where the slot holds that class.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

from spmd_rfdetr.xla.mesh import take_rows

#: rfdetr's keypoint loss names, in ``weight_dict`` order (each also per aux layer ``_i`` and for ``_enc``).
KEYPOINT_LOSSES = ("loss_keypoints_l1", "loss_keypoints_findable", "loss_keypoints_visible", "loss_keypoints_nll")


def target_keypoint_losses(pred: Tensor, target: Tensor, classes: Tensor, areas: Tensor,
                           schema: Sequence[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Location L1, findable BCE, visible BCE and Gaussian NLL per matched pair: rfdetr's
    ``compute_l1_keypoint_loss`` for ``pred [..., len(schema) * kpad, >= 7]`` (the model's keypoint channels: x, y,
    findable and visible logits, ``log_l11, l21, log_l22``), ``target [..., kpad, 3]`` (normalised x, y and COCO
    visibility 0/1/2), ``classes [...]`` and ``areas [...]`` (normalised box ``w * h``); each result ``[...]``."""
    lead, kpad = pred.shape[:-2], pred.shape[-2] // len(schema)
    by_class = pred.reshape(*lead, len(schema), kpad, pred.shape[-1])
    hit = classes[..., None] == torch.arange(len(schema), device=pred.device)  # [..., C]; none when out of schema
    picked = torch.where(hit[..., None, None], by_class, torch.zeros_like(by_class)).sum(dim=-3)  # [..., kpad, D]
    slots = torch.arange(kpad, device=pred.device)
    active = torch.zeros_like(picked[..., 0], dtype=torch.bool)  # [..., kpad]: the class's keypoint slots
    for c, count in enumerate(schema):  # (a device tensor of the counts would be a host transfer in every trace)
        active = active | (hit[..., c, None] & (slots < count))

    area = areas.to(torch.float32)
    eps = torch.finfo(area.dtype).eps
    valid_area = torch.isfinite(area) & (area > eps)
    valid_xy = torch.isfinite(picked[..., :2]).all(dim=-1) & torch.isfinite(target[..., :2]).all(dim=-1)
    seen = torch.isfinite(target[..., 2]) & (target[..., 2] > 0)
    located = active & seen & valid_xy & valid_area[..., None]
    location_count = located.sum(-1).to(picked.dtype)
    safe_area = torch.where(valid_area, area, torch.ones_like(area))

    zeros_xy = torch.zeros_like(picked[..., :2])
    l1 = F.l1_loss(torch.where(located[..., None], picked[..., :2], zeros_xy),
                   torch.where(located[..., None], target[..., :2], zeros_xy), reduction="none").sum(-1)
    location = (l1.masked_fill(~located, 0.0) / safe_area.clamp_min(eps).sqrt()[..., None]).sum(-1)
    location = location / location_count.clamp(min=1)
    findable = _bce(picked[..., 2], target[..., 2] > 0, active)
    visible = _bce(picked[..., 3], target[..., 2] > 1, active)

    factors = picked[..., 4:7].to(torch.float32)
    gaussian = located & torch.isfinite(factors).all(dim=-1)
    dxdy = torch.where(gaussian[..., None], picked[..., :2], zeros_xy) - torch.where(gaussian[..., None],
                                                                                   target[..., :2], zeros_xy)
    dxdy = dxdy.to(torch.float32)
    factors = torch.where(gaussian[..., None], factors, torch.zeros_like(factors))
    u0, u1, maha2 = _whitened(dxdy, factors)
    finite = gaussian & torch.isfinite(u0) & torch.isfinite(u1) & torch.isfinite(maha2)  # exp() may overflow
    dxdy = torch.where(finite[..., None], dxdy, torch.zeros_like(dxdy))
    factors = torch.where(finite[..., None], factors, torch.zeros_like(factors))
    _, _, maha2 = _whitened(dxdy, factors)
    count = finite.sum(-1).to(picked.dtype)
    nll = 0.5 * (maha2 / safe_area.clamp_min(eps)[..., None]) - (factors[..., 0] + factors[..., 2])
    nll = torch.nan_to_num(nll, nan=0.0, posinf=torch.finfo(nll.dtype).max / 2, neginf=torch.finfo(nll.dtype).min)
    nll = nll.masked_fill(~finite, 0.0).sum(-1) / count.clamp(min=1)
    nll = torch.where(count <= 0, torch.zeros_like(nll), nll)
    return location, findable, visible, nll


def keypoint_losses(pred: Tensor, target: Tensor, classes: Tensor, areas: Tensor, valid: Tensor, num_boxes: Tensor,
                    schema: Sequence[int], suffix: str = "") -> dict[str, Tensor]:
    """rfdetr's four ``loss_keypoints`` terms over matched pairs (any leading shape), each pair weighted by ``valid``
    (0: a padding slot) and summed over ``num_boxes``, the box losses' normaliser."""
    weight = valid.to(pred.dtype)
    terms = target_keypoint_losses(pred, target, classes, areas, schema)
    return {f"{name}{suffix}": (term * weight).sum() / num_boxes for name, term in zip(KEYPOINT_LOSSES, terms)}


def matched_keypoint_losses(pred: Tensor, query: Tensor, batch: dict[str, Tensor], num_boxes: Tensor,
                            schema: list[int], suffix: str) -> dict[str, Tensor]:
    """rfdetr's ``loss_keypoints`` of one layer: ``pred [B, Q, S, D]`` at the matched queries ``query [B, M]`` (match
    ``m`` is target slot ``m % T``), taken as whole rows of each image."""
    batch_size, _, slots, dim = pred.shape
    repeat = query.shape[1] // batch["labels"].shape[1]
    matched = take_rows(pred.flatten(2), query).view(batch_size, -1, slots, dim)
    boxes = batch["boxes"].repeat(1, repeat, 1)
    return keypoint_losses(matched, batch["keypoints"].repeat(1, repeat, 1, 1), batch["labels"].repeat(1, repeat),
                           boxes[..., 2] * boxes[..., 3], batch["valid"].repeat(1, repeat), num_boxes, schema, suffix)


def keypoint_match_costs(pred: Tensor, target: Tensor, classes: Tensor, areas: Tensor,
                         schema: Sequence[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """rfdetr's keypoint matching costs (L1, findable, visible, NLL), each ``[B, Q, T]``, of ``pred [B, Q, len(schema)
    * kpad, >= 7]`` against the image's own ``target [B, T, kpad, 3]``, ``classes [B, T]`` and ``areas [B, T]``; zero
    for a slot whose class has no keypoints (padding with a keypoint class is the caller's to mask, as upstream's
    matcher masks it)."""
    batch, queries, _, dim = pred.shape
    kpad = pred.shape[2] // len(schema)
    by_class = pred.reshape(batch, queries, len(schema), kpad, dim)
    costs = [torch.zeros(batch, queries, classes.shape[1], dtype=pred.dtype, device=pred.device) for _ in range(4)]
    for c, count in enumerate(schema):
        if count == 0:
            continue
        here = (classes == c)[:, None, :]
        for i, cost in enumerate(_class_costs(by_class[:, :, c, :count], target[:, :, :count], areas)):
            costs[i] = torch.where(here, cost.to(pred.dtype), costs[i])
    return costs[0], costs[1], costs[2], costs[3]


def _class_costs(pred: Tensor, target: Tensor, areas: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One class's four costs ``[B, Q, T]`` for ``pred [B, Q, K, D]`` and ``target [B, T, K, 3]``: upstream's
    arithmetic for that class, per image instead of over the whole batch's targets."""
    count = pred.shape[2]
    area = areas.to(torch.float32)
    eps = torch.finfo(area.dtype).eps
    valid_area = torch.isfinite(area) & (area > eps)
    target_xy = target[..., :2]
    seen = (torch.isfinite(target[..., 2]) & (target[..., 2] > 0) & torch.isfinite(target_xy).all(dim=-1)
            & valid_area[..., None])  # [B, T, K]
    seen_count = seen.sum(dim=-1).to(torch.float32)
    denom = seen_count.clamp(min=1)[:, None, :]  # [B, 1, T]

    pred_xy = pred[..., :2].to(torch.float32)
    diff = pred_xy[:, :, None] - target_xy.to(torch.float32)[:, None]  # [B, Q, T, K, 2]
    l1 = diff.abs().sum(-1).masked_fill(~seen[:, None], 0.0).sum(-1)
    l1 = (l1 / denom).div(area.clamp_min(eps).sqrt()[:, None, :])
    l1 = torch.nan_to_num(l1, nan=0.0, posinf=0.0, neginf=0.0)

    factors = pred[..., 4:7].to(torch.float32)  # [B, Q, K, 3]
    finite_pred = torch.isfinite(pred_xy).all(dim=-1) & torch.isfinite(factors).all(dim=-1)
    u0, u1, maha2 = _whitened(diff, factors[:, :, None])  # [B, Q, T, K]
    used = seen[:, None] & finite_pred[:, :, None] & torch.isfinite(u0) & torch.isfinite(u1) & torch.isfinite(maha2)
    nll = 0.5 * (maha2 / area.clamp_min(eps)[:, None, :, None]) - (factors[..., 0] + factors[..., 2])[:, :, None]
    nll = torch.nan_to_num(nll, nan=0.0, posinf=torch.finfo(nll.dtype).max / 2, neginf=torch.finfo(nll.dtype).min)
    nll = nll.masked_fill(~used, 0.0).sum(-1) / denom
    nll = nll.masked_fill(~(seen_count > 0)[:, None, :], 0.0)

    findable = _pairwise_bce(pred[..., 2], (target[..., 2] > 0).to(pred.dtype)) / float(count)
    visible = _pairwise_bce(pred[..., 3], (target[..., 2] > 1).to(pred.dtype)) / float(count)
    return l1, findable, visible, nll


def _pairwise_bce(logits: Tensor, labels: Tensor) -> Tensor:
    """``[B, Q, T]``: BCE-with-logits of every query's ``logits [B, Q, K]`` against every slot's ``labels [B, T, K]``,
    summed over ``K`` (rfdetr's ``_cdist_bce_with_logits``, per image)."""
    return F.softplus(logits).sum(dim=-1, keepdim=True) - torch.matmul(logits, labels.transpose(1, 2))


def _bce(logits: Tensor, positive: Tensor, active: Tensor) -> Tensor:
    """The mean BCE-with-logits over the class's keypoint slots whose logit is finite (rfdetr's findable/visible)."""
    used = active & torch.isfinite(logits)
    safe = torch.where(used, logits, torch.zeros_like(logits))
    bce = F.binary_cross_entropy_with_logits(safe, positive.to(logits.dtype), reduction="none")
    return bce.masked_fill(~used, 0.0).sum(-1) / used.sum(-1).clamp(min=1).to(logits.dtype)


def _whitened(dxdy: Tensor, factors: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``L^T d`` for the lower-triangular precision factor ``L = [[exp(log_l11), 0], [l21, exp(log_l22)]]``, and its
    squared norm (the Mahalanobis distance squared)."""
    dx, dy = dxdy[..., 0], dxdy[..., 1]
    u0 = factors[..., 0].exp() * dx + factors[..., 1] * dy
    u1 = factors[..., 2].exp() * dy
    return u0, u1, u0 * u0 + u1 * u1

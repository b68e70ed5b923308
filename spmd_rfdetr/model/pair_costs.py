"""rfdetr's box matching costs for every (target, query) pair, written one coordinate at a time.

rfdetr's ``pairwise_box_l1_cost`` and ``generalized_box_iou`` build ``[..., Q, T, 2]`` corner tensors (and its L1 cost
``[..., Q, T, 4]`` chunks) whose size-2 and size-4 minor axes the TPU compiler writes to memory, then reads back
into the final cost: 2.8 GB per v5e.yaml step for a ``[16, 11700, 100]`` cost. Here each coordinate is its own
``[B, 1, Q]`` or ``[B, T, 1]`` tensor, so the whole cost is one element-wise expression over ``[B, T, Q]`` (queries on
the minor axis, where they fill the chip's 128 lanes; 100 targets would pad to 128) that XLA fuses into one pass.
Every element is computed with rfdetr's operations in rfdetr's order (``box_cxcywh_to_xyxy``, torchvision's
``box_area``, ``box_iou``'s and ``generalized_box_iou``'s clamps and ``eps``, the L1 sum left to right), so the
values are rfdetr's (``tests/test_loss.py`` compares them).
"""

from __future__ import annotations

import torch
from torch import Tensor

_EPS = 1e-7  # rfdetr's union and enclosing-area clamp in box_iou / generalized_box_iou


def _corners(boxes: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``box_cxcywh_to_xyxy`` as four tensors of the leading shape."""
    cx, cy, w, h = boxes.unbind(-1)
    half_w, half_h = 0.5 * w.clamp(min=0.0), 0.5 * h.clamp(min=0.0)
    return cx - half_w, cy - half_h, cx + half_w, cy + half_h


def l1_and_giou(pred: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """rfdetr's ``pairwise_box_l1_cost`` and ``generalized_box_iou`` (cxcywh boxes; ``pred [B, Q, 4]``,
    ``target [B, T, 4]``) as ``[B, T, Q]`` tensors: entry ``[b, t, q]`` is rfdetr's ``[q, t]`` of image ``b``."""
    p = [c[:, None, :] for c in pred.unbind(-1)]  # [B, 1, Q] each
    t = [c[:, :, None] for c in target.unbind(-1)]  # [B, T, 1] each
    l1 = (p[0] - t[0]).abs() + (p[1] - t[1]).abs() + (p[2] - t[2]).abs() + (p[3] - t[3]).abs()
    px0, py0, px1, py1 = (c[:, None, :] for c in _corners(pred))
    tx0, ty0, tx1, ty1 = (c[:, :, None] for c in _corners(target))
    inter = (torch.min(px1, tx1) - torch.max(px0, tx0)).clamp(min=0) * (
        torch.min(py1, ty1) - torch.max(py0, ty0)).clamp(min=0)
    union = (px1 - px0) * (py1 - py0) + (tx1 - tx0) * (ty1 - ty0) - inter
    iou = inter / union.clamp(min=_EPS)
    enclosing = (torch.max(px1, tx1) - torch.min(px0, tx0)).clamp(min=0) * (
        torch.max(py1, ty1) - torch.min(py0, ty0)).clamp(min=0)
    return l1, iou - (enclosing - union) / enclosing.clamp(min=_EPS)

"""rfdetr's views of a static batch: images as its ``NestedTensor`` samples, targets as its list of dicts."""

from __future__ import annotations

import torch
from rfdetr.utilities.tensors import NestedTensor


def as_samples(images: torch.Tensor) -> NestedTensor:
    """Fixed-size images need no padding: an all-False bool mask, as rfdetr's NestedTensor expects."""
    mask = torch.zeros(images.shape[0], images.shape[2], images.shape[3], dtype=torch.bool, device=images.device)
    return NestedTensor(images, mask)


def targets_list(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """rfdetr's list-of-dicts targets view of a static batch (per-image slices: still fixed shapes)."""
    keys = [k for k in ("boxes", "labels", "valid", "keypoints") if k in batch]
    return [{k: batch[k][i] for k in keys} for i in range(batch["boxes"].shape[0])]

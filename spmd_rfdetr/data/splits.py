"""rfdetr's dataset splits, read as the batches need them, and the overflow policy.

Overflow policy (never silent): before training, the annotation files are scanned for images with more than
``max_targets`` boxes. ``on_overflow="error"`` stops and names them; ``"truncate"`` logs how many images and boxes are
affected (naming the first files) and keeps each such image's ``max_targets`` largest boxes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rfdetr.datasets import build_dataset, get_coco_api_from_dataset
from rfdetr.detr import RFDETR
from torch.utils.data import Dataset, Subset

from spmd_rfdetr.config.options import DataOptions
from spmd_rfdetr.data.pixels import uint8_pixels
from spmd_rfdetr.model.upstream import UpstreamConfigs
from spmd_rfdetr.quiet import library_prints

log = logging.getLogger(__name__)


SPLITS = {"train": "train", "valid": "val", "test": "test"}


def num_classes_in(dataset_dir: str, keypoints: bool = False) -> int:
    """Class count the way rfdetr's ``train()`` detects it (same category basis as its labels). ``keypoints``: the
    keypoint model's label slots, where a Roboflow export's root category takes one too (rfdetr's keypoint basis)."""
    return RFDETR._detect_num_classes_for_training(dataset_dir, use_grouppose_keypoints=keypoints)


def class_names(dataset: Dataset[Any], num_classes: int) -> list[str]:
    """Category names indexed by training label, as rfdetr's dataset maps categories to labels ('' where unnamed)."""
    coco = get_coco_api_from_dataset(dataset)
    if coco is None:
        return [""] * num_classes
    label2cat = getattr(coco, "label2cat", None) or {i: i for i in range(num_classes)}
    return [coco.cats.get(int(label2cat.get(label, -1)), {}).get("name", "") for label in range(num_classes)]


def upstream_split(cfgs: UpstreamConfigs, split: str) -> Dataset[Any]:
    """rfdetr's dataset for ``split`` (``train``/``valid``/``test``) exactly as rfdetr builds it, float32 images
    normalised on the host: what comparisons with upstream read. Training and evaluation read :func:`build_split`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
    with library_prints():  # pycocotools' progress prints (quiet.configure's choice)
        return build_dataset(SPLITS[split], cfgs.namespace(), cfgs.model.resolution)


def build_split(cfgs: UpstreamConfigs, split: str) -> Dataset[Any]:
    """rfdetr's dataset for ``split`` with its transforms at the fixed resolution, images as uint8 [3, R, R]
    (:func:`uint8_pixels`; the boxes are rfdetr's, normalised cxcywh)."""
    dataset = upstream_split(cfgs, split)
    reader = _reader(dataset)
    reader._transforms = uint8_pixels(reader._transforms)
    return dataset


def build_eval_split(cfgs: UpstreamConfigs, split: str) -> Dataset[Any]:
    """``split`` read for evaluation: rfdetr's validation transforms at the model's resolution, whatever the split.
    The train split's own transforms augment (flips, resize-crop jitter, multi-scale sizes): scored against the
    original annotations they give a different mAP at every pass. rfdetr's builders pick transforms by split name, so
    the train reader takes the valid split's pipeline (and decodes at full size, as the valid split does)."""
    dataset = build_split(cfgs, split)
    if split == "train":
        reader, valid = _reader(dataset), _reader(upstream_split(cfgs, "valid"))
        reader._transforms = uint8_pixels(valid._transforms)
        if hasattr(reader, "_draft_size"):  # rfdetr's JPEG draft decode is for the train transforms' smaller sizes
            reader._draft_size = getattr(valid, "_draft_size", None)
    return dataset


def _reader(dataset: Dataset[Any]) -> Any:
    """The rfdetr dataset under any ``Subset``, which holds the transform pipeline."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    if getattr(dataset, "_transforms", None) is None:
        raise TypeError(f"rfdetr built a {type(dataset).__name__} without a transform pipeline to read as uint8")
    return dataset


@dataclass
class Overflow:
    """Images whose annotations hold more boxes than ``max_targets``."""

    files: list[str]
    boxes_over: int

    def describe(self, max_targets: int, limit: int = 5) -> str:
        shown = ", ".join(self.files[:limit]) + (f" (+{len(self.files) - limit} more)" if len(self.files) > limit else "")
        return f"{len(self.files)} image(s) have more than data.max_targets={max_targets} boxes ({self.boxes_over} boxes over): {shown}"


#: How to resolve an :class:`Overflow` (said by ``check_overflow`` and by the data check, :mod:`spmd_rfdetr.data.check`).
OVERFLOW_FIX = (
    "Raise data.max_targets (it must stay <= queries per group) or set data.on_overflow=truncate to keep each "
    "image's largest boxes."
)


def count_overflow(box_counts: Mapping[str, int], max_targets: int) -> Overflow:
    """The images of ``{file name: boxes training sees}`` over the padding cap."""
    files = sorted(name for name, count in box_counts.items() if count > max_targets)
    return Overflow(files, sum(box_counts[name] - max_targets for name in files))


def find_overflow(dataset: Dataset[Any], max_targets: int) -> Overflow:
    """Scan the split's annotations (not the images) for images over the padding cap (crowd boxes do not count)."""
    coco = get_coco_api_from_dataset(dataset)
    if coco is None:
        return Overflow([], 0)
    counts = {
        coco.imgs[image_id]["file_name"]: sum(1 for a in anns if not a.get("iscrowd", 0))
        for image_id, anns in coco.imgToAnns.items()
    }
    return count_overflow(counts, max_targets)


def check_overflow(dataset: Dataset[Any], data: DataOptions, split: str) -> None:
    """Apply ``data.on_overflow`` before any training: raise, or log what will be truncated."""
    overflow = find_overflow(dataset, data.max_targets)
    if not overflow.files:
        return
    message = f"{data.dataset_dir} [{split}]: {overflow.describe(data.max_targets)}"
    if data.on_overflow == "error":
        raise ValueError(f"{message}. {OVERFLOW_FIX}")
    log.warning("%s; keeping the %d largest boxes of each (data.on_overflow=truncate)", message, data.max_targets)

"""Static-shape batches from rfdetr's own dataset readers and transforms.

Every batch is one dict with fixed shapes, so the training step compiles once:
``images`` [B, 3, R, R] float, ``boxes`` [B, T, 4] (normalised cxcywh), ``labels`` [B, T] int64, ``valid`` [B, T] bool,
``image_id`` [B] int64, ``orig_size`` [B, 2] int64 (h, w), with T = ``data.max_targets``.

Overflow policy (never silent): before training, the annotation files are scanned for images with more than
``max_targets`` boxes. ``on_overflow="error"`` stops and names them; ``"truncate"`` logs how many images and boxes are
affected (naming the first files) and keeps each such image's ``max_targets`` largest boxes.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rfdetr.datasets import build_dataset, get_coco_api_from_dataset
from torch.utils.data import DataLoader, Dataset, Sampler

from spmd_rfdetr.config import DataOptions
from spmd_rfdetr.hosts import host_rows
from spmd_rfdetr.model import UpstreamConfigs

log = logging.getLogger(__name__)

SPLITS = {"train": "train", "valid": "val", "test": "test"}


def num_classes_in(dataset_dir: str) -> int:
    """Class count the way rfdetr's ``train()`` detects it (same category basis as its labels)."""
    from rfdetr.detr import RFDETR

    return RFDETR._detect_num_classes_for_training(dataset_dir)


def class_names(dataset: Dataset[Any], num_classes: int) -> list[str]:
    """Category names indexed by training label, as rfdetr's dataset maps categories to labels ('' where unnamed)."""
    coco = get_coco_api_from_dataset(dataset)
    if coco is None:
        return [""] * num_classes
    label2cat = getattr(coco, "label2cat", None) or {i: i for i in range(num_classes)}
    return [coco.cats.get(int(label2cat.get(label, -1)), {}).get("name", "") for label in range(num_classes)]


def build_split(cfgs: UpstreamConfigs, split: str) -> Dataset[Any]:
    """rfdetr's dataset for ``split`` (``train``/``valid``/``test``) with its transforms at the fixed resolution."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
    return build_dataset(SPLITS[split], cfgs.namespace(), cfgs.model.resolution)


@dataclass
class Overflow:
    """Images whose annotations hold more boxes than ``max_targets``."""

    files: list[str]
    boxes_over: int

    def describe(self, max_targets: int, limit: int = 5) -> str:
        shown = ", ".join(self.files[:limit]) + (f" (+{len(self.files) - limit} more)" if len(self.files) > limit else "")
        return f"{len(self.files)} image(s) have more than data.max_targets={max_targets} boxes ({self.boxes_over} boxes over): {shown}"


#: How to resolve an :class:`Overflow` (said by ``check_overflow`` and by the data check, :mod:`spmd_rfdetr.checks`).
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


def pad_target(target: dict[str, torch.Tensor], max_targets: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(boxes [T, 4], labels [T], valid [T]) for one image; beyond ``max_targets`` the largest boxes are kept."""
    boxes, labels = target["boxes"], target["labels"]
    if len(labels) > max_targets:
        keep = torch.argsort(boxes[:, 2] * boxes[:, 3], descending=True, stable=True)[:max_targets]
        boxes, labels = boxes[keep], labels[keep]
    n = len(labels)
    padded_boxes = torch.zeros(max_targets, 4, dtype=torch.float32)
    padded_labels = torch.zeros(max_targets, dtype=torch.int64)
    padded_boxes[:n], padded_labels[:n] = boxes, labels
    return padded_boxes, padded_labels, torch.arange(max_targets) < n


class StaticCollate:
    """Collate rfdetr samples into one fixed-shape batch dict (picklable, for DataLoader workers).

    Samples of a multi-scale batch carry the batch's size (``(image, target, size)``): the stacked images are then
    resized to it as rfdetr's per-batch multi-scale does (bilinear, on the collated batch; boxes are normalised, so
    they stay)."""

    def __init__(self, max_targets: int, resolution: int) -> None:
        self.max_targets = max_targets
        self.resolution = resolution

    def __call__(self, samples: Sequence[tuple[Any, ...]]) -> dict[str, torch.Tensor]:
        size = samples[0][2] if len(samples[0]) == 3 else None
        batch = self._collate([sample[:2] for sample in samples])
        if size is not None and size != self.resolution:
            batch["images"] = torch.nn.functional.interpolate(batch["images"], size=size, mode="bilinear",
                                                              align_corners=False)
        return batch

    def _collate(self, samples: Sequence[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        expected = (3, self.resolution, self.resolution)
        for image, target in samples:
            if tuple(image.shape) != expected:
                raise ValueError(
                    f"image_id {int(target['image_id'])}: transformed to {tuple(image.shape)}, expected {expected}; "
                    "static batches need one resolution (with data.multi_scale the train split reads images at the "
                    "largest scale and each batch is resized to its bucket)"
                )
        padded = [pad_target(t, self.max_targets) for _, t in samples]
        return {
            "images": torch.stack([image for image, _ in samples]),
            "boxes": torch.stack([p[0] for p in padded]),
            "labels": torch.stack([p[1] for p in padded]),
            "valid": torch.stack([p[2] for p in padded]),
            "image_id": torch.stack([t["image_id"].reshape(()).to(torch.int64) for _, t in samples]),
            "orig_size": torch.stack([t["orig_size"].to(torch.int64) for _, t in samples]),
        }


def blank_batch(rows: int, size: int, max_targets: int) -> dict[str, torch.Tensor]:
    """A host batch of zeros shaped as the train loader's batches of ``rows`` images at ``size`` (collated by
    :class:`StaticCollate` itself, so keys, shapes and dtypes match): compiling a bucket's program needs only that."""
    target = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
              "image_id": torch.zeros((), dtype=torch.int64), "orig_size": torch.tensor([size, size])}
    return StaticCollate(max_targets, size)([(torch.zeros(3, size, size), target)] * rows)


class TrainBatches(Sampler[list[tuple[int, int]]]):
    """Endless shuffled training batches, each a list of ``(epoch, index)``: a pure function of the seed and the step.

    Epoch ``e`` is a permutation drawn from ``seed`` and ``e`` alone (the last partial batch is dropped), so the
    batches from ``start_step`` on are exactly those a run started at step 0 sees from there: what exact resume needs.
    ``host`` = ``(index, count)``: on several hosts each yields only its rows of every global batch
    (:func:`~spmd_rfdetr.hosts.host_rows`). With ``scales`` (multi-scale buckets) each key also names the size its
    batch is resized to, :func:`batch_scale` of the step.
    """

    def __init__(self, size: int, batch_size: int, seed: int, start_step: int = 0,
                 host: tuple[int, int] = (0, 1), scales: Sequence[int] = ()) -> None:
        self.size, self.batch_size, self.seed, self.start_step = size, batch_size, seed, start_step
        self.steps_per_epoch = size // batch_size
        self.host, self.scales = host, list(scales)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of the batch a run uses at 0-based ``step``."""
        return divmod(step, self.steps_per_epoch)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, offset = self.position(self.start_step)
        while True:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            for b in range(offset, self.steps_per_epoch):
                keys = [(epoch, int(i)) for i in order[b * self.batch_size:(b + 1) * self.batch_size]]
                if self.scales:
                    size = batch_scale(self.scales, epoch * self.steps_per_epoch + b)  # this batch's 0-based step
                    keys = [(*key, size) for key in keys]
                yield host_rows(keys, *self.host)
            epoch, offset = epoch + 1, 0

    def __len__(self) -> int:
        return self.steps_per_epoch


def batch_scale(scales: Sequence[int], step: int) -> int:
    """The image size of the batch of 0-based ``step``: rfdetr's per-batch draw, ``random.Random(step).choice``
    (its ``on_train_batch_start`` with the global step), so a run here sees upstream's sizes step for step."""
    return random.Random(step).choice(list(scales))


def first_uses(scales: Sequence[int], start_step: int, max_steps: int) -> dict[int, int]:
    """``{size: the first 1-based step after start_step whose batch has that size}``: the steps that compile a bucket's
    training graph (sizes never drawn before ``max_steps`` are left out)."""
    first: dict[int, int] = {}
    for step in range(start_step, max_steps):
        first.setdefault(batch_scale(scales, step), step + 1)
        if len(first) == len(set(scales)):
            break
    return first


class SeededSamples(Dataset):  # type: ignore[type-arg]
    """Reads ``dataset[index]`` for a ``(epoch, index)`` key with the host RNGs seeded from (seed, epoch, index).

    rfdetr's augmentations draw from torch's, Python's and NumPy's global RNGs; seeding them per sample makes every
    augmented image a function of its key, independent of worker count, prefetching and where a run resumed. The
    caller's RNG states are restored afterwards.
    """

    def __init__(self, dataset: Dataset[Any], seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, ...]) -> Any:
        """``dataset[index]`` for ``(epoch, index)``; for ``(epoch, index, size)`` the sample plus that batch size."""
        if len(key) == 3:
            return (*self[key[:2]], key[2])
        epoch, index = key
        sample_seed = hash((self.seed, epoch, index)) & 0xFFFF_FFFF  # ints hash to themselves: stable across runs
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed)
            random.seed(sample_seed)
            np.random.seed(sample_seed)
            try:
                return self.dataset[index]
            finally:
                random.setstate(py_state)
                np.random.set_state(np_state)


def make_train_loader(
    dataset: Dataset[Any], data: DataOptions, resolution: int, *, seed: int = 0, start_step: int = 0,
    host: tuple[int, int] = (0, 1), scales: Sequence[int] = (),
) -> DataLoader[dict[str, torch.Tensor]]:
    """Endless reproducible static batches of ``data.global_batch_size`` (:class:`TrainBatches`,
    :class:`SeededSamples`), starting with the batch of the 0-based ``start_step``; ``host`` = ``(index, count)``
    loads only this host's rows of each; ``scales``: multi-scale buckets (``resolution`` is then the largest, the size
    the train split reads images at)."""
    if len(dataset) < data.global_batch_size:  # type: ignore[arg-type]
        raise ValueError(
            f"{data.dataset_dir}: the train split has {len(dataset)} images, fewer than "  # type: ignore[arg-type]
            f"data.global_batch_size={data.global_batch_size}"
        )
    batches = TrainBatches(len(dataset), data.global_batch_size, seed, start_step, host, scales)  # type: ignore[arg-type]
    return DataLoader(SeededSamples(dataset, seed), batch_sampler=batches, num_workers=data.num_workers,
                      collate_fn=StaticCollate(data.max_targets, resolution))


def targets_list(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """rfdetr's list-of-dicts targets view of a static batch (per-image slices: still fixed shapes)."""
    return [
        {"boxes": batch["boxes"][i], "labels": batch["labels"][i], "valid": batch["valid"][i]}
        for i in range(batch["boxes"].shape[0])
    ]

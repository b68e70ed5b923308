"""Static-shape batches from rfdetr's own dataset readers and transforms.

Every batch is one dict with fixed shapes, so the training step compiles once:
``images`` [B, 3, R, R] uint8, ``boxes`` [B, T, 4] (normalised cxcywh), ``labels`` [B, T] int64, ``valid`` [B, T] bool,
``image_id`` [B] int64, ``orig_size`` [B, 2] int64 (h, w), with T = ``data.max_targets``; for the ``seg-*`` variants
also ``masks`` [B, T, R, ceil(R/8)] uint8, each target's instance mask at the input resolution, bit-packed
(:func:`spmd_rfdetr.model.masks.pack_masks`: 8x fewer bytes than rfdetr's bool masks, read on the device at points).

Pixels travel as uint8, a quarter of the bytes of rfdetr's float32 input: rfdetr's transforms run on the host except
their last two steps (``ToDtype(float32, scale=True)`` and the image half of ``Normalize``), which
:func:`normalize_images` runs on the device inside every compiled program that feeds the model.

Overflow policy (never silent): before training, the annotation files are scanned for images with more than
``max_targets`` boxes. ``on_overflow="error"`` stops and names them; ``"truncate"`` logs how many images and boxes are
affected (naming the first files) and keeps each such image's ``max_targets`` largest boxes.

Multi-scale training (``data.multi_scale``, rfdetr's default recipe; instance masks stay at the size read, as rfdetr's
per-batch resize leaves them: they are sampled at normalised points): the train split is read at the largest of
rfdetr's scales for the model (``compute_multi_scale_scales`` with its default ``expanded_scales``, e.g. 64...288 for a
128-pixel model) and each batch is resized to one size drawn per step exactly as rfdetr draws it
(``random.Random(step).choice(scales)``: the same size at the same step as an upstream run, and a pure function of the
step, so resume stays exact). Every size is a bucket: a static batch shape with its own compiled training program
(replay keeps one program per batch signature); ``data.scales`` keeps some of rfdetr's sizes only. In ``replay`` mode
``fit`` compiles every bucket's program before step 1 (``loop.precompile_buckets``, one log line each: ``multi-scale:
compiled 288 px (8/8) in 95 s``) from a blank batch of that shape: traced, compiled without running, and every weight,
AdamW moment, learning rate, step count and the RNG seed put back as it was (``Replayer.precompile``); in ``trace`` and
``openxla`` mode each bucket compiles at its first step (``fit`` logs which). Evaluation stays at
``model.resolution``. ``tests/test_multiscale.py``: 3 buckets over 12 steps from the real loader, sizes as rfdetr draws
them, every bucket compiled before step 1, one trace per bucket (+1 replay check at step 1), no compile during the 12
steps, every step's loss equal to upstream's eager step on the same batches (7e-8 measured at step 1, bound 1e-5;
``parity_tolerance`` after); ``tests/test_replay.py`` shows on a toy step that compiling ahead runs nothing and leaves
every state tensor bit-identical.
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
from rfdetr.datasets.transforms import Normalize
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision.transforms.v2 import ToDtype

from spmd_rfdetr.config.options import DataOptions
from spmd_rfdetr.xla.hosts import host_rows
from spmd_rfdetr.model.masks import pack_masks
from spmd_rfdetr.model.upstream import UpstreamConfigs
from spmd_rfdetr.quiet import library_prints
from spmd_rfdetr.config.resolve import worker_count

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


# ---------------------------------------------------------------------------------------------------------------------
# Pixels: uint8 on the host, normalised on the device
# ---------------------------------------------------------------------------------------------------------------------

#: rfdetr's image normalisation, from its own ``Normalize`` (ImageNet mean and std of its defaults).
PIXEL_MEAN: tuple[float, ...] = tuple(Normalize()._normalize.mean)
PIXEL_STD: tuple[float, ...] = tuple(Normalize()._normalize.std)


def _unchanged(image: torch.Tensor) -> torch.Tensor:
    return image


class BoxesOnlyNormalize(Normalize):
    """rfdetr's ``Normalize`` with the image left as it is (uint8): its own code still turns the boxes into
    normalised cxcywh; the pixels are normalised on the device (:func:`normalize_images`)."""

    def __init__(self) -> None:
        super().__init__()
        self._normalize = _unchanged  # the one image step of rfdetr's __call__; everything else in it is kept


def uint8_pixels(transforms: Any) -> Any:
    """rfdetr's transform ``Compose`` with its last two steps, ``ToDtype(float32, scale=True)`` and ``Normalize``
    (rfdetr's default mean/std), replaced by :class:`BoxesOnlyNormalize`: samples come out as uint8 ``[3, H, W]``
    (``ToImage``'s output) with rfdetr's boxes. Anything else is an error, not a silent float batch."""
    steps = list(transforms.transforms)
    to_float, normalize = (steps[-2:] if len(steps) >= 2 else (None, None))
    if not (isinstance(to_float, ToDtype) and to_float.dtype == torch.float32 and to_float.scale
            and type(normalize) is Normalize
            and (tuple(normalize._normalize.mean), tuple(normalize._normalize.std)) == (PIXEL_MEAN, PIXEL_STD)):
        raise ValueError(f"rfdetr's transforms end with {[type(t).__name__ for t in steps[-2:]]}, not ToDtype(float32, "
                         "scale=True) + Normalize with its default mean/std: cannot hand their pixels over as uint8")
    return type(transforms)([*steps[:-2], BoxesOnlyNormalize()])


def normalize_images(images: torch.Tensor) -> torch.Tensor:
    """rfdetr's ``ToDtype(float32, scale=True)`` + ``Normalize`` on the device, in float32 and in its order
    (``x * (1/255)``, then ``(x - mean) / std``): pixels ``[B, 3, H, W]``, uint8 (or float32 values 0..255: a resized
    multi-scale batch, :class:`StaticCollate`) -> the model's float32 input. Called inside every compiled program that
    feeds the model (training step, eval forward, predict). A traced program cannot look at the values: the collates
    (:class:`StaticCollate`, ``evaluate.EvalCollate``) refuse samples that are not uint8 pixels (rfdetr's own
    normalised float input would be normalised twice)."""
    if images.dtype not in (torch.uint8, torch.float32):
        raise TypeError(f"images are {images.dtype}: batches carry uint8 pixels (spmd_rfdetr.data.batches.build_split), "
                        "which this normalises")

    def const(values: Any) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=images.device)

    mean, std = const(PIXEL_MEAN).view(1, -1, 1, 1), const(PIXEL_STD).view(1, -1, 1, 1)
    return (images.to(torch.float32) * const(1 / 255) - mean) / std


def upstream_float(images: torch.Tensor) -> torch.Tensor:
    """rfdetr's own host steps on uint8 pixels ``[B, 3, H, W]`` (its ``ToDtype(float32, scale=True)``, then its
    ``Normalize``, image by image): the float input upstream's model gets for these pixels."""
    if images.dtype != torch.uint8:
        raise TypeError(f"upstream's ToDtype(float32, scale=True) scales uint8 pixels only, got {images.dtype}")
    to_float, normalize = ToDtype(torch.float32, scale=True), Normalize()
    return torch.stack([normalize(to_float(image), None)[0] for image in images])


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


def pad_target(target: dict[str, torch.Tensor], max_targets: int) -> dict[str, torch.Tensor]:
    """``boxes [T, 4]``, ``labels [T]``, ``valid [T]`` (and packed ``masks`` when the target has masks) for one image;
    beyond ``max_targets`` the largest boxes are kept."""
    boxes, labels, masks = target["boxes"], target["labels"], target.get("masks")
    if len(labels) > max_targets:
        keep = torch.argsort(boxes[:, 2] * boxes[:, 3], descending=True, stable=True)[:max_targets]
        boxes, labels = boxes[keep], labels[keep]
        masks = masks[keep] if masks is not None else None
    n = len(labels)
    padded_boxes = torch.zeros(max_targets, 4, dtype=torch.float32)
    padded_labels = torch.zeros(max_targets, dtype=torch.int64)
    padded_boxes[:n], padded_labels[:n] = boxes, labels
    padded = {"boxes": padded_boxes, "labels": padded_labels, "valid": torch.arange(max_targets) < n}
    if masks is not None:
        padded["masks"] = pack_masks(masks, max_targets)
    return padded


class StaticCollate:
    """Collate rfdetr samples into one fixed-shape batch dict (picklable, for DataLoader workers).

    Samples of a multi-scale batch carry the batch's size (``(image, target, size)``): the stacked images are then
    resized to it as rfdetr's per-batch multi-scale does (bilinear, on the collated batch; boxes are normalised, so
    they stay). The resize runs in float32 on the pixel values, so such a batch carries float32 pixels (0..255, not
    normalised): rounding it back to uint8 moved the first losses by up to 2e-3 from upstream's resize of its float
    input (measured on the tiny models), where float32 agrees to rounding."""

    def __init__(self, max_targets: int, resolution: int, float_pixels: bool = False) -> None:
        self.max_targets = max_targets
        self.resolution = resolution
        self.float_pixels = float_pixels  # rfdetr's normalised float samples let through (benchmarks/: its pipeline)

    def __call__(self, samples: Sequence[tuple[Any, ...]]) -> dict[str, torch.Tensor]:
        size = samples[0][2] if len(samples[0]) == 3 else None
        batch = self._collate([sample[:2] for sample in samples])
        if size is not None and size != self.resolution:
            batch["images"] = torch.nn.functional.interpolate(batch["images"].float(), size=size, mode="bilinear",
                                                              align_corners=False)
        return batch

    def _collate(self, samples: Sequence[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        expected = (3, self.resolution, self.resolution)
        for image, target in samples:
            if image.dtype != torch.uint8 and not self.float_pixels:  # a float sample is rfdetr's normalised input: normalised twice, silently
                raise TypeError(f"image_id {int(target['image_id'])}: {image.dtype} pixels, expected uint8: every "
                                "program normalises pixels itself, so read splits with spmd_rfdetr.data.batches.build_split "
                                "(rfdetr's transforms, pixels left uint8), not rfdetr's build_dataset")
            if tuple(image.shape) != expected:
                raise ValueError(
                    f"image_id {int(target['image_id'])}: transformed to {tuple(image.shape)}, expected {expected}; "
                    "static batches need one resolution (with data.multi_scale the train split reads images at the "
                    "largest scale and each batch is resized to its bucket)"
                )
        padded = [pad_target(t, self.max_targets) for _, t in samples]
        batch = {"images": torch.stack([image for image, _ in samples])}
        batch.update({key: torch.stack([p[key] for p in padded]) for key in padded[0]})
        batch["image_id"] = torch.stack([t["image_id"].reshape(()).to(torch.int64) for _, t in samples])
        batch["orig_size"] = torch.stack([t["orig_size"].to(torch.int64) for _, t in samples])
        return batch


def blank_batch(rows: int, size: int, max_targets: int, read_at: int | None = None, masks: bool = False,
                ) -> dict[str, torch.Tensor]:
    """A host batch of zeros shaped as the train loader's batches of ``rows`` images at ``size`` (collated by
    :class:`StaticCollate` itself, so keys, shapes and dtypes match): compiling a bucket's program needs only that.
    ``read_at``: the size a multi-scale train split reads images at (a bucket of another size is resized: float32);
    ``masks``: with instance masks (the ``seg-*`` variants)."""
    read_at = size if read_at is None else read_at
    target = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
              "image_id": torch.zeros((), dtype=torch.int64), "orig_size": torch.tensor([read_at, read_at])}
    if masks:
        target["masks"] = torch.zeros(0, read_at, read_at, dtype=torch.bool)
    image = torch.zeros(3, read_at, read_at, dtype=torch.uint8)
    return StaticCollate(max_targets, read_at)([(image, target, size)] * rows)


class TrainBatches(Sampler[list[tuple[int, int]]]):
    """Endless shuffled training batches, each a list of ``(epoch, index)``: a pure function of the seed and the step.

    Epoch ``e`` is a permutation drawn from ``seed`` and ``e`` alone (the last partial batch is dropped), so the
    batches from ``start_step`` on are exactly those a run started at step 0 sees from there: what exact resume needs.
    ``host`` = ``(index, count)``: on several hosts each yields only its rows of every global batch
    (:func:`~spmd_rfdetr.xla.hosts.host_rows`). With ``scales`` (multi-scale buckets) each key also names the size its
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
    host: tuple[int, int] = (0, 1), scales: Sequence[int] = (), float_pixels: bool = False,
) -> DataLoader[dict[str, torch.Tensor]]:
    """Endless reproducible static batches of ``data.global_batch_size`` (:class:`TrainBatches`,
    :class:`SeededSamples`), starting with the batch of the 0-based ``start_step``; ``host`` = ``(index, count)``
    loads only this host's rows of each; ``scales``: multi-scale buckets (``resolution`` is then the largest, the size
    the train split reads images at); ``float_pixels``: rfdetr's float samples pass (a loader benchmark; training
    refuses them, :class:`StaticCollate`)."""
    if len(dataset) < data.global_batch_size:  # type: ignore[arg-type]
        raise ValueError(
            f"{data.dataset_dir}: the train split has {len(dataset)} images, fewer than "  # type: ignore[arg-type]
            f"data.global_batch_size={data.global_batch_size}"
        )
    batches = TrainBatches(len(dataset), data.global_batch_size, seed, start_step, host, scales)  # type: ignore[arg-type]
    return DataLoader(SeededSamples(dataset, seed), batch_sampler=batches, num_workers=worker_count(data.num_workers),
                      collate_fn=StaticCollate(data.max_targets, resolution, float_pixels))


"""Static-shape batches from rfdetr's own dataset readers and transforms.

Every batch is one dict with fixed shapes, so the training step compiles once:
``images`` [B, 3, R, R] uint8, ``boxes`` [B, T, 4] (normalised cxcywh), ``labels`` [B, T] int64, ``valid`` [B, T] bool,
``image_id`` [B] int64, ``orig_size`` [B, 2] int64 (h, w), with T = ``data.max_targets``; for the ``seg-*`` variants
also ``masks`` [B, T, R, ceil(R/8)] uint8, each target's instance mask at the input resolution, bit-packed
(:func:`spmd_rfdetr.model.masks.pack_masks`: 8x fewer bytes than rfdetr's bool masks, read on the device at points).

Pixels travel as uint8 (:mod:`spmd_rfdetr.data.pixels`); the splits and the overflow policy:
:mod:`spmd_rfdetr.data.splits`.

Multi-scale training (``data.multi_scale``, rfdetr's default recipe; instance masks stay at the size read, as rfdetr's
per-batch resize leaves them: they are sampled at normalised points): the train split is read at the largest of
rfdetr's scales for the model (``compute_multi_scale_scales`` with its default ``expanded_scales``, e.g. 64...288 for a
128-pixel model) and each batch is resized to one size drawn per step exactly as rfdetr draws it
(``random.Random(step).choice(scales)``: the same size at the same step as an upstream run, and a pure function of the
step, so resume stays exact). Every size is a bucket: a static batch shape with its own compiled training program
(replay keeps one program per batch signature); ``data.scales`` keeps some of rfdetr's sizes only. In ``replay`` mode
``fit`` compiles every bucket's program before step 1 (``setup.precompile_buckets``, one log line each: ``multi-scale:
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

import random
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from spmd_rfdetr.config.options import DataOptions
from spmd_rfdetr.config.resolve import worker_count
from spmd_rfdetr.data.pixels import require_uint8
from spmd_rfdetr.model.masks import pack_masks
from spmd_rfdetr.xla.hosts import host_rows




def pad_target(target: dict[str, torch.Tensor], max_targets: int) -> dict[str, torch.Tensor]:
    """``boxes [T, 4]``, ``labels [T]``, ``valid [T]`` (and packed ``masks``, ``keypoints [T, K, 3]`` when the target
    has them) for one image; beyond ``max_targets`` the largest boxes are kept. Padding rows are zeros."""
    boxes, labels, masks, keypoints = target["boxes"], target["labels"], target.get("masks"), target.get("keypoints")
    if len(labels) > max_targets:
        keep = torch.argsort(boxes[:, 2] * boxes[:, 3], descending=True, stable=True)[:max_targets]
        boxes, labels = boxes[keep], labels[keep]
        masks = masks[keep] if masks is not None else None
        keypoints = keypoints[keep] if keypoints is not None else None
    n = len(labels)
    padded_boxes = torch.zeros(max_targets, 4, dtype=torch.float32)
    padded_labels = torch.zeros(max_targets, dtype=torch.int64)
    padded_boxes[:n], padded_labels[:n] = boxes, labels
    padded = {"boxes": padded_boxes, "labels": padded_labels, "valid": torch.arange(max_targets) < n}
    if masks is not None:
        padded["masks"] = pack_masks(masks, max_targets)
    if keypoints is not None:
        padded["keypoints"] = torch.zeros(max_targets, *keypoints.shape[1:], dtype=torch.float32)
        padded["keypoints"][:n] = keypoints
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
            if not self.float_pixels:  # the loader benchmark's float pipeline passes
                require_uint8(image, target)
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
                keypoints: int = 0) -> dict[str, torch.Tensor]:
    """A host batch of zeros shaped as the train loader's batches of ``rows`` images at ``size`` (collated by
    :class:`StaticCollate` itself, so keys, shapes and dtypes match): compiling a bucket's program needs only that.
    ``read_at``: the size a multi-scale train split reads images at (a bucket of another size is resized: float32);
    ``masks``: with instance masks (the ``seg-*`` variants); ``keypoints``: with that many keypoints per target."""
    read_at = size if read_at is None else read_at
    target = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
              "image_id": torch.zeros((), dtype=torch.int64), "orig_size": torch.tensor([read_at, read_at])}
    if masks:
        target["masks"] = torch.zeros(0, read_at, read_at, dtype=torch.bool)
    if keypoints:
        target["keypoints"] = torch.zeros(0, keypoints, 3)
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


#: Held while a sample is read with the global host RNGs seeded (:class:`SeededSamples`), and by ``fit`` around an
#: evaluation: with ``data.num_workers: 0`` samples are read in the loader's prefetch thread, and an evaluation's
#: use of torch's global RNG on the main thread (a DataLoader's ``iter()``, dynamo saving and restoring the RNG while
#: it compiles) landing inside a sample's augmentations changed that sample's flip or crop at random (measured
#: 2026-12-06: the first train batch loaded during an evaluation, about one run in three).
HOST_RNG = threading.RLock()


class SeededSamples(Dataset):  # type: ignore[type-arg]
    """Reads ``dataset[index]`` for a ``(epoch, index)`` key with the host RNGs seeded from (seed, epoch, index).

    rfdetr's augmentations draw from torch's, Python's and NumPy's global RNGs; seeding them per sample makes every
    augmented image a function of its key, independent of worker count, prefetching and where a run resumed. The
    caller's RNG states are restored afterwards. The read holds :data:`HOST_RNG`.
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
        with HOST_RNG, torch.random.fork_rng(devices=[]):
            py_state, np_state = random.getstate(), np.random.get_state()
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

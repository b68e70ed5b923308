"""Static eval batches: each process loads its rows of every global batch, a partial batch padded with blank rows."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from spmd_rfdetr.data.pixels import require_uint8
from spmd_rfdetr.xla import hosts


class EvalCollate:
    """Batch ``(image, target)`` samples to a FIXED number of rows (this host's share of a global eval batch): a
    partial batch is padded.

    Returns ``images`` [rows,3,R,R], ``orig_size`` [rows,2] (h, w) and ``image_id`` [rows], -1 for padding. Padding rows
    are blank images of size (R, R): they run through the same compiled graph and are dropped on the host (by their
    id) before anything is scored.
    """

    def __init__(self, rows: int, resolution: int) -> None:
        self.rows = rows
        self.resolution = resolution

    def __call__(self, samples: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        r, b = self.resolution, self.rows
        for image, target in samples:
            require_uint8(image, target)
            if tuple(image.shape) != (3, r, r):
                raise ValueError(
                    f"image_id {int(target['image_id'])}: transformed to {tuple(image.shape)}, expected {(3, r, r)}; "
                    "static eval batches need one resolution"
                )
        images = torch.zeros(b, 3, r, r, dtype=torch.uint8)  # uint8 pixels, normalised on the device
        orig_size = torch.full((b, 2), r, dtype=torch.int64)
        image_id = torch.full((b,), -1, dtype=torch.int64)
        for i, (image, target) in enumerate(samples):
            images[i] = image
            orig_size[i] = target["orig_size"].to(torch.int64)
            image_id[i] = int(target["image_id"].reshape(()))
        return {"images": images, "orig_size": orig_size, "image_id": image_id}


class EvalBatches(Sampler[list[int]]):
    """The dataset indices this process loads of every global eval batch: consecutive global batches of
    ``global_batch_size`` (the last one partial), of which slice ``share[0]`` of ``share[1]`` (:func:`~spmd_rfdetr.
    hosts.host_rows`); indices past the end are left out (:class:`EvalCollate` pads them)."""

    def __init__(self, size: int, global_batch_size: int, share: tuple[int, int] = (0, 1)) -> None:
        self.size, self.global_batch_size, self.share = size, global_batch_size, share

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(0, self.size, self.global_batch_size):
            rows = hosts.host_rows(list(range(start, start + self.global_batch_size)), *self.share)
            yield [i for i in rows if i < self.size]

    def __len__(self) -> int:
        return math.ceil(self.size / self.global_batch_size)


def eval_loader(dataset: Dataset[Any], global_batch_size: int, resolution: int, num_workers: int = 0,
                share: tuple[int, int] | None = None) -> DataLoader:
    """Sequential loader of padded static batches: this process's rows (``share``, default :func:`~spmd_rfdetr.
    hosts.batch_share`) of every global batch of ``global_batch_size``. Its ``iter()`` draws nothing from torch's
    global RNG, which the train samples are seeded through (:data:`~spmd_rfdetr.data.batches.HOST_RNG`)."""
    share = hosts.batch_share() if share is None else share
    return DataLoader(
        dataset,
        batch_sampler=EvalBatches(len(dataset), global_batch_size, share),  # type: ignore[arg-type]
        num_workers=num_workers,
        collate_fn=EvalCollate(global_batch_size // share[1], resolution),
        persistent_workers=num_workers > 0,
        generator=torch.Generator(),  # a DataLoader's iter() draws its base seed from this
    )

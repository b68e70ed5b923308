"""Pixels: uint8 on the host, normalised on the device.

Pixels travel as uint8, a quarter of the bytes of rfdetr's float32 input: rfdetr's transforms run on the host except
their last two steps (``ToDtype(float32, scale=True)`` and the image half of ``Normalize``), which
:func:`normalize_images` runs on the device inside every compiled program that feeds the model.
"""

from __future__ import annotations

from typing import Any

import torch
from rfdetr.datasets.transforms import Normalize
from torchvision.transforms.v2 import ToDtype


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
        raise TypeError(f"images are {images.dtype}: batches carry uint8 pixels (spmd_rfdetr.data.splits.build_split), "
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


def require_uint8(image: torch.Tensor, target: dict[str, torch.Tensor]) -> None:
    """A collate's guard on one sample: uint8 pixels only. Every program normalises pixels itself
    (:func:`normalize_images`): rfdetr's own float sample is normalised already and would be normalised twice."""
    if image.dtype != torch.uint8:
        raise TypeError(f"image_id {int(target['image_id'])}: {image.dtype} pixels, expected uint8: every program "
                        "normalises pixels itself, so read splits with spmd_rfdetr.data.splits.build_split (rfdetr's "
                        "transforms, pixels left uint8), not rfdetr's build_dataset")

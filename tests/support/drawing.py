"""Checks of ``predict --save_images`` drawings against the images they were drawn on (no XLA of their own)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

#: Room a "name score" label takes above a box's top-left corner (supervision's LabelAnnotator at its defaults:
#: text scale 0.5 plus 10 px padding is about 130 x 30 px for "rectangle 0.87"), generously.
LABEL_W, LABEL_H = 200, 40
#: Pixels around anything drawn that may change: a JPEG re-encodes 16 x 16 blocks (and upsamples chroma across them).
JPEG_MARGIN, PNG_MARGIN = 24, 2


def original_pixels(path: Path, like: Path) -> np.ndarray:
    """The image ``path`` as predict decoded it (rfdetr's decoder), through the encoder ``like`` was saved with: a
    JPEG drawing is compared with the original re-encoded at the same quality (blocks nothing was drawn on then
    decode to the same pixels)."""
    from rfdetr.datasets.io_utils import decode_pil_image

    from spmd_rfdetr.eval.draw import JPEG_QUALITY

    image = decode_pil_image(path)[0].convert("RGB")
    if like.suffix.lower() in (".jpg", ".jpeg"):
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=JPEG_QUALITY)
        image = Image.open(buffer).convert("RGB")
    return np.asarray(image, np.int64)


def box_zones(shape: tuple[int, int], rows: list[dict[str, Any]], margin: int) -> np.ndarray:
    """``[H, W]`` bool: where the results' boxes, labels, masks and keypoints may have been drawn (grown by
    ``margin``)."""
    from pycocotools import mask as mask_util
    from scipy.ndimage import binary_dilation

    zone = np.zeros(shape, bool)
    for row in rows:
        x, y, w, h = row["bbox"]
        x0, y0, x1, y1 = int(x), int(y), int(x + w) + 1, int(y + h) + 1
        zone[max(0, y0 - LABEL_H):max(0, y1), max(0, x0):max(0, x1, x0 + LABEL_W)] = True
        points = np.asarray(row.get("keypoints", []), np.float64).reshape(-1, 3)[:, :2]
        points = points[(points != 0).any(1)]
        if len(points):  # keypoints (radius 3) and the skeleton between them: within their bounding rectangle
            (px0, py0), (px1, py1) = points.min(0).astype(int) - 3, points.max(0).astype(int) + 4
            zone[max(0, py0):max(0, py1), max(0, px0):max(0, px1)] = True
        if "segmentation" in row:
            zone |= mask_util.decode(row["segmentation"]) > 0
    return binary_dilation(zone, np.ones((2 * margin + 1, 2 * margin + 1), bool)) if zone.any() else zone


def check_drawing(original: Path, drawn: Path, rows: list[dict[str, Any]]) -> dict[str, float]:
    """``drawn`` (one image's drawing of ``rows``, the detections drawn) has the original's size; its pixels away from
    every box, label and mask are the original's (exactly, after the same encoder); each box's left and bottom edges
    changed (mean over the edge of the summed RGB change > 30). Returns the changed and unchanged pixel counts."""
    assert drawn.is_file(), drawn
    before = original_pixels(original, drawn)
    after = np.asarray(Image.open(drawn).convert("RGB"), np.int64)
    assert after.shape == before.shape, (drawn, after.shape, before.shape)
    change = np.abs(after - before).sum(-1)
    margin = JPEG_MARGIN if drawn.suffix.lower() in (".jpg", ".jpeg") else PNG_MARGIN
    far = ~box_zones(change.shape, rows, margin)
    assert (change[far] == 0).all(), (drawn, int((change[far] > 0).sum()), "pixels changed away from every box")
    height, width = change.shape
    for row in rows:
        x, y, w, h = row["bbox"]
        x0, x1 = min(int(x), width - 1), min(int(x + w), width - 1)
        y0, y1 = min(int(y), height - 1), min(int(y + h), height - 1)
        edges = np.concatenate([change[y0:y1 + 1, x0], change[y1, x0:x1 + 1]])
        assert edges.mean() > 30, (drawn, row["bbox"], edges.mean())
    return {"far": int(far.sum()), "changed": int((change > 0).sum())}


def mask_interior(row: dict[str, Any]) -> np.ndarray:
    """``[H, W]`` bool: a seg result's mask away from its box's edges and its label (where only the mask is drawn)."""
    from pycocotools import mask as mask_util

    x, y, w, h = (int(v) for v in row["bbox"])
    inside = mask_util.decode(row["segmentation"]) > 0
    inside[max(0, y - LABEL_H):max(0, y + 4), max(0, x - 3):max(0, x + LABEL_W)] = False  # the label
    edges = np.zeros_like(inside)
    edges[max(0, y - 3):max(0, y + h + 4), max(0, x - 3):max(0, x + w + 4)] = True
    edges[max(0, y + 4):max(0, y + h - 3), max(0, x + 4):max(0, x + w - 3)] = False  # the box's outline, 2 px wide, with room
    return inside & ~edges


#: Fewest interior pixels a mask needs for the fraction of them that changed to say something.
MIN_INTERIOR = 10


def changed_inside_masks(before: np.ndarray, after: np.ndarray, rows: list[dict[str, Any]]) -> list[float]:
    """Per seg result with at least :data:`MIN_INTERIOR` pixels of :func:`mask_interior`, the fraction of them that
    changed."""
    changed = np.abs(after.astype(np.int64) - before.astype(np.int64)).sum(-1) > 0
    fractions = []
    for row in rows:
        inside = mask_interior(row)
        if inside.sum() >= MIN_INTERIOR:
            fractions.append(float(changed[inside].mean()))
    return fractions


def changed_at_keypoints(before: np.ndarray, after: np.ndarray, rows: list[dict[str, Any]]) -> list[bool]:
    """For each keypoint of the results inside the image (not supervision's (0, 0) for "none"), whether its pixel
    changed."""
    changed = np.abs(after.astype(np.int64) - before.astype(np.int64)).sum(-1) > 0
    height, width = changed.shape
    out = []
    for row in rows:
        for x, y, _ in np.asarray(row["keypoints"], np.float64).reshape(-1, 3):
            if (x, y) != (0, 0) and 0 <= x < width and 0 <= y < height:
                out.append(bool(changed[int(y), int(x)]))
    return out

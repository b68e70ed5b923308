"""A synthetic shapes detection dataset, written on disk exactly like a Roboflow "COCO" export.

Layout: ``DIR/{train,valid,test}/`` each with JPEG images and ``_annotations.coco.json``. Categories follow the
Roboflow convention: id 0 is the dataset's root ("shapes", ``supercategory: "none"``, never annotated) and the real
classes are ids ``1..N`` with ``supercategory: "shapes"``. rfdetr's reader drops that unannotated root
(``rfdetr.datasets.coco.filter_parent_categories``), so labels are ``0..N-1`` and the inferred class count is ``N``.

Each object is a flat-coloured shape in its own grid cell with a gap of at least 2 px to its neighbours, so shapes
never touch or occlude and every box is the exact tight bounding box of the shape's drawn pixels. Each annotation's
``segmentation`` is the shape's drawn pixels, exactly, as a compressed COCO RLE (``{"size": [H, W], "counts": str}``):
rfdetr's segmentation reader (``rfdetr.datasets.coco.convert_coco_poly_to_mask``) and pycocotools (``annToMask``,
``COCOeval``) decode it as is, and unlike a polygon it keeps a ring's hole and every edge pixel. ``area`` stays the
box's ``w * h`` (what detection runs have always read).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from pycocotools import mask as coco_mask

from spmd_rfdetr.config.options import ConfigError

SPLITS = ("train", "valid", "test")
#: Shape kind per class index, with its colour: the class is readable from shape and from colour alike.
SHAPES = ("rectangle", "ellipse", "triangle", "cross", "diamond", "ring")
COLOURS = ((220, 40, 40), (30, 160, 60), (40, 80, 220), (235, 170, 20), (180, 40, 180), (20, 170, 190))
SUPERCATEGORY = "shapes"
#: The keypoints every class names, in order (``synth(keypoints=True)``).
KEYPOINT_NAMES = ("top", "right", "bottom", "left", "centre")
MIN_IMAGE_SIZE = 64
MAX_IMAGE_SIZE = 2048
_CELL_MIN = 10  # smallest grid cell (px): a shape of >= 8 px plus a 1 px margin on each side


@dataclass(frozen=True)
class SynthImage:
    """One rendered image before JPEG encoding, with what was drawn in it."""

    pixels: np.ndarray  # (H, W, 3) uint8
    labels: list[int]  # 0-based class index per object; COCO category_id is label + 1
    masks: np.ndarray  # (N, H, W) bool, the pixels of each shape
    boxes: list[list[int]]  # COCO [x, y, w, h] of each mask's tight bounding box
    keypoints: np.ndarray  # (N, 5, 3) float: x, y (pixel centres) and COCO visibility of KEYPOINT_NAMES


def _grid(n: int) -> tuple[int, int]:
    """Columns and rows of the smallest near-square grid holding ``n`` cells (columns >= rows)."""
    cols = math.ceil(math.sqrt(n))
    return cols, math.ceil(n / cols)


def _draw(draw: ImageDraw.ImageDraw, kind: str, x0: int, y0: int, w: int, h: int) -> None:
    """Draw one filled shape of ``kind`` inside the box ``[x0, x0 + w) x [y0, y0 + h)`` of a mask."""
    x1, y1, cx, cy = x0 + w - 1, y0 + h - 1, x0 + (w - 1) / 2, y0 + (h - 1) / 2
    if kind == "rectangle":
        draw.rectangle((x0, y0, x1, y1), fill=255)
    elif kind == "ellipse":
        draw.ellipse((x0, y0, x1, y1), fill=255)
    elif kind == "triangle":
        draw.polygon(((cx, y0), (x1, y1), (x0, y1)), fill=255)
    elif kind == "diamond":
        draw.polygon(((cx, y0), (x1, cy), (cx, y1), (x0, cy)), fill=255)
    elif kind == "cross":
        t = max(2, round(min(w, h) / 3))
        draw.rectangle((x0, round(cy - t / 2), x1, round(cy + t / 2)), fill=255)
        draw.rectangle((round(cx - t / 2), y0, round(cx + t / 2), y1), fill=255)
    else:  # ring
        t = max(2, round(min(w, h) / 4))
        draw.ellipse((x0, y0, x1, y1), fill=255)
        draw.ellipse((x0 + t, y0 + t, x1 - t, y1 - t), fill=0)


def _keypoints(kind: str, mask: np.ndarray, box: list[int]) -> list[list[float]]:
    """``KEYPOINT_NAMES`` of one drawn shape: its extreme pixels (a triangle: apex, base corners and base midpoint)
    and its box centre, ``[x + 0.5, y + 0.5, v]`` each; ``v`` is 2 on the shape's pixels, 1 off them."""
    x0, y0, w, h = box
    x1, y1, cx, cy = x0 + w - 1, y0 + h - 1, x0 + (w - 1) // 2, y0 + (h - 1) // 2
    if kind == "triangle":
        xs, ys = np.nonzero(mask[y1])[0], np.nonzero(mask[y0])[0]
        points = [(int(ys.mean().round()), y0), (int(xs.max()), y1), (cx, y1), (int(xs.min()), y1)]
    else:
        rows, cols = np.nonzero(mask[:, cx])[0], np.nonzero(mask[cy])[0]
        points = [(cx, int(rows.min())), (int(cols.max()), cy), (cx, int(rows.max())), (int(cols.min()), cy)]
    points.append((cx, cy))
    return [[x + 0.5, y + 0.5, 2.0 if mask[y, x] else 1.0] for x, y in points]


def render_image(
    seed: int, split: str, index: int, image_size: int, num_classes: int, min_objects: int, max_objects: int
) -> SynthImage:
    """Render image ``index`` of ``split``; a pure function of its arguments (``synth`` writes exactly this)."""
    rng = np.random.default_rng([seed, SPLITS.index(split), index])
    size = image_size
    n = int(rng.integers(min_objects, max_objects + 1))
    cols, rows = _grid(n)
    if rng.random() < 0.5:
        cols, rows = rows, cols
    cells = rng.permutation(cols * rows)[:n]
    xs, ys = [i * size // cols for i in range(cols + 1)], [j * size // rows for j in range(rows + 1)]
    lo, hi = max(8, round(0.12 * size)), round(0.45 * size)
    background = rng.integers(150, 231) + rng.integers(-12, 13, size=3)
    noise = rng.normal(0.0, rng.uniform(0.0, 6.0), size=(size, size, 3))
    pixels = np.clip(background + noise, 0, 255).round().astype(np.uint8)
    labels, masks, boxes, keypoints = [], [], [], []
    for cell in cells:
        cx0, cx1 = xs[cell % cols] + 1, xs[cell % cols + 1] - 1  # 1 px margin inside the cell
        cy0, cy1 = ys[cell // cols] + 1, ys[cell // cols + 1] - 1
        cell_hi = min(hi, cx1 - cx0, cy1 - cy0)
        cell_lo = min(lo, cell_hi)
        w = int(rng.integers(cell_lo, cell_hi + 1))
        h = int(np.clip(round(w * math.exp(rng.uniform(-0.3, 0.3))), cell_lo, cell_hi))
        x0 = cx0 + int(rng.integers(0, cx1 - cx0 - w + 1))
        y0 = cy0 + int(rng.integers(0, cy1 - cy0 - h + 1))
        label = int(rng.integers(num_classes))
        canvas = Image.new("L", (size, size), 0)
        _draw(ImageDraw.Draw(canvas), SHAPES[label], x0, y0, w, h)
        mask = np.asarray(canvas) > 0
        pixels[mask] = COLOURS[label]
        rows_hit, cols_hit = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
        bx, by = int(cols_hit[0]), int(rows_hit[0])
        boxes.append([bx, by, int(cols_hit[-1]) - bx + 1, int(rows_hit[-1]) - by + 1])
        keypoints.append(_keypoints(SHAPES[label], mask, boxes[-1]))
        labels.append(label)
        masks.append(mask)
    return SynthImage(pixels, labels, np.stack(masks), boxes, np.array(keypoints, dtype=np.float64))


def rle(mask: np.ndarray) -> dict[str, object]:
    """The exact compressed COCO RLE of a (H, W) bool mask, its ``counts`` a str so that it can be written as JSON."""
    encoded = coco_mask.encode(np.asfortranarray(mask, dtype=np.uint8))
    return {"size": [int(v) for v in encoded["size"]], "counts": encoded["counts"].decode("ascii")}


def categories(num_classes: int, keypoints: bool = False) -> list[dict[str, object]]:
    """Roboflow-style COCO categories: the unannotated root (id 0) and classes ``1..num_classes`` (with
    ``keypoints``: each names :data:`KEYPOINT_NAMES`, its skeleton the centre to each other point, 1-based)."""
    root = {"id": 0, "name": SUPERCATEGORY, "supercategory": "none"}
    classes = [{"id": i + 1, "name": SHAPES[i], "supercategory": SUPERCATEGORY} for i in range(num_classes)]
    if keypoints:
        centre = len(KEYPOINT_NAMES)
        for category in classes:
            category.update(keypoints=list(KEYPOINT_NAMES), skeleton=[[k, centre] for k in range(1, centre)])
    return [root] + classes


def _check(output_dir: str, counts: dict[str, int], image_size: int, num_classes: int, min_objects: int,
           max_objects: int, seed: int) -> None:
    """Raise :class:`ConfigError` (a ``ValueError``) naming the first bad argument of :func:`synth`."""
    if not output_dir:
        raise ConfigError("output_dir must be a non-empty path")
    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output_dir={output_dir!r} exists and is not an empty directory; remove it or pick another")
    for name, count in counts.items():
        if count < (0 if name == "test_images" else 1):
            raise ConfigError(f"{name} must be >= {0 if name == 'test_images' else 1}, got {count}")
    if not MIN_IMAGE_SIZE <= image_size <= MAX_IMAGE_SIZE:
        raise ConfigError(f"image_size must be between {MIN_IMAGE_SIZE} and {MAX_IMAGE_SIZE}, got {image_size}")
    if not 1 <= num_classes <= len(SHAPES):
        raise ConfigError(f"num_classes must be between 1 and {len(SHAPES)} (shape kinds {SHAPES}), got {num_classes}")
    if max_objects < 1 or image_size // _grid(max_objects)[0] < _CELL_MIN:
        cols = _grid(max(max_objects, 1))[0]
        raise ConfigError(f"max_objects={max_objects} must be >= 1 and fit image_size={image_size} "
                         f"(a {cols}-column grid needs image_size >= {cols * _CELL_MIN})")
    if not 1 <= min_objects <= max_objects:
        raise ConfigError(f"min_objects must be between 1 and max_objects={max_objects}, got {min_objects}")
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}")


def synth(
    output_dir: str,
    train_images: int = 256,
    valid_images: int = 64,
    test_images: int = 32,
    image_size: int = 160,
    num_classes: int = 3,
    max_objects: int = 6,
    seed: int = 0,
    min_objects: int = 1,
    keypoints: bool = False,
) -> Path:
    """Write a synthetic shapes dataset in Roboflow's COCO layout, to try every verb without a dataset of your own.

    Each object has its box and exact mask (RLE ``segmentation``); with ``keypoints``, five COCO keypoints.

    Args:
        output_dir: Dataset root to create; must not exist or be an empty directory. Gets ``train/``, ``valid/`` and
            ``test/``, each with JPEG images and ``_annotations.coco.json``.
        train_images: Number of images in the train split (>= 1).
        valid_images: Number of images in the valid split (>= 1).
        test_images: Number of images in the test split (>= 0; an empty split still gets its annotation file).
        image_size: Side of the square images in pixels (64 to 2048).
        num_classes: Number of classes, 1 to 6; class ``i`` is always the same shape in the same colour (rectangle,
            ellipse, triangle, cross, diamond, ring).
        max_objects: Most objects per image. Shapes shrink to fit many objects (each gets a grid cell, at least
            10 px), so image_size must be >= 10 * ceil(sqrt(max_objects)).
        seed: Random seed (>= 0). The same arguments give byte-identical files; each image depends only on
            ``seed``, its split and its index.
        min_objects: Fewest objects per image (1 to max_objects); the count is uniform in
            ``[min_objects, max_objects]``.
        keypoints: Also write COCO keypoints (a Roboflow keypoint export's layout): ``top, right, bottom, left,
            centre`` of every shape, visibility 2 on the shape, 1 off it (a ring's centre).

    Returns:
        The dataset root, resolved.

    Raises:
        ConfigError: (a ``ValueError``) If an argument is out of range; the message names it.
    """
    counts = {"train_images": train_images, "valid_images": valid_images, "test_images": test_images}
    _check(output_dir, counts, image_size, num_classes, min_objects, max_objects, seed)
    root = Path(output_dir).resolve()
    summary = []
    for split, count in zip(SPLITS, counts.values()):
        (root / split).mkdir(parents=True, exist_ok=True)
        images, annotations = [], []
        for index in range(count):
            image = render_image(seed, split, index, image_size, num_classes, min_objects, max_objects)
            file_name = f"{split}_{index:06d}.jpg"
            Image.fromarray(image.pixels).save(root / split / file_name, "JPEG", quality=95, subsampling=0)
            images.append({"id": index, "file_name": file_name, "width": image_size, "height": image_size})
            for label, box, mask, points in zip(image.labels, image.boxes, image.masks, image.keypoints):
                # Annotation ids start at 1: pycocotools' COCOeval reads a matched id of 0 as "unmatched".
                annotations.append({"id": len(annotations) + 1, "image_id": index, "category_id": label + 1,
                                    "bbox": box, "area": box[2] * box[3], "iscrowd": 0, "segmentation": rle(mask)})
                if keypoints:
                    annotations[-1].update(keypoints=[float(v) for v in points.ravel()],
                                           num_keypoints=int((points[:, 2] > 0).sum()))
        coco = {"info": {"description": "spmd_rfdetr synthetic shapes", "version": "1"},
                "categories": categories(num_classes, keypoints), "images": images, "annotations": annotations}
        (root / split / "_annotations.coco.json").write_text(json.dumps(coco), encoding="utf-8")
        summary.append(f"{split} {count} images / {len(annotations)} objects")
    print(f"synth: {root}: {', '.join(summary)} ({num_classes} classes, {image_size} px)")
    return root

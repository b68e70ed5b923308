"""The data check's mask part, for the ``seg-*`` variants: every object's COCO ``segmentation`` as rfdetr will read it.

rfdetr's reader (``rfdetr.datasets.coco.convert_coco_poly_to_mask``, with ``segmentation_head``) decodes polygons with
pycocotools' ``frPyObjects`` and compressed RLE as is, at the image's own size. A missing or empty ``segmentation``
becomes an all-zero mask (the object trains as "no pixels"), a polygon part of fewer than 3 points or a malformed RLE
stops the reader, an odd coordinate count loses the last one, an RLE of another size than the image stops training at
the first batch holding it, and polygon points past the edge are clipped. A box of no size drops the object, mask and
all. :mod:`spmd_rfdetr.data.check` calls :func:`mask_findings` on the COCO layouts; YOLO label lines are rfdetr's own parse
(a box-only line is read as its box's rectangle). Crowd annotations are not training targets and are not checked.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from spmd_rfdetr.data.files import Finding, SplitData

OUTSIDE_TOLERANCE_PX = 1.0  # as for boxes: exports round polygon points, this much past the edge is not a finding
#: kind -> (what it is, how to fix it); :data:`spmd_rfdetr.data.check_report.KINDS` holds these too.
MASK_KINDS: dict[str, tuple[str, str]] = {
    "missing_mask": ("object without a mask (model.variant is a seg-* model)", "add the object's 'segmentation' (a "
                     "polygon [[x1, y1, x2, y2, ...]] or an RLE {'size': [height, width], 'counts': ...}; re-export "
                     "the dataset with masks) or delete the annotation; rfdetr would train it as an empty mask"),
    "bad_mask": ("mask malformed or empty", "re-export the mask: each polygon needs >= 3 (x, y) points and some area, "
                 "an RLE 'size' [height, width] and 'counts' (a COCO-compressed str or run lengths) covering "
                 "height * width pixels; rfdetr's reader stops on it or trains an empty mask"),
    "mask_size": ("mask size differs from the image", "encode the RLE at the image's size ('size' is [height, width]); "
                  "rfdetr's reader would stop on it"),
    "mask_outside": ("mask outside the image", "correct the polygon; data.on_bad=skip lets rfdetr clip it to the "
                     "image (train split)"),
    "mask_without_box": ("mask without a box", "set 'bbox' to the mask's tight box [x, y, width, height] "
                         "(pycocotools.mask.toBbox); without one rfdetr drops the object (no size) or stops (missing)"),
}
Size = tuple[int, int] | None  # (width, height) of an image, or None when unknown


def mask_findings(data: SplitData, sizes: dict[str, Size], *, train: bool) -> list[Finding]:
    """Mask problems of the non-crowd objects of ``data``'s readable images (``sizes``: image name -> (width, height)
    as the check knows it); ``train``: the split ``fit`` trains on (clipped points are skippable there)."""
    checked = {box.ann: (entry, box) for entry in data.entries if entry.name in sizes for box in entry.boxes
               if not box.crowd}
    found: list[Finding] = []
    for source, coco in annotation_files(data):
        names = {image.get("id"): image.get("file_name") for image in coco.get("images", []) if isinstance(image, dict)}
        for i, ann in enumerate(coco.get("annotations", [])):
            if not isinstance(ann, dict) or ann.get("iscrowd", 0):
                continue
            where = f"annotation {ann.get('id', f'#{i}')}"  # as dataset_files names it
            if where in checked:
                entry, box = checked[where]
                found += _object_findings(ann, box.xyxy, sizes[entry.name], entry.name, data.split, str(source), train)
            elif "bbox" not in ann and ann.get("segmentation") and names.get(ann.get("image_id")) in sizes:
                found.append(Finding(data.split, str(source), "mask_without_box", "a mask, but no 'bbox' on "
                                     f"{Path(str(names[ann['image_id']])).name}", where, str(names[ann["image_id"]])))
    return found


def annotation_files(data: SplitData) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Each COCO annotation file of ``data``'s images, parsed (one read a moment ago and changed since is left out:
    the next check reports it)."""
    for source in dict.fromkeys(entry.source for entry in data.entries):
        try:
            yield source, json.loads(Path(source).read_bytes())
        except (OSError, ValueError):
            continue


def merge(findings: Sequence[Finding], masks: Sequence[Finding]) -> list[Finding]:
    """``findings`` and ``masks`` without the box findings a ``mask_without_box`` says better (one message each)."""
    said = {(f.split, f.file, f.ann) for f in masks if f.kind == "mask_without_box"}
    kept = [f for f in findings if (f.split, f.file, f.ann) not in said
            or not (f.kind == "degenerate_box" or (f.kind == "bad_schema" and f.detail == "missing 'bbox'"))]
    return kept + list(masks)


def cache_key(key: str) -> str:
    """The data check's cache key of a seg-* model: the detection key plus this module's source."""
    return hashlib.sha256(f"{key}:masks:".encode() + Path(__file__).read_bytes()).hexdigest()


def _object_findings(ann: dict[str, Any], xyxy: tuple[float, float, float, float], size: Size, image: str,
                     split: str, source: str, train: bool) -> list[Finding]:
    """The mask problems of one object with a box (``xyxy`` pixels) on ``image`` of ``size``."""
    x1, y1, x2, y2 = xyxy
    has_box = x2 > x1 and y2 > y1
    if size:  # rfdetr clamps the box to the image, then drops the object if the box has no size left
        x1, x2 = min(max(x1, 0), size[0]), min(max(x2, 0), size[0])
        y1, y2 = min(max(y1, 0), size[1]), min(max(y2, 0), size[1])
    kept = x2 > x1 and y2 > y1  # not kept: degenerate_box or box_outside says so already
    segmentation = ann.get("segmentation")
    on = f" on {Path(image).name}" + (f" ({size[0]}x{size[1]})" if size else "")

    def finding(kind: str, detail: str, skippable: bool = False) -> list[Finding]:
        return [Finding(split, source, kind, detail + on, f"annotation {ann.get('id')}", image, skippable)]

    if segmentation is None or segmentation == []:
        shown = "no 'segmentation'" if "segmentation" not in ann else f"'segmentation' is {json.dumps(segmentation)}"
        return finding("missing_mask", shown) if kept else []
    # rfdetr decodes every mask of an image before it drops objects: a malformed one stops it even then
    xs: list[float] = []
    ys: list[float] = []
    if isinstance(segmentation, dict):
        problem, empty, rle_size = _rle_problem(segmentation)
        if not problem and size and rle_size != [size[1], size[0]]:
            return finding("mask_size", f"RLE size {rle_size} ([height, width]), the image is [{size[1]}, {size[0]}]")
    elif isinstance(segmentation, list):
        problem, empty, xs, ys = _polygon_problem(segmentation)
    else:
        problem, empty = f"'segmentation' must be polygons or an RLE dict, got {type(segmentation).__name__}", ""
    if problem:
        return finding("bad_mask", problem)
    if empty:
        return finding("bad_mask", empty) if kept else []
    if not has_box:
        shown = f"[{xyxy[0]:g}, {xyxy[1]:g}, {xyxy[2]:g}, {xyxy[3]:g}] (x1 y1 x2 y2)"
        return finding("mask_without_box", f"a mask, but its box {shown} has no size", skippable=train)
    tol = OUTSIDE_TOLERANCE_PX
    if kept and xs and size and (min(xs + ys) < -tol or max(xs) > size[0] + tol or max(ys) > size[1] + tol):
        return finding("mask_outside", f"polygon points span x {min(xs):g}..{max(xs):g}, y {min(ys):g}..{max(ys):g}",
                       skippable=train)
    return []


def _polygon_problem(polygons: list[Any]) -> tuple[str, str, list[float], list[float]]:
    """A COCO polygon list's ``(what is malformed, why it is empty, x coordinates, y coordinates)`` ('': nothing)."""
    xs: list[float] = []
    ys: list[float] = []
    area = 0.0
    for i, polygon in enumerate(polygons):
        if not isinstance(polygon, list) or not all(_is_finite(v) for v in polygon):
            return f"polygon {i} must be a list of finite numbers [x1, y1, x2, y2, ...]", "", xs, ys
        if len(polygon) % 2:
            return f"polygon {i} has an odd number of coordinates ({len(polygon)}): one lacks its pair", "", xs, ys
        if len(polygon) < 6:
            return f"polygon {i} has {len(polygon) // 2} point(s), a polygon needs >= 3", "", xs, ys
        px, py = polygon[0::2], polygon[1::2]
        area += abs(sum(px[j - 1] * py[j] - px[j] * py[j - 1] for j in range(len(px)))) / 2
        xs += px
        ys += py
    return "", "" if area > 0 else "the polygon(s) have zero area (an empty mask)", xs, ys


def _rle_problem(rle: dict[str, Any]) -> tuple[str, str, list[int] | None]:
    """A COCO RLE dict's ``(what is malformed, why it is empty, its size)`` ('': nothing)."""
    size, counts = rle.get("size"), rle.get("counts")
    if not (isinstance(size, list) and len(size) == 2 and all(_is_int(v) and v > 0 for v in size)):
        return f"RLE 'size' must be [height, width], got {json.dumps(size)}", "", None
    if isinstance(counts, str):
        try:
            runs = _string_runs(counts)
        except ValueError as error:
            return f"RLE 'counts' unreadable ({error})", "", size
    elif isinstance(counts, list) and all(_is_int(v) and v >= 0 for v in counts):
        runs = counts
    else:
        return "RLE 'counts' must be a COCO-compressed str or a list of run lengths", "", size
    if sum(runs) != size[0] * size[1]:
        return f"RLE 'counts' cover {sum(runs)} pixels, its size {size} has {size[0] * size[1]}", "", size
    return "", "" if any(runs[1::2]) else "the RLE has no pixel set (an empty mask)", size


def _string_runs(counts: str) -> list[int]:
    """The run lengths of a COCO-compressed RLE string (pycocotools' ``rleFrString``, which does not check them)."""
    runs: list[int] = []
    i = 0
    while i < len(counts):
        value = shift = 0
        more = True
        while more:
            if i == len(counts):
                raise ValueError("ends inside a number")
            c = ord(counts[i]) - 48
            if not 0 <= c < 64:
                raise ValueError(f"{counts[i]!r} at {i} is not an RLE character")
            value |= (c & 0x1F) << shift
            more, shift, i = bool(c & 0x20), shift + 5, i + 1
            if not more and c & 0x10:  # sign bit of the last 5-bit group
                value |= -1 << shift
        if len(runs) > 2:  # runs after the second are stored as differences
            value += runs[-2]
        if value < 0:
            raise ValueError(f"run {len(runs)} is negative")
        runs.append(value)
    return runs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

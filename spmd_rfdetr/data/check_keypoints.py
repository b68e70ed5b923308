"""The data check's keypoint part, for rfdetr's keypoint model: every object's COCO ``keypoints`` as rfdetr will read it.

rfdetr's COCO reader (``ConvertCoco`` with ``include_keypoints``) reads ``[x1, y1, v1, x2, y2, v2, ...]`` in pixels into
``max(num_keypoints_per_class)`` rows: a shorter vector is padded with unlabelled points and a longer one cut, both
silently; an object of a keypoint category without ``keypoints`` trains as "no point labelled". Visibility is 0 (not
labelled), 1 (labelled, hidden) or 2 (visible); the losses read ``v > 0`` and ``v == 2``, so any other value trains as
something it does not say. Its transforms mark a labelled point outside the image unlabelled (the point is lost).
Horizontal flips need the left/right pairs rfdetr infers from the keypoint names (``left_*``/``right_*`` ...): with
none it drops the flip from the augmentations (a note here, as rfdetr's own warning). :mod:`spmd_rfdetr.data.check`
calls :func:`keypoint_findings` on the COCO layouts; YOLO pose labels are rfdetr's own parse (it stops on a row of the
wrong length or a visibility outside 0..2 with its own message). Crowd annotations are not training targets.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

from spmd_rfdetr.data.check_masks import OUTSIDE_TOLERANCE_PX, Size, annotation_files
from spmd_rfdetr.data.files import Finding, SplitData

#: kind -> (what it is, how to fix it); :data:`spmd_rfdetr.data.check_report.KINDS` holds these too.
KEYPOINT_KINDS: dict[str, tuple[str, str]] = {
    "no_keypoint_categories": ("no category with keypoints (model.variant is keypoint-preview)", "name each keypoint "
                               "category's points in its 'keypoints' list (COCO), or train a detector variant; "
                               "rfdetr's keypoint reader stops on such a dataset"),
    "missing_keypoints": ("object of a keypoint category without keypoints", "add the object's 'keypoints' "
                          "[x1, y1, v1, ...] (v 0 for a point not labelled) or delete the annotation; rfdetr would "
                          "train it as having no labelled point"),
    "keypoint_count": ("keypoint count differs from the category's", "write 3 numbers (x, y, v) for each keypoint "
                       "the category's 'keypoints' names list; rfdetr would pad or cut the vector silently"),
    "bad_keypoints": ("keypoints malformed", "write 'keypoints' as a flat list of finite numbers [x1, y1, v1, ...] "
                      "with each visibility v 0 (not labelled), 1 (labelled, hidden) or 2 (visible)"),
    "keypoint_outside": ("labelled keypoint outside the image", "correct the point or set its v to 0; "
                         "data.on_bad=skip lets rfdetr drop it (its transforms mark it unlabelled; train split)"),
}


def keypoint_findings(data: SplitData, sizes: dict[str, Size], *, train: bool) -> tuple[list[Finding], list[str]]:
    """Keypoint problems of the non-crowd objects of ``data``'s readable images (``sizes``: image name -> (width,
    height) as the check knows it), and notes (flips off); ``train``: the split ``fit`` trains on."""
    found: list[Finding] = []
    notes: list[str] = []
    for source, coco in annotation_files(data):
        counts = _declared_counts(coco)
        if not counts and not any(isinstance(a, dict) and a.get("keypoints") for a in coco.get("annotations", [])):
            found.append(Finding(data.split, str(source), "no_keypoint_categories", "no category lists 'keypoints' "
                                 "and no annotation has any"))
            continue
        names = {image.get("id"): image.get("file_name") for image in coco.get("images", []) if isinstance(image, dict)}
        for i, ann in enumerate(coco.get("annotations", [])):
            if not isinstance(ann, dict) or ann.get("iscrowd", 0) or ann.get("category_id") not in counts:
                continue
            image = names.get(ann.get("image_id"))
            if image not in sizes:
                continue
            where = f"annotation {ann.get('id', f'#{i}')}"  # as dataset_files names it
            kind, detail = _object_problem(ann.get("keypoints"), counts[ann["category_id"]], sizes[image])
            if kind:
                on = f" on {Path(str(image)).name}"
                found.append(Finding(data.split, str(source), kind, detail + on, where, str(image),
                                     skippable=train and kind == "keypoint_outside"))
        if train and any(n > 1 for n in counts.values()) and not _flip_pairs(source):
            notes.append(f"{data.split}: horizontal flips are off: rfdetr finds no left/right pairs among the "
                         f"keypoint names of {Path(source).name} (name them left_*/right_* to flip)")
    return found, notes


def cache_key(key: str) -> str:
    """The data check's cache key of the keypoint model: the detection key plus this module's source."""
    return hashlib.sha256(f"{key}:keypoints:".encode() + Path(__file__).read_bytes()).hexdigest()


def _declared_counts(coco: dict[str, Any]) -> dict[int, int]:
    """Keypoints per category id as the categories name them (categories without a ``keypoints`` list: none)."""
    return {c["id"]: len(c["keypoints"]) for c in coco.get("categories", [])
            if isinstance(c, dict) and isinstance(c.get("keypoints"), list) and c["keypoints"]}


def _object_problem(keypoints: Any, count: int, size: Size) -> tuple[str, str]:
    """``(kind, detail)`` of one object's keypoints (``('', '')``: none)."""
    if keypoints is None or keypoints == []:
        return "missing_keypoints", "no 'keypoints'" if keypoints is None else "'keypoints' is []"
    if not isinstance(keypoints, list) or not all(_is_finite(v) for v in keypoints):
        return "bad_keypoints", "'keypoints' must be a flat list of finite numbers"
    if len(keypoints) != 3 * count:
        return "keypoint_count", f"{len(keypoints)} numbers, the category names {count} keypoints ({3 * count})"
    visibility = keypoints[2::3]
    odd = sorted({v for v in visibility if v not in (0, 1, 2)})
    if odd:
        return "bad_keypoints", f"visibility {odd[0]:g} (must be 0, 1 or 2)"
    tol = OUTSIDE_TOLERANCE_PX
    outside = [j + 1 for j, (x, y, v) in enumerate(zip(keypoints[0::3], keypoints[1::3], visibility))
               if v > 0 and size and not (-tol <= x <= size[0] + tol and -tol <= y <= size[1] + tol)]
    if outside:
        return "keypoint_outside", (f"keypoint(s) {', '.join(map(str, outside))} outside the {size[0]}x{size[1]} "
                                    "image")
    return "", ""


def _flip_pairs(source: Path | str) -> list[int]:
    """The flip pairs rfdetr infers from the annotation file (its own ``infer_coco_keypoint_schema``)."""
    # lazy: rfdetr imports torch_xla: the CLI imports the data check before the device choice
    from rfdetr.datasets._keypoint_schema import infer_coco_keypoint_schema

    try:
        return list(infer_coco_keypoint_schema(str(source)).keypoint_flip_pairs)
    except (OSError, ValueError, KeyError):  # its reader's own message comes when the split is built
        return []


def _is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

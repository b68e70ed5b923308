"""COCO scoring on the host: packed detection rows -> COCO results, and pycocotools' ``COCOeval`` summary + per-class AP.

A packed row is ``(score, label, x0, y0, x1, y1)`` (what :class:`spmd_rfdetr.eval.evaluator.EvalForward` returns per
detection): boxes in pixels of the original image, labels rfdetr's class indices. The dataset's own COCO
``category_id`` comes back through the split's ``label2cat``.

``COCOeval`` runs at maxDets 1/10/``eval.max_dets`` and is summarised as upstream does (mAP at the largest):
``tests/test_coco.py`` finds it equal to rfdetr's own ``CocoEvaluator`` at 500; ``tests/test_eval.py`` checks one eval
program for a padded split, mAP equal to upstream rfdetr's own eager CPU evaluation and to pycocotools on the written
JSON, and ``predict`` boxes equal to eval's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

#: Columns of a packed detection row.
SCORE, LABEL, BOXES = 0, 1, slice(2, 6)
#: Detections per image COCO scores by default: upstream's training eval (``TrainConfig.eval_max_dets``).
MAX_DETS = 500


def stat_names(max_dets: int = MAX_DETS) -> tuple[str, ...]:
    """``eval/...`` keys of :attr:`CocoMetrics.stats`, in pycocotools' ``COCOeval.stats`` order (maxDets 1, 10 and
    ``max_dets``)."""
    return ("mAP", "mAP50", "mAP75", "mAP_small", "mAP_medium", "mAP_large",
            "AR1", "AR10", f"AR{max_dets}", "AR_small", "AR_medium", "AR_large")


def detections_to_coco(
    rows: np.ndarray, image_ids: Iterable[int], label2cat: dict[int, int] | None,
    segmentations: Sequence[list[dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """COCO results from packed rows ``[N, K, 6]`` of real images, like rfdetr's ``CocoEvaluator.prepare``.

    ``label2cat`` maps rfdetr's label index back to the dataset's COCO ``category_id``; labels it does not map (e.g.
    rfdetr's extra "no object" logit) are dropped, as upstream does. ``None`` keeps label indices as ids.
    ``segmentations`` (seg variants): each image's ``K`` COCO RLEs (:func:`mask_rles`), one per row.
    """
    results = []
    for n, (image_rows, image_id) in enumerate(zip(rows, image_ids)):
        boxes = image_rows[:, BOXES].astype(np.float32, copy=True)
        boxes[:, 2:] -= boxes[:, :2]  # xyxy -> xywh, in float32 like upstream's _xyxy_to_xywh
        scores, labels = image_rows[:, SCORE].tolist(), image_rows[:, LABEL].astype(np.int64).tolist()
        rles = segmentations[n] if segmentations is not None else None
        for k, (box, score, label) in enumerate(zip(boxes.tolist(), scores, labels)):
            category = label if label2cat is None else label2cat.get(label)
            if category is not None:
                result = {"image_id": int(image_id), "category_id": int(category), "bbox": box, "score": score}
                if rles is not None:
                    result["segmentation"] = rles[k]
                results.append(result)
    return results


def mask_rles(logits: np.ndarray, size: tuple[int, int]) -> list[dict[str, Any]]:
    """COCO RLEs of mask logits ``[K, h, w]`` at an image's original ``(height, width)``: rfdetr's ``PostProcess``
    (bilinear resize of the logits, then ``> 0``; the same torch op on the CPU) and its ``CocoEvaluator``'s encoding."""
    # lazy: only the seg variants' masks need pycocotools' RLE codec
    from pycocotools import mask as mask_util

    rles = []
    for chunk in torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32)).split(32):  # rfdetr's _MASK_CHUNK
        resized = torch.nn.functional.interpolate(chunk[:, None], size=tuple(int(v) for v in size), mode="bilinear",
                                                  align_corners=False)[:, 0] > 0
        for mask in resized.numpy():
            rle = mask_util.encode(np.asfortranarray(mask.astype(np.uint8)))
            rles.append({"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode("utf-8")})
    return rles



@dataclass
class CocoMetrics:
    """pycocotools' summary (``stats``, keys of :func:`stat_names`) and per-class AP, of boxes or masks."""

    stats: dict[str, float]
    per_class: list[dict[str, Any]]
    num_images: int
    num_detections: int
    max_dets: int = MAX_DETS
    """pycocotools' largest ``maxDets``: the detections per image mAP and the last AR count."""
    iou_type: str = "bbox"
    """``bbox``, ``segm`` (masks) or ``keypoints`` (OKS, :func:`spmd_rfdetr.eval.keypoints.oks_metrics`)."""

    def record(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat ``{"eval/mAP": ...}`` for ``metrics.jsonl``."""
        return {f"{prefix}{k}": v for k, v in self.stats.items()}

    def table(self) -> str:
        """The summary and the per-class table, as printed."""
        head = "  ".join(f"{k} {v:.4f}" for k, v in self.stats.items())
        lines = [f"COCO {self.iou_type} ({self.num_images} images, {self.num_detections} detections, maxDets {self.max_dets}): {head}",
                 f"{'class':<20} {'id':>5} {'AP':>7} {'AP50':>7} {'AP75':>7} {'gt':>6}"]
        for row in self.per_class:
            lines.append(f"{row['name']:<20} {row['category_id']:>5} {row['AP']:>7.4f} {row['AP50']:>7.4f} "
                         f"{row['AP75']:>7.4f} {row['num_gt']:>6}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _mean_valid(values: np.ndarray) -> float:
    valid = values[values > -1]
    return float(valid.mean()) if valid.size else -1.0


def coco_metrics(coco_gt: Any, results: list[dict[str, Any]], image_ids: Iterable[int],
                 max_dets: int = MAX_DETS, iou_type: str = "bbox") -> CocoMetrics:
    """Score COCO results against ``coco_gt`` on ``image_ids`` with pycocotools at maxDets 1, 10 and ``max_dets``,
    summarised as upstream's training eval does (rfdetr's ``patched_pycocotools_summarize``: mAP at ``max_dets``,
    where pycocotools' own summary reads it at 100). ``iou_type="segm"`` scores the results' ``segmentation``, given
    without their ``bbox`` as rfdetr's ``prepare_for_coco_segmentation`` does (pycocotools then takes each
    detection's area from its mask)."""
    # lazy: scoring only: rfdetr imports torch_xla, and its coco_eval loads cv2 and faster_coco_eval
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    from rfdetr.evaluation.coco_eval import patched_pycocotools_summarize

    gt = coco_gt
    if type(gt) is not COCO:  # e.g. faster-coco-eval's COCO: rebuild a pycocotools one
        gt = COCO()
        gt.dataset = copy.deepcopy(coco_gt.dataset)
        with contextlib.redirect_stdout(io.StringIO()):
            gt.createIndex()
    img_ids = sorted({int(i) for i in image_ids})
    if iou_type == "segm":
        results = [{k: v for k, v in r.items() if k != "bbox"} for r in results]
    with contextlib.redirect_stdout(io.StringIO()):
        dt = gt.loadRes([dict(r) for r in results]) if results else empty_results(gt)  # loadRes adds keys
        evaluator = COCOeval(gt, dt, iouType=iou_type)
        evaluator.params.imgIds = img_ids
        evaluator.params.maxDets = [1, 10, max_dets]
        evaluator.evaluate()
        evaluator.accumulate()
        patched_pycocotools_summarize(evaluator, log_summary=False)
    stats = {name: float(v) for name, v in zip(stat_names(max_dets), evaluator.stats)}
    return CocoMetrics(stats, per_class_ap(evaluator, gt, img_ids, results), len(img_ids), len(results), max_dets,
                       iou_type)


def per_class_ap(evaluator: Any, gt: Any, img_ids: list[int], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """AP, AP50 and AP75 per category of an accumulated ``COCOeval`` (all areas, its largest maxDets), with the
    category's ground-truth count; categories never annotated nor predicted (a Roboflow root category) left out."""
    precision = evaluator.eval["precision"]  # [iou T, recall R, class K, area A, maxDets M]
    gt_counts: dict[int, int] = {}
    for image_id in img_ids:
        for ann in gt.imgToAnns.get(image_id, []):
            if not ann.get("iscrowd", 0):
                gt_counts[ann["category_id"]] = gt_counts.get(ann["category_id"], 0) + 1
    predicted = {r["category_id"] for r in results}
    per_class = []
    for k, category_id in enumerate(evaluator.params.catIds):
        if category_id not in gt_counts and category_id not in predicted:
            continue
        p = precision[:, :, k, 0, -1]
        per_class.append({
            "category_id": int(category_id),
            "name": str(gt.cats[category_id].get("name", category_id)),
            "AP": _mean_valid(p),
            "AP50": _mean_valid(p[0]),
            "AP75": _mean_valid(p[5]),
            "num_gt": gt_counts.get(category_id, 0),
        })
    return per_class


def empty_results(gt: Any) -> Any:
    """pycocotools' results object with no detections (``loadRes`` refuses an empty list)."""
    # lazy: scoring only, as coco_metrics' pycocotools imports
    from pycocotools.coco import COCO

    dt = COCO()
    dt.dataset = {"images": copy.deepcopy(gt.dataset["images"]), "categories": copy.deepcopy(gt.dataset["categories"]),
                  "annotations": []}
    dt.createIndex()
    return dt


def label2cat_of(dataset: Dataset[Any]) -> dict[int, int] | None:
    """rfdetr's label index -> COCO category_id mapping of a dataset split (``None``: labels are category ids)."""
    # lazy: rfdetr imports torch_xla, which must start after the device choice: this module loads without it
    from rfdetr.datasets import get_coco_api_from_dataset

    coco = get_coco_api_from_dataset(dataset)
    mapping = getattr(coco, "label2cat", None)
    return {int(k): int(v) for k, v in mapping.items()} if mapping is not None else None


def label2cat_for(dataset_dir: str, keypoint_schema: list[int] | None = None) -> dict[int, int] | None:
    """The train split's label -> category_id mapping of a Roboflow COCO dataset (what training used), if readable;
    ``keypoint_schema`` (the keypoint model's ``num_keypoints_per_class``): rfdetr's keypoint label slots instead."""
    # lazy: rfdetr imports torch_xla, which must start after the device choice: this module loads without it
    from rfdetr.datasets.coco import _build_keypoint_cat2label, _train_split_cat2label

    train = Path(dataset_dir) / "train" / "_annotations.coco.json"
    if keypoint_schema and train.is_file():
        # lazy: pycocotools, only for a keypoint model's label slots
        from pycocotools.coco import COCO

        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(str(train))
        return {label: cat for cat, label in _build_keypoint_cat2label(coco, keypoint_schema).items()}
    cat2label = _train_split_cat2label(Path(dataset_dir)) if Path(dataset_dir).is_dir() else None
    return {label: cat for cat, label in cat2label.items()} if cat2label else None

"""rfdetr's keypoint model at evaluation: its PostProcess keypoint decode as static device ops, and OKS keypoint mAP.

Device side, :func:`decode_keypoints`: rfdetr's ``PostProcess._postprocess_keypoints`` for a whole batch at once. Its
per-image loop, ``nonzero`` over the valid labels and indexed writes per class become a one-hot pick of each
detection's class slots and masks by the static schema; the numbers are its own (pixels ``x * W, y * H``, confidence
``sigmoid(findable)``, slots the class does not have zero; the score fused with the keypoints' predicted covariance,
``sigmoid(log s - alpha * log_mean_trace)`` capped below 1, for every label with a schema slot).

Host side: the COCO keypoint results as rfdetr's ``CocoEvaluator.prepare_for_coco_keypoint`` writes them (each
vector cut to its category's keypoint count; no ``bbox``, so pycocotools takes each detection's extent from its
points), and :func:`oks_metrics`, pycocotools' ``COCOeval(iouType="keypoints")`` set up as rfdetr's evaluator sets up
faster-coco-eval's: ``maxDets [20]``, one evaluator per keypoint count over that count's categories, the OKS sigmas by
rfdetr's own rule (COCO person's for 17 keypoints, else a uniform 0.05, unless given), ``num_keypoints`` filled in
where the annotations lack it, and the groups' stats averaged weighted by their category counts.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from spmd_rfdetr.eval.coco import CocoMetrics, per_class_ap

#: rfdetr's keypoint OKS evaluation scores at most this many detections per image (its ``CocoEvaluator``).
KEYPOINT_MAX_DETS = 20
#: ``torch.nextafter(1, 0)`` in float32: rfdetr's cap on a fused score (a constant: XLA has no ``nextafter``).
_BELOW_ONE = 1.0 - 2.0**-24


def keypoint_stat_names() -> tuple[str, ...]:
    """``eval/kp_...`` keys, in pycocotools' keypoint ``COCOeval.stats`` order (maxDets 20)."""
    return ("mAP", "mAP50", "mAP75", "mAP_medium", "mAP_large", "AR", "AR50", "AR75", "AR_medium", "AR_large")


def decode_keypoints(pred_keypoints: torch.Tensor, queries: torch.Tensor, labels: torch.Tensor, scores: torch.Tensor,
                     orig_size: torch.Tensor, schema: Sequence[int], trace_alpha: float,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [B, K], keypoints [B, K, maxK, 3])`` of the ``K`` selected detections per image.

    ``pred_keypoints [B, Q, C * maxK, D]`` (rfdetr's class-padded layout, ``C = len(schema)``), ``queries``/``labels``/
    ``scores [B, K]`` from PostProcess's top-k, ``orig_size [B, 2]`` (h, w). Scores of labels without a schema slot
    stay as they are, as in rfdetr.
    """
    # lazy: xla.mesh imports torch_xla: after the device choice, as EvalForward's own take_rows
    from spmd_rfdetr.xla.mesh import take_rows

    classes, most = len(schema), max(schema)
    batch, selected = queries.shape
    picked = take_rows(pred_keypoints.flatten(2), queries).view(batch, selected, classes, most, -1).float()
    own_class = labels[..., None] == torch.arange(classes, device=labels.device)  # [B, K, C]
    own = torch.where(own_class[..., None, None], picked, 0.0).sum(2)  # [B, K, maxK, D] (NaN elsewhere stays out)
    counts = torch.tensor(list(schema), device=labels.device)
    slots = torch.arange(most, device=labels.device) < counts[:, None]  # [C, maxK]: the slots each class has
    active = (own_class[..., None] & slots).any(2)  # [B, K, maxK]
    height, width = orig_size.to(own.dtype).unbind(1)
    decoded = torch.stack([own[..., 0] * width[:, None, None], own[..., 1] * height[:, None, None],
                           own[..., 2].sigmoid()], dim=-1)
    keypoints = torch.where(active[..., None], decoded, 0.0)
    if trace_alpha > 0 and own.shape[-1] >= 7:
        scores = _fused_scores(scores, own, active, labels < classes, trace_alpha)
    return scores, keypoints


def _fused_scores(scores: torch.Tensor, own: torch.Tensor, active: torch.Tensor, has_slot: torch.Tensor,
                  trace_alpha: float) -> torch.Tensor:
    """rfdetr's ``_apply_keypoint_trace_fusion`` with ``_keypoint_log_mean_trace`` over each detection's active
    slots (masked log-sum-exps; a class without keypoints has a log mean trace of 0, as rfdetr's zeros)."""
    log_l11, l21, log_l22 = own[..., 4], own[..., 5], own[..., 6]
    log_t1, log_t2 = -2.0 * log_l11, -2.0 * log_l22
    log_t3 = 2.0 * torch.log(l21.abs().clamp(min=1e-12)) + log_t1 + log_t2
    log_trace = torch.logsumexp(torch.stack([log_t1, log_t2, log_t3], dim=-1), dim=-1)
    log_w = torch.log(own[..., 2].sigmoid().clamp(min=1e-12))
    none = torch.tensor(float("-inf"), device=own.device)
    log_mean_trace = (torch.logsumexp(torch.where(active, log_trace + log_w, none), dim=-1)
                      - torch.logsumexp(torch.where(active, log_w, none), dim=-1))
    log_mean_trace = torch.where(active.any(-1), log_mean_trace, 0.0)
    fused = torch.sigmoid(torch.log(scores) - trace_alpha * log_mean_trace).clamp(max=_BELOW_ONE)
    return torch.where(has_slot, fused, scores)


def keypoints_to_coco(keypoints: np.ndarray, scores: np.ndarray, labels: np.ndarray, image_ids: Iterable[int],
                      label2cat: dict[int, int] | None, counts: dict[int, int]) -> list[dict[str, Any]]:
    """COCO keypoint results of real images (``keypoints [N, K, maxK, 3]``, ``scores``/``labels [N, K]``), as
    rfdetr's ``prepare_for_coco_keypoint``: a label ``label2cat`` does not map is dropped, each vector is cut to its
    category's keypoint count (``counts``, :func:`keypoint_counts`)."""
    results = []
    for points, image_scores, image_labels, image_id in zip(keypoints, scores, labels, image_ids):
        flat = points.reshape(points.shape[0], -1).tolist()
        for vector, score, label in zip(flat, image_scores.tolist(), image_labels.astype(np.int64).tolist()):
            category = label if label2cat is None else label2cat.get(label)
            if category is None:
                continue
            count = counts.get(int(category))
            results.append({"image_id": int(image_id), "category_id": int(category),
                            "keypoints": vector[: count * 3] if count is not None else vector, "score": score})
    return results


def keypoint_counts(coco_gt: Any) -> dict[int, int]:
    """Keypoints per category id, as rfdetr's evaluator reads them (category ``keypoints`` names, else the longest
    annotation)."""
    # lazy: rfdetr imports torch_xla, which starts on import
    from rfdetr.evaluation.coco_eval import _infer_keypoint_counts_by_category

    return _infer_keypoint_counts_by_category(coco_gt)


def oks_metrics(coco_gt: Any, results: list[dict[str, Any]], image_ids: Iterable[int],
                sigmas: list[float] | None = None) -> CocoMetrics:
    """OKS keypoint mAP of COCO keypoint results with pycocotools, grouped and weighted as rfdetr's evaluator does."""
    # lazy: scoring only: pycocotools, and rfdetr (torch_xla) for its grouping and sigma rules
    from pycocotools.coco import COCO
    from rfdetr.evaluation.coco_eval import (_backfill_num_keypoints, _build_keypoint_category_groups,
                                             _filter_coco_by_category_ids, _resolve_keypoint_oks_sigmas,
                                             _weighted_mean_coco_stats)

    gt = COCO()
    gt.dataset = copy.deepcopy(coco_gt.dataset)
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
    _backfill_num_keypoints(gt)
    img_ids = sorted({int(i) for i in image_ids})
    groups = _build_keypoint_category_groups(gt, sigmas)
    if len(groups) <= 1:  # one evaluator over every category, as rfdetr's
        parts = [(gt, results, _resolve_keypoint_oks_sigmas(gt, sigmas), 1)]
    else:
        parts = []
        for group in groups:
            ids = set(group.category_ids)
            parts.append((_filter_coco_by_category_ids(gt, group.category_ids),
                          [r for r in results if int(r["category_id"]) in ids], group.keypoint_oks_sigmas,
                          len(group.category_ids)))
    stats, weights, per_class = [], [], []
    for part_gt, part_results, part_sigmas, weight in parts:
        evaluator = _evaluate(part_gt, part_results, img_ids, part_sigmas)
        stats.append(np.asarray(evaluator.stats, dtype=np.float32))
        weights.append(weight)
        per_class += per_class_ap(evaluator, part_gt, img_ids, part_results)
    summary = _weighted_mean_coco_stats(stats, weights) if len(parts) > 1 else stats[0]
    return CocoMetrics(dict(zip(keypoint_stat_names(), map(float, summary))), per_class, len(img_ids), len(results),
                       KEYPOINT_MAX_DETS, "keypoints")


def _evaluate(gt: Any, results: list[dict[str, Any]], img_ids: list[int], sigmas: list[float] | None) -> Any:
    """One pycocotools keypoint ``COCOeval``, evaluated, accumulated and summarised at maxDets 20."""
    # lazy: scoring only, as oks_metrics
    from pycocotools.cocoeval import COCOeval
    from rfdetr.evaluation.coco_eval import patched_pycocotools_summarize

    from spmd_rfdetr.eval.coco import empty_results

    with contextlib.redirect_stdout(io.StringIO()):
        dt = gt.loadRes([dict(r) for r in results]) if results else empty_results(gt)
        evaluator = COCOeval(gt, dt, iouType="keypoints")
        if sigmas is not None:  # pycocotools' default is COCO person's 17, rfdetr's None means the same
            evaluator.params.kpt_oks_sigmas = np.asarray(sigmas, dtype=np.float64)
        evaluator.params.imgIds = img_ids
        evaluator.params.maxDets = [KEYPOINT_MAX_DETS]
        evaluator.evaluate()
        evaluator.accumulate()
        patched_pycocotools_summarize(evaluator, log_summary=False)
    return evaluator

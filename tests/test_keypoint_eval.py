"""The keypoint model's evaluation (``spmd_rfdetr.eval.keypoints``) against upstream's own pieces, eager CPU: the
batched keypoint decode and score fusion against rfdetr's ``PostProcess`` on the same outputs, and the OKS mAP of
pycocotools, set up as rfdetr sets up its evaluator, against rfdetr's ``CocoEvaluator(["keypoints"])`` (faster-coco-eval)
on the same detections, one keypoint count and two."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO
from rfdetr.evaluation.coco_eval import CocoEvaluator
from rfdetr.models.postprocess import PostProcess

from spmd_rfdetr.eval.keypoints import (decode_keypoints, keypoint_counts, keypoint_stat_names, keypoints_to_coco,
                                        oks_metrics)


@pytest.mark.parametrize("schema", [[17], [0, 5, 5]], ids=["person", "root-and-two-classes"])
def test_decode_and_score_fusion_equal_rfdetrs_postprocess(schema: list[int]) -> None:
    """Every image's fused scores and ``[x, y, confidence]`` keypoints equal PostProcess's (1e-6); the selection
    reaches labels without keypoints (a root class, the "no object" logit) and values that saturate the fusion."""
    g = torch.Generator().manual_seed(0)
    batch, queries, num_select = 3, 16, 24
    classes = len(schema) + 1  # rfdetr's class head: one more logit than the classes
    outputs = {"pred_logits": torch.randn(batch, queries, classes, generator=g) * 3,
               "pred_boxes": torch.rand(batch, queries, 4, generator=g) * 0.5 + 0.2,
               "pred_keypoints": torch.randn(batch, queries, len(schema) * max(schema), 8, generator=g) * 2}
    outputs["pred_keypoints"][0, :, :, 4] = -40.0  # a huge covariance: fused scores near 0
    outputs["pred_keypoints"][1, :, :, 5] = 0.0  # l21 = 0: the clamp inside the log
    outputs["pred_logits"][2, 0, 0] = 30.0  # a score that rounds to 1
    sizes = torch.tensor([[120, 160], [90, 90], [200, 64]])
    postprocess = PostProcess(num_select=num_select, num_keypoints_per_class=schema, trace_alpha=0.2)
    expected = postprocess(outputs, sizes)
    scores, labels, picked = postprocess._select_topk(outputs["pred_logits"])
    assert {int(label) for label in labels.flatten()} >= {0, len(schema)}  # both kinds of label without keypoints
    fused, keypoints = decode_keypoints(outputs["pred_keypoints"], picked, labels, scores, sizes, schema, 0.2)
    for i, image in enumerate(expected):
        torch.testing.assert_close(fused[i], image["scores"], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(keypoints[i], image["keypoints"], atol=1e-6, rtol=1e-6)
    assert not torch.equal(fused, scores)  # the fusion ran


def _dataset(counts: dict[int, int], seed: int = 0) -> tuple[COCO, dict[int, dict[str, torch.Tensor]]]:
    """A small COCO keypoint set (categories with ``counts`` keypoints each, plus a root category without) and
    detections near its objects (noisy points, some missed, some of the wrong class, random scores) and
    anywhere (up to 25 per image) as rfdetr's PostProcess gives
    them per image (``boxes`` xyxy, ``keypoints [N, maxK, 3]``; labels are category ids)."""
    rng = np.random.default_rng(seed)
    most = max(counts.values())
    categories = [{"id": 0, "name": "root", "supercategory": "none"}] + [
        {"id": c, "name": f"c{c}", "supercategory": "root", "keypoints": [f"k{j}" for j in range(n)], "skeleton": []}
        for c, n in counts.items()]
    images, annotations, predictions = [], [], {}
    for image_id in range(1, 13):
        images.append({"id": image_id, "file_name": f"{image_id}.jpg", "width": 200, "height": 160})
        boxes, scores, labels, points = [], [], [], []
        for _ in range(int(rng.integers(1, 4))):
            category = int(rng.choice(list(counts)))
            n = counts[category]
            x, y = rng.uniform(10, 120), rng.uniform(10, 90)
            w, h = rng.uniform(20, 70), rng.uniform(20, 60)
            kp = np.stack([x + rng.uniform(0, w, n), y + rng.uniform(0, h, n), rng.integers(0, 3, n)], axis=1)
            kp[kp[:, 2] == 0, :2] = 0
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": category,
                                "bbox": [x, y, w, h], "area": w * h, "iscrowd": 0,
                                "keypoints": kp.flatten().tolist()})  # num_keypoints left for the backfill
            for _ in range(int(rng.integers(0, 3))):  # 0 to 2 guesses per object
                guess = np.zeros((most, 3))
                guess[:n, :2] = kp[:, :2] + rng.normal(0, rng.uniform(0.5, 4), (n, 2))
                guess[:n, 2] = rng.uniform(0, 1, n)
                boxes.append([x, y, x + w, y + h])
                scores.append(rng.uniform())
                labels.append(category if rng.uniform() < 0.9 else int(rng.choice(list(counts))))
                points.append(guess)
        for _ in range(int(rng.integers(0, 26))):  # false detections: past maxDets 20 in some images
            guess = np.zeros((most, 3))
            guess[:, 0], guess[:, 1], guess[:, 2] = rng.uniform(0, 200, most), rng.uniform(0, 160, most), rng.uniform(0, 1, most)
            boxes.append([0.0, 0.0, 50.0, 50.0])
            scores.append(rng.uniform() * 0.6)
            labels.append(int(rng.choice(list(counts))))
            points.append(guess)
        predictions[image_id] = {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                                 "scores": torch.tensor(scores, dtype=torch.float32),
                                 "labels": torch.tensor(labels, dtype=torch.int64),
                                 "keypoints": torch.tensor(np.asarray(points), dtype=torch.float32).reshape(-1, most, 3)}
    gt = COCO()
    gt.dataset = {"images": images, "annotations": annotations, "categories": categories}
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
    return gt, predictions


@pytest.mark.parametrize("counts,sigmas", [({1: 5, 2: 5}, None), ({1: 3, 2: 5, 3: 5}, None), ({1: 5, 2: 5}, [0.1] * 5)],
                         ids=["one-count", "two-counts", "eval.keypoint_oks_sigmas"])
def test_oks_map_equals_rfdetrs_keypoint_evaluator(counts: dict[int, int], sigmas: list[float] | None) -> None:
    """pycocotools, as :func:`oks_metrics` sets it up, gives rfdetr's ``CocoEvaluator(["keypoints"])`` summary (its
    maxDets 20, its uniform 0.05 sigmas or the ones given, as ``eval.keypoint_oks_sigmas`` gives them, its per-count
    groups weighted by their categories) to 1e-4."""
    gt, predictions = _dataset(counts)
    upstream = CocoEvaluator(gt, ["keypoints"], log_summary=False, keypoint_oks_sigmas=sigmas)
    upstream.update(predictions)
    upstream.synchronize_between_processes()
    with contextlib.redirect_stdout(io.StringIO()):
        upstream.accumulate()
        upstream.summarize()
    ids = sorted(predictions)
    most = max(counts.values())
    results = keypoints_to_coco(
        np.stack([np.pad(p["keypoints"].numpy(), ((0, 60 - len(p["keypoints"])), (0, 0), (0, 0))) for p in
                  predictions.values()]),
        np.stack([np.pad(p["scores"].numpy(), (0, 60 - len(p["scores"])), constant_values=-1) for p in
                  predictions.values()]),
        np.stack([np.pad(p["labels"].numpy(), (0, 60 - len(p["labels"])), constant_values=99) for p in
                  predictions.values()]),
        ids, {c: c for c in counts}, keypoint_counts(gt))  # label 99 (the padding) maps to no category: dropped
    assert len(results) == sum(len(p["scores"]) for p in predictions.values()) and most == 5
    ours = oks_metrics(gt, results, ids, sigmas)
    expected = np.asarray(upstream.coco_eval["keypoints"].stats[:10])
    assert expected[0] > 0.05  # the detections find some of the points
    np.testing.assert_allclose([ours.stats[name] for name in keypoint_stat_names()], expected, atol=1e-4, rtol=0)

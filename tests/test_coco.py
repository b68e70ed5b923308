"""COCO scoring on the host (``spmd_rfdetr.eval.coco``) against pycocotools and upstream rfdetr's own evaluator.

Random detections on the session's synthetic valid split, more per image and class than pycocotools' default 100
(its ``maxDets`` caps each image's detections of each class), so the number scored (``eval.max_dets``) changes the
figures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from spmd_rfdetr.eval.coco import MAX_DETS, coco_metrics

#: Random detections per image, 110 of each of the 3 classes, on the split's first :data:`IMAGES` images.
PER_IMAGE, IMAGES = 330, 10


@pytest.fixture(scope="module")
def scored(synth_dir):
    """The split's COCO ground truth and :data:`PER_IMAGE` random detections per image plus the true boxes, as rfdetr's
    PostProcess gives them (xyxy pixel boxes, scores, labels) and as COCO results (xywh), and the images scored."""
    from pycocotools.coco import COCO

    gt = COCO(str(Path(synth_dir) / "valid" / "_annotations.coco.json"))
    generator = torch.Generator().manual_seed(0)
    postprocessed, results = {}, []
    for image_id in sorted(gt.imgs)[:IMAGES]:
        image = gt.imgs[image_id]
        xy = torch.rand(PER_IMAGE, 2, generator=generator) * torch.tensor([image["width"], image["height"]]) * 0.8
        wh = torch.rand(PER_IMAGE, 2, generator=generator) * 60 + 4
        boxes = torch.cat([xy, xy + wh], dim=1)
        scores = torch.rand(PER_IMAGE, generator=generator) * 0.9 + 0.1
        labels = torch.arange(PER_IMAGE) % 3 + 1
        # and each ground-truth box itself, scored below every random one: found at 500 detections, not at 100
        truth = gt.imgToAnns[image_id]
        x, y, w, h = (torch.tensor([a["bbox"][i] for a in truth]) for i in range(4))
        boxes = torch.cat([boxes, torch.stack([x, y, x + w, y + h], dim=1)])
        scores = torch.cat([scores, torch.full((len(truth),), 0.05)])
        labels = torch.cat([labels, torch.tensor([a["category_id"] for a in truth])])
        postprocessed[image_id] = {"boxes": boxes, "scores": scores, "labels": labels}
        for box, score, label in zip(boxes.tolist(), scores.tolist(), labels.tolist()):
            results.append({"image_id": image_id, "category_id": label, "score": score,
                            "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]]})
    return gt, postprocessed, results, sorted(postprocessed)


def test_at_100_detections_it_is_pycocotools_own_summary(scored):
    from pycocotools.cocoeval import COCOeval

    gt, _, results, image_ids = scored
    ours = coco_metrics(gt, results, image_ids, max_dets=100)
    reference = COCOeval(gt, gt.loadRes([dict(r) for r in results]), "bbox")
    reference.params.imgIds = image_ids
    reference.evaluate()
    reference.accumulate()
    reference.summarize()
    assert list(ours.stats) == ["mAP", "mAP50", "mAP75", "mAP_small", "mAP_medium", "mAP_large",
                                "AR1", "AR10", "AR100", "AR_small", "AR_medium", "AR_large"]
    np.testing.assert_allclose(list(ours.stats.values()), reference.stats, atol=1e-12, rtol=0)


def test_by_default_it_scores_as_upstreams_training_eval(scored):
    """``eval.max_dets`` 500, upstream's ``TrainConfig.eval_max_dets``: the figures of rfdetr's ``CocoEvaluator`` at
    that value (faster-coco-eval), not those at 100."""
    from rfdetr.config import TrainConfig
    from rfdetr.evaluation.coco_eval import CocoEvaluator

    gt, postprocessed, results, image_ids = scored
    assert MAX_DETS == TrainConfig.model_fields["eval_max_dets"].default == 500
    ours = coco_metrics(gt, results, image_ids)
    upstream = CocoEvaluator(gt, ["bbox"], max_dets=MAX_DETS, log_summary=False)
    upstream.update(postprocessed)
    upstream.synchronize_between_processes()
    upstream.accumulate()
    assert ours.max_dets == 500 and "AR500" in ours.stats
    np.testing.assert_allclose(list(ours.stats.values()), upstream.coco_eval["bbox"].stats, atol=1e-6, rtol=0)
    at_100 = coco_metrics(gt, results, image_ids, max_dets=100)
    assert ours.stats["AR500"] == 1 > at_100.stats["AR100"] + 0.5 and ours.stats["mAP"] > at_100.stats["mAP"]

"""``predict``'s detections you can see (:mod:`spmd_rfdetr.eval.draw`), without a model: predict's bad options end
before anything starts, and hand-made results convert to ``supervision`` objects and draw where they are. The drawings
of real predictions are checked in ``test_eval.py``, ``test_seg.py`` and ``test_keypoint_fit.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from spmd_rfdetr.eval import draw


@pytest.mark.parametrize("options, message", [
    (["--threshold", "1.5"], "--threshold 1.5: a score threshold must lie in [0, 1]"),
    (["--threshold", "-0.1"], "--threshold -0.1: a score threshold must lie in [0, 1]"),
    (["--save_images", "{images}"], "the --images folder itself (its images would be replaced)"),
])
def test_bad_predict_options_are_one_message_and_exit_2(options: list[str], message: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before the checkpoint is read (it does not exist here) and before XLA starts anything."""
    from spmd_rfdetr.cli import main

    images = tmp_path / "images"
    images.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--checkpoint", str(tmp_path / "none.pth"), "--images", str(images), "--output",
              str(tmp_path / "p.json"), *[o.format(images=images) for o in options]])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "no such file" not in err, err
    assert "Traceback" not in err and not (tmp_path / "p.json").exists()


def results() -> list[dict]:
    """Two detections of image 7 as predict writes them (seg RLE and keypoints included), one of image 8."""
    from pycocotools import mask as mask_util

    mask = np.zeros((100, 120), np.uint8)
    mask[52:78, 62:98] = 1
    rle = mask_util.encode(np.asfortranarray(mask))
    rle = {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode()}
    return [{"image_id": 7, "category_id": 2, "category_name": "ellipse", "bbox": [60.0, 50.0, 40.0, 30.0],
             "score": 0.9, "segmentation": rle, "keypoints": [104, 90, 0.9, 114, 96, 0.8, 110, 84, 0.7, 116, 66, 0.6]},
            {"image_id": 7, "category_id": 1, "category_name": "rectangle", "bbox": [5.0, 5.0, 10.0, 10.0],
             "score": 0.3, "segmentation": rle, "keypoints": [7, 7, 0.5]},
            {"image_id": 8, "category_id": 1, "category_name": "rectangle", "bbox": [1.0, 2.0, 3.0, 4.0],
             "score": 0.95, "segmentation": rle, "keypoints": [2, 3, 0.5]}]


def test_to_detections_and_to_keypoints_are_rfdetrs_supervision_objects() -> None:
    import supervision as sv

    detections = draw.to_detections(results(), image_id=7)
    assert isinstance(detections, sv.Detections) and len(detections) == 2
    np.testing.assert_array_equal(detections.xyxy, [[60, 50, 100, 80], [5, 5, 15, 15]])  # best first, xyxy pixels
    assert detections.class_id.tolist() == [2, 1] and detections.data["class_name"].tolist() == ["ellipse", "rectangle"]
    assert detections.mask.shape == (2, 100, 120) and detections.mask[0].sum() == 26 * 36
    kept = draw.to_detections(results(), image_id=7, threshold=0.3)  # >= threshold
    assert len(kept) == 2 and len(draw.to_detections(results(), image_id=7, threshold=0.31)) == 1
    points = draw.to_keypoints(results(), image_id=7)
    assert isinstance(points, sv.KeyPoints) and points.xy.shape == (2, 4, 2)  # the shorter one padded with (0, 0)
    np.testing.assert_array_equal(points.xy[1], [[7, 7], [0, 0], [0, 0], [0, 0]])
    assert points.class_id.tolist() == [2, 1]
    np.testing.assert_allclose(points.keypoint_confidence[0], [0.9, 0.8, 0.7, 0.6])


def test_draw_changes_pixels_at_boxes_masks_and_keypoints_only() -> None:
    image = Image.new("RGB", (120, 100), (40, 40, 40))
    rows = draw.kept(results(), image_id=7, threshold=0.5)
    edges = {2: [(1, 3), (2, 3)]}
    before = np.asarray(image, np.int64)
    after = np.asarray(draw.draw(image, rows, edges), np.int64)
    assert after.shape == before.shape and np.asarray(image, np.int64).sum() == before.sum()  # the input untouched
    changed = np.abs(after - before).sum(-1) > 0
    assert changed[79, 60:100].all() and changed[50:80, 99].all()  # the box's bottom and right edges
    assert changed[70, 66] and changed[75, 94]  # inside the mask
    assert changed[90, 104] and changed[96, 114] and changed[84, 110]  # the keypoints, outside box and mask
    assert changed[66, 116] and not changed[66, 112]  # the 4th, on no edge: a vertex of radius 3
    assert not changed[90:, :55].any() and not changed[5:15, 5:15].any()  # far from it; the 0.3 box not drawn
    no_edges = np.asarray(draw.draw(image, rows), np.int64)
    assert (no_edges != after).any()  # the skeleton's edges

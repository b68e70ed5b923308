"""rfdetr's keypoint model end to end, as a user runs it: ``synth --keypoints``, ``fit --config
configs/cpu-keypoints.yaml`` (made smaller), ``predict`` with keypoints; OKS mAP against pycocotools on predict's output
and upstream rfdetr's own eager evaluation of ``last.pth``; upstream's ``RFDETR.from_checkpoint`` predicting our
keypoints in a process without torch_xla."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from jobs import JobInputs, job_fixture
from support.runs import cli
from support.ties import pair_near_ties

ROOT = Path(__file__).resolve().parents[1]
#: The fit's steps: what its tests read needs a replayed, evaluated run, not a trained one (OKS mAP >= 0; the
#: drawing tests hold for any scores), so few (20 until 2026-12-06: ~1 min more of the suite).
STEPS = 8
SIZE = 72  # the synth images' size and the model's resolution: neither side resizes an image (synth: >= 64 px)
VALID = 16

#: Upstream rfdetr alone: ``RFDETR.from_checkpoint`` on our weight file, its ``predict`` keypoints.
UPSTREAM_KEYPOINT_PREDICT = """
import json, sys
from rfdetr import RFDETR
checkpoint, images = sys.argv[1], sys.argv[2:]
model = RFDETR.from_checkpoint(checkpoint)
assert "torch_xla" not in sys.modules, "upstream ran with torch_xla imported"
out = {"class": type(model).__name__, "images": []}
for path in images:
    k = model.predict(path, threshold=0.0)
    out["images"].append({"score": k.detection_confidence.tolist(), "label": k.class_id.tolist(),
                          "xy": k.xy.tolist(), "confidence": k.keypoint_confidence.tolist()})
print(json.dumps(out))
"""


@dataclass
class KeypointRun:
    """The keypoint fit's output folder, its dataset, ``predict``'s output and upstream's."""

    out: Path
    data: Path
    fit: subprocess.CompletedProcess
    predicted: Path
    """``predict`` of ``last.pth`` on the valid split's images (with ``--save_images`` :attr:`drawn`)."""
    drawn: Path
    upstream: subprocess.CompletedProcess
    exported: subprocess.CompletedProcess
    """``export`` of ``last.pth`` to :attr:`onnx`, in its own process as a user runs it."""
    onnx: Path


@job_fixture
def keypoint_run(inputs: JobInputs, base: Path) -> KeypointRun:
    """``synth --keypoints`` at the model's size, ``configs/cpu-keypoints.yaml`` with 2 backbone blocks for
    :data:`STEPS` steps (evaluated at the last), ``predict`` of ``last.pth`` on the valid images, upstream's
    ``from_checkpoint`` predict of the same images in a process without torch_xla, and ``export`` of ``last.pth``."""
    env = {**inputs.env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    data = base / "data"
    made = cli("synth", "--output_dir", str(data), "--keypoints", "true", "--image_size", str(SIZE),
               "--train_images", "64", "--valid_images", str(VALID), "--test_images", "0", env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    cfg = yaml.safe_load((ROOT / "configs" / "cpu-keypoints.yaml").read_text())
    cfg["model"].update(backbone_blocks=2, resolution=SIZE)
    cfg["data"].update(dataset_dir=str(data), num_workers=0)
    cfg["trainer"].update(output_dir=str(base / "run"), max_steps=STEPS, log_every=STEPS // 4)
    cfg["eval"].update(every_steps=STEPS, save_detections=True)
    config = base / "keypoints.yaml"
    config.write_text(yaml.safe_dump(cfg))
    fit = cli("fit", "--config", str(config), env=env)
    predicted, drawn = base / "valid_predictions.json", base / "drawn"
    if fit.returncode == 0:
        cli("predict", "--config", str(config), "--checkpoint", str(base / "run" / "last.pth"), "--images",
            str(data / "valid"), "--output", str(predicted), "--save_images", str(drawn), env=env)
    images = sorted((data / "valid").glob("*.jpg"))[:4]
    no_xla = {k: v for k, v in inputs.env.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS")}
    upstream = subprocess.run([sys.executable, "-c", UPSTREAM_KEYPOINT_PREDICT, str(base / "run" / "last.pth"),
                               *map(str, images)], cwd=base, env={**no_xla, "USE_TORCH_XLA": "0"},
                              capture_output=True, text=True, timeout=900)
    onnx = base / "keypoints.onnx"
    exported = cli("export", "--checkpoint", str(base / "run" / "last.pth"), "--output", str(onnx), env=env)
    return KeypointRun(base / "run", data, fit, predicted, drawn, upstream, exported, onnx)


def final_record(run: KeypointRun) -> dict:
    assert run.fit.returncode == 0, run.fit.stderr[-4000:]
    records = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    return records[-1]


@pytest.mark.slow
def test_keypoint_fit_replays_and_reports_oks_map(keypoint_run: KeypointRun) -> None:
    """The schema from the dataset's categories, one compiled training step replayed (no compile, one host read per
    log point), the four keypoint losses logged, OKS keypoint mAP beside the box mAP in the record and the summary."""
    record = final_record(keypoint_run)
    log = keypoint_run.fit.stdout + keypoint_run.fit.stderr
    assert "num_keypoints_per_class=[0, 5, 5, 5]" in log
    resolved = yaml.safe_load((keypoint_run.out / "config.yaml").read_text())  # what a weight file rebuilds from
    assert resolved["model"]["num_keypoints_per_class"] == [0, 5, 5, 5], resolved["model"]
    assert record["step"] == STEPS and record["step_mode"] == "replay" and record["step_traces"] == 2
    records = [json.loads(line) for line in (keypoint_run.out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and r["step"] > 1 and "eval/mAP" not in r]
    assert steps and all(r["xla_new_compiles"] == 0 and r["xla_aten_fallbacks"] == 0 for r in steps), steps
    for name in ("l1", "findable", "visible", "nll"):
        assert np.isfinite(record[f"loss_keypoints_{name}"]), record
    assert record["eval/kp_mAP"] >= 0 and "eval/kp_AR" in record
    summary = json.loads((keypoint_run.out / "eval" / f"step{STEPS:07d}_coco_eval.json").read_text())
    assert summary["keypoints"]["stats"]["mAP"] == record["eval/kp_mAP"] and summary["keypoints"]["max_dets"] == 20


def _predicted_keypoints(run: KeypointRun) -> tuple[list[dict], dict[int, int], object]:
    """predict's results, its image ids -> the split's, and the split's ground truth."""
    from pycocotools.coco import COCO

    gt = COCO(str(run.data / "valid" / "_annotations.coco.json"))
    ids = {image["file_name"]: image["id"] for image in gt.dataset["images"]}
    folder = {row["id"]: row["file_name"] for row in json.loads(run.predicted.with_suffix(".images.json").read_text())}
    return json.loads(run.predicted.read_text()), {i: ids[name] for i, name in folder.items()}, gt


@pytest.mark.slow
def test_oks_map_equals_pycocotools_on_predicts_keypoints(keypoint_run: KeypointRun) -> None:
    """``predict``'s keypoints for ``last.pth`` (the weights the final evaluation scored), mapped to the split's image
    ids by file name, scored by pycocotools itself at rfdetr's settings (maxDets 20, uniform 0.05 sigmas for 5
    keypoints): the fit's ``eval/kp_*`` to 1e-4."""
    from pycocotools.cocoeval import COCOeval
    from rfdetr.evaluation.coco_eval import patched_pycocotools_summarize

    from spmd_rfdetr.eval.keypoints import keypoint_stat_names

    record = final_record(keypoint_run)
    results, folder_ids, gt = _predicted_keypoints(keypoint_run)
    assert results and all(len(r["keypoints"]) == 15 for r in results)  # 5 keypoints (the root class: maxK, as rfdetr)
    points = [{"image_id": folder_ids[r["image_id"]], "category_id": r["category_id"], "score": r["score"],
               "keypoints": r["keypoints"]} for r in results]
    evaluator = COCOeval(gt, gt.loadRes(points), "keypoints")
    evaluator.params.kpt_oks_sigmas = np.full(5, 0.05)
    evaluator.params.imgIds = sorted(folder_ids.values())
    evaluator.params.maxDets = [20]
    evaluator.evaluate()
    evaluator.accumulate()
    patched_pycocotools_summarize(evaluator, log_summary=False)
    ours = np.asarray([record[f"eval/kp_{name}"] for name in keypoint_stat_names()])
    np.testing.assert_allclose(ours, evaluator.stats, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_oks_map_equals_upstream_eager_eval_of_last_pth(keypoint_run: KeypointRun) -> None:
    """Upstream rfdetr on the CPU, eager: its keypoint model with ``last.pth``'s weights, its ``PostProcess``
    (keypoint decode, fused scores) and its ``CocoEvaluator`` for bbox and keypoints on the valid split as rfdetr
    builds it: the keypoint results the fit's final evaluation scored, detection by detection, and its ``eval/mAP`` and
    ``eval/kp_mAP`` (and the rest of both summaries) to 1e-4."""
    from rfdetr.config import TrainConfig

    from spmd_rfdetr.eval.coco import stat_names
    from spmd_rfdetr.eval.keypoints import keypoint_stat_names
    from support.runs import upstream_coco_eval

    record = final_record(keypoint_run)
    evaluator = upstream_coco_eval(keypoint_run.out / "last.pth", ["bbox", "keypoints"])
    max_dets = TrainConfig.model_fields["eval_max_dets"].default
    ours = json.loads((keypoint_run.out / "eval" / f"step{STEPS:07d}_keypoints.json").read_text())
    _same_keypoint_results(ours, evaluator.coco_results["keypoints"])
    for prefix, iou_type, names in (("eval/", "bbox", stat_names(max_dets)),
                                    ("eval/kp_", "keypoints", keypoint_stat_names())):
        ours = np.asarray([record[prefix + name] for name in names])
        np.testing.assert_allclose(ours, evaluator.coco_eval[iou_type].stats[:len(names)], atol=1e-4, rtol=0,
                                   err_msg=iou_type)


def _same_keypoint_results(ours: list[dict], theirs: list[dict]) -> None:
    """Two lists of COCO keypoint results hold the same detections per image: categories, scores (1e-5) and points
    (1e-3 px, confidences 1e-5), in score order up to ties: detections whose scores are within 1e-5 of each other
    may come in either order (two programs' last digits), so each of ours is paired with the closest of theirs of
    its category among those."""
    assert len(ours) == len(theirs) > 0
    for image_id in {r["image_id"] for r in theirs}:
        mine = sorted((r for r in ours if r["image_id"] == image_id), key=lambda r: -r["score"])
        other = sorted((r for r in theirs if r["image_id"] == image_id), key=lambda r: -r["score"])
        np.testing.assert_allclose([r["score"] for r in mine], [r["score"] for r in other], atol=1e-5)
        points = [np.asarray(r["keypoints"]).reshape(-1, 3) for r in mine]
        ref_points = [np.asarray(r["keypoints"]).reshape(-1, 3) for r in other]

        def distance(i: int, j: int) -> float:
            same = mine[i]["category_id"] == other[j]["category_id"]
            return float(np.abs(points[i] - ref_points[j]).max()) if same else np.inf

        pairs = pair_near_ties([r["score"] for r in mine], [r["score"] for r in other], distance, atol=1e-5)
        for a, j in zip(points, pairs):
            np.testing.assert_allclose(a[:, :2], ref_points[j][:, :2], atol=1e-3, err_msg=f"image {image_id}")
            np.testing.assert_allclose(a[:, 2], ref_points[j][:, 2], atol=1e-5, err_msg=f"image {image_id}")


@pytest.mark.slow
def test_upstream_from_checkpoint_predicts_our_keypoints(keypoint_run: KeypointRun) -> None:
    """``RFDETR.from_checkpoint(last.pth)`` (no torch_xla in its process) is an ``RFDETRKeypointPreview`` whose
    ``predict`` gives our ``predict``'s detections: the same fused scores in the same order, and every detection's
    keypoints and their confidences (at the model's resolution, where neither side resizes the image)."""
    assert keypoint_run.upstream.returncode == 0, keypoint_run.upstream.stderr[-3000:]
    theirs = json.loads(keypoint_run.upstream.stdout.strip().splitlines()[-1])
    assert theirs["class"] == "RFDETRKeypointPreview"
    results, _, _ = _predicted_keypoints(keypoint_run)
    checked = 0
    for image_id, upstream in enumerate(theirs["images"]):
        rows = sorted((r for r in results if r["image_id"] == image_id), key=lambda r: -r["score"])
        order = np.argsort(-np.asarray(upstream["score"]), kind="stable")
        order = order[np.asarray(upstream["label"])[order] < 4]  # label 4: the "no object" logit, which we drop
        assert len(rows) == len(order) > 0, (len(rows), len(order))
        np.testing.assert_allclose([r["score"] for r in rows], np.asarray(upstream["score"])[order], atol=1e-4)
        for row, k in zip(rows, order):
            points = np.asarray(row["keypoints"]).reshape(-1, 3)
            np.testing.assert_allclose(points[:, :2], np.asarray(upstream["xy"][k])[:len(points)], atol=1e-2)
            np.testing.assert_allclose(points[:, 2], np.asarray(upstream["confidence"][k])[:len(points)], atol=1e-4)
            checked += 1
    assert checked >= 4 * 20


@pytest.mark.slow
def test_export_onnx_of_the_keypoint_model_runs_like_the_eager_model(keypoint_run: KeypointRun) -> None:
    """``export`` of ``last.pth`` through rfdetr's exporter: an ONNX graph with rfdetr's ``keypoints`` output (raw, of
    the last layer), equal under onnxruntime to the eager model's boxes, logits and keypoints; the tracer's warnings
    of rfdetr's export are left out, as every library warning that does not apply (``spmd_rfdetr.quiet``)."""
    pytest.importorskip("onnxruntime", reason="ONNX export needs rfdetr's onnx extra")
    from support.models import assert_onnx_runs_like_eager

    final_record(keypoint_run)
    assert keypoint_run.exported.returncode == 0, keypoint_run.exported.stderr[-3000:]
    assert "Warning: " not in keypoint_run.exported.stderr, keypoint_run.exported.stderr[-3000:]  # quiet.WARNINGS
    assert_onnx_runs_like_eager(keypoint_run.onnx, keypoint_run.out / "last.pth", SIZE, "keypoints")


@pytest.mark.slow
def test_predict_draws_keypoints_and_the_skeleton(keypoint_run: KeypointRun) -> None:
    """``predict --save_images`` without ``--threshold`` (drawn at 0.5, the JSON keeping every detection): each image
    drawn at its size, nothing changed away from the detections scoring >= 0.5, their keypoints' pixels changed; and
    each image's best detection drawn by ``draw.draw``: its keypoints' pixels change; the dataset's skeleton (synth:
    the centre to each other point) adds edges to the split's own keypoints drawn."""
    from PIL import Image

    from spmd_rfdetr.eval import draw
    from support.drawing import changed_at_keypoints, check_drawing, original_pixels

    results, _, _ = _predicted_keypoints(keypoint_run)
    files = {row["id"]: row["file_name"]
             for row in json.loads(keypoint_run.predicted.with_suffix(".images.json").read_text())}
    assert sorted(p.name for p in keypoint_run.drawn.iterdir()) == sorted(files.values())
    categories = json.loads((keypoint_run.data / "train" / "_annotations.coco.json").read_text())["categories"]
    names = {c["id"]: c["name"] for c in categories}
    assert all(r["category_name"] == names[r["category_id"]] for r in results)
    skeleton = draw.skeletons(categories)
    assert sorted(skeleton) == [1, 2, 3] and len(skeleton[1]) == 4
    gt = json.loads((keypoint_run.data / "valid" / "_annotations.coco.json").read_text())
    at_points, with_edges = [], 0
    for image_id, name in files.items():
        original, drawn = keypoint_run.data / "valid" / name, keypoint_run.drawn / name
        rows = [r for r in results if r["image_id"] == image_id and r["score"] >= draw.DRAW_THRESHOLD]
        check_drawing(original, drawn, rows)
        at_points += changed_at_keypoints(original_pixels(original, drawn), original_pixels(drawn, drawn), rows)
        best = max((r for r in results if r["image_id"] == image_id), key=lambda r: r["score"])
        image = Image.open(original).convert("RGB")
        changed = changed_at_keypoints(np.asarray(image), np.asarray(draw.draw(image, [best], skeleton)), [best])
        assert changed and np.mean(changed) >= 0.8, (name, changed)
        # the skeleton's edges, on the split's own keypoints (a short fit leaves a detection's points on one spot)
        split_id = next(im["id"] for im in gt["images"] if im["file_name"] == name)
        truth = [{**a, "score": 1.0} for a in gt["annotations"] if a["image_id"] == split_id]
        vertices_only, full = np.asarray(draw.draw(image, truth)), np.asarray(draw.draw(image, truth, skeleton))
        with_edges += int((vertices_only != full).any())
    assert not at_points or np.mean(at_points) >= 0.8, at_points
    assert with_edges == len(files), with_edges
    print(f"keypoints drawn at >= {draw.DRAW_THRESHOLD}: {len(at_points)}")

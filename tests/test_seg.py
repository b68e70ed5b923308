"""RF-DETR Seg end to end, as a user runs it: ``fit --config configs/cpu-seg.yaml`` on the session's synthetic masks
(with rfdetr's multi-scale buckets and FSDP on: the detectors' mechanisms carry the masks too), ``predict`` with RLE
masks, segm mAP against pycocotools and upstream rfdetr's own eager evaluation, upstream's ``RFDETR.from_checkpoint``
predicting our masks in a process without torch_xla, and rfdetr's ONNX exporter."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from jobs import JobInputs, job_fixture
from PIL import Image
from support.runs import cli

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
SCALES = [84, 96]  # two of rfdetr's multi-scale sizes for Seg Nano at 96 px: the split is read at 96
PNG_SIZE = 96  # the model's resolution: both sides' resizes are the identity
BACKBONE_BLOCKS = 2  # of DINOv2's 12: every program compiles and runs several times faster (the suite's budget)

#: Upstream rfdetr alone: ``RFDETR.from_checkpoint`` on our weight file, its ``predict`` masks as COCO RLE.
UPSTREAM_SEG_PREDICT = """
import json, sys
import numpy as np
from pycocotools import mask as mask_util
from rfdetr import RFDETR
checkpoint, images = sys.argv[1], sys.argv[2:]
model = RFDETR.from_checkpoint(checkpoint)
assert "torch_xla" not in sys.modules, "upstream ran with torch_xla imported"
out = {"class": type(model).__name__, "images": []}
for path in images:
    d = model.predict(path, threshold=0.0)
    rles = [mask_util.encode(np.asfortranarray(m.astype(np.uint8))) for m in d.mask]
    out["images"].append({"score": d.confidence.tolist(), "label": d.class_id.tolist(),
                          "masks": [{"size": r["size"], "counts": r["counts"].decode()} for r in rles]})
print(json.dumps(out))
"""


@dataclass
class SegRun:
    """The seg fit's output folder, its two predictions and upstream's."""

    out: Path
    fit: subprocess.CompletedProcess
    predicted: Path
    """``predict`` of ``last.pth`` on the valid split's images."""
    pngs: list[Path]
    """Valid images at the model's resolution, for the interop check."""
    ours_png: Path
    """``predict`` of ``best.pth`` on :attr:`pngs` (with ``--save_images`` :attr:`drawn`)."""
    drawn: Path
    upstream: subprocess.CompletedProcess
    exported: subprocess.CompletedProcess
    """``export`` of ``last.pth`` to :attr:`onnx`, in its own process as a user runs it."""
    onnx: Path


@job_fixture
def seg_run(inputs: JobInputs, base: Path) -> SegRun:
    """``configs/cpu-seg.yaml`` for :data:`STEPS` steps on the session dataset (evaluated at the last) with
    multi-scale buckets :data:`SCALES` and a 2 x 2 (data x fsdp) mesh, then ``predict`` twice (drawing the PNGs) and upstream's
    ``from_checkpoint`` predict in a process without torch_xla, and ``export`` of ``last.pth``."""
    cfg = yaml.safe_load((ROOT / "configs" / "cpu-seg.yaml").read_text())
    out = base / "run"
    cfg["model"].update(backbone_blocks=BACKBONE_BLOCKS)
    cfg["data"].update(dataset_dir=inputs.synth_dir, num_workers=0, multi_scale=True, scales=SCALES)
    cfg["mesh"].update(fsdp=2)
    cfg["trainer"].update(output_dir=str(base / "not-this-one"), max_steps=1, log_every=STEPS // 4)  # train() sets
    cfg["eval"].update(every_steps=STEPS, save_detections=True)
    config = base / "seg.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {**inputs.env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    # through spmd_rfdetr.train(config=...) with no variant: the recipe's seg variant must stand
    fit = subprocess.run([sys.executable, "-c", "import sys, spmd_rfdetr; spmd_rfdetr.train(config=sys.argv[1], "
                          "output_dir=sys.argv[2], max_steps=int(sys.argv[3]))", str(config), str(out), str(STEPS)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    predicted = base / "valid_predictions.json"
    if fit.returncode == 0:
        cli("predict", "--config", str(config), "--checkpoint", str(out / "last.pth"), "--images",
            str(Path(inputs.synth_dir) / "valid"), "--output", str(predicted), env=env)
    folder = base / "pngs"
    folder.mkdir()
    for name in sorted(p.name for p in (Path(inputs.synth_dir) / "valid").glob("*.jpg"))[:4]:
        image = Image.open(Path(inputs.synth_dir) / "valid" / name).convert("RGB")
        image.resize((PNG_SIZE, PNG_SIZE)).save(folder / f"{name}.png")
    pngs = sorted(folder.iterdir())
    ours_png, drawn = base / "png_predictions.json", base / "drawn"
    cli("predict", "--config", str(config), "--checkpoint", str(out / "best.pth"), "--images", str(folder),
        "--output", str(ours_png), "--save_images", str(drawn), env=env)
    no_xla = {k: v for k, v in inputs.env.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS")}
    upstream = subprocess.run([sys.executable, "-c", UPSTREAM_SEG_PREDICT, str(out / "best.pth"), *map(str, pngs)],
                              cwd=base, env={**no_xla, "USE_TORCH_XLA": "0"}, capture_output=True, text=True,
                              timeout=900)
    onnx = base / "seg.onnx"
    exported = cli("export", "--checkpoint", str(out / "last.pth"), "--output", str(onnx), env=env)
    return SegRun(out, fit, predicted, pngs, ours_png, drawn, upstream, exported, onnx)


def final_record(run: SegRun) -> dict:
    assert run.fit.returncode == 0, run.fit.stderr[-4000:]
    records = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    return records[-1]


@pytest.mark.slow
def test_seg_fit_replays_and_reports_segm_map(seg_run: SegRun) -> None:
    """Every bucket compiled before step 1 and replayed (one trace each, plus replay's check), FSDP sharding the
    weights, mask losses logged, segm mAP beside bbox mAP in the record and the summary file."""
    record = final_record(seg_run)
    assert record["step"] == STEPS and record["step_mode"] == "replay" and record["step_traces"] == len(SCALES) + 1
    assert all(f"multi-scale: compiled {size} px" in seg_run.fit.stdout + seg_run.fit.stderr for size in SCALES)
    resolved = yaml.safe_load((seg_run.out / "config.yaml").read_text())
    assert resolved["mesh"]["fsdp"] == 2 and resolved["mesh"]["cpu_devices"] == 4, resolved["mesh"]  # data: the rest
    assert record["loss_mask_ce"] > 0 and record["loss_mask_dice"] > 0
    assert record["eval/segm_mAP"] > 0.01, record  # a trained model, not a blank one
    summary = json.loads((seg_run.out / "eval" / f"step{STEPS:07d}_coco_eval.json").read_text())
    assert summary["segm"]["stats"]["mAP"] == record["eval/segm_mAP"] and summary["stats"]["mAP"] == record["eval/mAP"]


def _pycocotools_stats(synth_dir: str, results: list[dict], iou_type: str, max_dets: int) -> np.ndarray:
    """pycocotools' own summary of ``results`` (image ids of the split's annotations) on the valid split."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    from rfdetr.evaluation.coco_eval import patched_pycocotools_summarize

    gt = COCO(str(Path(synth_dir) / "valid" / "_annotations.coco.json"))
    keys = ("image_id", "category_id", "score", "bbox" if iou_type == "bbox" else "segmentation")
    evaluator = COCOeval(gt, gt.loadRes([{k: r[k] for k in keys} for r in results]), iou_type)  # a bbox key would
    evaluator.params.imgIds = sorted(image["id"] for image in gt.dataset["images"])  # make loadRes score boxes
    evaluator.params.maxDets = [1, 10, max_dets]
    evaluator.evaluate()
    evaluator.accumulate()
    patched_pycocotools_summarize(evaluator, log_summary=False)
    return evaluator.stats


def _predicted_on_split_ids(run: SegRun, synth_dir: str) -> list[dict]:
    """``predict``'s results for ``last.pth``, their image ids mapped to the split's by file name."""
    gt = json.loads((Path(synth_dir) / "valid" / "_annotations.coco.json").read_text())
    ids = {image["file_name"]: image["id"] for image in gt["images"]}
    folder_ids = {row["id"]: ids[row["file_name"]]
                  for row in json.loads(run.predicted.with_suffix(".images.json").read_text())}
    return [{**r, "image_id": folder_ids[r["image_id"]]} for r in json.loads(run.predicted.read_text())]


@pytest.mark.slow
def test_segm_map_equals_pycocotools_on_the_fits_own_detections(seg_run: SegRun, synth_dir: str) -> None:
    """The final evaluation's detections (``eval.save_detections``: boxes and COCO RLE masks) scored by pycocotools
    itself: the fit's ``eval/segm_*`` and ``eval/*`` to 1e-4."""
    from spmd_rfdetr.eval.coco import MAX_DETS, label2cat_for, stat_names

    record = final_record(seg_run)
    assert label2cat_for(synth_dir) is not None
    own = json.loads((seg_run.out / "eval" / f"step{STEPS:07d}_detections.json").read_text())
    assert own and all("segmentation" in r for r in own)
    for prefix, iou_type in (("eval/", "bbox"), ("eval/segm_", "segm")):
        ours = np.asarray([record[prefix + name] for name in stat_names(MAX_DETS)])
        np.testing.assert_allclose(ours, _pycocotools_stats(synth_dir, own, iou_type, MAX_DETS), atol=1e-4, rtol=0,
                                   err_msg=iou_type)


@pytest.mark.slow
def test_upstream_eager_eval_of_last_pth_equals_pycocotools_on_predicts_rles(seg_run: SegRun, synth_dir: str) -> None:
    """Upstream rfdetr on the CPU, eager: its model with ``last.pth``'s weights, its ``PostProcess`` (masks resized to
    each image) and its ``CocoEvaluator`` for bbox and segm on the valid split as rfdetr builds it, against our
    ``predict`` of ``last.pth`` (boxes and RLE masks) scored by pycocotools: both summaries to 1e-4. And ``last.pth``
    holds the weights the final evaluation scored: ``predict``'s scores are the fit's own, image by image, up to the
    rounding of the run's FSDP-sharded evaluation (median 2e-5 here; a 40-step model's near-tied proposals can still
    reorder a few images, which moves its AP by up to ~1e-2, so the fit's own figures are compared with pycocotools on
    its own detections above, not with a new process's)."""
    from rfdetr.config import TrainConfig

    from spmd_rfdetr.eval.coco import stat_names
    from support.runs import upstream_coco_eval

    final_record(seg_run)
    predicted = _predicted_on_split_ids(seg_run, synth_dir)
    assert predicted and all("segmentation" in r for r in predicted)
    evaluator = upstream_coco_eval(seg_run.out / "last.pth", ["bbox", "segm"])
    max_dets = TrainConfig.model_fields["eval_max_dets"].default
    for iou_type in ("bbox", "segm"):
        ours = _pycocotools_stats(synth_dir, predicted, iou_type, max_dets)
        np.testing.assert_allclose(ours, evaluator.coco_eval[iou_type].stats, atol=1e-4, rtol=0, err_msg=iou_type)
        assert len(ours) == len(stat_names(max_dets))
    own = json.loads((seg_run.out / "eval" / f"step{STEPS:07d}_detections.json").read_text())
    gaps = []
    for image in {r["image_id"] for r in own}:
        mine = sorted((r["score"] for r in own if r["image_id"] == image), reverse=True)
        theirs = sorted((r["score"] for r in predicted if r["image_id"] == image), reverse=True)
        assert len(mine) == len(theirs), image
        gaps.append(max(abs(a - b) for a, b in zip(mine, theirs)))
    assert float(np.median(gaps)) < 1e-3, sorted(gaps)


@pytest.mark.slow
def test_upstream_from_checkpoint_predicts_our_masks(seg_run: SegRun) -> None:
    """``RFDETR.from_checkpoint(best.pth)`` (no torch_xla in its process) is an ``RFDETRSegNano`` whose ``predict``
    gives our ``predict``'s detections: the same scores and labels in the same order and every instance's mask with
    IoU >= 0.99 (at the model's resolution, where neither side resizes the image)."""
    from pycocotools import mask as mask_util

    from spmd_rfdetr.eval.coco import label2cat_for

    assert seg_run.upstream.returncode == 0, seg_run.upstream.stderr[-3000:]
    theirs = json.loads(seg_run.upstream.stdout.strip().splitlines()[-1])
    assert theirs["class"] == "RFDETRSegNano"
    ours = json.loads(seg_run.ours_png.read_text())
    saved = torch.load(seg_run.out / "best.pth", map_location="cpu", weights_only=True)
    cat2label = {c: label for label, c in (label2cat_for(saved["config"]["data"]["dataset_dir"]) or {}).items()}
    checked = 0
    for image_id, upstream in enumerate(theirs["images"]):
        rows = sorted((d for d in ours if d["image_id"] == image_id), key=lambda d: -d["score"])
        order = np.argsort(-np.asarray(upstream["score"]), kind="stable")
        order = order[np.isin(np.asarray(upstream["label"])[order], list(cat2label.values()))]
        assert len(rows) == len(order) > 0, (len(rows), len(order))
        np.testing.assert_allclose([d["score"] for d in rows], np.asarray(upstream["score"])[order], atol=1e-4)
        assert [cat2label[d["category_id"]] for d in rows] == np.asarray(upstream["label"])[order].tolist()
        for row, k in zip(rows, order):
            mine, other = row["segmentation"], upstream["masks"][k]
            assert mine["size"] == other["size"] == [PNG_SIZE, PNG_SIZE]
            union = mask_util.area(mask_util.merge([mine, other], intersect=False))
            iou = mask_util.iou([mine], [other], [0])[0, 0] if union else 1.0
            assert iou >= 0.99, (image_id, row, iou)
            checked += 1
    assert checked >= 4 * 30 * 3 // 2  # most of the 30 queries x 3 classes each image selects


@pytest.mark.slow
def test_export_onnx_of_a_seg_model_runs_like_the_eager_model(seg_run: SegRun) -> None:
    """``export`` of ``last.pth`` through rfdetr's exporter: an ONNX graph with rfdetr's ``masks`` output, equal under
    onnxruntime to the eager model's boxes, logits and mask logits."""
    pytest.importorskip("onnxruntime", reason="ONNX export needs rfdetr's onnx extra")
    from support.models import assert_onnx_runs_like_eager

    final_record(seg_run)
    assert seg_run.exported.returncode == 0, seg_run.exported.stderr[-3000:]
    assert_onnx_runs_like_eager(seg_run.onnx, seg_run.out / "last.pth", PNG_SIZE, "masks")


@pytest.mark.slow
def test_predict_draws_masks(seg_run: SegRun) -> None:
    """``predict --save_images`` without ``--threshold`` (drawn at 0.5, the JSON keeping every detection): each PNG
    drawn at its size with its category names, the pixels away from every box, label and mask of the detections
    scoring >= 0.5 unchanged, inside each drawn mask changed; and on each image its best detection with a mask to see
    (a short run's best may have next to none) drawn by ``draw.draw``: inside its mask the pixels change."""
    from spmd_rfdetr.eval import draw
    from support.drawing import MIN_INTERIOR, changed_inside_masks, check_drawing, mask_interior, original_pixels

    final_record(seg_run)
    ours = json.loads(seg_run.ours_png.read_text())
    files = {row["id"]: row["file_name"] for row in json.loads(seg_run.ours_png.with_suffix(".images.json").read_text())}
    assert sorted(p.name for p in seg_run.drawn.iterdir()) == sorted(files.values())
    assert {d["category_name"] for d in ours} == {"rectangle", "ellipse", "triangle"}
    fractions, drawn_in_memory = [], 0
    for image_id, name in files.items():
        original, drawn = seg_run.pngs[0].parent / name, seg_run.drawn / name
        rows = [d for d in ours if d["image_id"] == image_id and d["score"] >= draw.DRAW_THRESHOLD]
        check_drawing(original, drawn, rows)
        before = original_pixels(original, drawn)
        fractions += changed_inside_masks(before, original_pixels(drawn, drawn), rows)
        seen = [d for d in ours if d["image_id"] == image_id and mask_interior(d).sum() >= MIN_INTERIOR]
        if not seen:
            continue
        best = max(seen, key=lambda d: d["score"])
        image = Image.open(original).convert("RGB")
        in_memory = changed_inside_masks(np.asarray(image), np.asarray(draw.draw(image, [best])), [best])
        assert in_memory and in_memory[0] > 0.9, (name, best["score"], in_memory)
        drawn_in_memory += 1
    assert drawn_in_memory >= 1, "no detection with a mask to see on any image"
    assert all(f > 0.9 for f in fractions), fractions
    print(f"masks drawn at >= {draw.DRAW_THRESHOLD}: {len(fractions)}; images with a best mask drawn in memory: "
          f"{drawn_in_memory} of {len(files)}")

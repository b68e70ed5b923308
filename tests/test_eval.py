"""Evaluation and prediction on the 4-device CPU mesh, against upstream rfdetr's own eager CPU evaluation.

The session's short ``fit`` (``conftest.fit_run``, eval inside it every 20 steps) trains the tiny model; its
``last.pth`` feeds the other tests. Besides
that run's training step, the module compiles one eval program per batch shape (8 for fit/validate/predict, 12 for the
padded-split test).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met

from spmd_rfdetr.eval import evaluator as ev
from spmd_rfdetr.eval.coco import BOXES, LABEL, SCORE
from spmd_rfdetr.model.inputs import as_samples

from support.drawing import check_drawing
from support.models import EVAL_EVERY
from support.runs import read_metrics
from support.ties import pair_near_ties

SUBSET, EVAL_BATCH = 20, 12  # 20 images in global batches of 12: 12 + 8 padded to 12
pytestmark = pytest.mark.slow  # every test reads the session fit (conftest.fit_run) or compiles an eval program


def counter(name: str) -> int:
    return int(met.counter_value(name) or 0)


def samples(name: str) -> int:
    data = met.metric_data(name)
    return int(data[0]) if data else 0


@pytest.fixture(scope="module")
def valid_split(tiny):
    from spmd_rfdetr.data.splits import build_split

    return build_split(tiny.cfgs, "valid")


@pytest.fixture(scope="module")
def trained_state(fit_run):
    return torch.load(fit_run / "last.pth", map_location="cpu", weights_only=False)["model"]


@pytest.fixture(scope="module")
def first_eval(tiny, trained_state, valid_split):
    """A padded 20-image split in global batches of 12 (a new batch shape), with the counters it moved."""
    from spmd_rfdetr.xla.fabric import spmd_fabric
    from spmd_rfdetr.xla.mesh import build_mesh
    from spmd_rfdetr.model.upstream import build_model

    fabric = spmd_fabric(build_mesh(), precision="32-true")
    net = build_model(tiny.cfgs)
    net.load_state_dict(trained_state)
    net = fabric.setup_module(net.eval())
    subset = torch.utils.data.Subset(valid_split, range(SUBSET))
    evaluator = ev.Evaluator(net, subset, mesh=fabric.strategy.mesh, global_batch_size=EVAL_BATCH,
                             resolution=tiny.cfgs.model.resolution, num_select=tiny.cfgs.model.num_select)
    torch_xla.sync()
    before = {"uncached": counter("UncachedCompile"), "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
              "transfers": samples("TransferFromDeviceTime")}
    result = evaluator.run()
    after = {"uncached": counter("UncachedCompile"), "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
             "transfers": samples("TransferFromDeviceTime")}
    moved = {k: after[k] - before[k] for k in before}
    print(f"first eval: {moved}\n{result.metrics.table()}")
    return evaluator, result, moved


def upstream_eager_eval(tiny, state, dataset):
    """Upstream rfdetr on the CPU: its model, its PostProcess and its CocoEvaluator (faster-coco-eval) at its training
    eval's ``eval_max_dets`` (pycocotools caps detections per image and class: the tiny model's 30 queries give at
    most 30, so 500 and 100 agree here; ``test_coco.py`` scores more)."""
    from rfdetr.config import TrainConfig
    from rfdetr.datasets import get_coco_api_from_dataset
    from rfdetr.evaluation.coco_eval import CocoEvaluator

    from spmd_rfdetr.data.pixels import upstream_float
    from spmd_rfdetr.model.upstream import build_model, build_upstream_criterion

    net = build_model(tiny.cfgs)
    net.load_state_dict(state)
    net.eval()
    postprocess = build_upstream_criterion(tiny.cfgs)[1]
    max_dets = TrainConfig.model_fields["eval_max_dets"].default
    evaluator = CocoEvaluator(get_coco_api_from_dataset(dataset), ["bbox"], max_dets=max_dets, log_summary=False)
    rows = []
    with torch.no_grad():
        for start in range(0, len(dataset), 8):
            items = [dataset[i] for i in range(start, min(start + 8, len(dataset)))]
            # the split's uint8 pixels through upstream's own host ToDtype + Normalize
            outputs = net(as_samples(upstream_float(torch.stack([image for image, _ in items]))))
            sizes = torch.stack([target["orig_size"] for _, target in items])
            results = postprocess(outputs, sizes)
            evaluator.update({int(target["image_id"]): r for (_, target), r in zip(items, results)})
            rows.append(ev.reference_postprocess(outputs, sizes, postprocess.num_select))
    evaluator.synchronize_between_processes()
    evaluator.accumulate()
    return np.asarray(evaluator.coco_eval["bbox"].stats, dtype=np.float64), torch.cat(rows).numpy()


def test_padded_split_one_eval_graph_and_upstream_eager_parity(tiny, trained_state, valid_split, first_eval):
    evaluator, result, moved = first_eval
    assert result.batches == 2 and len(result.image_ids) == SUBSET  # 12 + 8 padded to 12: padding never scored
    assert sorted(result.image_ids) == sorted(int(valid_split[i][1]["image_id"]) for i in range(SUBSET))
    assert moved["graphs"] == 1, moved  # dynamo traced the eval forward once, padded batch included
    assert moved["uncached"] == 1, moved  # XLA compiled exactly one program for this batch shape
    assert moved["transfers"] == 2, moved  # results leave the device once per batch
    again = counter("UncachedCompile"), torch._dynamo.utils.counters["stats"]["unique_graphs"]
    evaluator.run()
    assert (counter("UncachedCompile"), torch._dynamo.utils.counters["stats"]["unique_graphs"]) == again

    ref_stats, ref_rows = upstream_eager_eval(tiny, trained_state, torch.utils.data.Subset(valid_split, range(SUBSET)))
    ours = np.asarray(list(result.metrics.stats.values()))
    print("mAP parity: ours", ours.round(5).tolist(), "upstream eager", ref_stats.round(5).tolist())
    assert result.metrics.stats["mAP50"] > 0.05, result.metrics.stats  # a non-trivial model, not all zeros
    np.testing.assert_allclose(ours, ref_stats, atol=1e-4, rtol=0)
    rows = ev.run_detection(evaluator.forward, evaluator.loader, evaluator.to_device).rows
    np.testing.assert_allclose(rows[..., SCORE], ref_rows[..., SCORE], atol=1e-4)
    assert_rows_match_up_to_near_ties(rows, ref_rows)


def assert_rows_match_up_to_near_ties(rows: np.ndarray, ref_rows: np.ndarray) -> None:
    """Each image's detections (``[images, K, columns]``, best first) equal the reference's: label, and box to 1e-2 px
    (of a 160 px image), where two detections whose scores agree to 1e-4 may come in either order (top-k of a near
    tie): each is paired with the closest of the reference's near-tied ones of its label."""
    for image, (ours, ref) in enumerate(zip(rows, ref_rows)):
        def distance(i: int, j: int) -> float:
            same = ours[i, LABEL] == ref[j, LABEL]
            return float(np.abs(ours[i, BOXES] - ref[j, BOXES]).max()) if same else np.inf

        pairs = pair_near_ties(ours[:, SCORE], ref[:, SCORE], distance, atol=1e-4)
        np.testing.assert_allclose(ours[:, BOXES], ref[pairs][:, BOXES], atol=1e-2, rtol=0, err_msg=f"image {image}")


def test_the_train_split_is_evaluated_as_read_for_evaluation(tiny, first_eval):
    """``eval.split: train`` reads the train images with rfdetr's validation transforms (the train transforms flip and
    jitter, and with ``data.multi_scale`` change the size): two evaluations give the same detections and mAP."""
    import dataclasses

    from spmd_rfdetr.data.splits import build_eval_split
    from spmd_rfdetr.model.upstream import upstream_configs

    evaluator, _, _ = first_eval
    cfg = tiny.cfg
    cfgs = upstream_configs(cfg.model, dataclasses.replace(cfg.data, multi_scale=True), cfg.optim, num_classes=3)
    split = torch.utils.data.Subset(build_eval_split(cfgs, "train"), range(SUBSET))
    from rfdetr.datasets import get_coco_api_from_dataset

    from spmd_rfdetr.eval.coco import coco_metrics

    passes = []
    for _ in range(2):
        loader = ev.eval_loader(split, EVAL_BATCH, cfgs.model.resolution)
        found = ev.run_detection(evaluator.forward, loader, evaluator.to_device)
        results = found.to_coco(evaluator.label2cat)
        passes.append((found, coco_metrics(get_coco_api_from_dataset(split), results, found.image_ids.tolist())))
    (first, first_map), (second, second_map) = passes
    np.testing.assert_array_equal(first.rows, second.rows)
    assert first_map.stats == second_map.stats and first_map.stats["mAP50"] > 0, first_map.stats


def test_seg_masks_are_encoded_batch_by_batch(valid_split, tiny):
    """A seg evaluation's host memory is bounded by a batch, not the split: the mask logits of each fetched batch
    become RLEs at once (Seg Nano on a 5,000-image split kept ~24 GB of logits before). Measured with tracemalloc
    (numpy's buffers are traced) on two split sizes through a compiled program with a seg head's outputs."""
    import tracemalloc

    from spmd_rfdetr.xla.mesh import build_mesh

    num_select, plane = 40, 32

    class MaskForward(torch.nn.Module):
        """A compiled program with the eval forward's outputs: rows ``[B, K, 6]`` and mask logits ``[B, K, h, w]``
        (a blob per detection, so each RLE stays short as a real mask's)."""

        def forward(self, images, orig_size):
            pixels = images.float().mean(dim=(1, 2, 3))
            rows = pixels[:, None, None].expand(-1, num_select, 6).contiguous()
            grid = torch.linspace(-1, 1, plane, device=images.device)
            blob = 1 - (grid[:, None] ** 2 + grid[None, :] ** 2)
            masks = blob[None, None] + pixels[:, None, None, None] * 0
            return rows, masks.expand(-1, num_select, -1, -1).contiguous()

    class Forward:
        def __init__(self):
            self.program = torch.compile(MaskForward(), backend="openxla", fullgraph=True, dynamic=False)

        def __call__(self, images, orig_size):
            return self.program(images, orig_size)

        def eval_mode(self):
            import contextlib
            return contextlib.nullcontext()

    forward, to_device = Forward(), ev.device_sender(build_mesh())
    peaks = {}
    ev.run_detection(forward, ev.eval_loader(torch.utils.data.Subset(valid_split, range(8)), 8,
                                             tiny.cfgs.model.resolution), to_device)  # compiled before measuring
    for images in (8, 40):
        indices = [i % len(valid_split) for i in range(images)]
        loader = ev.eval_loader(torch.utils.data.Subset(valid_split, indices), 8, tiny.cfgs.model.resolution)
        tracemalloc.start()
        found = ev.run_detection(forward, loader, to_device)
        peaks[images] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(found.segmentations) == images and len(found.segmentations[0]) == num_select
        assert found.to_coco(None)[0]["segmentation"]["counts"]  # COCO RLEs, one per detection
    logits_per_image = num_select * plane * plane * 4
    print(f"peak traced host memory: {peaks}; one image's logits {logits_per_image} bytes")
    assert peaks[40] - peaks[8] < 8 * logits_per_image, peaks  # the 32 more images' logits were never held


def pycocotools_eval(gt, detections: Path, image_ids, max_dets: int | None = None):
    """pycocotools' own COCOeval of a results file, accumulated and summarised (at ``maxDets`` 1, 10, ``max_dets``)."""
    from pycocotools.cocoeval import COCOeval

    coco_eval = COCOeval(gt, gt.loadRes(str(detections)), "bbox")
    coco_eval.params.imgIds = sorted(image_ids)
    if max_dets is not None:
        coco_eval.params.maxDets = [1, 10, max_dets]
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    return coco_eval


def test_map_equals_pycocotools_on_the_detections_json(first_eval, synth_dir, tmp_path):
    """Our summary at maxDets 500 is pycocotools' at maxDets (1, 10, 500): its stats, with the mAP its own summary
    leaves at -1 (it reads mAP at 100 detections) taken from its accumulated precision as upstream's summary does."""
    from pycocotools.coco import COCO

    from spmd_rfdetr.eval.coco import MAX_DETS

    _, result, _ = first_eval
    summary = ev.save_result(result, tmp_path)
    saved = json.loads(summary.read_text())
    assert {row["name"] for row in saved["per_class"]} == {"rectangle", "ellipse", "triangle"}
    detections = json.loads((tmp_path / "detections.json").read_text())
    assert set(detections[0]) == {"image_id", "category_id", "bbox", "score"}
    assert {d["category_id"] for d in detections} <= {1, 2, 3}  # the dataset's ids, not rfdetr's label indices
    assert saved["max_dets"] == result.metrics.max_dets == MAX_DETS == 500
    gt = COCO(str(Path(synth_dir) / "valid" / "_annotations.coco.json"))
    at_500 = pycocotools_eval(gt, tmp_path / "detections.json", result.image_ids, MAX_DETS)
    ours = list(result.metrics.stats.values())
    precision = at_500.eval["precision"][:, :, :, 0, 2]  # [iou, recall, class, area "all", maxDets 500]
    assert at_500.stats[0] == -1 and ours[0] == pytest.approx(precision[precision > -1].mean(), abs=1e-6)
    np.testing.assert_allclose(ours[1:], at_500.stats[1:], atol=1e-6, rtol=0)
    assert saved["stats"] == result.metrics.stats and "AR500" in saved["stats"]


def test_validate_and_predict_cli_match_eval(fit_run, synth_dir, tmp_path, caplog):
    """The user's flow: the run's last.pth alone, then `validate` and `predict` (in this process), predict on a plain
    folder and on a split folder with annotations. No --config: the tiny architecture (not rfdetr's Nano default),
    dataset and batch size come from the checkpoint. Each detection names its dataset category; ``--threshold``
    keeps those scoring at least it, ``--save_images`` draws them (at 0.5 without a threshold, the JSON keeping all)."""
    from spmd_rfdetr.cli import main

    checkpoint = fit_run / "last.pth"
    main(["validate", "--checkpoint", str(checkpoint), "--output_dir", str(tmp_path / "val")])
    summary = json.loads((tmp_path / "val" / "coco_eval.json").read_text())
    assert summary["num_images"] == 40 and summary["stats"]["mAP50"] > 0.05
    eval_detections = json.loads((tmp_path / "val" / "detections.json").read_text())

    folder = tmp_path / "images"  # a plain folder: no annotations, ids from the sorted file names
    folder.mkdir()
    names = sorted(p.name for p in (Path(synth_dir) / "valid").glob("*.jpg"))[::8]  # 5 images: one padded batch
    for name in names:
        shutil.copy(Path(synth_dir) / "valid" / name, folder / name)
    main(["predict", "--checkpoint", str(checkpoint), "--images", str(folder), "--output", str(tmp_path / "pred.json")])
    predictions = json.loads((tmp_path / "pred.json").read_text())
    listed = {im["id"]: im["file_name"] for im in json.loads((tmp_path / "pred.images.json").read_text())}
    gt_ids = {im["file_name"]: im["id"] for im in
              json.loads((Path(synth_dir) / "valid" / "_annotations.coco.json").read_text())["images"]}
    assert sorted(listed.values()) == names
    for image_id, name in listed.items():
        assert_same_detections(predictions, image_id, eval_detections, gt_ids[name], name)
    categories = {c["id"]: c["name"] for c in
                  json.loads((Path(synth_dir) / "valid" / "_annotations.coco.json").read_text())["categories"]}
    assert all(d["category_name"] == categories[d["category_id"]] for d in predictions)  # the dataset's names
    assert {d["category_name"] for d in predictions} == {"rectangle", "ellipse", "triangle"}

    # --threshold and --save_images on the same program (no new compile): the detections scoring >= T, drawn
    scores = sorted((d["score"] for d in predictions), reverse=True)
    threshold = (scores[3] + scores[4]) / 2  # a few boxes over the 5 images, some images with none
    main(["predict", "--checkpoint", str(checkpoint), "--images", str(folder), "--output", str(tmp_path / "kept.json"),
          "--threshold", repr(threshold), "--save_images", str(tmp_path / "drawn")])
    kept = json.loads((tmp_path / "kept.json").read_text())
    above = [d for d in predictions if d["score"] >= threshold]
    assert all(d["score"] >= threshold for d in kept) and len(kept) == len(above) >= 4, (len(kept), len(above))
    key = lambda d: (d["image_id"], d["category_id"], d["category_name"], round(d["score"], 5))  # noqa: E731
    assert sorted(map(key, kept)) == sorted(map(key, above))
    assert sorted(p.name for p in (tmp_path / "drawn").iterdir()) == names
    far = [check_drawing(folder / name, tmp_path / "drawn" / name, [d for d in kept if d["image_id"] == image_id])
           for image_id, name in listed.items()]
    assert sum(f["far"] for f in far) > 0.3 * 5 * 160 * 160, far  # most pixels checked unchanged

    # the whole valid split folder, its annotation file giving ids unlike the sorted positions: predictions carry the
    # file's ids, and each image's detections are the eval's for that file
    from test_data_paths import relabelled_split

    ids = relabelled_split(Path(synth_dir) / "valid", tmp_path / "split")
    with caplog.at_level(logging.INFO, logger="spmd_rfdetr.eval.inference"):  # --save_images alone: drawn at 0.5
        main(["predict", "--checkpoint", str(checkpoint), "--images", str(tmp_path / "split"), "--output",
              str(tmp_path / "split.json"), "--save_images", str(tmp_path / "split_drawn")])
    assert "--save_images without --threshold: drawing the detections scoring >= 0.5" in caplog.text
    predictions = json.loads((tmp_path / "split.json").read_text())
    assert {im["file_name"]: im["id"] for im in json.loads((tmp_path / "split.images.json").read_text())} == ids
    assert {d["image_id"] for d in predictions} == set(ids.values())
    for name, image_id in ids.items():  # the JSON keeps every detection
        assert_same_detections(predictions, image_id, eval_detections, gt_ids[name], name)
        check_drawing(tmp_path / "split" / name, tmp_path / "split_drawn" / name,
                      [d for d in predictions if d["image_id"] == image_id and d["score"] >= 0.5])


def assert_same_detections(predictions: list, image_id: int, eval_detections: list, eval_id: int, name: str) -> None:
    """``predict``'s detections of one image (its id there) equal the eval's of the same file (its id there)."""
    ours = [(d["category_id"], d["score"], d["bbox"]) for d in predictions if d["image_id"] == image_id]
    theirs = [(d["category_id"], d["score"], d["bbox"]) for d in eval_detections if d["image_id"] == eval_id]
    assert len(ours) == len(theirs) > 0, name
    for (c1, s1, b1), (c2, s2, b2) in zip(ours, theirs):
        assert c1 == c2 and abs(s1 - s2) < 1e-5 and np.allclose(b1, b2, atol=1e-3), (name, b1, b2)


def test_fit_evaluates_every_n_steps_and_keeps_best(fit_run):
    records = read_metrics(fit_run)
    assert [r["step"] for r in records] == list(range(1, 2 * EVAL_EVERY + 1))  # log_every=1
    evals = [r for r in records if "eval/mAP" in r]
    assert [r["step"] for r in evals] == [EVAL_EVERY, 2 * EVAL_EVERY]  # every 20 steps, and the last one
    for r in evals:
        assert {"eval/mAP", "eval/mAP50", "eval/mAP75", "eval/mAP_small", "eval/AR1", "eval/AR500", "loss"} <= set(r)
    assert evals[1]["eval/best_mAP"] == max(r["eval/mAP"] for r in evals)
    print("fit eval/mAP50:", [r["eval/mAP50"] for r in evals])
    # Steps 21-40 (right after the eval at step 20) and the eval at step 40: the only CompileTime samples are the
    # openxla bridge's 5 cache look-ups (one per eval batch of 8): step 21 replayed step 20's training program, and
    # neither the eval program nor the parameter refresh compiled again.
    assert evals[1]["xla_compiles"] - evals[0]["xla_compiles"] == 5, evals
    assert sum(r["xla_new_compiles"] for r in records[EVAL_EVERY:-1]) == 0, records[EVAL_EVERY:]
    best = torch.load(fit_run / "best.pth", map_location="cpu", weights_only=True)  # plain values: rfdetr loads it
    assert set(best) == {"model", "config", "step", "class_names", "weights", "ema",  # EMA on: the evaluated weights
                         "model_name", "model_config", "args"}  # rfdetr's own entries (weights.rfdetr_entries)
    assert best["step"] == max(evals, key=lambda r: r["eval/mAP"])["step"]
    saved = json.loads((fit_run / "eval" / "step0000020_coco_eval.json").read_text())
    assert saved["num_images"] == 40 and saved["stats"]["mAP"] == evals[0]["eval/mAP"]

    from spmd_rfdetr.training.evaluation import FitEvaluation

    due = FitEvaluation(None, every_steps=100, output_dir=fit_run).due  # type: ignore[arg-type]
    assert [s for s in range(1, 251) if due(s, 250)] == [100, 200, 250]
    assert not any(FitEvaluation(None, 0, fit_run).due(s, 250) for s in range(1, 251))  # type: ignore[arg-type]

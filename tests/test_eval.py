"""Evaluation and prediction on the 4-device CPU mesh, against upstream rfdetr's own eager CPU evaluation.

All in-process tests share one XLA eval program (tiny config, global batch 8, fp32); only ``fit`` compiles a training
step here.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
import yaml

from spmd_rfdetr import evaluate as ev
from spmd_rfdetr.step import as_samples

TRAIN_STEPS = 40  # the tiny model, trained (on the eval images) so that mAP is clearly non-zero
SUBSET = 20  # images evaluated: 8 + 8 + 4, so the last batch is padded


def counter(name: str) -> int:
    return int(met.counter_value(name) or 0)


def samples(name: str) -> int:
    data = met.metric_data(name)
    return int(data[0]) if data else 0


@pytest.fixture(scope="module")
def fabric():
    from spmd_rfdetr.fabric import spmd_fabric
    from spmd_rfdetr.mesh import build_mesh

    return spmd_fabric(build_mesh(), precision="32-true")


@pytest.fixture(scope="module")
def trained(tiny, fabric):
    """The tiny model after TRAIN_STEPS of upstream rfdetr's own eager CPU training (on the eval images, LR 4e-4), on
    the mesh. Trained on the CPU so this module compiles no training graph of its own besides ``fit``'s."""
    from spmd_rfdetr.loss import total_loss
    from spmd_rfdetr.model import build_optimizer, build_upstream_criterion
    from spmd_rfdetr.data import targets_list

    net = tiny.model()
    criterion = build_upstream_criterion(tiny.cfgs)[0].train()
    optimizer = build_optimizer(net, tiny.cfgs)
    for group in optimizer.param_groups:
        group["lr"] *= 4
    for i in range(TRAIN_STEPS):
        batch = tiny.batches[i % len(tiny.batches)]
        optimizer.zero_grad(set_to_none=True)
        loss = total_loss(criterion(net(as_samples(batch["images"])), targets_list(batch)), criterion.weight_dict)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), tiny.cfg.optim.clip_max_norm)
        optimizer.step()
    print("trained copy: final loss", loss.item())
    return fabric.setup_module(net.eval())


@pytest.fixture(scope="module")
def valid_split(tiny):
    from spmd_rfdetr.data import build_split

    return build_split(tiny.cfgs, "valid")


@pytest.fixture(scope="module")
def first_eval(tiny, trained, valid_split, fabric):
    """The first evaluation in this process, with the counters it moved: a padded 20-image split."""
    subset = torch.utils.data.Subset(valid_split, range(SUBSET))
    evaluator = ev.Evaluator(trained, subset, mesh=fabric.strategy.mesh, global_batch_size=8,
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
    """Upstream rfdetr on the CPU: its model, its PostProcess and its CocoEvaluator (faster-coco-eval)."""
    from rfdetr.datasets import get_coco_api_from_dataset
    from rfdetr.evaluation.coco_eval import CocoEvaluator

    from spmd_rfdetr.model import build_model, build_upstream_criterion

    net = build_model(tiny.cfgs)
    net.load_state_dict(state)
    net.eval()
    postprocess = build_upstream_criterion(tiny.cfgs)[1]
    evaluator = CocoEvaluator(get_coco_api_from_dataset(dataset), ["bbox"], log_summary=False)
    rows = []
    with torch.no_grad():
        for start in range(0, len(dataset), 8):
            items = [dataset[i] for i in range(start, min(start + 8, len(dataset)))]
            outputs = net(as_samples(torch.stack([image for image, _ in items])))
            sizes = torch.stack([target["orig_size"] for _, target in items])
            results = postprocess(outputs, sizes)
            evaluator.update({int(target["image_id"]): r for (_, target), r in zip(items, results)})
            rows.append(ev.reference_postprocess(outputs, sizes, postprocess.num_select))
    evaluator.synchronize_between_processes()
    evaluator.accumulate()
    return np.asarray(evaluator.coco_eval["bbox"].stats, dtype=np.float64), torch.cat(rows).numpy()


def test_padded_split_one_eval_graph_and_upstream_eager_parity(tiny, trained, valid_split, first_eval):
    evaluator, result, moved = first_eval
    assert result.batches == 3 and len(result.image_ids) == SUBSET  # 8 + 8 + 4 (padded): padding never scored
    assert sorted(result.image_ids) == sorted(int(valid_split[i][1]["image_id"]) for i in range(SUBSET))
    assert moved["graphs"] == 1, moved  # dynamo traced the eval forward once, padded batch included
    # XLA compiled the eval program once, plus a 2-scalar constants program the openxla bridge syncs before tracing
    assert moved["uncached"] == 2, moved
    assert moved["transfers"] == 3, moved  # results leave the device once per batch
    again = counter("UncachedCompile"), torch._dynamo.utils.counters["stats"]["unique_graphs"]
    evaluator.run()
    assert (counter("UncachedCompile"), torch._dynamo.utils.counters["stats"]["unique_graphs"]) == again

    state = {k: v.cpu() for k, v in trained.state_dict().items()}
    ref_stats, ref_rows = upstream_eager_eval(tiny, state, torch.utils.data.Subset(valid_split, range(SUBSET)))
    ours = np.asarray(list(result.metrics.stats.values()))
    print("mAP parity: ours", ours.round(5).tolist(), "upstream eager", ref_stats.round(5).tolist())
    assert result.metrics.stats["mAP50"] > 0.05, result.metrics.stats  # a non-trivial model, not all zeros
    np.testing.assert_allclose(ours, ref_stats, atol=1e-4, rtol=0)
    rows, _ = ev.run_detection(evaluator.forward, evaluator.loader, evaluator.to_device)
    np.testing.assert_allclose(rows[..., ev.SCORE], ref_rows[..., ev.SCORE], atol=1e-4)
    np.testing.assert_allclose(rows[..., ev.BOXES], ref_rows[..., ev.BOXES], atol=1e-2)  # pixels of a 160 px image


def test_map_equals_pycocotools_on_the_detections_json(first_eval, synth_dir, tmp_path):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    _, result, _ = first_eval
    summary = ev.save_result(result, tmp_path)
    saved = json.loads(summary.read_text())
    assert {row["name"] for row in saved["per_class"]} == {"rectangle", "ellipse", "triangle"}
    detections = json.loads((tmp_path / "detections.json").read_text())
    assert set(detections[0]) == {"image_id", "category_id", "bbox", "score"}
    assert {d["category_id"] for d in detections} <= {1, 2, 3}  # the dataset's ids, not rfdetr's label indices
    gt = COCO(str(Path(synth_dir) / "valid" / "_annotations.coco.json"))
    coco_eval = COCOeval(gt, gt.loadRes(str(tmp_path / "detections.json")), "bbox")
    coco_eval.params.imgIds = sorted(result.image_ids)
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    np.testing.assert_allclose(list(result.metrics.stats.values()), coco_eval.stats, atol=1e-6, rtol=0)
    assert saved["stats"] == result.metrics.stats


def test_validate_and_predict_cli_match_eval(tiny, trained, synth_dir, tmp_path):
    from spmd_rfdetr.cli import main

    cfg = copy.deepcopy(tiny.cfg)
    config = dataclasses.asdict(cfg)
    config["data"]["dataset_dir"] = synth_dir
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    checkpoint = tmp_path / "last.pth"
    torch.save({"model": {k: v.cpu() for k, v in trained.state_dict().items()}, "optimizer": {}, "step": TRAIN_STEPS,
                "config": config | {"model": config["model"] | {"num_classes": 3}}}, checkpoint)

    main(["validate", "--config", str(tmp_path / "tiny.yaml"), "--checkpoint", str(checkpoint),
          "--output_dir", str(tmp_path / "val")])
    summary = json.loads((tmp_path / "val" / "coco_eval.json").read_text())
    assert summary["num_images"] == 40 and summary["stats"]["mAP50"] > 0.05
    eval_detections = json.loads((tmp_path / "val" / "detections.json").read_text())

    folder = tmp_path / "images"  # a plain folder: no annotations, ids from the sorted file names
    folder.mkdir()
    names = sorted(p.name for p in (Path(synth_dir) / "valid").glob("*.jpg"))[::8]  # 5 images: one padded batch
    for name in names:
        shutil.copy(Path(synth_dir) / "valid" / name, folder / name)
    main(["predict", "--config", str(tmp_path / "tiny.yaml"), "--checkpoint", str(checkpoint),
          "--images", str(folder), "--output", str(tmp_path / "pred.json")])
    predictions = json.loads((tmp_path / "pred.json").read_text())
    listed = {im["id"]: im["file_name"] for im in json.loads((tmp_path / "pred.images.json").read_text())}
    gt_ids = {im["file_name"]: im["id"] for im in
              json.loads((Path(synth_dir) / "valid" / "_annotations.coco.json").read_text())["images"]}
    assert sorted(listed.values()) == names
    for image_id, name in listed.items():
        ours = [(d["category_id"], d["score"], d["bbox"]) for d in predictions if d["image_id"] == image_id]
        theirs = [(d["category_id"], d["score"], d["bbox"]) for d in eval_detections
                  if d["image_id"] == gt_ids[name]]
        assert len(ours) == len(theirs) > 0, name
        for (c1, s1, b1), (c2, s2, b2) in zip(ours, theirs):
            assert c1 == c2 and abs(s1 - s2) < 1e-5 and np.allclose(b1, b2, atol=1e-3), (name, b1, b2)


@pytest.mark.xfail(
    strict=True,
    reason="known (issue 4, open): the first training step after the first in-fit evaluation compiles one more graph "
    "(CI run: 25 compiles against 24); the eval-every-N and best.pth assertions before it pass",
)
def test_fit_evaluates_every_n_steps_and_keeps_best(tiny, synth_dir, tmp_path):
    from spmd_rfdetr import loop

    cfg = copy.deepcopy(tiny.cfg)
    cfg.data.dataset_dir = synth_dir
    cfg.trainer.output_dir = str(tmp_path)
    cfg.trainer.max_steps, cfg.trainer.log_every, cfg.trainer.progress_bar = 5, 1, False
    cfg.eval.every_steps = 2
    loop.fit(cfg)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/mAP" in r]
    assert [r["step"] for r in evals] == [2, 4, 5]  # every 2 steps and after the last one
    # the training step after an evaluation neither compiles nor transfers more than its log point's read
    assert records[2]["xla_compiles"] == records[1]["xla_compiles"], records[1:3]
    assert records[2]["xla_transfers_to_host"] == records[1]["xla_transfers_to_host"] + 1, records[1:3]
    for r in evals:
        assert {"eval/mAP50", "eval/mAP75", "eval/AR100", "eval/mAP_small", "loss"} <= set(r)
    assert evals[-1]["eval/best_mAP"] == max(r["eval/mAP"] for r in evals)
    best = torch.load(tmp_path / "best.pth", map_location="cpu", weights_only=False)
    assert best["step"] in (2, 4, 5) and set(best) == {"model", "optimizer", "step", "config"}
    assert (tmp_path / "eval" / "step0000002_coco_eval.json").exists()


def test_openxla_training_still_wrong_and_fit_refuses_it(tiny):
    """shared/repro/openxla_spmd_grad.py as a test. When torch_xla fixes the bug the first assert fails: then allow
    trainer.compile_backend=openxla (config.validate) and flip this test."""
    import torch_xla.distributed.spmd as xs

    from spmd_rfdetr import loop
    from spmd_rfdetr.config import OPENXLA_TRAINING_REFUSED, ConfigError
    from spmd_rfdetr.mesh import build_mesh

    def net():
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def step(m, x, y):
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        return loss

    torch.manual_seed(0)
    ref, model = net(), net().to(torch_xla.device())
    model.load_state_dict(ref.state_dict())
    compiled, mesh = torch.compile(step, backend="openxla"), build_mesh()
    diffs = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        ref.zero_grad()
        step(ref, x, y)
        xx, yy = x.to(torch_xla.device()), y.to(torch_xla.device())
        xs.mark_sharding(xx, mesh, ("data", None))
        xs.mark_sharding(yy, mesh, ("data", None))
        model.zero_grad(set_to_none=True)
        compiled(model, xx, yy)
        torch_xla.sync()
        diffs.append(max((p.grad.cpu() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    print("openxla training under SPMD, max |grad - eager grad| per call:", diffs)
    assert diffs[0] < 1e-5, diffs
    assert max(diffs[1:]) > 1e-2, f"torch_xla now trains correctly with openxla under SPMD: {diffs}; allow it"

    cfg = copy.deepcopy(tiny.cfg)
    cfg.trainer.compile_backend = "openxla"
    with pytest.raises(ConfigError) as refused:
        loop.fit(cfg)
    assert OPENXLA_TRAINING_REFUSED in str(refused.value)

"""Our weights outside this project: upstream rfdetr loads and predicts with them, rfdetr's exporter exports them, and
rfdetr-format checkpoints load here (``validate``/``predict``, ``--model.pretrain_weights``).

The session's ``fit`` (``conftest.fit_run``) writes the weights; nothing here trains another model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from spmd_rfdetr.config.options import DataOptions, MeshOptions, ModelOptions, OptimOptions, RunConfig
from spmd_rfdetr.model.inputs import as_samples
from spmd_rfdetr.model.weights import inference_config, read_weights

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(resolution=128, num_queries=30, group_detr=2, dec_layers=2)

#: Upstream rfdetr alone (no spmd_rfdetr, no torch_xla): a user's own code for a fit weight file, both ways rfdetr
#: loads one: its variant class with the saved architecture, and ``RFDETR.from_checkpoint`` from the file alone.
UPSTREAM_PREDICT = """
import json, sys, torch
import supervision as sv
from rfdetr import RFDETR, RFDETRNano
checkpoint, best, threshold, images = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4:]
saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
m = saved["config"]["model"]
model = RFDETRNano(pretrain_weights=checkpoint, num_classes=m["num_classes"], resolution=m["resolution"],
                   num_queries=m["num_queries"], num_select=saved["model_config"]["num_select"],
                   group_detr=m["group_detr"], dec_layers=m["dec_layers"],
                   out_feature_indexes=saved["model_config"]["out_feature_indexes"])  # 4 blocks: [1, 2, 3, 4]
restored = RFDETR.from_checkpoint(checkpoint)
assert "torch_xla" not in sys.modules, "upstream ran with torch_xla imported"
best_model = RFDETR.from_checkpoint(best)  # the README's route: best.pth alone, predict at a threshold
out = {"class_names": restored.class_names, "best_class_names": best_model.class_names, "images": [], "best": []}
for path in images:
    d, r = model.predict(path, threshold=0.0), restored.predict(path, threshold=0.0)
    assert (d.xyxy == r.xyxy).all() and (d.confidence == r.confidence).all() and (d.class_id == r.class_id).all()
    out["images"].append({"xyxy": d.xyxy.tolist(), "score": d.confidence.tolist(), "label": d.class_id.tolist()})
    b = best_model.predict(path, threshold=threshold)
    assert isinstance(b, sv.Detections)
    out["best"].append({"xyxy": b.xyxy.tolist(), "score": b.confidence.tolist(), "label": b.class_id.tolist(),
                        "class_name": b.data["class_name"].tolist()})
print(json.dumps(out))
"""


def without_xla() -> dict[str, str]:
    """A child environment where nothing imports torch_xla (accelerate, under transformers, would: USE_TORCH_XLA)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS")}
    return {**env, "USE_TORCH_XLA": "0"}


@pytest.mark.slow
def test_upstream_rfdetr_predicts_what_our_predict_does(fit_run, synth_dir, tmp_path):
    """rfdetr alone (no torch_xla) on our weight files: its variant class and ``RFDETR.from_checkpoint(last.pth)``
    predict our ``predict``'s detections; ``RFDETR.from_checkpoint(best.pth).predict(image, threshold)`` gives
    ``supervision.Detections`` named by the dataset, equal to ``to_detections`` of our output."""
    from spmd_rfdetr.cli import main
    from spmd_rfdetr.eval.coco import label2cat_for

    checkpoint = fit_run / "last.pth"
    folder = tmp_path / "images"  # model-resolution PNGs: both sides' resizes are the identity, pixels are exact
    folder.mkdir()
    for name in sorted(p.name for p in (Path(synth_dir) / "valid").glob("*.jpg"))[:4]:
        Image.open(Path(synth_dir) / "valid" / name).convert("RGB").resize((128, 128)).save(folder / f"{name}.png")
    images = sorted(str(p) for p in folder.iterdir())

    main(["predict", "--checkpoint", str(checkpoint), "--images", str(folder), "--output", str(tmp_path / "p.json")])
    ours = json.loads((tmp_path / "p.json").read_text())
    main(["predict", "--checkpoint", str(fit_run / "best.pth"), "--images", str(folder), "--output",
          str(tmp_path / "best.json")])  # the same program: no compile
    ours_best = json.loads((tmp_path / "best.json").read_text())
    weight_file = torch.load(checkpoint, map_location="cpu", weights_only=True)
    saved = weight_file["config"]
    cat2label = {c: label for label, c in (label2cat_for(saved["data"]["dataset_dir"]) or {}).items()}
    best_scores = sorted((d["score"] for d in ours_best), reverse=True)
    threshold = min(0.5, (best_scores[4] + best_scores[5]) / 2)  # rfdetr's default, unless it keeps under 5 boxes

    child = subprocess.run([sys.executable, "-c", UPSTREAM_PREDICT, str(checkpoint), str(fit_run / "best.pth"),
                            repr(threshold), *images], cwd=tmp_path, env=without_xla(), capture_output=True, text=True,
                           timeout=900)
    assert child.returncode == 0, child.stderr[-3000:]
    theirs = json.loads(child.stdout.strip().splitlines()[-1])
    assert theirs["class_names"] == weight_file["class_names"] == ["rectangle", "ellipse", "triangle"]
    assert theirs["best_class_names"] == theirs["class_names"]
    assert_rfdetr_predict_is_to_detections(theirs["best"], ours_best, threshold, cat2label)
    for image_id, upstream in enumerate(theirs["images"]):  # ids of a folder without annotations: the sorted file order
        rows = sorted((d for d in ours if d["image_id"] == image_id), key=lambda d: -d["score"])
        order = np.argsort(-np.asarray(upstream["score"]), kind="stable")
        assert len(order) == weight_file["model_config"]["num_select"] == 120  # 30 queries x (3 classes + 1)
        order = order[np.isin(np.asarray(upstream["label"])[order], list(cat2label.values()))]  # as ours: rfdetr's
        assert len(rows) == len(order) > 0, (len(rows), len(order))  # extra logit has no category, its rows dropped
        ours_xyxy = np.asarray([[x, y, x + w, y + h] for x, y, w, h in (d["bbox"] for d in rows)])
        np.testing.assert_allclose([d["score"] for d in rows], np.asarray(upstream["score"])[order], atol=1e-4)
        np.testing.assert_allclose(ours_xyxy / 128, np.asarray(upstream["xyxy"])[order] / 128, atol=1e-4)
        assert [cat2label[d["category_id"]] for d in rows] == np.asarray(upstream["label"])[order].tolist()
    assert max(d["score"] for d in ours) > 0.3  # a trained model, not a blank one


def assert_rfdetr_predict_is_to_detections(theirs: list[dict], ours: list[dict], threshold: float,
                                           cat2label: dict[int, int]) -> None:
    """rfdetr's ``predict(image, threshold)`` on ``best.pth`` (its ``supervision.Detections``, per image) equals
    :func:`spmd_rfdetr.eval.draw.to_detections` of our ``predict`` output at that threshold: boxes, scores, labels and
    ``data["class_name"]``, the dataset's names (rfdetr keeps scores > threshold, ours >= it: no score is equal)."""
    from spmd_rfdetr.eval.draw import to_detections

    kept = 0
    for image_id, upstream in enumerate(theirs):
        mine = to_detections(ours, image_id, threshold)
        order = np.argsort(-np.asarray(upstream["score"]), kind="stable")
        order = order[np.isin(np.asarray(upstream["label"])[order], list(cat2label.values()))]  # as ours: no "no object"
        assert len(mine) == len(order), (image_id, len(mine), len(order))
        np.testing.assert_allclose(mine.confidence, np.asarray(upstream["score"])[order], atol=1e-4)
        np.testing.assert_allclose(mine.xyxy / 128, np.asarray(upstream["xyxy"]).reshape(-1, 4)[order] / 128,
                                   atol=1e-4)
        assert [cat2label[c] for c in mine.class_id] == np.asarray(upstream["label"])[order].tolist()
        assert mine.data["class_name"].tolist() == np.asarray(upstream["class_name"])[order].tolist()
        kept += len(mine)
    assert kept >= 5 and {n for u in theirs for n in u["class_name"]} <= {"rectangle", "ellipse", "triangle"}


@pytest.mark.slow
def test_export_onnx_runs_like_the_eager_model(fit_run, tmp_path):
    pytest.importorskip("onnxruntime", reason="ONNX export needs rfdetr's onnx extra: pip install -e '.[export]'")
    import onnxruntime

    from spmd_rfdetr.cli import main
    from support.models import eager_model

    checkpoint = fit_run / "last.pth"
    main(["export", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "tiny.onnx")])
    session = onnxruntime.InferenceSession(str(tmp_path / "tiny.onnx"), providers=["CPUExecutionProvider"])
    image = torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(0))
    normalized = (image - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[
        :, None, None]
    outputs = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {session.get_inputs()[0].name: normalized.numpy()})))

    net, _ = eager_model(checkpoint)
    with torch.no_grad():
        eager = net(as_samples(normalized))
    np.testing.assert_allclose(outputs["dets"], eager["pred_boxes"].numpy(), atol=1e-4)
    np.testing.assert_allclose(outputs["labels"], eager["pred_logits"].numpy(), atol=1e-3)


@pytest.mark.slow
def test_export_without_the_extra_names_it_and_exits_2(tmp_path):
    """A real missing dependency: rfdetr's OpenVINO extra is not a dependency of this project."""
    if importlib.util.find_spec("openvino") is not None:
        pytest.skip("openvino is installed here")
    child = subprocess.run([sys.executable, "-m", "spmd_rfdetr", "export", "--checkpoint", str(tmp_path / "x.pth"),
                            "--format", "openvino"], cwd=ROOT, env=without_xla(), capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 2, child.stderr[-3000:]
    assert 'pip install "rfdetr[openvino]==' in child.stderr and "Traceback" not in child.stderr, child.stderr


@pytest.fixture(scope="module")
def rfdetr_checkpoint(tmp_path_factory) -> Path:
    """An upstream-format checkpoint of the tiny architecture with 5 classes (``{"model", "args", "model_config"}``)."""
    from spmd_rfdetr.model.upstream import build_model, upstream_configs

    cfgs = upstream_configs(ModelOptions(**TINY, pretrain_weights=None), DataOptions(), RunConfig().optim, num_classes=5)
    torch.manual_seed(1)
    net = build_model(cfgs)
    path = tmp_path_factory.mktemp("rfdetr") / "checkpoint_best_ema.pth"
    args = {"num_classes": 5, "num_queries": 30, "group_detr": 2, "class_names": list("abcde")}
    torch.save({"model": net.state_dict(), "args": args, "model_name": "RFDETRNano",
                "model_config": {"resolution": 128, "num_queries": 30, "group_detr": 2, "dec_layers": 2}}, path)
    return path


def test_pretrain_weights_resize_the_class_head_with_rfdetrs_loader(rfdetr_checkpoint):
    from spmd_rfdetr.model.upstream import build_model, upstream_configs

    saved = torch.load(rfdetr_checkpoint, map_location="cpu", weights_only=True)["model"]
    options = ModelOptions(**TINY, pretrain_weights=str(rfdetr_checkpoint))
    net = build_model(upstream_configs(options, DataOptions(), RunConfig().optim, num_classes=3))
    assert net.class_embed.out_features == 4  # 3 classes + rfdetr's extra logit, down from the checkpoint's 6
    torch.testing.assert_close(net.class_embed.weight, saved["class_embed.weight"][:4], rtol=0, atol=0)
    backbone = "backbone.0.encoder.encoder.embeddings.patch_embeddings.projection.weight"
    torch.testing.assert_close(net.state_dict()[backbone], saved[backbone], rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="not one of rfdetr's published weights"):
        build_model(upstream_configs(ModelOptions(**TINY, pretrain_weights="/nonexistent/x.pth"), DataOptions(),
                                     RunConfig().optim, num_classes=3))


def test_inference_config_takes_the_architecture_from_the_checkpoint(rfdetr_checkpoint, tmp_path):
    from spmd_rfdetr.config.options import TrainerOptions

    trained = RunConfig(model=ModelOptions(variant="small", num_classes=7, backbone_blocks=3, **TINY),
                        data=DataOptions(dataset_dir="/train/data", global_batch_size=16, per_device_batch_size=2),
                        mesh=MeshOptions(data=8), trainer=TrainerOptions(precision="fp32"))
    fit_file = tmp_path / "best.pth"
    torch.save({"model": {}, "config": dataclasses.asdict(trained), "step": 3}, fit_file)
    given = RunConfig(model=ModelOptions(resolution=640), data=DataOptions(global_batch_size=4))
    cfg = inference_config(given, read_weights(fit_file))
    assert dataclasses.asdict(cfg.model) == {**dataclasses.asdict(trained.model), "pretrain_weights": None}
    assert (cfg.data.dataset_dir, cfg.data.global_batch_size) == ("/train/data", 4)  # an option given here wins
    assert cfg.data.per_device_batch_size is None  # the saved per-device size would have replaced it
    assert (cfg.trainer.precision, cfg.mesh.data) == ("fp32", -1)  # the mesh is this machine's

    cfg = inference_config(RunConfig(), read_weights(rfdetr_checkpoint))
    assert (cfg.model.variant, cfg.model.num_classes, cfg.model.pretrain_weights) == ("nano", 5, str(rfdetr_checkpoint))
    assert {k: getattr(cfg.model, k) for k in TINY} == TINY


def test_backbone_blocks_build_a_shallower_rfdetr_and_leave_rfdetr_as_it_was():
    """``model.backbone_blocks``: rfdetr's model with that many DINOv2 blocks, its last ones feeding the decoder (as
    many as the variant's own outputs); the next model built without it has rfdetr's 12 again."""
    from rfdetr.models.backbone import dinov2

    from spmd_rfdetr.model.upstream import build_model, upstream_configs

    def blocks(model: ModelOptions) -> tuple[int, list[int], tuple[int, ...]]:
        cfgs = upstream_configs(model, DataOptions(), OptimOptions(), 3)
        net = build_model(cfgs).eval()
        with torch.no_grad():
            out = net(as_samples(torch.zeros(1, 3, 128, 128)))
        layers = net.backbone[0].encoder.encoder.encoder.layer
        return len(layers), cfgs.model.out_feature_indexes, out["pred_boxes"].shape

    read = dinov2.get_config
    scratch = {**TINY, "pretrain_weights": None}
    assert blocks(ModelOptions(backbone_blocks=2, **scratch)) == (2, [1, 2], (1, 30, 4))
    assert blocks(ModelOptions(backbone_blocks=6, **scratch))[:2] == (6, [3, 4, 5, 6])
    assert dinov2.get_config is read and blocks(ModelOptions(**scratch))[:2] == (12, [3, 6, 9, 12])


#: rfdetr's own loader for its own checkpoints: architecture, weights and class names from the file alone.
UPSTREAM_FROM_CHECKPOINT = """
import json, sys, torch
from rfdetr import RFDETR
model = RFDETR.from_checkpoint(sys.argv[1])
assert "torch_xla" not in sys.modules
mc, weights = model.model_config, torch.load(sys.argv[1], map_location="cpu", weights_only=True)["model"]
same = all(torch.equal(v, weights[k]) for k, v in model.model.model.state_dict().items())
from PIL import Image
detections = model.predict(Image.new("RGB", (128, 128)), threshold=0.0)  # its own PostProcess, at the saved num_select
print(json.dumps({"class": type(model).__name__, "class_names": model.class_names, "same_weights": same,
                  "arch": [mc.resolution, mc.num_queries, mc.group_detr, mc.dec_layers, mc.num_classes],
                  "num_select": mc.num_select, "detections": len(detections)}))
"""


def test_rfdetr_from_checkpoint_reads_a_weight_file_with_rfdetr_entries(tmp_path):
    from spmd_rfdetr.model.upstream import build_model, upstream_configs
    from spmd_rfdetr.model.weights import rfdetr_entries

    cfg = RunConfig(model=ModelOptions(**TINY, num_classes=3, pretrain_weights=None))
    cfgs = upstream_configs(cfg.model, cfg.data, cfg.optim, 3)
    names = ["rectangle", "ellipse", "triangle"]
    path = tmp_path / "best.pth"  # a fit weight file (random weights) plus the entries rfdetr's checkpoints carry
    torch.save({"model": build_model(cfgs).state_dict(), "config": dataclasses.asdict(cfg), "step": 1,
                "class_names": names, **rfdetr_entries(cfgs.model, "nano", names)}, path)
    child = subprocess.run([sys.executable, "-c", UPSTREAM_FROM_CHECKPOINT, str(path)], cwd=tmp_path,
                           env=without_xla(), capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    loaded = json.loads(child.stdout.strip().splitlines()[-1])
    # num_select: rfdetr's 300 lowered to the 30 x (3 + 1) logits the model has, which rfdetr's predict then runs at
    assert loaded == {"class": "RFDETRNano", "class_names": names, "same_weights": True, "arch": [128, 30, 2, 2, 3],
                      "num_select": 120, "detections": 120}

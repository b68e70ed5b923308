"""The ``validate`` and ``predict`` verbs: a checkpoint's model on the mesh, run by :mod:`spmd_rfdetr.eval.evaluator`.

The architecture comes from the checkpoint (:func:`spmd_rfdetr.model.weights.inference_config`), so
``validate --checkpoint output/best.pth`` needs no ``--config``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from spmd_rfdetr.config.options import RunConfig, is_keypoint
from spmd_rfdetr.config.resolve import resolve_and_check
from spmd_rfdetr.data.check import check_data
from spmd_rfdetr.eval import draw
from spmd_rfdetr.eval.coco import label2cat_for
from spmd_rfdetr.xla import hosts
from spmd_rfdetr.eval.evaluator import (
    EvalForward,
    EvalResult,
    device_sender,
    eval_sizes,
    evaluator_for,
    run_detection,
    save_result,
)
from spmd_rfdetr.data.images import ImageFolder, eval_transforms
from spmd_rfdetr.eval.batches import eval_loader
from spmd_rfdetr.model.weights import inference_config, read_weights
from spmd_rfdetr.xla.runtime import PRECISIONS, choose_device, setup_runtime

log = logging.getLogger(__name__)


def load_for_inference(cfg: RunConfig, checkpoint: str) -> tuple[RunConfig, Any, Any, torch.nn.Module]:
    """Runtime + Fabric + rfdetr model with the checkpoint's weights, on the mesh.

    Returns (the config completed from the checkpoint, fabric, upstream configs, model).
    """
    choose_device(cfg.mesh)  # for callers other than the CLI (which chose before importing this module)
    saved = read_weights(checkpoint)
    cfg = inference_config(cfg, saved)
    if cfg.model.num_queries is not None:  # max_targets only shapes training batches: its query-count check is moot
        cfg.data.max_targets = min(cfg.data.max_targets, cfg.model.num_queries)
    setup_runtime(cfg.mesh)
    # lazy: torch_xla must start on the device setup_runtime chose
    import torch_xla.runtime as xr

    devices = xr.global_runtime_device_count()
    resolve_and_check(cfg, devices)
    log.info("%s on %d %s device(s)", Path(checkpoint).name, devices, xr.device_type())
    # lazy: these import rfdetr or torch_xla, which must start on the device setup_runtime chose
    from spmd_rfdetr.data.splits import num_classes_in
    from spmd_rfdetr.xla.fabric import spmd_fabric
    from spmd_rfdetr.xla.mesh import build_mesh
    from spmd_rfdetr.model.upstream import build_model, upstream_configs

    num_classes = cfg.model.num_classes or num_classes_in(cfg.data.dataset_dir, is_keypoint(cfg.model.variant))
    fabric = spmd_fabric(build_mesh(cfg.mesh.data, cfg.mesh.fsdp), precision=PRECISIONS[cfg.trainer.precision])
    cfgs = upstream_configs(cfg.model, cfg.data, cfg.optim, num_classes, cfg.eval.num_select)
    net = build_model(cfgs)  # an rfdetr checkpoint is loaded here, by rfdetr (cfg.model.pretrain_weights)
    if saved.kind != "rfdetr":
        net.load_state_dict(saved.state_dict)
    net = fabric.setup_module(net.eval())
    return cfg, fabric, cfgs, net


def evaluate_checkpoint(cfg: RunConfig, checkpoint: str, output_dir: str | None = None) -> EvalResult:
    """COCO-evaluate ``checkpoint`` on ``eval.split``; writes ``coco_eval.json`` + ``detections.json``.

    ``output_dir`` defaults to ``<checkpoint dir>/eval_<checkpoint stem>_<split>``.
    """
    cfg, fabric, cfgs, net = load_for_inference(cfg, checkpoint)
    from spmd_rfdetr.data.splits import build_eval_split  # imports rfdetr, which starts torch_xla: after the device is chosen

    check_data(cfg, [cfg.eval.split])  # the split's annotations and images, before the eval program compiles
    result = evaluator_for(cfg, cfgs, net, fabric, build_eval_split(cfgs, cfg.eval.split)).run()
    out = Path(output_dir) if output_dir else Path(checkpoint).parent / f"eval_{Path(checkpoint).stem}_{cfg.eval.split}"
    summary = save_result(result, out)
    print(result.table(), flush=True)
    log.info("wrote %s and %s", summary, out / "detections.json")
    return result


def predict(cfg: RunConfig, checkpoint: str, images: str, output: str, threshold: float | None = None,
            save_images: str | None = None) -> Path:
    """Detect on every image of the folder ``images``; writes COCO results to ``output`` (+ ``.images.json``).

    Category ids are the dataset's (``data.dataset_dir``'s train split label mapping, as in training; a YOLO
    dataset's class index) and each detection's ``category_name`` its name there; boxes are ``[x, y, w, h]`` in
    pixels of each original image; ``num_select`` detections per image, those scoring >= ``threshold`` when given; a
    seg model's detections also carry their mask as a COCO RLE ``segmentation`` at the image's size, the keypoint
    model's their ``keypoints`` (COCO's flat ``x, y, confidence`` per keypoint of the class, pixels; scores fused as
    rfdetr's). ``save_images``: a folder for each image with its detections drawn (:mod:`spmd_rfdetr.eval.draw`;
    at ``threshold``, else at :data:`~spmd_rfdetr.eval.draw.DRAW_THRESHOLD`).
    """
    draw.check_options(threshold, save_images, images)  # before anything compiles
    cfg, fabric, cfgs, net = load_for_inference(cfg, checkpoint)
    check_data(cfg, [], images=images)  # every image of the folder readable, before the eval program compiles
    # lazy: data.pixels imports rfdetr (torch_xla): after load_for_inference chose the device
    from spmd_rfdetr.data.pixels import uint8_pixels

    folder = ImageFolder(images, uint8_pixels(eval_transforms(cfgs)))  # uint8 pixels, as an eval split's
    hosts.check_same_on_all_hosts(f"the number of images in {images}", len(folder))  # else: a hang
    keypoints = cfgs.model.num_keypoints_per_class if cfgs.model.use_grouppose_keypoints else None
    label2cat = label2cat_for(cfg.data.dataset_dir, keypoints)
    # lazy: rfdetr imports torch_xla (load_for_inference chose the device above)
    from rfdetr.datasets.yolo import find_yolo_data_file

    yolo = cfg.data.dataset_format == "yolo" or find_yolo_data_file(cfg.data.dataset_dir) is not None
    if label2cat is None and not yolo:  # a YOLO dataset's category is its class index: nothing lost
        log.warning("%s has no readable train/_annotations.coco.json: category_id is the label index",
                    cfg.data.dataset_dir)
    batch_size, num_select = eval_sizes(cfg, cfgs)
    forward = EvalForward(net, num_select, fabric.strategy.precision.forward_context, cfg.eval.trace_alpha)
    loader = eval_loader(folder, batch_size, cfgs.model.resolution, cfg.data.num_workers)
    order = hosts.mesh_row_order(fabric.strategy.mesh, batch_size)  # several hosts: the global batch's row order
    found = run_detection(forward, loader, device_sender(fabric.strategy.mesh), order)
    results = found.to_coco(label2cat)
    if found.keypoints is not None:  # each detection's keypoints beside its box, as many as its class has (all
        # maxK for a class without keypoints, as rfdetr's evaluator writes them)
        counts = {label2cat.get(label, label) if label2cat else label: n for label, n in enumerate(keypoints) if n}
        for result, points in zip(results, found.keypoint_results(label2cat, counts), strict=True):
            result["keypoints"] = points["keypoints"]
    names = category_names(cfg.data.dataset_dir, checkpoint if label2cat is None else None, label2cat)
    for result in results:
        result["category_name"] = names.get(result["category_id"], str(result["category_id"]))
    everything = len(results)
    if threshold is not None:
        results = [r for r in results if r["score"] >= threshold]
    out = Path(output)
    if hosts.is_coordinator():  # several hosts hold the same global detections: host 0 writes them
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results))
        out.with_suffix(".images.json").write_text(json.dumps(folder.images_json()))
    kept = f" ({len(results)} of {everything} score >= {threshold})" if threshold is not None else ""
    print(f"predict: {len(folder)} images, {len(results)} detections{kept} -> {out}", flush=True)
    if save_images is not None and hosts.is_coordinator():
        at = draw.DRAW_THRESHOLD if threshold is None else threshold
        if threshold is None:
            log.info("--save_images without --threshold: drawing the detections scoring >= %s (%s keeps all of them)",
                     at, out.name)
        skeleton = draw.skeletons(_coco_categories(cfg.data.dataset_dir))
        written = draw.save_drawings(results, images, dict(zip(folder.ids, folder.files)), save_images, at, skeleton)
        print(f"predict: {len(written)} images drawn at score >= {at} -> {save_images}", flush=True)
    return out


def _coco_categories(dataset_dir: str) -> list[dict[str, Any]]:
    """The categories of the dataset's ``train/_annotations.coco.json`` (none when it has no readable one)."""
    path = Path(dataset_dir) / "train" / "_annotations.coco.json"
    try:
        return list(json.loads(path.read_text()).get("categories", []))
    except (OSError, ValueError, AttributeError):
        return []


def category_names(dataset_dir: str, checkpoint: str | None, label2cat: dict[int, int] | None) -> dict[int, str]:
    """``category_id`` -> name: the COCO dataset's category names (``label2cat`` given), else a YOLO dataset's class
    names by index, else the weight file's ``class_names`` by training label (``checkpoint``), else none."""
    if label2cat is not None:
        return {int(c["id"]): str(c["name"]) for c in _coco_categories(dataset_dir) if "id" in c and "name" in c}
    # lazy: rfdetr imports torch_xla (load_for_inference chose the device before this runs)
    from rfdetr.datasets.yolo import _extract_yolo_class_names, find_yolo_data_file

    data_file = find_yolo_data_file(dataset_dir) if Path(dataset_dir).is_dir() else None
    if data_file is not None:
        try:
            return dict(enumerate(_extract_yolo_class_names(str(data_file))))
        except (OSError, ValueError, TypeError):
            pass
    names = read_weights(checkpoint).class_names if checkpoint is not None else None
    return dict(enumerate(names or []))

"""The eval program on the mesh: static-shape batches, one compiled forward + post-processing, COCO mAP on the host.

The device part is ONE program per batch shape, compiled with ``torch.compile(backend="openxla")`` (correct for
inference under SPMD; training keeps ``torch_xla.compile``): rfdetr's model forward in eval mode, then rfdetr's own
``PostProcess`` box logic (sigmoid, top-k over queries x classes with its stable tie rule, cxcywh -> absolute xyxy at
the ORIGINAL image size, clamped), packed into one ``[B, K, 6]`` tensor ``(score, label, x0, y0, x1, y1)``. The batch
is sharded on the ``data`` axis; the last partial batch is padded to the full global batch with blank images whose image id is
-1, dropped on the host before the metrics. Results leave the device once per batch (one transfer
of that tensor, fetched while the next batch runs). Scoring is :mod:`spmd_rfdetr.eval.coco`'s.

Under SPMD there is one process and the predictions are global tensors: no pickled ``all_gather``, no device probing.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import numpy as np
import torch
from torch.utils.data import Dataset

from spmd_rfdetr.config.options import RunConfig
from spmd_rfdetr.eval.batches import eval_loader
from spmd_rfdetr.eval.coco import MAX_DETS, CocoMetrics, coco_metrics, detections_to_coco, label2cat_of, mask_rles
from spmd_rfdetr.eval.keypoints import decode_keypoints, keypoint_counts, keypoints_to_coco, oks_metrics
from spmd_rfdetr.xla import hosts


# ---------------------------------------------------------------------------------------------------------------------
# Device side: one compiled forward + post-processing
# ---------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _traceable_pos_encoding(model: torch.nn.Module) -> Iterator[None]:
    """Let dynamo trace rfdetr's DINOv2 ``interpolate_pos_encoding`` while the compiled eval runs.

    rfdetr marks it ``@torch.compiler.disable`` because its antialiased bicubic *backward* rejects symbolic sizes in
    AOT tracing. Eval is forward-only with static sizes, and the graph break would split the eval forward into several
    XLA programs with a host round trip between them. The same (undecorated) function is bound on the instances for
    the duration of the call only, so training and eager use are untouched.
    """
    # lazy: rfdetr imports torch_xla, which must start after the device choice (load_for_inference, setup_runtime)
    from rfdetr.models.backbone.dinov2_with_windowed_attn import WindowedDinov2WithRegistersEmbeddings as Embeddings

    plain = inspect.unwrap(Embeddings.interpolate_pos_encoding)
    patched = []
    for module in model.modules():
        if isinstance(module, Embeddings):
            bound = module.__dict__.get("_spmd_rfdetr_pos_encoding")
            if bound is None:  # one bound object per module: dynamo's guards see the same object every call
                bound = module.__dict__["_spmd_rfdetr_pos_encoding"] = types.MethodType(plain, module)
            module.__dict__["interpolate_pos_encoding"] = bound
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            module.__dict__.pop("interpolate_pos_encoding", None)


def refresh_parameter_data(model: torch.nn.Module) -> None:
    """Copy every XLA parameter and buffer into a fresh device buffer (one small copy program, compiled once).

    Measured here (torch_xla 2.9, CPU mesh): the first ``torch_xla.compile``'d training step after an openxla eval
    execution compiles a second variant of the step's graph (identical IR, different hash), then the next step goes
    back to the first one; with fresh parameter buffers the step after an eval reuses the usual graph.
    """
    # lazy: torch_xla starts on import: only after the device choice (load_for_inference, setup_runtime)
    import torch_xla

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "xla":
                tensor.copy_(tensor.clone())
    torch_xla.sync()


class EvalForward:
    """rfdetr forward + PostProcess (box path) as one ``torch.compile(backend="openxla")`` program.

    Args:
        model: rfdetr's LWDETR on the XLA device (parameters replicated); a Fabric-wrapped module is unwrapped.
        num_select: detections kept per image (rfdetr's ``num_select``).
        autocast: context for the model forward (e.g. Fabric's bf16 autocast); post-processing runs in fp32.

    Calling it with sharded ``images [B,3,R,R]`` and ``orig_size [B,2]`` (h, w) returns a ``[B, num_select, 6]`` device
    tensor of ``(score, label, x0, y0, x1, y1)`` rows, best first, boxes in pixels of the original image; for a model
    with rfdetr's mask head (the seg variants) also the selected queries' mask logits ``[B, num_select, R/4, R/4]``
    (rfdetr's PostProcess resizes them to each image's own size: done on the host, :func:`~spmd_rfdetr.eval.coco.
    mask_rles`, as the sizes differ per image); for rfdetr's keypoint model also the detections' keypoints
    ``[B, num_select, maxK, 3]`` (pixels, confidence), their scores fused with the keypoints' uncertainty as rfdetr's
    PostProcess fuses them (:func:`~spmd_rfdetr.eval.keypoints.decode_keypoints`, ``trace_alpha``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_select: int,
        autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
        trace_alpha: float = 0.2,
    ) -> None:
        # lazy: rfdetr imports torch_xla, which must start after the device choice
        from rfdetr.models.postprocess import PostProcess

        self.model = getattr(model, "_forward_module", model)  # lightning's _FabricModule -> the real module
        schema = list(getattr(self.model, "num_keypoints_per_class", None) or [])
        keypoints = bool(getattr(self.model, "use_grouppose_keypoints", False)) and max(schema, default=0) > 0
        #: ``"keypoints"``: the program returns the keypoints beside the rows (a seg model's masks: by its outputs).
        self.head = "keypoints" if keypoints else None
        self.postprocess = PostProcess(num_select=num_select, num_keypoints_per_class=schema, trace_alpha=trace_alpha)
        self.autocast = autocast
        self._compiled = torch.compile(self._forward, backend="openxla", fullgraph=True, dynamic=False)

    def _forward(self, images: torch.Tensor, orig_size: torch.Tensor,
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # lazy: data.pixels and model.inputs import rfdetr (torch_xla): after the device choice, as take_rows
        from spmd_rfdetr.data.pixels import normalize_images
        from spmd_rfdetr.xla.mesh import take_rows  # imports torch_xla: inference chooses the device first
        from spmd_rfdetr.model.inputs import as_samples

        samples = as_samples(normalize_images(images))  # uint8 pixels -> rfdetr's normalised float32 input
        with self.autocast():
            outputs = self.model(samples)
        logits, boxes = outputs["pred_logits"].float(), outputs["pred_boxes"].float()
        # rfdetr's own PostProcess steps (box-only path), batched: no per-image Python lists on the device.
        scores, labels, queries = self.postprocess._select_topk(logits)
        xyxy = self.postprocess._gather_and_scale_boxes(boxes, queries, orig_size)
        keypoints = None
        if self.head == "keypoints":  # rfdetr scores boxes with the fused scores too
            scores, keypoints = decode_keypoints(outputs["pred_keypoints"], queries, labels, scores, orig_size,
                                                 self.postprocess.num_keypoints_per_class, self.postprocess.trace_alpha)
        rows = torch.cat([scores.unsqueeze(-1), labels.unsqueeze(-1).to(scores.dtype), xyxy], dim=-1)
        if keypoints is not None:
            return rows, keypoints
        masks = outputs.get("pred_masks")
        if masks is None:
            return rows
        picked = take_rows(masks.flatten(2), queries)  # the selected queries' mask planes, whole rows
        return rows, picked.view(*queries.shape, *masks.shape[-2:]).float()

    def __call__(self, images: torch.Tensor, orig_size: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        from spmd_rfdetr.model.row_lookups import row_gathers  # imports torch_xla, as _forward's take_rows

        with torch.no_grad(), _traceable_pos_encoding(self.model), row_gathers():  # traced inside: row lookups
            return self._compiled(images, orig_size)

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        """Put the model in eval mode for a pass and restore its previous mode after (fit continues training)."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)


def reference_postprocess(outputs: dict[str, torch.Tensor], orig_size: torch.Tensor, num_select: int) -> torch.Tensor:
    """Upstream rfdetr's ``PostProcess`` module itself (eager), packed like :class:`EvalForward`'s output."""
    # lazy: rfdetr imports torch_xla, which must start after the device choice (load_for_inference, setup_runtime)
    from rfdetr.models.postprocess import PostProcess

    results = PostProcess(num_select=num_select)(outputs, orig_size)
    return torch.stack(
        [torch.cat([r["scores"][:, None], r["labels"][:, None].to(r["scores"].dtype), r["boxes"]], dim=-1)
         for r in results]
    )


# ---------------------------------------------------------------------------------------------------------------------
# Running batches
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Detections:
    """What :func:`run_detection` returns for the real images of a split (padding rows dropped)."""

    rows: np.ndarray
    """``[N, K, 6]`` packed ``(score, label, x0, y0, x1, y1)`` rows."""
    image_ids: np.ndarray
    """``[N]``"""
    segmentations: list[list[dict[str, Any]]] | None = None
    """Seg variants: per image, its ``K`` detections' masks as COCO RLEs at the image's size (encoded batch by
    batch: the mask logits of a split never sit in host memory together), else ``None``."""
    keypoints: np.ndarray | None = None
    """The keypoint model: ``[N, K, maxK, 3]`` keypoints (pixels, confidence) of each row, else ``None``."""

    def to_coco(self, label2cat: dict[int, int] | None) -> list[dict[str, Any]]:
        """COCO results (with ``segmentation`` for a seg model)."""
        return detections_to_coco(self.rows, self.image_ids, label2cat, self.segmentations)

    def keypoint_results(self, label2cat: dict[int, int] | None, counts: dict[int, int]) -> list[dict[str, Any]]:
        """COCO keypoint results (no ``bbox``, as rfdetr's), each vector cut to its category's ``counts``."""
        if self.keypoints is None:
            return []
        return keypoints_to_coco(self.keypoints, self.rows[..., 0], self.rows[..., 1], self.image_ids, label2cat,
                                 counts)


def run_detection(
    forward: EvalForward,
    loader: Iterable[dict[str, torch.Tensor]],
    to_device: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    order: np.ndarray | None = None,
) -> Detections:
    """Run every batch through the compiled forward; returns the :class:`Detections` of the real images.

    Each batch's result is fetched (one device->host transfer) after the next batch has been dispatched; a seg
    model's mask logits are encoded as RLEs right then, so host memory holds one batch of them. On several hosts each
    loads its rows and the result is the global array: the image ids and sizes are every host's, gathered over gloo in
    host order, then put in the global array's row order by ``order`` (:func:`~spmd_rfdetr.xla.hosts.mesh_row_order`;
    ``None``: the same
    order, as on one host). Padding rows (id -1) are dropped here.
    """
    parts: dict[str, list[Any]] = {"rows": [], "image_ids": [], "segmentations": [], "keypoints": []}
    keypoints = getattr(forward, "head", None) == "keypoints"  # a stand-in forward may not say
    pending: tuple[Any, np.ndarray, np.ndarray] | None = None

    def collect(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor], image_id: np.ndarray,
                orig_size: np.ndarray) -> None:
        real = image_id >= 0
        rows, extra = out if isinstance(out, tuple) else (out, None)
        parts["rows"].append(rows.cpu().numpy()[real])
        parts["image_ids"].append(image_id[real])
        if keypoints:
            parts["keypoints"].append(extra.cpu().numpy()[real])
        elif extra is not None:  # a seg model's mask logits
            logits = extra.cpu().numpy()
            parts["segmentations"] += [mask_rles(logits[i], tuple(orig_size[i])) for i in np.flatnonzero(real)]

    def in_global_order(rows: torch.Tensor) -> np.ndarray:
        gathered = hosts.gather_rows(rows).numpy()
        return gathered if order is None else gathered[order]

    with forward.eval_mode():
        for batch in loader:
            device_batch = to_device({"images": batch["images"], "orig_size": batch["orig_size"]})
            out = forward(device_batch["images"], device_batch["orig_size"])
            if pending is not None:
                collect(*pending)
            pending = (out, in_global_order(batch["image_id"]), in_global_order(batch["orig_size"]))
        if pending is not None:
            collect(*pending)
    if not parts["rows"]:
        return Detections(np.zeros((0, 0, 6), np.float32), np.zeros((0,), np.int64))
    return Detections(np.concatenate(parts["rows"]), np.concatenate(parts["image_ids"]),
                      parts["segmentations"] or None,
                      np.concatenate(parts["keypoints"]) if parts["keypoints"] else None)


@dataclass
class EvalResult:
    """One evaluation: the metrics, the COCO results behind them and the device-side counts."""

    metrics: CocoMetrics
    detections: list[dict[str, Any]]
    image_ids: list[int]
    batches: int = 0
    segm: CocoMetrics | None = None
    """Mask metrics (seg variants): logged as ``eval/segm_mAP`` ..."""
    keypoints: CocoMetrics | None = None
    """OKS keypoint metrics (the keypoint model): logged as ``eval/kp_mAP`` ..."""
    keypoint_detections: list[dict[str, Any]] | None = None
    """The COCO keypoint results behind :attr:`keypoints`."""

    def record(self, prefix: str = "eval/") -> dict[str, float]:
        """``{"eval/mAP": ...}`` (and ``eval/segm_mAP`` ... for a seg model, ``eval/kp_mAP`` ... for the keypoint
        model) for ``metrics.jsonl``."""
        return {**self.metrics.record(prefix), **(self.segm.record(f"{prefix}segm_") if self.segm else {}),
                **(self.keypoints.record(f"{prefix}kp_") if self.keypoints else {})}

    def table(self) -> str:
        """The box summary and per-class table, then the mask or keypoint one."""
        return "\n".join(m.table() for m in (self.metrics, self.segm, self.keypoints) if m is not None)


class Evaluator:
    """COCO evaluation of one dataset split on the mesh, reusable (e.g. every N steps inside ``fit``).

    Args:
        model: rfdetr's model on the XLA device (may be the one being trained; its mode is restored after a pass).
        dataset: an rfdetr dataset split (``CocoDetection``/``YoloDetection`` or a ``Subset`` of one) read with
            uint8 pixels, as :func:`spmd_rfdetr.data.splits.build_eval_split` reads it (the program normalises them).
        mesh: the SPMD mesh; batches are sharded on its batch axes.
        global_batch_size: images per eval batch (the last one padded to it).
        resolution: the model's input resolution.
        num_select: detections per image (rfdetr's ``num_select``).
        autocast: forward context (Fabric's precision), see :class:`EvalForward`.
        num_workers: DataLoader workers.
        max_dets: detections per image COCO scores (``eval.max_dets``).
        trace_alpha: the keypoint model's score fusion (``eval.trace_alpha``).
        keypoint_oks_sigmas: the keypoint model's OKS sigmas (``eval.keypoint_oks_sigmas``; ``None``: rfdetr's).
    """

    def __init__(self, model: torch.nn.Module, dataset: Dataset[Any], *, mesh: Any, global_batch_size: int,
                 resolution: int, num_select: int, autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 num_workers: int = 0, max_dets: int = MAX_DETS, trace_alpha: float = 0.2,
                 keypoint_oks_sigmas: list[float] | None = None) -> None:
        # lazy: rfdetr imports torch_xla, which must start after the device choice
        from rfdetr.datasets import get_coco_api_from_dataset

        # lazy: xla.fabric imports torch_xla and lightning_fabric: after the device choice
        from spmd_rfdetr.xla.fabric import replicate_parameters

        self.dataset = dataset
        self.coco_gt = get_coco_api_from_dataset(dataset)
        if self.coco_gt is None:
            raise ValueError(f"{type(dataset).__name__} has no COCO ground truth to evaluate against")
        self.label2cat, self.max_dets, self.sigmas = label2cat_of(dataset), max_dets, keypoint_oks_sigmas
        self.forward = EvalForward(model, num_select, autocast, trace_alpha)
        self.loader = eval_loader(dataset, global_batch_size, resolution, num_workers)
        # then its place on the mesh
        hosts.check_same_on_all_hosts("the number of images of the eval split", len(dataset))  # else: a hang
        self.mesh = mesh
        replicate_parameters(self.forward.model, mesh)
        self.to_device = device_sender(mesh)
        self.order = hosts.mesh_row_order(mesh, global_batch_size)  # several hosts: the global batch's row order

    def run(self) -> EvalResult:
        """Detect on the whole split, then score with COCOeval (host, process 0): boxes, and masks or keypoints
        when the model predicts them."""
        found = run_detection(self.forward, self.loader, self.to_device, self.order)
        detections, ids = found.to_coco(self.label2cat), found.image_ids.tolist()
        result = EvalResult(coco_metrics(self.coco_gt, detections, ids, self.max_dets), detections, ids,
                            len(self.loader))
        if detections and "segmentation" in detections[0]:
            result.segm = coco_metrics(self.coco_gt, detections, ids, self.max_dets, iou_type="segm")
        if found.keypoints is not None:
            result.keypoint_detections = found.keypoint_results(self.label2cat, keypoint_counts(self.coco_gt))
            result.keypoints = oks_metrics(self.coco_gt, result.keypoint_detections, ids, self.sigmas)
        return result


def device_sender(mesh: Any) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Host batch -> XLA tensors sharded on dim 0 over the mesh's batch axes (the training loader's own transfer)."""
    # lazy: torch_xla (xla.fabric imports it too) starts on import: after the device choice
    import torch_xla

    from spmd_rfdetr.xla.fabric import SPMDDataLoader

    return SPMDDataLoader([], mesh, torch_xla.device()).to_device


def save_result(result: EvalResult, output_dir: str | Path, *, detections: bool = True, stem: str = "") -> Path:
    """Write ``{stem}coco_eval.json`` (summary + per-class AP) and, optionally, ``{stem}detections.json`` (and the
    keypoint model's ``{stem}keypoints.json``, the COCO keypoint results OKS scored); on several hosts (each holds the
    same global result) host 0 alone writes them. Returns the summary's path."""
    out = Path(output_dir)
    summary = out / f"{stem}coco_eval.json"
    if not hosts.is_coordinator():
        return summary
    out.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps({**result.metrics.to_json(),
                                   **({"segm": result.segm.to_json()} if result.segm else {}),
                                   **({"keypoints": result.keypoints.to_json()} if result.keypoints else {})}, indent=1))
    if detections:
        (out / f"{stem}detections.json").write_text(json.dumps(result.detections))
        if result.keypoint_detections is not None:
            (out / f"{stem}keypoints.json").write_text(json.dumps(result.keypoint_detections))
    return summary


def eval_sizes(cfg: RunConfig, cfgs: Any) -> tuple[int, int]:
    """(global eval batch size, detections per image): ``eval.*`` or else the training batch and rfdetr's default."""
    return cfg.eval.global_batch_size or cfg.data.global_batch_size, cfg.eval.num_select or cfgs.model.num_select


def evaluator_for(cfg: RunConfig, cfgs: Any, model: torch.nn.Module, fabric: Any, dataset: Dataset[Any]) -> Evaluator:
    """An :class:`Evaluator` of ``dataset`` configured by ``cfg`` (eval sizes, precision, loader workers)."""
    batch_size, num_select = eval_sizes(cfg, cfgs)
    return Evaluator(
        model, dataset, mesh=fabric.strategy.mesh, global_batch_size=batch_size, resolution=cfgs.model.resolution,
        num_select=num_select, autocast=fabric.strategy.precision.forward_context, num_workers=cfg.data.num_workers,
        max_dets=cfg.eval.max_dets, trace_alpha=cfg.eval.trace_alpha, keypoint_oks_sigmas=cfg.eval.keypoint_oks_sigmas,
    )

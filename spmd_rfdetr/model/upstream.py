"""Build upstream rfdetr's model and criterion from our config; the one place that adapts rfdetr to XLA.

Nothing here copies rfdetr: the model is ``rfdetr``'s LWDETR, the loss its SetCriterion (with our static-shape matcher
from :mod:`spmd_rfdetr.model.loss`). The optimizer and the LR schedule: :mod:`spmd_rfdetr.training.optim`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from rfdetr import config as rfdetr_config
from rfdetr._namespace import _namespace_from_configs  # rfdetr's own config -> builder-namespace bridge
from rfdetr.assets.model_weights import ModelWeights
from rfdetr.detr import RFDETR
from rfdetr.models.backbone import dinov2
from rfdetr.models.criterion import SetCriterion
from rfdetr.models.lwdetr import LWDETR, build_criterion_from_config, build_model_from_config
from rfdetr.models.postprocess import PostProcess
from rfdetr.models.weights import load_pretrain_weights

from spmd_rfdetr.config.options import (VARIANT_CONFIGS, ConfigError, DataOptions, ModelOptions, OptimOptions,
                                        is_keypoint, is_segmentation, logit_count, resolved_weights)
from spmd_rfdetr.config.resolve import num_select_problem
from spmd_rfdetr.model import xla_safe

#: rfdetr's model config class per ``model.variant`` (names in :data:`spmd_rfdetr.config.options.VARIANT_CONFIGS`).
VARIANTS: dict[str, type[rfdetr_config.ModelConfig]] = {
    variant: getattr(rfdetr_config, name) for variant, name in VARIANT_CONFIGS.items()
}


@dataclass
class UpstreamConfigs:
    """rfdetr's own pydantic configs for this run (what its builders and dataset readers take)."""

    model: rfdetr_config.ModelConfig
    train: rfdetr_config.TrainConfig
    backbone_blocks: int | None = None
    """DINOv2 blocks to build (``ModelOptions.backbone_blocks``; ``None``: the variant's)."""

    def namespace(self) -> Any:
        """rfdetr's legacy builder namespace (model, criterion and dataset builders read it)."""
        return _namespace_from_configs(self.model, self.train)

    @property
    def keypoints_per_target(self) -> int:
        """Keypoint rows of each target (the schema's largest class: rfdetr's readers pad the others), 0 without
        keypoint heads."""
        if not self.model.use_grouppose_keypoints:
            return 0
        return max(self.model.num_keypoints_per_class or [0])

    def without_weights(self) -> UpstreamConfigs:
        """The same model built from scratch (a resumed run: its checkpoint holds every weight)."""
        return dataclasses.replace(self, model=self.model.model_copy(update={"pretrain_weights": None}))


def upstream_configs(model: ModelOptions, data: DataOptions, optim: OptimOptions, num_classes: int,
                     num_select: int | None = None) -> UpstreamConfigs:
    """Translate our options into rfdetr's ``ModelConfig`` + ``TrainConfig`` (unset fields keep rfdetr's defaults).

    ``model.pretrain_weights: auto`` becomes the variant's published weights (:func:`~spmd_rfdetr.config.options.
    resolved_weights`). ``num_select`` (``eval.num_select``) is the detections per image of the model's PostProcess;
    ``None``: rfdetr's default for the variant, at most the logits the model outputs. A ``num_select`` above that
    raises :class:`ConfigError`.
    """
    overrides = {
        k: v
        for k, v in {
            "resolution": model.resolution,
            "num_queries": model.num_queries,
            "group_detr": model.group_detr,
            "dec_layers": model.dec_layers,
            "num_keypoints_per_class": model.num_keypoints_per_class,
        }.items()
        if v is not None
    }
    fields = VARIANTS[model.variant].model_fields
    queries = model.num_queries if model.num_queries is not None else fields["num_queries"].default
    if num_select is None:  # PostProcess's top-k keeps at most the logits there are: record what it really keeps
        overrides["num_select"] = min(fields["num_select"].default, logit_count(queries, num_classes))
    else:
        problem = num_select_problem(num_select, queries, num_classes)
        if problem:
            raise ConfigError(f"invalid configuration:\n  - {problem}")
        overrides["num_select"] = num_select
    if model.backbone_blocks is not None:  # the last blocks feed the decoder, as many as the variant's (or all)
        outputs = len(VARIANTS[model.variant].model_fields["out_feature_indexes"].default)
        overrides["out_feature_indexes"] = list(range(1, model.backbone_blocks + 1))[-outputs:]
    with _no_from_scratch_warning():
        model_cfg = VARIANTS[model.variant](
            pretrain_weights=resolved_weights(model), num_classes=num_classes, device="cpu", **overrides
        )
    # rfdetr's seg models train with SegmentationTrainConfig (mask CE/dice weights 5, point ratio 16, class weight 1),
    # its keypoint model with KeypointTrainConfig (the four keypoint loss weights 1, class weight 2)
    train_class = (rfdetr_config.SegmentationTrainConfig if is_segmentation(model.variant) else
                   rfdetr_config.KeypointTrainConfig if is_keypoint(model.variant) else rfdetr_config.TrainConfig)
    train_cfg = train_class(
        dataset_dir=data.dataset_dir,
        dataset_file=data.dataset_format,
        output_dir=".",
        pad_targets_to=data.max_targets,
        multi_scale=data.multi_scale,
        augmentation_backend="cpu",
        lr=optim.lr,
        lr_encoder=optim.lr_encoder,
        weight_decay=optim.weight_decay,
        lr_vit_layer_decay=optim.lr_vit_layer_decay,
        lr_component_decay=optim.lr_component_decay,
        clip_max_norm=optim.clip_max_norm,
    )
    if is_keypoint(model.variant):
        _keypoint_schema_from_dataset(model_cfg, train_cfg, num_classes)
    return UpstreamConfigs(model_cfg, train_cfg, model.backbone_blocks)


def _keypoint_schema_from_dataset(model_cfg: rfdetr_config.ModelConfig, train_cfg: rfdetr_config.TrainConfig,
                                  num_classes: int) -> None:
    """rfdetr's ``train()`` before it builds a keypoint model: the keypoints per class and the horizontal-flip pairs
    from the dataset's metadata (COCO ``categories[].keypoints`` or YOLO ``kpt_shape``/``flip_idx``), by
    ``RFDETR._align_keypoint_schema_from_dataset`` on a shim (it reads and writes only these two configs; a dataset
    without keypoint metadata keeps the variant's ``[17]``), then the schema zero-padded to the class count (the rule
    of its ``_align_num_classes_from_dataset``: classes past the schema have no keypoints)."""
    shim = object.__new__(RFDETR)
    shim.model_config, shim.model = model_cfg, SimpleNamespace(args=None)
    with _no_from_scratch_warning():  # an assignment validates the config again
        shim._align_keypoint_schema_from_dataset(train_cfg)
        schema = list(model_cfg.num_keypoints_per_class)
        if len(schema) < num_classes:
            model_cfg.num_keypoints_per_class = schema + [0] * (num_classes - len(schema))


@contextlib.contextmanager
def _no_from_scratch_warning() -> Iterator[None]:
    """Without rfdetr's from-scratch warning: fit says it its own way (fetch_pretrain_weights), and inference loads a
    weight file."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pretrain_weights=None.*")
        yield


@contextlib.contextmanager
def dinov2_blocks(blocks: int | None) -> Iterator[None]:
    """While building, rfdetr's DINOv2 config says ``blocks`` (rfdetr reads the depth from a JSON file, no override;
    ``None``: as it is)."""
    if blocks is None:
        yield
        return
    read = dinov2.get_config
    dinov2.get_config = lambda size, use_registers: {**read(size, use_registers), "num_hidden_layers": blocks}
    try:
        yield
    finally:
        dinov2.get_config = read


def build_model(cfgs: UpstreamConfigs, training: bool = False) -> LWDETR:
    """rfdetr's LWDETR, from scratch or from ``pretrain_weights`` through rfdetr's own ``load_pretrain_weights``.

    That loader aligns the checkpoint to the configured model: a class head of another size is resized to the
    configured class count (rows truncated, or tiled when the checkpoint has fewer), query embeddings are sliced per
    group, position embeddings interpolated. A published name (``rf-detr-nano.pth`` ...) not on disk is downloaded by
    rfdetr into its cache (``$RF_HOME``, default ``~/.roboflow/models``). ``training``: a keypoint model that loaded
    weights starts its keypoint uncertainties at the identity, as rfdetr's trainer does (not its inference).
    """
    xla_safe.install()  # on an XLA device, the position table's resize for other image sizes (multi-scale)
    with dinov2_blocks(cfgs.backbone_blocks):
        net = build_model_from_config(cfgs.model, cfgs.train)
    if cfgs.model.pretrain_weights is not None:
        path = str(cfgs.model.pretrain_weights)
        if not os.path.isfile(path):
            if ModelWeights.from_filename(os.path.basename(path)) is None:
                raise FileNotFoundError(
                    f"model.pretrain_weights {path}: no such file, and not one of rfdetr's published weights "
                    f"({', '.join(ModelWeights.list_models())})"
                )
            os.makedirs(os.path.dirname(path), exist_ok=True)  # rfdetr's cache dir; its loader downloads into it
        load_pretrain_weights(net, cfgs.model)
        if training and cfgs.model.use_grouppose_keypoints:
            net.reset_keypoint_gaussian_parameters()
    return net


def build_upstream_criterion(cfgs: UpstreamConfigs) -> tuple[SetCriterion, PostProcess]:
    """rfdetr's SetCriterion with its SciPy HungarianMatcher, exactly as upstream trains (the reference)."""
    return build_criterion_from_config(cfgs.model, cfgs.train)


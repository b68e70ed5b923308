"""Build upstream rfdetr's model, criterion and optimizer from our config; the one place that adapts rfdetr to XLA.

Nothing here copies rfdetr: the model is ``rfdetr``'s LWDETR, the loss its SetCriterion (with our static-shape matcher
from :mod:`spmd_rfdetr.model.loss`), the parameter groups its ``get_param_dict``; the schedule uses rfdetr's cosine/step
formulas after a warm-up of its own (:func:`lr_factor` says where it differs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from rfdetr import config as rfdetr_config
from rfdetr._namespace import _namespace_from_configs  # rfdetr's own config -> builder-namespace bridge
from rfdetr.assets.model_weights import ModelWeights
from rfdetr.models.backbone import dinov2
from rfdetr.models.criterion import SetCriterion
from rfdetr.models.lwdetr import LWDETR, build_criterion_from_config, build_model_from_config
from rfdetr.models.postprocess import PostProcess
from rfdetr.models.weights import load_pretrain_weights
from rfdetr.training.param_groups import get_param_dict

from spmd_rfdetr.config.options import (VARIANT_CONFIGS, ConfigError, DataOptions, ModelOptions, OptimOptions,
                                is_segmentation, logit_count, resolved_weights)
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
    with warnings.catch_warnings():  # rfdetr's from-scratch warning: fit says it its own way (fetch_pretrain_weights),
        warnings.filterwarnings("ignore", message=".*pretrain_weights=None.*")  # and inference loads a weight file
        model_cfg = VARIANTS[model.variant](
            pretrain_weights=resolved_weights(model), num_classes=num_classes, device="cpu", **overrides
        )
    # rfdetr's seg models train with SegmentationTrainConfig (mask CE/dice weights 5, point ratio 16, class weight 1)
    train_class = rfdetr_config.SegmentationTrainConfig if is_segmentation(model.variant) else rfdetr_config.TrainConfig
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
    return UpstreamConfigs(model_cfg, train_cfg, model.backbone_blocks)


@contextlib.contextmanager
def _dinov2_blocks(blocks: int | None) -> Iterator[None]:
    """While building, rfdetr's DINOv2 config says ``blocks`` (rfdetr reads the depth from a JSON file, no override)."""
    if blocks is None:
        yield
        return
    read = dinov2.get_config
    dinov2.get_config = lambda size, use_registers: {**read(size, use_registers), "num_hidden_layers": blocks}
    try:
        yield
    finally:
        dinov2.get_config = read


def build_model(cfgs: UpstreamConfigs) -> LWDETR:
    """rfdetr's LWDETR, from scratch or from ``pretrain_weights`` through rfdetr's own ``load_pretrain_weights``.

    That loader aligns the checkpoint to the configured model: a class head of another size is resized to the
    configured class count (rows truncated, or tiled when the checkpoint has fewer), query embeddings are sliced per
    group, position embeddings interpolated. A published name (``rf-detr-nano.pth`` ...) not on disk is downloaded by
    rfdetr into its cache (``$RF_HOME``, default ``~/.roboflow/models``).
    """
    xla_safe.install()  # on an XLA device, the position table's resize for other image sizes (multi-scale)
    with _dinov2_blocks(cfgs.backbone_blocks):
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
    return net


def build_upstream_criterion(cfgs: UpstreamConfigs) -> tuple[SetCriterion, PostProcess]:
    """rfdetr's SetCriterion with its SciPy HungarianMatcher, exactly as upstream trains (the reference)."""
    return build_criterion_from_config(cfgs.model, cfgs.train)


def build_optimizer(net: torch.nn.Module, cfgs: UpstreamConfigs, *, on_device: bool = False) -> torch.optim.AdamW:
    """AdamW over rfdetr's parameter groups (backbone layer decay, decoder component decay, no-decay rules).

    ``on_device``: ``capturable`` AdamW (its step count lives on the device), for use with :class:`DeviceLRSchedule`.
    """
    param_groups = get_param_dict(cfgs.namespace(), net)
    return torch.optim.AdamW(param_groups, lr=cfgs.train.lr, weight_decay=cfgs.train.weight_decay, capturable=on_device)


def lr_factor(step: int, optim: OptimOptions, max_steps: int) -> float:
    """The LR factor of optimizer step ``step`` (from 0): linear warm-up, then cosine to ``min_lr_factor``, a 10x drop
    at ``lr_drop_step``, or constant.

    After warm-up these are the formulas of rfdetr's managed ``LambdaLR``
    (``rfdetr.training.module_model._build_managed_scheduler``). Where it differs from rfdetr (tests/test_schedule.py):
    the warm-up is ``(step + 1) / (warmup + 1)`` (rfdetr: ``step / warmup``, 0 at the first step), the drop step is
    counted in steps (rfdetr: ``lr_drop`` epochs), ``constant`` is ours, and the defaults (:class:`OptimOptions`:
    cosine to 0.05; rfdetr: ``step``, cosine to 0.0).
    """
    if step < optim.warmup_steps:
        return (step + 1) / (optim.warmup_steps + 1)  # never exactly 0, unlike upstream's first warmup step
    if optim.schedule == "cosine":
        progress = (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps)
        return optim.min_lr_factor + (1 - optim.min_lr_factor) * 0.5 * (1 + math.cos(math.pi * progress))
    if optim.schedule == "step" and optim.lr_drop_step and step >= optim.lr_drop_step:
        return 0.1
    return 1.0


def device_lr_factor(step: torch.Tensor, optim: OptimOptions, max_steps: int) -> torch.Tensor:
    """:func:`lr_factor` computed on the device from a float32 step count (no Python value changes per step)."""
    warmup = optim.warmup_steps
    if optim.schedule == "cosine":
        progress = (step - warmup) / max(1, max_steps - warmup)
        after = optim.min_lr_factor + (1 - optim.min_lr_factor) * 0.5 * (1 + torch.cos(math.pi * progress))
    elif optim.schedule == "step" and optim.lr_drop_step:
        after = torch.where(step >= optim.lr_drop_step, 0.1, 1.0)
    else:
        after = torch.ones_like(step)
    if warmup <= 0:
        return after
    return torch.where(step < warmup, (step + 1) / (warmup + 1), after)


class DeviceLRSchedule:
    """:func:`lr_factor` as device-tensor learning rates, stepped inside the compiled training step.

    A Python-float learning rate is baked into the XLA graph: AdamW's ``param.mul_(1 - lr * weight_decay)`` compiled a
    new graph when that factor stopped rounding to 1.0 in float32 (measured: a recompile at step 16 of the CPU recipe's
    warmup), and a replayed program would keep the first step's value for ever. So the step count is a device tensor
    too and the factor is computed from it on the device (:func:`device_lr_factor`): one graph for the whole run, never
    read back.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, optim: OptimOptions, max_steps: int) -> None:
        self.optimizer, self.optim, self.max_steps = optimizer, optim, max_steps
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        device = optimizer.param_groups[0]["params"][0].device
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)  # optimizer steps taken
        factor = lr_factor(0, optim, max_steps)
        for group, base in zip(optimizer.param_groups, self.base_lrs):
            group["lr"] = torch.tensor(base * factor, dtype=torch.float32, device=device)

    def step(self) -> None:
        """Advance one optimizer step (in-place device ops: part of the step's graph, no host value involved)."""
        self.step_count.add_(1)
        factor = device_lr_factor(self.step_count, self.optim, self.max_steps)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"].copy_(factor * base)

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors :meth:`step` updates (part of the training step's state)."""
        return [self.step_count]

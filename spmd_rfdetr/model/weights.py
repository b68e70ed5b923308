"""Weight files for inference: read ``last.pth``/``best.pth`` (or an upstream rfdetr checkpoint) and rebuild the
architecture they belong to. Nothing here touches XLA.

A ``fit`` weight file is a ``torch.load`` dict ``{"model": state_dict, "config": the resolved RunConfig as a dict,
"step", "class_names" (absent in older files), "ema" (when EMA was on)}``; ``model`` holds the weights to infer with
(the EMA weights when EMA was on). An rfdetr checkpoint is ``{"model": state_dict, "args": ..., ["model_config",
"model_name"]}`` and loads through rfdetr's own ``load_pretrain_weights``.

A ``fit`` weight file also carries rfdetr's own checkpoint entries (:func:`rfdetr_entries`: ``model_name``,
``model_config``, ``args`` with the class names), so upstream rfdetr loads it (``tests/test_interop.py``):
``torch.load(..., weights_only=True)`` works, ``RFDETR.from_checkpoint("best.pth")`` rebuilds the architecture and
names the classes, and ``RFDETRNano(pretrain_weights="best.pth", num_classes=..., resolution=..., num_queries=...,
group_detr=..., dec_layers=..., num_select=...)`` works with the values of its ``config["model"]`` and, for
``num_select`` (an eval setting here, ``eval.num_select``), ``model_config["num_select"]``. Their ``predict`` gives our
``predict``'s boxes, scores and labels (to 1e-4, tested in a process without torch_xla).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from spmd_rfdetr.config.options import DataOptions, ModelOptions, RunConfig

log = logging.getLogger(__name__)

#: ModelOptions fields that fix the weights' shapes: always taken from a ``fit`` checkpoint's config.
ARCHITECTURE = ("variant", "resolution", "num_queries", "group_detr", "dec_layers", "backbone_blocks", "num_classes",
                "num_keypoints_per_class")
#: Config sections that describe the machine, not the model: never taken from a checkpoint.
MACHINE_SECTIONS = ("mesh",)
#: rfdetr's class name per variant (``model_name`` in rfdetr's own checkpoints).
RFDETR_CLASSES = {"nano": "RFDETRNano", "small": "RFDETRSmall", "medium": "RFDETRMedium", "large": "RFDETRLarge",
                  "base": "RFDETRBase", "seg-nano": "RFDETRSegNano", "seg-small": "RFDETRSegSmall",
                  "seg-medium": "RFDETRSegMedium", "seg-large": "RFDETRSegLarge", "seg-xlarge": "RFDETRSegXLarge",
                  "seg-2xlarge": "RFDETRSeg2XLarge", "seg-preview": "RFDETRSegPreview",
                  "keypoint-preview": "RFDETRKeypointPreview"}


@dataclass
class SavedWeights:
    """What a weight file holds, in the terms inference needs."""

    path: Path
    kind: Literal["fit", "rfdetr", "state_dict"]
    state_dict: dict[str, torch.Tensor]
    config: dict[str, Any] | None = None  #: ``fit``'s resolved config (``kind == "fit"``)
    class_names: list[str] | None = None
    raw: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_classes(self) -> int | None:
        """Classes of the detection head (rfdetr's head has one more logit than classes)."""
        bias = self.state_dict.get("class_embed.bias")
        return int(bias.shape[0]) - 1 if bias is not None else None


def rfdetr_entries(model_config: Any, variant: str, class_names: list[str] | None) -> dict[str, Any]:
    """The entries of rfdetr's own checkpoints, for a weight file of rfdetr's ``model_config`` (a pydantic
    ``ModelConfig``): with them ``RFDETR.from_checkpoint`` rebuilds the architecture and reads the class names, and
    ``load_pretrain_weights`` slices the query embeddings per group. Plain values only (``weights_only`` loads)."""
    recorded = {k: getattr(model_config, k) for k in sorted(model_config.model_fields_set)
                if k not in ("pretrain_weights", "device")}
    args = {"class_names": list(class_names) if class_names else None,
            **{k: getattr(model_config, k) for k in ("num_classes", "num_queries", "group_detr", "resolution")}}
    return {"model_name": RFDETR_CLASSES[variant], "model_config": recorded, "args": args}


def read_weights(path: str | Path) -> SavedWeights:
    """Load a weight file on the CPU (rfdetr's safe loader: tensors and plain values only) and say what it is."""
    # lazy: rfdetr imports torch_xla: only when a file is read, so this module (no XLA here) imports without it
    from rfdetr.utilities.io import _safe_torch_load
    from rfdetr.utilities.state_dict import _ckpt_args_get

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--checkpoint {path}: no such file")
    state = _safe_torch_load(str(path))
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a checkpoint dict ({type(state).__name__})")
    weights = state.get("model")
    if isinstance(weights, dict) and isinstance(state.get("config"), dict):
        names = state.get("class_names")
        return SavedWeights(path, "fit", weights, state["config"], list(names) if names else None, state)
    if isinstance(weights, dict) and ("args" in state or "model_config" in state):
        names = _ckpt_args_get(state.get("args"), "class_names") if state.get("args") is not None else None
        return SavedWeights(path, "rfdetr", weights, None, list(names) if names else None, state)
    if isinstance(weights, dict):
        return SavedWeights(path, "state_dict", weights, raw=state)
    if state and all(isinstance(v, torch.Tensor) for v in state.values()):
        return SavedWeights(path, "state_dict", state)
    raise ValueError(f"{path}: no 'model' state dict in it (keys: {sorted(state)[:8]})")


def inference_config(cfg: RunConfig, saved: SavedWeights) -> RunConfig:
    """``cfg`` (what the command line gave) completed by what the weight file says about its model.

    A ``fit`` file's config is the base: its architecture (:data:`ARCHITECTURE`) always wins (other values cannot load
    these weights; a differing value given on the command line is named in a warning), and for the other sections a
    value on the command line that differs from the option's default wins (so ``--data.dataset_dir`` or
    ``--eval.split`` point a checkpoint elsewhere; a value given at its default cannot be told from an absent one, so
    the checkpoint's stands); ``mesh`` is always the command line's. An rfdetr checkpoint gives
    the class count and, where it records them, the variant, resolution, query and decoder sizes the command line left
    unset; its weights load through rfdetr's ``load_pretrain_weights`` (``model.pretrain_weights``).
    """
    out = copy.deepcopy(cfg)
    if saved.kind == "fit":
        assert saved.config is not None
        for section in dataclasses.fields(RunConfig):
            if section.name in MACHINE_SECTIONS or not isinstance(saved.config.get(section.name), dict):
                continue
            _merge_section(getattr(out, section.name), saved.config[section.name], section.name)
        if cfg.data.global_batch_size != DataOptions.global_batch_size and cfg.data.per_device_batch_size is None:
            out.data.per_device_batch_size = None  # a saved per-device size would replace the global one given here
        out.model.pretrain_weights = None  # the weights come from the checkpoint, never from the run's start point
    elif saved.kind == "rfdetr":
        _from_rfdetr_checkpoint(out.model, saved)
        out.model.pretrain_weights = str(saved.path)
    else:  # a bare state dict, loaded over the built model: no start point to load (or download) first
        out.model.pretrain_weights = None
    if out.model.num_classes is None:
        out.model.num_classes = saved.num_classes
    return out


def _merge_section(ours: Any, saved: dict[str, Any], name: str) -> None:
    defaults = type(ours)()
    for f in dataclasses.fields(ours):
        if f.name not in saved:
            continue  # a file from an older version: the command line's value stands
        given, stored = getattr(ours, f.name), saved[f.name]
        if name == "model" and f.name in ARCHITECTURE:
            if given != getattr(defaults, f.name) and given != stored:
                log.warning("--model.%s %s ignored: the checkpoint's weights are %s=%s", f.name, given, f.name, stored)
            setattr(ours, f.name, stored)
        elif given == getattr(defaults, f.name):
            setattr(ours, f.name, stored)


def _from_rfdetr_checkpoint(model: ModelOptions, saved: SavedWeights) -> None:
    # lazy: rfdetr imports torch_xla: only when a file is read, so this module (no XLA here) imports without it
    from rfdetr.utilities.state_dict import _ckpt_args_get

    by_class = {v: k for k, v in RFDETR_CLASSES.items()}
    if saved.raw.get("model_name") in by_class and model.variant == ModelOptions.variant:
        model.variant = by_class[saved.raw["model_name"]]  # type: ignore[assignment]
    recorded = saved.raw.get("model_config") if isinstance(saved.raw.get("model_config"), dict) else {}
    args = saved.raw.get("args")
    for name in ("resolution", "num_queries", "group_detr", "dec_layers"):
        value = recorded.get(name, _ckpt_args_get(args, name) if args is not None else None)
        if getattr(model, name) is None and isinstance(value, int):
            setattr(model, name, value)

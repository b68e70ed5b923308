"""The ``export`` verb: a checkpoint's weights in upstream rfdetr's own model class, exported by rfdetr's exporter.

Runs on the CPU in eager PyTorch (no XLA tensor is made): ``RFDETR.export`` (ONNX by default) traces rfdetr's model
with the checkpoint's weights and architecture (:func:`spmd_rfdetr.model.weights.inference_config`).

The exported ONNX graph gives the eager model's outputs under onnxruntime (tested). Other rfdetr formats (``tflite``,
``openvino``, ...) go through the same call; a format whose rfdetr extra is missing stops with exit status 2 and the
``pip install`` line.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import warnings
from pathlib import Path
from typing import Any

from spmd_rfdetr.config.options import ModelOptions, RunConfig
from spmd_rfdetr.model.weights import RFDETR_CLASSES, SavedWeights, inference_config, read_weights, rfdetr_entries

log = logging.getLogger(__name__)

#: Modules a format needs that rfdetr only imports inside the conversion, after a full forward pass of the model
#: (torch's ONNX exporter fails without ``onnx`` only once the graph is traced).
_LATE_IMPORTS = {"onnx": ("onnx",), "openvino": ("openvino",), "tflite": ("onnx2tf",)}


class MissingExportDependencies(RuntimeError):
    """The format's optional dependencies (an rfdetr extra) are not installed."""


def check_export_dependencies(fmt: str) -> str:
    """rfdetr's canonical name of ``fmt``; raises :class:`MissingExportDependencies` naming the extra to install."""
    # lazy: rfdetr imports torch_xla: only when exporting, so this module imports without it
    from rfdetr.export.registry import normalize_format, require_entry, resolve_exporter

    fmt = normalize_format(fmt)
    require_entry(fmt)  # ValueError naming the formats rfdetr knows
    missing = [name for name in _LATE_IMPORTS.get(fmt, ()) if importlib.util.find_spec(name) is None]
    if missing:
        raise _missing(fmt, ", ".join(missing))
    try:
        resolve_exporter(fmt).check_dependencies()
    except ImportError as err:
        raise _missing(fmt, str(err)) from err
    return fmt


def _missing(fmt: str, what: str) -> MissingExportDependencies:
    # lazy: rfdetr imports torch_xla: only when exporting, so this module imports without it
    from rfdetr.export.registry import require_entry

    extra = require_entry(fmt).pip_extra or fmt
    spec = f"rfdetr[{extra}]=={importlib.metadata.version('rfdetr')}"
    ours = ' (in a checkout of spmd_rfdetr: pip install -e ".[export]")' if fmt == "onnx" else ""
    return MissingExportDependencies(
        f"export --format {fmt} needs rfdetr's optional '{extra}' dependencies, which are not installed (missing: "
        f"{what}). Install them with: pip install \"{spec}\"{ours}"
    )


def upstream_model(cfg: RunConfig, saved: SavedWeights) -> Any:
    """rfdetr's high-level model (``RFDETRNano`` ...) for ``cfg``'s architecture, holding ``saved``'s weights."""
    # lazy: rfdetr imports torch_xla: only when exporting, so this module imports without it (model.upstream too)
    import rfdetr

    from spmd_rfdetr.model.upstream import dinov2_blocks, upstream_configs

    mc = upstream_configs(cfg.model, cfg.data, cfg.optim, cfg.model.num_classes or 0).model
    kwargs = rfdetr_entries(mc, cfg.model.variant, None)["model_config"]
    with warnings.catch_warnings(), dinov2_blocks(cfg.model.backbone_blocks):  # a debug model's depth, as fit built it
        warnings.filterwarnings("ignore", message=".*pretrain_weights=None.*")
        if saved.kind == "rfdetr":  # rfdetr loads its own format (query slicing, head alignment)
            model = getattr(rfdetr, RFDETR_CLASSES[cfg.model.variant])(pretrain_weights=str(saved.path), **kwargs)
        else:
            model = getattr(rfdetr, RFDETR_CLASSES[cfg.model.variant])(pretrain_weights=None, **kwargs)
            model.model.model.load_state_dict(saved.state_dict)
    return model


def export_checkpoint(checkpoint: str, fmt: str = "onnx", output: str | None = None, *,
                      model: ModelOptions | None = None, **export_args: Any) -> Path:
    """Export ``checkpoint`` with ``RFDETR.export``; returns the written file.

    ``output`` is the file to write (default: the checkpoint's path with the format's suffix); ``export_args`` go to
    ``RFDETR.export`` (``batch_size``, ``dynamic_batch``, ``opset_version`` ...).
    """
    fmt = check_export_dependencies(fmt)  # before any model is built: a missing extra costs nothing
    saved = read_weights(checkpoint)
    cfg = inference_config(RunConfig(model=model or ModelOptions()), saved)
    if cfg.model.num_classes is None:
        raise ValueError(f"{checkpoint}: no class_embed in the weights, cannot tell the class count")
    out = Path(output) if output else saved.path.with_suffix(f".{fmt}")
    net = upstream_model(cfg, saved)
    try:
        written = Path(net.export(output_dir=str(out.parent), output_name=out.stem, format=fmt, verbose=False,
                                  **export_args))
    except ImportError as err:  # a dependency the converter imports late, not in the table above
        raise _missing(fmt, str(err)) from err
    print(f"export: {written}", flush=True)
    return written

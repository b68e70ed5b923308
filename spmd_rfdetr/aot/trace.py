"""The programs ``fit`` runs, traced on a virtual XLA CPU mesh and written as HLO for the TPU compiler.

``python -m spmd_rfdetr.aot.trace CONFIG.yaml DIR [--train-only]`` runs in a process whose XLA runtime has as many
virtual CPU devices as the TPU topology has devices (the ``aot`` verb starts it so; a module traced on fewer devices
cannot be compiled for more). It builds the trainer exactly as ``fit`` does (:func:`~spmd_rfdetr.training.build.build_trainer`
on the config's mesh and precision), then for every batch shape ``fit`` would train on (``model.resolution``, or each
multi-scale bucket) traces the replayed training step on a blank batch of that shape and lowers it to the HLO module
torch_xla compiles, with the training state it updates marked for donation (:meth:`~spmd_rfdetr.training.step.TrainStep.lower`);
and the eval forward + post-processing on a blank eval batch (traced lazily here; ``fit`` compiles the same forward
with ``torch.compile(backend="openxla")``). Nothing is compiled for the CPU or run: a few tiny set-up graphs (AdamW
state, copies of the weights) are all that execute. ``XLA_HLO_DEBUG=1`` (set by the verb) puts the Python source
line of every op into the HLO metadata, so the compiler's report can name the line that causes a collective, and
:func:`~spmd_rfdetr.aot.labels.module_labels` prefixes each op's name with the path of the module that ran it (the
compiler's report attributes bytes to components by both: :mod:`spmd_rfdetr.aot.components`).

Writes ``DIR/programs.json`` (the interface of :mod:`spmd_rfdetr.aot.tpu_compile`) and one ``.hlo.pb`` per program.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from spmd_rfdetr.config.options import (
    CheckpointOptions,
    DataOptions,
    EvalOptions,
    MeshOptions,
    ModelOptions,
    OptimOptions,
    RunConfig,
    TrainerOptions,
    is_keypoint,
    is_segmentation,
)
from spmd_rfdetr.config.resolve import multi_scale_buckets, resolve_and_check, upstream_scales

log = logging.getLogger(__name__)

_SECTIONS = {"model": ModelOptions, "data": DataOptions, "optim": OptimOptions, "mesh": MeshOptions,
             "trainer": TrainerOptions, "eval": EvalOptions, "checkpointing": CheckpointOptions}


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


def config_from_yaml(text: str) -> RunConfig:
    values = yaml.safe_load(text)
    return RunConfig(**{name: cls(**values[name]) for name, cls in _SECTIONS.items()})


def _num_classes(cfg: RunConfig) -> int:
    """``model.num_classes``, else the dataset's (as ``fit`` reads it), else rfdetr's default for the variant; for a
    keypoint variant without a dataset, one class per entry of its keypoint schema (rfdetr's ``[17]``: COCO person),
    since rfdetr pads every query's keypoints to ``num_classes x 17`` slots: its default of 90 classes traced a
    keypoint step with 20% more bytes than a person dataset's (benchmarks/README.md, keypoints)."""
    if cfg.model.num_classes:
        return cfg.model.num_classes
    if (Path(cfg.data.dataset_dir) / "train").is_dir():
        # lazy: data.splits imports rfdetr, which starts torch_xla: only after trace_programs' setup_runtime
        from spmd_rfdetr.data.splits import num_classes_in

        return num_classes_in(cfg.data.dataset_dir, is_keypoint(cfg.model.variant))
    # lazy: model.upstream imports rfdetr, which starts torch_xla: only after trace_programs' setup_runtime
    from spmd_rfdetr.model.upstream import VARIANTS

    fields = VARIANTS[cfg.model.variant].model_fields
    if is_keypoint(cfg.model.variant):
        schema = cfg.model.num_keypoints_per_class or fields["num_keypoints_per_class"].default
        log.info("no dataset at %s: tracing %d class(es), one per entry of the keypoint schema %s (set "
                 "--model.num_classes)", cfg.data.dataset_dir, len(schema), schema)
        return len(schema)
    default = int(fields["num_classes"].default)
    log.info("no dataset at %s: tracing with rfdetr's default of %d classes (set --model.num_classes)",
             cfg.data.dataset_dir, default)
    return default


def trace_programs(cfg: RunConfig, out: Path, train_only: bool = False) -> list[dict[str, Any]]:
    """Trace and lower ``fit``'s programs for ``cfg`` into ``out``; returns the ``programs.json`` entries."""
    # lazy: aot.check imports this module (config_to_yaml) in the CLI: the runtime (torch) loads only in the trace child
    from spmd_rfdetr.xla.runtime import PRECISIONS, setup_runtime

    setup_runtime(cfg.mesh)
    # lazy: torch_xla (rfdetr's modules import it) must start after setup_runtime chose the device count
    import torch
    import torch_xla.runtime as xr

    from spmd_rfdetr.aot.labels import module_labels
    from spmd_rfdetr.training.build import build_trainer, unwrap
    from spmd_rfdetr.data.batches import blank_batch
    from spmd_rfdetr.eval.evaluator import EvalForward, eval_sizes
    from spmd_rfdetr.model.row_lookups import row_gathers
    from spmd_rfdetr.xla.fabric import spmd_fabric
    from spmd_rfdetr.xla.mesh import build_mesh
    from spmd_rfdetr.model.upstream import upstream_configs
    from spmd_rfdetr.xla.lowering import lower

    devices = xr.global_runtime_device_count()
    resolve_and_check(cfg, devices)
    t, d = cfg.trainer, cfg.data
    fabric = spmd_fabric(build_mesh(cfg.mesh.data, cfg.mesh.fsdp), precision=PRECISIONS[t.precision])
    fabric.seed_everything(t.seed)
    cfg.model.pretrain_weights = None  # the programs depend on the shapes, not the weights: nothing to download
    cfgs = upstream_configs(cfg.model, d, cfg.optim, _num_classes(cfg), cfg.eval.num_select)
    trainer = build_trainer(fabric, cfgs, cfg.optim, t, ema=cfg.model, mesh=cfg.mesh)
    if trainer.step.mode != "replay":
        raise ValueError(f"the aot check compiles the replayed training step; this config runs it in "
                         f"{trainer.step.mode!r} mode (trainer.step_mode / trainer.matcher / trainer.compile_backend)")
    place = fabric.strategy.process_dataloader(torch.utils.data.DataLoader([])).place
    sizes = multi_scale_buckets(cfg) or [cfgs.model.resolution]
    read_at = max(upstream_scales(cfg.model)) if multi_scale_buckets(cfg) else cfgs.model.resolution  # as fit reads
    if train_only:
        sizes = [max(sizes)]
    common = {"num_partitions": devices, "precision": t.precision, "variant": cfg.model.variant}
    programs = []
    for size in sizes:
        batch = place(blank_batch(d.global_batch_size, size, d.max_targets, read_at,
                                  masks=is_segmentation(cfg.model.variant), keypoints=cfgs.keypoints_per_target))
        with module_labels({"": unwrap(trainer.model), "criterion": trainer.criterion}, step_scopes(trainer)):
            lowered = trainer.step.lower(batch)
        name = f"train_step {size}px"
        programs.append(_write(out, name, "train", lowered, d.global_batch_size, devices, size, common))
        log.info("traced %s: %d instructions, %d donated inputs", name, lowered.instructions, len(lowered.donors))
    if not train_only:
        eval_batch, num_select = eval_sizes(cfg, cfgs)
        forward = EvalForward(trainer.inference_model, num_select, fabric.strategy.precision.forward_context)
        blank = place(blank_batch(eval_batch, cfgs.model.resolution, d.max_targets))
        with torch.no_grad(), forward.eval_mode(), module_labels({"": unwrap(trainer.inference_model)}), \
                row_gathers():  # as EvalForward.__call__ traces it
            detections = forward._forward(blank["images"], blank["orig_size"])  # lazily: same graph as openxla's
        outputs = list(detections) if isinstance(detections, tuple) else [detections]  # seg: rows and masks
        programs.append(_write(out, f"eval {cfgs.model.resolution}px", "eval", lower(outputs, name="eval_forward"),
                               eval_batch, devices, cfgs.model.resolution, common))
    (out / "programs.json").write_text(json.dumps({"programs": programs}, indent=1))
    return programs


def step_scopes(trainer: Any) -> list[tuple[str, Any, str]]:
    """Functions of the training step that are not a module's forward and return what they compute, as labels for
    :func:`~spmd_rfdetr.aot.labels.module_labels` (the names :data:`spmd_rfdetr.aot.components.RULES` reads).
    AdamW, the EMA, the LR schedule and the non-finite guard update tensors in place: their source files tell them."""
    # lazy: called inside trace_programs: torch and model.loss (rfdetr, torch_xla) only after setup_runtime
    import torch

    import spmd_rfdetr.model.loss as loss_mod

    matcher = getattr(trainer.criterion, "matcher", None)
    return [("clip", torch.nn.utils, "clip_grad_norm_"), ("matcher.cost", matcher, "cost"),
            ("matcher.mask_cost", matcher, "mask_costs"), ("matcher.solver", matcher, "_solve"),
            ("criterion.masks", loss_mod, "mask_losses")]


def _write(out: Path, name: str, kind: str, lowered: Any, global_batch: int, devices: int, resolution: int,
           common: dict[str, Any]) -> dict[str, Any]:
    file = f"{kind}_{resolution}.hlo.pb"
    (out / file).write_bytes(lowered.hlo)
    return {"name": name, "kind": kind, "file": file, "donors": lowered.donors,
            "own_outputs": {str(param): output for param, output in lowered.own_outputs.items()},
            "global_batch": global_batch,
            "images_per_device": global_batch // devices, "resolution": resolution,
            "traced_instructions": lowered.instructions, "input_types": lowered.input_types, **common}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmd_rfdetr.aot.trace", description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="a resolved RunConfig as YAML")
    parser.add_argument("dir", type=Path, help="where programs.json and the HLO files go")
    parser.add_argument("--train-only", action="store_true", help="only the training step at the largest size")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.dir.mkdir(parents=True, exist_ok=True)
    trace_programs(config_from_yaml(args.config.read_text()), args.dir, args.train_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``python -m spmd_rfdetr fit --config configs/v5e.yaml`` (jsonargparse over typed signatures)."""

from __future__ import annotations

import logging
from pathlib import Path

from jsonargparse import CLI, set_parsing_settings

from spmd_rfdetr import loop
from spmd_rfdetr.config import (
    DataOptions,
    CheckpointOptions,
    EvalOptions,
    MeshOptions,
    ModelOptions,
    OptimOptions,
    RunConfig,
    TrainerOptions,
)
from spmd_rfdetr.synth import synth

set_parsing_settings(docstring_parse_attribute_docstrings=True)  # each config field's docstring is its --help


def fit(
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    optim: OptimOptions = OptimOptions(),
    mesh: MeshOptions = MeshOptions(),
    trainer: TrainerOptions = TrainerOptions(),
    eval: EvalOptions = EvalOptions(),
    checkpointing: CheckpointOptions = CheckpointOptions(),
) -> Path:
    """Train RF-DETR on a single-process SPMD mesh.

    Args:
        model: Which RF-DETR to build.
        data: Dataset and static batch shapes.
        optim: AdamW, clipping and LR schedule.
        mesh: The device mesh.
        trainer: Run length, logging, precision and outputs.
        eval: COCO evaluation inside fit (every N steps, best.pth by mAP).
        checkpointing: Full training-state checkpoints for ``--trainer.resume``.
    """
    return loop.fit(
        RunConfig(model=model, data=data, optim=optim, mesh=mesh, trainer=trainer, eval=eval, checkpointing=checkpointing)
    )


def validate(
    checkpoint: str,
    output_dir: str | None = None,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    optim: OptimOptions = OptimOptions(),
    mesh: MeshOptions = MeshOptions(),
    trainer: TrainerOptions = TrainerOptions(),
    eval: EvalOptions = EvalOptions(),
    checkpointing: CheckpointOptions = CheckpointOptions(),
) -> dict[str, float]:
    """COCO-evaluate a checkpoint on a dataset split on the mesh (one compiled eval graph, pycocotools COCOeval).

    Args:
        checkpoint: A checkpoint written by ``fit`` (``last.pth``/``best.pth``) or a ``{"model": state_dict}`` file.
        output_dir: Where ``coco_eval.json`` (summary + per-class AP) and ``detections.json`` go; default
            ``<checkpoint dir>/eval_<checkpoint stem>_<split>``.
        model: Which RF-DETR to build (as trained).
        data: Dataset (``dataset_dir``) and batch size.
        optim: Unused (accepted so a training config can be passed as is).
        mesh: The device mesh.
        trainer: ``precision`` is used for the forward.
        eval: Split, eval batch size and detections per image.
        checkpointing: Unused (accepted so a training config can be passed as is).
    """
    from spmd_rfdetr import evaluate

    cfg = RunConfig(
        model=model, data=data, optim=optim, mesh=mesh, trainer=trainer, eval=eval, checkpointing=checkpointing
    )
    return evaluate.evaluate_checkpoint(cfg, checkpoint, output_dir).metrics.record()


def predict(
    checkpoint: str,
    images: str,
    output: str,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    optim: OptimOptions = OptimOptions(),
    mesh: MeshOptions = MeshOptions(),
    trainer: TrainerOptions = TrainerOptions(),
    eval: EvalOptions = EvalOptions(),
    checkpointing: CheckpointOptions = CheckpointOptions(),
) -> Path:
    """Detect objects in every image of a folder on the mesh and write COCO results JSON.

    Args:
        checkpoint: A checkpoint written by ``fit`` or a ``{"model": state_dict}`` file.
        images: Folder of images (jpg/png/...); ids come from its ``_annotations.coco.json`` if present, else from
            the sorted file order (listed in ``<output stem>.images.json``).
        output: COCO results file to write: ``[{"image_id", "category_id", "bbox": [x, y, w, h], "score"}]``.
        model: Which RF-DETR to build (as trained).
        data: ``dataset_dir`` gives the category ids (its train split's label mapping); batch size.
        optim: Unused (accepted so a training config can be passed as is).
        mesh: The device mesh.
        trainer: ``precision`` is used for the forward.
        eval: Eval batch size and detections per image.
        checkpointing: Unused (accepted so a training config can be passed as is).
    """
    from spmd_rfdetr import evaluate

    cfg = RunConfig(
        model=model, data=data, optim=optim, mesh=mesh, trainer=trainer, eval=eval, checkpointing=checkpointing
    )
    return evaluate.predict(cfg, checkpoint, images, output)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``python -m spmd_rfdetr`` and the ``spmd-rfdetr`` script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    CLI([fit, validate, predict, synth], args=args, as_positional=False)

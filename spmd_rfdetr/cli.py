"""Command line: ``python -m spmd_rfdetr fit --config configs/v5e.yaml`` (jsonargparse over typed signatures)."""

from __future__ import annotations

import logging
from pathlib import Path

from jsonargparse import CLI, set_parsing_settings

from spmd_rfdetr import loop
from spmd_rfdetr.config import DataOptions, MeshOptions, ModelOptions, OptimOptions, RunConfig, TrainerOptions
from spmd_rfdetr.synth import synth

set_parsing_settings(docstring_parse_attribute_docstrings=True)  # each config field's docstring is its --help


def fit(
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    optim: OptimOptions = OptimOptions(),
    mesh: MeshOptions = MeshOptions(),
    trainer: TrainerOptions = TrainerOptions(),
) -> Path:
    """Train RF-DETR on a single-process SPMD mesh.

    Args:
        model: Which RF-DETR to build.
        data: Dataset and static batch shapes.
        optim: AdamW, clipping and LR schedule.
        mesh: The device mesh.
        trainer: Run length, logging, precision and outputs.
    """
    return loop.fit(RunConfig(model=model, data=data, optim=optim, mesh=mesh, trainer=trainer))


def main(args: list[str] | None = None) -> None:
    """Entry point of ``python -m spmd_rfdetr`` and the ``spmd-rfdetr`` script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    CLI([fit, synth], args=args, as_positional=False)

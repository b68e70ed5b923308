"""Command line: ``python -m spmd_rfdetr fit --config configs/v5e.yaml`` (jsonargparse over typed signatures).

Every config, data and path error (and every command-line parse error) leaves as one message on stderr with exit
status 2 and no traceback; ``--debug`` anywhere on the command line (or ``SPMD_RFDETR_DEBUG=1``) adds the traceback.
Warnings that do not apply to a run of ours (XLA's, torch's and rfdetr's) are left out (:mod:`spmd_rfdetr.quiet`);
``--verbose`` anywhere on the command line (or ``SPMD_RFDETR_VERBOSE=1``) shows them.
A run stopped by a non-finite loss (``trainer.on_nonfinite=stop``) leaves with one message and exit status 3.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
from argparse import ArgumentError
from pathlib import Path
from typing import Any

from jsonargparse import CLI, ActionConfigFile, ArgumentParser, set_parsing_settings

from spmd_rfdetr import quiet
from spmd_rfdetr.aot.check import AotFailed, DoesNotFit
from spmd_rfdetr.data import check as checks
from spmd_rfdetr.training import loop
from spmd_rfdetr.training.loop import NonFiniteLoss
from spmd_rfdetr.xla import hosts
from spmd_rfdetr.xla.runtime import choose_device
from spmd_rfdetr.config.options import (
    ConfigError,
    DataOptions,
    CheckpointOptions,
    EvalOptions,
    MeshOptions,
    ModelOptions,
    OptimOptions,
    RunConfig,
    TrainerOptions,
)
from spmd_rfdetr.config.resolve import resolve_and_check
from spmd_rfdetr.data.check_report import DataError
from spmd_rfdetr.data.synth import synth

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


def check_data(
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    optim: OptimOptions = OptimOptions(),
    mesh: MeshOptions = MeshOptions(),
    trainer: TrainerOptions = TrainerOptions(),
    eval: EvalOptions = EvalOptions(),
    checkpointing: CheckpointOptions = CheckpointOptions(),
) -> None:
    """Check the config and the dataset splits ``fit`` would read (train, and eval.split when fit evaluates),
    without starting XLA: every problem at once, each with its file, annotation and fix (what ``fit`` checks first).

    Args:
        model: Which RF-DETR (resolution and query rules; ``num_classes`` bounds the labels).
        data: Dataset, ``max_targets``/``on_overflow`` and ``on_bad``.
        optim: Checked as ``fit`` checks it.
        mesh: Checked as ``fit`` checks it (without a device count).
        trainer: Checked as ``fit`` checks it.
        eval: ``every_steps``/``every_epochs`` and ``split``: which eval split is checked too.
        checkpointing: Accepted so a training config can be passed as is.
    """
    cfg = RunConfig(
        model=model, data=data, optim=optim, mesh=mesh, trainer=trainer, eval=eval, checkpointing=checkpointing
    )
    resolve_and_check(cfg)
    report = checks.check_data(cfg)
    print(f"check-data: {data.dataset_dir}: ok; {report.summary()}", flush=True)


def plan(
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    optim: OptimOptions = OptimOptions(),
    mesh: MeshOptions = MeshOptions(),
    trainer: TrainerOptions = TrainerOptions(),
    eval: EvalOptions = EvalOptions(),
    checkpointing: CheckpointOptions = CheckpointOptions(),
    variants: list[str] | None = None,
) -> None:
    """Print the bytes per device of parameters, gradients, AdamW state and the EMA copy for each RF-DETR variant on
    the mesh ``--mesh.data x --mesh.fsdp`` (the sharding rules ``fit`` applies), without a device: pick a mesh before
    renting one. Activations are not included.

    Args:
        model: ``num_classes`` sizes the class head (default: rfdetr's); each variant is built at its own defaults.
        data: Accepted so a training config can be passed as is.
        optim: Accepted so a training config can be passed as is.
        mesh: ``fsdp`` and ``fsdp_min_numel`` decide the sharding (``data`` does not change bytes per device).
        trainer: Accepted so a training config can be passed as is.
        eval: Accepted so a training config can be passed as is.
        checkpointing: Accepted so a training config can be passed as is.
        variants: Which variants (default: nano, small, medium, large, base).
    """
    # lazy: a verb imports what it runs, after quiet.configure and the device choice
    from spmd_rfdetr.aot.plan import VARIANTS, format_plan, memory_plan

    if mesh.fsdp < 1 or mesh.fsdp_min_numel < 1:
        raise ConfigError(f"mesh.fsdp={mesh.fsdp} and mesh.fsdp_min_numel={mesh.fsdp_min_numel} must be >= 1")
    unknown = sorted(set(variants or ()) - set(VARIANTS))
    if unknown:
        raise ConfigError(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    print(format_plan(memory_plan(mesh, variants or VARIANTS, model.num_classes), mesh), flush=True)


def aot(
    topology: str,
    json: str | None = None,
    max_batch: bool = False,
    headroom: float = 0.1,
    keep: str | None = None,
    hbm_only: bool = False,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    optim: OptimOptions = OptimOptions(),
    mesh: MeshOptions = MeshOptions(),
    trainer: TrainerOptions = TrainerOptions(),
    eval: EvalOptions = EvalOptions(),
    checkpointing: CheckpointOptions = CheckpointOptions(),
) -> None:
    """Compile the programs ``fit`` runs (the training step for each batch shape, the eval forward) for a TPU topology
    with the real TPU compiler (libtpu, the ``aot`` extra), on this machine: no TPU needed. Prints per program whether
    it fits, HBM per chip, FLOPs and bytes per step, a roofline time, collectives and compile time.

    Args:
        topology: TPU slice, ``<chip>:<shape>`` (``v5e:1x1``, ``v5e:2x4``, ``v6e:2x4``, ``v4:2x2x1``, ``v5p:2x2x1``,
            ``v3:2x2``) or a Cloud name (``v5litepod-8``, ``v3-8``).
        json: Also write the whole report (per program: memory, cost, collectives, largest byte movers) here.
        max_batch: Search ``data.per_device_batch_size`` for the largest training step that compiles (one compile
            per probe), and the largest that leaves ``headroom`` of HBM free.
        headroom: Fraction of HBM a recipe should leave free (``--max-batch``).
        keep: Keep the HLO modules and the compiler's results in this directory (default: a temporary one).
        hbm_only: Compile with no buffer in the chip's on-chip memory (libtpu's VMEM assignment off), so that
            "bytes accessed" counts HBM traffic only: an upper bound on what the normal program moves through HBM
            (whose count also includes its on-chip accesses). A measurement; ``fit`` runs the normal program, and
            ``--max_batch`` still searches with it.
        model: Which RF-DETR to build (``num_classes``: else the dataset's, else rfdetr's default).
        data: Batch shapes (``per_device_batch_size`` or ``global_batch_size``, ``max_targets``, multi-scale).
        optim: As ``fit`` (``accumulate`` changes the program).
        mesh: The mesh over the topology's devices (``data`` x ``fsdp``).
        trainer: ``precision`` and the step options ``fit`` would use.
        eval: Eval batch size and detections per image (the eval program).
        checkpointing: Accepted so a training config can be passed as is.
    """
    # lazy: a verb imports what it runs, after quiet.configure and the device choice
    from spmd_rfdetr.aot.check import aot_check

    cfg = RunConfig(
        model=model, data=data, optim=optim, mesh=mesh, trainer=trainer, eval=eval, checkpointing=checkpointing
    )
    report = aot_check(cfg, topology, json, max_batch, headroom, keep, hbm_only)
    if hbm_only:
        print(f"aot: compiled with no buffer in on-chip memory ({report['hbm_only']}): every byte accessed above is "
              "HBM traffic, an upper bound on the normal program's", flush=True)
    if max_batch:
        found = report["max_batch"]
        print(f"aot: largest data.per_device_batch_size that compiles on {report['topology']}: {found['largest']}; "
              f"with {found['headroom']:.0%} of HBM free: {found['largest_with_headroom']}", flush=True)


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

    A ``fit`` checkpoint carries its config: the architecture is always the checkpoint's, and its dataset, batch
    sizes, precision and eval settings are the defaults that options given here (other than their defaults) replace.

    Args:
        checkpoint: A weight file written by ``fit`` (``last.pth``/``best.pth``), an rfdetr checkpoint
            (``{"model", "args"}``) or a ``{"model": state_dict}`` file.
        output_dir: Where ``coco_eval.json`` (summary + per-class AP) and ``detections.json`` go; default
            ``<checkpoint dir>/eval_<checkpoint stem>_<split>``.
        model: Which RF-DETR to build, for checkpoints that do not record it (a ``fit`` checkpoint's wins).
        data: Dataset (``dataset_dir``) and batch size.
        optim: Unused (accepted so a training config can be passed as is).
        mesh: The device mesh.
        trainer: ``precision`` is used for the forward.
        eval: Split, eval batch size and detections per image.
        checkpointing: Unused (accepted so a training config can be passed as is).
    """
    choose_device(mesh)  # before eval.inference: its modules import rfdetr, which starts torch_xla
    from spmd_rfdetr.eval import inference  # lazy: a verb imports what it runs, after the device choice

    cfg = RunConfig(
        model=model, data=data, optim=optim, mesh=mesh, trainer=trainer, eval=eval, checkpointing=checkpointing
    )
    return inference.evaluate_checkpoint(cfg, checkpoint, output_dir).record()


def predict(
    checkpoint: str,
    images: str,
    output: str,
    threshold: float | None = None,
    save_images: str | None = None,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    optim: OptimOptions = OptimOptions(),
    mesh: MeshOptions = MeshOptions(),
    trainer: TrainerOptions = TrainerOptions(),
    eval: EvalOptions = EvalOptions(),
    checkpointing: CheckpointOptions = CheckpointOptions(),
) -> Path:
    """Detect objects in every image of a folder on the mesh and write COCO results JSON.

    The architecture, dataset (for category ids) and batch sizes come from a ``fit`` checkpoint as for ``validate``.

    Args:
        checkpoint: A weight file written by ``fit``, an rfdetr checkpoint or a ``{"model": state_dict}`` file.
        images: Folder of images (jpg/png/...); ids come from its ``_annotations.coco.json`` if present, else from
            the sorted file order (listed in ``<output stem>.images.json``).
        output: COCO results file to write: ``[{"image_id", "category_id", "category_name", "bbox": [x, y, w, h],
            "score"}]`` (+ ``segmentation`` for seg models, ``keypoints`` for the keypoint model).
        threshold: Keep the detections scoring >= this, in [0, 1] (rfdetr draws at 0.5); default: all
            ``eval.num_select`` per image, for COCO scoring.
        save_images: Folder for each image with its detections drawn by supervision (boxes, "name score" labels,
            masks, keypoints and the dataset's skeleton), same file names; drawn at ``--threshold``, else at 0.5.
        model: Which RF-DETR to build, for checkpoints that do not record it (a ``fit`` checkpoint's wins).
        data: ``dataset_dir`` gives the category ids and names (its train split's label mapping); batch size.
        optim: Unused (accepted so a training config can be passed as is).
        mesh: The device mesh.
        trainer: ``precision`` is used for the forward.
        eval: Eval batch size and detections per image.
        checkpointing: Unused (accepted so a training config can be passed as is).
    """
    from spmd_rfdetr.eval.draw import check_options  # lazy: a verb imports what it runs (this one: no XLA)

    check_options(threshold, save_images, images)  # before the device starts
    choose_device(mesh)  # before eval.inference: its modules import rfdetr, which starts torch_xla
    from spmd_rfdetr.eval import inference  # lazy: a verb imports what it runs, after the device choice

    cfg = RunConfig(
        model=model, data=data, optim=optim, mesh=mesh, trainer=trainer, eval=eval, checkpointing=checkpointing
    )
    return inference.predict(cfg, checkpoint, images, output, threshold, save_images)


def export(
    checkpoint: str,
    format: str = "onnx",
    output: str | None = None,
    batch_size: int = 1,
    dynamic_batch: bool = False,
    opset_version: int = 17,
    model: ModelOptions = ModelOptions(),
) -> Path:
    """Export a checkpoint with upstream rfdetr's own exporter (``RFDETR.export``), on the CPU (no XLA).

    Exits with status 2 and names the pip extra to install when the format's optional dependencies are missing.

    Args:
        checkpoint: A weight file written by ``fit`` (its architecture is used), an rfdetr checkpoint or a
            ``{"model": state_dict}`` file.
        format: rfdetr's export format: ``onnx`` (the ``rfdetr[onnx]`` extra), or another rfdetr knows (``tflite``,
            ``tensorrt``, ``openvino`` ..., each with the extra of its name).
        output: File to write; default: the checkpoint's path with the format's suffix (``best.onnx``).
        batch_size: Batch size baked into the exported graph.
        dynamic_batch: Export a dynamic batch dimension (formats that support it).
        opset_version: ONNX opset.
        model: Which RF-DETR to build, for checkpoints that do not record it (a ``fit`` checkpoint's wins).
    """
    # lazy: a verb imports what it runs, after quiet.configure and the device choice
    from spmd_rfdetr.model.export import MissingExportDependencies, export_checkpoint

    try:
        return export_checkpoint(checkpoint, format, output, model=model, batch_size=batch_size,
                                 dynamic_batch=dynamic_batch, opset_version=opset_version)
    except MissingExportDependencies as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


#: Errors the user fixes in the config, the data or a path: one message and exit status 2.
USER_ERRORS = (ConfigError, DataError, FileNotFoundError, ArgumentError)
DEBUG_ENV = "SPMD_RFDETR_DEBUG"
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


class _Parser(ArgumentParser):
    """jsonargparse's parser, raising its errors for :func:`main` to report instead of printing the whole usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("exit_on_error", False)
        super().__init__(*args, **kwargs)


def run_config(args: list[str]) -> RunConfig:
    """``fit``'s options (``--config`` YAML, ``--section.field=value``) read by the parser the CLI builds from
    :func:`fit`'s signature, without running it: what :func:`spmd_rfdetr.train` runs. Raises ``ArgumentError``."""
    parser = _Parser()
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_function_arguments(fit, as_positional=False)
    parsed = parser.instantiate_classes(parser.parse_args(args))
    return RunConfig(**{f.name: parsed[f.name] for f in dataclasses.fields(RunConfig)})


def main(args: list[str] | None = None) -> None:
    """Entry point of ``python -m spmd_rfdetr`` and the ``spmd-rfdetr`` script (see the module docstring for errors)."""
    argv = list(sys.argv[1:] if args is None else args)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    quiet.configure(verbose="--verbose" in argv)  # before torch_xla and rfdetr are imported
    argv = [a for a in argv if a not in ("--debug", "--verbose")]
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    verbs = {"fit": fit, "check-data": check_data, "validate": validate, "predict": predict, "export": export,
             "synth": synth, "plan": plan, "aot": aot}
    try:
        CLI(verbs, args=argv, as_positional=False, parser_class=_Parser)
        hosts.leave_hosts()  # several hosts: leave the gloo group together (gloo may abort at exit otherwise)
    except USER_ERRORS as error:
        if debug:
            traceback.print_exc()
        verb = next((a for a in argv if a in verbs), "")
        help_hint = f"python -m spmd_rfdetr {verb} --help".replace("  ", " ")
        print(f"error: {error}\n({help_hint} lists the options; --debug shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None
    except DoesNotFit as error:  # the TPU compiler's verdict on the config: the user lowers the batch
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except AotFailed as error:  # a crashed child, not the config's fault: its last lines, no traceback of ours
        print(f"aot: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except NonFiniteLoss as error:  # not the user's input: the run itself went bad; its checkpoints are intact
        if debug:
            traceback.print_exc()
        print(f"training stopped: {error}", file=sys.stderr)
        raise SystemExit(3) from None

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
from typing import Any, get_args

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
    Precision,
    RunConfig,
    TrainerOptions,
)
from spmd_rfdetr.config.recipes import listing as recipe_listing
from spmd_rfdetr.config.recipes import with_recipe_paths
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
    """Check the config and the dataset without starting XLA: every problem at once, each with its fix.

    Reads the splits ``fit`` would read (train, and ``eval.split`` when ``fit`` evaluates): each problem with its
    file, annotation and fix (what ``fit`` checks first).

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
    """Print each RF-DETR variant's weight, gradient, AdamW and EMA bytes per device on a mesh, without a device.

    The mesh is ``--mesh.data x --mesh.fsdp`` with the sharding rules ``fit`` applies: pick a mesh before renting
    one. Activations are not included (``aot`` compiles the whole step for a TPU).

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
    """Compile the programs ``fit`` runs for a TPU topology with the TPU compiler (libtpu), here: no TPU needed.

    The programs are the training step for each batch shape and the eval forward; libtpu comes with the ``aot``
    extra. Prints per program whether it fits, HBM per chip, FLOPs and bytes per step, a roofline time, collectives
    and compile time.

    Args:
        topology: TPU slice, ``<chip>:<shape>`` (``v5e:1x1``, ``v5e:2x4``, ``v6e:2x4``, ``v4:2x2x1``, ``v5p:2x2x1``,
            ``v3:2x2``) or a Cloud name (``v5litepod-8``, ``v3-8``).
        json: Also write the whole report (per program: memory, cost, collectives, largest byte movers) here.
        max_batch: Search ``data.per_device_batch_size`` for the largest training step that compiles (one compile
            per probe), and the largest that leaves ``headroom`` of HBM free.
        headroom: Fraction of HBM a recipe should leave free (``--max_batch``).
        keep: Keep the HLO modules and the compiler's results in this directory (default: a temporary one, removed
            after).
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


#: A training config's section that ``validate`` and ``predict`` accept (so a recipe passes as is) and do not read,
#: beyond ``trainer.precision``; their help shows it as one line, not every training option.
TrainingSection = dict[str, Any] | None


def _inference_run(model: ModelOptions, data: DataOptions, mesh: MeshOptions, eval: EvalOptions,
                   precision: Precision | None, trainer: TrainingSection) -> RunConfig:
    """The run config of ``validate``/``predict``: their own sections, ``precision`` (else a passed training config's
    ``trainer.precision``), the training-only sections at their defaults."""
    precision = precision or (trainer or {}).get("precision") or TrainerOptions.precision
    if precision not in get_args(Precision):
        raise ConfigError(f"trainer.precision={precision!r}: use one of {', '.join(get_args(Precision))}")
    return RunConfig(model=model, data=data, mesh=mesh, eval=eval, trainer=TrainerOptions(precision=precision))


def validate(
    checkpoint: str,
    output_dir: str | None = None,
    precision: Precision | None = None,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    mesh: MeshOptions = MeshOptions(),
    eval: EvalOptions = EvalOptions(),
    trainer: TrainingSection = None,
    optim: TrainingSection = None,
    checkpointing: TrainingSection = None,
) -> dict[str, float]:
    """COCO-evaluate a checkpoint on a dataset split on the mesh (one compiled eval program, pycocotools).

    A ``fit`` checkpoint carries its config: the architecture is always the checkpoint's, and its dataset, batch
    sizes, precision and eval settings are the defaults that options given here (other than their defaults) replace.

    Args:
        checkpoint: A weight file written by ``fit`` (``last.pth``/``best.pth``), an rfdetr checkpoint
            (``{"model", "args"}``) or a ``{"model": state_dict}`` file.
        output_dir: Where ``coco_eval.json`` (summary + per-class AP) and ``detections.json`` go; default
            ``<checkpoint dir>/eval_<checkpoint stem>_<split>``.
        precision: ``bf16`` or ``fp32`` for the forward; default: a ``--config``'s ``trainer.precision``, else the
            checkpoint's.
        model: Which RF-DETR to build, for checkpoints that do not record it (a ``fit`` checkpoint's wins).
        data: Dataset (``dataset_dir``) and batch size.
        mesh: The device mesh.
        eval: Split, eval batch size and detections per image.
        trainer: A training config's section, accepted so a recipe can be passed as is (only ``precision`` read).
        optim: A training config's section, accepted and not read.
        checkpointing: A training config's section, accepted and not read.
    """
    cfg = _inference_run(model, data, mesh, eval, precision, trainer)
    choose_device(mesh)  # before eval.inference: its modules import rfdetr, which starts torch_xla
    from spmd_rfdetr.eval import inference  # lazy: a verb imports what it runs, after the device choice

    return inference.evaluate_checkpoint(cfg, checkpoint, output_dir).record()


def predict(
    checkpoint: str,
    images: str,
    output: str,
    threshold: float | None = None,
    save_images: str | None = None,
    precision: Precision | None = None,
    model: ModelOptions = ModelOptions(),
    data: DataOptions = DataOptions(),
    mesh: MeshOptions = MeshOptions(),
    eval: EvalOptions = EvalOptions(),
    trainer: TrainingSection = None,
    optim: TrainingSection = None,
    checkpointing: TrainingSection = None,
) -> Path:
    """Detect objects in every image of a folder on the mesh: COCO results JSON, and the images drawn.

    The architecture, dataset (for category ids and names) and batch sizes come from a ``fit`` checkpoint as for
    ``validate``.

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
        precision: ``bf16`` or ``fp32`` for the forward; default: a ``--config``'s ``trainer.precision``, else the
            checkpoint's.
        model: Which RF-DETR to build, for checkpoints that do not record it (a ``fit`` checkpoint's wins).
        data: ``dataset_dir`` gives the category ids and names (its train split's label mapping); batch size.
        mesh: The device mesh.
        eval: Eval batch size and detections per image.
        trainer: A training config's section, accepted so a recipe can be passed as is (only ``precision`` read).
        optim: A training config's section, accepted and not read.
        checkpointing: A training config's section, accepted and not read.
    """
    from spmd_rfdetr.eval.draw import check_options  # lazy: a verb imports what it runs (this one: no XLA)

    check_options(threshold, save_images, images)  # before the device starts
    cfg = _inference_run(model, data, mesh, eval, precision, trainer)
    choose_device(mesh)  # before eval.inference: its modules import rfdetr, which starts torch_xla
    from spmd_rfdetr.eval import inference  # lazy: a verb imports what it runs, after the device choice

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
    """Export a checkpoint with rfdetr's own exporter (ONNX and rfdetr's other formats), on the CPU.

    Runs upstream's ``RFDETR.export`` on the checkpoint's weights (no XLA).

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


def recipes() -> None:
    """List the shipped recipes (``fit --config NAME`` reads one from any directory), with what each trains.

    A recipe is a YAML config for one kind of hardware (mesh, per-chip batch, precision, resolution, epochs,
    evaluation, LR); options after ``--config`` override it, and a copy you edit works as ``--config my.yaml``.
    """
    print(recipe_listing(), flush=True)


#: Errors the user fixes in the config, the data or a path: one message and exit status 2.
USER_ERRORS = (ConfigError, DataError, FileNotFoundError, ArgumentError)
DEBUG_ENV = "SPMD_RFDETR_DEBUG"
PROG = "python -m spmd_rfdetr"
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


class _Parser(ArgumentParser):
    """jsonargparse's parser, raising its errors for :func:`main` to report instead of printing the whole usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("exit_on_error", False)
        super().__init__(*args, **kwargs)


def _underscored(arg: str) -> str:
    """``--max-batch`` as ``--max_batch``: every option is spelled with underscores, and a dash is read as one."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return "--" + name[2:].replace("-", "_") + sep + value


def run_config(args: list[str]) -> RunConfig:
    """``fit``'s options (``--config`` YAML, ``--section.field=value``) read by the parser the CLI builds from
    :func:`fit`'s signature, without running it: what :func:`spmd_rfdetr.train` runs. Raises ``ArgumentError``."""
    parser = _Parser()
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_function_arguments(fit, as_positional=False)
    parsed = parser.instantiate_classes(parser.parse_args(with_recipe_paths(args)))
    return RunConfig(**{f.name: parsed[f.name] for f in dataclasses.fields(RunConfig)})


def main(args: list[str] | None = None) -> None:
    """Entry point of ``python -m spmd_rfdetr`` and the ``spmd-rfdetr`` script (see the module docstring for errors)."""
    argv = list(sys.argv[1:] if args is None else args)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    quiet.configure(verbose="--verbose" in argv)  # before torch_xla and rfdetr are imported
    argv = [a for a in argv if a not in ("--debug", "--verbose")]
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    verbs = {"fit": fit, "check-data": check_data, "validate": validate, "predict": predict, "export": export,
             "synth": synth, "plan": plan, "aot": aot, "recipes": recipes}
    try:
        argv = with_recipe_paths([_underscored(a) for a in argv])  # a shipped recipe by name, from any directory
        CLI(verbs, args=argv, as_positional=False, parser_class=_Parser, prog=PROG,
            description="Train RF-DETR on TPUs: one process drives the whole SPMD device mesh. "
                        f"`{PROG} VERB --help` documents each verb; `{PROG} recipes` lists the shipped recipes.")
        hosts.leave_hosts()  # several hosts: leave the gloo group together (gloo may abort at exit otherwise)
    except USER_ERRORS as error:
        if debug:
            traceback.print_exc()
        verb = next((a for a in argv if a in verbs), "")
        help_hint = f"{PROG} {verb} --help".replace("  ", " ")
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

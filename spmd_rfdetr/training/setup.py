"""``fit``'s start-up: everything that runs once before step 1, in this order.

:func:`prepare`: the config checked against the devices, the resume point, the starting weights, the data check
(every data problem at once, before anything is built or compiled), rfdetr's configs, the splits, what every weight file
carries, Fabric on the mesh, the run's length in steps, ``config.yaml``. Then, once the trainer is built and resumed:
:func:`evaluation` (``None`` when off), :func:`train_data` (the loader from the resumed step, started; in replay mode
each multi-scale bucket's step compiled before step 1).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch_xla.runtime as xr
import yaml

from spmd_rfdetr.config.options import ConfigError, RunConfig, is_keypoint, is_segmentation
from spmd_rfdetr.config.length import eval_every_steps, evaluates_in_fit, log_eval_share, size_in_steps
from spmd_rfdetr.config.resolve import (fetch_pretrain_weights, multi_scale_buckets, resolve_and_check, scale_lr,
                                        upstream_scales)
from spmd_rfdetr.data.batches import blank_batch, first_uses, make_train_loader
from spmd_rfdetr.data.check import check_data
from spmd_rfdetr.data.splits import build_eval_split, build_split, check_overflow, class_names, num_classes_in
from spmd_rfdetr.model.upstream import UpstreamConfigs, upstream_configs
from spmd_rfdetr.model.weights import rfdetr_entries
from spmd_rfdetr.training import checkpoint
from spmd_rfdetr.training.build import Trainer, unwrap
from spmd_rfdetr.training.evaluation import FitEvaluation, fit_evaluation
from spmd_rfdetr.training.metrics import wandb_login_problem
from spmd_rfdetr.training.step import TrainStep
from spmd_rfdetr.xla import hosts
from spmd_rfdetr.xla.fabric import spmd_fabric
from spmd_rfdetr.xla.mesh import build_mesh
from spmd_rfdetr.xla.runtime import PRECISIONS

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What start-up resolved for one ``fit``."""

    cfg: RunConfig
    out: Path
    resume_from: str | Path | None
    check_s: float  # the data check's seconds
    fabric: Any
    cfgs: UpstreamConfigs
    train_set: Any
    eval_set: Any  # ``eval.split`` when ``fit`` evaluates, else None
    resolved: dict[str, Any]  # the config as run (``config.yaml``, every checkpoint's ``config``)
    weight_file_entries: dict[str, Any]  # what every weight file carries besides its weights and step: the config,
    # the class names by training label and rfdetr's own entries

    @property
    def coordinator(self) -> bool:
        """Several hosts: host 0 writes the shared files."""
        return hosts.is_coordinator()

    @property
    def build_cfgs(self) -> UpstreamConfigs:
        """What the model is built from: a resumed run's checkpoint holds every weight, so none are loaded."""
        return self.cfgs.without_weights() if self.resume_from else self.cfgs


def check_output_dir_shared(out: Path) -> None:
    """On several hosts ``trainer.output_dir`` must be one directory they all write: each host writes its shards of
    every checkpoint there and host 0 publishes it, and ``resume auto`` must find the same checkpoint on each. A
    directory of each VM's own would leave every checkpoint incomplete, silently: a ConfigError instead."""
    if hosts.process_count() == 1:
        return
    out.mkdir(parents=True, exist_ok=True)
    if not hosts.shared_by_all_hosts(out):
        raise ConfigError(f"trainer.output_dir: {out} is not one directory of all {hosts.process_count()} hosts (each "
                          "VM has its own): every host writes its part of each checkpoint there, so host 0's "
                          "checkpoints would be incomplete. Set trainer.output_dir to a directory every host mounts "
                          "(Filestore/NFS, or a gcsfuse bucket).")


def prepare(cfg: RunConfig) -> Run:
    """Check, size and lay out the run before anything is built (``setup_runtime`` has run)."""
    resolve_and_check(cfg, xr.global_runtime_device_count())
    scale_lr(cfg)  # the global batch is known now; config.yaml and every checkpoint record the LR trained with
    t, d = cfg.trainer, cfg.data
    if "wandb" in t.loggers:  # the coordinator logs: its credentials, before the weights, the data check, the build
        problem = hosts.from_coordinator(lambda: (wandb_login_problem() or "").encode()).decode()
        if problem:
            raise ConfigError(problem)
    out = Path(t.output_dir)
    check_output_dir_shared(out)  # before resume picks a checkpoint: every host must find the same one
    resume_from = checkpoint.latest(out) if t.resume == "auto" else t.resume
    if resume_from:  # the checkpoint holds every weight: the starting weights are neither fetched nor loaded
        log.info("resuming from %s: model.pretrain_weights is not read", resume_from)
    else:
        fetch_pretrain_weights(cfg.model)  # on disk (downloaded now if published) or a ConfigError, before compiles
    check_start = time.perf_counter()
    data_report = check_data(cfg)  # every data problem at once, before anything is built or compiled (DataError)
    check_s = time.perf_counter() - check_start

    out.mkdir(parents=True, exist_ok=True)
    num_classes = cfg.model.num_classes or num_classes_in(d.dataset_dir, is_keypoint(cfg.model.variant))
    cfgs = upstream_configs(cfg.model, d, cfg.optim, num_classes, cfg.eval.num_select)
    train_set = data_report.usable(build_split(cfgs, "train"), "train")  # less the images data.on_bad=skip leaves out
    check_overflow(train_set, d, "train")
    eval_set = build_eval_split(cfgs, cfg.eval.split) if evaluates_in_fit(cfg) else None
    names = class_names(train_set, num_classes)
    upstream_entries = rfdetr_entries(cfgs.model, cfg.model.variant, names)
    fabric = spmd_fabric(build_mesh(cfg.mesh.data, cfg.mesh.fsdp), precision=PRECISIONS[t.precision])
    fabric.seed_everything(t.seed)
    hosts.check_same_on_all_hosts(f"{d.dataset_dir}: the number of usable train images", len(train_set))
    size_in_steps(cfg, len(train_set))  # rfdetr's epochs as steps; an epoch without a step is a ConfigError
    resolved = dataclasses.asdict(cfg)
    resolved["model"]["num_classes"] = num_classes
    if cfgs.model.use_grouppose_keypoints:  # as read from the dataset: a weight file rebuilds the model without it
        resolved["model"]["num_keypoints_per_class"] = list(cfgs.model.num_keypoints_per_class)
    if hosts.is_coordinator():
        (out / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    entries = {"config": resolved, "class_names": names, **upstream_entries}
    return Run(cfg, out, resume_from, check_s, fabric, cfgs, train_set, eval_set, resolved, entries)


@dataclass
class TrainData:
    """The train loader from the resumed step, and its multi-scale buckets."""

    loader: Any  # Fabric's wrapper
    spmd_loader: Any  # the SPMD loader under it: its counters (``wait_s``) and ``place`` live here
    buckets: list[int]
    warmup: int  # the steps that may compile (replay checks at step 2; a trace mode's buckets at their first step)
    read_at: int  # the train split's image size
    batches: Iterator[dict[str, Any]] = iter(())  # :meth:`start` starts them

    def __next__(self) -> dict[str, Any]:
        return next(self.batches)

    def start(self) -> None:
        """Start the loader's workers (after the bucket compiles)."""
        self.batches = iter(self.loader)

    def check_ahead(self, step_fn: TrainStep) -> None:
        """Replay's pending check traces the next step now, before an evaluation can change what it traces."""
        upcoming = next(self)
        step_fn.check_ahead(upcoming)
        self.batches = itertools.chain([upcoming], self.batches)


def train_data(run: Run, step_fn: TrainStep, start: int) -> TrainData:
    """The loader of the steps after ``start``, started; in replay mode every multi-scale bucket's step compiles
    first, from a blank batch of its shape."""
    cfg, d = run.cfg, run.cfg.data
    buckets, warmup = multi_scale_buckets(cfg), 2
    if buckets and step_fn.mode != "replay":
        first = first_uses(buckets, start, cfg.trainer.max_steps)
        warmup = max(2, max(first.values()) - start + 1)
        log.info("multi-scale: buckets %s; each compiles its training graph at its first step: %s", buckets,
                 ", ".join(f"{size} at step {step}" for size, step in sorted(first.items(), key=lambda kv: kv[1])))
    read_at = max(upstream_scales(cfg.model)) if buckets else run.cfgs.model.resolution
    fabric = run.fabric
    fabric.strategy.prefetch = d.prefetch
    fabric.strategy.sync_each_batch = False  # every step mode runs its own programs
    share = hosts.batch_share()  # (this host, hosts): each host loads its rows of every global batch
    loader = fabric.setup_dataloaders(make_train_loader(run.train_set, d, read_at, seed=cfg.trainer.seed,
                                                        start_step=start, host=share, scales=buckets))
    # Fabric's wrapper copied the loader's attributes once; its counters live in the loader under it
    data = TrainData(loader, loader._dataloader, buckets, warmup, read_at)
    if buckets and step_fn.mode == "replay":
        rows, masks = d.global_batch_size // share[1], is_segmentation(cfg.model.variant)

        def blank(size: int) -> dict[str, Any]:
            return data.spmd_loader.place(blank_batch(rows, size, d.max_targets, read_at, masks=masks,
                                                      keypoints=run.cfgs.keypoints_per_target))

        precompile_buckets(step_fn, buckets, blank)
    data.start()
    return data


def precompile_buckets(step_fn: TrainStep, buckets: list[int], batch_of: Callable[[int], dict[str, Any]]) -> None:
    """Compile the training step for every multi-scale bucket before step 1 (one line each), so no step compiles."""
    log.info("multi-scale: compiling the training step for %d buckets before step 1: %s", len(buckets), buckets)
    for i, size in enumerate(buckets, 1):
        started = time.perf_counter()
        if not step_fn.precompile(batch_of(size)) and step_fn.mode != "replay":
            log.info("multi-scale: the other buckets compile at their first step (%s)", step_fn.fallback_reason)
            return
        log.info("multi-scale: compiled %d px (%d/%d) in %.0f s", size, i, len(buckets), time.perf_counter() - started)


def evaluation(run: Run, trainer: Trainer, meta: dict[str, Any]) -> FitEvaluation | None:
    """The evaluation inside ``fit`` (``None`` when off), its best mAP and early stopping's counts as ``meta`` left
    them."""
    cfg = run.cfg
    eval_every = eval_every_steps(cfg, len(run.train_set))
    if run.eval_set is not None:
        log_eval_share(cfg, len(run.train_set), len(run.eval_set))
    raw = unwrap(trainer.model) if trainer.ema is not None and cfg.eval.base_model else None  # rfdetr's eval_base_model
    evaluation = fit_evaluation(cfg, run.cfgs, trainer.inference_model, run.fabric, run.eval_set, eval_every, raw)
    if evaluation is not None:
        evaluation.restore(meta)
        if run.resume_from:
            log.info("resumed the evaluation state: best %s %g; early stopping watches %s: best %g, %d "
                     "evaluation(s) without improvement", evaluation.metric, evaluation.best_map, evaluation.watched,
                     evaluation.stopping_best, evaluation.stale)
    return evaluation

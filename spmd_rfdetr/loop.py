"""``fit``: config -> mesh + Fabric -> static sharded batches -> rfdetr model -> one compiled step -> log/checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import yaml

from spmd_rfdetr.checks import check_data
from spmd_rfdetr.config import RunConfig, resolve_and_check
from spmd_rfdetr.runtime import PRECISIONS, setup_runtime

log = logging.getLogger(__name__)


def fit(cfg: RunConfig) -> Path:
    """Train for ``trainer.max_steps`` steps; returns the path of the final checkpoint (``last.pth``)."""
    setup_runtime(cfg.mesh)
    import torch_xla.runtime as xr

    resolve_and_check(cfg, xr.global_runtime_device_count())
    data_report = check_data(cfg)  # every data problem at once, before anything is built or compiled (DataError)

    import torch_xla.core.xla_model as xm

    from spmd_rfdetr.build import build_trainer
    from spmd_rfdetr.data import build_split, check_overflow, forever, make_loader, num_classes_in
    from spmd_rfdetr.evaluate import fit_evaluation
    from spmd_rfdetr.fabric import spmd_fabric
    from spmd_rfdetr.mesh import build_mesh
    from spmd_rfdetr.metrics import MetricsLog
    from spmd_rfdetr.model import upstream_configs

    t, d = cfg.trainer, cfg.data
    out = Path(t.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    fabric = spmd_fabric(build_mesh(cfg.mesh.data), precision=PRECISIONS[t.precision])
    fabric.seed_everything(t.seed)

    num_classes = cfg.model.num_classes or num_classes_in(d.dataset_dir)
    cfgs = upstream_configs(cfg.model, d, cfg.optim, num_classes)
    train_set = data_report.usable(build_split(cfgs, "train"), "train")  # less the images data.on_bad=skip leaves out
    check_overflow(train_set, d, "train")
    fabric.strategy.prefetch = d.prefetch
    loader = fabric.setup_dataloaders(make_loader(train_set, d, cfgs.model.resolution, train=True, seed=t.seed))
    spmd_loader = loader._dataloader  # Fabric's wrapper copied the loader's attributes once; its counters live here

    trainer = build_trainer(fabric, cfgs, cfg.optim, t)
    net, optimizer, step_fn = trainer.model, trainer.optimizer, trainer.step

    resolved = dataclasses.asdict(cfg)
    resolved["model"]["num_classes"] = num_classes
    (out / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    metrics = MetricsLog(out, t.max_steps, t.progress_bar)
    evaluation = fit_evaluation(cfg, cfgs, net, fabric)  # every eval.every_steps steps and at the end; None if off
    batches = forever(loader)
    window_start, window_steps, wait_start = time.perf_counter(), 0, spmd_loader.wait_s
    for step in range(1, t.max_steps + 1):
        stats = step_fn(next(batches))
        window_steps += 1
        metrics.after_step(step)
        eval_now = evaluation is not None and evaluation.due(step, t.max_steps)  # an eval step is also a log point
        if step == 1 or step % t.log_every == 0 or step == t.max_steps or eval_now:
            values = step_fn.read(stats)
            xm.wait_device_ops()  # replayed steps run asynchronously: let the counters below see every one finish
            elapsed = time.perf_counter() - window_start
            record = {
                "step": step,
                **values,
                "images_per_sec": window_steps * d.global_batch_size / elapsed,
                "step_time_s": elapsed / window_steps,
                "data_wait_s": spmd_loader.wait_s - wait_start,  # the loop waited for batches
                "step_mode": step_fn.mode,
                "step_traces": step_fn.traces,  # how often the step's Python ran (replay: 2 per run)
            }
            if eval_now:
                record.update(evaluation(step))
                if evaluation.improved:
                    best = {"model": net, "optimizer": optimizer, "step": step, "config": resolved}
                    fabric.save(out / "best.pth", best)
                    log.info("saved %s (eval/mAP %.4f)", out / "best.pth", evaluation.best_map)
            metrics.write(record)
            window_start, window_steps, wait_start = time.perf_counter(), 0, spmd_loader.wait_s

    checkpoint = out / "last.pth"
    fabric.save(checkpoint, {"model": net, "optimizer": optimizer, "step": t.max_steps, "config": resolved})
    log.info("saved %s", checkpoint)
    return checkpoint

"""Checkpoints: the full training state for resuming, and the plain weight files users and rfdetr load.

- **Training state** (``<output_dir>/checkpoints/step_XXXXXXXX/``): every device tensor the step updates (model, AdamW
  state, learning rates, schedule and EMA counters, EMA weights) by name, written with
  ``torch.distributed.checkpoint`` and torch_xla's SPMD planners (each shard is written once, from the host that holds
  it, and loaded back in place into tensors of the same sharding), plus ``meta.json`` (step, data position, best mAP,
  config). Written under a temporary name and published by renaming the directory, so a save killed half way never
  hides the previous checkpoint: :func:`latest` skips the leftover with a warning.
- **Lineage**: a run that starts at step ``s`` (fresh: 0; resumed from an older checkpoint: a rollback) trains a new
  branch. The checkpoints and weight files of later steps, the abandoned branch's, are moved aside into
  ``checkpoints/abandoned/`` (:func:`set_aside_later`, named in a warning), so pruning and ``--trainer.resume auto``
  see the branch being trained only, and the newest save (a SIGTERM's) is never pruned.
- **Weights** (``last.pth``, ``best.pth``): ``torch.load``-able dicts ``{"model": state_dict, "config", "step",
  "class_names"}`` whose ``model`` is what was evaluated (the EMA weights when EMA is on, as rfdetr's best-total
  checkpoint), plus ``"ema": {"decay", "tau", "updates"}`` then.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch_xla
import torch_xla.core.xla_model as xm
from torch.distributed.checkpoint.planner import WriteItemType
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner

from spmd_rfdetr.config.options import ConfigError
from spmd_rfdetr.training.build import Trainer, unwrap
from spmd_rfdetr.xla import hosts
from spmd_rfdetr.xla.lazy_state import replicate_unannotated

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
#: Where :func:`set_aside_later` moves an abandoned branch's checkpoints and weight files (inside ``checkpoints/``).
ABANDONED = "abandoned"
#: The weight files a run writes in its output directory (each records the step of its weights).
WEIGHT_FILES = ("last.pth", "best.pth")
_NAME = re.compile(r"^step_(\d{8})$")
_META = "meta.json"
#: A save slower than this warns: a spot VM's preemption notice is about 30 s.
SLOW_SAVE_S = 20
#: Seconds to pause before publishing a save (a test kills the process inside that window).
_PAUSE_ENV = "SPMD_RFDETR_TEST_PAUSE_BEFORE_PUBLISH_S"


def training_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every device tensor of a run, by a stable name: ``model.*``, ``optim.<param>.<state>``, ``optim.group<i>.<key>``
    (tensor hyper-parameters such as a device learning rate), ``schedule.*``, ``step.*`` (the step's counters) and,
    with EMA, ``ema.*``."""
    model = unwrap(trainer.model)
    state = dict(model.state_dict(keep_vars=True).items())
    state = {f"model.{name}": tensor for name, tensor in state.items()}
    names = {id(p): name for name, p in model.named_parameters()}
    for i, group in enumerate(trainer.optimizer.param_groups):
        state.update({f"optim.group{i}.{k}": v for k, v in group.items() if isinstance(v, torch.Tensor)})
        for p in group["params"]:
            per_param = trainer.optimizer.state.get(p, {})
            state.update({f"optim.{names[id(p)]}.{k}": v for k, v in per_param.items() if isinstance(v, torch.Tensor)})
    state.update({f"schedule.{i}": t for i, t in enumerate(trainer.schedule.tensors())})
    state.update({f"step.{i}": t for i, t in enumerate(trainer.step.counters())})
    if trainer.ema is not None:
        state.update({f"ema.{k}": v for k, v in trainer.ema.module.state_dict(keep_vars=True).items()})
        state["ema.updates"] = trainer.ema.updates
    return state  # the live objects (no detached aliases: a held alias of a parameter is a tensor replay cannot see)


def save(output_dir: str | Path, step: int, state: dict[str, torch.Tensor], meta: dict[str, Any], keep: int) -> Path:
    """Write ``state`` and ``meta`` as ``checkpoints/step_<step>``, atomically; keep the newest ``keep``."""
    root = Path(output_dir) / CHECKPOINTS
    final = root / f"step_{step:08d}"
    partial = root / f".{final.name}.partial"
    if hosts.is_coordinator():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    hosts.barrier()
    torch_xla.sync()
    started = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial)), planner=_save_planner())
    hosts.barrier()  # several hosts: every host's shards are written before the coordinator publishes
    if hosts.is_coordinator():
        (partial / _META).write_text(json.dumps({**meta, "step": step}, indent=1, default=str))
        pause = float(os.environ.get(_PAUSE_ENV, 0))
        if pause:
            log.warning("pausing %.1f s before publishing %s (%s)", pause, final, _PAUSE_ENV)
            time.sleep(pause)
        if final.exists():  # a re-run of the same step (e.g. SIGTERM right after a periodic save)
            shutil.rmtree(final)
        os.replace(partial, final)  # the publish: one rename
        took = time.perf_counter() - started
        log.info("saved %s (%.1f s)", final, took)
        if took > SLOW_SAVE_S:
            log.warning("saving took %.1f s, more than %g s: a preempted spot VM gets about 30 s of notice, so a save "
                        "on SIGTERM may not finish. Save to a faster disk (trainer.output_dir) or shard the weights "
                        "(mesh.fsdp).", took, SLOW_SAVE_S)
        for old in sorted(complete(root))[:-keep] if keep > 0 else []:
            if old != final:  # the save just made is kept whatever keep says (e.g. a SIGTERM's)
                shutil.rmtree(old, ignore_errors=True)
    hosts.barrier()
    return final


def _save_planner() -> Any:
    """torch_xla's ``SPMDSavePlanner`` writing each distinct shard once. A tensor split along ``fsdp`` and replicated
    along ``data`` has identical local shards; torch_xla 2.9's de-duplication (``MetadataIndex`` compares without its
    shard index) removes every copy of such a shard within one process, so the tensor silently vanished from the
    checkpoint (measured)."""
    class DistinctShards(SPMDSavePlanner):
        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            seen, items = set(), []
            for item in plan.items:
                key = (item.index.fqn, tuple(item.index.offset or ()))
                if item.type == WriteItemType.SHARD and key in seen:
                    continue
                seen.add(key)
                items.append(item)
            return dataclasses.replace(plan, items=items)

    return DistinctShards()


def complete(root: Path) -> list[Path]:
    """Published checkpoint directories under ``root`` (oldest first)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _NAME.match(p.name) and (p / _META).is_file() and (p / ".metadata").is_file())


def latest(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run; interrupted saves are named in a warning and skipped."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    good = complete(root)
    for entry in sorted(root.iterdir()):
        if entry not in good and entry.name != ABANDONED:
            log.warning("skipping %s: an interrupted or incomplete checkpoint save (safe to delete)", entry)
    return good[-1] if good else None


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json`` (its step, the evaluation's counts, the config), without loading any tensor."""
    return json.loads((Path(path) / _META).read_text())


def weight_file_step(path: Path) -> int | None:
    """The step of the weights in a weight file (``None``: no such file, or one without a step)."""
    if not path.is_file():
        return None
    step = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("step")
    return int(step) if step is not None else None


def set_aside_later(output_dir: str | Path, step: int) -> Path | None:
    """Move the checkpoints and weight files of steps after ``step`` (an abandoned branch: a rollback, or a fresh
    start in a used ``output_dir``) into ``checkpoints/abandoned/<time>-from-step_<step>/``; returns that folder
    (``None``: nothing was later). Host 0 moves them; every host waits for it."""
    root, out = Path(output_dir) / CHECKPOINTS, Path(output_dir)
    aside = root / ABANDONED / f"{time.strftime('%Y%m%d-%H%M%S')}-from-step_{step:08d}"
    if hosts.is_coordinator():
        later = [p for p in complete(root) if int(p.name.split("_")[1]) > step]
        later += [out / name for name in WEIGHT_FILES if (weight_file_step(out / name) or -1) > step]
        if later:
            aside.mkdir(parents=True, exist_ok=True)
            for path in later:
                os.replace(path, aside / path.name)
            log.warning("this run trains from step %d: %s of a later step (an abandoned branch: a rollback, or an "
                        "earlier run in this output_dir) moved to %s, so that --trainer.resume auto continues this "
                        "run; delete that folder when you no longer need it", step,
                        ", ".join(p.name for p in later), aside)
    hosts.barrier()
    return aside if aside.is_dir() else None


def load(path: str | Path, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Load a checkpoint into ``state``'s tensors (each keeps its sharding); returns its ``meta``.

    Sharded tensors are loaded shard by shard in place (torch_xla's SPMD planner). Replicated ones are read on the
    host and uploaded as fresh device data, as the tensors of a fresh run are: loaded in place, through the detached
    alias ``torch.distributed.checkpoint`` writes to, they traced a different graph at the step after the resume than
    at the one after it (an extra ``split`` node), so the replayed step's check refused replay (measured, torch_xla 2.9).
    """
    path = Path(path)
    if not (path / _META).is_file() or not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete spmd_rfdetr checkpoint (no {_META} or .metadata)")
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing, unexpected = sorted(set(state) - set(stored)), sorted(set(stored) - set(state))
    if missing or unexpected:
        raise ConfigError(
            f"trainer.resume: {path} does not match this run's training state (a different model, optimizer or EMA setting?): "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    torch_xla.sync()
    sharded = {k: t for k, t in state.items() if _is_sharded(t)}
    if sharded:
        dcp.load(sharded, storage_reader=dcp.FileSystemReader(str(path)), planner=SPMDLoadPlanner())
    whole = {k: t for k, t in state.items() if k not in sharded}
    host = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in whole.items()}
    dcp.load(host, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    for name, tensor in whole.items():
        fresh = xm.send_cpu_data_to_device(host[name], tensor.device)[0] if tensor.device.type == "xla" else host[name]
        tensor.data = fresh.to(tensor.dtype)
    replicate_unannotated([t for t in whole.values() if t.device.type == "xla"])  # as the fresh run's state
    torch_xla.sync()
    return json.loads((path / _META).read_text())


def _is_sharded(tensor: torch.Tensor) -> bool:
    if tensor.device.type != "xla":
        return False
    spec = torch_xla._XLAC._get_xla_sharding_spec(tensor)
    return bool(spec) and "replicated" not in spec


def save_weights(path: str | Path, weights: torch.nn.Module, meta: dict[str, Any]) -> Path:
    """Write a plain ``torch.load`` weight file (CPU tensors) via a temporary name, then publish it (host 0 only)."""
    torch_xla.sync()
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    state = {k: v.cpu() for k, v in weights.state_dict().items()}  # on every host: any gather runs everywhere
    if hosts.is_coordinator():
        torch.save({"model": state, **meta}, partial)
        os.replace(partial, path)
    return path

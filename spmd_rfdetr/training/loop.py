"""``fit``: config -> mesh + Fabric -> static sharded batches -> rfdetr model -> one compiled step -> log/checkpoint.

Long runs:
- Preemption: SIGTERM (what a spot/preemptible TPU VM gets before it goes) finishes the step in flight, saves a full
  checkpoint (:mod:`spmd_rfdetr.training.checkpoint`) and exits 0 with one line: ``stopped by SIGTERM after step N: saved ...``.
- Resume (``trainer.resume``: ``auto``, the newest complete checkpoint in ``output_dir`` or else a fresh start; or a
  path): the data order continues exactly, since the batch of each step is a pure function of ``trainer.seed`` and
  the step (a seeded permutation per epoch, every sample's augmentations seeded from (seed, epoch, index):
  :mod:`spmd_rfdetr.data.batches`), whatever ``num_workers`` is. ``metrics.jsonl`` drops the records the interrupted run wrote
  after its checkpoint, so every step is there once. Tested: a real SIGTERM, a SIGKILL inside a save, two resumes:
  every step is logged once, the steps after each resume equal the uninterrupted run's (<= 1e-6), and the resumed
  step is replayed after its one compile. Later steps are not compared on the CPU mesh: XLA's CPU client itself
  computes a gradient an ulp apart now and then between two identical runs (no resume involved), and the test fit's
  large learning rate amplifies that chaotically (measured 2e-5 by step 40 in one pair, 4e-4 by step 13 in another).
  ``pytest -m tpu`` checks a resumed fit bit for bit on a chip.
- Non-finite steps (:mod:`spmd_rfdetr.training.step` keeps their weights unchanged): ``trainer.on_nonfinite=stop`` stops at the
  next log or checkpoint point naming the steps (exit status 3; the newest checkpoint has finite weights);
  ``skip_step`` goes on and counts them (``nonfinite_steps``). Tested with a real NaN batch at step 5 of a real
  ``fit`` (fault injection: ``SPMD_RFDETR_TEST_NAN_BATCH=5``).
- ``fit``'s own host time per step is measured against the benchmark's in ``benchmarks/README.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

import yaml

from spmd_rfdetr.training import checkpoint
from spmd_rfdetr.xla import hosts
from spmd_rfdetr.data.check import check_data
from spmd_rfdetr.config.options import RunConfig, is_segmentation
from spmd_rfdetr.config.resolve import (eval_every_steps, fetch_pretrain_weights, multi_scale_buckets, resolve_and_check,
                                 steps_per_epoch, upstream_scales)
from spmd_rfdetr.xla.runtime import PRECISIONS, setup_runtime

if TYPE_CHECKING:
    from spmd_rfdetr.training.step import TrainStep

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """Training stopped: a step's loss or gradient norm was NaN/inf (``trainer.on_nonfinite=stop``)."""


#: Fault injection for tests: the loop sends its own process a real SIGTERM right after dispatching this step.
SIGTERM_AT_STEP_ENV = "SPMD_RFDETR_TEST_SIGTERM_AT_STEP"

#: The loop warns once when it waited for batches longer than this share of the time since the last log point.
DATA_BOUND_SHARE = 0.10


def fit(cfg: RunConfig) -> Path:
    """Train to ``trainer.max_steps`` (resuming if asked); returns the path of ``last.pth``, or of the checkpoint
    saved when SIGTERM stopped the run early. SIGTERM before the first step is done exits at once (:class:`Preemption`)."""
    hint = f"Start it again (--trainer.resume auto continues from the newest checkpoint in {cfg.trainer.output_dir})."
    with Preemption(hint) as preemption:
        return _train(cfg, preemption, started=time.perf_counter())


def _train(cfg: RunConfig, preemption: Preemption, started: float) -> Path:
    setup_runtime(cfg.mesh, cfg.trainer.compile_cache_dir)
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    resolve_and_check(cfg, xr.global_runtime_device_count())
    t, d = cfg.trainer, cfg.data
    out = Path(t.output_dir)
    resume_from = checkpoint.latest(out) if t.resume == "auto" else t.resume
    if resume_from:  # the checkpoint holds every weight: the starting weights are neither fetched nor loaded
        log.info("resuming from %s: model.pretrain_weights is not read", resume_from)
    else:
        fetch_pretrain_weights(cfg.model)  # on disk (downloaded now if published) or a ConfigError, before compiles
    check_start = time.perf_counter()
    data_report = check_data(cfg)  # every data problem at once, before anything is built or compiled (DataError)
    check_s = time.perf_counter() - check_start

    from spmd_rfdetr.training.build import build_trainer, unwrap
    from spmd_rfdetr.data.batches import blank_batch, first_uses, make_train_loader
    from spmd_rfdetr.data.splits import build_split, check_overflow, class_names, num_classes_in
    from spmd_rfdetr.training.evaluation import fit_evaluation
    from spmd_rfdetr.xla.fabric import spmd_fabric
    from spmd_rfdetr.xla.mesh import build_mesh
    from spmd_rfdetr.training.metrics import MetricsLog, build_loggers, execute_seconds
    from spmd_rfdetr.model.upstream import upstream_configs
    from spmd_rfdetr.model.weights import rfdetr_entries

    out.mkdir(parents=True, exist_ok=True)
    fabric = spmd_fabric(build_mesh(cfg.mesh.data, cfg.mesh.fsdp), precision=PRECISIONS[t.precision])
    fabric.seed_everything(t.seed)

    num_classes = cfg.model.num_classes or num_classes_in(d.dataset_dir)
    cfgs = upstream_configs(cfg.model, d, cfg.optim, num_classes, cfg.eval.num_select)
    train_set = data_report.usable(build_split(cfgs, "train"), "train")  # less the images data.on_bad=skip leaves out
    check_overflow(train_set, d, "train")
    hosts.check_same_on_all_hosts(f"{d.dataset_dir}: the number of usable train images", len(train_set))
    if t.epochs is not None:  # rfdetr's unit: whole passes over the train split (the last partial batch dropped)
        t.max_steps = max(1, round(t.epochs * steps_per_epoch(cfg, len(train_set))))
        log.info("trainer.epochs=%g: %d steps of %d images over %d train images", t.epochs, t.max_steps,
                 d.global_batch_size, len(train_set))
    if cfg.optim.warmup_epochs is not None:  # rfdetr's warmup unit
        cfg.optim.warmup_steps = round(cfg.optim.warmup_epochs * steps_per_epoch(cfg, len(train_set)))
        log.info("optim.warmup_epochs=%g: %d warmup steps", cfg.optim.warmup_epochs, cfg.optim.warmup_steps)
    built = cfgs.without_weights() if resume_from else cfgs  # (the checkpoint's weights replace them)
    trainer = build_trainer(fabric, built, cfg.optim, t, ema=cfg.model, mesh=cfg.mesh)
    step_fn = trainer.step
    meta = checkpoint.load(resume_from, checkpoint.training_state(trainer)) if resume_from else {"step": 0}
    start = meta["step"]
    if resume_from:
        log.info("resumed from %s at step %d", resume_from, start)

    buckets, warmup = multi_scale_buckets(cfg), 2  # warm-up: the steps that may compile (replay checks at step 2)
    if buckets and step_fn.mode != "replay":
        first = first_uses(buckets, start, t.max_steps)
        warmup = max(2, max(first.values()) - start + 1)
        log.info("multi-scale: buckets %s; each compiles its training graph at its first step: %s", buckets,
                 ", ".join(f"{size} at step {step}" for size, step in sorted(first.items(), key=lambda kv: kv[1])))
    read_at = max(upstream_scales(cfg.model)) if buckets else cfgs.model.resolution  # the train split's image size
    fabric.strategy.prefetch = d.prefetch
    fabric.strategy.sync_each_batch = False  # every step mode runs its own programs
    loader = fabric.setup_dataloaders(make_train_loader(train_set, d, read_at, seed=t.seed, start_step=start,
                                                        host=hosts.batch_share(), scales=buckets))
    spmd_loader = loader._dataloader  # Fabric's wrapper copied the loader's attributes once; its counters live here

    resolved = dataclasses.asdict(cfg)
    resolved["model"]["num_classes"] = num_classes
    if hosts.is_coordinator():
        (out / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    names = class_names(train_set, num_classes)

    def save_weights(path: Path, step: int) -> Path:
        meta = {"config": resolved, "step": step, "class_names": names, "weights": weights,
                **rfdetr_entries(cfgs.model, cfg.model.variant, names)}  # rfdetr's RFDETR.from_checkpoint reads these
        if trainer.ema is not None:
            meta["ema"] = {"decay": trainer.ema.decay, "tau": trainer.ema.tau, "updates": step}
        return checkpoint.save_weights(path, trainer.inference_model, meta)

    coordinator = hosts.is_coordinator()  # several hosts: host 0 writes the shared files
    metrics = MetricsLog(out, t.max_steps, t.progress_bar, warmup, start_step=start, writes_file=coordinator,
                         loggers=build_loggers(t.loggers, out) if coordinator else [])
    eval_every = eval_every_steps(cfg, len(train_set))
    if cfg.eval.every_epochs is not None:
        log.info("eval.every_epochs=%g: an evaluation every %d steps (%d steps per epoch)", cfg.eval.every_epochs,
                 eval_every, steps_per_epoch(cfg, len(train_set)))
    raw = unwrap(trainer.model) if trainer.ema is not None and cfg.eval.base_model else None  # rfdetr's eval_base_model
    evaluation = fit_evaluation(cfg, cfgs, trainer.inference_model, fabric, eval_every, raw)  # None if off
    if evaluation is not None:
        evaluation.restore(meta)  # best mAP and early stopping's counts, as the checkpoint left them
        if resume_from:
            log.info("resumed the evaluation state: best eval/mAP %g; early stopping watches %s: best %g, %d "
                     "evaluation(s) without improvement", evaluation.best_map, evaluation.watched,
                     evaluation.stopping_best, evaluation.stale)
    weights = "ema" if trainer.ema is not None else "raw"
    every = cfg.checkpointing.every_steps

    def save_state(step: int, **extra: Any) -> Path:
        kept = evaluation.state() if evaluation is not None else {"best_map": None}
        state = checkpoint.training_state(trainer)
        return checkpoint.save(out, step, state, {**kept, "config": resolved, **extra}, cfg.checkpointing.keep)

    if meta.get("early_stopped"):  # a relaunch (--trainer.resume auto) of a run that stopped early trains no more
        log.info("%s: this run stopped early at step %d (early stopping); nothing left to train", resume_from, start)
        metrics.close()
        return save_weights(out / "last.pth", start)

    if buckets and step_fn.mode == "replay":
        precompile_buckets(step_fn, buckets, lambda size: spmd_loader.place(
            blank_batch(d.global_batch_size // hosts.batch_share()[1], size, d.max_targets, read_at,
                        masks=is_segmentation(cfg.model.variant))))
    batches = iter(loader)
    window_start, window_steps, wait_start, nonfinite_seen = time.perf_counter(), 0, spmd_loader.wait_s, 0
    executed_start = execute_seconds()
    ready_s = window_start - started  # start-up: runtime, data check, build, loader, bucket compiles
    host_s = 0.0  # the loop's own time outside log points, waits for batches included
    sigterm_at = int(os.environ.get(SIGTERM_AT_STEP_ENV, "0"))
    for step in range(start + 1, t.max_steps + 1):
        iteration_start = time.perf_counter()
        stats = step_fn(next(batches))
        window_steps += 1
        if step == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # fault injection (SIGTERM_AT_STEP_ENV): a real signal, now
        stop = hosts.any_host(preemption.requested)  # a SIGTERM on one host stops them all at this step
        # a pending stop saves at once: the notice (~30 s on a spot VM) is shorter than an evaluation
        eval_now = not stop and evaluation is not None and evaluation.due(step, t.max_steps)
        if eval_now and step_fn.check_pending and step < t.max_steps:  # e.g. a resumed run's first step
            upcoming = next(batches)
            step_fn.check_ahead(upcoming)  # replay's check traces the next step before the evaluation can change it
            batches = itertools.chain([upcoming], batches)
        save_now = stop or (every > 0 and step % every == 0)
        host_s += time.perf_counter() - iteration_start
        warming_up = step <= start + 2  # replay's two traces: each a log point, so its compiles are told apart
        if warming_up or step % t.log_every == 0 or step == t.max_steps or eval_now or save_now:
            metrics.check_counters(first=step - window_steps + 1, last=step)  # at log points only: not per step
            values = step_fn.read(stats)
            xm.wait_device_ops()  # replayed steps run asynchronously: let the counters below see every one finish
            elapsed = time.perf_counter() - window_start
            waited, executed = spmd_loader.wait_s - wait_start, execute_seconds() - executed_start
            record = {
                "step": step,
                **values,
                "images_per_sec": window_steps * d.global_batch_size / elapsed,
                "step_time_s": elapsed / window_steps,
                "data_wait_s": waited,  # the loop waited for batches
                # what the host adds per step that graph execution does not hide (benchmarks/: "outside graph
                # execution"); None where executions overlap it (a TPU runs them while the host traces the next)
                "outside_execution_s": ((elapsed - waited - executed) / window_steps
                                        if executed <= elapsed - waited else None),
                # the host's time per step in the loop, not waiting for batches: the step's dispatch (replay: its
                # program launched, not run) and the loop's bookkeeping; benchmarks/ times the dispatch alone
                "host_s": (host_s - waited) / window_steps,
                "step_mode": step_fn.mode,
                "step_traces": step_fn.traces,  # how often the step's Python ran (replay: 2 per run)
            }
            if step == start + 1:
                preemption.first_step_done()  # from here SIGTERM saves
                record["time_to_first_step_s"] = time.perf_counter() - started
                log.info("step %d done %.1f s after the start (start-up %.1f s, of which the data check %.1f s; "
                         "the first step %.1f s)", step, record["time_to_first_step_s"], ready_s,
                         check_s, elapsed)
            elif not warming_up and record["data_wait_s"] > DATA_BOUND_SHARE * elapsed:
                metrics.warn_once("data_bound", f"steps {step - window_steps + 1}..{step}: the loop waited for "
                                  f"batches {record['data_wait_s']:.1f} s of {elapsed:.1f} s: the input pipeline is "
                                  f"slower than the device. Raise data.num_workers (now {d.num_workers}) or "
                                  "data.prefetch, or use a host with more cores.")
            problem = _nonfinite(values, nonfinite_seen, first_in_window=step - window_steps + 1, step=step)
            nonfinite_seen = int(values["nonfinite_steps"])
            if problem and t.on_nonfinite == "stop":
                metrics.write(record)
                metrics.close()
                raise NonFiniteLoss(f"{problem}. Training stopped (trainer.on_nonfinite=stop); the newest "
                                    f"checkpoint in {out / checkpoint.CHECKPOINTS} has finite weights. Lower the "
                                    "learning rate or check the data, then --trainer.resume auto.")
            if problem:
                log.warning("%s (trainer.on_nonfinite=skip_step)", problem)
            if eval_now:
                record.update(evaluation(step), evaluated_weights=weights)
                if evaluation.improved:
                    save_weights(out / "best.pth", step)
                    log.info("saved %s (eval/mAP %.4f)", out / "best.pth", evaluation.best_map)
                if evaluation.should_stop:
                    log.info("early stopping at step %d: %s has not improved by %g for %d evaluations (best "
                             "%.4f)", step, evaluation.watched, cfg.eval.early_stopping_min_delta, evaluation.stale,
                             evaluation.stopping_best)
                    record["early_stopped"] = True
                    save_state(step, early_stopped=True)  # a relaunch with --trainer.resume auto ends here too
                    metrics.write(record)
                    last_step = step
                    break
            if save_now:
                saved = save_state(step)
            if eval_now or save_now:
                xm.wait_device_ops()  # an execution they started (e.g. the eval's weight refresh) counts as theirs
            metrics.write(record)  # after the save: its own device->host copies are not the next step's
            if stop:
                metrics.close()
                print(f"stopped by SIGTERM after step {step}: saved {saved}; continue with --trainer.resume auto",
                      flush=True)
                return saved
            window_start, window_steps, wait_start = time.perf_counter(), 0, spmd_loader.wait_s
            executed_start, host_s = execute_seconds(), 0.0

    else:
        last_step = t.max_steps
    metrics.close()
    last = save_weights(out / "last.pth", last_step)
    log.info("saved %s (%s weights)", last, weights)
    return last


def precompile_buckets(step_fn: TrainStep, buckets: list[int], batch_of: Callable[[int], dict[str, Any]]) -> None:
    """Compile the training step for every multi-scale bucket before step 1 (one line each), so no step compiles."""
    log.info("multi-scale: compiling the training step for %d buckets before step 1: %s", len(buckets), buckets)
    for i, size in enumerate(buckets, 1):
        started = time.perf_counter()
        if not step_fn.precompile(batch_of(size)) and step_fn.mode != "replay":
            log.info("multi-scale: the other buckets compile at their first step (%s)", step_fn.fallback_reason)
            return
        log.info("multi-scale: compiled %d px (%d/%d) in %.0f s", size, i, len(buckets), time.perf_counter() - started)


def _nonfinite(values: dict[str, float], seen: int, *, first_in_window: int, step: int) -> str:
    """What the step counters say about non-finite steps since the last log point ('' if there were none)."""
    count = int(values["nonfinite_steps"]) - seen
    if count <= 0:
        return ""
    first = int(values["first_nonfinite_step"])
    return (f"non-finite loss or gradient at {count} step(s) in steps {max(first, first_in_window)}..{step} (the "
            f"first one in this run: step {first}); those updates were not applied")


class Preemption:
    """SIGTERM (what a spot/preemptible TPU VM gets, about 30 s before it stops) while ``fit`` runs.

    Until :meth:`first_step_done` there is nothing to save (start-up, the data check, the first step's compile, which
    takes minutes): SIGTERM ends the process at once with a message and exit code 143. That works while XLA compiles
    too: Python runs signal handlers only between the main thread's bytecodes, so a thread woken by
    ``signal.set_wakeup_fd`` ends it. After the first step SIGTERM only sets :attr:`requested`: the loop finishes the
    current step, saves and returns. The previous handler and wakeup fd are restored on exit.
    """

    EXIT_CODE = 128 + signal.SIGTERM

    def __init__(self, resume_hint: str = "") -> None:
        self.requested = False
        self.saves = False  # False: SIGTERM exits at once (nothing to save yet)
        self.resume_hint = resume_hint
        self._exiting = threading.Lock()

    def first_step_done(self) -> None:
        """From now on SIGTERM saves a checkpoint after the current step."""
        self.saves = True

    def _exit_now(self) -> None:
        if self._exiting.acquire(blocking=False):
            print(f"SIGTERM before the first step finished: nothing to save, exiting now. {self.resume_hint}",
                  file=sys.stderr, flush=True)
            os._exit(self.EXIT_CODE)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.saves:
            self._exit_now()
        self.requested = True
        log.warning("SIGTERM received: finishing the current step, then saving a checkpoint")

    def _watch(self, read_fd: int) -> None:
        """Thread body: wake on every signal byte; SIGTERM before the first step exits even mid-compile."""
        with open(read_fd, "rb", buffering=0) as wakeups:
            while data := wakeups.read(64):  # b"": the write end was closed (__exit__)
                if signal.SIGTERM in data and not self.saves:
                    self._exit_now()

    def __enter__(self) -> Preemption:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="sigterm-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(signal.SIGTERM, self._previous)
        os.close(self._write_fd)  # the watcher reads EOF and ends

"""The loop's log points: when one is due, its ``metrics.jsonl`` record, the messages about start-up and the input
pipeline, and the non-finite check (``trainer.on_nonfinite``: stop, or warn and go on)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch_xla.core.xla_model as xm

from spmd_rfdetr.training import checkpoint
from spmd_rfdetr.training.metrics import MetricsLog, build_loggers, execute_seconds
from spmd_rfdetr.training.setup import Run, TrainData
from spmd_rfdetr.training.step import TrainStep
from spmd_rfdetr.training.stops import NonFiniteLoss, Preemption
from spmd_rfdetr.xla import hosts

log = logging.getLogger(__name__)

#: The loop warns once when it waited for batches longer than this share of the time since the last log point.
DATA_BOUND_SHARE = 0.10


class StepLog:
    """The records of one run: each covers the steps since the previous log point (its window)."""

    def __init__(self, run: Run, step_fn: TrainStep, preemption: Preemption, start: int, started: float,
                 meta: dict[str, Any] | None = None) -> None:
        t = run.cfg.trainer
        loggers: list[Any] = []

        def start_loggers() -> bytes:  # the coordinator's; should one fail to start (wandb.init), every host raises
            loggers.extend(build_loggers(t.loggers, run.out, wandb_project=t.wandb_project, wandb_run=t.wandb_run,
                                         config=run.resolved))
            return b""

        hosts.from_coordinator(start_loggers)
        # from here the XLA counters count toward the first record (the bucket compiles before step 1 too)
        self.metrics = MetricsLog(run.out, t.max_steps, t.progress_bar, start_step=start, writes_file=run.coordinator,
                                  loggers=loggers)
        self.run, self.step_fn, self.preemption = run, step_fn, preemption
        self.start, self.started = start, started
        self.nonfinite_seen = int((meta or {}).get("nonfinite_steps", 0))  # the resumed run's: the device counts on

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the records' counts (the non-finite steps already reported)."""
        return {"nonfinite_steps": self.nonfinite_seen}

    def amend(self, step: int, values: dict[str, Any]) -> None:
        """Add ``values`` (a late evaluation's) to the record of ``step``."""
        self.metrics.amend(step, values)

    def open(self, data: TrainData) -> None:
        """Start the first window, after start-up (runtime, data check, build, loader, bucket compiles); ``data``'s
        loader counts the waits for batches, its warm-up steps may compile."""
        self.loader = data.spmd_loader
        self.metrics.warmup_steps = self.start + data.warmup
        self.next_window()
        self.ready_s = self.window_start - self.started

    def next_window(self) -> None:
        self.window_start, self.window_steps, self.wait_start = time.perf_counter(), 0, self.loader.wait_s
        self.executed_start, self.host_s = execute_seconds(), 0.0  # host_s: the loop's own time, waits included

    def begin(self) -> None:
        """A step starts (the loop's own host time counts from here)."""
        self.iteration_start = time.perf_counter()
        self.window_steps += 1

    def due(self, step: int, *, evaluates: bool, saves: bool) -> bool:
        """Whether ``step`` is a log point; ends the step's host time."""
        self.host_s += time.perf_counter() - self.iteration_start
        t = self.run.cfg.trainer
        warming_up = step <= self.start + 2  # replay's two traces: each a log point, so its compiles are told apart
        return warming_up or step % t.log_every == 0 or step == t.max_steps or evaluates or saves

    def record(self, step: int, stats: Any) -> dict[str, Any]:
        """The window's record; raises :class:`NonFiniteLoss` (``trainer.on_nonfinite=stop``) after writing it."""
        self.metrics.check_counters(first=step - self.window_steps + 1, last=step)  # at log points only: not per step
        values = self.step_fn.read(stats)
        xm.wait_device_ops()  # replayed steps run asynchronously: let the counters below see every one finish
        elapsed = time.perf_counter() - self.window_start
        waited, executed = self.loader.wait_s - self.wait_start, execute_seconds() - self.executed_start
        steps, d = self.window_steps, self.run.cfg.data
        record = {
            "step": step,
            **values,
            "images_per_sec": steps * d.global_batch_size / elapsed,
            "step_time_s": elapsed / steps,
            "data_wait_s": waited,  # the loop waited for batches
            # what the host adds per step that graph execution does not hide (benchmarks/: "outside graph
            # execution"); None where executions overlap it (a TPU runs them while the host traces the next)
            "outside_execution_s": (elapsed - waited - executed) / steps if executed <= elapsed - waited else None,
            # the host's time per step in the loop, not waiting for batches: the step's dispatch (replay: its
            # program launched, not run) and the loop's bookkeeping; benchmarks/ times the dispatch alone
            "host_s": (self.host_s - waited) / steps,
            "step_mode": self.step_fn.mode,
            "step_traces": self.step_fn.traces,  # how often the step's Python ran (replay: 2 per run)
        }
        if step == self.start + 1:
            self.preemption.first_step_done()  # from here SIGTERM saves
            record["time_to_first_step_s"] = time.perf_counter() - self.started
            log.info("step %d done %.1f s after the start (start-up %.1f s, of which the data check %.1f s; "
                     "the first step %.1f s)", step, record["time_to_first_step_s"], self.ready_s,
                     self.run.check_s, elapsed)
        elif step > self.start + 2 and waited > DATA_BOUND_SHARE * elapsed:
            self.metrics.warn_once("data_bound", f"steps {step - steps + 1}..{step}: the loop waited for "
                                   f"batches {waited:.1f} s of {elapsed:.1f} s: the input pipeline is "
                                   f"slower than the device. Raise data.num_workers (now {d.num_workers}) or "
                                   "data.prefetch, or use a host with more cores.")
        self._check_finite(values, step, record)
        return record

    def _check_finite(self, values: dict[str, float], step: int, record: dict[str, Any]) -> None:
        problem = _nonfinite(values, self.nonfinite_seen, first_in_window=step - self.window_steps + 1, step=step)
        self.nonfinite_seen = int(values["nonfinite_steps"])
        if problem and self.run.cfg.trainer.on_nonfinite == "stop":
            self.metrics.write(record)
            self.metrics.close("failed")
            raise NonFiniteLoss(f"{problem}. Training stopped (trainer.on_nonfinite=stop); the newest checkpoint in "
                                f"{self.run.out / checkpoint.CHECKPOINTS} has finite weights. Lower the learning "
                                "rate or check the data, then --trainer.resume auto.")
        if problem:
            log.warning("%s (trainer.on_nonfinite=skip_step)", problem)

    def write(self, record: dict[str, Any], *, wait: bool = False) -> None:
        """Write the window's record (after ``wait``: the device ops an evaluation or a save started) and open the
        next window."""
        if wait:
            xm.wait_device_ops()  # an execution they started (e.g. the eval's weight refresh) counts as theirs
        self.metrics.write(record)  # after the save: its own device->host copies are not the next step's
        self.next_window()

    def close(self) -> None:
        self.metrics.close()


def _nonfinite(values: dict[str, float], seen: int, *, first_in_window: int, step: int) -> str:
    """What the step counters say about non-finite steps since the last log point ('' if there were none)."""
    count = int(values["nonfinite_steps"]) - seen
    if count <= 0:
        return ""
    first = int(values["first_nonfinite_step"])
    return (f"non-finite loss or gradient at {count} step(s) in steps {max(first, first_in_window)}..{step} (the "
            f"first one in this run: step {first}); those updates were not applied")

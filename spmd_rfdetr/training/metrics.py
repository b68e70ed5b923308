"""What a run reports: torch_xla's deterministic counters, ``metrics.jsonl`` and the console progress line."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch_xla.debug.metrics as met

from spmd_rfdetr.config.options import ConfigError

log = logging.getLogger(__name__)


def xla_counters() -> dict[str, int]:
    """Cumulative torch_xla counters: compilations, graph executions, device->host transfers, CPU fallbacks."""

    def samples(metric: str) -> int:
        data = met.metric_data(metric)
        return int(data[0]) if data else 0

    return {
        "xla_compiles": samples("CompileTime"),
        "xla_cache_loads": met.counter_value("PersistentCacheHit") or 0,  # graphs read from the persistent cache
        "xla_cache_misses": met.counter_value("PersistentCacheMiss") or 0,  # ... and not found there (compiled)
        "xla_executions": samples("ExecuteReplicatedTime") + samples("ExecuteTime"),
        "xla_transfers_to_host": samples("TransferFromDeviceTime"),
        "xla_aten_fallbacks": sum(met.counter_value(name) or 0 for name in met.counter_names() if name.startswith("aten::")),
    }


def execute_seconds() -> float:
    """Seconds torch_xla has spent executing graphs so far (its ``ExecuteTime``/``ExecuteReplicatedTime`` sums)."""
    total = 0.0
    for name in ("ExecuteTime", "ExecuteReplicatedTime"):
        data = met.metric_data(name)
        total += float(data[1]) / 1e9 if data else 0.0
    return total


def aten_fallbacks() -> dict[str, int]:
    """Ops that fell back to the CPU (``aten::*`` counters), by name."""
    return {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::") and met.counter_value(n)}


class MetricsLog:
    """Appends one JSON object per log point to ``<output_dir>/metrics.jsonl`` and prints a progress line/bar.

    Also checks the counters at every log point (:meth:`check_counters`): a line whenever XLA compiled, and one
    warning each for a compile and for a device->host transfer outside a log point after ``warmup_steps`` (both cost
    a TPU dearly; in warm-up the replayed step checks its second trace against the first, which reads the graph's
    constants once).

    A resumed run (``start_step`` > 0) keeps the records up to ``start_step`` and drops later ones (the interrupted run
    wrote them after its checkpoint; they are trained again), so every step is in the file once. ``loggers`` (Fabric
    loggers, :func:`build_loggers`) get every numeric field of every record too.
    """

    def __init__(
        self, output_dir: str | Path, max_steps: int, progress_bar: bool | None = None, warmup_steps: int = 2,
        *, start_step: int = 0, loggers: Sequence[Any] = (), writes_file: bool = True,
    ) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.writes_file = writes_file  # several hosts: only the coordinator writes the file
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if writes_file:
            self._keep_until(start_step)
        self.max_steps = max_steps
        self.warmup_steps = start_step + warmup_steps
        self.loggers = list(loggers)
        self.bar = sys.stderr.isatty() if progress_bar is None else progress_bar
        self._seen = xla_counters()
        self._compiles_at_last_record = self._seen["xla_compiles"]
        self._warned: set[str] = set()

    def check_counters(self, first: int, last: int) -> None:
        """At a log point, before its read-back: report the compilations, host transfers and CPU fallbacks of steps
        ``first..last`` (the counters are read here only, not every step: reading them costs host time)."""
        now = xla_counters()
        steps = f"step {last}" if first == last else f"steps {first}..{last}"
        new_compiles = now["xla_compiles"] - self._seen["xla_compiles"]
        if new_compiles:
            data = met.metric_data("CompileTime")
            total_s = data[1] / 1e9 if data else float("nan")
            self._print(f"{steps}: XLA compiled {new_compiles} new graph(s) ({now['xla_compiles']} in total, {total_s:.1f} s compiling so far)")
            if first > self.warmup_steps:
                self.warn_once(
                    "recompile",
                    f"{steps}: XLA compiled a new graph after warm-up; something changed shape or a Python value "
                    "baked into the graph changed. Rerun with PT_XLA_DEBUG_LEVEL=2 to print the cause.",
                )
        if first > self.warmup_steps and now["xla_transfers_to_host"] > self._seen["xla_transfers_to_host"]:
            self.warn_once(
                "transfer",
                f"{steps}: {now['xla_transfers_to_host'] - self._seen['xla_transfers_to_host']} device->host "
                "transfer(s) outside a log point; each one stalls the device. Rerun with PT_XLA_DEBUG_LEVEL=2 to see where.",
            )
        if now["xla_aten_fallbacks"] > self._seen["xla_aten_fallbacks"]:
            self.warn_once("fallback", f"{steps}: ops fell back to the CPU: {aten_fallbacks()}")
        self._seen = now

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (plus the cumulative XLA counters) and show it; call after reading the step's stats."""
        counters = xla_counters()
        self._seen = counters  # the log point's own read-back is expected
        new_compiles = counters["xla_compiles"] - self._compiles_at_last_record
        self._compiles_at_last_record = counters["xla_compiles"]
        record = {**record, **counters, "xla_new_compiles": new_compiles, "time": time.time()}
        if self.writes_file:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        numeric = {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        for logger in self.loggers:
            logger.log_metrics(numeric, step=record["step"])
        step = record["step"]
        line = f"step {step}/{self.max_steps}  loss {record['loss']:.4f}  {record['images_per_sec']:.1f} img/s"
        if step < self.max_steps and step > self.warmup_steps:  # the warm-up's windows hold the compiles
            line += f"  ETA {_duration((self.max_steps - step) * record['step_time_s'])}"
        if self.bar:
            done = int(30 * step / self.max_steps)
            line = f"[{'#' * done}{'.' * (30 - done)}] " + line
        self._print(line)

    def amend(self, step: int, values: dict[str, Any]) -> None:
        """Merge ``values`` into the record of ``step`` (appended if there is none), and send them to the loggers."""
        if self.writes_file:
            records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()] \
                if self.path.exists() else []
            matching = [r for r in records if r["step"] == step]
            for record in matching:
                record.update(values)
            if not matching:
                records.append({"step": step, **values})
            self.path.write_text("".join(json.dumps(r) + "\n" for r in records))
        numeric = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        for logger in self.loggers:
            logger.log_metrics(numeric, step=step)

    def close(self, status: str = "success") -> None:
        """Flush and close the extra loggers (``status``: ``success``, or ``failed`` when the run stops on an error)."""
        for logger in self.loggers:
            logger.finalize(status)

    def _keep_until(self, step: int) -> None:
        if not self.path.exists():
            return
        if step == 0:
            log.info("metrics.jsonl: replacing the file of an earlier run in this output_dir (a fresh start)")
            self.path.unlink()
            return
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if json.loads(line)["step"] <= step]
        if len(kept) < len(lines):
            log.info("metrics.jsonl: dropped %d record(s) after step %d (trained again after the resume)",
                     len(lines) - len(kept), step)
        self.path.write_text("".join(line + "\n" for line in kept))

    def warn_once(self, kind: str, message: str) -> None:
        """Log ``message`` as a warning the first time ``kind`` happens in this run."""
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)

    @staticmethod
    def _print(line: str) -> None:
        print(line, file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``: time left, as a progress line says it."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def build_loggers(names: Sequence[str], output_dir: str | Path, *, wandb_project: str = "spmd_rfdetr",
                  wandb_run: str | None = None, config: dict[str, Any] | None = None) -> list[Any]:
    """The extra loggers by name, writing under ``<output_dir>/logs``: Lightning Fabric's ``tensorboard`` and ``csv``;
    ``wandb``: a W&B run (Lightning's ``WandbLogger``) in project ``wandb_project`` named ``wandb_run`` (``None``: the
    output directory's name) with ``config`` as its config, started here: an error (no API key, no network) comes
    before anything compiles, as a :class:`~spmd_rfdetr.config.options.ConfigError`."""
    # lazy: tensorboard's and wandb's imports only when asked for
    from lightning_fabric.loggers import CSVLogger, TensorBoardLogger

    logs = Path(output_dir) / "logs"
    kinds = {"tensorboard": TensorBoardLogger, "csv": CSVLogger}
    loggers = []
    for name in names:
        if name == "wandb":
            loggers.append(WandbRun(logs, wandb_project, wandb_run or Path(output_dir).resolve().name, config))
        else:
            loggers.append(kinds[name](root_dir=str(logs), name=name))
    return loggers


def wandb_login_problem() -> str | None:
    """Why ``trainer.loggers: [wandb]`` cannot log here (``None``: it can): online without credentials. Never prompts:
    wandb itself would ask for a key on a terminal (after start-up) and raise in a process without one."""
    import wandb  # lazy: only for loggers: [wandb]

    settings = wandb.setup().settings  # WANDB_MODE, or the mode `wandb offline` / `wandb disabled` saved
    if settings._offline or settings._noop or wandb.login(prompt=False, verify=False):
        return None
    return ("trainer.loggers: wandb has no API key in this process (online mode): run `wandb login` once on this "
            "machine, or set WANDB_API_KEY; or set WANDB_MODE=offline to write the W&B run under output_dir/logs/wandb "
            "and upload it later with `wandb sync`; or leave wandb out of trainer.loggers")


class WandbRun:
    """One W&B run through Lightning's ``WandbLogger`` (its ``log_metrics``, each record's ``step`` as the
    ``trainer/global_step`` axis). :meth:`finalize` also finishes the W&B run, which ``WandbLogger.finalize`` leaves
    open (Lightning's Trainer relies on wandb's exit hook): its files are complete when ``fit`` returns, and another
    ``fit`` in this process starts a run of its own instead of reusing this one."""

    def __init__(self, save_dir: Path, project: str, name: str, config: dict[str, Any] | None) -> None:
        import wandb  # lazy: only for loggers: [wandb]
        from pytorch_lightning.loggers import WandbLogger  # lazy: as wandb

        save_dir.mkdir(parents=True, exist_ok=True)
        self.logger = WandbLogger(name=name, project=project, save_dir=str(save_dir), config=config)
        self.logger._wandb_init.pop("anonymous", None)  # Lightning always passes it; wandb 0.31 warns it does nothing
        try:
            self.logger.experiment  # wandb.init now, not at the first record (after the first step's compile)
        except wandb.errors.Error as error:
            raise ConfigError(f"trainer.loggers: wandb could not start a run ({type(error).__name__}: {error}); "
                              "check `wandb login` / WANDB_API_KEY and the network, or set WANDB_MODE=offline") from error

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logger.log_metrics(metrics, step=step)

    def finalize(self, status: str) -> None:
        self.logger.finalize(status)
        self.logger.experiment.finish(exit_code=0 if status == "success" else 1)

"""What a run reports: torch_xla's deterministic counters, ``metrics.jsonl`` and the console progress line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch_xla.debug.metrics as met


def xla_counters() -> dict[str, int]:
    """Cumulative torch_xla counters: compilations, graph executions, device->host transfers, CPU fallbacks."""

    def samples(metric: str) -> int:
        data = met.metric_data(metric)
        return int(data[0]) if data else 0

    return {
        "xla_compiles": samples("CompileTime"),
        "xla_executions": samples("ExecuteReplicatedTime") + samples("ExecuteTime"),
        "xla_transfers_to_host": samples("TransferFromDeviceTime"),
        "xla_aten_fallbacks": sum(met.counter_value(name) or 0 for name in met.counter_names() if name.startswith("aten::")),
    }


def aten_fallbacks() -> dict[str, int]:
    """Ops that fell back to the CPU (``aten::*`` counters), by name."""
    return {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::") and met.counter_value(n)}


class MetricsLog:
    """Appends one JSON object per log point to ``<output_dir>/metrics.jsonl`` and prints a progress line/bar."""

    def __init__(self, output_dir: str | Path, max_steps: int, progress_bar: bool | None = None) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_steps = max_steps
        self.bar = sys.stderr.isatty() if progress_bar is None else progress_bar
        self._compiles_seen = xla_counters()["xla_compiles"]

    def note_compiles(self, step: int) -> int:
        """Print a line when XLA compiled new graphs since the last call; returns how many."""
        compiles = xla_counters()["xla_compiles"]
        new = compiles - self._compiles_seen
        if new:
            data = met.metric_data("CompileTime")
            seconds = data[1] / 1e9 if data else float("nan")
            self._print(f"step {step}: XLA compiled {new} new graph(s) ({compiles} in total, {seconds:.1f} s compiling so far)")
            self._compiles_seen = compiles
        return new

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (plus the cumulative XLA counters) and show it."""
        record = {**record, **xla_counters(), "time": time.time()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        line = f"step {step}/{self.max_steps}  loss {record['loss']:.4f}  {record['images_per_sec']:.1f} img/s"
        if self.bar:
            done = int(30 * step / self.max_steps)
            line = f"[{'#' * done}{'.' * (30 - done)}] " + line
        self._print(line)

    @staticmethod
    def _print(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

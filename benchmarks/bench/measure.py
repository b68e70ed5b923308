"""Inside a child: timing, torch_xla counters, per-run statistics, device, FLOPs, memory and environment."""

from __future__ import annotations

import copy
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from .config import DEVICES_PER_CHIP, PEAK_BF16_TFLOPS


class Counters:
    """Cumulative torch_xla metrics (counts and nanosecond sums) read between steps."""

    TIMES = {"compile": ("CompileTime",), "execute": ("ExecuteTime", "ExecuteReplicatedTime"),
             "transfer": ("TransferFromDeviceTime",)}

    def read(self) -> dict[str, float]:
        import torch_xla.debug.metrics as met

        out: dict[str, float] = {}
        for key, names in self.TIMES.items():
            count, total = 0, 0.0
            for name in names:
                data = met.metric_data(name)
                if data:
                    count, total = count + int(data[0]), total + float(data[1])
            out[f"{key}s"], out[f"{key}_s"] = count, total / 1e9
        out["aten_fallbacks"] = sum(met.counter_value(n) or 0 for n in met.counter_names() if n.startswith("aten::"))
        return out

    @staticmethod
    def fallback_names() -> dict[str, int]:
        import torch_xla.debug.metrics as met

        return {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::") and met.counter_value(n)}


class PythonTraces:
    """Counts the times the step's Python ran the model's forward (a forward pre-hook: Python only, no graph op).

    Lazy tracing runs it on every call; a replayed step runs it only when it traces."""

    def __init__(self, model: Any) -> None:
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def __call__(self) -> int:
        return self.count


def timed_steps(step_fn: Any, batches: list[Any], warmup: int, steps: int, label: str,
                traces: Callable[[], int] | None = None) -> tuple[list[dict], list[Any], dict[str, float]]:
    """Run warmup + steps calls of ``step_fn``, each timed alone: host time until it returns, wall time until the
    device is idle again (``wait_device_ops`` transfers nothing). Then ``steps`` more back to back; returns (per-step
    records, outputs, the back-to-back run: seconds and counter deltas per step). ``traces`` (a cumulative count of
    the step's Python runs) adds ``python_traces`` to each record."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    counters = Counters()
    torch_xla.sync()
    xm.wait_device_ops()
    records, outputs = [], []
    for i in range(warmup + steps):
        before, traces_before = counters.read(), traces() if traces else 0
        t0 = time.perf_counter()
        out = step_fn(batches[i % len(batches)])
        t1 = time.perf_counter()
        xm.wait_device_ops()
        t2 = time.perf_counter()
        after = counters.read()
        rec = {"step": i + 1, "warmup": i < warmup, "host_s": t1 - t0, "step_s": t2 - t0}
        rec.update({k: after[k] - before[k] for k in after})
        if traces:
            rec["python_traces"] = traces() - traces_before
        records.append(rec)
        outputs.append(out)
        print(f"[bench] {label} step {i + 1}/{warmup + steps}{' (warm-up)' if i < warmup else ''}: "
              f"{rec['step_s']:.3f} s (host {rec['host_s']:.3f} s), {rec['compiles']} compile(s), "
              f"{rec['executes']} graph(s), {rec['transfers']} transfer(s)", file=sys.stderr, flush=True)
    # As a training loop runs them: `steps` more calls back to back, one wait at the end. Where the runtime allows it,
    # tracing step k+1 overlaps executing step k (a side that syncs with the host inside its step cannot overlap).
    before, traces_before = counters.read(), traces() if traces else 0
    t0 = time.perf_counter()
    for i in range(steps):
        step_fn(batches[i % len(batches)])
    xm.wait_device_ops()
    loop_s = (time.perf_counter() - t0) / steps
    after = counters.read()
    loop = {"step_s": loop_s, **{k: (after[k] - before[k]) / steps for k in after}}
    if traces:
        loop["python_traces"] = (traces() - traces_before) / steps
    print(f"[bench] {label}: {steps} steps back to back: {loop_s:.3f} s/step, XLA execute {loop['execute_s']:.3f} "
          f"s/step", file=sys.stderr, flush=True)
    return records, outputs, loop


def summarize(records: list[dict], global_batch: int, chips: float, loop: dict[str, float]) -> dict[str, Any]:
    timed = [r for r in records if not r["warmup"]]
    n = len(timed)
    step_times = [r["step_s"] for r in timed]
    median = statistics.median(step_times)
    total = lambda key: sum(r[key] for r in records)  # noqa: E731
    timed_total = lambda key: sum(r[key] for r in timed)  # noqa: E731
    out = {
        "timed_steps": n,
        "warmup_steps": len(records) - n,
        "compiles": int(total("compiles")),
        "compile_time_s": total("compile_s"),
        "compiles_in_timed_steps": int(timed_total("compiles")),
        "compiles_per_step": timed_total("compiles") / n,
        "graphs_per_step": timed_total("executes") / n,
        "transfers_per_step": timed_total("transfers") / n,
        "aten_fallbacks_per_step": timed_total("aten_fallbacks") / n,
        "step_time_median_s": median,
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        "host_time_median_s": statistics.median(r["host_s"] for r in timed),
        "execute_time_per_step_s": timed_total("execute_s") / n,
        "execute_time_by_step_s": [r["execute_s"] for r in timed],
        "transfer_time_per_step_s": timed_total("transfer_s") / n,
        "images_per_sec": global_batch / median,
        "images_per_sec_per_chip": global_batch / median / chips,
        "loop_step_time_s": loop["step_s"],
        # the back-to-back loop's own counters, per step
        "loop_execute_time_per_step_s": loop["execute_s"],
        "loop_graphs_per_step": loop["executes"],
        "loop_transfers_per_step": loop["transfers"],
        "loop_compiles_per_step": loop["compiles"],
        # what the host adds to a step in a training loop: tracing, dispatch, transfers, host work not hidden
        # behind the device's execution. None when the loop's executions were queued asynchronously (replay,
        # openxla): torch_xla times each from its enqueue, so they overlap and add up to more than the loop's time.
        "outside_execution_per_step_s": (loop["step_s"] - loop["execute_s"]
                                         if loop["execute_s"] <= loop["step_s"] else None),
        # the same from the timed steps (one at a time, each waited for): wall time not spent executing a graph; None
        # where a step's own executions overlap (openxla queues its ~30 graphs)
        "not_executing_per_step_s": (median - timed_total("execute_s") / n
                                     if timed_total("execute_s") / n <= median else None),
    }
    if "python_traces" in timed[0]:
        out["python_traces_per_step"] = timed_total("python_traces") / n
        out["loop_python_traces_per_step"] = loop["python_traces"]
    return out


def device_info(num_devices_used: int) -> dict[str, Any]:
    """What the XLA runtime says about the hardware, the chip generation and the chips ``num_devices_used`` span."""
    import torch_xla.runtime as xr

    kind = xr.device_type() or "unknown"
    attrs = [{k: str(v) for k, v in a.items()} for a in xr.global_runtime_device_attributes()]
    generation = None
    if kind == "TPU":
        text = " ".join(a.get("device_kind", "") for a in attrs).lower()
        text += " " + os.environ.get("TPU_ACCELERATOR_TYPE", "").lower()
        try:
            from torch_xla._internal import tpu

            text += " " + str(tpu.get_tpu_env().get("ACCELERATOR_TYPE", "")).lower()
        except Exception:  # noqa: BLE001  no metadata server: rely on the device attributes
            pass
        for pattern, gen in (("v6", "v6e"), ("v5 lite", "v5e"), ("v5lite", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"),
                             ("v5", "v5p"), ("v4", "v4"), ("v3", "v3"), ("v2", "v2")):
            if pattern in text:
                generation = gen
                break
    per_chip = DEVICES_PER_CHIP.get(generation or "", 1)
    return {
        "device_type": kind,
        "tpu_generation": generation,
        "device_kind": attrs[0].get("device_kind", kind) if attrs else kind,
        "runtime_device_count": len(attrs),
        "devices_used": num_devices_used,
        "chips": num_devices_used / per_chip,
        "peak_bf16_tflops_per_chip": PEAK_BF16_TFLOPS.get(generation or ""),
    }


def peak_memory_bytes() -> int | None:
    """Peak device memory of the first device, where the backend reports it (TPU/GPU); ``None`` on the CPU."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    try:
        info = xm.get_memory_info(torch_xla.device())
    except Exception:  # noqa: BLE001  XLA CPU: "GetAllocatorStats is not supported"
        return None
    peak = info.get("peak_bytes_used", info.get("bytes_used"))
    return int(peak) if peak is not None else None


def count_flops_per_image(net_cpu: Any, cfgs: Any, batch: dict[str, Any]) -> float:
    """FLOPs of one training forward + loss + backward of the model on the CPU (eager), per image."""
    from torch.utils.flop_counter import FlopCounterMode

    from spmd_rfdetr.data.pixels import upstream_float
    from spmd_rfdetr.model.inputs import targets_list
    from spmd_rfdetr.model.loss import total_loss
    from spmd_rfdetr.model.upstream import build_upstream_criterion
    from spmd_rfdetr.model.inputs import as_samples

    model = copy.deepcopy(net_cpu).train()
    images = upstream_float(batch["images"])  # normalised before counting, as upstream's host does
    criterion = build_upstream_criterion(cfgs)[0].train()
    with FlopCounterMode(display=False) as counter:
        loss_dict = criterion(model(as_samples(images)), targets_list(batch))
        total_loss(loss_dict, criterion.weight_dict).backward()
    del model
    return counter.get_total_flops() / batch["images"].shape[0]


def environment() -> dict[str, Any]:
    from importlib.metadata import version

    def v(pkg: str) -> str | None:
        try:
            return version(pkg)
        except Exception:  # noqa: BLE001
            return None

    return {"python": platform.python_version(), "platform": platform.platform(), "host_cpus": os.cpu_count(),
            "torch": v("torch"), "torch_xla": v("torch_xla"), "rfdetr": v("rfdetr"),
            "lightning_fabric": v("lightning-fabric"), "scipy": v("scipy"),
            "PJRT_DEVICE": os.environ.get("PJRT_DEVICE"), "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
            "CPU_NUM_DEVICES": os.environ.get("CPU_NUM_DEVICES"), "XLA_USE_BF16": os.environ.get("XLA_USE_BF16")}

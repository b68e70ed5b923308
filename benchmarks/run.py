#!/usr/bin/env python
"""Our SPMD training step side by side with upstream rfdetr's own XLA training path, on the same XLA device.

    python benchmarks/run.py --config configs/v5e.yaml --compare upstream --warmup 3 --steps 5
    python benchmarks/run.py --config configs/cpu.yaml --scaling 1,2,4,8            # our side over mesh sizes
    python benchmarks/run.py --config configs/v5e.yaml --matcher                     # assignment micro-benchmark

Each side runs in its own subprocess (SPMD is process-global in torch_xla): the parent re-invokes this script with
``--_child ours|upstream|matcher``, collects its JSON, prints a markdown table and writes a JSON file and a PNG plot
(default names say model, resolution, batch, hardware and date, under ``benchmarks/results/``).

- ours: ``spmd_rfdetr``'s one-graph ``TrainStep`` (device matcher, ``torch_xla.compile(full_graph=True)``) on an SPMD
  mesh over every device, batch sharded on the ``data`` axis, via our Lightning Fabric plugins.
- upstream: rfdetr's LWDETR + SetCriterion + HungarianMatcher (SciPy, through the host) + AdamW on ``get_param_dict``
  + ``clip_grad_norm_`` in the order its Lightning module runs them, plain lazy torch_xla on ONE device (no SPMD),
  ``torch_xla.sync()`` after the optimizer step as Lightning's XLA precision plugin does. Lightning's own logging and
  progress-bar reads are not included. With ``--precision bf16`` upstream runs ``XLA_USE_BF16=1`` ("bf16-true", what
  rfdetr picks on TPU); ours runs bf16 autocast with fp32 weights ("bf16-mixed").

Both sides train the same model config from the same initial weights (same seed) on the same fixed synthetic batches
(deterministic random images, 1..T valid random boxes per image), which are put on the device once before timing:
neither data loading nor the host->device input copy is measured. Ours steps its device-tensor LR schedule inside
the step as ``fit`` does; upstream keeps a constant learning rate.
Every step is timed on its own: ``time.perf_counter()`` around the step call and ``xm.wait_device_ops()`` (which
moves no data to the host), so host time (tracing + dispatch, and for upstream its synchronous matcher round trips)
and wall time per step are both reported; warm-up steps (where compilation happens) are plotted but not in the
statistics. Then the same number of steps runs back to back with one wait at the end, as a training loop runs them
("step time in a loop"). Counters come from ``torch_xla.debug.metrics``.

On a CPU host (``PJRT_DEVICE`` unset or ``CPU``) ours runs on ``--devices`` virtual XLA CPU devices
(``CPU_NUM_DEVICES``; default 1: virtual devices share the host's cores, so the like-for-like comparison is one
device each; Nano at batch 2 measured 6.6 s/step on 2 virtual devices against 4.2 s on one, on 2 cores), upstream on
one. On a TPU VM every visible chip is used by ours and one device by upstream; to benchmark fewer chips, restrict
the visible chips before starting (e.g. ``TPU_VISIBLE_CHIPS=0,1 TPU_CHIPS_PER_PROCESS_BOUNDS=1,2,1
TPU_PROCESS_BOUNDS=1,1,1``) and pass the same ``--devices`` (a mismatch with what the runtime sees is an error).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/run.py` from a checkout, without installing the package

#: bf16 peak TFLOP/s per chip (dense), for MFU.
PEAK_BF16_TFLOPS = {"v3": 123.0, "v4": 275.0, "v5e": 197.0, "v5p": 459.0, "v6e": 918.0}
#: XLA devices per chip (v2/v3 expose each of a chip's two TensorCores as a device; later chips are megacore).
DEVICES_PER_CHIP = {"v2": 2, "v3": 2}
PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed"}
#: Decoder layers + the encoder (two-stage) output: each one calls the matcher once per step.
DEFAULT_NUM_CLASSES = 90  # rfdetr's default class count (COCO ids)


# --------------------------------------------------------------------------------------------------------- config


def _sections() -> dict[str, type]:
    """``RunConfig``'s sections and their option classes (``model``, ``data``, ``optim``, ``mesh``, ``trainer``, ...)."""
    from spmd_rfdetr.config import RunConfig

    return {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}  # type: ignore[misc]


def load_run_config(path: str | None) -> Any:
    """Our ``RunConfig`` from a ``fit`` YAML."""
    import yaml

    from spmd_rfdetr.config import RunConfig

    raw = (yaml.safe_load(Path(path).read_text()) if path else {}) or {}
    sections = _sections()
    unknown = set(raw) - set(sections)
    if unknown:
        raise SystemExit(f"{path}: unknown section(s) {sorted(unknown)}; expected {sorted(sections)}")
    try:
        return RunConfig(**{name: cls(**(raw.get(name) or {})) for name, cls in sections.items()})
    except TypeError as e:
        raise SystemExit(f"{path}: {e}") from e


def run_config_from_dict(d: dict[str, Any]) -> Any:
    from spmd_rfdetr.config import RunConfig

    return RunConfig(**{name: cls(**d[name]) for name, cls in _sections().items()})


def apply_overrides(cfg: Any, args: argparse.Namespace) -> None:
    m, d = cfg.model, cfg.data
    for field, value in (("variant", args.variant), ("resolution", args.resolution), ("num_queries", args.queries),
                         ("group_detr", args.group_detr), ("dec_layers", args.dec_layers)):
        if value is not None:
            setattr(m, field, value)
    if args.num_classes is not None:
        m.num_classes = args.num_classes
    if m.num_classes is None:
        m.num_classes = DEFAULT_NUM_CLASSES  # synthetic data: no dataset to read the class count from
    m.pretrain_weights = None  # from scratch: both sides start from the same seeded random weights
    if args.batch is not None:
        d.global_batch_size, d.per_device_batch_size = args.batch, None
    if args.targets is not None:
        d.max_targets = args.targets
    if args.precision is not None:
        cfg.trainer.precision = args.precision
    cfg.trainer.seed = args.seed


def on_cpu_host() -> bool:
    """No TPU visible and PJRT_DEVICE unset (or CPU): the children run on virtual XLA CPU devices."""
    pjrt = os.environ.get("PJRT_DEVICE")
    if pjrt is not None:
        return pjrt.upper() == "CPU"
    return not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*")


#: XLA CPU codegen without LLVM optimisation: compiles ~2x faster, runs slower. For smoke tests (the counters do not
#: depend on it), never for published numbers.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_FAST_COMPILE = False


def child_env(devices: int | None) -> dict[str, str]:
    env = dict(os.environ)
    if _FAST_COMPILE:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FAST_COMPILE_FLAGS).strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("XLA_USE_BF16", None)
    if on_cpu_host():
        env["PJRT_DEVICE"] = "CPU"
        if devices is not None:
            env["CPU_NUM_DEVICES"] = str(devices)
    return env


def run_child(role: str, spec: dict[str, Any], devices: int | None, timeout: float | None) -> dict[str, Any]:
    """Run one side in a fresh interpreter; its logs go to our stderr, its result comes back as JSON."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", role, "--_spec", str(spec_path),
               "--_out", str(out_path)]
        print(f"[bench] {role}: starting ({'CPU_NUM_DEVICES=' + str(devices) if on_cpu_host() else 'all devices'})",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=child_env(devices), stdout=sys.stderr, stderr=sys.stderr, timeout=timeout)
        if proc.returncode != 0 or not out_path.exists():
            raise SystemExit(f"[bench] {role} failed with exit code {proc.returncode} (see the log above)")
        result = json.loads(out_path.read_text())
        result["process_wall_s"] = time.perf_counter() - start
        return result


# ------------------------------------------------------------------------------------------------- child helpers


def synthetic_batches(batch: int, resolution: int, max_targets: int, num_classes: int, count: int,
                      seed: int) -> list[dict[str, Any]]:
    """Fixed static batches: N(0,1) images (already "normalised"), 1..T valid random cxcywh boxes per image."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(count):
        n_valid = torch.randint(1, max_targets + 1, (batch,), generator=g)
        valid = torch.arange(max_targets)[None, :] < n_valid[:, None]
        centers = torch.rand(batch, max_targets, 2, generator=g) * 0.6 + 0.2
        sides = torch.rand(batch, max_targets, 2, generator=g) * 0.35 + 0.05
        boxes = torch.where(valid[..., None], torch.cat([centers, sides], dim=-1), torch.zeros(()))
        labels = torch.where(valid, torch.randint(0, num_classes, (batch, max_targets), generator=g), 0)
        batches.append({
            "images": torch.randn(batch, 3, resolution, resolution, generator=g),
            "boxes": boxes.float(),
            "labels": labels.long(),
            "valid": valid,
            "image_id": torch.arange(batch, dtype=torch.int64),
            "orig_size": torch.full((batch, 2), resolution, dtype=torch.int64),
        })
    return batches


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


def timed_steps(step_fn: Any, batches: list[Any], warmup: int, steps: int,
                label: str) -> tuple[list[dict], list[Any], float]:
    """Run warmup + steps calls of ``step_fn``, each timed alone: host time until it returns, wall time until the
    device is idle again (``wait_device_ops`` transfers nothing). Then ``steps`` more back to back; returns (per-step
    records, outputs, seconds per step of the back-to-back run)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    counters = Counters()
    torch_xla.sync()
    xm.wait_device_ops()
    records, outputs = [], []
    for i in range(warmup + steps):
        before = counters.read()
        t0 = time.perf_counter()
        out = step_fn(batches[i % len(batches)])
        t1 = time.perf_counter()
        xm.wait_device_ops()
        t2 = time.perf_counter()
        after = counters.read()
        rec = {"step": i + 1, "warmup": i < warmup, "host_s": t1 - t0, "step_s": t2 - t0}
        rec.update({k: after[k] - before[k] for k in after})
        records.append(rec)
        outputs.append(out)
        print(f"[bench] {label} step {i + 1}/{warmup + steps}{' (warm-up)' if i < warmup else ''}: "
              f"{rec['step_s']:.3f} s (host {rec['host_s']:.3f} s), {rec['compiles']} compile(s), "
              f"{rec['executes']} graph(s), {rec['transfers']} transfer(s)", file=sys.stderr, flush=True)
    # As a training loop runs them: `steps` more calls back to back, one wait at the end. Where the runtime allows it,
    # tracing step k+1 overlaps executing step k (a side that syncs with the host inside its step cannot overlap).
    t0 = time.perf_counter()
    for i in range(steps):
        step_fn(batches[i % len(batches)])
    xm.wait_device_ops()
    loop_s = (time.perf_counter() - t0) / steps
    print(f"[bench] {label}: {steps} steps back to back: {loop_s:.3f} s/step", file=sys.stderr, flush=True)
    return records, outputs, loop_s


def summarize(records: list[dict], global_batch: int, chips: float, loop_step_s: float) -> dict[str, Any]:
    timed = [r for r in records if not r["warmup"]]
    n = len(timed)
    step_times = [r["step_s"] for r in timed]
    median = statistics.median(step_times)
    total = lambda key: sum(r[key] for r in records)  # noqa: E731
    timed_total = lambda key: sum(r[key] for r in timed)  # noqa: E731
    return {
        "timed_steps": n,
        "warmup_steps": len(records) - n,
        "compiles": int(total("compiles")),
        "compile_time_s": total("compile_s"),
        "compiles_in_timed_steps": int(timed_total("compiles")),
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
        "loop_step_time_s": loop_step_s,
    }


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
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from spmd_rfdetr.data import targets_list
    from spmd_rfdetr.loss import total_loss
    from spmd_rfdetr.model import build_upstream_criterion
    from spmd_rfdetr.step import as_samples

    model = copy.deepcopy(net_cpu).train()
    criterion = build_upstream_criterion(cfgs)[0].train()
    with FlopCounterMode(display=False) as counter:
        loss_dict = criterion(model(as_samples(batch["images"])), targets_list(batch))
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
            "PJRT_DEVICE": os.environ.get("PJRT_DEVICE"), "XLA_FLAGS": os.environ.get("XLA_FLAGS"), "CPU_NUM_DEVICES": os.environ.get("CPU_NUM_DEVICES"),
            "XLA_USE_BF16": os.environ.get("XLA_USE_BF16")}


# ------------------------------------------------------------------------------------------------------- children


def child_ours(spec: dict[str, Any]) -> dict[str, Any]:
    """Our one-graph step on an SPMD mesh over every device."""
    import torch_xla.runtime as xr

    xr.use_spmd()  # before any XLA tensor exists
    import torch
    import torch_xla

    from spmd_rfdetr.config import validate
    from spmd_rfdetr.fabric import spmd_fabric
    from spmd_rfdetr.loss import build_criterion
    from spmd_rfdetr.mesh import build_mesh, data_axis_size
    from spmd_rfdetr.model import (
        DeviceLRSchedule, build_model, build_optimizer, build_upstream_criterion, upstream_configs)
    from spmd_rfdetr.step import TrainStep

    cfg = run_config_from_dict(spec["run_config"])
    devices = xr.global_runtime_device_count()
    if spec.get("expect_devices") and spec["expect_devices"] != devices:
        raise SystemExit(f"--devices {spec['expect_devices']} but the XLA runtime sees {devices} devices; on a TPU "
                         "restrict the visible chips (TPU_VISIBLE_CHIPS ...) before starting")
    validate(cfg, devices)
    m, d = cfg.model, cfg.data
    fabric = spmd_fabric(build_mesh(cfg.mesh.data), precision=PRECISIONS[cfg.trainer.precision])
    mesh = fabric.strategy.mesh
    cfgs = upstream_configs(m, d, cfg.optim, m.num_classes)
    torch.manual_seed(cfg.trainer.seed)
    net = build_model(cfgs)
    resolution = cfgs.model.resolution
    cpu_batches = synthetic_batches(d.global_batch_size, resolution, d.max_targets, m.num_classes,
                                    spec["num_batches"], cfg.trainer.seed)
    flops = None
    if spec.get("count_flops"):
        print("[bench] ours: counting FLOPs (CPU eager forward + loss + backward)", file=sys.stderr, flush=True)
        t = time.perf_counter()
        flops = count_flops_per_image(net, cfgs, cpu_batches[0])
        print(f"[bench] ours: {flops / 1e9:.2f} GFLOP/image ({time.perf_counter() - t:.1f} s)", file=sys.stderr)

    criterion = build_criterion(build_upstream_criterion(cfgs)[0], solver="device").train()
    optimizer = build_optimizer(net, cfgs, on_device=True)
    net, optimizer = fabric.setup(net, optimizer)
    net.train()
    schedule = DeviceLRSchedule(optimizer, cfg.optim, max_steps=1_000_000)  # as `fit` runs it
    step = TrainStep(net, criterion, optimizer, clip_max_norm=cfg.optim.clip_max_norm, full_graph=True,
                     schedule=schedule)
    loader = fabric.strategy.process_dataloader(cpu_batches)
    batches = [loader.to_device(b) for b in cpu_batches]
    torch_xla.sync()

    records, outputs, loop_s = timed_steps(step, batches, spec["warmup"], spec["steps"], "ours")
    fallbacks = Counters.fallback_names()
    stats = [step.read(s) for s in outputs]  # after timing: reads back every step's stats
    info = device_info(devices)
    shards = data_axis_size(mesh)
    result = summarize(records, d.global_batch_size, info["chips"], loop_s)
    result.update({
        "side": "ours",
        "description": f"spmd_rfdetr TrainStep, torch_xla.compile(full_graph=True), SPMD mesh {dict(mesh.shape())}",
        "precision": PRECISIONS[cfg.trainer.precision],
        "global_batch": d.global_batch_size,
        "per_device_batch_shape": [d.global_batch_size // shards, 3, resolution, resolution],
        "mesh_shape": {k: int(v) for k, v in mesh.shape().items()},
        "aten_fallback_names": fallbacks,
        "peak_memory_bytes": peak_memory_bytes(),
        "flops_per_image": flops,
        "losses": [s["loss"] for s in stats],
        "matcher_unconverged": [s.get("matcher_unconverged") for s in stats],
        "device": info,
        "environment": environment(),
        "resolved_run_config": dataclasses.asdict(cfg),
        "resolved_model_config": json.loads(cfgs.model.model_dump_json()),
        "per_step": records,
    })
    return result


def child_upstream(spec: dict[str, Any]) -> dict[str, Any]:
    """rfdetr's own XLA path: lazy tensors on one device, SciPy matcher on the host, sync after optimizer.step()."""
    cfg = run_config_from_dict(spec["run_config"])
    if cfg.trainer.precision == "bf16":
        os.environ["XLA_USE_BF16"] = "1"  # rfdetr picks XLAPrecision("bf16-true") on TPU; read at the first transfer
    import torch
    import torch_xla

    from spmd_rfdetr.data import targets_list
    from spmd_rfdetr.loss import total_loss
    from spmd_rfdetr.model import build_model, build_optimizer, build_upstream_criterion, upstream_configs
    from spmd_rfdetr.step import as_samples

    m, d = cfg.model, cfg.data
    device = torch_xla.device()
    cfgs = upstream_configs(m, d, cfg.optim, m.num_classes)
    torch.manual_seed(cfg.trainer.seed)
    net = build_model(cfgs).to(device).train()
    criterion = build_upstream_criterion(cfgs)[0].to(device).train()
    optimizer = build_optimizer(net, cfgs)  # configure_optimizers runs after the module is on the device
    params = [p for group in optimizer.param_groups for p in group["params"]]
    clip = cfg.optim.clip_max_norm
    resolution = cfgs.model.resolution
    cpu_batches = synthetic_batches(d.global_batch_size, resolution, d.max_targets, m.num_classes,
                                    spec["num_batches"], cfg.trainer.seed)
    batches = [{k: v.to(device) for k, v in b.items()} for b in cpu_batches]
    torch_xla.sync()

    def step(batch: dict[str, Any]) -> Any:
        # RFDETRModelModule.training_step + Lightning's automatic optimization on XLA
        optimizer.zero_grad(set_to_none=True)
        samples, targets = as_samples(batch["images"]), targets_list(batch)
        loss_dict = criterion(net(samples, targets), targets)
        loss = total_loss(loss_dict, criterion.weight_dict)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)  # LightningModule.clip_gradients (gradient_clip_val)
        optimizer.step()
        torch_xla.sync()  # XLAPrecision.optimizer_step: xm.mark_step()
        return loss.detach()

    records, outputs, loop_s = timed_steps(step, batches, spec["warmup"], spec["steps"], "upstream")
    fallbacks = Counters.fallback_names()
    losses = torch.stack(outputs).float().cpu().tolist()
    info = device_info(1)
    result = summarize(records, d.global_batch_size, info["chips"], loop_s)
    result.update({
        "side": "upstream",
        "description": "rfdetr LWDETR + SetCriterion (SciPy HungarianMatcher) + AdamW + clip, lazy torch_xla, 1 device",
        "precision": "bf16-true" if cfg.trainer.precision == "bf16" else "32-true",
        "global_batch": d.global_batch_size,
        "per_device_batch_shape": [d.global_batch_size, 3, resolution, resolution],
        "mesh_shape": None,
        "aten_fallback_names": fallbacks,
        "peak_memory_bytes": peak_memory_bytes(),
        "losses": losses,
        "device": info,
        "environment": environment(),
        "per_step": records,
    })
    return result


def child_matcher(spec: dict[str, Any]) -> dict[str, Any]:
    """Assignment micro-benchmark on one XLA device: our device solver vs SciPy through the host."""
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from rfdetr.models.matcher import HungarianMatcher
    from scipy.optimize import linear_sum_assignment

    from spmd_rfdetr.matching import solve_assignment_with_stats

    device = torch_xla.device()
    images, groups, reps = spec["images"], spec["group_detr"], spec["reps"]
    num_classes = spec["num_classes"]
    matcher = HungarianMatcher(cost_class=2.0, cost_bbox=5.0, cost_giou=2.0, focal_alpha=0.25)
    counters = Counters()
    rows = []
    for q in spec["queries"]:
        for t in spec["targets"]:
            if t > q:
                rows.append({"queries": q, "targets": t, "skipped": f"T={t} > Q={q} queries per group"})
                continue
            g = torch.Generator().manual_seed(spec["seed"] + 1000 * q + t)
            # rfdetr's own matching cost on random predictions: [G*Q queries, B*T targets] -> [B*G, Q, T]
            logits = torch.randn(images, groups * q, num_classes, generator=g) * 2.0 - 2.0
            pred = torch.cat([torch.rand(images, groups * q, 2, generator=g),
                              torch.rand(images, groups * q, 2, generator=g) * 0.48 + 0.02], dim=-1)
            targets = [{"boxes": torch.cat([torch.rand(t, 2, generator=g), torch.rand(t, 2, generator=g) * 0.48 + 0.02],
                                           dim=-1),
                        "labels": torch.randint(0, num_classes, (t,), generator=g)} for _ in range(images)]
            with torch.no_grad():
                cost = matcher._compute_compact_detection_cost_matrix({"pred_logits": logits, "pred_boxes": pred},
                                                                      targets).float()
            cost = cost.view(groups * q, images, t).permute(1, 0, 2).reshape(images * groups, q, t).contiguous()
            problems = cost.shape[0]
            valid = torch.ones(problems, t, dtype=torch.bool)
            cost_dev, valid_dev = cost.to(device), valid.to(device)
            torch_xla.sync()
            xm.wait_device_ops()

            solve = torch_xla.compile(lambda c, v: tuple(solve_assignment_with_stats(c, v)), full_graph=True,
                                      name=f"assign_q{q}_t{t}")
            before = counters.read()
            t0 = time.perf_counter()
            out = solve(cost_dev, valid_dev)
            xm.wait_device_ops()
            first_s = time.perf_counter() - t0
            mid = counters.read()
            device_s = []
            for _ in range(reps):
                t0 = time.perf_counter()
                out = solve(cost_dev, valid_dev)
                xm.wait_device_ops()
                device_s.append(time.perf_counter() - t0)
            after = counters.read()
            query_of_target, converged, _, iterations = (x.cpu() for x in out)

            scipy_total, scipy_d2h, scipy_solve, scipy_h2d = [], [], [], []
            for rep in range(reps + 1):  # the first round trip is a warm-up
                t0 = time.perf_counter()
                host = cost_dev.cpu()
                t1 = time.perf_counter()
                result = np.empty((problems, t), dtype=np.int64)
                for p, c in enumerate(host.numpy()):
                    rows_q, cols_t = linear_sum_assignment(c)
                    result[p, cols_t] = rows_q
                t2 = time.perf_counter()
                back = torch.from_numpy(result).to(device)
                torch_xla.sync()
                xm.wait_device_ops()
                t3 = time.perf_counter()
                if rep:
                    scipy_total.append(t3 - t0)
                    scipy_d2h.append(t1 - t0)
                    scipy_solve.append(t2 - t1)
                    scipy_h2d.append(t3 - t2)
            del back
            ours_total = cost.gather(1, query_of_target[:, None, :]).sum().item()
            ref_total = cost.gather(1, torch.from_numpy(result)[:, None, :]).sum().item()
            row = {
                "queries": q, "targets": t, "problems": problems, "cost_shape": [problems, q, t],
                "device_compile_and_first_s": first_s,
                "device_compiles": int(mid["compiles"] - before["compiles"]),
                "device_median_s": statistics.median(device_s),
                "device_graphs_per_call": (after["executes"] - mid["executes"]) / reps,
                "device_transfers_per_call": (after["transfers"] - mid["transfers"]) / reps,
                "device_loop_iterations": int(iterations),
                "device_converged": bool(converged.all()),
                "scipy_median_s": statistics.median(scipy_total),
                "scipy_d2h_median_s": statistics.median(scipy_d2h),
                "scipy_solve_median_s": statistics.median(scipy_solve),
                "scipy_h2d_median_s": statistics.median(scipy_h2d),
                "total_cost_device": ours_total,
                "total_cost_scipy": ref_total,
                "optimal": abs(ours_total - ref_total) <= 1e-4 * max(1.0, abs(ref_total)),
            }
            row["ratio_device_over_scipy"] = row["device_median_s"] / row["scipy_median_s"]
            print(f"[bench] matcher Q={q} T={t} P={problems}: device {row['device_median_s'] * 1e3:.1f} ms "
                  f"({row['device_loop_iterations']} iterations), scipy+transfers {row['scipy_median_s'] * 1e3:.1f} ms",
                  file=sys.stderr, flush=True)
            rows.append(row)
    return {"rows": rows, "device": device_info(1), "environment": environment()}


# ------------------------------------------------------------------------------------------------------- reporting


def fmt(value: Any, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}{unit}"
    return f"{value}{unit}"


def mfu(side: dict[str, Any]) -> float | None:
    peak, flops = side["device"].get("peak_bf16_tflops_per_chip"), side.get("flops_per_image")
    if not peak or not flops:
        return None
    return flops * side["images_per_sec"] / (peak * 1e12 * side["device"]["chips"])


def comparison_table(ours: dict[str, Any], upstream: dict[str, Any] | None) -> str:
    def ratio(a: Any, b: Any) -> str:
        if a is None or b is None or not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or b == 0:
            return ""
        return f"{a / b:.3g}x"

    mem = lambda s: None if s.get("peak_memory_bytes") is None else s["peak_memory_bytes"] / 2**30  # noqa: E731
    gflops = lambda s: None if not s.get("flops_per_image") else s["flops_per_image"] / 1e9  # noqa: E731
    mfu_s = lambda s: None if mfu(s) is None else f"{100 * mfu(s):.2f}%"  # noqa: E731
    rows = [
        ("compilations (all steps)", lambda s: s["compiles"], ""),
        ("compile time, s", lambda s: s["compile_time_s"], ""),
        ("compilations after warm-up", lambda s: s["compiles_in_timed_steps"], ""),
        ("graph executions / step", lambda s: s["graphs_per_step"], ""),
        ("device->host transfers / step", lambda s: s["transfers_per_step"], ""),
        ("aten:: CPU fallbacks / step", lambda s: s["aten_fallbacks_per_step"], ""),
        ("step time median, s", lambda s: s["step_time_median_s"], ""),
        ("step time min, s", lambda s: s["step_time_min_s"], ""),
        ("step time max, s", lambda s: s["step_time_max_s"], ""),
        ("step time in a loop (no per-step wait), s", lambda s: s.get("loop_step_time_s"), ""),
        ("host time / step (median), s", lambda s: s["host_time_median_s"], ""),
        ("XLA execute time / step, s", lambda s: s["execute_time_per_step_s"], ""),
        ("not executing a graph / step, s", lambda s: s["step_time_median_s"] - s["execute_time_per_step_s"], ""),
        ("images/s", lambda s: s["images_per_sec"], ""),
        ("images/s/chip", lambda s: s["images_per_sec_per_chip"], ""),
        ("peak device memory, GiB", mem, ""),
        ("GFLOP / image (fwd+bwd)", gflops, ""),
        ("MFU (bf16 peak)", mfu_s, ""),
    ]
    up_name = f"upstream ({upstream['precision']}, 1 device)" if upstream else ""
    mesh = "x".join(str(v) for v in ours["mesh_shape"].values())
    head = f"| metric | ours ({ours['precision']}, SPMD mesh {mesh}) |"
    lines = [head + (f" {up_name} | ours/upstream |" if upstream else ""),
             "|---|---|" + ("---|---|" if upstream else "")]
    for name, get, _ in rows:
        a = get(ours)
        line = f"| {name} | {fmt(a)} |"
        if upstream:
            b = get(upstream)
            line += f" {fmt(b)} | {ratio(a, b)} |"
        lines.append(line)
    return "\n".join(lines)


def plot_steps(path: Path, sides: dict[str, dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(9, 5))
    colors = {"ours": "tab:blue", "upstream": "tab:orange"}
    warmup = 0
    for name, side in sides.items():
        per_step = side["per_step"]
        warmup = max(warmup, side["warmup_steps"])
        x = [r["step"] for r in per_step]
        color = colors.get(name, None)
        ax.plot(x, [r["step_s"] for r in per_step], "o-", color=color,
                label=f"{name}: wall time per step (median {side['step_time_median_s']:.3g} s)")
        ax.plot(x, [r["host_s"] for r in per_step], ":", color=color, alpha=0.7, label=f"{name}: host time per step")
        compiled = [r for r in per_step if r["compiles"]]
        if compiled:
            ax.scatter([r["step"] for r in compiled], [r["step_s"] for r in compiled], s=140, marker="*",
                       color=color, edgecolor="black", zorder=5,
                       label=f"{name}: steps that compiled ({side['compiles']} graphs, {side['compile_time_s']:.0f} s)")
            for r in compiled:
                ax.annotate(f"{int(r['compiles'])}x, {r['compile_s']:.0f}s", (r["step"], r["step_s"]),
                            textcoords="offset points", xytext=(6, 6), fontsize=8, color=color)
    if warmup:
        ax.axvspan(0.5, warmup + 0.5, color="gray", alpha=0.12, label="warm-up (not in the statistics)")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("time per step, s (log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scaling(path: Path, points: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = [p["devices"] for p in points]
    ax.plot(n, [p["step_time_median_s"] for p in points], "o-", label="step time (median)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices in the mesh")
    ax.set_ylabel("time per step, s (log scale)")
    ax2 = ax.twinx()
    ax2.plot(n, [p["images_per_sec"] for p in points], "s--", color="tab:green", label="images/s")
    ax2.set_ylabel("images/s")
    ax.set_title(title, fontsize=10)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def hardware_tag(side: dict[str, Any]) -> str:
    dev = side["device"]
    if dev["device_type"] == "TPU":
        return f"tpu_{dev['tpu_generation'] or 'unknown'}-{dev['runtime_device_count']}"
    return f"xla_{dev['device_type'].lower()}{dev['runtime_device_count']}"


def default_stem(cfg: Any, side: dict[str, Any], suffix: str = "") -> str:
    prec = "" if cfg.trainer.precision == "fp32" else f"-{cfg.trainer.precision}"
    resolution = side.get("resolved_model_config", {}).get("resolution", cfg.model.resolution)
    return (f"{cfg.model.variant}-{resolution}-b{side['global_batch']}{prec}-{hardware_tag(side)}{suffix}-"
            f"{datetime.date.today().isoformat()}")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


# ------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="a `fit` YAML (configs/*.yaml); its model/data/optim/trainer sections are used")
    p.add_argument("--compare", choices=["upstream"], help="also run upstream rfdetr's own XLA training path")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps, not in the statistics (default 3)")
    p.add_argument("--json", type=Path, help="output JSON (default benchmarks/results/<model>-<res>-b<batch>-<hw>-<date>.json)")
    p.add_argument("--plot", type=Path, help="output PNG (default: the JSON's name with .png)")
    p.add_argument("--batch", type=int, help="global batch size (overrides data.global_batch_size/per_device_batch_size)")
    p.add_argument("--resolution", type=int, help="square input resolution (multiple of 32)")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="overrides trainer.precision")
    p.add_argument("--variant", choices=["nano", "small", "medium", "large", "base"], help="overrides model.variant")
    p.add_argument("--queries", type=int, help="overrides model.num_queries (queries per group)")
    p.add_argument("--group-detr", type=int, help="overrides model.group_detr")
    p.add_argument("--dec-layers", type=int, help="overrides model.dec_layers")
    p.add_argument("--targets", type=int, help="padded target slots per image T (overrides data.max_targets)")
    p.add_argument("--num-classes", type=int, help=f"classes (default model.num_classes, else {DEFAULT_NUM_CLASSES})")
    p.add_argument("--devices", type=int, help="devices for ours: CPU_NUM_DEVICES on a CPU host (default 1, "
                   "like upstream); on a TPU, a check against the visible devices")
    p.add_argument("--seed", type=int, default=0, help="weights and synthetic data seed (default 0)")
    p.add_argument("--no-flops", action="store_true", help="skip the CPU eager FLOP count (and MFU)")
    p.add_argument("--scaling", help="comma-separated mesh sizes, e.g. 1,2,4,8: our side only, one run per size")
    p.add_argument("--scaling-batch", choices=["weak", "strong"], default="weak",
                   help="weak: global batch = --per-device-batch x devices (default); strong: the global batch is "
                   "fixed (--batch / the config) and must divide by every size")
    p.add_argument("--per-device-batch", type=int, default=1, help="images per device in weak scaling (default 1)")
    p.add_argument("--matcher", action="store_true", help="assignment micro-benchmark: device solver vs SciPy + transfers")
    p.add_argument("--matcher-images", type=int, default=8, help="images per step in --matcher (default 8)")
    p.add_argument("--matcher-queries", default="30,300", help="queries per group Q in --matcher (default 30,300)")
    p.add_argument("--matcher-targets", default="1,10,50,100", help="targets T in --matcher (default 1,10,50,100)")
    p.add_argument("--fast-compile", action="store_true", help="XLA CPU only: compile without LLVM optimisation "
                   f"(XLA_FLAGS+='{FAST_COMPILE_FLAGS}'); for smoke tests, slows execution")
    p.add_argument("--child-timeout", type=float, default=None, help="seconds before a side's subprocess is killed")
    p.add_argument("--_child", choices=["ours", "upstream", "matcher"], help=argparse.SUPPRESS)
    p.add_argument("--_spec", help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def default_devices(args: argparse.Namespace) -> int | None:
    """Devices for our side: ``--devices``; on a CPU host 1, the device upstream runs on (virtual XLA CPU devices
    share the same cores, so more of them add partitioning and collectives, not compute); on a TPU every chip."""
    if args.devices is not None:
        return args.devices
    return 1 if on_cpu_host() else None


def main_compare(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    devices = default_devices(args)
    spec = {"run_config": dataclasses.asdict(cfg), "warmup": args.warmup, "steps": args.steps, "num_batches": 2,
            "count_flops": not args.no_flops, "expect_devices": args.devices if not on_cpu_host() else None}
    ours = run_child("ours", spec, devices, args.child_timeout)
    upstream = None
    if args.compare == "upstream":
        up_cfg = copy.deepcopy(cfg)
        up_cfg.data.global_batch_size, up_cfg.data.per_device_batch_size = ours["global_batch"], None
        up_spec = dict(spec, run_config=dataclasses.asdict(up_cfg), count_flops=False, expect_devices=None)
        upstream = run_child("upstream", up_spec, 1, args.child_timeout)
        upstream["flops_per_image"] = ours.get("flops_per_image")  # the same model: counted once
    for side in (ours, upstream):
        if side is not None:
            side["mfu"] = mfu(side)
    payload: dict[str, Any] = {
        "benchmark": "train_step",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config_file": args.config,
        "config": ours["resolved_run_config"],
        "model_config": ours["resolved_model_config"],
        "bench": {"warmup": args.warmup, "steps": args.steps, "seed": args.seed, "data": "synthetic, fixed",
                  "synthetic_batches": spec["num_batches"], "lr_schedule": "constant",
                  "fast_compile": args.fast_compile},
        "environment": {**ours["environment"], "device": ours["device"],
                        "upstream_device": upstream["device"] if upstream else None},
        "ours": ours,
        "upstream": upstream,
    }
    if upstream:
        payload["ratio_step_time"] = ours["step_time_median_s"] / upstream["step_time_median_s"]
        payload["ratios"] = {k: (ours[k] / upstream[k] if upstream[k] else None) for k in (
            "step_time_median_s", "loop_step_time_s", "host_time_median_s", "images_per_sec", "images_per_sec_per_chip",
            "graphs_per_step", "transfers_per_step", "compiles", "compile_time_s")}
    stem = default_stem(cfg, ours)
    json_path = args.json or ROOT / "benchmarks" / "results" / f"{stem}.json"
    plot_path = args.plot or json_path.with_suffix(".png")
    payload["plot"] = str(plot_path)
    write_json(json_path, payload)
    title = (f"RF-DETR {cfg.model.variant} {ours['resolved_model_config']['resolution']}px, global batch "
             f"{ours['global_batch']}, {cfg.trainer.precision}, {hardware_tag(ours)} ({datetime.date.today()})")
    plot_steps(plot_path, {k: v for k, v in (("ours", ours), ("upstream", upstream)) if v}, title)
    print(f"## {title}\n")
    print(comparison_table(ours, upstream))
    for side in (ours, upstream):
        if side and side["compiles_in_timed_steps"]:
            print(f"\nnote: {side['side']} compiled {side['compiles_in_timed_steps']} graph(s) during the timed steps "
                  "(they are in its step-time statistics); use a longer --warmup (the graph changes once after step 1)")
    if upstream:
        print(f"\nratio step time ours/upstream: {payload['ratio_step_time']:.3g} (per-step median), "
              f"{payload['ratios']['loop_step_time_s']:.3g} (back-to-back loop)")
        print(f"losses ours     {[round(x, 4) for x in ours['losses']]}\nlosses upstream {[round(x, 4) for x in upstream['losses']]}")
    print(f"\nJSON: {json_path}\nplot: {plot_path}")
    return payload


def main_scaling(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.scaling.split(",") if s.strip()]
    points = []
    for i, n in enumerate(sizes):
        run_cfg = copy.deepcopy(cfg)
        if args.scaling_batch == "weak":
            run_cfg.data.global_batch_size, run_cfg.data.per_device_batch_size = args.per_device_batch * n, None
        spec = {"run_config": dataclasses.asdict(run_cfg), "warmup": args.warmup, "steps": args.steps,
                "num_batches": 2, "count_flops": False, "expect_devices": n}
        side = run_child("ours", spec, n if on_cpu_host() else None, args.child_timeout)
        points.append({"devices": n, "global_batch": side["global_batch"],
                       "per_device_batch_shape": side["per_device_batch_shape"],
                       **{k: side[k] for k in ("step_time_median_s", "step_time_min_s", "step_time_max_s",
                                               "host_time_median_s", "images_per_sec", "images_per_sec_per_chip",
                                               "graphs_per_step", "transfers_per_step", "compiles",
                                               "compile_time_s")},
                       "run": side})
    base = points[0]
    for p in points:
        if args.scaling_batch == "weak":  # ideal: constant step time
            p["scaling_efficiency"] = base["step_time_median_s"] / p["step_time_median_s"]
        else:  # ideal: step time / (n / n0)
            p["scaling_efficiency"] = base["step_time_median_s"] * base["devices"] / (p["step_time_median_s"] * p["devices"])
    payload = {"benchmark": "scaling", "mode": args.scaling_batch, "command": " ".join(sys.argv),
               "date": datetime.datetime.now().isoformat(timespec="seconds"), "config_file": args.config,
               "config": dataclasses.asdict(cfg), "environment": points[0]["run"]["environment"], "points": points}
    stem = default_stem(cfg, points[-1]["run"], f"-scaling-{args.scaling_batch}")
    json_path = args.json or ROOT / "benchmarks" / "results" / f"{stem}.json"
    plot_path = args.plot or json_path.with_suffix(".png")
    write_json(json_path, payload)
    title = f"ours, {args.scaling_batch} scaling, RF-DETR {cfg.model.variant} ({datetime.date.today()})"
    plot_scaling(plot_path, points, title)
    print(f"## {title}\n")
    print("| devices | global batch | per-device batch | step median, s | host, s | images/s | images/s/chip | "
          "graphs/step | transfers/step | efficiency |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in points:
        print(f"| {p['devices']} | {p['global_batch']} | {p['per_device_batch_shape']} | {p['step_time_median_s']:.3g} | "
              f"{p['host_time_median_s']:.3g} | {p['images_per_sec']:.3g} | {p['images_per_sec_per_chip']:.3g} | "
              f"{p['graphs_per_step']:.3g} | {p['transfers_per_step']:.3g} | {p['scaling_efficiency']:.2f} |")
    print(f"\nJSON: {json_path}\nplot: {plot_path}")
    return payload


def main_matcher(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    from spmd_rfdetr.model import upstream_configs

    cfgs = upstream_configs(cfg.model, cfg.data, cfg.optim, cfg.model.num_classes)
    groups, layers = cfgs.model.group_detr, cfgs.model.dec_layers + (1 if cfgs.model.two_stage else 0)
    spec = {"images": args.matcher_images, "group_detr": groups, "num_classes": cfg.model.num_classes,
            "queries": [int(x) for x in args.matcher_queries.split(",")],
            "targets": [int(x) for x in args.matcher_targets.split(",")], "reps": args.steps, "seed": args.seed}
    result = run_child("matcher", spec, 1, args.child_timeout)
    payload = {"benchmark": "matcher", "command": " ".join(sys.argv),
               "date": datetime.datetime.now().isoformat(timespec="seconds"), "spec": spec,
               "matcher_calls_per_step": layers, "environment": result["environment"], "device": result["device"],
               "rows": result["rows"]}
    tag = f"{cfg.model.variant}-matcher-i{args.matcher_images}-g{groups}-{hardware_tag(result)}-{datetime.date.today()}"
    json_path = args.json or ROOT / "benchmarks" / "results" / f"{tag}.json"
    write_json(json_path, payload)
    print(f"## assignment per matcher call: P = {args.matcher_images} images x {groups} groups problems of [Q, T] "
          f"(Q = queries per group, all T targets valid); one step calls the matcher {layers}x "
          f"({cfgs.model.dec_layers} decoder layers + encoder output); {hardware_tag(result)}, one device\n")
    print("| Q | T | P | device solve, ms | loop iterations | compile+first, s | SciPy path, ms (d2h + solve + h2d) | "
          "device/SciPy | optimal | per step: device / SciPy, ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "skipped" in r:
            print(f"| {r['queries']} | {r['targets']} | | skipped: {r['skipped']} | | | | | | |")
            continue
        print(f"| {r['queries']} | {r['targets']} | {r['problems']} | {r['device_median_s'] * 1e3:.2f} | "
              f"{r['device_loop_iterations']} | {r['device_compile_and_first_s']:.1f} | {r['scipy_median_s'] * 1e3:.2f} "
              f"({r['scipy_d2h_median_s'] * 1e3:.2f} + {r['scipy_solve_median_s'] * 1e3:.2f} + "
              f"{r['scipy_h2d_median_s'] * 1e3:.2f}) | {r['ratio_device_over_scipy']:.3g} | {r['optimal']} | "
              f"{layers * r['device_median_s'] * 1e3:.1f} / {layers * r['scipy_median_s'] * 1e3:.1f} |")
    print(f"\nJSON: {json_path}")
    return payload


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args._child:
        spec = json.loads(Path(args._spec).read_text())
        result = {"ours": child_ours, "upstream": child_upstream, "matcher": child_matcher}[args._child](spec)
        Path(args._out).write_text(json.dumps(result, default=str))
        return
    global _FAST_COMPILE
    _FAST_COMPILE = args.fast_compile
    if on_cpu_host():
        os.environ.setdefault("PJRT_DEVICE", "CPU")  # the parent never starts a runtime; this only quiets probes
    cfg = load_run_config(args.config)
    apply_overrides(cfg, args)
    if args.matcher:
        main_matcher(cfg, args)
    elif args.scaling:
        if args.compare:
            raise SystemExit("--scaling runs our side only; drop --compare")
        main_scaling(cfg, args)
    else:
        main_compare(cfg, args)


if __name__ == "__main__":
    main()

"""What runs inside a child process: our step, upstream rfdetr's XLA path, the matcher micro-benchmark.

Each ``child_*`` takes the spec the parent wrote and returns a JSON-able dict; ``run.py --_child ROLE`` calls it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

from spmd_rfdetr.xla.runtime import PRECISIONS

from .config import STEP_MODES, apply_step_mode, run_config_from_dict
from .measure import (
    Counters,
    PythonTraces,
    count_flops_per_image,
    device_info,
    environment,
    peak_memory_bytes,
    summarize,
    timed_steps,
)

#: ``trainer.max_steps`` for our side's device LR schedule, stepped inside the step as ``fit`` does (so long that the
#: learning rate barely moves over a benchmark).
SCHEDULE_STEPS = 1_000_000


def synthetic_batches(batch: int, resolution: int, max_targets: int, num_classes: int, count: int,
                      seed: int) -> list[dict[str, Any]]:
    """Fixed static batches: random uint8 pixels (as the train loader's; upstream's side puts them through its own
    ToDtype + Normalize, :func:`~spmd_rfdetr.data.pixels.upstream_float`), 1..T valid random cxcywh boxes per image."""
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
            "images": torch.randint(0, 256, (batch, 3, resolution, resolution), generator=g, dtype=torch.uint8),
            "boxes": boxes.float(),
            "labels": labels.long(),
            "valid": valid,
            "image_id": torch.arange(batch, dtype=torch.int64),
            "orig_size": torch.full((batch, 2), resolution, dtype=torch.int64),
        })
    return batches


def child_ours(spec: dict[str, Any]) -> dict[str, Any]:
    """Our one-graph step on an SPMD mesh over every device, built by ``build_trainer`` in ``spec["step_mode"]``."""
    import torch_xla.runtime as xr

    xr.use_spmd()  # before any XLA tensor exists
    import torch
    import torch_xla

    from spmd_rfdetr.training.build import build_trainer
    from spmd_rfdetr.config.resolve import resolve_and_check
    from spmd_rfdetr.xla.fabric import spmd_fabric
    from spmd_rfdetr.xla.mesh import batch_shard_count, build_mesh
    from spmd_rfdetr.model.upstream import build_model, upstream_configs

    mode = spec.get("step_mode", "replay")
    label = f"ours ({mode})"
    cfg = run_config_from_dict(spec["run_config"])
    apply_step_mode(cfg, mode)
    cfg.trainer.max_steps = SCHEDULE_STEPS
    cfg.trainer.matcher = "device"  # the one-graph step (upstream's SciPy path is the other side)
    # a constant LR as upstream runs here, so the two sides' losses stay comparable (the schedule is still computed on
    # the device inside the step: a factor of 1 every step)
    cfg.optim.warmup_steps, cfg.optim.schedule = 0, "constant"
    devices = xr.global_runtime_device_count()
    if spec.get("expect_devices") and spec["expect_devices"] != devices:
        raise SystemExit(f"--devices {spec['expect_devices']} but the XLA runtime sees {devices} devices; on a TPU "
                         "restrict the visible chips (TPU_VISIBLE_CHIPS ...) before starting")
    resolve_and_check(cfg, devices)
    m, d = cfg.model, cfg.data
    fabric = spmd_fabric(build_mesh(cfg.mesh.data, cfg.mesh.fsdp), precision=PRECISIONS[cfg.trainer.precision])
    mesh = fabric.strategy.mesh
    cfgs = upstream_configs(m, d, cfg.optim, m.num_classes)
    torch.manual_seed(cfg.trainer.seed)
    net = build_model(cfgs)
    resolution = cfgs.model.resolution
    cpu_batches = synthetic_batches(d.global_batch_size, resolution, d.max_targets, m.num_classes,
                                    spec["num_batches"], cfg.trainer.seed)
    flops = None
    if spec.get("count_flops"):
        print(f"[bench] {label}: counting FLOPs (CPU eager forward + loss + backward)", file=sys.stderr, flush=True)
        t = time.perf_counter()
        flops = count_flops_per_image(net, cfgs, cpu_batches[0])
        print(f"[bench] {label}: {flops / 1e9:.2f} GFLOP/image ({time.perf_counter() - t:.1f} s)", file=sys.stderr)

    trainer = build_trainer(fabric, cfgs, cfg.optim, cfg.trainer, model=net, mesh=cfg.mesh)
    step = trainer.step
    traces = PythonTraces(trainer.model)
    loader = fabric.strategy.process_dataloader(cpu_batches)
    batches = [loader.to_device(b) for b in cpu_batches]
    torch_xla.sync()

    records, outputs, loop = timed_steps(step, batches, spec["warmup"], spec["steps"], label, traces)
    fallbacks = Counters.fallback_names()
    stats = [step.read(s) for s in outputs]  # after timing: reads back every step's stats
    info = device_info(devices)
    shards = batch_shard_count(mesh)
    result = summarize(records, d.global_batch_size, info["chips"], loop)
    replayer = getattr(step, "_replayer", None)
    step_traces = getattr(step, "traces", None)  # TrainStep's own count of its Python runs, where it keeps one
    result.update({
        "side": "ours",
        "step_mode": mode,
        "step_mode_used": step.mode,
        "step_mode_fallback_reason": getattr(step, "fallback_reason", "") or None,
        "python_traces": traces.count,
        "step_traces": step_traces() if callable(step_traces) else step_traces,
        "replayer_traces": getattr(replayer, "traces", None),
        "step_calls": len(records) + spec["steps"],
        "description": f"spmd_rfdetr TrainStep, {STEP_MODES[mode].description}, SPMD mesh {dict(mesh.shape())}",
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

    from spmd_rfdetr.data.pixels import upstream_float
    from spmd_rfdetr.model.inputs import targets_list
    from spmd_rfdetr.model.loss import total_loss
    from spmd_rfdetr.model.upstream import build_model, build_upstream_criterion, upstream_configs
    from spmd_rfdetr.training.optim import build_optimizer
    from spmd_rfdetr.model.inputs import as_samples

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
    # upstream's input: its own host float pipeline on the same pixels (not timed, as its DataLoader's is not)
    batches = [{k: (upstream_float(v) if k == "images" else v).to(device) for k, v in b.items()} for b in cpu_batches]
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

    graph_offsets: list[int] = []
    if spec.get("record_graph_offsets"):  # bench.compiler: where each step's graphs end in XLA_SAVE_TENSORS_FILE
        saved, timed = os.environ["XLA_SAVE_TENSORS_FILE"] + ".0", step

        def step(batch: dict[str, Any]) -> Any:
            out = timed(batch)
            graph_offsets.append(os.path.getsize(saved))
            return out

    traces = PythonTraces(net)
    records, outputs, loop = timed_steps(step, batches, spec["warmup"], spec["steps"], "upstream", traces)
    fallbacks = Counters.fallback_names()
    losses = torch.stack(outputs).float().cpu().tolist()
    info = device_info(1)
    result = summarize(records, d.global_batch_size, info["chips"], loop)
    result.update({
        "side": "upstream",
        "python_traces": traces.count,
        "step_calls": len(records) + spec["steps"],
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
        "graph_offsets": graph_offsets,
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

    from spmd_rfdetr.model.matching import solve_assignment_with_stats

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



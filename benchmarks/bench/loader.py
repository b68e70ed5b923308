"""``--loader``: the input pipeline alone, no training and no XLA runtime.

rfdetr's own training dataset and transforms for the config (``spmd_rfdetr.data.build_split(cfgs, "train")``),
batched by the training loader ``fit`` uses (``make_train_loader``: seeded shuffles, ``StaticCollate`` to fixed shapes,
endless) at the config's resolution and global batch. For each DataLoader worker count it reads warm-up batches (one
per worker, at least one: worker start-up is not measured), then times ``--loader-batches`` batches back to back and
reports images/s and images/s per worker. For 0 workers the main process is the one worker and loads with one torch
thread, as every DataLoader worker does (torch's intra-op threads on a busy host slow rfdetr's transforms many times
over). A host that must feed R images/s needs about R / (images/s per worker) workers, and that many cores. Each
worker keeps up to ``prefetch_factor`` (2) batches ahead, so use enough ``--loader-batches`` that those few batches
do not matter.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import math
import os
import sys
import time
from typing import Any

from . import RESULTS
from .measure import environment
from .report import write_json


def measure_workers(dataset: Any, data: Any, resolution: int, workers: int, batches: int,
                    seed: int) -> dict[str, Any]:
    """Images/s of ``fit``'s training loader with ``workers`` DataLoader workers over ``batches`` batches."""
    import torch

    threads = torch.get_num_threads()
    if workers == 0:
        torch.set_num_threads(1)  # as torch sets it in each DataLoader worker
    try:
        row = _measure(dataset, data, resolution, workers, batches, seed)
    finally:
        torch.set_num_threads(threads)
    print(f"[bench] loader, {workers} worker(s): {row['images_per_sec']:.1f} images/s "
          f"({row['images_per_sec_per_worker']:.1f} per worker), warm-up {row['warmup_s']:.2f} s", file=sys.stderr,
          flush=True)
    return row


def _measure(dataset: Any, data: Any, resolution: int, workers: int, batches: int, seed: int) -> dict[str, Any]:
    from spmd_rfdetr.data import make_train_loader

    loader = make_train_loader(dataset, dataclasses.replace(data, num_workers=workers), resolution, seed=seed)
    expected = (data.global_batch_size, 3, resolution, resolution)
    warmup = max(1, workers)
    batch_iter = iter(loader)  # endless
    t0 = time.perf_counter()
    for _ in range(warmup):
        batch = next(batch_iter)
    warmup_s = time.perf_counter() - t0
    if tuple(batch["images"].shape) != expected:
        raise SystemExit(f"loader batch images {tuple(batch['images'].shape)}, expected {expected}")
    t0 = time.perf_counter()
    for _ in range(batches):
        next(batch_iter)
    seconds = time.perf_counter() - t0
    del batch_iter, loader, batch  # shuts the persistent workers down
    gc.collect()
    images = batches * data.global_batch_size
    rate = images / seconds
    per_worker = rate / max(1, workers)
    return {"workers": workers, "warmup_batches": warmup, "warmup_s": warmup_s, "batches": batches,
            "images": images, "seconds": seconds, "images_per_sec": rate, "images_per_sec_per_worker": per_worker,
            "ms_per_image_per_worker": 1e3 / per_worker}


def _xla_runtime_started() -> bool | None:
    """Whether anything started an XLA runtime in this process (``None``: torch_xla not even imported)."""
    if "torch_xla" not in sys.modules:
        return None
    return bool(sys.modules["torch_xla"]._XLAC._xla_runtime_is_initialized())


def main_loader(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    from spmd_rfdetr.data import build_split
    from spmd_rfdetr.model import upstream_configs

    workers = [int(w) for w in args.loader_workers.split(",") if w.strip()]
    if not workers or min(workers) < 0:
        raise SystemExit(f"--loader-workers {args.loader_workers!r}: comma-separated counts >= 0")
    if args.loader_batches < 1:
        raise SystemExit("--loader-batches must be >= 1")
    d = cfg.data
    if d.per_device_batch_size is not None:
        raise SystemExit("--loader needs a global batch: set data.global_batch_size or pass --batch")
    if not d.dataset_dir or not os.path.isdir(d.dataset_dir):
        raise SystemExit(f"--loader: dataset directory {d.dataset_dir!r} not found (data.dataset_dir or "
                         "--dataset-dir; e.g. python -m spmd_rfdetr synth --output_dir /tmp/synth)")
    cfgs = upstream_configs(cfg.model, d, cfg.optim, cfg.model.num_classes)
    resolution = cfgs.model.resolution
    t0 = time.perf_counter()
    dataset = build_split(cfgs, "train")
    build_s = time.perf_counter() - t0
    if len(dataset) < d.global_batch_size:  # type: ignore[arg-type]
        raise SystemExit(f"{d.dataset_dir}: {len(dataset)} train images, fewer than the batch {d.global_batch_size}")
    print(f"[bench] loader: {d.dataset_dir} train split, {len(dataset)} images, {resolution}px, batch "
          f"{d.global_batch_size} ({build_s:.1f} s to build)", file=sys.stderr, flush=True)
    rows = [measure_workers(dataset, d, resolution, w, args.loader_batches, args.seed) for w in workers]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    payload = {
        "benchmark": "loader",
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config_file": args.config,
        "config": dataclasses.asdict(cfg),
        "dataset_dir": d.dataset_dir,
        "split": "train",
        "dataset_images": len(dataset),  # type: ignore[arg-type]
        "resolution": resolution,
        "global_batch": d.global_batch_size,
        "max_targets": d.max_targets,
        "multi_scale": d.multi_scale,
        "host_cpus_available": cpus,
        "environment": environment(),
        "xla_runtime_started": _xla_runtime_started(),
        "rows": rows,
    }
    tag = f"{cfg.model.variant}-{resolution}-b{d.global_batch_size}-loader-cpu{cpus}-{datetime.date.today()}"
    json_path = args.json or RESULTS / f"{tag}.json"
    write_json(json_path, payload)
    print(f"## input pipeline: rfdetr train dataset + transforms, {resolution}px, batch {d.global_batch_size}, "
          f"{args.loader_batches} batches per row, {cpus} CPU(s) available\n")
    print("| DataLoader workers | images/s | images/s per worker | ms/image per worker | warm-up, s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['images_per_sec']:.1f} | {r['images_per_sec_per_worker']:.1f} | "
              f"{r['ms_per_image_per_worker']:.1f} | {r['warmup_s']:.2f} |")
    most = max(rows, key=lambda r: r["workers"])  # every core busy: the most conservative rate per worker
    print(f"\nat {most['images_per_sec_per_worker']:.1f} images/s per worker ({most['workers']} worker(s)), feeding "
          f"1000 images/s takes about {math.ceil(1000 / most['images_per_sec_per_worker'])} workers (and cores)")
    print(f"\nJSON: {json_path}")
    return payload

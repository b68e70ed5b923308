"""``--loader``: the input pipeline alone, no training and no XLA runtime.

rfdetr's own training dataset and transforms for the config, batched by the training loader ``fit`` uses
(``make_train_loader``: seeded shuffles, ``StaticCollate`` to fixed shapes, endless) at the config's resolution and
global batch, per ``--loader-pipeline``: ``uint8`` is what ``fit`` reads (``spmd_rfdetr.data.splits.build_split``: uint8
pixels, normalised on the device), ``float`` rfdetr's pipeline as it ships (``upstream_split``: ``ToDtype`` +
``Normalize`` on the host, float32 batches; what this project sent before). ``--loader-jpegs 640x480,1280x960``
writes a photo-like JPEG train split of each size (:func:`write_jpeg_split`) and reads those instead of
``data.dataset_dir``. For each DataLoader worker count it reads warm-up batches (one per worker, at least one: worker
start-up is not measured), then times ``--loader-batches`` batches back to back and reports images/s, images/s per
worker and the bytes of a batch; with ``--loader-repeats N`` each row is the best of N runs, the pipelines taking
turns (a shared host slows them alike). For 0 workers the main process is the one worker and loads with one torch
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
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
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
    from spmd_rfdetr.data.batches import make_train_loader

    loader = make_train_loader(dataset, dataclasses.replace(data, num_workers=workers), resolution, seed=seed,
                               float_pixels=True)  # rfdetr's float pipeline is one of the two measured
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
    del batch_iter, loader  # shuts the persistent workers down
    gc.collect()
    images = batches * data.global_batch_size
    rate = images / seconds
    per_worker = rate / max(1, workers)
    return {"workers": workers, "warmup_batches": warmup, "warmup_s": warmup_s, "batches": batches,
            "images": images, "seconds": seconds, "images_per_sec": rate, "images_per_sec_per_worker": per_worker,
            "ms_per_image_per_worker": 1e3 / per_worker, "image_dtype": str(batch["images"].dtype),
            "image_bytes_per_batch": batch["images"].nbytes, "batch_bytes": sum(v.nbytes for v in batch.values())}


def _xla_runtime_started() -> bool | None:
    """Whether anything started an XLA runtime in this process (``None``: torch_xla not even imported)."""
    if "torch_xla" not in sys.modules:
        return None
    return bool(sys.modules["torch_xla"]._XLAC._xla_runtime_is_initialized())


#: ``--loader-pipeline`` choices: the dataset builder of each (names in ``spmd_rfdetr.data.batches``).
PIPELINES = {"float": "upstream_split", "uint8": "build_split"}


def write_jpeg_split(root: Path, width: int, height: int, count: int, seed: int = 0) -> Path:
    """A Roboflow-layout dataset whose train split holds ``count`` photo-like JPEGs of ``width`` x ``height``
    (smooth colour fields plus sensor-like noise, quality 90, 4:2:0: ~100 KB at 640x480, ~380 KB at 1280x960, as
    camera photos) with 1-7 random boxes each, so decoding costs what real photos cost (flat synthetic shapes decode
    several times faster)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    split = root / "train"
    split.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for i in range(count):
        low = Image.fromarray((rng.random((height // 32 + 1, width // 32 + 1, 3)) * 255).astype(np.uint8))
        pixels = np.asarray(low.resize((width, height), Image.BICUBIC), np.float32)
        pixels += rng.normal(0, 8, (height, width, 3))
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(split / f"{i:05d}.jpg", "JPEG", quality=90)
        images.append({"id": i, "file_name": f"{i:05d}.jpg", "width": width, "height": height})
        for _ in range(int(rng.integers(1, 8))):
            w, h = int(rng.integers(20, width // 3)), int(rng.integers(20, height // 3))
            x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
            annotations.append({"id": len(annotations), "image_id": i, "category_id": int(rng.integers(1, 4)),
                                "bbox": [x, y, w, h], "area": w * h, "iscrowd": 0})
    categories = [{"id": 0, "name": "objects", "supercategory": "none"}] + [
        {"id": c, "name": f"class{c}", "supercategory": "objects"} for c in (1, 2, 3)]
    (split / "_annotations.coco.json").write_text(json.dumps(
        {"images": images, "annotations": annotations, "categories": categories}))
    return root


def _sources(args: argparse.Namespace, dataset_dir: str, batch: int) -> list[tuple[str, str]]:
    """``(label, dataset directory)`` per source of images: ``--loader-jpegs`` written to a temporary folder, or
    ``data.dataset_dir``."""
    if not args.loader_jpegs:
        if not dataset_dir or not os.path.isdir(dataset_dir):
            raise SystemExit(f"--loader: dataset directory {dataset_dir!r} not found (data.dataset_dir, --dataset-dir "
                             "or --loader-jpegs; e.g. python -m spmd_rfdetr synth --output_dir /tmp/synth)")
        return [(os.path.basename(os.path.normpath(dataset_dir)), dataset_dir)]
    sources, work = [], Path(tempfile.mkdtemp(prefix="spmd_rfdetr_loader_"))
    for size in args.loader_jpegs.split(","):
        width, height = (int(v) for v in size.lower().split("x"))
        t0 = time.perf_counter()
        write_jpeg_split(work / size, width, height, max(64, 2 * batch), seed=args.seed)
        print(f"[bench] loader: wrote {max(64, 2 * batch)} {size} JPEGs ({time.perf_counter() - t0:.1f} s)",
              file=sys.stderr, flush=True)
        sources.append((f"{width}x{height} JPEG", str(work / size)))
    return sources


def main_loader(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    from spmd_rfdetr.data import splits as data_module
    from spmd_rfdetr.model.upstream import upstream_configs

    workers = [int(w) for w in args.loader_workers.split(",") if w.strip()]
    if not workers or min(workers) < 0:
        raise SystemExit(f"--loader-workers {args.loader_workers!r}: comma-separated counts >= 0")
    pipelines = [p.strip() for p in args.loader_pipeline.split(",") if p.strip()]
    if not pipelines or set(pipelines) - set(PIPELINES):
        raise SystemExit(f"--loader-pipeline {args.loader_pipeline!r}: comma-separated, of {', '.join(PIPELINES)}")
    if args.loader_batches < 1 or args.loader_repeats < 1:
        raise SystemExit("--loader-batches and --loader-repeats must be >= 1")
    d = cfg.data
    if d.per_device_batch_size is not None:
        raise SystemExit("--loader needs a global batch: set data.global_batch_size or pass --batch")
    rows = []
    for label, dataset_dir in _sources(args, d.dataset_dir, d.global_batch_size):
        data = dataclasses.replace(d, dataset_dir=dataset_dir)
        cfgs = upstream_configs(cfg.model, data, cfg.optim, cfg.model.num_classes)
        resolution = cfgs.model.resolution
        datasets = {}
        for pipeline in pipelines:
            t0 = time.perf_counter()
            datasets[pipeline] = dataset = getattr(data_module, PIPELINES[pipeline])(cfgs, "train")
            if len(dataset) < d.global_batch_size:  # type: ignore[arg-type]
                raise SystemExit(f"{dataset_dir}: {len(dataset)} train images, fewer than the batch "
                                 f"{d.global_batch_size}")
            print(f"[bench] loader: {label}, {pipeline} pipeline, {len(dataset)} train images, {resolution}px, batch "
                  f"{d.global_batch_size} ({time.perf_counter() - t0:.1f} s to build)", file=sys.stderr, flush=True)
        for w in workers:  # the pipelines take turns, repeatedly: a busy host slows them alike
            runs = {p: [measure_workers(datasets[p], data, resolution, w, args.loader_batches, args.seed)
                        for _ in range(args.loader_repeats)] for p in pipelines}
            for pipeline in pipelines:
                best = max(runs[pipeline], key=lambda r: r["images_per_sec"])  # the least disturbed run
                rows.append({"source": label, "dataset_dir": dataset_dir, "pipeline": pipeline,
                             "dataset_images": len(datasets[pipeline]), **best,  # type: ignore[arg-type]
                             "repeats": len(runs[pipeline]),
                             "images_per_sec_runs": [r["images_per_sec"] for r in runs[pipeline]]})
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    payload = {
        "benchmark": "loader",
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config_file": args.config,
        "config": dataclasses.asdict(cfg),
        "dataset_dir": d.dataset_dir,
        "split": "train",
        "resolution": resolution,
        "global_batch": d.global_batch_size,
        "max_targets": d.max_targets,
        "multi_scale": d.multi_scale,
        "pipelines": pipelines,
        "bytes_per_batch": {p: {"images": r["image_bytes_per_batch"], "batch": r["batch_bytes"]}
                            for p in pipelines for r in rows[::-1] if r["pipeline"] == p},
        "host_cpus_available": cpus,
        "environment": environment(),
        "xla_runtime_started": _xla_runtime_started(),
        "rows": rows,
    }
    tag = f"{cfg.model.variant}-{resolution}-b{d.global_batch_size}-loader-cpu{cpus}-{datetime.date.today()}"
    json_path = args.json or RESULTS / f"{tag}.json"
    write_json(json_path, payload)
    plot_path = json_path.with_suffix(".png")
    plot_loader(plot_path, rows, f"{cfg.model.variant} train pipeline, {resolution}px, batch {d.global_batch_size}, "
                                 f"{cpus} CPU(s)")
    print(f"## input pipeline: rfdetr train dataset + transforms, {resolution}px, batch {d.global_batch_size}, "
          f"{args.loader_batches} batches per row, {cpus} CPU(s) available\n")
    print("| images | pipeline | DataLoader workers | images/s | images/s per worker | ms/image per worker | "
          "image bytes / batch | warm-up, s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['source']} | {r['pipeline']} ({r['image_dtype'].replace('torch.', '')}) | {r['workers']} | "
              f"{r['images_per_sec']:.1f} | {r['images_per_sec_per_worker']:.1f} | "
              f"{r['ms_per_image_per_worker']:.1f} | "
              f"{r['image_bytes_per_batch'] / 2**20:.1f} MiB | {r['warmup_s']:.2f} |")
    busiest = [r for r in rows if r["workers"] == max(w["workers"] for w in rows) and r["pipeline"] == pipelines[-1]]
    most = min(busiest, key=lambda r: r["images_per_sec_per_worker"])  # every core busy, slowest images: conservative
    print(f"\nat {most['images_per_sec_per_worker']:.1f} images/s per worker ({most['workers']} worker(s), "
          f"{most['source']}, {most['pipeline']}), feeding 1000 images/s takes about "
          f"{math.ceil(1000 / most['images_per_sec_per_worker'])} workers (and cores)")
    print(f"\nJSON: {json_path}\nplot: {plot_path}")
    return payload


def plot_loader(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """Images/s per worker, one group of bars per source of images and worker count, one bar per pipeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["source"], r["workers"]) for r in rows))
    pipelines = list(dict.fromkeys(r["pipeline"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups)), 4.5))
    width = 0.8 / len(pipelines)
    for k, pipeline in enumerate(pipelines):
        rate = {(r["source"], r["workers"]): r["images_per_sec_per_worker"] for r in rows if r["pipeline"] == pipeline}
        bars = ax.bar([i + (k - (len(pipelines) - 1) / 2) * width for i in range(len(groups))],
                      [rate.get(g, 0.0) for g in groups], width, label=pipeline)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(groups)), [f"{source}\n{workers} worker(s)" for source, workers in groups], fontsize=8)
    ax.set_ylabel("images/s per DataLoader worker")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

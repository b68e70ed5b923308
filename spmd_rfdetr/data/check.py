"""The data check: every problem in the annotations and images of the splits a run reads, before XLA compiles anything.

``python -m spmd_rfdetr check-data --config ...`` runs it alone; ``fit`` runs it right after the config check (the
train split, and ``eval.split`` when ``fit`` evaluates), ``validate`` on ``eval.split`` and ``predict`` on its
image folder. All findings are reported at once, grouped by kind with the fix, then a summary per split; any finding
that ``data.on_bad=skip`` does not cover raises :class:`DataError` (the CLI exits 2).

What is checked matches what rfdetr's readers will do (:mod:`spmd_rfdetr.data.files`): missing, empty, truncated or
non-image files; malformed COCO JSON or YOLO label lines; boxes of zero/negative size or outside the image; categories
missing from the category list (for valid/test: from the train split's label mapping, which rfdetr reuses); labels at
or above ``model.num_classes`` (on XLA an out-of-range class index is clamped, so training would silently learn the
wrong class); images over ``data.max_targets`` under ``data.on_overflow=error``; empty splits. Images without
annotations are allowed (negatives) and counted. For a ``seg-*`` model, every object's mask too
(:mod:`spmd_rfdetr.data.check_masks`).

Start-up that scales: ``data.check`` chooses how much is read (``full``: annotations and every image header;
``annotations``: no image opened; ``off``); images are opened on :data:`THREADS` threads; on several hosts host 0
checks and sends its report to the others; a result is cached (:mod:`spmd_rfdetr.data.check_cache`), so a second run on
unchanged annotations and settings (a resume) opens no image. One log line gives the duration.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from spmd_rfdetr.config.options import ConfigError, RunConfig, is_keypoint, is_segmentation
from spmd_rfdetr.config.length import evaluates_in_fit
from spmd_rfdetr.data import check_cache
from spmd_rfdetr.data import check_keypoints as keypoint_checks
from spmd_rfdetr.data import check_masks as mask_checks
from spmd_rfdetr.data.check_report import DataError, DataReport, SplitSummary  # check_data raises DataError
from spmd_rfdetr.data.files import Entry, Finding, SplitData, inspect_image, layout_of, read_split
from spmd_rfdetr.xla import hosts

log = logging.getLogger(__name__)

OUTSIDE_TOLERANCE_PX = 1.0  # exports round box corners: this much past the edge is not a finding
PROGRESS_FROM = 500  # images: show a progress bar (on a terminal) from this many on
#: Threads opening images. Opening a header is I/O-bound (the GIL is released while waiting), so threads overlap a
#: network mount's latency. Measured on 2,200 synthetic 640 px images, 2 shared cores, read from the local disk (the
#: whole check, medians of 5): JPEG 0.7 s on 1 thread, no faster on 8 (headers only); PNG (CRCs) 1.6 s -> 0.9 s; with
#: 5 ms per image open (a network mount, simulated) 13.2 s -> 1.75 s on 8 -> 0.92 s on 32. Processes would pay their
#: start (spawn: 0.3 s) and must not fork a process whose XLA runtime runs threads.
THREADS = min(32, 4 * (os.cpu_count() or 1))
Looked = dict[Path, tuple[tuple[int, int] | None, str]]  # image path -> inspect_image's (size, problem)


def fit_splits(cfg: RunConfig) -> list[str]:
    """The splits ``fit`` reads: train, and ``eval.split`` when evaluation is on."""
    evaluates = evaluates_in_fit(cfg) and cfg.eval.split != "train"
    return ["train", cfg.eval.split] if evaluates else ["train"]


def check_data(cfg: RunConfig, splits: Sequence[str] | None = None, *, images: str | None = None) -> DataReport:
    """Check ``splits`` of ``data.dataset_dir`` (default: :func:`fit_splits`, as training reads them) and the image
    folder ``images``.

    Raises :class:`DataError` listing every problem not skipped by ``data.on_bad``; returns the report otherwise.
    ``data.check=off`` returns an empty report (a warning says nothing was checked). On several hosts host 0 checks
    and every host gets its report, so all of them return or raise alike.
    """
    training = splits is None  # fit's splits: the train split is trained on (skippable problems, batch size)
    splits = fit_splits(cfg) if splits is None else list(splits)
    if cfg.data.check not in ("full", "annotations", "off"):
        raise ConfigError(f"data.check={cfg.data.check!r}: use full, annotations or off")
    if cfg.data.check == "off":
        log.warning("data.check=off: %s is not checked; a bad image or label will stop training later, or train it "
                    "wrong", cfg.data.dataset_dir)
        return DataReport(str(Path(cfg.data.dataset_dir)), cfg.data.on_bad)
    start, checked_here = time.perf_counter(), []

    def make() -> bytes:  # host 0's part
        checked_here.append(True)
        return _report(cfg, splits, training, images).to_json().encode()

    report = DataReport.from_json(hosts.from_coordinator(make).decode())
    if not checked_here:
        report.took = f"host 0's check: {report.took}; {time.perf_counter() - start:.2f} s here"
    report.finish()
    return report


def _report(cfg: RunConfig, splits: list[str], training: bool, images: str | None) -> DataReport:
    """The check's report: cached when the annotations and settings are unchanged (dataset splits only), else made."""
    start = time.perf_counter()
    key = check_cache.fingerprint(cfg, splits, training) if splits and images is None else None
    if key and is_segmentation(cfg.model.variant):  # the mask findings: a key of their own
        key = mask_checks.cache_key(key)
    if key and is_keypoint(cfg.model.variant):  # the keypoint findings too
        key = keypoint_checks.cache_key(key)
    cached = check_cache.load(key) if key else None
    if cached:
        try:
            report = DataReport.from_json(cached[0])
        except (ValueError, KeyError, TypeError):
            log.warning("data check: %s is not a cached result; checking again", cached[1])
        else:
            report.took = f"cached, {time.perf_counter() - start:.2f} s"
            log.info("data check of %s: result cached in %s (annotations and settings unchanged); delete that file "
                     "to check again", report.dataset_dir, cached[1])
            return report
    root = Path(cfg.data.dataset_dir)
    report = DataReport(str(root), cfg.data.on_bad)
    opened = 0
    if splits:
        opened += _check_dataset(report, root, cfg, splits, training)
    if images is not None:
        opened += _check_folder(report, Path(images), cfg.data.check)
    report.took = f"{time.perf_counter() - start:.2f} s, "
    if cfg.data.check != "full":
        report.took += f"data.check={cfg.data.check}: no image opened"
    else:
        threads = min(THREADS, opened)
        report.took += f"{opened:,} images" + (f", {threads} thread{'s' * (threads > 1)}" if opened else "")
    if key:
        check_cache.store(key, report.to_json())
    return report


def _check_dataset(report: DataReport, root: Path, cfg: RunConfig, splits: list[str], training: bool) -> int:
    """Read each split (annotations first, then every image header unless ``data.check=annotations``) and judge what
    training will see; returns how many images were opened."""
    if not root.is_dir():
        report.findings.append(Finding("-", str(root), "missing_file", "data.dataset_dir is not a directory"))
        return 0
    try:
        layout = layout_of(root, cfg.data.dataset_format)
    except ValueError as error:
        report.findings.append(Finding("-", str(root), "missing_file", str(error)))
        return 0
    if layout == "coco2017" and cfg.model.num_classes is None:
        report.findings.append(Finding("-", str(root), "label_range", "the COCO 2017 layout's labels are the raw "
                                       "category ids: set model.num_classes (>= the largest id; COCO: 90)"))
    read: dict[str, SplitData] = {}
    if layout == "coco" and (splits != ["train"]):  # valid/test take their labels from the train split's mapping
        read["train"] = read_split(root, layout, "train", None)
        if read["train"].labels is None and "train" not in splits:
            report.findings += [f for f in read["train"].findings if f.kind in ("missing_file", "bad_json")]
    train_labels = read["train"].labels if "train" in read else None
    for split in splits:
        if split not in read:
            read[split] = read_split(root, layout, split, train_labels)
    full = cfg.data.check == "full"
    looked = _inspect_all([e.path for s in splits for e in read[s].entries]) if full else None
    for split in splits:
        report.findings += read[split].findings
        _check_split(report, read[split], cfg, layout, root, looked, train=training and split == "train")
    if not full:
        report.notes.append("images not opened (data.check=annotations): boxes checked against the sizes the "
                            "annotations declare")
    return len(looked or ())


def _inspect_all(paths: list[Path]) -> Looked:
    """:func:`inspect_image` of every path (each once), on :data:`THREADS` threads, with a progress bar."""
    unique = list(dict.fromkeys(paths))
    quiet = None if len(unique) >= PROGRESS_FROM else True  # None: shown on a terminal
    looked: Looked = {}
    with ThreadPoolExecutor(THREADS, thread_name_prefix="check-data") as pool, \
            tqdm(total=len(unique), desc="check-data", unit="img", disable=quiet) as bar:
        for path, result in zip(unique, pool.map(inspect_image, unique)):
            looked[path] = result
            bar.update()
    return looked


def _check_split(report: DataReport, data: SplitData, cfg: RunConfig, layout: str, root: Path, looked: Looked | None,
                 *, train: bool) -> None:
    """One split's images, boxes, labels, overflow and size; ``train``: the split ``fit`` trains on; ``looked``: what
    the image headers said (``None``: images not opened, sizes as the annotations declare them)."""
    # lazy: data.splits imports rfdetr (torch_xla): the CLI imports this module before the device choice
    from spmd_rfdetr.data.splits import count_overflow

    summary, split, d = SplitSummary(data.split, data.readable), data.split, cfg.data
    counts: dict[str, int] = {}
    per_object = is_segmentation(cfg.model.variant) or is_keypoint(cfg.model.variant)  # masks or keypoints
    sizes: dict[str, tuple[int, int] | None] | None = {} if per_object else None
    paths = {entry.name: entry.path for entry in data.entries}
    for entry in data.entries:
        real = [box for box in entry.boxes if not box.crowd]
        counts[entry.name] = len(real)
        size, problem = looked[entry.path] if looked is not None else (entry.declared, "")
        if problem:  # rfdetr's YOLO reader opens every image while it builds the split: no skipping there
            report.findings.append(Finding(split, str(entry.path), "bad_image", problem, image=entry.name,
                                           skippable=train and layout != "yolo"))
            continue
        summary.images += 1
        summary.boxes += len(real)
        summary.negatives += int(not real)
        for box in real:
            report.findings += _box_findings(box, entry, size, data, cfg, train)
        if sizes is not None:
            sizes[entry.name] = size
    if sizes is not None and layout != "yolo" and is_segmentation(cfg.model.variant):  # YOLO: rfdetr's own line
        report.findings = mask_checks.merge(report.findings, mask_checks.mask_findings(data, sizes, train=train))
    if sizes is not None and layout != "yolo" and is_keypoint(cfg.model.variant):  # parser reads polygons, points
        found, notes = keypoint_checks.keypoint_findings(data, sizes, train=train)
        report.findings += found
        report.notes += notes
    overflow = count_overflow(counts, d.max_targets)
    if overflow.files and d.on_overflow == "error":
        report.findings += [Finding(split, str(paths[name]), "overflow", f"{counts[name]} objects, "
                                    f"data.max_targets={d.max_targets}", image=name) for name in overflow.files]
    elif overflow.files:
        report.notes.append(f"{split}: {overflow.describe(d.max_targets)}; their largest boxes are kept "
                            "(data.on_overflow=truncate)")
    if data.readable and summary.images == 0:
        report.findings.append(Finding(split, str(root / split), "empty_split", "no readable images"))
    elif train and data.readable and summary.images < d.global_batch_size:
        report.findings.append(Finding(split, str(root / split), "too_few_images", f"{summary.images} "
                                       f"usable images, data.global_batch_size={d.global_batch_size}"))
    report.summaries.append(summary)


def _box_findings(box: Any, entry: Entry, size: tuple[int, int] | None, data: SplitData, cfg: RunConfig,
                  train: bool) -> list[Finding]:
    """Geometry and label problems of one non-crowd box on a readable image of ``size`` (``None``: unknown, so only
    the box's own size is checked)."""
    x1, y1, x2, y2 = box.xyxy
    width, height = size or (1, 1)
    if entry.normalised:
        x1, y1, x2, y2 = x1 * width, y1 * height, x2 * width, y2 * height
    found, split, source = [], data.split, str(entry.source)
    shown_box = f"box [{x1:g}, {y1:g}, {x2:g}, {y2:g}] (x1 y1 x2 y2) on {Path(entry.name).name}"
    shown_box += f" ({width}x{height})" if size else ""
    if x2 <= x1 or y2 <= y1:
        found.append(Finding(split, source, "degenerate_box", shown_box, box.ann, entry.name, skippable=train))
    elif size and (min(x1, y1) < -OUTSIDE_TOLERANCE_PX or x2 > width + OUTSIDE_TOLERANCE_PX
                   or y2 > height + OUTSIDE_TOLERANCE_PX):
        found.append(Finding(split, source, "box_outside", shown_box, box.ann, entry.name, skippable=train))
    n = cfg.model.num_classes
    if n is None:  # read from the dataset: rfdetr's label space covers every label
        return found
    if data.num_labels is None:  # raw COCO ids: rfdetr's head has num_classes + 1 outputs (COCO: ids 1..90, 90)
        bad, rule = not 0 <= box.label <= n, f"> model.num_classes={n} (COCO 2017 layout: labels are the raw ids)"
    else:
        bad, rule = box.label >= n, f">= model.num_classes={n} (the dataset has {data.num_labels} classes)"
    if bad:
        found.append(Finding(split, source, "label_range", f"category {box.category} trains as label {box.label} "
                             f"{rule}", box.ann, entry.name))
    return found


def _check_folder(report: DataReport, folder: Path, level: str) -> int:
    """``predict``'s image folder: every image readable (``level`` ``annotations``: only listed); returns how many
    images were opened."""
    # lazy: only predict's image folder check needs data.images (a torch dataset module)
    from spmd_rfdetr.data.images import IMAGE_SUFFIXES

    if not folder.is_dir():
        report.findings.append(Finding("images", str(folder), "missing_file", "--images is not a directory"))
        return 0
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        report.findings.append(Finding("images", str(folder), "empty_split", f"no {', '.join(IMAGE_SUFFIXES)} files"))
    if level != "full":
        return 0
    looked = _inspect_all(files)
    for path in files:
        _, problem = looked[path]
        if problem:
            report.findings.append(Finding("images", str(path), "bad_image", problem, image=path.name))
    return len(files)

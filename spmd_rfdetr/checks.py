"""The data check: every problem in the annotations and images of the splits a run reads, before XLA compiles anything.

``python -m spmd_rfdetr check-data --config ...`` runs it alone; ``fit`` runs it right after the config check (the
train split, and ``eval.split`` when ``eval.every_steps > 0``), ``validate`` on ``eval.split`` and ``predict`` on its
image folder. All findings are reported at once, grouped by kind with the fix, then a summary per split; any finding
that ``data.on_bad=skip`` does not cover raises :class:`DataError` (the CLI exits 2).

What is checked matches what rfdetr's readers will do (:mod:`spmd_rfdetr.dataset_files`): missing, empty, truncated or
non-image files; malformed COCO JSON or YOLO label lines; boxes of zero/negative size or outside the image; categories
missing from the category list (for valid/test: from the train split's label mapping, which rfdetr reuses); labels at
or above ``model.num_classes`` (on XLA an out-of-range class index is clamped, so training would silently learn the
wrong class); images over ``data.max_targets`` under ``data.on_overflow=error``; empty splits. Images without
annotations are allowed (negatives) and counted.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from spmd_rfdetr.config import RunConfig
from spmd_rfdetr.dataset_files import Finding, SplitData, inspect_image, layout_of, read_split

log = logging.getLogger(__name__)

#: kind -> (what it is, how to fix it); ``overflow``'s fix is ``data.OVERFLOW_FIX``.
KINDS: dict[str, tuple[str, str]] = {
    "missing_file": ("file or folder not found", "check data.dataset_dir and data.dataset_format (roboflow: "
                     "<split>/_annotations.coco.json or a YOLO data.yaml; coco: annotations/instances_*2017.json)"),
    "bad_json": ("annotation file unreadable", "re-export it as COCO JSON: an object with lists 'images', "
                 "'categories' and 'annotations'"),
    "bad_schema": ("annotation entry malformed", "fix or delete the entry: images need 'id' and 'file_name'; "
                   "annotations 'id', 'image_id', 'category_id', 'bbox' [x, y, w, h] and 'area'; categories 'id' "
                   "and 'name'"),
    "bad_label_file": ("YOLO label line malformed", "each line is 'class_id cx cy w h' (fractions of the image) "
                       "or 'class_id' then polygon x y pairs"),
    "unknown_category": ("category not in the category list", "add the category to the categories (valid/test "
                         "splits use the train split's) or correct the annotation"),
    "label_range": ("label >= model.num_classes", "raise model.num_classes or leave it unset to read it from the "
                    "dataset (on XLA an out-of-range class index is clamped: training would go on, silently wrong)"),
    "bad_image": ("image missing or unreadable", "restore or re-export the image, or delete it and its annotations; "
                  "data.on_bad=skip trains without it (train split, COCO layouts)"),
    "degenerate_box": ("box of zero or negative size", "correct or delete the annotation; data.on_bad=skip lets "
                       "rfdetr drop it (train split)"),
    "box_outside": ("box outside the image", "correct the box; data.on_bad=skip lets rfdetr clip it to the image "
                    "(train split)"),
    "overflow": ("more objects than data.max_targets", ""),
    "empty_split": ("split has no usable images", "point data.dataset_dir at a dataset whose split has images"),
    "too_few_images": ("fewer train images than one batch", "lower data.global_batch_size or add images"),
}
SHOWN_PER_KIND = 20  # findings listed per kind; the rest are counted
OUTSIDE_TOLERANCE_PX = 1.0  # exports round box corners: this much past the edge is not a finding
PROGRESS_FROM = 500  # images: show a progress bar (on a terminal) from this many on


class DataError(ValueError):
    """The dataset has problems the run cannot go on with; the message lists all of them with their fixes."""


@dataclass
class SplitSummary:
    """What a split holds, as training will read it."""

    split: str
    readable: bool = True  # False: its annotations could not be read
    images: int = 0  # readable images
    boxes: int = 0  # non-crowd objects on them
    negatives: int = 0  # readable images without objects (allowed)

    def __str__(self) -> str:
        if not self.readable:
            return f"{self.split}: annotations unreadable"
        return f"{self.split}: {self.images} images ({self.negatives} without annotations), {self.boxes} boxes"


@dataclass
class DataReport:
    """Every finding of one check, the per-split summaries and what ``data.on_bad=skip`` leaves out."""

    dataset_dir: str
    on_bad: str
    findings: list[Finding] = field(default_factory=list)
    summaries: list[SplitSummary] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        """Findings that stop the run."""
        return [f for f in self.findings if not (f.skippable and self.on_bad == "skip")]

    @property
    def skipped(self) -> list[Finding]:
        """Findings ``data.on_bad=skip`` lets the run go on without."""
        return [f for f in self.findings if f.skippable and self.on_bad == "skip"]

    def skipped_images(self, split: str) -> set[str]:
        """File names (as the annotations write them) of the ``split`` images training leaves out."""
        return {f.image for f in self.skipped if f.split == split and f.kind == "bad_image"}

    def usable(self, dataset: Any, split: str) -> Any:
        """rfdetr's ``dataset`` of ``split`` without the images ``data.on_bad=skip`` leaves out (a ``Subset``)."""
        skip = self.skipped_images(split)
        if not skip:
            return dataset
        from rfdetr.datasets import get_coco_api_from_dataset
        from torch.utils.data import Subset

        coco = get_coco_api_from_dataset(dataset)
        keep = [i for i, image_id in enumerate(dataset.ids) if coco.imgs[image_id]["file_name"] not in skip]
        return Subset(dataset, keep)

    def describe(self, findings: Sequence[Finding]) -> str:
        """Findings grouped by kind, each kind with its fix, at most :data:`SHOWN_PER_KIND` listed per kind."""
        by_kind: dict[str, list[Finding]] = defaultdict(list)
        for finding in findings:
            by_kind[finding.kind].append(finding)
        lines = []
        for kind, group in by_kind.items():
            lines.append(f"  {KINDS[kind][0]} ({len(group)}): fix: {_fix(kind)}")
            for f in group[:SHOWN_PER_KIND]:
                where = f" ({f.ann})" if f.ann else ""
                shown = _shown(Path(f.file), Path(self.dataset_dir))
                lines.append(f"    - [{f.split}] {shown}{where}: {f.detail}")
            if len(group) > SHOWN_PER_KIND:
                lines.append(f"    ... and {len(group) - SHOWN_PER_KIND} more")
        return "\n".join(lines)

    def summary(self) -> str:
        return "; ".join([str(s) for s in self.summaries] + self.notes)

    def finish(self) -> None:
        """Log the summary and what is skipped; raise :class:`DataError` listing every error."""
        errors, skipped = self.errors, self.skipped
        if errors:
            raise DataError(
                f"data check of {self.dataset_dir}: {len(errors)} problem(s)"
                + (f" (and {len(skipped)} that data.on_bad=skip would skip)" if skipped else "")
                + f"\n{self.describe(errors)}\nchecked: {self.summary()}"
            )
        if skipped:
            log.warning("data check of %s: data.on_bad=skip leaves out %d image(s) and lets rfdetr drop or clip %d "
                        "box(es):\n%s", self.dataset_dir, sum(f.kind == "bad_image" for f in skipped),
                        sum(f.kind != "bad_image" for f in skipped), self.describe(skipped))
        log.info("data check of %s: ok; %s", self.dataset_dir, self.summary())


def fit_splits(cfg: RunConfig) -> list[str]:
    """The splits ``fit`` reads: train, and ``eval.split`` when evaluation is on."""
    evaluates = cfg.eval.every_steps > 0 and cfg.eval.split != "train"
    return ["train", cfg.eval.split] if evaluates else ["train"]


def check_data(cfg: RunConfig, splits: Sequence[str] | None = None, *, images: str | None = None) -> DataReport:
    """Check ``splits`` of ``data.dataset_dir`` (default: :func:`fit_splits`, as training reads them) and the image
    folder ``images``.

    Raises :class:`DataError` listing every problem not skipped by ``data.on_bad``; returns the report otherwise.
    """
    training = splits is None  # fit's splits: the train split is trained on (skippable problems, batch size)
    splits = fit_splits(cfg) if splits is None else list(splits)
    root = Path(cfg.data.dataset_dir)
    report = DataReport(str(root), cfg.data.on_bad)
    if splits:
        _check_dataset(report, root, cfg, splits, training)
    if images is not None:
        _check_folder(report, Path(images))
    report.finish()
    return report


def _check_dataset(report: DataReport, root: Path, cfg: RunConfig, splits: list[str], training: bool) -> None:
    """Read each split (annotations first, then every image header) and judge what training will see."""
    if not root.is_dir():
        report.findings.append(Finding("-", str(root), "missing_file", "data.dataset_dir is not a directory"))
        return
    try:
        layout = layout_of(root, cfg.data.dataset_format)
    except ValueError as error:
        report.findings.append(Finding("-", str(root), "missing_file", str(error)))
        return
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
    total = sum(len(read[s].entries) for s in splits)
    with tqdm(total=total, desc="check-data", unit="img", disable=None if total >= PROGRESS_FROM else True) as bar:
        for split in splits:
            report.findings += read[split].findings
            _check_split(report, read[split], cfg, layout, root, bar, train=training and split == "train")


def _check_split(report: DataReport, data: SplitData, cfg: RunConfig, layout: str, root: Path, bar: Any, *,
                 train: bool) -> None:
    """One split's images, boxes, labels, overflow and size; ``train``: the split ``fit`` trains on."""
    from spmd_rfdetr.data import count_overflow

    summary, split, d = SplitSummary(data.split, data.readable), data.split, cfg.data
    counts: dict[str, int] = {}
    paths = {entry.name: entry.path for entry in data.entries}
    for entry in data.entries:
        bar.update()
        real = [box for box in entry.boxes if not box.crowd]
        counts[entry.name] = len(real)
        size, problem = inspect_image(entry.path)
        if problem:  # rfdetr's YOLO reader opens every image while it builds the split: no skipping there
            report.findings.append(Finding(split, str(entry.path), "bad_image", problem, image=entry.name,
                                           skippable=train and layout != "yolo"))
            continue
        summary.images += 1
        summary.boxes += len(real)
        summary.negatives += int(not real)
        width, height = size  # type: ignore[misc]
        for box in real:
            report.findings += _box_findings(box, entry, width, height, data, cfg, train)
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


def _box_findings(box: Any, entry: Any, width: int, height: int, data: SplitData, cfg: RunConfig,
                  train: bool) -> list[Finding]:
    """Geometry and label problems of one non-crowd box on a readable image."""
    x1, y1, x2, y2 = box.xyxy
    if entry.normalised:
        x1, y1, x2, y2 = x1 * width, y1 * height, x2 * width, y2 * height
    found, split, source = [], data.split, str(entry.source)
    shown_box = f"box [{x1:g}, {y1:g}, {x2:g}, {y2:g}] (x1 y1 x2 y2) on {Path(entry.name).name} ({width}x{height})"
    if x2 <= x1 or y2 <= y1:
        found.append(Finding(split, source, "degenerate_box", shown_box, box.ann, entry.name, skippable=train))
    elif min(x1, y1) < -OUTSIDE_TOLERANCE_PX or x2 > width + OUTSIDE_TOLERANCE_PX or y2 > height + OUTSIDE_TOLERANCE_PX:
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


def _check_folder(report: DataReport, folder: Path) -> None:
    """``predict``'s image folder: every image readable."""
    from spmd_rfdetr.images import IMAGE_SUFFIXES

    if not folder.is_dir():
        report.findings.append(Finding("images", str(folder), "missing_file", "--images is not a directory"))
        return
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        report.findings.append(Finding("images", str(folder), "empty_split", f"no {', '.join(IMAGE_SUFFIXES)} files"))
    for path in files:
        _, problem = inspect_image(path)
        if problem:
            report.findings.append(Finding("images", str(path), "bad_image", problem, image=path.name))


def _fix(kind: str) -> str:
    if kind == "overflow":
        from spmd_rfdetr.data import OVERFLOW_FIX

        return OVERFLOW_FIX
    return KINDS[kind][1]


def _shown(path: Path, root: Path) -> str:
    """``path`` relative to the dataset root when it lies inside it."""
    try:
        relative = Path(path).relative_to(root)
    except ValueError:
        return str(path)
    return str(path) if relative == Path() else str(relative)

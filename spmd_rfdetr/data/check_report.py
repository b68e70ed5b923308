"""What the data check found: the kinds of problem with their fixes, each split's summary, and the report that raises
:class:`DataError` listing every error (the CLI exits 2)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spmd_rfdetr.data import check_keypoints as keypoint_checks
from spmd_rfdetr.data import check_masks as mask_checks
from spmd_rfdetr.data.files import Finding

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
    **mask_checks.MASK_KINDS,
    **keypoint_checks.KEYPOINT_KINDS,
}


SHOWN_PER_KIND = 20  # findings listed per kind; the rest are counted


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
    took: str = field(default="", compare=False)  # how the result came: "12.3 s, 2,000 images, 8 threads", "cached"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DataReport:
        """The report :meth:`to_json` wrote (``ValueError``/``KeyError``/``TypeError`` if it is not one)."""
        d = json.loads(text)
        return cls(d["dataset_dir"], d["on_bad"], [Finding(**f) for f in d["findings"]],
                   [SplitSummary(**s) for s in d["summaries"]], list(d["notes"]), d.get("took", ""))

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
        # lazy: rfdetr imports torch_xla: the CLI imports this module before the device choice
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
                + f"\n{self.describe(errors)}\nchecked: {self.summary()}{self._took()}"
            )
        if skipped:
            log.warning("data check of %s: data.on_bad=skip leaves out %d image(s) and lets rfdetr drop or clip %d "
                        "box(es):\n%s", self.dataset_dir, sum(f.kind == "bad_image" for f in skipped),
                        sum(f.kind != "bad_image" for f in skipped), self.describe(skipped))
        log.info("data check of %s: ok; %s%s", self.dataset_dir, self.summary(), self._took())

    def _took(self) -> str:
        return f" ({self.took})" if self.took else ""


def _fix(kind: str) -> str:
    if kind == "overflow":
        # lazy: data.splits imports rfdetr (torch_xla): the CLI imports this module before the device choice
        from spmd_rfdetr.data.splits import OVERFLOW_FIX

        return OVERFLOW_FIX
    return KINDS[kind][1]


def _shown(path: Path, root: Path) -> str:
    """``path`` relative to the dataset root when it lies inside it."""
    try:
        relative = Path(path).relative_to(root)
    except ValueError:
        return str(path)
    return str(path) if relative == Path() else str(relative)

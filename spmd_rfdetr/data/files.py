"""Read a split's annotation files and image headers the way rfdetr's readers will, without building its datasets.

What training sees is rfdetr's: the COCO readers (``rfdetr.datasets.coco``) take label indices from the categories of
``train/_annotations.coco.json`` that ``filter_parent_categories`` keeps (Roboflow layout; the other splits reuse the
train mapping) or use the raw ``category_id`` (COCO 2017 layout, ``remap_category_ids=False``); the YOLO reader takes
the class id of each label line, checked against ``data.yaml``'s names, and parses it with rfdetr's own line parser.
Every problem becomes a :class:`Finding`; :mod:`spmd_rfdetr.data.check` judges them.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

#: rfdetr's split name per our split name (its builders say ``val``; Roboflow folders say ``valid``).
UPSTREAM_SPLITS = {"train": "train", "valid": "val", "test": "test"}
COCO2017 = {"train": ("train2017", "instances_train2017.json"), "valid": ("val2017", "instances_val2017.json"),
            "test": ("test2017", "image_info_test-dev2017.json")}


@dataclass(frozen=True)
class Finding:
    """One problem: where (split, file, annotation), which kind (a key of ``checks.KINDS``) and what exactly."""

    split: str
    file: str
    kind: str
    detail: str
    ann: str = ""  # "annotation 12", "line 3", or "" for the whole file
    image: str = ""  # the image's file name as the annotations write it (what ``data.on_bad=skip`` leaves out)
    skippable: bool = False  # ``data.on_bad=skip`` may leave it out


@dataclass
class Box:
    """One object as training will read it."""

    ann: str  # "annotation <id>" or "line <n>"
    category: int  # COCO category_id / YOLO class id
    label: int | None  # label index training sees; None if the category is unknown (already a finding)
    xyxy: tuple[float, float, float, float]  # pixels, or fractions of the image when ``Entry.normalised``
    crowd: bool = False


@dataclass
class Entry:
    """One image of a split and its objects."""

    name: str  # the file name as the annotations write it (what ``data.on_bad=skip`` leaves out)
    path: Path
    source: Path  # the annotation or label file its boxes come from
    boxes: list[Box] = field(default_factory=list)
    normalised: bool = False
    declared: tuple[int, int] | None = None  # (width, height) as the annotations declare it (COCO), if they do


@dataclass
class SplitData:
    """A split read from disk: its images, the problems met while reading, and its label space."""

    split: str
    entries: list[Entry] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    num_labels: int | None = None  # size of the contiguous label space; None: labels are raw COCO category ids
    labels: dict[int, int] | None = None  # the category_id -> label mapping used (Roboflow COCO)
    readable: bool = True  # False when the annotations could not be read at all

    def fail(self, file: Path | str, kind: str, detail: str, ann: str = "") -> None:
        self.findings.append(Finding(self.split, str(file), kind, detail, ann))


def layout_of(root: Path, dataset_format: str) -> str:
    """``coco`` (Roboflow COCO), ``yolo`` or ``coco2017``: the reader rfdetr's ``build_dataset`` will pick."""
    if dataset_format == "coco":
        return "coco2017"
    if dataset_format == "yolo":
        return "yolo"
    # lazy: rfdetr imports torch_xla: the CLI imports this module before the device choice
    from rfdetr.datasets import detect_roboflow_format

    return detect_roboflow_format(root)  # ValueError names what it looked for


def read_split(root: Path, layout: str, split: str, train_labels: dict[int, int] | None) -> SplitData:
    """Read ``split`` of the dataset at ``root``; ``train_labels`` is the train split's mapping (Roboflow COCO)."""
    if layout == "yolo":
        return _read_yolo(root, split)
    if layout == "coco2017":
        folder, ann_file = COCO2017[split]
        return _read_coco(root / "annotations" / ann_file, root / folder, split, labels=None)
    return _read_coco(root / split / "_annotations.coco.json", root / split, split,
                      labels=train_labels if split != "train" else None, remap=True)


def split_inputs(root: Path, layout: str, split: str) -> tuple[list[Path], list[Path], list[Path]]:
    """What :func:`read_split` reads of ``split`` besides image contents: ``(annotation files, folders of label files,
    image folders)``; YOLO's label files are those of the label folder, one per image."""
    if layout == "yolo":
        # lazy: rfdetr imports torch_xla: the CLI imports this module before the device choice
        from rfdetr.datasets.yolo import _resolve_yolo_split_dirs, find_yolo_data_file

        data_file = find_yolo_data_file(root, default=root / "data.yaml")
        assert data_file is not None
        try:
            img_dir, lb_dir = _resolve_yolo_split_dirs(root, data_file, UPSTREAM_SPLITS[split])
        except (OSError, ValueError):
            return [data_file], [], []
        return [data_file], [Path(lb_dir)], [Path(img_dir)]
    if layout == "coco2017":
        folder, ann_file = COCO2017[split]
        return [root / "annotations" / ann_file], [], [root / folder]
    return [root / split / "_annotations.coco.json"], [], [root / split]


def coco_label_map(data: dict[str, Any]) -> dict[int, int]:
    """rfdetr's ``category_id -> label`` mapping of a parsed, schema-checked COCO file (as ``CocoDetection``'s)."""
    # lazy: rfdetr imports torch_xla: the CLI imports this module before the device choice
    from rfdetr.datasets.coco import annotated_category_ids, filter_parent_categories

    kept = filter_parent_categories(data["categories"], annotated_category_ids(data))
    return {int(category["id"]): label for label, category in enumerate(kept)}


def load_coco(path: Path, out: SplitData) -> dict[str, Any] | None:
    """Parse a COCO file and keep only schema-valid entries (each bad one becomes a finding); ``None`` if unusable."""
    if not path.is_file():
        out.fail(path, "missing_file", "annotation file not found")
        return None
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        out.fail(path, "bad_json", f"not readable as JSON ({error})")
        return None
    if not isinstance(data, dict) or not all(isinstance(data.get(k, []), list) for k in ("images", "categories",
                                                                                         "annotations")):
        out.fail(path, "bad_json", "top level must be an object with lists 'images', 'categories', 'annotations'")
        return None
    if "images" not in data or "categories" not in data:
        out.fail(path, "bad_json", "missing the 'images' or 'categories' list")
        return None
    images, image_ids = [], set()
    for i, image in enumerate(data["images"]):
        where = f"images[{i}]"
        if not isinstance(image, dict) or not _is_int(image.get("id")) or not isinstance(image.get("file_name"), str):
            out.fail(path, "bad_schema", "an image needs an integer 'id' and a string 'file_name'", where)
        elif image["id"] in image_ids:
            out.fail(path, "bad_schema", f"duplicate image id {image['id']}", where)
        else:
            image_ids.add(image["id"])
            images.append(image)
    categories, category_ids = [], set()
    for i, category in enumerate(data["categories"]):
        if not isinstance(category, dict) or not _is_int(category.get("id")) or "name" not in category:
            out.fail(path, "bad_schema", "a category needs an integer 'id' and a 'name'", f"categories[{i}]")
        else:
            category_ids.add(category["id"])
            categories.append(category)
    annotations = []
    for i, ann in enumerate(data.get("annotations", [])):
        where = f"annotation {ann.get('id', f'#{i}')}" if isinstance(ann, dict) else f"annotations[{i}]"
        problem = _annotation_problem(ann, image_ids)
        if problem:
            out.fail(path, "bad_schema", problem, where)
        elif ann["category_id"] not in category_ids and not ann.get("iscrowd", 0):
            out.fail(path, "unknown_category", f"category_id {ann['category_id']} is not in the file's categories "
                     f"(ids {_ids(category_ids)})", where)
        else:
            annotations.append(ann)
    return {"images": images, "categories": categories, "annotations": annotations}


def _annotation_problem(ann: Any, image_ids: set[int]) -> str:
    """What keeps rfdetr's ``ConvertCoco`` from reading this annotation ('' if nothing)."""
    if not isinstance(ann, dict):
        return "an annotation must be an object"
    missing = [k for k in ("id", "image_id", "category_id", "bbox", "area") if k not in ann]
    if missing:
        return f"missing {', '.join(repr(k) for k in missing)}"
    if not _is_int(ann["category_id"]) or not _is_int(ann["image_id"]):
        return "'image_id' and 'category_id' must be integers"
    if ann["image_id"] not in image_ids:
        return f"image_id {ann['image_id']} is not in the file's images"
    bbox = ann["bbox"]
    if not isinstance(bbox, list) or len(bbox) != 4 or not all(_is_finite(v) for v in bbox):
        return f"'bbox' must be 4 finite numbers [x, y, width, height], got {bbox!r}"
    if not _is_finite(ann["area"]):
        return f"'area' must be a number, got {ann['area']!r}"
    return ""


def _read_coco(ann_file: Path, img_dir: Path, split: str, labels: dict[int, int] | None,
               remap: bool = False) -> SplitData:
    out = SplitData(split)
    data = load_coco(ann_file, out)
    if data is None:
        out.readable = False
        return out
    if remap and labels is None:  # the train split (or a split whose train mapping is unreadable): its own mapping
        labels = coco_label_map(data)
    out.labels, out.num_labels = labels, len(labels) if labels is not None else None
    by_image: dict[int, list[Box]] = {image["id"]: [] for image in data["images"]}
    for ann in data["annotations"]:
        crowd = bool(ann.get("iscrowd", 0))
        category = ann["category_id"]
        label = labels.get(category) if labels is not None else category
        where = f"annotation {ann['id']}"
        if label is None and not crowd:
            out.fail(ann_file, "unknown_category", f"category_id {category} has no label in the train split's "
                     f"categories (ids {_ids(labels or {})}); rfdetr's reader would stop on it", where)
            continue
        x, y, w, h = (float(v) for v in ann["bbox"])
        by_image[ann["image_id"]].append(Box(where, category, label, (x, y, x + w, y + h), crowd))
    out.entries = [Entry(image["file_name"], img_dir / image["file_name"], ann_file, by_image[image["id"]],
                         declared=_declared_size(image)) for image in data["images"]]
    return out


def _declared_size(image: dict[str, Any]) -> tuple[int, int] | None:
    """A COCO image entry's ``(width, height)`` when it states both as positive integers."""
    width, height = image.get("width"), image.get("height")
    return (width, height) if _is_int(width) and _is_int(height) and width > 0 and height > 0 else None


def _read_yolo(root: Path, split: str) -> SplitData:
    # lazy: rfdetr imports torch_xla: the CLI imports this module before the device choice
    from rfdetr.datasets.yolo import (
        _extract_yolo_class_names,
        _list_yolo_image_paths,
        _parse_yolo_label_line,
        _parse_yolo_pose_label_line,
        _resolve_yolo_split_dirs,
        find_yolo_data_file,
    )

    out = SplitData(split)
    data_file = find_yolo_data_file(root, default=root / "data.yaml")
    assert data_file is not None
    try:
        names = _extract_yolo_class_names(str(data_file))
        out.num_labels = len(names)
    except (OSError, ValueError, TypeError) as error:
        out.fail(data_file, "bad_schema", f"class names unreadable: {error}")
        out.readable = False
        return out
    try:
        pose = _pose_shape(data_file)  # a pose dataset's rows: box, then (x, y[, v]) per keypoint
    except ValueError as error:
        out.fail(data_file, "bad_schema", str(error))
        out.readable = False
        return out
    try:
        img_dir, lb_dir = _resolve_yolo_split_dirs(root, data_file, UPSTREAM_SPLITS[split])
    except ValueError as error:
        out.fail(data_file, "missing_file", str(error))
        out.readable = False
        return out
    if not img_dir.is_dir():
        out.fail(img_dir, "missing_file", "the split's image folder does not exist")
        out.readable = False
        return out
    for image_path in _list_yolo_image_paths(str(img_dir)):
        label_path = lb_dir / f"{Path(image_path).stem}.txt"
        entry = Entry(image_path, Path(image_path), label_path, normalised=True)
        lines: list[str] = []
        if label_path.exists():  # no label file: a background image, as rfdetr reads it
            try:
                lines = label_path.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as error:
                out.fail(label_path, "bad_label_file", f"unreadable ({error})")
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:  # rfdetr's own parser; its class-range check is ours below (it would stop at the first)
                if pose is None:
                    cid, xyxy, _ = _parse_yolo_label_line(line.split(), number, label_path, sys.maxsize, 1, 1,
                                                          parse_polygons=False)
                else:
                    cid, xyxy, _ = _parse_yolo_pose_label_line(line.split(), number, label_path, sys.maxsize, 1, 1,
                                                               num_keypoints=pose[0], keypoint_dim=pose[1])
            except ValueError as error:
                out.fail(label_path, "bad_label_file", str(error), f"line {number}")
                continue
            if cid >= len(names):
                out.fail(label_path, "unknown_category", f"class id {cid} is not in {data_file.name}'s "
                         f"{len(names)} names", f"line {number}")
                continue
            entry.boxes.append(Box(f"line {number}", cid, cid, tuple(float(v) for v in xyxy)))  # type: ignore[arg-type]
        out.entries.append(entry)
    return out


def _pose_shape(data_file: Path) -> tuple[int, int] | None:
    """``kpt_shape`` of a YOLO pose ``data.yaml`` as rfdetr validates it (keypoints, 2 or 3 numbers each); ``None``
    for a detection dataset."""
    # lazy: rfdetr imports torch_xla: the CLI imports this module before the device choice
    import yaml
    from rfdetr.datasets._keypoint_schema import _validate_yolo_kpt_shape

    try:
        declared = (yaml.safe_load(data_file.read_text(encoding="utf-8")) or {}).get("kpt_shape")
    except (OSError, yaml.YAMLError, AttributeError):  # the class names' reader above says what is wrong
        return None
    return None if declared is None else _validate_yolo_kpt_shape(declared, data_file)


def inspect_image(path: Path) -> tuple[tuple[int, int] | None, str]:
    """``((width, height), '')`` from the image header, or ``(None, what is wrong)``.

    Headers are enough for the size; to catch truncated files a JPEG must end with its end-of-image marker (a full
    decode decides when it does not), a PNG's chunks are read to ``IEND`` with their CRCs (no decompression), and
    other formats are decoded.
    """
    try:
        nbytes = path.stat().st_size
    except FileNotFoundError:
        return None, "file not found"
    except OSError as error:
        return None, f"unreadable ({error.strerror})"
    if nbytes == 0:
        return None, "empty file (0 bytes)"
    try:
        with Image.open(path) as image:
            size = image.size
            if image.format == "PNG":
                image.verify()
            elif image.format != "JPEG" or not _jpeg_ends(path, nbytes):
                image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        return None, f"not a readable image ({error})"
    return size, ""


def _jpeg_ends(path: Path, nbytes: int) -> bool:
    """Whether the file ends with the JPEG end-of-image marker (trailing zero padding allowed)."""
    with path.open("rb") as f:
        f.seek(max(0, nbytes - 1024))
        return f.read().rstrip(b"\x00").endswith(b"\xff\xd9")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < float("inf")


def _ids(ids: Any) -> str:
    ordered = sorted(ids)
    return ", ".join(map(str, ordered[:12])) + (", ..." if len(ordered) > 12 else "") if ordered else "none"

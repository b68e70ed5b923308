"""The data check of the keypoint model (``spmd_rfdetr.data.check_keypoints``): ``synth --keypoints`` passes, every
keypoint problem rfdetr's reader would pass over silently is named with its annotation, once, before anything is built;
a detector does not read keypoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spmd_rfdetr.config.options import DataOptions, EvalOptions, ModelOptions, RunConfig
from spmd_rfdetr.data.check import check_data
from spmd_rfdetr.data.check_report import KINDS, DataError
from spmd_rfdetr.data.synth import synth


@pytest.fixture(autouse=True)
def data_check_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test caches data check results in a folder of its own."""
    import matplotlib  # rfdetr's import; it keeps its font list under XDG_CACHE_HOME too: keep it where it is

    monkeypatch.setenv("MPLCONFIGDIR", matplotlib.get_cachedir())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))


def keypoint_cfg(root: Path, variant: str = "keypoint-preview", **data: object) -> RunConfig:
    return RunConfig(model=ModelOptions(variant=variant, resolution=96, num_queries=30), eval=EvalOptions(every_steps=10),
                     data=DataOptions(dataset_dir=str(root), global_batch_size=8, max_targets=8, **data))


#: One keypoint problem per train image (its first annotation): the new ``keypoints``, what the report says.
PROBLEMS: dict[int, tuple[object, str]] = {
    1: (None, "no 'keypoints' on train_000001.jpg"),
    2: ([], "'keypoints' is [] on train_000002.jpg"),
    3: ([10, 10, 2] * 4, "12 numbers, the category names 5 keypoints (15) on train_000003.jpg"),
    4: ([10, 10, 2] * 4 + [10, 10, 3], "visibility 3 (must be 0, 1 or 2) on train_000004.jpg"),
    5: ([10, 10, 2] * 4 + [70, 10, 1], "keypoint(s) 5 outside the 64x64 image on train_000005.jpg"),
    6: ([10, 10, 2] * 4 + [10, "x", 2], "'keypoints' must be a flat list of finite numbers on train_000006.jpg"),
}
KIND_COUNTS = {"missing_keypoints": 2, "keypoint_count": 1, "bad_keypoints": 2, "keypoint_outside": 1}


def keypoint_dataset(root: Path, images: tuple[int, ...] = tuple(PROBLEMS)) -> list[str]:
    """``synth --keypoints`` (16 train, 8 valid images of 64 px) with the problems of ``images``; the report lines."""
    synth(str(root), train_images=16, valid_images=8, test_images=0, image_size=64, keypoints=True)
    ann_file = root / "train" / "_annotations.coco.json"
    coco = json.loads(ann_file.read_text())
    lines = []
    for image in images:
        change, detail = PROBLEMS[image]
        ann = next(a for a in coco["annotations"] if a["image_id"] == image)
        if change is None:
            del ann["keypoints"]
        else:
            ann["keypoints"] = change
        lines.append(f"[train] train/_annotations.coco.json (annotation {ann['id']}): {detail}")
    ann_file.write_text(json.dumps(coco))
    return lines


def test_synth_keypoints_pass_the_keypoint_check(tmp_path: Path) -> None:
    root = tmp_path / "data"
    keypoint_dataset(root, images=())
    report = check_data(keypoint_cfg(root))
    assert report.findings == [] and "train: 16 images" in report.summary()
    assert not any("flips are off" in note for note in report.notes)  # synth names left and right


def test_keypoint_check_reports_every_problem_and_flips_off(tmp_path: Path) -> None:
    root = tmp_path / "data"
    lines = keypoint_dataset(root)
    with pytest.raises(DataError) as error:
        check_data(keypoint_cfg(root))
    message = str(error.value)
    for line in lines:
        assert line in message, line
    assert f"{len(lines)} problem(s)" in message
    for kind, count in KIND_COUNTS.items():
        assert f"{KINDS[kind][0]} ({count}): fix: {KINDS[kind][1]}" in message, kind
    check_data(keypoint_cfg(root, variant="nano"))  # a detector reads no keypoints: nothing to say

    renamed = tmp_path / "unnamed"
    keypoint_dataset(renamed, images=())
    ann_file = renamed / "train" / "_annotations.coco.json"
    coco = json.loads(ann_file.read_text())
    for category in coco["categories"]:
        if "keypoints" in category:
            category["keypoints"] = [f"p{j}" for j in range(len(category["keypoints"]))]
    ann_file.write_text(json.dumps(coco))
    report = check_data(keypoint_cfg(renamed))
    assert report.findings == [] and any("horizontal flips are off" in note for note in report.notes), report.notes


def test_a_keypoint_outside_the_image_is_skippable_in_the_train_split(tmp_path: Path) -> None:
    """rfdetr's transforms mark it unlabelled: ``data.on_bad=skip`` lets the run go on; a missing vector does not."""
    root = tmp_path / "data"
    keypoint_dataset(root, images=(5,))
    report = check_data(keypoint_cfg(root, on_bad="skip"))
    assert [f.kind for f in report.skipped] == ["keypoint_outside"] and not report.errors
    missing = tmp_path / "missing"
    keypoint_dataset(missing, images=(1,))
    with pytest.raises(DataError):
        check_data(keypoint_cfg(missing, on_bad="skip"))


def test_a_dataset_without_keypoints_is_named_before_rfdetrs_reader_stops(tmp_path: Path) -> None:
    root = tmp_path / "data"
    synth(str(root), train_images=16, valid_images=8, test_images=0, image_size=64)  # boxes and masks, no keypoints
    with pytest.raises(DataError) as error:
        check_data(keypoint_cfg(root))
    assert f"{KINDS['no_keypoint_categories'][0]} (2): fix: " in str(error.value)  # train and valid
    check_data(keypoint_cfg(root, variant="nano"))


def yolo_pose(coco_root: Path, yolo: Path) -> None:
    """``coco_root`` (``synth --keypoints``) rewritten as an Ultralytics YOLO pose dataset: ``kpt_shape [5, 3]``,
    ``flip_idx`` swapping right and left, one row per object (class, box, then x y v per keypoint, normalised)."""
    import shutil

    import yaml

    names = None
    for split in ("train", "valid"):
        coco = json.loads((coco_root / split / "_annotations.coco.json").read_text())
        real = sorted((c for c in coco["categories"] if "keypoints" in c), key=lambda c: c["id"])
        names, cls = [c["name"] for c in real], {c["id"]: i for i, c in enumerate(real)}
        (yolo / split / "images").mkdir(parents=True)
        (yolo / split / "labels").mkdir()
        for im in coco["images"]:
            shutil.copy(coco_root / split / im["file_name"], yolo / split / "images" / im["file_name"])
            w, h, rows = im["width"], im["height"], []
            for a in (a for a in coco["annotations"] if a["image_id"] == im["id"]):
                x, y, bw, bh = a["bbox"]
                points = [v / (w if j % 3 == 0 else h) if j % 3 < 2 else int(v) for j, v in enumerate(a["keypoints"])]
                rows.append(" ".join(map(repr, [cls[a["category_id"]], (x + bw / 2) / w, (y + bh / 2) / h, bw / w,
                                                bh / h, *points])))
            (yolo / split / "labels" / (Path(im["file_name"]).stem + ".txt")).write_text("\n".join(rows) + "\n")
    (yolo / "data.yaml").write_text(yaml.safe_dump({"names": names, "nc": len(names), "kpt_shape": [5, 3],
                                                    "flip_idx": [0, 3, 2, 1, 4]}))


def test_yolo_pose_labels_read_as_rfdetr_reads_them_and_are_checked(tmp_path: Path) -> None:
    """A YOLO pose export of the same objects: the check passes it (rows parsed by rfdetr's pose parser), rfdetr's
    YOLO reader gives the Roboflow COCO reading's keypoints (schema [5, 5, 5] from ``kpt_shape``, flip pairs from
    ``flip_idx``), and a row of the wrong length is named with its line."""
    import torch

    from spmd_rfdetr.data.splits import build_split
    from spmd_rfdetr.model.upstream import upstream_configs

    coco_root, yolo = tmp_path / "coco", tmp_path / "yolo"
    keypoint_dataset(coco_root, images=())
    yolo_pose(coco_root, yolo)
    cfg = keypoint_cfg(yolo, dataset_format="yolo")
    report = check_data(cfg)
    assert report.findings == [] and "train: 16 images" in report.summary(), report.summary()
    ours = upstream_configs(cfg.model, cfg.data, cfg.optim, num_classes=3)
    assert ours.model.num_keypoints_per_class == [5, 5, 5] and ours.train.keypoint_flip_pairs == [1, 3]
    reference = keypoint_cfg(coco_root)
    theirs = upstream_configs(reference.model, reference.data, reference.optim, num_classes=4)
    a, b = build_split(ours, "valid"), build_split(theirs, "valid")
    for i in range(len(b)):
        mine, other = a[i][1], b[i][1]
        order, other_order = mine["boxes"][:, 0].argsort(), other["boxes"][:, 0].argsort()
        torch.testing.assert_close(mine["keypoints"][order], other["keypoints"][other_order], atol=1e-5, rtol=0)
        assert torch.equal(mine["labels"][order] + 1, other["labels"][other_order])  # COCO: the root takes label 0

    label = next((yolo / "train" / "labels").glob("*.txt"))
    rows = label.read_text().splitlines()
    label.write_text("\n".join([" ".join(rows[0].split()[:-3])] + rows[1:]) + "\n")  # one keypoint short
    with pytest.raises(DataError) as error:
        check_data(cfg)
    assert f"{label.name} (line 1): Malformed YOLO pose label" in str(error.value) and "expected 20 fields" in str(
        error.value)

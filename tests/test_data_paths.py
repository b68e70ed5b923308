"""Data paths without XLA: ``data.on_overflow`` (error / truncate) and ``data.dataset_format`` coco and yolo.

The synthetic dataset (Roboflow COCO layout) is rewritten as a Roboflow YOLO export and as the COCO 2017 folder
layout; rfdetr's own readers must then give the same images, boxes and labels (COCO 2017 keeps the raw category ids),
and the data check must pass on each.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from spmd_rfdetr.data.check import check_data
from spmd_rfdetr.data.check_report import DataError
from spmd_rfdetr.config.options import DataOptions, ModelOptions, OptimOptions, RunConfig
from spmd_rfdetr.data.batches import StaticCollate
from spmd_rfdetr.data.splits import OVERFLOW_FIX, build_split, check_overflow, find_overflow
from spmd_rfdetr.model.upstream import upstream_configs
from spmd_rfdetr.data.synth import synth

RESOLUTION, MAX_TARGETS = 128, 8


def run_config(root: Path, **data: object) -> RunConfig:
    return RunConfig(model=ModelOptions(resolution=RESOLUTION, num_queries=30),
                     data=DataOptions(dataset_dir=str(root), global_batch_size=4, max_targets=MAX_TARGETS,
                                      num_workers=0, **data))


def split_of(cfg: RunConfig, split: str, num_classes: int = 3):
    return build_split(upstream_configs(cfg.model, cfg.data, cfg.optim, num_classes), split)


# ------------------------------------------------------------------------------------------------ on_overflow
@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Images of 1 to 12 objects (some over max_targets=8)."""
    return synth(str(tmp_path_factory.mktemp("crowded") / "data"), train_images=12, valid_images=8, test_images=0,
                 image_size=128, max_objects=12, seed=3)


def expected_overflow(root: Path) -> dict[str, int]:
    coco = json.loads((root / "train" / "_annotations.coco.json").read_text())
    names = {im["id"]: im["file_name"] for im in coco["images"]}
    counts: dict[str, int] = {}
    for ann in coco["annotations"]:
        counts[names[ann["image_id"]]] = counts.get(names[ann["image_id"]], 0) + 1
    return {name: n for name, n in counts.items() if n > MAX_TARGETS}


def test_overflow_error_names_every_file_and_the_fix(crowded: Path) -> None:
    over = expected_overflow(crowded)
    assert 1 <= len(over) < 12, over  # the fixture must mix images over and under the cap
    cfg = run_config(crowded)
    train = split_of(cfg, "train")
    found = find_overflow(train, MAX_TARGETS)
    assert found.files == sorted(over) and found.boxes_over == sum(n - MAX_TARGETS for n in over.values())
    with pytest.raises(ValueError) as error:
        check_overflow(train, cfg.data, "train")  # what fit does before building the step
    message = str(error.value)
    assert f"{len(over)} image(s) have more than data.max_targets={MAX_TARGETS} boxes" in message
    assert all(name in message for name in sorted(over)[:5]) and OVERFLOW_FIX in message
    with pytest.raises(DataError) as error:  # the data check (check-data, and the first thing fit does)
        check_data(cfg)
    for name, count in over.items():
        assert f"train/{name}: {count} objects, data.max_targets={MAX_TARGETS}" in str(error.value)


def test_overflow_truncate_logs_and_keeps_the_largest_boxes(crowded: Path, caplog: pytest.LogCaptureFixture) -> None:
    over = expected_overflow(crowded)
    cfg = run_config(crowded, on_overflow="truncate")
    train, valid = split_of(cfg, "train"), split_of(cfg, "valid")
    with caplog.at_level(logging.WARNING, logger="spmd_rfdetr.data.splits"):
        check_overflow(train, cfg.data, "train")
    assert f"{len(over)} image(s) have more than data.max_targets={MAX_TARGETS}" in caplog.text
    assert f"keeping the {MAX_TARGETS} largest boxes of each (data.on_overflow=truncate)" in caplog.text
    report = check_data(cfg)
    assert any("their largest boxes are kept (data.on_overflow=truncate)" in note for note in report.notes), report
    assert not report.errors

    # the static batch of an over-full image (valid: no random crop drops boxes first): exactly max_targets real
    # boxes, the largest ones, labels with them
    index = next(i for i in range(len(valid)) if len(valid[i][1]["boxes"]) > MAX_TARGETS)
    image, target = valid[index]
    batch = StaticCollate(MAX_TARGETS, RESOLUTION)([(image, target)])
    assert batch["boxes"].shape == (1, MAX_TARGETS, 4) and bool(batch["valid"].all())
    area = target["boxes"][:, 2] * target["boxes"][:, 3]
    keep = torch.argsort(area, descending=True, stable=True)[:MAX_TARGETS]
    assert torch.equal(batch["boxes"][0], target["boxes"][keep]) and torch.equal(batch["labels"][0],
                                                                                 target["labels"][keep])
    dropped = torch.ones(len(area), dtype=torch.bool)
    dropped[keep] = False
    assert int(dropped.sum()) == len(area) - MAX_TARGETS > 0
    assert (area[dropped] <= area[keep].min()).all()  # nothing kept is smaller than anything dropped


# -------------------------------------------------------------------------------------------- dataset_format
@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One synthetic dataset in three layouts: Roboflow COCO (synth's), Roboflow YOLO and COCO 2017."""
    base = tmp_path_factory.mktemp("layouts")
    roboflow = synth(str(base / "roboflow"), train_images=8, valid_images=8, test_images=2, image_size=96, seed=5)
    yolo, coco2017 = base / "yolo", base / "coco2017"
    names = None
    for split, folder, ann_name in (("train", "train2017", "instances_train2017.json"),
                                    ("valid", "val2017", "instances_val2017.json"),
                                    ("test", "test2017", "image_info_test-dev2017.json")):
        coco = json.loads((roboflow / split / "_annotations.coco.json").read_text())
        real = sorted((c for c in coco["categories"] if c["supercategory"] != "none"), key=lambda c: c["id"])
        names = [c["name"] for c in real]
        cls = {c["id"]: i for i, c in enumerate(real)}
        (yolo / split / "images").mkdir(parents=True)
        (yolo / split / "labels").mkdir()
        (coco2017 / folder).mkdir(parents=True)
        (coco2017 / "annotations").mkdir(exist_ok=True)
        for im in coco["images"]:
            shutil.copy(roboflow / split / im["file_name"], yolo / split / "images" / im["file_name"])
            shutil.copy(roboflow / split / im["file_name"], coco2017 / folder / im["file_name"])
            lines = []
            for a in (a for a in coco["annotations"] if a["image_id"] == im["id"]):
                x, y, w, h = a["bbox"]
                lines.append(f"{cls[a['category_id']]} {(x + w / 2) / im['width']!r} {(y + h / 2) / im['height']!r} "
                             f"{w / im['width']!r} {h / im['height']!r}")
            (yolo / split / "labels" / (Path(im["file_name"]).stem + ".txt")).write_text("\n".join(lines) + "\n")
        (coco2017 / "annotations" / ann_name).write_text(json.dumps(coco))
    (yolo / "data.yaml").write_text(yaml.safe_dump({"names": names, "nc": len(names)}))
    return {"roboflow": roboflow, "yolo": yolo, "coco2017": coco2017}


@pytest.mark.parametrize(("layout", "dataset_format", "label_offset"),
                         [("yolo", "yolo", 0), ("yolo", "roboflow", 0), ("coco2017", "coco", 1)],
                         ids=["yolo", "yolo-auto-detected", "coco2017"])
def test_dataset_formats_read_the_same_samples(layouts: dict[str, Path], layout: str, dataset_format: str,
                                               label_offset: int) -> None:
    """``valid`` (deterministic transforms) read from each layout equals the Roboflow COCO reading: same pixels, boxes
    to float precision of the YOLO text, labels (COCO 2017: rfdetr keeps the raw category ids, ``label + 1`` here as
    synth's ids start at 1 after the unannotated root)."""
    num_classes = 3 + label_offset
    reference = split_of(run_config(layouts["roboflow"]), "valid")
    cfg = run_config(layouts[layout], dataset_format=dataset_format)
    cfg.model.num_classes = num_classes
    report = check_data(cfg, ["train", "valid"])
    assert not report.errors and "train" in report.summary(), report.summary()
    other = split_of(cfg, "valid", num_classes)
    assert len(other) == len(reference) == 8
    collate = StaticCollate(MAX_TARGETS, RESOLUTION)
    ours, theirs = collate([other[i] for i in range(8)]), collate([reference[i] for i in range(8)])
    assert torch.equal(ours["valid"], theirs["valid"]) and int(ours["valid"].sum()) > 8
    assert torch.allclose(ours["images"], theirs["images"], atol=1e-6)
    assert torch.allclose(ours["boxes"], theirs["boxes"], atol=1e-5)
    assert torch.equal(ours["labels"][ours["valid"]], theirs["labels"][theirs["valid"]] + label_offset)
    train = split_of(cfg, "train", num_classes)
    assert len(train) == 8 and train[0][0].shape == (3, RESOLUTION, RESOLUTION)


# ------------------------------------------------------------------------------------- predict's image folder
def relabelled_split(src: Path, dst: Path) -> dict[str, int]:
    """A copy of a split folder whose annotation file gives its images ids unlike their sorted positions."""
    shutil.copytree(src, dst)
    ann_file = dst / "_annotations.coco.json"
    coco = json.loads(ann_file.read_text())
    new_id = {im["id"]: 1000 + 7 * (len(coco["images"]) - i) for i, im in enumerate(coco["images"])}
    for im in coco["images"]:
        im["id"] = new_id[im["id"]]
    for ann in coco["annotations"]:
        ann["image_id"] = new_id[ann["image_id"]]
    ann_file.write_text(json.dumps(coco))
    return {im["file_name"]: im["id"] for im in coco["images"]}


def test_image_folder_takes_ids_from_its_annotations(layouts: dict[str, Path], tmp_path: Path) -> None:
    """``predict --images`` on a split folder: image ids from its ``_annotations.coco.json`` (so detections line up
    with that split's ground truth), positions in a plain folder, and an unlisted image is a clear error."""
    from spmd_rfdetr.data.images import ImageFolder, eval_transforms

    cfgs = upstream_configs(ModelOptions(resolution=RESOLUTION), DataOptions(), OptimOptions(), num_classes=3)
    transforms = eval_transforms(cfgs)
    ids = relabelled_split(layouts["roboflow"] / "valid", tmp_path / "split")
    folder = ImageFolder(tmp_path / "split", transforms)
    assert dict(zip(folder.files, folder.ids)) == ids and folder.ids != list(range(len(ids)))
    image, target = folder[0]
    assert image.shape == (3, RESOLUTION, RESOLUTION) and int(target["image_id"]) == ids[folder.files[0]]
    assert folder.images_json() == [{"id": ids[name], "file_name": name} for name in sorted(ids)]
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in sorted(ids)[:3]:
        shutil.copy(tmp_path / "split" / name, plain / name)
    assert ImageFolder(plain, transforms).ids == [0, 1, 2]
    extra = sorted(ids)[0].replace(".jpg", "_extra.jpg")
    shutil.copy(tmp_path / "split" / sorted(ids)[0], tmp_path / "split" / extra)
    with pytest.raises(ValueError, match=f"does not list 1 image\\(s\\) of the folder, e.g. {extra}"):
        ImageFolder(tmp_path / "split", transforms)

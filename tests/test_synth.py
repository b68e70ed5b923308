"""The synthetic shapes dataset: real files on disk, read back by pycocotools and by rfdetr's own Roboflow reader."""
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from pycocotools.coco import COCO

from spmd_rfdetr.data.synth import COLOURS, SHAPES, SPLITS, render_image, synth

SMALL = dict(train_images=6, valid_images=3, test_images=2, image_size=96, num_classes=4, max_objects=5)


def _load(root: Path, split: str) -> dict:
    return json.loads((root / split / "_annotations.coco.json").read_text())


def _tight_box(mask: np.ndarray) -> list[int]:
    ys, xs = np.nonzero(mask)
    return [int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1), int(ys.max() - ys.min() + 1)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth(str(tmp_path_factory.mktemp("synth") / "ds"), seed=3, **SMALL)


def test_layout_and_pycocotools(dataset: Path) -> None:
    counts = dict(zip(SPLITS, (SMALL["train_images"], SMALL["valid_images"], SMALL["test_images"])))
    for split, count in counts.items():
        coco = COCO(str(dataset / split / "_annotations.coco.json"))
        assert len(coco.getImgIds()) == count == len(list((dataset / split).glob("*.jpg")))
        assert len(coco.getAnnIds()) == sum(len(coco.getAnnIds(imgIds=i)) for i in coco.getImgIds()) > 0
        assert min(coco.getAnnIds()) == 1  # COCOeval treats a matched annotation id 0 as unmatched
        cats = coco.loadCats(coco.getCatIds())
        assert cats[0] == {"id": 0, "name": "shapes", "supercategory": "none"}  # Roboflow's unannotated root
        assert [c["id"] for c in cats[1:]] == list(range(1, SMALL["num_classes"] + 1))
        assert all(c["supercategory"] == "shapes" for c in cats[1:])
        assert {a["category_id"] for a in coco.loadAnns(coco.getAnnIds())} <= set(range(1, SMALL["num_classes"] + 1))
        for image in coco.loadImgs(coco.getImgIds()):
            assert Image.open(dataset / split / image["file_name"]).size == (image["width"], image["height"]) == (96, 96)
            assert 1 <= len(coco.getAnnIds(imgIds=image["id"])) <= SMALL["max_objects"]


def test_rfdetr_reader(dataset: Path) -> None:
    from rfdetr.datasets import build_dataset
    from rfdetr.detr import RFDETR

    assert RFDETR._detect_num_classes_for_training(str(dataset)) == SMALL["num_classes"]
    assert RFDETR._load_classes(str(dataset)) == ["rectangle", "ellipse", "triangle", "cross"]
    args = SimpleNamespace(dataset_file="roboflow", dataset_dir=str(dataset), square_resize_div_64=True,
                           segmentation_head=False, multi_scale=False, expanded_scales=False, patch_size=16,
                           num_windows=2)
    for image_set, split in (("train", "train"), ("val", "valid"), ("test", "test")):
        ds = build_dataset(image_set, args, 64)
        assert len(ds) == len(_load(dataset, split)["images"])
        assert ds.cat2label == {i: i - 1 for i in range(1, SMALL["num_classes"] + 1)}
        image, target = ds[0]
        assert tuple(image.shape) == (3, 64, 64)
        assert int(target["labels"].max()) < SMALL["num_classes"]
        if image_set != "train":  # no augmentation: boxes are the annotations, normalised cx, cy, w, h
            anns = [a for a in _load(dataset, split)["annotations"] if a["image_id"] == int(target["image_id"])]
            want = [[(x + w / 2) / 96, (y + h / 2) / 96, w / 96, h / 96] for x, y, w, h in (a["bbox"] for a in anns)]
            np.testing.assert_allclose(target["boxes"].numpy(), want, atol=1e-5)
            assert target["labels"].tolist() == [a["category_id"] - 1 for a in anns]


def test_masks_are_exact_through_rfdetr_and_pycocotools(dataset: Path) -> None:
    """Each annotation's ``segmentation`` (an RLE) decodes to exactly the drawn shape: in rfdetr's reader of a seg model
    (``target["masks"]``, before and, on valid, after its transforms) and in pycocotools' ``annToMask``."""
    from spmd_rfdetr.config.options import DataOptions, ModelOptions, OptimOptions
    from spmd_rfdetr.data.splits import upstream_split
    from spmd_rfdetr.model.upstream import upstream_configs

    model = ModelOptions(variant="seg-nano", resolution=96, pretrain_weights=None)
    cfgs = upstream_configs(model, DataOptions(dataset_dir=str(dataset)), OptimOptions(), SMALL["num_classes"])
    assert cfgs.namespace().segmentation_head
    drawn_shapes = set()
    for split in SPLITS:
        coco = COCO(str(dataset / split / "_annotations.coco.json"))
        ds = upstream_split(cfgs, split)
        resized = [ds[i][1]["masks"].numpy() for i in range(len(ds))] if split == "valid" else None  # 96 px: as is
        ds._transforms = None  # the reader's own targets (train's are randomly augmented)
        for i, image_id in enumerate(ds.ids):
            drawn = render_image(3, split, image_id, 96, SMALL["num_classes"], 1, SMALL["max_objects"])
            drawn_shapes.update(drawn.labels)
            anns = coco.loadAnns(coco.getAnnIds(imgIds=image_id))
            assert all(isinstance(a["segmentation"]["counts"], str) for a in anns)  # compressed RLE, JSON-safe
            assert np.array_equal(np.stack([coco.annToMask(a) for a in anns]).astype(bool), drawn.masks)
            masks = ds[i][1]["masks"].numpy()
            assert masks.dtype == bool and np.array_equal(masks, drawn.masks)
            if resized is not None:
                assert np.array_equal(resized[i], drawn.masks)
    assert 3 in drawn_shapes  # a cross (not convex) among them; rings have a test of their own below


def test_ring_masks_keep_their_hole(tmp_path: Path) -> None:
    root = synth(str(tmp_path / "ds"), train_images=4, valid_images=1, test_images=0, image_size=96, num_classes=6,
                 min_objects=4, max_objects=4, seed=1)
    coco = COCO(str(root / "train" / "_annotations.coco.json"))
    rings = 0
    for image_id in coco.getImgIds():
        drawn = render_image(1, "train", image_id, 96, 6, 4, 4)
        for ann, label, mask in zip(coco.loadAnns(coco.getAnnIds(imgIds=image_id)), drawn.labels, drawn.masks):
            decoded = coco.annToMask(ann).astype(bool)
            assert np.array_equal(decoded, mask) and ann["area"] == ann["bbox"][2] * ann["bbox"][3]
            if label == SHAPES.index("ring"):
                rings += 1
                x, y, w, h = ann["bbox"]
                assert not decoded[y + h // 2, x + w // 2]  # the hole
                assert decoded.sum() < 0.6 * w * h
    assert rings > 0


def test_boxes_are_exact(dataset: Path) -> None:
    for split in SPLITS:
        data = _load(dataset, split)
        for image in data["images"]:
            drawn = render_image(3, split, image["id"], 96, SMALL["num_classes"], 1, SMALL["max_objects"])
            anns = [a for a in data["annotations"] if a["image_id"] == image["id"]]
            assert [a["bbox"] for a in anns] == drawn.boxes == [_tight_box(m) for m in drawn.masks]
            assert [a["category_id"] for a in anns] == [label + 1 for label in drawn.labels]
            assert drawn.masks.sum(axis=0).max() == 1  # no overlap: every visible pixel belongs to one shape
            for label, mask in zip(drawn.labels, drawn.masks):
                assert (drawn.pixels[mask] == COLOURS[label]).all()
            # The JPEG on disk matches what was drawn, and colour thresholding finds the same boxes within 2 px.
            decoded = np.asarray(Image.open(dataset / split / image["file_name"]).convert("RGB")).astype(int)
            assert np.abs(decoded - drawn.pixels).mean() < 5
            for label, (x, y, w, h) in zip(drawn.labels, drawn.boxes):
                x0, y0 = max(x - 1, 0), max(y - 1, 0)
                window = decoded[y0 : y + h + 1, x0 : x + w + 1]
                hit = np.abs(window - np.array(COLOURS[label])).max(axis=-1) < 60
                bx, by, bw, bh = _tight_box(hit)
                np.testing.assert_allclose([bx + x0, by + y0, bx + x0 + bw, by + y0 + bh], [x, y, x + w, y + h], atol=2)


def test_many_small_objects(tmp_path: Path) -> None:
    root = synth(str(tmp_path / "ds"), train_images=2, valid_images=1, test_images=0, image_size=160,
                 num_classes=6, min_objects=40, max_objects=40)
    data = _load(root, "train")
    assert len(data["annotations"]) == 80
    assert _load(root, "test")["images"] == []
    drawn = render_image(0, "train", 0, 160, 6, 40, 40)
    assert len(drawn.labels) == 40 and drawn.masks.sum(axis=0).max() == 1
    assert min(min(b[2], b[3]) for b in drawn.boxes) >= 6


def test_deterministic(tmp_path: Path) -> None:
    def pixels(root: Path) -> list[np.ndarray]:
        return [np.asarray(Image.open(p)) for p in sorted((root / "train").glob("*.jpg"))]

    a, b, c = (synth(str(tmp_path / name), seed=seed, **SMALL) for name, seed in (("a", 7), ("b", 7), ("c", 8)))
    for split in SPLITS:
        assert (a / split / "_annotations.coco.json").read_bytes() == (b / split / "_annotations.coco.json").read_bytes()
    assert all((x == y).all() for x, y in zip(pixels(a), pixels(b)))
    assert _load(a, "train")["annotations"] != _load(c, "train")["annotations"]
    assert any((x != y).any() for x, y in zip(pixels(a), pixels(c)))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_classes=0), "num_classes"),
        (dict(num_classes=7), "num_classes"),
        (dict(image_size=32), "image_size"),
        (dict(train_images=0), "train_images"),
        (dict(valid_images=0), "valid_images"),
        (dict(test_images=-1), "test_images"),
        (dict(max_objects=0), "max_objects"),
        (dict(image_size=64, max_objects=40), "max_objects"),
        (dict(min_objects=7, max_objects=6), "min_objects"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        synth(str(tmp_path / "ds"), **kwargs)
    assert not (tmp_path / "ds").exists()


def test_refuses_non_empty_output_dir(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="output_dir"):
        synth(str(tmp_path), train_images=1, valid_images=1, test_images=0)


def test_keypoints_through_rfdetr_and_pycocotools(tmp_path: Path) -> None:
    """``synth(keypoints=True)``: rfdetr infers the schema and flip pairs from it and reads every point as written;
    pycocotools scores the annotations as detections at OKS AP 1; every visible point is on its shape."""
    from pycocotools import mask as coco_mask
    from pycocotools.cocoeval import COCOeval
    from rfdetr.datasets._keypoint_schema import infer_coco_keypoint_schema
    from rfdetr.datasets.coco import CocoDetection

    root = synth(str(tmp_path / "kp"), train_images=6, valid_images=2, test_images=0, image_size=96, num_classes=6,
                 max_objects=5, seed=5, keypoints=True)
    ann_file = root / "train" / "_annotations.coco.json"
    coco = _load(root, "train")
    schema = infer_coco_keypoint_schema(ann_file)
    assert schema.num_keypoints_per_class == [0] + [5] * 6  # the root has none (a Roboflow keypoint export's layout)
    assert schema.keypoint_flip_pairs == [1, 3]  # right <-> left, from the names
    visibilities = set()
    for a in coco["annotations"]:
        points = np.array(a["keypoints"]).reshape(5, 3)
        mask = coco_mask.decode({"size": a["segmentation"]["size"], "counts": a["segmentation"]["counts"].encode()})
        on_shape = mask[points[:, 1].astype(int), points[:, 0].astype(int)] > 0
        assert ((points[:, 2] == 2) == on_shape).all() and (points[:, 2] > 0).all(), a
        assert a["num_keypoints"] == 5
        assert points[1, 0] > points[3, 0] and points[0, 1] < points[2, 1]  # right of left, top above bottom
        x, y, w, h = a["bbox"]
        assert ((points[:, 0] > x) & (points[:, 0] < x + w) & (points[:, 1] > y) & (points[:, 1] < y + h)).all()
        visibilities |= set(points[:, 2].tolist())
    assert visibilities == {1.0, 2.0}  # some ring's centre is in its hole

    ds = CocoDetection(root / "train", ann_file, transforms=None, include_keypoints=True,
                       num_keypoints_per_class=schema.num_keypoints_per_class, remap_category_ids=True)
    for index in range(len(ds)):
        _, target = ds[index]
        anns = [a for a in coco["annotations"] if a["image_id"] == int(target["image_id"])]
        want = np.array([a["keypoints"] for a in anns]).reshape(len(anns), 5, 3)
        np.testing.assert_allclose(target["keypoints"].numpy(), want, atol=1e-5)
        assert target["labels"].tolist() == [ds.cat2label[a["category_id"]] for a in anns]

    gt = COCO(str(ann_file))
    results = [{"image_id": a["image_id"], "category_id": a["category_id"], "keypoints": a["keypoints"], "score": 1.0}
               for a in coco["annotations"]]
    evaluator = COCOeval(gt, gt.loadRes(results), iouType="keypoints")
    evaluator.params.kpt_oks_sigmas = np.full(5, 0.05)  # rfdetr's sigma for a keypoint count other than COCO's 17
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    assert evaluator.stats[0] == pytest.approx(1.0)

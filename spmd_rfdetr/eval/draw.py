"""Detections you can see: ``predict``'s COCO results as ``supervision`` objects, drawn with supervision's annotators.

:func:`to_detections` (and :func:`to_keypoints` for the keypoint model) turn ``predict``'s results into what rfdetr's
own ``predict`` returns (``supervision.Detections``: ``xyxy`` pixels, ``confidence``, ``class_id`` = the dataset's
``category_id``, ``data["class_name"]``, seg models' ``mask``); :func:`load_predictions` reads a ``predict`` output
file by image file name. ``predict --save_images DIR`` draws with :func:`draw` (boxes and "name score" labels, masks,
keypoints and the dataset's skeleton) through :func:`save_drawings`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spmd_rfdetr.config.options import ConfigError

#: The score threshold drawings use when ``predict`` was given none (rfdetr's ``predict`` default).
DRAW_THRESHOLD = 0.5
JPEG_QUALITY = 95

Result = Mapping[str, Any]


def check_options(threshold: float | None, save_images: str | None, images: str) -> None:
    """``predict``'s ``--threshold`` (in [0, 1]) and ``--save_images`` (not the ``--images`` folder, not a file)."""
    problems = []
    if threshold is not None and not (isinstance(threshold, (int, float)) and 0.0 <= threshold <= 1.0):
        problems.append(f"--threshold {threshold}: a score threshold must lie in [0, 1] (rfdetr draws at 0.5)")
    if save_images is not None:
        out = Path(save_images)
        if out.exists() and not out.is_dir():
            problems.append(f"--save_images {save_images}: a file, not a folder")
        elif out.exists() and Path(images).exists() and out.resolve() == Path(images).resolve():
            problems.append(f"--save_images {save_images}: the --images folder itself (its images would be replaced)")
    if problems:
        raise ConfigError("; ".join(problems))


def kept(results: Iterable[Result], image_id: int | None = None, threshold: float = 0.0) -> list[Result]:
    """The results of ``image_id`` (all when ``None``) whose score is >= ``threshold``, best first."""
    rows = [r for r in results if (image_id is None or r["image_id"] == image_id) and r["score"] >= threshold]
    return sorted(rows, key=lambda r: -r["score"])


def to_detections(results: Iterable[Result], image_id: int | None = None, threshold: float = 0.0) -> Any:
    """``predict``'s results (one image's: give ``image_id`` when the list holds several) as ``supervision.Detections``:
    ``xyxy`` in pixels, ``confidence``, ``class_id`` (the dataset's ``category_id``), ``data["class_name"]`` (its
    ``category_name``) and, for a seg model, ``mask`` (``[N, H, W]`` bool, decoded from the RLE ``segmentation``)."""
    import supervision as sv  # lazy: only drawing and this conversion need it

    rows = kept(results, image_id, threshold)
    boxes = np.asarray([r["bbox"] for r in rows], np.float32).reshape(-1, 4)
    boxes[:, 2:] += boxes[:, :2]  # COCO [x, y, w, h] -> xyxy
    mask = None
    if rows and all("segmentation" in r for r in rows):
        from pycocotools import mask as mask_util  # lazy: only seg results carry RLEs

        mask = np.stack([mask_util.decode(dict(r["segmentation"])) > 0 for r in rows])
    names = np.asarray([str(r.get("category_name", r["category_id"])) for r in rows], dtype=object)
    return sv.Detections(xyxy=boxes, confidence=np.asarray([r["score"] for r in rows], np.float32),
                         class_id=np.asarray([r["category_id"] for r in rows], int), mask=mask,
                         data={"class_name": names})


def to_keypoints(results: Iterable[Result], image_id: int | None = None, threshold: float = 0.0) -> Any:
    """The keypoint model's results as ``supervision.KeyPoints`` (``xy`` ``[N, K, 2]`` pixels, ``keypoint_confidence``,
    ``class_id`` = ``category_id``, ``detection_confidence``); a detection with fewer keypoints than the most is
    padded with (0, 0), which supervision's annotators skip."""
    import supervision as sv  # lazy: only drawing and this conversion need it

    rows = [r for r in kept(results, image_id, threshold) if r.get("keypoints")]
    most = max((len(r["keypoints"]) // 3 for r in rows), default=0)
    points = np.zeros((len(rows), most, 3), np.float32)
    for n, r in enumerate(rows):
        flat = np.asarray(r["keypoints"], np.float32).reshape(-1, 3)
        points[n, :len(flat)] = flat
    return sv.KeyPoints(xy=points[..., :2], keypoint_confidence=points[..., 2],
                        class_id=np.asarray([r["category_id"] for r in rows], int),
                        detection_confidence=np.asarray([r["score"] for r in rows], np.float32),
                        data={"class_name": np.asarray([str(r.get("category_name", "")) for r in rows], dtype=object)})


def load_predictions(output: str | Path) -> dict[str, list[dict[str, Any]]]:
    """A ``predict`` output file's results per image file name (ids from the ``<output>.images.json`` beside it)."""
    output = Path(output)
    files = {row["id"]: row["file_name"] for row in json.loads(output.with_suffix(".images.json").read_text())}
    by_file: dict[str, list[dict[str, Any]]] = {name: [] for name in files.values()}
    for result in json.loads(output.read_text()):
        by_file[files[result["image_id"]]].append(result)
    return by_file


def skeletons(categories: Iterable[Mapping[str, Any]]) -> dict[int, list[tuple[int, int]]]:
    """COCO categories' ``skeleton`` edges (1-based keypoint indices, as COCO and supervision number them) per
    category id; categories without one are left out (their keypoints are drawn as vertices only)."""
    return {int(c["id"]): [(int(a), int(b)) for a, b in c["skeleton"]] for c in categories if c.get("skeleton")}


def draw(image: Any, results: Sequence[Result], skeleton: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> Any:
    """``image`` (PIL or a numpy array) with one image's ``results`` drawn: masks (seg), boxes, "name score" labels,
    keypoints and, for categories in ``skeleton``, their edges. Draws every result given (threshold them first)."""
    import supervision as sv  # lazy: only drawing needs it

    detections = to_detections(results)
    scene = image.copy()
    if detections.mask is not None:
        scene = sv.MaskAnnotator().annotate(scene, detections)
    scene = sv.BoxAnnotator().annotate(scene, detections)
    labels = [f"{name} {score:.2f}" for name, score in zip(detections.data["class_name"], detections.confidence)]
    scene = sv.LabelAnnotator().annotate(scene, detections, labels=labels)
    keypoints = to_keypoints(results)
    if len(keypoints):
        for category, edges in (skeleton or {}).items():
            own = keypoints[keypoints.class_id == category]
            if len(own) and max(max(edge) for edge in edges) <= own.xy.shape[1]:
                scene = sv.EdgeAnnotator(edges=list(edges)).annotate(scene, own)
        scene = sv.VertexAnnotator(radius=3).annotate(scene, keypoints)
    return scene


def save_drawings(results: Sequence[Result], images: str | Path, files: Mapping[int, str], out_dir: str | Path,
                  threshold: float, skeleton: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> list[Path]:
    """Draw the results scoring >= ``threshold`` on each image ``files`` names (image id -> file name in ``images``)
    and write it under ``out_dir`` with the same name and format (JPEG at quality :data:`JPEG_QUALITY`)."""
    # lazy: rfdetr's decoder (the pixels predict read) imports torch_xla, which starts after the device choice
    from rfdetr.datasets.io_utils import decode_pil_image

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for image_id, name in files.items():
        image, _ = decode_pil_image(Path(images) / name)
        drawn = draw(image.convert("RGB"), kept(results, image_id, threshold), skeleton)
        path = out_dir / name
        options = {"quality": JPEG_QUALITY} if path.suffix.lower() in (".jpg", ".jpeg") else {}
        drawn.save(path, **options)
        written.append(path)
    return written

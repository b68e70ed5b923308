"""A folder of images read like an eval split: rfdetr's decoder and its val transforms for the model's resolution."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


class ImageFolder(Dataset):  # type: ignore[type-arg]
    """The images of a folder, decoded and transformed exactly like an eval split (rfdetr's decoder and val transforms).

    Image ids come from the folder's ``_annotations.coco.json`` when it has one (so predictions line up with that
    split's ground truth), otherwise they are positions in the sorted file list.
    """

    def __init__(self, folder: str | Path, transforms: Any) -> None:
        # lazy: rfdetr imports torch_xla, which must start after the device choice: this module loads without it
        from rfdetr.datasets.coco import ConvertCoco

        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"--images {folder}: not a directory")
        self.files = sorted(p.name for p in self.folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not self.files:
            raise FileNotFoundError(f"--images {folder}: no images ({', '.join(IMAGE_SUFFIXES)})")
        annotations = self.folder / "_annotations.coco.json"
        ids: dict[str, int] = {}
        if annotations.exists():
            ids = {im["file_name"]: int(im["id"]) for im in json.loads(annotations.read_text())["images"]}
        self.ids = [ids.get(name, -1) for name in self.files] if ids else list(range(len(self.files)))
        if -1 in self.ids:
            missing = [n for n, i in zip(self.files, self.ids) if i == -1]
            raise ValueError(f"{annotations} does not list {len(missing)} image(s) of the folder, e.g. {missing[0]}")
        self.transforms = transforms
        self.prepare = ConvertCoco()

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # lazy: rfdetr imports torch_xla, which must start after the device choice: this module loads without it
        from rfdetr.datasets.io_utils import decode_pil_image

        image, _ = decode_pil_image(self.folder / self.files[index])  # full-size decode, as eval splits do
        image, target = self.prepare(image, {"image_id": self.ids[index], "annotations": []})
        return self.transforms(image, target)

    def images_json(self) -> list[dict[str, Any]]:
        """``[{"id", "file_name"}]`` for the folder (written next to the predictions)."""
        return [{"id": i, "file_name": n} for i, n in zip(self.ids, self.files)]


def eval_transforms(cfgs: Any) -> Any:
    """The val-split transform pipeline rfdetr's dataset readers use for this model (resize + normalize)."""
    # lazy: rfdetr imports torch_xla, which must start after the device choice: this module loads without it
    from rfdetr.datasets.coco import make_coco_transforms, make_coco_transforms_square_div_64

    ns = cfgs.namespace()
    make = make_coco_transforms_square_div_64 if ns.square_resize_div_64 else make_coco_transforms
    return make("val", cfgs.model.resolution, patch_size=ns.patch_size, num_windows=ns.num_windows)

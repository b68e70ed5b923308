"""The data check's result, cached: a second run on unchanged annotations (a resume after preemption) opens no image.

The key is a sha256 over

- the annotation files' bytes (COCO JSON, YOLO ``data.yaml``). Measured (this 2-core VM): a 573 MB COCO-style JSON
  hashes in 0.4 s from the page cache and 1.4 s from disk, against 12 s to parse it, so the key reads the content
  rather than trusting size and mtime (a copy that keeps both, or a coarse network-mount mtime, cannot fool it);
- the size and ``mtime_ns`` of each YOLO label file (thousands of small files: hashing them would open each one);
- the ``mtime_ns`` of the image and label folders: an image added, removed or renamed changes it. An image rewritten
  in place does not: after repairing images, delete the cache file the log names;
- every setting that changes the findings (``model.num_classes``, ``data.max_targets``/``on_overflow``/``on_bad``/
  batch size/format/``check``, the splits, whether the train split is trained on), the dataset path as given and
  resolved (findings name files), this checker's own source and rfdetr's version.

Location: ``$XDG_CACHE_HOME/spmd_rfdetr/data_check/`` (default ``~/.cache``), beside the XLA compile cache, rather than
in the dataset: datasets are often read-only mounts or shared between users and configs, and the result names paths of
this machine. Only host 0 reads and writes it (the others receive its report). On a VM recreated after preemption,
point ``XDG_CACHE_HOME`` at a disk that survives it. The newest :data:`KEEP` results are kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from spmd_rfdetr.config.options import RunConfig
from spmd_rfdetr.data.files import layout_of, split_inputs

log = logging.getLogger(__name__)

KEEP = 200  # cached results kept (a few KB each); the oldest go first
_SOURCES = ("checks.py", "dataset_files.py", "check_cache.py", "data.py")  # what decides the findings


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/spmd_rfdetr/data_check`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "spmd_rfdetr" / "data_check"


def fingerprint(cfg: RunConfig, splits: Sequence[str], training: bool) -> str | None:
    """The cache key of checking ``splits`` under ``cfg``; ``None`` when the dataset's layout cannot be told (no
    cache: the check finds that at once)."""
    root, d = Path(cfg.data.dataset_dir), cfg.data
    try:
        layout = layout_of(root, d.dataset_format) if root.is_dir() else None
    except ValueError:
        layout = None
    if layout is None:
        return None
    here = Path(__file__).parent
    settings = {"dataset_dir": d.dataset_dir, "resolved": os.path.abspath(root), "layout": layout,
                "format": d.dataset_format, "splits": list(splits), "training": training, "check": d.check,
                "num_classes": cfg.model.num_classes, "max_targets": d.max_targets, "on_overflow": d.on_overflow,
                "on_bad": d.on_bad, "global_batch_size": d.global_batch_size,
                "per_device_batch_size": d.per_device_batch_size, "rfdetr": metadata.version("rfdetr"),
                "code": [_digest(here / name) for name in _SOURCES]}
    read = set(splits) | ({"train"} if layout == "coco" else set())  # valid/test use train's label mapping
    files, folders = {}, {}
    for split in sorted(read):
        annotations, label_folders, image_folders = split_inputs(root, layout, split)
        files.update({str(p): _digest(p) for p in annotations})
        folders.update({str(p): _folder_state(p, every_file=True) for p in label_folders})
        folders.update({str(p): _folder_state(p, every_file=False) for p in image_folders})
    text = json.dumps({"settings": settings, "files": files, "folders": folders}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def load(key: str) -> tuple[str, Path] | None:
    """The cached report text of ``key`` and its file, or ``None``."""
    path = cache_dir() / f"{key}.json"
    try:
        return path.read_text(encoding="utf-8"), path
    except (OSError, UnicodeDecodeError):
        return None


def store(key: str, text: str) -> Path | None:
    """Write ``text`` as the result of ``key`` (atomically); ``None`` when the cache folder is not writable."""
    folder = cache_dir()
    path = folder / f"{key}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
        _prune(folder)
    except OSError as error:
        log.warning("data check: cannot cache the result in %s (%s); the next run checks again", folder, error)
        return None
    return path


def _prune(folder: Path) -> None:
    results = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    for old in results[:-KEEP]:
        old.unlink(missing_ok=True)


def _digest(path: Path) -> str:
    """sha256 of a file's bytes, or why there are none (the check reports a missing file itself)."""
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as error:
        return f"unreadable: {error.strerror}"


def _folder_state(folder: Path, every_file: bool) -> list:
    """A folder's ``mtime_ns`` and, with ``every_file``, each file's name, size and ``mtime_ns``."""
    try:
        state: list = [folder.stat().st_mtime_ns]
        if every_file:
            with os.scandir(folder) as entries:
                stats = [(e.name, e.stat()) for e in entries]
            state += sorted((name, s.st_size, s.st_mtime_ns) for name, s in stats)
    except OSError as error:
        return [f"unreadable: {error.strerror}"]
    return state

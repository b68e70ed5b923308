"""Quiet by default: what upstream libraries print that does not apply to a run of ours is left out, each by its exact
message and source, all of it here. ``--verbose`` anywhere on the command line (or ``SPMD_RFDETR_VERBOSE=1``, or
``spmd_rfdetr.train(verbose=True)``) shows everything.

- XLA's C++ log (``TF_CPP_MIN_LOG_LEVEL=2``: errors and fatal errors only), unless the variable holds another level
  than torch_xla's default 1 (which every process that imported torch_xla passes on to its children). XLA's
  only per-file switches (``TF_CPP_VMODULE``, ``TF_CPP_MAX_VLOG_LEVEL``) select verbose (VLOG) lines, not warnings, so
  this hides every XLA warning; the one a run of ours prints is GSPMD's deprecation notice, once per compile (13 times
  in the README's CPU quick start). :func:`xla_note` says so once instead. A compile that fails, a device out of
  memory and a malformed ``XLA_FLAGS`` are errors (a Python exception or an ``E``/``F`` log line): they still show.
- Python warnings: :data:`WARNINGS`; rfdetr's log lines: :data:`RFDETR_LOG`; pycocotools' prints while rfdetr reads a
  split's annotations: :func:`library_prints`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from typing import TextIO

VERBOSE_ENV = "SPMD_RFDETR_VERBOSE"
XLA_LOG_ENV = "TF_CPP_MIN_LOG_LEVEL"
#: tsl's levels: 0 info, 1 warnings (torch_xla's default), 2 errors, 3 fatal errors only.
XLA_LOG_LEVEL, XLA_DEFAULT_LEVEL = "2", "1"

#: Python warnings left out: (category, message start, module that ``warnings`` names as its source, why).
WARNINGS = (
    (UserWarning, "Please use the new API settings to control TF32 behavior", "torch",
     "rfdetr sets torch's old float32 matmul precision switch at import (rfdetr/detr.py); TF32 is CUDA's, we run XLA"),
    (UserWarning, "RF-DETR has changed the default training augmentation backend", r"rfdetr\.datasets\.\w+",
     "rfdetr's note to users upgrading from an older rfdetr; we pin rfdetr 1.11.2's pipeline and take no aug_config"),
    (UserWarning, "TypedStorage is deprecated", r"torch\.distributed\.checkpoint\.filesystem",
     "torch's own checkpoint writer calls its deprecated tensor.storage() at every save; we never touch storages"),
    (UserWarning, "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to ",
     r"torch\.distributed\.checkpoint\.state_dict_(saver|loader)",
     "one host: one process drives the whole mesh, so a single-process save/load is right (several: join_hosts)"),
    (UserWarning, "The function definition for SavePlanner.set_up_planner has been updated",
     r"torch\.distributed\.checkpoint\.state_dict_saver",
     "addressed to the planner's author: torch_xla 2.9's SPMDSavePlanner (checkpoint.py only subclasses it)"),
    (UserWarning, "Using a non-tuple sequence for multidimensional indexing is deprecated",
     r"torch_xla\.distributed\.spmd\.xla_sharded_tensor",
     "torch_xla 2.9's XLAShardedTensor.unpadded_data indexes with a list; a checkpoint of weights sharded over "
     "mesh.fsdp reads every shard through it (torch's deprecation is addressed to torch_xla, its last release)"),
    (Warning, "Converting a tensor to a Python ", r"(rfdetr|torch)(\.|$)",
     "torch.jit's TracerWarning while rfdetr's exporter traces its model (export): the graph is traced at one input "
     "shape, where the values read are constants; rfdetr's own export prints the same ~15 lines"),
)

#: rfdetr's log records (its ``rf-detr`` logger, rfdetr/models/backbone/dinov2.py) left out: (message start, why).
RFDETR_LOG = (
    ("Using a different number of positional encodings than DINOv2, which means we're not loading DINOv2 backbone",
     "every RF-DETR variant's backbone differs from DINOv2's: its weights come from pretrain_weights, and a run "
     "from scratch says so itself (resolve.fetch_pretrain_weights)"),
    ("Using patch size ", "the same, for the patch size (16 instead of DINOv2's 14)"),
)

#: Set by :func:`configure` when it chose XLA's log level (for :func:`xla_note`).
_state = {"xla_hidden": False, "xla_level_before": None, "noted": False, "warnings": [], "log_filter": None}


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(message.startswith(start) for start, _ in RFDETR_LOG)


def verbose_requested(verbose: bool = False) -> bool:
    return verbose or os.environ.get(VERBOSE_ENV, "0") not in ("", "0")


def configure(verbose: bool = False) -> None:
    """Quiet (the default) or ``verbose``: called by the CLI at its start and by :func:`spmd_rfdetr.train`, before
    torch_xla and rfdetr are imported. Calling it again switches (XLA's level only while XLA has logged nothing)."""
    if verbose_requested(verbose):
        _loud()
        return
    if _state["log_filter"] is not None:
        return
    before = os.environ.get(XLA_LOG_ENV)
    if before in (None, XLA_DEFAULT_LEVEL) and "torch_xla" not in sys.modules:  # XLA reads it at its first log line
        os.environ[XLA_LOG_ENV] = XLA_LOG_LEVEL
        _state["xla_hidden"], _state["xla_level_before"] = True, before
    for category, message, module, _why in WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category, module=module)
        _state["warnings"].append(warnings.filters[0])
    _state["log_filter"] = _DropRecords()
    logging.getLogger("rf-detr").addFilter(_state["log_filter"])


def _loud() -> None:
    """Undo :func:`configure`'s quiet set-up in this process (a second ``train(verbose=True)``)."""
    if _state["xla_hidden"] and os.environ.get(XLA_LOG_ENV) == XLA_LOG_LEVEL:
        if _state["xla_level_before"] is None:
            del os.environ[XLA_LOG_ENV]
        else:
            os.environ[XLA_LOG_ENV] = _state["xla_level_before"]
    _state["xla_hidden"] = False
    for entry in _state["warnings"]:
        if entry in warnings.filters:
            warnings.filters.remove(entry)
    _state["warnings"] = []
    if _state["log_filter"] is not None:
        logging.getLogger("rf-detr").removeFilter(_state["log_filter"])
        _state["log_filter"] = None


def xla_note() -> None:
    """Once per process, where XLA starts (``runtime.setup_runtime``): the XLA warnings :func:`configure` hid."""
    if _state["xla_hidden"] and not _state["noted"]:
        _state["noted"] = True
        logging.getLogger(__name__).info(
            "XLA's C++ warnings are hidden (%s=%s; errors still show), among them GSPMD's deprecation notice, "
            "which XLA prints at every compile; --verbose shows them", XLA_LOG_ENV, XLA_LOG_LEVEL)


#: pycocotools' progress prints when it reads an annotation file (pycocotools/coco.py, ``COCO.__init__`` and
#: ``createIndex``): 4 lines per split; the data check says what was read.
PYCOCOTOOLS_PRINTS = re.compile(r"loading annotations into memory\.\.\.|Done \(t=\d+\.\d+s\)|creating index\.\.\.|"
                                r"index created!")


class _DropLines(io.TextIOBase):
    """``stream`` less the whole lines :data:`PYCOCOTOOLS_PRINTS` matches (anything else written passes through)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream, self._partial = stream, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if not PYCOCOTOOLS_PRINTS.fullmatch(line):
                self._stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def close_partial(self) -> None:
        if self._partial and not PYCOCOTOOLS_PRINTS.fullmatch(self._partial):
            self._stream.write(self._partial)
        self._partial = ""


@contextlib.contextmanager
def library_prints() -> Iterator[None]:
    """While rfdetr reads a split: stdout less pycocotools' progress prints (:data:`PYCOCOTOOLS_PRINTS`); rfdetr's own
    lines pass. Verbose (or :func:`configure` not called): stdout as it is."""
    if _state["log_filter"] is None:
        yield
        return
    dropping = _DropLines(sys.stdout)
    try:
        with contextlib.redirect_stdout(dropping):
            yield
    finally:
        dropping.close_partial()

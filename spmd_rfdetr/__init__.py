"""Train RF-DETR on TPUs with one process driving the whole SPMD device mesh (Lightning Fabric + torch_xla).

``spmd_rfdetr.train(variant="nano", dataset_dir=..., epochs=..., batch_size=...)`` is the one-call API
(:mod:`spmd_rfdetr.api`); ``python -m spmd_rfdetr fit --config ...`` the CLI.

Where things are (each module's docstring says how it works):

- ``cli`` the verbs (``fit``, ``check-data``, ``validate``, ``predict``, ``export``, ``synth``, ``plan``, ``aot``);
  ``api`` ``train(...)``; ``quiet`` the library warnings left out unless ``--verbose``.
- ``config`` the option dataclasses (the CLI's help text); ``resolve`` their validation and derived values (batch
  shards, multi-scale buckets, the starting weights).
- ``mesh`` the ``(data, fsdp)`` mesh and work on each device's own rows (manual-sharding regions, row lookups);
  ``fabric`` Fabric's accelerator, strategy and precision for one SPMD process; ``runtime`` the PJRT device, SPMD
  switch, persistent compilation cache, precision names.
- ``data`` static-shape batches from rfdetr's readers, multi-scale buckets; ``loader`` the prefetching, sharding
  loader; ``checks``, ``mask_checks``, ``check_cache``, ``dataset_files`` the data check; ``synth`` the synthetic
  dataset.
- ``model`` rfdetr's model, criterion, optimizer and schedule; ``matching`` the on-device exact assignment; ``loss``
  rfdetr's matching cost and set criterion on whole static batches (nothing per image); ``masks`` the seg variants'
  mask cost and losses (packed target masks, point sampling); ``xla_safe`` rfdetr/torch functions that are not
  XLA-safe or not local on a batch-sharded mesh, rewritten for XLA tensors.
- ``build`` the one build path (model, Fabric set-up, criterion, optimizer, schedule, step); ``parallelize`` FSDP
  sharding rules as data; ``plan`` the ``plan`` verb's bytes per device.
- ``step`` the compiled step (step modes, accumulation); ``replay`` trace once and replay; ``openxla_fix`` the openxla
  bridge fix for SPMD training; ``ema`` the EMA inside the step.
- ``loop`` ``fit``: resume, SIGTERM, periodic checkpoints and evaluation, non-finite stop; ``checkpoint`` training
  state (sharding-aware, atomic) and weight files; ``metrics`` counters, ``metrics.jsonl``, progress; ``hosts``
  several hosts (gloo agreement, each host's rows).
- ``evaluate`` the eval program; ``fit_eval`` evaluation inside ``fit`` (best mAP, early stopping); ``coco`` COCO
  results and pycocotools scoring; ``images`` a folder of images read like an eval split; ``inference``
  ``validate`` and ``predict``; ``weights`` weight files and the architecture they hold; ``export`` rfdetr's exporter on a checkpoint's weights.
- ``aot`` the ``aot`` verb: ``fit``'s programs compiled by libtpu for a TPU topology, on a CPU.
"""

__version__ = "0.1.0"


def train(*args, **kwargs):  # type: ignore[no-untyped-def]
    """:func:`spmd_rfdetr.api.train` (imported on first use: ``import spmd_rfdetr`` stays light)."""
    from spmd_rfdetr.api import train as _train

    return _train(*args, **kwargs)

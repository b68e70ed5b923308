"""Train RF-DETR on TPUs with one process driving the whole SPMD device mesh (Lightning Fabric + torch_xla).

``spmd_rfdetr.train(variant="nano", dataset_dir=..., epochs=..., batch_size=...)`` is the one-call API
(:mod:`spmd_rfdetr.api`); ``python -m spmd_rfdetr fit --config ...`` the CLI.

Where things are, by folder; each folder imports only those listed after it (each module's docstring says how it
works):

- ``cli`` the verbs (``fit``, ``check-data``, ``validate``, ``predict``, ``export``, ``synth``, ``plan``, ``aot``);
  ``api`` ``train(...)``; ``quiet`` the library warnings left out unless ``--verbose`` (imported at every level).
- ``aot/`` the ``aot`` verb (``fit``'s programs compiled by libtpu for a TPU topology, on a CPU) and ``plan`` (bytes
  per device).
- ``training/`` ``fit``: ``loop`` (``fit``, light: the runtime starts first), ``run`` (the loop: "due? do it"),
  ``setup`` (start-up), ``saver`` (resume, interval, keep, ``best.pth``/``last.pth``) over ``checkpoint`` (the
  sharding-aware, atomic formats), ``steplog`` (the records, warnings, non-finite stop) over ``metrics``
  (``metrics.jsonl``, counters, progress), ``stops`` (SIGTERM, the non-finite error), ``evaluation`` (eval inside
  ``fit``: best mAP, early stopping); ``build`` the one build path (model, Fabric set-up, criterion, optimizer,
  schedule, step), ``step`` the compiled step (step modes, accumulation), ``optim`` AdamW and the device LR schedule,
  ``ema`` the EMA inside the step.
- ``eval/`` ``evaluator`` the eval program, ``batches`` static eval batches, ``coco`` COCO results and pycocotools
  scoring, ``inference`` ``validate`` and ``predict``.
- ``data/`` ``splits`` rfdetr's splits and the overflow policy, ``pixels`` uint8 on the host and normalised on the
  device, ``batches`` static-shape batches and multi-scale buckets; ``check``, ``check_report``, ``check_masks``,
  ``check_cache``, ``files`` the data check; ``images`` a folder of images read like an eval split; ``synth`` the
  synthetic dataset.
- ``model/`` ``upstream`` rfdetr's model and criterion from our options; ``inputs`` rfdetr's views of a static batch;
  ``matching`` the on-device exact assignment (``matching_problems``: DETR-like problems and SciPy's answer);
  ``loss`` rfdetr's matching cost and set criterion on whole static batches; ``masks`` the seg variants' mask cost and
  losses; ``xla_safe`` rfdetr/torch functions rewritten for XLA tensors (``resize``: resizes as matrix products;
  ``row_lookups``: gathers and bilinear sampling as row lookups; ``deform_attention``: deformable attention as one
  matrix product per image and head; ``attention``: bf16 attention without a kept score matrix);
  ``weights`` weight files and the architecture they hold; ``export`` rfdetr's exporter on a checkpoint's weights.
- ``xla/`` everything torch_xla-specific (the room another backend would sit beside): ``runtime`` the PJRT device,
  SPMD, the persistent compilation cache; ``mesh`` the ``(data, fsdp)`` mesh and work on each device's own rows;
  ``hosts`` several hosts (gloo agreement, each host's rows); ``fabric`` Fabric for one SPMD process; ``loader`` the
  prefetching, sharding loader; ``replay`` trace once and replay (``lowering``: HLO for the ``aot`` verb);
  ``parallelize`` FSDP sharding rules as data and the optimizer state on the device; ``openxla_fix`` the openxla
  bridge fix for SPMD training; ``while_loop`` the XLA ``While`` the matcher runs in.
- ``config/`` ``options`` the option dataclasses (the CLI's help text); ``resolve`` their validation and derived
  values (batch shards, multi-scale buckets, the starting weights, the loader's workers).
"""

__version__ = "0.1.0"


def train(*args, **kwargs):  # type: ignore[no-untyped-def]
    """:func:`spmd_rfdetr.api.train` (imported on first use: ``import spmd_rfdetr`` stays light)."""
    # lazy: `import spmd_rfdetr` stays light: train() loads the CLI and the training loop on first use
    from spmd_rfdetr.api import train as _train

    return _train(*args, **kwargs)

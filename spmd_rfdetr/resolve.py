"""The config resolved and checked as a whole: every problem in one :class:`~spmd_rfdetr.config.ConfigError` before
anything is built, and the values derived from the mesh (the batch's shards, the multi-scale buckets)."""

from __future__ import annotations

import logging
import os
import sys

from spmd_rfdetr.config import RunConfig, ModelOptions, ConfigError, variant_defaults

_warned: set[str] = set()  # warnings resolve_and_check has given in this process (each is given once)


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logging.getLogger(__name__).warning(message)


#: Set by the ``aot`` verb for its trace child: the device type its virtual CPU mesh stands in for.
TRACED_FOR_ENV = "SPMD_RFDETR_TRACED_FOR"


def _backend() -> str | None:
    """The XLA device type (``CPU``, ``TPU`` ...) when torch_xla's runtime is already loaded, else ``None``."""
    if os.environ.get(TRACED_FOR_ENV):
        return os.environ[TRACED_FOR_ENV]
    if "torch_xla.runtime" not in sys.modules:
        return None
    import torch_xla.runtime as xr

    return str(xr.device_type())


#: Why ``trainer.compile_backend=openxla`` is refused on unverified torch_xla versions.
OPENXLA_TRAINING_REFUSED = (
    "trainer.compile_backend=openxla is refused on this torch_xla: torch.compile(backend='openxla') under SPMD returns "
    "stale weight gradients from the second step on (pytorch/xla#4824), and spmd_rfdetr's fix "
    "(spmd_rfdetr/openxla_fix.py) is verified for torch_xla {verified} only. Use trainer.compile_backend=torch_xla "
    "(exact gradients, and the faster replay step mode)."
)


def data_axis(cfg: RunConfig, device_count: int) -> int:
    """Devices on the ``data`` axis of the mesh this config asks for."""
    if cfg.mesh.data != -1:
        return cfg.mesh.data
    return device_count // cfg.mesh.fsdp if cfg.mesh.fsdp >= 1 else device_count


def batch_shards(cfg: RunConfig, device_count: int) -> int:
    """Devices the batch is split over: ``data x fsdp`` of the mesh this config asks for."""
    return data_axis(cfg, device_count) * max(cfg.mesh.fsdp, 1)


def _batch_axes(cfg: RunConfig, device_count: int) -> str:
    """How messages name the batch axes: ``data axis`` or ``data x fsdp axes``, with their device count."""
    axes = "data axis" if cfg.mesh.fsdp == 1 else "data x fsdp axes"
    return f"{axes} ({batch_shards(cfg, device_count)} devices)"


def resolve_and_check(cfg: RunConfig, device_count: int | None = None) -> None:
    """Check the whole config at once and raise :class:`ConfigError` listing every problem.

    With ``device_count``, also resolves ``data.per_device_batch_size`` into ``data.global_batch_size``.
    """
    problems: list[str] = []
    d, t, o = cfg.data, cfg.trainer, cfg.optim
    if d.per_device_batch_size is not None and d.per_device_batch_size < 1:
        problems.append(f"data.per_device_batch_size={d.per_device_batch_size} must be >= 1")
    elif device_count is not None and d.per_device_batch_size is not None and batch_shards(cfg, device_count) > 0:
        d.global_batch_size = d.per_device_batch_size * batch_shards(cfg, device_count)
    if d.num_workers == "auto":
        from spmd_rfdetr.data import worker_count

        d.num_workers = worker_count("auto")  # this host's CPUs, before any loader is built
        logging.getLogger(__name__).info("data.num_workers=auto: %d DataLoader workers", d.num_workers)
    elif not isinstance(d.num_workers, int) or d.num_workers < 0:
        problems.append(f"data.num_workers={d.num_workers!r} must be >= 0 or auto")
    if cfg.trainer.epochs is not None and not cfg.trainer.epochs > 0:
        problems.append(f"trainer.epochs={cfg.trainer.epochs} must be > 0 (or unset: trainer.max_steps counts)")
    e = cfg.eval
    if e.early_stopping and e.every_steps <= 0:
        problems.append("eval.early_stopping needs evaluations: set eval.every_steps > 0")
    if e.early_stopping and e.early_stopping_patience < 1:
        problems.append(f"eval.early_stopping_patience={e.early_stopping_patience} must be >= 1")
    c = cfg.checkpointing
    lower_bounds = [  # (field, value, smallest allowed value, what a value at the bound means)
        ("data.global_batch_size", d.global_batch_size, 1, ""),
        ("data.max_targets", d.max_targets, 1, ""),
        ("trainer.max_steps", t.max_steps, 1, ""),
        ("trainer.log_every", t.log_every, 1, ""),
        ("optim.accumulate", o.accumulate, 1, " (1: no accumulation)"),
        ("optim.warmup_steps", o.warmup_steps, 0, ""),
        ("checkpointing.every_steps", c.every_steps, 0, " (0: a checkpoint only on SIGTERM)"),
        ("checkpointing.keep", c.keep, 0, " (0: keep every checkpoint)"),
        ("eval.max_dets", cfg.eval.max_dets, 1, ""),
    ]
    problems += [f"{name}={value} must be >= {low}{meaning}" for name, value, low, meaning in lower_bounds if value < low]
    problems += _model_problems(cfg)
    problems += _scale_problems(cfg)
    mesh_ok = cfg.mesh.data == -1 or cfg.mesh.data >= 1
    if not mesh_ok:
        problems.append(f"mesh.data={cfg.mesh.data} must be >= 1, or -1 for every device")
    if cfg.mesh.fsdp < 1:
        mesh_ok = False
        problems.append(f"mesh.fsdp={cfg.mesh.fsdp} must be >= 1 (1: no parameter sharding)")
    if cfg.mesh.fsdp_min_numel < 1:
        problems.append(f"mesh.fsdp_min_numel={cfg.mesh.fsdp_min_numel} must be >= 1")
    if cfg.mesh.cpu_devices is not None and cfg.mesh.cpu_devices < 1:
        problems.append(f"mesh.cpu_devices={cfg.mesh.cpu_devices} must be >= 1")
    if device_count is not None and t.precision == "bf16" and _backend() == "CPU":
        _warn_once(
            "trainer.precision=bf16 on the XLA CPU backend: the CPU has no fast bf16 matmuls (slower than fp32 here) "
            "and the results differ from fp32; bf16 is meant for TPUs (trainer.precision=fp32 on CPU)"
        )
    if device_count is not None and mesh_ok:
        axis = batch_shards(cfg, device_count)
        mesh = f"mesh.data={data_axis(cfg, device_count)}" if cfg.mesh.fsdp == 1 else \
            f"mesh.data={cfg.mesh.data} x mesh.fsdp={cfg.mesh.fsdp}"
        if axis > device_count:
            problems.append(f"{mesh} asks for more devices than the {device_count} there are")
        elif axis < 1 or device_count % axis:
            problems.append(f"{mesh} must divide the {device_count} devices (or be -1 for all)")
        elif d.global_batch_size % axis:
            problems.append(
                f"data.global_batch_size={d.global_batch_size} does not divide by the {_batch_axes(cfg, device_count)}"
                f": use a multiple of {axis}, e.g. {axis * max(1, round(d.global_batch_size / axis))}"
            )
        elif o.accumulate > 1 and d.global_batch_size % (axis * o.accumulate):
            step = axis * o.accumulate
            problems.append(
                f"data.global_batch_size={d.global_batch_size} does not split into optim.accumulate={o.accumulate} "
                f"micro-batches over the {_batch_axes(cfg, device_count)}: use a multiple of {step}"
            )
    if t.compile_backend == "openxla":
        from spmd_rfdetr.openxla_fix import VERIFIED_TORCH_XLA, fix_available

        if not fix_available():
            problems.append(OPENXLA_TRAINING_REFUSED.format(verified=", ".join(VERIFIED_TORCH_XLA)))
        if t.matcher != "device":
            problems.append("trainer.compile_backend=openxla needs trainer.matcher=device")
    e = cfg.eval
    if e.every_steps < 0:
        problems.append(f"eval.every_steps={e.every_steps} must be >= 0 (0 = no evaluation inside fit)")
    if e.num_select is not None and e.num_select < 1:
        problems.append(f"eval.num_select={e.num_select} must be >= 1")
    if e.global_batch_size is not None and e.global_batch_size < 1:
        problems.append(f"eval.global_batch_size={e.global_batch_size} must be >= 1")
    elif e.global_batch_size is not None and device_count is not None and mesh_ok:
        axis = batch_shards(cfg, device_count)
        if axis >= 1 and e.global_batch_size % axis:
            problems.append(
                f"eval.global_batch_size={e.global_batch_size} does not divide by the {_batch_axes(cfg, device_count)}"
            )
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def upstream_scales(model: ModelOptions) -> list[int]:
    """rfdetr's per-batch multi-scale sizes for the model: its ``compute_multi_scale_scales`` with its training
    default ``expanded_scales`` (the list its dataset builder reads images at the largest of)."""
    import rfdetr.config
    from rfdetr.datasets.coco import compute_multi_scale_scales

    defaults = variant_defaults(model.variant)
    resolution = model.resolution if model.resolution is not None else defaults["resolution"]
    expanded = rfdetr.config.TrainConfig.model_fields["expanded_scales"].default
    return compute_multi_scale_scales(resolution, expanded, defaults["patch_size"], defaults["num_windows"])


def multi_scale_buckets(cfg: RunConfig) -> list[int]:
    """The training image sizes: ``data.scales`` (or all of rfdetr's) with ``data.multi_scale``, else none."""
    if not cfg.data.multi_scale:
        return []
    return sorted(cfg.data.scales) if cfg.data.scales else upstream_scales(cfg.model)


def _scale_problems(cfg: RunConfig) -> list[str]:
    d = cfg.data
    if d.scales is None:
        return []
    if not d.multi_scale:
        return [f"data.scales={d.scales} needs data.multi_scale=true (it lists the multi-scale buckets)"]
    allowed = upstream_scales(cfg.model)
    wrong = sorted(set(d.scales) - set(allowed))
    if wrong or not d.scales:
        return [f"data.scales={d.scales}: use some of rfdetr's scales for this model, {allowed}"]
    return []


def _model_problems(cfg: RunConfig) -> list[str]:
    """Resolution and query-count rules of the variant, with rfdetr's own defaults for fields left ``None``."""
    m, problems = cfg.model, []
    defaults = variant_defaults(m.variant)
    block = defaults["patch_size"] * defaults["num_windows"]
    resolution = m.resolution if m.resolution is not None else defaults["resolution"]
    if resolution < block or resolution % block:
        problems.append(
            f"model.resolution={resolution} must be a multiple of {block} for model.variant={m.variant} (rfdetr's "
            f"patch_size {defaults['patch_size']} x num_windows {defaults['num_windows']}), e.g. "
            f"{block * max(1, round(resolution / block))}"
        )
    queries = m.num_queries if m.num_queries is not None else defaults["num_queries"]
    if queries < 1:
        problems.append(f"model.num_queries={queries} must be >= 1")
    elif cfg.data.max_targets > queries:
        source = "model.num_queries" if m.num_queries is not None else f"model.variant={m.variant}'s num_queries"
        problems.append(
            f"data.max_targets={cfg.data.max_targets} is more than the {queries} queries per group ({source}): the "
            "matcher gives every target its own query. Lower data.max_targets or raise model.num_queries"
        )
    for name in ("group_detr", "dec_layers", "num_classes", "backbone_blocks"):
        value = getattr(m, name)
        if value is not None and value < 1:
            problems.append(f"model.{name}={value} must be >= 1")
    if m.backbone_blocks is not None and m.pretrain_weights is not None:
        problems.append(f"model.backbone_blocks={m.backbone_blocks} builds a backbone no published weights fit: "
                        "leave it unset to start from model.pretrain_weights")
    return problems

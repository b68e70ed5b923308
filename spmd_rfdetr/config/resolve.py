"""The config resolved and checked as a whole: every problem in one :class:`~spmd_rfdetr.config.options.ConfigError` before
anything is built, and the values derived from the mesh (the batch's shards, the multi-scale buckets)."""

from __future__ import annotations

import logging
import os
from importlib.metadata import version

from spmd_rfdetr.config.backend import fused_attention_problems, xla_backend
from spmd_rfdetr.config.length import evaluates_in_fit
from spmd_rfdetr.config.options import (AUTO_WEIGHTS, ConfigError, ModelOptions, RunConfig, is_keypoint, is_segmentation,
                                        logit_count, published_weights, resolved_weights,
                                        variant_defaults)

_warned: set[str] = set()  # warnings resolve_and_check has given in this process (each is given once)


#: The torch_xla versions :mod:`spmd_rfdetr.xla.openxla_fix` was verified on (``trainer.compile_backend=openxla``).
VERIFIED_TORCH_XLA = ("2.9.0",)


def fix_available() -> bool:
    """Whether this torch_xla is one the openxla bridge fix was verified on (reads the version without importing it)."""
    return version("torch_xla").split("+")[0] in VERIFIED_TORCH_XLA


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logging.getLogger(__name__).warning(message)


#: Why ``trainer.compile_backend=openxla`` is refused on unverified torch_xla versions.
OPENXLA_TRAINING_REFUSED = (
    "trainer.compile_backend=openxla is refused on this torch_xla: torch.compile(backend='openxla') under SPMD returns "
    "stale weight gradients from the second step on (pytorch/xla#4824), and spmd_rfdetr's fix "
    "(spmd_rfdetr/xla/openxla_fix.py) is verified for torch_xla {verified} only. Use trainer.compile_backend=torch_xla "
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
        d.num_workers = worker_count("auto")  # this host's CPUs, before any loader is built
        logging.getLogger(__name__).info("data.num_workers=auto: %d DataLoader workers", d.num_workers)
    elif not isinstance(d.num_workers, int) or d.num_workers < 0:
        problems.append(f"data.num_workers={d.num_workers!r} must be >= 0 or auto")
    if cfg.trainer.epochs is not None and not cfg.trainer.epochs > 0:
        problems.append(f"trainer.epochs={cfg.trainer.epochs} must be > 0 (or unset: trainer.max_steps counts)")
    e = cfg.eval
    if cfg.optim.warmup_epochs is not None and not cfg.optim.warmup_epochs >= 0:
        problems.append(f"optim.warmup_epochs={cfg.optim.warmup_epochs} must be >= 0")
    if e.every_epochs is not None and e.every_steps != 0:
        problems.append(f"eval.every_steps={e.every_steps} and eval.every_epochs={e.every_epochs} are both set: "
                        "evaluate in steps (--eval.every_epochs null) or in epochs (eval.every_steps: 0)")
    if e.every_epochs is not None and not e.every_epochs > 0:
        problems.append(f"eval.every_epochs={e.every_epochs} must be > 0 (or unset: eval.every_steps counts)")
    if e.early_stopping and not evaluates_in_fit(cfg):
        problems.append("eval.early_stopping needs evaluations: set eval.every_steps > 0 or eval.every_epochs")
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
        ("optim.lr_reference_batch", o.lr_reference_batch, 1, ""),
        ("checkpointing.every_steps", c.every_steps, 0, " (0: a checkpoint only on SIGTERM)"),
        ("checkpointing.keep", c.keep, 0, " (0: keep every checkpoint)"),
        ("eval.max_dets", cfg.eval.max_dets, 1, ""),
    ]
    problems += [f"{name}={value} must be >= {low}{meaning}" for name, value, low, meaning in lower_bounds if value < low]
    problems += _model_problems(cfg)
    cfg.model.pretrain_weights = resolved_weights(cfg.model)  # auto: the variant's published file, as config.yaml says
    problems += _scale_problems(cfg)
    problems += _head_problems(cfg)
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
    if t.bf16_streams and t.precision != "bf16":
        problems.append(f"trainer.bf16_streams=true rounds activations to bf16 under bf16 autocast; with "
                        f"trainer.precision={t.precision} it would do nothing: set trainer.precision=bf16 or drop it")
    problems += fused_attention_problems(t)
    problems += _keypoint_groups_problems(cfg)
    if device_count is not None and t.precision == "bf16" and xla_backend() == "CPU":
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
        if not fix_available():
            problems.append(OPENXLA_TRAINING_REFUSED.format(verified=", ".join(VERIFIED_TORCH_XLA)))
        if t.matcher != "device":
            problems.append("trainer.compile_backend=openxla needs trainer.matcher=device")
    e = cfg.eval
    if e.every_steps < 0:
        problems.append(f"eval.every_steps={e.every_steps} must be >= 0 (0 = no evaluation inside fit)")
    if e.num_select is not None and e.num_select < 1:
        problems.append(f"eval.num_select={e.num_select} must be >= 1")
    elif e.num_select is not None and cfg.model.num_classes is not None:  # else read from the dataset, and
        m = cfg.model  # upstream_configs checks it when the model is built (before anything compiles)
        queries = m.num_queries if m.num_queries is not None else variant_defaults(m.variant)["num_queries"]
        problem = num_select_problem(e.num_select, queries, m.num_classes) if queries >= 1 and m.num_classes >= 1 \
            else None
        if problem:
            problems.append(problem)
    if not e.trace_alpha >= 0:
        problems.append(f"eval.trace_alpha={e.trace_alpha} must be >= 0 (rfdetr's postprocess_trace_alpha; 0: no fusion)")
    if e.keypoint_oks_sigmas is not None and not (e.keypoint_oks_sigmas and all(
            0 < sigma < float("inf") for sigma in e.keypoint_oks_sigmas)):
        problems.append(f"eval.keypoint_oks_sigmas={e.keypoint_oks_sigmas}: one positive sigma per keypoint (e.g. "
                        "[0.05, 0.05, ...]), or unset for rfdetr's")
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


def scale_lr(cfg: RunConfig) -> None:
    """``optim.lr``/``lr_encoder`` scaled to the global batch by ``optim.lr_scaling`` (once, when ``fit`` starts)."""
    o, batch = cfg.optim, cfg.data.global_batch_size
    if o.lr_scaling == "none" or batch == o.lr_reference_batch:
        return
    factor = batch / o.lr_reference_batch if o.lr_scaling == "linear" else (batch / o.lr_reference_batch) ** 0.5
    logging.getLogger(__name__).info(
        "optim.lr_scaling=%s: a global batch of %d is %g x optim.lr_reference_batch=%d: lr %g -> %g, lr_encoder %g -> "
        "%g", o.lr_scaling, batch, batch / o.lr_reference_batch, o.lr_reference_batch, o.lr, o.lr * factor,
        o.lr_encoder, o.lr_encoder * factor)
    o.lr, o.lr_encoder = o.lr * factor, o.lr_encoder * factor


def num_select_problem(num_select: int, num_queries: int, num_classes: int) -> str | None:
    """Why ``eval.num_select`` cannot be used with this many queries and classes (``None``: it can)."""
    limit = logit_count(num_queries, num_classes)
    if num_select <= limit:
        return None
    return (f"eval.num_select={num_select} is more than the {limit} logits the model outputs per image (its "
            f"{num_queries} queries x (num_classes {num_classes} + 1)): use at most {limit}, or leave it unset")


def worker_count(num_workers: int | str) -> int:
    """``data.num_workers`` as a number: ``auto`` is the CPUs this process may run on, less one for the main
    process (``os.sched_getaffinity``; ``os.cpu_count`` where there is none)."""
    if num_workers != "auto":
        return int(num_workers)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(cpus - 1, 0)


def published_names() -> list[str]:
    """The file names of rfdetr's published weights (``rf-detr-nano.pth`` ...)."""
    # lazy: rfdetr imports torch_xla: the CLI imports this module before the device choice
    from rfdetr.assets.model_weights import ModelWeights

    return list(ModelWeights.list_models())


def fetch_pretrain_weights(model: ModelOptions) -> None:
    """``fit``'s starting weights, settled before anything is built or compiled: from scratch (said once, here), a
    file on disk, or one of rfdetr's published weights, which rfdetr downloads now into its cache (``$RF_HOME``,
    default ``~/.roboflow/models``). Raises one :class:`ConfigError` saying how to go on when the file is not there
    and cannot be downloaded (offline, a failed download, an unknown name)."""
    weights = resolved_weights(model)
    published = published_weights(model.variant)
    if weights is None:
        _warn_once(f"model.pretrain_weights: null: training from scratch (no COCO-pretrained weights); fine-tuning "
                   f"from the published {published} (model.pretrain_weights: auto, the default) usually converges "
                   "far faster")
        return
    # lazy: rfdetr imports torch_xla: the CLI imports this module before the device choice
    from rfdetr.assets.model_weights import ModelWeights, download_pretrain_weights, get_model_cache_dir
    from rfdetr.config import ModelConfig

    path = str(ModelConfig.expand_path(weights))  # where rfdetr's loader reads it: a bare name is in its cache
    if os.path.isfile(path):
        return
    name = os.path.basename(path)
    given = f"model.pretrain_weights={model.pretrain_weights}"
    if model.pretrain_weights == AUTO_WEIGHTS:
        given += f" (model.variant={model.variant}'s published weights, {published})"
    elif weights == published:  # auto, resolved by resolve_and_check, or that name given
        given += f" (model.variant={model.variant}'s published weights)"
    local = (f"pass a local copy: --model.pretrain_weights /path/to/{name} (or model.pretrain_weights in the YAML "
             "config); or model.pretrain_weights: null (--model.pretrain_weights null) to train from scratch")
    asset = ModelWeights.from_filename(name)
    if asset is None:
        raise ConfigError(f"{given}: no such file ({path}), and not one of rfdetr's published weights "
                          f"({', '.join(ModelWeights.list_models())}): {local}")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        download_pretrain_weights(path)
    except Exception as error:  # offline, a proxy, HTTP errors, an MD5 mismatch, an unwritable cache: all one message
        reason = f"{type(error).__name__}: {error}"
    else:
        if os.path.isfile(path):
            return
        reason = "no file was written"
    reason = reason if len(reason) <= 300 else reason[:300] + " ..."
    raise ConfigError(
        f"{given}: {path} is not there and rfdetr could not download it from {asset.url} ({reason}). Download "
        f"{name} on a machine with internet and copy it into rfdetr's cache ($RF_HOME, here {get_model_cache_dir()}),"
        f" or {local}"
    )


def upstream_scales(model: ModelOptions) -> list[int]:
    """rfdetr's per-batch multi-scale sizes for the model: its ``compute_multi_scale_scales`` with its training
    default ``expanded_scales`` (the list its dataset builder reads images at the largest of)."""
    # lazy: rfdetr imports torch_xla: the CLI imports this module before the device choice
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


def _keypoint_groups_problems(cfg: RunConfig) -> list[str]:
    """``trainer.keypoint_groups``: the keypoint model, 1..group_detr groups, the device matcher (our criterion)."""
    groups = cfg.trainer.keypoint_groups
    if groups is None:
        return []
    if not is_keypoint(cfg.model.variant):
        return [f"trainer.keypoint_groups={groups} limits the keypoint model's keypoint stream; "
                f"model.variant={cfg.model.variant} has none: drop it"]
    total = cfg.model.group_detr or variant_defaults(cfg.model.variant)["group_detr"]
    problems = []
    if not 1 <= groups <= total:
        problems.append(f"trainer.keypoint_groups={groups} must be between 1 and the {total} query groups "
                        "(model.group_detr)")
    if cfg.trainer.matcher != "device":
        problems.append(f"trainer.keypoint_groups needs trainer.matcher=device (our criterion masks the other "
                        f"groups' keypoint costs; rfdetr's, which trainer.matcher={cfg.trainer.matcher} runs, cannot)")
    return problems


def _head_problems(cfg: RunConfig) -> list[str]:
    """What the ``seg-*`` and keypoint variants do not train with (yet): each an error naming the setting to change."""
    variant = cfg.model.variant
    if is_segmentation(variant):
        refuser = "mask loss refuses padded targets (SetCriterion.loss_masks)"
    elif is_keypoint(variant):
        refuser = "keypoint loss refuses padded targets (SetCriterion.loss_keypoints)"
    else:
        return []
    problems = []
    if cfg.trainer.matcher == "scipy":
        problems.append(f"trainer.matcher=scipy with model.variant={variant}: rfdetr's own {refuser}; use "
                        "trainer.matcher=device")
    if cfg.trainer.compile_backend == "openxla":
        problems.append(f"trainer.compile_backend=openxla with model.variant={variant} is not supported yet; use "
                        "trainer.compile_backend=torch_xla")
    return problems


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
    if m.num_keypoints_per_class is not None and (not is_keypoint(m.variant) or not m.num_keypoints_per_class
                                                   or min(m.num_keypoints_per_class) < 0):
        problems.append(f"model.num_keypoints_per_class={m.num_keypoints_per_class}: keypoints per class label (>= 0 "
                        "each, e.g. [17]) of model.variant=keypoint-preview; leave it unset for other variants")
    for name in ("group_detr", "dec_layers", "num_classes", "backbone_blocks"):
        value = getattr(m, name)
        if value is not None and value < 1:
            problems.append(f"model.{name}={value} must be >= 1")
    published = m.pretrain_weights is not None and (m.pretrain_weights == AUTO_WEIGHTS or os.path.basename(
        str(m.pretrain_weights)) in published_names())  # a local weight file (a fit's own, same backbone) may fit
    if m.backbone_blocks is not None and m.backbone_blocks >= 1 and published:
        weights = m.pretrain_weights if m.pretrain_weights != AUTO_WEIGHTS else \
            f"{AUTO_WEIGHTS} (the default: {published_weights(m.variant)})"
        problems.append(f"model.backbone_blocks={m.backbone_blocks} builds a backbone no published weights fit, but "
                        f"model.pretrain_weights={weights} starts from weights: set model.pretrain_weights: null "
                        "(--model.pretrain_weights null) to train it from scratch, pass a weight file of the same "
                        "backbone, or leave model.backbone_blocks unset")
    return problems

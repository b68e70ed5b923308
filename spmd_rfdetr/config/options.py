"""Typed run configuration: one dataclass per concern, validated in one place (``resolve.resolve_and_check``).

jsonargparse turns these dataclasses into the CLI (``--data.dataset_dir`` ...) and reads each field's docstring as its
help text, so every field below carries one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Precision = Literal["fp32", "bf16"]


@dataclass
class ModelOptions:
    """Which RF-DETR to build. Fields left ``None`` keep the variant's upstream default."""

    variant: Literal["nano", "small", "medium", "large", "base", "seg-nano", "seg-small", "seg-medium", "seg-large",
                     "seg-xlarge", "seg-2xlarge", "seg-preview", "keypoint-preview"] = "nano"
    """RF-DETR size, as in ``rfdetr`` (``RFDETRNanoConfig`` ...); ``seg-*`` are rfdetr's instance-segmentation models
    (``RFDETRSegNano`` ...: a mask head, mask losses and segm mAP; the dataset needs a ``segmentation`` for every
    annotation); ``keypoint-preview`` is rfdetr's keypoint model (``RFDETRKeypointPreview``: GroupPose keypoints,
    keypoint losses and OKS keypoint mAP; the keypoint schema and flip pairs come from the dataset, as in rfdetr)."""
    resolution: int | None = None
    """Square input resolution in pixels; must divide by the variant's ``patch_size * num_windows`` (rfdetr's model
    config: 32 for Nano/Small/Medium/Large, 56 for Base, 12 for Seg Nano, 24 for the other ``seg-*`` and ``keypoint-preview``). ``None``: the
    variant's default."""
    num_queries: int | None = None
    """Object queries per group at inference (``None``: the variant's default, 300; 100-300 for the ``seg-*``
    variants); must be >= ``data.max_targets``."""
    group_detr: int | None = None
    """Query groups used during training (Group DETR); inference uses one."""
    dec_layers: int | None = None
    """Decoder layers."""
    backbone_blocks: int | None = None
    """DINOv2 blocks to build (``None``: the variant's 12). Fewer make a smaller RF-DETR that compiles in a fraction
    of the time, for smoke runs and tests of the training loop (torchtitan's "debug model"); its last blocks feed the
    decoder. No published weights fit it, and upstream rfdetr cannot rebuild it from a weight file."""
    num_classes: int | None = None
    """Number of classes; ``None`` reads it from the dataset."""
    num_keypoints_per_class: list[int] | None = None
    """``keypoint-preview`` only: keypoints per class label (rfdetr's ``num_keypoints_per_class``, e.g. ``[17]``);
    ``None`` reads it from the dataset's keypoint categories as rfdetr does (``fit`` records what it read, so a weight
    file rebuilds its model without the dataset). A dataset whose categories say otherwise wins, as in rfdetr."""
    pretrain_weights: str | None = "auto"
    """RF-DETR checkpoint to fine-tune from. ``auto``: the variant's published COCO weights, as upstream (the default
    of rfdetr's config class: ``rf-detr-nano.pth`` for Nano ...); a published rfdetr name such as ``rf-detr-nano.pth``
    is downloaded by rfdetr into its cache (``$RF_HOME``, default ``~/.roboflow/models``) unless it is there already,
    and ``fit`` stops before anything compiles if it cannot be; or a local ``.pth`` (rfdetr's or a ``fit`` weight
    file), e.g. that file copied to a machine without internet; ``null``: from scratch. A class head of another size
    is resized to ``num_classes`` by rfdetr's own loader."""
    ema: bool = True
    """Keep an exponential moving average of the weights inside the compiled step (upstream's trainer's EMA, on by
    default as upstream). Evaluation, ``best.pth``, ``last.pth`` and exports then use the EMA weights."""
    ema_decay: float = 0.993
    """EMA decay (rfdetr's ``ema_decay``)."""
    ema_tau: int = 100
    """EMA warm-up in steps: the decay at update ``n`` is ``ema_decay * (1 - exp(-n / ema_tau))`` (0: no warm-up)."""


@dataclass
class DataOptions:
    """Where the images come from and how batches are shaped (every batch has the same shapes)."""

    dataset_dir: str = "data/synth"
    """Dataset root: a Roboflow/COCO export (``train/_annotations.coco.json``) or a YOLO layout."""
    dataset_format: Literal["roboflow", "coco", "yolo"] = "roboflow"
    """``roboflow`` auto-detects COCO or YOLO layouts; ``coco`` expects the COCO 2017 folder layout."""
    global_batch_size: int = 8
    """Images per step over the whole mesh; must divide by the batch axes (``mesh.data x mesh.fsdp`` devices)."""
    per_device_batch_size: int | None = None
    """When set, overrides ``global_batch_size`` with this many images per device (``mesh.data x mesh.fsdp``)."""
    max_targets: int = 100
    """Ground-truth boxes per image after padding (a fixed shape); must be <= ``num_queries``."""
    on_overflow: Literal["error", "truncate"] = "error"
    """An image with more than ``max_targets`` boxes: ``error`` stops before training and names the files;
    ``truncate`` keeps the largest ``max_targets`` boxes and logs how many images and boxes were cut."""
    num_workers: int | Literal["auto"] = 2
    """DataLoader worker processes; each decodes and augments whole images (measured 69-155 images/s per worker at
    384 px from 1280x960-640x480 JPEGs: ``benchmarks/run.py --loader``). ``auto``: the CPUs this process may run on
    (``os.sched_getaffinity``) less one for the main process."""
    prefetch: int = 2
    """Batches loaded and sent to the device ahead of the step in a background thread (0: load synchronously). With
    ``num_workers: 0`` that thread also runs rfdetr's random augmentations on torch's global host RNG, shared with
    the main thread (``compile_backend: openxla`` compiles draw from it): for bit-reproducible batches there, use
    worker processes or 0 here."""
    multi_scale: bool = False
    """rfdetr's per-batch multi-scale training (its default mode): the train split is read at the largest scale and
    every batch is resized to one scale drawn per step as rfdetr draws it (``random.Random(step).choice(scales)``).
    Each scale is a bucket with its own compiled training graph, compiled when the bucket is first used (the steps are
    known in advance and logged). Evaluation stays at ``model.resolution``."""
    scales: list[int] | None = None
    """With ``multi_scale``: the buckets, some of rfdetr's scales for the model (``rfdetr.datasets.coco.
    compute_multi_scale_scales`` with its default ``expanded_scales``: up to 11 sizes around the resolution); default
    all of them. Fewer buckets, fewer compiles."""
    on_bad: Literal["error", "skip"] = "error"
    """What the data check (``check-data``, and the start of ``fit``/``validate``/``predict``) does with problems
    that can be skipped without guessing: unreadable or missing train images, and boxes of zero/negative size or
    outside the image. ``error``: stop, listing every problem; ``skip``: train without those images (rfdetr already
    drops such boxes or clips them to the image), naming each and counting them in the log. Schema errors, unknown
    categories, labels >= ``num_classes``, problems in the eval split and an empty split are always errors."""
    check: Literal["full", "annotations", "off"] = "full"
    """How much the data check reads: ``full``: the annotations and every image's header (finds missing, empty and
    truncated images); ``annotations``: the annotations only, no image opened (boxes are checked against the sizes
    the annotations declare); ``off``: no check at all (a warning says so). The result is cached by the annotation
    files' contents and these settings (``$XDG_CACHE_HOME/spmd_rfdetr/data_check``): a second run on an unchanged
    dataset, such as a resume, opens no image. On several hosts host 0 checks and the others receive its result."""


@dataclass
class OptimOptions:
    """AdamW with rfdetr's parameter groups, gradient clipping, warmup and a cosine, step or constant schedule (rfdetr's
    formulas after warm-up; the warm-up and the defaults differ from rfdetr's, as each field says)."""

    lr: float = 1e-4
    """Learning rate of the decoder/heads."""
    lr_encoder: float = 1.5e-4
    """Learning rate of the backbone (scaled per layer by ``lr_vit_layer_decay``)."""
    weight_decay: float = 1e-4
    """AdamW weight decay (rfdetr's no-decay rules apply to the backbone)."""
    lr_scaling: Literal["none", "sqrt", "linear"] = "none"
    """How ``lr`` and ``lr_encoder`` follow the global batch: set for ``lr_reference_batch`` images per step, ``fit``
    multiplies both by ``global batch / lr_reference_batch`` (``linear``) or its square root (``sqrt``) once the
    mesh is known (logged); ``none`` keeps them. Fine-tuning on the CPU mesh at 4x the batch and equal epochs,
    linear kept the most mAP (``benchmarks/README.md``: "Batch size and learning rate")."""
    lr_reference_batch: int = 16
    """The global batch ``lr`` and ``lr_encoder`` are set for (rfdetr's: 4 images x 4 accumulation steps)."""
    lr_vit_layer_decay: float = 0.8
    """Per-layer LR decay of the ViT backbone."""
    lr_component_decay: float = 0.7
    """LR multiplier of the transformer decoder."""
    clip_max_norm: float = 0.1
    """Gradient clipping by global L2 norm; 0 disables."""
    warmup_steps: int = 0
    """Linear warmup steps: step ``s`` (from 0) of ``w`` uses ``(s + 1) / (w + 1)`` of the LR, never 0. rfdetr's is
    ``s / w`` (its first step has LR 0 and does not move the weights); both reach the full LR at step ``w``."""
    warmup_epochs: float | None = None
    """rfdetr's unit for the warmup: passes over the train split, converted to ``warmup_steps`` when ``fit`` starts
    (as ``trainer.epochs``; it replaces ``warmup_steps``); ``None``: ``warmup_steps`` counts."""
    schedule: Literal["cosine", "step", "constant"] = "cosine"
    """LR schedule after warmup: ``cosine`` (to ``min_lr_factor`` at ``trainer.max_steps``) and ``step`` (see
    ``lr_drop_step``) use rfdetr's formulas; ``constant`` keeps the peak (rfdetr has no such preset: its ``step``
    before the drop). rfdetr's default is ``step``, with the drop after 100 epochs."""
    min_lr_factor: float = 0.05
    """Cosine: final LR as a fraction of the peak. rfdetr's default ``min_factor`` is 0.0 (decay to zero)."""
    lr_drop_step: int = 0
    """Step schedule: the LR drops 10x at this optimizer step (0 = never). rfdetr counts its ``lr_drop`` in epochs:
    the same drop is ``lr_drop_step = lr_drop x steps per epoch``."""
    accumulate: int = 1
    """Micro-batches per optimizer step, run one after another inside the one compiled step (gradient accumulation
    with static shapes): ``data.global_batch_size`` images per optimizer step in ``accumulate`` pieces, so each piece
    needs 1/``accumulate`` of the activation memory. Losses are normalised by the whole batch's box count, as rfdetr
    does, so the update is that of one batch of ``global_batch_size``."""


@dataclass
class MeshOptions:
    """The device mesh one process drives."""

    data: int = -1
    """Size of the ``data`` axis (parameters replicated along it); -1 uses every device left after ``fsdp``. The batch
    is split over ``data x fsdp`` devices."""
    fsdp: int = 1
    """Size of the ``fsdp`` axis: every parameter of at least ``fsdp_min_numel`` elements with a dimension divisible
    by it is sharded along it (so are its gradient, AdamW state and EMA copy), the rest replicated; 1: pure data
    parallelism. ``data x fsdp`` must be the device count (``python -m spmd_rfdetr plan`` prints the bytes per device
    for a mesh before you rent one)."""
    fsdp_min_numel: int = 2**16
    """Parameters with fewer elements stay replicated on the ``fsdp`` axis (sharding them saves little and adds
    collectives)."""
    cpu_devices: int | None = None
    """Run on this many virtual XLA CPU devices (sets ``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES``) unless
    ``PJRT_DEVICE`` is already set. For trying things out without a TPU."""


@dataclass
class TrainerOptions:
    """How long to train and what to write."""

    output_dir: str = "output"
    """Where ``metrics.jsonl``, ``config.yaml`` and checkpoints go."""
    max_steps: int = 1000
    """Optimizer steps to run (``epochs``, when set, decides it instead)."""
    epochs: float | None = None
    """Passes over the train split, as rfdetr counts training: when set, ``max_steps`` becomes ``epochs`` x (usable
    train images // ``data.global_batch_size``), fixed at the start of the run (the LR schedule, the last step and
    ``eval.every_steps`` then count in those steps; a resume recomputes the same number)."""
    log_every: int = 50
    """Read the loss back from the device every N steps (the only host syncs of the loop)."""
    precision: Precision = "bf16"
    """``bf16``: bf16 matmuls with fp32 weights (autocast); ``fp32``: full precision."""
    bf16_streams: bool = False
    """With ``precision: bf16``, keep the residual streams (every LayerNorm's output but the two-stage proposals',
    DINOv2's embeddings and layer scales) in bf16 instead of float32, as TPU trainers keep activations; weights,
    optimizer and loss stay float32 (:mod:`spmd_rfdetr.model.streams`). Fewer HBM bytes per step; a numerics change
    (``benchmarks/README.md``)."""
    keypoint_groups: int | None = None
    """The keypoint model only: train the keypoint stream (GroupPose's keypoint tokens, costs and losses) on the first
    this many of the ``model.group_detr`` query groups; the others train as plain detection groups. Evaluation (group
    0) is unchanged. ``None``: every group, as rfdetr (13 by default; the stream is about half the step's FLOPs and
    most of its HBM bytes). A numerics change (:mod:`spmd_rfdetr.model.keypoint_groups`, ``benchmarks/README.md``)."""
    fused_attention: bool = False
    """Run the training step's attention (the decoder's self-attention, DINOv2's) as Pallas TPU kernels that keep
    their score matrices on chip (:mod:`spmd_rfdetr.xla.fused_attention`): v5e.yaml's step moves 32% fewer HBM bytes
    by the TPU compiler. Opt-in: compiled ahead of time (``aot``) and tested in Pallas's interpreter, which runs them
    (slowly) on other backends, but no chip has run them yet. Not on TPU v3, whose compiler refuses them (a config
    error). Needs JAX (``pip install -e ".[tpu,aot]"``)."""
    seed: int = 42
    """Seed for model init and data order."""
    matcher: Literal["device", "scipy"] = "device"
    """Assignment solver: ``device`` keeps the whole step one XLA graph; ``scipy`` is upstream's host path."""
    progress_bar: bool | None = None
    """Show a progress bar; ``None`` shows it only on a terminal."""
    step_mode: Literal["replay", "trace"] = "replay"
    """``replay``: trace the step's Python once, then replay its compiled program every step (host cost per step
    near zero; a second trace at step 2 checks nothing per-step was baked in, else it falls back to ``trace``).
    ``trace``: lazy tracing re-runs the step's Python every step (``torch_xla.compile``). ``matcher=scipy`` always
    traces."""
    on_nonfinite: Literal["stop", "skip_step"] = "stop"
    """A step whose loss or gradient norm is NaN/inf never changes the weights (checked on the device). ``stop``: fit
    stops at the next log or checkpoint point, naming the steps; ``skip_step``: training goes on, the skipped steps are
    counted in ``metrics.jsonl`` (``nonfinite_steps``)."""
    resume: str | None = None
    """``auto``: continue from the newest complete checkpoint in ``output_dir/checkpoints`` (a fresh start if there is
    none); a path: continue from that checkpoint directory; ``None``: start fresh."""
    loggers: list[Literal["tensorboard", "csv", "wandb"]] = field(default_factory=list)
    """Extra loggers fed every numeric field of every ``metrics.jsonl`` record, writing under ``output_dir/logs``:
    Lightning Fabric's ``tensorboard`` and ``csv``, and Weights & Biases (``wandb``, Lightning's ``WandbLogger``; the
    resolved config is the W&B run's config). Several hosts: the coordinator logs. ``wandb`` needs ``wandb login`` or
    ``WANDB_API_KEY`` (checked before anything is built), or ``WANDB_MODE=offline`` (``wandb sync`` uploads later)."""
    wandb_project: str = "spmd_rfdetr"
    """The W&B project of ``loggers: [wandb]`` (rfdetr's ``project``); the entity is your default one, or
    ``WANDB_ENTITY``."""
    wandb_run: str | None = None
    """The W&B run's display name (rfdetr's ``run``); ``None``: the name of ``output_dir``. Each ``fit``, a resume
    too, is a new W&B run (its steps continue where the checkpoint left off)."""
    compile_cache_dir: str | None = None
    """Persistent XLA compilation cache (a second run with the same config compiles nothing). ``None``: a directory
    under ``~/.cache/spmd_rfdetr/xla`` on TPU; the XLA CPU backend cannot read its own cache back, so it is off there."""
    compile_backend: Literal["torch_xla", "openxla"] = "torch_xla"
    """How the training step is compiled: ``torch_xla`` (lazy tracing, in ``step_mode``). ``openxla``
    (``torch.compile(backend="openxla")``, dynamo: several programs per step) with this project's fix for torch_xla's
    stale weight gradients under SPMD (pytorch/xla#4824); refused on torch_xla versions the fix is not verified for.
    Evaluation always uses ``openxla``."""


@dataclass
class CheckpointOptions:
    """Full training-state checkpoints for resuming (``output_dir/checkpoints/step_XXXXXXXX``), sharding-aware."""

    every_steps: int = 1000
    """Save the full training state every N steps (and on SIGTERM); 0: only on SIGTERM."""
    keep: int = 2
    """How many of the newest full checkpoints to keep; 0 keeps every one."""


@dataclass
class EvalOptions:
    """COCO evaluation of a split on the mesh (inside ``fit``, and for ``validate``)."""

    every_steps: int = 0
    """Inside ``fit``: evaluate every N optimizer steps and after the last one, keeping the best weights by mAP as
    ``best.pth``; 0 turns evaluation inside ``fit`` off (unless ``every_epochs`` is set)."""
    every_epochs: float | None = None
    """Inside ``fit``: evaluate every N passes over the train split instead, as rfdetr's ``eval_interval`` counts:
    converted once at the start to ``round(N x steps per epoch)`` steps (at least 1), with the steps per epoch
    ``trainer.epochs`` uses (usable train images // ``data.global_batch_size``); a resume converts it the same way.
    Set it or ``every_steps``, not both (``every_steps: 0`` with it)."""
    split: Literal["valid", "test", "train"] = "valid"
    """Dataset split to evaluate."""
    global_batch_size: int | None = None
    """Images per eval batch over the whole mesh (the last batch is padded to it); ``None`` uses
    ``data.global_batch_size``. Must divide by the batch axes (``mesh.data x mesh.fsdp`` devices)."""
    num_select: int | None = None
    """Detections kept per image (top-k over queries x classes, as rfdetr's PostProcess); at most the logits the model
    outputs, ``num_queries x (num_classes + 1)``. ``None``: rfdetr's default for the variant (its ``num_select``, 300),
    lowered to that many logits when the model has fewer (a small ``num_queries``)."""
    save_detections: bool = False
    """Inside ``fit``: also write each evaluation's detections (COCO results JSON) next to its metrics."""
    max_dets: int = 500
    """Detections per image COCO scores (pycocotools' largest ``maxDets``): upstream's training eval scores at its
    ``eval_max_dets``, 500; 100 gives pycocotools' and the COCO leaderboard's figures."""
    base_model: bool = False
    """Inside ``fit`` with ``model.ema``: also evaluate the raw (non-EMA) weights at every evaluation, as rfdetr's
    ``eval_base_model`` does: a second pass over the eval split (its time again, and a second COCO scoring; no new
    compile: the same eval program runs on the raw weights), logged as ``eval/raw_mAP`` ... beside the EMA's
    ``eval/mAP``. Only early stopping reads it (``early_stopping_use_ema``); ``best.pth``, ``eval/best_mAP`` and
    ``last.pth`` stay the EMA's. Without ``model.ema`` it does nothing (the raw weights are the evaluated ones)."""
    keypoint_oks_sigmas: list[float] | None = None
    """The keypoint model's OKS sigmas per keypoint for ``eval/kp_mAP`` (rfdetr's ``keypoint_oks_sigmas``); ``None``:
    rfdetr's (COCO person's for 17 keypoints, else a uniform 0.05)."""
    trace_alpha: float = 0.2
    """The keypoint model's score fusion (rfdetr's ``postprocess_trace_alpha``): how much the keypoints' uncertainty
    lowers a detection's score; 0 keeps the class score alone."""
    early_stopping: bool = False
    """Inside ``fit``: stop when the watched mAP has not improved by ``early_stopping_min_delta`` for
    ``early_stopping_patience`` evaluations in a row (rfdetr's ``early_stopping``, counted in evaluations as its
    Lightning callback counts validation epochs); ``last.pth`` is then written at that step. It watches the task's
    mAP as rfdetr's ``best_model_metric: map`` (``eval/mAP``; a seg model's ``eval/segm_mAP``, the keypoint model's
    ``eval/kp_mAP``; the EMA's with ``model.ema``), or the better of the raw and EMA one with ``base_model`` and
    ``early_stopping_use_ema: false``, as rfdetr 1.11; ``best.pth`` keeps the best of the same mAP."""
    early_stopping_patience: int = 10
    """Evaluations without improvement before early stopping stops (rfdetr's default: 10)."""
    early_stopping_min_delta: float = 0.001
    """The mAP gain that counts as an improvement (rfdetr's default: 0.001)."""
    early_stopping_use_ema: bool = False
    """rfdetr's ``early_stopping_use_ema``: ``true`` watches the EMA's mAP alone; ``false`` (rfdetr's default) the
    better of the raw and EMA mAP when both are evaluated (``base_model`` with ``model.ema``). As in rfdetr 1.11,
    whose validation evaluates only the EMA weights unless ``eval_base_model``, both values watch the EMA's mAP
    otherwise, and without ``model.ema`` the raw weights' (the only ones evaluated)."""


@dataclass
class RunConfig:
    """Everything ``fit`` needs, as one object (what ``config.yaml`` in the output holds)."""

    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    mesh: MeshOptions = field(default_factory=MeshOptions)
    trainer: TrainerOptions = field(default_factory=TrainerOptions)
    eval: EvalOptions = field(default_factory=EvalOptions)
    checkpointing: CheckpointOptions = field(default_factory=CheckpointOptions)


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message lists every problem found."""


#: rfdetr's ``ModelConfig`` class (in ``rfdetr.config``) per ``model.variant``; :data:`spmd_rfdetr.model.upstream.VARIANTS`
#: holds the classes themselves.
VARIANT_CONFIGS = {
    "nano": "RFDETRNanoConfig",
    "small": "RFDETRSmallConfig",
    "medium": "RFDETRMediumConfig",
    "large": "RFDETRLargeConfig",
    "base": "RFDETRBaseConfig",
    "seg-nano": "RFDETRSegNanoConfig",
    "seg-small": "RFDETRSegSmallConfig",
    "seg-medium": "RFDETRSegMediumConfig",
    "seg-large": "RFDETRSegLargeConfig",
    "seg-xlarge": "RFDETRSegXLargeConfig",
    "seg-2xlarge": "RFDETRSeg2XLargeConfig",
    "seg-preview": "RFDETRSegPreviewConfig",
    "keypoint-preview": "RFDETRKeypointPreviewConfig",
}


def is_segmentation(variant: str) -> bool:
    """Whether ``model.variant`` is one of rfdetr's instance-segmentation models (a mask head: ``seg-*``)."""
    return variant.startswith("seg-")


def is_keypoint(variant: str) -> bool:
    """Whether ``model.variant`` is rfdetr's keypoint model (GroupPose keypoint heads: ``keypoint-preview``)."""
    return variant == "keypoint-preview"


def variant_defaults(variant: str) -> dict[str, int]:
    """rfdetr's own defaults of ``variant``'s ``patch_size``, ``num_windows``, ``resolution``, ``num_queries`` and
    ``group_detr`` (read from its pydantic model config class; nothing is built)."""
    # lazy: rfdetr imports torch_xla, which starts on import: the CLI reads these options before choosing the device
    import rfdetr.config

    fields = getattr(rfdetr.config, VARIANT_CONFIGS[variant]).model_fields
    names = ("patch_size", "num_windows", "resolution", "num_queries", "group_detr")
    return {name: fields[name].default for name in names}


#: ``model.pretrain_weights`` default: the variant's published weights (:func:`published_weights`).
AUTO_WEIGHTS = "auto"


def published_weights(variant: str) -> str:
    """The file name of ``variant``'s published COCO weights, as rfdetr's config class defaults its
    ``pretrain_weights`` (``rf-detr-nano.pth`` ...): what ``model.pretrain_weights: auto`` means."""
    # lazy: rfdetr imports torch_xla, which starts on import: the CLI reads these options before choosing the device
    import rfdetr.config

    return str(getattr(rfdetr.config, VARIANT_CONFIGS[variant]).model_fields["pretrain_weights"].default)


def resolved_weights(model: ModelOptions) -> str | None:
    """``model.pretrain_weights`` with ``auto`` replaced by the variant's published file name."""
    weights = model.pretrain_weights
    return published_weights(model.variant) if weights == AUTO_WEIGHTS else weights


def logit_count(num_queries: int, num_classes: int) -> int:
    """Logits per image the model outputs at inference: one query group, ``num_classes + 1`` logits per query
    (rfdetr's class head has one more than the classes): the most detections its PostProcess can select."""
    return num_queries * (num_classes + 1)

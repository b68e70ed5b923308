"""The run config: our ``RunConfig`` from a ``fit`` YAML, the command-line overrides, and our side's step modes."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: bf16 peak TFLOP/s per chip (dense), for MFU.
PEAK_BF16_TFLOPS = {"v3": 123.0, "v4": 275.0, "v5e": 197.0, "v5p": 459.0, "v6e": 918.0}
#: XLA devices per chip (v2/v3 expose each of a chip's two TensorCores as a device; later chips are megacore).
DEVICES_PER_CHIP = {"v2": 2, "v3": 2}
DEFAULT_NUM_CLASSES = 90  # rfdetr's default class count (COCO ids)


@dataclass(frozen=True)
class StepMode:
    """How our side runs its training step: the ``trainer`` options it sets, and what that means in one line."""

    description: str
    trainer: dict[str, Any] = field(default_factory=dict)


#: ``--step-mode`` choices. A new way to run the step is one entry here (the ``TrainerOptions`` fields it sets);
#: ``build_trainer`` does the rest.
STEP_MODES: dict[str, StepMode] = {
    "replay": StepMode("step traced once, its compiled program replayed every step (spmd_rfdetr.xla.replay)",
                       {"step_mode": "replay"}),
    "trace": StepMode("torch_xla.compile(full_graph=True): lazy tracing of the step's Python every step",
                      {"step_mode": "trace"}),
    "openxla": StepMode("torch.compile(backend='openxla') with spmd_rfdetr's SPMD bridge fix: dynamo graphs per step",
                        {"compile_backend": "openxla"}),
}


def parse_step_modes(text: str) -> list[str]:
    """``replay,trace`` -> ``["replay", "trace"]``; an unknown or repeated mode is an argparse error."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in STEP_MODES]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"step modes {unknown or modes!r}: choose from {', '.join(STEP_MODES)}")
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"step mode repeated in {text!r}")
    return modes


def apply_step_mode(cfg: Any, mode: str) -> None:
    """Set the ``trainer`` options of step mode ``mode`` on ``cfg``."""
    for name, value in STEP_MODES[mode].trainer.items():
        setattr(cfg.trainer, name, value)


def _sections() -> dict[str, type]:
    """``RunConfig``'s sections and their option classes (``model``, ``data``, ``optim``, ``mesh``, ``trainer``, ...)."""
    from spmd_rfdetr.config.options import RunConfig

    return {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}  # type: ignore[misc]


def load_run_config(path: str | None) -> Any:
    """Our ``RunConfig`` from a ``fit`` YAML."""
    import yaml

    from spmd_rfdetr.config.options import RunConfig

    raw = (yaml.safe_load(Path(path).read_text()) if path else {}) or {}
    sections = _sections()
    unknown = set(raw) - set(sections)
    if unknown:
        raise SystemExit(f"{path}: unknown section(s) {sorted(unknown)}; expected {sorted(sections)}")
    try:
        return RunConfig(**{name: cls(**(raw.get(name) or {})) for name, cls in sections.items()})
    except TypeError as e:
        raise SystemExit(f"{path}: {e}") from e


def run_config_from_dict(d: dict[str, Any]) -> Any:
    from spmd_rfdetr.config.options import RunConfig

    return RunConfig(**{name: cls(**d[name]) for name, cls in _sections().items()})


def apply_overrides(cfg: Any, args: argparse.Namespace) -> None:
    m, d = cfg.model, cfg.data
    for name, value in (("variant", args.variant), ("resolution", args.resolution), ("num_queries", args.queries),
                        ("group_detr", args.group_detr), ("dec_layers", args.dec_layers)):
        if value is not None:
            setattr(m, name, value)
    if args.num_classes is not None:
        m.num_classes = args.num_classes
    if m.num_classes is None:
        m.num_classes = DEFAULT_NUM_CLASSES  # synthetic data: no dataset to read the class count from
    m.pretrain_weights = None  # from scratch: both sides start from the same seeded random weights
    if args.batch is not None:
        d.global_batch_size, d.per_device_batch_size = args.batch, None
    if args.targets is not None:
        d.max_targets = args.targets
    if getattr(args, "dataset_dir", None) is not None:
        d.dataset_dir = args.dataset_dir
    if args.precision is not None:
        cfg.trainer.precision = args.precision
    cfg.trainer.seed = args.seed

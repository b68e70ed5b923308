"""Memory plan: bytes per device of parameters, gradients, AdamW state and the EMA copy, from the sharding rules.

For each RF-DETR variant and a ``(data, fsdp)`` mesh, without a device or XLA: the model is built on PyTorch's meta
device (shapes only; patch-14 variants skip the DINOv2 hub weights they would otherwise download) and
:func:`spmd_rfdetr.xla.parallelize.sharding_specs` gives each parameter's spec, as ``fit`` would apply it. Counted as
``fit`` holds them: fp32 weights (``trainer.precision=bf16`` is autocast, the weights stay fp32), a gradient per
trainable parameter sharded like it (GSPMD; live within the step only, its peak: the step drops them after the
update), AdamW's ``exp_avg``/``exp_avg_sq`` sharded like it plus a replicated
fp32 step count, and an EMA copy of every parameter and floating buffer. Activations are not included (they scale with
the per-device batch and resolution, not the mesh).

rfdetr 1.11's detection variants all use a DINOv2-small-sized backbone, so their weights differ little (30-34 M
parameters, about 0.6 GiB of training state replicated; the table for data 2 x fsdp 4 is in ``benchmarks/README.md``):
what grows with the variant is the resolution, hence the activations. For these models FSDP buys room for a larger
per-device batch rather than making a model fit at all.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spmd_rfdetr.config.options import VARIANT_CONFIGS, DataOptions, MeshOptions, ModelOptions, OptimOptions
from spmd_rfdetr.xla.mesh import DATA_AXIS, FSDP_AXIS
from spmd_rfdetr.xla.parallelize import DEFAULT_RULES, Rule, shard_count, sharding_specs

VARIANTS: tuple[str, ...] = tuple(VARIANT_CONFIGS)
_MIB = 2**20


@dataclass
class MemoryRow:
    """Per-device bytes of one variant on one mesh (and the parameter counts behind them)."""

    variant: str
    parameters: int
    sharded_parameters: int
    param_bytes: int
    grad_bytes: int
    adamw_bytes: int
    ema_bytes: int
    replicated_bytes: int  # the same four on a mesh without an fsdp axis

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.adamw_bytes + self.ema_bytes


def meta_model(variant: str, num_classes: int | None = None) -> torch.nn.Module:
    """rfdetr's LWDETR for ``variant`` at its defaults, on the meta device (no memory, no download)."""
    # lazy: rfdetr (model.upstream imports it too) takes seconds to import: only to build a model, after plan's checks
    import rfdetr.config
    from rfdetr.models.lwdetr import build_model_from_config

    from spmd_rfdetr.model.upstream import upstream_configs

    if num_classes is None:
        num_classes = getattr(rfdetr.config, VARIANT_CONFIGS[variant]).model_fields["num_classes"].default
    cfgs = upstream_configs(ModelOptions(variant=variant), DataOptions(), OptimOptions(), num_classes)
    shapes_only = cfgs.model.model_copy(update={"pretrain_weights": "shapes-only"})  # no DINOv2 hub weights
    quiet = logging.getLogger("rf-detr")
    level, quiet.level = quiet.level, logging.ERROR  # its "not loading DINOv2 weights" warnings are expected here
    try:
        with torch.device("meta"):
            return build_model_from_config(shapes_only, cfgs.train)
    finally:
        quiet.setLevel(level)


def memory_row(model: torch.nn.Module, variant: str, data: int, fsdp: int, min_numel: int,
               rules: Sequence[Rule] = DEFAULT_RULES) -> MemoryRow:
    """Per-device bytes of ``model``'s training state on a ``data x fsdp`` mesh under ``rules``."""
    params = dict(model.named_parameters())
    sizes = {DATA_AXIS: data, FSDP_AXIS: fsdp}

    def per_device(specs_fsdp: int) -> tuple[int, int, int, int, int]:
        specs = sharding_specs(((n, p.shape) for n, p in params.items()), specs_fsdp, min_numel, rules)
        axis = {**sizes, FSDP_AXIS: specs_fsdp}
        size = {n: p.numel() * p.element_size() // shard_count(specs[n], axis) for n, p in params.items()}
        trainable = [n for n, p in params.items() if p.requires_grad]
        buffers = sum(b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point())
        adamw = sum(2 * size[n] + 4 for n in trainable)  # exp_avg, exp_avg_sq; a 0-d fp32 step (capturable)
        sharded = sum(params[n].numel() for n, spec in specs.items() if any(spec))
        return sum(size.values()), sum(size[n] for n in trainable), adamw, sum(size.values()) + buffers, sharded

    param_b, grad_b, adamw_b, ema_b, sharded = per_device(fsdp)
    replicated = sum(per_device(1)[:4])
    return MemoryRow(variant, sum(p.numel() for p in params.values()), sharded, param_b, grad_b, adamw_b, ema_b,
                     replicated)


def memory_plan(mesh: MeshOptions, variants: Sequence[str] = VARIANTS, num_classes: int | None = None,
                rules: Sequence[Rule] = DEFAULT_RULES) -> list[MemoryRow]:
    """One :class:`MemoryRow` per variant on the mesh ``mesh.data x mesh.fsdp``."""
    return [memory_row(meta_model(v, num_classes), v, mesh.data, mesh.fsdp, mesh.fsdp_min_numel, rules)
            for v in variants]


def format_plan(rows: Sequence[MemoryRow], mesh: MeshOptions) -> str:
    """A markdown table of :func:`memory_plan`'s rows (MiB per device)."""
    data = "all devices left" if mesh.data == -1 else str(mesh.data)
    lines = [
        f"Per-device training state, mesh data={data} x fsdp={mesh.fsdp} (fsdp_min_numel={mesh.fsdp_min_numel}); "
        "fp32 weights, MiB per device (activations not included):",
        "",
        "| variant | parameters | sharded | params | grads | AdamW | EMA | total | replicated (fsdp=1) | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.parameters / 1e6:.1f} M | {100 * r.sharded_parameters / r.parameters:.0f} % "
            f"| {r.param_bytes / _MIB:.1f} | {r.grad_bytes / _MIB:.1f} | {r.adamw_bytes / _MIB:.1f} "
            f"| {r.ema_bytes / _MIB:.1f} | {r.total_bytes / _MIB:.1f} | {r.replicated_bytes / _MIB:.1f} "
            f"| {r.total_bytes / r.replicated_bytes:.3f} |"
        )
    return "\n".join(lines)

"""The keypoint stream on the first query groups only (``trainer.keypoint_groups``), a numerics option of the
keypoint model's training step.

rfdetr's GroupPose decoder runs 17 keypoint tokens beside every training query of all 13 Group DETR groups (1,300 x 17
tokens per image through self-attention, deformable cross-attention and a 1,024-wide FFN at every layer): about half
of the step's FLOPs and most of its HBM bytes (``benchmarks/keypoint_branch.md``). Evaluation keeps group 0 only, and
the groups never see each other in training (self-attention is per group, cross-attention reads the shared memory).
With ``keypoint_groups = n`` the decoder runs the keypoint stream for the first ``n`` groups' queries only; the other
groups train as plain Group DETR detection groups: their box path is upstream's layer as is, then the keypoint branch's
``kp_inst_norm`` with a zero instance update (what the layer does to a query whose keypoints add nothing), no keypoint
tokens, a zero keypoint output (so no class-logit boost) and no keypoint cost or loss
(:class:`~spmd_rfdetr.model.loss.StaticSetCriterion`). The two-stage encoder's keypoint predictions are kept for every
group (computed once, not per layer). Each layer runs upstream's ``forward_post`` twice, on the two query sets, with
the module's ``group_detr`` and ``enable_keypoint_processing`` set for the call (the layer reads them from ``self``).
Evaluation (one group) is unchanged. Not rfdetr's training algorithm: judged by the keypoint yardstick
(``benchmarks/finetune.py --task keypoints``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch


def first_groups(x: torch.Tensor, total: int, groups: int | None, dim: int = 1) -> torch.Tensor:
    """``x``'s rows along ``dim`` that belong to the first ``groups`` of its ``total`` equal, group-major groups of
    queries (or of matched pairs); ``groups`` ``None``: ``x`` itself."""
    if groups is None:
        return x
    return x.narrow(dim, 0, x.shape[dim] // total * groups)


def train_keypoints_on_groups(model: torch.nn.Module, groups: int) -> None:
    """Limit ``model``'s (rfdetr's ``LWDETR`` with GroupPose keypoints) training keypoint stream to its first
    ``groups`` query groups (module docstring). Instance-level wrappers: they follow the module into ``deepcopy``."""
    total = int(model.group_detr)
    if not getattr(model, "use_grouppose_keypoints", False):
        raise ValueError("trainer.keypoint_groups applies to the keypoint model (variant keypoint-preview) only")
    if not 1 <= groups <= total:
        raise ValueError(f"trainer.keypoint_groups={groups} must be between 1 and model.group_detr={total}")
    if groups == total:
        return
    transformer = model.transformer
    if getattr(transformer, "num_decoder_registers", 0):
        raise ValueError("trainer.keypoint_groups does not support decoder registers (num_decoder_registers > 0)")
    transformer.keypoint_query_initializer.register_forward_pre_hook(_first_groups_hook(total, groups))
    for layer in transformer.decoder.layers:
        layer.forward_post = types.MethodType(_forward_post_on_groups(groups), layer)
    model.keypoint_embed.register_forward_hook(_zero_other_groups_hook(total, groups))


def _first_groups_hook(total: int, groups: int) -> Any:
    """Pre-hook of the keypoint query initializer: in training, its box queries ``[B, G*Q, C]`` -> the first
    ``groups`` groups' ``[B, groups*Q, C]`` (the decoder then carries keypoint tokens for those only)."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        tgt = args[0]
        if not module.training or tgt.shape[1] % total:
            return None
        return (first_groups(tgt, total, groups), *args[1:])

    return hook


def _zero_other_groups_hook(total: int, groups: int) -> Any:
    """Forward hook of ``keypoint_embed``: its ``[L, B, groups*Q, K, D]`` output zero-padded to all ``total`` groups'
    queries (keypoints at the box centre, logits 0: no class-logit boost; their costs and losses are masked)."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        if not module.training or output.dim() != 5:
            return None
        rest = output.new_zeros(*output.shape[:2], output.shape[2] // groups * (total - groups), *output.shape[3:])
        return torch.cat([output, rest], dim=2)

    return hook


def _forward_post_on_groups(groups: int) -> Any:
    def forward_post(self: Any, tgt: torch.Tensor, memory: torch.Tensor, **kwargs: Any) -> Any:
        """Upstream's ``forward_post`` (the class's, with its XLA wrappers) on the keypoint groups' queries with their
        keypoint tokens, and on the other groups' queries without; their box streams concatenated again."""
        keypoint_tgt = kwargs.get("keypoint_tgt")
        forward = type(self).forward_post
        if not self.training or keypoint_tgt is None or keypoint_tgt.shape[1] == tgt.shape[1]:
            return forward(self, tgt, memory, **kwargs)
        kept = keypoint_tgt.shape[1]
        total = self.group_detr
        if tgt.shape[1] % total or kept != first_groups(tgt, total, groups).shape[1]:
            raise ValueError(f"keypoint tokens for {kept} of {tgt.shape[1]} queries: expected {groups} of {total} "
                             "groups")
        per_query = {k: kwargs.pop(k) for k in ("query_pos", "reference_points")}
        with _overridden(self, group_detr=groups):
            tgt_kp, keypoint_tgt = forward(self, tgt[:, :kept], memory,
                                           **{k: v[:, :kept] for k, v in per_query.items()}, **kwargs)
        plain = {k: v for k, v in kwargs.items() if not k.startswith("keypoint_") and k != "kp_cross_attn_memory"}
        with _overridden(self, group_detr=total - groups, enable_keypoint_processing=False):
            tgt_rest = forward(self, tgt[:, kept:], memory, **{k: v[:, kept:] for k, v in per_query.items()}, **plain)
        return torch.cat([tgt_kp, self.kp_inst_norm(tgt_rest)], dim=1), keypoint_tgt

    return forward_post


@contextlib.contextmanager
def _overridden(module: torch.nn.Module, **values: Any) -> Iterator[None]:
    """``module``'s attributes set to ``values`` while active (rfdetr's layer reads its group count and keypoint
    switch from ``self``)."""
    saved = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)

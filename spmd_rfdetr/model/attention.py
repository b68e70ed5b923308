"""Scaled dot-product attention in bf16 that keeps no score matrix for the backward.

Under bf16 autocast, PyTorch's attention runs the softmax in float32 and keeps its float32 output for the gradient
beside the bf16 copy the second matmul reads; the TPU compiler then adds transposed copies of both. For the decoder's
self-attention (``[B * groups * heads, 300, 300]`` scores) those were 24 GB of the v5e step's HBM traffic. Here the
forward keeps only ``q, k, v`` and the output, and the backward recomputes the probabilities (one more ``q k^T``, which
the MXU does in a fraction of the time the copies took to move) and uses FlashAttention's identity
``dS = P * (dP - rowsum(dO * O))``, so no ``[L, L]`` tensor outlives the pass that made it.

The softmax is computed in float32 from the bf16 scores the matmul returns (as eager PyTorch's bf16 attention does)
and its result rounded to bf16, the precision the MXU reads it in anyway; float32 inputs go to
``scaled_dot_product_attention`` unchanged (the CPU parity tests compare with upstream). XLA would fold the softmax's
upcast into the matmul and write float32 scores; :func:`~spmd_rfdetr.xla.lowering.as_computed` keeps them bf16, and
so the backward's ``dP = dO V^T`` (bf16 as eager's matmul returns it; XLA wrote it as float32 for the ``dS`` pass).
Measured with libtpu at v5e.yaml's shapes per chip (``[208, 8, 300, 32]``, forward and backward): 7.94 GB (6.84 of
it HBM traffic) against PyTorch's 11.45 (9.27), 9.26 (7.76) with float32 scores; ``dP`` in bf16 then 7.65 -> 6.95 GB.
A softmax computed in bf16 would save more but was 4x less accurate, so it was not kept.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from spmd_rfdetr.xla.lowering import as_computed


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + mask) v`` for ``[B, H, L, d]`` tensors (``mask``: an additive float ``[L, S]``,
    ``-inf`` where blocked, as ``nn.MultiheadAttention`` takes it); see the module docstring for bf16/f16 inputs."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return _LowPrecisionAttention.apply(q, k, v, mask)


def _probabilities(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    scores = as_computed(torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-2, -1)))  # bf16, as eager's
    scores = scores.float() if mask is None else scores.float() + mask.float()
    return torch.softmax(scores, dim=-1).to(q.dtype)


class _LowPrecisionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = torch.matmul(_probabilities(q, k, mask), v)
        ctx.save_for_backward(q, k, v, out)
        ctx.mask = mask  # a constant of the model (no gradient)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out = ctx.saved_tensors
        grad_out = grad_out.to(q.dtype)
        probs = _probabilities(q, k, ctx.mask)
        grad_probs = as_computed(torch.matmul(grad_out, v.transpose(-2, -1)))  # bf16, as eager's (not float32)
        row = (grad_out.float() * out.float()).sum(dim=-1, keepdim=True)  # = rowsum(dP * P)
        grad_scores = (probs.float() * (grad_probs.float() - row)).to(q.dtype)
        scale = 1.0 / math.sqrt(q.shape[-1])
        grad_q = torch.matmul(grad_scores, k) * scale
        grad_k = torch.matmul(grad_scores.transpose(-2, -1), q) * scale
        grad_v = torch.matmul(probs.transpose(-2, -1), grad_out)
        return grad_q, grad_k, grad_v, None

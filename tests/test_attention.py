"""The decoder self-attention's bf16 path (:mod:`spmd_rfdetr.model.attention`): no kept score matrix, a recomputed
backward. Its output and gradients are compared with float64 attention; PyTorch's own bf16 attention on the same
inputs sets how far bf16 may be off."""

from __future__ import annotations

import torch
import torch_xla

from spmd_rfdetr.model.attention import attention


def _errors(fn, inputs: list[torch.Tensor], weight: torch.Tensor, reference: list[torch.Tensor]) -> list[float]:
    out = fn(*inputs)
    (out.float() * weight).sum().backward()
    got = [out.detach(), *(t.grad for t in inputs)]
    return [float((a.float().cpu() - b.float()).abs().max()) for a, b in zip(got, reference)]


def test_bf16_attention_and_its_gradients_are_as_close_to_float64_as_pytorchs_bf16() -> None:
    device = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    q, k, v, weight = (torch.randn(6, 4, 30, 8, generator=g) for _ in range(4))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*exact)
    (out * weight.double()).sum().backward()
    reference = [out.detach(), *(t.grad for t in exact)]

    def on_device(dtype: torch.dtype) -> list[torch.Tensor]:
        return [t.to(device, dtype).requires_grad_() for t in (q, k, v)]

    ours = _errors(attention, on_device(torch.bfloat16), weight.to(device), reference)
    pytorch = _errors(torch.nn.functional.scaled_dot_product_attention, on_device(torch.bfloat16),
                      weight.to(device), reference)
    assert all(e <= 2 * p + 1e-3 for e, p in zip(ours, pytorch)), (ours, pytorch)  # output, dq, dk, dv
    assert max(_errors(attention, on_device(torch.float32), weight.to(device), reference)) < 1e-5  # f32: PyTorch's

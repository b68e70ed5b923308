"""The decoder self-attention's bf16 path (:mod:`spmd_rfdetr.model.attention`): no kept score matrix, a recomputed
backward. Its output and gradients are compared with float64 attention; PyTorch's own bf16 attention on the same
inputs sets how far bf16 may be off."""

from __future__ import annotations

import pytest
import torch
import torch_xla

from spmd_rfdetr.model.attention import attention


def _errors(fn, inputs: list[torch.Tensor], weight: torch.Tensor, reference: list[torch.Tensor]) -> list[float]:
    out = fn(*inputs)
    (out.float() * weight).sum().backward()
    got = [out.detach(), *(t.grad for t in inputs)]
    return [float((a.float().cpu() - b.float()).abs().max()) for a, b in zip(got, reference)]


def _class_mask(length: int) -> torch.Tensor:
    """An additive mask like rfdetr's keypoint class mask: token 0 (the instance) sees all, the others their block."""
    block = torch.arange(length) * 3 // length
    blocked = (block[:, None] != block[None, :]) & (torch.arange(length)[:, None] > 0) & (torch.arange(length) > 0)
    return torch.zeros(length, length).masked_fill(blocked, float("-inf"))


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "additive-mask"])
def test_bf16_attention_and_its_gradients_are_as_close_to_float64_as_pytorchs_bf16(masked: bool) -> None:
    device = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    q, k, v, weight = (torch.randn(6, 4, 30, 8, generator=g) for _ in range(4))
    mask = _class_mask(30) if masked else None
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*exact, attn_mask=None if mask is None else mask.double())
    (out * weight.double()).sum().backward()
    reference = [out.detach(), *(t.grad for t in exact)]

    def on_device(dtype: torch.dtype) -> list[torch.Tensor]:
        return [t.to(device, dtype).requires_grad_() for t in (q, k, v)]

    on = None if mask is None else mask.to(device)
    ours = _errors(lambda *x: attention(*x, on), on_device(torch.bfloat16), weight.to(device), reference)
    pytorch = _errors(lambda *x: torch.nn.functional.scaled_dot_product_attention(*x, attn_mask=None if on is None else
                                                                                  on.bfloat16()),
                      on_device(torch.bfloat16), weight.to(device), reference)
    assert all(e <= 2 * p + 1e-3 for e, p in zip(ours, pytorch)), (ours, pytorch)  # output, dq, dk, dv
    f32 = _errors(lambda *x: attention(*x, on), on_device(torch.float32), weight.to(device), reference)
    assert max(f32) < 1e-5  # f32: PyTorch's


def test_multihead_attention_with_an_additive_mask_runs_batch_first_on_xla_as_eager(monkeypatch) -> None:
    """rfdetr's keypoint self-attention calls ``nn.MultiheadAttention`` with a float mask: on XLA it takes the
    batch-first path (:func:`spmd_rfdetr.model.xla_safe.install`), with the eager module's output and gradients."""
    from spmd_rfdetr.model import xla_safe

    xla_safe.install()
    calls = []
    batch_first = xla_safe._batch_first_attention
    monkeypatch.setattr(xla_safe, "_batch_first_attention", lambda *a: calls.append(a[-1]) or batch_first(*a))
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    x, mask = torch.randn(5, 12, 16), _class_mask(12)
    eager = layer(x, x, x, attn_mask=mask, need_weights=False)[0]
    eager.sum().backward()
    expected = layer.in_proj_weight.grad.clone()
    layer.zero_grad()
    device = torch_xla.device()
    on = layer.to(device)
    out = on(x.to(device), x.to(device), x.to(device), attn_mask=mask.to(device), need_weights=False)[0]
    out.sum().backward()
    assert len(calls) == 1 and calls[0] is not None  # the batch-first path, given the mask
    torch.testing.assert_close(out.cpu(), eager.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(on.in_proj_weight.grad.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_backbone_attention_runs_ours_on_xla_with_the_eager_modules_output_and_gradients(monkeypatch) -> None:
    """DINOv2's self-attention (rfdetr's SDPA class) on XLA takes :func:`~spmd_rfdetr.model.attention.attention`
    (:func:`spmd_rfdetr.model.xla_safe.install`); its heads, projections and layout are upstream's."""
    from rfdetr.models.backbone import dinov2_with_windowed_attn as dinov2

    from spmd_rfdetr.model import xla_safe

    xla_safe.install()
    calls = []
    monkeypatch.setattr(xla_safe, "attention", lambda *a: calls.append(a[0].shape) or attention(*a))
    torch.manual_seed(0)
    config = dinov2.WindowedDinov2WithRegistersConfig(hidden_size=24, num_attention_heads=4)
    layer = dinov2.Dinov2WithRegistersSdpaSelfAttention(config)
    x = torch.randn(3, 10, 24)
    eager = layer(x)[0]
    (eager * eager).sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    device = torch_xla.device()
    on = layer.to(device)
    out = on(x.to(device))[0]
    (out * out).sum().backward()
    assert calls == [torch.Size([3, 4, 10, 6])]  # [batch, heads, tokens, head dim]
    torch.testing.assert_close(out.cpu(), eager.detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip(on.parameters(), expected):
        torch.testing.assert_close(got.grad.cpu(), want, atol=1e-4, rtol=1e-4)

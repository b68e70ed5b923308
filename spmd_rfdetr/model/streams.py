"""bf16 residual streams (``trainer.bf16_streams``): under bf16 autocast, the transformers' residual streams in bf16.

Autocast runs matmuls in bf16 but ``layer_norm`` in float32 and returns float32; a float32 parameter times a bf16
tensor (DINOv2's layer scales) is float32, and a bf16 branch added to a float32 stream stays float32. So RF-DETR's
residual streams under ``trainer.precision: bf16`` are float32 end to end: every pass over the decoder's
``[images, 13 x 300, 256]`` and DINOv2's ``[windows, tokens, 384]`` stream, and every activation the backward keeps,
moves twice the bytes that TPU trainers (MaxText, big_vision: bf16 activations, float32 weights) move. These forward
hooks round to autocast's dtype: every ``nn.LayerNorm``'s output (its statistics still computed in float32), DINOv2's
layer-scaled branches and its embeddings. Not the two-stage proposals' norm (``enc_output_norm``): no residual stream,
and the rows the top-k picks from its output cost the TPU compiler 40x more in bf16 (v5e.yaml, on-chip memory off:
1.9 -> 76.9 GB a step). Weights, gradients, the optimizer and the loss stay float32. Outside autocast
(``fp32``, or a model evaluated without it) the hooks return the output unchanged. A numerics change, measured by the
fine-tuning yardstick (``benchmarks/finetune.py``, arm ``ours-bf16-streams``) and the TPU compiler
(``benchmarks/README.md``).
"""

from __future__ import annotations

from typing import Any

import torch

#: rfdetr's DINOv2 modules whose output is a residual stream or a branch added to one (by class name: the hooks are
#: for rfdetr's classes, found in a built model without importing its backbone module here).
_STREAM_MODULES = ("Dinov2WithRegistersLayerScale", "WindowedDinov2WithRegistersEmbeddings")

#: Modules left float32 (by attribute name in rfdetr's model): see the module docstring.
_KEPT_FLOAT32 = ("enc_output_norm",)


def round_streams_to_bf16(model: torch.nn.Module) -> int:
    """Hook every LayerNorm (but the proposals') and DINOv2 layer scale and embeddings of ``model``; returns how
    many modules were hooked. Hooks survive ``copy.deepcopy`` (the EMA's copy rounds as the trained model does)."""
    hooked = 0
    for name, module in model.named_modules():
        if any(part in _KEPT_FLOAT32 for part in name.split(".")):
            continue
        if isinstance(module, torch.nn.LayerNorm) or type(module).__name__ in _STREAM_MODULES:
            module.register_forward_hook(_to_autocast_dtype)
            hooked += 1
    return hooked


def _to_autocast_dtype(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
    if not isinstance(output, torch.Tensor) or output.dtype != torch.float32:
        return output
    device = output.device.type
    if not torch.is_autocast_enabled(device):
        return output
    return output.to(torch.get_autocast_dtype(device))

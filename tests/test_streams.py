"""``trainer.bf16_streams`` (:mod:`spmd_rfdetr.model.streams`): under bf16 autocast the residual streams are bf16,
outside it the model is untouched. Eager on the CPU (autocast keeps LayerNorm's float32 input, and so the stream,
float32 there as on XLA); what the hooks save on a TPU is the compiler's measure (``benchmarks/README.md``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from spmd_rfdetr.model.streams import round_streams_to_bf16

#: rfdetr's blocks whose output is a residual stream: DINOv2's layer and the decoder's layer.
STREAM_BLOCKS = ("WindowedDinov2WithRegistersLayer", "TransformerDecoderLayer")


def _forward(net: torch.nn.Module, tiny: Any, autocast: bool) -> tuple[dict[str, torch.Tensor], set[torch.dtype]]:
    """The model's outputs on the tiny batch (and, as ``"backbone"``, its last DINOv2 layer's) and the dtypes its
    residual-stream blocks returned."""
    from rfdetr.utilities.tensors import nested_tensor_from_tensor_list

    from spmd_rfdetr.data.pixels import upstream_float

    dtypes: set[torch.dtype] = set()
    streams: dict[str, torch.Tensor] = {}

    def record(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        stream = output[0] if isinstance(output, tuple) else output
        dtypes.add(stream.dtype)
        if type(module).__name__ == STREAM_BLOCKS[0]:
            streams["backbone"] = stream.float()

    handles = [m.register_forward_hook(record) for m in net.modules() if type(m).__name__ in STREAM_BLOCKS]
    samples = nested_tensor_from_tensor_list(list(upstream_float(tiny.batches[0]["images"])))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = net(samples)
    for handle in handles:
        handle.remove()
    return {**out, **streams}, dtypes


def test_the_residual_streams_are_bf16_under_autocast_and_untouched_outside(loop_tiny: Any) -> None:
    """Every LayerNorm but the two-stage proposals', DINOv2 layer scale and embeddings hooked; in fp32 the outputs
    bit-equal an unhooked model's; under bf16 autocast every DINOv2 and decoder layer returns bf16 (float32 without
    the hooks), the EMA's deepcopy too, and the backbone's output stays within 5% of fp32 (and 4x autocast's own
    error). Fails with the hooks a no-op (seen: the streams stay float32)."""
    tiny = loop_tiny  # one DINOv2 layer at 64 px: the hooks are per module, one of each is enough
    plain, rounded = tiny.model(), tiny.model()
    norms = sum(isinstance(m, torch.nn.LayerNorm) and "enc_output_norm" not in name
                for name, m in rounded.named_modules())
    layers = sum(type(m).__name__ == "WindowedDinov2WithRegistersLayer" for m in rounded.modules())
    assert layers >= 1 and round_streams_to_bf16(rounded) == norms + 2 * layers + 1  # 2 layer scales a layer, +1

    reference, _ = _forward(plain, tiny, autocast=False)
    same, _ = _forward(rounded, tiny, autocast=False)
    for key in ("pred_logits", "pred_boxes"):
        assert torch.equal(same[key], reference[key]), key  # fp32: the hooks change nothing

    plain_bf16, plain_streams = _forward(plain, tiny, autocast=True)
    assert plain_streams == {torch.float32}  # what the option is for: autocast alone keeps the streams float32
    for net in (rounded, copy.deepcopy(rounded)):  # the EMA's deepcopy rounds as the trained model does
        out, streams = _forward(net, tiny, autocast=True)
        assert streams == {torch.bfloat16}
        # the same function at bf16's precision, on the backbone's output (the boxes of an untrained model are not a
        # measure: its two-stage selection picks other queries under autocast alone, 49% off in fp32's norm)
        error, autocast_error = (relative(o["backbone"], reference["backbone"]) for o in (out, plain_bf16))
        assert error < 0.05 and error < 4 * autocast_error, (error, autocast_error)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())

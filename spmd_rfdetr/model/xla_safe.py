"""rfdetr functions that are not XLA-safe, or not local on a batch-sharded mesh, each wrapped for XLA tensors only
(other devices run upstream's code as is).

- ``WindowedDinov2WithRegistersEmbeddings.interpolate_pos_encoding``: at an image size other than the position
  table's (every multi-scale bucket but one) it resizes the table with antialiased bicubic interpolation, which
  torch_xla does not lower: the op runs on the host, a device->host->device round trip inside the compiled step (the
  replay trace refuses it). The wrapper runs the same resize as two matrix products: antialiased bicubic resizing is
  separable and linear, so each axis is a fixed ``(out, in)`` matrix, built once on the CPU by resizing the identity
  with PyTorch's own kernel.
- ``TransformerDecoderLayer.forward_post`` (training, ``group_detr`` > 1): Group DETR's self-attention regroups the
  queries group-major along the batch axis (``torch.cat(q.split(n, dim=1), dim=0)``, and back), which on a mesh whose
  batch axis is split over chips moves every image's queries to other chips (the TPU compiler counted collective-
  permutes and all-to-alls there, and all-gathers in the attention after them). Attention treats each row on its own,
  so the same rows batch-major (image, group) give the same result row for row: inside the layer those two
  concatenations are done as reshapes of the batch-major layout (:func:`_batch_major_groups`).
- ``WindowedDinov2WithRegistersEmbeddings.forward`` (windowed backbones): the class token of every window is
  ``cls.repeat(windows**2, 1, 1)``, window-major along the batch axis (an all-to-all on a sharded batch), next to
  batch-major window tokens. Every image's class token is the same vector (a parameter plus the shared position
  embedding), so repeating each image's token in place (batch-major) gives the same tensor, locally.
- ``torch.nn.MultiheadAttention.forward`` (the decoder's self-attention, ``batch_first``): PyTorch's implementation
  goes sequence-first and flattens (sequence, batch) into one axis with the batch inside, which a batch-sharded
  tensor cannot keep (an all-gather before every projection). Without masks or returned weights the same
  projections and attention run on the batch-first layout (:func:`_batch_first_attention`; in bf16 without a kept
  score matrix, :mod:`spmd_rfdetr.model.attention`; with ``trainer.fused_attention``, in training, one Pallas TPU
  kernel per pass on the packed projections, :func:`use_fused_attention`).
- ``Dinov2WithRegistersSdpaSelfAttention.forward`` (the backbone's attention): in bf16 PyTorch's attention keeps its
  float32 softmax for the backward beside a bf16 copy, which the TPU compiler also transposes; the same projections
  with :mod:`spmd_rfdetr.model.attention` instead (v5e.yaml's step on v5e:2x4: 119.2 -> 117.5 GB per chip, its
  eval 9.6 -> 9.0; ``benchmarks/README.md``); with ``trainer.fused_attention``, in training, the kernels.
- ``ms_deform_attn_core_pytorch`` (deformable attention's core, XLA, maps of up to 2,048 positions: every RF-DETR
  detector): one matrix product per image and head whose weight matrix the TPU compiler builds inside the product
  (:mod:`spmd_rfdetr.model.deform_attention`; v5e.yaml's shapes: 7x fewer bytes than the row lookups below).
- ``_bilinear_grid_sample`` (the sampling on larger maps, and the seg variants' ``point_sample``): rfdetr's XLA path
  gathers every sampled value with an element-wise ``gather`` (one index per value and channel), which the TPU
  compiler runs as one memory tile read per element; its gradient, a scatter-add, it runs on all-gathered operands.
  The same bilinear sampling as one row lookup per point of its four corners' channels
  (:mod:`spmd_rfdetr.model.row_lookups`, on each device's own images): no collective, and on v5e 2.8x fewer bytes
  than four lookups of one corner each, which were 25x fewer than the element-wise gather. Both in the training step
  and the eval program (dynamo traces them, as it does the seg masks' lookup in :mod:`spmd_rfdetr.eval.evaluator`);
  ``point_sample`` (mask cost and losses, also under ``no_grad``) in the training step on maps above the next limit.
- ``point_sample``'s sampler in the training step (the seg variants' mask cost; their losses sample two planes of
  points the same way, :func:`~spmd_rfdetr.model.masks.sample_at`): on maps of up to
  :data:`~spmd_rfdetr.model.deform_attention.DENSE_SAMPLE_MAX_POSITIONS` positions, two products per map
  (:func:`~spmd_rfdetr.model.deform_attention.separable_grid_sample`) instead of a row lookup per point: at the seg
  recipe's shapes (5,200 matched 78x78 masks, 380 points each, forward + backward, v5e) 0.81 GB against 203.5.
- ``SegmentationHead.sparse_forward`` (the seg variants' mask head, training): its bilinear upsampling of the
  spatial features has no XLA gradient (``aten::upsample_bilinear2d_backward`` ran on the host, a round trip inside
  the step). The same resize as two matrix products, as for the position table above.
- ``Transformer._two_stage_group_selection`` (top-k encoder proposals, ``[group, image, ...]``): its ``gather``
  calls take whole rows (the index is expanded along the last axis), as row lookups too.

And two torch_xla lowerings that put float64 into the program (TPUs have no f64): a comparison of a tensor with a
Python number (``x > 0.01`` in rfdetr's proposals, and ``torch.isfinite``, which PyTorch decomposes into
``abs(x) != inf``) compares in float64, the tensor converted and the number an ``f64[]`` graph input, where eager
PyTorch compares in the tensor's dtype; and ``addcmul_``'s ``value`` (AdamW's ``1 - beta2``) is an ``f64[]`` input
converted to the tensor's dtype. Both take the number as a 0-d tensor of PyTorch's result dtype instead
(:func:`_install_number_operands`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from spmd_rfdetr.model.attention import attention
from spmd_rfdetr.model.deform_attention import dense_core_for_xla, samples_by_products, separable_grid_sample
from spmd_rfdetr.model.resize import resize_as_matmul
from spmd_rfdetr.model.row_lookups import row_sampler, with_row_gathers
from spmd_rfdetr.xla.fused_attention import fused_attention, takes


def install() -> None:
    """Wrap the functions listed above (idempotent)."""
    from rfdetr.models.backbone import dinov2_with_windowed_attn as dinov2

    embeddings = dinov2.WindowedDinov2WithRegistersEmbeddings
    original = embeddings.interpolate_pos_encoding
    if getattr(original, "_spmd_rfdetr", False):
        return

    def interpolate_pos_encoding(self: Any, embeddings: torch.Tensor, height: int, width: int) -> torch.Tensor:
        table = self.position_embeddings
        if table.device.type != "xla":
            return original(self, embeddings, height, width)
        if embeddings.shape[1] == table.shape[1] and height == width:
            return table  # upstream's own first case (no resize): also what dynamo traces in the openxla eval forward
        if torch.compiler.is_compiling():
            return original(self, embeddings, height, width)
        with resize_as_matmul():
            return original(self, embeddings, height, width)

    interpolate_pos_encoding._spmd_rfdetr = True  # type: ignore[attr-defined]
    embeddings.interpolate_pos_encoding = interpolate_pos_encoding
    _install_batch_major_groups()
    _install_batch_major_windows(embeddings)
    _install_batch_first_attention()
    _install_backbone_attention()
    _install_row_lookups()
    _install_number_operands()
    _install_mask_head_resize()


def _install_mask_head_resize() -> None:
    from rfdetr.models.heads.segmentation import SegmentationHead

    sparse_forward = SegmentationHead.sparse_forward
    if getattr(sparse_forward, "_spmd_rfdetr", False):
        return

    @functools.wraps(sparse_forward)
    def wrapped(self: Any, spatial_features: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if spatial_features.device.type != "xla" or not _may_patch():
            return sparse_forward(self, spatial_features, *args, **kwargs)
        with resize_as_matmul():
            return sparse_forward(self, spatial_features, *args, **kwargs)

    wrapped._spmd_rfdetr = True  # type: ignore[attr-defined]
    SegmentationHead.sparse_forward = wrapped


def _install_row_lookups() -> None:
    from rfdetr.models.heads import segmentation
    from rfdetr.models.ops.functions import ms_deform_attn_func
    from rfdetr.models.ops.modules import ms_deform_attn
    from rfdetr.models.transformer import Transformer

    if not getattr(ms_deform_attn.ms_deform_attn_core_pytorch, "_spmd_rfdetr", False):  # small maps: one product
        ms_deform_attn.ms_deform_attn_core_pytorch = dense_core_for_xla(ms_deform_attn.ms_deform_attn_core_pytorch)
    if not getattr(ms_deform_attn_func._bilinear_grid_sample, "_spmd_rfdetr", False):
        ms_deform_attn_func._bilinear_grid_sample = row_sampler(ms_deform_attn_func._bilinear_grid_sample,
                                                                 lambda: True)  # training trace and eval program
    if not getattr(segmentation._bilinear_grid_sample, "_spmd_rfdetr", False):  # point_sample: training only
        segmentation._bilinear_grid_sample = _point_sampler(segmentation._bilinear_grid_sample)
    selection = Transformer._two_stage_group_selection
    if not getattr(selection, "_spmd_rfdetr", False):
        Transformer._two_stage_group_selection = with_row_gathers(selection, batch_dim=1, may_patch=_may_patch)


def _point_sampler(upstream: Any) -> Any:
    """rfdetr's ``_bilinear_grid_sample`` for ``point_sample`` in the training step: two products per map
    (:func:`separable_grid_sample`) where :func:`samples_by_products` says so, else row lookups."""
    rows = row_sampler(upstream, lambda: not torch.compiler.is_compiling())

    @functools.wraps(upstream)
    def sample(input: torch.Tensor, grid: torch.Tensor, padding_mode: str = "zeros",
               align_corners: bool = False) -> torch.Tensor:
        if padding_mode in ("zeros", "border") and samples_by_products(input):
            return separable_grid_sample(input, grid, padding_mode, align_corners)
        return rows(input, grid, padding_mode, align_corners)

    sample._spmd_rfdetr = True  # type: ignore[attr-defined]
    return sample


_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
_number_operands: torch.library.Library | None = None


def _install_number_operands() -> None:
    """``aten::{eq,ne,lt,le,gt,ge}.Scalar`` and ``aten::addcmul_`` on XLA tensors with the Python number as a 0-d
    tensor of PyTorch's result dtype (``torch.result_type``), as the ``.Tensor`` comparison and ``self.add_(t1 * t2 *
    value)``: the arithmetic of torch_xla's kernels in the dtype eager PyTorch uses, and no float64 input. Registered
    for the ``AutogradXLA`` key, where the tensors are the caller's own: a Python kernel at the ``XLA`` key would give
    the inner tensors under functionalization Python objects of their own, which replay's trace check counts as stray
    pending tensors."""
    global _number_operands
    if _number_operands is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": PyTorch's autograd kernel
        warnings.simplefilter("ignore", UserWarning)
        for name in _COMPARISONS:
            compare = functools.partial(_compare, getattr(torch.ops.aten, name).Tensor)
            library.impl(f"{name}.Scalar", compare, "AutogradXLA")
        library.impl("addcmul_", _addcmul_, "AutogradXLA")
    _number_operands = library


def _as_tensor(number: Any, like: torch.Tensor) -> torch.Tensor:
    return torch.full((), number, dtype=torch.result_type(like, number), device=like.device)


def _compare(tensor_op: Any, tensor: torch.Tensor, number: Any) -> torch.Tensor:
    return tensor_op(tensor, _as_tensor(number, tensor))


def _addcmul_(self: torch.Tensor, tensor1: torch.Tensor, tensor2: torch.Tensor, *, value: Any = 1) -> torch.Tensor:
    product = tensor1 * tensor2
    return self.add_(product if value == 1 else product * _as_tensor(value, self))


def _install_batch_major_windows(embeddings: Any) -> None:
    original = embeddings.forward
    if getattr(original, "_spmd_rfdetr", False):
        return

    @functools.wraps(original)
    def forward(self: Any, pixel_values: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        windows = self.config.num_windows ** 2
        if pixel_values.device.type != "xla" or windows == 1 or not _may_patch():
            return original(self, pixel_values, *args, **kwargs)
        repeat, batch = torch.Tensor.repeat, pixel_values.shape[0]

        def batch_major_repeat(tensor: torch.Tensor, *sizes: Any) -> torch.Tensor:
            if (tuple(sizes) == (windows, 1, 1) and tensor.device.type == "xla" and tensor.dim() == 3
                    and tensor.shape[:2] == (batch, 1)):
                return tensor[:, None].expand(batch, windows, 1, tensor.shape[2]).reshape(batch * windows, 1, -1)
            return repeat(tensor, *sizes)

        torch.Tensor.repeat = batch_major_repeat  # type: ignore[method-assign]
        try:
            return original(self, pixel_values, *args, **kwargs)
        finally:
            torch.Tensor.repeat = repeat  # type: ignore[method-assign]

    forward._spmd_rfdetr = True  # type: ignore[attr-defined]
    embeddings.forward = forward


def _install_batch_first_attention() -> None:
    attention = torch.nn.MultiheadAttention
    original = attention.forward
    if getattr(original, "_spmd_rfdetr", False):
        return

    @functools.wraps(original)
    def forward(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        additive = attn_mask is None or (attn_mask.dim() == 2 and attn_mask.is_floating_point())  # rfdetr's keypoints
        plain = (query.device.type == "xla" and query.dim() == 3 and self.batch_first and not need_weights
                 and key_padding_mask is None and additive and not is_causal and self._qkv_same_embed_dim
                 and self.bias_k is None and not self.add_zero_attn and not (self.training and self.dropout > 0))
        if not plain:
            return original(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                            average_attn_weights, is_causal)
        return _batch_first_attention(self, query, key, value, attn_mask), None

    forward._spmd_rfdetr = True  # type: ignore[attr-defined]
    attention.forward = forward


def _install_backbone_attention() -> None:
    from rfdetr.models.backbone import dinov2_with_windowed_attn as dinov2

    block = dinov2.Dinov2WithRegistersSdpaSelfAttention
    original = block.forward
    if getattr(original, "_spmd_rfdetr", False):
        return

    @functools.wraps(original)
    def forward(self: Any, hidden_states: torch.Tensor, output_attentions: bool = False) -> tuple[torch.Tensor, None]:
        if (hidden_states.device.type != "xla" or output_attentions
                or (self.training and self.attention_probs_dropout_prob > 0)):
            return original(self, hidden_states, output_attentions)
        if getattr(self, FUSED_ATTENTION, False) and takes(hidden_states.shape[1]) and _may_patch():
            projected = (p(hidden_states) for p in (self.query, self.key, self.value))
            return fused_attention(*projected, self.num_attention_heads), None
        q, k, v = (self.transpose_for_scores(p(hidden_states)) for p in (self.query, self.key, self.value))
        return attention(q, k, v).transpose(1, 2).flatten(2), None  # [B, L, heads * d], as upstream's

    forward._spmd_rfdetr = True  # type: ignore[attr-defined]
    block.forward = forward


def _batch_first_attention(self: torch.nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch's multi-head attention (in-projection, ``scaled_dot_product_attention``, out-projection) on
    ``[B, L, E]`` tensors, never flattening the batch into another axis; ``mask``: additive float ``[L, S]``."""
    linear = torch.nn.functional.linear
    heads, (batch, length, width) = self.num_heads, query.shape
    weights = self.in_proj_weight.chunk(3)
    biases = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)

    q, k, v = (linear(x, weights[i], biases[i]) for i, x in enumerate((query, key, value)))
    if (mask is None and query.shape == key.shape and getattr(self, FUSED_ATTENTION, False) and takes(length)
            and _may_patch()):
        out = fused_attention(q, k, v, heads)
    else:
        q, k, v = (x.view(batch, x.shape[1], heads, width // heads).transpose(1, 2) for x in (q, k, v))
        out = attention(q, k, v, mask).transpose(1, 2).reshape(batch, length, width)  # from [B, H, L, E/H]
    return linear(out, self.out_proj.weight, self.out_proj.bias)


#: The attribute :func:`use_fused_attention` sets on the attention modules whose training forward runs the kernel.
FUSED_ATTENTION = "_spmd_rfdetr_fused_attention"


def use_fused_attention(model: torch.nn.Module) -> int:
    """Let ``model``'s self-attention modules (the decoder's, DINOv2's) run their training forward as one Pallas TPU
    kernel (``trainer.fused_attention``, :mod:`spmd_rfdetr.xla.fused_attention`) where :func:`install`'s wrappers take
    them; returns how many were marked. The mark survives ``copy.deepcopy``; evaluation (no gradients) and dynamo's
    traces keep the XLA path."""
    from rfdetr.models.backbone import dinov2_with_windowed_attn as dinov2

    marked = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.MultiheadAttention, dinov2.Dinov2WithRegistersSdpaSelfAttention)):
            setattr(module, FUSED_ATTENTION, True)
            marked += 1
    return marked


def _may_patch() -> bool:
    """Whether a wrapper may swap a torch function for the call: only in a training trace (gradients on) and never
    while dynamo traces (``openxla``), which would have to trace the swap itself."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _install_batch_major_groups() -> None:
    from rfdetr.models.transformer import TransformerDecoderLayer

    original = TransformerDecoderLayer.forward_post
    if getattr(original, "_spmd_rfdetr", False):
        return

    @functools.wraps(original)
    def forward_post(self: Any, tgt: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        regroup = (self.training and self.group_detr > 1 and tgt.device.type == "xla" and tgt.dim() == 3 and _may_patch()
                   and kwargs.get("tgt_mask") is None and kwargs.get("tgt_key_padding_mask") is None
                   and len(args) <= 1)  # (memory): rfdetr's forward passes the masks by keyword
        if not regroup:
            return original(self, tgt, *args, **kwargs)
        with _batch_major_groups(tgt.shape[0], tgt.shape[1] // self.group_detr):
            return original(self, tgt, *args, **kwargs)

    forward_post._spmd_rfdetr = True  # type: ignore[attr-defined]
    TransformerDecoderLayer.forward_post = forward_post


class _Chunks(list):  # type: ignore[type-arg]
    """The chunks of one ``split`` inside :func:`_batch_major_groups`, remembering what was split and how."""

    def __init__(self, chunks: Any, source: torch.Tensor, kind: str) -> None:
        super().__init__(chunks)
        self.source, self.kind = source, kind


@contextlib.contextmanager
def _batch_major_groups(batch: int, per_group: int) -> Iterator[None]:
    """While active, Group DETR's regrouping in the decoder layer runs batch-major (module docstring):
    ``torch.cat(x.split(per_group, dim=1), dim=0)`` of ``x [B, G*n, C]`` is ``x.reshape(B*G, n, C)`` (row
    ``b*G + g`` instead of upstream's ``g*B + b``), and ``torch.cat(y.split(B, dim=0), dim=1)`` of such a ``y`` is
    ``y.reshape(B, G*n, C)``. Any other ``split``/``cat`` goes to PyTorch's own."""
    split, cat = torch.Tensor.split, torch.cat
    regrouped = []  # the group sizes regrouped so far: the attention's output comes back in that layout

    def patched_split(self: torch.Tensor, size: Any, dim: int = 0) -> Any:
        chunks = split(self, size, dim)
        if self.dim() != 3 or self.device.type != "xla":  # (a loader thread may split CPU tensors meanwhile)
            return chunks
        if dim == 1 and size == per_group and self.shape[0] == batch and self.shape[1] % per_group == 0:
            return _Chunks(chunks, self, "groups")
        if dim == 0 and size == batch and self.shape[0] in regrouped and self.shape[1] == per_group:
            return _Chunks(chunks, self, "rows")  # the attention's output, batch-major like its inputs
        return chunks

    def patched_cat(tensors: Any, dim: int = 0, **kwargs: Any) -> torch.Tensor:
        if isinstance(tensors, _Chunks) and not kwargs:
            x = tensors.source
            if tensors.kind == "groups" and dim == 0:
                regrouped.append(x.shape[0] * len(tensors))
                return x.reshape(x.shape[0] * len(tensors), per_group, x.shape[2])
            if tensors.kind == "rows" and dim == 1:
                return x.reshape(batch, x.shape[0] // batch * x.shape[1], x.shape[2])
        return cat(tensors, dim, **kwargs)

    torch.Tensor.split, torch.cat = patched_split, patched_cat  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.split, torch.cat = split, cat  # type: ignore[method-assign]

"""Deformable attention's core as one matrix product per image and head, for the small maps RF-DETR samples.

rfdetr's ``ms_deform_attn_core_pytorch`` samples each query's points bilinearly (four corners each) and sums them with
the attention weights. Written out, one image and head's output is ``W @ V``: ``V`` the map's ``S`` positions
(``[S, C]``) and ``W`` a ``[Q, S]`` matrix holding, per query, the attention weight times the bilinear weight of
every corner it reads (at most ``levels x points x 4`` non-zeros a row). RF-DETR's maps are small (one P4 level:
24x24 for Nano at 384 px, 44x44 for Large at 704), so the MXU does that product in well under a millisecond, and the
TPU compiler builds ``W`` inside the product's own fusion from the corners' indices and weights: it never reaches
HBM. The backward picks each corner's value column by a one-hot product of its own and dots it with ``dOut``.

Against row lookups (:mod:`spmd_rfdetr.model.row_lookups`), whose gathers the TPU charges about a memory tile per
row: v5e.yaml's shapes (16 images, 16 heads, 3,900 queries, 2 points, 24x24), forward + backward, 13.98 -> 2.01 GB
per layer (``benchmarks/README.md``). Per-corner zero padding and the coordinates are ``_bilinear_grid_sample``'s;
the corner weights are summed in the weights' dtype (f32 under autocast) and rounded to the map's dtype once.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: Above this many positions (all levels) :func:`dense_core_for_xla` leaves the core to rfdetr's sampler (row lookups
#: on XLA): the products' FLOPs grow with the map, the lookups' bytes do not. v5e, one layer forward + backward at 16
#: images: 24x24 2.0 GB and 217 GFLOP vs 14.0 GB by rows, 32x32 (Small) 2.1 and 386 vs 14.5, 44x44 (Large) 2.2 and
#: 728 vs 15.5 (``benchmarks/op_costs.py``); a product with 16 channels a head uses a fraction of the MXU.
DENSE_MAX_POSITIONS = 2048
#: The same for :func:`separable_grid_sample` (the seg masks' point sampling, one channel per map): its ``[Q, H]``
#: intermediate and FLOPs grow with the map's side. Seg Nano at 312 px: 78x78 masks.
DENSE_SAMPLE_MAX_POSITIONS = 16384


def samples_by_products(maps: torch.Tensor) -> bool:
    """Whether ``maps [..., H, W]`` are sampled by :func:`tent_sample`'s two products: XLA tensors traced lazily (dynamo
    traces rfdetr's row lookups instead) of at most :data:`DENSE_SAMPLE_MAX_POSITIONS` positions."""
    return (maps.device.type == "xla" and not torch.compiler.is_compiling()
            and maps.shape[-2] * maps.shape[-1] <= DENSE_SAMPLE_MAX_POSITIONS)


def corners(locations: torch.Tensor, attention_weights: torch.Tensor, shapes: list[tuple[int, int]],
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sampled corner's flat position (``-1`` outside the map) and weight (attention x bilinear), as
    ``[B * heads, Q, levels * points * 4]``, from rfdetr's ``sampling_locations`` ``[B, Q, heads, levels, points, 2]``
    (in ``[0, 1]``) and ``attention_weights`` ``[B, Q, heads, levels * points]``."""
    batch, queries, heads, levels, points, _ = locations.shape
    attention = attention_weights.reshape(batch, queries, heads, levels, points)
    grid = 2 * locations - 1  # rfdetr's own steps to pixel coordinates, for the same rounding
    positions, weights, start = [], [], 0
    for level, (height, width) in enumerate(shapes):
        x = (grid[:, :, :, level, :, 0] + 1) * width / 2 - 0.5
        y = (grid[:, :, :, level, :, 1] + 1) * height / 2 - 0.5
        x0, y0 = x.floor(), y.floor()
        fx, fy = x - x0, y - y0
        x0, y0 = x0.clamp(-2, width).to(torch.int32), y0.clamp(-2, height).to(torch.int32)  # far outside stays out
        for dy, wy in ((0, 1 - fy), (1, fy)):
            for dx, wx in ((0, 1 - fx), (1, fx)):
                xi, yi = x0 + dx, y0 + dy
                inside = (xi >= 0) & (xi < width) & (yi >= 0) & (yi < height)
                positions.append(torch.where(inside, start + yi * width + xi, -1))
                weights.append(attention[:, :, :, level] * wx * wy)
        start += height * width
    def flat(parts: list[torch.Tensor]) -> torch.Tensor:  # [B, Q, heads, points, 4 per level] -> [B*heads, Q, K]
        return torch.stack(parts, -1).flatten(3).transpose(1, 2).flatten(0, 1)
    return flat(positions), flat(weights)


def _weight_matrix(positions: torch.Tensor, weights: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, Q, size]``: each corner's weight at its position, summed (one select per corner, so that the compiler
    fuses the whole matrix into the product that reads it)."""
    grid = torch.arange(size, device=positions.device, dtype=positions.dtype)
    matrix = None
    for k in range(positions.shape[-1]):
        term = torch.where(positions[..., k, None] == grid, weights[..., k, None], 0.0)
        matrix = term if matrix is None else matrix + term
    return matrix.to(dtype)


class _Sample(torch.autograd.Function):
    """``W(positions, weights) @ value^T`` per row of ``value [N, C, S]``; gradients for ``value`` and ``weights``."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        matrix = _weight_matrix(positions, weights, value.shape[-1], value.dtype)
        ctx.save_for_backward(value, positions, matrix)
        ctx.weights_dtype = weights.dtype
        return torch.matmul(matrix, value.transpose(1, 2))  # [N, Q, C]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        value, positions, matrix = ctx.saved_tensors
        grad = grad.to(value.dtype)
        grad_value = torch.matmul(grad.transpose(1, 2), matrix)  # [N, C, S]
        return grad_value, None, _corner_grads(value, positions, grad).to(ctx.weights_dtype)


def _corner_grads(value: torch.Tensor, positions: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``[N, Q, K]``: each corner's ``grad[n, q] . value[n, :, positions[n, q, k]]`` (0 outside the map).

    Per corner, its value columns are picked by a one-hot product (exact: one non-zero a column) and dotted with the
    gradient in the same fusion, so nothing ``[Q, S]``-sized reaches HBM. Picking from ``dW = grad @ value`` instead
    wrote ``dW`` ([256, 3900, 576] bf16 per layer on v5e.yaml) and read it three times: 4.91 -> 1.79 GB per layer,
    forward + backward, at 2.2x the FLOPs (``benchmarks/README.md``)."""
    grid = torch.arange(value.shape[-1], device=positions.device, dtype=positions.dtype)
    grad_t = grad.transpose(1, 2)  # [N, C, Q]
    per_corner = []
    for k in range(positions.shape[-1]):
        one_hot = (grid[:, None] == positions[:, None, :, k]).to(value.dtype)  # [N, S, Q]
        per_corner.append(torch.einsum("ncq,ncq->nq", torch.matmul(value, one_hot), grad_t))
    return torch.stack(per_corner, -1)


def dense_core(value: torch.Tensor, locations: torch.Tensor, attention_weights: torch.Tensor,
               shapes: list[tuple[int, int]]) -> torch.Tensor:
    """rfdetr's ``ms_deform_attn_core_pytorch(value [B, heads, C, S], ..., sampling_locations, attention_weights)``
    -> ``[B, Q, heads * C]`` (in ``value``'s dtype) as one product per image and head."""
    batch, heads, channels, _ = value.shape
    positions, weights = corners(locations, attention_weights, shapes)
    out = _Sample.apply(value.flatten(0, 1), positions, weights)  # [B * heads, Q, C]
    return out.view(batch, heads, -1, channels).transpose(1, 2).flatten(2)


def pixel_coordinates(grid: torch.Tensor, height: int, width: int, align_corners: bool,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.grid_sample``'s (and rfdetr's ``_bilinear_grid_sample``'s) pixel coordinates ``(x, y)`` of a ``[-1, 1]``
    grid ``[..., 2]`` on an ``height x width`` map."""
    if align_corners:
        return (grid[..., 0] + 1) * (width - 1) / 2, (grid[..., 1] + 1) * (height - 1) / 2
    return (grid[..., 0] + 1) * width / 2 - 0.5, (grid[..., 1] + 1) * height / 2 - 0.5


def separable_grid_sample(input: torch.Tensor, grid: torch.Tensor, padding_mode: str = "zeros",
                          align_corners: bool = False) -> torch.Tensor:
    """rfdetr's ``_bilinear_grid_sample(input [N, C, H, W], grid [N, Hg, Wg, 2])`` (bilinear, ``zeros`` or ``border``
    padding) as two products per map, for many small maps (the seg variants' per-match mask logits, where a row
    lookup per point costs the TPU a memory tile or more): the points' column weights ``[Q, W]`` times the map, then
    each point's row weights times that ``[Q, H]`` result.

    A point at pixel coordinate ``x`` weighs column ``i`` by the tent ``max(0, 1 - |x - i|)``: rfdetr's ``1 - frac``
    and ``frac`` at its two corners, 0 elsewhere and at corners outside the map (``zeros``); ``border`` clamps ``x``
    into the map first (both corners on the edge pixel). One element-wise function of ``x`` and the column index,
    which the TPU compiler builds inside the product's fusion; the floor/clamp/corner form wrote six ``[N, Q]``
    index and weight arrays to HBM first (seg recipe: 2.98 -> 2.50 GB per layer, ``benchmarks/README.md``)."""
    maps, channels, height, width = input.shape
    x, y = (axis.flatten(1) for axis in pixel_coordinates(grid, height, width, align_corners))  # [N, Q]
    if padding_mode == "border":
        x, y = x.clamp(0, width - 1), y.clamp(0, height - 1)
    return tent_sample(input, x, y).reshape(maps, channels, grid.shape[1], grid.shape[2])


def tent_sample(maps: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Bilinear samples ``[N, C, Q]`` of ``maps [N, C, H, W]`` at pixel coordinates ``x, y [N, Q]`` (corners outside
    the map count 0), as two products per map: the points' column weights ``[Q, W]`` times the map, then each point's
    row weights times that ``[Q, H]`` result (:func:`separable_grid_sample`)."""
    height, width = maps.shape[-2:]

    def axis_weights(coordinate: torch.Tensor, size: int) -> torch.Tensor:  # [N, Q, size]
        index = torch.arange(size, device=maps.device, dtype=coordinate.dtype)
        return (1 - (coordinate[..., None] - index).abs()).clamp(min=0).to(maps.dtype)

    by_row = torch.einsum("nqw,nchw->nqch", axis_weights(x, width), maps)  # [N, Q, C, H]
    return torch.einsum("nqch,nqh->ncq", by_row, axis_weights(y, height))


def dense_core_for_xla(upstream: Any) -> Any:
    """rfdetr's ``ms_deform_attn_core_pytorch`` as :func:`dense_core` for XLA tensors on maps of at most
    :data:`DENSE_MAX_POSITIONS` positions with Python ``(H, W)`` pairs (rank-6 locations)."""

    @functools.wraps(upstream)
    def core(value: torch.Tensor, value_spatial_shapes: torch.Tensor, sampling_locations: torch.Tensor,
             attention_weights: torch.Tensor, value_spatial_shapes_hw: list[tuple[int, int]] | None = None,
             ) -> torch.Tensor:
        if (value.device.type != "xla" or value_spatial_shapes_hw is None or sampling_locations.dim() != 6
                or sum(h * w for h, w in value_spatial_shapes_hw) > DENSE_MAX_POSITIONS):
            return upstream(value, value_spatial_shapes, sampling_locations, attention_weights,
                            value_spatial_shapes_hw=value_spatial_shapes_hw)
        return dense_core(value, sampling_locations, attention_weights, value_spatial_shapes_hw)

    core._spmd_rfdetr = True  # type: ignore[attr-defined]
    return core

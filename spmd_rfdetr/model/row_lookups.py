"""Row lookups in place of the element-wise gathers rfdetr's XLA code runs (XLA tensors only).

The TPU compiler runs ``torch.gather`` as an element-wise gather: a memory tile read per gathered value. Where every
gathered value of a row comes from one source row (an index constant along the last axis), the same result is a row
lookup (:func:`~spmd_rfdetr.xla.mesh.take_rows`: contiguous slices, on each device's own images).

- :func:`bilinear_sample_rows`: rfdetr's ``_bilinear_grid_sample`` (deformable attention, seg ``point_sample``).
- :func:`with_row_gathers`: a function whose ``torch.gather`` calls take whole rows (the training step's two-stage
  proposal selection), with those gathers as row lookups while it runs.
- :func:`row_gathers`: the same for everything called inside the context; the eval program is traced inside it
  (by dynamo in ``fit``/``validate``, lazily by ``aot``), so that rfdetr's eval-mode proposal selection and box
  gathers are row lookups too (dynamo traces what ``torch.gather`` names at trace time; it could not trace a swap
  made inside the traced function).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from spmd_rfdetr.model.deform_attention import pixel_coordinates
from spmd_rfdetr.xla.mesh import take_rows

_plain_gather = torch.gather


def row_sampler(upstream: Any, may_patch: Any) -> Any:
    """rfdetr's ``_bilinear_grid_sample`` as :func:`bilinear_sample_rows` for XLA tensors when ``may_patch()``."""

    @functools.wraps(upstream)
    def sample(input: torch.Tensor, grid: torch.Tensor, padding_mode: str = "zeros",
               align_corners: bool = False) -> torch.Tensor:
        if input.device.type != "xla" or padding_mode not in ("zeros", "border") or not may_patch():
            return upstream(input, grid, padding_mode, align_corners)
        return bilinear_sample_rows(input, grid, padding_mode, align_corners)

    sample._spmd_rfdetr = True  # type: ignore[attr-defined]
    return sample


def bilinear_sample_rows(input: torch.Tensor, grid: torch.Tensor, padding_mode: str = "zeros",
                         align_corners: bool = False) -> torch.Tensor:
    """``F.grid_sample(input [N, C, H, W], grid [N, Hg, Wg, 2], mode="bilinear")`` with rfdetr's coordinate and
    padding rules (``_bilinear_grid_sample``): one row lookup per sample point of its four corners' channels.

    The map is padded by one pixel (zeros, or edge copies for ``"border"``) and each position's 2x2 neighbourhood
    stacked into one row of ``4C`` channels, so a point whose top-left corner is ``(x0, y0)``, ``-1 <= x0 < W``, reads
    one row instead of four: the TPU charges a gathered row about a memory tile whatever its width. With the padding
    mask on the weights (not on the rows) a v5e chip's sampler forward and backward at v5e.yaml's shapes, 4 images,
    moves 3.27 GB, against 9.10 with four lookups (``benchmarks/README.md``). The weights and the sum are rfdetr's,
    term by term."""
    images, channels, height, width = input.shape
    x, y = pixel_coordinates(grid, height, width, align_corners)
    x0, y0 = x.floor(), y.floor()
    wx1, wy1 = (x - x0).to(input.dtype).flatten(1)[..., None], (y - y0).to(input.dtype).flatten(1)[..., None]
    x0, y0 = x0.long().flatten(1), y0.long().flatten(1)
    padded = F.pad(input, (1, 1, 1, 1), mode="constant" if padding_mode == "zeros" else "replicate")
    corners = torch.cat([padded[:, :, :-1, :-1], padded[:, :, :-1, 1:], padded[:, :, 1:, :-1], padded[:, :, 1:, 1:]],
                        dim=1)  # [N, 4C, H+1, W+1]: position (y0+1, x0+1) holds (y0, x0), (y0, x0+1), (y0+1, x0), ...
    index = (y0 + 1).clamp(0, height) * (width + 1) + (x0 + 1).clamp(0, width)  # border: clamped corners are edges
    v00, v01, v10, v11 = take_rows(corners.flatten(2).transpose(1, 2), index).split(channels, dim=-1)  # [N, G, C]
    weights = [(1 - wx1) * (1 - wy1), wx1 * (1 - wy1), (1 - wx1) * wy1, wx1 * wy1]
    if padding_mode == "zeros":  # a point whose four corners all lie outside the padded map weighs 0: on the weights
        # ([N, G, 1]), in their dtype (torch_xla multiplies a bf16 tensor by a bool one in f32, a copy of the rows)
        inside = ((x0 >= -1) & (x0 < width) & (y0 >= -1) & (y0 < height)).to(input.dtype)[..., None]
        weights = [weight * inside for weight in weights]
    out = weights[0] * v00
    out = out + weights[1] * v01
    out = out + weights[2] * v10
    out = out + weights[3] * v11
    return out.transpose(1, 2).reshape(images, channels, *grid.shape[1:3])


def _is_row_gather(input: torch.Tensor, dim: int, index: torch.Tensor, batch_dim: int) -> bool:
    """An XLA gather along the rows axis (``dim = -2``), batch axis before it, an index as wide as the rows. The
    callers vouch that such an index is one value per row (rfdetr's ``idx.unsqueeze(-1).expand(..., C)`` or
    ``.repeat(1, 1, C)``): a lazy XLA tensor cannot show it (an expanded view reports dense strides)."""
    return (input.device.type == "xla" and input.dim() >= 3 and dim % input.dim() == input.dim() - 2
            and batch_dim < input.dim() - 2 and index.dim() == input.dim() and index.shape[-1] == input.shape[-1])


def row_gather(input: torch.Tensor, dim: int, index: torch.Tensor, *, batch_dim: int = 0, **options: Any,
               ) -> torch.Tensor:
    """``torch.gather(input, dim, index)`` for an index constant along the last axis, as a row lookup where
    :func:`_is_row_gather` holds (any other gather is ``torch.gather``'s)."""
    if options or not _is_row_gather(input, dim, index, batch_dim):
        return _plain_gather(input, dim, index, **options)
    source, rows = input.movedim(batch_dim, 0), index[..., 0].movedim(batch_dim, 0)  # [B, ..., S, C], [B, ..., K]
    lead, count, picked = source.shape[1:-2], source.shape[-2], rows.shape[-1]
    offsets = torch.arange(math.prod(lead), device=rows.device).view(*lead, 1) * count
    taken = take_rows(source.reshape(source.shape[0], -1, source.shape[-1]), (rows + offsets).flatten(1))
    return taken.view(source.shape[0], *lead, picked, source.shape[-1]).movedim(0, batch_dim)


def with_row_gathers(function: Callable[..., Any], batch_dim: int, may_patch: Callable[[], bool]) -> Any:
    """``function`` with its row gathers on XLA tensors as row lookups (when ``may_patch()``); ``batch_dim``: the
    images' axis of its gathers' inputs."""

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not may_patch():
            return function(*args, **kwargs)
        torch.gather = functools.partial(row_gather, batch_dim=batch_dim)  # type: ignore[assignment]
        try:
            return function(*args, **kwargs)
        finally:
            torch.gather = _plain_gather  # type: ignore[assignment]

    wrapped._spmd_rfdetr = True  # type: ignore[attr-defined]
    return wrapped


@contextlib.contextmanager
def row_gathers() -> Iterator[None]:
    """Gathers along the rows axis (images on axis 0) as row lookups for everything run, or traced, inside: for
    rfdetr's eval forward and ``PostProcess``, whose every such gather takes whole rows (``tests/test_aot.py`` finds
    no element-wise gather in the compiled eval program; the eval parity tests compare its detections)."""
    torch.gather = row_gather  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.gather = _plain_gather  # type: ignore[assignment]

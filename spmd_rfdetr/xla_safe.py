"""rfdetr functions that are not XLA-safe, each wrapped for XLA tensors only (other devices run upstream's code as is).

- ``WindowedDinov2WithRegistersEmbeddings.interpolate_pos_encoding``: at an image size other than the position
  table's (every multi-scale bucket but one) it resizes the table with antialiased bicubic interpolation, which
  torch_xla does not lower: the op runs on the host, a device->host->device round trip inside the compiled step (the
  replay trace refuses it). The wrapper runs the same resize as two matrix products: antialiased bicubic resizing is
  separable and linear, so each axis is a fixed ``(out, in)`` matrix, built once on the CPU by resizing the identity
  with PyTorch's own kernel.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch


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
        with _antialiased_bicubic_as_matmul():
            return original(self, embeddings, height, width)

    interpolate_pos_encoding._spmd_rfdetr = True  # type: ignore[attr-defined]
    embeddings.interpolate_pos_encoding = interpolate_pos_encoding


@contextlib.contextmanager
def _antialiased_bicubic_as_matmul() -> Iterator[None]:
    """While active, ``F.interpolate(..., mode="bicubic", antialias=True)`` of an XLA tensor to a given size is two
    matrix products; every other call goes to PyTorch's own ``interpolate``."""
    functional = torch.nn.functional
    original = functional.interpolate

    def interpolate(input: torch.Tensor, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                    align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                    antialias: bool = False) -> torch.Tensor:
        if mode == "bicubic" and antialias and size is not None and input.device.type == "xla" and input.dim() == 4:
            rows, cols = (size, size) if isinstance(size, int) else size
            along_h = resize_matrix(input.shape[-2], int(rows), bool(align_corners)).to(input.device, input.dtype)
            along_w = resize_matrix(input.shape[-1], int(cols), bool(align_corners)).to(input.device, input.dtype)
            return torch.einsum("oh,bchw,pw->bcop", along_h, input, along_w)
        return original(input, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)

    functional.interpolate = interpolate
    try:
        yield
    finally:
        functional.interpolate = original


@functools.lru_cache(maxsize=None)
def resize_matrix(size_in: int, size_out: int, align_corners: bool) -> torch.Tensor:
    """``(size_out, size_in)``: PyTorch's antialiased bicubic resize of a length-``size_in`` axis, as a matrix."""
    # the other axis has 2 pixels, kept as they are: with 1, PyTorch's antialiased kernel returns a constant
    basis = torch.eye(size_in, dtype=torch.float64).reshape(size_in, 1, size_in, 1).expand(-1, -1, -1, 2).contiguous()
    resized = torch.nn.functional.interpolate(basis, size=(size_out, 2), mode="bicubic",
                                              align_corners=align_corners, antialias=True)
    return resized[:, 0, :, 0].T.float().contiguous()

"""``F.interpolate`` resizes as two matrix products on XLA tensors (torch_xla lowers neither antialiased bicubic nor
bilinear's gradient): resizing is separable and linear, so each axis is a fixed ``(out, in)`` matrix, built once on the
CPU by resizing the identity with PyTorch's own kernel."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch


#: ``F.interpolate`` (mode, antialias) pairs :func:`resize_as_matmul` replaces.
_MATMUL_RESIZES = {("bicubic", True), ("bilinear", False)}


@contextlib.contextmanager
def resize_as_matmul() -> Iterator[None]:
    """While active, ``F.interpolate`` of a 4-d XLA tensor to a given size, antialiased bicubic or plain bilinear, is
    two matrix products; every other call goes to PyTorch's own ``interpolate``."""
    functional = torch.nn.functional
    original = functional.interpolate

    def interpolate(input: torch.Tensor, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                    align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                    antialias: bool = False) -> torch.Tensor:
        matmul = (mode, antialias) in _MATMUL_RESIZES and size is not None
        if matmul and input.device.type == "xla" and input.dim() == 4:
            rows, cols = (size, size) if isinstance(size, int) else size
            along_h = resize_matrix(input.shape[-2], int(rows), bool(align_corners), mode).to(input.device, input.dtype)
            along_w = resize_matrix(input.shape[-1], int(cols), bool(align_corners), mode).to(input.device, input.dtype)
            return torch.einsum("oh,bchw,pw->bcop", along_h, input, along_w)
        return original(input, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)

    functional.interpolate = interpolate
    try:
        yield
    finally:
        functional.interpolate = original


@functools.lru_cache(maxsize=None)
def resize_matrix(size_in: int, size_out: int, align_corners: bool, mode: str = "bicubic") -> torch.Tensor:
    """``(size_out, size_in)``: PyTorch's resize of a length-``size_in`` axis as a matrix: antialiased ``bicubic``
    or plain ``bilinear``."""
    # the other axis has 2 pixels, kept as they are: with 1, PyTorch's antialiased kernel returns a constant
    basis = torch.eye(size_in, dtype=torch.float64).reshape(size_in, 1, size_in, 1).expand(-1, -1, -1, 2).contiguous()
    resized = torch.nn.functional.interpolate(basis, size=(size_out, 2), mode=mode, align_corners=align_corners,
                                              antialias=mode == "bicubic")
    return resized[:, 0, :, 0].T.float().contiguous()

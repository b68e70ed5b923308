"""rfdetr's mask cost (``HungarianMatcher._compute_mask_costs``) and mask losses (``SetCriterion.loss_masks``) on
static batches, for the ``seg-*`` variants.

rfdetr's segmentation head trains sparsely: a layer's ``pred_masks`` is ``{spatial_features [B, C, h, w],
query_features [B, Q, C], bias [1]}`` and a query's mask logits are ``query_features . spatial_features + bias``
(h = resolution / 4). Upstream builds the matched queries' masks image by image and point-samples them
(PointRend: 3x oversampled random points, the 75 % most uncertain kept, the rest fresh random points); the matcher
compares every query with every target at one shared random draw of points. Here the same arithmetic runs on whole
padded batches:

- every image has ``M = group_detr * max_targets`` matches (match ``m`` is target slot ``m % T``); padding matches are
  computed like real ones and weighted 0 by ``valid`` (upstream's ``loss_masks`` refuses padded targets for that
  reason: here the weight is explicit), normalised by the same device tensor ``num_boxes`` as the box losses;
- target masks travel bit-packed (:func:`pack_masks`: ``[T, R, ceil(R/8)]`` uint8 per image at the input resolution,
  8x fewer bytes than bool) and are read at the sampled points by one-hot row products (:func:`sample_targets`):
  rfdetr's nearest-pixel rule, no unpacked mask on the device;
- the uncertain-point selection is rfdetr's, with its flat-index gather over all matches replaced by a per-match
  one-hot pick (:func:`uncertain_points`): the flat index crosses images, which a batch split over chips cannot keep,
  and a row lookup per point costs the TPU a memory tile or more;
- the points travel as two planes ``x, y [N, P]`` (drawn as two draws; sampled by :func:`sample_at`): the TPU laid
  rfdetr's interleaved ``[N, P, 2]`` points out, copied and split them before every product.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from rfdetr.models.heads.segmentation import calculate_uncertainty, point_sample
from torch import Tensor

from spmd_rfdetr.model.deform_attention import samples_by_products, tent_sample
from spmd_rfdetr.model.matching import pick_values
from spmd_rfdetr.xla.mesh import take_rows

#: rfdetr's PointRend sampling in ``loss_masks`` (its ``get_uncertain_point_coords_with_randomness`` arguments).
OVERSAMPLE_RATIO = 3
IMPORTANCE_SAMPLE_RATIO = 0.75


def pack_masks(masks: Tensor, slots: int) -> Tensor:
    """Host side: bool ``[N, R, R]`` instance masks -> uint8 ``[slots, R, ceil(R/8)]``, bit ``x % 8`` of byte ``x // 8``
    of row ``y`` is pixel ``(y, x)`` (NumPy's little-endian ``packbits``); rows past ``N`` are zero."""
    n, height, width = masks.shape
    packed = np.zeros((slots, height, (width + 7) // 8), dtype=np.uint8)
    if n:
        packed[:n] = np.packbits(masks[:slots].numpy().astype(bool), axis=-1, bitorder="little")
    return torch.from_numpy(packed)


def unpack_masks(packed: Tensor, width: int) -> Tensor:
    """Host side: :func:`pack_masks`'s ``[..., R, ceil(R/8)]`` uint8 -> bool ``[..., R, width]``."""
    bits = np.unpackbits(packed.cpu().numpy(), axis=-1, count=width, bitorder="little")
    return torch.from_numpy(bits.astype(bool))


def sample_targets(packed: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Target masks at points, rfdetr's nearest-pixel rule (``point_sample(..., mode="nearest")``, border padding).

    ``packed [B, T, R, Rb]`` (:func:`pack_masks` of square ``R x R`` masks), the points' ``x, y`` in [0, 1] as
    ``[B, T, K]`` or ``[B, G, T, K]`` -> float ``[B, (G,) T, K]``: 1 where target ``t``'s mask covers the point.
    Each point's packed row is picked by a one-hot product (exact: bytes 0..255 are exact in bf16, one non-zero term a
    sum), then its byte and bit. A row lookup per point cost the TPU a memory tile for 39 bytes: 3.0 GB a layer of
    the seg recipe (2M points).
    """
    height, row_bytes = packed.shape[-2:]
    width = height
    dtype = x.dtype
    x, y = nearest_pixel(x, width), nearest_pixel(y, height)
    row = (y[..., None] == torch.arange(height, device=packed.device)).to(torch.bfloat16)  # [B, (G,) T, K, R]
    groups = "g" if x.dim() == 4 else ""  # matches in groups: no transpose to targets first
    rows = torch.einsum(f"b{groups}tkr,btrc->b{groups}tkc", row, packed.to(torch.bfloat16))  # [B, (G,) T, K, Rb]
    column = (x // 8)[..., None] == torch.arange(row_bytes, device=packed.device)
    byte = torch.where(column, rows, 0).sum(-1, dtype=torch.int32)
    bit = torch.bitwise_and(torch.bitwise_right_shift(byte, (x % 8).to(torch.int32)), 1)
    return bit.to(dtype)


def nearest_pixel(coordinate: Tensor, size: int) -> Tensor:
    """rfdetr's nearest pixel of points in [0, 1] on ``size`` pixels (``grid_sample``'s rule: ``g = 2c - 1``,
    ``q = (g + 1) * (size / 2)``, then ``round(q - 0.5)`` with ties to even, clamped). That is ``floor(q)``, except
    where ``q`` is an integer ``k`` (a tie between pixels ``k - 1`` and ``k``: the even one), so no subtraction
    follows the product for a fused multiply-add to move a tie by. XLA's CPU compiler folds ``(2c - 1) + 1`` to
    ``2c``: the same number for every point ``torch.rand`` draws (multiples of 2**-24)."""
    scaled = (2.0 * coordinate - 1.0 + 1.0) * (size / 2)
    below = torch.floor(scaled)
    odd_tie = (scaled == below) & (torch.remainder(below, 2) == 1)
    return (below - odd_tie.to(below.dtype)).long().clamp(0, size - 1)


def query_masks(pred_masks: dict[str, Tensor], query: Tensor) -> Tensor:
    """Mask logits ``[B, M, h, w]`` of the queries ``query [B, M]`` (rfdetr's sparse head: features . spatial + bias;
    upstream's ``loss_masks`` builds the same image by image)."""
    features = take_rows(pred_masks["query_features"], query)  # [B, M, C]
    return torch.einsum("bchw,bmc->bmhw", pred_masks["spatial_features"], features) + pred_masks["bias"]


def mask_cost(pred_masks: dict[str, Tensor], packed: Tensor, point_ratio: int) -> tuple[Tensor, Tensor]:
    """rfdetr's pairwise mask costs ``[B, Q, T]`` (sigmoid CE, dice) of one layer at one shared uniform draw of
    ``h * w // point_ratio`` points (``HungarianMatcher._compute_mask_costs``, sparse head, per image)."""
    spatial, features, bias = pred_masks["spatial_features"], pred_masks["query_features"], pred_masks["bias"]
    batch, slots = packed.shape[:2]
    points = spatial.shape[-2] * spatial.shape[-1] // point_ratio
    coords = torch.rand(1, points, 2, device=spatial.device)
    logits = point_sample(spatial, coords.repeat(batch, 1, 1), align_corners=False)  # [B, C, P]
    logits = torch.einsum("bcp,bqc->bqp", logits, features) + bias
    x, y = (axis[:, None].expand(batch, slots, points) for axis in coords.unbind(-1))
    target = sample_targets(packed, x, y).to(logits.dtype)
    pos = F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits), reduction="none")
    neg = F.binary_cross_entropy_with_logits(logits, torch.zeros_like(logits), reduction="none")
    ce = (torch.einsum("bqp,btp->bqt", pos, target) + torch.einsum("bqp,btp->bqt", neg, 1 - target)) / points
    prob = logits.sigmoid()
    numerator = 2 * torch.einsum("bqp,btp->bqt", prob, target)
    denominator = prob.sum(-1)[:, :, None] + target.sum(-1)[:, None, :]
    return ce, 1 - (numerator + 1) / (denominator + 1)


def sample_at(maps: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """rfdetr's ``point_sample`` of ``maps [N, h, w]`` at points ``x, y [N, P]`` in [0, 1] -> ``[N, P]`` (bilinear,
    ``border`` padding: its default). On the XLA device the points stay two planes, in pixel units ``x * w - 0.5``
    (rfdetr's ``((2x - 1) + 1) * w / 2 - 0.5``) clamped into the map, sampled by tent weights
    (:func:`~spmd_rfdetr.model.deform_attention.tent_sample`): rfdetr's ``[N, P, 1, 2]`` grid was rewritten three
    times on the TPU before the products."""
    height, width = maps.shape[-2:]
    if samples_by_products(maps):
        pixel_x, pixel_y = (x * width - 0.5).clamp(0, width - 1), (y * height - 0.5).clamp(0, height - 1)
        return tent_sample(maps[:, None], pixel_x, pixel_y)[:, 0]
    return point_sample(maps[:, None], torch.stack([x, y], -1), align_corners=False)[:, 0]


def uncertain_points(logits: Tensor, points: int) -> tuple[Tensor, Tensor]:
    """rfdetr's ``get_uncertain_point_coords_with_randomness(logits, calculate_uncertainty, points, 3, 0.75)`` for
    ``logits [N, h, w]`` -> the points' ``x, y [N, points]``. The same arithmetic on the same kind of draws, but x
    and y drawn as two planes (upstream: one ``[N, P, 2]`` draw, which the TPU laid out, copied and split: ~0.3 GB a
    layer of the seg recipe). The uncertain points are taken per mask by a one-hot pick (upstream indexes all masks'
    points as one flat array)."""
    count = logits.shape[0]
    x, y = (torch.rand(count, points * OVERSAMPLE_RATIO, device=logits.device) for _ in range(2))
    uncertainty = calculate_uncertainty(sample_at(logits, x, y)[:, None])[:, 0]
    uncertain = int(IMPORTANCE_SAMPLE_RATIO * points)
    index = torch.topk(uncertainty, k=uncertain, dim=1)[1]
    # one-hot picks (the matcher's): a row lookup of 2 coordinates cost the TPU ~66 KB (98 GB a layer at 100 targets)
    x, y = pick_values(x, index), pick_values(y, index)
    if points == uncertain:
        return x, y
    fresh_x, fresh_y = (torch.rand(count, points - uncertain, device=logits.device) for _ in range(2))
    return torch.cat([x, fresh_x], dim=1), torch.cat([y, fresh_y], dim=1)


def mask_losses(pred_masks: dict[str, Tensor], query: Tensor, batch: dict[str, Tensor], num_boxes: Tensor,
                point_ratio: int) -> dict[str, Tensor]:
    """rfdetr's ``loss_mask_ce`` and ``loss_mask_dice`` of one layer: ``query [B, M]`` the matched query of each of
    the ``M = G*T`` matches (match ``m`` is target slot ``m % T``), padding matches weighted 0."""
    masks = query_masks(pred_masks, query)  # [B, M, h, w]
    batch_size, matches, height, mask_width = masks.shape
    slots = batch["valid"].shape[1]
    groups = matches // slots
    flat = masks.reshape(batch_size * matches, height, mask_width)
    points = max(height, height * mask_width // point_ratio)
    with torch.no_grad():
        x, y = uncertain_points(flat, points)  # [B*M, P] each
        in_groups = (batch_size, groups, slots, points)
        labels = sample_targets(batch["masks"], x.view(in_groups), y.view(in_groups)).reshape(-1, points)
    logits = sample_at(flat, x, y)  # [B*M, P]
    valid = batch["valid"].repeat(1, groups).reshape(-1).to(logits.dtype)
    ce = F.binary_cross_entropy_with_logits(logits, labels, reduction="none").mean(1)
    prob = logits.sigmoid()
    dice = 1 - (2 * (prob * labels).sum(-1) + 1) / (prob.sum(-1) + labels.sum(-1) + 1)
    return {"loss_mask_ce": (ce * valid).sum() / num_boxes, "loss_mask_dice": (dice * valid).sum() / num_boxes}

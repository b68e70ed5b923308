"""The static-shape set criterion: rfdetr's matching cost and detection losses on whole padded batches.

A static batch holds every image's targets padded to ``max_targets`` slots with a ``valid`` mask. rfdetr's
``SetCriterion`` takes them as a list of per-image dicts and its ``HungarianMatcher`` solves each image on the host with
SciPy. On a mesh whose batch axis is split over chips, every per-image slice and every concatenation across images
becomes a collective (the TPU compiler counted 1,226 collective-permutes from such slices in one Nano step), and the
program grows with the batch. Here nothing is per image:

- :class:`StaticShapeMatcher`: rfdetr's cost terms (its focal class cost, ``pairwise_box_l1_cost`` and
  ``generalized_box_iou`` per coordinate (:mod:`spmd_rfdetr.model.pair_costs`), its padding cost) for ``[B, Q, T]`` at
  once, and the exact assignment of
  :mod:`spmd_rfdetr.model.matching` run on each device's own images (:func:`~spmd_rfdetr.xla.mesh.on_each_shard`: no collective
  inside the solver's loop). ``solver="scipy"`` solves on the host instead (a reference, and a fallback).
- :class:`StaticSetCriterion`: rfdetr's IoU-aware BCE, L1 and GIoU losses (``SetCriterion.loss_labels`` /
  ``loss_boxes``, the ``ia_bce_loss`` branch with the ``valid`` mask, and the logged cardinality / class errors) for
  every layer at once, with matched predictions taken by ``gather`` along the query axis, never along the batch axis.
  Loss configurations it does not cover, and the SciPy solver, go through upstream's own ``SetCriterion.forward``.

Either way every image gets exactly ``group_detr * max_targets`` (query, target) pairs: real targets at their optimal
query, padding slots parked on distinct leftover queries, where ``valid`` zeroes them. The loss normaliser
``num_boxes`` is the global batch's real box count (times ``group_detr``), a device tensor: upstream would
``all_reduce`` it over ``torch.distributed`` and divide by the number of processes, which is wrong under SPMD, where
every tensor is global already.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F  # noqa: N812
from rfdetr.models.criterion import SetCriterion
from rfdetr.models.matcher import _PADDED_TARGET_COST, HungarianMatcher
from rfdetr.utilities.box_ops import (
    box_cxcywh_to_xyxy,
    elementwise_box_iou,
    elementwise_generalized_box_iou,
)
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from spmd_rfdetr.model.inputs import targets_list
from spmd_rfdetr.model.keypoint_groups import first_groups
from spmd_rfdetr.model.keypoints import keypoint_match_costs, matched_keypoint_losses
from spmd_rfdetr.model.masks import mask_cost, mask_losses
from spmd_rfdetr.model.matching import pick_values, solve_assignment_with_stats
from spmd_rfdetr.model.pair_costs import l1_and_giou
from spmd_rfdetr.xla.mesh import on_each_shard, take_rows

Solver = Literal["device", "scipy"]
#: rfdetr's loss terms the batched criterion computes (SetCriterion's ``losses`` of every detection variant).
BATCHED_LOSSES = frozenset({"labels", "boxes", "cardinality"})
#: ... and of the segmentation variants (:mod:`spmd_rfdetr.model.masks`).
MASK_LOSSES = BATCHED_LOSSES | {"masks"}
#: ... and of the keypoint model (:mod:`spmd_rfdetr.model.keypoints`).
KEYPOINT_LOSSES = BATCHED_LOSSES | {"keypoints"}
#: rfdetr's focal loss exponent in ``loss_labels``.
_GAMMA = 2


def park_padding(query_of_target: Tensor, valid: Tensor, num_queries: int) -> Tensor:
    """Give every padding slot its own query among those no real target took (fixed shapes, no host sync).

    ``query_of_target`` [P, T] (only valid slots meaningful), ``valid`` [P, T] -> [P, T] injective per problem.
    """
    taken = torch.zeros(query_of_target.shape[0], num_queries, dtype=torch.int32, device=query_of_target.device)
    # scatter_add, not scatter: the padding slots all point at query 0, and duplicate-index scatter is unordered
    taken = taken.scatter_add(1, torch.where(valid, query_of_target, 0), valid.to(torch.int32))
    free_first = torch.argsort(taken, dim=1, stable=True)  # free queries in ascending order, then taken ones
    pad_rank = torch.cumsum((~valid).to(torch.int64), dim=1) - 1
    parked = torch.gather(free_first, 1, pad_rank.clamp(min=0))
    return torch.where(valid, query_of_target, parked)


def _scipy_solve(cost: Tensor) -> Tensor:
    """Upstream's host path: SciPy on every [Q, T] problem (padding columns included). Returns [P, T]."""
    cost_host = cost.detach().float().cpu()
    result = torch.empty(cost.shape[0], cost.shape[2], dtype=torch.int64)
    for p, c in enumerate(cost_host):
        rows, cols = linear_sum_assignment(c.numpy())
        result[p, torch.as_tensor(cols)] = torch.as_tensor(rows)
    return result.to(cost.device)


def _solve_and_park(cost: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    result = solve_assignment_with_stats(cost, valid)
    return park_padding(result.query_of_target, valid, cost.shape[1]), result.converged, result.rounds


def stack_targets(targets: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """rfdetr's list of padded per-image targets as one static batch's ``labels``/``boxes``/``valid``."""
    if any("valid" not in t or t["boxes"].shape != targets[0]["boxes"].shape for t in targets):
        raise ValueError("StaticShapeMatcher needs targets padded to one length with a 'valid' mask")
    return {key: torch.stack([t[key] for t in targets]) for key in ("labels", "boxes", "valid")}


class StaticShapeMatcher(HungarianMatcher):
    """rfdetr's matcher cost + a fixed-shape assignment for whole batches (see the module docstring).

    :meth:`assign` matches several layers at once (one solve); :meth:`forward` is upstream's per-layer interface
    (list of per-image ``(query_index, target_index)`` pairs) for rfdetr's own ``SetCriterion.forward``.
    """

    def __init__(self, *args: Any, solver: Solver = "device", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.solver = solver
        self.solver_stats: dict[str, Tensor] = {}  # device counters of the solves since the last pop_stats()
        self._solved: dict[int, list[tuple[Tensor, Tensor]]] = {}  # id(pred_logits) -> pairs (upstream's path)

    def cost(self, logits: Tensor, boxes: Tensor, targets: dict[str, Tensor], extra: Tensor | None = None) -> Tensor:
        """rfdetr's matching cost (``_compute_compact_detection_cost_matrix`` without its per-image padding and
        concatenation) for ``logits [B, Q, C]``, ``boxes [B, Q, 4]`` and padded targets: ``[B, Q, T]``, padding columns
        at rfdetr's padded-target cost. ``extra [B, Q, T]``: more cost terms (the mask costs)."""
        labels, target_boxes, valid = targets["labels"], targets["boxes"], targets["valid"]
        # built [B, T, Q] (pair_costs.py). Each target's class of the logits is picked by a select summed over the
        # classes (exact; fused into one pass: 0.47 GB at v5e.yaml's shapes, against 1.59 as a row lookup of the
        # transposed logits, and an element-wise gather costs a memory tile per element; matching.pick_values picks
        # into [B*Q, T], which cost the whole cost 1.44 GB against 0.66); rfdetr's focal cost is elementwise, so it
        # is taken of the picked logits (as its own compact path does)
        classes = torch.arange(logits.shape[-1], device=labels.device)
        picked = torch.where(labels[:, :, None, None] == classes, logits[:, None], 0.0).sum(-1)
        class_cost = self._focal_classification_cost(picked)
        bbox_cost, giou = l1_and_giou(boxes, target_boxes)
        cost = self.cost_bbox * bbox_cost + self.cost_class * class_cost + self.cost_giou * -giou
        if extra is not None:
            cost = cost + extra.transpose(1, 2)
        padded = torch.full((), _PADDED_TARGET_COST, dtype=cost.dtype, device=cost.device)  # not an f64 scalar input
        return torch.where(valid[:, :, None], cost, padded).transpose(1, 2)

    def keypoint_costs(self, pred_keypoints: list[Tensor], targets: dict[str, Tensor], queries: int) -> Tensor:
        """rfdetr's weighted keypoint costs of ``L`` layers (its matcher weighs them by the keypoint loss
        coefficients): ``[B, L*Q, T]``; a layer with keypoints for its first queries only (``trainer.keypoint_groups``)
        costs 0 for the others."""
        areas = targets["boxes"][..., 2] * targets["boxes"][..., 3]
        coefs = (self.keypoint_l1_loss_coef, self.keypoint_findable_loss_coef, self.keypoint_visible_loss_coef,
                 self.keypoint_nll_loss_coef)
        costs = []
        for layer in pred_keypoints:
            terms = keypoint_match_costs(layer, targets["keypoints"], targets["labels"], areas,
                                         self.num_keypoints_per_class)
            cost = sum(coef * term for coef, term in zip(coefs, terms))
            costs.append(F.pad(cost, (0, 0, 0, queries - cost.shape[1])) if cost.shape[1] < queries else cost)
        return torch.stack(costs, dim=1).flatten(1, 2)

    def mask_costs(self, pred_masks: list[dict[str, Tensor]], targets: dict[str, Tensor]) -> Tensor:
        """rfdetr's weighted mask costs of ``L`` layers (one point draw each, in layer order): ``[B, L*Q, T]``."""
        costs = []
        for layer in pred_masks:
            ce, dice = mask_cost(layer, targets["masks"], self.mask_point_sample_ratio)
            costs.append(self.cost_mask_ce * ce + self.cost_mask_dice * dice)
        return torch.stack(costs, dim=1).flatten(1, 2)

    @torch.no_grad()
    def assign(self, logits: Tensor, boxes: Tensor, targets: dict[str, Tensor], group_detr: int,
               pred_masks: list[dict[str, Tensor]] | None = None,
               pred_keypoints: list[Tensor] | None = None) -> Tensor:
        """Match ``L`` layers at once: ``logits [B, L, Q, C]``, ``boxes [B, L, Q, 4]`` -> ``[B, L, G*T]`` int64, the
        query of target slot ``t`` in group ``g`` at position ``g*T + t`` (rfdetr's group DETR: each group of
        ``Q/G`` queries is matched on its own). ``pred_masks``: each layer's sparse mask outputs (seg variants), whose
        mask costs enter the cost as in rfdetr's matcher; ``pred_keypoints``: each layer's ``[B, Q, S, 8]`` keypoints
        (the keypoint model), whose costs enter likewise."""
        batch, layers, queries, _ = logits.shape
        slots = targets["labels"].shape[1]
        per_group = queries // group_detr
        if slots > per_group:
            raise ValueError(f"max_targets={slots} exceeds the {per_group} queries per group; lower data.max_targets")
        extra = self.mask_costs(pred_masks, targets) if pred_masks is not None else None
        if pred_keypoints is not None:
            extra = self.keypoint_costs(pred_keypoints, targets, queries)
        cost = self.cost(logits.flatten(1, 2), boxes.flatten(1, 2), targets, extra)  # [B, L*Q, T]
        if pred_keypoints is not None:  # a non-finite keypoint logit makes its query's row non-finite
            cost = _finite_costs(cost)
        problems = cost.reshape(batch * layers * group_detr, per_group, slots)  # image-major: each device its own
        valid = targets["valid"][:, None, :].expand(batch, layers * group_detr, slots).reshape(-1, slots)
        query = self._solve(problems, valid).view(batch, layers, group_detr, slots)
        offsets = torch.arange(group_detr, device=query.device)[:, None] * per_group
        return (query + offsets).view(batch, layers, group_detr * slots)

    @torch._dynamo.disable  # the solver builds an XLA While loop with xla_builder: under torch.compile it runs lazily
    def _solve(self, cost: Tensor, valid: Tensor) -> Tensor:
        """``[P, Q, T]`` problems -> ``[P, T]`` query per target slot, injective per problem (padding parked)."""
        if self.solver == "scipy":
            return park_padding(_scipy_solve(cost), valid, cost.shape[1])
        query_of_target, converged, rounds = on_each_shard(_solve_and_park, cost, valid)
        # problems finished greedily; the search loop's rounds (its hardest problem's, which the chip waits for)
        for name, value in (("matcher_unconverged", (~converged).sum()), ("matcher_rounds", rounds.max())):
            self.solver_stats[name] = value + self.solver_stats[name] if name in self.solver_stats else value
        return query_of_target

    def pop_stats(self) -> dict[str, Tensor]:
        """The solves' counters since the last call (summed over solves), and a fresh start: a step reads them into
        its stats, so that no pending tensor outlives the step (replay refuses one)."""
        stats, self.solver_stats = self.solver_stats, {}
        return stats

    @torch.no_grad()
    def match_layers(self, layers: list[dict[str, Any]], targets: list[dict[str, Tensor]], group_detr: int = 1) -> None:
        """Solve every layer of ``layers`` (same shapes) in one :meth:`assign`; each layer's :meth:`forward` call
        (from upstream's ``SetCriterion.forward``) then gets its share."""
        self._solved = {}
        if not layers or len({tuple(layer["pred_logits"].shape) for layer in layers}) != 1:
            return  # layers of different query counts: left to per-layer forward calls
        logits = torch.stack([layer["pred_logits"] for layer in layers], dim=1)
        boxes = torch.stack([layer["pred_boxes"] for layer in layers], dim=1)
        query = self.assign(logits, boxes, stack_targets(targets), group_detr)
        for k, layer in enumerate(layers):
            self._solved[id(layer["pred_logits"])] = _pairs(query[:, k], group_detr)

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self, outputs: dict[str, Any], targets: list[dict[str, Tensor]], group_detr: int = 1, **_: Any
    ) -> list[tuple[Tensor, Tensor]]:
        solved = self._solved.pop(id(outputs["pred_logits"]), None)
        if solved is not None:
            return solved
        query = self.assign(outputs["pred_logits"][:, None], outputs["pred_boxes"][:, None], stack_targets(targets),
                            group_detr)
        return _pairs(query[:, 0], group_detr)


def _finite_costs(cost: Tensor) -> Tensor:
    """rfdetr's ``_sanitize_cost_matrix`` on the device: non-finite costs become one value above every finite one
    (the largest finite cost plus the largest finite magnitude plus 1)."""
    finite = torch.isfinite(cost)
    largest = torch.where(finite, cost, torch.full_like(cost, -torch.inf)).max()
    magnitude = torch.where(finite, cost.abs(), torch.zeros_like(cost)).max()
    return torch.where(finite, cost, largest + magnitude + 1.0)


def _pairs(query: Tensor, group_detr: int) -> list[tuple[Tensor, Tensor]]:
    """``[B, G*T]`` query indices -> rfdetr's per-image ``(query_index, target_index)`` pairs."""
    slots = query.shape[1] // group_detr
    target_index = torch.arange(slots, device=query.device).repeat(group_detr)
    return [(query[i], target_index) for i in range(query.shape[0])]


def _match_all_layers(criterion: SetCriterion, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of upstream's criterion: one batched matching for the final, auxiliary and encoder outputs
    (the layers rfdetr's ``SetCriterion.forward`` matches, in its order; it then asks the matcher layer by layer)."""
    outputs = args[0] if args else kwargs["outputs"]
    targets = args[1] if len(args) > 1 else kwargs["targets"]
    criterion.matcher.match_layers(_layers(outputs), targets, group_detr=_groups(criterion))


def _layers(outputs: dict[str, Any]) -> list[dict[str, Any]]:
    """The final, auxiliary and encoder outputs, in rfdetr's order."""
    layers = [outputs, *outputs.get("aux_outputs", [])]
    if "enc_outputs" in outputs:
        layers.append(outputs["enc_outputs"])
    return layers


def _suffixes(outputs: dict[str, Any]) -> list[str]:
    """rfdetr's loss-key suffix of each of :func:`_layers`."""
    return ["", *(f"_{i}" for i in range(len(outputs.get("aux_outputs", []))))] + (
        ["_enc"] if "enc_outputs" in outputs else [])


def _groups(criterion: SetCriterion) -> int:
    return criterion.group_detr if criterion.training else 1


class StaticSetCriterion(torch.nn.Module):
    """rfdetr's ``SetCriterion`` for static batches: ``criterion(outputs, batch)`` -> rfdetr's loss dict.

    ``batch`` is a static batch (``labels [B, T]``, ``boxes [B, T, 4]``, ``valid [B, T]``); the keys and values are
    those of upstream's ``SetCriterion.forward`` on the same padded targets (``loss_ce``, ``loss_bbox``,
    ``loss_giou``, ``cardinality_error`` per layer with its suffix, ``class_error`` for the final layer).
    """

    def __init__(self, upstream: SetCriterion, solver: Solver = "device", keypoint_groups: int | None = None) -> None:
        super().__init__()
        #: ``trainer.keypoint_groups``: in training, keypoint costs and losses of the decoder layers for the first this
        #: many query groups only (:mod:`spmd_rfdetr.model.keypoint_groups`); ``None``: all, as rfdetr
        self.keypoint_groups = keypoint_groups
        m = upstream.matcher
        self.matcher = StaticShapeMatcher(
            cost_class=m.cost_class, cost_bbox=m.cost_bbox, cost_giou=m.cost_giou, focal_alpha=m.focal_alpha,
            mask_point_sample_ratio=m.mask_point_sample_ratio, cost_mask_ce=m.cost_mask_ce,
            cost_mask_dice=m.cost_mask_dice, num_keypoints_per_class=m.num_keypoints_per_class,
            keypoint_l1_loss_coef=m.keypoint_l1_loss_coef, keypoint_findable_loss_coef=m.keypoint_findable_loss_coef,
            keypoint_visible_loss_coef=m.keypoint_visible_loss_coef, keypoint_nll_loss_coef=m.keypoint_nll_loss_coef,
            solver=solver)
        upstream.matcher = self.matcher
        upstream.register_forward_pre_hook(_match_all_layers, with_kwargs=True)
        self.upstream = upstream
        self.masks = "masks" in upstream.losses
        self.keypoints = "keypoints" in upstream.losses
        self.batched = (solver == "device" and set(upstream.losses) in (BATCHED_LOSSES, MASK_LOSSES, KEYPOINT_LOSSES)
                        and upstream.ia_bce_loss)

    @property
    def weight_dict(self) -> dict[str, float]:
        return self.upstream.weight_dict

    def num_boxes(self, batch: dict[str, Tensor]) -> Tensor:
        """rfdetr's loss normaliser for the (global) batch: real boxes, times ``group_detr`` in training unless its
        ``sum_group_losses``, at least 1; a device tensor, no ``torch.distributed`` call."""
        count = batch["valid"].sum().float()
        if not self.upstream.sum_group_losses:
            count = count * _groups(self.upstream)
        return count.clamp(min=1.0)

    def forward(self, outputs: dict[str, Any], batch: dict[str, Tensor], num_boxes: Tensor | None = None,
                ) -> dict[str, Tensor]:
        num_boxes = self.num_boxes(batch) if num_boxes is None else num_boxes
        if not self.batched:
            return self.upstream(outputs, targets_list(batch), num_boxes=num_boxes)
        layers, suffixes = _layers(outputs), _suffixes(outputs)
        losses: dict[str, Tensor] = {}
        for shape in dict.fromkeys(tuple(layer["pred_logits"].shape) for layer in layers):  # usually all one shape
            index = [k for k, layer in enumerate(layers) if tuple(layer["pred_logits"].shape) == shape]
            logits = torch.stack([layers[k]["pred_logits"] for k in index], dim=1)
            boxes = torch.stack([layers[k]["pred_boxes"] for k in index], dim=1)
            pred_masks = [layers[k]["pred_masks"] for k in index] if self.masks else None
            groups, kept = _groups(self.upstream), [self._keypoint_groups(suffixes[k]) for k in index]
            pred_keypoints = ([first_groups(layers[k]["pred_keypoints"].detach(), groups, n)
                               for k, n in zip(index, kept)] if self.keypoints else None)
            query = self.matcher.assign(logits.detach(), boxes.detach(), batch, groups, pred_masks, pred_keypoints)
            terms = detection_losses(logits, boxes, query, batch, num_boxes, self.upstream.focal_alpha)
            for j, k in enumerate(index):
                losses.update({name + suffixes[k]: value[j] for name, value in terms.items() if name != "class_error"})
                if k == 0:
                    losses["class_error"] = terms["class_error"][j]
                if self.masks:
                    terms_k = mask_losses(layers[k]["pred_masks"], query[:, j], batch, num_boxes,
                                          self.upstream.mask_point_sample_ratio)
                    losses.update({name + suffixes[k]: value for name, value in terms_k.items()})
                if self.keypoints:
                    norm = num_boxes if kept[j] is None else num_boxes * (kept[j] / groups)  # the kept groups' targets
                    losses.update(matched_keypoint_losses(layers[k]["pred_keypoints"],
                                                          first_groups(query[:, j], groups, kept[j]), batch, norm,
                                                          self.upstream.num_keypoints_per_class, suffixes[k]))
        return losses

    def _keypoint_groups(self, suffix: str) -> int | None:
        """The first query groups whose keypoints a layer prices and scores: ``keypoint_groups`` for the decoder
        layers in training; ``None`` (all) otherwise, and for the encoder's, which keeps every group's keypoints."""
        if self.keypoint_groups is None or _groups(self.upstream) == 1 or suffix == "_enc":
            return None
        return self.keypoint_groups


def detection_losses(logits: Tensor, boxes: Tensor, query: Tensor, batch: dict[str, Tensor], num_boxes: Tensor,
                     focal_alpha: float) -> dict[str, Tensor]:
    """rfdetr's ``loss_labels`` (IoU-aware BCE), ``loss_boxes`` and ``loss_cardinality`` for ``L`` layers at once.

    ``logits [B, L, Q, C]``, ``boxes [B, L, Q, 4]``, ``query [B, L, M]`` (M = G*T matches per image, match ``m`` is
    target slot ``m % T``). Returns ``[L]`` tensors: ``loss_ce``, ``loss_bbox``, ``loss_giou``, ``cardinality_error``
    and ``class_error``. The same arithmetic as upstream's per-layer methods with the ``valid`` mask (a padding pair's
    query keeps its plain negative weight and adds nothing else); matched predictions are taken as whole rows (all
    classes of a query) of each image: no element-wise gather, and a batch split over devices stays local. rfdetr
    writes each match's weights into dense ``[B, L*Q, C]`` weight tensors; here ``loss_ce`` is the sum with every
    weight negative plus, per real match, its term with its own weights minus the negative one (the same terms,
    summed in another order), so the backward's only scatter is the picked rows' gradient (libtpu, v5e.yaml's
    shapes, forward + backward: 4.63 -> 2.39 GB; ``benchmarks/op_costs.py --op criterion``).
    """
    batch_size, layers, queries, classes = logits.shape
    matches = query.shape[2]
    repeat = matches // batch["labels"].shape[1]
    labels = batch["labels"].repeat(1, repeat)[:, None, :].expand(batch_size, layers, matches)
    valid = batch["valid"].repeat(1, repeat)[:, None, :].expand(batch_size, layers, matches).to(logits.dtype)
    target_boxes = batch["boxes"].repeat(1, repeat, 1)[:, None].expand(batch_size, layers, matches, 4)
    layer_rows = query + torch.arange(layers, device=query.device)[:, None] * queries  # rows of [B, L*Q, ...]
    src_boxes = take_rows(boxes.reshape(batch_size, layers * queries, 4), layer_rows.flatten(1))
    src_boxes = src_boxes.view(batch_size, layers, matches, 4)
    src_xyxy = box_cxcywh_to_xyxy(src_boxes).reshape(-1, 4)
    target_xyxy = box_cxcywh_to_xyxy(target_boxes).reshape(-1, 4)

    scores = logits.reshape(batch_size, layers * queries, classes)  # a row per (layer, query) of each image
    prob = scores.sigmoid()
    rows = layer_rows.flatten(1)
    picked = take_rows(scores, rows)  # each match's row (all classes of its query)
    logit = pick_values(picked.reshape(-1, classes), labels.reshape(-1, 1)).view(labels.shape)  # at its class
    with torch.no_grad():  # rfdetr's IoU-aware targets are constants of the loss
        ious, _ = elementwise_box_iou(box_cxcywh_to_xyxy(src_boxes.detach()).reshape(-1, 4), target_xyxy)
        t = torch.clamp(logit.detach().sigmoid().pow(focal_alpha) * ious.reshape(labels.shape).pow(1 - focal_alpha),
                        0.01)
    # rfdetr's loss_ce: every (query, class) with the negative weight prob**gamma, then each real match's
    # (query, class) with its own weights instead (no dense [B, L*Q, C] weight tensors: see the docstring)
    unmatched = _negative_term(scores, prob).view(batch_size, layers, -1).sum(dim=(0, 2))
    as_unmatched = _negative_term(logit, logit.sigmoid())  # the same term at each match, to take it back out
    as_matched = (1 - t) * logit - F.logsigmoid(logit) * (t + (1 - t))
    correction = torch.where(valid > 0, as_matched - as_unmatched, 0.0).sum(dim=(0, 2))
    loss_ce = (unmatched + correction) / num_boxes

    loss_bbox = (F.l1_loss(src_boxes, target_boxes, reduction="none") * valid[..., None]).sum(dim=(0, 2, 3)) / num_boxes
    giou = elementwise_generalized_box_iou(src_xyxy, target_xyxy).reshape(labels.shape)
    loss_giou = ((1 - giou) * valid).sum(dim=(0, 2)) / num_boxes

    with torch.no_grad():
        real = batch["valid"].sum(dim=1).float()[:, None]  # [B, 1]
        predicted = (prob.view(batch_size, layers, queries, classes).max(-1).values > 0.5).sum(2).float()
        cardinality_error = (predicted - real).abs().mean(dim=0)
        picked = picked.detach().view(batch_size, layers, matches, classes).argmax(-1)
        correct = (picked == labels).to(valid.dtype)
        class_error = 100 - 100 * (correct * valid).sum(dim=(0, 2)) / valid.sum(dim=(0, 2)).clamp(min=1)
    return {"loss_ce": loss_ce, "loss_bbox": loss_bbox, "loss_giou": loss_giou,
            "cardinality_error": cardinality_error, "class_error": class_error}


def _negative_term(scores: Tensor, prob: Tensor) -> Tensor:
    """rfdetr's ``loss_ce`` element of a (query, class) no real target matched: negative weight ``prob**gamma``."""
    negative = prob**_GAMMA
    return negative * scores - F.logsigmoid(scores) * negative


def build_criterion(upstream: SetCriterion, solver: Solver = "device",
                    keypoint_groups: int | None = None) -> StaticSetCriterion:
    """rfdetr's criterion (same losses, weights, group DETR) for static batches, with :class:`StaticShapeMatcher`
    (``keypoint_groups``: :attr:`StaticSetCriterion.keypoint_groups`)."""
    return StaticSetCriterion(upstream, solver, keypoint_groups)


def total_loss(loss_dict: dict[str, Tensor], weight_dict: dict[str, float]) -> Tensor:
    """The weighted sum rfdetr's training step backpropagates."""
    return torch.stack([loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict]).sum()

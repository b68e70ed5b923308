"""The static-shape set criterion: rfdetr's SetCriterion with a matcher whose output shapes never change.

Upstream's loss math is already static for padded targets (``valid`` masks in ``loss_labels``/``loss_boxes``,
``num_boxes`` kept as a tensor). What is not static is its HungarianMatcher: it moves every cost matrix to the host and
solves it with SciPy, one variable-length result per image. :class:`StaticShapeMatcher` keeps rfdetr's cost (the same
``_compute_compact_detection_cost_matrix``) and replaces only the solve:

- ``solver="device"``: :func:`spmd_rfdetr.matching.solve_assignment` on the device, inside the step's one graph;
- ``solver="scipy"``: the upstream way, through the host (a reference, and a fallback).

Either way every image gets exactly ``group_detr * max_targets`` (query, target) pairs: real targets at their optimal
query, padding slots parked on distinct leftover queries, where the criterion's ``valid`` mask zeroes them.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from rfdetr.models.criterion import SetCriterion
from rfdetr.models.matcher import HungarianMatcher
from scipy.optimize import linear_sum_assignment

Solver = Literal["device", "scipy"]


def park_padding(query_of_target: torch.Tensor, valid: torch.Tensor, num_queries: int) -> torch.Tensor:
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


def _scipy_solve(cost: torch.Tensor) -> torch.Tensor:
    """Upstream's host path: SciPy on every [Q, T] problem (padding columns included). Returns [P, T]."""
    cost_host = cost.detach().float().cpu()
    result = torch.empty(cost.shape[0], cost.shape[2], dtype=torch.int64)
    for p, c in enumerate(cost_host):
        rows, cols = linear_sum_assignment(c.numpy())
        result[p, torch.as_tensor(cols)] = torch.as_tensor(rows)
    return result.to(cost.device)


class StaticShapeMatcher(HungarianMatcher):
    """rfdetr's matcher cost + a fixed-shape assignment (see the module docstring).

    :meth:`match_layers` solves several layers' matchings in ONE batched assignment (the criterion calls it through a
    forward pre-hook, see :func:`build_criterion`); :meth:`forward` then hands each layer its share. One solver loop
    per step instead of one per layer: its rounds run until the hardest problem of all layers is done (not the sum of
    each layer's hardest), and there is one loop to trace and compile.
    """

    def __init__(self, *args: Any, solver: Solver = "device", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.solver = solver
        self.unconverged: torch.Tensor | None = None  # problems finished greedily since the last reset (device)
        self._solved: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # id(pred_logits) -> indices

    def _problems(
        self, outputs: dict[str, Any], targets: list[dict[str, torch.Tensor]], group_detr: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rfdetr's cost as ``[B*G, Q/G, T]`` problems (image-major, one per image x group) and their ``valid``."""
        batch, queries = outputs["pred_logits"].shape[:2]
        slots = targets[0]["boxes"].shape[0]
        if any("valid" not in t or t["boxes"].shape[0] != slots for t in targets):
            raise ValueError("StaticShapeMatcher needs targets padded to one length with a 'valid' mask")
        per_group = queries // group_detr
        if slots > per_group:
            raise ValueError(f"max_targets={slots} exceeds the {per_group} queries per group; lower data.max_targets")
        # rfdetr's cost, [Q, B*T] (padding columns already at its sentinel cost) -> [B, Q, T]
        cost = self._compute_compact_detection_cost_matrix(outputs, targets).view(queries, batch, slots)
        cost = cost.permute(1, 0, 2).reshape(batch * group_detr, per_group, slots)
        valid = torch.stack([t["valid"] for t in targets]).repeat_interleave(group_detr, dim=0)
        return cost, valid

    @torch._dynamo.disable  # the solver builds an XLA While loop with xla_builder: under torch.compile it runs lazily
    def _solve(self, cost: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``[P, Q, T]`` problems -> ``[P, T]`` query per target slot, injective per problem (padding parked)."""
        if self.solver == "scipy":
            return _scipy_solve(cost)
        from spmd_rfdetr.matching import solve_assignment

        query_of_target, converged = solve_assignment(cost, valid)
        missed = (~converged).sum()
        self.unconverged = missed if self.unconverged is None else self.unconverged + missed
        return park_padding(query_of_target, valid, cost.shape[1])

    @torch.no_grad()
    def match_layers(
        self, layers: list[dict[str, Any]], targets: list[dict[str, torch.Tensor]], group_detr: int = 1
    ) -> None:
        """Solve the matchings of every layer in ``layers`` (same query count) in one assignment call.

        The results wait, keyed by each layer's ``pred_logits`` tensor, for that layer's :meth:`forward` call.
        Problems are stacked image-major (``[B*G, L, ...]``), so each device keeps solving its own images.
        """
        self._solved = {}
        if not layers:
            return
        shapes = {tuple(layer["pred_logits"].shape) for layer in layers}
        if len(shapes) != 1:  # layers of different query counts: leave them to per-layer forward calls
            return
        problems = [self._problems(layer, targets, group_detr) for layer in layers]
        cost = torch.stack([c for c, _ in problems], dim=1).flatten(0, 1)  # [B*G*L, Q/G, T], image-major
        valid = torch.stack([v for _, v in problems], dim=1).flatten(0, 1)
        solved = self._solve(cost, valid).view(-1, len(layers), cost.shape[2])
        batch, queries = layers[0]["pred_logits"].shape[:2]
        for k, layer in enumerate(layers):
            pairs = _pairs(solved[:, k], batch, group_detr, queries // group_detr)
            self._solved[id(layer["pred_logits"])] = pairs

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self, outputs: dict[str, Any], targets: list[dict[str, torch.Tensor]], group_detr: int = 1, **_: Any
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        solved = self._solved.pop(id(outputs["pred_logits"]), None)
        if solved is not None:
            return solved
        batch, queries = outputs["pred_logits"].shape[:2]
        cost, valid = self._problems(outputs, targets, group_detr)
        return _pairs(self._solve(cost, valid), batch, group_detr, queries // group_detr)


def _pairs(
    query_of_target: torch.Tensor, batch: int, group_detr: int, per_group: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[B*G, T]`` per-group query indices -> rfdetr's per-image ``(query_index, target_index)`` pairs."""
    slots, device = query_of_target.shape[1], query_of_target.device
    offsets = torch.arange(group_detr, device=device).repeat(batch)[:, None] * per_group
    query_index = (query_of_target + offsets).view(batch, group_detr * slots)
    target_index = torch.arange(slots, device=device).repeat(group_detr)
    return [(query_index[i], target_index) for i in range(batch)]


def _match_all_layers(criterion: SetCriterion, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of the criterion: one batched matching for the final, auxiliary and encoder outputs.

    The layers are the ones rfdetr's ``SetCriterion.forward`` matches, in its order; it then calls the matcher per
    layer and gets the stored results.
    """
    outputs = args[0] if args else kwargs["outputs"]
    targets = args[1] if len(args) > 1 else kwargs["targets"]
    layers = [outputs, *outputs.get("aux_outputs", [])]
    if "enc_outputs" in outputs:
        layers.append(outputs["enc_outputs"])
    group_detr = criterion.group_detr if criterion.training else 1
    criterion.matcher.match_layers(layers, targets, group_detr=group_detr)


def build_criterion(upstream: SetCriterion, solver: Solver = "device") -> SetCriterion:
    """rfdetr's criterion (same losses, weights, group DETR) with its matcher swapped for :class:`StaticShapeMatcher`.

    A forward pre-hook solves all layers' matchings in one call before rfdetr's forward asks for them layer by layer.
    """
    m = upstream.matcher
    upstream.matcher = StaticShapeMatcher(
        cost_class=m.cost_class, cost_bbox=m.cost_bbox, cost_giou=m.cost_giou, focal_alpha=m.focal_alpha, solver=solver
    )
    upstream.register_forward_pre_hook(_match_all_layers, with_kwargs=True)
    return upstream


def total_loss(loss_dict: dict[str, torch.Tensor], weight_dict: dict[str, float]) -> torch.Tensor:
    """The weighted sum rfdetr's training step backpropagates."""
    return torch.stack([loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict]).sum()

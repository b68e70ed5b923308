"""The static-shape matcher and criterion: padding parking, the same assignment and losses as upstream's SciPy matcher and SetCriterion."""

from __future__ import annotations

import pytest
import torch
import torch_xla

from spmd_rfdetr.model.loss import park_padding


def test_padding_parks_on_distinct_free_queries_on_xla() -> None:
    # a real target on query 0: padding slots also index query 0, which a plain scatter may let win
    query = torch.tensor([[0, 5, 0, 0], [3, 0, 0, 0], [0, 1, 2, 3]])
    valid = torch.tensor([[True, True, False, False], [True, False, False, False], [True, True, True, True]])
    for device in ("cpu", torch_xla.device()):
        parked = park_padding(query.to(device), valid.to(device), num_queries=6).cpu()
        for row, mask, original in zip(parked, valid, query):
            assert len(set(row.tolist())) == 4, parked  # injective
            assert torch.equal(row[mask], original[mask])  # real targets keep their query
            free = sorted(set(range(6)) - set(original[mask].tolist()))
            assert row[~mask].tolist() == free[: int((~mask).sum())]  # lowest free queries, in order


def test_all_layers_in_one_solve_equal_per_layer_and_scipy() -> None:
    """The criterion's pre-hook solves final + aux + encoder layers in one call: same pairs as one solve per layer,
    and the same total cost as upstream's SciPy matcher (eager CPU, the solver's Python-loop driver)."""
    from rfdetr.models.matcher import _PADDED_TARGET_COST, HungarianMatcher
    from scipy.optimize import linear_sum_assignment

    from spmd_rfdetr.model.loss import StaticShapeMatcher, stack_targets

    torch.manual_seed(0)
    batch, group_detr, per_group, slots, classes = 3, 2, 12, 5, 4

    def layer() -> dict[str, torch.Tensor]:
        return {"pred_logits": torch.randn(batch, group_detr * per_group, classes),
                "pred_boxes": torch.rand(batch, group_detr * per_group, 4) * 0.5 + 0.25}

    counts = [5, 2, 0]
    targets = [{"labels": torch.randint(0, classes, (slots,)), "boxes": torch.rand(slots, 4) * 0.4 + 0.3,
                "valid": torch.arange(slots) < k} for k in counts]
    layers = [layer() for _ in range(3)]
    kwargs = dict(cost_class=2.0, cost_bbox=5.0, cost_giou=2.0, focal_alpha=0.25)
    matcher = StaticShapeMatcher(**kwargs)
    matcher.match_layers(layers, targets, group_detr=group_detr)
    assert len(matcher._solved) == 3
    batched = [matcher(out, targets, group_detr=group_detr) for out in layers]  # served from the batched solve
    assert not matcher._solved
    per_layer = [matcher(out, targets, group_detr=group_detr) for out in layers]  # one solve each
    upstream = HungarianMatcher(**kwargs)
    for out, got, ref in zip(layers, batched, per_layer):
        for (q1, t1), (q2, t2) in zip(got, ref):
            assert torch.equal(q1, q2) and torch.equal(t1, t2)
        for i, (k, (query_index, _)) in enumerate(zip(counts, got)):
            real = [{"labels": targets[i]["labels"][:k], "boxes": targets[i]["boxes"][:k]}]
            for g in range(group_detr):
                queries = slice(g * per_group, (g + 1) * per_group)
                one = {key: value[i : i + 1, queries] for key, value in out.items()}
                cost = upstream._compute_compact_detection_cost_matrix(one, real)  # [per_group, k]
                ours = query_index[g * slots : g * slots + k] - g * per_group
                rows, cols = linear_sum_assignment(cost.numpy())
                assert torch.isclose(cost[ours, torch.arange(k)].sum(), cost[rows, cols].sum(), atol=1e-5)
    # the cost itself (built per coordinate, pair_costs.py) is upstream's, element by element
    for out in layers:
        ours = matcher.cost(out["pred_logits"], out["pred_boxes"], stack_targets(targets))  # [B, Q, T]
        for i, k in enumerate(counts):
            real = [{"labels": targets[i]["labels"][:k], "boxes": targets[i]["boxes"][:k]}]
            cost = upstream._compute_compact_detection_cost_matrix({key: v[i : i + 1] for key, v in out.items()}, real)
            assert torch.allclose(ours[i, :, :k], cost, rtol=1e-6, atol=1e-6), (ours[i, :, :k] - cost).abs().max()
            assert (ours[i, :, k:] == _PADDED_TARGET_COST).all()


def test_criterion_matches_all_layers_in_one_solve_with_upstream_losses() -> None:
    """Our criterion on a padded static batch, batched over images and layers (and through upstream's own
    ``SetCriterion.forward`` with the SciPy solver): one solve for final + aux + encoder, the losses and gradients of
    upstream's criterion (its SciPy matcher, unpadded targets), eager CPU."""
    from spmd_rfdetr.config.options import DataOptions, ModelOptions, OptimOptions
    from spmd_rfdetr.model.loss import build_criterion, stack_targets, total_loss
    from spmd_rfdetr.model.upstream import build_upstream_criterion, upstream_configs

    cfgs = upstream_configs(ModelOptions(resolution=128, num_queries=10, group_detr=2, dec_layers=3),
                            DataOptions(dataset_dir="unused", global_batch_size=2, max_targets=4), OptimOptions(), 3)
    torch.manual_seed(1)
    batch, queries, classes = 2, 20, 4

    def layer() -> dict[str, torch.Tensor]:
        return {"pred_logits": torch.randn(batch, queries, classes), "pred_boxes": torch.rand(batch, queries, 4) * 0.5 + 0.25}

    outputs = {**layer(), "aux_outputs": [layer(), layer()], "enc_outputs": layer()}
    counts = [3, 1]
    padded = [{"labels": torch.randint(0, 3, (4,)), "boxes": torch.rand(4, 4) * 0.4 + 0.3,
               "valid": torch.arange(4) < k} for k in counts]
    real = [{"labels": t["labels"][:k], "boxes": t["boxes"][:k]} for t, k in zip(padded, counts)]

    leaves = [outputs["pred_logits"], outputs["pred_boxes"], outputs["aux_outputs"][0]["pred_boxes"],
              outputs["enc_outputs"]["pred_logits"]]
    for leaf in leaves:
        leaf.requires_grad_()
    upstream = build_upstream_criterion(cfgs)[0].train()
    reference = upstream(outputs, real)
    expected = torch.autograd.grad(total_loss(reference, upstream.weight_dict), leaves)
    for solver in ("device", "scipy"):  # the batched losses, and upstream's own SetCriterion.forward
        ours = build_criterion(build_upstream_criterion(cfgs)[0], solver=solver).train()
        assert ours.batched == (solver == "device")
        solves = []
        solve = ours.matcher._solve
        ours.matcher._solve = lambda cost, valid: solves.append(tuple(cost.shape)) or solve(cost, valid)
        got = ours(outputs, stack_targets(padded))
        assert solves == [(batch * 2 * 4, queries // 2, 4)], solves  # B x group_detr x 4 layers, in one call
        assert set(got) == set(reference)
        for key in reference:
            assert torch.allclose(got[key], reference[key], atol=1e-5, rtol=1e-5), (solver, key, got[key],
                                                                                   reference[key])
        grads = torch.autograd.grad(total_loss(got, ours.weight_dict), leaves)
        for g, e in zip(grads, expected):
            assert torch.allclose(g, e, atol=1e-6, rtol=1e-5), (solver, (g - e).abs().max())



def test_the_criterion_calls_no_collective_with_a_default_process_group(tmp_path) -> None:
    """With several hosts ``fit`` initialises a gloo default group (spmd_rfdetr.xla.hosts). rfdetr's criterion then
    all-reduces its XLA box count over gloo inside the traced step, which gloo cannot do (and divides by the process
    count, while under SPMD the count is global already); ours computes the global count on the device. Both
    criteria on sharded XLA tensors, with a one-process gloo group initialised here."""
    import torch.distributed as dist
    import torch_xla.distributed.spmd as xs

    from spmd_rfdetr.config.options import DataOptions, ModelOptions, OptimOptions
    from spmd_rfdetr.model.loss import build_criterion, stack_targets
    from spmd_rfdetr.xla.mesh import build_mesh
    from spmd_rfdetr.model.upstream import build_upstream_criterion, upstream_configs

    cfgs = upstream_configs(ModelOptions(resolution=128, num_queries=10, group_detr=2, dec_layers=2),
                            DataOptions(dataset_dir="unused", global_batch_size=4, max_targets=4), OptimOptions(), 3)
    mesh = build_mesh()
    g = torch.Generator().manual_seed(2)

    def sharded(t: torch.Tensor) -> torch.Tensor:
        x = t.to(torch_xla.device())
        xs.mark_sharding(x, mesh, (("data", "fsdp"),) + (None,) * (x.dim() - 1))
        return x

    def layer() -> dict[str, torch.Tensor]:
        return {"pred_logits": sharded(torch.randn(4, 20, 4, generator=g)),
                "pred_boxes": sharded(torch.rand(4, 20, 4, generator=g) * 0.5 + 0.25)}

    outputs = {**layer(), "aux_outputs": [layer()]}
    padded = [{"labels": torch.randint(0, 3, (4,), generator=g), "boxes": torch.rand(4, 4, generator=g) * 0.4 + 0.3,
               "valid": torch.arange(4) < k} for k in (3, 1, 0, 4)]
    batch = {k: sharded(v) for k, v in stack_targets(padded).items()}
    torch_xla.sync()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    allowed = torch_xla._XLAC._get_allow_execution()
    torch_xla._XLAC._set_allow_execution(False)  # as the replayed step is traced: a host round trip raises
    try:
        losses = build_criterion(build_upstream_criterion(cfgs)[0]).train()(outputs, batch)
        targets = [{k: v[i] for k, v in batch.items()} for i in range(4)]
        upstream = build_criterion(build_upstream_criterion(cfgs)[0]).train().upstream  # rfdetr's, our matcher
        with pytest.raises(RuntimeError):  # what a pod slice met at step 1: its num_boxes all_reduce over gloo
            upstream(outputs, targets)
    finally:
        dist.destroy_process_group()
    try:
        upstream(outputs, targets)  # the same call without the group traces (the group was the cause)
    finally:
        torch_xla._XLAC._set_allow_execution(allowed)
    assert torch.isfinite(losses["loss_ce"].cpu())

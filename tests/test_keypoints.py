"""rfdetr's keypoint losses and matching costs on a padded static batch (``spmd_rfdetr.model.keypoints``) against
upstream's own ``SetCriterion.loss_keypoints`` and ``compute_keypoint_matching_cost`` on the unpadded targets: every
term (and the losses' gradients), eager CPU, the same draws."""

from __future__ import annotations

import pytest
import torch
from rfdetr.models.criterion import SetCriterion
from rfdetr.models.heads.keypoints import compute_keypoint_matching_cost
from rfdetr.models.matcher import HungarianMatcher

from spmd_rfdetr.data.batches import pad_target
from spmd_rfdetr.model.keypoints import KEYPOINT_LOSSES, keypoint_losses, keypoint_match_costs

QUERIES, SLOTS = 12, 5


def _draw(schema: list[int], counts: list[int], seed: int = 0) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Predictions ``[B, Q, len(schema) * kpad, 8]`` with the awkward values rfdetr's loss guards against (NaN and
    inf channels, a log-precision that overflows exp), and per-image targets with visibility 0/1/2, a zero-area box
    and labels of every class of the schema."""
    g = torch.Generator().manual_seed(seed)
    kpad = max(schema)
    pred = torch.randn(len(counts), QUERIES, len(schema) * kpad, 8, generator=g)
    pred[0, 1, 2, 0] = float("nan")  # a location channel
    pred[0, 2, 3, 2] = float("inf")  # a findable logit
    pred[1, 0, 1, 3] = float("nan")  # a visible logit
    pred[1, 3, 0, 4] = 100.0  # log_l11: exp() overflows
    pred[0, 0, 4, 6] = float("nan")  # log_l22
    if len(schema) > 1:
        pred[0, 1, kpad + 1, 0] = float("nan")  # another class's slot: read by nothing
    targets = []
    for n in counts:
        keypoints = torch.rand(n, kpad, 3, generator=g)
        keypoints[..., 2] = torch.randint(0, 3, (n, kpad), generator=g).float()
        keypoints[keypoints[..., 2] == 0] = 0.0  # rfdetr's readers zero unlabelled points
        boxes = torch.rand(n, 4, generator=g) * 0.5 + 0.05
        if n:
            boxes[0, 2] = 0.0  # a degenerate box: no location or NLL term
        labels = torch.arange(n) % len(schema)
        targets.append({"keypoints": keypoints, "boxes": boxes, "labels": labels})
    return pred, targets


def _padded(targets: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The per-image targets padded to ``SLOTS`` slots as the train loader pads them (``data.batches.pad_target``)."""
    rows = [pad_target(t, SLOTS) for t in targets]
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


@pytest.mark.parametrize("schema", [[17], [0, 5]], ids=["person", "two-classes"])
def test_keypoint_losses_on_a_padded_batch_equal_rfdetrs_on_the_targets(schema):
    counts = [3, 4, 0]
    pred, targets = _draw(schema, counts)
    torch.manual_seed(1)
    indices = [(torch.randperm(n), torch.randperm(n)) for n in counts]  # queries 0..n-1: the awkward values matched
    num_boxes = torch.tensor(float(sum(counts)))
    upstream = SetCriterion(len(schema), HungarianMatcher(), {}, 0.25, ["keypoints"],
                            num_keypoints_per_class=schema)
    theirs_pred = pred.clone().requires_grad_()
    theirs = upstream.loss_keypoints({"pred_keypoints": theirs_pred}, targets, indices, num_boxes)

    # the static batch (every image SLOTS target slots, as data.batches pads them) and each slot's matched query
    batch = _padded(targets)
    query = torch.zeros(len(counts), SLOTS, dtype=torch.long)
    for b, (src, tgt) in enumerate(indices):
        leftover = [q for q in range(QUERIES) if q not in src.tolist()]
        query[b] = torch.cat([src[torch.argsort(tgt)], torch.tensor(leftover[:SLOTS - len(tgt)], dtype=torch.long)])
    ours_pred = pred.clone().requires_grad_()
    at_slots = ours_pred.gather(1, query[:, :, None, None].expand(-1, -1, *pred.shape[2:]))
    areas = batch["boxes"][..., 2] * batch["boxes"][..., 3]
    ours = keypoint_losses(at_slots, batch["keypoints"], batch["labels"], areas, batch["valid"], num_boxes, schema)

    assert set(ours) == set(theirs) == set(KEYPOINT_LOSSES)
    for name in KEYPOINT_LOSSES:
        assert torch.isfinite(theirs[name]), name
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7, msg=name)
    (sum(ours.values()) * 1.0).backward()
    sum(theirs.values()).backward()
    assert theirs_pred.grad.abs().sum() > 0 and torch.isfinite(theirs_pred.grad).all()
    torch.testing.assert_close(ours_pred.grad, theirs_pred.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("schema", [[17], [0, 5]], ids=["person", "two-classes"])
def test_keypoint_match_costs_per_image_equal_rfdetrs_over_the_batch(schema):
    counts = [3, 4, 0]
    pred, targets = _draw(schema, counts, seed=2)
    everything = {key: torch.cat([t[key] for t in targets]) for key in ("keypoints", "boxes", "labels")}
    theirs = compute_keypoint_matching_cost(pred, everything["keypoints"], everything["labels"],
                                            everything["boxes"][:, 2] * everything["boxes"][:, 3], schema)
    padded = _padded(targets)
    ours = keypoint_match_costs(pred, padded["keypoints"], padded["labels"],
                                padded["boxes"][..., 2] * padded["boxes"][..., 3], schema)
    first = 0
    for b, n in enumerate(counts):  # upstream prices every query against every image's targets: ours, its own
        for name, mine, upstream in zip(("l1", "findable", "visible", "nll"), ours, theirs):
            assert mine.shape == (len(counts), QUERIES, SLOTS)
            torch.testing.assert_close(mine[b, :, :n], upstream[b, :, first:first + n], rtol=1e-6, atol=1e-6,
                                       equal_nan=True, msg=f"{name}, image {b}")
        first += n
    assert sum(torch.isfinite(c).sum() for c in ours) > 0


def test_criterion_on_rfdetrs_keypoint_model_equals_upstreams() -> None:
    """rfdetr's keypoint model (tiny, from scratch) in train mode; our criterion on a padded static batch, batched
    over images and layers (its matcher pricing the keypoint costs), against upstream's ``SetCriterion`` with its
    SciPy matcher on the unpadded targets: every loss term of every layer, and the gradients."""
    from rfdetr.config import KeypointTrainConfig, RFDETRKeypointPreviewConfig
    from rfdetr.models.lwdetr import build_criterion_from_config, build_model_from_config

    from spmd_rfdetr.model.loss import build_criterion, total_loss

    model_cfg = RFDETRKeypointPreviewConfig(pretrain_weights=None, device="cpu", resolution=96, num_queries=6,
                                            group_detr=2, dec_layers=2, num_classes=1)
    train_cfg = KeypointTrainConfig(dataset_dir=".", output_dir=".")
    torch.manual_seed(0)
    net = build_model_from_config(model_cfg, train_cfg).train()
    with torch.no_grad():
        outputs = net(torch.rand(2, 3, 96, 96))
    leaves: list[torch.Tensor] = []

    def leaf(value):  # every output tensor a leaf of its own, so both criteria's gradients can be compared
        if isinstance(value, torch.Tensor):
            leaves.append(value.clone().requires_grad_())
            return leaves[-1]
        if isinstance(value, dict):
            return {k: leaf(v) for k, v in value.items()}
        return [leaf(v) for v in value] if isinstance(value, list) else value

    outputs = leaf(outputs)
    assert {"pred_keypoints"} <= set(outputs) and outputs["pred_keypoints"].shape == (2, 12, 17, 8)
    g = torch.Generator().manual_seed(3)
    counts = [3, 1]
    real = []
    for n in counts:
        keypoints = torch.rand(n, 17, 3, generator=g)
        keypoints[..., 2] = torch.randint(0, 3, (n, 17), generator=g).float()
        keypoints[keypoints[..., 2] == 0] = 0.0
        real.append({"labels": torch.zeros(n, dtype=torch.long), "boxes": torch.rand(n, 4, generator=g) * 0.4 + 0.2,
                     "keypoints": keypoints})

    upstream = build_criterion_from_config(model_cfg, train_cfg)[0].train()
    reference = upstream(outputs, real)
    expected = torch.autograd.grad(total_loss(reference, upstream.weight_dict), leaves, allow_unused=True)
    ours = build_criterion(build_criterion_from_config(model_cfg, train_cfg)[0]).train()
    assert ours.batched and ours.keypoints
    got = ours(outputs, _padded(real))
    assert set(got) == set(reference) and {f"{k}_enc" for k in KEYPOINT_LOSSES} <= set(got)
    for key in reference:
        torch.testing.assert_close(got[key], reference[key], rtol=1e-5, atol=1e-5, msg=key)
    grads = torch.autograd.grad(total_loss(got, ours.weight_dict), leaves, allow_unused=True)
    for mine, theirs in zip(grads, expected):
        if theirs is None:
            assert mine is None or not mine.any()
        else:
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_keypoint_losses_and_costs_trace_on_xla_as_one_graph_without_host_reads() -> None:
    """The losses (with their backward) and the costs on XLA tensors: one graph, no device->host transfer and no CPU
    fallback while tracing (what a compiled step needs: upstream's versions read the device twice per call), and
    the eager values."""
    import torch_xla

    from spmd_rfdetr.training.metrics import xla_counters

    schema = [0, 5]
    pred, targets = _draw(schema, [3, 4, 0], seed=4)
    padded = _padded(targets)
    areas, valid = padded["boxes"][..., 2] * padded["boxes"][..., 3], padded["valid"]
    num_boxes = torch.tensor(7.0)

    def inputs(device: torch.device) -> tuple[torch.Tensor, ...]:
        tensors = (pred.detach().clone(), padded["keypoints"], padded["labels"], areas, valid, num_boxes)
        return tuple(t.to(device) for t in tensors)

    def compute(leaf, keypoints, labels, areas, valid, num_boxes):
        leaf.requires_grad_()
        losses = keypoint_losses(leaf[:, :SLOTS], keypoints, labels, areas, valid, num_boxes, schema)
        sum(losses.values()).backward()
        return losses, keypoint_match_costs(leaf.detach(), keypoints, labels, areas, schema), leaf.grad

    eager = compute(*inputs(torch.device("cpu")))
    on_device = inputs(torch_xla.device())
    torch_xla.sync()  # the inputs on the device first
    before = xla_counters()
    on_xla = compute(*on_device)
    torch_xla.sync()
    after = xla_counters()
    assert after["xla_compiles"] - before["xla_compiles"] == 1
    assert after["xla_transfers_to_host"] == before["xla_transfers_to_host"]
    assert after["xla_aten_fallbacks"] == before["xla_aten_fallbacks"]
    for name in KEYPOINT_LOSSES:
        torch.testing.assert_close(on_xla[0][name].cpu(), eager[0][name], rtol=1e-5, atol=1e-6, msg=name)
    for mine, reference in zip(on_xla[1], eager[1]):
        torch.testing.assert_close(mine.cpu(), reference, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(on_xla[2].cpu(), eager[2], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_keypoint_step_on_the_mesh_equals_upstream(mesh_trainer) -> None:
    """rfdetr's keypoint model (tiny; a root class without keypoints beside two with 3) compiled as ``fit``'s step on
    the 4-device mesh (replay: step 2 is traced again, checked against step 1's program and replayed; trace mode
    compiled the same program twice, as a first step's graph hash differs from a later step's), against upstream
    rfdetr's eager CPU steps (its model, SetCriterion with its SciPy matcher and the keypoint costs, clipping, AdamW)
    on the unpadded targets: step 1 to 1e-5 in every logged loss term (the four keypoint terms among them) and 1e-4
    relative L2 in the clipped gradients, step 2 (after one AdamW update) within ``parity_tolerance``."""
    from spmd_rfdetr.config.options import DataOptions, ModelOptions, OptimOptions, TrainerOptions
    from spmd_rfdetr.data.pixels import upstream_float
    from spmd_rfdetr.model.loss import total_loss
    from spmd_rfdetr.model.upstream import build_model, build_upstream_criterion, upstream_configs
    from spmd_rfdetr.training.build import build_trainer
    from spmd_rfdetr.training.optim import build_optimizer
    from spmd_rfdetr.training.step import LOGGED_LOSSES
    from support.models import first_step_gradients, gradient_relative_error, parity_tolerance

    schema, size, slots = [0, 3, 3], 48, 4
    model = ModelOptions(variant="keypoint-preview", resolution=size, num_queries=6, group_detr=2, dec_layers=2,
                         backbone_blocks=2, pretrain_weights=None, num_keypoints_per_class=schema)
    optim = OptimOptions(schedule="constant")
    cfgs = upstream_configs(model, DataOptions(dataset_dir="/nonexistent", max_targets=slots), optim, num_classes=3)
    assert cfgs.model.num_keypoints_per_class == schema and cfgs.keypoints_per_target == 3
    torch.manual_seed(0)
    init = build_model(cfgs).state_dict()
    g = torch.Generator().manual_seed(5)

    def batch(counts: list[int]) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        targets = []
        for n in counts:
            keypoints = torch.rand(n, 3, 3, generator=g)
            keypoints[..., 2] = torch.randint(0, 3, (n, 3), generator=g).float()
            keypoints[keypoints[..., 2] == 0] = 0.0
            targets.append({"boxes": torch.rand(n, 4, generator=g) * 0.4 + 0.2, "keypoints": keypoints,
                            "labels": torch.randint(0, 3, (n,), generator=g)})
        padded = [pad_target(t, slots) for t in targets]
        static = {key: torch.stack([p[key] for p in padded]) for key in padded[0]}
        static["images"] = torch.randint(0, 256, (len(counts), 3, size, size), dtype=torch.uint8, generator=g)
        static["image_id"] = torch.arange(len(counts))
        static["orig_size"] = torch.full((len(counts), 2), size)
        return static, targets

    reference_net = build_model(cfgs)
    reference_net.load_state_dict(init)
    reference_net.train()
    reference = build_upstream_criterion(cfgs)[0].train()
    optimizer = build_optimizer(reference_net, cfgs)  # plain AdamW, as rfdetr trains
    net = build_model(cfgs)
    net.load_state_dict(init)
    ours = build_trainer(mesh_trainer.fabric, cfgs, optim, TrainerOptions(precision="fp32", step_mode="replay"),
                         model=net)
    losses = []
    for step in range(1, 3):
        static, targets = batch([3, 1, 0, 4])
        optimizer.zero_grad(set_to_none=True)
        expected = reference(reference_net(upstream_float(static["images"])), targets)
        total_loss(expected, reference.weight_dict).backward()
        torch.nn.utils.clip_grad_norm_(reference_net.parameters(), optim.clip_max_norm)
        stats = ours.step.read(ours.step(mesh_trainer.to_device(static)))
        reference_loss = float(total_loss(expected, reference.weight_dict))
        losses.append((stats["loss"], reference_loss))
        assert abs(stats["loss"] - reference_loss) <= parity_tolerance(step) * reference_loss, (step, losses)
        if step == 1:
            logged = [key for key in LOGGED_LOSSES if key in expected]
            assert {f"loss_keypoints_{k}" for k in ("l1", "findable", "visible", "nll")} <= set(logged)
            for key in logged:
                value = float(expected[key])
                assert abs(stats[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, stats[key], value)
            error = gradient_relative_error(first_step_gradients(ours.optimizer, ours.model.parameters()),
                                            reference_net.parameters())
            assert error <= 1e-4, f"gradient relative L2 error {error:.3g}"
        optimizer.step()
    assert ours.step.mode == "replay", ours.step.fallback_reason  # step 2 replayed step 1's program
    print(f"keypoint step: losses (ours, upstream) {losses}")

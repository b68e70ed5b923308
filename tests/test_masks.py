"""The seg variants' mask cost and losses (:mod:`spmd_rfdetr.model.masks`) against upstream rfdetr's own matcher and
``SetCriterion.loss_masks`` on the same model outputs and the same random point draws (eager CPU)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from spmd_rfdetr.config.options import DataOptions, ModelOptions, OptimOptions
from spmd_rfdetr.data.batches import pad_target
from spmd_rfdetr.model.loss import build_criterion, total_loss
from spmd_rfdetr.model.masks import pack_masks, sample_at, sample_targets, unpack_masks
from spmd_rfdetr.model.upstream import build_model, build_upstream_criterion, upstream_configs

RESOLUTION, SLOTS, CLASSES = 48, 4, 3


def seg_targets(counts: list[int], generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """rfdetr targets after its transforms: boxes in normalised cxcywh and each object's mask, a filled ellipse
    inside its box at the input resolution."""
    targets = []
    ys, xs = torch.meshgrid(torch.arange(RESOLUTION) + 0.5, torch.arange(RESOLUTION) + 0.5, indexing="ij")
    for n in counts:
        centre = torch.rand(n, 2, generator=generator) * 0.5 + 0.25
        size = torch.rand(n, 2, generator=generator) * 0.3 + 0.15
        boxes = torch.cat([centre, size], dim=1)
        cx, cy = (centre * RESOLUTION).T[:, :, None, None]
        rx, ry = (size * RESOLUTION / 2).T[:, :, None, None]
        masks = ((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2 <= 1
        targets.append({"boxes": boxes, "labels": torch.randint(0, CLASSES, (n,), generator=generator),
                        "masks": masks})
    return targets


class Draws:
    """``torch.rand`` replaced: records upstream's draws, then serves them to our criterion re-ordered."""

    def __init__(self) -> None:
        self.recorded: list[torch.Tensor] = []
        self.served: list[torch.Tensor] = []

    @contextmanager
    def record(self) -> Iterator[None]:
        rand = torch.rand

        def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = rand(*args, **kwargs)
            self.recorded.append(out.clone())
            return out

        torch.rand = recording
        try:
            yield
        finally:
            torch.rand = rand

    @contextmanager
    def serve(self, draws: list[torch.Tensor]) -> Iterator[None]:
        rand, queue = torch.rand, list(draws)

        def serving(*shape: Any, **kwargs: Any) -> torch.Tensor:
            out = queue.pop(0)
            assert tuple(out.shape) == tuple(shape), (out.shape, shape)
            self.served.append(out)
            return out

        torch.rand = serving
        try:
            yield
            assert not queue, f"{len(queue)} draws left unused"
        finally:
            torch.rand = rand


def ours_from_upstream(draws: list[torch.Tensor], pairs: list[list[tuple[torch.Tensor, torch.Tensor]]],
                       batch: int, groups: int, per_group: int) -> list[torch.Tensor]:
    """Upstream's draws in the order our criterion draws them (both: every layer's matcher draw, then each layer's two
    loss draws), the loss draws' rows as our matches ``[B, G, T]``: upstream's row of pair (image, query, target) goes
    to row ``image*G*T + (query // per_group)*T + target``; padding rows get fresh random values. Upstream draws
    a loss draw's points as ``[N, P, 2]``, ours as two planes (x, then y)."""
    layers = len(pairs)
    cost_draws, loss_draws = draws[:layers], []
    for k in range(layers):
        rows = [(i, int(q) // per_group * SLOTS + int(t))
                for i, (qs, ts) in enumerate(pairs[k]) for q, t in zip(qs, ts)]
        index = torch.tensor([i * groups * SLOTS + r for i, r in rows])
        for upstream in draws[layers + 2 * k: layers + 2 * k + 2]:
            ours = torch.rand(batch * groups * SLOTS, *upstream.shape[1:])
            ours[index] = upstream
            loss_draws += [ours[..., 0].contiguous(), ours[..., 1].contiguous()]
    return cost_draws + loss_draws


@pytest.mark.parametrize("counts", [[3, 1], [4, 0]])
def test_seg_losses_and_gradients_equal_upstream(counts: list[int]) -> None:
    """Loss terms (with the two mask losses of every layer) and gradients of the static criterion equal upstream's
    ``SetCriterion`` on the unpadded targets (its matcher with the mask cost, its ``loss_masks``) to 1e-5, given the
    same point draws; the matching of every layer is the same too."""
    torch.manual_seed(0)
    model_options = ModelOptions(variant="seg-nano", resolution=RESOLUTION, num_queries=8, group_detr=2, dec_layers=2,
                                 backbone_blocks=2, pretrain_weights=None)
    cfgs = upstream_configs(model_options, DataOptions(max_targets=SLOTS), OptimOptions(), num_classes=CLASSES)
    net = build_model(cfgs).train()
    reference, _ = build_upstream_criterion(cfgs)
    ours = build_criterion(build_upstream_criterion(cfgs)[0])
    assert ours.batched and ours.masks
    reference.train(), ours.train()
    generator = torch.Generator().manual_seed(1)
    targets = seg_targets(counts, generator)
    outputs = net(torch.randn(len(counts), 3, RESOLUTION, RESOLUTION, generator=generator))

    pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    match = reference.matcher.forward

    def recording_match(*args: Any, **kwargs: Any) -> Any:
        pairs.append(match(*args, **kwargs))
        return pairs[-1]

    reference.matcher.forward = recording_match
    draws = Draws()
    with draws.record():
        expected = reference(outputs, targets)
    layers = 1 + len(outputs["aux_outputs"]) + 1
    assert len(pairs) == layers and len(draws.recorded) == 3 * layers

    padded = [pad_target(t, SLOTS) for t in targets]
    batch = {key: torch.stack([p[key] for p in padded]) for key in padded[0]}
    groups, per_group = net.group_detr, outputs["pred_logits"].shape[1] // net.group_detr
    with draws.serve(ours_from_upstream(draws.recorded, pairs, len(counts), groups, per_group)):
        got = ours(outputs, batch)
    assert set(got) == set(expected) and any(k.startswith("loss_mask_dice") for k in got)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)

    params = [p for p in net.parameters() if p.requires_grad]
    want = torch.autograd.grad(total_loss(expected, reference.weight_dict), params, retain_graph=True,
                               allow_unused=True)
    have = torch.autograd.grad(total_loss(got, ours.weight_dict), params, allow_unused=True)
    used = [(w, h) for w, h in zip(want, have) if w is not None]
    assert len(used) > 100 and all(h is not None for w, h in zip(want, have) if w is not None)
    for w, h in used:
        torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5)


def test_packed_masks_sample_as_rfdetr_nearest_point_sample() -> None:
    """Bit-packed target masks read at points equal rfdetr's ``point_sample(mode="nearest")`` of the bool masks,
    at random points and at exact pixel-centre ties, eagerly and on the XLA device (the row products in bf16). XLA's
    CPU compiler folds rfdetr's ``(2c - 1) + 1`` to ``2c``, which differs only off the 2**-24 grid ``torch.rand``
    draws from: the device gets the random points and the ties on that grid."""
    import torch_xla
    from rfdetr.models.heads.segmentation import point_sample

    generator = torch.Generator().manual_seed(3)
    for size in (12, 13, 40):
        masks = torch.rand(2, 3, size, size, generator=generator) > 0.5
        packed = torch.stack([pack_masks(m, 3) for m in masks])
        assert torch.equal(unpack_masks(packed, size), masks)
        on_grid_ties = torch.randint(0, 17, (2, 3, 10, 2), generator=generator) / 16  # ties at sizes 12 and 40
        ties = torch.randint(0, 2 * size + 1, (2, 3, 20, 2), generator=generator) / (2 * size)
        coords = torch.cat([torch.rand(2, 3, 50, 2, generator=generator), on_grid_ties, ties], dim=2)
        want = point_sample(masks.flatten(0, 1)[:, None].float(), coords.flatten(0, 1)[:, :, None],
                            align_corners=False, mode="nearest").view(2, 3, -1)
        assert torch.equal(sample_targets(packed, *coords.unbind(-1)), want)
        device = torch_xla.device()
        on_device = sample_targets(packed.to(device), *coords[:, :, :60].to(device).unbind(-1))
        assert torch.equal(on_device.cpu(), want[..., :60])


def test_points_sampled_as_planes_equal_rfdetrs_point_sample() -> None:
    """``sample_at`` on the XLA device (two planes in pixel units, tent-weight products) against rfdetr's
    ``point_sample`` on the CPU (``F.grid_sample``, ``border`` padding): random points, pixel centres and the edges 0
    and 1; the samples and the maps' gradient."""
    import torch_xla
    from rfdetr.models.heads.segmentation import point_sample

    generator = torch.Generator().manual_seed(11)
    for height, width in ((6, 5), (13, 13)):
        maps = torch.randn(4, height, width, generator=generator)
        x, y = ((torch.cat([torch.rand(4, 30, generator=generator),
                            (torch.randint(0, size, (4, 6), generator=generator) + 0.5) / size,
                            torch.zeros(4, 1), torch.ones(4, 1)], dim=1)) for size in (width, height))
        cpu = maps.clone().requires_grad_()
        want = point_sample(cpu[:, None], torch.stack([x, y], -1), align_corners=False)[:, 0]
        (want * want).sum().backward()
        device = torch_xla.device()
        on_device = maps.to(device).requires_grad_()
        got = sample_at(on_device, x.to(device), y.to(device))
        assert "gather" not in torch_xla._XLAC._get_xla_tensors_hlo([got])  # the products, not rfdetr's lookups
        (got * got).sum().backward()
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(on_device.grad.cpu(), cpu.grad, rtol=0, atol=1e-5)


def seg_tiny(num_queries: int = 8) -> tuple[ModelOptions, OptimOptions, Any]:
    """The tiny seg model of these tests, its optimizer options and rfdetr configs."""
    model = ModelOptions(variant="seg-nano", resolution=RESOLUTION, num_queries=num_queries, group_detr=2,
                         dec_layers=2, backbone_blocks=2, pretrain_weights=None)
    optim = OptimOptions(schedule="constant")
    return model, optim, upstream_configs(model, DataOptions(max_targets=SLOTS), optim, num_classes=CLASSES)


def seg_batch(counts: list[int], generator: torch.Generator) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """A static seg batch (uint8 pixels, packed masks) and the unpadded targets upstream gets for it."""
    targets = seg_targets(counts, generator)
    padded = [pad_target(t, SLOTS) for t in targets]
    batch = {key: torch.stack([p[key] for p in padded]) for key in padded[0]}
    batch["images"] = torch.randint(0, 256, (len(counts), 3, RESOLUTION, RESOLUTION), dtype=torch.uint8,
                                    generator=generator)
    batch["image_id"] = torch.arange(len(counts))
    batch["orig_size"] = torch.full((len(counts), 2), RESOLUTION)
    return batch, targets


@pytest.mark.slow
def test_seg_step_on_the_mesh_equals_upstream_and_replays(mesh_trainer: Any) -> None:
    """The compiled seg step on the 4-device mesh in trace mode, served upstream's point draws, against upstream
    rfdetr's eager CPU steps (its model, SetCriterion with the mask cost and losses, clipping, AdamW): step 1 to 1e-5
    in every logged loss term and 1e-4 relative L2 in the clipped gradients, steps 2-3 within ``parity_tolerance``;
    in replay mode the step is one program: 5 steps = 5 executions, no transfer, no compile, no ``aten::`` fallback
    (the mask head's bilinear resize has no XLA gradient: ``xla_safe`` runs it as matrix products)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    from spmd_rfdetr.training.build import build_trainer
    from spmd_rfdetr.config.options import TrainerOptions
    from spmd_rfdetr.data.pixels import upstream_float
    from spmd_rfdetr.training.metrics import xla_counters

    from support.models import first_step_gradients, gradient_relative_error, parity_tolerance

    from spmd_rfdetr.training.optim import build_optimizer

    model, optim, cfgs = seg_tiny()
    torch.manual_seed(0)
    init = build_model(cfgs).state_dict()
    generator = torch.Generator().manual_seed(5)
    steps = [seg_batch([3, 1, 0, 4], generator) for _ in range(3)]

    reference_net = build_model(cfgs)
    reference_net.load_state_dict(init)
    reference_net.train()
    reference, _ = build_upstream_criterion(cfgs)
    reference.train()
    optimizer = build_optimizer(reference_net, cfgs)  # plain AdamW, as rfdetr trains
    fabric = mesh_trainer.fabric
    net = build_model(cfgs)
    net.load_state_dict(init)
    traced = build_trainer(fabric, cfgs, optim, TrainerOptions(precision="fp32", step_mode="trace"), model=net)
    to_device = mesh_trainer.to_device
    pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    match = reference.matcher.forward
    reference.matcher.forward = lambda *a, **k: pairs.append(match(*a, **k)) or pairs[-1]
    losses: list[tuple[float, float]] = []
    for step, (batch, targets) in enumerate(steps, start=1):
        pairs.clear()
        draws = Draws()
        optimizer.zero_grad(set_to_none=True)
        outputs = reference_net(upstream_float(batch["images"]))
        with draws.record():
            expected = reference(outputs, targets)
        total_loss(expected, reference.weight_dict).backward()
        torch.nn.utils.clip_grad_norm_(reference_net.parameters(), optim.clip_max_norm)
        served = [d.to(torch_xla.device()) for d in
                  ours_from_upstream(draws.recorded, pairs, 4, reference_net.group_detr, model.num_queries)]
        with draws.serve(served):
            stats = traced.step.read(traced.step(to_device(batch)))
        reference_loss = float(total_loss(expected, reference.weight_dict))
        losses.append((stats["loss"], reference_loss))
        assert abs(stats["loss"] - reference_loss) <= parity_tolerance(step) * reference_loss, (step, losses)
        if step == 1:
            for key in ("loss_ce", "loss_bbox", "loss_giou", "loss_mask_ce", "loss_mask_dice"):
                value = float(expected[key])
                assert abs(stats[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, stats)
            ours = first_step_gradients(traced.optimizer, traced.model.parameters())
            error = gradient_relative_error(ours, reference_net.parameters())
            assert error <= 1e-4, f"gradient relative L2 error {error:.3g}"
        optimizer.step()
    del traced

    net = build_model(cfgs)
    net.load_state_dict(init)
    replayed = build_trainer(fabric, cfgs, optim, TrainerOptions(precision="fp32"), model=net, ema=model)
    batches = [to_device(seg_batch([3, 1, 0, 4], generator)[0]) for _ in range(7)]
    start = xla_counters()
    for b in batches[:2]:
        replayed.step(b)
    torch_xla.sync()
    xm.wait_device_ops()
    before = xla_counters()
    outputs = [replayed.step(b) for b in batches[2:]]
    xm.wait_device_ops()
    after = xla_counters()
    assert replayed.step.mode == "replay" and before["xla_compiles"] - start["xla_compiles"] == 1
    assert {k: after[k] - before[k] for k in after} == {**{k: 0 for k in after}, "xla_executions": 5}
    stats = replayed.step.read(outputs[-1])
    assert stats["loss_mask_dice"] > 0 and stats["matcher_unconverged"] == 0
    print(f"seg step: compiles at steps 1-2 {before['xla_compiles'] - start['xla_compiles']}, step-1 grad rel L2 "
          f"{error:.3g}, losses (ours, upstream) {losses}")

"""``trainer.keypoint_groups`` (:mod:`spmd_rfdetr.model.keypoint_groups`): the keypoint stream on the first query groups
only. Groups never see each other in training, so against upstream's own model on the same weights (eager CPU): the
kept groups' outputs are upstream's; the others' boxes are upstream's with the keypoints' instance update off
(``instance_kp_layer_scale`` 0) and their logits upstream's without the keypoints' class boost; evaluation is
unchanged. The criterion's keypoint terms are then those of the kept groups alone."""

from __future__ import annotations

import copy

import pytest
import torch

from spmd_rfdetr.model.keypoint_groups import train_keypoints_on_groups

QUERIES, GROUPS = 6, 3


def _queries(outputs: dict, keep: slice) -> dict:
    """``outputs`` (final and aux layers) cut to the queries ``keep``; no encoder outputs."""
    cut = {k: outputs[k][:, keep] for k in ("pred_logits", "pred_boxes", "pred_keypoints")}
    cut["aux_outputs"] = [{k: layer[k][:, keep] for k in cut if k in layer} for layer in outputs["aux_outputs"]]
    return cut


@pytest.fixture(scope="module")
def built():
    from rfdetr.config import KeypointTrainConfig, RFDETRKeypointPreviewConfig
    from rfdetr.models.lwdetr import build_criterion_from_config, build_model_from_config

    model_cfg = RFDETRKeypointPreviewConfig(pretrain_weights=None, device="cpu", resolution=96, num_queries=QUERIES,
                                            group_detr=GROUPS, dec_layers=2, num_classes=2,
                                            num_keypoints_per_class=[0, 5])
    train_cfg = KeypointTrainConfig(dataset_dir=".", output_dir=".")
    torch.manual_seed(0)
    net = build_model_from_config(model_cfg, train_cfg).train()
    with torch.no_grad():  # a trained-looking model: the instance update and the heads not at their zero init
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = copy.deepcopy(net)
    train_keypoints_on_groups(ours, 1)
    images = torch.rand(2, 3, 96, 96, generator=torch.Generator().manual_seed(1))
    return net, ours, images, lambda: build_criterion_from_config(model_cfg, train_cfg)[0]


def test_kept_group_is_upstreams_and_the_others_train_as_detection_groups(built) -> None:
    net, ours, images, _ = built
    with torch.no_grad():
        theirs, mine = net(images), ours(images)
        plain = copy.deepcopy(net)
        for layer in plain.transformer.decoder.layers:
            layer.instance_kp_layer_scale.zero_()
        without = plain(images)
    kept, rest = slice(0, QUERIES), slice(QUERIES, None)
    assert mine["pred_keypoints"].shape == theirs["pred_keypoints"].shape
    for mine_l, theirs_l, without_l in zip([mine, *mine["aux_outputs"]], [theirs, *theirs["aux_outputs"]],
                                           [without, *without["aux_outputs"]]):
        for key in ("pred_logits", "pred_boxes", "pred_keypoints"):
            torch.testing.assert_close(mine_l[key][:, kept], theirs_l[key][:, kept], rtol=1e-5, atol=1e-5, msg=key)
        torch.testing.assert_close(mine_l["pred_boxes"][:, rest], without_l["pred_boxes"][:, rest], rtol=1e-5,
                                   atol=1e-5)
        boost = plain._aggregate_keypoint_class_logits(without_l["pred_keypoints"])
        torch.testing.assert_close(mine_l["pred_logits"][:, rest], (without_l["pred_logits"] - boost)[:, rest],
                                   rtol=1e-5, atol=1e-5)
        assert not mine_l["pred_keypoints"][:, rest, :, 2:].any()  # no keypoint output: no boost, no cost
    assert not torch.equal(theirs["pred_boxes"][:, rest], without["pred_boxes"][:, rest])  # the update mattered
    for key in ("pred_logits", "pred_boxes", "pred_keypoints"):  # the encoder's keypoints: every group's, as upstream
        torch.testing.assert_close(mine["enc_outputs"][key], theirs["enc_outputs"][key], rtol=1e-5, atol=1e-5)
    net.eval(), ours.eval()
    with torch.no_grad():
        evaluated, evaluated_ours = net(images), ours(images)
    net.train(), ours.train()
    for key in ("pred_logits", "pred_boxes", "pred_keypoints"):
        assert torch.equal(evaluated[key], evaluated_ours[key]), key


def test_criterion_prices_and_scores_keypoints_of_the_kept_groups_only(built) -> None:
    from spmd_rfdetr.model.keypoints import KEYPOINT_LOSSES
    from spmd_rfdetr.model.loss import build_criterion, total_loss

    net, ours, images, upstream = built
    outputs = ours(images)
    g = torch.Generator().manual_seed(3)
    keypoints = torch.rand(2, 4, 5, 3, generator=g)
    keypoints[..., 2] = torch.randint(0, 3, (2, 4, 5), generator=g).float()
    batch = {"labels": torch.ones(2, 4, dtype=torch.long), "boxes": torch.rand(2, 4, 4, generator=g) * 0.4 + 0.2,
             "keypoints": keypoints, "valid": torch.tensor([[True, True, True, False], [True, False, False, False]])}
    limited = build_criterion(upstream(), keypoint_groups=1).train()
    losses = limited(outputs, batch)
    every = build_criterion(upstream(), keypoint_groups=None).train()(outputs, batch)
    one_group = upstream()
    one_group.group_detr = 1
    alone = build_criterion(one_group).train()(_queries(outputs, slice(0, QUERIES)), batch)
    names = {name + suffix for name in KEYPOINT_LOSSES for suffix in ("", "_0")}
    assert names <= set(alone)
    for key in names:  # the decoder layers: the kept group's matches, normalised by its own targets
        torch.testing.assert_close(losses[key], alone[key], rtol=1e-5, atol=1e-6, msg=key)
        assert not torch.allclose(losses[key], every[key]), key  # the zero keypoints of the others are not scored
    boxes_only = upstream()  # the other groups: matched by box and class costs alone, as a plain detector's
    boxes_only.group_detr, boxes_only.losses = GROUPS - 1, [k for k in boxes_only.losses if k != "keypoints"]
    rest = build_criterion(boxes_only).train()(_queries(outputs, slice(QUERIES, None)), batch)
    for key in (name + suffix for name in ("loss_ce", "loss_bbox", "loss_giou") for suffix in ("", "_0")):
        expected = (alone[key] + (GROUPS - 1) * rest[key]) / GROUPS  # each normalised by its own groups' targets
        torch.testing.assert_close(losses[key], expected, rtol=1e-5, atol=1e-6, msg=key)
    for key in (f"{name}_enc" for name in KEYPOINT_LOSSES):  # the encoder keeps every group's keypoints
        torch.testing.assert_close(losses[key], every[key], rtol=1e-6, atol=0, msg=key)
    total_loss(losses, limited.weight_dict).backward()
    grads = [p.grad for p in ours.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    ours.zero_grad(set_to_none=True)

"""Property tests of the static batch padding: whatever the objects, the batch shapes never change and nothing under
the cap is lost (``data.StaticCollate``/``pad_target`` for training, the eval collate's padding rows)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spmd_rfdetr.data.batches import StaticCollate, pad_target
from spmd_rfdetr.eval.batches import EvalBatches, EvalCollate
from spmd_rfdetr.model.masks import unpack_masks

unit = st.floats(0.0, 1.0, allow_nan=False, width=32)


@st.composite
def targets(draw: st.DrawFn, max_objects: int, mask_size: int | None = None,
            keypoints: int = 0) -> dict[str, torch.Tensor]:
    """An rfdetr target after its transforms: normalised cxcywh boxes, any class ids, an original size; with
    ``mask_size`` also random bool instance masks (a seg variant's ``masks``), with ``keypoints`` that many random
    ``(x, y, visibility)`` per object (the keypoint model's ``keypoints``)."""
    n = draw(st.integers(0, max_objects))
    boxes = torch.tensor(draw(st.lists(st.tuples(unit, unit, unit, unit), min_size=n, max_size=n)),
                         dtype=torch.float32).reshape(n, 4)
    labels = torch.tensor(draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n)), dtype=torch.int64)
    size = draw(st.tuples(st.integers(1, 4000), st.integers(1, 4000)))
    target = {"boxes": boxes, "labels": labels, "image_id": torch.tensor([draw(st.integers(0, 2**31))]),
              "orig_size": torch.tensor(size)}
    if mask_size is not None:
        seed = draw(st.integers(0, 2**31))
        target["masks"] = torch.rand(n, mask_size, mask_size, generator=torch.Generator().manual_seed(seed)) > 0.5
    if keypoints:
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        target["keypoints"] = torch.rand(n, keypoints, 3, generator=generator)
        target["keypoints"][..., 2] = torch.randint(0, 3, (n, keypoints), generator=generator).float()
    return target


def check_row(target: dict[str, torch.Tensor], row: dict[str, torch.Tensor], cap: int) -> None:
    """One padded row against its target: exact valid mask, every object kept under the cap, the largest over it, each
    with its own label (and mask)."""
    boxes, labels, valid = row["boxes"], row["labels"], row["valid"]
    n, kept = len(target["labels"]), min(len(target["labels"]), cap)
    assert boxes.shape == (cap, 4) and labels.shape == (cap,) and valid.shape == (cap,)
    assert boxes.dtype == torch.float32 and labels.dtype == torch.int64 and valid.dtype == torch.bool
    assert torch.equal(valid, torch.arange(cap) < kept)
    assert not boxes[~valid].any() and not labels[~valid].any()  # padding is zeros
    assert ((boxes >= 0) & (boxes <= 1)).all()
    assert ("masks" in row) == ("masks" in target) and ("keypoints" in row) == ("keypoints" in target)
    masks = target.get("masks", torch.zeros(n, 1, 1, dtype=torch.bool))
    points = target.get("keypoints", torch.zeros(n, 1, 3))
    row_points = row.get("keypoints", torch.zeros(cap, 1, 3))
    assert row_points.shape == (cap, *points.shape[1:]) and row_points.dtype == torch.float32
    assert not row_points[~valid].any()
    row_masks = torch.zeros(cap, 1, 1, dtype=torch.bool)
    if "masks" in row:
        size = masks.shape[-1]
        assert row["masks"].shape == (cap, size, (size + 7) // 8) and row["masks"].dtype == torch.uint8
        row_masks = unpack_masks(row["masks"], size)
        assert not row_masks[~valid].any()
    if n <= cap:
        assert torch.equal(boxes[:n], target["boxes"]) and torch.equal(labels[:n], target["labels"])
        assert torch.equal(row_masks[:n], masks) or "masks" not in row
        assert torch.equal(row_points[:n], points) or "keypoints" not in row
    else:  # the cap's worth of largest boxes, each with its own label, mask and keypoints
        areas = target["boxes"][:, 2] * target["boxes"][:, 3]
        assert torch.equal(torch.sort(boxes[:, 2] * boxes[:, 3]).values, torch.sort(areas.topk(cap).values).values)
        if "keypoints" not in row:
            row_points = torch.zeros(cap, 1, 3)
        objects = {(tuple(b.tolist()), int(c), m.numpy().tobytes(), p.numpy().tobytes())
                   for b, c, m, p in zip(target["boxes"], target["labels"], masks, points)}
        assert all((tuple(b.tolist()), int(c), m.numpy().tobytes(), p.numpy().tobytes()) in objects
                   for b, c, m, p in zip(boxes, labels, row_masks, row_points))


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(1, 12), mask_size=st.sampled_from([None, 5, 16]), keypoints=st.sampled_from([0, 1, 17]),
       data=st.data())
def test_pad_target_is_static_and_exact(cap: int, mask_size: int | None, keypoints: int, data: st.DataObject) -> None:
    target = data.draw(targets(max_objects=2 * cap + 2, mask_size=mask_size, keypoints=keypoints))
    check_row(target, pad_target(target, cap), cap)


@settings(max_examples=60, deadline=None)
@given(cap=st.integers(1, 8), batch=st.integers(1, 4), resolution=st.sampled_from([8, 16]), masks=st.booleans(),
       data=st.data())
def test_static_collate_shapes_never_change(cap: int, batch: int, resolution: int, masks: bool,
                                            data: st.DataObject) -> None:
    mask_size = resolution if masks else None
    samples = [(torch.randint(0, 256, (3, resolution, resolution), dtype=torch.uint8),
                data.draw(targets(max_objects=2 * cap, mask_size=mask_size))) for _ in range(batch)]
    out = StaticCollate(cap, resolution)(samples)
    expected = {"images": (batch, 3, resolution, resolution), "boxes": (batch, cap, 4), "labels": (batch, cap),
                "valid": (batch, cap), "image_id": (batch,), "orig_size": (batch, 2)}
    if masks:
        expected["masks"] = (batch, cap, resolution, resolution // 8)
    assert {k: tuple(v.shape) for k, v in out.items()} == expected
    for i, (image, target) in enumerate(samples):
        check_row(target, {key: value[i] for key, value in out.items()}, cap)
        assert torch.equal(out["images"][i], image) and int(out["image_id"][i]) == int(target["image_id"])
        assert torch.equal(out["orig_size"][i], target["orig_size"])


def test_static_collate_refuses_another_resolution() -> None:
    target = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64), "image_id": torch.tensor([3]),
              "orig_size": torch.tensor([5, 5])}
    with pytest.raises(ValueError, match=r"image_id 3: transformed to \(3, 8, 16\), expected \(3, 8, 8\)"):
        StaticCollate(4, 8)([(torch.zeros(3, 8, 16, dtype=torch.uint8), target)])


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 6), data=st.data())
def test_eval_collate_pads_to_the_global_batch(batch: int, data: st.DataObject) -> None:
    real = data.draw(st.integers(1, batch))
    samples = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), data.draw(targets(max_objects=3)))
               for _ in range(real)]
    out = EvalCollate(batch, 8)(samples)
    assert out["images"].shape == (batch, 3, 8, 8) and out["orig_size"].shape == (batch, 2)
    assert set(out) == {"images", "orig_size", "image_id"}  # padding is told by its id alone
    assert out["image_id"][:real].tolist() == [int(t["image_id"]) for _, t in samples]
    assert (out["image_id"][real:] == -1).all() and not out["images"][real:].any()
    assert torch.equal(out["images"][:real], torch.stack([image for image, _ in samples]))  # the pixels themselves
    assert torch.equal(out["orig_size"][:real], torch.stack([t["orig_size"] for _, t in samples]))


@settings(max_examples=80, deadline=None)
@given(size=st.integers(1, 40), hosts=st.sampled_from([1, 2, 4]), per_host=st.integers(1, 4))
def test_each_hosts_eval_rows_assemble_the_one_host_batches(size: int, hosts: int, per_host: int) -> None:
    """Several hosts: host ``i`` loads slice ``i`` of every global eval batch; the slices in host order, each padded
    to its rows, are the one-host batches (the global array torch_xla assembles), every image exactly once."""
    batch = hosts * per_host
    one_host = list(EvalBatches(size, batch))
    shares = [list(EvalBatches(size, batch, (i, hosts))) for i in range(hosts)]
    assert all(len(s) == len(one_host) == -(-size // batch) for s in shares)
    for k, global_rows in enumerate(one_host):
        padded = [rows + [-1] * (per_host - len(rows)) for rows in (s[k] for s in shares)]
        assert sum(padded, []) == global_rows + [-1] * (batch - len(global_rows)), k
    assert sorted(i for s in shares for rows in s for i in rows) == list(range(size))

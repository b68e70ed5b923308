"""The input pipeline sized to the chip: uint8 pixels on the host, rfdetr's normalisation on the device, the
multi-scale resize, ``data.num_workers: auto`` and the loader's NaN fault injection. No RF-DETR compile."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F
import yaml

from spmd_rfdetr.config.options import ConfigError, DataOptions, RunConfig
from spmd_rfdetr.data.batches import StaticCollate, blank_batch, worker_count
from spmd_rfdetr.data.pixels import BoxesOnlyNormalize, normalize_images, uint8_pixels, upstream_float
from spmd_rfdetr.data.splits import build_split, upstream_split
from spmd_rfdetr.config.resolve import resolve_and_check

#: Float rounding between two float32 evaluations of ``(x / 255 - mean) / std`` (|values| <= 2.7): a few ulps.
ROUNDING = 1e-6


def pixels(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random uint8 pixels with every value 0..255 present."""
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    x.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    return x


def test_batches_are_uint8_a_quarter_of_upstreams_float_bytes(tiny) -> None:
    """The tiny batches (valid split, ``StaticCollate``) carry uint8 pixels: a quarter of the bytes of the float32
    input rfdetr's own pipeline makes of the same pixels."""
    images = tiny.batches[0]["images"]
    assert images.dtype == torch.uint8 and images.shape == (8, 3, 128, 128)
    assert 4 * images.nbytes == upstream_float(images).nbytes == 8 * 3 * 128 * 128 * 4


@pytest.mark.parametrize("split", ["valid", "train"])
def test_uint8_samples_are_upstreams_pixels_with_its_boxes(tiny, split: str) -> None:
    """``build_split`` is rfdetr's dataset with only its last two steps moved: the same (seeded) sample through
    upstream's own host ``ToDtype`` + ``Normalize`` is upstream's own dataset's image bit for bit, with equal boxes."""
    ours, theirs = build_split(tiny.cfgs, split), upstream_split(tiny.cfgs, split)
    assert isinstance(ours._transforms.transforms[-1], BoxesOnlyNormalize)
    for index in range(3):
        samples = []
        for dataset in (ours, theirs):
            torch.manual_seed(index)  # the train split's random augmentations draw the same
            random.seed(index)
            samples.append(dataset[index])
        (image, target), (reference, reference_target) = samples
        assert image.dtype == torch.uint8 and reference.dtype == torch.float32
        assert torch.equal(upstream_float(image[None])[0], reference)
        assert torch.equal(target["boxes"], reference_target["boxes"]) and len(target["boxes"])


def test_device_normalisation_equals_rfdetrs_host_normalize() -> None:
    """:func:`normalize_images` on the XLA device against rfdetr's own ``ToDtype(float32, scale=True)`` +
    ``Normalize`` on the CPU, on the same pixels (every value 0..255): equal to float rounding. The same for a
    resized multi-scale batch (float32 pixels) against upstream's resize of its normalised batch."""
    import torch_xla

    x = pixels(2, 3, 32, 32)
    ref = upstream_float(x)
    ours = normalize_images(x.to(torch_xla.device())).cpu()
    assert ours.dtype == torch.float32 and (ours - ref).abs().max() <= ROUNDING
    assert (normalize_images(x) - ref).abs().max() <= ROUNDING  # eager CPU too
    resized = normalize_images(F.interpolate(x.float(), size=24, mode="bilinear").to(torch_xla.device())).cpu()
    assert (resized - F.interpolate(ref, size=24, mode="bilinear")).abs().max() <= 2 * ROUNDING
    with pytest.raises(TypeError, match="uint8 pixels"):
        normalize_images(ref.double())
    with pytest.raises(TypeError, match="uint8 pixels only"):
        upstream_float(ref)


def test_an_unknown_pipeline_is_refused_not_read_as_float(tiny) -> None:
    """A pipeline that does not end with rfdetr's ToDtype + Normalize (another mean/std, a missing step) is an
    error, not a float batch in disguise."""
    from rfdetr.datasets.transforms import Normalize
    from torchvision.transforms.v2 import ToDtype

    steps = upstream_split(tiny.cfgs, "valid")._transforms
    cls = type(steps)
    assert [type(t) for t in uint8_pixels(steps).transforms[-2:]] == [type(steps.transforms[-3]), BoxesOnlyNormalize]
    for bad in (steps.transforms[:-1], [*steps.transforms[:-1], Normalize(mean=(0.5,) * 3)],
                [*steps.transforms[:-2], ToDtype(torch.float32, scale=False), Normalize()]):
        with pytest.raises(ValueError, match="cannot hand their pixels over as uint8"):
            uint8_pixels(cls(bad))


def test_multi_scale_buckets_resize_in_float_and_blank_batches_match() -> None:
    """A multi-scale batch resized to a smaller bucket carries float32 pixels, upstream's bilinear resize of the
    uint8 pixels (so device normalisation agrees with upstream's resize of its normalised batch); the bucket read at
    full size stays uint8; :func:`blank_batch` with the read size gives each its keys, shapes and dtypes."""
    collate = StaticCollate(4, 32)
    target = {"boxes": torch.rand(2, 4), "labels": torch.ones(2, dtype=torch.int64),
              "image_id": torch.tensor(3), "orig_size": torch.tensor([40, 50])}
    images = pixels(2, 3, 32, 32)
    small = collate([(image, target, 24) for image in images])
    full = collate([(image, target, 32) for image in images])
    assert small["images"].dtype == torch.float32 and full["images"].dtype == torch.uint8
    assert torch.equal(small["images"], F.interpolate(images.float(), size=24, mode="bilinear", align_corners=False))
    assert torch.equal(full["images"], images)
    for size, real in ((24, small), (32, full)):
        blank = blank_batch(2, size, 4, read_at=32)
        assert {k: (v.shape, v.dtype) for k, v in blank.items()} == {k: (v.shape, v.dtype) for k, v in real.items()}
    assert blank_batch(2, 24, 4)["images"].dtype == torch.uint8  # not multi-scale: read at the size itself


def test_num_workers_auto_resolves_from_the_affinity(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``auto``: the CPUs this process may run on, less one for the main process; resolved with the config (every
    verb's loaders see a number); ``--data.num_workers auto`` parses; a negative count is a config error."""
    from spmd_rfdetr.cli import main

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(7)), raising=False)
    assert worker_count("auto") == 6 and worker_count(3) == 3
    cfg = RunConfig(data=DataOptions(num_workers="auto"))
    resolve_and_check(cfg)
    assert cfg.data.num_workers == 6
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert worker_count("auto") == 0
    with pytest.raises(ConfigError, match=r"data.num_workers=-1 must be >= 0 or auto"):
        resolve_and_check(RunConfig(data=DataOptions(num_workers=-1)))
    with pytest.raises(SystemExit):
        main(["fit", "--config", "configs/v5e.yaml", "--data.num_workers", "auto", "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["data"]["num_workers"] == "auto"


def test_nan_fault_injection_makes_the_boxes_nan(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """``NAN_BATCH_ENV``: the N-th loaded batch gets NaN boxes (its uint8 images hold no NaN; a float image batch
    would be another program), the same shapes and dtypes; other batches, and eval batches (no boxes), pass as they
    are."""
    import torch_xla

    from spmd_rfdetr.xla.loader import NAN_BATCH_ENV, SPMDDataLoader
    from spmd_rfdetr.xla.mesh import build_mesh

    monkeypatch.setenv(NAN_BATCH_ENV, "2")
    loader = SPMDDataLoader([], build_mesh(), torch_xla.device())
    batch = tiny.batches[0]
    first, second = loader.to_device(batch), loader.to_device(batch)
    assert torch.equal(first["boxes"].cpu(), batch["boxes"]) and second["boxes"].cpu().isnan().all()
    assert torch.equal(second["images"].cpu(), batch["images"]) and second["images"].dtype == torch.uint8
    monkeypatch.setenv(NAN_BATCH_ENV, "1")
    evaluation = SPMDDataLoader([], build_mesh(), torch_xla.device()).to_device({"images": batch["images"]})
    assert torch.equal(evaluation["images"].cpu(), batch["images"])


def test_normalised_float_samples_are_refused_by_both_collates(tiny) -> None:
    """rfdetr's own splits give normalised float32 images; every program normalises pixels itself, so such samples
    would be normalised twice (train) or cast to uint8 garbage (eval): both collates refuse them, naming the image."""
    from spmd_rfdetr.data.splits import upstream_split
    from spmd_rfdetr.eval.batches import EvalCollate

    resolution = tiny.cfgs.model.resolution
    float_sample = upstream_split(tiny.cfgs, "valid")[0]  # rfdetr's build_dataset: normalised float32
    uint8_sample = build_split(tiny.cfgs, "valid")[0]
    assert float_sample[0].dtype == torch.float32 and float_sample[0].min() < 0
    for collate in (StaticCollate(tiny.cfg.data.max_targets, resolution), EvalCollate(2, resolution)):
        with pytest.raises(TypeError, match=r"image_id \d+: torch.float32 pixels, expected uint8"):
            collate([float_sample, uint8_sample])
        assert collate([uint8_sample, uint8_sample])["images"].dtype == torch.uint8

"""Every message of :func:`spmd_rfdetr.config.resolve.resolve_and_check`, one bad field at a time (no XLA, no data read).

tests/test_checks.py covers the resolution rule per variant, ``max_targets`` vs queries, ``multi_scale``, ``mesh.data``
of 0 or more than the devices, and the bf16-on-CPU warning; tests/test_cli.py the batch vs data axis message through
the CLI. The rest is here.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from spmd_rfdetr.config import resolve as openxla_fix  # the openxla fix's version check, fix_available, lives here
from spmd_rfdetr.config import length, resolve
from spmd_rfdetr.config.options import ConfigError, DataOptions, RunConfig
from spmd_rfdetr.config.resolve import resolve_and_check


def edited(**sections: dict[str, object]) -> Callable[[], RunConfig]:
    def make() -> RunConfig:
        cfg = RunConfig(data=DataOptions(global_batch_size=8))
        cfg.trainer.precision = "fp32"
        for section, values in sections.items():
            for key, value in values.items():
                setattr(getattr(cfg, section), key, value)
        return cfg

    return make


CASES = {
    "batch": (edited(data={"global_batch_size": 0}), None, "data.global_batch_size=0 must be >= 1"),
    "per_device": (edited(data={"per_device_batch_size": 0}), 4, "data.per_device_batch_size=0 must be >= 1"),
    "max_targets": (edited(data={"max_targets": 0}), None, "data.max_targets=0 must be >= 1"),
    "max_steps": (edited(trainer={"max_steps": 0}), None, "trainer.max_steps=0 must be >= 1"),
    "log_every": (edited(trainer={"log_every": 0}), None, "trainer.log_every=0 must be >= 1"),
    "warmup": (edited(optim={"warmup_steps": -1}), None, "optim.warmup_steps=-1 must be >= 0"),
    "queries": (edited(model={"num_queries": 0}), None, "model.num_queries=0 must be >= 1"),
    "group_detr": (edited(model={"group_detr": 0}), None, "model.group_detr=0 must be >= 1"),
    "dec_layers": (edited(model={"dec_layers": -2}), None, "model.dec_layers=-2 must be >= 1"),
    "num_classes": (edited(model={"num_classes": 0}), None, "model.num_classes=0 must be >= 1"),
    "backbone_blocks": (edited(model={"backbone_blocks": 0}), None, "model.backbone_blocks=0 must be >= 1"),
    "blocks_weights": (edited(model={"backbone_blocks": 2, "pretrain_weights": "rf-detr-nano.pth"}), None,
                       "model.backbone_blocks=2 builds a backbone no published weights fit"),
    "blocks_default_weights": (edited(model={"backbone_blocks": 2}), None,
                               "model.backbone_blocks=2 builds a backbone no published weights fit, but "
                               "model.pretrain_weights=auto (the default: rf-detr-nano.pth) starts from weights: set "
                               "model.pretrain_weights: null (--model.pretrain_weights null) to train it from scratch"),
    "cpu_devices": (edited(mesh={"cpu_devices": 0}), None, "mesh.cpu_devices=0 must be >= 1"),
    "bf16_streams_fp32": (edited(trainer={"bf16_streams": True}), None,
                          "trainer.bf16_streams=true rounds activations to bf16 under bf16 autocast; with "
                          "trainer.precision=fp32 it would do nothing"),
    "fused_attention_openxla": (edited(trainer={"fused_attention": True, "compile_backend": "openxla"}), None,
                                "trainer.fused_attention=true runs in the lazily traced step only: set "
                                "trainer.compile_backend=torch_xla"),
    "keypoint_groups_variant": (edited(trainer={"keypoint_groups": 1}), None,
                                "trainer.keypoint_groups=1 limits the keypoint model's keypoint stream; "
                                "model.variant=nano has none: drop it"),
    "keypoint_groups_range": (edited(model={"variant": "keypoint-preview", "pretrain_weights": None},
                                     trainer={"keypoint_groups": 14}), None,
                              "trainer.keypoint_groups=14 must be between 1 and the 13 query groups "
                              "(model.group_detr)"),
    "mesh_divides": (edited(mesh={"data": 3}), 4, "mesh.data=3 must divide the 4 devices (or be -1 for all)"),
    "batch_axis": (edited(data={"global_batch_size": 6}), 4,
                   "data.global_batch_size=6 does not divide by the data axis (4 devices): use a multiple of 4, "
                   "e.g. 8"),
    "accumulate": (edited(optim={"accumulate": 0}), None, "optim.accumulate=0 must be >= 1 (1: no accumulation)"),
    "accumulate_split": (edited(optim={"accumulate": 3}), 4,
                         "data.global_batch_size=8 does not split into optim.accumulate=3 micro-batches over the data "
                         "axis (4 devices): use a multiple of 12"),
    "openxla_matcher": (edited(trainer={"compile_backend": "openxla", "matcher": "scipy"}), None,
                        "trainer.compile_backend=openxla needs trainer.matcher=device"),
    "eval_every": (edited(eval={"every_steps": -1}), None,
                   "eval.every_steps=-1 must be >= 0 (0 = no evaluation inside fit)"),
    "eval_steps_and_epochs": (edited(eval={"every_steps": 50, "every_epochs": 1.0}), None,
                              "eval.every_steps=50 and eval.every_epochs=1.0 are both set: evaluate in steps "
                              "(--eval.every_epochs null) or in epochs (eval.every_steps: 0)"),
    "trace_alpha": (edited(eval={"trace_alpha": -0.5}), None,
                    "eval.trace_alpha=-0.5 must be >= 0 (rfdetr's postprocess_trace_alpha; 0: no fusion)"),
    "oks_sigmas": (edited(eval={"keypoint_oks_sigmas": [0.05, 0.0]}), None,
                   "eval.keypoint_oks_sigmas=[0.05, 0.0]: one positive sigma per keypoint"),
    "eval_epochs": (edited(eval={"every_epochs": 0.0}), None,
                    "eval.every_epochs=0.0 must be > 0 (or unset: eval.every_steps counts)"),
    "early_stopping_without_eval": (edited(eval={"early_stopping": True}), None,
                                    "eval.early_stopping needs evaluations: set eval.every_steps > 0 or "
                                    "eval.every_epochs"),
    "checkpoint_every": (edited(checkpointing={"every_steps": -5}), None,
                         "checkpointing.every_steps=-5 must be >= 0 (0: a checkpoint only on SIGTERM)"),
    "checkpoint_keep": (edited(checkpointing={"keep": -1}), None,
                        "checkpointing.keep=-1 must be >= 0 (0: keep every checkpoint)"),
    "num_select": (edited(eval={"num_select": 0}), None, "eval.num_select=0 must be >= 1"),
    "num_select_logits": (edited(model={"num_classes": 1}, eval={"num_select": 601}), None,
                          "eval.num_select=601 is more than the 600 logits the model outputs per image (its 300 "
                          "queries x (num_classes 1 + 1)): use at most 600"),
    "seg_scipy": (edited(model={"variant": "seg-nano"}, trainer={"matcher": "scipy"}), None,
                  "trainer.matcher=scipy with model.variant=seg-nano: rfdetr's own mask loss refuses padded targets"),
    "seg_openxla": (edited(model={"variant": "seg-small"}, trainer={"compile_backend": "openxla"}), None,
                    "trainer.compile_backend=openxla with model.variant=seg-small is not supported yet"),
    "seg_resolution": (edited(model={"variant": "seg-small", "resolution": 300}), None,
                       "model.resolution=300 must be a multiple of 24 for model.variant=seg-small"),
    "eval_batch": (edited(eval={"global_batch_size": 0}), None, "eval.global_batch_size=0 must be >= 1"),
    "eval_batch_axis": (edited(eval={"global_batch_size": 10}), 4,
                        "eval.global_batch_size=10 does not divide by the data axis (4 devices)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_config_error_is_named(case: str) -> None:
    make, device_count, message = CASES[case]
    with pytest.raises(ConfigError) as error:
        resolve_and_check(make(), device_count)
    text = str(error.value)
    assert text.startswith("invalid configuration:\n  - ") and message in text, text
    assert text.count("\n  - ") == 1, text  # one bad field, one problem: no knock-on messages


def test_valid_configs_pass() -> None:
    for device_count in (None, 1, 4, 8):
        resolve_and_check(edited()(), device_count)
    resolve_and_check(edited(mesh={"data": 2}, eval={"global_batch_size": 6})(), 4)  # 8 and 6 divide by 2
    resolve_and_check(edited(eval={"every_epochs": 0.5, "early_stopping": True})(), 4)
    resolve_and_check(edited(model={"variant": "seg-nano", "resolution": 96})(), 4)


def test_eval_every_epochs_counts_in_the_steps_trainer_epochs_uses() -> None:
    """``eval.every_epochs`` becomes steps with ``trainer.epochs``' steps per epoch (37 usable train images in batches
    of 8: 4 steps, the partial batch dropped), at least 1; ``eval.every_steps`` is taken as it is. Either one makes
    ``fit``'s data check read the eval split."""
    from spmd_rfdetr.data.check import fit_splits

    assert length.steps_per_epoch(edited()(), 37) == 4
    for epochs, steps in ((1.0, 4), (2.5, 10), (0.5, 2), (0.1, 1)):
        assert length.eval_every_steps(edited(eval={"every_epochs": epochs})(), 37) == steps, epochs
    assert length.eval_every_steps(edited(eval={"every_steps": 7})(), 37) == 7
    assert length.eval_every_steps(edited()(), 37) == 0  # no evaluation
    assert fit_splits(edited(eval={"every_epochs": 1.0})()) == ["train", "valid"]
    assert fit_splits(edited(eval={"every_steps": 3})()) == ["train", "valid"]
    assert fit_splits(edited()()) == ["train"]


def test_epochs_become_steps_and_a_schedule_that_cannot_work_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """rfdetr's units as steps (a recipe's ``trainer.epochs``, ``optim.warmup_epochs``); a ``max_steps`` that epochs
    replace, a warm-up covering most (or all) of the run and a step schedule that never drops are warned about; a dataset smaller than one global batch
    gives epochs no step: one ConfigError naming the fixes."""
    cfg = edited(trainer={"epochs": 10.0}, optim={"warmup_epochs": 1.0})()
    length.size_in_steps(cfg, 37)  # 4 steps an epoch
    assert (cfg.trainer.max_steps, cfg.optim.warmup_steps) == (40, 4) and not caplog.records
    cfg = edited(trainer={"epochs": 2.0, "max_steps": 500}, optim={"warmup_epochs": 1.5})()
    length.size_in_steps(cfg, 37)
    assert "optim.warmup_epochs=1.5 (6 steps) covers 75% of the run's 8 steps" in caplog.text
    assert "trainer.max_steps=500 is not used: trainer.epochs=2 decides the run's length" in caplog.text
    caplog.clear()
    cfg = edited(trainer={"epochs": 1.0}, optim={"warmup_steps": 20, "schedule": "step", "lr_drop_step": 0})()
    length.size_in_steps(cfg, 37)
    assert "optim.warmup_steps=20 covers the whole run of 4 steps: the LR never reaches optim.lr=0.0001" in caplog.text
    assert "optim.schedule=step with optim.lr_drop_step=0: the LR never drops" in caplog.text
    with pytest.raises(ConfigError, match=r"trainer.epochs, eval.every_epochs count\(s\) in epochs, but the 7 usable "
                                          r"train images of data/synth are fewer than one global batch of 8"):
        length.size_in_steps(edited(trainer={"epochs": 3.0}, eval={"every_epochs": 1.0})(), 7)
    length.size_in_steps(edited(trainer={"max_steps": 5})(), 7)  # counted in steps: no epoch needed


def test_the_lr_follows_the_global_batch_by_the_recipes_rule(caplog: pytest.LogCaptureFixture) -> None:
    """``optim.lr_scaling``: linear and square-root scaling from ``lr_reference_batch`` (rfdetr's 16), both LRs, said
    in the log; ``none`` keeps them; a reference batch below 1 is a config error."""
    import logging

    caplog.set_level(logging.INFO)
    for rule, batch, factor in (("linear", 128, 8.0), ("sqrt", 64, 2.0), ("linear", 16, 1.0), ("none", 128, 1.0)):
        cfg = edited(optim={"lr": 1e-4, "lr_encoder": 1.5e-4, "lr_scaling": rule}, data={"global_batch_size": batch})()
        resolve.scale_lr(cfg)
        assert (cfg.optim.lr, cfg.optim.lr_encoder) == pytest.approx((1e-4 * factor, 1.5e-4 * factor)), (rule, batch)
    assert "optim.lr_scaling=linear: a global batch of 128 is 8 x optim.lr_reference_batch=16: lr 0.0001 -> 0.0008" \
        in caplog.text
    with pytest.raises(ConfigError, match="optim.lr_reference_batch=0 must be >= 1"):
        resolve_and_check(edited(optim={"lr_reference_batch": 0})())


def test_openxla_is_refused_where_the_fix_is_not_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = edited(trainer={"compile_backend": "openxla"})
    resolve_and_check(cfg())  # torch_xla 2.9.0: verified
    monkeypatch.setattr(openxla_fix, "fix_available", lambda: False)
    with pytest.raises(ConfigError) as error:
        resolve_and_check(cfg())
    assert resolve.OPENXLA_TRAINING_REFUSED.format(verified="2.9.0") in str(error.value)


@pytest.mark.parametrize(("mesh_data", "devices", "expected"), [(-1, 4, 8), (-1, 8, 16), (2, 4, 4), (1, 1, 2)])
def test_per_device_batch_size_sets_the_global_batch(mesh_data: int, devices: int, expected: int) -> None:
    """``data.per_device_batch_size`` x the data axis replaces ``global_batch_size`` (so it always divides); without a
    device count (``check-data``, ``--print_config``) nothing is resolved. End to end: the 8-device ``fit`` of
    tests/test_cli.py runs with ``per_device_batch_size 1``."""
    cfg = edited(data={"global_batch_size": 6, "per_device_batch_size": 2}, mesh={"data": mesh_data})()
    resolve_and_check(cfg, devices)
    assert cfg.data.global_batch_size == expected
    cfg = edited(data={"global_batch_size": 6, "per_device_batch_size": 2})()
    resolve_and_check(cfg)
    assert cfg.data.global_batch_size == 6

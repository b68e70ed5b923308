"""``spmd_rfdetr.train(...)``: rfdetr's one-call shape, on the CLI's path (its parser, its checks, ``fit``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from support.models import LOOP_MODEL
from support.runs import ROOT, assert_quiet
from jobs import JobInputs, job_fixture

#: The loop model, one epoch of the session's 32 train images at rfdetr's per-device batch of 2 on 4 devices (4 steps),
#: evaluated every step with early stopping that no mAP gain can satisfy (min_delta 1): it stops at the second eval.
TRAIN = r"""
import json, sys
import spmd_rfdetr
args = dict(dataset_dir=sys.argv[1], output_dir=sys.argv[2], epochs=1, batch_size=2, lr=4e-4, warmup_epochs=0.5,
            options=json.loads(sys.argv[3]))
result = spmd_rfdetr.train("nano", **args)
print("RESULT", json.dumps({"weights": str(result.weights), "metrics": result.metrics}))
again = spmd_rfdetr.train("nano", resume="auto", **args)  # a relaunch of the early-stopped run: nothing to train
print("AGAIN", json.dumps({"weights": str(again.weights), "metrics": again.metrics}))
"""


@job_fixture
def api_train(inputs: JobInputs, out: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    options = {"model.resolution": LOOP_MODEL.resolution, "model.dec_layers": LOOP_MODEL.dec_layers,
               "model.backbone_blocks": LOOP_MODEL.backbone_blocks, "model.num_queries": LOOP_MODEL.num_queries,
               "model.group_detr": LOOP_MODEL.group_detr, "model.pretrain_weights": LOOP_MODEL.pretrain_weights,
               "data.max_targets": 8, "data.num_workers": 0,
               "trainer.precision": "fp32", "eval.every_steps": 1, "eval.early_stopping": True,
               "eval.early_stopping_patience": 1, "eval.early_stopping_min_delta": 1.0}
    env = {**inputs.env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    result = subprocess.run([sys.executable, "-c", TRAIN, inputs.synth_dir, str(out), json.dumps(options)], cwd=ROOT,
                            env=env, text=True, capture_output=True, timeout=900)
    return result, out


@pytest.mark.slow
def test_train_runs_epochs_stops_early_and_returns_the_weight_file(api_train, synth_dir):
    """A user's script: ``import spmd_rfdetr; spmd_rfdetr.train(...)`` with rfdetr's argument names sizes the run by
    its epochs (1 x 32 images // (2 per device x 4 devices) = 4 steps), stops early at the second evaluation (patience
    1, an improvement of 1.0 mAP required) and returns that step's ``last.pth`` and the last record."""
    proc, out = api_train
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1].splitlines()[0])
    assert Path(result["weights"]) == out / "last.pth" and (out / "last.pth").is_file()
    assert result["metrics"]["step"] == 2 and result["metrics"]["early_stopped"] is True, result
    assert "eval/mAP" in result["metrics"] and result["metrics"]["loss"] > 0
    assert torch.load(out / "last.pth", weights_only=False)["step"] == 2
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["trainer"]["epochs"] == 1 and resolved["trainer"]["max_steps"] == 4
    assert resolved["data"]["global_batch_size"] == 8 and resolved["optim"]["lr"] == 4e-4
    assert "trainer.epochs=1: 4 steps of 8 images over 32 train images" in proc.stderr
    assert "early stopping at step 2: eval/mAP has not improved by 1 for 1 evaluations" in proc.stderr
    assert resolved["optim"]["warmup_steps"] == 2 and "optim.warmup_epochs=0.5: 2 warmup steps" in proc.stderr
    # said before the first compile and the first evaluation, which would look like a stall otherwise
    assert ("compiling the training step (RF-DETR nano, 64 px, 8 images a step over 4 CPU device(s), fp32) before "
            "step 1: 1-4 min" in proc.stderr), proc.stderr[-3000:]
    assert "evaluating at step 1 (the first evaluation compiles the eval program" in proc.stdout
    assert "evaluation: 40 valid images every 1 steps and at the end (4 evaluations" in proc.stderr


@pytest.mark.slow
def test_a_relaunch_of_an_early_stopped_run_trains_no_more(api_train):
    """Early stopping saves a checkpoint that says so: ``--trainer.resume auto`` (here ``train(resume="auto")``)
    ends at once with the same step, instead of training the stopped steps again."""
    proc, out = api_train
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["step"] == 2 and meta["early_stopped"] is True
    again = json.loads(proc.stdout.split("AGAIN", 1)[1].splitlines()[0])
    assert again["metrics"]["step"] == 2 and again["metrics"]["early_stopped"] is True, again  # no record added
    assert "this run stopped early at step 2 (early stopping); nothing left to train" in proc.stderr
    assert torch.load(out / "last.pth", weights_only=False)["step"] == 2


@pytest.mark.slow
def test_train_is_quiet_by_default(api_train):
    """``train()`` without ``verbose=True`` leaves out what the CLI leaves out (conftest's ``assert_quiet``): XLA's
    per-compile GSPMD notice, torch's and rfdetr's warnings, the DINOv2 notes, pycocotools' prints."""
    proc, _ = api_train
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_quiet(proc.stdout + proc.stderr)


def test_train_names_an_unknown_argument_and_what_to_use_instead():
    import spmd_rfdetr
    from spmd_rfdetr.config.options import ConfigError

    with pytest.raises(ConfigError, match=r"unknown argument\(s\) epoch;.*options=\{'section.field': value\}"):
        spmd_rfdetr.train("nano", dataset_dir="data", epoch=3)
    with pytest.raises(ConfigError, match="give epochs or max_steps, not both"):
        spmd_rfdetr.train("nano", dataset_dir="data", epochs=1, max_steps=3)


def test_a_recipes_variant_stands_and_rfdetrs_names_mean_what_they_mean_there():
    """``train(config=...)`` without a variant keeps the recipe's (``configs/cpu-seg.yaml`` is a seg model, not
    Nano); rfdetr's ``grad_accum_steps`` (its ``batch_size`` is per micro-batch), ``warmup_epochs`` and
    ``early_stopping*`` become ours; ``warmup_steps`` is not one of rfdetr's names."""
    from spmd_rfdetr.api import fit_arguments
    from spmd_rfdetr.cli import run_config
    from spmd_rfdetr.config.options import ConfigError

    assert run_config(fit_arguments(config=str(ROOT / "configs" / "cpu-seg.yaml"))).model.variant == "seg-nano"
    assert run_config(fit_arguments("small", config=str(ROOT / "configs" / "cpu-seg.yaml"))).model.variant == "small"
    cfg = run_config(fit_arguments(batch_size=2, grad_accum_steps=3, warmup_epochs=0.5, early_stopping=True,
                                   early_stopping_patience=4, early_stopping_min_delta=0.01,
                                   early_stopping_use_ema=True))
    assert cfg.data.per_device_batch_size == 6 and cfg.optim.accumulate == 3 and cfg.optim.warmup_epochs == 0.5
    assert (cfg.eval.early_stopping, cfg.eval.early_stopping_patience, cfg.eval.early_stopping_min_delta,
            cfg.eval.early_stopping_use_ema) == (True, 4, 0.01, True)
    with pytest.raises(ConfigError, match=r"unknown argument\(s\) warmup_steps"):
        fit_arguments(warmup_steps=10)


def test_rfdetrs_logger_switches_and_refused_names():
    """rfdetr's ``wandb=True, project=..., run=...`` and ``tensorboard`` become ``trainer.loggers`` (rfdetr's defaults
    for the switch not given: tensorboard on, wandb off) and the W&B options; without either switch the config's list
    stands. rfdetr's names with no counterpart here are refused together, each naming what to use instead."""
    from spmd_rfdetr.api import fit_arguments
    from spmd_rfdetr.cli import run_config
    from spmd_rfdetr.config.options import ConfigError

    argv = fit_arguments(wandb=True, project="detectors", run="nano-1")
    assert '--trainer.loggers=["tensorboard", "wandb"]' in argv
    cfg = run_config(argv)
    assert (cfg.trainer.loggers, cfg.trainer.wandb_project, cfg.trainer.wandb_run) == (
        ["tensorboard", "wandb"], "detectors", "nano-1")
    assert run_config(fit_arguments(wandb=True, tensorboard=False)).trainer.loggers == ["wandb"]
    assert run_config(fit_arguments(tensorboard=True)).trainer.loggers == ["tensorboard"]
    assert run_config(fit_arguments(tensorboard=False)).trainer.loggers == []
    assert not any(a.startswith("--trainer.loggers") for a in fit_arguments(lr=1e-4))
    cfg = run_config(fit_arguments(eval_interval=2, multi_scale="per-batch", amp_dtype=None))
    assert (cfg.eval.every_epochs, cfg.data.multi_scale, cfg.trainer.precision) == (2, True, "fp32")
    with pytest.raises(ConfigError) as refused:
        fit_arguments(checkpoint_interval=10, class_names=["a"], multi_scale="per-sample")
    message = str(refused.value)
    assert "rfdetr's checkpoint_interval is not taken here: rfdetr counts it in epochs" in message
    assert "options={'checkpointing.every_steps': N}" in message
    assert "rfdetr's class_names is not taken here: the class names are the dataset's categories" in message
    assert "multi_scale='per-sample' is not taken here: one of 'off', 'per-batch', False, True" in message

"""Where a run starts from and what it keeps per image follow upstream rfdetr's defaults (issue 20).

``model.pretrain_weights`` defaults to ``auto``: the variant's published COCO checkpoint, as rfdetr's own config
classes default it (``RFDETRNanoConfig().pretrain_weights``), downloaded by rfdetr into its cache; offline, ``fit``
stops with one message and exit status 2 before anything compiles. ``eval.num_select`` defaults to rfdetr's
``num_select`` for the variant, lowered to the logits a small model outputs. Nothing here compiles an RF-DETR graph.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import rfdetr.config
import torch
from rfdetr.assets.model_weights import ModelWeights
from rfdetr.models.postprocess import PostProcess

from spmd_rfdetr.config import resolve
from spmd_rfdetr.config.options import ConfigError, DataOptions, EvalOptions, ModelOptions, OptimOptions, RunConfig
from spmd_rfdetr.config.resolve import fetch_pretrain_weights, resolve_and_check

ROOT = Path(__file__).resolve().parents[1]
#: rfdetr's config class per variant, named here from rfdetr itself (the outside reference).
UPSTREAM = {"nano": rfdetr.config.RFDETRNanoConfig, "small": rfdetr.config.RFDETRSmallConfig,
            "medium": rfdetr.config.RFDETRMediumConfig, "large": rfdetr.config.RFDETRLargeConfig,
            "base": rfdetr.config.RFDETRBaseConfig}
SCRATCH = ModelOptions(resolution=128, num_queries=30, group_detr=2, dec_layers=2, pretrain_weights=None)
#: A network that fails at once, on any machine: every HTTP(S) request goes to a proxy on the discard port.
OFFLINE = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "http_proxy": "http://127.0.0.1:9", "ALL_PROXY": "http://127.0.0.1:9", "all_proxy": "http://127.0.0.1:9"}


def offline(env: dict[str, str], rf_home: Path) -> dict[str, str]:
    """``env`` with rfdetr's cache at ``rf_home`` and every download failing (no proxy exceptions)."""
    kept = {k: v for k, v in env.items() if k.lower() not in ("no_proxy", "roboflow_home")}
    return {**kept, **OFFLINE, "RF_HOME": str(rf_home)}


# ---------------------------------------------------------------------------------------------- pretrain weights
@pytest.mark.parametrize("variant", list(UPSTREAM))
def test_the_default_is_the_variants_published_checkpoint_as_rfdetr_says(variant: str) -> None:
    from spmd_rfdetr.model.upstream import upstream_configs

    assert ModelOptions().pretrain_weights == "auto"
    published = UPSTREAM[variant]().pretrain_weights
    cfg = RunConfig(model=ModelOptions(variant=variant))
    resolve_and_check(cfg)
    assert cfg.model.pretrain_weights == published  # what config.yaml and the checkpoints record
    cfgs = upstream_configs(ModelOptions(variant=variant), DataOptions(), OptimOptions(), 3)  # unresolved: the same
    assert cfgs.model.pretrain_weights == UPSTREAM[variant](pretrain_weights=published).pretrain_weights  # in $RF_HOME
    assert upstream_configs(ModelOptions(variant=variant, pretrain_weights=None), DataOptions(), OptimOptions(),
                            3).model.pretrain_weights is None


def test_the_debug_model_trains_from_scratch_only() -> None:
    """``model.backbone_blocks``: no published weights fit it, so with the default it is a config error naming both
    fields and the way out; with ``pretrain_weights: null`` it is fine."""
    with pytest.raises(ConfigError) as error:
        resolve_and_check(RunConfig(model=ModelOptions(backbone_blocks=2)))
    assert ("model.backbone_blocks=2 builds a backbone no published weights fit, but model.pretrain_weights=auto (the "
            "default: rf-detr-nano.pth) starts from weights: set model.pretrain_weights: null") in str(error.value)
    resolve_and_check(RunConfig(model=ModelOptions(backbone_blocks=2, pretrain_weights=None)))


def test_offline_fit_stops_with_one_message_and_exit_2_before_anything_compiles(tmp_path: Path, synth_dir: str):
    """``fit`` with the default weights, rfdetr's cache empty and the network failing: one message naming the file,
    how to pass a local copy and how to train from scratch; exit status 2, no traceback, nothing compiled (XLA dumps
    every module it compiles: none) and nothing written."""
    dump, out = tmp_path / "xla-dump", tmp_path / "out"
    env = offline(dict(os.environ), tmp_path / "rf-home")
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump}")
    result = subprocess.run([sys.executable, "-m", "spmd_rfdetr", "fit", "--config", "configs/cpu.yaml",
                             "--model.pretrain_weights", "auto", "--model.backbone_blocks", "null",  # Nano's 12
                             "--data.dataset_dir", synth_dir,
                             "--trainer.output_dir", str(out)], cwd=ROOT, env=env, text=True, capture_output=True,
                            timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    stderr = result.stderr
    assert "Traceback" not in stderr and stderr.count("error: ") == 1, stderr[-3000:]
    message = stderr.split("error: ", 1)[1]
    for part in ("model.pretrain_weights=rf-detr-nano.pth (model.variant=nano's published weights): "  # auto, resolved
                 f"{tmp_path / 'rf-home' / 'rf-detr-nano.pth'} is not there and rfdetr could not download it",
                 "--model.pretrain_weights /path/to/rf-detr-nano.pth (or model.pretrain_weights in the YAML config)",
                 "model.pretrain_weights: null (--model.pretrain_weights null) to train from scratch"):
        assert part in message, (part, message)
    assert not out.exists() and not list(dump.rglob("*module*")), sorted(p.name for p in dump.rglob("*"))[:10]


def test_a_published_name_a_local_copy_and_an_unknown_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process, the same check: a published name not in the cache (offline: the message), a copy already there
    (nothing downloaded, nothing said), a path that is neither (the list of published names)."""
    for key, value in offline(dict(os.environ), tmp_path).items():
        monkeypatch.setenv(key, value)
    for key in ("NO_PROXY", "no_proxy", "ROBOFLOW_HOME"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match=r"model.pretrain_weights=auto \(model.variant=small's published weights, "
                                          r"rf-detr-small.pth\): .*rf-detr-small.pth is not there and rfdetr could not "
                                          r"download it from https://"):
        fetch_pretrain_weights(ModelOptions(variant="small"))
    base = ModelWeights.from_filename("rf-detr-base.pth").url  # another variant's published name: downloaded as well
    with pytest.raises(ConfigError, match=rf"model.pretrain_weights=rf-detr-base.pth: .*rf-detr-base.pth is not there "
                                          rf"and rfdetr could not download it from {base} \((ProxyError|ConnectionError)"):
        fetch_pretrain_weights(ModelOptions(variant="small", pretrain_weights="rf-detr-base.pth"))
    (tmp_path / "rf-detr-small.pth").write_bytes(b"")  # a copy in the cache: rfdetr's loader reads it, not this check
    fetch_pretrain_weights(ModelOptions(variant="small", pretrain_weights="rf-detr-small.pth"))
    fetch_pretrain_weights(ModelOptions(variant="small"))  # auto: the same file
    local = tmp_path / "mine" / "weights.pth"
    with pytest.raises(ConfigError, match="no such file .*, and not one of rfdetr's published weights .*rf-detr-nano"):
        fetch_pretrain_weights(ModelOptions(pretrain_weights=str(local)))
    local.parent.mkdir()
    local.write_bytes(b"")
    fetch_pretrain_weights(ModelOptions(pretrain_weights=str(local)))


def test_from_scratch_is_said_once_in_plain_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """rfdetr's own warning about ``pretrain_weights=None`` stays silenced; ``fit``'s check says it instead, once,
    through the project's logger, and says nothing when weights are loaded."""
    monkeypatch.setattr(resolve, "_warned", set())  # this process may have said it already
    monkeypatch.setenv("RF_HOME", str(tmp_path))
    (tmp_path / "rf-detr-nano.pth").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        fetch_pretrain_weights(ModelOptions())  # weights on disk: nothing said
        assert not caplog.records
        for _ in range(2):
            fetch_pretrain_weights(ModelOptions(pretrain_weights=None))
    said = [r for r in caplog.records if "training from scratch" in r.getMessage()]
    assert len(said) == 1 and said[0].name == "spmd_rfdetr.config.resolve", caplog.records
    assert said[0].getMessage() == (
        "model.pretrain_weights: null: training from scratch (no COCO-pretrained weights); fine-tuning from the "
        "published rf-detr-nano.pth (model.pretrain_weights: auto, the default) usually converges far faster")


# ---------------------------------------------------------------------------------------------------- num_select
def test_num_select_defaults_to_rfdetrs_lowered_to_the_logits_the_model_outputs() -> None:
    """rfdetr's PostProcess takes a top-k over the model's ``num_queries x (num_classes + 1)`` logits: the tiny model
    (30 queries, 3 classes) outputs 120, so rfdetr's 300 becomes 120, every detection that top-k can keep (it keeps
    no more whatever its ``num_select``); a 300-query model keeps rfdetr's own default. Our evaluation reads the same
    value, and so do rfdetr's checkpoint entries (tests/test_interop.py)."""
    from spmd_rfdetr.eval.evaluator import eval_sizes
    from spmd_rfdetr.model.upstream import build_model, build_upstream_criterion, upstream_configs
    from spmd_rfdetr.model.inputs import as_samples

    full = upstream_configs(ModelOptions(pretrain_weights=None), DataOptions(), OptimOptions(), 90)
    assert full.model.num_select == rfdetr.config.RFDETRNanoConfig().num_select == 300
    cfgs = upstream_configs(SCRATCH, DataOptions(), OptimOptions(), 3)
    torch.manual_seed(0)
    net = build_model(cfgs).eval()
    with torch.no_grad():
        outputs = net(as_samples(torch.rand(1, 3, 128, 128)))
    assert cfgs.model.num_select == outputs["pred_logits"][0].numel() == 120
    postprocess = build_upstream_criterion(cfgs)[1]
    assert postprocess.num_select == 120
    assert len(postprocess(outputs, torch.tensor([[128, 128]]))[0]["scores"]) == 120
    # rfdetr's own PostProcess keeps no more than that whatever its num_select says: 120 is every detection there is
    assert len(PostProcess(num_select=300)(outputs, torch.tensor([[128, 128]]))[0]["scores"]) == 120
    assert eval_sizes(RunConfig(model=SCRATCH), cfgs)[1] == 120


def test_eval_num_select_is_the_models_and_more_than_its_logits_is_a_config_error(
        capsys: pytest.CaptureFixture[str], synth_dir: str) -> None:
    from spmd_rfdetr.cli import main
    from spmd_rfdetr.eval.evaluator import eval_sizes
    from spmd_rfdetr.model.upstream import build_upstream_criterion, upstream_configs

    cfgs = upstream_configs(SCRATCH, DataOptions(), OptimOptions(), 3, num_select=50)
    assert cfgs.model.num_select == build_upstream_criterion(cfgs)[1].num_select == 50
    assert eval_sizes(RunConfig(model=SCRATCH, eval=EvalOptions(num_select=50)), cfgs)[1] == 50
    limit = "eval.num_select=121 is more than the 120 logits the model outputs per image (its 30 queries x " \
            "(num_classes 3 + 1)): use at most 120"
    with pytest.raises(ConfigError, match=re.escape(limit)):
        upstream_configs(SCRATCH, DataOptions(), OptimOptions(), 3, num_select=121)  # classes read from the dataset
    with pytest.raises(SystemExit) as exit_info:  # classes given: the config check says it, before anything runs
        main(["check-data", "--config", str(ROOT / "configs" / "cpu.yaml"), "--data.dataset_dir", synth_dir,
              "--model.num_classes", "3", "--eval.num_select", "121"])
    assert exit_info.value.code == 2
    assert limit in capsys.readouterr().err


def test_aot_without_a_dataset_traces_the_class_count_a_user_would_train(tmp_path: Path) -> None:
    """``aot`` with no dataset: a detector takes rfdetr's default class count for the variant (COCO's 90), a keypoint
    model one class per entry of its keypoint schema (rfdetr's ``[17]``: COCO person), not rfdetr's 90, which pads
    every query's keypoints to 90 x 17 slots; ``model.num_classes`` and a dataset decide over both."""
    from spmd_rfdetr.aot.trace import _num_classes

    missing = str(tmp_path / "no-dataset")
    keypoints = ModelOptions(variant="keypoint-preview", pretrain_weights=None)
    schema = rfdetr.config.RFDETRKeypointPreviewConfig().num_keypoints_per_class
    assert _num_classes(RunConfig(model=keypoints, data=DataOptions(dataset_dir=missing))) == len(schema) == 1
    two = dataclasses.replace(keypoints, num_keypoints_per_class=[0, 17])
    assert _num_classes(RunConfig(model=two, data=DataOptions(dataset_dir=missing))) == 2
    assert _num_classes(RunConfig(model=dataclasses.replace(keypoints, num_classes=5),
                                  data=DataOptions(dataset_dir=missing))) == 5
    detector = RunConfig(model=ModelOptions(pretrain_weights=None), data=DataOptions(dataset_dir=missing))
    assert _num_classes(detector) == rfdetr.config.RFDETRNanoConfig().num_classes == 90

"""Bad input is caught before XLA compiles: the data check, the config check and the CLI's one error boundary.

The subprocess tests run the real CLI on a synthetic dataset corrupted on purpose (one dataset holds every kind of
problem, so one run checks that all are reported at once) with ``PT_XLA_DEBUG_LEVEL=1``, under which torch_xla prints a
"Compilation Analysis" block for every graph it compiles: its absence shows nothing was compiled.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spmd_rfdetr.config import options as config
from spmd_rfdetr.config import resolve
from spmd_rfdetr.data.check import check_data
from spmd_rfdetr.data.check_report import KINDS, DataError
from spmd_rfdetr.cli import main
from spmd_rfdetr.config.options import ConfigError, DataOptions, EvalOptions, ModelOptions, RunConfig
from spmd_rfdetr.config.resolve import resolve_and_check
from spmd_rfdetr.data.synth import synth

ROOT = Path(__file__).resolve().parents[1]
COMPILED = "Compilation Analysis"  # what PT_XLA_DEBUG_LEVEL=1 prints for each graph XLA compiles


@pytest.fixture(autouse=True)
def data_check_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test (and the CLI it starts) caches data check results in a folder of its own."""
    import matplotlib  # rfdetr's import; it keeps its font list under XDG_CACHE_HOME too: keep it where it is

    monkeypatch.setenv("MPLCONFIGDIR", matplotlib.get_cachedir())
    cache = tmp_path_factory.mktemp("xdg_cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache / "spmd_rfdetr" / "data_check"


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "PT_XLA_DEBUG_LEVEL": "1"}
    return subprocess.run([sys.executable, "-m", "spmd_rfdetr", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


def small_dataset(root: Path) -> tuple[Path, dict]:
    """A synthetic dataset (16 train, 8 valid images of 64 px) and its parsed train annotations."""
    synth(str(root), train_images=16, valid_images=8, test_images=0, image_size=64)
    ann_file = root / "train" / "_annotations.coco.json"
    return ann_file, json.loads(ann_file.read_text())


def first_annotation(coco: dict, image_id: int) -> dict:
    return next(a for a in coco["annotations"] if a["image_id"] == image_id)


@pytest.fixture(scope="module")
def bad_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind of problem at once: train images 0-3 empty/truncated/not an image/missing, annotation problems on
    images 4-7, image 8 without annotations (allowed), 14 objects on image 9, valid annotations cut mid-file."""
    root = tmp_path_factory.mktemp("bad") / "data"
    ann_file, coco = small_dataset(root)
    train = root / "train"
    (train / "train_000000.jpg").write_bytes(b"")
    jpeg = (train / "train_000001.jpg").read_bytes()
    (train / "train_000001.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (train / "train_000002.jpg").write_text("not an image")
    (train / "train_000003.jpg").unlink()
    first_annotation(coco, 4)["bbox"][2] = 0  # zero width
    first_annotation(coco, 5)["bbox"] = [50, 50, 30, 30]  # past the 64 px edge
    first_annotation(coco, 6)["category_id"] = 99  # not a category
    del first_annotation(coco, 7)["area"]  # rfdetr's reader needs it
    coco["annotations"] = [a for a in coco["annotations"] if a["image_id"] != 8]
    coco["annotations"] += [dict(first_annotation(coco, 9), id=1000 + i) for i in range(10)]
    ann_file.write_text(json.dumps(coco))
    valid = root / "valid" / "_annotations.coco.json"
    valid.write_text(valid.read_text()[:100])
    return root


def ids(coco_file: Path) -> dict[str, int]:
    """Annotation ids of the corrupted annotations (first annotation of images 4 to 7)."""
    coco = json.loads(coco_file.read_text())
    return {kind: first_annotation(coco, image)["id"] for kind, image in
            (("zero", 4), ("outside", 5), ("category", 6), ("area", 7))}


def expected_lines(root: Path) -> list[str]:
    """What the report must say about ``bad_dataset`` (split, file, annotation id and the problem)."""
    n = ids(root / "train" / "_annotations.coco.json")
    return [
        "[train] train/train_000000.jpg: empty file (0 bytes)",
        "[train] train/train_000001.jpg: not a readable image (image file is truncated",
        "[train] train/train_000002.jpg: not a readable image (cannot identify image file",
        "[train] train/train_000003.jpg: file not found",
        f"[train] train/_annotations.coco.json (annotation {n['zero']}): box [",
        f"[train] train/_annotations.coco.json (annotation {n['outside']}): box [50, 50, 80, 80]",
        f"[train] train/_annotations.coco.json (annotation {n['category']}): category_id 99 is not in the file's "
        "categories",
        f"[train] train/_annotations.coco.json (annotation {n['area']}): missing 'area'",
        "[train] train/train_000009.jpg: 14 objects, data.max_targets=8",
        "[valid] valid/_annotations.coco.json: not readable as JSON",
    ]


@pytest.mark.slow
def test_check_data_reports_every_problem_at_once(bad_dataset: Path) -> None:
    result = run_cli("check-data", "--config", "configs/cpu.yaml", "--data.dataset_dir", str(bad_dataset),
                     "--model.num_classes", "2")
    assert result.returncode == 2, result.stderr[-3000:]
    for line in expected_lines(bad_dataset):
        assert line in result.stderr, line
    assert "category 3 trains as label 2 >= model.num_classes=2 (the dataset has 3 classes)" in result.stderr
    assert "checked: train: 12 images (1 without annotations)" in result.stderr  # negatives are counted, allowed
    assert "Traceback" not in result.stderr and COMPILED not in result.stdout + result.stderr


@pytest.mark.slow
def test_fit_stops_on_bad_data_before_compiling(bad_dataset: Path, tmp_path: Path) -> None:
    result = run_cli("fit", "--config", "configs/cpu.yaml", "--data.dataset_dir", str(bad_dataset),
                     "--trainer.output_dir", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr[-3000:]
    for line in expected_lines(bad_dataset):
        assert line in result.stderr, line
    assert "Traceback" not in result.stderr
    assert COMPILED not in result.stdout + result.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists() and not (tmp_path / "out" / "config.yaml").exists()


@pytest.mark.slow
def test_compile_marker_is_printed_when_xla_compiles() -> None:
    """The marker the tests above look for is real: a one-op graph prints it."""
    code = "import torch, torch_xla; print((torch.ones(2, device='xla') + 1).cpu())"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PT_XLA_DEBUG_LEVEL": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert COMPILED in result.stdout + result.stderr


def skippable_dataset(root: Path) -> Path:
    """Only problems ``data.on_bad=skip`` covers: an empty train image, a negative-height box, a box past the edge."""
    ann_file, coco = small_dataset(root)
    (root / "train" / "train_000000.jpg").write_bytes(b"")
    first_annotation(coco, 4)["bbox"][3] = -2
    first_annotation(coco, 5)["bbox"] = [50, 50, 30, 30]
    ann_file.write_text(json.dumps(coco))
    return root


@pytest.mark.slow
def test_check_data_on_bad_skip_names_and_counts_what_it_skips(tmp_path: Path) -> None:
    root = skippable_dataset(tmp_path / "data")
    result = run_cli("check-data", "--config", "configs/cpu.yaml", "--data.dataset_dir", str(root),
                     "--data.on_bad", "skip")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data.on_bad=skip leaves out 1 image(s) and lets rfdetr drop or clip 2 box(es)" in result.stderr
    assert "[train] train/train_000000.jpg: empty file (0 bytes)" in result.stderr
    assert "check-data: " in result.stdout and "train: 15 images" in result.stdout


def tiny_cfg(root: Path, **data: object) -> RunConfig:
    return RunConfig(model=ModelOptions(resolution=128, num_queries=30), eval=EvalOptions(every_steps=10),
                     data=DataOptions(dataset_dir=str(root), global_batch_size=8, max_targets=8, **data))


def test_skipped_images_are_left_out_of_the_train_split(tmp_path: Path) -> None:
    from spmd_rfdetr.data.splits import build_split
    from spmd_rfdetr.model.upstream import upstream_configs

    root = skippable_dataset(tmp_path / "data")
    with pytest.raises(DataError, match="train_000000.jpg: empty file"):
        check_data(tiny_cfg(root))
    cfg = tiny_cfg(root, on_bad="skip")
    report = check_data(cfg)
    assert report.skipped_images("train") == {"train_000000.jpg"} and report.skipped_images("valid") == set()
    cfgs = upstream_configs(cfg.model, cfg.data, cfg.optim, num_classes=3)
    full = build_split(cfgs, "train")
    train = report.usable(full, "train")
    assert len(train) == len(full) - 1 == 15
    coco = full.coco
    assert "train_000000.jpg" not in {coco.imgs[full.ids[i]]["file_name"] for i in train.indices}
    for i in range(len(train)):  # every image left reads (the empty one would raise here)
        image, target = train[i]
        assert image.shape == (3, 128, 128) and len(target["labels"]) == len(target["boxes"])
    valid = build_split(cfgs, "valid")
    assert report.usable(valid, "valid") is valid  # nothing skipped there: rfdetr's dataset as built


def test_labels_are_checked_against_the_train_mapping(tmp_path: Path) -> None:
    """valid/test take rfdetr's label mapping from train: a category only the valid split lists is an error there."""
    root = tmp_path / "data"
    small_dataset(root)
    valid_file = root / "valid" / "_annotations.coco.json"
    valid = json.loads(valid_file.read_text())
    valid["categories"].append({"id": 7, "name": "extra", "supercategory": "shapes"})
    valid["annotations"][0]["category_id"] = 7
    valid_file.write_text(json.dumps(valid))
    with pytest.raises(DataError) as error:
        check_data(tiny_cfg(root))
    message = str(error.value)
    assert f"[valid] valid/_annotations.coco.json (annotation {valid['annotations'][0]['id']}): category_id 7 has no " \
           "label in the train split's categories" in message
    assert "1 problem(s)" in message


def test_base_variant_default_resolution_passes() -> None:
    resolve_and_check(RunConfig(model=ModelOptions(variant="base")))  # 560 = 10 x (patch 14 x 4 windows)
    with pytest.raises(ConfigError, match=r"model.resolution=512 must be a multiple of 56 for model.variant=base"):
        resolve_and_check(RunConfig(model=ModelOptions(variant="base", resolution=512)))
    with pytest.raises(ConfigError, match=r"model.resolution=560 must be a multiple of 32 for model.variant=nano"):
        resolve_and_check(RunConfig(model=ModelOptions(variant="nano", resolution=560)))


def test_config_problems_are_listed_together() -> None:
    cfg = RunConfig(data=DataOptions(max_targets=301, multi_scale=True, scales=[384, 400]))
    cfg.mesh.data = 0
    with pytest.raises(ConfigError) as error:
        resolve_and_check(cfg, device_count=4)
    message = str(error.value)
    assert "data.max_targets=301 is more than the 300 queries per group (model.variant=nano's num_queries)" in message
    assert "data.scales=[384, 400]: use some of rfdetr's scales for this model, [" in message
    assert "mesh.data=0 must be >= 1, or -1 for every device" in message
    explicit = RunConfig(model=ModelOptions(num_queries=30), data=DataOptions(max_targets=31))
    with pytest.raises(ConfigError, match=r"the 30 queries per group \(model.num_queries\)"):
        resolve_and_check(explicit)
    with pytest.raises(ConfigError, match=r"mesh.data=8 asks for more devices than the 4 there are"):
        resolve_and_check(RunConfig(mesh=config.MeshOptions(data=8)), device_count=4)


def test_bf16_on_the_cpu_backend_warns_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(resolve, "_warned", set())  # this process may have warned already
    cfg = RunConfig(data=DataOptions(global_batch_size=8))
    cfg.trainer.precision = "bf16"
    with caplog.at_level("WARNING", logger="spmd_rfdetr.config.resolve"):
        for _ in range(2):
            resolve_and_check(copy.deepcopy(cfg), device_count=4)  # this test process runs on XLA CPU devices
    warnings = [r.message for r in caplog.records if "trainer.precision=bf16 on the XLA CPU backend" in r.message]
    assert len(warnings) == 1, caplog.text


def test_cli_parse_errors_exit_2_with_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  bogus_key: 1\n")
    for args, messages in (
        (["fit", "--config", str(bad)], ("does not accept option", "bogus_key")),  # jsonargparse's own check
        (["fit", "--data.max_targets", "many"], ('Parser key "data.max_targets"', "many")),
        (["fitt"], ("invalid choice: 'fitt'",)),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and all(m in err for m in messages), (args, err)
        assert "Traceback" not in err and "usage:" not in err, err


def test_data_errors_exit_2_and_debug_keeps_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["check-data", "--data.dataset_dir", str(tmp_path / "missing")]
    monkeypatch.delenv("SPMD_RFDETR_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "missing: data.dataset_dir is not a directory" in err
    assert "Traceback" not in err
    for debug_args, env in ((["--debug", *args], "0"), (args, "1")):
        monkeypatch.setenv("SPMD_RFDETR_DEBUG", env)
        with pytest.raises(SystemExit) as exit_info:
            main(debug_args)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" in err and "DataError" in err, err


@pytest.mark.slow
def test_validate_checks_the_eval_split_before_compiling(bad_dataset: Path, tiny: Any, tmp_path: Path) -> None:
    import torch

    checkpoint = tmp_path / "weights.pth"
    torch.save({"model": tiny.init_state}, checkpoint)  # the tiny model's weights (configs/cpu.yaml's shapes)
    result = run_cli("validate", "--config", "configs/cpu.yaml", "--data.dataset_dir", str(bad_dataset),
                     "--model.num_classes", "3", "--checkpoint", str(checkpoint))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "[valid] valid/_annotations.coco.json: not readable as JSON" in result.stderr
    assert "[train]" not in result.stderr  # validate reads the eval split only (train's mapping read fine)
    assert "Traceback" not in result.stderr and COMPILED not in result.stdout + result.stderr


@pytest.mark.slow
def test_validate_runs_on_the_configured_cpu_mesh(bad_dataset: Path, tiny: Any, tmp_path: Path) -> None:
    """``mesh.cpu_devices`` (cpu.yaml: 4) reaches ``validate`` with no ``PJRT_DEVICE`` set: reading the checkpoint
    imports rfdetr, which starts torch_xla, so the device is chosen before (it once ran on torch_xla's default, 1)."""
    import torch

    checkpoint = tmp_path / "weights.pth"
    torch.save({"model": tiny.init_state}, checkpoint)
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    result = subprocess.run([sys.executable, "-m", "spmd_rfdetr", "validate", "--config", "configs/cpu.yaml",
                             "--data.dataset_dir", str(bad_dataset), "--model.num_classes", "3",
                             "--checkpoint", str(checkpoint)], cwd=ROOT, env=env, text=True, capture_output=True,
                            timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]  # the bad eval split: stopped before compiling
    assert "weights.pth on 4 CPU device(s)" in result.stderr, result.stderr[-3000:]


def without_timing(error: pytest.ExceptionInfo[DataError]) -> str:
    """A :class:`DataError`'s message less its last ``(...)``: how long the check took, or that it was cached."""
    return str(error.value).rsplit(" (", 1)[0]


def test_a_cached_check_gives_the_same_report_without_opening_an_image(tmp_path: Path, data_check_cache: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    root = skippable_dataset(tmp_path / "data")
    cfg, erroring = tiny_cfg(root, on_bad="skip"), tiny_cfg(root)
    first = check_data(cfg)
    with pytest.raises(DataError) as first_error:
        check_data(erroring)
    assert first.skipped and ", 24 images, " in first.took and first.took.endswith(" threads")
    (root / "train" / "train_000001.jpg").write_bytes(b"broken now")  # a check that opened it would report it
    with caplog.at_level(logging.INFO, logger="spmd_rfdetr.data.check"):
        again = check_data(cfg)
        with pytest.raises(DataError) as again_error:
            check_data(erroring)
    assert again == first and again.took.startswith("cached, ") and again.summaries == first.summaries
    assert again.skipped_images("train") == {"train_000000.jpg"}  # what usable() leaves out: the same image
    assert without_timing(again_error) == without_timing(first_error) and "(cached, " in str(again_error.value)
    cached = sorted(data_check_cache.glob("*.json"))
    assert len(cached) == 2 and all(f"result cached in {c} " in caplog.text for c in cached)
    assert "delete that file to check again" in caplog.text
    both = {"train_000000.jpg", "train_000001.jpg"}  # checked again: the broken image is found
    other = tiny_cfg(root, on_bad="skip")
    other.data.max_targets = 9  # another setting
    assert check_data(other).skipped_images("train") == both
    ann_file = root / "train" / "_annotations.coco.json"
    stat, text = ann_file.stat(), ann_file.read_text()
    ann_file.write_text(text.replace('"version": "1"', '"version": "2"'))  # other bytes; size and mtime kept
    os.utime(ann_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert ann_file.stat().st_size == stat.st_size and ann_file.read_text() != text
    assert check_data(cfg).skipped_images("train") == both


def test_check_annotations_reads_no_image(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``data.check=annotations`` finds annotation problems (boxes against the declared sizes) but not a truncated
    image, which ``full`` finds."""
    root = tmp_path / "data"
    ann_file, coco = small_dataset(root)
    jpeg = (root / "train" / "train_000001.jpg").read_bytes()
    (root / "train" / "train_000001.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    first_annotation(coco, 4)["bbox"][2] = 0
    first_annotation(coco, 5)["bbox"] = [50, 50, 30, 30]  # past the declared 64 px
    ann_file.write_text(json.dumps(coco))
    with pytest.raises(DataError) as error:
        check_data(tiny_cfg(root, check="annotations"))
    message = str(error.value)
    assert "2 problem(s)" in message and "box [50, 50, 80, 80] (x1 y1 x2 y2) on train_000005.jpg (64x64)" in message
    assert "box of zero or negative size (1)" in message and "train_000001.jpg" not in message
    assert "images not opened (data.check=annotations)" in message and "no image opened" in message
    with pytest.raises(DataError, match="3 problem") as error:
        check_data(tiny_cfg(root))
    assert "train/train_000001.jpg: not a readable image (image file is truncated" in str(error.value)


def test_check_off_checks_nothing(tmp_path: Path, data_check_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tiny_cfg(tmp_path / "no-data", check="off")
    with caplog.at_level(logging.WARNING, logger="spmd_rfdetr.data.check"):
        report = check_data(missing)
    assert report.findings == [] and report.summaries == [] and "data.check=off: " in caplog.text
    assert not data_check_cache.exists()
    with pytest.raises(DataError, match="data.dataset_dir is not a directory"):
        check_data(tiny_cfg(tmp_path / "no-data"))


#: One of two hosts of a real gloo group: the same data checks on both; each reports what it got and how many images
#: it opened. Then ``from_coordinator`` when host 0's work raises.
CHECK_HOST = r"""
import json, os, sys
import torch.distributed as dist
rank, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
from spmd_rfdetr.data import check as checks
from spmd_rfdetr.xla import hosts
from spmd_rfdetr.config.options import DataOptions, EvalOptions, ModelOptions, RunConfig
opened = []
inspect = checks.inspect_image
checks.inspect_image = lambda path: opened.append(str(path)) or inspect(path)
def cfg(on_bad):
    return RunConfig(model=ModelOptions(resolution=128, num_queries=30), eval=EvalOptions(every_steps=10),
                     data=DataOptions(dataset_dir=root, global_batch_size=8, max_targets=8, on_bad=on_bad))
out = {}
report = checks.check_data(cfg("skip"))
out["report"], out["took"] = json.loads(report.to_json()), report.took
out["skipped"] = sorted(report.skipped_images("train"))
try:
    checks.check_data(cfg("error"))
except checks.DataError as error:
    out["error"] = str(error).rsplit(" (", 1)[0]
out["opened"] = len(opened)
try:
    hosts.from_coordinator(lambda: 1 // 0)
except Exception as error:
    out["failed"] = f"{type(error).__name__}: {error}"
out["report"].pop("took")
hosts.barrier()
print("RESULT", json.dumps(out), flush=True)
os._exit(0)  # gloo's teardown at exit aborts now and then after any collective ("terminate called ...", 4 in 40)
"""


def test_host_0_checks_and_the_other_host_gets_its_report(tmp_path: Path) -> None:
    """Two processes in a real gloo group: host 0 opens the images (and caches), host 1 opens none and caches nothing,
    and both return the same report or raise the same :class:`DataError`."""
    root = skippable_dataset(tmp_path / "data")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
        env["XDG_CACHE_HOME"] = str(tmp_path / f"cache{rank}")  # hosts may not share a disk
        procs.append(subprocess.Popen([sys.executable, "-c", CHECK_HOST, str(rank), str(port), str(root)], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.split("RESULT", 1)[1]))
    host0, host1 = results
    assert host0["opened"] == 2 * 24 and host1["opened"] == 0  # 16 train + 8 valid images, for each of two settings
    assert host0["report"] == host1["report"] and host0["report"]["findings"]
    assert host0["skipped"] == host1["skipped"] == ["train_000000.jpg"]
    assert host0["error"] == host1["error"] and "train/train_000000.jpg: empty file (0 bytes)" in host0["error"]
    assert "threads" in host0["took"] and host1["took"].startswith("host 0's check: ")
    assert len(list((tmp_path / "cache0" / "spmd_rfdetr").rglob("*.json"))) == 2
    assert not (tmp_path / "cache1" / "spmd_rfdetr").exists()
    assert host0["failed"].startswith("ZeroDivisionError: ")  # host 0's own error; the other host is told
    assert host1["failed"].startswith("RuntimeError: host 0 failed")


def seg_cfg(root: Path, **data: object) -> RunConfig:
    """:func:`tiny_cfg` of a seg-* model: the data check looks at every object's mask too."""
    cfg = tiny_cfg(root, **data)
    cfg.model.variant, cfg.model.resolution = "seg-nano", 96
    return cfg


#: One mask problem per train image (the image's first annotation): what is done to it, what the report says.
MASK_PROBLEMS: dict[int, tuple[Any, str]] = {
    1: ("delete", "no 'segmentation' on train_000001.jpg (64x64)"),
    2: ([], "'segmentation' is [] on train_000002.jpg (64x64)"),
    3: ([[1, 1, 9, 9]], "polygon 0 has 2 point(s), a polygon needs >= 3 on train_000003.jpg"),
    4: ([[1, 1, 9, 1, 9, 9, 3]], "polygon 0 has an odd number of coordinates (7): one lacks its pair"),
    5: ([[1, 1, 5, 5, 9, 9]], "the polygon(s) have zero area (an empty mask) on train_000005.jpg"),
    6: ([[-5, 2, 30, 2, 30, 70]], "polygon points span x -5..30, y 2..70 on train_000006.jpg (64x64)"),
    7: ("half", "RLE size [32, 64] ([height, width]), the image is [64, 64] on train_000007.jpg (64x64)"),
    9: ("no size", "a mask, but its box [3, 4, 3, 9] (x1 y1 x2 y2) has no size on train_000009.jpg (64x64)"),
    10: ("no bbox", "a mask, but no 'bbox' on train_000010.jpg"),
    11: ({"size": [64, 64], "counts": [5, 10, 5]}, "RLE 'counts' cover 20 pixels, its size [64, 64] has 4096"),
    12: ({"size": [64, 64], "counts": "0`"}, "RLE 'counts' unreadable (ends inside a number)"),
}
MASK_KIND_COUNTS = {"missing_mask": 2, "bad_mask": 5, "mask_outside": 1, "mask_size": 1, "mask_without_box": 2}


def mask_dataset(root: Path, images: tuple[int, ...] = tuple(MASK_PROBLEMS)) -> list[str]:
    """The synthetic dataset with the mask problems of ``images`` (:data:`MASK_PROBLEMS`); returns the report lines."""
    from spmd_rfdetr.data.synth import rle

    ann_file, coco = small_dataset(root)
    lines = []
    for image in images:
        change, detail = MASK_PROBLEMS[image]
        ann = first_annotation(coco, image)
        if change == "delete":
            del ann["segmentation"]
        elif change == "half":
            ann["segmentation"] = rle(np.ones((32, 64), dtype=bool))
        elif change == "no size":
            ann["bbox"] = [3, 4, 0, 5]
        elif change == "no bbox":
            del ann["bbox"]
        else:
            ann["segmentation"] = change
        lines.append(f"[train] train/_annotations.coco.json (annotation {ann['id']}): {detail}")
    ann_file.write_text(json.dumps(coco))
    return lines


def test_synth_masks_pass_the_seg_check(tmp_path: Path) -> None:
    root = tmp_path / "data"
    small_dataset(root)
    for check in ("full", "annotations"):
        report = check_data(seg_cfg(root, check=check))
        assert report.findings == [] and "train: 16 images" in report.summary()


def test_seg_check_reports_every_mask_problem(tmp_path: Path) -> None:
    root = tmp_path / "data"
    lines = mask_dataset(root)
    with pytest.raises(DataError) as error:
        check_data(seg_cfg(root))
    message = str(error.value)
    for line in lines:
        assert line in message, line
    assert f"{len(lines)} problem(s)" in message  # one message per annotation: no box finding said twice
    for kind, count in MASK_KIND_COUNTS.items():
        assert f"{KINDS[kind][0]} ({count}): fix: {KINDS[kind][1]}" in message, kind
    assert "box of zero or negative size" not in message and "missing 'bbox'" not in message
    with pytest.raises(DataError) as error:  # a detector reads no mask: only the box problems, as before
        check_data(tiny_cfg(root))
    message = str(error.value)
    assert "2 problem(s)" in message and "box of zero or negative size (1)" in message
    assert "): missing 'bbox'" in message and "mask" not in message


def test_seg_check_on_bad_skip_lets_rfdetr_clip_and_drop(tmp_path: Path) -> None:
    """A polygon past the edge (clipped) and a mask whose box has no size (dropped) are skippable in the train split;
    a missing mask is not."""
    root = tmp_path / "data"
    lines = mask_dataset(root, images=(6, 9))
    with pytest.raises(DataError, match=r"2 problem\(s\)"):
        check_data(seg_cfg(root))
    report = check_data(seg_cfg(root, on_bad="skip"))
    assert sorted(f.kind for f in report.skipped) == ["mask_outside", "mask_without_box"]
    assert all(line in report.describe(report.skipped) for line in lines)
    assert report.skipped_images("train") == set()  # every image is trained on
    missing = tmp_path / "missing"
    mask_dataset(missing, images=(1,))
    with pytest.raises(DataError, match="no 'segmentation' on train_000001.jpg"):
        check_data(seg_cfg(missing, on_bad="skip"))


def test_a_detector_cached_check_does_not_answer_for_a_seg_model(tmp_path: Path) -> None:
    root = tmp_path / "data"
    mask_dataset(root, images=(2,))
    assert check_data(tiny_cfg(root)).findings == []  # cached: this dataset has no problem for a detector
    assert check_data(tiny_cfg(root)).took.startswith("cached, ")
    with pytest.raises(DataError, match=r"'segmentation' is \[\] on train_000002.jpg"):
        check_data(seg_cfg(root))
    with pytest.raises(DataError, match=r"\(cached, "):
        check_data(seg_cfg(root))


@pytest.mark.slow
def test_check_data_cli_reports_mask_problems(tmp_path: Path) -> None:
    root = tmp_path / "data"
    lines = mask_dataset(root)
    result = run_cli("check-data", "--config", "configs/cpu.yaml", "--data.dataset_dir", str(root),
                     "--model.variant", "seg-nano", "--model.resolution", "96")
    assert result.returncode == 2, result.stderr[-3000:]
    for line in lines:
        assert line in result.stderr, line
    assert f"{len(lines)} problem(s)" in result.stderr
    assert "Traceback" not in result.stderr and COMPILED not in result.stdout + result.stderr

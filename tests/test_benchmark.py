"""benchmarks/run.py end to end on the loop model: ours (replay) vs upstream rfdetr, each in its own
subprocess; and its ``--loader`` mode on the session's synthetic dataset.

The script runs as a subprocess (a background job: it starts its own children, SPMD is process-global), on
``configs/cpu.yaml`` with the model of ``conftest.LOOP_MODEL`` (what is checked is the report and the counters, not
the numbers of a real model), 2 warm-up + 2 timed steps, ``--step-mode replay``, with
``--fast-compile`` (XLA CPU codegen without LLVM optimisation: the counters checked here do not depend on it, compile
time halves). ``--loader`` needs no XLA and runs in this process.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import yaml

from support.models import LOOP_MODEL, TINY_MODEL
from jobs import JobInputs, job_fixture

ROOT = Path(__file__).resolve().parents[1]
SIDE_KEYS = ("step_time_median_s", "loop_step_time_s", "graphs_per_step", "transfers_per_step", "compiles", "images_per_sec",
             "host_time_median_s", "execute_time_per_step_s", "not_executing_per_step_s", "compiles_per_step")
#: One step mode: a second (``trace``) is one more child compiling the step (~1 min); trace mode's own counters are
#: tests/test_replay.py's.
MODES = ("replay",)
WARMUP, STEPS = 2, 2  # step 2 is replay's check trace: keep it out of the timed steps


@job_fixture
def bench(inputs: JobInputs, out: Path) -> tuple[dict, Path, str]:
    """``benchmarks/run.py --compare upstream --step-mode replay`` on the loop model: its JSON, plot, stdout."""
    json_path, plot_path, config = out / "tiny.json", out / "tiny.png", out / "loop.yaml"
    cfg = yaml.safe_load((ROOT / "configs" / "cpu.yaml").read_text())
    cfg["model"]["backbone_blocks"] = LOOP_MODEL.backbone_blocks
    config.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--config", str(config),
           "--resolution", str(LOOP_MODEL.resolution), "--queries", str(LOOP_MODEL.num_queries),
           "--group-detr", str(LOOP_MODEL.group_detr), "--dec-layers", str(LOOP_MODEL.dec_layers),
           "--batch", "4", "--targets", "4", "--devices", "4", "--warmup", str(WARMUP), "--steps", str(STEPS),
           "--compare", "upstream", "--step-mode", ",".join(MODES), "--no-flops", "--fast-compile",
           "--json", str(json_path), "--plot", str(plot_path)]
    env = {k: v for k, v in inputs.env.items() if k not in ("XLA_USE_BF16", "PT_XLA_DEBUG_LEVEL")}
    env["PJRT_DEVICE"] = env.get("PJRT_DEVICE", "CPU")
    if env["PJRT_DEVICE"] != "CPU":
        pytest.skip("the tiny benchmark runs on virtual XLA CPU devices")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(json_path.read_text()), plot_path, proc.stdout


@pytest.mark.slow
def test_json_has_both_sides_and_the_resolved_config(bench) -> None:
    result, _, _ = bench
    sides = {"upstream": result["upstream"], **{f"ours {m}": result["ours_by_mode"][m] for m in MODES}}
    for name, side in sides.items():
        for key in SIDE_KEYS:
            assert isinstance(side[key], (int, float)), (name, key)
        assert side["timed_steps"] == STEPS and side["warmup_steps"] == WARMUP
        assert len(side["per_step"]) == WARMUP + STEPS
        outside = side["loop_step_time_s"] - side["loop_execute_time_per_step_s"]
        assert side["outside_execution_per_step_s"] == (pytest.approx(outside) if outside >= 0 else None)
        assert side["not_executing_per_step_s"] == pytest.approx(
            side["step_time_median_s"] - side["execute_time_per_step_s"])
    assert result["ours"] == result["ours_by_mode"][MODES[0]]  # backward compatible: the first mode
    assert result["ratio_step_time"] == pytest.approx(
        result["ours"]["step_time_median_s"] / result["upstream"]["step_time_median_s"])
    model = result["config"]["model"]
    fields = ("resolution", "num_queries", "group_detr", "dec_layers", "backbone_blocks")
    assert [model[f] for f in fields] == [getattr(LOOP_MODEL, f) for f in fields]
    assert result["ours"]["global_batch"] == result["upstream"]["global_batch"] == 4
    assert result["ours"]["per_device_batch_shape"] == [1, 3, LOOP_MODEL.resolution, LOOP_MODEL.resolution]
    env = result["environment"]
    assert env["torch"] and env["torch_xla"] and env["rfdetr"]
    assert env["device"]["device_type"] == "CPU" and env["device"]["runtime_device_count"] == 4
    assert result["upstream"]["device"]["devices_used"] == 1


@pytest.mark.slow
def test_ours_is_one_graph_without_transfers_upstream_is_not(bench) -> None:
    result, _, stdout = bench
    ours, upstream = result["ours"], result["upstream"]
    assert ours["graphs_per_step"] == 1
    assert ours["transfers_per_step"] == 0
    assert ours["aten_fallbacks_per_step"] == 0
    assert upstream["graphs_per_step"] > 1
    assert upstream["transfers_per_step"] > 0  # the SciPy matcher's cost matrices go to the host
    # same model, same initial weights, same batches: the first losses agree
    assert ours["losses"][0] == pytest.approx(upstream["losses"][0], rel=1e-3)
    assert "| graph executions / step | 1 |" in stdout


@pytest.mark.slow
def test_the_step_mode_ran_one_graph_in_and_out_of_the_timed_loop(bench) -> None:
    result, _, stdout = bench
    assert result["bench"]["step_modes"] == list(MODES)
    assert set(result["ours_by_mode"]) == set(MODES) and set(result["ratios_by_mode"]) == set(MODES)
    calls = WARMUP + 2 * STEPS  # timed steps, then as many back to back
    for mode in MODES:
        side = result["ours_by_mode"][mode]
        assert side["step_mode"] == mode and side["step_calls"] == calls
        assert side["graphs_per_step"] == 1 and side["transfers_per_step"] == 0, mode
        assert side["loop_graphs_per_step"] == 1 and side["loop_transfers_per_step"] == 0, mode
        assert f"ours {mode} (" in stdout  # one column per mode


@pytest.mark.slow
def test_replay_traced_once_and_replayed(bench) -> None:
    replay = bench[0]["ours_by_mode"]["replay"]
    assert replay["step_mode_used"] == "replay", f"replay fell back: {replay['step_mode_fallback_reason']}"
    assert 1 <= replay["python_traces"] <= 2  # traced once, plus the check at step 2
    assert replay["loop_python_traces_per_step"] == 0


@pytest.mark.slow
def test_plot_is_written(bench) -> None:
    _, plot_path, _ = bench
    assert plot_path.exists() and plot_path.stat().st_size > 10_000
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loader_reports_images_per_sec_per_worker(synth_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``--loader`` on the synthetic dataset: rfdetr's transforms, 0 and 1 DataLoader workers, rfdetr's float pipeline
    and fit's uint8 one (a quarter of the image bytes per batch), no XLA runtime, JSON + PNG; and on photo-like JPEGs
    of a given size (``--loader-jpegs``)."""
    import torch_xla

    monkeypatch.setattr(sys, "path", list(sys.path))  # run.py puts benchmarks/ on it
    monkeypatch.setenv("PJRT_DEVICE", os.environ.get("PJRT_DEVICE", "CPU"))
    runtime_before = torch_xla._XLAC._xla_runtime_is_initialized()
    json_path = tmp_path / "loader.json"
    run = runpy.run_path(str(ROOT / "benchmarks" / "run.py"), run_name="benchmarks_run")
    run["main"](["--config", str(ROOT / "configs" / "cpu.yaml"), "--loader", "--dataset-dir", synth_dir,
                 "--resolution", str(TINY_MODEL.resolution), "--batch", "4", "--loader-workers", "0,1",
                 "--loader-batches", "2", "--json", str(json_path)])
    result = json.loads(json_path.read_text())
    assert result["benchmark"] == "loader" and result["resolution"] == TINY_MODEL.resolution
    assert [(r["workers"], r["pipeline"]) for r in result["rows"]] == [(0, "float"), (0, "uint8"), (1, "float"),
                                                                        (1, "uint8")]
    for row in result["rows"]:
        assert row["images"] == 8 and row["images_per_sec"] > 0 and row["images_per_sec_per_worker"] > 0
        assert row["image_dtype"] == {"float": "torch.float32", "uint8": "torch.uint8"}[row["pipeline"]]
    image_bytes = {p: b["images"] for p, b in result["bytes_per_batch"].items()}
    assert image_bytes == {"float": 4 * 3 * 128 * 128 * 4, "uint8": 4 * 3 * 128 * 128}  # a quarter
    assert json_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if not runtime_before:
        assert not result["xla_runtime_started"]
    assert "| DataLoader workers |" in capsys.readouterr().out
    run["main"](["--config", str(ROOT / "configs" / "cpu.yaml"), "--loader", "--loader-jpegs", "96x64", "--resolution",
                 str(TINY_MODEL.resolution), "--batch", "4", "--loader-workers", "0", "--loader-batches", "1",
                 "--loader-pipeline", "uint8", "--json", str(json_path)])
    rows = json.loads(json_path.read_text())["rows"]
    assert [(r["source"], r["pipeline"], r["dataset_images"]) for r in rows] == [("96x64 JPEG", "uint8", 64)]


SAVED_GRAPHS_CHILD = r"""
import os, sys, torch, torch_xla
saved, ends = sys.argv[1] + ".0", []
x = torch.arange(16.0).view(4, 4).to(torch_xla.device())
def host_read(t):
    return (t @ t).sum().item()
for step in range(3):
    x = x * host_read(x) / 1e4  # one graph up to the host read, one at the sync
    torch_xla.sync()
    ends.append(os.path.getsize(saved))
print(ends)
"""


@pytest.mark.slow  # a torch_xla child: ~15 s
def test_upstream_compiler_mode_reads_each_steps_graphs(tmp_path: Path) -> None:
    """``--tpu-compiler``'s reading of torch_xla's saved-tensors file (every executed graph, cached or not): per
    step, the graph up to the host read and the one at the sync, with their hashes and where they synced; the HLO
    text is a module libtpu's parser takes."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench.compiler import graphs_by_step
    from jax._src.lib import _jax

    saved = tmp_path / "graphs.hlo"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "XLA_SAVE_TENSORS_FILE": str(saved),
           "XLA_SAVE_TENSORS_FMT": "hlo"}
    child = subprocess.run([sys.executable, "-c", SAVED_GRAPHS_CHILD, str(saved)], env=env, capture_output=True,
                           text=True, timeout=300, check=True)
    ends = json.loads(child.stdout.strip().splitlines()[-1])
    steps = graphs_by_step(Path(f"{saved}.0"), ends)
    assert [len(graphs) for graphs in steps] == [2, 2, 2]
    assert [[h for h, _, _ in graphs] for graphs in steps[1:]] == [[h for h, _, _ in steps[0]]] * 2  # cached: saved
    assert steps[0][0][0] != steps[0][1][0] and "host_read" in steps[0][0][1]
    for _, _, hlo in steps[0]:
        assert hlo.startswith("HloModule") and _jax.hlo_module_from_text(hlo).as_serialized_hlo_module_proto()

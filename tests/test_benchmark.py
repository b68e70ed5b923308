"""benchmarks/run.py end to end on the tiny model: ours vs upstream rfdetr, each side in its own subprocess.

The script runs as a subprocess (it starts its own children: SPMD is process-global), on the tiny model of
``conftest.TINY_MODEL`` (via ``configs/cpu.yaml``), 1 warm-up + 2 timed steps, with ``--fast-compile`` (XLA CPU codegen
without LLVM optimisation: the counters checked here do not depend on it, compile time halves).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_MODEL  # tests/ is on sys.path (rootdir conftest, no __init__.py)

ROOT = Path(__file__).resolve().parents[1]
SIDE_KEYS = ("step_time_median_s", "loop_step_time_s", "graphs_per_step", "transfers_per_step", "compiles", "images_per_sec")


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("bench")
    json_path, plot_path = out / "tiny.json", out / "tiny.png"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--config", str(ROOT / "configs" / "cpu.yaml"),
           "--resolution", str(TINY_MODEL.resolution), "--queries", str(TINY_MODEL.num_queries),
           "--group-detr", str(TINY_MODEL.group_detr), "--dec-layers", str(TINY_MODEL.dec_layers),
           "--batch", "4", "--targets", "4", "--devices", "4", "--warmup", "1", "--steps", "2",
           "--compare", "upstream", "--no-flops", "--fast-compile", "--json", str(json_path), "--plot", str(plot_path)]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_BF16", "PT_XLA_DEBUG_LEVEL")}
    env["PJRT_DEVICE"] = env.get("PJRT_DEVICE", "CPU")
    if env["PJRT_DEVICE"] != "CPU":
        pytest.skip("the tiny benchmark runs on virtual XLA CPU devices")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(json_path.read_text()), plot_path, proc.stdout


@pytest.mark.slow
def test_json_has_both_sides_and_the_resolved_config(bench) -> None:
    result, _, _ = bench
    for side in ("ours", "upstream"):
        for key in SIDE_KEYS:
            assert isinstance(result[side][key], (int, float)), (side, key)
        assert result[side]["timed_steps"] == 2 and result[side]["warmup_steps"] == 1
        assert len(result[side]["per_step"]) == 3
    assert result["ratio_step_time"] == pytest.approx(
        result["ours"]["step_time_median_s"] / result["upstream"]["step_time_median_s"])
    model = result["config"]["model"]
    assert (model["resolution"], model["num_queries"], model["group_detr"], model["dec_layers"]) == (
        TINY_MODEL.resolution, TINY_MODEL.num_queries, TINY_MODEL.group_detr, TINY_MODEL.dec_layers)
    assert result["ours"]["global_batch"] == result["upstream"]["global_batch"] == 4
    assert result["ours"]["per_device_batch_shape"] == [1, 3, TINY_MODEL.resolution, TINY_MODEL.resolution]
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
def test_plot_is_written(bench) -> None:
    _, plot_path, _ = bench
    assert plot_path.exists() and plot_path.stat().st_size > 10_000
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

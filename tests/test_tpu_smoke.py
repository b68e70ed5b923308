"""Seed Phase 2a smoke checklist on a real TPU: `pytest -m tpu` on a TPU VM (skipped with a reason elsewhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch_xla
import torch_xla.runtime as xr

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(xr.device_type() != "TPU", reason=f"needs a TPU; this process runs on {xr.device_type()}"),
]
ROOT = Path(__file__).resolve().parents[1]
#: The v5e recipe from scratch (a TPU VM of the suite need not reach rfdetr's weight host: the recipe fine-tunes),
#: counted in steps without evaluation (the recipe counts in epochs and evaluates every epoch).
FIT_V5E = ("fit", "--config", "configs/v5e.yaml", "--model.pretrain_weights", "null", "--trainer.epochs", "null",
           "--eval.every_epochs", "null")


def run(*args: str) -> subprocess.CompletedProcess:
    """``python -m spmd_rfdetr ...`` on the TPU (the CPU-mesh variables of the test process removed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    return subprocess.run([sys.executable, "-m", "spmd_rfdetr", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=1800)


def test_1_xla_device_is_a_tpu() -> None:
    assert xr.device_type() == "TPU" and torch_xla.device().type == "xla"


def test_2_matmul_over_5_tflops() -> None:
    a = torch.randn(2048, 2048, device=torch_xla.device(), dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device=torch_xla.device(), dtype=torch.bfloat16)
    torch_xla.sync()
    (a @ b).sum().item()  # compile + warm up
    start, reps = time.perf_counter(), 50
    out = a
    for _ in range(reps):
        out = (out @ b) * 1e-3
    out.sum().item()
    tflops = 2 * 2048**3 * reps / (time.perf_counter() - start) / 1e12
    assert tflops > 5, f"{tflops:.1f} TFLOP/s"


def test_3_to_7_two_nano_steps_finite_no_fallbacks(tmp_path: Path) -> None:
    """Nano at 384 px, bf16, 2 steps through `fit`: finite loss, zero aten:: fallbacks (grid_sampler included)."""
    data = tmp_path / "synth"
    assert run("synth", "--output_dir", str(data), "--image_size", "384").returncode == 0
    result = run(*FIT_V5E, "--data.dataset_dir", str(data), "--trainer.max_steps", "2",
                 "--trainer.log_every", "1", "--trainer.output_dir", str(tmp_path / "out"), "--data.num_workers", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert records[-1]["xla_aten_fallbacks"] == 0
    assert "grid_sampler" not in result.stderr


def test_8_a_second_fit_loads_every_graph_from_the_persistent_cache(tmp_path: Path) -> None:
    """Issue 10: two `fit` runs with the same config and compile cache; the second compiles nothing from scratch."""
    data = tmp_path / "synth"
    assert run("synth", "--output_dir", str(data), "--image_size", "384").returncode == 0
    last = []
    for attempt in ("first", "second"):
        out = tmp_path / attempt
        result = run(*FIT_V5E, "--data.dataset_dir", str(data), "--trainer.max_steps",
                     "3", "--trainer.log_every", "1", "--trainer.output_dir", str(out), "--eval.every_steps", "0",
                     "--trainer.compile_cache_dir", str(tmp_path / "cache"))
        assert result.returncode == 0, result.stderr[-3000:]
        last.append(json.loads((out / "metrics.jsonl").read_text().splitlines()[-1]))
    assert last[0]["xla_cache_misses"] >= 1 and last[1]["xla_cache_misses"] == 0, last
    assert last[1]["xla_cache_loads"] >= 1, last


def test_9_a_preempted_fit_resumes_bit_for_bit(tmp_path: Path) -> None:
    """The replayed step donates the training state on the chip: a fit stopped by a real SIGTERM after step 2 and
    resumed gives the uninterrupted run's losses bit for bit (XLA on a TPU is deterministic; on the CPU mesh the
    client's own ulp drift makes tests/test_resume.py bound them instead)."""
    import signal

    from support.runs import read_metrics, wait_for

    data = tmp_path / "synth"
    assert run("synth", "--output_dir", str(data), "--image_size", "384").returncode == 0
    common = [*FIT_V5E, "--data.dataset_dir", str(data), "--trainer.max_steps", "6",
              "--trainer.log_every", "1", "--eval.every_steps", "0", "--data.num_workers", "2"]
    assert run(*common, "--trainer.output_dir", str(tmp_path / "straight")).returncode == 0
    out = tmp_path / "preempted"
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    proc = subprocess.Popen([sys.executable, "-m", "spmd_rfdetr", *common, "--trainer.output_dir", str(out),
                             "--trainer.resume", "auto"], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    wait_for(lambda: len(read_metrics(out)) >= 2, proc, "step 2", timeout=1800)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == 0
    assert run(*common, "--trainer.output_dir", str(out), "--trainer.resume", "auto").returncode == 0
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(tmp_path / "straight")]


def test_5_masks_stay_bool_inside_the_step(tiny, mesh_trainer) -> None:
    mesh_trainer.backbone_mask_dtypes.clear()
    mesh_trainer.step(mesh_trainer.to_device(tiny.batches[0]))
    assert mesh_trainer.backbone_mask_dtypes == [torch.bool]


def test_10_the_fused_attention_kernels_run_on_the_chip_as_the_xla_path(tmp_path: Path) -> None:
    """``trainer.fused_attention`` (opt-in until this passes on a chip): the Mosaic kernels at the decoder's and
    DINOv2's shapes give the XLA path's output and gradients (:mod:`spmd_rfdetr.model.attention`) to bf16 rounding,
    and 20 steps of v5e.yaml with them follow the steps without them."""
    from spmd_rfdetr.model.attention import attention
    from spmd_rfdetr.xla.fused_attention import fused_attention

    for n, length, width, heads in ((16, 300, 256, 8), (8, 145, 384, 6), (4, 580, 384, 6)):
        g = torch.Generator().manual_seed(0)
        q, k, v, grad = (torch.randn(n, length, width, generator=g).bfloat16().to(torch_xla.device())
                         for _ in range(4))

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(n, length, heads, width // heads).transpose(1, 2)

        results = []
        for fn in (lambda *t: fused_attention(*t, heads),
                   lambda *t: attention(*map(split, t)).transpose(1, 2).reshape(n, length, width)):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*inputs)
            results.append([t.float().cpu() for t in (out, *torch.autograd.grad(out, inputs, grad))])
        for a, b in zip(*results):
            assert (a - b).abs().max() <= 2e-2 * max(float(b.abs().max()), 1.0), (n, length, width)
    data = tmp_path / "synth"
    assert run("synth", "--output_dir", str(data), "--image_size", "384").returncode == 0
    losses = []
    for fused in ("false", "true"):
        out = tmp_path / f"fused-{fused}"
        result = run(*FIT_V5E, "--data.dataset_dir", str(data), "--trainer.max_steps", "20", "--trainer.log_every",
                     "1", "--eval.every_steps", "0", "--trainer.output_dir", str(out),
                     "--trainer.fused_attention", fused)
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-2) and losses[1][-1] < 1.1 * losses[0][-1], losses

"""``trainer.compile_backend=openxla``: torch.compile training under SPMD, exact with spmd_rfdetr's bridge fix.

torch_xla 2.9's dynamo bridge gives stale weight gradients under SPMD (pytorch/xla#4824; root cause in
:mod:`spmd_rfdetr.xla.openxla_fix`). The first test keeps showing the bug without the fix (it fails when torch_xla fixes it
upstream: then the fix can go) and shows the fix exact against eager; the second trains RF-DETR through the real CLI.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import yaml

from support.models import parity_tolerance
from support.runs import read_metrics
from jobs import JobInputs, job_fixture
from spmd_rfdetr.xla.openxla_fix import apply_bridge_fix

ROOT = Path(__file__).resolve().parents[1]
OPENXLA_STEPS = 5
#: Step 5's tolerance against the replay fit: the step where near-tied proposals were ranked differently on the CPU of
#: 2026-12-06 (3.4e-3: losses 10.72927 / 10.76600 with the code of 6290202 too, whose CI passed at 6.2e-5 on another
#: CPU; steps 3-4 agreed to 6e-7, so the weights were right). A 10% LR error moves step 3 by 7.6e-3: steps 1-4 keep
#: :func:`parity_tolerance`.
REORDERED_STEP_TOLERANCE = 1e-2


def openxla_grad_errors(mesh, calls: int = 5) -> list[float]:
    """max |grad - eager grad| per call of a torch.compile(openxla)'d forward+backward on a sharded batch."""

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def step(m, x, y):
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        return loss

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref, model = net(), net().to(torch_xla.device())
    model.load_state_dict(ref.state_dict())
    compiled, errors = torch.compile(step, backend="openxla"), []
    for i in range(calls):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        ref.zero_grad()
        step(ref, x, y)
        xx, yy = x.to(torch_xla.device()), y.to(torch_xla.device())
        xs.mark_sharding(xx, mesh, ("data", None))
        xs.mark_sharding(yy, mesh, ("data", None))
        model.zero_grad(set_to_none=True)
        compiled(model, xx, yy)
        torch_xla.sync()
        errors.append(max((p.grad.cpu() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    torch._dynamo.reset()
    return errors


def test_openxla_training_is_wrong_without_the_fix_and_exact_with_it(mesh_trainer):
    mesh = mesh_trainer.fabric.strategy.mesh
    without = openxla_grad_errors(mesh)
    assert without[0] < 1e-5 and max(without[1:]) > 1e-2, f"torch_xla trains right without the fix now: {without}"
    undo = apply_bridge_fix()
    try:
        with_fix = openxla_grad_errors(mesh)
    finally:
        undo()
    print("openxla under SPMD, max |grad - eager| per call: without fix", without, "with fix", with_fix)
    assert max(with_fix) < 1e-5, with_fix


@job_fixture
def openxla_fit(inputs: JobInputs, out: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The CLI's ``fit`` of the loop fit's config with compile_backend=openxla, a NaN batch at the last step."""
    from spmd_rfdetr.xla.loader import NAN_BATCH_ENV

    cfg = yaml.safe_load(inputs.loop_config.read_text())
    cfg["trainer"].update(compile_backend="openxla", max_steps=OPENXLA_STEPS + 1, on_nonfinite="skip_step",
                          output_dir=str(out / "run"))
    cfg["checkpointing"].update(every_steps=1, keep=2)  # the training state after steps 5 and 6
    # data.num_workers=0 runs rfdetr's random augmentations in the loading thread; dynamo saves and restores torch's
    # host RNG while it compiles, which would reorder those draws. Loading in the loop keeps the replay run's batches.
    cfg["data"]["prefetch"] = 0
    config = out / "openxla.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**inputs.env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", NAN_BATCH_ENV: str(OPENXLA_STEPS + 1)}
    result = subprocess.run([sys.executable, "-m", "spmd_rfdetr", "fit", "--config", str(config)], cwd=ROOT, env=env,
                            text=True, capture_output=True, timeout=1800)
    return result, out / "run"


@pytest.mark.slow
def test_fit_trains_with_openxla_as_with_replay_and_skips_a_nan_step(openxla_fit, loop_run):
    """The CLI's `fit` with compile_backend=openxla, 5 steps of the loop fit's config (in its LR warm-up): the
    replay fit's losses within :func:`~conftest.parity_tolerance` (1e-5 at step 1, 1e-4 at step 2: the weight
    updates were right; from step 3 the two programs, which round differently, may rank near-tied proposals
    differently: measured 6.2e-5 at step 5 on a CI run, 3.4e-3 on another CPU: :data:`REORDERED_STEP_TOLERANCE`).
    Then a real NaN batch at step 6 with ``trainer.on_nonfinite=skip_step``: counted, named, and the weights and AdamW
    state after it are those after step 5, bit for bit (the non-finite guard around dynamo's graphs), and the EMA
    stays finite."""
    from support.models import read_training_checkpoint

    result, out = openxla_fit
    assert result.returncode == 0, result.stderr[-4000:]
    ours = read_metrics(out)
    ref = read_metrics(loop_run)[:OPENXLA_STEPS]
    assert [r["step"] for r in ours] == list(range(1, OPENXLA_STEPS + 2))
    assert {r["step_mode"] for r in ours} == {"openxla"}
    for a, b in zip(ours, ref):
        tolerance = parity_tolerance(a["step"]) if a["step"] < OPENXLA_STEPS else REORDERED_STEP_TOLERANCE
        assert abs(a["loss"] - b["loss"]) <= tolerance * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    nan_step = ours[-1]
    assert nan_step["loss"] != nan_step["loss"] and nan_step["nonfinite_steps"] == 1
    assert nan_step["first_nonfinite_step"] == OPENXLA_STEPS + 1 and ours[-2]["nonfinite_steps"] == 0
    before, after = (read_training_checkpoint(out / "checkpoints" / f"step_{s:08d}") for s in (5, 6))
    kept = [k for k in before if k.startswith(("model.", "optim.")) and not k.startswith("optim.group")]  # LRs move on
    assert len(kept) > 10 and all(torch.equal(before[k], after[k]) for k in kept)
    ema = [v for k, v in after.items() if k.startswith("ema.") and v.is_floating_point()]
    assert len(ema) > 10 and all(torch.isfinite(v).all() for v in ema)  # it averaged the kept weights, not NaNs
    graphs = (ours[-2]["xla_executions"] - ours[1]["xla_executions"]) / (OPENXLA_STEPS - 2)
    print(f"openxla fit: losses {[r['loss'] for r in ours]}; {graphs:.1f} graph executions per step")

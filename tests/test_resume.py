"""Long runs: the data order as a function of the step, and a real preempted run resumed exactly.

The subprocess test trains the session fit's config (``fit_run``: 40 steps, EMA on) in three real ``fit`` processes:
stopped by a real SIGTERM, resumed and killed with SIGKILL inside a checkpoint save, resumed again to the end. Every
step's loss and the final (EMA) weights equal the straight in-process run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from spmd_rfdetr.data import SeededSamples, TrainBatches

ROOT = Path(__file__).resolve().parents[1]


def test_batches_from_any_step_are_the_straight_runs_batches():
    straight = TrainBatches(size=37, batch_size=8, seed=5)  # 4 batches per epoch, 5 images dropped each epoch
    it = iter(straight)
    first = [next(it) for _ in range(13)]
    for start in (0, 3, 4, 9):
        resumed = iter(TrainBatches(size=37, batch_size=8, seed=5, start_step=start))
        assert [next(resumed) for _ in range(13 - start)] == first[start:]
    epochs = [[i for _, i in sum(first[e * 4:(e + 1) * 4], [])] for e in range(3)]
    assert all(len(set(e)) == 32 for e in epochs) and epochs[0] != epochs[1]  # a fresh permutation per epoch
    assert first[4][0][0] == 1 and straight.position(4) == (1, 0) and len(straight) == 4
    other_seed = iter(TrainBatches(size=37, batch_size=8, seed=6))
    assert next(other_seed) != first[0]


class Augmented(torch.utils.data.Dataset):
    """A stand-in for rfdetr's augmenting dataset: each read draws from torch's, Python's and NumPy's global RNGs."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int):
        import random

        import numpy as np

        return index, torch.rand(()).item(), random.random(), float(np.random.rand())


def test_seeded_samples_depend_on_the_key_only():
    data = SeededSamples(Augmented(), seed=1)
    a = [data[(0, i)] for i in range(10)]
    b = [data[(0, i)] for i in reversed(range(10))][::-1]  # another order (another worker split, a resume)
    assert a == b
    assert data[(1, 3)] != data[(0, 3)]  # the next epoch augments differently
    state = torch.get_rng_state()
    data[(0, 0)]
    assert torch.equal(state, torch.get_rng_state())  # the caller's RNG is untouched


def read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def start_fit(config: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "spmd_rfdetr", "fit", "--config", str(config), *extra], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"fit exited ({proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="replay drifts from trace mode after a few steps since issue 17's step (2026-12-01: first gradient difference at step 7 of the session fit; a resumed run follows trace mode): under investigation, see the issue 17 notes")
def test_sigterm_kill_during_save_and_resume_give_the_straight_run(fit_run: Path, tmp_path: Path):
    straight = {r["step"]: r["loss"] for r in read_metrics(fit_run)}
    cfg = yaml.safe_load((fit_run / "config.yaml").read_text())
    out = tmp_path / "run"
    cfg["trainer"].update(output_dir=str(out), loggers=[], resume="auto")
    cfg["eval"]["every_steps"] = 0  # evaluation must not change training: the straight run evaluated at 20 and 40
    cfg["checkpointing"] = {"every_steps": 8, "keep": 2}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))

    # 1. a real SIGTERM once step 3 is logged: the step in flight finishes, its state is saved, exit 0
    proc = start_fit(config)
    wait_for(lambda: any(r["step"] >= 3 for r in read_metrics(out)), proc, "step 3")
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    stopped = int(stdout.split("stopped by SIGTERM after step ")[1].split(":")[0])
    assert 3 <= stopped < 8, stdout
    assert (out / "checkpoints" / f"step_{stopped:08d}").is_dir() and not (out / "last.pth").exists()

    # 2. resumed, then SIGKILLed inside the step-8 save (after its files were written, before it was published)
    proc = start_fit(config, env={"SPMD_RFDETR_TEST_PAUSE_BEFORE_PUBLISH_S": "600"})
    partial = out / "checkpoints" / ".step_00000008.partial"
    wait_for(lambda: (partial / "meta.json").exists(), proc, "the step-8 save")
    proc.kill()
    proc.communicate()
    second = {r["step"]: r["loss"] for r in read_metrics(out)}

    # 3. resumed again: the half-written save is named and skipped, the SIGTERM checkpoint used, to the end
    proc = start_fit(config)
    stdout, stderr = proc.communicate(timeout=1200)
    assert proc.returncode == 0, stderr[-4000:]
    assert f"skipping {partial}" in stderr and f"resumed from {out / 'checkpoints' / f'step_{stopped:08d}'}" in stderr
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 41))  # every step once: nothing lost, nothing twice
    assert records[stopped]["xla_new_compiles"] == 1 and records[stopped]["step_mode"] == "replay"
    assert all(r["xla_new_compiles"] == 0 for r in records[stopped + 1:]), "a resumed run recompiled"
    for step, loss in list(second.items()) + [(r["step"], r["loss"]) for r in records]:
        assert abs(loss - straight[step]) <= 1e-6 * abs(straight[step]), (step, loss, straight[step])
    ours = torch.load(out / "last.pth", map_location="cpu", weights_only=False)
    ref = torch.load(fit_run / "last.pth", map_location="cpu", weights_only=False)
    assert ours["weights"] == ref["weights"] == "ema" and ours["ema"]["updates"] == 40
    worst = max((ours["model"][k].float() - ref["model"][k].float()).abs().max().item()
                for k in ref["model"] if ref["model"][k].numel())
    assert worst <= 1e-6, worst
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000032", "step_00000040"]  # keep 2


@pytest.mark.slow
def test_tensorboard_and_csv_get_the_records(fit_run: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = read_metrics(fit_run)
    (events,) = (fit_run / "logs" / "tensorboard").glob("version_*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    losses = {e.step: e.value for e in accumulator.Scalars("loss")}
    assert losses == pytest.approx({r["step"]: r["loss"] for r in records}, rel=1e-6)
    assert [e.step for e in accumulator.Scalars("eval/mAP")] == [r["step"] for r in records if "eval/mAP" in r]
    (csv,) = (fit_run / "logs" / "csv").glob("version_*/metrics.csv")
    header = csv.read_text().splitlines()[0].split(",")
    assert {"loss", "lr", "images_per_sec", "xla_compiles"} <= set(header)


@pytest.mark.slow
def test_a_nan_step_stops_fit_or_is_skipped(tiny, synth_dir: str, fit_run: Path, tmp_path: Path, monkeypatch):
    """A real NaN batch at step 5 of the session fit's config (its graphs are compiled already, in this process):
    ``stop`` ends the run there, naming the step, with the step-4 checkpoint finite and no last.pth; ``skip_step``
    trains on to the end with exactly one skipped step and finite weights."""
    from conftest import fit_config, read_training_checkpoint
    from spmd_rfdetr import loop
    from spmd_rfdetr.loader import NAN_BATCH_ENV

    monkeypatch.setenv(NAN_BATCH_ENV, "5")
    (tmp_path / "stop").mkdir()
    (tmp_path / "skip").mkdir()
    cfg = fit_config(tiny, synth_dir, tmp_path / "stop", "replay")
    cfg.checkpointing.every_steps = 2
    with pytest.raises(loop.NonFiniteLoss, match=r"at 1 step\(s\) in steps 5\.\.5 \(the first one in this run: step 5\)"):
        loop.fit(cfg)
    out = Path(cfg.trainer.output_dir)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5] and not (out / "last.pth").exists()
    host = read_training_checkpoint(out / "checkpoints" / "step_00000004")
    assert all(torch.isfinite(t).all() for k, t in host.items() if k.startswith(("model.", "ema.")))

    cfg = fit_config(tiny, synth_dir, tmp_path / "skip", "replay")
    cfg.trainer.on_nonfinite, cfg.eval.every_steps = "skip_step", 0
    last = torch.load(loop.fit(cfg), map_location="cpu", weights_only=False)
    records = read_metrics(Path(cfg.trainer.output_dir))
    assert [r["nonfinite_steps"] for r in records] == [0] * 4 + [1] * 36
    assert records[4]["loss"] != records[4]["loss"] and all(r["loss"] == r["loss"] for i, r in enumerate(records) if i != 4)
    assert all(torch.isfinite(t).all() for t in last["model"].values() if t.is_floating_point())

"""The session's fixtures (a plugin of conftest's ``pytest_plugins``): the synthetic dataset, the tiny models, the
mesh trainer, the first steps, the session fits and the preempted run (a background job, ``jobs.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from spmd_rfdetr.training.stops import SIGTERM_AT_STEP_ENV

from jobs import JobInputs, job_fixture
from support.models import (FIRST_STEPS, LOOP_MODEL, PREEMPTED_EVAL_EPOCHS, PREEMPTED_SIGTERM_STEP, TINY_MODEL,
                            TINY_SEED, TRACE_STEPS, FirstSteps, MeshTrainer, Tiny, first_step_gradients, fit_config,
                            loop_config, make_tiny)
from support.runs import PreemptedRun, read_metrics, sigterm_after, start_fit, wait_for


@pytest.fixture(scope="module", autouse=True)
def _return_freed_memory() -> Any:
    """After each module, hand the heap XLA's compilers freed back to the OS (glibc keeps it otherwise)."""
    yield
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real synthetic COCO dataset on disk (Roboflow layout), shared by the session."""
    from spmd_rfdetr.data.synth import synth

    return str(synth(str(tmp_path_factory.mktemp("data") / "synth"), train_images=32, valid_images=40, test_images=4))


@pytest.fixture(scope="session")
def tiny(synth_dir: str) -> Tiny:
    """The numerics model (:data:`TINY_MODEL`): what is compared with upstream's step."""
    return make_tiny(TINY_MODEL, synth_dir, TINY_SEED)


@pytest.fixture(scope="session")
def loop_tiny(synth_dir: str) -> Tiny:
    """The loop model (:data:`LOOP_MODEL`): for tests of a mechanism that any RF-DETR shows (buckets, several hosts)."""
    return make_tiny(LOOP_MODEL, synth_dir)


@pytest.fixture(scope="session")
def mesh_trainer(tiny: Tiny) -> MeshTrainer:
    from spmd_rfdetr.training.build import build_trainer
    from spmd_rfdetr.xla.fabric import spmd_fabric
    from spmd_rfdetr.xla.mesh import build_mesh

    fabric = spmd_fabric(build_mesh(), precision="32-true")
    net = tiny.model()
    mask_dtypes: list[torch.dtype] = []
    net.backbone.register_forward_pre_hook(lambda _m, args: mask_dtypes.append(args[0].mask.dtype))
    # as `fit` builds it, EMA on (it never changes the weights the tests compare with upstream)
    trainer = build_trainer(fabric, tiny.cfgs, tiny.cfg.optim, tiny.cfg.trainer, model=net, ema=tiny.cfg.model)
    loader = fabric.strategy.process_dataloader(torch.utils.data.DataLoader(tiny.batches, batch_size=None))
    return MeshTrainer(fabric, trainer.model, trainer.optimizer, trainer.step, loader.to_device, mask_dtypes,
                       trainer.ema)


@pytest.fixture(scope="session")
def first_steps(tiny: Tiny, mesh_trainer: MeshTrainer) -> FirstSteps:
    """One fresh trainer (as ``fit`` builds it) on the session mesh, run once for every test that needs steps from the
    initial weights: its programs are the session trainer's (the same graphs), so this costs steps, not compiles."""
    import gc

    from spmd_rfdetr.training.build import build_trainer

    trainer = build_trainer(mesh_trainer.fabric, tiny.cfgs, tiny.cfg.optim, tiny.cfg.trainer, model=tiny.model(),
                            ema=tiny.cfg.model)
    stats, grads, weights = [], [], []
    for i in range(FIRST_STEPS):
        stats.append(trainer.step.read(trainer.step(mesh_trainer.to_device(tiny.batches[i % len(tiny.batches)]))))
        if i == 0:
            params = list(trainer.model.parameters())
            grads = first_step_gradients(trainer.optimizer, params)
            weights = [p.detach().cpu() for p in params]
    result = FirstSteps(stats, grads, weights, trainer.step.mode)
    del trainer
    gc.collect()
    return result


@pytest.fixture(scope="session")
def fit_run(tiny: Tiny, synth_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fit`` on the mesh in the default step mode (replay); its output directory (metrics, checkpoints, evals).
    In this process, not a background job: the jobs are the longer half of the suite already. Its W&B logger runs
    offline (``WANDB_MODE`` set for the fit only: the environment of the tests after it is left as it was)."""
    from spmd_rfdetr.training import loop

    cfg = fit_config(tiny, synth_dir, tmp_path_factory.mktemp("fit"), "replay")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        loop.fit(cfg)
    return Path(cfg.trainer.output_dir)


@pytest.fixture(scope="session")
def loop_run(tiny: Tiny, synth_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fit`` of :func:`loop_config` on the mesh (replay): the straight run the loop tests compare with."""
    from spmd_rfdetr.training import loop

    cfg = loop_config(tiny, synth_dir, tmp_path_factory.mktemp("loop"), "replay")
    loop.fit(cfg)
    return Path(cfg.trainer.output_dir)


@pytest.fixture(scope="session")
def trace_fit_run(tiny: Tiny, synth_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`loop_config` in trace mode, stopped by a real SIGTERM after :data:`TRACE_STEPS` steps (each step is
    traced by Python and compiled code is looked up by hash: seconds per step, so not all of them)."""
    from spmd_rfdetr.training import loop

    cfg = loop_config(tiny, synth_dir, tmp_path_factory.mktemp("fit-trace"), "trace")
    with sigterm_after(Path(cfg.trainer.output_dir), TRACE_STEPS):
        loop.fit(cfg)
    return Path(cfg.trainer.output_dir)


@job_fixture
def preempted_run(inputs: JobInputs, base: Path) -> PreemptedRun:
    """``fit`` as a user runs it, on the loop fit's config (a checkpoint every 8 steps, keep 2), evaluated every
    :data:`PREEMPTED_EVAL_EPOCHS` epochs, the raw weights too (``eval.base_model``), with early stopping that counts but
    never stops (an improvement must be 1.0 mAP; patience 100): a real SIGTERM, which the process sends itself right
    after dispatching step :data:`PREEMPTED_SIGTERM_STEP` (an evaluation step: the stop skips that evaluation, saves
    the step and exits 0); resumed, with ``model.pretrain_weights`` now naming a file that does not exist (a resume
    needs no starting weights), and SIGKILLed inside the step-8 save (after its files were written, before it was
    published); resumed again to the end. The CLI's own tests read this run too (its outputs, its counters): one set of
    CLI compiles for both."""
    cfg = yaml.safe_load(inputs.loop_config.read_text())
    out = base / "run"
    cfg["trainer"].update(output_dir=str(out), loggers=[], resume="auto")
    cfg["checkpointing"] = {"every_steps": 8, "keep": 2}
    cfg["eval"].update(every_steps=0, every_epochs=PREEMPTED_EVAL_EPOCHS, base_model=True, early_stopping=True,
                       early_stopping_patience=100, early_stopping_min_delta=1.0, early_stopping_use_ema=False)
    config = base / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))

    proc = start_fit(config, env={**inputs.env, SIGTERM_AT_STEP_ENV: str(PREEMPTED_SIGTERM_STEP)})
    stdout, stderr = proc.communicate(timeout=600)
    first = (proc.returncode, stdout, stderr)
    stopped = int(stdout.split("stopped by SIGTERM after step ")[1].split(":")[0]) if proc.returncode == 0 else -1
    left = (out / "checkpoints" / f"step_{stopped:08d}").is_dir() and not (out / "last.pth").exists()

    # the resumes: the run's starting weights are gone (an empty rfdetr cache on a recreated VM); the checkpoint has all
    cfg["model"]["pretrain_weights"] = str(base / "gone" / "fine-tuned-from.pth")
    config.write_text(yaml.safe_dump(cfg))
    proc = start_fit(config, env={**inputs.env, "SPMD_RFDETR_TEST_PAUSE_BEFORE_PUBLISH_S": "600"})
    partial = out / "checkpoints" / ".step_00000008.partial"
    wait_for(lambda: (partial / "meta.json").exists(), proc, "the step-8 save")
    proc.kill()
    proc.communicate()
    killed = {r["step"]: r["loss"] for r in read_metrics(out)}

    proc = start_fit(config, env=inputs.env)
    stdout, stderr = proc.communicate(timeout=1800)
    return PreemptedRun(out, stopped, first, left, partial, killed, (proc.returncode, stdout, stderr))

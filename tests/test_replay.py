"""Trace once, replay (``trainer.step_mode=replay``) against lazy tracing and eager CPU references.

The fit-level tests compare the session's replayed loop fit (``conftest.loop_run``) with the same fit in trace mode
(stopped early by an in-process SIGTERM). The rest use a toy model through the same ``TrainStep`` /
:class:`Replayer` (graphs that compile in seconds).
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

from support.models import EVAL_EVERY, FIT_WARMUP, LOOP_STEPS, TRACE_STEPS
from support.runs import read_metrics
from spmd_rfdetr.config.options import OptimOptions
from spmd_rfdetr.training.metrics import xla_counters
from spmd_rfdetr.training.optim import DeviceLRSchedule, lr_factor
from spmd_rfdetr.xla.replay import DONATE_ON_CPU_ENV, Replayer, ReplayUnsafe
from spmd_rfdetr.training.step import TrainStep


@pytest.mark.slow
def test_replay_fit_equals_trace_fit_through_warmup_into_cosine(loop_run, trace_fit_run):
    """The session's replayed loop fit against the same fit traced every step: the same losses, gradient norms and LRs
    (computed on the device: rfdetr-style warm-up then cosine) at every step the trace run made; the replay run's
    step Python ran twice (trace + check), trace mode's every step. (Measured 2026-12-01: losses bit-equal over these
    steps, gradient norms an ulp apart at some; XLA's CPU client varies between identical runs: test_resume.py.)
    A replay that reads stale state or bakes a per-step value is off by far more (test_replayed_toy_training...)."""
    replay, trace = read_metrics(loop_run), read_metrics(trace_fit_run)
    assert [r["step"] for r in replay] == list(range(1, LOOP_STEPS + 1))
    assert TRACE_STEPS <= len(trace) < LOOP_STEPS and [r["step"] for r in trace] == list(range(1, len(trace) + 1))
    assert {r["step_mode"] for r in replay} == {"replay"} and {r["step_mode"] for r in trace} == {"trace"}
    for a, b in zip(replay, trace):  # two identical replay runs differ by up to 4.6e-7 over 12 steps: 1e-5
        for key in ("loss", "loss_ce", "loss_bbox", "loss_giou", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key, a[key], b[key])
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-6, abs=1e-12), (a["step"], a["lr"], b["lr"])
        assert a["matcher_unconverged"] == b["matcher_unconverged"] == 0  # still read under replay
    lrs = [r["lr"] for r in replay]
    expected = [4e-4 * lr_factor(s, replay_cfg_optim(), LOOP_STEPS) for s in range(LOOP_STEPS)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-6)
    assert lrs[FIT_WARMUP - 1] > lrs[0] and lrs[-1] < lrs[FIT_WARMUP]
    assert replay[-1]["step_traces"] == 2 and trace[-1]["step_traces"] == len(trace)
    # a fresh state hashes as a stepped one (hold_as_device_data): trace mode's step 2 reuses step 1's program
    assert trace[0]["xla_new_compiles"] >= 1 and trace[1]["xla_new_compiles"] == 0, trace[:2]


def replay_cfg_optim() -> OptimOptions:
    return OptimOptions(warmup_steps=FIT_WARMUP, schedule="cosine")


@pytest.mark.slow
def test_a_fresh_fit_compiles_the_step_once(fit_run):
    """Optimizer state exists before the first trace: step 1 compiles the steady-state program, step 2 nothing."""
    records = read_metrics(fit_run)
    assert records[0]["xla_new_compiles"] == 1, records[0]
    assert [r["xla_new_compiles"] for r in records[1:EVAL_EVERY - 1]] == [0] * (EVAL_EVERY - 2)
    # one program per step: torch_xla records an execution when its execution thread finishes, which can land just
    # after the step's stats were read at that log point, so the count is exact over the window, not per record
    window = records[EVAL_EVERY - 2]["xla_executions"] - records[1]["xla_executions"]
    assert abs(window - (EVAL_EVERY - 3)) <= 1, window


# ---------------------------------------------------------------------------------------------------- toy step


class ToyDetector(torch.nn.Module):
    """A few parameters shaped like a detector's outputs (what TrainStep's forward_loss calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 6)

    def forward(self, samples):
        feats = self.conv(samples.tensors).mean(dim=(2, 3))
        out = self.head(feats)
        return {"pred_logits": out[:, None, :2], "pred_boxes": out[:, None, 2:].sigmoid()}


class ToyCriterion(torch.nn.Module):
    """L1 to the first target box; ``bake`` multiplies the loss by a Python float that changes every call."""

    def __init__(self, bake: bool = False) -> None:
        super().__init__()
        self.matcher, self.weight_dict, self.bake, self.calls = object(), {"loss_bbox": 1.0}, bake, 0

    def forward(self, outputs, batch):
        loss = (outputs["pred_boxes"][:, 0] - batch["boxes"][:, 0]).abs().mean() + outputs["pred_logits"].pow(2).mean()
        if self.bake:
            self.calls += 1
            loss = loss * (1.0 + 0.25 * self.calls)  # a per-step Python value: frozen by a replayed program
        return {"loss_bbox": loss}


def toy_batches(count: int, batch: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"images": torch.randint(0, 256, (batch, 3, 8, 8), generator=g, dtype=torch.uint8),
             "boxes": torch.rand(batch, 2, 4, generator=g),
             "labels": torch.zeros(batch, 2, dtype=torch.int64), "valid": torch.ones(batch, 2, dtype=torch.bool)}
            for _ in range(count)]


def toy_optim() -> OptimOptions:
    return OptimOptions(lr=0.05, weight_decay=0.01, warmup_steps=2, schedule="cosine", clip_max_norm=0.5)


def eager_toy_losses(batches, bake: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same toy training on the CPU: torch AdamW + clipping + the Python schedule :func:`lr_factor`."""
    from spmd_rfdetr.training.step import forward_loss

    torch.manual_seed(0)
    net, criterion, optim = ToyDetector(), ToyCriterion(bake), toy_optim()
    optimizer = torch.optim.AdamW(net.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
    losses = []
    for step, batch in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = optim.lr * lr_factor(step, optim, len(batches))
        optimizer.zero_grad()
        loss, _ = forward_loss(net, criterion, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), optim.clip_max_norm)
        optimizer.step()
        losses.append(loss.item())
    return losses, net.state_dict()


def mesh_toy_step(mesh_trainer, bake: bool, steps: int, mode: str = "replay") -> TrainStep:
    torch.manual_seed(0)
    net = ToyDetector()
    optimizer = torch.optim.AdamW(net.parameters(), lr=toy_optim().lr, weight_decay=toy_optim().weight_decay,
                                  capturable=True)
    net, optimizer = mesh_trainer.fabric.setup(net, optimizer)
    schedule = DeviceLRSchedule(optimizer, toy_optim(), steps)
    return TrainStep(net, ToyCriterion(bake), optimizer, clip_max_norm=toy_optim().clip_max_norm, schedule=schedule,
                     mode=mode)


def run_toy(mesh_trainer, batches, bake: bool, mode: str) -> tuple[TrainStep, list[float], dict[str, torch.Tensor]]:
    step = mesh_toy_step(mesh_trainer, bake, len(batches), mode)
    losses = [step.read(step(mesh_trainer.to_device(b)))["loss"] for b in batches]
    return step, losses, {k: v.cpu() for k, v in step.model.state_dict().items()}


@pytest.mark.parametrize("bake", [False, True], ids=["device-values", "baked-python-float"])
def test_replayed_toy_training_equals_eager_and_a_baked_value_falls_back(mesh_trainer, bake, caplog):
    steps = 6
    cpu_batches = toy_batches(steps)
    ref_losses, ref_state = eager_toy_losses(cpu_batches, bake)
    with caplog.at_level(logging.WARNING, logger="spmd_rfdetr.training.step"):
        step, losses, state = run_toy(mesh_trainer, cpu_batches, bake, "replay")
    _, trace_losses, trace_state = run_toy(mesh_trainer, cpu_batches, bake, "trace")
    assert losses == pytest.approx(trace_losses, rel=1e-6)  # replay == lazy tracing, step for step
    assert all(p.grad is None for p in step.model.parameters())  # the gradients end with the step
    for k, v in trace_state.items():
        assert (state[k] - v).abs().max() <= 1e-6, k
    # and both == eager CPU torch (AdamW's update divides by sqrt(v): near-zero gradient entries move by ~lr on
    # float noise, so the weights get an lr-sized tolerance, the losses a tight one)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    for k, v in ref_state.items():
        np.testing.assert_allclose(state[k].numpy(), v.numpy(), atol=toy_optim().lr * 0.01, err_msg=k)
    if bake:  # caught at the step-2 check, the run went on lazily tracing: right values, not stale ones
        assert step.mode == "trace" and "constant input(s) of the step changed value" in step.fallback_reason
        assert "NOT safe" in caplog.text and step.traces == 2 + (steps - 2)
    else:
        assert step.mode == "replay" and step.fallback_reason == "" and step.traces == 2
        assert "NOT safe" not in caplog.text


def test_a_pending_tensor_outside_the_state_refuses_replay(mesh_trainer):
    """A step that leaves a computed tensor on an object it does not declare: traced, refused, then run lazily."""
    holder: dict[str, torch.Tensor] = {}
    weight = torch.ones(8, device=torch_xla.device())
    torch_xla.sync()

    def fn(batch):
        holder["side"] = batch["x"].sum() * 2  # not in state(): a replay would never update it
        weight.add_(batch["x"].mean(0))
        return weight.sum()

    replayer = Replayer(fn, lambda: [weight])
    x = mesh_trainer.to_device({"x": torch.ones(8, 8)})
    with pytest.raises(ReplayUnsafe, match="pending work outside its state") as refused:
        replayer(x)
    torch_xla.sync()  # the step's own lazy trace runs: nothing lost, nothing run twice
    assert weight.cpu().tolist() == [2.0] * 8
    assert refused.value.result.cpu().item() == 16.0 and holder["side"].cpu().item() == 128.0
    assert not replayer.programs


def test_a_pending_tensor_in_unreachable_garbage_does_not_refuse_replay(mesh_trainer):
    """A pending tensor left only in a reference cycle (garbage until a collection) is no stray: the scan collects
    before it refuses."""
    weight = torch.ones(8, device=torch_xla.device())
    torch_xla.sync()

    def fn(batch):
        cycle = {"side": batch["x"].sum() * 2}
        cycle["self"] = cycle  # unreachable once fn returns, freed only by gc.collect
        weight.add_(batch["x"].mean(0))
        return weight.sum()

    replayer = Replayer(fn, lambda: [weight])
    x = mesh_trainer.to_device({"x": torch.ones(8, 8)})
    assert replayer(x).cpu().item() == 16.0
    assert len(replayer.programs) == 1


def test_another_batch_signature_traces_its_own_program(mesh_trainer):
    """Shape or sharding changes -> a new trace and program (counted), never the old program on the new batch."""
    weight = torch.zeros(4, device=torch_xla.device())
    torch_xla.sync()
    replayer = Replayer(lambda b: weight.add_(b["x"].sum(0)[:4]).sum(), lambda: [weight])
    sharded = mesh_trainer.to_device({"x": torch.ones(8, 4)})
    replicated = {"x": torch.ones(8, 4).to(torch_xla.device())}
    xs.mark_sharding(replicated["x"], mesh_trainer.fabric.strategy.mesh, (None, None))
    wider = mesh_trainer.to_device({"x": torch.ones(8, 6)})
    before = xla_counters()["xla_compiles"]
    totals = [replayer(b).cpu().item() for b in (sharded, sharded, replicated, wider, sharded)]
    assert totals == [32.0, 64.0, 96.0, 128.0, 160.0]  # 8 per element added each step, whichever program ran
    assert replayer.traces == 3 and len(replayer.programs) == 3
    assert xla_counters()["xla_compiles"] - before == 3


def test_an_input_the_step_only_reads_is_read_fresh_after_the_check(mesh_trainer):
    """A state tensor the step reads but never writes (a frozen weight, a learning rate set by hand) stays matched to
    its tensor across traces: a replay after the step-2 check sees a new value set between steps, not a stale copy."""
    weight, scale = torch.zeros(4).to(torch_xla.device()), torch.ones(4).to(torch_xla.device())
    torch_xla.sync()
    replayer = Replayer(lambda b: weight.add_(b["x"].sum(0) * scale).sum(), lambda: [weight, scale])
    x = mesh_trainer.to_device({"x": torch.ones(8, 4)})
    assert replayer(x).cpu().item() == 32.0  # traced: every weight 8
    result, problem = replayer.check(x)
    assert problem == "" and result.cpu().item() == 64.0
    scale.data = torch.full((4,), 2.0).to(torch_xla.device())  # set outside the step
    assert replayer(x).cpu().item() == 128.0 and replayer.traces == 2  # replayed with scale 2: every weight 32


def test_precompiled_programs_leave_the_state_alone_and_train_as_compiled_at_first_use(mesh_trainer):
    """Multi-scale buckets compiled before step 1 (``TrainStep.precompile``): compiling runs nothing and leaves every
    weight, AdamW moment, LR and step count as it was; the steps then compile nothing and give the losses and weights
    of a run that compiles each size at its first use."""
    sizes = [8, 12, 8, 8, 12, 12, 8]
    batches = toy_batches(len(sizes))
    for batch, size in zip(batches, sizes):
        batch["images"] = torch.nn.functional.interpolate(batch["images"], size=(size, size), mode="bilinear")
    lazy = mesh_toy_step(mesh_trainer, False, len(sizes))
    lazy_losses = [lazy.read(lazy(mesh_trainer.to_device(b)))["loss"] for b in batches]

    step = mesh_toy_step(mesh_trainer, False, len(sizes))
    before = [t.cpu() for t in step.state()]
    counters = xla_counters()
    assert [step.precompile(mesh_trainer.to_device(batches[i])) for i in (0, 1, 2)] == [True, True, False]
    after = xla_counters()
    assert after["xla_compiles"] - counters["xla_compiles"] <= 2  # 0 if the first run's programs are in the cache
    assert after["xla_executions"] == counters["xla_executions"]  # compiled, never run
    assert all(torch.equal(a, b) for a, b in zip(before, [t.cpu() for t in step.state()]))
    assert all(p.grad is None for p in step.model.parameters())
    compiles = xla_counters()["xla_compiles"]
    losses = [step.read(step(mesh_trainer.to_device(b)))["loss"] for b in batches]
    assert xla_counters()["xla_compiles"] == compiles
    assert step.mode == "replay" and step.traces == 3  # two precompiles + the check at step 1
    assert losses == pytest.approx(lazy_losses, rel=1e-6) and len(set(losses)) == len(losses)
    for k, v in lazy.model.state_dict().items():
        assert torch.equal(step.model.state_dict()[k].cpu(), v.cpu()), k


def test_a_program_dropped_from_the_compilation_cache_is_compiled_again(mesh_trainer):
    """torch_xla's compilation cache is an LRU (``XLA_COMPILATION_CACHE_SIZE``, bounded in conftest): a replayed
    program it dropped is traced and compiled again, not a crash."""
    from support.environment import COMPILATION_CACHE_SIZE

    weight = torch.zeros(4, device=torch_xla.device())
    torch_xla.sync()
    replayer = Replayer(lambda b: weight.add_(b["x"].sum(0)).sum(), lambda: [weight])
    x = mesh_trainer.to_device({"x": torch.ones(8, 4)})
    assert replayer(x).cpu().item() == 32.0
    for size in range(1, COMPILATION_CACHE_SIZE + 2):  # more new programs than the cache holds
        torch.ones(size, device=torch_xla.device()).mul(3).sum().cpu()
    assert replayer(x).cpu().item() == 64.0 and replayer.traces == 2


@pytest.mark.parametrize("setting", [None, "1"], ids=["default", "on"])
def test_a_replay_on_the_cpu_donates_the_state_it_updates_only_when_asked(mesh_trainer, monkeypatch, setting):
    """With ``SPMD_RFDETR_DONATE_ON_CPU=1`` (as a TPU always does) the replayed program reuses the buffers of the
    state it updates for its results: a reference to the pre-step data is gone after the replay. By default, on XLA's
    CPU client, that data stays readable (``replay._compile``: why)."""
    import torch_xla.core.xla_model as xm

    if setting is None:
        monkeypatch.delenv(DONATE_ON_CPU_ENV, raising=False)
    else:
        monkeypatch.setenv(DONATE_ON_CPU_ENV, setting)
    weight = torch.zeros(4, device=torch_xla.device())
    torch_xla.sync()
    replayer = Replayer(lambda b: weight.add_(b["x"].sum(0)).sum(), lambda: [weight])
    x = mesh_trainer.to_device({"x": torch.ones(8, 4)})
    assert replayer(x).cpu().item() == 32.0  # traced and compiled (donating or not), then run
    before = weight.detach()  # the pre-step data of the next replay
    assert replayer(x).cpu().item() == 64.0
    xm.wait_device_ops()
    if setting == "1":
        with pytest.raises(RuntimeError, match="HasValue"):
            before.cpu()
    else:
        assert before.cpu().tolist() == [8.0] * 4

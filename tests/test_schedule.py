"""The LR schedule against rfdetr's own (``rfdetr.training.module_model._build_managed_scheduler``), and on the mesh.

rfdetr 1.11.2's managed schedule is a ``LambdaLR``: linear warm-up ``s / w`` (0 at the first step), then cosine to
``min_factor`` (default 0.0) or a 10x drop after ``lr_drop`` epochs (default 100); its default preset is ``step``.
Ours (:func:`spmd_rfdetr.training.optim.lr_factor`, computed on the device by :class:`DeviceLRSchedule`) keeps its cosine and
step formulas, and deliberately differs in: the warm-up ``(s + 1) / (w + 1)`` (never 0), the defaults (cosine,
``min_lr_factor`` 0.05), the drop step counted in steps, and a ``constant`` kind (rfdetr has none). Each test below
pins one agreement or one difference.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from rfdetr.config import _MANAGED_SCHEDULER_DEFAULTS, TrainConfig
from rfdetr.training.module_model import _build_managed_scheduler

from spmd_rfdetr.config.options import OptimOptions
from spmd_rfdetr.training.optim import DeviceLRSchedule, lr_factor

F32 = 1e-6  # the device schedule computes in float32


def rfdetr_factors(kind: str, total: int, warmup: int, steps_per_epoch: int = 1, **kwargs: float) -> list[float]:
    """The LR factor rfdetr's managed scheduler gives each optimizer step (read before the step, as it is used)."""
    config = TrainConfig(dataset_dir=".", output_dir=".", lr_scheduler=kind, lr_scheduler_kwargs=kwargs)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = _build_managed_scheduler(optimizer, config, total, steps_per_epoch, warmup)
    factors = []
    for _ in range(total):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return factors


def our_factors(optim: OptimOptions, total: int) -> list[float]:
    """The factor :class:`DeviceLRSchedule` (the one ``fit`` uses) sets for each step, here on CPU tensors (base LR 1,
    so the float32 LR is the factor itself)."""
    optim = dataclasses.replace(optim, lr=1.0)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr, capturable=True)
    schedule = DeviceLRSchedule(optimizer, optim, total)
    factors = []
    for _ in range(total):
        factors.append(float(optimizer.param_groups[0]["lr"]))
        schedule.step()
    return factors


@pytest.mark.parametrize("min_factor", [0.0, 0.05])
@pytest.mark.parametrize("warmup", [0, 5])
def test_cosine_after_warmup_is_rfdetrs(warmup: int, min_factor: float) -> None:
    total = 40
    ours = our_factors(OptimOptions(schedule="cosine", warmup_steps=warmup, min_lr_factor=min_factor), total)
    theirs = rfdetr_factors("cosine", total, warmup, min_factor=min_factor)
    assert ours[warmup:] == pytest.approx(theirs[warmup:], rel=F32, abs=F32)
    assert ours[warmup] == theirs[warmup] == 1.0
    last = min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * (total - 1 - warmup) / (total - warmup)))
    assert ours[-1] == pytest.approx(last, abs=F32)
    assert ours == pytest.approx([lr_factor(s, OptimOptions(schedule="cosine", warmup_steps=warmup,
                                                            min_lr_factor=min_factor), total) for s in range(total)],
                                 rel=F32, abs=F32)  # the device formula is the Python one


def test_warmup_differs_from_rfdetrs_by_one_step() -> None:
    """rfdetr's warm-up starts at factor 0 (its first step does not move the weights); ours at 1 / (w + 1)."""
    warmup, total = 4, 12
    ours = our_factors(OptimOptions(schedule="cosine", warmup_steps=warmup), total)
    theirs = rfdetr_factors("cosine", total, warmup)
    assert theirs[:warmup] == [s / warmup for s in range(warmup)] and theirs[0] == 0.0
    assert ours[:warmup] == pytest.approx([(s + 1) / (warmup + 1) for s in range(warmup)], rel=F32)
    assert all(o > t for o, t in zip(ours[:warmup], theirs[:warmup]))
    assert ours[warmup] == theirs[warmup] == 1.0  # both reach the peak at step `warmup`


def test_step_schedule_is_rfdetrs_counted_in_steps() -> None:
    """rfdetr drops 10x after ``lr_drop`` epochs; ours after ``lr_drop_step`` optimizer steps (epochs x steps/epoch)."""
    total, steps_per_epoch, drop_epochs, warmup = 50, 10, 3, 5
    ours = our_factors(OptimOptions(schedule="step", warmup_steps=warmup, lr_drop_step=drop_epochs * steps_per_epoch),
                       total)
    theirs = rfdetr_factors("step", total, warmup, steps_per_epoch, lr_drop=drop_epochs)
    assert ours[warmup:] == pytest.approx(theirs[warmup:], rel=F32)
    assert ours[29] == theirs[29] == 1.0 and ours[30] == pytest.approx(0.1) and theirs[30] == pytest.approx(0.1)
    # lr_drop_step=0 never drops (rfdetr's default drop is at epoch 100)
    assert set(our_factors(OptimOptions(schedule="step", lr_drop_step=0), 20)) == {1.0}


def test_constant_is_rfdetrs_step_schedule_before_its_drop() -> None:
    """rfdetr has no constant preset: its ``step`` preset before the drop is the same thing."""
    total, warmup = 20, 3
    ours = our_factors(OptimOptions(schedule="constant", warmup_steps=warmup), total)
    theirs = rfdetr_factors("step", total, warmup, lr_drop=1000)
    assert ours[warmup:] == theirs[warmup:] == [1.0] * (total - warmup)
    assert our_factors(OptimOptions(schedule="constant"), total) == [1.0] * total


def test_our_defaults_differ_from_rfdetrs_as_documented() -> None:
    """The differences ``OptimOptions``' docstrings state: cosine (rfdetr: step) down to 0.05 (rfdetr: 0.0)."""
    import inspect

    from spmd_rfdetr.config import options as config

    ours, theirs = OptimOptions(), TrainConfig(dataset_dir=".", output_dir=".")
    assert (ours.schedule, theirs.lr_scheduler) == ("cosine", "step")
    assert (ours.min_lr_factor, _MANAGED_SCHEDULER_DEFAULTS["min_factor"]) == (0.05, 0.0)
    assert (ours.warmup_steps, theirs.warmup_epochs) == (0, 0.0)
    source = " ".join(inspect.getsource(config.OptimOptions).split())
    for said in ("rfdetr's default is ``step``", "rfdetr's default ``min_factor`` is 0.0", "(s + 1) / (w + 1)",
                 "rfdetr's is ``s / w``"):
        assert said in source, said


# ------------------------------------------------------------------------------------------- on the XLA mesh
def toy_step(optim: OptimOptions, max_steps: int, schedule: bool):
    """A toy model through the real :class:`TrainStep` in ``trace`` mode: the step's Python runs every call, so a
    value baked into the graph shows up as a new compile."""
    from test_replay import ToyCriterion, ToyDetector

    from spmd_rfdetr.xla.fabric import spmd_fabric
    from spmd_rfdetr.training.step import TrainStep

    fabric = spmd_fabric()
    torch.manual_seed(0)
    net = ToyDetector()
    optimizer = torch.optim.AdamW(net.parameters(), lr=optim.lr, weight_decay=optim.weight_decay, capturable=True)
    net, optimizer = fabric.setup(net, optimizer)
    lrs = DeviceLRSchedule(optimizer, optim, max_steps) if schedule else None
    step = TrainStep(net, ToyCriterion(), optimizer, clip_max_norm=optim.clip_max_norm, schedule=lrs, mode="trace")
    return fabric, step


def test_a_factor_of_exactly_1_or_0_compiles_nothing_new() -> None:
    """torch_xla bakes a Python scalar of exactly 0 or +-1 into the graph as a constant (any other value is passed as
    data), so a Python LR would compile a new graph the step its factor hits 0. The device schedule hits 1.0 (the end
    of warm-up) and 0.0 (cosine to ``min_lr_factor`` 0, one step past ``max_steps``) without compiling anything after
    the first step. The same run with Python-float LRs (the control) does compile at the factor-0 step: the counters
    see a baked value."""
    from test_replay import toy_batches

    from spmd_rfdetr.training.metrics import xla_counters

    optim = OptimOptions(lr=0.05, weight_decay=0.01, warmup_steps=2, schedule="cosine", min_lr_factor=0.0,
                         clip_max_norm=0.5)
    max_steps = 5
    batches = toy_batches(max_steps + 1)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731

    def run(schedule: bool) -> tuple[list[float], list[int]]:
        fabric, step = toy_step(optim, max_steps, schedule)
        used, compiles = [], []
        for i, batch in enumerate(batches):
            if not schedule:
                for group in step.optimizer.param_groups:
                    group["lr"] = optim.lr * lr_factor(i, optim, max_steps)
            before = xla_counters()["xla_compiles"]
            stats = step.read(step(fabric.strategy.process_dataloader([batch]).to_device(batch)))
            compiles.append(xla_counters()["xla_compiles"] - before)
            used.append(stats["lr"])
        return used, compiles

    used, compiles = run(schedule=True)
    assert used[optim.warmup_steps] == f32(optim.lr) and used[-1] == 0.0, used  # factors exactly 1.0 and 0.0
    assert used[0] == f32(optim.lr / 3) and 0 < used[-2] < used[optim.warmup_steps], used
    assert compiles[0] >= 1 and compiles[1:] == [0] * max_steps, compiles

    control, control_compiles = run(schedule=False)
    assert control == pytest.approx(used, rel=F32, abs=1e-12)
    assert control_compiles[-1] >= 1 and control_compiles[1:-1] == [0] * (max_steps - 1), control_compiles

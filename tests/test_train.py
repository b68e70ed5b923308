"""The training step on the 4-device CPU mesh against upstream rfdetr's own eager CPU step."""

from __future__ import annotations

import torch
import torch_xla
import torch_xla.debug.metrics as met

from spmd_rfdetr.loss import total_loss
from spmd_rfdetr.metrics import aten_fallbacks
from spmd_rfdetr.model import build_optimizer, build_upstream_criterion
from spmd_rfdetr.step import as_samples
from spmd_rfdetr.data import targets_list

PARITY_STEPS = 5


def sharding(t: torch.Tensor) -> str:
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def upstream_eager_steps(tiny, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """Upstream rfdetr's step on the CPU: its model, its SetCriterion (SciPy matcher), AdamW, clipping."""
    net = tiny.model()
    criterion = build_upstream_criterion(tiny.cfgs)[0].train()
    optimizer = build_optimizer(net, tiny.cfgs)
    losses, first_grads = [], []
    for i in range(steps):
        batch = tiny.batches[i % len(tiny.batches)]
        optimizer.zero_grad(set_to_none=True)
        loss_dict = criterion(net(as_samples(batch["images"])), targets_list(batch))
        loss = total_loss(loss_dict, criterion.weight_dict)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), tiny.cfg.optim.clip_max_norm)
        if i == 0:
            first_grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in net.parameters()]
        optimizer.step()
        losses.append(loss.item())
    return losses, first_grads


def test_batch_sharded_on_data_axis_params_replicated(tiny, mesh_trainer):
    batch = mesh_trainer.to_device(tiny.batches[0])
    assert sharding(batch["images"]) == "{devices=[4,1,1,1]0,1,2,3}"
    assert sharding(batch["boxes"]) == "{devices=[4,1,1]0,1,2,3}"
    assert sharding(batch["valid"]) == "{devices=[4,1]0,1,2,3}"
    assert batch["valid"].dtype == torch.bool
    for p in mesh_trainer.model.parameters():
        assert p.device.type == "xla"
        assert sharding(p) in ("", "{replicated}")


def test_parity_with_upstream_eager_step(tiny, mesh_trainer):
    ref_losses, ref_grads = upstream_eager_steps(tiny, PARITY_STEPS)
    losses = []
    for i in range(PARITY_STEPS):
        stats = mesh_trainer.step.read(mesh_trainer.step(mesh_trainer.to_device(tiny.batches[i % len(tiny.batches)])))
        losses.append(stats["loss"])
        if i == 0:
            grads = [
                p.grad.cpu() if p.grad is not None else torch.zeros(p.shape) for p in mesh_trainer.model.parameters()
            ]
            diff = torch.sqrt(sum(((g - r) ** 2).sum() for g, r in zip(grads, ref_grads)))
            norm = torch.sqrt(sum((r**2).sum() for r in ref_grads))
            assert abs(losses[0] - ref_losses[0]) <= 1e-5 * abs(ref_losses[0]), (losses[0], ref_losses[0])
            assert diff / norm <= 1e-4, f"gradient relative L2 error {float(diff / norm):.3g}"
    for ours, ref in zip(losses, ref_losses):
        assert abs(ours - ref) <= 1e-3 * abs(ref), (losses, ref_losses)
    print(f"parity: losses ours {losses} upstream {ref_losses}; step-1 grad rel L2 {float(diff / norm):.3g}")


def test_two_steps_finite_bool_masks_no_cpu_fallbacks(tiny, mesh_trainer):
    mesh_trainer.backbone_mask_dtypes.clear()
    for i in range(2):
        stats = mesh_trainer.step.read(mesh_trainer.step(mesh_trainer.to_device(tiny.batches[i])))
        assert torch.isfinite(torch.tensor(stats["loss"])), stats
    assert mesh_trainer.backbone_mask_dtypes == [torch.bool, torch.bool]
    assert aten_fallbacks() == {}, aten_fallbacks()
    assert not [n for n in met.counter_names() if "grid_sampler" in n]


def test_bf16_reaches_the_step_hlo(tiny, mesh_trainer):
    """precision=bf16 (what `fit` uses): fp32 weights, bf16 compute in the HLO handed to XLA."""
    from spmd_rfdetr.fabric import spmd_fabric

    batch = mesh_trainer.to_device(tiny.batches[0])
    for precision, expect_bf16 in (("bf16-mixed", True), ("32-true", False)):
        net = spmd_fabric(precision=precision).setup_module(tiny.model())
        logits = net(as_samples(batch["images"]))["pred_logits"]
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([logits])
        assert ("bf16" in hlo) is expect_bf16, precision
        assert all(p.dtype == torch.float32 for p in net.parameters())
        del net, logits  # drop the traced graph unexecuted

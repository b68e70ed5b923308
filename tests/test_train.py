"""The training step on the 4-device CPU mesh against upstream rfdetr's own eager CPU step."""

from __future__ import annotations

import copy
import dataclasses
import types
from pathlib import Path

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

from support.models import FIRST_STEPS, first_step_gradients, parity_tolerance
from jobs import JobInputs, job_fixture

from spmd_rfdetr.training.metrics import aten_fallbacks, xla_counters
from spmd_rfdetr.model.upstream import build_upstream_criterion
from spmd_rfdetr.training.optim import build_optimizer



def sharding(t: torch.Tensor) -> str:
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def upstream_steps(tiny, steps: int, on_xla: bool = False, net: torch.nn.Module | None = None,
                   first_batch: int = 0) -> tuple[list[float], list[torch.Tensor]]:
    """Upstream rfdetr's own step, from upstream's own pieces only: its model on ``nested_tensor_from_tensor_list``
    samples of its own host float pipeline on the batch's uint8 pixels (``ToDtype`` + ``Normalize``:
    :func:`~spmd_rfdetr.data.pixels.upstream_float`; a float32 batch is taken as that input already), its SetCriterion
    (SciPy matcher) on each image's real boxes (on XLA padded by its own ``pad_targets_to_fixed_count``, its XLA path), the weighted sum of its training module, AdamW over its parameter
    groups, clipping. On the CPU (eager torch, plain AdamW as rfdetr trains), or ``on_xla``: on the XLA device, traced
    lazily by torch_xla (graphs cut where upstream's matcher reads the costs on the host) with AdamW ``capturable``
    (step count on the device), the numerics our compiled step uses. (torch_xla's eager mode, which ran it op by op
    until 2026-11-30, segfaults at random under SPMD: in the forward or in AdamW, about 1 run in 4.) ``net``: train
    this CPU model (in place) instead of a fresh one at the initial weights; ``first_batch``: the index of step 1's
    batch."""
    from rfdetr.utilities.tensors import nested_tensor_from_tensor_list, pad_targets_to_fixed_count

    from spmd_rfdetr.data.pixels import upstream_float

    device = torch_xla.device() if on_xla else torch.device("cpu")
    net = (tiny.model() if net is None else net).to(device)
    criterion = build_upstream_criterion(tiny.cfgs)[0].train().to(device)
    optimizer = build_optimizer(net, tiny.cfgs, on_device=on_xla)
    losses, first_grads = [], []
    for i in range(steps):
        batch = tiny.batches[(first_batch + i) % len(tiny.batches)]
        targets = [{"labels": labels[keep], "boxes": boxes[keep]}
                   for labels, boxes, keep in zip(batch["labels"], batch["boxes"], batch["valid"])]
        if on_xla:
            targets = pad_targets_to_fixed_count(targets, batch["labels"].shape[1])
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        images = batch["images"]  # uint8 pixels through upstream's own ToDtype + Normalize; float: its input already
        images = upstream_float(images) if images.dtype == torch.uint8 else images
        samples = nested_tensor_from_tensor_list(list(images)).to(device)
        optimizer.zero_grad(set_to_none=True)
        loss_dict = criterion(net(samples), targets)
        weight_dict = criterion.weight_dict  # rfdetr's RFDETRModelModule.training_step
        loss = torch.stack([loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict]).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), tiny.cfg.optim.clip_max_norm)
        if on_xla:
            torch_xla.sync()  # one graph for the loss and gradients, not one per tensor read below
        if i == 0:
            first_grads = [p.grad.cpu() if p.grad is not None else torch.zeros(p.shape) for p in net.parameters()]
        optimizer.step()
        if on_xla:
            torch_xla.sync()
        losses.append(loss.item())
    return losses, first_grads


#: One child process on the same 4-device mesh runs what would crowd the session's bounded compilation cache (its
#: shared programs would be evicted) or misbehaved inside the session's process after its many programs:
#: :func:`upstream_steps` ``on_xla`` (a handful of graphs per step, cut at each host matcher call) and our step with
#: ``trainer.matcher=scipy`` (its traced step, cut by the host solve, segfaulted in a sync there on a CI run).
XLA_CHILD = """
import dataclasses, json, sys, types, torch
import torch_xla.runtime as xr
xr.use_spmd()
sys.path.insert(0, sys.argv[2])
from spmd_rfdetr.training.build import build_trainer
from spmd_rfdetr.xla.fabric import spmd_fabric
from spmd_rfdetr.xla.mesh import build_mesh
from spmd_rfdetr.model.upstream import build_model, upstream_configs
from test_train import upstream_steps
saved = torch.load(sys.argv[1], weights_only=False)
cfg = saved["cfg"]
cfgs = upstream_configs(cfg.model, cfg.data, cfg.optim, num_classes=3)
def model():
    net = build_model(cfgs)
    net.load_state_dict(saved["init_state"])
    return net.train()
tiny = types.SimpleNamespace(cfg=cfg, cfgs=cfgs, batches=saved["batches"], model=model)
out = {"upstream_on_xla": upstream_steps(tiny, int(sys.argv[3]), on_xla=True)[0]}
fabric = spmd_fabric(build_mesh(), precision="32-true")
options = dataclasses.replace(cfg.trainer, matcher="scipy")
trainer = build_trainer(fabric, cfgs, cfg.optim, options, model=model(), ema=cfg.model)
to_device = fabric.strategy.process_dataloader(torch.utils.data.DataLoader(saved["batches"], batch_size=None)).to_device
stats = [trainer.step.read(trainer.step(to_device(b))) for b in saved["batches"][:int(sys.argv[4])]]
out.update(scipy=[s["loss"] for s in stats], scipy_mode=trainer.step.mode, scipy_stats=sorted(stats[0]))
print("RESULT", json.dumps(out))
"""
#: Steps of our step with the SciPy matcher, from the same weights as the device matcher's: what the matchers are
#: compared on is step 1's assignments (each such step took 1.5-2 min in the child, beside the in-process tests, in
#: trace mode: a second step after an update compared the same matchers again and was cut, 2026-12-02).
SCIPY_STEPS = 1
#: Upstream's steps on XLA: the two the 1e-5 bound holds for (later ones are compared on the CPU, within
#: parity_tolerance); each more is one more lazily traced step of several graphs in the child.
UPSTREAM_XLA_STEPS = 2


@job_fixture
def xla_child(inputs: JobInputs, out: Path) -> dict:
    """:data:`XLA_CHILD`'s results: upstream's step on XLA for UPSTREAM_XLA_STEPS steps, ours with the SciPy matcher for
    SCIPY_STEPS steps, from the tiny model's initial weights on the same batches."""
    import json
    import subprocess
    import sys

    tiny = inputs.tiny
    batches = tiny.batches[:max(SCIPY_STEPS, UPSTREAM_XLA_STEPS)]
    torch.save({"cfg": tiny.cfg, "init_state": tiny.init_state, "batches": batches}, out / "tiny.pt")
    tests = Path(__file__).resolve().parent
    env = {**inputs.env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    child = subprocess.run([sys.executable, "-X", "faulthandler", "-c", XLA_CHILD, str(out / "tiny.pt"), str(tests),
                            str(UPSTREAM_XLA_STEPS), str(SCIPY_STEPS)], cwd=tests.parent, env=env, capture_output=True,
                           text=True, timeout=1800)
    (out / "xla_child.err").write_text(child.stderr)
    stderr = "\n".join(line for line in child.stderr.splitlines() if "sharding_propagation" not in line)
    assert child.returncode == 0, stderr[-4000:]
    return json.loads(child.stdout.split("RESULT", 1)[1])


@pytest.mark.slow
def test_parity_with_upstream_eager_step(tiny, first_steps, xla_child):
    """Our compiled step on the mesh over FIRST_STEPS steps (conftest's ``first_steps``) against upstream rfdetr's own
    step: on the CPU, step 1's loss and gradients, then each step's loss within :func:`parity_tolerance` (why later
    steps need more: its docstring); on the same XLA device with the same (capturable) AdamW, steps 1-2 to 1e-5."""
    ref_losses, ref_grads = upstream_steps(tiny, FIRST_STEPS)
    same_device, losses, grads = xla_child["upstream_on_xla"], first_steps.losses, first_steps.grads
    diff = torch.sqrt(sum(((g - r) ** 2).sum() for g, r in zip(grads, ref_grads)))
    norm = torch.sqrt(sum((r**2).sum() for r in ref_grads))
    assert abs(losses[0] - ref_losses[0]) <= 1e-5 * abs(ref_losses[0]), (losses[0], ref_losses[0])
    assert diff / norm <= 1e-4, f"gradient relative L2 error {float(diff / norm):.3g}"
    assert len(losses) == len(ref_losses) == FIRST_STEPS and len(same_device) == UPSTREAM_XLA_STEPS
    for step, (ours, ref) in enumerate(zip(losses, ref_losses), start=1):
        assert abs(ours - ref) <= parity_tolerance(step) * abs(ref), (step, losses, ref_losses)
    for step, (ours, xla_ref) in enumerate(zip(losses, same_device), start=1):
        assert abs(ours - xla_ref) <= 1e-5 * abs(xla_ref), (step, losses, same_device)
    print(f"parity: losses ours {losses} upstream {ref_losses} upstream on XLA {same_device}; step-1 grad rel L2 "
          f"{float(diff / norm):.3g}")


#: Upstream's own steps, at TRAINED_LR_SCALE times the tiny config's LR, that move the tiny model away from its
#: initial weights before our step is compared with upstream's from there
#: (:func:`test_our_step_equals_upstreams_from_weights_upstream_trained`). 10 steps, not 15: on an AMD EPYC the best
#: image's ranking margin after 15 was 1.1e-5, after 10 4.7e-4 (the loss 23% below the initial weights'), on the
#: 12-block model; on the 4-block model of seed 5 (2026-12-07), 2.6e-5 (image 19, the median 2.4e-6; loss 7% below).
TRAINED_STEPS, TRAINED_LR_SCALE = 10, 20
#: The smallest relative gap between consecutive two-stage proposal scores (:func:`proposal_ranking_margins`) that the
#: compared image must have: on an AMD EPYC CPU (2026-12-07) a gap of 6.8e-7 flipped two proposals between upstream's
#: eager step and our compiled one (loss 11.4288 vs 11.4820), while upstream's float32 and float64 agreed.
MIN_RANKING_MARGIN = 1e-5


class _TopkInputs(torch.overrides.TorchFunctionMode):
    """Records the scores and ``k`` of every ``torch.topk`` call while active (the calls themselves run as they are)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.topk:
            self.calls.append((args[0].detach(), args[1]))
        return func(*args, **(kwargs or {}))


def proposal_ranking_margins(net: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Per image of ``batches`` (in order), upstream's eager forward of ``net``: the smallest relative gap between
    consecutive scores of its two-stage ranking (every group, the top k and the first one left out). Queries take
    the selected proposals in rank order with learned per-query features, so two scores within rounding of each
    other make two correct float32 programs select or order differently, and their losses part by far more than
    rounding."""
    from rfdetr.utilities.tensors import nested_tensor_from_tensor_list

    from spmd_rfdetr.data.pixels import upstream_float

    margins = []
    for batch in batches:
        with torch.no_grad(), _TopkInputs() as record:
            net(nested_tensor_from_tensor_list(list(upstream_float(batch["images"]))))
        (scores, k), = record.calls  # [group, image, positions]: one batched ranking of every group
        top = scores.sort(dim=-1, descending=True).values[..., :k + 1]
        margins.append(((top[..., :-1] - top[..., 1:]) / top[..., 1:].abs()).amin(dim=(0, 2)))
    return torch.cat(margins)


def one_image_batch(batches: list[dict[str, torch.Tensor]], image: int) -> dict[str, torch.Tensor]:
    """A batch of ``batches``' shapes holding its ``image``-th image (counted across batches) in every slot."""
    size = len(batches[0]["images"])
    batch, slot = divmod(image, size)
    return {k: v[slot:slot + 1].repeat(size, *[1] * (v.dim() - 1)) for k, v in batches[batch].items()}


@pytest.mark.slow
def test_our_step_equals_upstreams_from_weights_upstream_trained(tiny, mesh_trainer):
    """Issue 33's check, where the parity test stops: two correct runs part after a few steps (rounding reorders
    near-tied proposals, see ``parity_tolerance``), so later steps of two runs cannot be compared, but one step from
    the same weights can. Upstream's own eager step trains the tiny model for TRAINED_STEPS steps; from those weights,
    on a batch of one image repeated (the valid image whose proposal ranking is farthest from a tie, at least
    MIN_RANKING_MARGIN: a near tie is rounding's to decide, :func:`proposal_ranking_margins`), our compiled step (a
    fresh trainer on the session's programs: no compile) gives upstream's loss and clipped gradients within step 1's
    bounds. ``benchmarks/teacher_forced.py`` does the same along a real run (Nano, seed 7, through its unstable
    phase, with upstream's AdamW state: loss <= 2.4e-7, gradient direction <= 1.1e-5, the update <= 6.9e-5 at every
    point)."""
    from spmd_rfdetr.training.build import build_trainer

    train = tiny.cfgs.train
    fast = dataclasses.replace(tiny.cfgs, train=train.model_copy(update={
        "lr": train.lr * TRAINED_LR_SCALE, "lr_encoder": train.lr_encoder * TRAINED_LR_SCALE}))
    trained = tiny.model()
    upstream_steps(types.SimpleNamespace(cfg=tiny.cfg, cfgs=fast, batches=tiny.batches), TRAINED_STEPS, net=trained)
    margins = proposal_ranking_margins(trained, tiny.batches)
    image = int(margins.argmax())
    assert margins[image] >= MIN_RANKING_MARGIN, f"every image's proposals are near-tied: {margins.tolist()}"
    batch = one_image_batch(tiny.batches, image)
    one = types.SimpleNamespace(cfg=tiny.cfg, cfgs=tiny.cfgs, batches=[batch], model=tiny.model)
    ref_losses, ref_grads = upstream_steps(one, 1, net=copy.deepcopy(trained))
    init_loss = upstream_steps(one, 1)[0][0]
    trainer = build_trainer(mesh_trainer.fabric, tiny.cfgs, tiny.cfg.optim, tiny.cfg.trainer,
                            model=copy.deepcopy(trained), ema=tiny.cfg.model)
    stats = trainer.step.read(trainer.step(mesh_trainer.to_device(batch)))
    grads = first_step_gradients(trainer.optimizer, trainer.model.parameters())
    diff = torch.sqrt(sum(((g - r) ** 2).sum() for g, r in zip(grads, ref_grads)))
    norm = torch.sqrt(sum((r**2).sum() for r in ref_grads))
    print(f"from upstream-trained weights, valid image {image} (ranking margin {float(margins[image]):.2g}, median "
          f"{float(margins.median()):.2g}; its loss at the initial weights {init_loss:.4f}): loss ours {stats['loss']} "
          f"upstream {ref_losses[0]}; gradient rel L2 {float(diff / norm):.3g}")
    assert abs(ref_losses[0] - init_loss) >= 0.05 * init_loss, (ref_losses[0], init_loss)  # not the initial weights
    assert abs(stats["loss"] - ref_losses[0]) <= 1e-5 * abs(ref_losses[0]), (stats["loss"], ref_losses[0])
    assert diff / norm <= 1e-4, f"gradient relative L2 error {float(diff / norm):.3g}"


@pytest.mark.slow
def test_two_steps_finite_bool_masks_no_cpu_fallbacks(tiny, mesh_trainer):
    for i in range(2):
        stats = mesh_trainer.step.read(mesh_trainer.step(mesh_trainer.to_device(tiny.batches[i])))
        assert torch.isfinite(torch.tensor(stats["loss"])), stats
    # the backbone saw bool masks whenever the step's Python ran (replay: at its traces, not at every step)
    assert mesh_trainer.backbone_mask_dtypes and set(mesh_trainer.backbone_mask_dtypes) == {torch.bool}
    # `.item()` on an XLA tensor counts as aten::_local_scalar_dense, in any test of this process; inside the step it
    # cannot run (tracing disallows execution: test_a_stray_host_sync_in_the_step_fails_loudly), so only ops count
    ops = {name: n for name, n in aten_fallbacks().items() if name != "aten::_local_scalar_dense"}
    assert ops == {}, ops
    assert not [n for n in met.counter_names() if "grid_sampler" in n]


@pytest.mark.slow
def test_steady_state_one_graph_no_transfers_no_recompiles(tiny, mesh_trainer):
    """Issue 'zero host syncs': >= 5 steady-state steps = 5 executions, 0 transfers, 0 compiles, 0 fallbacks."""
    # warm-up: the step's one program exists (optimizer state is made before the first trace)
    mesh_trainer.step(mesh_trainer.to_device(tiny.batches[0]))
    batches = [mesh_trainer.to_device(b) for b in tiny.batches[:5]]
    torch_xla.sync()
    xm.wait_device_ops()  # a warm-up step still running would be counted in the window (replays are asynchronous)
    before = xla_counters()
    outputs = [mesh_trainer.step(b) for b in batches]
    xm.wait_device_ops()  # executions are counted when they finish; waiting transfers nothing
    after = xla_counters()
    assert after["xla_executions"] - before["xla_executions"] == 5
    assert after["xla_transfers_to_host"] == before["xla_transfers_to_host"]
    assert after["xla_compiles"] == before["xla_compiles"]
    assert after["xla_aten_fallbacks"] == before["xla_aten_fallbacks"]
    stats = mesh_trainer.step.read(outputs[-1])  # a log point: exactly one transfer
    assert xla_counters()["xla_transfers_to_host"] == after["xla_transfers_to_host"] + 1
    assert stats["matcher_unconverged"] == 0


@pytest.mark.slow
def upstream_ema(model: torch.nn.Module, decay: float, tau: int):
    """Upstream's trainer's EMA: torch's AveragedModel with rfdetr's ``RFDETREMACallback`` average (its own code)."""
    from rfdetr.training.callbacks.ema import RFDETREMACallback
    from torch.optim.swa_utils import AveragedModel

    callback = RFDETREMACallback(decay=decay, tau=tau)
    averaged = AveragedModel(model, multi_avg_fn=callback._multi_avg_fn, use_buffers=True)
    callback._average_model = averaged
    return averaged


def test_ema_from_the_first_update_equals_upstreams_trainer() -> None:
    """DeviceEMA on the XLA mesh against upstream's AveragedModel on the CPU from a fresh start: the first update
    copies the weights (rfdetr's legacy ModelEma would average the initial weights in), then the warm-up decays."""
    from spmd_rfdetr.training.ema import DeviceEMA

    torch.manual_seed(0)
    live = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    reference = upstream_ema(live, decay=0.9, tau=2)
    on_xla = copy.deepcopy(live).to(torch_xla.device())
    ours = DeviceEMA(on_xla, decay=0.9, tau=2)
    for step in range(4):
        with torch.no_grad():
            for p, q in zip(live.parameters(), on_xla.parameters()):
                p.add_(torch.randn(p.shape))
                q.copy_(p.to(q.device))
        reference.update_parameters(live)
        ours.update()
        torch_xla.sync()  # one graph per update: reading each tensor's pending update alone compiles one per shape
        got = {k: v.cpu() for k, v in ours.state_dict().items()}
        for k, v in reference.module.state_dict().items():
            if v.is_floating_point():
                assert torch.allclose(got[k], v, atol=1e-6), (step, k, got[k], v)
    assert int(ours.updates.cpu()) - 1 == int(reference.n_averaged) == 4


@pytest.mark.slow
def test_ema_in_the_step_equals_upstreams_trainer_on_the_same_weights(tiny, mesh_trainer):
    """Upstream's trainer's EMA on the CPU, fed the weights our step produced after each step, from the EMA state the
    session's trainer has now: the averages our compiled step kept agree to 1e-6, and updating them cost nothing."""
    from spmd_rfdetr.training.build import unwrap

    ema, model = mesh_trainer.ema, unwrap(mesh_trainer.model)
    reference = upstream_ema(tiny.model(), decay=ema.decay, tau=ema.tau)
    reference.module.load_state_dict({k: v.cpu() for k, v in ema.state_dict().items()})
    reference.n_averaged.fill_(int(ema.updates.cpu()) - 1)
    live = tiny.model()
    batches = [mesh_trainer.to_device(b) for b in tiny.batches[:3]]
    for i, batch in enumerate(batches):
        before = xla_counters()
        mesh_trainer.step(batch)
        xm.wait_device_ops()
        after = xla_counters()
        assert after["xla_compiles"] == before["xla_compiles"], "the EMA update compiled something"
        assert after["xla_transfers_to_host"] == before["xla_transfers_to_host"], "the EMA update read the host"
        live.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        reference.update_parameters(live)
    ours = {k: v.cpu() for k, v in ema.state_dict().items()}
    theirs = reference.module.state_dict()
    worst = max((ours[k].float() - theirs[k].float()).abs().max().item() for k in theirs
                if theirs[k].numel() and theirs[k].is_floating_point())
    moved = max((ours[k] - live.state_dict()[k]).abs().max().item() for k in theirs if theirs[k].is_floating_point())
    assert worst <= 1e-6, worst
    assert moved > 10 * 1e-6, moved  # the tolerance is far below how far the average is from the weights
    assert int(ema.updates.cpu()) - 1 == int(reference.n_averaged)


@pytest.mark.slow
def test_a_nonfinite_step_changes_nothing_and_is_counted(tiny, mesh_trainer):
    """A NaN batch (NaN target boxes: the uint8 images cannot hold one): the step's loss is NaN, the weights and AdamW
    state stay as they were, the device counters name the step; the next finite batch trains again."""
    step = mesh_trainer.step
    optimizer = mesh_trainer.optimizer
    snapshot = lambda: [t.cpu().clone() for t in step._updated_by_optimizer()]  # noqa: E731
    bad = dict(tiny.batches[0])
    bad["boxes"] = torch.full_like(bad["boxes"], float("nan"))
    counted = step.read(step(mesh_trainer.to_device(tiny.batches[1])))["nonfinite_steps"]
    before = snapshot()
    stats = step.read(step(mesh_trainer.to_device(bad)))
    assert stats["loss"] != stats["loss"] and stats["nonfinite_steps"] == counted + 1
    assert stats["first_nonfinite_step"] == float(step.steps_done.cpu())
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot())), "a NaN step changed the weights or AdamW state"
    stats = step.read(step(mesh_trainer.to_device(tiny.batches[2])))
    assert stats["loss"] == stats["loss"] and stats["nonfinite_steps"] == counted + 1
    after = snapshot()  # on the CPU: checking each device tensor alone would compile a graph per shape
    assert not all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.isfinite(t).all() for t in after) and optimizer is mesh_trainer.optimizer


@pytest.mark.slow
def test_accumulating_two_micro_batches_equals_one_batch(tiny, mesh_trainer, first_steps):
    """optim.accumulate=2 inside the one compiled step vs the whole batch at once (conftest's ``first_steps``), from
    the same weights: the same loss and pre-clip gradient norm (rfdetr's whole-batch box count normalises both
    halves), the same clipped gradients and the same weights after the update. On the tiny model: the loop model's
    zero-size learned reference boxes make its gradients differ between any two programs (conftest's LOOP_MODEL)."""
    import dataclasses

    from spmd_rfdetr.training.build import build_trainer

    optim = dataclasses.replace(tiny.cfg.optim, accumulate=2)
    trainer = build_trainer(mesh_trainer.fabric, tiny.cfgs, optim, tiny.cfg.trainer, model=tiny.model(),
                            ema=tiny.cfg.model)
    halves = trainer.step.read(trainer.step(mesh_trainer.to_device(tiny.batches[0])))
    params = list(trainer.model.parameters())
    grads = first_step_gradients(trainer.optimizer, params)
    whole = first_steps.stats[0]
    assert halves["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert halves["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert len(grads) == len(first_steps.grads) > 0 and any(g.abs().max() > 0 for g in grads)
    scale = max(g.abs().max().item() for g in first_steps.grads)
    assert max((a - b).abs().max().item() for a, b in zip(grads, first_steps.grads)) <= 1e-5 * scale
    assert max((p.detach().cpu() - w).abs().max().item() for p, w in zip(params, first_steps.weights)) <= 1e-5


@pytest.mark.slow
def test_scipy_matcher_steps_equal_the_device_matchers(first_steps, xla_child):
    """``trainer.matcher=scipy`` (upstream's host solve: the step is traced every call and cut at the matcher's
    transfer; run in :data:`XLA_CHILD`) against the device matcher (conftest's ``first_steps``), each from the initial
    weights for :data:`SCIPY_STEPS` steps: the same assignments, so the same losses, within :func:`parity_tolerance`
    (two programs that round differently)."""
    device, scipy = first_steps.losses[:SCIPY_STEPS], xla_child["scipy"]
    assert (first_steps.mode, xla_child["scipy_mode"]) == ("replay", "trace")
    assert "matcher_unconverged" in first_steps.stats[0] and "matcher_unconverged" not in xla_child["scipy_stats"]
    assert len(scipy) == SCIPY_STEPS
    for step, (ours, ref) in enumerate(zip(device, scipy), start=1):
        assert abs(ours - ref) <= parity_tolerance(step) * abs(ref), (step, device, scipy)
    print(f"device matcher {device}, scipy matcher {scipy}")


@pytest.mark.parametrize("mode", ["replay", pytest.param("trace", marks=pytest.mark.slow)])  # trace compiles (below)
def test_a_stray_host_sync_in_the_step_fails_loudly(tiny, mesh_trainer, mode):
    """full_graph=True: an `.item()` inside the step raises torch_xla's own error (execution is disallowed while the
    step is traced) instead of silently splitting the graph; replay raises while tracing, before the step compiles."""
    from spmd_rfdetr.training.step import TrainStep

    class SyncingCriterion(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.matcher, self.weight_dict = inner, inner.matcher, inner.weight_dict

        def forward(self, outputs, targets, **kwargs):
            losses = self.inner(outputs, targets, **kwargs)
            float(losses["loss_ce"])  # a host sync
            return losses

    step = TrainStep(mesh_trainer.model, SyncingCriterion(mesh_trainer.step.criterion), mesh_trainer.optimizer,
                     clip_max_norm=0.1, full_graph=True, mode=mode)
    before = xla_counters()["xla_compiles"]
    with pytest.raises(RuntimeError, match="Unexpected execution happens inside the compiled function"):
        step(mesh_trainer.to_device(tiny.batches[0]))
    if mode == "replay":  # (trace: torch_xla.compile's exit syncs the partial trace, a small compile of its own)
        assert xla_counters()["xla_compiles"] == before, "the step compiled before the sync was caught"

#!/usr/bin/env python
"""Upstream rfdetr's own training step fed a ``fit`` run's exact batches: the bisection arm of issue 33.

``benchmarks/convergence.py --compare upstream`` trains both trainers with their own data order, augmentation draws
and initial weights. This arm takes all three from a ``fit`` run (its ``config.yaml``, so a run stopped once that file
exists will do: the same seed gives the same initial weights, and ``make_train_loader`` the same batches, a pure
function of the seed and the step) and trains them with upstream's own pieces in eager float32 on the CPU, in a
process without XLA: rfdetr's model, ``SetCriterion`` (SciPy matcher) and the weighted loss sum of its
``training_step``, ``torch.optim.AdamW`` over rfdetr's ``get_param_dict`` groups (its ``configure_optimizers``),
``clip_grad_norm_`` (Lightning's ``norm`` clipping), our LR factor as a ``LambdaLR`` (what ``--match-lr`` gives
upstream's trainer) and rfdetr's ``RFDETREMACallback`` average (``AveragedModel`` with its own ``_multi_avg_fn``). The
final EMA weights are scored as ``convergence.py`` scores both others (upstream's eager PostProcess and CocoEvaluator
on the valid split).

If this arm lands on ours, the gap to upstream's own trainer is data order, augmentation draws or initial weights;
if it lands on upstream's trainer, it is our step. Step 1's loss must equal the run's own step 1 (same weights, same
batch): the script prints both.

    python benchmarks/same_batches.py --run /tmp/compare/ours-42 --out /tmp/same/42
    python benchmarks/same_batches.py --collect /tmp/same --into benchmarks/results/<comparison>.json

``--collect`` adds every finished arm under ``DIR`` to a ``convergence.py --compare upstream`` JSON: per seed its
final scores (``runs.same_batches``), its mean/std/SE/min/max (``summary.same_batches``) and its gap to ours per seed;
``--name same_batches_xla`` files ``--xla`` arms under their own key.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def train_on_run_batches(run: Path, out: Path, perturb: float = 0.0, criterion_kind: str = "upstream",
                         states_at: frozenset[int] = frozenset(), steps: int | None = None,
                         on_xla: bool = False, flush_denormal: bool = False, autocast_bf16: bool = False) -> dict:
    """Upstream's step on ``run``'s batches from ``run``'s initial weights; returns the losses and the EMA file.
    ``perturb``: every initial weight times ``1 + perturb * N(0, 1)`` (a control: how far two runs of the same step
    on the same batches part when they start a rounding error apart). ``criterion_kind="ours"``: our batched
    criterion and device matcher (``StaticSetCriterion``, eagerly on the CPU) instead of rfdetr's ``SetCriterion``:
    the one part swapped. ``states_at``: at these steps, save ``states/step_N.pt`` (the weights and AdamW state the
    step starts from, its loss, its gradients before clipping and the weights after its update: what
    ``benchmarks/teacher_forced.py`` gives our step). ``steps``: stop after this many steps (no EMA file, no score).
    ``on_xla``: the same upstream step on one XLA CPU device (lazy tracing, graphs cut where upstream's matcher reads
    the costs; capturable AdamW with the LR factor as device tensors, :class:`DeviceLRSchedule`, since a float LR
    changing per step would compile a graph per step; the EMA on a CPU copy): upstream's code with XLA's rounding.
    ``flush_denormal``: eager CPU arithmetic flushes denormal floats to zero (``torch.set_flush_denormal``), as XLA's
    CPU backend does. ``autocast_bf16``: the model's forward under eager bf16 autocast, the loss in float32, as our
    ``trainer.precision: bf16`` step splits them (PyTorch's own bf16 rounding, the reference for ours)."""
    import torch
    from lightning_fabric.utilities.seed import seed_everything
    from rfdetr.training.callbacks.ema import RFDETREMACallback
    from rfdetr.utilities.tensors import nested_tensor_from_tensor_list
    from torch.optim.swa_utils import AveragedModel

    from spmd_rfdetr.cli import run_config
    from spmd_rfdetr.data.batches import make_train_loader
    from spmd_rfdetr.data.pixels import upstream_float
    from spmd_rfdetr.data.splits import build_split, num_classes_in
    from spmd_rfdetr.model.upstream import build_model, build_upstream_criterion, upstream_configs
    from spmd_rfdetr.training.optim import build_optimizer, lr_factor
    from spmd_rfdetr.training.step import _to_float

    cfg = run_config(["--config", str(run / "config.yaml")])
    d, o, t = cfg.data, cfg.optim, cfg.trainer
    if flush_denormal and not torch.set_flush_denormal(True):
        raise RuntimeError("this CPU cannot flush denormals")
    seed_everything(t.seed)  # as fit: Fabric's seed_everything, then the split, then the model
    cfgs = upstream_configs(cfg.model, d, o, cfg.model.num_classes or num_classes_in(d.dataset_dir),
                            cfg.eval.num_select)
    train_set = build_split(cfgs, "train")
    net = build_model(cfgs).train()
    if perturb:
        noise = torch.Generator().manual_seed(12345)
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(1 + perturb * torch.randn(p.shape, generator=noise))
    criterion = build_upstream_criterion(cfgs)[0].train()
    if criterion_kind == "ours":
        from spmd_rfdetr.model.loss import build_criterion
        from spmd_rfdetr.training.step import forward_loss

        criterion = build_criterion(criterion, solver="device").train()
    ema_rule = RFDETREMACallback(decay=cfg.model.ema_decay, tau=cfg.model.ema_tau)
    ema = AveragedModel(net, use_buffers=True, multi_avg_fn=ema_rule._multi_avg_fn)
    if on_xla:
        # lazy: only this arm may load torch_xla (the eager arms run in a process without it)
        import torch_xla
        from rfdetr.utilities.tensors import pad_targets_to_fixed_count

        from spmd_rfdetr.training.optim import DeviceLRSchedule

        live, device = copy.deepcopy(net), torch_xla.device()  # live: the CPU copy the EMA averages
        net, criterion = net.to(device), criterion.to(device)
        optimizer = build_optimizer(net, cfgs, on_device=True)
        schedule = DeviceLRSchedule(optimizer, o, t.max_steps)
    else:
        device, live = torch.device("cpu"), net
        optimizer = build_optimizer(net, cfgs)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, functools.partial(lr_factor, optim=o, max_steps=t.max_steps))
    batches = iter(make_train_loader(train_set, d, cfgs.model.resolution, seed=t.seed))
    losses, started = [], time.perf_counter()
    for step in range(1, (steps or t.max_steps) + 1):
        batch = next(batches)
        if step in states_at:
            start = {"weights": {k: v.detach().clone() for k, v in net.state_dict().items()},
                     "optimizer": copy.deepcopy(optimizer.state_dict())}
        optimizer.zero_grad(set_to_none=True)
        if criterion_kind == "ours":
            loss, _ = forward_loss(net, criterion, batch)
        else:
            targets = [{"labels": labels[keep], "boxes": boxes[keep]}
                       for labels, boxes, keep in zip(batch["labels"], batch["boxes"], batch["valid"])]
            samples = nested_tensor_from_tensor_list(list(upstream_float(batch["images"])))
            if on_xla:  # upstream's own XLA path pads the targets
                targets = [{k: v.to(device) for k, v in target.items()}
                           for target in pad_targets_to_fixed_count(targets, batch["labels"].shape[1])]
                samples = samples.to(device)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
                outputs = net(samples, targets)
            loss_dict = criterion(_to_float(outputs) if autocast_bf16 else outputs, targets)
            loss = torch.stack([loss_dict[k] * w for k, w in criterion.weight_dict.items() if k in loss_dict]).sum()
        loss.backward()
        if step in states_at:
            start.update(step=step, loss=loss.item(),
                         grads={name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None})
        if on_xla:
            torch_xla.sync()  # one graph for the loss and gradients
        torch.nn.utils.clip_grad_norm_(net.parameters(), o.clip_max_norm)
        optimizer.step()
        if step in states_at:
            (out / "states").mkdir(parents=True, exist_ok=True)
            start["after"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
            torch.save(start, out / "states" / f"step_{step}.pt")
        schedule.step()
        if on_xla:
            torch_xla.sync()
            live.load_state_dict({k: v.cpu() for k, v in net.state_dict().items()})
        ema.update_parameters(live)
        losses.append(loss.item())
        if step % 10 == 0 or step == 1:
            print(f"step {step}/{t.max_steps} loss {losses[-1]:.4f} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    out.mkdir(parents=True, exist_ok=True)
    if steps is not None:
        return {"losses": losses}
    weights = out / "ema.pth"
    torch.save({"model": ema.module.state_dict()}, weights)
    return {"losses": losses, "weights": str(weights)}


def collect(arms: Path, into: Path, name: str = "same_batches") -> None:
    """Every finished arm under ``arms`` into the comparison JSON ``into`` (matched to ours by seed), under ``name``
    (``runs.<name>``, ``summary.<name>``: one key per kind of arm, e.g. eager and ``--xla``)."""
    import yaml
    from convergence import spread

    payload = json.loads(into.read_text())
    ours = {r["seed"]: r["final"]["mAP"] for r in payload["runs"]["ours"]}
    found = [json.loads(f.read_text()) for f in sorted(arms.glob("*/result.json"))]
    runs = [{"seed": yaml.safe_load((Path(r["run"]) / "config.yaml").read_text())["trainer"]["seed"],
             "final": r["final"], "step1_loss": r["losses"][0], "run_step1_loss": r["run_losses"].get("1")}
            for r in found]
    runs.sort(key=lambda r: payload["seeds"].index(r["seed"]))
    payload["runs"][name] = runs
    payload["summary"][name] = spread([r["final"]["mAP"] for r in runs])
    payload[f"gap_ours_minus_{name}_per_seed"] = {r["seed"]: ours[r["seed"]] - r["final"]["mAP"] for r in runs}
    payload[name] = ("upstream's step (its model, SetCriterion, AdamW over get_param_dict, clip_grad_norm_, our LR "
                     "factor as LambdaLR, RFDETREMACallback) on each of our runs' own batches from its own initial "
                     f"weights: benchmarks/same_batches.py; arms from {arms}")
    into.write_text(json.dumps(payload, indent=1))
    print(f"{len(runs)} arms into {into} as {name}: {payload['summary'][name]}")


def score(run: Path, weights: Path) -> tuple[dict[str, float], dict[int, float]]:
    """Upstream's eager evaluation of ``weights`` with ``run``'s config (a finished run, or one stopped once its
    ``config.yaml`` existed: then without its losses), and the run's logged losses by step."""
    import torch
    import yaml
    from convergence import eager_stats

    from spmd_rfdetr.eval.coco import stat_names

    config = yaml.safe_load((run / "config.yaml").read_text())
    metrics = run / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    max_dets = config["eval"].get("max_dets", 100)
    model_state = torch.load(weights, map_location="cpu", weights_only=False)["model"]
    return dict(zip(stat_names(max_dets), eager_stats(config, model_state, "valid"))), losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, help="a finished fit run dir (config.yaml, metrics.jsonl)")
    p.add_argument("--out", type=Path)
    p.add_argument("--perturb", type=float, default=0.0, help="initial weights times 1 + PERTURB * N(0, 1) (control)")
    p.add_argument("--criterion", choices=("upstream", "ours"), default="upstream",
                   help="ours: our batched criterion and device matcher, eagerly on the CPU (the one part swapped)")
    p.add_argument("--states-at", type=lambda v: frozenset(int(x) for x in v.split(",")), default=frozenset(),
                   help="comma-separated steps: save each one's start weights, loss and gradients under OUT/states")
    p.add_argument("--steps", type=int, help="stop after this many steps (no EMA, no score: for --states-at)")
    p.add_argument("--xla", action="store_true", help="upstream's step on one XLA CPU device (XLA's rounding)")
    p.add_argument("--flush-denormal", action="store_true", help="eager CPU flushes denormals to zero (as XLA's does)")
    p.add_argument("--autocast-bf16", action="store_true",
                   help="the forward under eager bf16 autocast, the loss in float32 (as trainer.precision: bf16)")
    p.add_argument("--collect", type=Path, help="a dir of finished arms (each --out)")
    p.add_argument("--into", type=Path, help="with --collect: the comparison JSON to add them to")
    p.add_argument("--name", default="same_batches", help="with --collect: their key in the JSON")
    args = p.parse_args(argv)
    if args.collect:
        collect(args.collect, args.into, args.name)
        return 0
    result = train_on_run_batches(args.run, args.out, args.perturb, args.criterion, args.states_at, args.steps,
                                  args.xla, args.flush_denormal, args.autocast_bf16)
    if args.steps is not None:
        (args.out / "result.json").write_text(json.dumps({**result, "run": str(args.run)}, indent=1))
        return 0
    stats, ours = score(args.run, Path(result["weights"]))
    print(f"step 1 loss: this arm {result['losses'][0]:.6f}, the run's {ours.get(1)}")
    print(f"upstream's step on the run's batches: mAP {stats['mAP']:.4f} mAP50 {stats['mAP50']:.4f} "
          f"mAP75 {stats['mAP75']:.4f}")
    (args.out / "result.json").write_text(json.dumps({**result, "final": stats, "run": str(args.run),
                                                      "run_losses": ours}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

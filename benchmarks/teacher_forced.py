#!/usr/bin/env python
"""Our compiled step against upstream's eager step from the same weights, at many points of a run (issue 33).

Two runs of one recipe part after a few dozen steps whether or not their steps differ: rounding differences grow in an
unstable phase. This separates the two. ``benchmarks/same_batches.py --states-at ...`` trains upstream's step
(eager CPU) on a ``fit`` run's batches and saves, at chosen steps, the weights the step starts from, its loss and its
gradients before clipping. Here each saved step is run again through our training step as ``fit`` builds it (the
4-device XLA CPU mesh, the compiled step, our criterion and device matcher, the XLA-safe model ops) from those same
weights and AdamW state on the same batch, and the two are compared: the loss, the gradient norm, the gradients'
relative L2 error and the update's (the weights after minus before). A cause in our step shows as an error far above step 1's (``tests/test_train.py`` bounds step 1's at 1e-4) at
some point of the run; rounding alone keeps every point near step 1's.

    python benchmarks/same_batches.py --run RUN --out ARM --states-at 1,10,20,30 --steps 30
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python benchmarks/teacher_forced.py --run RUN --states ARM/states --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def compare(run: Path, states: list[Path], step_mode: str = "trace") -> list[dict]:
    """Our step from each saved state's weights on its step's batch, against the saved eager loss and gradients."""
    from spmd_rfdetr.cli import run_config
    from spmd_rfdetr.xla.runtime import setup_runtime

    cfg = run_config(["--config", str(run / "config.yaml"), "--trainer.step_mode", step_mode, "--data.num_workers", "0"])
    setup_runtime(cfg.mesh, None)
    # lazy: torch_xla starts on the device setup_runtime chose
    import torch

    from spmd_rfdetr.config.resolve import resolve_and_check
    from spmd_rfdetr.data.batches import make_train_loader
    from spmd_rfdetr.data.splits import build_split, num_classes_in
    from spmd_rfdetr.model.upstream import upstream_configs
    from spmd_rfdetr.training.build import build_trainer, unwrap
    from spmd_rfdetr.xla import hosts
    from spmd_rfdetr.xla.fabric import spmd_fabric
    from spmd_rfdetr.xla.mesh import build_mesh
    from spmd_rfdetr.xla.runtime import PRECISIONS

    import torch_xla.runtime as xr

    resolve_and_check(cfg, xr.global_runtime_device_count())
    d, t = cfg.data, cfg.trainer
    fabric = spmd_fabric(build_mesh(cfg.mesh.data, cfg.mesh.fsdp), precision=PRECISIONS[t.precision])
    fabric.seed_everything(t.seed)
    cfgs = upstream_configs(cfg.model, d, cfg.optim, cfg.model.num_classes or num_classes_in(d.dataset_dir),
                            cfg.eval.num_select)
    train_set = build_split(cfgs, "train")
    trainer = build_trainer(fabric, cfgs.without_weights(), cfg.optim, t, ema=None, mesh=cfg.mesh)
    net = unwrap(trainer.model)
    names = [name for name, _ in net.named_parameters()]
    rows = []
    for path in states:
        state = torch.load(path, weights_only=False)
        step = state["step"]
        net.load_state_dict(state["weights"])
        if "optimizer" in state:
            _load_optimizer(trainer, state["optimizer"], step, cfg)
        loader = fabric.setup_dataloaders(make_train_loader(train_set, d, cfgs.model.resolution, seed=t.seed,
                                                            start_step=step - 1, host=hosts.batch_share()))
        stats = trainer.step.read(trainer.step(next(iter(loader))))
        ours = {name: p.grad.cpu() for name, p in zip(names, net.parameters()) if p.grad is not None}
        ref = state["grads"]
        shared = [n for n in names if n in ours and n in ref]
        ref_norm = float(torch.sqrt(sum((ref[n].double() ** 2).sum() for n in shared)))
        ours_norm = float(torch.sqrt(sum((ours[n].double() ** 2).sum() for n in shared)))
        # ours are clipped in place (clip_grad_norm_): compare directions, and the norms from the step's grad_norm
        err = float(torch.sqrt(sum(((ours[n].double() / ours_norm - ref[n].double() / ref_norm) ** 2).sum()
                                   for n in shared)))
        worst = max(shared, key=lambda n: float((ours[n].double() / ours_norm - ref[n].double() / ref_norm).norm()
                                                / max(float(ref[n].double().norm() / ref_norm), 1e-12)))
        row = {"step": step, "loss_ours": stats["loss"], "loss_upstream": state["loss"],
               "loss_rel_error": abs(stats["loss"] - state["loss"]) / abs(state["loss"]),
               "grad_norm_ours": stats["grad_norm"], "grad_norm_upstream": ref_norm,
               "grad_direction_rel_l2": err, "params_compared": len(shared), "params_only_upstream": len(ref) - len(shared),
               "worst_param": worst}
        if "after" in state:  # the update: ours (weights after - before) against upstream's AdamW step's
            after = {n: p.detach().cpu().double() for n, p in net.named_parameters()}
            before = {n: v.double() for n, v in state["weights"].items()}
            ours_update = {n: after[n] - before[n] for n in after}
            ref_update = {n: state["after"][n].double() - before[n] for n in after}
            ref_size = float(torch.sqrt(sum((u**2).sum() for u in ref_update.values())))
            row["update_rel_l2"] = float(torch.sqrt(sum(((ours_update[n] - ref_update[n]) ** 2).sum()
                                                        for n in after))) / ref_size
            row["update_size"] = ref_size
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _load_optimizer(trainer: Any, saved: dict, step: int, cfg: Any) -> None:
    """Upstream's AdamW state before ``step`` into our capturable AdamW, and our device LR schedule at ``step``."""
    from spmd_rfdetr.training.optim import lr_factor

    rates = [group["lr"] for group in trainer.optimizer.param_groups]  # device tensors: load_state_dict copies them
    # upstream's moments and step counts; our groups' settings (capturable: the step count stays on the device)
    trainer.optimizer.load_state_dict({"state": saved["state"],
                                       "param_groups": trainer.optimizer.state_dict()["param_groups"]})
    factor = lr_factor(step - 1, cfg.optim, cfg.trainer.max_steps)
    for group, rate, base in zip(trainer.optimizer.param_groups, rates, trainer.schedule.base_lrs, strict=True):
        group["lr"] = rate
        rate.fill_(base * factor)
    trainer.schedule.step_count.fill_(step - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="the fit run whose batches the states were trained on")
    p.add_argument("--states", type=Path, required=True, help="same_batches.py's OUT/states")
    p.add_argument("--step-mode", default="trace", help="the step's trainer.step_mode (fit's default: replay)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "4")
    states = sorted(args.states.glob("step_*.pt"), key=lambda f: int(f.stem.split("_")[1]))
    rows = compare(args.run, states, args.step_mode)
    if args.json:
        args.json.write_text(json.dumps({"run": str(args.run), "states": str(args.states), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

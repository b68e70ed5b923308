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

``--precision bf16`` runs our step as the TPU recipes train (bf16 autocast, fp32 weights) against the same eager
float32 states: issue 50's step-1 fidelity. Every row also has the gradient's error per parameter group
(:data:`GROUPS`): the relative L2 error and the cosine of each group's share of the unit-normalised gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


#: The per-group gradient errors' groups: (name prefix, group); a name takes the first prefix it starts with.
GROUPS = (("backbone.0.encoder", "backbone (DINOv2)"), ("backbone.0.projector", "projector"),
          ("transformer.decoder", "decoder"), ("transformer.enc_", "two-stage"), ("", "heads and queries"))


def group_of(name: str) -> str:
    return next(group for prefix, group in GROUPS if name.startswith(prefix))


def group_errors(ours: dict[str, Any], ref: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per :data:`GROUPS` group: the relative L2 error of ``ours`` against ``ref`` and their cosine (unit-normalised
    gradients, float64)."""
    rows = {}
    for _, group in GROUPS:
        names = [n for n in ref if group_of(n) == group]
        if not names:
            continue
        dot = sum(float((ours[n] * ref[n]).sum()) for n in names)
        a, b = _norm(ours[n] for n in names), _norm(ref[n] for n in names)
        rows[group] = {"params": len(names), "rel_l2": _norm(ours[n] - ref[n] for n in names) / b,
                       "cosine": dot / (a * b)}
    return rows


def compare(run: Path, states: list[Path], step_mode: str = "trace", precision: str | None = None) -> list[dict]:
    """Our step from each saved state's weights on its step's batch, against the saved eager loss and gradients
    (our step in ``precision``, default the run's)."""
    from spmd_rfdetr.cli import run_config
    from spmd_rfdetr.xla.runtime import setup_runtime

    with tempfile.TemporaryDirectory(prefix="teacher_forced_") as scratch:  # fit's start-up writes config.yaml there
        cfg = run_config(["--config", str(run / "config.yaml"), "--trainer.step_mode", step_mode,
                          "--data.num_workers", "0", "--trainer.output_dir", scratch,
                          *(["--trainer.precision", precision] if precision else [])])
        setup_runtime(cfg.mesh, None)
        # lazy: torch_xla starts on the device setup_runtime chose
        from spmd_rfdetr.training import setup

        return _compare(setup.prepare(cfg), states)


def _compare(run: Any, states: list[Path]) -> list[dict]:
    """:func:`compare` once fit's start-up (``run``: :class:`~spmd_rfdetr.training.setup.Run`) has run."""
    import torch

    from spmd_rfdetr.data.batches import make_train_loader
    from spmd_rfdetr.training.build import build_trainer, unwrap
    from spmd_rfdetr.xla import hosts

    cfg, d, t = run.cfg, run.cfg.data, run.cfg.trainer
    trainer = build_trainer(run.fabric, run.cfgs.without_weights(), cfg.optim, t, ema=None, mesh=cfg.mesh)
    net = unwrap(trainer.model)
    rows = []
    for path in states:
        state = torch.load(path, weights_only=False)
        step = state["step"]
        net.load_state_dict(state["weights"])
        if "optimizer" in state:
            _load_optimizer(trainer, state["optimizer"], step, cfg)
        loader = run.fabric.setup_dataloaders(make_train_loader(run.train_set, d, run.cfgs.model.resolution,
                                                                seed=t.seed, start_step=step - 1,
                                                                host=hosts.batch_share()))
        moments = {n: trainer.optimizer.state[p]["exp_avg"].cpu() for n, p in net.named_parameters()}
        stats = trainer.step.read(trainer.step(next(iter(loader))))
        # ours are clipped (clip_grad_norm_): compare directions, and the norms from the step's grad_norm
        grads = _applied_gradients(trainer.optimizer, dict(net.named_parameters()), moments)
        shared = [n for n in grads if n in state["grads"]]
        ours, ref = _unit({n: grads[n] for n in shared}), _unit({n: state["grads"][n] for n in shared})
        err = _norm(ours[n] - ref[n] for n in shared)
        worst = max(shared, key=lambda n: float((ours[n] - ref[n]).norm() / max(float(ref[n].norm()), 1e-12)))
        row = {"step": step, "loss_ours": stats["loss"], "loss_upstream": state["loss"],
               "loss_rel_error": abs(stats["loss"] - state["loss"]) / abs(state["loss"]),
               "grad_norm_ours": stats["grad_norm"], "grad_norm_upstream": _norm(state["grads"][n] for n in shared),
               "grad_direction_rel_l2": err, "params_compared": len(shared),
               "params_only_upstream": len(state["grads"]) - len(shared), "worst_param": worst,
               "precision": t.precision, "groups": group_errors(ours, ref)}
        if "after" in state:  # the update: ours (weights after - before) against upstream's AdamW step's
            before = state["weights"]
            differences = [p.detach().cpu().double() - state["after"][n].double() for n, p in net.named_parameters()]
            ref_size = _norm(state["after"][n].double() - before[n].double() for n, _ in net.named_parameters())
            row["update_rel_l2"] = _norm(differences) / ref_size
            row["update_size"] = ref_size
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def compare_saved(states: list[Path], others: list[Path]) -> list[dict]:
    """Saved eager states against saved eager states of the same steps (e.g. ``same_batches.py --autocast-bf16``
    against its float32 run: PyTorch's own bf16 rounding, the reference for our bf16 step's)."""
    import torch

    rows = []
    for path, other in zip(states, others, strict=True):
        ref, alt = torch.load(path, weights_only=False), torch.load(other, weights_only=False)
        assert ref["step"] == alt["step"], (path, other)
        shared = [n for n in alt["grads"] if n in ref["grads"]]
        ours, theirs = _unit({n: alt["grads"][n] for n in shared}), _unit({n: ref["grads"][n] for n in shared})
        rows.append({"step": ref["step"], "loss_ours": alt["loss"], "loss_upstream": ref["loss"],
                     "loss_rel_error": abs(alt["loss"] - ref["loss"]) / abs(ref["loss"]),
                     "grad_norm_ours": _norm(alt["grads"][n] for n in shared),
                     "grad_norm_upstream": _norm(ref["grads"][n] for n in shared),
                     "grad_direction_rel_l2": _norm(ours[n] - theirs[n] for n in shared),
                     "params_compared": len(shared), "groups": group_errors(ours, theirs)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _norm(tensors: Any) -> float:
    """The L2 norm of several tensors together, in float64."""
    import torch

    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


def _unit(grads: dict[str, Any]) -> dict[str, Any]:
    """``grads`` (float64) divided by their joint L2 norm."""
    norm = _norm(grads.values())
    return {n: g.double() / norm for n, g in grads.items()}


def _applied_gradients(optimizer: Any, params: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The (clipped) gradient the step just applied to each parameter, from AdamW's first moment before and after
    (``exp_avg = before + (1 - beta1) * (grad - before)``): the step drops ``.grad`` at its end. A parameter the step
    gave no gradient reads ``before`` (compare only those upstream had a gradient for)."""
    beta1 = {id(p): group["betas"][0] for group in optimizer.param_groups for p in group["params"]}
    return {n: before[n] + (optimizer.state[p]["exp_avg"].cpu() - before[n]) / (1 - beta1[id(p)])
            for n, p in params.items()}


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


def saved_states(folder: Path) -> list[Path]:
    """``same_batches.py``'s ``OUT/states`` files in step order."""
    return sorted(folder.glob("step_*.pt"), key=lambda f: int(f.stem.split("_")[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="the fit run whose batches the states were trained on")
    p.add_argument("--states", type=Path, required=True, help="same_batches.py's OUT/states")
    p.add_argument("--step-mode", default="trace", help="the step's trainer.step_mode (fit's default: replay)")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="our step's trainer.precision (default: the run's)")
    p.add_argument("--eager-states", type=Path,
                   help="another same_batches.py OUT/states to compare with --states instead of our step")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "4")
    states = saved_states(args.states)
    if args.eager_states:
        rows = compare_saved(states, saved_states(args.eager_states))
    else:
        rows = compare(args.run, states, args.step_mode, args.precision)
    if args.json:
        args.json.write_text(json.dumps({"run": str(args.run), "states": str(args.states), "precision": args.precision,
                                         "eager_states": args.eager_states and str(args.eager_states), "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

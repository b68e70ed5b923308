#!/usr/bin/env python
"""Batch size and learning rate when fine-tuning (issue 48 item 1): keep rfdetr's LR, or scale it with the batch?

    python benchmarks/batch_lr.py --out /tmp/batch_lr      # the committed table (~100 min on 2 busy shared cores)

1. ``synth`` writes two synthetic sets (unless ``--data`` has them): A (seed 11, 3 classes, 512 train images) and B
   (seed 22, 6 classes: A's three and three new shapes; 256 train, 256 valid images), both 64 px, 1-4 shapes each.
2. Pretraining, once: ``fit`` from scratch on A (``configs/cpu.yaml``'s recipe: lr 4e-4, batch 8) for
   ``--pretrain-epochs``, the head sized for 6 classes, so the fine-tunes load it as users load a checkpoint.
3. Fine-tunes from its ``last.pth`` (``--model.pretrain_weights``) on B, ``--epochs`` passes each, cosine to 0.05,
   the warm-up ``--warmup-epochs`` passes in every arm, one per (arm, seed): ``b8`` at the base LR (rfdetr's
   1e-4 decoder / 1.5e-4 encoder), ``b32`` the same LR at 4x the batch, ``b32-sqrt`` 2x the LR (square-root rule),
   ``b32-linear`` 4x (linear rule). Scored by ``fit``'s own final evaluation on B's valid split (COCO, maxDets 100):
   the EMA weights (``eval/mAP``, what ``last.pth`` holds) and the raw weights (``eval.base_model``).

The model is ``configs/cpu.yaml``'s Nano cut to 6 backbone blocks at 64 px (so all runs fit in the time given).
Each arm runs in one child process (its seeds share the compiled step and eval programs); a finished run in
``--out`` is reused. Writes ``benchmarks/results/batch-lr-<date>.{json,png}``: per run arm, seed, batch, LR, steps,
mAP, mAP50 (EMA and raw), wall time; per arm the mean, sample std and standard error (std / sqrt(n)).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from convergence import spread

ROOT = Path(__file__).resolve().parents[1]

BASE_LR, BASE_LR_ENCODER, B0 = 1e-4, 1.5e-4, 8
#: arm -> (global batch, LR multiplier)
ARMS = {"b8": (8, 1.0), "b32": (32, 1.0), "b32-sqrt": (32, 2.0), "b32-linear": (32, 4.0)}
MODEL = ["--config", "configs/cpu.yaml", "--model.resolution", "64", "--model.backbone_blocks", "6",
         "--model.num_classes", "6", "--data.max_targets", "4", "--eval.global_batch_size", "32",
         "--eval.max_dets", "100", "--trainer.progress_bar", "false", "--trainer.log_every", "8"]


#: the synthetic sets: name -> (seed, classes, train images, valid images), 1-4 shapes each
SETS = {"A": (11, 3, 512, 64), "B": (22, 6, 256, 256)}


def write_sets(data: Path, image_size: int = 64, keypoints: bool = False,
               sets: dict[str, tuple[int, int, int, int]] = SETS) -> None:
    """``synth``'s ``sets`` (default :data:`SETS`, A and B) at ``image_size`` px into ``data``, those not there yet
    (``keypoints``: with synth's 5 keypoints per shape)."""
    for name, (seed, classes, train, valid) in sets.items():
        if not (data / name).exists():
            subprocess.run([sys.executable, "-m", "spmd_rfdetr", "synth", "--output_dir", str(data / name),
                            "--seed", str(seed), "--num_classes", str(classes), "--train_images", str(train),
                            "--valid_images", str(valid), "--test_images", "0", "--image_size", str(image_size),
                            "--max_objects", "4", *(["--keypoints", "true"] if keypoints else [])], check=True,
                           cwd=ROOT)


def pretrain(data_a: Path, run: Path, epochs: float, model: list[str] = MODEL, evaluations: int = 1) -> None:
    """The checkpoint the fine-tunes start from: ``model`` from scratch on set A for ``epochs`` (seed 0, the head
    sized for B's classes, ``evaluations`` evenly spaced, the last at the end) into ``run``; writes
    ``run/result.json``."""
    wall = fit_in_process(["--data.dataset_dir", str(data_a), "--trainer.output_dir", str(run),
                           "--trainer.epochs", str(epochs), "--eval.every_steps", "0",
                           "--eval.every_epochs", str(epochs / evaluations), "--trainer.seed", "0"], model)
    (run / "result.json").write_text(json.dumps({**last_eval(run), "wall_s": wall}))


def fit_in_process(args: list[str], model: list[str] = MODEL) -> float:
    """One ``fit`` of ``model`` in this process (programs compiled by an earlier fit of the same shapes are reused);
    wall s."""
    from spmd_rfdetr.cli import main

    started = time.perf_counter()
    main(["fit", *model, *args])
    return time.perf_counter() - started


def last_eval(run: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in records if "eval/mAP" in r][-1]
    return {"steps": ev["step"], "mAP": ev["eval/mAP"], "mAP50": ev["eval/mAP50"],
            "raw_mAP": ev.get("eval/raw_mAP"), "raw_mAP50": ev.get("eval/raw_mAP50"),
            **{f"{kind}_mAP": ev[f"eval/{kind}_mAP"] for kind in ("segm", "kp") if f"eval/{kind}_mAP" in ev}}


def finetune_args(data_b: Path, pretrain: Path, run: Path, seed: int, epochs: float, warmup_epochs: float,
                  batch: int = B0, mult: float = 1.0, base_model: bool = True) -> list[str]:
    """``fit``'s options (after :data:`MODEL`) of one fine-tune from the checkpoint ``pretrain`` on the set ``data_b``
    into ``run``: ``epochs`` passes, ``warmup_epochs`` of them warm-up, then cosine; rfdetr's LR x ``mult``; one
    evaluation at the end (``base_model``: of the raw weights too)."""
    return ["--data.dataset_dir", str(data_b), "--trainer.output_dir", str(run),
            "--model.pretrain_weights", str(pretrain), "--data.global_batch_size", str(batch),
            "--optim.lr", repr(BASE_LR * mult), "--optim.lr_encoder", repr(BASE_LR_ENCODER * mult),
            "--optim.warmup_epochs", str(warmup_epochs), "--optim.schedule", "cosine", "--trainer.epochs",
            str(epochs), "--eval.every_steps", "0", "--eval.every_epochs", str(epochs), "--eval.base_model",
            "true" if base_model else "false", "--trainer.seed", str(seed)]


def child(a: argparse.Namespace) -> None:
    """Runs the pretraining (arm ``pretrain``) or one arm's seeds, in this process; each run writes result.json."""
    out = a.out
    if a._arm == "pretrain":
        pretrain(a.data / "A", out / "pretrain", a.pretrain_epochs)
        return
    batch, mult = ARMS[a._arm]
    for seed in a.seeds:
        run = out / f"{a._arm}-seed{seed}"
        if (run / "result.json").exists():
            continue
        lr, lr_enc = BASE_LR * mult, BASE_LR_ENCODER * mult
        wall = fit_in_process(finetune_args(a.data / "B", out / "pretrain" / "last.pth", run, seed, a.epochs,
                                            a.warmup_epochs, batch, mult))
        result = {"arm": a._arm, "seed": seed, "batch": batch, "lr": lr, "lr_encoder": lr_enc, **last_eval(run),
                  "wall_s": round(wall, 1)}
        (run / "result.json").write_text(json.dumps(result))
        print(f"RESULT {json.dumps(result)}", flush=True)


def plot(path: Path, runs: list[dict[str, Any]], arms: list[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, arm in enumerate(arms):
        rs = [r for r in runs if r["arm"] == arm]
        if not rs:
            continue
        for key, dx, style, label in (("mAP", -0.1, "o", "EMA (last.pth)"), ("raw_mAP", 0.1, "x", "raw weights")):
            vals = [r[key] for r in rs if r.get(key) is not None]
            ax.plot([i + dx] * len(vals), vals, style, color="tab:blue" if key == "mAP" else "tab:orange",
                    alpha=0.7, label=label if i == 0 else None)
            s = spread(vals)
            ax.errorbar([i + dx + 0.05], [s["mean"]], yerr=[s["se"] if s["n"] > 1 else 0], fmt="_", color="k",
                        markersize=14, capsize=4)
    batch_lr = [f"{a}\nB={ARMS[a][0]}, lr x{ARMS[a][1]:g}" for a in arms]
    ax.set_xticks(range(len(arms)), batch_lr, fontsize=8)
    ax.set_ylabel("COCO mAP, valid split of B (256 images)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/batch_lr"), help="runs (a finished run is reused)")
    p.add_argument("--data", type=Path, help="dir with the synthetic sets A and B (default OUT/data; written if missing)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--epochs", type=float, default=4, help="fine-tuning passes over B's train split (default 4)")
    p.add_argument("--warmup-epochs", type=float, default=1.0, help="warm-up passes, every arm (default 1)")
    p.add_argument("--pretrain-epochs", type=float, default=5, help="passes over A's 512 images (default 5)")
    p.add_argument("--json", type=Path, help="result JSON (default benchmarks/results/batch-lr-<date>.json)")
    p.add_argument("--_arm", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.data = a.data or a.out / "data"
    if a._arm:
        child(a)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    write_sets(a.data)
    common = ["--out", str(a.out), "--data", str(a.data), "--seeds", *map(str, a.seeds), "--epochs", str(a.epochs),
              "--warmup-epochs", str(a.warmup_epochs), "--pretrain-epochs", str(a.pretrain_epochs)]
    for arm in ["pretrain", *a.arms]:
        if arm == "pretrain" and (a.out / "pretrain" / "result.json").exists():
            continue
        print(f"== {arm}", flush=True)
        subprocess.run([sys.executable, __file__, "--_arm", arm, *common], check=True, cwd=ROOT)
    pretrain = json.loads((a.out / "pretrain" / "result.json").read_text())
    runs = [json.loads((a.out / f"{arm}-seed{s}" / "result.json").read_text()) for arm in a.arms for s in a.seeds]
    summary = {arm: {key: spread([r[key] for r in runs if r["arm"] == arm])
                     for key in ("mAP", "mAP50", "raw_mAP", "raw_mAP50")} for arm in a.arms}
    print("\n| arm | batch | lr (decoder / encoder) | steps | mAP mean ± std | SE | mAP50 mean ± std | SE | n |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm in a.arms:
        r0, s = next(r for r in runs if r["arm"] == arm), summary[arm]
        print(f"| {arm} | {r0['batch']} | {r0['lr']:.1e} / {r0['lr_encoder']:.2e} | {r0['steps']} | "
              f"{s['mAP']['mean']:.4f} ± {s['mAP']['std']:.4f} | {s['mAP']['se']:.4f} | "
              f"{s['mAP50']['mean']:.4f} ± {s['mAP50']['std']:.4f} | {s['mAP50']['se']:.4f} | {s['mAP']['n']} |")
    print("\nper run: " + "; ".join(f"{r['arm']} s{r['seed']} mAP {r['mAP']:.4f} raw {r['raw_mAP']:.4f} "
                                    f"{r['wall_s']:.0f} s" for r in runs))
    date = datetime.date.today().isoformat()
    path = a.json or ROOT / "benchmarks" / "results" / f"batch-lr-{date}.json"
    payload = {
        "question": "fine-tuning at 4x the batch: rfdetr's LR unchanged, x sqrt(4), or x4?",
        "command": "python benchmarks/batch_lr.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": MODEL, "base_lr": BASE_LR, "base_lr_encoder": BASE_LR_ENCODER, "base_batch": B0,
        "epochs": a.epochs, "warmup_epochs": a.warmup_epochs, "pretrain_epochs": a.pretrain_epochs,
        "pretrain": pretrain, "data": {"A": "synth seed 11, 3 classes, 512 train / 64 valid, 64 px, 1-4 shapes",
                                       "B": "synth seed 22, 6 classes, 256 train / 256 valid, 64 px, 1-4 shapes"},
        "scored_by": "fit's final eval on B's valid split, pycocotools, maxDets 100; mAP: EMA weights, raw_mAP: raw",
        "runs": runs, "summary": summary}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    plot(path.with_suffix(".png"), runs, a.arms,
         f"fine-tune {a.epochs:g} epochs on synth B from one checkpoint; per seed, mean ± SE")
    print(f"wrote {path} and its .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

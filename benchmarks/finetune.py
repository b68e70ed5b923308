#!/usr/bin/env python
"""Fine-tuning accuracy yardstick (issue 50): ours against upstream rfdetr's own trainer, and bf16 against fp32.

    python benchmarks/finetune.py --arms ours upstream ours-bf16 --seeds 1 2 3 4 5 6 7 8  # 1-7 min a run, 2 cores

Reuses ``benchmarks/batch_lr.py``'s sets and checkpoint (``--pretrain``: its ``pretrain/last.pth``, the tiny Nano cut
to 6 DINOv2 blocks at 64 px, pretrained on set A; ``--data``: its sets A and B, written by ``batch_lr.py`` if missing).
Per seed, one fine-tune from that checkpoint on B per arm, 4 passes (1 of warm-up, then cosine to 0.05), batch 8,
rfdetr's LR (1e-4 decoder, 1.5e-4 encoder):

- ``ours``: ``fit`` on the 4-device CPU mesh, exactly as ``batch_lr.py``'s ``b8`` arm (fp32); its ``last.pth`` (EMA);
- ``ours-bf16``: the same with ``--trainer.precision bf16`` (autocast, fp32 weights: how the TPU recipes train);
- ``ours-bf16-streams``: ``ours-bf16`` with ``--trainer.bf16_streams true`` (the residual streams in bf16);
- ``ours-bf16-streams-fused``: that with ``--trainer.fused_attention true`` (the attention kernels, here run by Pallas's
  interpreter: the kernels' arithmetic, on the CPU);
- ``ours-bf16-keypoint-groups`` (``--task keypoints``): ``ours-bf16`` with ``--trainer.keypoint_groups 1`` (the
  keypoint stream on the first query group only);
- ``upstream``: rfdetr's own trainer, ``RFDETRNano(...).train(pretrain_weights=<the same checkpoint>, ...)`` (eager,
  CPU, a process without torch_xla), given our recipe and our LR factor per step (``convergence.py``'s
  ``upstream_train_kwargs(match_lr=True)``); its DINOv2 built with 6 blocks by the patch our builder uses
  (``run_upstream_trainer``); its ``last_ema.pth``. Before it trains, its Lightning module's weights are checked
  against the checkpoint (every key, shape and value) and against the model ``fit`` builds (``verify.json``).

``--task seg`` (the mask yardstick, for numerics options on Seg): ``configs/cpu-seg.yaml``'s Seg Nano cut to 6
DINOv2 blocks at 96 px, pretrained by this script on set A drawn at 96 px (``--pretrain-epochs``, from scratch at
cpu-seg.yaml's LR), fine-tuned on B as above and scored by COCO **mask** mAP (``segm``; box mAP beside it); our arms
only (``upstream`` is detection only here). Writes ``finetune-seg-<date>.{json,png}``.

``--task keypoints`` (the OKS yardstick, for numerics options on the keypoint model): ``configs/cpu-keypoints.yaml``'s
RF-DETR keypoint model (GroupPose, 30 queries in 2 groups, 2 decoder layers; rfdetr's 13 groups took ~17 GB and
~20 s a step here) with 6 DINOv2 blocks at 96 px, pretrained by this script (6 epochs) on set A drawn with synth's 5
keypoints per shape, fine-tuned on B3 (seed 22, A's 3 classes: the keypoint schema, one token per class keypoint,
fixes the weights' shapes, and users fine-tune the published keypoint weights on the same skeleton) and scored by
COCO **keypoint** (OKS) mAP, maxDets 20 as rfdetr scores it. Writes ``finetune-keypoints-<date>.{json,png}``.

Every arm's final EMA weights are scored the same way: upstream's eager model, PostProcess and CocoEvaluator
(``convergence.eager_stats``) on B's valid split (256 images, maxDets 100), with the pretraining run's config pointed
at B. Runs land in ``--out`` (a run with ``score.json`` is reused); before each training run the script waits while
``/tmp/cores_reserved`` exists, and starts none after ``--deadline``. Writes ``benchmarks/results/finetune-<date>.
{json,png}``: per run arm, seed, mAP, mAP50, wall s; per arm mean, sample std, standard error; the gaps ours -
upstream, ours-bf16 - ours and ours-bf16-streams - ours-bf16 with the standard error of the difference,
sqrt(se_a^2 + se_b^2), and for two of our arms (same seed, same data order and draws) the paired one: mean and SE of
the per-seed differences. ``--baseline`` takes the runs of an arm not run in ``--out`` from an earlier result JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_lr import MODEL, SETS, fit_in_process, finetune_args, last_eval, pretrain, write_sets  # noqa: E402
from convergence import (NOT_MATCHED, _env_without_xla, _train_images, eager_coco_stats,  # noqa: E402
                         run_upstream_trainer, spread, upstream_train_kwargs)

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"ours": [], "upstream": None, "ours-bf16": ["--trainer.precision", "bf16"],
        "ours-bf16-streams": ["--trainer.precision", "bf16", "--trainer.bf16_streams", "true"],
        "ours-bf16-streams-fused": ["--trainer.precision", "bf16", "--trainer.bf16_streams", "true",
                                    "--trainer.fused_attention", "true"],
        "ours-bf16-keypoint-groups": ["--trainer.precision", "bf16", "--trainer.keypoint_groups", "1"]}
RESERVED = Path("/tmp/cores_reserved")
#: ``--task seg``: ``configs/cpu-seg.yaml``'s Seg Nano cut to 6 DINOv2 blocks at 96 px (its 12 px patches)
SEG_MODEL = ["--config", "configs/cpu-seg.yaml", "--model.resolution", "96", "--model.backbone_blocks", "6",
             "--model.num_classes", "6", "--data.max_targets", "4", "--eval.global_batch_size", "32",
             "--eval.max_dets", "100", "--trainer.progress_bar", "false", "--trainer.log_every", "8"]
#: ``--task keypoints``: ``configs/cpu-keypoints.yaml``'s keypoint model (2 query groups) with 6 DINOv2 blocks at 96 px;
#: the classes come from the data (A's and B3's: 3 shapes, 5 keypoints each)
KEYPOINT_MODEL = ["--config", "configs/cpu-keypoints.yaml", "--model.resolution", "96", "--model.backbone_blocks", "6",
                  "--data.max_targets", "4", "--eval.global_batch_size", "32",
                  "--eval.max_dets", "100", "--trainer.progress_bar", "false", "--trainer.log_every", "8"]
#: ``--task keypoints``' sets: A as the other tasks', B3 a new draw of A's classes (see the module docstring)
KEYPOINT_SETS = {"A": SETS["A"], "B": (22, 3, 256, 256)}
#: task -> the model's fit options, default data / checkpoint / runs, the COCO metric scored ("mAP" in the results)
TASKS: dict[str, dict[str, Any]] = {
    "detect": {"model": MODEL, "data": Path("/tmp/batch_lr/data"), "pretrain": Path("/tmp/batch_lr/pretrain/last.pth"),
               "out": Path("/tmp/finetune"), "metric": "bbox", "image_size": 64},
    "seg": {"model": SEG_MODEL, "data": Path("/tmp/finetune_seg/data"),
            "pretrain": Path("/tmp/finetune_seg/pretrain/last.pth"), "out": Path("/tmp/finetune_seg/runs"),
            "metric": "segm", "image_size": 96, "pretrain_epochs": 8},
    "keypoints": {"model": KEYPOINT_MODEL, "data": Path("/tmp/finetune_kp/data"),
                  "pretrain": Path("/tmp/finetune_kp/pretrain/last.pth"), "out": Path("/tmp/finetune_kp/runs"),
                  "metric": "keypoints", "image_size": 96, "sets": KEYPOINT_SETS, "pretrain_epochs": 6}}
#: (arm, reference arm) pairs whose mean gap is reported
GAPS = [("ours", "upstream"), ("ours-bf16", "ours"), ("ours-bf16-streams", "ours-bf16"),
        ("ours-bf16-streams-fused", "ours-bf16-streams"), ("ours-bf16-keypoint-groups", "ours-bf16")]


def may_start(a: argparse.Namespace) -> bool:
    """Waits while another job reserves the cores; False once past ``--deadline`` (no new run then)."""
    said = False
    while RESERVED.exists():
        if not said:
            print(f"{RESERVED} exists: waiting", flush=True)
            said = True
        time.sleep(30)
    return a.deadline is None or datetime.datetime.now(datetime.timezone.utc) < a.deadline


def ours_child(a: argparse.Namespace, arm: str) -> None:
    """One ``fit`` per seed of ``arm`` in this process (its seeds share the compiled programs)."""
    for seed in a.seeds:
        run = a.out / f"{arm}-seed{seed}"
        if (run / "train.json").exists():
            continue
        if not may_start(a):
            return
        wall = fit_in_process([*finetune_args(a.data / "B", a.pretrain, run, seed, a.epochs, a.warmup_epochs,
                                              base_model=False), *ARMS[arm]], TASKS[a.task]["model"])
        own = last_eval(run)
        (run / "train.json").write_text(json.dumps({"wall_s": round(wall, 1), "steps": own["steps"],
                                                    "own_eval_mAP": own["mAP"], "own_eval_mAP50": own["mAP50"],
                                                    **{f"own_eval_{k}": v for k, v in own.items()
                                                       if k in ("segm_mAP", "kp_mAP")}}))


def upstream_child(a: argparse.Namespace, seed: int) -> None:
    """rfdetr's own trainer for one seed (no torch_xla in this process); checks its starting weights first."""
    import torch
    from rfdetr.training import RFDETRModelModule

    from spmd_rfdetr.cli import run_config
    from spmd_rfdetr.config.length import size_in_steps
    from spmd_rfdetr.model.upstream import build_model, upstream_configs

    run = a.out / f"upstream-seed{seed}"
    cfg = run_config([*MODEL, *finetune_args(a.data / "B", a.pretrain, run, seed, a.epochs, a.warmup_epochs)])
    train_images = _train_images(a.data / "B")
    size_in_steps(cfg, train_images)  # warm-up epochs -> steps, as fit converts them (the LR factor reads them)
    per_epoch = train_images // cfg.data.global_batch_size
    model, train = upstream_train_kwargs(cfg, int(a.epochs), per_epoch, int(a.epochs), seed, run, match_lr=True)
    checkpoint = torch.load(a.pretrain, map_location="cpu", weights_only=False)["model"]
    ours = build_model(upstream_configs(cfg.model, cfg.data, cfg.optim, cfg.model.num_classes), training=True)
    verified: dict[str, Any] = {}
    init = RFDETRModelModule.__init__

    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:  # the module train() builds, before it trains
        init(self, *args, **kwargs)
        theirs = self.model.state_dict()
        for name, ref in (("checkpoint", checkpoint), ("ours", ours.state_dict())):
            same_keys = sorted(theirs) == sorted(ref)
            diff = max(((theirs[k].float() - ref[k].float()).abs().max().item() for k in theirs
                        if k in ref and theirs[k].shape == ref[k].shape and ref[k].numel()), default=float("nan"))
            shapes = same_keys and all(theirs[k].shape == ref[k].shape for k in theirs)
            verified[name] = {"same_keys": same_keys, "same_shapes": shapes, "max_abs_diff": diff,
                              "tensors": len(ref), "numel": sum(v.numel() for v in ref.values())}
            if not (same_keys and shapes and diff == 0):
                raise SystemExit(f"upstream's starting model differs from {name}: {verified[name]}")
        verified["upstream_params"] = sum(p.numel() for p in self.model.parameters())
        verified["ours_params"] = sum(p.numel() for p in ours.parameters())
        verified["backbone_blocks"] = 1 + max(int(k.split(".layer.")[1].split(".")[0]) for k in theirs
                                              if k.startswith("backbone.") and ".layer." in k)

    RFDETRModelModule.__init__ = checked_init
    started = time.perf_counter()
    run_upstream_trainer(cfg, model, train)
    wall = time.perf_counter() - started
    (run / "train.json").write_text(json.dumps({"wall_s": round(wall, 1), "steps": int(a.epochs) * per_epoch,
                                                "verify": verified, "upstream_model_kwargs": model}))


def score_child(a: argparse.Namespace) -> None:
    """Upstream's eager evaluator on B's valid split for every trained run without ``score.json``."""
    import torch

    c = torch.load(a.pretrain, map_location="cpu", weights_only=False)["config"]
    c["data"]["dataset_dir"] = str(a.data / "B")  # the pretraining run's model and eval settings, on set B
    metric = TASKS[a.task]["metric"]
    for run in sorted(a.out.glob("*-seed*")):
        if (run / "score.json").exists() or not (run / "train.json").exists():
            continue
        weights = run / ("last_ema.pth" if run.name.startswith("upstream") else "last.pth")
        stats = eager_coco_stats(c, torch.load(weights, map_location="cpu", weights_only=False)["model"], "valid",
                                 tuple(dict.fromkeys(("bbox", metric))))
        box = stats["bbox"]
        s = stats[metric]
        (run / "score.json").write_text(json.dumps({"mAP": s[0], "mAP50": s[1], "stats": s, "metric": metric,
                                                    "box_mAP": box[0], "box_mAP50": box[1]}))
        print(f"{run.name}: {metric} mAP {s[0]:.4f} mAP50 {s[1]:.4f} (box mAP {box[0]:.4f})", flush=True)


def child_cmd(a: argparse.Namespace, *extra: str) -> list[str]:
    return ["nice", "-n", "19", sys.executable, __file__, "--task", a.task, "--out", str(a.out), "--data",
            str(a.data), "--pretrain", str(a.pretrain), "--epochs", str(a.epochs), "--warmup-epochs",
            str(a.warmup_epochs), *(["--pretrain-epochs", str(a.pretrain_epochs)] if a.pretrain_epochs else []),
            "--seeds", *map(str, a.seeds),
            *(["--deadline", a.deadline.isoformat()] if a.deadline else []), *extra]


def collect(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The scored runs in ``--out``, and ``--baseline``'s runs of the arms with none there."""
    runs = []
    for arm in a.arms:
        for seed in a.seeds:
            run = a.out / f"{arm}-seed{seed}"
            if (run / "score.json").exists():
                t, s = (json.loads((run / f).read_text()) for f in ("train.json", "score.json"))
                runs.append({"arm": arm, "seed": seed, "mAP": s["mAP"], "mAP50": s["mAP50"], "wall_s": t["wall_s"],
                             "steps": t["steps"], **{k: v for k, v in t.items() if k.startswith("own_eval")},
                             **{k: v for k, v in s.items() if k.startswith("box_")},
                             **({"note": t["note"]} if "note" in t else {})})  # a note: wall_s not comparable
    here = {r["arm"] for r in runs}
    runs += [{**r, "from": str(a.baseline)} for r in a.earlier
             if r["arm"] in a.arms and r["arm"] not in here and r["seed"] in a.seeds]
    return runs


def report(a: argparse.Namespace, argv: list[str]) -> None:
    runs = collect(a)
    arms = [arm for arm in a.arms if any(r["arm"] == arm for r in runs)]
    summary = {arm: {k: spread([r[k] for r in runs if r["arm"] == arm and not (k == "wall_s" and "note" in r)])
                     for k in ("mAP", "mAP50", "wall_s")} for arm in arms}
    gaps = {}
    for arm, ref in GAPS:
        if arm in summary and ref in summary and min(summary[arm]["mAP"]["n"], summary[ref]["mAP"]["n"]) > 1:
            x, y = summary[arm]["mAP"], summary[ref]["mAP"]
            gaps[f"{arm} - {ref}"] = {"mAP": x["mean"] - y["mean"], "se": (x["se"] ** 2 + y["se"] ** 2) ** 0.5}
            seeds = {r["seed"]: r["mAP"] for r in runs if r["arm"] == ref}
            pairs = [r["mAP"] - seeds[r["seed"]] for r in runs if r["arm"] == arm and r["seed"] in seeds]
            if "upstream" not in (arm, ref) and len(pairs) > 1:  # ours' arms share each seed's data order and draws
                paired = spread(pairs)
                gaps[f"{arm} - {ref}"]["paired"] = {"mAP": paired["mean"], "se": paired["se"], "n": paired["n"]}
    print("\n| arm | n | mAP mean ± std | SE | mAP50 mean ± std | SE | wall s (mean) |")
    print("|---|---|---|---|---|---|---|")
    for arm in arms:
        s = summary[arm]
        print(f"| {arm} | {s['mAP']['n']} | {s['mAP']['mean']:.4f} ± {s['mAP']['std']:.4f} | {s['mAP']['se']:.4f} | "
              f"{s['mAP50']['mean']:.4f} ± {s['mAP50']['std']:.4f} | {s['mAP50']['se']:.4f} | "
              f"{s['wall_s']['mean']:.0f} |")
    for name, g in gaps.items():
        print(f"gap {name}: {g['mAP'] * 100:+.2f} AP ± {g['se'] * 100:.2f} (SE of the difference)")
        if "paired" in g:
            print(f"  paired by seed: {g['paired']['mAP'] * 100:+.2f} AP ± {g['paired']['se'] * 100:.2f} "
                  f"(n={g['paired']['n']})")
    verify = [json.loads((a.out / f"upstream-seed{s}" / "train.json").read_text())["verify"]
              for s in a.seeds if (a.out / f"upstream-seed{s}" / "train.json").exists()]
    task = TASKS[a.task]
    name = "finetune" if a.task == "detect" else f"finetune-{a.task}"
    path = a.json or ROOT / "benchmarks" / "results" / f"{name}-{datetime.date.today().isoformat()}.json"
    seed, classes, train, valid = task.get("sets", SETS)["B"]
    payload = {
        "question": ("fine-tuning from one checkpoint: ours (fit, fp32 / bf16) vs upstream rfdetr's own trainer"
                     if a.task == "detect" else f"fine-tuning {a.task} from one checkpoint: our numerics options"),
        "command": "python benchmarks/finetune.py " + " ".join(argv), "task": a.task,
        "metric": f"COCO {task['metric']} mAP (\"mAP\"; box_mAP beside it)",
        "model": task["model"], "pretrain": str(a.pretrain), "epochs": a.epochs, "warmup_epochs": a.warmup_epochs,
        "pretrain_run": (json.loads((a.pretrain.parent / "result.json").read_text())
                         if (a.pretrain.parent / "result.json").exists() else None),
        "data_B": f"synth seed {seed}, {classes} classes, {train} train / {valid} valid, {task['image_size']} px, "
                  "1-4 shapes",
        "scored_by": "upstream's eager model + PostProcess + CocoEvaluator, B's valid split, maxDets 100, final EMA",
        "upstream": "RFDETRNano(...).train(...), our LR factor per step (LambdaLR), 6-block DINOv2, last_ema.pth",
        "upstream_start_verified": verify[0] if verify else None, "not_matched": NOT_MATCHED,
        "runs": runs, "summary": summary, "gaps": gaps}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    plot(path.with_suffix(".png"), runs, arms, summary, task["metric"])
    print(f"wrote {path} and its .png")


def plot(path: Path, runs: list[dict[str, Any]], arms: list[str], summary: dict[str, Any], metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, arm in enumerate(arms):
        vals = [r["mAP"] for r in runs if r["arm"] == arm]
        ax.plot([i] * len(vals), vals, "o", alpha=0.6)
        s = summary[arm]["mAP"]
        ax.errorbar([i + 0.15], [s["mean"]], yerr=[s["se"] if s["n"] > 1 else 0], fmt="_", color="k",
                    markersize=14, capsize=4)
    ax.set_xticks(range(len(arms)), [f"{arm}\nn={summary[arm]['mAP']['n']}" for arm in arms])
    ax.set_ylabel(f"COCO {metric} mAP, B's valid split (256 images)")
    ax.set_title("fine-tune on synth B from one checkpoint, upstream's evaluator: runs, mean ± SE", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=list(TASKS), default="detect",
                   help="detect (box mAP), seg (mask mAP, Seg Nano) or keypoints (OKS mAP); seg and keypoints: "
                        "ours' arms only")
    p.add_argument("--out", type=Path, help="runs (a scored run is reused; default: the task's, TASKS)")
    p.add_argument("--data", type=Path, help="the synthetic sets A and B (written if missing; default: the task's, "
                                             "detect: batch_lr.py's /tmp/batch_lr/data)")
    p.add_argument("--pretrain", type=Path, help="the pretraining checkpoint (written if missing; default: the "
                                                 "task's, detect: batch_lr.py's)")
    p.add_argument("--pretrain-epochs", type=float,
                   help="seg, keypoints: passes over A's 512 images when pretraining (default: seg 8, keypoints 6)")
    p.add_argument("--arms", nargs="+", default=["ours", "upstream"], choices=list(ARMS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--epochs", type=int, default=4, help="fine-tuning passes over B's train split (default 4)")
    p.add_argument("--warmup-epochs", type=float, default=1.0, help="warm-up passes (default 1)")
    p.add_argument("--deadline", type=datetime.datetime.fromisoformat,
                   help="UTC time (ISO, e.g. 2026-12-06T10:45+00:00) after which no run starts")
    p.add_argument("--json", type=Path, help="result JSON (default benchmarks/results/finetune-<date>.json)")
    p.add_argument("--baseline", type=Path, help="an earlier result JSON: its runs of arms with none in --out")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for key in ("out", "data", "pretrain", "pretrain_epochs"):
        setattr(a, key, getattr(a, key) or TASKS[a.task].get(key))
    if a.task != "detect" and "upstream" in a.arms and not a._child:
        p.error(f"--task {a.task} compares our arms only (upstream's trainer is wired for detection only here)")
    a.earlier = json.loads(a.baseline.read_text())["runs"] if a.baseline else []  # --baseline's runs, read once
    if a._child == "score":
        score_child(a)
    elif a._child == "pretrain":  # --task seg/keypoints' checkpoint, --pretrain's directory (the config's LR)
        pretrain(a.data / "A", a.pretrain.parent, a.pretrain_epochs, TASKS[a.task]["model"], evaluations=2)
    elif a._child == "upstream":
        upstream_child(a, a.seeds[0])
    elif a._child:
        ours_child(a, a._child)
    if a._child:
        return 0
    if a.task == "detect" and (not a.pretrain.exists() or not (a.data / "B").exists()):
        subprocess.run([sys.executable, "benchmarks/batch_lr.py", "--out", str(a.pretrain.parents[1]), "--data",
                        str(a.data), "--arms", "b8", "--seeds", "1"], check=True, cwd=ROOT)
    if a.task != "detect":
        write_sets(a.data, TASKS[a.task]["image_size"], a.task == "keypoints", TASKS[a.task].get("sets", SETS))
    if not a.pretrain.exists():
        subprocess.run(child_cmd(a, "--_child", "pretrain"), check=True, cwd=ROOT)
    a.out.mkdir(parents=True, exist_ok=True)
    for arm in a.arms:
        if any(r["arm"] == arm for r in a.earlier):  # its runs come from --baseline
            continue
        print(f"== {arm}", flush=True)
        if arm != "upstream":
            subprocess.run(child_cmd(a, "--_child", arm), check=True, cwd=ROOT)
        for seed in a.seeds if arm == "upstream" else []:
            if not (a.out / f"upstream-seed{seed}" / "train.json").exists() and may_start(a):
                subprocess.run([*child_cmd(a, "--_child", "upstream"), "--seeds", str(seed)], check=True, cwd=ROOT,
                               env=_env_without_xla())
        subprocess.run(child_cmd(a, "--_child", "score"), check=True, cwd=ROOT, env=_env_without_xla())
    report(a, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

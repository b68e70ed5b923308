#!/usr/bin/env python
"""Convergence check: a short ``fit`` on the synthetic dataset, then the final weights scored twice.

    python benchmarks/convergence.py                           # configs/cpu.yaml, 200 steps, eval every 50
    python benchmarks/convergence.py --steps 100 --json out.json

1. ``python -m spmd_rfdetr synth`` writes the built-in dataset (separate train/valid images) unless ``--data`` exists.
2. ``python -m spmd_rfdetr fit`` trains on the mesh with evaluation inside ``fit`` (our compiled eval, pycocotools).
3. In a fresh process without XLA, upstream rfdetr scores ``last.pth`` on the same valid split its own way: its model
   in eager mode, its ``PostProcess`` and its ``CocoEvaluator``.

Prints both and writes a JSON (default ``benchmarks/results/convergence-<config>-<steps>steps-<date>.json``). Exits
non-zero when the two mAPs differ by more than ``--tolerance`` (0.005 = 0.5 AP).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing the package


def upstream_eager_stats(checkpoint: Path, split: str) -> list[float]:
    """rfdetr's own eager evaluation of a ``fit`` checkpoint (run in a process without torch_xla)."""
    import torch
    from rfdetr.datasets import get_coco_api_from_dataset
    from rfdetr.evaluation.coco_eval import CocoEvaluator

    from spmd_rfdetr.config import DataOptions, ModelOptions, OptimOptions
    from spmd_rfdetr.data import upstream_split
    from spmd_rfdetr.model import build_model, build_upstream_criterion, upstream_configs
    from spmd_rfdetr.step import as_samples

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    c = state["config"]
    cfgs = upstream_configs(ModelOptions(**c["model"]), DataOptions(**c["data"]), OptimOptions(**c["optim"]),
                            c["model"]["num_classes"])
    dataset = upstream_split(cfgs, split)  # rfdetr's own dataset and float pipeline
    net = build_model(cfgs)
    net.load_state_dict(state["model"])
    net.eval()
    postprocess = build_upstream_criterion(cfgs)[1]
    max_dets = c["eval"].get("max_dets", 100)  # the fit's own eval setting (before it existed: pycocotools' 100)
    evaluator = CocoEvaluator(get_coco_api_from_dataset(dataset), ["bbox"], max_dets=max_dets, log_summary=False)
    with torch.no_grad():
        for start in range(0, len(dataset), 8):
            items = [dataset[i] for i in range(start, min(start + 8, len(dataset)))]
            outputs = net(as_samples(torch.stack([image for image, _ in items])))
            results = postprocess(outputs, torch.stack([target["orig_size"] for _, target in items]))
            evaluator.update({int(target["image_id"]): r for (_, target), r in zip(items, results)})
    evaluator.synchronize_between_processes()
    evaluator.accumulate()
    return [float(v) for v in evaluator.coco_eval["bbox"].stats]


def run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/cpu.yaml")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--data", type=Path, help="synthetic dataset dir (written if missing; default: a temp dir)")
    p.add_argument("--out", type=Path, help="fit output dir (default: a temp dir)")
    p.add_argument("--json", type=Path, help="result JSON")
    p.add_argument("--tolerance", type=float, default=0.005, help="max |mAP ours - mAP upstream| (default 0.005)")
    p.add_argument("--_upstream", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._upstream:  # child: upstream eager eval, prints its stats as JSON
        print(json.dumps(upstream_eager_stats(args._upstream, "valid")))
        return 0

    work = Path(tempfile.mkdtemp(prefix="spmd_rfdetr_convergence_"))
    data, out = args.data or work / "synth", args.out or work / "fit"
    if not data.exists():
        run([sys.executable, "-m", "spmd_rfdetr", "synth", "--output_dir", str(data)])
    run([sys.executable, "-m", "spmd_rfdetr", "fit", "--config", args.config, "--data.dataset_dir", str(data),
         "--trainer.output_dir", str(out), "--trainer.max_steps", str(args.steps),
         "--eval.every_steps", str(args.eval_every), "--trainer.progress_bar", "false"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [{"step": r["step"], **{k[5:]: v for k, v in r.items() if k.startswith("eval/")}}
             for r in records if "eval/mAP" in r]
    child = subprocess.run([sys.executable, __file__, "--_upstream", str(out / "last.pth")], cwd=ROOT, check=True,
                           capture_output=True, text=True, env=_env_without_xla())
    from spmd_rfdetr.coco import stat_names

    max_dets = json.loads((out / "eval" / f"step{records[-1]['step']:07d}_coco_eval.json").read_text())["max_dets"]
    upstream = dict(zip(stat_names(max_dets), json.loads(child.stdout.strip().splitlines()[-1])))
    ours = evals[-1]
    diff = abs(ours["mAP"] - upstream["mAP"])
    print("\n| step | mAP | mAP50 | mAP75 |\n|---|---|---|---|")
    for e in evals:
        print(f"| {e['step']} | {e['mAP']:.4f} | {e['mAP50']:.4f} | {e['mAP75']:.4f} |")
    print(f"| {args.steps}, upstream eager | {upstream['mAP']:.4f} | {upstream['mAP50']:.4f} | "
          f"{upstream['mAP75']:.4f} |")
    print(f"\n|mAP ours - mAP upstream eager| = {diff:.2e} (tolerance {args.tolerance})")
    date = datetime.date.today().isoformat()
    path = args.json or ROOT / "benchmarks" / "results" / f"convergence-{Path(args.config).stem}-{args.steps}steps-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"config": args.config, "steps": args.steps, "eval_every": args.eval_every,
                               "ours": evals, "upstream_eager_final": upstream, "abs_diff_mAP": diff,
                               "train_loss": [(r["step"], r["loss"]) for r in records]}
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return 0 if diff <= args.tolerance else 1


def _env_without_xla() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS")}


if __name__ == "__main__":
    sys.exit(main())

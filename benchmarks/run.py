#!/usr/bin/env python
"""Our SPMD training step side by side with upstream rfdetr's own XLA training path, on the same XLA device.

    python benchmarks/run.py --config configs/v5e.yaml --compare upstream --warmup 3 --steps 5
    python benchmarks/run.py --config configs/cpu.yaml --scaling 1,2,4,8            # our side over mesh sizes
    python benchmarks/run.py --config configs/v5e.yaml --matcher                     # assignment micro-benchmark
    python benchmarks/run.py --config configs/v5e.yaml --compare upstream --tpu-compiler v5e:1x1 --warmup 2 --steps 1 \
        --ours-report report.json   # upstream's step graphs on the TPU compiler, beside ours (aot --json report.json)
    python benchmarks/run.py --config configs/cpu.yaml --compare upstream --step-mode replay,trace  # ours per mode
    python benchmarks/run.py --config configs/cpu.yaml --loader --loader-workers 0,1,2  # input pipeline, no XLA
    python benchmarks/run.py --config configs/v5e.yaml --loader --loader-jpegs 640x480,1280x960 --batch 16

Each side runs in its own subprocess (SPMD is process-global in torch_xla): the parent re-invokes this script with
``--_child ours|upstream|matcher``, collects its JSON, prints a markdown table and writes a JSON file and a PNG plot
(default names say model, resolution, batch, hardware and date, under ``benchmarks/results/``).

- ours: ``spmd_rfdetr``'s one-graph ``TrainStep`` (device matcher) as ``build_trainer`` builds it for ``fit``, on an
  SPMD mesh over every device, batch sharded on the ``data`` axis, via our Lightning Fabric plugins; once per
  ``--step-mode`` (``replay``: traced once, its compiled program replayed; ``trace``: ``torch_xla.compile`` lazy
  tracing every step), each in its own child, back to back, on the same batches and seed.
- upstream: rfdetr's LWDETR + SetCriterion + HungarianMatcher (SciPy, through the host) + AdamW on ``get_param_dict``
  + ``clip_grad_norm_`` in the order its Lightning module runs them, plain lazy torch_xla on ONE device (no SPMD),
  ``torch_xla.sync()`` after the optimizer step as Lightning's XLA precision plugin does. Lightning's own logging and
  progress-bar reads are not included. With ``--precision bf16`` upstream runs ``XLA_USE_BF16=1`` ("bf16-true", what
  rfdetr picks on TPU); ours runs bf16 autocast with fp32 weights ("bf16-mixed").

Both sides train the same model config from the same initial weights (same seed) on the same fixed synthetic batches
(deterministic random images, 1..T valid random boxes per image), which are put on the device once before timing:
neither data loading nor the host->device input copy is measured. Both sides train at a constant learning rate (ours
still steps its device-tensor LR schedule inside the step as ``fit`` does, with a constant factor of 1).
Every step is timed on its own: ``time.perf_counter()`` around the step call and ``xm.wait_device_ops()`` (which
moves no data to the host), so host time (tracing + dispatch, and for upstream its synchronous matcher round trips)
and wall time per step are both reported; warm-up steps (where compilation happens) are plotted but not in the
statistics. Then the same number of steps runs back to back with one wait at the end, as a training loop runs them
("step time in a loop"); its wall time minus its XLA execute time is the host's cost per step outside graph
execution. Counters come from ``torch_xla.debug.metrics``.

On a CPU host (``PJRT_DEVICE`` unset or ``CPU``) ours runs on ``--devices`` virtual XLA CPU devices
(``CPU_NUM_DEVICES``; default 1: virtual devices share the host's cores, so the like-for-like comparison is one
device each; Nano at batch 2 measured 6.6 s/step on 2 virtual devices against 4.2 s on one, on 2 cores), upstream on
one. On a TPU VM every visible chip is used by ours and one device by upstream; to benchmark fewer chips, restrict
the visible chips before starting (e.g. ``TPU_VISIBLE_CHIPS=0,1 TPU_CHIPS_PER_PROCESS_BOUNDS=1,2,1
TPU_PROCESS_BOUNDS=1,1,1``) and pass the same ``--devices`` (a mismatch with what the runtime sees is an error).

``--loader`` measures rfdetr's training dataset + transforms alone (images/s per DataLoader worker count and bytes
per batch, for the uint8 pipeline ``fit`` reads and rfdetr's float one), in this process, without an XLA runtime.

The pieces live in ``benchmarks/bench/`` (see its ``__init__``); this file is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT), str(HERE)):  # `python benchmarks/run.py` from a checkout, without installing the package
    if path not in sys.path:
        sys.path.insert(0, path)

from bench import children  # noqa: E402
from bench.config import (  # noqa: E402
    DEFAULT_NUM_CLASSES,
    STEP_MODES,
    apply_overrides,
    load_run_config,
    parse_step_modes,
)

CHILDREN = ("ours", "upstream", "matcher")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="a `fit` YAML (configs/*.yaml); its model/data/optim/trainer sections are used")
    p.add_argument("--compare", choices=["upstream"], help="also run upstream rfdetr's own XLA training path")
    p.add_argument("--tpu-compiler", metavar="TOPOLOGY", help="with --compare upstream: upstream's steady-state step "
                   "graphs (at the config's per-chip batch, one device) compiled by libtpu for one chip of TOPOLOGY "
                   "(e.g. v5e:1x1): bytes, FLOPs and roofline per image (bench/compiler.py)")
    p.add_argument("--hbm-only", action="store_true", help="with --tpu-compiler: compile with nothing kept in on-chip "
                   "memory, as `aot --hbm_only true` (the count is HBM traffic); --ours-report must be such a report")
    p.add_argument("--ours-report", type=Path, help="with --tpu-compiler: an `aot --json` report of the same config, "
                   "for ours beside upstream")
    p.add_argument("--upstream-graphs", type=Path, help="with --tpu-compiler: keep upstream's saved step graphs in "
                   "this directory, or compile the ones kept there by an earlier run of the same config instead of "
                   "running upstream's child again (~45 min for v5e.yaml on 2 cores)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps, not in the statistics (default 3)")
    p.add_argument("--json", type=Path, help="output JSON (default benchmarks/results/<model>-<res>-b<batch>-<hw>-<date>.json)")
    p.add_argument("--plot", type=Path, help="output PNG (default: the JSON's name with .png)")
    p.add_argument("--batch", type=int, help="global batch size (overrides data.global_batch_size/per_device_batch_size)")
    p.add_argument("--resolution", type=int, help="square input resolution (multiple of 32)")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="overrides trainer.precision")
    p.add_argument("--variant", choices=["nano", "small", "medium", "large", "base"], help="overrides model.variant")
    p.add_argument("--queries", type=int, help="overrides model.num_queries (queries per group)")
    p.add_argument("--group-detr", type=int, help="overrides model.group_detr")
    p.add_argument("--dec-layers", type=int, help="overrides model.dec_layers")
    p.add_argument("--targets", type=int, help="padded target slots per image T (overrides data.max_targets)")
    p.add_argument("--num-classes", type=int, help=f"classes (default model.num_classes, else {DEFAULT_NUM_CLASSES})")
    p.add_argument("--devices", type=int, help="devices for ours: CPU_NUM_DEVICES on a CPU host (default 1, "
                   "like upstream); on a TPU, a check against the visible devices")
    p.add_argument("--seed", type=int, default=0, help="weights and synthetic data seed (default 0)")
    p.add_argument("--no-flops", action="store_true", help="skip the CPU eager FLOP count (and MFU)")
    p.add_argument("--scaling", help="comma-separated mesh sizes, e.g. 1,2,4,8: our side only, one run per size")
    p.add_argument("--scaling-batch", choices=["weak", "strong"], default="weak",
                   help="weak: global batch = --per-device-batch x devices (default); strong: the global batch is "
                   "fixed (--batch / the config) and must divide by every size")
    p.add_argument("--per-device-batch", type=int, default=1, help="images per device in weak scaling (default 1)")
    p.add_argument("--matcher", action="store_true", help="assignment micro-benchmark: device solver vs SciPy + transfers")
    p.add_argument("--matcher-images", type=int, default=8, help="images per step in --matcher (default 8)")
    p.add_argument("--matcher-queries", default="30,300", help="queries per group Q in --matcher (default 30,300)")
    p.add_argument("--matcher-targets", default="1,10,50,100", help="targets T in --matcher (default 1,10,50,100)")
    p.add_argument("--step-mode", type=parse_step_modes, default=["replay"], metavar="MODE[,MODE...]",
                   help="how our step runs, comma-separated: one child per mode, back to back (default replay; "
                   "--scaling uses the first). " + "; ".join(f"{k}: {v.description}" for k, v in STEP_MODES.items()))
    p.add_argument("--loader", action="store_true", help="input pipeline only (no training, no XLA): rfdetr's train "
                   "dataset + transforms of the config, images/s per DataLoader worker count")
    p.add_argument("--loader-workers", default="0,1,2", help="DataLoader worker counts in --loader (default 0,1,2)")
    p.add_argument("--loader-batches", type=int, default=20,
                   help="timed batches per worker count in --loader, after one warm-up batch per worker (default 20)")
    p.add_argument("--loader-pipeline", default="float,uint8",
                   help="--loader pipelines, comma-separated (default float,uint8): uint8 = fit's (build_split: uint8 "
                   "pixels, normalised on the device); float = rfdetr's as it ships (ToDtype + Normalize on the host)")
    p.add_argument("--loader-repeats", type=int, default=1,
                   help="--loader runs per row, the pipelines taking turns; the row keeps the fastest (default 1)")
    p.add_argument("--loader-jpegs", metavar="WxH[,WxH...]",
                   help="--loader reads photo-like JPEGs of these sizes (written to a temporary folder) instead of "
                   "data.dataset_dir, e.g. 640x480,1280x960")
    p.add_argument("--dataset-dir", help="overrides data.dataset_dir (--loader reads it)")
    p.add_argument("--fast-compile", action="store_true", help="XLA CPU only: compile without LLVM optimisation "
                   f"(XLA_FLAGS+='{children.FAST_COMPILE_FLAGS}'); for smoke tests, slows execution")
    p.add_argument("--child-timeout", type=float, default=None, help="seconds before a side's subprocess is killed")
    p.add_argument("--_child", choices=CHILDREN, help=argparse.SUPPRESS)
    p.add_argument("--_spec", help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args._child:
        from bench import sides

        spec = json.loads(Path(args._spec).read_text())
        result = getattr(sides, f"child_{args._child}")(spec)
        Path(args._out).write_text(json.dumps(result, default=str))
        return
    children.FAST_COMPILE = args.fast_compile
    if children.on_cpu_host():
        os.environ.setdefault("PJRT_DEVICE", "CPU")  # the parent never starts a runtime; this only quiets probes
    cfg = load_run_config(args.config)
    apply_overrides(cfg, args)
    if args.loader:
        from bench.loader import main_loader

        main_loader(cfg, args)
        return
    from bench.commands import main_compare, main_matcher, main_scaling

    if args.tpu_compiler:
        if args.compare != "upstream":
            raise SystemExit("--tpu-compiler compiles upstream's step: add --compare upstream")
        from bench.compiler import main_upstream_compiler

        main_upstream_compiler(cfg, args)
    elif args.matcher:
        main_matcher(cfg, args)
    elif args.scaling:
        if args.compare:
            raise SystemExit("--scaling runs our side only; drop --compare")
        if len(args.step_mode) > 1:
            raise SystemExit("--scaling runs one step mode; pass one --step-mode")
        main_scaling(cfg, args)
    else:
        main_compare(cfg, args)


if __name__ == "__main__":
    main()

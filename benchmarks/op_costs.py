"""What one op of the training step costs on a TPU chip, by the TPU compiler: forward + backward of a variant alone at a
recipe's per-chip shapes, compiled ahead of time (libtpu, no TPU needed), its HBM bytes and FLOPs.

A whole-step ``aot`` compile takes ~10 minutes and 14 GB of RAM; one op takes seconds (a gather-heavy one a few
minutes), so a rewrite is measured here first and then in the step. The op is traced lazily on a one-device XLA CPU
backend, its HLO compiled for one chip of ``--topology``.

    python benchmarks/op_costs.py --json benchmarks/results/op-costs-deform-attention-v5e-2026-12-04.json

Ops: ``deform`` (deformable attention's core: rfdetr's own, with our row lookups, against
:mod:`spmd_rfdetr.model.deform_attention`) at v5e.yaml's shapes (16 images, 16 heads of 16 channels, 13 x 300
queries, 2 points) on the maps of Nano (24x24), Small (32x32) and Large (44x44).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "1")

import torch  # noqa: E402
import torch_xla  # noqa: E402


def compile_cost(outputs: list[torch.Tensor], devices: list) -> dict:
    """libtpu's cost and memory figures for the lazy XLA graph that computes ``outputs``."""
    from spmd_rfdetr.aot import tpu_compile

    start = time.time()
    exe = tpu_compile.compile_text(torch_xla._XLAC._get_xla_tensors_hlo(outputs), devices)
    cost, memory = tpu_compile._cost(exe), tpu_compile._memory(exe)
    torch_xla._XLAC._xla_sync_multi([], devices=[], wait=False)
    return {"bytes": cost["bytes_accessed"], "flops": cost["flops"], "temp_bytes": memory["temp"],
            "compile_s": round(time.time() - start, 1)}


def deform_cases() -> list[tuple[str, dict, Callable[[], tuple[Callable, list[torch.Tensor], dict]]]]:
    from rfdetr.models.ops.functions import ms_deform_attn_func

    from spmd_rfdetr.model.deform_attention import dense_core
    from spmd_rfdetr.model.row_lookups import row_sampler

    if not getattr(ms_deform_attn_func._bilinear_grid_sample, "_spmd_rfdetr", False):
        ms_deform_attn_func._bilinear_grid_sample = row_sampler(ms_deform_attn_func._bilinear_grid_sample,
                                                                 lambda: True)
    images, heads, channels, queries, points = 16, 16, 16, 13 * 300, 2
    cases = []
    for model, side in (("nano", 24), ("small", 32), ("large", 44)):
        shapes = [(side, side)]
        for variant, core in (("row lookups", ms_deform_attn_func.ms_deform_attn_core_pytorch),
                              ("one product", lambda v, s, loc, w, value_spatial_shapes_hw: dense_core(
                                  v, loc, w, value_spatial_shapes_hw))):
            def make(core=core, shapes=shapes, side=side):
                g = torch.Generator().manual_seed(0)
                value = torch.randn(images, heads, channels, side * side, generator=g).to(torch.bfloat16)
                locations = torch.rand(images, queries, heads, 1, points, 2, generator=g) * 1.1 - 0.05
                weights = torch.softmax(torch.randn(images, queries, heads, points, generator=g), -1)
                inputs = [t.to(torch_xla.device()).requires_grad_() for t in (value, locations, weights)]
                out = core(inputs[0], torch.tensor(shapes), inputs[1], inputs[2], value_spatial_shapes_hw=shapes)
                return out, inputs
            cases.append((f"deform {model} {side}x{side} {variant}", {"op": "deform", "model": model,
                                                                     "map": f"{side}x{side}", "variant": variant},
                          make))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v5e:1x1", help="compile for one chip of this topology")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    from spmd_rfdetr.aot import tpu_compile

    devices, _, _ = tpu_compile.build_topology(args.topology)
    rows = []
    for name, labels, make in deform_cases():
        out, inputs = make()
        forward = compile_cost([out], devices)
        grads = torch.autograd.grad(out.float().square().sum(), inputs)
        both = compile_cost([out, *grads], devices)
        rows.append({**labels, "forward": forward, "forward_backward": both})
        print(f"{name:34s} forward {forward['bytes'] / 1e9:6.2f} GB   forward+backward {both['bytes'] / 1e9:6.2f} GB"
              f"  {both['flops'] / 1e9:6.1f} GFLOP", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"topology": args.topology, "versions": tpu_compile.versions(),
                                         "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one op of the training step costs on a TPU chip, by the TPU compiler: forward + backward of a variant alone at a
recipe's per-chip shapes, compiled ahead of time (libtpu, no TPU needed), its HBM bytes and FLOPs.

A whole-step ``aot`` compile takes ~10 minutes and 14 GB of RAM; one op takes seconds (a gather-heavy one a few
minutes), so a rewrite is measured here first and then in the step. The op is traced lazily on a one-device XLA CPU
backend, its HLO compiled for one chip of ``--topology``.

    python benchmarks/op_costs.py --json benchmarks/results/op-costs-deform-attention-v5e-2026-12-04.json

``--hbm-only`` compiles with on-chip memory off, as ``aot --hbm_only true`` (issue 51's measure).

Ops (``--op``): ``deform`` (deformable attention's core: rfdetr's own, with our row lookups, against
:mod:`spmd_rfdetr.model.deform_attention`) at v5e.yaml's shapes (16 images, 16 heads of 16 channels, 13 x 300
queries, 2 points) on the maps of Nano (24x24), Small (32x32) and Large (44x44); ``attention`` (bf16 attention at
Nano's per-chip shapes on v5e.yaml: the decoder's self-attention ``[16 x 13, 8, 300, 32]``, DINOv2's windowed
``[16 x 4, 6, 145, 64]`` and global ``[16, 6, 580, 64]`` blocks): PyTorch's ``scaled_dot_product_attention``, ours
(:mod:`spmd_rfdetr.model.attention`) and torch_xla's Pallas flash attention (:func:`flash_padded`; not used by the
step yet: measured here to decide whether to).

    python benchmarks/op_costs.py --op attention --json benchmarks/results/op-costs-attention-v5e-2026-12-04.json

``fused``: the step's attention from the packed projections (``[N, L, heads x d]``) at the same three shapes, the
XLA path against ``trainer.fused_attention``'s Pallas kernels (:mod:`spmd_rfdetr.xla.fused_attention`).

    python benchmarks/op_costs.py --op fused --hbm-only

``criterion``: the matcher's cost (forward; the solver not included) and the detection losses (forward + backward,
from a fixed assignment) at v5e.yaml's per-chip shapes (16 images, 3 layers x 3,900 queries, 91 classes, 100
targets of which 1-39 real), as the step runs them.

    python benchmarks/op_costs.py --op criterion

``backbone``: one of Nano's DINOv2 layers (rfdetr's ``WindowedDinov2WithRegistersLayer``: norms, attention with its
projections, MLP, layer scales) under bf16 autocast at v5e.yaml's per-chip shapes, windowed (``[16 x 4, 145, 384]``)
and global, its attention as rfdetr's SDPA class runs it and as :func:`spmd_rfdetr.model.xla_safe.install` runs it
(:mod:`spmd_rfdetr.model.attention`): the attention in the layout and fusions around it that the step has.

    python benchmarks/op_costs.py --op backbone

``masks``: one layer of the seg losses (:func:`spmd_rfdetr.model.masks.mask_losses`: the matched masks, the uncertain
points, the targets and logits at the points; forward + backward to the spatial and query features) at
``v5e-seg.yaml``'s per-chip shapes (4 images, 13 x 100 matches, 78x78 mask logits, 256 channels, 312 px targets).

    python benchmarks/op_costs.py --op masks --hbm-only
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


def _lower_pallas_for_tpu() -> None:
    """torch_xla's Pallas kernels traced in a process without a TPU (as ``aot`` traces). torch_xla lowers a kernel
    with JAX's default backend, here the CPU, which refuses Mosaic kernels: lower it for the TPU instead. JAX 0.7.1
    writes Mosaic IR version 8 unless it sees an older TPU runtime; libtpu 0.0.21 (torch_xla 2.9's) reads up to 7.
    Block sizes of 128: torch_xla's defaults (512, ``block_k_dq`` 256) need sequence lengths they divide."""
    import jax
    import jax._src.tpu_custom_call as tpu_custom_call
    from torch_xla.experimental import custom_kernel

    def trace_pallas(kernel, *args, static_argnums=None, static_argnames=None, use_cache=False, **kwargs):
        import jax._src.pallas.mosaic.pallas_call_registration  # noqa: F401  (registers the Mosaic lowering)

        specs = [custom_kernel.to_jax_shape_dtype_struct(a) if torch.is_tensor(a) else a for a in args]
        traced = jax.jit(kernel, static_argnums=static_argnums, static_argnames=static_argnames).trace(*specs, **kwargs)
        ir = traced.lower(lowering_platforms=("tpu",)).compiler_ir()
        return custom_kernel._extract_backend_config(ir), [a for a in args if torch.is_tensor(a)]

    custom_kernel.trace_pallas = trace_pallas
    tpu_custom_call.get_ir_version = lambda ctx: 7
    custom_kernel.FlashAttention.DEFAULT_BLOCK_SIZES = {
        key: 2 if key == "block_b" else 128 for key in custom_kernel.FlashAttention.DEFAULT_BLOCK_SIZES}


def flash_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: Callable | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) v`` for ``[B, H, L, d]`` through a flash-attention kernel that needs ``L`` a multiple
    of 128: ``L`` is zero-padded and the padded keys are masked by one more head-dimension column (1 in ``q``, 0 in a
    real key, a large negative number in a padded one: their scores underflow to probability 0). Padded queries'
    outputs are sliced off, so their zero gradients add nothing to ``k`` and ``v``. ``kernel(q, k, v, sm_scale)``:
    torch_xla's Pallas ``flash_attention`` unless given (the CPU check passes the plain formula)."""
    if kernel is None:
        from torch_xla.experimental.custom_kernel import flash_attention

        kernel = lambda q, k, v, scale: flash_attention(q, k, v, sm_scale=scale)  # noqa: E731
    length, dim = q.shape[-2], q.shape[-1]
    pad = -length % 128
    scale = dim**-0.5
    column = torch.zeros(*k.shape[:-2], length + pad, 1, dtype=k.dtype, device=k.device)
    column[..., length:, :] = -3e4  # x scale: far below any real score, and finite in bf16

    def padded(t: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(t, (0, 0, 0, pad)), last], dim=-1)

    out = kernel(padded(q, torch.ones_like(column)), padded(k, column), padded(v, torch.zeros_like(column)), scale)
    return out[..., :length, :dim]


def _check_flash_padding() -> None:
    """:func:`flash_padded` around the plain formula equals the formula on the unpadded tensors (CPU, float64)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 45, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))

    def plain(q, k, v, scale):
        return torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v

    got, want = flash_padded(q, k, v, plain), plain(q, k, v, 8**-0.5)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    wants = torch.autograd.grad(want.square().sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip((got, *grads), (want, *wants)))


def attention_cases() -> list[tuple[str, dict, Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]]]:
    from spmd_rfdetr.model.attention import attention

    _lower_pallas_for_tpu()
    variants = {"pytorch sdpa": torch.nn.functional.scaled_dot_product_attention, "ours": attention,
                "pallas flash (padded to 128)": flash_padded}
    cases = []
    for block, shape in (("decoder self-attention", (16 * 13, 8, 300, 32)),
                         ("DINOv2 windowed", (16 * 4, 6, 145, 64)), ("DINOv2 global", (16, 6, 580, 64))):
        for variant, fn in variants.items():
            def make(fn=fn, shape=shape):
                g = torch.Generator().manual_seed(0)
                inputs = [torch.randn(*shape, generator=g).to(torch.bfloat16).to(torch_xla.device()).requires_grad_()
                          for _ in range(3)]
                return fn(*inputs), inputs
            cases.append((f"{block} {variant}", {"op": "attention", "block": block, "shape": list(shape),
                                                  "variant": variant}, make))
    return cases


def fused_cases() -> list[tuple[str, dict, Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]]]:
    """The step's attention from its packed projections ``[N, L, heads x d]`` to the packed output: the XLA path
    (split heads, :mod:`spmd_rfdetr.model.attention`, merge) against ``trainer.fused_attention``'s Pallas kernels."""
    from spmd_rfdetr.config.backend import TRACED_FOR_ENV
    from spmd_rfdetr.model.attention import attention
    from spmd_rfdetr.xla.fused_attention import fused_attention

    os.environ[TRACED_FOR_ENV] = "TPU"  # the Mosaic kernels, as `aot` traces them

    def xla_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
        n, length, width = q.shape
        split = [t.view(n, length, heads, width // heads).transpose(1, 2) for t in (q, k, v)]
        return attention(*split).transpose(1, 2).reshape(n, length, width)

    cases = []
    for block, (n, length, width, heads) in (("decoder self-attention", (16 * 13, 300, 256, 8)),
                                             ("DINOv2 windowed", (16 * 4, 145, 384, 6)),
                                             ("DINOv2 global", (16, 580, 384, 6))):
        for variant, fn in (("xla path", xla_path), ("fused kernels", fused_attention)):
            def make(fn=fn, n=n, length=length, width=width, heads=heads):
                g = torch.Generator().manual_seed(0)
                inputs = [torch.randn(n, length, width, generator=g).to(torch.bfloat16).to(torch_xla.device())
                          .requires_grad_() for _ in range(3)]
                return fn(*inputs, heads), inputs
            cases.append((f"{block} {variant}", {"op": "fused", "block": block, "shape": [n, length, width],
                                                  "heads": heads, "variant": variant}, make))
    return cases


def criterion_cases() -> list[tuple[str, dict, Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]]]:
    from spmd_rfdetr.model.loss import StaticShapeMatcher, detection_losses

    images, layers, queries, classes, slots, groups = 16, 3, 13 * 300, 91, 100, 13

    def inputs() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Generator]:
        g = torch.Generator().manual_seed(0)
        dev = torch_xla.device()
        logits = (torch.randn(images, layers, queries, classes, generator=g) * 2 - 4).to(dev).requires_grad_()
        boxes = (torch.rand(images, layers, queries, 4, generator=g) * 0.5 + 0.1).to(dev).requires_grad_()
        real = torch.randint(1, 40, (images, 1), generator=g)
        batch = {"labels": torch.randint(0, classes, (images, slots), generator=g).to(dev),
                 "boxes": (torch.rand(images, slots, 4, generator=g) * 0.4 + 0.2).to(dev),
                 "valid": (torch.arange(slots)[None, :] < real).to(dev)}
        return logits, boxes, batch, g

    def cost() -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits, boxes, batch, _ = inputs()
        matcher = StaticShapeMatcher(cost_class=2, cost_bbox=5, cost_giou=2, focal_alpha=0.25)
        return matcher.cost(logits.detach().flatten(1, 2), boxes.detach().flatten(1, 2), batch), []

    def losses() -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
        logits, boxes, batch, g = inputs()
        query = torch.stack([torch.randperm(queries, generator=g)[: groups * slots] for _ in range(images * layers)])
        terms = detection_losses(logits, boxes, query.view(images, layers, -1).to(logits.device), batch,
                                 torch.tensor(500.0, device=logits.device), 0.25)
        total = (terms["loss_ce"] + 5 * terms["loss_bbox"] + 2 * terms["loss_giou"]).sum()
        return (total, terms["class_error"], terms["cardinality_error"]), [logits, boxes]  # all three logged

    return [("matcher cost", {"op": "criterion", "part": "matcher cost"}, cost),
            ("detection losses", {"op": "criterion", "part": "detection losses"}, losses)]


def mask_cases() -> list[tuple[str, dict, Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]]]:
    from spmd_rfdetr.model import xla_safe
    from spmd_rfdetr.model.masks import mask_losses, pack_masks

    images, channels, side, slots, groups, resolution = 4, 256, 78, 100, 13, 312

    def losses() -> tuple[torch.Tensor, list[torch.Tensor]]:
        xla_safe.install()  # the step's point sampler
        g = torch.Generator().manual_seed(0)
        dev = torch_xla.device()
        spatial = torch.randn(images, channels, side, side, generator=g).to(dev).requires_grad_()
        features = (torch.randn(images, groups * slots, channels, generator=g) * 0.05).to(dev).requires_grad_()
        masks = torch.rand(images, slots, resolution, resolution, generator=g) > 0.7
        batch = {"masks": torch.stack([pack_masks(m, slots) for m in masks]).to(dev),
                 "valid": (torch.arange(slots)[None] < torch.randint(1, slots + 1, (images, 1), generator=g)).to(dev)}
        query = torch.stack([torch.randperm(groups * slots, generator=g) for _ in range(images)]).to(dev)
        pred = {"spatial_features": spatial, "query_features": features, "bias": torch.zeros(1, device=dev)}
        terms = mask_losses(pred, query, batch, torch.tensor(200.0, device=dev), point_ratio=16)
        return terms["loss_mask_ce"] + terms["loss_mask_dice"], [spatial, features]

    return [("mask losses, one layer", {"op": "masks", "part": "mask losses"}, losses)]


def backbone_cases() -> list[tuple[str, dict, Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]]]:
    from rfdetr.models.backbone import dinov2_with_windowed_attn as dinov2

    from spmd_rfdetr.model import xla_safe

    block = dinov2.Dinov2WithRegistersSdpaSelfAttention
    upstream = getattr(block.forward, "__wrapped__", block.forward)
    xla_safe.install()
    ours = block.forward
    config = dinov2.WindowedDinov2WithRegistersConfig(hidden_size=384, num_attention_heads=6, num_windows=2)
    config._attn_implementation = "sdpa"
    cases = []
    for scope in ("windowed", "global"):
        for variant, forward in (("rfdetr's SDPA", upstream), ("ours", ours)):
            def make(forward=forward, scope=scope):
                block.forward = forward
                torch.manual_seed(0)
                layer = dinov2.WindowedDinov2WithRegistersLayer(config).to(torch_xla.device())
                x = torch.randn(16 * 4, 145, 384).to(torch_xla.device()).requires_grad_()
                with torch.autocast("xla", dtype=torch.bfloat16):
                    out = layer(x, run_full_attention=scope == "global")[0]
                block.forward = ours
                return out, [x, *layer.parameters()]
            cases.append((f"DINOv2 layer, {scope}, {variant}", {"op": "backbone", "scope": scope, "variant": variant},
                          make))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="v5e:1x1", help="compile for one chip of this topology")
    ap.add_argument("--op", choices=("deform", "attention", "fused", "criterion", "masks", "backbone"), default="deform")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--hbm-only", action="store_true",
                    help="compile with on-chip memory off (aot's --hbm_only): every byte counted is HBM traffic")
    ap.add_argument("--only", default="", help="only the cases whose name contains this (e.g. 'one product')")
    args = ap.parse_args(argv)
    from spmd_rfdetr.aot import chips, tpu_compile

    if args.hbm_only:  # before libtpu loads (build_topology)
        if problem := chips.hbm_only_problem(chips.parse_topology(args.topology)[0]):
            ap.error(problem)
        os.environ.update(chips.hbm_only_env(args.topology))

    devices, _, _ = tpu_compile.build_topology(args.topology)
    rows = []
    cases = {"deform": deform_cases, "attention": attention_cases, "fused": fused_cases, "criterion": criterion_cases,
             "masks": mask_cases, "backbone": backbone_cases}[args.op]()
    for name, labels, make in cases:
        if args.only not in name:
            continue
        out, inputs = make()
        out, *logged = out if isinstance(out, tuple) else (out,)  # the first is differentiated
        forward = compile_cost([out, *logged], devices)
        if not inputs:  # no backward (the matcher's cost)
            rows.append({**labels, "forward": forward})
            print(f"{name:34s} forward {forward['bytes'] / 1e9:6.2f} GB", flush=True)
            continue
        grads = torch.autograd.grad(out.float().square().sum() if out.dim() else out, inputs)
        both = compile_cost([out, *logged, *grads], devices)
        rows.append({**labels, "forward": forward, "forward_backward": both})
        print(f"{name:34s} forward {forward['bytes'] / 1e9:6.2f} GB   forward+backward {both['bytes'] / 1e9:6.2f} GB"
              f"  {both['flops'] / 1e9:6.1f} GFLOP", flush=True)
    if args.op == "attention":
        _check_flash_padding()  # on the CPU, after the XLA graphs: a CPU backward first broke XLA's (autograd engine)
    if args.json:
        args.json.write_text(json.dumps({"topology": args.topology, "hbm_only": args.hbm_only,
                                         "versions": tpu_compile.versions(),
                                         "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
